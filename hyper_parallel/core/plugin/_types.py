"""Typed protocols shared by the registry and plugin authors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["LRScheduleFn", "RegisterFn"]


class RegisterFn(Protocol):
    """The ``register`` callback every hook receives."""

    def __call__(
        self,
        name: str,
        obj: Any,
        *,
        description: str = "",
        aliases: Sequence[str] = (),
        requires: Sequence[str] = (),
    ) -> None: ...


class LRScheduleFn(Protocol):
    """A learning-rate schedule: the lr factor at ``step``."""

    def __call__(
        self, step: int, *, total_steps: int, warmup_steps: int, **options: Any
    ) -> float: ...
