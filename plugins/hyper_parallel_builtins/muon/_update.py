"""One Muon step's arithmetic, on data decided when the group was added.

:class:`DecidedGroup` is what a group's options and params decide (its
:class:`MuonSettings`, backend, needs, transform and team), made once;
:class:`StepOptions` is what may change between steps (lr, weight decay,
momentum), read once per step. The step is then momentum
(:class:`MomentumSource`), Newton-Schulz of whole blocks
(:class:`BlockTransform`, which the sharding backend calls wherever it
assembled them, or :class:`MuonTeam` for a team of ranks sharing each
matrix), and the update applied (:func:`apply_updates_`). A group whose
params are all held whole here streams instead: :meth:`BlockTransform.stream_`
makes, orthogonalizes and applies each param's update in turn.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from hyper_parallel.core.distributed import Blocks, Need, ShardingBackend, TeamTransform
from hyper_parallel.core.distributed.toolkit import local_tensor, shard_like
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import (
    apply_momentum,
    by_device_and_dtype,
    lerp_momentum_,
    momentum_updates,
    new_or_into,
)
from hyper_parallel_builtins.muon._extensions import (
    MomentumUpdateFn,
    NSInputTransform,
    NSTransformFn,
    ReshapeFn,
    ZeropowerFn,
    check_transform,
)
from hyper_parallel_builtins.muon._matrices import matrix_shape, piece_shape
from hyper_parallel_builtins.newton_schulz import (
    Coefficients,
    Workspace,
    new_stack,
    newton_schulz_flops,
    newton_schulz_stack_,
    normalize_,
    resolve_ns_method,
    stack_into,
)

__all__ = [
    "BlockTransform",
    "DecidedGroup",
    "MomentumSource",
    "MuonSettings",
    "ScaleRule",
    "StepOptions",
    "apply_updates_",
    "as_update",
    "hyper_parallel_momentum",
    "hyper_parallel_momentum_",
    "live_lr",
    "momentum_pair",
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
    qk_clip_threshold: float | None = None  # QK-clip's tau; None: the group does not clip
    qk_clip_alpha: float = 0.5  # the share of the clip W_q takes (W_k takes the rest)
    #: (rows, cols, default dtype) -> the dtype tuning found faster (float32), per matrix shape
    tuned_dtypes: Mapping[tuple[int, int, torch.dtype], torch.dtype] = field(
        default_factory=dict, hash=False
    )

    def scale(self, rows: int, cols: int, lr: float) -> float:
        """The factor on a ``(rows, cols)`` matrix's orthogonalized update (a head block: its own)."""
        if self.scale_rule is ScaleRule.MATCHED_RMS:
            scale = self.rms * math.sqrt(max(rows, cols))
        elif self.scale_rule is ScaleRule.ASPECT:
            scale = math.sqrt(max(1.0, rows / cols)) if cols else 1.0
        else:
            scale = 1.0 if self.scale_rule is ScaleRule.ONE else 0.0
        return -lr * scale if self.lr_in_update else scale

    def dtype_for(self, block: Tensor, matrix: tuple[int, int] | None = None) -> torch.dtype:
        """The dtype ``block`` is orthogonalized in: the group's, else :func:`ns_dtype_of`, or
        for its ``(rows, cols)`` matrices the one tuning chose (:attr:`tuned_dtypes`)."""
        if self.group_ns_dtype is not None:
            return self.group_ns_dtype
        dtype = ns_dtype_of(block, self.env_ns_dtype, self.cpu_ns_dtype)
        if matrix is None or not self.tuned_dtypes:
            return dtype
        return self.tuned_dtypes.get((*matrix, dtype), dtype)


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


def live_lr(group: Mapping[str, Any]) -> float:
    """``group``'s lr now, as a float (a scheduler may have made it a 1-element tensor)."""
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)


@dataclass(frozen=True)
class StepOptions:
    """What a group's step reads live: the options schedulers and users change between steps."""

    lr: float
    m1: float  # the factor on the buffer in the update
    m2: float  # the factor on the buffer in its own step
    nesterov: bool
    decay: float  # 1 - lr * weight_decay, on the param before the update
    alpha: float  # the factor the update is added with: -lr, or 1 when the scale carries it

    @classmethod
    def of(cls, group: Mapping[str, Any], settings: MuonSettings) -> StepOptions:
        """``group``'s values now."""
        lr = live_lr(group)
        m1, m2 = momentum_pair(group["momentum"])
        return cls(
            lr=lr,
            m1=m1,
            m2=m2,
            nesterov=bool(group["nesterov"]),
            decay=1 - lr * group["weight_decay"],
            alpha=1.0 if settings.lr_in_update else -lr,
        )


def hyper_parallel_momentum_(
    local_buffers: list[Tensor],
    local_grads: list[Tensor],
    m1: float,
    m2: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
) -> list[Tensor] | None:
    """HyperParallel's momentum on local tensors of one device and dtype (a ``MomentumRule``).

    ``U = G + m1 B`` (with the buffer before this step), ``B <- m2 B + G``,
    and with Nesterov ``U <- G + m1 U``. Returns the updates (into ``out``
    where given), or ``None`` with ``m1 == m2`` and no Nesterov: the update
    is the new buffer itself.

    Each line is one ``G + m X`` pass (``torch.add`` with ``alpha``): with
    ``m1 == m2`` the Nesterov update is ``G + m1 B`` of the new buffer, the
    same sum, so the step reads the param-sized tensors twice rather than
    five times (at d=512 x 4 blocks on one CPU thread, 33 ms of a 280 ms step became 18).
    """
    separate = m1 != m2
    add = torch._foreach_add, torch.add
    looked = new_or_into(out, *add, local_grads, local_buffers, alpha=m1) if separate else []
    for grad, buffer in zip(local_grads, local_buffers, strict=True):
        torch.add(grad, buffer, alpha=m2, out=buffer)
    if not nesterov:
        return looked if separate else None
    if separate:  # U <- G + m1 U, in place
        return new_or_into(looked, *add, local_grads, looked, alpha=m1)
    return new_or_into(out, *add, local_grads, local_buffers, alpha=m1)


def hyper_parallel_momentum(
    buffers: list[Tensor],
    grads: list[Tensor],
    m1: float,
    m2: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """:func:`hyper_parallel_momentum_` on the local shards: the buffers in place, the updates
    returned laid out like them (see :func:`~hyper_parallel.core.optimizer.apply_momentum`)."""

    def rule(
        local_buffers: list[Tensor], local_grads: list[Tensor], into: list[Tensor] | None
    ) -> list[Tensor] | None:
        return hyper_parallel_momentum_(local_buffers, local_grads, m1, m2, nesterov, into)

    return apply_momentum(buffers, grads, rule, out)


@dataclass(frozen=True)
class MomentumSource:
    """One step's momentum updates, made when the sharding backend asks (its ``prepare``).

    ``source(positions, out)`` steps the buffers at those positions in place
    and returns their updates, laid out like them; the built-in rules write
    updates that are not the buffers into ``out`` where given. ``custom``
    (``momentum_update_fn``) replaces the rule: it gets the local tensors
    and ``(m1, m2, nesterov)``.
    """

    settings: MuonSettings
    options: StepOptions
    buffers: list[Tensor]
    grads: list[Tensor]
    custom: MomentumUpdateFn | None = None

    def __call__(self, positions: list[int], out: list[Tensor] | None = None) -> list[Tensor]:
        buffers = [self.buffers[i] for i in positions]
        grads = [self.grads[i] for i in positions]
        o = self.options
        if self.custom is not None:
            return _custom_momentum(self.custom, buffers, grads, o)
        if self.settings.torch_momentum:
            return momentum_updates(buffers, grads, o.m1, o.nesterov, out)
        return hyper_parallel_momentum(buffers, grads, o.m1, o.m2, o.nesterov, out)


def _custom_momentum(
    custom: MomentumUpdateFn, buffers: list[Tensor], grads: list[Tensor], options: StepOptions
) -> list[Tensor]:
    """``momentum_update_fn``'s updates, checked: one per gradient, each shaped like it."""
    made = list(
        custom(
            [local_tensor(g) for g in grads],
            [local_tensor(b) for b in buffers],
            options.m1,
            options.m2,
            options.nesterov,
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


def apply_updates_(local_params: list[Tensor], updates: list[Tensor], options: StepOptions) -> None:
    """``W <- decay * W + alpha * update`` on the local shards, one foreach call per device and dtype."""
    for indices in by_device_and_dtype(local_params):
        mine = [local_params[i] for i in indices]
        if options.decay != 1:
            torch._foreach_mul_(mine, options.decay)
        torch._foreach_add_(mine, [local_tensor(updates[i]) for i in indices], alpha=options.alpha)


def _torch_rule(
    buffers: list[Tensor], grads: list[Tensor], options: StepOptions, out: list[Tensor]
) -> list[Tensor] | None:
    return lerp_momentum_(buffers, grads, options.m1, options.nesterov, out)


def _hyper_parallel_rule(
    buffers: list[Tensor], grads: list[Tensor], options: StepOptions, out: list[Tensor]
) -> list[Tensor] | None:
    return hyper_parallel_momentum_(buffers, grads, options.m1, options.m2, options.nesterov, out)


def as_update(result: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``result`` in ``dtype``, times ``scale``, in contiguous memory.

    A tall matrix's Newton-Schulz result can come back as a transposed view;
    cast and laid out in one copy, its update is applied over contiguous
    memory (a transposed one is many times slower to add on a CPU: docs/benchmarks.md).
    It is always a copy: ``result`` may be a view of a ``Workspace`` buffer,
    which the next Newton-Schulz call on its shape overwrites.
    """
    return result.to(dtype, memory_format=torch.contiguous_format, copy=True).mul_(scale)


class BlockTransform:
    """Newton-Schulz of one group's whole blocks, each scaled (a ``BlocksFn``); made once per group.

    Args:
        group: The Muon param group (its lr is read when a block is scaled,
            for ``apply_lr_in_update``).
        settings: What its options decide (:class:`MuonSettings`).
        names: The name of each param of the group, by position: a block's
            key (:class:`~hyper_parallel.core.distributed.Blocks`); needed
            only with ``reshape_fn`` / ``ns_transform_fn``.
        zeropower_fn, reshape_fn, ns_transform_fn: HyperParallel's
            extension callables, or ``None``.
        workspace: Newton-Schulz work buffers kept across steps (the
            optimizer's); ``None``: allocated per call.
        device: Where the group's params live (for :meth:`cost`'s method).
    """

    def __init__(
        self,
        group: Mapping[str, Any],
        settings: MuonSettings,
        names: Sequence[str | None] = (),
        *,
        zeropower_fn: ZeropowerFn | None = None,
        reshape_fn: ReshapeFn | None = None,
        ns_transform_fn: NSTransformFn | None = None,
        workspace: Workspace | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.group, self.settings, self.names = group, settings, names
        self.workspace, self.device = workspace, device
        self.zeropower_fn = zeropower_fn
        self.reshape_fn, self.ns_transform_fn = reshape_fn, ns_transform_fn
        self.keyed = reshape_fn is not None or ns_transform_fn is not None
        self._shapes: dict[tuple[int, ...], tuple[int, int, int]] = {}

    def dtype(self, block: Tensor, matrix: tuple[int, int] | None = None) -> torch.dtype:
        """The dtype ``block`` (of ``(rows, cols)`` matrices, where known) is orthogonalized in."""
        return self.settings.dtype_for(block, matrix)

    def matrices(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """How a block of ``shape`` reads as matrices, ``(batch, rows, cols)`` (kept per shape)."""
        key = tuple(shape)
        found = self._shapes.get(key)
        if found is None:
            found = self._shapes[key] = matrix_shape(key, self.group["matrix_view"])
        return found

    def cost(self, shape: torch.Size) -> float:
        """Newton-Schulz FLOPs of a block of ``shape``, for the backend's balance."""
        batch, rows, cols = self.matrices(shape)
        device = self.device or torch.device("cpu")
        method = resolve_ns_method(self.group["ns_method"], rows, cols, device)
        return batch * newton_schulz_flops(rows, cols, self.group["ns_steps"], method)

    def __call__(self, blocks: list[Tensor]) -> list[Tensor]:
        if not self.keyed:
            return self._orthogonalize(list(blocks), [self.matrices(b.shape) for b in blocks])
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
            out[i] = as_update(result.reshape(tensors[i].shape), tensors[i].dtype, scale)

        self._run(
            tensors,
            shapes,
            lambda i, part: stack_into(part, tensors[i].reshape(part.shape), self.workspace),
            keep,
        )
        return cast(list[Tensor], out)

    def stream_(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        buffers: Sequence[Tensor],
        options: StepOptions,
    ) -> None:
        """The whole step of plain params held whole here: each update made, orthogonalized
        and applied in turn.

        Each param's momentum update goes into a buffer laid out like it
        (unless it is the momentum buffer itself) and is copied into the
        Newton-Schulz stack of its shape; after the iteration its scaled
        update comes back in that same buffer and is applied before the
        next. Nothing the size of a param is allocated per step (holding
        every update at once cost a large model a quarter of its CPU step
        in fresh pages: docs/benchmarks.md). The numbers are those of
        :meth:`__call__` with :class:`MomentumSource` and
        :func:`apply_updates_`, bit for bit.
        """
        rule = _torch_rule if self.settings.torch_momentum else _hyper_parallel_rule

        def fill(i: int, part: Tensor) -> None:
            made = rule([buffers[i]], [grads[i]], options, [self._scratch(buffers[i])])
            update = buffers[i] if made is None else made[0]
            stack_into(part, update.reshape(part.shape), self.workspace)

        def take(i: int, result: Tensor, scale: float) -> None:
            update = self._scratch(buffers[i])
            update.copy_(result.reshape(update.shape)).mul_(scale)
            if options.decay != 1:
                params[i].mul_(options.decay)
            params[i].add_(update, alpha=options.alpha)

        self._run(buffers, [self.matrices(b.shape) for b in buffers], fill, take)

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
        lr = live_lr(self.group)
        buckets: dict[tuple[torch.device, torch.dtype, int, int], list[int]] = {}
        for i, (tensor, (_, rows, cols)) in enumerate(zip(tensors, shapes, strict=True)):
            key = (tensor.device, self.dtype(tensor, (rows, cols)), rows, cols)
            buckets.setdefault(key, []).append(i)
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
                if self.zeropower_fn is None:  # while the part is in cache
                    normalize_(part, self.settings.eps, self.settings.eps_added)
            result = self._newton_schulz(stack)
            scale = self.settings.scale(rows, cols, lr)
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
                normalized=True,
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


@dataclass(frozen=True)
class DecidedGroup:
    """What a Muon group's options and params decide, worked out when they change, never per step.

    Muon makes it when the group is first stepped after it was added, loaded
    or edited (its deciding options, its params, the optimizer's callables
    or workspace); a step reads it as data.

    Attributes:
        settings: What the options decide (rule, coefficients, dtypes, scale).
        backend: The group's sharding backend.
        needs: What Newton-Schulz needs of each param, by ``id(param)``.
        names: Each param's name, by ``id(param)`` (``None`` where it has none).
        transform: The block transform the backend calls.
        team: The transform as a team of ranks computes it, where a team
            may (the standard iteration, no keyed or custom callables).
        streams: The backend holds every param whole here and nothing asks
            for more than whole matrices: the step streams param by param
            (:meth:`BlockTransform.stream_`) instead of calling the backend.
    """

    settings: MuonSettings
    backend: ShardingBackend
    needs: Mapping[int, Need]
    names: Mapping[int, str | None]
    transform: BlockTransform
    team: TeamTransform | None
    streams: bool
