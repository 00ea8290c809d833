"""One smoke test over every registered plugin of every kind.

Optimizers: build, 5 steps, loss falls on a toy problem, and a ``state_dict``
round trip gives an identical next step. Schedules: every group follows its
own peak. Partitioners: every trainable param assigned once, and training
through them works. Backends: blocks and reductions equal the whole-tensor
result. (``hyper_parallel.testing`` does the checking, the same helpers
plugin authors use.)
"""

from __future__ import annotations

from typing import Any

import pytest

from hyper_parallel import get_registry
from hyper_parallel.testing import (
    check_lr_schedule,
    check_optimizer,
    check_partitioner,
    check_sharding_backend,
)

# Only what a toy problem needs to exercise an optimizer, never its math.
OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    "sparseadam": {"sparse": True},
}
SCHEDULE_OPTIONS: dict[str, dict[str, Any]] = {}


@pytest.mark.parametrize("name", get_registry().names("optimizer"))
def test_every_optimizer(name: str) -> None:
    check_optimizer(name, steps=5, **OPTIMIZER_OPTIONS.get(name, {}))


@pytest.mark.parametrize("name", get_registry().names("lr_scheduler"))
def test_every_lr_schedule(name: str) -> None:
    check_lr_schedule(name, total_steps=40, warmup_steps=4, **SCHEDULE_OPTIONS.get(name, {}))


@pytest.mark.parametrize("name", get_registry().names("partitioner"))
def test_every_partitioner(name: str) -> None:
    check_partitioner(name)


@pytest.mark.parametrize("name", get_registry().names("sharding_backend"))
def test_every_sharding_backend(name: str) -> None:
    check_sharding_backend(name)


def test_builtins_are_all_covered() -> None:
    names = set(get_registry().names("optimizer"))
    assert {"muon", "adamw", "sgd", "adam", "lbfgs", "sparseadam", "torch_muon"} <= names
    schedules = set(get_registry().names("lr_scheduler"))
    assert {
        "constant",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "wsd",
    } <= schedules
