"""``LRSchedulersContainer``: one scheduler per sub-optimizer of a chain, as HyperParallel's."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hyper_parallel.core.errors import (
    HyperParallelStateDictError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.optimizer._scheduler import set_lr

__all__ = ["LRSchedulersContainer", "SchedulerFactory"]


class SchedulerFactory(Protocol):
    """Makes one sub-optimizer's LR scheduler: ``factory(optimizer=sub_optimizer)``."""

    def __call__(self, optimizer: Optimizer) -> LRScheduler: ...


class LRSchedulersContainer(LRScheduler):
    """One LR scheduler per sub-optimizer of a chain, stepped as one (HyperParallel's container).

    :func:`get_hyper_lr_scheduler` on a chain gives every group the lrs this
    gives; the container is for a scheduler per sub-optimizer, or code
    written for HyperParallel's.

    It is a :class:`torch.optim.lr_scheduler.LRScheduler` the way torch's
    own ``ChainedScheduler`` is one (its ``optimizer`` is the chain; it keeps
    no ``last_epoch`` of its own, its schedulers do), so trainers that check
    for a torch scheduler (PyTorch Lightning's ``configure_optimizers``)
    take it as it is.

    Examples:
        >>> schedulers = LRSchedulersContainer(
        ...     optimizer,
        ...     lambda optimizer: get_hyper_lr_scheduler(optimizer, total_steps=1000),
        ... )

    Args:
        optimizer: A :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`
            (anything with ``optimizers_dict``).
        scheduler: ``scheduler(optimizer=sub_optimizer)`` makes each one's
            scheduler, e.g. ``lambda optimizer: StepLR(optimizer, 10)``; or a
            mapping from sub-optimizer name to such a callable.

    Attributes:
        optimizer: The chain the schedulers belong to, as given.
        schedulers: The schedulers, in the chain's order.
    """

    def __init__(
        self,
        optimizer: Any,
        scheduler: SchedulerFactory | Mapping[str, SchedulerFactory],
    ) -> None:
        optimizers = getattr(optimizer, "optimizers_dict", None)
        if not isinstance(optimizers, Mapping):
            raise HyperParallelTypeError(
                f"LRSchedulersContainer needs a ChainedOptimizer, got {type(optimizer).__name__}; "
                "for a single optimizer use its scheduler directly."
            )
        makers = (
            scheduler if isinstance(scheduler, Mapping) else dict.fromkeys(optimizers, scheduler)
        )
        if set(makers) != set(optimizers):
            raise HyperParallelValueError(
                f"LRSchedulersContainer got schedulers for {sorted(makers)}; the chain has "
                f"{sorted(optimizers)}. Give one per sub-optimizer."
            )
        # Not LRScheduler.__init__ (torch's ChainedScheduler skips it too): its initial step
        # would step every scheduler once more; each has already set its groups' lrs.
        self.optimizer = optimizer
        self._by_name = {name: makers[name](optimizer=sub) for name, sub in optimizers.items()}
        self.schedulers = list(self._by_name.values())

    def __getitem__(self, name: str) -> LRScheduler:
        return self._by_name[name]

    def __iter__(self) -> Iterator[LRScheduler]:
        return iter(self.schedulers)

    def __len__(self) -> int:
        return len(self.schedulers)

    def step(self) -> None:  # type: ignore[override]
        """Step every scheduler, in the chain's order."""
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        """Every group's lr, sub-optimizer by sub-optimizer, in the chain's order."""
        return [float(lr) for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        """Each scheduler's state, keyed by its sub-optimizer's name."""
        return {name: scheduler.state_dict() for name, scheduler in self._by_name.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load each scheduler's state by name; the groups' lrs move to the saved position.

        Raises:
            HyperParallelStateDictError: the names differ from this
                container's; a ``RuntimeError`` (as HyperParallel raises)
                and a ``ValueError``.
        """
        if set(state_dict) != set(self._by_name):
            raise HyperParallelStateDictError(
                f"The saved schedulers are {sorted(state_dict)}; this container has "
                f"{sorted(self._by_name)}. Build it for the same sub-optimizers."
            )
        for name, scheduler in self._by_name.items():
            scheduler.load_state_dict(copy.deepcopy(dict(state_dict[name])))
            for group, lr in zip(
                scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
            ):
                set_lr(group, lr)
