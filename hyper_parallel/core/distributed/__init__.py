"""Distributed building blocks: device meshes, FSDP2 sharding, clipping, and the full-matrix map."""

from hyper_parallel.core.distributed.backend import (
    SHARDING_ENV,
    FullTensorsFn,
    ShardingBackend,
    resolve_backend,
)
from hyper_parallel.core.distributed.clip_grad import clip_grad_norm_
from hyper_parallel.core.distributed.fsdp import fully_shard, set_gradient_scaling_factor
from hyper_parallel.core.distributed.mesh import init_device_mesh

__all__ = [
    "SHARDING_ENV",
    "FullTensorsFn",
    "ShardingBackend",
    "clip_grad_norm_",
    "fully_shard",
    "init_device_mesh",
    "resolve_backend",
    "set_gradient_scaling_factor",
]
