"""The checkpoint errors, and the process-group facts every part of a save or load asks."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hyper_parallel.core.errors import HyperParallelRuntimeError

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "NonFiniteStateError",
    "interrupt_in",
    "is_dist",
    "rank",
    "reason",
    "save_failed",
    "world_size",
]


class CheckpointError(HyperParallelRuntimeError):
    """A checkpoint is missing, malformed, corrupt, or does not fit the objects given."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are not what its manifest recorded, or a tensor in them cannot be read.

    Changed, truncated or missing files are found against the manifest's
    checksums; a tensor that a faulty writer sealed unreadable is found when
    it is read, and named with its file.

    :func:`~hyper_parallel.checkpoint.load_latest` skips a corrupt checkpoint
    and falls back to an older one; it never skips one that merely does not fit
    the objects given (a plain :class:`CheckpointError`).
    """


class NonFiniteStateError(CheckpointError):
    """State holding NaN or Inf: refused by a save, or found in a checkpoint by a load.

    A save that raises it writes nothing (the previous checkpoint is
    intact); :func:`~hyper_parallel.checkpoint.load_latest` passes over a
    checkpoint that holds such state to an older one, saying so.
    """


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def interrupt_in(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` or ``SystemExit`` behind ``exc``, if it is one or wraps one.

    DCP's collectives catch ``BaseException`` and wrap what each rank raised
    in a ``CheckpointException``; Ctrl-C during a save must still stop the
    program as Ctrl-C.
    """
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (KeyboardInterrupt, SystemExit)):
            return current
        if isinstance(current, CheckpointException):
            pending.extend(inner for inner, _ in current.failures.values())
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def save_failed(target: object, exc: BaseException, *, background: bool = False) -> BaseException:
    """What a failed save of ``target`` raises: the interrupt behind it, else one :class:`CheckpointError`.

    The message names the checkpoint, the cause (``OSError``'s own words: no
    space left on device, read-only file system, permission denied, ...) and
    that the previous checkpoint is intact, alike for a save in the caller's
    thread and one in the background.
    """
    interrupt = interrupt_in(exc)
    if interrupt is not None:
        return interrupt
    kind = "asynchronous save" if background else "save"
    return CheckpointError(
        f"The {kind} of {target} failed: {reason(exc)}. The previous checkpoint is intact."
    )


def reason(exc: BaseException) -> str:
    """``exc`` in one line; for DCP's per-rank wrapper, the first rank's own error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        where, (inner, _) = next(iter(exc.failures.items()))
        return f"{type(inner).__name__}: {inner} (rank {where})"
    return f"{type(exc).__name__}: {exc}"
