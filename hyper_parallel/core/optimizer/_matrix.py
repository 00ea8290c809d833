"""``MatrixOptimizer``: the base of optimizers whose update transforms whole matrices.

Muon (Newton-Schulz on whole matrices or head blocks) and Sinkhorn (row and
column norms) share everything but their transform: momentum on the local
shards, a sharding backend resolved once per param group, group checks that
leave nothing half-added, and ``step(closure)``. A third-party matrix
optimizer subclasses this and gets every layout the installed backends
handle.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, overload

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hyper_parallel.core.compat import eager_when_compiled
from hyper_parallel.core.distributed import GroupBackends, ShardingBackend
from hyper_parallel.core.distributed.toolkit import local_tensor, shard_like
from hyper_parallel.core.errors import HyperParallelRuntimeError
from hyper_parallel.core.options import check_group_keys

__all__ = [
    "MatrixOptimizer",
    "MomentumRule",
    "apply_momentum",
    "by_device_and_dtype",
    "lerp_momentum_",
    "momentum_updates",
    "new_or_into",
]


class MatrixOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base class of matrix optimizers: one transform per matrix, on any layout.

    Subclasses implement :meth:`_check_options`, :meth:`_check_param` and
    :meth:`_step_group`, and
    reach the group's data through :meth:`sharding_backend`: its
    ``map_blocks`` for whole matrices or row blocks, its ``map_reductions``
    for row and column sums. The backend is resolved when a group is added
    (so a layout no backend takes fails when the optimizer is built) and
    again only when the group's params or ``sharding`` option change.

    Register a subclass with ``requires=("matrices_only",)`` so that
    ``get_hyper_optimizer`` gives params with fewer than two dims to AdamW.
    ``replica_group_size``
    (HSDP's ``hsdp_replica_count``) limits the replicas that share the work
    (:meth:`~hyper_parallel.core.distributed.ShardingBackend.group_replicas`).
    """

    #: Set by :meth:`stepping_in_parts` while steps update part of the params each.
    _in_parts: bool = False

    #: Group keys a state_dict from an older version may lack, with their defaults.
    extra_group_defaults: ClassVar[Mapping[str, Any]] = {"sharding": None}

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        replica_group_size: int | None = None,
    ) -> None:
        self._check_options(defaults)  # the constructor's own arguments, before any group
        # before super() adds the groups
        self._backends = GroupBackends(replica_group_size=replica_group_size)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, checking its options, its params and their sharding backend.

        Raises:
            ValueError: an unknown key (a typo: with a suggestion), a bad option
                or param, or a layout no backend takes; the group is not added.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_group_keys(group, self.defaults, where=f"optimizer {type(self).__name__}")
            self._check_group(group)
            self._backends(group)
        except ValueError:
            self.param_groups.pop()
            raise

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and groups; the backends' replica grouping goes too
        # (a copy resolves its own backends, grouped the same way)
        return {**super().__getstate__(), "_backends": self._backends}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.extra_group_defaults.items():
                group.setdefault(key, self.defaults.get(key, value))
        if "_backends" not in self.__dict__:
            self._backends = GroupBackends()

    def sharding_backend(self, group: Mapping[str, Any]) -> ShardingBackend:
        """The sharding backend of ``group`` (resolved once; see the class docstring)."""
        return self._backends(group)

    def _params_with_grads(
        self, group: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The group's params that have a gradient, those gradients, and their momentum buffers.

        A buffer is made by :meth:`_new_buffer` at a param's first step.
        (Not named ``_init_group``: ``torch.compile`` treats a method of that
        name as torch's own and cannot trace ours.)
        """
        params: list[Tensor] = []
        grads: list[Tensor] = []
        buffers: list[Tensor] = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            self._check_grad(p, grad)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = self._new_buffer(p, grad)
            params.append(p)
            grads.append(grad)
            buffers.append(state["momentum_buffer"])
        return params, grads, buffers

    def _check_grad(self, param: Tensor, grad: Tensor) -> None:
        """Refuse a gradient the update cannot use (by default: a sparse one)."""
        if grad.is_sparse:
            raise HyperParallelRuntimeError(
                f"{type(self).__name__} does not support sparse gradients (param of shape "
                f"{tuple(param.shape)}); use a dense gradient, or SparseAdam for sparse embeddings."
            )

    def _new_buffer(self, param: Tensor, grad: Tensor) -> Tensor:
        """A zero momentum buffer for ``param`` (by default shaped, laid out and typed like ``grad``)."""
        return torch.zeros_like(grad, memory_format=torch.preserve_format)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a bad option or param of a group being added."""
        self._check_options(group)
        for p in group["params"]:
            self._check_param(p, group)

    @abc.abstractmethod
    def _check_options(self, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` for an out-of-range option (of the constructor or a group)."""

    @abc.abstractmethod
    def _check_param(self, param: Tensor, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a param the update cannot take under ``group``'s options."""

    def _check_step(self, group: dict[str, Any]) -> None:
        """Raise before a step changes anything, for a group option edited since it was added.

        Called on every group before any group steps (by default: nothing to check).
        """

    @abc.abstractmethod
    def _step_group(self, group: dict[str, Any]) -> None:
        """Update the params of ``group`` that have a gradient (called under ``no_grad``)."""

    def _ready_step(self) -> None:
        """Raise before a step changes anything, for what spans groups (by default: nothing).

        Called once every group's :meth:`_check_step` passed, before any group steps.
        """

    def _finish_step(self) -> None:
        """Called once every group has stepped, under ``no_grad`` (by default: nothing)."""

    def check_step(self) -> None:
        """Raise now what the next step would raise before changing anything.

        Every group's :meth:`_check_step`, then :meth:`_ready_step`. A step
        runs it first; ``ChainedOptimizer`` runs it on each sub-optimizer
        before any of them steps, so a failing step leaves every param as it was.
        """
        for group in self.param_groups:
            self._check_step(group)
        self._ready_step()

    def finish_step(self) -> None:
        """What follows a whole step (:meth:`_finish_step`), after steps made in parts."""
        with torch.no_grad():
            self._finish_step()

    @contextlib.contextmanager
    def stepping_in_parts(self) -> Iterator[None]:
        """Steps inside update part of the params each (``SwapOptimizer``'s batches).

        They skip what spans the whole step: the caller runs :meth:`check_step`
        once before, on the whole groups, and :meth:`finish_step` once after.
        """
        self._in_parts = True
        try:
            yield
        finally:
            self._in_parts = False

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
        if torch.compiler.is_compiling():
            eager_when_compiled(_step_groups, self)
        else:
            _step_groups(self)
        return loss


def check_steps(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """:meth:`MatrixOptimizer.check_step` of each matrix optimizer among ``optimizers``
    (eager code even inside ``torch.compile``)."""
    matrix = [opt for opt in optimizers if isinstance(opt, MatrixOptimizer)]
    if torch.compiler.is_compiling():
        eager_when_compiled(_check_each, matrix)
    else:
        _check_each(matrix)


def _check_each(optimizers: list[MatrixOptimizer]) -> None:
    for opt in optimizers:
        opt.check_step()


@torch.no_grad()
def _step_groups(optimizer: MatrixOptimizer) -> None:
    """Every group's update; eager code even inside ``torch.compile(optimizer.step)``.

    The step's time is its matrix products (Newton-Schulz), which compiling
    does not shorten, and its work is laid out per matrix shape and per
    step's lr, which Dynamo would specialize on: compiled, a model of more
    than 8 matrix shapes or a changing lr hit Dynamo's recompile limit. The
    rest of a compiled step (AdamW, the chain) still compiles.
    """
    whole = not optimizer._in_parts
    if whole:
        optimizer.check_step()  # every check before any group changes
    for group in optimizer.param_groups:
        optimizer._step_group(group)
    if whole:
        optimizer._finish_step()


def by_device_and_dtype(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped so each group can take one foreach call."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


#: A momentum rule on one device's and dtype's local tensors: ``rule(buffers, grads, out)`` steps
#: the buffers in place and returns the updates, or ``None`` when the updates are the buffers.
#: Updates that are not the buffers go into ``out`` (one tensor per buffer, laid out like it)
#: where given, else into new tensors (:func:`new_or_into`).
MomentumRule = Callable[[list[Tensor], list[Tensor], "list[Tensor] | None"], "list[Tensor] | None"]


def new_or_into(
    out: list[Tensor] | None,
    foreach_op: Callable[..., Sequence[Tensor]],
    op: Callable[..., Tensor],
    *lists: list[Tensor],
    **scalars: float,
) -> list[Tensor]:
    """``foreach_op(*lists, **scalars)``: new tensors, or ``op`` on each, written into ``out``.

    The two give the same values bit for bit (on a CPU a foreach op runs
    ``op`` tensor by tensor); ``out`` lets a caller that steps param by
    param reuse one buffer rather than allocate per param.
    """
    if out is None:
        return list(foreach_op(*lists, **scalars))
    for target, *operands in zip(out, *lists, strict=True):
        op(*operands, **scalars, out=target)
    return out


def apply_momentum(
    buffers: list[Tensor],
    grads: list[Tensor],
    rule: MomentumRule,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """Run ``rule`` on the local shards, one call per device and dtype; the updates, laid out as the buffers.

    The element-wise work skips DTensor's per-op dispatch and takes one
    foreach call per device and dtype.

    Args:
        buffers: Momentum buffers (DTensors or plain), changed in place.
        grads: The gradients, in the buffers' dtype and layout.
        rule: The momentum rule (:data:`MomentumRule`).
        out: Plain tensors, one per buffer and laid out like its local
            shard, for updates that are not the buffers; default new ones.

    Returns:
        One update per buffer, laid out like it.
    """
    local_buffers = [local_tensor(b) for b in buffers]
    local_grads = [local_tensor(g) for g in grads]
    updates = list(buffers)
    for indices in by_device_and_dtype(local_buffers):
        made = rule(
            [local_buffers[i] for i in indices],
            [local_grads[i] for i in indices],
            None if out is None else [out[i] for i in indices],
        )
        if made is not None:
            for i, update in zip(indices, made, strict=True):
                updates[i] = shard_like(update, buffers[i])
    return updates


def lerp_momentum_(
    local_buffers: list[Tensor],
    local_grads: list[Tensor],
    momentum: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
) -> list[Tensor] | None:
    """torch's momentum rule on local tensors of one device and dtype (a :data:`MomentumRule`).

    ``B <- momentum * B + (1 - momentum) * G`` in place; returns the
    Nesterov look-ahead ``(1 - momentum) * G + momentum * B`` (into ``out``
    where given), or ``None`` without Nesterov: the update is ``B`` itself.
    """
    torch._foreach_lerp_(local_buffers, local_grads, 1 - momentum)
    if not nesterov:
        return None
    return new_or_into(
        out, torch._foreach_lerp, torch.lerp, local_grads, local_buffers, weight=momentum
    )


def momentum_updates(
    buffers: list[Tensor],
    grads: list[Tensor],
    momentum: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """Step the momentum buffers in place and return the updates to transform (torch's rule).

    :func:`lerp_momentum_` on the local shards (:func:`apply_momentum`).

    Args:
        buffers: Momentum buffers (DTensors or plain), changed in place.
        grads: The gradients, in the buffers' dtype and layout.
        momentum: The momentum factor.
        nesterov: Return the look-ahead instead of the buffers.
        out: Where the look-ahead goes (see :func:`apply_momentum`).

    Returns:
        One update per buffer, laid out like it.
    """

    def rule(
        local_buffers: list[Tensor], local_grads: list[Tensor], into: list[Tensor] | None
    ) -> list[Tensor] | None:
        return lerp_momentum_(local_buffers, local_grads, momentum, nesterov, into)

    return apply_momentum(buffers, grads, rule, out)
