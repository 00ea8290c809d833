"""Distributed building blocks: device meshes, FSDP2 sharding, clipping, and the sharding-backend contract."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hyper_parallel.core.distributed._backend import (
    SHARDING_ENV,
    BlocksFn,
    GroupBackends,
    PrepareFn,
    ReductionsFn,
    ShardingBackend,
    TeamTransform,
    resolve_backend,
)
from hyper_parallel.core.distributed._needs import Blocks, Need, RowBlocks, WholeMatrices
from hyper_parallel.core.distributed.toolkit import Reducer

if TYPE_CHECKING:
    from hyper_parallel.core.distributed._clip_grad import clip_grad_norm_
    from hyper_parallel.core.distributed._fsdp import fully_shard, set_gradient_scaling_factor
    from hyper_parallel.core.distributed._mesh import hsdp_mesh, init_device_mesh, ranks_per_node

# Imported on first use: they need torch.distributed.tensor and FSDP, which a
# process that only lists plugins or trains on one device never loads.
LAZY: dict[str, str] = {
    "clip_grad_norm_": "hyper_parallel.core.distributed._clip_grad",
    "fully_shard": "hyper_parallel.core.distributed._fsdp",
    "set_gradient_scaling_factor": "hyper_parallel.core.distributed._fsdp",
    "hsdp_mesh": "hyper_parallel.core.distributed._mesh",
    "init_device_mesh": "hyper_parallel.core.distributed._mesh",
    "ranks_per_node": "hyper_parallel.core.distributed._mesh",
}

__all__ = [
    "SHARDING_ENV",
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
    "clip_grad_norm_",
    "fully_shard",
    "hsdp_mesh",
    "init_device_mesh",
    "ranks_per_node",
    "resolve_backend",
    "set_gradient_scaling_factor",
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
