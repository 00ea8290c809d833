"""hyper_parallel: Muon + AdamW for large-model training, on a plugin registry.

Plugin authors need only :data:`hookimpl` (see
:mod:`hyper_parallel.core.plugin.hookspecs` for the contract). Users build
optimizers with :func:`hyper_parallel.core.optimizer.get_hyper_optimizer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyper_parallel.core import distributed as _distributed
from hyper_parallel.core.errors import (
    DuplicatePluginError,
    HyperParallelError,
    PluginError,
    PluginLoadError,
    UnknownPluginError,
)
from hyper_parallel.core.plugin import (
    PluginKind,
    get_registry,
    hookimpl,
    register_plugin,
    unregister_plugin,
)

if TYPE_CHECKING:
    from hyper_parallel.core.distributed import (
        clip_grad_norm_,
        fully_shard,
        init_device_mesh,
        set_gradient_scaling_factor,
    )

__version__ = "0.1.0"

__all__ = [
    "DuplicatePluginError",
    "HyperParallelError",
    "PluginError",
    "PluginKind",
    "PluginLoadError",
    "UnknownPluginError",
    "__version__",
    "clip_grad_norm_",
    "fully_shard",
    "get_registry",
    "hookimpl",
    "init_device_mesh",
    "register_plugin",
    "set_gradient_scaling_factor",
    "unregister_plugin",
]


def __getattr__(name: str) -> Any:
    # The distributed API loads on first use (hyper_parallel.core.distributed.LAZY),
    # keeping `import hyper_parallel` light.
    if name in _distributed.LAZY:
        value = getattr(_distributed, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
