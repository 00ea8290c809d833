"""One writer per checkpoint folder: an advisory lock held while a process saves there.

The lock is ``flock`` on ``<root>/.lock``, which names its holder (pid and
host) and is removed when the holder lets go. The kernel drops it when the
holder's process ends, however it ends, so a lock (and its file) left by a
killed run is simply taken by the next one. On a network
file system ``flock`` is as good as the file system makes it: NFSv4 (Linux
clients since 2.6.12) and Lustre mounted with ``-o flock`` lock across
machines; where the file system cannot lock at all (``ENOLCK``,
``EOPNOTSUPP``), the folder goes unlocked, with a warning.

A lock can outlive its holder where the file system keeps it for a host that
crashed (NFS). :func:`break_lock` takes such a lock over, once told which host
is down: it removes ``.lock``, leaving the stale lock on the orphaned file, and
the next :func:`hold` creates and locks a new one.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import warnings
from pathlib import Path
from typing import IO

from hyper_parallel.checkpoint._errors import CheckpointError

__all__ = ["LOCK_FILE", "break_lock", "hold", "release"]

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
                raise CheckpointError(_in_use(root, _holder(path))) from None
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


def _in_use(root: Path, holder: str) -> str:
    """Why :func:`hold` refuses ``root``, and the ways out."""
    message = (
        f"{root} is in use by another run ({holder}); wait for it to end, or save to another "
        "directory."
    )
    named = _parse_holder(holder)
    if named is not None and named[1] != socket.gethostname():
        # Only a lock from another host can outlive its process (NFS keeps it for a crashed
        # client); on this host the kernel drops it with the process.
        message += (
            f" If host {named[1]} is down, `hyper-parallel checkpoint unlock {root} "
            f"--dead-host {named[1]}` takes the lock over."
        )
    return message


_HOLDER = re.compile(r"pid (\d+) on host (\S+)")


def _parse_holder(text: str) -> tuple[int, str] | None:
    """The pid and host a lock file's text names; ``None`` for text :func:`hold` did not write."""
    found = _HOLDER.fullmatch(text.strip())
    return (int(found[1]), found[2]) if found else None


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def break_lock(root: Path | str, *, dead_host: str | None = None) -> str:
    """Take over ``root``'s lock from a holder that is known to be dead; returns what was done.

    A lock can outlive its holder where the file system keeps it for a host
    that crashed (NFS). Taking it over removes ``root/.lock``: the stale lock
    stays on the removed file, and the next :func:`hold` creates and locks a
    new one. What is done depends on what the lock file names:

    * No lock file, or one nobody holds: the folder is not locked; nothing is
      done (an error), except that a file naming a process of this host that
      has ended (a run that was killed) is removed.
    * Held by a process of this host: refused; stop that process and its lock
      goes with it.
    * Held by another host: taken over only if ``dead_host`` is that host.

    Naming a host that is still running lets two runs write to one folder:
    check that it is down first.

    Args:
        root: The folder holding ``.lock`` (a run's folder under
            ``--checkpoint-dir``, such as ``ckpt/muon_adamw``).
        dead_host: The host the lock names, confirming that it is down.

    Returns:
        One line saying what was done.

    Raises:
        CheckpointError: there is nothing to take over, the holder runs on this
            host, or ``dead_host`` is not the host the lock names; the message
            names ``root``, the holder and what to do.
    """
    import fcntl

    root = Path(root).resolve()
    path = root / LOCK_FILE
    if root in _held:
        raise CheckpointError(
            f"{root} is locked by this process (pid {os.getpid()}); close its "
            "CheckpointManager instead of taking the lock over."
        )
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except FileNotFoundError:
        raise CheckpointError(
            f"{root} is not locked (it has no {LOCK_FILE}); there is nothing to unlock, a run "
            "can save there."
        ) from None
    here = socket.gethostname()
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise CheckpointError(
                    f"{root} is not locked: the file system cannot lock files ({exc.strerror}); "
                    "there is nothing to unlock, a run can save there."
                ) from None
            held = True
        else:
            held = False
        text = handle.read().strip()
        named = _parse_holder(text)
        if not held:
            if named is not None and named[1] == here and not _pid_alive(named[0]):
                # A killed run's file: the kernel dropped its lock. Holding it now, remove it
                # as release() does.
                if _same_file(handle, path):
                    path.unlink(missing_ok=True)
                return (
                    f"{root} was not locked: removed the {LOCK_FILE} left by pid {named[0]} "
                    f"on host {here}, which has ended"
                )
            raise CheckpointError(
                f"{root} is not locked"
                + (f" ({LOCK_FILE} names {text}, which does not hold it)" if text else "")
                + "; there is nothing to unlock, a run can save there."
            )
        if named is None:
            raise CheckpointError(
                f"{root} is locked by a holder that does not name its pid and host "
                f"({LOCK_FILE} says {text!r}); it may be starting: try again in a moment."
            )
        pid, host = named
        if host == here:
            # The kernel drops a lock on this host with the process holding it, so someone
            # here holds it: a process the run started (it inherits the open file) if pid ended.
            raise CheckpointError(
                f"{root} is locked by pid {pid} on host {host}, this host; "
                + (
                    "stop that process first, and its lock goes with it."
                    if _pid_alive(pid)
                    else "that pid has ended, but a process it started holds the lock: stop "
                    f"it first (`fuser -v {path}` finds it)."
                )
            )
        if dead_host != host:
            raise CheckpointError(
                f"{root} is locked by pid {pid} on host {host}"
                + (f", not on {dead_host}" if dead_host is not None else "")
                + f"; check that {host} is down, then take the lock over with --dead-host {host}."
            )
        if _same_file(handle, path):  # not a new holder's file, which replaced it meanwhile
            path.unlink(missing_ok=True)
    return f"took over {root}'s lock from pid {pid} on host {host}, which is down"


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
