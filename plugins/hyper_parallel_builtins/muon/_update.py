"""One Muon step's arithmetic: momentum by either convention, and the orthogonalized blocks.

:class:`BlockTransform` is what the sharding backend calls with whole blocks
(whole matrices or head blocks, wherever they were assembled): it groups
them by matrix shape, runs one batched Newton-Schulz (or the caller's
``zeropower_fn``) per shape, and scales each result. With a ``reshape_fn`` or
``ns_transform_fn`` it first asks, per param (found by the block's key),
which pieces to orthogonalize. :class:`MuonTeam` is the same for a team of
ranks sharing each matrix.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from hyper_parallel.core.distributed import Blocks
from hyper_parallel.core.distributed.toolkit import local_tensor, shard_like
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import apply_momentum, momentum_updates, new_or_into
from hyper_parallel_builtins.muon._extensions import (
    MomentumUpdateFn,
    NSInputTransform,
    NSTransformFn,
    ReshapeFn,
    ZeropowerFn,
    check_transform,
)
from hyper_parallel_builtins.muon._matrices import batch_dims, matrix_shape, piece_shape
from hyper_parallel_builtins.newton_schulz import (
    Coefficients,
    Workspace,
    new_stack,
    newton_schulz_flops,
    newton_schulz_stack_,
    newton_schulz_team,
    newton_schulz_team_collectives,
    stack_into,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "BlockTransform",
    "MuonSettings",
    "MuonTeam",
    "ScaleRule",
    "hyper_parallel_momentum",
    "momentum_pair",
    "momentum_step",
    "ns_dtype_of",
]


class ScaleRule(enum.Enum):
    """How a ``(rows, cols)`` matrix's orthogonalized update is scaled (before any lr)."""

    MATCHED_RMS = "matched_rms"  # rms * sqrt(max(rows, cols)): HyperParallel's, or torch's match
    ASPECT = "aspect"  # sqrt(max(1, rows / cols)): torch's original
    ONE = "one"  # HyperParallel without an rms, zero_rms_scale_mode="use_lr"
    ZERO = "zero"  # HyperParallel without an rms, zero_rms_scale_mode="zero"


@dataclass(frozen=True)
class MuonSettings:
    """What a Muon group's options decide, worked out when the group is added, never at a step.

    ``resolve_settings`` (in ``_options``) makes it from the group's keys; the
    step reads it as data. What schedulers and users change between steps
    (``lr``, ``weight_decay``, ``momentum``) is read from the group, live.
    """

    torch_momentum: bool  # torch's interpolation B <- mu B + (1 - mu) G, else HyperParallel's
    coefficients: tuple[Coefficients, ...]  # (a, b, c) of each iteration
    eps: float  # the norm's epsilon: added (HyperParallel's) or a floor (torch's)
    eps_added: bool
    scale_rule: ScaleRule
    rms: float  # the target RMS of MATCHED_RMS
    lr_in_update: bool  # apply_lr_in_update: the scale carries -lr
    group_ns_dtype: torch.dtype | None  # the group's ns_dtype
    env_ns_dtype: torch.dtype | None  # what $HYPER_PARALLEL_NS_DTYPE named when the group was added
    cpu_ns_dtype: torch.dtype  # a CPU's default: bf16 where it multiplies bf16 natively, else fp32

    def scale(self, rows: int, cols: int, lr: float) -> float:
        """The factor on a ``(rows, cols)`` matrix's orthogonalized update (a head block: its own)."""
        if self.scale_rule is ScaleRule.MATCHED_RMS:
            scale = self.rms * math.sqrt(max(rows, cols))
        elif self.scale_rule is ScaleRule.ASPECT:
            scale = math.sqrt(max(1.0, rows / cols)) if cols else 1.0
        else:
            scale = 1.0 if self.scale_rule is ScaleRule.ONE else 0.0
        return -lr * scale if self.lr_in_update else scale

    def dtype_for(self, block: Tensor) -> torch.dtype:
        """The dtype ``block`` is orthogonalized in: the group's, else :func:`ns_dtype_of`."""
        if self.group_ns_dtype is not None:
            return self.group_ns_dtype
        return ns_dtype_of(block, self.env_ns_dtype, self.cpu_ns_dtype)


def ns_dtype_of(
    param: Tensor, env_dtype: torch.dtype | None, cpu_dtype: torch.dtype
) -> torch.dtype:
    """Newton-Schulz's default dtype for ``param``: float64 for float64, else ``env_dtype``,
    else bfloat16 off the CPU, else ``cpu_dtype``."""
    if param.dtype == torch.float64:
        return torch.float64
    if env_dtype is not None:
        return env_dtype
    return torch.bfloat16 if param.device.type != "cpu" else cpu_dtype


def momentum_pair(momentum: float | Sequence[float]) -> tuple[float, float]:
    """``(m1, m2)``: the factor on the buffer in the update, and in the buffer's own step."""
    if isinstance(momentum, Sequence):
        first, second = (momentum[0], momentum[0]) if len(momentum) == 1 else momentum
        return float(first), float(second)
    return float(momentum), float(momentum)


def hyper_parallel_momentum(
    buffers: list[Tensor],
    grads: list[Tensor],
    m1: float,
    m2: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """HyperParallel's momentum, on the local shards: the buffers in place, the updates returned.

    ``U = G + m1 B`` (with the buffer before this step), ``B <- m2 B + G``,
    and with Nesterov ``U <- G + m1 U``. With ``m1 == m2`` and no Nesterov
    the update is the new buffer itself; else it goes into ``out`` where
    given (see :func:`~hyper_parallel.core.optimizer.apply_momentum`).
    """

    def rule(
        local_buffers: list[Tensor], local_grads: list[Tensor], into: list[Tensor] | None
    ) -> list[Tensor] | None:
        separate = nesterov or m1 != m2
        looked = (
            new_or_into(into, torch._foreach_add, torch.add, local_grads, local_buffers, alpha=m1)
            if separate
            else []
        )
        torch._foreach_mul_(local_buffers, m2)
        torch._foreach_add_(local_buffers, local_grads)
        if nesterov:
            torch._foreach_mul_(looked, m1)
            torch._foreach_add_(looked, local_grads)
        return looked if separate else None

    return apply_momentum(buffers, grads, rule, out)


def momentum_step(
    group: Mapping[str, Any],
    settings: MuonSettings,
    buffers: list[Tensor],
    grads: list[Tensor],
    custom: MomentumUpdateFn | None,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """Step the momentum buffers of ``group``'s params and return their updates (laid out like them).

    ``custom`` (``momentum_update_fn``) replaces the built-in rule: it gets
    the local tensors and ``(m1, m2, nesterov)``. The built-in rules write
    updates that are not the buffers into ``out`` where given.
    """
    m1, m2 = momentum_pair(group["momentum"])
    if custom is not None:
        made = list(
            custom(
                [local_tensor(g) for g in grads],
                [local_tensor(b) for b in buffers],
                m1,
                m2,
                group["nesterov"],
            )
        )
        if len(made) != len(grads):
            raise HyperParallelValueError(
                f"momentum_update_fn must return one update tensor per input gradient, got "
                f"{len(made)} updates for {len(grads)} gradients."
            )
        for update, buffer in zip(made, buffers, strict=True):
            if not isinstance(update, Tensor) or update.shape != local_tensor(buffer).shape:
                got = tuple(update.shape) if isinstance(update, Tensor) else type(update).__name__
                raise HyperParallelValueError(
                    f"momentum_update_fn returned an update of shape {got} for a gradient of "
                    f"shape {tuple(local_tensor(buffer).shape)}; return each update shaped like "
                    "its gradient."
                )
        return [shard_like(u, b) for u, b in zip(made, buffers, strict=True)]
    if settings.torch_momentum:
        return momentum_updates(buffers, grads, m1, group["nesterov"], out)
    return hyper_parallel_momentum(buffers, grads, m1, m2, group["nesterov"], out)


def _as_update(result: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``result`` in ``dtype``, times ``scale``, in contiguous memory.

    A tall matrix's Newton-Schulz result can come back as a transposed view;
    cast and laid out in one copy, its update is applied over contiguous
    memory (on a CPU, adding a transposed 2048 x 512 update took 16x the time).
    It is always a copy: ``result`` may be a view of a ``Workspace`` buffer,
    which the next Newton-Schulz call on its shape overwrites.
    """
    return result.to(dtype, memory_format=torch.contiguous_format, copy=True).mul_(scale)


class BlockTransform:
    """Newton-Schulz of one group's whole blocks, each scaled (a ``BlocksFn``).

    Args:
        group: The Muon param group.
        settings: What its options decide (:class:`MuonSettings`).
        lr: Its lr this step (for ``apply_lr_in_update``).
        names: Each block key's param name (keys are positions in the
            step's params); needed only with ``reshape_fn`` /
            ``ns_transform_fn``.
        zeropower_fn, reshape_fn, ns_transform_fn: HyperParallel's
            extension callables, or ``None``.
        workspace: Newton-Schulz work buffers kept across steps (the
            optimizer's); ``None``: allocated per call.
    """

    def __init__(
        self,
        group: Mapping[str, Any],
        settings: MuonSettings,
        lr: float,
        names: Sequence[str | None] = (),
        *,
        zeropower_fn: ZeropowerFn | None = None,
        reshape_fn: ReshapeFn | None = None,
        ns_transform_fn: NSTransformFn | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        self.group, self.settings, self.lr, self.names = group, settings, lr, names
        self.workspace = workspace
        self.zeropower_fn = zeropower_fn
        self.reshape_fn, self.ns_transform_fn = reshape_fn, ns_transform_fn

    @property
    def keyed(self) -> bool:
        """Whether blocks must come with their param's key (a callable asks per param)."""
        return self.reshape_fn is not None or self.ns_transform_fn is not None

    def dtype(self, block: Tensor) -> torch.dtype:
        """The dtype ``block`` is orthogonalized in."""
        return self.settings.dtype_for(block)

    def __call__(self, blocks: list[Tensor]) -> list[Tensor]:
        if not self.keyed:
            view = self.group["matrix_view"]
            return self._orthogonalize(list(blocks), [matrix_shape(b.shape, view) for b in blocks])
        if not isinstance(blocks, Blocks):
            raise HyperParallelValueError(
                "reshape_fn and ns_transform_fn need to know each block's param, but this sharding "
                "backend hands blocks without their keys (hyper_parallel.core.distributed.Blocks); "
                "use a backend built on map_held_blocks, or drop the function."
            )
        return [self._by_param(block, key) for block, key in zip(blocks, blocks.keys, strict=True)]

    def _orthogonalize(
        self, tensors: list[Tensor], shapes: list[tuple[int, int, int]]
    ) -> list[Tensor]:
        """Each tensor (read as ``shapes``' matrices) orthogonalized and scaled, in its own dtype."""
        out: list[Tensor | None] = [None] * len(tensors)

        def keep(i: int, result: Tensor, scale: float) -> None:
            out[i] = _as_update(result.reshape(tensors[i].shape), tensors[i].dtype, scale)

        self._run(
            tensors,
            shapes,
            lambda i, part: stack_into(part, tensors[i].reshape(part.shape), self.workspace),
            keep,
        )
        return cast(list[Tensor], out)

    def stream(
        self,
        layouts: Sequence[Tensor],
        prepare: Callable[[list[int], list[Tensor]], list[Tensor]],
        apply: Callable[[int, Tensor], None],
    ) -> None:
        """The transform of whole plain tensors, made and applied one at a time.

        ``prepare([i], [out])`` makes each tensor (in ``out``, a buffer laid
        out like ``layouts[i]``, unless it is one the caller holds), which
        is copied into the Newton-Schulz stack of its shape. After the
        iteration ``apply(i, update)`` gets each scaled update in that same
        buffer, to apply before the next. Nothing the size of a param is
        allocated: holding every update of a step at once (what
        :meth:`__call__` returns) cost a d=1024 transformer 60,000-100,000
        fresh pages per step on a CPU, a quarter of its time. The numbers
        are :meth:`__call__`'s, bit for bit.
        """
        view = self.group["matrix_view"]

        def fill(i: int, part: Tensor) -> None:
            made = prepare([i], [self._scratch(layouts[i])])[0]
            stack_into(part, made.reshape(part.shape), self.workspace)

        def take(i: int, result: Tensor, scale: float) -> None:
            update = self._scratch(layouts[i])
            apply(i, update.copy_(result.reshape(update.shape)).mul_(scale))

        self._run(layouts, [matrix_shape(t.shape, view) for t in layouts], fill, take)

    def _run(
        self,
        tensors: Sequence[Tensor],
        shapes: Sequence[tuple[int, int, int]],
        fill: Callable[[int, Tensor], None],
        take: Callable[[int, Tensor, float], None],
    ) -> None:
        """One Newton-Schulz call per bucket of one matrix shape and dtype.

        ``fill(i, part)`` writes tensor ``i``'s matrices into its part of the
        bucket's stack; ``take(i, result, scale)`` gets its results (a view
        of the stack, valid until the next bucket of that shape) and the
        bucket's update scale.
        """
        buckets: dict[tuple[torch.device, torch.dtype, int, int], list[int]] = {}
        for i, (tensor, (_, rows, cols)) in enumerate(zip(tensors, shapes, strict=True)):
            buckets.setdefault((tensor.device, self.dtype(tensor), rows, cols), []).append(i)
        for (device, dtype, rows, cols), indices in buckets.items():
            counts = [shapes[i][0] for i in indices]
            shape = (sum(counts), rows, cols)
            stack = (
                new_stack(shape, dtype, device, self.workspace, self.group["ns_method"])
                if self.zeropower_fn is None
                else torch.empty(shape, dtype=dtype, device=device)  # the caller's: contiguous
            )
            for i, part in zip(indices, stack.split(counts), strict=True):
                fill(i, part)
            result = self._newton_schulz(stack)
            scale = self.settings.scale(rows, cols, self.lr)
            for i, part in zip(indices, result.split(counts), strict=True):
                take(i, part, scale)

    def _scratch(self, like: Tensor) -> Tensor:
        """A buffer laid out like ``like``: the workspace's (one per shape), else a new one."""
        if self.workspace is None:
            return torch.empty_like(like)
        return self.workspace.take_like("param", like)

    def _newton_schulz(self, stack: Tensor) -> Tensor:
        """The stack orthogonalized: ``stack`` itself or another stack laid out like it."""
        if self.zeropower_fn is None:
            return newton_schulz_stack_(
                stack,
                self.settings.coefficients,
                eps=self.settings.eps,
                eps_added=self.settings.eps_added,
                method=self.group["ns_method"],
                workspace=self.workspace,
            )
        given = stack[0] if stack.shape[0] == 1 else stack
        result = self.zeropower_fn(given, steps=self.group["ns_steps"])
        if not isinstance(result, Tensor) or result.shape != given.shape:
            got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
            raise HyperParallelValueError(
                f"zeropower_fn returned {got} for an input of shape {tuple(given.shape)}; return "
                "the orthogonalized input in its own shape."
            )
        return result.reshape(stack.shape)

    def _by_param(self, block: Tensor, key: object) -> Tensor:
        """One param's whole update, cut into pieces as its ``reshape_fn``/``ns_transform_fn`` says."""
        name = self.names[cast(int, key)] if key is not None else None
        working = block.to(self.dtype(block), memory_format=torch.contiguous_format)
        transform = self._transform(name, working)
        shapes = [piece_shape(t.shape) for t in transform.tensors]
        results = self._orthogonalize(list(transform.tensors), shapes)
        transform.restore(results, working)
        return working.to(block.dtype)

    def _transform(self, name: str | None, working: Tensor) -> NSInputTransform:
        if name is not None and self.ns_transform_fn is not None:
            made = self.ns_transform_fn(name, working)
            if made is not None:
                return check_transform(made, working)
        views = [working]
        if name is not None and self.reshape_fn is not None:
            views = list(self.reshape_fn(name, working)) or [working]
            storage = working.untyped_storage().data_ptr()
            if any(v.untyped_storage().data_ptr() != storage for v in views):
                raise HyperParallelValueError(
                    f"reshape_fn must return views that share storage with the working NS input "
                    f"tensor (param {name!r}); return views of it (view, reshape, split), not copies."
                )

        def restore(updates: list[Tensor], output: Tensor) -> None:
            for view, update in zip(views, updates, strict=True):
                view.copy_(update.view_as(view))

        return NSInputTransform(tensors=views, restore=restore)


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
        group: A Muon param group (its coefficients, normalization, scale
            and ``matrix_view``).
        dtype: The Newton-Schulz dtype.
        lr: The group's lr this step (for ``apply_lr_in_update``).
        workspace: Work buffers kept across steps (the optimizer's), or ``None``.
        settings: What the group's options decide; ``None``: worked out from
            ``group`` now (Muon passes the ones it keeps).
    """

    def __init__(
        self,
        group: Mapping[str, Any],
        dtype: torch.dtype,
        lr: float = 0.0,
        workspace: Workspace | None = None,
        settings: MuonSettings | None = None,
    ) -> None:
        if settings is None:
            from hyper_parallel_builtins.muon._options import resolve_settings

            settings = resolve_settings(group)
        self.group, self.dtype, self.lr = group, dtype, lr
        self.workspace = workspace
        self.settings = settings
        self.coefficients = settings.coefficients

    def split_dim(self, shape: torch.Size) -> int | None:
        _, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        batch = batch_dims(len(shape), self.group["matrix_view"])
        return batch if rows > cols else batch + 1

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
            scales.append(self.settings.scale(rows, cols, self.lr))
        results = newton_schulz_team(
            views,
            self.coefficients,
            group,
            eps=self.settings.eps,
            eps_added=self.settings.eps_added,
            dtype=self.dtype,
            workspace=self.workspace,
        )
        return [
            _as_update((r.mT if tall else r).reshape(piece.shape), piece.dtype, scale)
            for r, tall, piece, scale in zip(results, talls, slices, scales, strict=True)
        ]
