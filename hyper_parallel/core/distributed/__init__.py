"""Distributed building blocks: the sharding-backend contract."""

from hyper_parallel.core.distributed.backend import FullMatrixFn, ShardingBackend

__all__ = ["FullMatrixFn", "ShardingBackend"]
