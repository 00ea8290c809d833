"""``hyper-parallel train``: outputs, learning, comparison, interruption and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY_TRAIN_ARGS as TINY
from hyper_parallel.cli import main
from hyper_parallel.train import TinyGPT, TrainConfig, plot, train
from hyper_parallel.train import threads as threads_module
from hyper_parallel.train.data import SYNTHETIC_ALPHABET, synthetic_corpus
from hyper_parallel.train.loop import _comparison_line, reached_between, steps_to_reach
from hyper_parallel.train.plot import Curve, smooth_by_step
from hyper_parallel.train.threads import choose_threads


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_every_output_and_learns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--steps",
                "30",
                "--eval-every",
                "10",
                "--lr",
                "1e-2",
                "--out",
                str(out),
                *TINY,
            ]
        )
        == 0
    )
    records = read_metrics(out)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    train = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 10, 20, 30]
    assert val[-1] < val[0] - 0.3, val  # it learned something
    assert set(train[0]["lr"]) == {"muon", "adamw"} and train[0]["tokens_per_s"] > 0
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["muon+adamw"]
    assert run["steps"] == 30 and run["final_val_loss"] == pytest.approx(val[-1])
    assert "muon+adamw: 30 steps" in capsys.readouterr().out


def test_compare_plots_both_runs_and_reports_the_step_ratio(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "train",
                "--steps",
                "12",
                "--eval-every",
                "4",
                "--compare",
                "adamw",
                "--out",
                str(out),
                *TINY,
            ]
        )
        == 0
    )
    runs = {r["run"] for r in read_metrics(out)}
    assert runs == {"muon+adamw", "adamw"}
    summary = json.loads((out / "summary.json").read_text())
    cmp = summary["comparison"]
    assert cmp["baseline"] == "adamw" and cmp["baseline_steps"] == 12
    assert cmp["target_val_loss"] == pytest.approx(summary["runs"]["adamw"]["final_val_loss"])
    if cmp["steps_to_reach"] is not None:
        assert cmp["step_ratio"] == pytest.approx(cmp["steps_to_reach"] / 12)


def test_any_registered_optimizer_by_name(tmp_path: Path) -> None:
    out = tmp_path / "sgd"
    assert (
        main(
            [
                "train",
                "--optimizer",
                "sgd",
                "--lr",
                "0.5",
                "--steps",
                "4",
                "--eval-every",
                "2",
                "--out",
                str(out),
                *TINY,
            ]
        )
        == 0
    )
    assert {k for r in read_metrics(out) if "lr" in r for k in r["lr"]} == {"sgd"}


def test_ctrl_c_stops_cleanly_and_keeps_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_loss = TinyGPT.loss

    def interrupted_loss(self: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
        if self.training:
            calls["n"] += 1
            if calls["n"] == 8:
                raise KeyboardInterrupt
        return real_loss(self, batch)

    monkeypatch.setattr(TinyGPT, "loss", interrupted_loss)
    out = tmp_path / "stop"
    assert (
        main(
            [
                "train",
                "--steps",
                "50",
                "--eval-every",
                "5",
                "--compare",
                "adamw",
                "--out",
                str(out),
                *TINY,
            ]
        )
        == 130
    )
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == ["muon+adamw"]  # the compare run never started
    assert summary["runs"]["muon+adamw"]["interrupted"]
    assert summary["runs"]["muon+adamw"]["steps"] == 7
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [0, 5]
    assert (out / "loss_curves.png").stat().st_size > 0


def test_user_text_file_char_and_byte(tmp_path: Path) -> None:
    text = tmp_path / "poem.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. ünïcode\n" * 40, encoding="utf-8")
    for tokenizer in ("char", "byte"):
        out = tmp_path / tokenizer
        args = [
            "train",
            "--data",
            str(text),
            "--tokenizer",
            tokenizer,
            "--steps",
            "3",
            "--eval-every",
            "3",
            "--out",
            str(out),
            *TINY,
        ]
        assert main(args) == 0
        assert json.loads((out / "summary.json").read_text())["data"] == str(text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "{tmp}/missing.txt"], "--data {tmp}/missing.txt: no such file"),
        (["--data", "{tmp}/empty.txt"], "--data {tmp}/empty.txt: the file is empty"),
        (["--data", "{tmp}/blob.bin"], "--data {tmp}/blob.bin: looks binary"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--optimizer", "muonn"], "--optimizer: Unknown optimizer 'muonn'"),
        (["--compare", "adamx"], "--compare: Unknown optimizer 'adamx'"),
        (["--scheduler", "cosin"], "--scheduler: Unknown LR schedule 'cosin'"),
        (["--sharding", "ddp"], "--sharding ddp: train shards its model with fsdp or hsdp"),
        (["--sharding", "fsdpp"], "--sharding: Unknown sharding backend 'fsdpp'"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as info:
        main(["train", *argv, "--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_an_unreadable_data_file_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "locked.txt"
    text.write_text("enough text " * 200)
    real = Path.read_bytes

    def denied(self: Path) -> bytes:  # chmod 000 does not stop root: refuse the read itself
        if self == text:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", str(text), "--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"hyper-parallel: error: --data {text}: cannot be read (Permission denied); check that "
        "the file is readable by this user"
    ]


def test_a_run_folder_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    (checkpoints / "muon_adamw").write_text("a file where the run's folder would go")
    with pytest.raises(SystemExit) as info:
        main(["train", "--checkpoint-dir", str(checkpoints), "--out", str(tmp_path / "o"),
              "--no-progress", *TINY])  # fmt: skip
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"hyper-parallel: error: --checkpoint-dir {checkpoints / 'muon_adamw'}: is a file; "
        "give a directory"
    ]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_sharded_train_tears_down_only_the_process_group_it_brought_up(
    tmp_path: Path, torchrun_env: None
) -> None:
    import torch.distributed as dist

    args = ["train", "--sharding", "fsdp", "--steps", "2", "--eval-every", "2", *TINY]

    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert not dist.is_initialized()  # nothing left for the interpreter's exit to tear down

    dist.init_process_group("gloo")  # the caller's group is the caller's to end
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert dist.is_initialized()


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel", "train", "--data", str(tmp_path / "nope.txt")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"hyper-parallel: error: --data {tmp_path / 'nope.txt'}: no such file"
    )


def test_steps_to_reach_interpolates() -> None:
    curve = [(0, 4.0), (10, 3.0), (20, 2.0), (30, 1.5)]
    assert steps_to_reach(curve, 2.5) == pytest.approx(15.0)
    assert steps_to_reach(curve, 3.0) == pytest.approx(10.0)
    assert steps_to_reach(curve, 5.0) == 0.0
    assert steps_to_reach(curve, 1.0) is None


def test_synthetic_corpus_is_deterministic_with_held_out_sums() -> None:
    a, b = (
        synthetic_corpus(train_chars=20_000, val_chars=5_000),
        synthetic_corpus(train_chars=20_000, val_chars=5_000),
    )
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.vocab_size == len(SYNTHETIC_ALPHABET)

    def sums(ids: torch.Tensor) -> set[tuple[int, int]]:
        lines = a.decode(ids.tolist()).splitlines()
        pairs = set()
        for line in lines:
            if "+" in line:
                left, right = line.split(" = ")
                x, y = left.split(" + ")
                assert int(x) + int(y) == int(right.rstrip(" ."))
                pairs.add((int(x), int(y)))
        return pairs

    train_pairs, val_pairs = sums(a.train), sums(a.val)
    assert train_pairs and val_pairs and not train_pairs & val_pairs
    assert all(x % 7 == 3 for x, _ in val_pairs)


# -- threads ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "env", "cpus", "load", "count", "why"),
    [
        (3, {"OMP_NUM_THREADS": "1"}, 8, 0.0, 3, "--threads"),  # the flag over everything
        (None, {"OMP_NUM_THREADS": "2"}, 8, 7.0, 2, "OMP_NUM_THREADS"),  # as set, whatever the load
        (None, {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, 8, 0.0, 1, "OMP_NUM_THREADS"),
        (None, {}, 2, 0.1, 2, "2 CPUs, load 0.1"),  # an idle machine: every CPU
        (None, {}, 2, 1.0, 1, "2 CPUs, load 1.0"),  # one CPU busy elsewhere: one thread
        (None, {}, 2, 9.0, 1, "2 CPUs, load 9.0"),  # never fewer than one
        (None, {}, 16, 4.0, 12, "16 CPUs, load 4.0"),
        (None, {"LOCAL_WORLD_SIZE": "4"}, 16, 0.0, 4, "16 CPUs / 4 processes, load 0.0"),
        (None, {"LOCAL_WORLD_SIZE": "4"}, 2, 0.0, 1, "2 CPUs / 4 processes, load 0.0"),
        (None, {"OMP_NUM_THREADS": "junk"}, 4, None, 4, "4 CPUs"),  # no load average here
    ],
)  # fmt: skip
def test_threads_are_the_flag_else_omp_num_threads_else_the_free_share_of_the_cpus(
    requested: int | None, env: dict[str, str], cpus: int, load: float | None, count: int, why: str
) -> None:
    threads = choose_threads(requested=requested, env=env, cpus=cpus, machine_cpus=cpus, load=load)
    assert (threads.count, threads.why) == (count, why)


def test_the_load_counts_as_a_share_of_the_whole_machine() -> None:
    # 4 of a 64-CPU machine's CPUs are this process's; a load of 32 leaves half of them
    threads = choose_threads(requested=None, env={}, cpus=4, machine_cpus=64, load=32.0)
    assert threads.count == 2


def test_the_load_is_the_cpus_busy_now_not_the_load_average(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    times = iter([(1000, 800), (1100, 850)])  # (all, idle): 50 of 100 ticks busy
    monkeypatch.setattr(threads_module, "_cpu_times", lambda: next(times))
    monkeypatch.setattr(threads_module, "_LOAD_WINDOW_S", 0.0)
    monkeypatch.setattr(threads_module.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads_module.os, "getloadavg", lambda: (3.9, 0.0, 0.0))
    assert threads_module._load() == 2.0  # half of 4 CPUs, not the lagging 3.9
    monkeypatch.setattr(threads_module, "_cpu_times", lambda: None)  # no /proc/stat
    assert threads_module._load() == 3.9


def test_threads_reach_torch_for_the_run_and_are_put_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = torch.get_num_threads()
    argv = ["train", "--steps", "2", "--eval-every", "2", "--threads", "3", "--out", str(tmp_path)]
    assert main([*argv, *TINY]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["threads"] == {"count": 3, "chosen_by": "--threads"}  # as torch reported it
    assert "3 torch threads (--threads); writing" in capsys.readouterr().out
    assert torch.get_num_threads() == before


def test_a_resume_keeps_the_threads_its_run_was_saved_with_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads_module, "_load", lambda: 0.0)  # worked out: 2 threads
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    run = ["train", *TINY, "--eval-every", "2", "--out", str(tmp_path / "run"), *ckpt]
    last = tmp_path / "ckpt" / "muon_adamw" / "step_00000004"
    assert main([*run, "--steps", "4", "--threads", "1"]) == 0
    shutil.rmtree(last)  # as if it had stopped after step 2's checkpoint
    assert main([*run, "--steps", "4", "--resume"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["threads"] == {"count": 1, "chosen_by": "as the run was saved with"}
    shutil.rmtree(last)
    assert main([*run, "--steps", "4", "--resume", "--threads", "2"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["threads"] == {"count": 2, "chosen_by": "--threads"}
    assert "1 torch thread (as the run was saved with)" in capsys.readouterr().out


# -- --compare's wording -----------------------------------------------------------------


def test_compare_says_the_step_reached_is_interpolated_between_validations() -> None:
    curve = [(0, 4.0), (25, 2.0), (50, 1.5)]
    assert reached_between(curve, 2.4) == ((0, 4.0), (25, 2.0))
    cmp = {"baseline": "adamw", "target_val_loss": 2.4, "baseline_steps": 50,
           "steps_to_reach": steps_to_reach(curve, 2.4), "validated_between": [0, 25],
           "step_ratio": 0.4}  # fmt: skip
    assert _comparison_line("muon+adamw", cmp) == (
        "muon+adamw reached adamw's final val loss 2.4000 between its validations at steps 0 "
        "and 25 (interpolated: step 20 of 50; step ratio 0.40)"
    )
    exact = {**cmp, "steps_to_reach": 0.0, "validated_between": [0, 0], "step_ratio": 0.0}
    assert _comparison_line("muon+adamw", exact) == (
        "muon+adamw reached adamw's final val loss 2.4000 at its validation at step 0 "
        "(of 50; step ratio 0.00)"
    )


# -- the plot of a resumed run -----------------------------------------------------------


_CURVES = plot.curves


class _StopAt:
    """A preemption asked for after the ``step``-th step (as SIGTERM would be)."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def requested(self, device: object) -> bool:
        self.calls += 1
        return self.calls == self.step


def _plotted(monkeypatch: pytest.MonkeyPatch, config: TrainConfig, **kwargs: Any) -> list[Curve]:
    """What ``train(config)``'s plot was drawn from."""
    drawn: list[Curve] = []

    def keep(results: Any) -> list[Curve]:
        found = _CURVES(results)
        drawn.extend(found)
        return found

    monkeypatch.setattr(plot, "curves", keep)
    train(config, echo=lambda line: None, **kwargs)
    return drawn


def test_a_resumed_run_plots_the_curves_of_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = TrainConfig(dim=32, layers=1, heads=2, seq_len=32, batch_size=8, progress=False,
                       steps=30, eval_every=10, threads=1)  # fmt: skip
    straight = _plotted(monkeypatch, replace(tiny, out=tmp_path / "straight"))
    stopped = replace(tiny, out=tmp_path / "stopped", checkpoint_dir=tmp_path / "ckpt")
    summary = train(stopped, echo=lambda line: None, preemption=_StopAt(17))  # type: ignore[arg-type]
    assert summary["runs"]["muon+adamw"]["steps"] == 17  # saved at 17, between log rows
    resumed = _plotted(monkeypatch, replace(stopped, resume=True))
    assert resumed == straight
    (curve,) = resumed
    assert [step for step, _ in curve.train] == [1, 5, 10, 15, 20, 25, 30]
    assert [step for step, _ in curve.val] == [0, 10, 20, 30]


def test_the_smoothing_weighs_a_gap_of_steps_as_those_steps() -> None:
    # a loss logged at steps 1 and 3 smooths to what one logged at every step does, when the
    # step between had the same loss as the one after it: 0.9 of the past per step
    assert smooth_by_step([(1, 4.0), (3, 2.0)]) == pytest.approx([4.0, 3.62])
    assert smooth_by_step([(1, 4.0), (2, 2.0), (3, 2.0)]) == pytest.approx([4.0, 3.8, 3.62])
