"""The checkpoint errors, and the process-group facts every part of a save or load asks."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hyper_parallel.core.errors import HyperParallelRuntimeError

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "is_dist",
    "rank",
    "reason",
    "world_size",
]


class CheckpointError(HyperParallelRuntimeError):
    """A checkpoint is missing, malformed, corrupt, or does not fit the objects given."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are not what its manifest recorded: changed, truncated or missing.

    :func:`~hyper_parallel.checkpoint.load_latest` skips a corrupt checkpoint
    and falls back to an older one; it never skips one that merely does not fit
    the objects given (a plain :class:`CheckpointError`).
    """


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def reason(exc: BaseException) -> str:
    """``exc`` in one line; for DCP's per-rank wrapper, the first rank's own error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        where, (inner, _) = next(iter(exc.failures.items()))
        return f"{type(inner).__name__}: {inner} (rank {where})"
    return f"{type(exc).__name__}: {exc}"
