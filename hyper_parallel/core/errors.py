"""Exceptions raised by hyper_parallel.

Every error says what was asked, what exists, and what to do about it, and
every one derives from :class:`HyperParallelError`, so ``except
HyperParallelError`` catches all of them. Each also keeps the built-in base
its kind of failure has always had (``ValueError``, ``TypeError``, ...), so
``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "DuplicatePluginError",
    "HyperParallelAttributeError",
    "HyperParallelConfigError",
    "HyperParallelError",
    "HyperParallelImportError",
    "HyperParallelKeyError",
    "HyperParallelRuntimeError",
    "HyperParallelStateDictError",
    "HyperParallelTypeError",
    "HyperParallelValueError",
    "PluginError",
    "PluginLoadError",
    "UnknownPluginError",
]


class HyperParallelError(Exception):
    """Base class of every exception hyper_parallel raises on its own account."""


class HyperParallelValueError(HyperParallelError, ValueError):
    """An argument or option has a value hyper_parallel cannot use."""


class HyperParallelTypeError(HyperParallelError, TypeError):
    """An argument has a type hyper_parallel cannot use."""


class HyperParallelConfigError(HyperParallelValueError, HyperParallelTypeError):
    """A configuration is malformed: both a ``ValueError`` and a ``TypeError``.

    HyperParallel raises ``ValueError`` where torch-style code expects
    ``TypeError`` (a dict where a list of groups belongs, mixed argument
    forms); code written for either catches this.
    """


class HyperParallelRuntimeError(HyperParallelError, RuntimeError):
    """An operation cannot go ahead in the current state (non-finite norms, a device mismatch)."""


class HyperParallelStateDictError(HyperParallelValueError, HyperParallelRuntimeError):
    """A saved state dict does not fit the object loading it: both a ``ValueError`` and a ``RuntimeError``.

    HyperParallel raises ``RuntimeError`` where a state dict names other
    parts than the object has (``LRSchedulersContainer.load_state_dict``);
    code written for it, or for this library's ``ValueError``, catches this.
    """


class HyperParallelKeyError(HyperParallelError, KeyError):
    """A key (a param, a sub-optimizer) is not where it was looked up."""


class HyperParallelAttributeError(HyperParallelError, AttributeError):
    """An attribute that does not apply to this object: ``hasattr`` and ``getattr(..., default)`` say no."""


class HyperParallelImportError(HyperParallelError, ImportError):
    """An optional dependency (``torch_npu``) is missing."""


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
