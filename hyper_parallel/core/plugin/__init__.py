"""The plugin contract (hookspecs) and the registry that discovers plugins.

What a plugin author or a user of the registry names here: the registry
(:func:`get_registry`, :class:`Registry`, :class:`RegistryEntry`,
:class:`OptimizerEntry`, :class:`PluginKind`) and the type of a hook's
``register`` callback (:class:`RegisterFn`). ``hookimpl``,
``register_plugin`` and ``unregister_plugin`` are imported from
:mod:`hyper_parallel`.
"""

from hyper_parallel.core.plugin._entries import (
    OptimizerEntry,
    PluginKind,
    RegistryEntry,
)
from hyper_parallel.core.plugin._registry import Registry, get_registry
from hyper_parallel.core.plugin._types import RegisterFn

__all__ = [
    "OptimizerEntry",
    "PluginKind",
    "RegisterFn",
    "Registry",
    "RegistryEntry",
    "get_registry",
]
