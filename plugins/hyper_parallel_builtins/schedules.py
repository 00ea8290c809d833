"""Built-in plugin: the LR schedules ``constant``, ``linear``, ``cosine``,
``cosine_with_restarts``, ``polynomial``, ``inverse_sqrt`` and ``wsd``.

Each schedule is a plain function following the contract in
:func:`~hyper_parallel.core.plugin.hookspecs.hyper_parallel_register_lr_schedulers`:
``fn(step, *, total_steps, warmup_steps, **options) -> float`` is the factor
applied to every param group's own peak lr at ``step``.

They share one shape, HyperParallel's. With ``s = step``, ``W = warmup_steps``
and ``T = total_steps``:

* warmup: for ``s < W`` the factor rises linearly from ``start_ratio`` (0 by
  default) to 1: ``start_ratio + (1 - start_ratio) * s / W``;
* decay: afterwards the schedule's decay of its progress, ending at ``T``
  (``linear`` and ``cosine``: at ``int(T * decay_ratio)``; ``wsd``: over its
  own last steps);
* after the end the factor stays at its final value.

Where a schedule has ``min_lr_ratio = r``, the lr ends at ``r`` times the
peak: ``cosine``, ``wsd``, ``polynomial`` and ``cosine_with_restarts`` decay
``r + (1 - r) * decay``; ``linear`` is clipped, ``max(r, 1 - p)``, as
HyperParallel's. Options are validated on every call (cheaply), so a bad
value is reported when the scheduler is built, before it touches the
optimizer.
"""

from __future__ import annotations

import math
import numbers

from hyper_parallel import hookimpl
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean
from hyper_parallel.core.plugin import RegisterFn

__all__ = [
    "constant",
    "cosine",
    "cosine_with_restarts",
    "inverse_sqrt",
    "linear",
    "polynomial",
    "wsd",
]

#: The decay shapes of ``wsd`` (``"1-sqrt"`` is accepted for ``"minus_sqrt"``).
WSD_DECAY_SHAPES: tuple[str, ...] = ("exponential", "linear", "cosine", "minus_sqrt")
_WSD_SHAPE_ALIASES = {"1_sqrt": "minus_sqrt"}
_WSD_DEFAULT_DECAY_FRACTION = 0.1
_INVERSE_SQRT_DEFAULT_TIMESCALE = 10_000


# -- option checks -----------------------------------------------------------


def _real(schedule: str, option: str, value: object) -> float:
    """``value`` as a float; ``TypeError`` naming the option when it is not a number."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise HyperParallelTypeError(
        f"LR schedule {schedule!r}: {option} must be a number, got {type(value).__name__} "
        f"{value!r}."
    )


def _check_min_lr_ratio(schedule: str, value: object) -> float:
    ratio = _real(schedule, "min_lr_ratio", value)
    if not 0.0 <= ratio <= 1.0:
        raise HyperParallelValueError(
            f"LR schedule {schedule!r}: min_lr_ratio must be in [0, 1] (the final lr as a "
            f"fraction of each group's peak lr), got {value!r}."
        )
    return ratio


def _check_non_negative(schedule: str, option: str, value: object) -> float:
    number = _real(schedule, option, value)
    if not math.isfinite(number) or number < 0:
        raise HyperParallelValueError(
            f"LR schedule {schedule!r}: {option} must be a finite number >= 0, got {value!r}."
        )
    return number


def _check_positive(schedule: str, option: str, value: object) -> float:
    number = _real(schedule, option, value)
    if not math.isfinite(number) or number <= 0:
        raise HyperParallelValueError(
            f"LR schedule {schedule!r}: {option} must be a positive number, got {value!r}."
        )
    return number


# -- shared shape ------------------------------------------------------------


def _warmup(schedule: str, step: int, warmup_steps: int, start_ratio: float) -> float | None:
    """The warmup factor while ``step < warmup_steps`` (from ``start_ratio`` to 1), else ``None``."""
    start = _check_non_negative(schedule, "start_ratio", start_ratio)
    if step >= warmup_steps:
        return None
    return start + (1.0 - start) * (step / warmup_steps)


def _decay_end(schedule: str, total_steps: int, decay_ratio: float) -> int:
    """The step the decay ends at: ``int(total_steps * decay_ratio)``, as HyperParallel's."""
    return int(total_steps * _check_non_negative(schedule, "decay_ratio", decay_ratio))


def _progress(step: int, end: int, warmup_steps: int) -> float:
    """Progress ``(s - W) / max(1, end - W)`` through the decay, clamped to ``[0, 1]``."""
    if step > end:
        return 1.0
    return min(1.0, max(0.0, (step - warmup_steps) / max(1, end - warmup_steps)))


def _floored(decay: float, min_lr_ratio: float) -> float:
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


# -- schedules ---------------------------------------------------------------


def constant(step: int, *, total_steps: int, warmup_steps: int, start_ratio: float = 0.0) -> float:
    """Warm up linearly, then hold the peak lr.

    Args:
        step: The step (0-based).
        total_steps: Unused: a constant does not end.
        warmup_steps: Length of the linear warmup.
        start_ratio: Where the warmup starts, as a fraction of the peak.
    """
    warm = _warmup("constant", step, warmup_steps, start_ratio)
    return 1.0 if warm is None else warm


def linear(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.0,
    start_ratio: float = 0.0,
    decay_ratio: float = 1.0,
) -> float:
    """Warm up linearly, then decay linearly, clipped at ``min_lr_ratio``: ``max(r, 1 - p)``.

    Args:
        step: The step (0-based).
        total_steps: The schedule's length.
        warmup_steps: Length of the linear warmup.
        min_lr_ratio: Floor as a fraction of the peak, in ``[0, 1]``.
        start_ratio: Where the warmup starts, as a fraction of the peak.
        decay_ratio: The decay ends at ``int(total_steps * decay_ratio)``.
    """
    r = _check_min_lr_ratio("linear", min_lr_ratio)
    end = _decay_end("linear", total_steps, decay_ratio)
    warm = _warmup("linear", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    return max(r, 1.0 - _progress(step, end, warmup_steps))


def cosine(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    num_cycles: float = 0.5,
    min_lr_ratio: float = 0.0,
    start_ratio: float = 0.0,
    decay_ratio: float = 1.0,
) -> float:
    """Warm up linearly, then follow a cosine to ``min_lr_ratio``.

    The decay is ``0.5 * (1 + cos(2 * pi * num_cycles * p))``; the default
    ``num_cycles=0.5`` is half a wave, from the peak down to the floor.

    Args:
        step: The step (0-based).
        total_steps: The schedule's length.
        warmup_steps: Length of the linear warmup.
        num_cycles: Number of cosine waves over the decay, positive.
        min_lr_ratio: Floor as a fraction of the peak, in ``[0, 1]``.
        start_ratio: Where the warmup starts, as a fraction of the peak.
        decay_ratio: The decay ends at ``int(total_steps * decay_ratio)``.
    """
    cycles = _check_positive("cosine", "num_cycles", num_cycles)
    r = _check_min_lr_ratio("cosine", min_lr_ratio)
    end = _decay_end("cosine", total_steps, decay_ratio)
    warm = _warmup("cosine", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    p = _progress(step, end, warmup_steps)
    return max(0.0, _floored(0.5 * (1.0 + math.cos(2.0 * math.pi * cycles * p)), r))


def cosine_with_restarts(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    num_cycles: float = 1,
    min_lr_ratio: float = 0.0,
    start_ratio: float = 0.0,
) -> float:
    """Warm up linearly, then ``num_cycles`` half-cosines, each restarting at the peak.

    Args:
        step: The step (0-based).
        total_steps: Where the last cycle ends.
        warmup_steps: Length of the linear warmup.
        num_cycles: Number of hard restarts (cycles), positive.
        min_lr_ratio: Floor as a fraction of the peak, in ``[0, 1]``.
        start_ratio: Where the warmup starts, as a fraction of the peak.
    """
    cycles = _check_positive("cosine_with_restarts", "num_cycles", num_cycles)
    r = _check_min_lr_ratio("cosine_with_restarts", min_lr_ratio)
    warm = _warmup("cosine_with_restarts", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    p = _progress(step, total_steps, warmup_steps)
    decay = 0.0 if p >= 1.0 else 0.5 * (1.0 + math.cos(math.pi * ((cycles * p) % 1.0)))
    return _floored(decay, r)


def polynomial(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    power: float = 1.0,
    min_lr_ratio: float = 0.0,
    start_ratio: float = 0.0,
) -> float:
    """Warm up linearly, then decay as ``(1 - p) ** power`` to ``min_lr_ratio``.

    Hugging Face's ``lr_end`` is ``min_lr_ratio * peak lr``.

    Args:
        step: The step (0-based).
        total_steps: Where the decay ends.
        warmup_steps: Length of the linear warmup.
        power: Exponent of the decay, positive (1.0 is linear).
        min_lr_ratio: Final lr as a fraction of the peak, in ``[0, 1]``.
        start_ratio: Where the warmup starts, as a fraction of the peak.
    """
    exponent = _check_positive("polynomial", "power", power)
    r = _check_min_lr_ratio("polynomial", min_lr_ratio)
    warm = _warmup("polynomial", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    return _floored((1.0 - _progress(step, total_steps, warmup_steps)) ** exponent, r)


def inverse_sqrt(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    timescale: float | None = None,
    start_ratio: float = 0.0,
) -> float:
    """Warm up linearly, then decay as ``1 / sqrt((s - W + timescale) / timescale)``.

    The factor is 1 at the end of warmup and held from ``total_steps`` on.

    Args:
        step: The step (0-based).
        total_steps: Where the factor stops changing.
        warmup_steps: Length of the linear warmup.
        timescale: Positive; ``None`` means ``warmup_steps``, or 10,000 without
            warmup (as in Hugging Face).
        start_ratio: Where the warmup starts, as a fraction of the peak.
    """
    if timescale is None:
        scale = float(warmup_steps or _INVERSE_SQRT_DEFAULT_TIMESCALE)
    else:
        scale = _check_positive("inverse_sqrt", "timescale", timescale)
    warm = _warmup("inverse_sqrt", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    s = min(step, total_steps)
    return 1.0 / math.sqrt((s - warmup_steps + scale) / scale)


def _wsd_shape(value: object) -> str:
    choices = f"Choose one of: {', '.join(WSD_DECAY_SHAPES)} (or '1-sqrt' for 'minus_sqrt')."
    if not isinstance(value, str):
        raise HyperParallelTypeError(
            f"LR schedule 'wsd': decay_shape must be a str, got {type(value).__name__} "
            f"{value!r}. {choices}"
        )
    key = value.strip().lower().replace("-", "_")
    key = _WSD_SHAPE_ALIASES.get(key, key)
    if key not in WSD_DECAY_SHAPES:
        raise HyperParallelValueError(
            f"LR schedule 'wsd': unknown decay_shape {value!r}."
            f"{did_you_mean(key, WSD_DECAY_SHAPES)} {choices}"
        )
    return key


def _wsd_decay_steps(
    total_steps: int, warmup_steps: int, decay_fraction: float | None, decay_steps: int | None
) -> int:
    after_warmup = total_steps - warmup_steps
    if decay_steps is not None:
        if decay_fraction is not None:
            raise HyperParallelValueError(
                f"LR schedule 'wsd': give decay_steps or decay_fraction, not both "
                f"(got decay_steps={decay_steps!r}, decay_fraction={decay_fraction!r})."
            )
        if isinstance(decay_steps, bool) or not isinstance(decay_steps, numbers.Integral):
            raise HyperParallelTypeError(
                f"LR schedule 'wsd': decay_steps must be an int, got "
                f"{type(decay_steps).__name__} {decay_steps!r}."
            )
        if not 1 <= decay_steps <= total_steps:
            raise HyperParallelValueError(
                f"LR schedule 'wsd': decay_steps must be between 1 and total_steps = "
                f"{total_steps}, got {decay_steps}."
            )
        return int(decay_steps)
    fraction = (
        _WSD_DEFAULT_DECAY_FRACTION
        if decay_fraction is None
        else _real("wsd", "decay_fraction", decay_fraction)
    )
    if not 0.0 < fraction <= 1.0:
        raise HyperParallelValueError(
            f"LR schedule 'wsd': decay_fraction must be in (0, 1] (the share of the steps "
            f"after warmup spent decaying), got {decay_fraction!r}."
        )
    return max(1, round(fraction * after_warmup)) if after_warmup > 0 else 0


def wsd(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_fraction: float | None = None,
    decay_steps: int | None = None,
    decay_shape: str = "exponential",
    min_lr_ratio: float = 0.0,
    start_ratio: float = 0.0,
) -> float:
    """Warmup-stable-decay: warm up, hold the peak, then decay over the last steps.

    The decay window is the last ``D`` steps before ``total_steps``, with ``D``
    either ``decay_steps`` or ``round(decay_fraction * (T - W))`` (at least
    one step). With ``p`` the progress through that window the decay is
    ``2 * 0.5 ** p - 1`` (exponential, HyperParallel's default, as in
    Megatron-LM), ``1 - p`` (linear), ``0.5 * (1 + cos(pi * p))`` (cosine)
    or ``1 - sqrt(p)`` (minus_sqrt).

    Args:
        step: The step (0-based).
        total_steps: Where the decay ends.
        warmup_steps: Length of the linear warmup.
        decay_fraction: Share of the steps after warmup spent decaying, in
            ``(0, 1]``; 0.1 when neither it nor ``decay_steps`` is given.
        decay_steps: Length of the decay in steps, ``1 <= D <= T`` (a window
            that reaches into the warmup starts right after it); exclusive
            with ``decay_fraction``.
        decay_shape: ``"exponential"``, ``"linear"``, ``"cosine"`` or
            ``"minus_sqrt"`` (alias ``"1-sqrt"``).
        min_lr_ratio: Final lr as a fraction of the peak, in ``[0, 1]``.
        start_ratio: Where the warmup starts, as a fraction of the peak.
    """
    shape = _wsd_shape(decay_shape)
    r = _check_min_lr_ratio("wsd", min_lr_ratio)
    window = _wsd_decay_steps(total_steps, warmup_steps, decay_fraction, decay_steps)
    warm = _warmup("wsd", step, warmup_steps, start_ratio)
    if warm is not None:
        return warm
    start = total_steps - window
    if step < start:
        return 1.0
    p = 1.0 if window == 0 or step >= total_steps else (step - start) / window
    if shape == "linear":
        decay = 1.0 - p
    elif shape == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * p))
    elif shape == "exponential":
        decay = 2.0 * 0.5**p - 1.0
    else:
        decay = 1.0 - math.sqrt(p)
    return _floored(decay, r)


@hookimpl
def hyper_parallel_register_lr_schedulers(register: RegisterFn) -> None:
    """Register the built-in LR schedules."""
    register(
        "constant",
        constant,
        description="linear warmup, then the peak lr",
        aliases=("constant_with_warmup",),
    )
    register("linear", linear, description="linear warmup, linear decay to min_lr_ratio")
    register("cosine", cosine, description="linear warmup, cosine decay to min_lr_ratio")
    register(
        "cosine_with_restarts",
        cosine_with_restarts,
        description="linear warmup, num_cycles hard-restarted cosines",
        aliases=("cosine_with_hard_restarts",),
    )
    register(
        "polynomial",
        polynomial,
        description="linear warmup, (1 - p) ** power decay to min_lr_ratio",
        aliases=("polynomial_decay",),
    )
    register(
        "inverse_sqrt",
        inverse_sqrt,
        description="linear warmup, then 1 / sqrt(step / timescale) decay",
        aliases=("inverse_square_root",),
    )
    register(
        "wsd",
        wsd,
        description="warmup-stable-decay: hold the peak, decay over the last steps",
        aliases=("warmup_stable_decay",),
    )
