"""``get_hyper_lr_scheduler``: one torch LR scheduler driven by a named schedule.

A schedule is a registered function ``fn(step, *, total_steps, warmup_steps,
**options) -> float`` (see
:func:`~hyper_parallel.core.plugin.hookspecs.hyper_parallel_register_lr_schedulers`).
:class:`HyperLRScheduler` applies its factor to every param group of any
:class:`torch.optim.Optimizer`, :class:`ChainedOptimizer` included, each group
from its own peak lr: ``lr_g(s) = initial_lr_g * factor(s)``.

Everything is checked before the optimizer is touched, so a failed call
leaves the optimizer exactly as it was. ``state_dict()`` holds only plain
numbers, strings and lists (the schedule's name and resolved options, never
the function), and ``load_state_dict`` refuses a state saved for another
schedule configuration.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hyper_parallel.core._suggest import did_you_mean
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.plugin import PluginKind, get_registry

__all__ = ["HyperLRScheduler", "get_hyper_lr_scheduler"]

_ScheduleFn = Callable[..., float]

_STEP_ARGS: Final = ("total_steps", "warmup_steps")
#: Megatron-style keywords of ``get_hyper_lr_scheduler`` -> the schedule option they set.
_OPTION_ALIASES: Final = {"wsd_decay_steps": "decay_steps", "lr_wsd_decay_style": "decay_shape"}
_LR_MIN_TARGET: Final = "min_lr_ratio"
_FACTORY_KEYWORDS: Final = ("decay_style", "scheduler_type", "warmup_ratio", *_STEP_ARGS)
_CONFIG_KEYS: Final = ("schedule", "total_steps", "warmup_steps", "options", "lr_min")
_STATE_KEYS: Final = (*_CONFIG_KEYS, "base_lrs", "last_epoch", "step_count", "last_lr")


class _DefaultScheduleName(str):
    """``"cosine"``, but told apart from a ``"cosine"`` the caller passed."""

    __slots__ = ()


_DEFAULT_SCHEDULE: Final = _DefaultScheduleName("cosine")


@dataclass(frozen=True)
class _Signature:
    """A schedule's options (name -> default, ``inspect.Parameter.empty`` if required)."""

    options: dict[str, Any]
    var_keyword: bool

    def accepts(self, option: str) -> bool:
        return option in self.options or self.var_keyword


_OPTION_KINDS: Final = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(fn: _ScheduleFn) -> _Signature:
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # after ``step``
    except (TypeError, ValueError):
        return _Signature(options={}, var_keyword=True)
    options: dict[str, Any] = {}
    var_keyword = False
    for p in params:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
        elif p.kind in _OPTION_KINDS and p.name not in _STEP_ARGS:
            options[p.name] = p.default
    return _Signature(options=options, var_keyword=var_keyword)


def _describe_options(schedule: str, sig: _Signature) -> str:
    names = sorted(sig.options) + (["**options"] if sig.var_keyword else [])
    text = f"Options of LR schedule {schedule!r}: {', '.join(names) or '(none)'}."
    extra = ["lr_min"] if _LR_MIN_TARGET in sig.options else []
    extra += [alias for alias, target in _OPTION_ALIASES.items() if target in sig.options]
    if extra:
        text += f" Also accepted: {', '.join(extra)}."
    return text


def _check_option_names(
    schedule: str, given: Mapping[str, Any], sig: _Signature, *, also: tuple[str, ...]
) -> None:
    """``TypeError`` for the first keyword in ``given`` the schedule does not take."""
    for key in given:
        if key in _STEP_ARGS:
            raise HyperParallelTypeError(
                f"{key} is an argument of the scheduler itself, not an option of LR "
                f"schedule {schedule!r}; pass it as {key}=..."
            )
        if not sig.accepts(key):
            candidates = [*sig.options, "lr_min", *_OPTION_ALIASES, *also]
            raise HyperParallelTypeError(
                f"Unknown keyword argument {key!r} for LR schedule {schedule!r}."
                f"{did_you_mean(key, candidates)} {_describe_options(schedule, sig)}"
            )


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = " Pass a whole number of steps, e.g. int(...)." if isinstance(value, float) else ""
        raise HyperParallelTypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}.{hint}"
        )
    number = int(value)
    if number < minimum:
        raise HyperParallelValueError(f"{name} must be at least {minimum}, got {number}.")
    return number


def _check_steps(total_steps: object, warmup_steps: object) -> tuple[int, int]:
    total = _check_int("total_steps", total_steps, minimum=1)
    warmup = _check_int("warmup_steps", warmup_steps, minimum=0)
    if warmup > total:
        raise HyperParallelValueError(
            f"warmup_steps={warmup} is more than total_steps={total}; the warmup is part of "
            f"the total, so lower warmup_steps or raise total_steps."
        )
    return total, warmup


def _peak_lr(group: Mapping[str, Any], index: int) -> float:
    # torch's LRScheduler keeps an ``initial_lr`` already in the group; so do we.
    value = group.get("initial_lr", group.get("lr"))
    if isinstance(value, Tensor):
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HyperParallelTypeError(
            f"param group {index} has lr {value!r}; a scheduler needs a number (or a tensor)."
        )
    return float(value)


def _check_lr_min(lr_min: object) -> float:
    if isinstance(lr_min, bool) or not isinstance(lr_min, numbers.Real):
        raise HyperParallelTypeError(
            f"lr_min must be a number, got {type(lr_min).__name__} {lr_min!r}."
        )
    value = float(lr_min)
    if not math.isfinite(value) or value < 0:
        raise HyperParallelValueError(f"lr_min must be a finite number >= 0, got {lr_min!r}.")
    return value


def _group_options(
    options: Mapping[str, Any], lr_min: float | None, peaks: list[float]
) -> list[dict[str, Any]]:
    """Each group's options: ``lr_min`` becomes that group's own ``min_lr_ratio``."""
    if lr_min is None:
        return [dict(options) for _ in peaks]
    groups = []
    for index, peak in enumerate(peaks):
        if lr_min > peak:
            raise HyperParallelValueError(
                f"lr_min={lr_min!r} is above the peak lr {peak!r} of param group {index}; "
                f"lr_min is an absolute floor and must not exceed any group's lr (smallest: "
                f"{min(peaks)!r}). Lower it, or use min_lr_ratio for a fraction of each peak."
            )
        ratio = lr_min / peak if peak > 0 else 0.0
        groups.append({**options, _LR_MIN_TARGET: min(ratio, 1.0)})
    return groups


def _probe(
    schedule: str,
    fn: _ScheduleFn,
    total_steps: int,
    warmup_steps: int,
    groups: list[dict[str, Any]],
) -> None:
    """Call the schedule at a few steps, so bad options fail before the optimizer changes."""
    steps = sorted(
        {0, warmup_steps, (warmup_steps + total_steps) // 2, total_steps, total_steps + 1}
    )
    tried: list[dict[str, Any]] = []
    for options in groups:
        if options in tried:
            continue
        tried.append(options)
        for step in steps:
            value = fn(step, total_steps=total_steps, warmup_steps=warmup_steps, **options)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(float(value))
                or value < 0
            ):
                raise HyperParallelValueError(
                    f"LR schedule {schedule!r} returned {value!r} at step {step}; a schedule "
                    f"must return a finite float >= 0 (the factor on each group's peak lr)."
                )


def _set_lr(group: dict[str, Any], lr: float | Tensor) -> None:
    if isinstance(group["lr"], Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


class HyperLRScheduler(LRScheduler):
    """A torch LR scheduler that follows a registered schedule over every param group.

    Each group follows ``lr_g(s) = initial_lr_g * factor(s)`` where
    ``factor`` is the schedule's function and ``initial_lr_g`` the group's
    peak lr (its ``lr`` when the scheduler is built, as torch's
    :class:`~torch.optim.lr_scheduler.LRScheduler` records it). Usually built
    with :func:`get_hyper_lr_scheduler`, which also takes HyperParallel /
    Megatron keyword aliases.

    Args:
        optimizer: Any :class:`torch.optim.Optimizer`, including
            :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`.
        schedule: A registered schedule name (case-insensitive, ``-`` = ``_``).
        total_steps: Steps the schedule spans, at least 1; after it the lr
            stays at the schedule's final value.
        warmup_steps: Steps of linear warmup from 0, ``0 <= W <= total_steps``.
        lr_min: An absolute lr floor for schedules with a ``min_lr_ratio``
            option: each group gets ``min_lr_ratio = lr_min / initial_lr_g``,
            so ``lr_g = lr_min + (initial_lr_g - lr_min) * decay``. Exclusive
            with ``min_lr_ratio``.
        options: The schedule's own options (its keyword-only parameters).

    Attributes:
        schedule_name: The canonical registry name of the schedule.
        total_steps: As given.
        warmup_steps: As given.
        options: The resolved options, defaults included (without the
            per-group ``min_lr_ratio`` that ``lr_min`` implies).
        lr_min: As given.

    Raises:
        UnknownPluginError: no schedule of that name is registered.
        TypeError: an option the schedule does not take (with a hint), or an
            argument of the wrong type.
        ValueError: a value out of range (steps, ``lr_min``, or the
            schedule's own checks).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: str = "cosine",
        *,
        total_steps: int,
        warmup_steps: int = 0,
        lr_min: float | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise HyperParallelTypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        total, warmup = _check_steps(total_steps, warmup_steps)
        entry = get_registry().get(PluginKind.LR_SCHEDULER, schedule)
        fn: _ScheduleFn = entry.obj
        sig = _signature(fn)
        given = dict(options or {})
        _check_option_names(entry.name, given, sig, also=())
        missing = [
            n for n, d in sig.options.items() if d is inspect.Parameter.empty and n not in given
        ]
        if missing:
            raise HyperParallelTypeError(
                f"LR schedule {entry.name!r} needs the option(s) {', '.join(missing)}. "
                f"{_describe_options(entry.name, sig)}"
            )
        resolved = {
            **{n: d for n, d in sig.options.items() if d is not inspect.Parameter.empty},
            **given,
        }
        floor: float | None = None
        if lr_min is not None:
            if _LR_MIN_TARGET not in sig.options:
                raise HyperParallelTypeError(
                    f"lr_min sets {_LR_MIN_TARGET}, which LR schedule {entry.name!r} does not "
                    f"have. {_describe_options(entry.name, sig)}"
                )
            if _LR_MIN_TARGET in given:
                raise HyperParallelValueError(
                    f"Give lr_min (an absolute floor) or min_lr_ratio (a fraction of each "
                    f"group's peak), not both (got lr_min={lr_min!r}, "
                    f"min_lr_ratio={given[_LR_MIN_TARGET]!r})."
                )
            floor = _check_lr_min(lr_min)
            resolved.pop(_LR_MIN_TARGET)
        peaks = [_peak_lr(g, i) for i, g in enumerate(optimizer.param_groups)]
        groups = _group_options(resolved, floor, peaks)
        _probe(entry.name, fn, total, warmup, groups)

        self.schedule_name = entry.name
        self.total_steps = total
        self.warmup_steps = warmup
        self.options: dict[str, Any] = resolved
        self.lr_min = floor
        self._schedule_fn = fn
        self._group_options = groups
        super().__init__(optimizer)

    def _factor(self, step: int, options: Mapping[str, Any]) -> float:
        return float(
            self._schedule_fn(
                step, total_steps=self.total_steps, warmup_steps=self.warmup_steps, **options
            )
        )

    def get_lr(self) -> list[float | Tensor]:
        """The lr of every param group at ``last_epoch``: its peak times the factor."""
        return [
            base * self._factor(self.last_epoch, options)
            for base, options in zip(self.base_lrs, self._group_options, strict=True)
        ]

    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """The position and configuration, as plain numbers, strings and lists.

        Holds the schedule's name and resolved options, never the function,
        so it loads with ``torch.load(..., weights_only=True)``.
        """
        return {
            "schedule": self.schedule_name,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "options": copy.deepcopy(self.options),
            "lr_min": self.lr_min,
            "base_lrs": [float(b) for b in self.base_lrs],
            "last_epoch": self.last_epoch,
            "step_count": self._step_count,
            "last_lr": [float(x) for x in self._last_lr],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the param groups' lrs move to that position.

        Args:
            state_dict: What :meth:`state_dict` returned, from a scheduler with
                the same schedule, steps, options and ``lr_min``.

        Raises:
            ValueError: the state is not a ``HyperLRScheduler``'s, was saved for
                another configuration (the differences are listed), or for a
                different number of param groups.
        """
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise HyperParallelValueError(
                f"Not a HyperLRScheduler state_dict: missing {', '.join(missing)}. Load the "
                f"state that HyperLRScheduler.state_dict() returned."
            )
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state_dict[k]!r}, here {mine[k]!r}"
            for k in _CONFIG_KEYS
            if state_dict[k] != mine[k]
        ]
        if diffs:
            raise HyperParallelValueError(
                "Cannot load this LR scheduler state: it was saved for another schedule "
                f"configuration ({'; '.join(diffs)}). Build the scheduler with the saved "
                "settings, then load the state."
            )
        base_lrs = [float(b) for b in state_dict["base_lrs"]]
        if len(base_lrs) != len(self.optimizer.param_groups):
            raise HyperParallelValueError(
                f"The saved LR scheduler state has {len(base_lrs)} param groups; this "
                f"optimizer has {len(self.optimizer.param_groups)}."
            )
        self._group_options = _group_options(self.options, self.lr_min, base_lrs)
        self.base_lrs = list(base_lrs)
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["step_count"])
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            _set_lr(group, lr)
        self._last_lr = [float(x) for x in lrs]


def _resolve_schedule_name(scheduler_type: str, decay_style: str | None) -> str:
    if decay_style is None:
        return scheduler_type
    if scheduler_type is _DEFAULT_SCHEDULE:
        return decay_style
    registry = get_registry()
    chosen = registry.get(PluginKind.LR_SCHEDULER, scheduler_type)
    other = registry.get(PluginKind.LR_SCHEDULER, decay_style)
    if chosen.name != other.name:
        raise HyperParallelValueError(
            f"scheduler_type={scheduler_type!r} and decay_style={decay_style!r} name different "
            f"LR schedules ({chosen.name!r} and {other.name!r}); decay_style is another name "
            f"for scheduler_type, so pass only one of them."
        )
    return scheduler_type


def _warmup_from_ratio(warmup_ratio: object, total_steps: object, warmup_steps: object) -> int:
    total = _check_int("total_steps", total_steps, minimum=1)
    if warmup_steps != 0:
        raise HyperParallelValueError(
            f"Give warmup_steps or warmup_ratio, not both (got warmup_steps={warmup_steps!r}, "
            f"warmup_ratio={warmup_ratio!r})."
        )
    if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, numbers.Real):
        raise HyperParallelTypeError(
            f"warmup_ratio must be a number, got {type(warmup_ratio).__name__} {warmup_ratio!r}."
        )
    if not 0.0 <= float(warmup_ratio) <= 1.0:
        raise HyperParallelValueError(
            f"warmup_ratio must be in [0, 1] (a fraction of total_steps), got {warmup_ratio!r}."
        )
    return round(float(warmup_ratio) * total)


def get_hyper_lr_scheduler(
    optimizer: Optimizer,
    scheduler_type: str = _DEFAULT_SCHEDULE,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    **options: Any,
) -> HyperLRScheduler:
    """Build a :class:`HyperLRScheduler` for ``optimizer`` from a schedule name.

    Examples:
        >>> scheduler = get_hyper_lr_scheduler(
        ...     optimizer, "cosine", total_steps=10_000, warmup_steps=500, lr_min=3e-5
        ... )

    HyperParallel / Megatron-LM keyword aliases:

    * ``decay_style``: another name for ``scheduler_type``; give either. If
      both are given they must name the same schedule (aliases resolved),
      else ``ValueError``. (Leaving ``scheduler_type`` at its default is not
      giving it.)
    * ``lr_min``: an absolute floor; see :class:`HyperLRScheduler`.
    * ``warmup_ratio``: ``warmup_steps = round(warmup_ratio * total_steps)``,
      ratio in ``[0, 1]``; ``ValueError`` if ``warmup_steps`` is also non-zero.
    * ``wsd_decay_steps`` -> the schedule's ``decay_steps``;
      ``lr_wsd_decay_style`` -> its ``decay_shape``. Each is a ``TypeError``
      for a schedule without that option, and a ``ValueError`` together with
      the option it stands for.

    Args:
        optimizer: Any :class:`torch.optim.Optimizer`, including
            :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`; every
            param group follows the schedule from its own lr.
        scheduler_type: A registered schedule (``hyper-parallel plugins``
            lists them): built in are ``constant`` (``constant_with_warmup``),
            ``linear``, ``cosine``, ``cosine_with_restarts``, ``polynomial``,
            ``inverse_sqrt`` and ``wsd``.
        total_steps: Steps the schedule spans, at least 1.
        warmup_steps: Steps of linear warmup from 0, at most ``total_steps``.
        **options: The schedule's options (e.g. ``num_cycles``,
            ``min_lr_ratio``) and the aliases above.

    Returns:
        The scheduler; it has already set every group's lr for step 0.

    Raises:
        UnknownPluginError: an unknown schedule name (the message lists them).
        TypeError: an unknown option (with a did-you-mean and the schedule's
            options), or a wrong type (e.g. a float ``total_steps``).
        ValueError: out-of-range steps or option values, or conflicting
            aliases. Nothing about the optimizer has changed when any of these
            is raised.
    """
    decay_style = options.pop("decay_style", None)
    warmup_ratio = options.pop("warmup_ratio", None)
    lr_min = options.pop("lr_min", None)
    name = _resolve_schedule_name(scheduler_type, decay_style)
    entry = get_registry().get(PluginKind.LR_SCHEDULER, name)
    sig = _signature(entry.obj)
    for alias, target in _OPTION_ALIASES.items():
        if alias not in options:
            continue
        if target not in sig.options:
            raise HyperParallelTypeError(
                f"{alias} sets the option {target!r}, which LR schedule {entry.name!r} does "
                f"not have. {_describe_options(entry.name, sig)}"
            )
        if target in options:
            raise HyperParallelValueError(
                f"Give {alias} or {target}, not both (got {alias}={options[alias]!r}, "
                f"{target}={options[target]!r})."
            )
        options[target] = options.pop(alias)
    _check_option_names(entry.name, options, sig, also=_FACTORY_KEYWORDS)
    if warmup_ratio is not None:
        warmup_steps = _warmup_from_ratio(warmup_ratio, total_steps, warmup_steps)
    return HyperLRScheduler(
        optimizer,
        entry.name,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        lr_min=lr_min,
        options=options,
    )
