"""Exceptions raised by hyper_parallel.

Every error says what was asked, what exists, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "DuplicatePluginError",
    "HyperParallelError",
    "PluginError",
    "PluginLoadError",
    "UnknownPluginError",
]


class HyperParallelError(Exception):
    """Base class of every exception hyper_parallel raises on its own account."""


class PluginError(HyperParallelError):
    """Something is wrong with a plugin or a plugin lookup."""


class UnknownPluginError(PluginError, LookupError):
    """A name was looked up that no loaded plugin registered."""

    def __init__(self, message: str, *, kind: str, name: str, available: list[str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.available = available


class DuplicatePluginError(PluginError):
    """Two registrations claimed the same name within one kind."""


class PluginLoadError(PluginError):
    """A plugin's entry point could not be imported or its hook failed."""

    def __init__(self, message: str, *, plugin: str, distribution: str | None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution
