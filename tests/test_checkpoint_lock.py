"""Taking over a checkpoint folder's lock from a holder that is dead: ``break_lock`` and the CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hyper_parallel.checkpoint import CheckpointError, CheckpointManager, break_lock
from hyper_parallel.checkpoint._lock import hold, release
from hyper_parallel.cli import main

#: A process that holds a folder's lock as a run does, until its stdin closes.
_HOLD = (
    "import sys\n"
    "from hyper_parallel.checkpoint._lock import hold\n"
    "hold(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)
OTHER = "pid 4242 on host other-node"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another process of this host holding ``tmp_path/run``'s lock; killed at the end."""
    root = (tmp_path / "run").resolve()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        if proc.stdout.readline() != "held\n":
            pytest.fail(f"the holder did not take the lock: {proc.stderr.read()[-3000:]}")
        yield proc, root
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def _held_elsewhere(root: Path, text: str) -> Iterator[None]:
    """``root``'s lock held as another process would hold it, its file saying ``text``.

    A flock belongs to an open file, not to a process: one taken through a
    second open of ``.lock`` stops this process's own attempts as another
    process's would, without the cost of starting one.
    """
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    (root / ".lock").write_text(f"{text}\n", encoding="utf-8")
    with open(root / ".lock", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def _ended_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def test_a_run_alive_on_this_host_is_never_taken_over(
    holder: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, root = holder
    here = socket.gethostname()
    for dead_host in (None, here):
        with pytest.raises(CheckpointError) as refused:
            break_lock(root, dead_host=dead_host)
        assert str(refused.value) == (
            f"{root} is locked by pid {proc.pid} on host {here}, this host; stop that process "
            "first, and its lock goes with it."
        )
    assert (root / ".lock").read_text() == f"pid {proc.pid} on host {here}\n"
    with pytest.raises(CheckpointError, match="in use by another run") as refused:
        hold(root)
    assert "--dead-host" not in str(refused.value)  # a lock of this host ends with its process


def test_a_lock_of_a_dead_host_is_taken_over_only_when_named(
    holder: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, root = holder
    # The holder's flock stays, its file now names another host: what NFS shows for a run
    # whose host crashed.
    (root / ".lock").write_text(f"{OTHER}\n", encoding="utf-8")
    with pytest.raises(CheckpointError) as refused:
        hold(root)
    assert str(refused.value) == (
        f"{root} is in use by another run ({OTHER}); wait for it to end, or save to another "
        "directory. If host other-node is down, `hyper-parallel checkpoint unlock "
        f"{root} --dead-host other-node` takes the lock over."
    )
    with pytest.raises(CheckpointError) as refused:
        break_lock(root)
    assert str(refused.value) == (
        f"{root} is locked by {OTHER}; check that other-node is down, then take the lock over "
        "with --dead-host other-node."
    )
    with pytest.raises(CheckpointError) as refused:
        break_lock(root, dead_host="node-7")
    assert str(refused.value) == (
        f"{root} is locked by {OTHER}, not on node-7; check that other-node is down, then take "
        "the lock over with --dead-host other-node."
    )
    assert (root / ".lock").read_text() == f"{OTHER}\n"  # refusals leave it as it was

    done = break_lock(root, dead_host="other-node")
    assert done == f"took over {root}'s lock from {OTHER}, which is down"
    assert not (root / ".lock").exists()
    manager = CheckpointManager(root)  # holds a new .lock, the old holder still on the old one
    try:
        assert proc.poll() is None
        assert (root / ".lock").read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    finally:
        manager.close()


def test_a_run_starting_as_the_lock_file_is_removed_locks_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    root = tmp_path.resolve()
    real_flock = fcntl.flock
    removed: list[int] = []

    def flock_after_removal(handle: object, operation: int) -> None:
        if not removed:  # the lock is taken over between hold()'s open and its flock
            removed.append(os.stat(root / ".lock").st_ino)
            (root / ".lock").unlink()
        real_flock(handle, operation)  # type: ignore[arg-type]

    (root / ".lock").write_text(f"{OTHER}\n", encoding="utf-8")
    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    hold(root)
    monkeypatch.undo()
    try:
        assert removed
        path = root / ".lock"
        assert path.read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
        with open(path, encoding="utf-8") as second, pytest.raises(BlockingIOError):
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the new file is the one held
    finally:
        release(root)


def test_the_file_of_an_ended_process_of_this_host(tmp_path: Path) -> None:
    root, here, pid = tmp_path.resolve(), socket.gethostname(), _ended_pid()
    (root / ".lock").write_text(f"pid {pid} on host {here}\n", encoding="utf-8")
    assert break_lock(root) == (
        f"{root} was not locked: removed the .lock left by pid {pid} on host {here}, which has "
        "ended"
    )
    assert not (root / ".lock").exists()
    # held all the same: by a process the ended one started, which inherited the open file
    with _held_elsewhere(root, f"pid {pid} on host {here}"), pytest.raises(CheckpointError) as e:
        break_lock(root, dead_host=here)
    assert str(e.value) == (
        f"{root} is locked by pid {pid} on host {here}, this host; that pid has ended, but a "
        f"process it started holds the lock: stop it first (`fuser -v {root / '.lock'}` finds it)."
    )
    assert (root / ".lock").exists()


def test_a_folder_nobody_holds_is_not_locked(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    with pytest.raises(CheckpointError) as refused:
        break_lock(root, dead_host="other-node")
    assert str(refused.value) == (
        f"{root} is not locked (it has no .lock); there is nothing to unlock, a run can save there."
    )
    (root / ".lock").write_text(f"{OTHER}\n", encoding="utf-8")  # a killed run's, elsewhere
    with pytest.raises(CheckpointError) as refused:
        break_lock(root, dead_host="other-node")
    assert str(refused.value) == (
        f"{root} is not locked (.lock names {OTHER}, which does not hold it); there is nothing "
        "to unlock, a run can save there."
    )
    manager = CheckpointManager(root)
    try:
        with pytest.raises(CheckpointError, match="locked by this process .* close its"):
            break_lock(root)
    finally:
        manager.close()


def test_unlock_command_prints_one_line_and_refuses_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = (tmp_path / "muon_adamw").resolve()
    with _held_elsewhere(root, OTHER):
        for given in ([], ["--dead-host", "node-7"]):
            with pytest.raises(SystemExit) as exited:
                main(["checkpoint", "unlock", str(root), *given])
            assert exited.value.code == 2
            (line,) = capsys.readouterr().err.splitlines()
            assert line.startswith(f"hyper-parallel: error: {root} is locked by {OTHER}")
            assert line.endswith("take the lock over with --dead-host other-node.")
        assert main(["checkpoint", "unlock", str(root), "--dead-host", "other-node"]) == 0
        assert capsys.readouterr().out.splitlines() == [
            f"took over {root}'s lock from {OTHER}, which is down"
        ]
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "unlock", str(root), "--dead-host", "other-node"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hyper-parallel: error: {root} is not locked (it has no .lock); there is nothing to "
        "unlock, a run can save there."
    ]
