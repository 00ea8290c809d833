"""``get_hyper_lr_scheduler``: one torch LR scheduler driven by a named schedule.

A schedule is a registered function ``fn(step, *, total_steps, warmup_steps,
**options) -> float`` (see
:func:`~hyper_parallel.core.plugin.hookspecs.hyper_parallel_register_lr_schedulers`).
:class:`HyperLRScheduler` applies its factor to every param group of any
:class:`torch.optim.Optimizer`, :class:`ChainedOptimizer` included, each group
from its own peak lr: ``lr_g(s) = initial_lr_g * factor(s)``.
:class:`~hyper_parallel.core.optimizer.LRSchedulersContainer` (in its own
module) is one scheduler per sub-optimizer instead, as HyperParallel's is.

:func:`get_hyper_lr_scheduler` takes HyperParallel's keywords with their
defaults: ``lr`` is the lr that ``lr_min`` and ``lr_start`` are relative to,
so every group decays to ``lr_min / lr`` of its own peak (1e-7 / 1e-4 by
default) and warms up from ``lr_start / lr`` of it.

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

from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean
from hyper_parallel.core.plugin import PluginKind, get_registry

__all__ = [
    "HyperLRScheduler",
    "get_hyper_lr_scheduler",
]

_ScheduleFn = Callable[..., float]

_STEP_ARGS: Final = ("total_steps", "warmup_steps")
#: HyperParallel's scheduler keywords whose values are schedule options as they are.
_OPTION_ALIASES: Final = {"wsd_decay_steps": "decay_steps", "lr_wsd_decay_style": "decay_shape",
                          "lr_decay_ratio": "decay_ratio"}  # fmt: skip
#: HyperParallel's keywords relative to its ``lr``: the schedule option ``value / lr`` sets.
_RATIO_ALIASES: Final = {"lr_min": "min_lr_ratio", "lr_start": "start_ratio"}
#: HyperParallel's decay styles: they take all of its keywords, and a keyword that does not
#: shape a style (``lr_min`` for ``constant``) has no effect there, as in HyperParallel.
_HYPER_PARALLEL_STYLES: Final = ("constant", "linear", "cosine", "wsd")
_FACTORY_KEYWORDS: Final = ("decay_style", "scheduler_type", "warmup_ratio", "lr", *_STEP_ARGS)
_CONFIG_KEYS: Final = ("schedule", "total_steps", "warmup_steps", "options")
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
    aliases = {**_OPTION_ALIASES, **_RATIO_ALIASES}
    extra = [alias for alias, target in aliases.items() if target in sig.options]
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
            candidates = [*sig.options, *_RATIO_ALIASES, *_OPTION_ALIASES, *also]
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


def _probe(
    schedule: str,
    fn: _ScheduleFn,
    total_steps: int,
    warmup_steps: int,
    options: dict[str, Any],
) -> None:
    """Call the schedule at a few steps, so bad options fail before the optimizer changes."""
    steps = sorted(
        {0, warmup_steps, (warmup_steps + total_steps) // 2, total_steps, total_steps + 1}
    )
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


def set_lr(group: dict[str, Any], lr: float | Tensor) -> None:
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
        warmup_steps: Steps of linear warmup, ``0 <= W <= total_steps``.
        options: The schedule's own options (its keyword-only parameters).

    Attributes:
        schedule_name: The canonical registry name of the schedule.
        total_steps: As given.
        warmup_steps: As given.
        options: The resolved options, defaults included.

    Raises:
        UnknownPluginError: no schedule of that name is registered.
        TypeError: an option the schedule does not take (with a hint), or an
            argument of the wrong type.
        ValueError: a value out of range (steps, or the schedule's own checks).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: str = "cosine",
        *,
        total_steps: int,
        warmup_steps: int = 0,
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
        for index, group in enumerate(optimizer.param_groups):
            _peak_lr(group, index)  # a number, before torch reads it
        _probe(entry.name, fn, total, warmup, resolved)

        self.schedule_name = entry.name
        self.total_steps = total
        self.warmup_steps = warmup
        self.options: dict[str, Any] = resolved
        self._schedule_fn = fn
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        """The schedule's factor on every group's peak lr at ``step``."""
        return float(
            self._schedule_fn(
                step, total_steps=self.total_steps, warmup_steps=self.warmup_steps, **self.options
            )
        )

    def get_lr(self) -> list[float | Tensor]:
        """The lr of every param group at ``last_epoch``: its peak times the factor."""
        factor = self.factor(self.last_epoch)
        return [base * factor for base in self.base_lrs]

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
            "base_lrs": [float(b) for b in self.base_lrs],
            "last_epoch": self.last_epoch,
            "step_count": self._step_count,
            "last_lr": [float(x) for x in self._last_lr],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the param groups' lrs move to that position.

        Args:
            state_dict: What :meth:`state_dict` returned, from a scheduler with
                the same schedule, steps and options.

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
        self.base_lrs = list(base_lrs)
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["step_count"])
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            set_lr(group, lr)
        self._last_lr = [float(x) for x in lrs]


def _required_total_steps(scheduler_type: object, total_steps: int | None) -> int:
    """``total_steps``, which is required; a number where the name goes says where it belongs."""
    if not isinstance(scheduler_type, str):
        steps = f"total_steps={scheduler_type!r}" if total_steps is None else "total_steps=..."
        raise HyperParallelTypeError(
            f"get_hyper_lr_scheduler's second argument is the schedule's name, got "
            f"{type(scheduler_type).__name__} {scheduler_type!r}; the steps go by keyword: "
            f'get_hyper_lr_scheduler(optimizer, "cosine", {steps}).'
        )
    if total_steps is None:
        raise HyperParallelTypeError(
            f"get_hyper_lr_scheduler(optimizer, {scheduler_type!r}) needs total_steps=N, the "
            "steps the schedule spans."
        )
    return total_steps


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
    """HyperParallel's ``warmup_ratio``: ``int(total_steps * warmup_ratio)`` warmup steps."""
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
    return int(total * float(warmup_ratio))


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HyperParallelTypeError(
            f"{name} must be a number, got {type(value).__name__} {value!r}."
        )
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise HyperParallelValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    return number


def _hyper_parallel_options(
    schedule: str, sig: _Signature, options: dict[str, Any], given: Mapping[str, Any]
) -> None:
    """Put HyperParallel's keywords in ``options`` as the schedule's own options.

    ``lr_min`` and ``lr_start`` become ``min_lr_ratio`` / ``start_ratio``
    (over ``lr``); the others are the options they name. A keyword sets its
    option where the schedule has it and the caller did not give the option
    itself; at its default, only for HyperParallel's styles (other schedules
    keep their own defaults). A keyword that asks for something (set away from its default
    and from "nothing": no floor, no start, the whole decay) is a
    ``ValueError`` next to its option, and a ``TypeError`` for a schedule
    without the option, except HyperParallel's own styles, where it has no
    effect as in HyperParallel.
    """
    lr = _real("lr", given["lr"])
    if lr <= 0:
        raise HyperParallelValueError(
            f"lr must be > 0 (the lr that lr_min and lr_start are relative to), got {lr!r}."
        )
    lr_min = _real("lr_min", given["lr_min"])
    if lr_min > lr:
        raise HyperParallelValueError(
            f"lr_min={lr_min!r} is above lr={lr!r}; lr must be >= lr_min (the floor is "
            "lr_min / lr of each group's peak lr)."
        )
    values = {
        "min_lr_ratio": lr_min / lr,
        "start_ratio": _real("lr_start", given["lr_start"]) / lr,
        "decay_ratio": _real("lr_decay_ratio", given["lr_decay_ratio"]),
        "decay_steps": given["wsd_decay_steps"],
        "decay_shape": given["lr_wsd_decay_style"],
    }
    keywords = {**{v: k for k, v in _RATIO_ALIASES.items()},
                **{v: k for k, v in _OPTION_ALIASES.items()}}  # fmt: skip
    for option, value in values.items():
        keyword = keywords[option]
        explicit = given[keyword] != _HYPER_PARALLEL_DEFAULTS[keyword]
        if keyword == "lr_min" and given["lr"] != _HYPER_PARALLEL_DEFAULTS["lr"]:
            explicit = True  # the floor's ratio moved
        explicit = explicit and value != _NEUTRAL.get(option, object())
        if option not in sig.options:
            if explicit and schedule not in _HYPER_PARALLEL_STYLES:
                raise HyperParallelTypeError(
                    f"{keyword} sets the option {option!r}, which LR schedule {schedule!r} does "
                    f"not have. {_describe_options(schedule, sig)}"
                )
            continue
        if option in options:
            if explicit:
                raise HyperParallelValueError(
                    f"Give {keyword} or {option}, not both (got {keyword}={given[keyword]!r}, "
                    f"{option}={options[option]!r})."
                )
            continue
        if explicit or schedule in _HYPER_PARALLEL_STYLES:
            options[option] = value  # other schedules keep their own defaults


#: What each option is when it asks for nothing: no floor, no warmup start, all of the decay.
_NEUTRAL: Final[Mapping[str, Any]] = {
    "min_lr_ratio": 0.0,
    "start_ratio": 0.0,
    "decay_ratio": 1.0,
    "decay_steps": None,
}

#: HyperParallel's scheduler defaults: every group decays to 1e-7 / 1e-4 of its own peak.
_HYPER_PARALLEL_DEFAULTS: Final[Mapping[str, Any]] = {
    "lr": 1e-4,
    "lr_min": 1e-7,
    "lr_start": 0.0,
    "lr_decay_ratio": 1.0,
    "wsd_decay_steps": None,
    "lr_wsd_decay_style": "exponential",
}


def get_hyper_lr_scheduler(
    optimizer: Optimizer,
    scheduler_type: str = _DEFAULT_SCHEDULE,
    *,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
    decay_style: str | None = None,
    lr: float = 1e-4,
    lr_min: float = 1e-7,
    lr_start: float = 0.0,
    lr_decay_ratio: float = 1.0,
    wsd_decay_steps: int | None = None,
    lr_wsd_decay_style: str = "exponential",
    **options: Any,
) -> HyperLRScheduler:
    """Build a :class:`HyperLRScheduler` for ``optimizer`` from a schedule name.

    Takes HyperParallel's keywords, with its defaults for its styles
    (``constant``, ``linear``, ``cosine``, ``wsd``), so its scripts give its
    lr sequence: every param group follows ``lr_g(s) = peak_g * factor(s)``
    from its own peak lr. Other schedules take the keywords where they have
    the options, and keep their own defaults.

    Examples:
        >>> scheduler = get_hyper_lr_scheduler(
        ...     optimizer, scheduler_type="cosine", total_steps=10_000, warmup_steps=500
        ... )

    Args:
        optimizer: Any :class:`torch.optim.Optimizer`, including
            :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`.
        scheduler_type: A registered schedule (``hyper-parallel plugins``
            lists them): built in are ``constant`` (``constant_with_warmup``),
            ``linear``, ``cosine``, ``cosine_with_restarts``, ``polynomial``,
            ``inverse_sqrt`` and ``wsd`` (``WSD``).
        total_steps: Steps the schedule spans, at least 1 (required, by keyword).
        warmup_steps: Steps of linear warmup, at most ``total_steps``.
        warmup_ratio: HyperParallel's: ``int(warmup_ratio * total_steps)``
            warmup steps, ratio in ``[0, 1]``; not together with ``warmup_steps``.
        decay_style: HyperParallel's name for ``scheduler_type``; give either
            (both must name the same schedule).
        lr: The lr ``lr_min`` and ``lr_start`` are relative to (not a group's
            peak, which is its own ``lr``).
        lr_min: The floor: each group decays to ``lr_min / lr`` of its peak
            (the schedule's ``min_lr_ratio``).
        lr_start: Each group's warmup starts at ``lr_start / lr`` of its peak
            (``start_ratio``).
        lr_decay_ratio: ``linear`` and ``cosine`` end their decay at
            ``int(total_steps * lr_decay_ratio)`` and hold the floor after
            (``decay_ratio``).
        wsd_decay_steps: ``wsd``'s decay length (``decay_steps``; default a
            tenth of the steps after warmup).
        lr_wsd_decay_style: ``wsd``'s decay shape: ``exponential``,
            ``linear``, ``cosine`` or ``minus_sqrt`` (``decay_shape``).
        **options: The schedule's own options (e.g. ``num_cycles``,
            ``min_lr_ratio``).

    Returns:
        The scheduler; it has already set every group's lr for step 0.

    Raises:
        UnknownPluginError: an unknown schedule name (the message lists them).
        TypeError: an unknown option (with a did-you-mean and the schedule's
            options), a HyperParallel keyword set for a schedule without its
            option, or a wrong type (e.g. a float ``total_steps``).
        ValueError: out-of-range steps or option values, or a keyword given
            with the option it stands for. Nothing about the optimizer has
            changed when any of these is raised.
    """
    total_steps = _required_total_steps(scheduler_type, total_steps)
    name = _resolve_schedule_name(scheduler_type, decay_style)
    entry = get_registry().get(PluginKind.LR_SCHEDULER, name)
    sig = _signature(entry.obj)
    _check_option_names(entry.name, options, sig, also=_FACTORY_KEYWORDS)
    given = {
        "lr": lr,
        "lr_min": lr_min,
        "lr_start": lr_start,
        "lr_decay_ratio": lr_decay_ratio,
        "wsd_decay_steps": wsd_decay_steps,
        "lr_wsd_decay_style": lr_wsd_decay_style,
    }
    _hyper_parallel_options(entry.name, sig, options, given)
    if warmup_ratio:
        warmup_steps = _warmup_from_ratio(warmup_ratio, total_steps, warmup_steps)
    return HyperLRScheduler(
        optimizer, entry.name, total_steps=total_steps, warmup_steps=warmup_steps, options=options
    )
