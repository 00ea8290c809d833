"""What a plugin checks in what it is given: close-match hints, keywords, group keys, switches.

Public for plugin authors: the built-in optimizers, schedules and partitioners
use these, and a third-party plugin can give its users the same errors.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hyper_parallel.core._cache import CACHE_DIR_ENV, default_cache_dir
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError

__all__ = [
    "CACHE_DIR_ENV",
    "FAMILY_KEYS",
    "FAMILY_ORDER",
    "accepted_group_keys",
    "accepted_keywords",
    "check_group_keys",
    "check_keywords",
    "default_cache_dir",
    "did_you_mean",
    "env_switch",
    "listed",
]

#: The keys of a family dict (``muon={...}``) that route params to the family's optimizer;
#: ``by_family`` reads these, and every other key is an option of the optimizer.
FAMILY_KEYS: tuple[str, ...] = ("param_patterns", "param_groups")

#: The optimizers HyperParallel's forms name (``<name>_params``/``<name>_kwargs``, and the
#: families of family configuration), in the order their chain steps them (HyperParallel's).
FAMILY_ORDER: tuple[str, ...] = ("adamw", "muon", "sinkhorn")

#: How many names a message lists before it says how many more there are.
_NAMES_LISTED = 5


def listed(names: Sequence[str], limit: int = _NAMES_LISTED) -> str:
    """``"a, b, c and 7 more"``: the first ``limit`` names, and how many more, for a message."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidates, or ``""``."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=3, cutoff=0.6)
    if not matches:
        return ""
    return " Did you mean " + " or ".join(repr(m) for m in matches) + "?"


def accepted_keywords(fn: Callable[..., Any], *, skip: int = 0) -> set[str] | None:
    """Keyword names ``fn`` accepts, or ``None`` when it takes ``**kwargs``.

    ``skip`` drops that many leading positional parameters (e.g. ``params``).
    """
    target: Any = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if inspect.isclass(fn) and params and params[0].name == "self":
        params = params[1:]
    names: set[str] = set()
    for index, p in enumerate(params):
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if index < skip or p.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            continue
        names.add(p.name)
    return names


def accepted_group_keys(optimizer: Callable[..., Any]) -> set[str] | None:
    """Keys a param group of ``optimizer`` may set, or ``None`` when it takes ``**kwargs``.

    Its keyword options (:func:`accepted_keywords` after ``params``), plus the
    keys of its class attribute ``fixed_group_keys``: keys the optimizer puts
    in every group that no option sets (torch's ``AdamW`` puts
    ``decoupled_weight_decay`` there), so that a group copied from its
    ``param_groups`` (``[dict(g) for g in opt.param_groups]``) can be given
    back. The optimizer checks their values itself.
    """
    accepted = accepted_keywords(optimizer, skip=1)
    if accepted is None:
        return None
    return accepted | set(getattr(optimizer, "fixed_group_keys", ()))


def check_keywords(given: Mapping[str, Any], accepted: Iterable[str] | None, *, where: str) -> None:
    """Raise ``TypeError`` naming the first keyword in ``given`` not in ``accepted``.

    ``where`` names the thing being configured, e.g. ``"optimizer 'muon'"``.
    ``accepted=None`` accepts everything.
    """
    if accepted is None:
        return
    accepted = sorted(set(accepted))
    for key in given:
        if key not in accepted:
            raise HyperParallelTypeError(
                f"Unknown keyword argument {key!r} for {where}.{did_you_mean(key, accepted)}"
                f" Accepted: {', '.join(accepted) or '(none)'}."
            )


#: Param-group keys that are not options: torch's own and what LR schedulers add.
GROUP_BOOKKEEPING_KEYS = frozenset({"params", "param_names", "initial_lr"})


def check_group_keys(group: Mapping[str, Any], options: Iterable[str], *, where: str) -> None:
    """Raise ``ValueError`` for a param-group key that is not one of ``options``.

    A typo such as ``{"params": ..., "lrr": 0.1}`` would otherwise be stored
    and never read, so the group would silently train at the default lr.
    ``where`` names the optimizer, e.g. ``"optimizer 'muon'"``. The keys that
    are not options (``params``, ``param_names``, ``initial_lr``) are always
    allowed.
    """
    known = set(options) | GROUP_BOOKKEEPING_KEYS
    for key in group:
        if key not in known:
            raise HyperParallelValueError(
                f"Unknown key {key!r} in a param group of {where}.{did_you_mean(str(key), known)} "
                f"A group may set: {', '.join(sorted(set(options)))}."
            )


_SWITCH_VALUES = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def env_switch(name: str, *, default: bool, meaning: str) -> bool:
    """The on/off value of ``$name``: ``default`` when unset or empty.

    ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` (any case)
    are accepted; anything else is a ``ValueError`` that names the variable
    and says what 1 (``meaning``) and 0 do.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return _SWITCH_VALUES[value.lower()]
    except KeyError:
        raise HyperParallelValueError(
            f"{name}={value!r} is not a switch: set it to 1 ({meaning}) or 0 (not); "
            "true/false, yes/no and on/off are accepted too."
        ) from None
