"""Nothing wrong is kept: no checkpoint holds NaN or Inf, and a load that fails changes nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import _batch, _build, _train
from test_checkpoint_integrity import _assert_untouched, _snapshot

from conftest import TINY_TRAIN_ARGS
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    NonFiniteStateError,
    _load,
    _save,
)
from hyper_parallel.checkpoint._integrity import MANIFEST, checksum_share, write_manifest
from hyper_parallel.checkpoint._tensors import read_metadata
from hyper_parallel.cli import main
from hyper_parallel.core.optimizer._nonfinite import non_finite_state


def _momentum(opt: Any) -> torch.Tensor:
    muon = opt.optimizers["muon"]
    return next(s["momentum_buffer"] for s in muon.state.values() if "momentum_buffer" in s)


def test_non_finite_state_is_named_and_a_save_of_it_writes_nothing(tmp_path: Path) -> None:
    model, opt, sched = built = _build()
    _train(*built, _batch(), 1)
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, model=model, optimizer=opt, scheduler=sched)
    assert non_finite_state(model, opt) == []
    _momentum(opt)[0, 0] = float("inf")
    bad = non_finite_state(model, opt)
    assert (
        len(bad) == 1 and bad[0].startswith("muon state ") and bad[0].endswith(".momentum_buffer")
    )
    with pytest.raises(NonFiniteStateError) as raised:
        manager.save(2, model=model, optimizer=opt, scheduler=sched)
    message = str(raised.value)
    assert "\n" not in message and "momentum_buffer holds NaN or Inf" in message
    assert "previous checkpoint is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000001"]
    with pytest.raises(NonFiniteStateError):  # and in the background, refused before staging
        checkpoint.save(tmp_path / "other", model=model, optimizer=opt, step=2, async_save=True)
    checkpoint.wait()
    assert not (tmp_path / "other").exists()


def _save_unchecked(
    monkeypatch: pytest.MonkeyPatch, manager: CheckpointManager, step: int, built: Any
) -> None:
    """A save as an older version (or a hand-made file) would write it: NaN and all."""
    with monkeypatch.context() as patch:
        patch.setattr(_save, "_refuse_non_finite", lambda *_: None)
        manager.save(step, model=built[0], optimizer=built[1], scheduler=built[2])


def test_verify_and_load_latest_pass_over_a_checkpoint_holding_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built = _build()
    _train(*built, _batch(), 1)
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, model=built[0], optimizer=built[1], scheduler=built[2])
    after_one = _snapshot(built)
    _train(*built, _batch(), 1)
    with torch.no_grad():
        built[0].lm_head.weight[1, 2] = float("nan")
    _save_unchecked(monkeypatch, manager, 2, built)

    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok ") and "step_00000001" in lines[0]
    assert lines[1].startswith("BAD ") and "model.lm_head.weight" in lines[1]
    assert "NaN or Inf" in lines[1]

    fresh = _build()
    with pytest.warns(
        UserWarning, match=r"Skipping step_00000002: .*NaN or Inf in model.lm_head.weight"
    ):
        assert manager.load_latest(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]) == 1
    _assert_untouched(fresh, after_one)


def _last_tensor_zeroed_and_resealed(ckpt: Path) -> str:
    """Zero the bytes of the file's last tensor and re-seal the manifest, as a faulty writer would."""
    metadata = read_metadata(ckpt)
    index, info = max(metadata.storage_data.items(), key=lambda item: item[1].offset)
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)
    path.write_bytes(bytes(data))
    meta = json.loads((ckpt / MANIFEST).read_text())
    for key in ("files", "checksum_algorithm", "manifest_xxh3_64"):
        del meta[key]
    write_manifest(ckpt, meta, checksum_share(ckpt))
    return str(index.fqn)


@pytest.mark.parametrize("stepped", [True, False], ids=["trained", "never-stepped"])
def test_a_load_that_fails_part_way_changes_nothing_and_names_the_tensor(
    tmp_path: Path, stepped: bool
) -> None:
    saved = _build()
    _train(*saved, _batch(), 3)
    ckpt = checkpoint.save(
        tmp_path / "ckpt", model=saved[0], optimizer=saved[1], scheduler=saved[2], step=3
    )
    bad_tensor = _last_tensor_zeroed_and_resealed(ckpt)
    found = checkpoint.verify(ckpt)  # the checksums hold: reading the tensors finds it
    assert found.line().startswith("CORRUPT") and bad_tensor in found.line()

    into = _build()
    if stepped:
        _train(*into, _batch()[:2], 2)
    before = _snapshot(into)
    with pytest.raises(CorruptCheckpointError) as raised:
        checkpoint.load(ckpt, model=into[0], optimizer=into[1], scheduler=into[2])
    message = str(raised.value)
    assert "\n" not in message and "does not fit" not in message
    assert bad_tensor in message and "__0_0.distcp" in message and "cannot be read" in message
    if not stepped:  # its lazy state, made to load into, is gone again
        assert all(not opt.state for opt in into[1].optimizers.values())
    _assert_untouched(into, before)


def test_a_checkpoint_pruned_while_it_is_read_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _build()
    _train(*saved, _batch(), 1)
    ckpt = checkpoint.save(tmp_path / "ckpt", model=saved[0], optimizer=saved[1], step=1)
    real_load = _load._dcp_load

    def pruned_first(*args: Any, **kwargs: Any) -> Any:
        shutil.rmtree(ckpt)  # what a writer's retention does to a reader made with lock=False
        return real_load(*args, **kwargs)

    monkeypatch.setattr(_load, "_dcp_load", pruned_first)
    into = _build()
    before = _snapshot(into)
    with pytest.raises(CheckpointError, match="was removed while it was read") as raised:
        checkpoint.load(ckpt, model=into[0], optimizer=into[1])
    assert "does not fit" not in str(raised.value)
    _assert_untouched(into, before)


def test_a_checkpoint_of_other_shapes_does_not_fit_and_names_the_tensor(tmp_path: Path) -> None:
    saved = _build()
    ckpt = checkpoint.save(tmp_path / "ckpt", model=saved[0], optimizer=saved[1], step=0)
    other = _build(dim=24)
    before = _snapshot(other)
    with pytest.raises(
        CheckpointError, match=r"does not fit the objects given: model\.\S+ is \["
    ) as raised:
        checkpoint.load(ckpt, model=other[0], optimizer=other[1])
    assert "\n" not in str(raised.value)
    _assert_untouched(other, before)


def test_a_checkpoint_without_checksums_is_unverified_never_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = _build()
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, model=built[0], optimizer=built[1], scheduler=built[2])
    manifest = manager.path_for(1) / MANIFEST
    meta = json.loads(manifest.read_text())
    for key in ("files", "checksum_algorithm", "manifest_xxh3_64"):
        del meta[key]
    manifest.write_text(json.dumps({**meta, "version": 1}))  # as format 1 wrote it
    with pytest.warns(UserWarning, match="saved without checksums") as warned:
        assert main(["checkpoint", "verify", str(tmp_path)]) == 0
        for _ in range(2):
            checkpoint.load(manager.path_for(1), model=built[0], optimizer=built[1])
    assert len(warned) == 1  # once per checkpoint, however often it is read
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok?") and out[-1] == "1 intact, 1 unverified"
    # the command line prints it as one line, without Python's source line
    cli = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "checkpoint", "verify", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (line,) = cli.stderr.splitlines()
    assert line.startswith("hyper-parallel: warning: ") and "saved without checksums" in line


def _train_cli(tmp_path: Path, *args: str) -> int:
    return main(["train", *TINY_TRAIN_ARGS, "--steps", "12", "--out", str(tmp_path / "out"), *args])


def test_a_run_whose_params_go_non_finite_stops_with_one_line_and_keeps_no_bad_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    huge = [
        "--lr",
        "3e38",
        "--muon-lr",
        "3e38",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        str(ck),
    ]
    assert _train_cli(tmp_path, *huge) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped at step" in err[0] and "NaN or Inf" in err[0], err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    run = summary["runs"]["muon+adamw"]
    assert summary["exit_code"] == 3 and run["non_finite"] in err[0]
    assert (tmp_path / "out" / "loss_curves.png").is_file()
    saved = sorted(ck.glob("*/step_*"))
    assert saved and all(
        checkpoint.verify(p).intact for p in saved
    )  # each tensor read back: finite
    assert main(["outcome", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().out.startswith("failed: NaN/Inf")


def test_the_loop_tells_a_bad_batch_from_lost_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without checkpoints, NaN params are found from the loss alone: stopped at once, exit 3."""
    from hyper_parallel.train import run

    real = run.step_if_finite
    calls = {"n": 0}

    def poisoned(optimizer: Any) -> bool:
        calls["n"] += 1
        stepped = real(optimizer)
        if calls["n"] == 4:  # after step 4 a param goes NaN: step 5's loss is NaN
            with torch.no_grad():
                next(iter(optimizer.optimizers["muon"].param_groups[0]["params"])).fill_(
                    float("nan")
                )
        return stepped

    monkeypatch.setattr(run, "step_if_finite", poisoned)
    assert _train_cli(tmp_path) == 3
    err = capsys.readouterr().err
    assert "stopped at step 5: the loss is nan and" in err, err
    assert (
        json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]["muon+adamw"]["steps"]
        == 4
    )


def test_a_diverging_run_says_so_once_and_a_healthy_one_says_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train_cli(tmp_path / "big", "--lr", "1e4", "--muon-lr", "1e4") == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "the loss has not fallen by step 10" in err, err
    summary = json.loads((tmp_path / "big" / "out" / "summary.json").read_text())
    assert "not learning" in summary["runs"]["muon+adamw"]["diverged"]
    assert _train_cli(tmp_path / "ok", "--compare", "adamw") == 0
    assert "warning" not in capsys.readouterr().err
    summary = json.loads((tmp_path / "ok" / "out" / "summary.json").read_text())
    assert all(run["diverged"] is None for run in summary["runs"].values())


def test_the_divergence_rule() -> None:
    from hyper_parallel.train.divergence import DivergenceWatch

    def said(losses: list[float], warmup: int = 0) -> list[int]:
        watch = DivergenceWatch.for_warmup(warmup)
        return [step for step, loss in enumerate(losses, 1) if watch.observe(step, loss)]

    assert said([3.7] * 30) == [10]  # flat: not learning, said at the end of the stretch
    assert said([3.7] * 30, warmup=20) == [20]
    falling = [3.7 - 0.05 * i for i in range(30)]
    assert said(falling) == []
    assert said(falling[:15] + [3.8] * 15) == [20]  # back above the start: diverging, once
    assert said([3.7, 5.0, 4.8, 4.4, 3.5, 3.0, 2.8, 2.6, 2.5, 2.4] + [2.3] * 20) == []  # a spike


def test_outcome_answers_for_a_run_with_its_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["outcome", str(tmp_path)]) == 1  # no summary: it crashed
    assert capsys.readouterr().out.startswith("failed:")
    runs = {"muon+adamw": {"steps": 4, "preempted": True, "interrupted": False}}
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}))  # no exit_code: computed
    assert main(["outcome", str(tmp_path)]) == 143
    assert capsys.readouterr().out.startswith("preempted: requeue it with --resume")


def test_a_scheduler_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    from hyper_parallel import get_hyper_lr_scheduler

    saved = _build()
    _train(*saved, _batch(), 2)
    ckpt = checkpoint.save(
        tmp_path / "ckpt", model=saved[0], optimizer=saved[1], scheduler=saved[2], step=2
    )
    model, opt, _ = _build()
    other = get_hyper_lr_scheduler(opt, "cosine", total_steps=20, warmup_steps=2)
    before = _snapshot((model, opt, other))
    with pytest.raises(CheckpointError, match="does not fit the scheduler given") as raised:
        checkpoint.load(ckpt, model=model, optimizer=opt, scheduler=other)
    assert "\n" not in str(raised.value)
    assert all(not o.state for o in opt.optimizers.values())
    _assert_untouched((model, opt, other), before)


def test_a_read_failure_no_tensor_reproduces_is_not_taken_for_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory while reading is no reason to fall back to an older checkpoint."""
    built = _build()
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        _train(*built, _batch(), 1)
        manager.save(step, model=built[0], optimizer=built[1], scheduler=built[2])

    def out_of_memory(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(_load, "_dcp_load", out_of_memory)
    fresh = _build()
    with pytest.raises(CheckpointError, match="out of memory") as raised:
        manager.load_latest(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert not isinstance(raised.value, CorruptCheckpointError) and "step_00000002" in str(
        raised.value
    )


def test_a_refused_requeue_of_a_preempted_run_is_not_answered_as_preempted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    runs = {"muon+adamw": {"steps": 4, "preempted": True, "interrupted": False}}
    (out / "summary.json").write_text(json.dumps({"runs": runs, "exit_code": 143}))
    assert main(["outcome", str(out)]) == 143
    with pytest.raises(SystemExit) as refused:  # no --checkpoint-dir: refused before training
        main(["train", "--out", str(out), "--resume"])
    assert refused.value.code == 2
    assert main(["outcome", str(out)]) == 1  # the last attempt failed: not requeued
    assert capsys.readouterr().out.splitlines()[-1].startswith("failed:")
