"""``get_hyper_lr_scheduler`` and ``HyperLRScheduler`` (``hyper_parallel.core.optimizer``'s
``_scheduler``): every param group from its own peak, HyperParallel's and Megatron's keywords,
errors by type and message with the optimizer untouched, state after a round trip, a
third-party schedule, and HyperParallel's lr sequence.
"""

from __future__ import annotations

import copy
import io
import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_schedules import (
    BUILTINS,
    PEAK,
    T,
    W,
    lrs,
    ref_cosine,
    ref_linear,
    ref_wsd,
    run,
    sgd,
)

from hyper_parallel import (
    UnknownPluginError,
    get_registry,
    hookimpl,
    register_plugin,
    unregister_plugin,
)
from hyper_parallel.core.optimizer import HyperLRScheduler, get_hyper_lr_scheduler

# -- param groups and ChainedOptimizer ----------------------------------------------------------


def test_groups_of_one_optimizer_each_follow_their_own_peak() -> None:
    optimizer = sgd(0.02, 3e-4)
    scheduler = get_hyper_lr_scheduler(
        optimizer, "cosine", total_steps=T, warmup_steps=W, lr_min=0.0
    )
    for step, (a, b) in enumerate(run(optimizer, scheduler, T + 5)):
        factor = ref_cosine(step, T, W)
        assert a == pytest.approx(0.02 * factor) and b == pytest.approx(3e-4 * factor)


def test_chained_optimizer_sub_optimizers_each_follow_their_own_peak() -> None:
    chained_module = pytest.importorskip("hyper_parallel.core.optimizer._chained")
    muon, adamw = sgd(0.02), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=3e-4)
    chained = chained_module.ChainedOptimizer({"muon": muon, "adamw": adamw})
    # HyperParallel's lr_min is relative to lr: every group ends at a tenth of its own peak
    scheduler = get_hyper_lr_scheduler(
        chained, "wsd", total_steps=T, warmup_steps=W, decay_steps=20, lr=1e-4, lr_min=1e-5
    )
    for step in range(T + 5):
        factor = ref_wsd(step, T, W, decay_steps=20, min_lr_ratio=0.1)
        for sub, peak in [(muon, 0.02), (adamw, 3e-4)]:
            assert sub.param_groups[0]["lr"] == pytest.approx(peak * factor, rel=1e-12)
        chained.step()
        scheduler.step()
    assert muon.param_groups[0]["lr"] == pytest.approx(0.002)
    assert adamw.param_groups[0]["lr"] == pytest.approx(3e-5)


def test_tensor_lrs_stay_tensors() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.01), foreach=False)
    scheduler = get_hyper_lr_scheduler(optimizer, "linear", total_steps=10, warmup_steps=2)
    for step in range(12):
        lr = optimizer.param_groups[0]["lr"]
        assert isinstance(lr, torch.Tensor)
        assert float(lr) == pytest.approx(0.01 * ref_linear(step, 10, 2, min_lr_ratio=1e-3))
        optimizer.step()
        scheduler.step()


# -- HyperParallel / Megatron aliases ------------------------------------------------------------


def test_default_schedule_is_cosine() -> None:
    scheduler = get_hyper_lr_scheduler(sgd(), total_steps=T, warmup_steps=W)
    assert scheduler.schedule_name == "cosine"


@pytest.mark.parametrize(
    ("decay_style", "expected"),
    [("linear", "linear"), ("WSD", "wsd"), ("inverse-square-root", "inverse_sqrt")],
)
def test_decay_style_names_the_schedule(decay_style: str, expected: str) -> None:
    optimizer = sgd()
    scheduler = get_hyper_lr_scheduler(
        optimizer, total_steps=T, warmup_steps=W, decay_style=decay_style, lr_min=0.0
    )
    assert scheduler.schedule_name == expected
    fn = get_registry().get("lr_scheduler", expected).obj
    history = [h[0] for h in run(optimizer, scheduler, T + 3)]
    assert history == pytest.approx(
        [PEAK * fn(s, total_steps=T, warmup_steps=W) for s in range(T + 3)]
    )


def test_decay_style_and_scheduler_type_may_agree() -> None:
    for scheduler_type, decay_style in [("cosine", "cosine"), ("constant", "constant_with_warmup")]:
        scheduler = get_hyper_lr_scheduler(
            sgd(), scheduler_type, total_steps=T, decay_style=decay_style
        )
        assert scheduler.schedule_name == get_registry().get("lr_scheduler", decay_style).name


def test_lr_min_is_a_floor_relative_to_lr_for_every_group() -> None:
    optimizer = sgd(0.1, 0.01)
    scheduler = get_hyper_lr_scheduler(
        optimizer, "cosine", total_steps=T, warmup_steps=W, lr=0.02, lr_min=0.002
    )
    assert scheduler.options["min_lr_ratio"] == pytest.approx(0.1)
    for step, got in enumerate(run(optimizer, scheduler, T + 5)):
        for lr, peak in zip(got, (0.1, 0.01), strict=True):
            expected = peak * ref_cosine(step, T, W, min_lr_ratio=0.1)
            assert lr == pytest.approx(expected, rel=1e-12)
    assert lrs(optimizer) == pytest.approx([0.01, 0.001])


def test_the_defaults_decay_every_group_to_a_thousandth_of_its_peak() -> None:
    optimizer = sgd(0.1, 0.01)
    scheduler = get_hyper_lr_scheduler(optimizer, "linear", total_steps=10)
    assert scheduler.options["min_lr_ratio"] == pytest.approx(1e-7 / 1e-4)
    run(optimizer, scheduler, 12)
    assert lrs(optimizer) == pytest.approx([1e-4, 1e-5])


def test_lr_min_equal_to_lr_holds_every_group_flat() -> None:
    optimizer = sgd(0.1, 0.01)
    scheduler = get_hyper_lr_scheduler(optimizer, "linear", total_steps=10, lr=1e-3, lr_min=1e-3)
    assert [lr for step in run(optimizer, scheduler, 12) for lr in step] == pytest.approx(
        [0.1, 0.01] * 12
    )


def test_warmup_ratio_sets_warmup_steps() -> None:
    optimizer = sgd()
    scheduler = get_hyper_lr_scheduler(
        optimizer, "linear", total_steps=T, warmup_ratio=0.13, lr_min=0.0
    )
    assert scheduler.warmup_steps == 6  # int(50 * 0.13), truncated as HyperParallel does
    history = [h[0] for h in run(optimizer, scheduler, T + 2)]
    assert history == pytest.approx([PEAK * ref_linear(s, T, 6) for s in range(T + 2)])


def test_wsd_megatron_aliases_set_decay_steps_and_shape() -> None:
    optimizer = sgd()
    scheduler = get_hyper_lr_scheduler(
        optimizer,
        decay_style="WSD",
        total_steps=T,
        warmup_steps=W,
        wsd_decay_steps=15,
        lr_wsd_decay_style="cosine",
        lr_min=0.0,
    )
    assert scheduler.options["decay_steps"] == 15
    assert scheduler.options["decay_shape"] == "cosine"
    history = [h[0] for h in run(optimizer, scheduler, T + 3)]
    expected = [PEAK * ref_wsd(s, T, W, 15, "cosine") for s in range(T + 3)]
    assert history == pytest.approx(expected, rel=1e-12)


# -- bad input: a clear error, and the optimizer untouched --------------------------------------


def _snapshot(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown schedule", {"scheduler_type": "cosin"}, UnknownPluginError,
     r"Unknown LR schedule 'cosin'\. Available: .*cosine.*Did you mean 'cosine'"),
    ("unknown decay_style", {"decay_style": "cosin"}, UnknownPluginError,
     r"Unknown LR schedule 'cosin'"),
    ("unknown option", {"num_cycle": 2}, TypeError,
     r"'num_cycle' for LR schedule 'cosine'\. Did you mean 'num_cycles'\?.*"
     r"Options of LR schedule 'cosine': decay_ratio, min_lr_ratio, num_cycles, start_ratio\. "
     r"Also accepted: lr_decay_ratio, lr_min, lr_start"),
    ("misspelt factory keyword", {"warmup_step": 3}, TypeError,
     r"'warmup_step'.*Did you mean 'warmup_steps'"),
    ("misspelt wsd option", {"scheduler_type": "wsd", "decay_shap": "cosine"}, TypeError,
     r"'decay_shap' for LR schedule 'wsd'\. Did you mean 'decay_shape'.*decay_fraction, "
     r"decay_shape, decay_steps, min_lr_ratio, start_ratio"),
    ("total_steps < 1", {"total_steps": 0}, ValueError, r"total_steps must be at least 1, got 0"),
    ("float total_steps", {"total_steps": 100.0}, TypeError,
     r"total_steps must be an int, got float 100\.0"),
    ("bool total_steps", {"total_steps": True}, TypeError, r"total_steps must be an int"),
    ("negative warmup", {"warmup_steps": -1}, ValueError, r"warmup_steps must be at least 0"),
    ("float warmup", {"warmup_steps": 2.5}, TypeError, r"warmup_steps must be an int"),
    ("warmup > total", {"warmup_steps": T + 1}, ValueError,
     rf"warmup_steps={T + 1} is more than total_steps={T}"),
    ("min_lr_ratio > 1", {"min_lr_ratio": 1.5}, ValueError, r"min_lr_ratio must be in \[0, 1\]"),
    ("min_lr_ratio < 0", {"scheduler_type": "wsd", "min_lr_ratio": -0.1}, ValueError,
     r"'wsd': min_lr_ratio must be in \[0, 1\]"),
    ("min_lr_ratio a str", {"min_lr_ratio": "0.1"}, TypeError,
     r"min_lr_ratio must be a number, got str"),
    ("num_cycles 0", {"num_cycles": 0}, ValueError, r"'cosine': num_cycles must be a positive"),
    ("restarts num_cycles < 0", {"scheduler_type": "cosine_with_restarts", "num_cycles": -1},
     ValueError, r"'cosine_with_restarts': num_cycles must be a positive"),
    ("power < 0", {"scheduler_type": "polynomial", "power": -1.0}, ValueError,
     r"'polynomial': power must be a positive"),
    ("timescale 0", {"scheduler_type": "inverse_sqrt", "timescale": 0}, ValueError,
     r"'inverse_sqrt': timescale must be a positive"),
    ("decay_fraction 0", {"scheduler_type": "wsd", "decay_fraction": 0.0}, ValueError,
     r"decay_fraction must be in \(0, 1\]"),
    ("decay_fraction > 1", {"scheduler_type": "wsd", "decay_fraction": 1.5}, ValueError,
     r"decay_fraction must be in \(0, 1\]"),
    ("decay_steps too long", {"scheduler_type": "wsd", "decay_steps": T + 1}, ValueError,
     rf"decay_steps must be between 1 and total_steps = {T}"),
    ("decay_steps 0", {"scheduler_type": "wsd", "decay_steps": 0}, ValueError,
     r"decay_steps must be between 1"),
    ("decay_steps float", {"scheduler_type": "wsd", "decay_steps": 5.0}, TypeError,
     r"decay_steps must be an int"),
    ("decay_steps and decay_fraction",
     {"scheduler_type": "wsd", "decay_steps": 5, "decay_fraction": 0.2}, ValueError,
     r"give decay_steps or decay_fraction, not both"),
    ("unknown decay_shape", {"scheduler_type": "wsd", "decay_shape": "exponental"}, ValueError,
     r"unknown decay_shape 'exponental'\. Did you mean 'exponential'\?.*exponential, linear, "
     r"cosine, minus_sqrt"),
    ("decay_shape not a str", {"scheduler_type": "wsd", "decay_shape": 2}, TypeError,
     r"decay_shape must be a str"),
    ("lr_min above lr", {"lr_min": 0.05, "lr": 0.01}, ValueError,
     r"lr_min=0\.05 is above lr=0\.01; lr must be >= lr_min"),
    ("lr not positive", {"lr": 0.0}, ValueError, r"lr must be > 0"),
    ("lr_min negative", {"lr_min": -1e-4}, ValueError, r"lr_min must be a finite number >= 0"),
    ("lr_min a str", {"lr_min": "1e-4"}, TypeError, r"lr_min must be a number"),
    ("lr_min and min_lr_ratio", {"lr_min": 1e-5, "min_lr_ratio": 0.1}, ValueError,
     r"Give lr_min or min_lr_ratio, not both"),
    ("lr_min without min_lr_ratio", {"scheduler_type": "inverse_sqrt", "lr_min": 1e-5}, TypeError,
     r"lr_min sets the option 'min_lr_ratio', which LR schedule 'inverse_sqrt' does not have"),
    ("lr_start negative", {"lr_start": -1.0}, ValueError, r"lr_start must be a finite number >= 0"),
    ("warmup_ratio > 1", {"warmup_steps": 0, "warmup_ratio": 1.5}, ValueError,
     r"warmup_ratio must be in \[0, 1\]"),
    ("warmup_ratio and warmup_steps", {"warmup_ratio": 0.1}, ValueError,
     r"Give warmup_steps or warmup_ratio, not both"),
    ("warmup_ratio a str", {"warmup_steps": 0, "warmup_ratio": "0.1"}, TypeError,
     r"warmup_ratio must be a number"),
    ("decay_style conflict", {"scheduler_type": "cosine", "decay_style": "linear"}, ValueError,
     r"scheduler_type='cosine' and decay_style='linear' name different LR schedules"),
    ("wsd_decay_steps on polynomial", {"scheduler_type": "polynomial", "wsd_decay_steps": 5},
     TypeError, r"wsd_decay_steps sets the option 'decay_steps', which LR schedule 'polynomial' "
     r"does not have"),
    ("lr_wsd_decay_style on inverse_sqrt",
     {"scheduler_type": "inverse_sqrt", "lr_wsd_decay_style": "cosine"},
     TypeError, r"lr_wsd_decay_style sets the option 'decay_shape'"),
    ("wsd_decay_steps and decay_steps",
     {"scheduler_type": "wsd", "wsd_decay_steps": 5, "decay_steps": 6}, ValueError,
     r"Give wsd_decay_steps or decay_steps, not both"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [pytest.param(kw, err, m, id=case) for case, kw, err, m in BAD_CALLS],
)
def test_bad_input_is_a_clear_error_and_leaves_the_optimizer_alone(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    optimizer = sgd(0.1, 0.01)
    before = _snapshot(optimizer)
    call = {"total_steps": T, "warmup_steps": W, **kwargs}
    with pytest.raises(error, match=match):
        get_hyper_lr_scheduler(optimizer, **call)
    assert _snapshot(optimizer) == before  # lrs unchanged, no initial_lr added
    assert not hasattr(optimizer.step, "_wrapped_by_lr_sched")


def test_not_an_optimizer_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        get_hyper_lr_scheduler([torch.zeros(2)], total_steps=T)  # type: ignore[arg-type]


def test_step_counts_in_the_class_options_are_rejected() -> None:
    with pytest.raises(TypeError, match="total_steps is an argument of the scheduler itself"):
        HyperLRScheduler(sgd(), "cosine", total_steps=T, options={"total_steps": 3})


# -- state_dict -----------------------------------------------------------------------------------


def _plain(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@pytest.mark.parametrize(
    ("name", "options"),
    [(name, {}) for name in BUILTINS]
    + [
        ("wsd", {"decay_steps": 20, "decay_shape": "minus_sqrt", "lr_min": 1e-5}),
        ("cosine", {"lr_min": 1e-5, "num_cycles": 0.4, "lr_start": 1e-5, "lr_decay_ratio": 0.8}),
    ],
)
def test_state_dict_round_trip_continues_with_identical_lrs(
    name: str, options: dict[str, Any]
) -> None:
    optimizer = sgd(0.1, 0.01)
    scheduler = get_hyper_lr_scheduler(optimizer, name, total_steps=T, warmup_steps=W, **options)
    run(optimizer, scheduler, 23)
    state = scheduler.state_dict()
    assert _plain(state), state
    assert not any(callable(v) for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = run(optimizer, scheduler, T - 23 + 5)

    fresh = sgd(0.1, 0.01)
    resumed = get_hyper_lr_scheduler(fresh, name, total_steps=T, warmup_steps=W, **options)
    resumed.load_state_dict(loaded)
    assert resumed.last_epoch == 23
    assert run(fresh, resumed, T - 23 + 5) == expected


def test_state_dict_holds_the_schedule_by_name_and_resolved_options() -> None:
    scheduler = get_hyper_lr_scheduler(
        sgd(), "wsd", total_steps=T, warmup_steps=W, lr_wsd_decay_style="cosine"
    )
    state = scheduler.state_dict()
    assert state["schedule"] == "wsd"
    assert state["options"] == {
        "decay_fraction": None,
        "decay_steps": None,
        "decay_shape": "cosine",
        "min_lr_ratio": pytest.approx(1e-3),
        "start_ratio": 0.0,
    }
    assert (state["total_steps"], state["warmup_steps"]) == (T, W)


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"scheduler_type": "linear"}, r"schedule: saved 'cosine', here 'linear'"),
        ({"total_steps": T + 1}, rf"total_steps: saved {T}, here {T + 1}"),
        ({"warmup_steps": 0}, rf"warmup_steps: saved {W}, here 0"),
        ({"num_cycles": 1.0}, r"options: saved .*'num_cycles': 0\.5.*here .*'num_cycles': 1\.0"),
        (
            {"lr_min": 1e-5},
            r"options: saved .*'min_lr_ratio': 0\.000999.*here .*'min_lr_ratio': 0\.1",
        ),
    ],
)
def test_loading_a_state_saved_for_another_configuration_fails(
    other: dict[str, Any], match: str
) -> None:
    optimizer = sgd()
    scheduler = get_hyper_lr_scheduler(optimizer, "cosine", total_steps=T, warmup_steps=W)
    run(optimizer, scheduler, 5)
    state = scheduler.state_dict()
    fresh = sgd()
    kwargs: dict[str, Any] = {"scheduler_type": "cosine", "total_steps": T, "warmup_steps": W}
    resumed = get_hyper_lr_scheduler(fresh, **{**kwargs, **other})
    before = (resumed.last_epoch, lrs(fresh))
    with pytest.raises(ValueError, match="Cannot load this LR scheduler state.*" + match):
        resumed.load_state_dict(state)
    assert (resumed.last_epoch, lrs(fresh)) == before


def test_loading_something_else_fails_clearly() -> None:
    scheduler = get_hyper_lr_scheduler(sgd(), total_steps=T)
    torch_state = torch.optim.lr_scheduler.StepLR(sgd(), step_size=2).state_dict()
    with pytest.raises(ValueError, match="Not a HyperLRScheduler state_dict: missing schedule"):
        scheduler.load_state_dict(torch_state)
    state = scheduler.state_dict()
    two_groups = get_hyper_lr_scheduler(sgd(0.1, 0.2), total_steps=T)
    with pytest.raises(ValueError, match="saved LR scheduler state has 1 param groups"):
        two_groups.load_state_dict(copy.deepcopy(state))


# -- a third-party schedule ---------------------------------------------------------------------


def step_decay(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    gamma: float = 0.5,
    every: int = 10,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiply the lr by ``gamma`` every ``every`` steps after warmup."""
    if step < warmup_steps:
        return step / warmup_steps
    return max(min_lr_ratio, gamma ** ((min(step, total_steps) - warmup_steps) // every))


def _plugin(name: str, register_schedules: Callable[[Any], None]) -> types.ModuleType:
    plugin = types.ModuleType(name)
    plugin.hyper_parallel_register_lr_schedulers = hookimpl(register_schedules)  # type: ignore[attr-defined]
    return plugin


def test_third_party_schedule_is_selected_by_name_with_its_options() -> None:
    def hyper_parallel_register_lr_schedulers(register: Any) -> None:
        register("step_decay", step_decay, aliases=("multistep",))

    name = register_plugin(
        _plugin("test_schedules_thirdparty", hyper_parallel_register_lr_schedulers),
        name="test_schedules_thirdparty",
    )
    try:
        entry = get_registry().get("lr_scheduler", "Step-Decay")
        assert entry.plugin == name and entry.obj is step_decay
        optimizer = sgd(0.1, 0.01)
        scheduler = get_hyper_lr_scheduler(
            optimizer, "multistep", total_steps=40, warmup_steps=2, gamma=0.1, every=5, lr_min=0
        )
        assert scheduler.schedule_name == "step_decay"
        assert scheduler.options == {"gamma": 0.1, "every": 5, "min_lr_ratio": 0.0}
        for step, (a, b) in enumerate(run(optimizer, scheduler, 45)):
            factor = step_decay(step, total_steps=40, warmup_steps=2, gamma=0.1, every=5)
            assert (a, b) == pytest.approx((0.1 * factor, 0.01 * factor))

        with pytest.raises(TypeError, match=r"'evry' for LR schedule 'step_decay'.*'every'"):
            get_hyper_lr_scheduler(optimizer, "step_decay", total_steps=40, evry=2)

        # an option named min_lr_ratio makes lr_min work for a third party's schedule too
        floored = sgd(0.1, 0.01)
        scheduler = get_hyper_lr_scheduler(
            floored, "step_decay", total_steps=40, gamma=0.01, lr_min=1e-5
        )
        run(floored, scheduler, 41)
        assert lrs(floored) == pytest.approx([0.01, 0.001])
    finally:
        unregister_plugin(name)
    with pytest.raises(UnknownPluginError, match="Unknown LR schedule 'step_decay'"):
        get_hyper_lr_scheduler(sgd(), "step_decay", total_steps=T)


def test_a_schedule_returning_a_bad_value_fails_before_touching_the_optimizer() -> None:
    def hyper_parallel_register_lr_schedulers(register: Any) -> None:
        register("broken_schedule", lambda step, *, total_steps, warmup_steps: float("nan"))

    name = register_plugin(
        _plugin("test_schedules_broken", hyper_parallel_register_lr_schedulers),
        name="test_schedules_broken",
    )
    try:
        optimizer = sgd()
        before = _snapshot(optimizer)
        with pytest.raises(ValueError, match="'broken_schedule' returned nan at step 0"):
            get_hyper_lr_scheduler(optimizer, "broken_schedule", total_steps=T)
        assert _snapshot(optimizer) == before
    finally:
        unregister_plugin(name)


# -- HyperParallel's scheduler ------------------------------------------------------------------


def hp_factor(
    n: int,
    *,
    style: str,
    total: int,
    warmup: int = 0,
    lr: float = 1e-4,
    lr_min: float = 1e-7,
    lr_start: float = 0.0,
    lr_decay_ratio: float = 1.0,
    wsd_decay_steps: int | None = None,
    lr_wsd_decay_style: str = "exponential",
) -> float:
    """HyperParallel's OptimizerParamScheduler: the factor on each group's peak at step ``n``."""
    r = lr_min / lr if lr > 0 else 0.0
    if warmup > 0 and n < warmup:
        return (lr_start + (lr - lr_start) * (float(n) / float(warmup))) / lr
    if style == "constant":
        return 1.0
    if style == "WSD":
        if n > total:
            return r
        anneal = total - (wsd_decay_steps or 0)
        if n <= anneal:
            return 1.0
        x = float(n - anneal) / float(wsd_decay_steps or 1)
        coeff = {
            "linear": 1.0 - x,
            "cosine": 0.5 * (math.cos(math.pi * x) + 1.0),
            "exponential": 2.0 * (0.5**x) - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(x),
        }[lr_wsd_decay_style]
        return max(0.0, coeff) * (1 - r) + r
    end = int(total * lr_decay_ratio)
    if n > end:
        return r
    d = max(0.0, min(1.0, float(n - warmup) / float(max(1, end - warmup))))
    if style == "linear":
        return max(r, 1.0 - d)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * d)) * (1 - r) + r)


HP_KEYWORDS = {
    "lr": 3e-4,
    "lr_min": 3e-6,
    "lr_start": 1e-5,
    "lr_decay_ratio": 0.8,
    "wsd_decay_steps": 12,
    "lr_wsd_decay_style": "cosine",
}


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD"])
@pytest.mark.parametrize(
    "keywords",
    [
        {"warmup_steps": 7},  # the defaults (WSD needs its decay length)
        {"warmup_ratio": 0.13, **HP_KEYWORDS},
        {
            "warmup_steps": 5,
            **HP_KEYWORDS,
            "lr_wsd_decay_style": "minus_sqrt",
            "lr_decay_ratio": 1.0,
        },
        {"warmup_steps": 0, **HP_KEYWORDS, "lr_wsd_decay_style": "exponential"},
        {"warmup_steps": 5, **HP_KEYWORDS, "lr_wsd_decay_style": "linear"},
    ],
    ids=["defaults", "all_keywords", "minus_sqrt", "no_warmup", "linear_wsd"],
)
def test_get_hyper_lr_scheduler_gives_hyper_parallels_lr_sequence(
    style: str, keywords: dict[str, Any]
) -> None:
    from hyper_parallel.core.optimizer import ChainedOptimizer

    keywords = dict(keywords)
    if style == "WSD":
        keywords.setdefault("wsd_decay_steps", 10)
    total = 60
    muon, adamw = sgd(0.02), sgd(3e-4, 1e-3)
    chained = ChainedOptimizer({"adamw": adamw, "muon": muon})
    scheduler = get_hyper_lr_scheduler(
        optimizer=chained, decay_style=style, total_steps=total, **keywords
    )
    warmup = keywords.pop("warmup_steps", None)
    if warmup is None:
        warmup = int(total * keywords.pop("warmup_ratio"))
    peaks = [0.02, 3e-4, 1e-3]
    for n in range(total + 5):
        factor = hp_factor(n, style=style, total=total, warmup=warmup, **keywords)
        got = [g["lr"] for g in muon.param_groups + adamw.param_groups]
        assert got == pytest.approx([p * factor for p in peaks], rel=1e-9, abs=0), n
        chained.step()
        scheduler.step()
