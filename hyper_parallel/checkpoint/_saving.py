"""Writing a checkpoint, in the caller's thread or behind training: at most one save in flight.

A save is one :class:`SaveJob`: DCP writes the tensors into
``<parent>/.tmp-<name>``, every rank fsyncs and checksums its share of the
files, and rank 0 writes the manifest, renames the directory into place and
runs the commit hook (the manager's ``latest`` pointer and retention). A crash
at any point before the rename leaves only a ``.tmp-`` directory, which no load
reads.

An asynchronous save first copies the state to CPU memory (DCP's stager), so
training may change the model as soon as :meth:`Saver.submit` returns; the job
then runs in a background thread. Under a process group that thread talks only
over a gloo group of its own, so its collectives never interleave with the
training step's.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hyper_parallel.checkpoint._errors import interrupt_in, is_dist, rank, reason, save_failed
from hyper_parallel.checkpoint._integrity import checksum_share, fsync_dir, write_manifest

__all__ = ["SaveJob", "Saver", "make_writer", "new_stager", "saver"]

# A save without a process group is meant to be one process's; DCP says so on every
# call, from whichever thread writes. ``warnings.catch_warnings`` is not thread-safe,
# so this one message is filtered for the process instead.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
    "is to save in a single process",
    category=UserWarning,
)


def make_writer(directory: Path) -> FileSystemWriter:
    """The DCP writer of one checkpoint directory (a seam for tests that need a slow disk)."""
    return FileSystemWriter(directory)


@dataclass
class SaveJob:
    """Everything one save writes, and where; :meth:`run` on every rank."""

    tensors: dict[str, Any]
    meta: dict[str, Any]
    target: Path
    on_commit: Callable[[Path], None] | None = None

    @property
    def tmp(self) -> Path:
        return self.target.parent / f".tmp-{self.target.name}"

    def prepare(self) -> None:
        """Make an empty ``tmp`` directory (rank 0; call before :meth:`run`, then barrier)."""
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():  # left by a crashed save
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()

    def run(self, group: dist.ProcessGroup | None) -> None:
        """Write, checksum and commit, talking over ``group`` (the default one if ``None``).

        A failure before the commit (the rename) removes ``tmp`` (rank 0) and
        raises; the checkpoints already there are untouched.
        """
        try:
            dcp_save(
                self.tensors,
                storage_writer=make_writer(self.tmp),
                process_group=group,
                no_dist=not is_dist(),
            )
            files = checksum_share(self.tmp, group)
            if rank() == 0:
                write_manifest(self.tmp, self.meta, files)
                _replace(self.tmp, self.target)
        except BaseException as exc:
            full = _out_of_space(self.tmp, exc)
            if rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if full is not None:
                raise full from exc
            raise
        if rank() == 0 and self.on_commit is not None:
            self.on_commit(self.target)
        if is_dist():
            dist.barrier(group=group)


#: Free bytes under which a write that failed without an ``OSError`` is taken for a full disk.
_NEARLY_FULL = 1 << 20


def _out_of_space(tmp: Path, exc: BaseException) -> OSError | None:
    """An ``ENOSPC`` error for a failure that a full disk caused but does not say so, else ``None``.

    torch's writer reports a short write as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``; read before the partial files go,
    the file system's free space names the cause.
    """
    if isinstance(exc, OSError) or interrupt_in(exc) is not None:
        return None
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        return None
    if free >= _NEARLY_FULL:
        return None
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)", str(tmp))


def _replace(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` directory to ``target``, replacing an older one, durably."""
    old = target.parent / f".old-{target.name}"
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def new_stager() -> DefaultStager:
    """A stager that copies state to plain CPU memory, in the caller's thread.

    It keeps its copies' storage for the next :meth:`~DefaultStager.stage` of
    the same tensors, so a manager that keeps one stages later saves by a plain
    copy, without allocating (and faulting in) fresh memory each time.
    """
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


class Saver:
    """Runs save jobs, at most one at a time; the one behind every save of this process."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._running: SaveJob | None = None
        self._failure: tuple[Path, BaseException] | None = None
        self._group: dist.ProcessGroup | None = None
        self._world: object = None  # the default group ``_group`` was made under
        atexit.register(self._report_at_exit)

    def submit(
        self, job: SaveJob, *, background: bool, stager: DefaultStager | None = None
    ) -> None:
        """Run ``job`` now, or stage it and run it in the background.

        Waits for the save in flight first, and raises its failure if it had one.
        A background job is staged by ``stager`` (kept by the caller for its
        next save), or by a stager of its own that is closed after the write.
        """
        self.wait()
        if rank() == 0:
            job.prepare()
        if is_dist():
            dist.barrier()
        if not background:
            try:
                job.run(None)
            except BaseException as exc:
                raise save_failed(job.target, exc) from exc
            return
        owned = None
        if stager is None:
            stager = owned = new_stager()
        staged = stager.stage(job.tensors)
        assert isinstance(staged, dict)
        job.tensors = staged
        group = self._background_group()
        self._running = job
        self._thread = threading.Thread(
            target=self._run, args=(job, group, owned), name="hyper_parallel-checkpoint"
        )
        self._thread.start()

    def _run(
        self, job: SaveJob, group: dist.ProcessGroup | None, owned: DefaultStager | None
    ) -> None:
        try:
            job.run(group)
        except BaseException as exc:  # surfaced by wait()
            self._failure = (job.target, exc)
        finally:
            if owned is not None:
                owned.close()

    def _background_group(self) -> dist.ProcessGroup | None:
        """A gloo group for the background thread alone (collective: every rank, main thread)."""
        if not is_dist():
            return None
        if self._group is None or self._world is not dist.group.WORLD:
            self._group = dist.new_group(backend="gloo")
            self._world = dist.group.WORLD
        return self._group

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written in the background, or ``None``."""
        thread, job = self._thread, self._running
        return job.target if thread is not None and thread.is_alive() and job else None

    def wait(self) -> None:
        """Block until the save in flight is committed.

        Raises:
            CheckpointError: the save in flight (or an earlier background one) failed.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = self._running = None
        self._raise_failure()

    def check(self) -> None:
        """Raise the failure of a background save that has ended; never waits.

        Raises:
            CheckpointError: a background save failed (the same error
                :meth:`wait` raises, raised once).
        """
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            target, exc = self._failure
            self._failure = None
            raise save_failed(target, exc, background=True) from exc

    def _report_at_exit(self) -> None:
        # the interpreter joined the (non-daemon) thread before atexit runs
        if self._failure is not None:
            target, exc = self._failure
            print(
                f"hyper_parallel: the asynchronous save of {target} failed: {reason(exc)}",
                file=sys.stderr,
            )


saver = Saver()
