"""The HyperParallel optimizer API.

``Muon``, ``Sinkhorn`` and ``AdamW`` are resolved through the plugin registry
(they are built-in plugins), so ``from hyper_parallel.core.optimizer import
Muon`` gives whatever the registry holds under that name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyper_parallel.core._grads import grad_tensors
from hyper_parallel.core.optimizer._chained import ChainedOptimizer
from hyper_parallel.core.optimizer._container import LRSchedulersContainer
from hyper_parallel.core.optimizer._factory import get_hyper_optimizer
from hyper_parallel.core.optimizer._main_params import MainParams
from hyper_parallel.core.optimizer._matrix import (
    MatrixOptimizer,
    MomentumRule,
    apply_momentum,
    by_device_and_dtype,
    momentum_updates,
    new_or_into,
)
from hyper_parallel.core.optimizer._nonfinite import (
    NonFiniteTensors,
    grads_are_finite,
    named_training_state,
    non_finite,
    non_finite_state,
    step_if_finite,
)
from hyper_parallel.core.optimizer._scheduler import HyperLRScheduler, get_hyper_lr_scheduler
from hyper_parallel.core.optimizer._swap import (
    SwapOptimizer,
    SwapOptimizerConfig,
    is_swap_optimizer,
)

__all__ = [
    "AdamW",
    "ChainedOptimizer",
    "HyperLRScheduler",
    "LRSchedulersContainer",
    "MainParams",
    "MatrixOptimizer",
    "MomentumRule",
    "Muon",
    "NonFiniteTensors",
    "Sinkhorn",
    "SwapOptimizer",
    "SwapOptimizerConfig",
    "apply_momentum",
    "by_device_and_dtype",
    "get_hyper_lr_scheduler",
    "get_hyper_optimizer",
    "grad_tensors",
    "grads_are_finite",
    "is_swap_optimizer",
    "momentum_updates",
    "named_training_state",
    "new_or_into",
    "non_finite",
    "non_finite_state",
    "step_if_finite",
]

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
