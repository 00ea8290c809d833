"""Built-in plugin: ``sinkhorn``, momentum balanced by alternating row and column normalization.

:class:`Sinkhorn` takes the momentum of each matrix param, drops the rows
whose norm is negligible, and runs a few Sinkhorn-Knopp style sweeps that
normalize its rows and columns in turn to unit L2 norm. The result has rows
of unit norm and columns of near-equal norm, and is scaled by
``correction * sqrt(cols)``.

It needs only row and column sums of squares, never a whole matrix, so the
sharding backend's :meth:`~hyper_parallel.core.distributed.ShardingBackend.map_reductions`
runs it on every rank's own shard: a sharded param all-reduces vectors of
norms, nothing param-sized.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import GroupBackends, Reducer
from hyper_parallel.core.distributed.toolkit import is_dtensor, local_tensor
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import MatrixOptimizer, momentum_updates
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel_builtins.muon._options import check_replica_count

__all__ = ["Sinkhorn"]


def state_dtype(param: Tensor) -> torch.dtype:
    """The dtype of ``param``'s momentum buffer and statistics: float64 for float64, else float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_options(options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an out-of-range option, naming it and saying what is accepted.

    HyperParallel's checks: ``lr`` and ``correction`` finite and >= 0,
    ``momentum`` in ``[0, 1)``, ``steps`` a positive odd int, ``eps`` finite
    and > 0, ``tau`` finite and >= 0, no weight decay.
    """
    lr = options["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise HyperParallelValueError(
                f"A tensor lr must have 1 element, got shape {tuple(lr.shape)}."
            )
    elif not _is_real(lr):
        raise HyperParallelValueError(
            f"lr should be a finite float >= 0 (or a 1-element tensor), got {lr!r}."
        )
    if not (math.isfinite(lr) and lr >= 0.0):
        raise HyperParallelValueError(f"Learning rate should be finite and >= 0 but is: {lr}")

    weight_decay = options["weight_decay"]
    if not _is_real(weight_decay) or weight_decay != 0:
        raise HyperParallelValueError(
            f"Sinkhorn has no weight decay, but got weight_decay={weight_decay!r}. Set "
            "weight_decay=0; to decay these params, use AdamW's decoupled weight decay "
            "(give them to adamw)."
        )
    momentum = options["momentum"]
    if not _is_real(momentum) or not 0.0 <= momentum < 1.0:
        raise HyperParallelValueError(f"momentum should be a float in [0, 1), got {momentum!r}.")
    steps = options["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0 or steps % 2 == 0:
        raise HyperParallelValueError(
            f"steps should be an odd int >= 1 (one row normalization, then (steps - 1) / 2 "
            f"column and row sweeps), got {steps!r}; e.g. 11."
        )
    _check_bound(options, "eps", zero_allowed=False)
    _check_bound(
        options,
        "tau",
        zero_allowed=True,
        meaning=" (rows with norm <= tau * mean row norm stay still)",
    )
    _check_bound(options, "correction", zero_allowed=True, meaning=" (0: params stay still)")
    sharding = options["sharding"]
    if sharding is not None and not isinstance(sharding, str):
        raise HyperParallelValueError(
            f"sharding should be a backend name or None, got {sharding!r}."
        )


def _check_bound(
    options: Mapping[str, Any], name: str, *, zero_allowed: bool, meaning: str = ""
) -> None:
    """``options[name]`` is a finite real number > 0 (or >= 0 where ``zero_allowed``)."""
    value = options[name]
    if (
        not _is_real(value)
        or not math.isfinite(value)
        or not (value >= 0.0 if zero_allowed else value > 0.0)
    ):
        bound = ">= 0" if zero_allowed else "> 0"
        raise HyperParallelValueError(
            f"{name} should be a finite float {bound}{meaning}, got {value!r}."
        )


def _validate_param(param: Tensor) -> None:
    """Refuse a param that is not a real, non-empty 2-D matrix (no group option changes that)."""
    if param.ndim != 2:
        raise HyperParallelValueError(
            f"Sinkhorn only updates non-empty 2D matrices (it normalizes their rows and "
            f"columns), but got a param of shape {tuple(param.shape)} ({param.ndim}-D). Give "
            "params with fewer than 2 dims (biases, norm weights) to AdamW, e.g. with "
            "get_hyper_optimizer, which moves them there; give N-D params (conv kernels, "
            "expert stacks) to Muon or AdamW."
        )
    if min(param.shape) == 0:
        raise HyperParallelValueError(
            f"Sinkhorn only updates non-empty 2D matrices, but got a param of shape "
            f"{tuple(param.shape)}: it has no rows or no columns to normalize. Leave it out "
            "of the optimizer (it has nothing to update)."
        )
    if param.is_complex() or not param.is_floating_point():
        raise HyperParallelValueError(
            f"Sinkhorn needs real floating-point params, got {param.dtype} for the param of "
            f"shape {tuple(param.shape)}; optimize it with AdamW or view it as real."
        )


def _check_replica_groups(param: Tensor, count: int | None) -> None:
    """``hsdp_replica_count`` divides each replicated mesh dim of ``param`` larger than it.

    HyperParallel splits every replicate group of more than ``count`` ranks
    into groups of ``count``, so one it does not divide is a ``ValueError``
    there, and here too.
    """
    if count is None or not is_dtensor(param):
        return
    mesh = param.device_mesh  # type: ignore[attr-defined]
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        size = mesh.size(dim)
        if placement.is_replicate() and size > count and size % count:
            raise HyperParallelValueError(
                f"hsdp_replica_count={count} must evenly divide the {size} replicas of mesh "
                f"dim {dim} of the param of shape {tuple(param.shape)} (placements "
                f"{param.placements}); choose a divisor of {size}, or leave it unset."  # type: ignore[attr-defined]
            )


def sinkhorn_normalize(
    local: list[Tensor],
    reducer: Reducer,
    *,
    rows: Sequence[int],
    steps: int,
    eps: float,
    tau: float,
) -> list[Tensor]:
    """Sinkhorn's balancing of each (local piece of a) matrix, as a ``ReductionsFn``.

    Drops the rows whose L2 norm is at most ``tau`` times the mean row norm,
    divides every row by its norm plus ``eps``, then ``(steps - 1) / 2`` times
    divides every column, then every row, by its norm plus ``eps``. Norms are
    taken over the full matrix: ``reducer`` completes each sum over the ranks
    that hold the rest of the row or column, one call per phase for all
    matrices together.

    Args:
        local: This rank's pieces of the matrices; left unchanged.
        reducer: Completes row and column sums (no collective for plain tensors).
        rows: Each full matrix's row count (for the mean row norm).
        steps: Odd number of normalizations, >= 1.
        eps: Added to every norm before dividing.
        tau: Rows with norm <= ``tau`` times the mean row norm become zero.

    Returns:
        New tensors, shaped like ``local``.
    """
    norms = [s.sqrt_() for s in reducer.row_sums([x.square() for x in local])]
    totals = reducer.row_totals(norms)
    out: list[Tensor] = []
    for x, r, total, m in zip(local, norms, totals, rows, strict=True):
        dropped = r <= tau * (total[0] / m)
        out.append(x.div(r.add(eps)[:, None]).masked_fill_(dropped[:, None], 0.0))
    for _ in range((steps - 1) // 2):
        col_norms = reducer.col_sums([x.square() for x in out])
        for x, c in zip(out, col_norms, strict=True):
            x.div_(c.sqrt_().add_(eps))
        row_norms = reducer.row_sums([x.square() for x in out])
        for x, r in zip(out, row_norms, strict=True):
            x.div_(r.sqrt_().add_(eps)[:, None])
    return out


class Sinkhorn(MatrixOptimizer):
    r"""Momentum balanced by Sinkhorn row and column normalization, for embeddings and heads.

    For each 2-D param :math:`W` of shape :math:`(m, n)` (never transposed),
    with gradient :math:`G` and momentum buffer :math:`B` (zero at first):

    .. math::

        B &\leftarrow \mu B + (1 - \mu) G \\
        U &\leftarrow (1 - \mu) G + \mu B \ \text{(nesterov)}
             \quad\text{or}\quad U \leftarrow B \\
        U_{i,:} &\leftarrow 0 \quad\text{where}\quad r_i \le \tau\,\bar r,
             \qquad U_{i,:} \leftarrow U_{i,:} / (r_i + \varepsilon) \\
        U_{:,j} &\leftarrow U_{:,j} / (\lVert U_{:,j} \rVert_2 + \varepsilon), \quad
        U_{i,:} \leftarrow U_{i,:} / (\lVert U_{i,:} \rVert_2 + \varepsilon)
             \quad \text{(} (k - 1) / 2 \text{ times)} \\
        W &\leftarrow W - \gamma\,c\,\sqrt{n}\,U

    where :math:`r_i = \lVert U_{i,:} \rVert_2`, :math:`\bar r` is their mean,
    :math:`k` is ``steps`` and :math:`c` is ``correction``. Rows dropped by
    the :math:`\tau` test stay zero, so those rows of :math:`W` do not move.
    There is no weight decay.

    The momentum buffer and every statistic are float32 (float64 for float64
    params); params keep their own dtype. For sharded (DTensor) params each
    rank works on its own shard, and only row and column norm vectors are
    all-reduced, through the group's sharding backend. Matrices of a param
    group share each of those all-reduces.

    Args:
        params: Params or param-group dicts; a group may override any
            option below but ``hsdp_replica_count``, the keyword-only ones
            included.
        lr: Learning rate :math:`\gamma` (a float or a 1-element tensor).
        momentum: Momentum factor :math:`\mu`, in ``[0, 1)``.
        nesterov: Normalize the Nesterov look-ahead rather than the buffer.
        steps: Normalizations :math:`k`, an odd int: one of the rows, then
            :math:`(k - 1) / 2` sweeps of columns then rows.
        eps: Added to every norm before dividing by it, > 0.
        tau: Rows whose norm is at most :math:`\tau` times the mean row norm
            are zeroed (their params do not move), >= 0.
        correction: Factor :math:`c` on the update, >= 0 (0: params do
            not move; the momentum still does).
        hsdp_replica_count: HyperParallel's size of the groups of HSDP
            replicas that share the optimizer's work: ``None`` or a positive
            int that divides each replicated mesh dim larger than it. Checked
            as HyperParallel checks it; it changes no number here, where each
            rank updates its own shard and only row and column norms travel,
            so there is no per-matrix work for replicas to share.
        weight_decay: Must be 0: Sinkhorn has no weight decay (decay with
            AdamW). Accepted so that code passing ``weight_decay=0`` works.
        sharding: For sharded (DTensor) params, the sharding backend whose
            reductions complete the row and column norms (``"fsdp"``,
            ``"hsdp"``, ...). ``None``: ``$HYPER_PARALLEL_SHARDING`` as it is
            when the optimizer is built, else detected from the params'
            placements. Resolved once per group, when the group is added.

    Raises:
        ValueError: a param that is not a real, non-empty 2-D matrix, an
            out-of-range option (when a group is added, and at each
            ``step``, as HyperParallel checks them), non-zero
            ``weight_decay``, an ``hsdp_replica_count`` that is not positive
            or does not divide a replicated mesh dim, or (at ``step``) a
            sparse or ``Partial`` DTensor gradient.
        TypeError: an ``hsdp_replica_count`` that is not an int.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> matrices = [p for p in model.parameters() if p.ndim == 2]
        >>> opt = Sinkhorn(matrices, lr=0.02, steps=7)
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        steps: int = 11,
        eps: float = 1e-20,
        tau: float = 1e-3,
        correction: float = 0.18,
        hsdp_replica_count: int | None = None,
        *,
        weight_decay: float = 0.0,
        sharding: str | None = None,
    ) -> None:
        self.hsdp_replica_count = check_replica_count(hsdp_replica_count)
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "steps": steps,
            "eps": eps,
            "tau": tau,
            "correction": correction,
            "weight_decay": weight_decay,
            "sharding": sharding,
        }
        super().__init__(params, defaults, replica_group_size=self.hsdp_replica_count)

    _check_options = staticmethod(_validate_options)

    def _check_param(self, param: Tensor, group: dict[str, Any]) -> None:
        """A real, non-empty 2-D matrix, on a mesh ``hsdp_replica_count`` can group."""
        _validate_param(param)
        _check_replica_groups(param, self.hsdp_replica_count)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state, with ``hsdp_replica_count`` (copies and pickles keep it)."""
        state = super().__getstate__()
        state["hsdp_replica_count"] = self.hsdp_replica_count
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a copy or pickle; its backends are resolved again, with its replica count."""
        count = state.setdefault("hsdp_replica_count", None)
        state.setdefault("_backends", GroupBackends(replica_group_size=count))
        super().__setstate__(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, keeping momentum buffers in their float32 (or float64) dtype.

        ``torch.optim.Optimizer`` casts floating-point state to each param's
        dtype, which would round a bf16 param's float32 buffer to bf16.
        """
        saved = state_dict["state"]
        buffers = {
            key: value["momentum_buffer"]
            for key, value in saved.items()
            if isinstance(value, Mapping) and isinstance(value.get("momentum_buffer"), Tensor)
        }
        super().load_state_dict(state_dict)
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        for key, buffer in buffers.items():
            param = id_map.get(key)
            if param is not None:
                self.state[param]["momentum_buffer"] = buffer.to(
                    device=param.device, dtype=state_dtype(param)
                )

    def _check_grad(self, param: Tensor, grad: Tensor) -> None:
        if grad.is_sparse:
            raise HyperParallelValueError(
                f"Sinkhorn does not support sparse gradients (param of shape "
                f"{tuple(param.shape)}); use a dense gradient, or SparseAdam for sparse embeddings."
            )
        if is_dtensor(grad) and any(pl.is_partial() for pl in grad.placements):  # type: ignore[attr-defined]
            raise HyperParallelValueError(
                f"The gradient of the param of shape {tuple(param.shape)} is a Partial DTensor "
                f"(placements {grad.placements}): its row and column norms need the reduced "  # type: ignore[attr-defined]
                "gradient. Reduce it first (redistribute it to Shard or Replicate, as FSDP's "
                "reduce-scatter does) before step()."
            )

    def _new_buffer(self, param: Tensor, grad: Tensor) -> Tensor:
        """float32 (float64 for float64 params), whatever the param's dtype."""
        return torch.zeros_like(grad, dtype=state_dtype(param), memory_format=torch.preserve_format)

    def _check_step(self, group: dict[str, Any]) -> None:
        _validate_options(group)  # a group's options may have been edited since it was added

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, buffers = self._params_with_grads(group)
        if not params:
            return
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
        # In the buffers' dtype (float32 for a bf16 param), on the local shards.
        local_grads = [local_tensor(g).to(b.dtype) for g, b in zip(grads, buffers, strict=True)]
        updates = momentum_updates(
            buffers, local_grads, float(group["momentum"]), group["nesterov"]
        )
        del local_grads

        rows = [p.shape[0] for p in params]
        steps, eps, tau = int(group["steps"]), float(group["eps"]), float(group["tau"])

        def normalize(local: list[Tensor], reducer: Reducer) -> list[Tensor]:
            return sinkhorn_normalize(local, reducer, rows=rows, steps=steps, eps=eps, tau=tau)

        balanced = self.sharding_backend(group).map_reductions(normalize, updates)
        del updates

        scale = lr * float(group["correction"])
        for p, u in zip(params, balanced, strict=True):
            # In float32/64, rounded once into the param's dtype.
            local_tensor(p).add_(local_tensor(u), alpha=-scale * math.sqrt(p.shape[1]))


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``sinkhorn``."""
    register(
        "sinkhorn",
        Sinkhorn,
        description="Momentum balanced by Sinkhorn row and column normalization, for matrices",
        requires=("matrices_only",),
    )
