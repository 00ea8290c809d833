"""Distributed building blocks: sharding backends and the full-matrix map used by Muon."""

from hyper_parallel.core.distributed.backend import (
    SHARDING_ENV,
    FullTensorsFn,
    ShardingBackend,
    resolve_backend,
)

__all__ = ["SHARDING_ENV", "FullTensorsFn", "ShardingBackend", "resolve_backend"]
