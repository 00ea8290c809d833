"""One writer per checkpoint folder: an advisory lock held while a process saves there.

The lock is ``flock`` on ``<root>/.lock``, which names its holder (pid and
host) and is removed when the holder lets go. The kernel drops it when the
holder's process ends, however it ends, so a lock (and its file) left by a
killed run is simply taken by the next one. On a network
file system ``flock`` is as good as the file system makes it: NFSv4 (Linux
clients since 2.6.12) and Lustre mounted with ``-o flock`` lock across
machines; where the file system cannot lock at all (``ENOLCK``,
``EOPNOTSUPP``), the folder goes unlocked, with a warning.
"""

from __future__ import annotations

import errno
import os
import socket
import warnings
from pathlib import Path
from typing import IO

from hyper_parallel.checkpoint._errors import CheckpointError

__all__ = ["LOCK_FILE", "hold", "release"]

LOCK_FILE = ".lock"

_held: dict[Path, IO[str]] = {}  # the folders this process holds: their open lock files
_holders: dict[Path, int] = {}  # how many holds of each (managers of one folder in one process)


def hold(root: Path) -> None:
    """Hold ``root``'s lock for this process until as many :func:`release` calls, or its exit.

    Raises:
        CheckpointError: another process holds it; the message names it.
    """
    import fcntl

    root = Path(root).resolve()
    if root in _held:
        _holders[root] += 1
        return
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    while True:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise CheckpointError(
                    f"{root} is in use by another run ({_holder(path)}); wait for it to end, or "
                    "save to another directory."
                ) from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                warnings.warn(
                    f"{root}: the file system cannot lock files ({exc.strerror}); a second run "
                    "saving to this directory would not be stopped.",
                    stacklevel=2,
                )
                return
            raise
        if _same_file(handle, path):
            break
        handle.close()  # its holder removed the file as we opened it: lock the new one
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    _held[root] = handle
    _holders[root] = 1


def _holder(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip() or "a process that has not said who"
    except OSError:
        return "a process that has just ended"


def _same_file(handle: IO[str], path: Path) -> bool:
    """Whether ``handle`` is still the file at ``path`` (not one its last holder removed)."""
    try:
        return os.fstat(handle.fileno()).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def release(root: Path) -> None:
    """Undo one :func:`hold` of ``root``; the last gives the lock back (nothing if not held)."""
    root = Path(root).resolve()
    if root not in _held:
        return
    _holders[root] -= 1
    if not _holders[root]:
        del _holders[root]
        (root / LOCK_FILE).unlink(missing_ok=True)  # still holding it: no one else has it
        _held.pop(root).close()  # closing the file drops the flock
