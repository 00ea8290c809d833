"""``hyper-parallel train --resume`` is exact or refused, and says where it resumed.

A run killed past its last checkpoint continues from it with the same numbers,
the same metrics rows and a throughput over its own span; an option that
changes the numbers is refused before any step; a finished run is left as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_TRAIN_ARGS as TINY
from conftest import refused
from hyper_parallel.cli import main
from hyper_parallel.train import plot
from hyper_parallel.train.run import RunResult

SCRIPTS = Path(__file__).parent / "scripts"
#: 30 steps, validated every 3, saved every 10 (train loss logged every 5).
RUN = [*TINY, "--steps", "30", "--eval-every", "3", "--checkpoint-every", "10"]


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(out: Path) -> dict[str, Any]:
    run: dict[str, Any] = json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]
    return run


def _without_timing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: its ``--out`` (checkpoints under ``ckpt/``)."""
    out = tmp_path_factory.mktemp("straight")
    assert main(["train", *RUN, "--out", str(out), "--checkpoint-dir", str(out / "ckpt")]) == 0
    return out


@dataclass
class Resumed:
    """The same run killed in its 24th step (no cleanup, as SIGKILL), then resumed."""

    out: Path
    stderr: str  # what the resume printed
    plotted: list[RunResult]  # what the resume's plot drew


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    out = tmp_path_factory.mktemp("resumed")
    argv = [*RUN, "--out", str(out), "--checkpoint-dir", str(out / "ckpt")]
    killed = subprocess.run(
        [sys.executable, str(SCRIPTS / "train_with_fault.py"), "24", "0", "--", "train", *argv],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert max(r["step"] for r in _rows(out)) == 21  # a row past the step-20 checkpoint
    assert not (out / "summary.json").exists()
    plotted: list[RunResult] = []
    real_plot = plot.plot_losses

    def plot_and_keep(results: list[RunResult], path: Path, **kwargs: Any) -> None:
        plotted.extend(results)
        real_plot(results, path, **kwargs)

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(plot, "plot_losses", plot_and_keep)
        assert main(["train", *argv, "--resume"]) == 0
    return Resumed(out, stderr.getvalue(), plotted)


def test_a_resume_says_where_it_resumed(resumed: Resumed) -> None:
    where = resumed.out / "ckpt" / "muon_adamw" / "step_00000020"
    assert f"resuming from step 20 ({where})" in resumed.stderr


def test_a_resumed_run_logs_the_rows_of_an_uninterrupted_one_once_in_order(
    straight: Path, resumed: Resumed
) -> None:
    rows = _rows(resumed.out)
    assert _without_timing(rows) == _without_timing(_rows(straight))  # losses bitwise equal
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps)


def test_a_resumed_run_ends_as_the_uninterrupted_one_and_counts_its_own_span(
    straight: Path, resumed: Resumed
) -> None:
    want, got = _summary(straight), _summary(resumed.out)
    for key in ("steps", "final_train_loss", "final_val_loss", "best_val_loss"):
        assert got[key] == want[key], key
    assert (got["resumed_from_step"], want["resumed_from_step"]) == (20, 0)
    # tokens/s is this process's tokens over this process's time: 10 steps, not 30
    tokens_per_step = 8 * 32  # --batch-size x --seq-len, one process
    assert _span_tokens(got)[0] <= 10 * tokens_per_step <= _span_tokens(got)[1]
    assert _span_tokens(want)[0] <= 30 * tokens_per_step <= _span_tokens(want)[1]


def _span_tokens(run: dict[str, Any]) -> tuple[float, float]:
    """The tokens a summary's tokens/s and seconds describe, within their rounding."""
    tps, seconds = run["tokens_per_s"], run["seconds"]  # rounded to 1 and to 0.01
    return (tps - 0.5) * (seconds - 0.005), (tps + 0.5) * (seconds + 0.005)


def test_the_plot_after_a_resume_draws_the_whole_run(resumed: Resumed) -> None:
    (result,) = resumed.plotted
    (curve,) = plot.curves([result])
    assert [step for step, _ in curve.val] == list(range(0, 31, 3))
    # the points the log holds (step 1, every 5th, the last), as an uninterrupted run plots them
    assert [step for step, _ in curve.train] == [1, 5, 10, 15, 20, 25, 30]
    assert (resumed.out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_resume_of_a_finished_run_changes_nothing(
    straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {n: (straight / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}
    argv = [*RUN, "--out", str(straight), "--checkpoint-dir", str(straight / "ckpt"), "--resume"]
    capsys.readouterr()
    assert main(["train", *argv]) == 0
    assert "the run already finished: muon+adamw at step 30 (" in capsys.readouterr().err
    after = {n: (straight / n).read_bytes() for n in before}
    assert after == before
    assert _summary(straight)["final_train_loss"] is not None


# -- refusals -------------------------------------------------------------------------


@pytest.mark.usefixtures("no_step")
@pytest.mark.parametrize(
    ("change", "says"),
    [
        (["--lr", "0.01"], "--lr 0.01: the checkpoint {ckpt} was made with --lr 0.003; pass that"),
        (["--seed", "1"], "--seed 1: the checkpoint {ckpt} was made with --seed 0; pass that"),
        (["--muon-lr", "0.01"], "was made with --muon-lr 0.006"),
        (["--steps", "40"], "--steps 40: the checkpoint {ckpt} was made with --steps 30"),
        (["--warmup-steps", "3"], "--warmup-steps 3: the checkpoint {ckpt} was made with --warmup-steps 1"),
        (["--batch-size", "4"], "--batch-size 4: the checkpoint {ckpt} was made with --batch-size 8"),
        (["--weight-decay", "0.1"], "was made with --weight-decay 0.0"),
        (["--scheduler", "linear"], "was made with --scheduler cosine"),
        (["--partitioner", "by_family"], "was made with --partitioner by_shape"),
        (["--dim", "64"], "--dim 64: the checkpoint {ckpt} was made with --dim 32"),
        (["--tied-embeddings"], "--tied-embeddings: the checkpoint {ckpt} was made with no --tied-embeddings"),
        (["--positions", "rotary"], "--positions rotary: the checkpoint {ckpt} was made with --positions learned; pass that"),
    ],
)  # fmt: skip
def test_a_resume_that_would_change_the_numbers_is_refused_naming_the_flag(
    straight: Path,
    tmp_path: Path,
    change: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = straight / "ckpt"
    argv = [*RUN, "--checkpoint-dir", str(ckpt), "--resume", "--out", str(tmp_path / "b")]
    line = refused([*argv, *change], capsys)
    assert says.replace("{ckpt}", str(ckpt / "muon_adamw" / "step_00000030")) in line, line
    assert line.endswith("or start without --resume")


def test_the_same_warmup_given_explicitly_is_no_change(straight: Path, tmp_path: Path) -> None:
    ckpt = straight / "ckpt"
    argv = [*RUN, "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "b"), "--resume"]
    assert main(["train", *argv, "--warmup-steps", "1"]) == 0  # 5% of 30 steps is 1


def test_other_data_is_refused_and_moved_data_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 200
    first, moved, other = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    first.write_text(text)
    moved.write_text(text)
    other.write_text(text.upper())
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--steps", "2", "--eval-every", "2", "--checkpoint-dir", str(ckpt)]
    assert main(["train", *argv, "--data", str(first), "--out", str(tmp_path / "o1")]) == 0
    assert (
        main(["train", *argv, "--data", str(moved), "--out", str(tmp_path / "o2"), "--resume"]) == 0
    )
    resume_other = [*argv, "--data", str(other), "--out", str(tmp_path / "o3"), "--resume"]
    line = refused(resume_other, capsys)
    assert f"--data {other}: the checkpoint {ckpt / 'muon_adamw' / 'step_00000002'}" in line
    assert f"was made with other data ({first}, --tokenizer char)" in line
    assert line.endswith("resume with that --data and --tokenizer, or start without --resume")
