"""``hyper-parallel train --qk-clip-threshold``: logits held at the threshold, logged and summed up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from distributed import run_distributed

from conftest import TINY_TRAIN_ARGS as TINY
from conftest import refused
from hyper_parallel.cli import main
from hyper_parallel.train import TrainConfig, train

#: What each logged row of a clipping run holds (``QKClipStats.as_dict``).
QK_KEYS = {"qk_max_logit", "qk_max_logit_after", "qk_heads_clipped", "qk_heads"}

#: A tiny built-in model at a Muon lr high enough that its largest logit grows from 0.05
#: to past 200 in 40 steps, every step logged.
HIGH_LR: dict[str, Any] = {
    "dim": 32, "layers": 1, "heads": 2, "seq_len": 32, "batch_size": 8, "steps": 40,
    "muon_lr": 0.5, "eval_every": 40, "eval_batches": 4, "log_every": 1, "progress": False,
    "threads": 1,
}  # fmt: skip
TAU = 10.0


def _train(out: Path, **options: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's summary entry and its logged train rows."""
    summary = train(TrainConfig(out=out, **{**HIGH_LR, **options}), echo=lambda _: None)
    (run,) = summary["runs"].values()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return run, [r for r in rows if "train_loss" in r]


def test_a_high_lr_run_held_at_tau_stays_under_it_and_its_loss_is_no_worse(
    tmp_path: Path,
) -> None:
    plain, plain_rows = _train(tmp_path / "plain")
    # a threshold no head reaches: tracked and measured, scaled by exactly 1, so the same run
    watched, watched_rows = _train(tmp_path / "watched", qk_clip_threshold=1e9)
    clipped, clipped_rows = _train(tmp_path / "clipped", qk_clip_threshold=TAU)

    assert [r["train_loss"] for r in watched_rows] == [r["train_loss"] for r in plain_rows]
    assert plain["qk_clip"] is None and not QK_KEYS & set(plain_rows[-1])
    grown = [r["qk_max_logit"] for r in watched_rows]
    assert grown[0] < 1 and max(grown) > 10 * TAU, grown  # the logits explode without the clip
    assert watched["qk_clip"]["heads_clipped"] == 0
    assert watched["qk_clip"]["max_logit"] == watched["qk_clip"]["max_logit_after"] == max(grown)

    assert len(clipped_rows) == HIGH_LR["steps"]
    for row in clipped_rows:  # every step, after its clip
        assert set(row) >= QK_KEYS and row["qk_heads"] == 2
        assert row["qk_max_logit_after"] <= TAU * (1 + 1e-4), row
        assert (row["qk_heads_clipped"] > 0) == (row["qk_max_logit"] > TAU), row
    assert clipped["qk_clip"] == {
        "threshold": TAU,
        "alpha": 0.5,
        "max_logit": max(r["qk_max_logit"] for r in clipped_rows),
        "max_logit_after": max(r["qk_max_logit_after"] for r in clipped_rows),
        "heads_clipped": sum(r["qk_heads_clipped"] for r in clipped_rows),
        "steps_clipped": sum(r["qk_heads_clipped"] > 0 for r in clipped_rows),
        "heads": 2,
    }
    assert clipped["qk_clip"]["steps_clipped"] > HIGH_LR["steps"] // 2
    # no worse: both the last step's loss and the validation loss (measured at 2.82 and 2.87
    # with the clip, against 2.87 and 2.91 without)
    assert clipped["final_train_loss"] < plain["final_train_loss"]
    assert clipped["final_val_loss"] < plain["final_val_loss"]


def test_the_flags_log_each_step_and_sum_up_for_the_muon_run_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", *TINY, "--steps", "6", "--eval-every", "6", "--muon-lr", "0.5",
            "--optimizer", "muon", "--compare", "adamw", "--qk-clip-threshold", "0.5",
            "--qk-clip-alpha", "0.25", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {run: [r for r in rows if r["run"] == run and "train_loss" in r]
              for run in ("muon", "adamw")}  # fmt: skip
    assert [r["step"] for r in logged["muon"]] == [1, 5, 6]
    assert all(set(r) >= QK_KEYS and r["qk_max_logit_after"] <= 0.5 * (1 + 1e-4)
               for r in logged["muon"])  # fmt: skip
    assert not any(QK_KEYS & set(r) for r in logged["adamw"])  # the baseline does not clip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["qk_clip_threshold"] == 0.5
    figures = summary["runs"]["muon"]["qk_clip"]
    assert summary["runs"]["adamw"]["qk_clip"] is None
    assert (figures["threshold"], figures["alpha"], figures["heads"]) == (0.5, 0.25, 2)
    assert figures["max_logit"] >= max(r["qk_max_logit"] for r in logged["muon"])
    assert figures["heads_clipped"] >= sum(r["qk_heads_clipped"] for r in logged["muon"]) > 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("muon:")]
    assert (
        f"QK-clip at 0.5: max logit {figures['max_logit']:.2f} "
        f"({figures['max_logit_after']:.2f} after the clip), {figures['heads_clipped']} heads "
        f"clipped at {figures['steps_clipped']} steps"
    ) in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--optimizer", "adamw", "--qk-clip-threshold", "10"],
         "--qk-clip-threshold: --optimizer adamw has no Muon, and QK-clip runs after Muon's "
         "step; use --optimizer muon+adamw (the default) or muon, or drop --qk-clip-threshold"),
        (["--optimizer", "torch_muon", "--qk-clip-threshold", "10"],
         "--optimizer torch_muon has no Muon"),
        (["--qk-clip-threshold", "0"], "--qk-clip-threshold must be a positive number (the "
         "largest attention logit allowed), got 0.0"),
        (["--qk-clip-threshold", "-3"], "--qk-clip-threshold must be a positive number"),
        (["--qk-clip-threshold", "inf"], "--qk-clip-threshold must be a positive number"),
        (["--qk-clip-threshold", "nan"], "--qk-clip-threshold must be a positive number"),
        (["--qk-clip-threshold", "10", "--qk-clip-alpha", "1.5"],
         "--qk-clip-alpha must be between 0 and 1, got 1.5"),
        (["--qk-clip-alpha", "0.3"],
         "--qk-clip-alpha 0.3 does nothing without --qk-clip-threshold T; give both"),
    ],
)  # fmt: skip
def test_a_threshold_train_cannot_use_is_one_line_before_any_step(
    args: list[str], message: str, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refused([*TINY, *args], capsys)


def test_resuming_with_another_threshold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY, "--steps", "2", "--eval-every", "2", "--out", str(tmp_path / "run"),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--qk-clip-threshold", "5"]  # fmt: skip
    assert main(["train", *argv]) == 0
    line = refused([*argv, "--resume", "--qk-clip-threshold", "6"], capsys)
    assert "--qk-clip-threshold 6.0: the checkpoint" in line
    assert "was made with --qk-clip-threshold 5.0" in line


def _sharded_run(rank: int, world_size: int, out: str) -> None:
    """Both ranks of an FSDP run see the same figures: the maxima of every rank's batches."""
    summary = train(
        TrainConfig(out=Path(out), sharding="fsdp", qk_clip_threshold=TAU,
                    **{**HIGH_LR, "steps": 12, "eval_every": 12, "eval_batches": 1}),
        echo=lambda _: None,
    )  # fmt: skip
    figures = summary["runs"]["muon+adamw"]["qk_clip"]
    assert figures["heads_clipped"] > 0 and figures["max_logit_after"] <= TAU * (1 + 1e-4)
    Path(out, f"figures{rank}.json").write_text(json.dumps(figures))


def test_a_sharded_run_clips_on_the_maxima_of_every_rank(tmp_path: Path) -> None:
    run_distributed(_sharded_run, world_size=2, args=(str(tmp_path),))
    figures = [json.loads((tmp_path / f"figures{rank}.json").read_text()) for rank in (0, 1)]
    assert figures[0] == figures[1]  # each rank drew its own batches
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert max(r["qk_max_logit"] for r in logged) == figures[0]["max_logit"]
