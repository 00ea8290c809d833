"""Numbered checkpoints under one directory: :class:`CheckpointManager`."""

from __future__ import annotations

import os
import shutil
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.optim import Optimizer

from hyper_parallel.checkpoint._errors import CheckpointError
from hyper_parallel.checkpoint._layout import LATEST_FILE, candidates, step_dirs
from hyper_parallel.checkpoint._load import load_latest
from hyper_parallel.checkpoint._lock import release
from hyper_parallel.checkpoint._save import make_job
from hyper_parallel.checkpoint._saving import new_stager, saver
from hyper_parallel.checkpoint._shared import check_shared, lock_for_rank_0
from hyper_parallel.checkpoint._verify import Verified, verify
from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["CheckpointManager"]

# -- manager ---------------------------------------------------------------------


class CheckpointManager:
    """Numbered checkpoints under one directory, with a ``latest`` pointer and retention.

    Args:
        root: The directory holding ``step_<N>`` checkpoints.
        keep_last: How many checkpoints to keep (the newest); ``None`` keeps all.
        async_save: Save in the background (see :func:`save`); the pointer
            moves and old checkpoints go only once the new one is committed.
            The manager keeps its CPU copy of the state between saves, so
            later saves copy into it instead of allocating anew.
        lock: Hold ``root``'s writer lock (rank 0) until :meth:`close` or
            the manager is gone, so that two runs never save into one
            directory: a manager on ``root`` in another process is refused
            meanwhile. ``False`` for a manager that only loads while a run
            writes there.

    Under a process group, make it on every rank: it checks, collectively,
    that every rank sees the same ``root`` (each writes a marker file there
    and looks for the others'), before anything is saved or loaded.

    Raises:
        CheckpointError: some rank does not see the files the others wrote in
            ``root`` (a disk local to each node), or another process holds
            ``root``'s lock; the message names ``root`` and that rank or the
            holder (pid and host), on every rank alike.

    Examples:
        >>> manager = CheckpointManager("ckpt", keep_last=2)
        >>> manager.save(100, model=model, optimizer=opt, scheduler=sched)
        >>> manager.load_latest(model=model, optimizer=opt, scheduler=sched)
        100
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        lock: bool = True,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise HyperParallelValueError(
                f"keep_last must be an int >= 1 or None, got {keep_last!r}."
            )
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self._stager: DefaultStager | None = None  # one CPU copy of the state, reused
        self._unlock: weakref.finalize[Any, Any] | None = None
        check_shared(self.root)
        if lock:
            lock_for_rank_0(self.root)
            self._unlock = weakref.finalize(self, release, self.root)

    def close(self) -> None:
        """Wait for the save in flight, then give ``root``'s lock back (a manager gone does too)."""
        saver.wait()
        if self._unlock is not None:
            self._unlock()

    def path_for(self, step: int) -> Path:
        """The directory of the checkpoint at ``step``."""
        return self.root / f"step_{int(step):08d}"

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: Any | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save at ``step`` (see :func:`save`); once committed, move ``latest`` and prune.

        Returns:
            The new checkpoint's directory (still being written when asynchronous).
        """
        if self._unlock is None:
            raise CheckpointError(
                f"This CheckpointManager of {self.root} was made with lock=False, to load only; "
                "make it with lock=True (the default) to save, so that no other run saves there."
            )
        job = make_job(self.path_for(step), model, optimizer, scheduler, step, extra)
        job.on_commit = self._committed
        if self.async_save and self._stager is None:
            self._stager = new_stager()
        saver.submit(job, background=self.async_save, stager=self._stager)
        return job.target

    def _committed(self, target: Path) -> None:
        """Point ``latest`` at ``target`` and prune (rank 0, after the rename).

        ``target`` is committed already: a ``latest`` that cannot be written
        (a full disk) is a warning, not a failed save, and loads do not rely
        on it (they take the newest ``step_*``).
        """
        pointer_tmp = self.root / f".{LATEST_FILE}.tmp"
        try:
            pointer_tmp.write_text(target.name + "\n")
            os.replace(pointer_tmp, self.root / LATEST_FILE)
        except OSError as exc:
            pointer_tmp.unlink(missing_ok=True)
            warnings.warn(
                f"{target} is saved, but {self.root / LATEST_FILE} could not be updated "
                f"({exc.strerror or exc}); loads take the newest checkpoint all the same.",
                stacklevel=2,
            )
        if self.keep_last is not None:
            for _, old in step_dirs(self.root)[: -self.keep_last]:
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the save in flight (see :func:`wait`)."""
        saver.wait()

    def check(self) -> None:
        """Raise now if a background save has failed, without waiting for one in flight.

        Call it once per step to hear of a failed asynchronous save at the
        next step rather than at the next save.

        Raises:
            CheckpointError: a background save failed; the previous
                checkpoint is intact.
        """
        saver.check()

    def newest_intact(self) -> Verified | None:
        """The checkpoint :meth:`load_latest` would load, checked in this process alone; or ``None``."""
        for ckpt in candidates(self.root):
            found = verify(ckpt, read_tensors=False)  # the load reads and checks the tensors
            if found.ok:
                return found
        return None

    def latest(self) -> Path | None:
        """The newest committed checkpoint (``step_*``), or ``None``; unverified."""
        found = candidates(self.root)
        return found[0] if found else None

    def load_latest(
        self, *, model: nn.Module, optimizer: Optimizer, scheduler: Any | None = None
    ) -> int | None:
        """Load the newest intact checkpoint (see :func:`load_latest`); ``None`` if there is none."""
        return load_latest(self.root, model=model, optimizer=optimizer, scheduler=scheduler)
