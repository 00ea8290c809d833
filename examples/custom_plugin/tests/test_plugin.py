"""Tests of the installed hp_lion plugin, as a user of hyper_parallel would see it.

Run after installing the distribution (the plugin is found through its entry
point, exactly as in a user's environment)::

    pip install -e examples/custom_plugin
    python -m pytest examples/custom_plugin/tests
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel import UnknownPluginError, get_registry
from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer
from hyper_parallel.testing import check_lr_schedule, check_optimizer

DISTRIBUTION = "hyper-parallel-lion"
PLUGIN = "hp_lion"
NOT_INSTALLED = (
    f"{DISTRIBUTION} is not installed, so hyper_parallel cannot find its entry point: "
    "run `pip install -e examples/custom_plugin` first."
)

try:
    from hp_lion import Lion, step_decay
except ImportError:
    pytest.fail(NOT_INSTALLED, pytrace=False)


@pytest.fixture(autouse=True)
def installed_plugin() -> Iterator[None]:
    """Fail with the fix when the distribution is not installed; load plugins afresh."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(NOT_INSTALLED)
    get_registry().reset()
    try:
        yield
    finally:
        get_registry().reset()


# -- registration ------------------------------------------------------------


def test_registered_through_this_distributions_entry_point() -> None:
    version = importlib.metadata.version(DISTRIBUTION)
    optimizer = get_registry().get("optimizer", "lion")
    schedule = get_registry().get("lr_scheduler", "step_decay")
    for entry in (optimizer, schedule):
        assert entry.distribution == f"{DISTRIBUTION} {version}"
        assert entry.plugin == PLUGIN
    assert optimizer.obj is Lion
    assert schedule.obj is step_decay
    # Names are case-insensitive, '-' and '_' alike, and aliases resolve to the same entry.
    assert get_registry().get("lr_scheduler", "Staircase") is schedule
    assert get_registry().get("lr_scheduler", "step-decay") is schedule


def test_a_misspelt_name_suggests_ours() -> None:
    with pytest.raises(UnknownPluginError, match="lion"):
        get_registry().get("optimizer", "loin")


# -- Lion ----------------------------------------------------------------------


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("options", [{}, {"lr": 1e-2, "weight_decay": 0.1}])
def test_lion_conforms(foreach: bool, options: dict[str, Any]) -> None:
    # Builds by name, lowers a toy loss, and steps identically after a state_dict round trip.
    check_optimizer("lion", foreach=foreach, **options)


@pytest.mark.parametrize("foreach", [False, True])
def test_lion_matches_the_update_rule_worked_by_hand(foreach: bool) -> None:
    # lr=0.1, betas=(0.9, 0.99), weight_decay=0.5, so each step first scales by 1 - 0.05.
    param = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64))
    optimizer = Lion([param], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5, foreach=foreach)

    # Step 1, m = 0: c = 0.1 * g = [0.05, -0.1, 0, 0.2], sign [1, -1, 0, 1].
    # theta = [0.95, -1.9, 0.475, 0] - 0.1 * sign; m = 0.01 * g.
    param.grad = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.tensor([0.85, -1.8, 0.475, -0.1]).double())
    torch.testing.assert_close(
        optimizer.state[param]["exp_avg"], torch.tensor([0.005, -0.01, 0.0, 0.02]).double()
    )

    # Step 2: c = 0.9 * m + 0.1 * g = [0.0035, 0.041, 0.1, -0.012], sign [1, 1, 1, -1]:
    # the first coordinate's gradient is negative, but the momentum still wins.
    # theta = 0.95 * [0.85, -1.8, 0.475, -0.1] - 0.1 * sign; m = 0.99 * m + 0.01 * g.
    param.grad = torch.tensor([-0.01, 0.5, 1.0, -0.3], dtype=torch.float64)
    optimizer.step()
    torch.testing.assert_close(
        param.detach(), torch.tensor([0.7075, -1.81, 0.35125, 0.005]).double()
    )
    torch.testing.assert_close(
        optimizer.state[param]["exp_avg"], torch.tensor([0.00485, -0.0049, 0.01, 0.0168]).double()
    )


def test_lion_maximize_is_minimizing_the_negated_loss() -> None:
    up = nn.Parameter(torch.ones(3))
    down = nn.Parameter(torch.ones(3))
    grad = torch.tensor([1.0, -2.0, 3.0])
    maximizing = Lion([up], lr=0.1, maximize=True)
    minimizing = Lion([down], lr=0.1)
    up.grad, down.grad = grad.clone(), -grad
    maximizing.step()
    minimizing.step()
    assert torch.equal(up.detach(), down.detach())
    assert torch.equal(up.detach(), torch.tensor([1.1, 0.9, 1.1]))


def test_foreach_and_per_param_loops_agree_across_groups_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    dtypes = [torch.float32, torch.float64, torch.float32]
    weights = [torch.randn(s, generator=gen, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for foreach in (False, True):
        params = [nn.Parameter(w.clone()) for w in weights]
        groups: list[dict[str, Any]] = [
            {"params": params[:2]},
            {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0},
        ]
        optimizer = Lion(
            groups,
            lr=1e-2,
            weight_decay=0.1,
            foreach=foreach,
        )
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        results.append([p.detach() for p in params])
    for loop, fused in zip(*results, strict=True):
        assert torch.equal(loop, fused)


def test_lion_state_dict_round_trip_resumes_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = Lion(model.parameters(), lr=1e-2, weight_decay=0.1)
    inputs = torch.randn(8, 4)
    for _ in range(3):
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    twin = copy.deepcopy(model)
    restored = Lion(twin.parameters(), lr=1.0)  # hyperparameters come from the state dict
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert restored.param_groups[0]["lr"] == 1e-2
    for net, opt in ((model, optimizer), (twin, restored)):
        net(inputs).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, "lr must be positive"),
        ({"betas": (0.9, 1.0)}, "betas must be two numbers in"),
        ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
    ],
)
def test_lion_rejects_bad_hyperparameters(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lion([nn.Parameter(torch.zeros(2))], **options)


def test_lion_refuses_sparse_gradients() -> None:
    embedding = nn.Embedding(4, 2, sparse=True)
    optimizer = Lion(embedding.parameters())
    embedding(torch.tensor([0, 1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()


# -- step_decay ----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"gamma": 0.5, "every": 5}, {"gamma": 0.1, "every": 1, "min_lr_ratio": 0.05}],
)
def test_step_decay_conforms(options: dict[str, Any]) -> None:
    # Every group follows the factor from its own peak, and a state_dict round trip resumes it.
    check_lr_schedule("step_decay", total_steps=40, warmup_steps=4, **options)


def test_step_decay_values() -> None:
    def factor(step: int, **options: float) -> float:
        return step_decay(step, total_steps=20, warmup_steps=4, gamma=0.5, every=5, **options)

    assert [factor(s) for s in (0, 2, 4, 8, 9, 13, 14, 19)] == [0, 0.5, 1, 1, 0.5, 0.5, 0.25, 0.125]
    assert factor(20) == factor(100) == 0.5**3  # held from total_steps on
    assert factor(14, min_lr_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.25)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"gamma": 0.0}, ValueError, r"gamma must be in \(0, 1\]"),
        ({"gamma": "half"}, TypeError, "gamma must be a number"),
        ({"every": 0}, ValueError, "every must be at least 1"),
        ({"every": 2.5}, TypeError, "every must be an int"),
        ({"min_lr_ratio": 1.5}, ValueError, r"min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_step_decay_bad_options_fail_before_the_optimizer_changes(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(error, match=message):
        get_hyper_lr_scheduler(optimizer, "step_decay", total_steps=10, **options)
    assert optimizer.param_groups[0]["lr"] == 0.1


# -- selected by name through hyper_parallel's API ----------------------------------


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1))


def test_get_hyper_optimizer_and_scheduler_select_them_by_name() -> None:
    model = _tiny_model()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = get_hyper_optimizer(
        model,
        optimizers={
            "lion": {"params": matrices, "lr": 3e-3, "weight_decay": 0.1},
            "adamw": {"params": others, "lr": 1e-2},
        },
    )
    assert isinstance(optimizer.optimizers["lion"], Lion)
    scheduler = get_hyper_lr_scheduler(
        optimizer, "step_decay", total_steps=12, warmup_steps=2, gamma=0.5, every=4
    )
    ids = (torch.arange(12).repeat(4, 1) + torch.arange(4)[:, None]) % 16
    before = float(_loss(model, ids).detach())
    for _ in range(10):
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert float(_loss(model, ids).detach()) < before
    # step 10 = warmup 2 + two decays of 4 steps: a quarter of each group's own peak.
    assert optimizer.optimizers["lion"].param_groups[0]["lr"] == pytest.approx(3e-3 / 4)
    assert optimizer.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(1e-2 / 4)


def test_lr_min_works_because_step_decay_has_min_lr_ratio() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = get_hyper_lr_scheduler(
        optimizer, "staircase", total_steps=10, every=1, gamma=0.1, lr=0.1, lr_min=0.01
    )  # HyperParallel's lr_min is relative to lr: the floor is a tenth of each peak
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01, rel=1e-6)


def test_misspelt_options_are_reported_with_a_suggestion() -> None:
    model = _tiny_model()
    with pytest.raises(TypeError, match=r"Unknown keyword argument 'beta'.*Did you mean 'betas'"):
        get_hyper_optimizer(model, optimizers={"lion": {"params": model.parameters(), "beta": 0}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"Unknown keyword argument 'evry'.*Did you mean 'every'"):
        get_hyper_lr_scheduler(optimizer, "step_decay", total_steps=10, evry=2)
