"""``hyper-parallel train`` keeps its promises: bad input is one line and exit 2 before any step.

Paths, data sizes, optimizers train cannot step, memory,
overwriting a run, and Ctrl-C at any moment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_TRAIN_ARGS as TINY
from conftest import refused
from hyper_parallel.cli import main
from hyper_parallel.train import run as run_module


def _train(argv: list[str]) -> int:
    return main(["train", *TINY, *argv])


# -- paths ----------------------------------------------------------------------------


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into, whoever it runs as."""
    if os.geteuid() == 0:  # root writes through mode bits; /proc takes no new files
        return Path("/proc/self/hyper-parallel-out")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked / "run"


@pytest.mark.parametrize(
    ("flag", "where", "says"),
    [
        ("--out", "file", "is a file; give a directory"),
        ("--out", "under_file", "is under {tmp}/file, which is a file; give a directory"),
        ("--out", "read_only", "is not writable"),
        ("--checkpoint-dir", "file", "is a file; give a directory"),
        ("--checkpoint-dir", "read_only", "is not writable"),
    ],
)
def test_unusable_paths_are_refused_before_any_step(
    tmp_path: Path, flag: str, where: str, says: str, no_step: None,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    (tmp_path / "file").write_text("not a directory")
    path = {
        "file": tmp_path / "file",
        "under_file": tmp_path / "file" / "run",
        "read_only": _read_only_dir(tmp_path),
    }[where]
    argv = [*TINY, "--out", str(tmp_path / "o"), flag, str(path)]
    line = refused(argv, capsys)
    assert f"{flag} {path}: " in line and says.replace("{tmp}", str(tmp_path)) in line
    assert not (tmp_path / "o").exists()


def test_a_second_run_into_the_same_out_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _train(["--steps", "2", "--eval-every", "2", "--out", str(out)]) == 0
    first = (out / "summary.json").read_text()
    line = refused([*TINY, "--steps", "3", "--out", str(out)], capsys)
    assert f"--out {out}: the directory is not empty" in line and "--overwrite" in line
    assert (out / "summary.json").read_text() == first  # the first run's results are kept
    assert _train(["--steps", "3", "--eval-every", "3", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]["steps"] == 3


# -- data -----------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "tokenizer"), [(100, "char"), (1000, "char"), (1000, "byte")])
def test_data_too_short_counts_the_whole_file(
    tmp_path: Path, size: int, tokenizer: str, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "short.txt"
    data.write_text("abcdefghij" * (size // 10))
    argv = ["--data", str(data), "--tokenizer", tokenizer, "--seq-len", "128",
            "--out", str(tmp_path / "o")]  # fmt: skip
    line = refused(argv, capsys)
    unit = "bytes" if tokenizer == "byte" else "characters"
    assert f"the file has {size:,} {unit}; --seq-len 128 needs at least 1,301" in line


def test_byte_tokenizer_reads_any_file(tmp_path: Path) -> None:
    data = tmp_path / "blob.bin"
    data.write_bytes(bytes(range(256)) * 8)  # NUL bytes and invalid UTF-8
    out = tmp_path / "o"
    argv = ["--data", str(data), "--tokenizer", "byte", "--steps", "2", "--eval-every", "2"]
    assert _train([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]["steps"] == 2


def test_argparse_never_shows_internal_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(["--steps", "abc"], capsys)
    assert "--steps: expected a whole number >= 1, got 'abc'" in line and "_positive" not in line


# -- optimizers and memory --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("lbfgs", "needs a closure"),
        ("sparseadam", "sparse gradients only"),
    ],
)
def test_optimizers_train_cannot_step_are_refused_and_marked(
    tmp_path: Path, name: str, why: str, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(["--optimizer", name, "--out", str(tmp_path / "o")], capsys)
    assert f"--optimizer {name}: train cannot use it: " in line and why in line
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert name in " ".join(capsys.readouterr().out.split())
    assert main(["plugins", "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert entries[name]["train"] is False and entries["adamw"]["train"] is True


def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_estimate(
    tmp_path: Path, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(["--batch-size", "100000", "--out", str(tmp_path / "o")], capsys)
    assert line.startswith("hyper-parallel: error: --batch-size 100000: a training step needs")
    fits = re.search(r"GiB is free; lower --batch-size to (\d+) or less, or --seq-len$", line)
    assert fits and 1 <= int(fits.group(1)) < 100000, line


def test_a_model_too_large_for_memory_is_blamed_on_its_width_not_the_batch(
    tmp_path: Path, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(["--dim", "65536", "--out", str(tmp_path / "o")], capsys)
    assert line.startswith(
        "hyper-parallel: error: --dim 65536 and --layers 4: the model's params, gradients and "
        "optimizer state alone need about "
    )
    assert line.endswith("GiB is free; lower --dim (the model grows with its square) or --layers")
    assert "--batch-size" not in line


def test_a_sequence_too_long_for_memory_is_blamed_on_its_length(
    tmp_path: Path, no_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--seq-len", "1000000", "--batch-size", "1", "--out", str(tmp_path / "o")]
    line = refused(argv, capsys)
    assert line.startswith("hyper-parallel: error: --seq-len 1000000: one sequence's activations")
    assert line.endswith("GiB is free; lower --seq-len or --dim")


# -- Ctrl-C ---------------------------------------------------------------------------


def _interrupt_on_call(monkeypatch: pytest.MonkeyPatch, target: str, at: int) -> None:
    """Make the ``at``-th call of ``run_module.<target>`` (or ``_Run.<target>``) raise Ctrl-C."""
    owner: Any = run_module._Run if hasattr(run_module._Run, target) else run_module
    real: Callable[..., Any] = getattr(owner, target)
    calls = [0]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, target, interrupted)


def test_ctrl_c_during_the_first_evaluation_leaves_no_plot_and_an_honest_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _interrupt_on_call(monkeypatch, "evaluate", 1)
    out = tmp_path / "o"
    assert _train(["--steps", "4", "--out", str(out)]) == 130
    assert not (out / "loss_curves.png").exists()
    run = json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]
    assert run["interrupted"] and run["steps"] == 0 and run["final_val_loss"] is None
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "loss_curves.png" not in captured.out


def test_ctrl_c_mid_run_says_which_step_the_last_validation_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _interrupt_on_call(monkeypatch, "step", 4)  # steps 1-3 done, validation at 0 and 2
    out = tmp_path / "o"
    assert _train(["--steps", "6", "--eval-every", "2", "--out", str(out)]) == 130
    run = json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]
    assert (run["steps"], run["final_train_step"], run["final_val_step"]) == (3, 3, 2)
    printed = capsys.readouterr().out
    assert "(at step 2)  (interrupted)" in printed
    assert "it cannot be resumed: it saved no checkpoints (--checkpoint-dir DIR" in printed
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    _interrupt_on_call(monkeypatch, "step", 4)
    saved = ["--steps", "6", "--out", str(tmp_path / "c"), "--checkpoint-dir", str(tmp_path / "k")]
    assert _train(saved) == 130
    assert "run the same command with --resume" in capsys.readouterr().out


def test_after_a_resume_metrics_hold_no_row_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, ckpt = tmp_path / "o", tmp_path / "ckpt"
    argv = ["--steps", "6", "--eval-every", "2", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2", "--out", str(out)]  # fmt: skip
    with monkeypatch.context() as patch:
        _interrupt_on_call(patch, "step", 4)  # after step 3: checkpoint 2, rows up to step 3
        assert _train(argv) == 130
    assert _train([*argv, "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["run"], r["step"], tuple(sorted(r))) for r in rows]
    assert len(keys) == len(set(keys))
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2, 4, 6]


def test_console_script_refusal_is_one_line_without_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel", "train", "--out", str(tmp_path / "file")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"hyper-parallel: error: --out {tmp_path / 'file'}: is a file; give a directory"
    )


def test_sharding_without_torchrun_names_the_command_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    line = refused([*TINY, "--sharding", "fsdp", "--out", str(tmp_path / "o")], capsys)
    assert line.endswith(
        "--sharding fsdp shards the model over the processes torchrun starts; run: torchrun "
        "--nproc_per_node 2 -m hyper_parallel train --sharding fsdp (and your other options)"
    )


def test_a_run_is_labelled_by_the_optimizers_it_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    argv = ["--steps", "2", "--eval-every", "2", "--partitioner", "by_family", "--out", str(out)]
    assert _train(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("training muon+adamw for 2 steps on built-in")  # before any step
    run = json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]
    assert run["label"] == "muon+sinkhorn+adamw"
    assert sorted(run["optimizers"]) == ["adamw", "muon", "sinkhorn"]
    assert "muon+sinkhorn+adamw: 2 steps in" in printed
