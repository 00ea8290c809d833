"""The sharding-backend contract: what an optimizer's transform needs, and what a backend implements.

Plugin authors build a backend from :class:`ShardingBackend` and the parts in
:mod:`hyper_parallel.core.distributed.toolkit`; :func:`ranks_per_node` is the
processes per node a backend sizes its teams by. Users import the distributed
API (``init_device_mesh``, ``hsdp_mesh``, ``fully_shard``,
``set_gradient_scaling_factor``, ``clip_grad_norm_``) from
:mod:`hyper_parallel`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hyper_parallel.core.distributed._backend import (
    BlocksFn,
    GroupBackends,
    PrepareFn,
    ReductionsFn,
    ShardingBackend,
    TeamTransform,
)
from hyper_parallel.core.distributed._needs import Need, RowBlocks, WholeMatrices
from hyper_parallel.core.distributed.toolkit import Blocks, Reducer

if TYPE_CHECKING:
    from hyper_parallel.core.distributed._mesh import ranks_per_node

# Imported on first use: they need torch.distributed.tensor and FSDP, which a
# process that only lists plugins or trains on one device never loads.
LAZY: dict[str, str] = {
    "ranks_per_node": "hyper_parallel.core.distributed._mesh",
}

__all__ = [
    "Blocks",
    "BlocksFn",
    "GroupBackends",
    "Need",
    "PrepareFn",
    "Reducer",
    "ReductionsFn",
    "RowBlocks",
    "ShardingBackend",
    "TeamTransform",
    "WholeMatrices",
    "ranks_per_node",
]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        value = getattr(importlib.import_module(LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the ones loaded on first use, for tab completion and ``dir()``."""
    return sorted(set(globals()) | set(__all__))
