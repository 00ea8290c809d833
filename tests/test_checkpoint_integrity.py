"""Checkpoints that never load wrong values: checksums, fallback, verify, async save, FSDP."""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from test_checkpoint import _assert_same, _batch, _build, _train

from conftest import TINY_TRAIN_ARGS
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    _saving,
)
from hyper_parallel.checkpoint._integrity import MANIFEST
from hyper_parallel.cli import main

TESTS = Path(__file__).parent


def _snapshot(built: tuple[Any, Any, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Deep copies of a model, optimizer and scheduler state, to compare against later."""
    model, opt = copy.deepcopy((built[0], built[1]))  # together: the copies share their params
    return model, opt, copy.deepcopy(built[2].state_dict())


def _assert_untouched(built: tuple[Any, Any, Any], before: tuple[Any, Any, dict[str, Any]]) -> None:
    _assert_same((built[0], built[1], None), (before[0], before[1], None))
    assert built[2].state_dict() == before[2]


def _flip(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint at step 3 of a trained model, optimizer and scheduler."""
    built = _build()
    _train(*built, _batch(), 3)
    root = tmp_path_factory.mktemp("saved")
    return checkpoint.save(
        root / "ckpt", model=built[0], optimizer=built[1], scheduler=built[2], step=3
    )


def test_every_single_bit_flip_and_truncation_is_refused_and_changes_nothing(
    saved: Path, tmp_path: Path
) -> None:
    ckpt = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    files = sorted(p.name for p in ckpt.iterdir())
    assert MANIFEST in files and ".metadata" in files and any(f.endswith(".distcp") for f in files)
    built = _build()  # a different state: an untrained model with fresh optimizers
    _train(*built, _batch(), 1)
    before = _snapshot(built)
    rng = random.Random(16)
    for flip in range(24):
        name = files[flip % len(files)]  # every file gets its share of the flips
        offset, bit = rng.randrange((ckpt / name).stat().st_size), rng.randrange(8)
        _flip(ckpt / name, offset, bit)
        with pytest.raises(CorruptCheckpointError, match=f"is corrupt.*{name}"):
            checkpoint.load(ckpt, model=built[0], optimizer=built[1], scheduler=built[2])
        _assert_untouched(built, before)
        _flip(ckpt / name, offset, bit)  # mended: the next flip is the only one
    distcp = next(ckpt.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=f"{distcp.name} is truncated"):
        checkpoint.load(ckpt, model=built[0], optimizer=built[1], scheduler=built[2])
    distcp.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"{distcp.name} is missing"):
        checkpoint.load(ckpt, model=built[0], optimizer=built[1], scheduler=built[2])
    (ckpt / MANIFEST).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=f"{MANIFEST} cannot be read"):
        checkpoint.load(ckpt, model=built[0], optimizer=built[1], scheduler=built[2])
    _assert_untouched(built, before)


def test_an_intact_checkpoint_still_loads_bitwise(saved: Path) -> None:
    built = _build()
    assert checkpoint.load(saved, model=built[0], optimizer=built[1], scheduler=built[2]) == 3
    want = _build()
    _train(*want, _batch(), 3)
    _assert_same(built, want)


def _manager_with_steps(root: Path, steps: tuple[int, ...]) -> tuple[CheckpointManager, Any]:
    built = _build()
    manager = CheckpointManager(root)
    for step in steps:
        _train(*built, _batch(), 1)
        manager.save(step, model=built[0], optimizer=built[1], scheduler=built[2])
    return manager, built


def test_load_latest_falls_back_past_a_corrupt_newest_with_a_warning(tmp_path: Path) -> None:
    manager, _ = _manager_with_steps(tmp_path, (1, 2))
    _flip(next(manager.path_for(2).glob("*.distcp")), 10, 3)
    fresh = _build()
    with pytest.warns(UserWarning, match="Skipping step_00000002: .*is corrupt"):
        assert manager.load_latest(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]) == 1
    want = _build()
    _train(*want, _batch(), 1)
    _assert_same(fresh, want)
    (manager.path_for(1) / MANIFEST).unlink()
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError) as raised:
        checkpoint.load_latest(tmp_path, model=fresh[0], optimizer=fresh[1])
    assert "tried 2" in str(raised.value)
    assert "step_00000002" in str(raised.value) and "step_00000001" in str(raised.value)


def test_a_checkpoint_that_does_not_fit_is_not_skipped(tmp_path: Path) -> None:
    """Fallback is for corruption only: a wrong optimizer is the caller's error, said once."""
    from conftest import TinyLM
    from hyper_parallel.core.optimizer import get_hyper_optimizer

    _manager_with_steps(tmp_path, (1,))
    torch.manual_seed(0)
    other = TinyLM()
    adamw_only = get_hyper_optimizer(other, optimizers={"adamw": {"params": other.parameters()}})
    with pytest.raises(CheckpointError, match="holds optimizers") as raised:
        checkpoint.load_latest(tmp_path, model=other, optimizer=adamw_only)
    assert not isinstance(raised.value, CorruptCheckpointError)


def test_verify_cli_reports_each_checkpoint_and_exits_1_on_corruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager, _ = _manager_with_steps(tmp_path / "root", (1, 2))
    assert main(["checkpoint", "verify", str(manager.path_for(1))]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("ok") and "step_00000001" in line and "step 1" in line
    _flip(next(manager.path_for(2).glob("*.distcp")), 0, 0)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("ok") and "step_00000001" in lines[0]
    assert lines[1].startswith("CORRUPT") and "step_00000002" in lines[1] and ".distcp" in lines[1]
    assert lines[2] == "1 intact, 1 corrupt"
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "verify", str(tmp_path / "nowhere")])
    assert exited.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "verify", str(loop)])
    assert exited.value.code == 2
    assert f"{loop} is a symlink loop" in capsys.readouterr().err


# -- async save ----------------------------------------------------------------------


class _GatedWriter(torch.distributed.checkpoint.FileSystemWriter):
    """A disk that writes only once the test opens the gate (or fails when told to)."""

    gate = threading.Event()
    fail = False

    def write_data(self, plan: Any, planner: Any) -> Any:
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        if self.fail:
            raise OSError("disk full")
        return super().write_data(plan, planner)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_GatedWriter]]:
    _GatedWriter.gate = threading.Event()
    _GatedWriter.fail = False
    monkeypatch.setattr(_saving, "make_writer", _GatedWriter)
    yield _GatedWriter
    _GatedWriter.gate.set()
    with contextlib.suppress(CheckpointError):
        checkpoint.wait()


def test_training_goes_on_while_an_async_save_writes(
    tmp_path: Path, gated: type[_GatedWriter]
) -> None:
    built = _build()
    _train(*built, _batch(), 2)
    at_save = _snapshot(built)
    manager = CheckpointManager(tmp_path / "async", async_save=True)
    manager.save(2, model=built[0], optimizer=built[1], scheduler=built[2])
    _train(*built, _batch(), 3)  # the step loop advances while the writer is held
    assert _saving.saver.in_flight == manager.path_for(2)
    assert not manager.path_for(2).exists() and manager.latest() is None  # not committed yet
    gated.gate.set()
    manager.wait()
    assert manager.latest() == manager.path_for(2)
    # it holds the state at the save, bitwise as a synchronous save of that state
    sync_dir = tmp_path / "sync"
    checkpoint.save(sync_dir, model=at_save[0], optimizer=at_save[1], step=2)
    from_async, from_sync = _build(), _build()
    checkpoint.load(manager.path_for(2), model=from_async[0], optimizer=from_async[1])
    checkpoint.load(sync_dir, model=from_sync[0], optimizer=from_sync[1])
    _assert_same(from_async, from_sync)
    _assert_same(from_async, (at_save[0], at_save[1], None))


def test_a_second_save_waits_for_the_first_and_a_failure_surfaces(
    tmp_path: Path, gated: type[_GatedWriter]
) -> None:
    built = _build()
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(1, model=built[0], optimizer=built[1], scheduler=built[2])
    threading.Timer(0.3, gated.gate.set).start()
    manager.save(2, model=built[0], optimizer=built[1], scheduler=built[2])  # waits for step 1
    assert checkpoint.verify(manager.path_for(1)).ok
    manager.wait()
    gated.fail = True
    manager.save(3, model=built[0], optimizer=built[1], scheduler=built[2])
    with pytest.raises(
        CheckpointError, match=r"asynchronous save of .*step_00000003 failed.*disk full"
    ):
        manager.wait()
    assert manager.latest() == manager.path_for(2)


_KILLED_DURING_SAVE = """
import sys, time
sys.path.insert(0, {tests!r})
import torch
from test_checkpoint import _build, _train, _batch
from hyper_parallel.checkpoint import CheckpointManager, _saving

class Slow(torch.distributed.checkpoint.FileSystemWriter):
    def write_data(self, plan, planner):
        time.sleep({delay})
        return super().write_data(plan, planner)

built = _build()
manager = CheckpointManager({root!r}, async_save=True)
_train(*built, _batch(), 2)
manager.save(2, model=built[0], optimizer=built[1], scheduler=built[2])
manager.wait()
_saving.make_writer = Slow
_train(*built, _batch(), 2)
manager.save(4, model=built[0], optimizer=built[1], scheduler=built[2])
print("saving", flush=True)
"""


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_process_killed_during_an_async_save_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    proc = _start(_KILLED_DURING_SAVE.format(tests=str(TESTS), root=str(tmp_path), delay=600))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saving", proc.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (tmp_path / ".tmp-step_00000004").exists()  # the write had begun
    fresh = _build()
    assert checkpoint.load_latest(tmp_path, model=fresh[0], optimizer=fresh[1]) == 2


def test_exit_waits_for_the_async_save_in_flight(tmp_path: Path) -> None:
    proc = _start(_KILLED_DURING_SAVE.format(tests=str(TESTS), root=str(tmp_path), delay=1))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert checkpoint.verify(tmp_path / "step_00000004").ok
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


# -- train -----------------------------------------------------------------------------


def test_train_resume_falls_back_past_a_corrupt_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", *TINY_TRAIN_ARGS, "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "2", "--checkpoint-async", "--out"]  # fmt: skip
    assert main([*args, str(tmp_path / "full")]) == 0
    run_dir = tmp_path / "ck" / "muon_adamw"
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert all(checkpoint.verify(p).ok for p in run_dir.glob("step_*"))
    _flip(next((run_dir / "step_00000006").glob("*.distcp")), 5, 5)
    capsys.readouterr()
    assert main([*args, str(tmp_path / "resumed"), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "step_00000006" in err and "corrupt" in err and "resuming from step 4" in err


# -- FSDP ------------------------------------------------------------------------------


def _fsdp_corrupt_rank_1_file(rank: int, world_size: int, root: str) -> None:
    from test_checkpoint import _fsdp_build
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    built = _fsdp_build(mesh)
    _train(*built, _batch(), 2)
    manager = CheckpointManager(root, async_save=True)  # the background group's path
    manager.save(2, model=built[0], optimizer=built[1], scheduler=built[2])
    manager.wait()
    torch.distributed.barrier()
    if rank == 0:
        _flip(manager.path_for(2) / "__1_0.distcp", 100, 2)
    torch.distributed.barrier()
    start = time.monotonic()
    try:
        checkpoint.load(manager.path_for(2), model=built[0], optimizer=built[1])
    except CorruptCheckpointError as exc:
        assert "__1_0.distcp" in str(exc), exc
        Path(root, f"raised{rank}").write_text(f"{time.monotonic() - start:.1f}")
        return
    raise AssertionError(f"rank {rank} loaded a corrupt checkpoint")


def test_fsdp_a_corrupt_file_of_rank_1_fails_both_ranks(tmp_path: Path) -> None:
    run_distributed(_fsdp_corrupt_rank_1_file, world_size=2, args=(str(tmp_path),))
    assert (tmp_path / "raised0").exists() and (tmp_path / "raised1").exists()
    assert max(float((tmp_path / f"raised{r}").read_text()) for r in (0, 1)) < 60


def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    ckpt = Path(shutil.copytree(saved, tmp_path / "old"))
    meta = json.loads((ckpt / MANIFEST).read_text())
    for key in ("files", "checksum_algorithm", "manifest_xxh3_64"):
        del meta[key]
    (ckpt / MANIFEST).write_text(json.dumps({**meta, "version": 1}))  # as format 1 wrote it
    built = _build()
    with pytest.warns(UserWarning, match="saved without checksums.*loaded unverified"):
        assert checkpoint.load(ckpt, model=built[0], optimizer=built[1], scheduler=built[2]) == 3
    want = _build()
    _train(*want, _batch(), 3)
    _assert_same(built, want)
    assert main(["checkpoint", "verify", str(ckpt)]) == 0  # warned once already, at the load
    assert capsys.readouterr().out.startswith("ok?")
