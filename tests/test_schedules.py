"""The built-in LR schedules (``hyper_parallel_builtins.schedules``): their names and aliases,
each against a formula written out here and against Hugging Face ``transformers``' schedulers.

The formulas and the helpers that drive a scheduler (``sgd``, ``lrs``, ``run``) are imported
by ``test_scheduler.py`` and ``test_lr_container.py`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyper_parallel import get_registry
from hyper_parallel.core.optimizer import get_hyper_lr_scheduler

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
