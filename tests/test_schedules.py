"""Built-in LR schedules and ``get_hyper_lr_scheduler``.

Numbers are checked against formulas written out here and against Hugging
Face ``transformers``' schedulers; errors by type and message, with the
optimizer untouched; state after a round trip; a third-party schedule.
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

from hyper_parallel import (
    UnknownPluginError,
    get_registry,
    hookimpl,
    register_plugin,
    unregister_plugin,
)
from hyper_parallel.core.optimizer import HyperLRScheduler, get_hyper_lr_scheduler

T, W = 50, 10
PEAK = 0.1
BUILTINS = (
    "constant",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "wsd",
)


def sgd(*peaks: float) -> torch.optim.SGD:
    """One SGD with a param group per peak lr."""
    peaks = peaks or (PEAK,)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in peaks]
    return torch.optim.SGD(groups, lr=peaks[0])  # HF's polynomial reads defaults["lr"]


def lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def run(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[list[float]]:
    """The groups' lrs at steps 0..steps-1 (optimizer.step before scheduler.step, as torch wants)."""
    out = []
    for _ in range(steps):
        out.append(lrs(optimizer))
        optimizer.step()
        scheduler.step()
    return out


# -- reference formulas, written independently of the plugin --------------------------------


def _p(s: int, t: int, w: int) -> float:
    return 1.0 if s > t else min(1.0, max(0.0, (s - w) / max(1, t - w)))


def ref_constant(s: int, t: int, w: int) -> float:
    return s / w if s < w else 1.0


def ref_linear(
    s: int, t: int, w: int, min_lr_ratio: float = 0.0, decay_ratio: float = 1.0
) -> float:
    if s < w:
        return s / w
    return max(min_lr_ratio, 1 - _p(s, int(t * decay_ratio), w))  # clipped, as HyperParallel's


def ref_cosine(
    s: int,
    t: int,
    w: int,
    num_cycles: float = 0.5,
    min_lr_ratio: float = 0.0,
    decay_ratio: float = 1.0,
) -> float:
    if s < w:
        return s / w
    wave = (1 + math.cos(2 * math.pi * num_cycles * _p(s, int(t * decay_ratio), w))) / 2
    return min_lr_ratio + (1 - min_lr_ratio) * wave


def ref_restarts(s: int, t: int, w: int, num_cycles: float = 1, min_lr_ratio: float = 0.0) -> float:
    if s < w:
        return s / w
    p = _p(s, t, w)
    wave = 0.0 if p >= 1 else (1 + math.cos(math.pi * math.fmod(num_cycles * p, 1.0))) / 2
    return min_lr_ratio + (1 - min_lr_ratio) * wave


def ref_polynomial(s: int, t: int, w: int, power: float = 1.0, min_lr_ratio: float = 0.0) -> float:
    if s < w:
        return s / w
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - _p(s, t, w)) ** power


def ref_inverse_sqrt(s: int, t: int, w: int, timescale: float | None = None) -> float:
    if s < w:
        return s / w
    tau = timescale if timescale is not None else (w if w else 10_000)
    return (tau / (min(s, t) - w + tau)) ** 0.5


def ref_wsd(
    s: int,
    t: int,
    w: int,
    decay_steps: int,
    decay_shape: str = "exponential",
    min_lr_ratio: float = 0.0,
) -> float:
    if s < w:
        return s / w
    if s < t - decay_steps:
        return 1.0
    p = 1.0 if s >= t else (s - (t - decay_steps)) / decay_steps
    decay = {
        "linear": 1 - p,
        "cosine": (1 + math.cos(math.pi * p)) / 2,
        "exponential": 2 * 0.5**p - 1,
        "minus_sqrt": 1 - p**0.5,
    }[decay_shape]
    return min_lr_ratio + (1 - min_lr_ratio) * decay


# (name, options given, reference)
FORMULA_CASES: list[tuple[str, dict[str, Any], Callable[..., float]]] = [
    ("constant", {}, ref_constant),
    ("constant_with_warmup", {}, ref_constant),
    ("linear", {}, ref_linear),
    ("linear", {"min_lr_ratio": 0.2}, ref_linear),
    ("linear", {"min_lr_ratio": 0.1, "decay_ratio": 0.6}, ref_linear),
    ("cosine", {}, ref_cosine),
    ("cosine", {"num_cycles": 1.5, "min_lr_ratio": 0.1}, ref_cosine),
    ("cosine", {"min_lr_ratio": 0.1, "decay_ratio": 0.7}, ref_cosine),
    ("cosine_with_restarts", {}, ref_restarts),
    ("cosine_with_restarts", {"num_cycles": 3, "min_lr_ratio": 0.05}, ref_restarts),
    ("polynomial", {}, ref_polynomial),
    ("polynomial", {"power": 2.0, "min_lr_ratio": 0.3}, ref_polynomial),
    ("inverse_sqrt", {}, ref_inverse_sqrt),
    ("inverse_sqrt", {"timescale": 4}, ref_inverse_sqrt),
    ("wsd", {}, ref_wsd),
    ("wsd", {"decay_fraction": 0.5}, ref_wsd),
    ("wsd", {"decay_steps": 15, "decay_shape": "cosine"}, ref_wsd),
    ("wsd", {"decay_steps": 15, "decay_shape": "linear", "min_lr_ratio": 0.1}, ref_wsd),
    ("wsd", {"decay_steps": 12, "decay_shape": "minus_sqrt"}, ref_wsd),
    ("wsd", {"decay_steps": 12, "decay_shape": "1-sqrt", "min_lr_ratio": 0.3}, ref_wsd),
]


def _reference_kwargs(
    name: str, options: dict[str, Any], total: int, warmup: int
) -> dict[str, Any]:
    """The reference's arguments: wsd's window in steps (a fraction is of the post-warmup steps)."""
    kwargs = dict(options)
    if name == "wsd":
        fraction = kwargs.pop("decay_fraction", 0.1)
        kwargs.setdefault("decay_steps", max(1, round(fraction * (total - warmup))))
        if kwargs.get("decay_shape") == "1-sqrt":
            kwargs["decay_shape"] = "minus_sqrt"
    return kwargs


@pytest.mark.parametrize(("name", "options", "reference"), FORMULA_CASES)
@pytest.mark.parametrize(("total", "warmup"), [(T, W), (37, 0)])
def test_schedule_matches_its_formula(
    name: str,
    options: dict[str, Any],
    reference: Callable[..., float],
    total: int,
    warmup: int,
) -> None:
    steps = list(range(total + 11))  # warmup, the boundaries W and T, and past T
    assert len(steps) >= 20 and warmup in steps and total in steps and total + 10 in steps
    fn = get_registry().get("lr_scheduler", name).obj
    kwargs = _reference_kwargs(name, options, total, warmup)
    expected = [reference(s, total, warmup, **kwargs) for s in steps]
    got = [fn(s, total_steps=total, warmup_steps=warmup, **options) for s in steps]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-14)

    # the same numbers reach every group through the scheduler, each from its own peak
    optimizer = sgd(PEAK, 0.003)
    scheduler = get_hyper_lr_scheduler(
        optimizer, name, total_steps=total, warmup_steps=warmup, lr_min=0.0, **options
    )
    history = run(optimizer, scheduler, len(steps))
    assert [h[0] for h in history] == pytest.approx([PEAK * e for e in expected], rel=1e-12)
    assert [h[1] for h in history] == pytest.approx([0.003 * e for e in expected], rel=1e-12)


def test_every_builtin_is_registered_with_its_aliases() -> None:
    registry = get_registry()
    assert set(BUILTINS) <= set(registry.names("lr_scheduler"))
    for alias, name in [
        ("constant_with_warmup", "constant"),
        ("Cosine-With-Restarts", "cosine_with_restarts"),
        ("inverse-square-root", "inverse_sqrt"),  # Megatron-LM's spelling
        ("WSD", "wsd"),
        ("warmup_stable_decay", "wsd"),
    ]:
        assert registry.get("lr_scheduler", alias).name == name
        assert registry.get("lr_scheduler", name).plugin == "schedules"


def test_warmup_equal_to_total_reaches_the_peak_then_the_final_value() -> None:
    # HyperParallel's rule: the decay ends after total_steps, so step total_steps is the peak.
    for name, final, at_end in [
        ("linear", 0.0, 1.0), ("cosine", 0.25, 1.0), ("wsd", 0.25, 0.25), ("constant", 1.0, 1.0),
    ]:  # fmt: skip
        options = {} if name == "constant" else {"min_lr_ratio": final}
        optimizer = sgd()
        scheduler = get_hyper_lr_scheduler(
            optimizer, name, total_steps=8, warmup_steps=8, **options
        )
        history = [h[0] for h in run(optimizer, scheduler, 12)]
        assert history[:8] == pytest.approx([PEAK * s / 8 for s in range(8)])
        assert history[8] == pytest.approx(PEAK * at_end)
        assert history[9:] == pytest.approx([PEAK * final] * 3)


# -- Hugging Face transformers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf() -> Any:
    return pytest.importorskip("transformers.optimization")


def _hf_case(
    hf: Any, name: str
) -> tuple[Callable[[torch.optim.Optimizer], Any], str, dict[str, Any], int, int]:
    """HF factory, our name and options, and the steps (0..last) both define alike."""
    cases: dict[
        str, tuple[Callable[[torch.optim.Optimizer], Any], str, dict[str, Any], int, int]
    ] = {
        "constant": (lambda o: hf.get_constant_schedule(o), "constant", {}, 0, T + 10),
        "constant_with_warmup": (
            lambda o: hf.get_constant_schedule_with_warmup(o, W),
            "constant_with_warmup",
            {},
            W,
            T + 10,
        ),
        "linear": (lambda o: hf.get_linear_schedule_with_warmup(o, W, T), "linear", {}, W, T + 10),
        # HF's cosine keeps waving after T; ours holds the final value, so compare up to T
        "cosine": (lambda o: hf.get_cosine_schedule_with_warmup(o, W, T), "cosine", {}, W, T),
        "cosine_quarter": (
            lambda o: hf.get_cosine_schedule_with_warmup(o, W, T, num_cycles=0.25),
            "cosine",
            {"num_cycles": 0.25},
            W,
            T,
        ),
        "cosine_with_min_lr": (
            lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup(o, W, T, min_lr_rate=0.1),
            "cosine",
            {"min_lr_ratio": 0.1},
            W,
            T,
        ),
        "cosine_with_restarts": (
            lambda o: hf.get_cosine_with_hard_restarts_schedule_with_warmup(o, W, T, num_cycles=3),
            "cosine_with_restarts",
            {"num_cycles": 3},
            W,
            T + 10,
        ),
        "polynomial": (
            lambda o: hf.get_polynomial_decay_schedule_with_warmup(
                o, W, T, lr_end=0.2 * PEAK, power=2.0
            ),
            "polynomial",
            {"min_lr_ratio": 0.2, "power": 2.0},
            W,
            T + 10,
        ),
        "polynomial_default": (
            lambda o: hf.get_polynomial_decay_schedule_with_warmup(o, W, T),
            "polynomial",
            {"min_lr_ratio": 1e-7 / PEAK},
            W,
            T + 10,
        ),
        # HF's inverse_sqrt has no end; ours holds its value from T on
        "inverse_sqrt": (lambda o: hf.get_inverse_sqrt_schedule(o, W), "inverse_sqrt", {}, W, T),
        "inverse_sqrt_timescale": (
            lambda o: hf.get_inverse_sqrt_schedule(o, W, timescale=7),
            "inverse_sqrt",
            {"timescale": 7},
            W,
            T,
        ),
        "inverse_sqrt_no_warmup": (
            lambda o: hf.get_inverse_sqrt_schedule(o, 0),
            "inverse_sqrt",
            {},
            0,
            T,
        ),
    }
    for hf_type, ours in [("linear", "linear"), ("cosine", "cosine"), ("1-sqrt", "minus_sqrt")]:
        cases[f"wsd_{ours}"] = (
            lambda o, d=hf_type: hf.get_wsd_schedule(
                o, W, num_decay_steps=15, num_training_steps=T, decay_type=d
            ),
            "wsd",
            {"decay_steps": 15, "decay_shape": ours},
            W,
            T + 10,
        )
        # HF's wsd warms up from min_lr_ratio, ours from 0 like every schedule: compare from W
        cases[f"wsd_{ours}_min_lr"] = (
            lambda o, d=hf_type: hf.get_wsd_schedule(
                o, W, num_decay_steps=15, num_training_steps=T, decay_type=d, min_lr_ratio=0.2
            ),
            "wsd",
            {"decay_steps": 15, "decay_shape": ours, "min_lr_ratio": 0.2},
            W,
            T + 10,
        )
    return cases[name]


HF_CASES = [
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_quarter",
    "cosine_with_min_lr",
    "cosine_with_restarts",
    "polynomial",
    "polynomial_default",
    "inverse_sqrt",
    "inverse_sqrt_timescale",
    "inverse_sqrt_no_warmup",
    "wsd_linear",
    "wsd_cosine",
    "wsd_minus_sqrt",
    "wsd_linear_min_lr",
    "wsd_cosine_min_lr",
    "wsd_minus_sqrt_min_lr",
]


@pytest.mark.parametrize("case", HF_CASES)
def test_matches_hugging_face(hf: Any, case: str) -> None:
    build_hf, name, options, warmup, last = _hf_case(hf, case)
    theirs_opt, ours_opt = sgd(), sgd()
    theirs = build_hf(theirs_opt)
    first = warmup if case.endswith("_min_lr") else 0  # see the wsd note in _hf_case
    ours = get_hyper_lr_scheduler(
        ours_opt, name, total_steps=T, warmup_steps=warmup, lr_min=0.0, **options
    )
    expected = [h[0] for h in run(theirs_opt, theirs, last + 1)]
    got = [h[0] for h in run(ours_opt, ours, last + 1)]
    assert len(got[first:]) >= 20
    assert got[first:] == pytest.approx(expected[first:], rel=1e-12, abs=1e-15)


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
