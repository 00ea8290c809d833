"""The HyperParallel optimizer API.

``Muon``, ``Sinkhorn`` and ``AdamW`` are resolved through the plugin registry
(they are built-in plugins), so ``from hyper_parallel.core.optimizer import
Muon`` gives whatever the registry holds under that name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyper_parallel.core.optimizer._chained import ChainedOptimizer
from hyper_parallel.core.optimizer._container import LRSchedulersContainer
from hyper_parallel.core.optimizer._factory import (
    detect_dtensor_backend,
    get_hyper_optimizer,
    swap_optimizer,
)
from hyper_parallel.core.optimizer._main_params import MainParams
from hyper_parallel.core.optimizer._matrix import (
    MatrixOptimizer,
    apply_momentum,
    by_device_and_dtype,
    lerp_momentum_,
    momentum_updates,
    new_or_into,
)
from hyper_parallel.core.optimizer._nonfinite import grads_are_finite, step_if_finite
from hyper_parallel.core.optimizer._scheduler import HyperLRScheduler, get_hyper_lr_scheduler
from hyper_parallel.core.optimizer._swap import SwapOptimizer, SwapOptimizerConfig

__all__ = [
    "AdamW",
    "ChainedOptimizer",
    "HyperLRScheduler",
    "LRSchedulersContainer",
    "MainParams",
    "MatrixOptimizer",
    "Muon",
    "Sinkhorn",
    "SwapOptimizer",
    "SwapOptimizerConfig",
    "detect_dtensor_backend",
    "get_hyper_lr_scheduler",
    "get_hyper_optimizer",
    "grads_are_finite",
    "momentum_updates",
    "step_if_finite",
    "swap_optimizer",
]
# A matrix optimizer's momentum on local shards (Muon's and Sinkhorn's, and a plugin's).
__all__ += ["apply_momentum", "by_device_and_dtype", "lerp_momentum_", "new_or_into"]

if TYPE_CHECKING:
    # Their real classes for type checkers; at run time they come from the registry.
    from hyper_parallel_builtins.adamw import AdamW
    from hyper_parallel_builtins.muon import Muon
    from hyper_parallel_builtins.sinkhorn import Sinkhorn

#: Class name -> the registered optimizer name it resolves to.
REGISTERED = {"Muon": "muon", "Sinkhorn": "sinkhorn", "AdamW": "adamw"}


def __getattr__(name: str) -> Any:
    if name in REGISTERED:
        from hyper_parallel.core.plugin import PluginKind, get_registry

        return get_registry().get(PluginKind.OPTIMIZER, REGISTERED[name]).obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
