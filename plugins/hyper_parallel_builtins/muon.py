"""Built-in plugin: ``muon``, momentum orthogonalized by Newton-Schulz.

:class:`Muon` takes the arguments of :class:`torch.optim.Muon` with the same
names, defaults and meaning, and makes the same update. Beyond it: N-D params
(conv kernels, MoE expert stacks), a Newton-Schulz dtype chosen by device,
named coefficient sets, the Moonlight-style RMS target
``matched_adamw_rms``, and one batched Newton-Schulz call per matrix shape.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast, overload

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hyper_parallel import hookimpl
from hyper_parallel.core._suggest import did_you_mean
from hyper_parallel.core.distributed import SHARDING_ENV, ShardingBackend, resolve_backend
from hyper_parallel.core.distributed._dtensor import is_dtensor, local_tensor
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel_builtins.newton_schulz import (
    KELLER_COEFFICIENTS,
    CoefficientSpec,
    newton_schulz_batched,
    resolve_coefficients,
)

__all__ = ["ADJUST_LR_FNS", "MATRIX_VIEWS", "Muon", "default_ns_dtype", "matrix_shape"]

MATRIX_VIEWS = ("auto", "flatten", "batch")
"""Accepted values of ``matrix_view``."""

ADJUST_LR_FNS = ("original", "match_rms_adamw")
"""Accepted values of ``adjust_lr_fn`` besides ``None`` (same as ``torch.optim.Muon``)."""

_MATCH_RMS_ADAMW_TARGET = 0.2  # torch's "match_rms_adamw" (Moonlight's 0.2)

# Group keys beyond torch.optim.Muon's, with the defaults a group loaded from a
# torch.optim.Muon state_dict gets.
_EXTRA_DEFAULTS: Mapping[str, Any] = {
    "matched_adamw_rms": None,
    "ns_dtype": None,
    "matrix_view": "auto",
    "sharding": None,
}


def _batch_dims(ndim: int, matrix_view: str) -> int:
    """Leading dims Newton-Schulz treats independently under ``matrix_view``."""
    if ndim <= 2 or matrix_view == "flatten" or (matrix_view == "auto" and ndim >= 4):
        return 0
    return ndim - 2


def matrix_shape(shape: torch.Size | tuple[int, ...], matrix_view: str) -> tuple[int, int, int]:
    """How Muon reads a param of ``shape``: ``(batch, rows, cols)``.

    ``"auto"``: 2-D as is; 3-D ``(E, m, n)`` is ``E`` matrices ``(m, n)``
    (an expert stack); 4-D and more (conv kernels) is ``(shape[0], rest)``.
    ``"flatten"``: always one matrix ``(shape[0], rest)``. ``"batch"``: all
    dims but the last two are batch dims.
    """
    if len(shape) < 2:
        raise ValueError(f"Muon needs params with at least 2 dims, got shape {tuple(shape)}.")
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if matrix_view == "flatten" or (matrix_view == "auto" and len(shape) >= 4):
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def default_ns_dtype(param: Tensor) -> torch.dtype:
    """The Newton-Schulz dtype used for ``param`` when ``ns_dtype=None``.

    bfloat16 on an accelerator (CUDA, NPU, anything not a CPU), where bf16
    matmuls run at several times the fp32 rate; float32 on a CPU (float64 for
    a float64 param), where bf16 is often far slower than fp32 (CPUs without
    native bf16 matmul emulate it) and, where it is fast, still loses
    precision the CPU does not need to lose. Pass ``ns_dtype`` to choose.
    """
    if param.device.type != "cpu":
        return torch.bfloat16
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _check_options(options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an out-of-range or unknown hyperparameter."""
    lr = options["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"A tensor lr must have 1 element, got shape {tuple(lr.shape)}.")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not options["momentum"] >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {options['momentum']}")
    if not options["weight_decay"] >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {options['weight_decay']}")
    if not options["eps"] > 0.0:
        raise ValueError(f"eps should be > 0 but is: {options['eps']}")
    resolve_coefficients(options["ns_coefficients"], options["ns_steps"])

    adjust = options["adjust_lr_fn"]
    if adjust is not None and adjust not in ADJUST_LR_FNS:
        raise ValueError(
            f"Unknown adjust_lr_fn {adjust!r}. Use None, {', '.join(map(repr, ADJUST_LR_FNS))}."
            f"{did_you_mean(str(adjust), ADJUST_LR_FNS)}"
        )
    rms = options["matched_adamw_rms"]
    if rms is not None:
        if isinstance(rms, bool) or not isinstance(rms, (int, float)) or not rms > 0:
            raise ValueError(f"matched_adamw_rms should be a float > 0 or None, got {rms!r}.")
        if adjust == "original":
            raise ValueError(
                f"matched_adamw_rms={rms} scales the update to match AdamW's RMS, which "
                "contradicts adjust_lr_fn='original'; give one of them (set the other to None)."
            )
    ns_dtype = options["ns_dtype"]
    if ns_dtype is not None and (
        not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point
    ):
        raise ValueError(
            f"ns_dtype should be a floating-point torch.dtype or None, got {ns_dtype!r}."
        )
    sharding = options["sharding"]
    if sharding is not None and not isinstance(sharding, str):
        raise ValueError(f"sharding should be a backend name or None, got {sharding!r}.")
    view = options["matrix_view"]
    if view not in MATRIX_VIEWS:
        raise ValueError(
            f"Unknown matrix_view {view!r}. Available: {', '.join(MATRIX_VIEWS)}."
            f"{did_you_mean(str(view), MATRIX_VIEWS)}"
        )


def _check_param(param: Tensor) -> None:
    if param.ndim < 2:
        raise ValueError(
            f"Muon only updates matrices, but got a param of shape {tuple(param.shape)} "
            f"({param.ndim}-D). Optimize params with fewer than 2 dims (biases, norm weights) "
            "with AdamW: e.g. get_hyper_optimizer(model, partitioner='by_shape'), or put them "
            "in adamw_params."
        )
    if param.is_complex():
        raise ValueError(
            f"Muon does not support complex params (got {param.dtype}, shape "
            f"{tuple(param.shape)}); optimize them with AdamW or view them as real."
        )


def _like(local: Tensor, template: Tensor) -> Tensor:
    """``local`` as a DTensor laid out like ``template`` (``local`` itself for plain tensors)."""
    if not is_dtensor(template):
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(template, DTensor)
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False,
        shape=template.shape, stride=template.stride(),
    )  # fmt: skip


def _by_device_and_dtype(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped so each group can take one foreach call."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


class Muon(torch.optim.Optimizer):
    r"""Momentum orthogonalized by Newton-Schulz, for hidden-layer matrices.

    For each matrix param :math:`\theta` of shape :math:`(m, n)`, with
    gradient :math:`g` and momentum buffer :math:`B` (zero at first):

    .. math::

        B &\leftarrow \mu B + (1 - \mu) g \\
        U &\leftarrow (1 - \mu) g + \mu B \ \text{(nesterov)}
             \quad\text{or}\quad U \leftarrow B \\
        O &\leftarrow \mathrm{NS}_k(U / \max(\lVert U \rVert_F, \varepsilon)) \\
        \theta &\leftarrow (1 - \gamma\lambda)\,\theta - \gamma'\,O

    where :math:`\mathrm{NS}_k` is ``ns_steps`` iterations of
    :math:`X \leftarrow aX + (bA + cA^2)X` with :math:`A = XX^\top` (on
    :math:`X^\top` when :math:`m > n`), which drives the singular values of
    :math:`U` towards 1, and the adjusted lr :math:`\gamma'` is
    :math:`\gamma\sqrt{\max(1, m/n)}` (``adjust_lr_fn=None`` or
    ``"original"``) or :math:`\gamma\,r\,\sqrt{\max(m, n)}` with RMS target
    :math:`r` (``0.2`` for ``"match_rms_adamw"``, or ``matched_adamw_rms``),
    which makes the update's RMS about that of AdamW's so AdamW's lr and
    weight decay carry over. This is :class:`torch.optim.Muon`'s update; code
    written for it runs unchanged. (torch always runs Newton-Schulz in
    bfloat16; ``ns_dtype=torch.bfloat16`` reproduces it on a CPU.)

    Params with fewer than 2 dims are refused: give them to AdamW
    (``get_hyper_optimizer`` does so). Params of more dims are read as
    matrices as ``matrix_view`` says. Matrices of one shape, device and NS
    dtype in a param group are orthogonalized in one batched call.

    Args:
        params: Params or param-group dicts; a group may override any
            option below, the keyword-only ones included.
        lr: Learning rate :math:`\gamma` (a float or a 1-element tensor).
        weight_decay: Decoupled weight decay :math:`\lambda`; each step
            multiplies the param by :math:`1 - \gamma\lambda`.
        momentum: Momentum factor :math:`\mu`.
        nesterov: Orthogonalize the Nesterov look-ahead rather than the buffer.
        ns_coefficients: Newton-Schulz coefficients: one triple ``(a, b, c)``
            used at every iteration (the default is Keller Jordan's
            ``(3.4445, -4.7750, 2.0315)``, as in torch); a sequence of
            triples, one per iteration (a short one repeats its last
            triple); or a set name from
            :data:`~hyper_parallel_builtins.newton_schulz.COEFFICIENT_SETS`:
            ``"keller"``, ``"polar_express"`` (per-iteration optimal,
            arXiv 2505.16932) or ``"cubic"`` (slow, converges to
            :math:`UV^\top`).
        eps: Floor on the Frobenius norm the update is divided by.
        ns_steps: Newton-Schulz iterations :math:`k`, 1 to 99.
        adjust_lr_fn: ``None`` or ``"original"`` (Keller's shape
            adjustment), or ``"match_rms_adamw"`` (Moonlight's).
        matched_adamw_rms: RMS target :math:`r` of the update, Moonlight
            style; ``0.2`` is ``adjust_lr_fn="match_rms_adamw"``. Cannot be
            combined with ``adjust_lr_fn="original"``.
        ns_dtype: dtype Newton-Schulz runs in. ``None``: bfloat16 for params
            on an accelerator, float32 on CPU (float64 for float64 params).
            Params and momentum buffers keep their own dtype.
        matrix_view: How params with more than 2 dims become matrices:
            ``"auto"`` (3-D ``(E, m, n)`` is a stack of ``E`` expert matrices,
            4-D and more is flattened to ``(out, -1)``), ``"flatten"``
            (always ``(shape[0], -1)``, e.g. for Conv1d kernels) or
            ``"batch"`` (all leading dims are batch dims). The lr adjustment
            uses each matrix's own shape.
        sharding: For sharded (DTensor) params, the sharding backend that
            runs Newton-Schulz on the full matrices (``"fsdp"``, ``"hsdp"``,
            ...). ``None``: ``$HYPER_PARALLEL_SHARDING``, else detected from
            the params' placements. Each matrix gets one owner rank, chosen
            by Newton-Schulz FLOPs, so the work is spread over the ranks and
            the result equals that of one process.

    Raises:
        ValueError: a param with fewer than 2 dims or complex, or an
            out-of-range or unknown option.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> matrices = [p for p in model.parameters() if p.ndim >= 2]
        >>> opt = Muon(matrices, lr=0.02, momentum=0.95, ns_coefficients="polar_express")
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step()
    """

    matrix_only: ClassVar[bool] = True

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        matched_adamw_rms: float | None = None,
        ns_dtype: torch.dtype | None = None,
        matrix_view: str = "auto",
        sharding: str | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "matched_adamw_rms": matched_adamw_rms,
            "ns_dtype": ns_dtype,
            "matrix_view": matrix_view,
            "sharding": sharding,
        }
        _check_options(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, checking its options and that its params are matrices."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_options(group)
            for p in group["params"]:
                _check_param(p)
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state_dict saved by torch.optim.Muon lacks the keys only we have.
        for group in self.param_groups:
            for key, value in _EXTRA_DEFAULTS.items():
                group.setdefault(key, self.defaults.get(key, value))

    def _orthogonalize(self, updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Newton-Schulz of every update in ``group``, on the full matrices.

        Plain tensors are orthogonalized here. Sharded ones (DTensors) go
        through their sharding backend's full-matrix map, which gives each
        matrix one owner rank (balanced by Newton-Schulz FLOPs), runs
        :meth:`_orthogonalize_full` there and returns the result as shards.

        Returns:
            The orthogonalized updates, laid out like ``updates``.
        """
        named = group["sharding"] or os.environ.get(SHARDING_ENV)
        if not named and not any(is_dtensor(u) for u in updates):
            return self._orthogonalize_full(updates, group)
        backend = self._backend(group)
        view = group["matrix_view"]

        def ns_flops(shape: torch.Size) -> float:
            batch, rows, cols = matrix_shape(shape, view)
            small, large = min(rows, cols), max(rows, cols)
            return float(group["ns_steps"] * batch * (4 * small * small * large + 2 * small**3))

        return backend.full_matrix_map(
            lambda fulls: self._orthogonalize_full(fulls, group),
            updates,
            batch_dims=[_batch_dims(u.ndim, view) for u in updates],
            cost=ns_flops,
        )

    def _backend(self, group: dict[str, Any]) -> ShardingBackend:
        """The group's sharding backend: its ``sharding`` option, the environment, or detected."""
        # Resolved every step (cheap): groups, their options and the environment can change.
        return resolve_backend(group["sharding"], group["params"])

    def _orthogonalize_full(self, updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Newton-Schulz of whole (plain) tensors, one batched call per matrix shape.

        Args:
            updates: One tensor per param, shaped like it.
            group: The param group (its ``matrix_view``, ``ns_*`` and ``eps``).

        Returns:
            The orthogonalized updates, shaped like ``updates``, each in its
            Newton-Schulz dtype.
        """
        coefficients = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        buckets: dict[tuple[torch.device, torch.dtype, int, int], list[int]] = {}
        for i, update in enumerate(updates):
            _, rows, cols = matrix_shape(update.shape, group["matrix_view"])
            dtype = group["ns_dtype"]
            if dtype is None:
                dtype = default_ns_dtype(update)
            buckets.setdefault((update.device, dtype, rows, cols), []).append(i)
        out: list[Tensor | None] = [None] * len(updates)
        for (_, dtype, rows, cols), indices in buckets.items():
            matrices = [updates[i].reshape(-1, rows, cols) for i in indices]
            results = newton_schulz_batched(matrices, coefficients, eps=group["eps"], dtype=dtype)
            for i, result in zip(indices, results, strict=True):
                out[i] = result.reshape(updates[i].shape)
        return cast(list[Tensor], out)

    def _adjusted_lr(self, lr: float, rows: int, cols: int, group: dict[str, Any]) -> float:
        target = group["matched_adamw_rms"]
        if target is None and group["adjust_lr_fn"] == "match_rms_adamw":
            target = _MATCH_RMS_ADAMW_TARGET
        if target is not None:
            return lr * float(target) * math.sqrt(max(rows, cols))
        return lr * math.sqrt(max(1.0, rows / cols)) if cols else lr

    def _init_group(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        buffers: list[Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"Muon does not support sparse gradients (param of shape {tuple(p.shape)}); "
                    "use a dense gradient, or SparseAdam for sparse embeddings."
                )
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p.grad, memory_format=torch.preserve_format
                )
            params.append(p)
            grads.append(p.grad)
            buffers.append(state["momentum_buffer"])
        return params, grads, buffers

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, buffers = self._init_group(group)
        if not params:
            return
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
        momentum = group["momentum"]
        foreach_groups = _by_device_and_dtype(params)
        # Element-wise work runs on the local shards: for DTensors that skips the
        # per-op dispatch cost, and the math is the same shard by shard.
        local_params, local_grads, local_buffers = (
            [local_tensor(t) for t in ts] for ts in (params, grads, buffers)
        )

        updates: list[Tensor] = list(buffers)
        for indices in foreach_groups:
            group_grads = [local_grads[i] for i in indices]
            group_buffers = [local_buffers[i] for i in indices]
            torch._foreach_lerp_(group_buffers, group_grads, 1 - momentum)
            if group["nesterov"]:
                looked_ahead = torch._foreach_lerp(group_grads, group_buffers, momentum)
                for i, update in zip(indices, looked_ahead, strict=True):
                    updates[i] = _like(update, buffers[i])

        orthogonal = self._orthogonalize(updates, group)
        del updates

        decay = 1 - lr * group["weight_decay"]
        if decay != 1:
            for indices in foreach_groups:
                torch._foreach_mul_([local_params[i] for i in indices], decay)
        for p, local, o in zip(params, local_params, orthogonal, strict=True):
            _, rows, cols = matrix_shape(p.shape, group["matrix_view"])
            local.add_(local_tensor(o), alpha=-self._adjusted_lr(lr, rows, cols, group))

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Make one update of every param that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``muon``."""
    register(
        "muon",
        Muon,
        description="Momentum orthogonalized by Newton\u2013Schulz, for hidden-layer matrices",
    )
