"""The plugin contract (hookspecs) and the registry that discovers plugins."""

from hyper_parallel.core.plugin.markers import PROJECT_NAME, hookimpl, hookspec
from hyper_parallel.core.plugin.registry import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    STRICT_ENV,
    LoadedPlugin,
    PluginKind,
    Registry,
    RegistryEntry,
    get_registry,
    normalize_name,
    register_plugin,
    unregister_plugin,
)
from hyper_parallel.core.plugin.types import LRScheduleFn, RegisterFn

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "STRICT_ENV",
    "LRScheduleFn",
    "LoadedPlugin",
    "PluginKind",
    "RegisterFn",
    "Registry",
    "RegistryEntry",
    "get_registry",
    "hookimpl",
    "hookspec",
    "normalize_name",
    "register_plugin",
    "unregister_plugin",
]
