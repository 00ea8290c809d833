"""One smoke test over every registered optimizer and LR schedule.

Build, 5 steps, loss falls on a toy problem, and a ``state_dict`` round trip
gives an identical next step (``hyper_parallel.testing`` does the checking,
the same helpers plugin authors use).
"""

from __future__ import annotations

from typing import Any

import pytest

from hyper_parallel import get_registry
from hyper_parallel.testing import check_lr_schedule, check_optimizer

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
