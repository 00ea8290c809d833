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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hyper_parallel import hookimpl
from hyper_parallel.core._suggest import did_you_mean
from hyper_parallel.core._torch_private import cpu_has_native_bf16
from hyper_parallel.core.distributed import Need, PrepareFn, RowBlocks, WholeMatrices
from hyper_parallel.core.distributed.toolkit import local_tensor
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import (
    MatrixOptimizer,
    by_device_and_dtype,
    momentum_updates,
)
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel_builtins.newton_schulz import (
    KELLER_COEFFICIENTS,
    CoefficientSpec,
    newton_schulz_batched,
    newton_schulz_flops,
    newton_schulz_team,
    newton_schulz_team_collectives,
    resolve_coefficients,
    resolve_ns_method,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ADJUST_LR_FNS",
    "MATRIX_VIEWS",
    "NS_DTYPE_ENV",
    "Muon",
    "MuonTeam",
    "default_ns_dtype",
    "lr_scale",
    "matrix_shape",
    "ns_dtype_from_env",
]

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
    "ns_method": "auto",
    "matrix_view": "auto",
    "sharding": None,
    "head_dim": None,
    "split_rows": None,
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
        raise HyperParallelValueError(
            f"Muon needs params with at least 2 dims, got shape {tuple(shape)}."
        )
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if matrix_view == "flatten" or (matrix_view == "auto" and len(shape) >= 4):
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


#: Environment variable naming the Newton-Schulz dtype of every group with
#: ``ns_dtype=None`` (float64 params excepted): the same numbers on every machine.
NS_DTYPE_ENV = "HYPER_PARALLEL_NS_DTYPE"
_NS_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16, "float64": torch.float64}  # fmt: skip


def default_ns_dtype(param: Tensor) -> torch.dtype:
    """The Newton-Schulz dtype used for ``param`` when ``ns_dtype=None``: the fastest here.

    * float64 for a float64 param, anywhere;
    * else ``$HYPER_PARALLEL_NS_DTYPE`` where set (``float32``, ``bfloat16``,
      ``float16`` or ``float64``), so that machines of different kinds give
      the same numbers;
    * bfloat16 on an accelerator (CUDA, NPU, anything not a CPU);
    * on a CPU, bfloat16 where it multiplies bf16 in hardware (AVX512-BF16
      or AMX-BF16), float32 otherwise: without them torch emulates bf16
      matmul, about 30x slower than fp32 (figures in the benchmarks page).

    Pass ``ns_dtype`` to choose.

    Raises:
        ValueError: ``$HYPER_PARALLEL_NS_DTYPE`` names no such dtype.
    """
    if param.dtype == torch.float64:
        return torch.float64
    chosen = ns_dtype_from_env()
    if chosen is not None:
        return chosen
    if param.device.type != "cpu" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def ns_dtype_from_env() -> torch.dtype | None:
    """The dtype ``$HYPER_PARALLEL_NS_DTYPE`` names; ``None`` where it is unset or empty.

    Raises:
        ValueError: a value that names no dtype Newton-Schulz runs in.
    """
    name = os.environ.get(NS_DTYPE_ENV, "").strip()
    if not name:
        return None
    if name not in _NS_DTYPE_NAMES:
        raise HyperParallelValueError(
            f"{NS_DTYPE_ENV}={name!r} is not a Newton-Schulz dtype; set it to one of "
            f"{', '.join(_NS_DTYPE_NAMES)}, or unset it for the fastest here."
            f"{did_you_mean(name, list(_NS_DTYPE_NAMES))}"
        )
    return _NS_DTYPE_NAMES[name]


def _validate_options(options: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an out-of-range or unknown hyperparameter."""
    lr = options["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise HyperParallelValueError(
            f"A tensor lr must have 1 element, got shape {tuple(lr.shape)}."
        )
    if not lr >= 0.0:
        raise HyperParallelValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not options["momentum"] >= 0.0:
        raise HyperParallelValueError(f"momentum should be >= 0 but is: {options['momentum']}")
    if not options["weight_decay"] >= 0.0:
        raise HyperParallelValueError(
            f"weight decay should be >= 0 but is: {options['weight_decay']}"
        )
    if not options["eps"] > 0.0:
        raise HyperParallelValueError(f"eps should be > 0 but is: {options['eps']}")
    resolve_coefficients(options["ns_coefficients"], options["ns_steps"])

    adjust = options["adjust_lr_fn"]
    if adjust is not None and adjust not in ADJUST_LR_FNS:
        raise HyperParallelValueError(
            f"Unknown adjust_lr_fn {adjust!r}. Use None, {', '.join(map(repr, ADJUST_LR_FNS))}."
            f"{did_you_mean(str(adjust), ADJUST_LR_FNS)}"
        )
    rms = options["matched_adamw_rms"]
    if rms is not None:
        if isinstance(rms, bool) or not isinstance(rms, (int, float)) or not rms > 0:
            raise HyperParallelValueError(
                f"matched_adamw_rms should be a float > 0 or None, got {rms!r}."
            )
        if adjust == "original":
            raise HyperParallelValueError(
                f"matched_adamw_rms={rms} scales the update to match AdamW's RMS, which "
                "contradicts adjust_lr_fn='original'; give one of them (set the other to None)."
            )
    ns_dtype = options["ns_dtype"]
    if ns_dtype is None:
        ns_dtype_from_env()  # a bad value fails here, before any step
    elif not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
        raise HyperParallelValueError(
            f"ns_dtype should be a floating-point torch.dtype or None, got {ns_dtype!r}."
        )
    resolve_ns_method(options["ns_method"], 1, 1, torch.device("cpu"))  # a known name
    sharding = options["sharding"]
    if sharding is not None and not isinstance(sharding, str):
        raise HyperParallelValueError(
            f"sharding should be a backend name or None, got {sharding!r}."
        )
    _check_blocks(options)
    view = options["matrix_view"]
    if view not in MATRIX_VIEWS:
        raise HyperParallelValueError(
            f"Unknown matrix_view {view!r}. Available: {', '.join(MATRIX_VIEWS)}."
            f"{did_you_mean(str(view), MATRIX_VIEWS)}"
        )


def lr_scale(rows: int, cols: int, group: Mapping[str, Any]) -> float:
    """The factor on the lr for a ``(rows, cols)`` matrix (or head block): the shape adjustment."""
    target = group["matched_adamw_rms"]
    if target is None and group["adjust_lr_fn"] == "match_rms_adamw":
        target = _MATCH_RMS_ADAMW_TARGET
    if target is not None:
        return float(target) * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols)) if cols else 1.0


def _validate_param(param: Tensor, group: Mapping[str, Any]) -> None:
    """Refuse vectors, complex params, and row splits (``head_dim``, ``split_rows``) that do not fit."""
    if param.ndim < 2:
        raise HyperParallelValueError(
            f"Muon only updates matrices, but got a param of shape {tuple(param.shape)} "
            f"({param.ndim}-D). Optimize params with fewer than 2 dims (biases, norm weights) "
            "with AdamW: e.g. get_hyper_optimizer(model, partitioner='by_shape'), or put them "
            "in adamw_params."
        )
    if param.is_complex():
        raise HyperParallelValueError(
            f"Muon does not support complex params (got {param.dtype}, shape "
            f"{tuple(param.shape)}); optimize them with AdamW or view them as real."
        )
    _need(param.shape, group)


def _row_heights(shape: torch.Size, group: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The independent row blocks of a param under ``split_rows`` and ``head_dim`` (``None``: one matrix)."""
    head_dim, split_rows = group["head_dim"], group["split_rows"]
    if head_dim is None and split_rows is None:
        return None
    rows = shape[_batch_dims(len(shape), group["matrix_view"])]
    blocks = tuple(split_rows) if split_rows is not None else (rows,)
    if sum(blocks) != rows:
        raise HyperParallelValueError(
            f"split_rows={blocks} adds up to {sum(blocks)} rows, but the param of shape "
            f"{tuple(shape)} has {rows}; give one row count per fused part (e.g. q, k, v)."
        )
    if head_dim is None:
        return blocks
    for block in blocks:
        if block % head_dim:
            where = "its" if split_rows is None else "the split_rows block of"
            raise HyperParallelValueError(
                f"head_dim={head_dim} does not divide {where} {block} rows of the param of shape "
                f"{tuple(shape)}; give the head size of this projection, or put the param in a "
                "group without head_dim."
            )
    return tuple(head_dim for block in blocks for _ in range(block // head_dim))


def _need(shape: torch.Size, group: Mapping[str, Any]) -> Need:
    """What Newton-Schulz needs of a param: whole matrices, or independent row blocks."""
    batch = _batch_dims(len(shape), group["matrix_view"])
    heights = _row_heights(shape, group)
    return WholeMatrices(batch) if heights is None else RowBlocks(heights, batch)


class MuonTeam:
    """Newton-Schulz of a group's whole matrices as a team of ranks computes it.

    The :class:`~hyper_parallel.core.distributed.TeamTransform` Muon hands
    its sharding backend. Members slice the columns of the iterated matrix
    (the rows of a tall param, which is iterated transposed; else its first
    column dim) and run :func:`newton_schulz_team`; each result is scaled
    like a whole one's. A team always runs the standard iteration (whatever
    ``ns_method``), in one dtype for the group (``ns_dtype``, else the
    default for its first param), and sums its Gram matrices in that dtype.

    Args:
        group: A Muon param group, or a mapping with its ``ns_coefficients``,
            ``ns_steps``, ``matrix_view``, ``eps``, ``matched_adamw_rms`` and
            ``adjust_lr_fn``.
        dtype: The Newton-Schulz dtype.
    """

    def __init__(self, group: Mapping[str, Any], dtype: torch.dtype) -> None:
        self.group, self.dtype = group, dtype
        self.coefficients = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])

    def split_dim(self, shape: torch.Size) -> int | None:
        _, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        batch_dims = _batch_dims(len(shape), self.group["matrix_view"])
        return batch_dims if rows > cols else batch_dims + 1

    def cost(self, shape: torch.Size, members: int) -> float:
        batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        return batch * newton_schulz_flops(rows, cols, len(self.coefficients), "standard") / members

    def collectives(self, shape: torch.Size, members: int) -> list[tuple[str, int]]:
        batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        return newton_schulz_team_collectives(
            batch, min(rows, cols), self.coefficients, members, self.dtype
        )

    def __call__(
        self, slices: list[Tensor], shapes: list[torch.Size], group: ProcessGroup
    ) -> list[Tensor]:
        views, talls, scales = [], [], []
        for piece, shape in zip(slices, shapes, strict=True):
            batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
            tall = rows > cols
            x = piece.reshape(batch, -1, cols) if tall else piece.reshape(batch, rows, -1)
            views.append(x.mT if tall else x)
            talls.append(tall)
            scales.append(lr_scale(rows, cols, self.group))
        results = newton_schulz_team(
            views, self.coefficients, group, eps=self.group["eps"], dtype=self.dtype
        )
        return [
            _as_update((r.mT if tall else r).reshape(piece.shape), piece.dtype, scale)
            for r, tall, piece, scale in zip(results, talls, slices, scales, strict=True)
        ]


def _as_update(result: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``result`` in ``dtype``, times ``scale``, in contiguous memory.

    A tall matrix's Newton-Schulz result can come back as a transposed view;
    cast and laid out in one copy, its update is applied over contiguous
    memory (on a CPU, adding a transposed 2048 x 512 update took 16x the time).
    """
    return result.to(dtype, memory_format=torch.contiguous_format).mul_(scale)


def _check_blocks(options: dict[str, Any]) -> None:
    """Check ``head_dim`` and ``split_rows``; store ``split_rows`` as a tuple."""
    head_dim, split_rows = options["head_dim"], options["split_rows"]
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
    ):
        raise HyperParallelValueError(
            f"head_dim should be a positive int or None, got {head_dim!r}."
        )
    if split_rows is not None:
        if isinstance(split_rows, (str, bytes)) or not isinstance(split_rows, Sequence):
            raise HyperParallelValueError(
                f"split_rows should be a tuple of row counts or None, got {split_rows!r}."
            )
        if not split_rows or any(
            isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in split_rows
        ):
            raise HyperParallelValueError(
                f"split_rows should hold positive ints, got {split_rows!r}."
            )
        options["split_rows"] = tuple(split_rows)


class Muon(MatrixOptimizer):
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
    bfloat16 and iterates on ``X``; ``ns_dtype=torch.bfloat16, ns_method="standard"``
    reproduces it on a CPU.)

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
        ns_dtype: dtype Newton-Schulz runs in. ``None``: the fastest on the
            device (:func:`default_ns_dtype`): bfloat16 on an accelerator
            and on a CPU with native bf16 matmul, float32 on other CPUs,
            float64 for float64 params; ``$HYPER_PARALLEL_NS_DTYPE`` where
            set. Params and momentum buffers keep their own dtype.
        ns_method: ``"standard"`` iterates on ``X``; ``"gram"`` iterates
            on the small Gram matrix ``X X^T`` and touches ``X`` only at a
            restart and at the end, fewer FLOPs for a matrix several times
            longer than wide (MLP projections, experts), the same result up
            to rounding; ``"auto"`` takes Gram from the aspect ratio measured
            to pay off on the device
            (:data:`~hyper_parallel_builtins.newton_schulz.GRAM_MIN_ASPECT`).
        matrix_view: How params with more than 2 dims become matrices:
            ``"auto"`` (3-D ``(E, m, n)`` is a stack of ``E`` expert matrices,
            4-D and more is flattened to ``(out, -1)``), ``"flatten"``
            (always ``(shape[0], -1)``, e.g. for Conv1d kernels) or
            ``"batch"`` (all leading dims are batch dims). The lr adjustment
            uses each matrix's own shape.
        sharding: For sharded (DTensor) params, the sharding backend that
            brings whole matrices (or head blocks) to Newton-Schulz
            (``"fsdp"``, ``"hsdp"``, ...). ``None``:
            ``$HYPER_PARALLEL_SHARDING`` as it is when the optimizer is
            built, else detected from the params' placements. Resolved once
            per group, when the group is added. Blocks a rank holds whole are
            done in place; every other matrix gets one owner rank, chosen by
            Newton-Schulz FLOPs, so the result equals that of one process.
        head_dim: Head-wise Muon, usually a group key for q/k projections: a
            ``(heads * head_dim, in)`` weight is ``heads`` independent
            ``(head_dim, in)`` matrices for Newton-Schulz, the lr adjustment
            and RMS matching (momentum is as usual). ``None``: whole matrices.
        split_rows: Row counts that split a fused weight (fused QKV) into
            independent blocks first; ``head_dim`` then applies inside each.
            Row counts that do not add up, or heads that do not divide a
            block, are a ``ValueError`` naming the param's shape.

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

    extra_group_defaults: ClassVar[Mapping[str, Any]] = _EXTRA_DEFAULTS

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
        ns_method: str = "auto",
        matrix_view: str = "auto",
        sharding: str | None = None,
        head_dim: int | None = None,
        split_rows: Sequence[int] | None = None,
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
            "ns_method": ns_method,
            "matrix_view": matrix_view,
            "sharding": sharding,
            "head_dim": head_dim,
            "split_rows": split_rows,
        }
        super().__init__(params, defaults)

    _check_options = staticmethod(_validate_options)

    _check_param = staticmethod(_validate_param)

    def _orthogonalize(
        self, prepare: PrepareFn, layouts: list[Tensor], group: dict[str, Any]
    ) -> list[Tensor]:
        """Newton-Schulz of every update in ``group``, scaled by each block's lr adjustment.

        The group's sharding backend (resolved when the group was added)
        brings each whole matrix, or each head block, to one rank: plain
        tensors and blocks a rank holds whole are done in place, the rest by
        one owner rank each, balanced by Newton-Schulz FLOPs. It asks
        ``prepare`` for the updates as it needs them (those that travel
        first), so the rest of the momentum work can run while they travel.

        Returns:
            The scaled, orthogonalized updates, laid out like ``layouts``.
        """
        view = group["matrix_view"]
        device = layouts[0].device if layouts else torch.device("cpu")

        def ns_flops(shape: torch.Size) -> float:
            batch, rows, cols = matrix_shape(shape, view)
            method = resolve_ns_method(group["ns_method"], rows, cols, device)
            return batch * newton_schulz_flops(rows, cols, group["ns_steps"], method)

        dtype = group["ns_dtype"] or (default_ns_dtype(layouts[0]) if layouts else torch.float32)
        return self.sharding_backend(group).map_prepared_blocks(
            lambda blocks: self._orthogonalize_full(blocks, group),
            prepare,
            layouts,
            [_need(u.shape, group) for u in layouts],
            cost=ns_flops,
            team=MuonTeam(group, dtype),
        )

    def _orthogonalize_full(self, updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Newton-Schulz of whole (plain) blocks, one batched call per matrix shape.

        Args:
            updates: Whole matrices or head blocks, each read as
                ``matrix_view`` says.
            group: The param group (its ``matrix_view``, ``ns_*``, ``eps`` and
                lr adjustment).

        Returns:
            The orthogonalized blocks in their own dtype, each multiplied by
            its lr adjustment (:func:`lr_scale` of its matrix shape).
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
            results = newton_schulz_batched(
                matrices, coefficients, eps=group["eps"], dtype=dtype, method=group["ns_method"]
            )
            scale = lr_scale(rows, cols, group)
            for i, result in zip(indices, results, strict=True):
                out[i] = _as_update(result.reshape(updates[i].shape), updates[i].dtype, scale)
        return cast(list[Tensor], out)

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, buffers = self._params_with_grads(group)
        if not params:
            return
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)

        def updates(positions: list[int]) -> list[Tensor]:
            return momentum_updates(
                [buffers[i] for i in positions],
                [grads[i] for i in positions],
                group["momentum"],
                group["nesterov"],
            )

        orthogonal = self._orthogonalize(updates, buffers, group)

        local_params = [local_tensor(p) for p in params]
        foreach_groups = by_device_and_dtype(local_params)
        decay = 1 - lr * group["weight_decay"]
        if decay != 1:
            for indices in foreach_groups:
                torch._foreach_mul_([local_params[i] for i in indices], decay)
        for indices in foreach_groups:
            torch._foreach_add_(
                [local_params[i] for i in indices],
                [local_tensor(orthogonal[i]) for i in indices],
                alpha=-lr,
            )


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``muon``."""
    register(
        "muon",
        Muon,
        description="Momentum orthogonalized by Newton\u2013Schulz, for hidden-layer matrices",
    )
