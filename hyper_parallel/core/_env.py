"""On/off switches read from the environment, spelled one way everywhere."""

from __future__ import annotations

import os

from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["env_switch"]

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
