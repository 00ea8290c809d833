"""The plugin contract (hookspecs) and the registry that discovers plugins."""

from hyper_parallel.core.plugin._entries import (
    ENTRY_TYPES,
    OPTIMIZER_REQUIREMENTS,
    BackendEntry,
    LoadedPlugin,
    OptimizerEntry,
    PartitionerEntry,
    PluginKind,
    RegistryEntry,
    ScheduleEntry,
    normalize_name,
)
from hyper_parallel.core.plugin._markers import PROJECT_NAME, hookimpl, hookspec
from hyper_parallel.core.plugin._registry import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    STRICT_ENV,
    Registry,
    get_registry,
    register_plugin,
    unregister_plugin,
)
from hyper_parallel.core.plugin._types import LRScheduleFn, RegisterFn

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "ENTRY_TYPES",
    "OPTIMIZER_REQUIREMENTS",
    "PROJECT_NAME",
    "STRICT_ENV",
    "BackendEntry",
    "LRScheduleFn",
    "LoadedPlugin",
    "OptimizerEntry",
    "PartitionerEntry",
    "PluginKind",
    "RegisterFn",
    "Registry",
    "RegistryEntry",
    "ScheduleEntry",
    "get_registry",
    "hookimpl",
    "hookspec",
    "normalize_name",
    "register_plugin",
    "unregister_plugin",
]
