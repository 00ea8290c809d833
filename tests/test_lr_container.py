"""``LRSchedulersContainer`` (``hyper_parallel.core.optimizer``'s ``_container``): one
scheduler per sub-optimizer, against one scheduler for all, and its state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_schedules import sgd

from hyper_parallel.core.optimizer import HyperLRScheduler, get_hyper_lr_scheduler


def test_one_scheduler_per_sub_optimizer_gives_the_same_lrs() -> None:
    from hyper_parallel.core.optimizer import ChainedOptimizer, LRSchedulersContainer

    pairs: list[tuple[ChainedOptimizer, Any]] = []
    for per_optimizer in (False, True):
        chained = ChainedOptimizer({"adamw": sgd(3e-4), "muon": sgd(0.02)})

        def cosine(optimizer: torch.optim.Optimizer) -> HyperLRScheduler:
            return get_hyper_lr_scheduler(optimizer, "cosine", total_steps=20, warmup_steps=3)

        scheduler = LRSchedulersContainer(chained, cosine) if per_optimizer else cosine(chained)
        pairs.append((chained, scheduler))
    (_, single), (_, container) = pairs
    assert isinstance(container, LRSchedulersContainer) and len(container) == 2
    assert isinstance(container["muon"], HyperLRScheduler)
    for _ in range(22):
        assert container.get_last_lr() == pytest.approx(single.get_last_lr(), rel=1e-12)
        for opt, sched in pairs:
            opt.step()
            sched.step()
    state = container.state_dict()
    assert set(state) == {"adamw", "muon"}
    with pytest.raises(ValueError, match=r"saved schedulers are \['muon'\]"):
        container.load_state_dict({"muon": state["muon"]})


def test_the_container_restores_the_saved_lr_before_the_first_resumed_step() -> None:
    """HyperParallel's test_load_state_dict_restores_optimizer_learning_rate, ported."""
    from types import SimpleNamespace

    from hyper_parallel.core.optimizer import LRSchedulersContainer

    def step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    source_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    source = LRSchedulersContainer(
        SimpleNamespace(optimizers_dict={"main": source_optimizer}), step_lr
    )
    source_optimizer.step()
    source.step()
    target_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.0)
    target = LRSchedulersContainer(
        SimpleNamespace(optimizers_dict={"main": target_optimizer}), step_lr
    )
    target.load_state_dict(source.state_dict())
    assert target_optimizer.param_groups[0]["lr"] == 0.5
    assert target.get_last_lr() == [0.5]
