"""``clip_grad_norm_`` whose reductions follow each gradient's own placements.

``torch.nn.utils.clip_grad_norm_`` stacks every per-gradient norm into one
tensor, so on torch 2.13 it fails as soon as plain tensors sit beside DTensors
("got mixed torch.Tensor and DTensor") or DTensors live on different meshes
("All operands in aten.stack.default must have the same mesh") — the normal
state of a model with dense layers on the full mesh, experts on a sub-mesh and
TP-sharded projections. Here each gradient's norm *terms* (``sum |x|**p``, or
``max |x|`` for the inf-norm) are reduced over exactly the process groups its
placements require, and only then combined:

* ``Shard(d)`` on mesh dim ``i``: the local terms are summed (inf: max) over
  mesh dim ``i``'s group — every element lives on exactly one rank of it.
* ``Partial`` on mesh dim ``i``: the local tensor is one addend of the true
  gradient, and the norm of a sum is not a function of the addends' norms. So
  the *values* are reduced first (the gradient is redistributed to
  ``Replicate`` on that dim, one collective per such gradient) and the norm is
  taken of the result. The gradient itself stays ``Partial``: scaling every
  addend by the same ``clip_coef >= 0`` scales the reduced value by it too.
* ``Replicate``: nothing; every rank of that dim already holds the same values.
* Plain tensors: nothing; they are taken to be the same on every rank
  (replicated). Gradients that differ per pipeline stage go through
  ``pp_group``.

Collectives are batched: one all-reduce per distinct process group (gradients
on different meshes that share a group, such as ``mesh["dp"]`` and the full
mesh's ``"dp"`` dim, share it), plus one over ``pp_group``, plus one per
``Partial`` gradient. Terms are reduced in float32 on every backend.

Contract with the caller, as with FSDP: every rank of a mesh passes the same
parameters in the same order (the order fixes the order of the collectives).
A rank whose ``grad`` is ``None`` for some of them still joins every
collective and counts that gradient as zero, using the parameter's own
placements; so a gradient whose placements differ from its parameter's (a
``Partial`` grad of a ``Replicate`` param) must exist on all ranks of its mesh
or on none. Ranks of different pipeline stages may pass different parameters,
but each passes ``pp_group`` (and, per optimizer, the same names in the same
order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from hyper_parallel.core._grads import grad_of, grad_tensors

# torch's own rule for where foreach kernels exist (the one its clip_grad_norm_ uses).
from hyper_parallel.core.compat import device_has_foreach_support
from hyper_parallel.core.errors import (
    HyperParallelRuntimeError,
    HyperParallelTypeError,
    HyperParallelValueError,
)

__all__ = ["ParamSource", "clip_grad_norm_"]

#: What ``clip_grad_norm_`` takes params from: a tensor, tensors, an optimizer,
#: or (per optimizer) a mapping of name to any of those.
ParamSource: TypeAlias = (
    Tensor | Iterable[Tensor] | Optimizer | Mapping[str, Tensor | Iterable[Tensor] | Optimizer]
)

_EPS = 1e-6  # torch's: clip_coef = max_norm / (total_norm + 1e-6)


@dataclass
class _Bucket:
    """Gradients whose terms reduce over the same process groups."""

    groups: tuple[ProcessGroup, ...]
    device: torch.device
    #: per name: the local tensors to take norms of
    tensors: list[list[Tensor]] = field(default_factory=list)


@overload
def clip_grad_norm_(
    parameters: ParamSource,
    max_norm: float,
    norm_type: float | str = ...,
    error_if_nonfinite: bool = ...,
    foreach: bool | None = ...,
    *,
    pp_group: ProcessGroup | None = ...,
    per_optimizer: Literal[False] = ...,
) -> Tensor: ...


@overload
def clip_grad_norm_(
    parameters: ParamSource,
    max_norm: float,
    norm_type: float | str = ...,
    error_if_nonfinite: bool = ...,
    foreach: bool | None = ...,
    *,
    pp_group: ProcessGroup | None = ...,
    per_optimizer: Literal[True],
) -> dict[str, Tensor]: ...


@overload
def clip_grad_norm_(
    parameters: ParamSource,
    max_norm: float,
    norm_type: float | str = ...,
    error_if_nonfinite: bool = ...,
    foreach: bool | None = ...,
    *,
    pp_group: ProcessGroup | None = ...,
    per_optimizer: bool,
) -> Tensor | dict[str, Tensor]: ...


def clip_grad_norm_(
    parameters: ParamSource,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_group: ProcessGroup | None = None,
    per_optimizer: bool = False,
) -> Tensor | dict[str, Tensor]:
    """Clip gradients in place to a total norm, reducing over each gradient's own groups.

    A drop-in for :func:`torch.nn.utils.clip_grad_norm_` (same positional
    arguments, same result on plain tensors) that also takes DTensor
    gradients on any mix of meshes and placements beside plain tensors; see
    the module docstring for how each placement is reduced and for the
    requirement that every rank of a mesh passes the same parameters in the
    same order.

    Every gradient is multiplied by
    ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
        parameters: A tensor, an iterable of tensors, or an optimizer (its
            ``param_groups``' params, e.g. a ``ChainedOptimizer``), whose
            gradient (plain tensor or DTensor: the fp32 ``main_grad`` where a
            param has one, else ``.grad``) is clipped; params without a grad
            count as zero. With ``per_optimizer=True``: a
            ``ChainedOptimizer`` (any optimizer with a ``.optimizers`` mapping
            of name to optimizer) or a mapping of name to any of the above.
        max_norm: The largest total norm left unclipped; ``>= 0``.
        norm_type: The p of the p-norm, ``> 0``; ``float("inf")`` or
            ``"inf"`` for the max-norm.
        error_if_nonfinite: Raise ``RuntimeError`` instead of clipping when a
            total norm is nan or inf (like torch, clipping by a non-finite
            norm otherwise goes ahead).
        foreach: Use the foreach kernels: ``None`` where the device has them,
            ``True`` always (``RuntimeError`` where it has not), ``False``
            never.
        pp_group: The process group joining pipeline stages that hold
            different params; the stages' terms are summed (inf: max) over it.
        per_optimizer: Clip each sub-optimizer's params separately, each to
            ``max_norm``, so one optimizer's large gradients (AdamW's
            embeddings) do not shrink another's (Muon's matrices). All norms
            share the same collectives.

    Returns:
        The total norm of the gradients as a float32 0-dim tensor, the same on
        every rank; with ``per_optimizer=True`` a dict of name to such norms,
        in the optimizer's order.

    Raises:
        ValueError: ``max_norm`` is negative or nan, ``norm_type`` is not a
            positive number, or a per-optimizer mapping is empty.
        TypeError: ``parameters`` holds something other than tensors, or
            ``per_optimizer=True`` is given neither a ``ChainedOptimizer`` nor
            a mapping.
        RuntimeError: a total norm is non-finite and ``error_if_nonfinite``,
            or ``foreach=True`` on a device without foreach kernels.

    Examples:
        >>> norm = clip_grad_norm_(model.parameters(), 1.0)
        >>> norms = clip_grad_norm_(chained_optimizer, 1.0, per_optimizer=True)
        >>> norms["muon"], norms["adamw"]
    """
    max_norm_value = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    named = _named_params(parameters, per_optimizer)
    with torch.no_grad():
        norms = _total_norms(named, p, foreach, pp_group)
        if error_if_nonfinite:
            for index, name in enumerate(named):
                _raise_if_nonfinite(norms[index], p, name if per_optimizer else None)
        for index, params in enumerate(named.values()):
            _scale_grads(params, max_norm_value, norms[index], foreach)
    if per_optimizer:
        return dict(zip(named, norms.unbind(), strict=True))
    return norms[0]


# -- arguments -----------------------------------------------------------------


def _check_max_norm(max_norm: float) -> float:
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        raise HyperParallelTypeError(f"max_norm must be a number, got {max_norm!r}.") from None
    if math.isnan(value) or value < 0:
        raise HyperParallelValueError(f"max_norm must be a non-negative number, got {value}.")
    return value


def _check_norm_type(norm_type: float | str) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        raise HyperParallelValueError(
            f"norm_type must be a positive number or 'inf', got {norm_type!r}."
        ) from None
    if math.isnan(value) or value <= 0:
        raise HyperParallelValueError(
            f"norm_type must be a positive number or 'inf', got {norm_type!r}."
        )
    return value


def _named_params(parameters: ParamSource, per_optimizer: bool) -> dict[str, list[Tensor]]:
    """The params to clip together, by name (one unnamed entry unless per optimizer)."""
    if not per_optimizer:
        if isinstance(parameters, Mapping):
            flat = [t for source in parameters.values() for t in _params_of(source, "parameters")]
            return {"": flat}
        return {"": _params_of(parameters, "parameters")}
    if isinstance(parameters, Optimizer):
        subs = getattr(parameters, "optimizers", None)
        if not isinstance(subs, Mapping):
            raise HyperParallelTypeError(
                f"per_optimizer=True needs a ChainedOptimizer (named sub-optimizers) or a mapping "
                f"of name -> params; got a {type(parameters).__name__}, which is one optimizer. "
                "Pass per_optimizer=False to clip all its params together."
            )
        grad_params = getattr(parameters, "grad_params", None)
        sources: Mapping[str, Tensor | Iterable[Tensor] | Optimizer] = (
            {name: grad_params(name) for name in subs} if callable(grad_params) else subs
        )
    elif isinstance(parameters, Mapping):
        sources = parameters
    else:
        raise HyperParallelTypeError(
            "per_optimizer=True needs a ChainedOptimizer or a mapping of name -> params to "
            f"know the groups; got {type(parameters).__name__}. Pass per_optimizer=False to "
            "clip these params together."
        )
    if not sources:
        raise HyperParallelValueError(
            "per_optimizer=True got no optimizers (an empty mapping); nothing to clip."
        )
    named: dict[str, list[Tensor]] = {}
    for name, source in sources.items():
        if not isinstance(name, str):
            raise HyperParallelTypeError(f"per_optimizer names must be str, got {name!r}.")
        named[name] = _params_of(source, f"parameters[{name!r}]")
    return named


def _params_of(source: Tensor | Iterable[Tensor] | Optimizer, what: str) -> list[Tensor]:
    if isinstance(source, Tensor):
        return [source]
    if isinstance(source, Optimizer):
        return grad_tensors(source)
    params = list(source)
    for index, t in enumerate(params):
        if not isinstance(t, Tensor):
            raise HyperParallelTypeError(
                f"{what} must hold tensors, but item {index} is a {type(t).__name__}; pass "
                "model.parameters(), a list of tensors or an optimizer."
            )
    return params


# -- the norm --------------------------------------------------------------------


def _total_norms(
    named: dict[str, list[Tensor]], p: float, foreach: bool | None, pp_group: ProcessGroup | None
) -> Tensor:
    """The total norm of each entry of ``named``, as one float32 vector."""
    n = len(named)
    is_max = math.isinf(p)
    buckets = _bucket_grads(named)
    home = _home_device(buckets, pp_group)

    terms: dict[tuple[int, ...], Tensor] = {
        key: torch.stack([_local_terms(ts, p, foreach, bucket.device) for ts in bucket.tensors])
        for key, bucket in buckets.items()
    }
    # One all-reduce per distinct group, over every bucket that needs it. Sum and
    # max commute, so reducing a bucket over its groups one at a time, in any
    # order, gives its total; the order here is first appearance in param order,
    # the same on every rank of a mesh.
    seen: dict[int, ProcessGroup] = {}
    for bucket in buckets.values():
        for group in bucket.groups:
            seen.setdefault(id(group), group)
    for group_id, group in seen.items():
        keys = [key for key in buckets if group_id in key]
        device = buckets[keys[0]].device
        reduced = _all_reduce(torch.stack([terms[k].to(device) for k in keys]), group, is_max)
        for key, row in zip(keys, reduced.unbind(), strict=True):
            terms[key] = row

    if terms:
        stacked = torch.stack([t.to(home) for t in terms.values()])
        totals = stacked.amax(dim=0) if is_max else stacked.sum(dim=0)
    else:
        totals = torch.zeros(n, dtype=torch.float32, device=home)
    if pp_group is not None:
        totals = _all_reduce(totals.unsqueeze(0), pp_group, is_max)[0]
    if is_max or p == 1.0:
        return totals
    return totals.sqrt() if p == 2.0 else totals.pow(1.0 / p)


def _bucket_grads(named: dict[str, list[Tensor]]) -> dict[tuple[int, ...], _Bucket]:
    """Local gradient tensors grouped by the process groups their terms reduce over."""
    n = len(named)
    buckets: dict[tuple[int, ...], _Bucket] = {}
    for index, params in enumerate(named.values()):
        for param in params:
            grad = grad_of(param)
            groups: tuple[ProcessGroup, ...] = ()
            local: Tensor | None = grad
            # A missing grad counts as zero laid out like its param, so this rank
            # still joins the collectives the other ranks' grads need.
            layout = grad if grad is not None else param
            if isinstance(layout, DTensor):
                mesh = layout.device_mesh
                if mesh.get_coordinate() is None:
                    continue  # this rank is not on the mesh: nothing here, no collective
                placements = layout.placements
                groups = tuple(
                    mesh.get_group(i) for i, pl in enumerate(placements) if pl.is_shard()
                )
                if isinstance(grad, DTensor):
                    if any(pl.is_partial() for pl in placements):
                        whole = [Replicate() if pl.is_partial() else pl for pl in placements]
                        grad = grad.redistribute(mesh, whole)
                    local = grad.to_local()
            device = layout.device
            key = tuple(id(g) for g in groups)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = _Bucket(groups, device, [[] for _ in range(n)])
            if local is not None and local.numel() > 0:
                bucket.tensors[index].append(local)
    return buckets


def _local_terms(
    tensors: list[Tensor], p: float, foreach: bool | None, device: torch.device
) -> Tensor:
    """``sum |x|**p`` (inf: ``max |x|``) over ``tensors``, as a float32 scalar on ``device``."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms: list[Tensor] = []
    for (dev, _), group in _by_device_and_dtype(tensors).items():
        if _use_foreach(foreach, dev):
            norms.extend(torch._foreach_norm(group, p))
        else:
            norms.extend(torch.linalg.vector_norm(t, p) for t in group)
    stacked = torch.stack([t.to(device=device, dtype=torch.float32) for t in norms])
    if math.isinf(p):
        return stacked.amax()
    return stacked.sum() if p == 1.0 else stacked.pow(p).sum()


def _all_reduce(rows: Tensor, group: ProcessGroup, is_max: bool) -> Tensor:
    """Sum (or max) ``rows`` over ``group``; a nan anywhere stays nan everywhere."""
    if not is_max:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
        return rows
    # A backend's MAX may drop nan depending on operand order, which would let
    # ranks disagree; carry "was nan" as a second max-reduced channel.
    flagged = torch.cat([rows.nan_to_num(nan=0.0), rows.isnan().to(rows.dtype)])
    dist.all_reduce(flagged, op=dist.ReduceOp.MAX, group=group)
    values, nan_flags = flagged.chunk(2)
    return torch.where(nan_flags > 0, torch.full_like(values, math.nan), values)


def _home_device(
    buckets: dict[tuple[int, ...], _Bucket], pp_group: ProcessGroup | None
) -> torch.device:
    """Where the totals are combined: next to the DTensors (their backend's device) if any."""
    for bucket in buckets.values():
        if bucket.groups:
            return bucket.device
    for bucket in buckets.values():
        return bucket.device
    if pp_group is not None and dist.get_backend(pp_group) != "gloo":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator
    return torch.device("cpu")


def _raise_if_nonfinite(norm: Tensor, p: float, name: str | None) -> None:
    if bool(torch.isfinite(norm)):
        return
    whose = f"the params of optimizer {name!r}" if name is not None else "`parameters`"
    raise HyperParallelRuntimeError(
        f"The total gradient norm of order {p} for {whose} is non-finite ({norm.item()}), so it "
        "cannot be clipped. Look for inf/nan gradients (loss scaling, a diverged step), or pass "
        "error_if_nonfinite=False to scale the gradients by the non-finite norm anyway."
    )


# -- scaling -----------------------------------------------------------------------


def _scale_grads(params: list[Tensor], max_norm: float, norm: Tensor, foreach: bool | None) -> None:
    grads = [_local(grad) for param in params if (grad := grad_of(param)) is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (norm + _EPS), max=1.0)
    for (device, _), group in _by_device_and_dtype(grads).items():
        coef_here = coef.to(device)
        if _use_foreach(foreach, device):
            torch._foreach_mul_(group, coef_here)
        else:
            for g in group:
                g.mul_(coef_here)


def _local(grad: Tensor) -> Tensor:
    # Under no_grad, to_local() is the DTensor's own storage, so scaling it in
    # place scales the gradient (a Partial one included: every addend alike).
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    grouped: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        grouped.setdefault((t.device, t.dtype), []).append(t)
    return grouped


def _use_foreach(foreach: bool | None, device: torch.device) -> bool:
    if foreach is False:
        return False
    if device_has_foreach_support(device):
        return True
    if foreach:
        raise HyperParallelRuntimeError(
            f"foreach=True was passed, but there are no foreach kernels for {device.type} tensors; "
            "pass foreach=None to fall back to one kernel per tensor."
        )
    return False
