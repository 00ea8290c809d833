"""The ``step_decay`` LR schedule: warm up, then multiply the lr by ``gamma`` every few steps.

A schedule follows the contract of
:func:`hyper_parallel.core.plugin.hookspecs.hyper_parallel_register_lr_schedulers`:
``fn(step, *, total_steps, warmup_steps, **options) -> float`` returns the
factor on every param group's own peak lr at ``step``. Its keyword-only
parameters after ``warmup_steps`` are the options users may pass to
``get_hyper_lr_scheduler``; their defaults are the users' defaults. Having a
``min_lr_ratio`` option also lets users pass ``lr_min`` (HyperParallel's floor, relative to ``lr``).
"""

from __future__ import annotations

import numbers

__all__ = ["step_decay"]


def _number(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"LR schedule 'step_decay': {option} must be a number, got "
            f"{type(value).__name__} {value!r}."
        )
    return float(value)


def step_decay(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    gamma: float = 0.5,
    every: int = 10,
    min_lr_ratio: float = 0.0,
) -> float:
    """Warm up linearly, then decay by ``gamma`` every ``every`` steps.

    With ``s = min(step, total_steps)``, ``W = warmup_steps`` and
    ``r = min_lr_ratio``, the factor is ``s / W`` during warmup and then
    ``r + (1 - r) * gamma ** ((s - W) // every)``: a staircase from the peak
    towards ``r`` times the peak, held from ``total_steps`` on. ``every=1``
    is a plain exponential decay.

    Args:
        step: The step (0-based; 0 is the lr before the first optimizer step).
        total_steps: Where the factor stops changing.
        warmup_steps: Length of the linear warmup from 0.
        gamma: Factor applied at each decay, in ``(0, 1]``.
        every: Steps between decays, a positive int.
        min_lr_ratio: The floor the decay approaches, as a fraction of each
            group's peak lr, in ``[0, 1]``.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option out of range.
    """
    # Checked on every call (cheap), so hyper_parallel's probe reports a bad
    # value when the scheduler is built, before the optimizer is touched.
    factor = _number("gamma", gamma)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"LR schedule 'step_decay': gamma must be in (0, 1], got {gamma!r}.")
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
        raise TypeError(
            f"LR schedule 'step_decay': every must be an int (steps between decays), got "
            f"{type(every).__name__} {every!r}."
        )
    if every < 1:
        raise ValueError(f"LR schedule 'step_decay': every must be at least 1, got {every}.")
    floor = _number("min_lr_ratio", min_lr_ratio)
    if not 0.0 <= floor <= 1.0:
        raise ValueError(
            f"LR schedule 'step_decay': min_lr_ratio must be in [0, 1] (the floor as a "
            f"fraction of each group's peak lr), got {min_lr_ratio!r}."
        )

    if step < warmup_steps:
        return step / warmup_steps
    decays = (min(step, total_steps) - warmup_steps) // int(every)
    return floor + (1.0 - floor) * factor**decays
