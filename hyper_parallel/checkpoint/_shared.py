"""Ranks agree on checkpoints: they see one directory, and they load the same checkpoint.

Under a process group every rank writes its share of a checkpoint and reads
its share back, so the directory must be one directory on storage every rank
shares. :func:`check_shared` proves that before anything is saved or loaded
there; :func:`agreed` makes one rank's choice of checkpoint every rank's.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from hyper_parallel.checkpoint._errors import CheckpointError, is_dist, rank, world_size
from hyper_parallel.checkpoint._lock import hold

__all__ = ["agreed", "agreed_value", "check_shared", "first_problem", "lock_for_rank_0"]

T = TypeVar("T")

#: The directories proved shared in this process (a check is collective: done once each).
_SHARED: set[tuple[str, int]] = set()


def check_shared(root: Path) -> None:
    """Under a process group of two or more ranks, prove every rank sees the same ``root``.

    Collective: call it on every rank. Each rank writes a marker file named by
    a token rank 0 drew and its rank, then looks for every rank's; the markers
    are removed again. Without a process group, or once ``root`` passed, it
    does nothing.

    Raises:
        CheckpointError: on every rank alike, naming ``root`` and the first
            rank that could not write there or could not see another's marker.
    """
    if not is_dist() or world_size() == 1 or (str(root), world_size()) in _SHARED:
        return
    token = _from_rank_0(secrets.token_hex(8))
    mine = _marker(root, token, rank())
    problem = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        mine.write_bytes(b"")
    except OSError as exc:
        problem = f"cannot write there ({exc.strerror or exc})"
    dist.barrier()
    if problem is None:
        unseen = [r for r in range(world_size()) if not _marker(root, token, r).exists()]
        if unseen:
            problem = f"does not see the files rank(s) {_listed(unseen)} wrote there"
    problems: list[str | None] = [None] * world_size()
    dist.all_gather_object(problems, problem)
    dist.barrier()  # every rank has looked: the markers can go
    mine.unlink(missing_ok=True)
    first = next(((r, p) for r, p in enumerate(problems) if p is not None), None)
    if first is not None:
        raise CheckpointError(
            f"Checkpoint directory {root}: rank {first[0]} {first[1]}. Every rank reads and "
            "writes its share of each checkpoint there, so it must be one directory on storage "
            "all ranks share (a shared file system), not a disk local to each node."
        )
    _SHARED.add((str(root), world_size()))


def lock_for_rank_0(root: Path) -> None:
    """Rank 0 holds ``root``'s writer lock (:mod:`._lock`); every rank raises alike if it cannot.

    Raises:
        CheckpointError: another process holds the lock; the message names it.
    """
    refusal = None
    if rank() == 0:
        try:
            hold(root)
        except CheckpointError as exc:
            refusal = str(exc)
    refusal = _from_rank_0(refusal)
    if refusal is not None:
        raise CheckpointError(refusal)


def agreed(names: list[str]) -> list[str]:
    """Rank 0's ``names`` on every rank (collective under a process group; else ``names``)."""
    return _from_rank_0(names)


def agreed_value(value: T) -> T:
    """Rank 0's ``value`` (any picklable one) on every rank; collective under a process group."""
    return _from_rank_0(value)


def first_problem(problem: str | None) -> str | None:
    """The first rank's ``problem`` that is not ``None``, on every rank (collective when distributed)."""
    if not is_dist():
        return problem
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p is not None), None)


def _from_rank_0(value: T) -> T:
    if not is_dist():
        return value
    box: list[T] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _marker(root: Path, token: str, r: int) -> Path:
    return root / f".shared-check-{token}-rank{r}"


def _listed(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
