"""hyper_parallel: Muon + AdamW for large-model training, on a plugin registry.

The one root for users and plugin authors: ``from hyper_parallel import
get_hyper_optimizer, Muon, fully_shard, hookimpl, ...``. The optimizer API is
also importable from :mod:`hyper_parallel.core.optimizer`, as the
HyperParallel guide writes it; the plugin contract is
:mod:`hyper_parallel.core.plugin.hookspecs`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hyper_parallel.core import optimizer as _optimizer
from hyper_parallel.core.errors import (
    DuplicatePluginError,
    HyperParallelError,
    PluginError,
    PluginLoadError,
    UnknownPluginError,
)
from hyper_parallel.core.optimizer import (
    ChainedOptimizer,
    HyperLRScheduler,
    LRSchedulersContainer,
    MainParams,
    detect_dtensor_backend,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    grads_are_finite,
    step_if_finite,
    swap_optimizer,
)
from hyper_parallel.core.plugin import PluginKind, get_registry
from hyper_parallel.core.plugin._markers import hookimpl
from hyper_parallel.core.plugin._registry import register_plugin, unregister_plugin

if TYPE_CHECKING:
    # Their real classes for type checkers; at run time they come from the registry.
    from hyper_parallel.core.distributed._clip_grad import clip_grad_norm_
    from hyper_parallel.core.distributed._fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        set_gradient_scaling_factor,
    )
    from hyper_parallel.core.distributed._mesh import hsdp_mesh, init_device_mesh
    from hyper_parallel_builtins.adamw import AdamW
    from hyper_parallel_builtins.muon import Muon
    from hyper_parallel_builtins.sinkhorn import Sinkhorn

# The distributed API, imported on first use: it needs torch.distributed.tensor and FSDP,
# which a process that only lists plugins or trains on one device never loads.
_LAZY: dict[str, str] = {
    "clip_grad_norm_": "hyper_parallel.core.distributed._clip_grad",
    "fully_shard": "hyper_parallel.core.distributed._fsdp",
    "MixedPrecisionPolicy": "hyper_parallel.core.distributed._fsdp",
    "set_gradient_scaling_factor": "hyper_parallel.core.distributed._fsdp",
    "hsdp_mesh": "hyper_parallel.core.distributed._mesh",
    "init_device_mesh": "hyper_parallel.core.distributed._mesh",
}
#: Subpackages reachable as attributes without their own import.
_SUBPACKAGES = frozenset({"checkpoint", "qk_clip"})

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "ChainedOptimizer",
    "DuplicatePluginError",
    "HyperLRScheduler",
    "HyperParallelError",
    "LRSchedulersContainer",
    "MainParams",
    "MixedPrecisionPolicy",
    "Muon",
    "PluginError",
    "PluginKind",
    "PluginLoadError",
    "Sinkhorn",
    "UnknownPluginError",
    "__version__",
    "clip_grad_norm_",
    "detect_dtensor_backend",
    "fully_shard",
    "get_hyper_lr_scheduler",
    "get_hyper_optimizer",
    "get_registry",
    "grads_are_finite",
    "hookimpl",
    "hsdp_mesh",
    "init_device_mesh",
    "register_plugin",
    "set_gradient_scaling_factor",
    "step_if_finite",
    "swap_optimizer",
    "unregister_plugin",
]


def __getattr__(name: str) -> Any:
    # The registered optimizers come from the registry, like the guide's import path.
    if name in _optimizer.REGISTERED:
        return getattr(_optimizer, name)
    # The distributed API loads on first use, keeping `import hyper_parallel` light.
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:  # `hyper_parallel.qk_clip.track(model)` after `import hyper_parallel`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the ones loaded on first use, for tab completion and ``dir()``."""
    return sorted(set(globals()) | set(__all__))
