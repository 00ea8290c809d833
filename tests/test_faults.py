"""Faults while training and saving, with ``hyper-parallel train`` in a process of its own.

Each fault ends the run with its own exit code and one line on stderr (no
traceback), leaves no ``.tmp-`` directory, keeps the checkpoint before it
intact, writes the summary, and ``--resume`` then trains on exactly as an
uninterrupted run does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_TRAIN_ARGS
from hyper_parallel.checkpoint import verify

#: Runs the command line with one fault injected: ``python -c DRIVER FAULT AT ARGS...``.
#: FAULT ``enospc``/``erofs``: the writer of the checkpoint whose path holds AT fails with
#: that error. ``SIGINT``/``SIGTERM``: that writer sends the signal to its own process as it
#: starts writing; ``SIGINT@step``/``SIGTERM@step``: sent after step AT
#: (``SIGTERM@step:rank1``: by rank 1 only; ``raise@step``: a RuntimeError instead);
#: ``wait@step``: the run waits after step AT
#: until the file ``$RELEASE`` exists. ``none``: no fault.
DRIVER = """
import errno, os, signal, sys
from torch.distributed.checkpoint.filesystem import FileSystemWriter
import hyper_parallel.checkpoint._saving as saving
import hyper_parallel.train.run as run
from hyper_parallel.cli import main

fault, at, args = sys.argv[1], sys.argv[2], sys.argv[3:]

class Faulty(FileSystemWriter):
    def write_data(self, plan, planner):
        if at in str(self.path):
            if fault in ("enospc", "erofs"):
                code = getattr(errno, fault.upper())
                raise OSError(code, os.strerror(code), str(self.path))
            if fault in ("SIGINT", "SIGTERM"):
                os.kill(os.getpid(), getattr(signal, fault))
        return super().write_data(plan, planner)

saving.make_writer = Faulty
if fault == "wait@step":  # hold the run at step AT until the file $RELEASE exists
    import pathlib, time
    real_step = run._Run.step
    def step(self, n):
        real_step(self, n)
        if n == int(at):
            pathlib.Path(os.environ["RELEASE"] + ".waiting").touch()
            while not os.path.exists(os.environ["RELEASE"]):
                time.sleep(0.05)
    run._Run.step = step
if "@step" in fault and fault != "wait@step":  # "SIGTERM@step:rank1": that rank alone
    real_step = run._Run.step
    name, only = fault.partition("@step")[0], fault.partition(":rank")[2]
    def step(self, n):
        real_step(self, n)
        if n == int(at) and only in ("", os.environ.get("RANK")):
            if name == "raise":
                raise RuntimeError("a bug in this worker")
            os.kill(os.getpid(), getattr(signal, name))
    run._Run.step = step
sys.exit(main(["train", *args]))
"""

STEPS = 10  # saves at steps 3, 6, 9 and 10
TESTS = Path(__file__).parent


def _command(tmp: Path, name: str, fault: str, at: str, *extra: str) -> list[str]:
    args = ["--steps", str(STEPS), "--eval-every", "1", "--checkpoint-every", "3",
            "--checkpoint-dir", str(tmp / f"{name}-ckpt"), "--out", str(tmp / name),
            *TINY_TRAIN_ARGS, *extra]  # fmt: skip
    return [sys.executable, "-c", DRIVER, fault, at, *args]


def _train(tmp: Path, name: str, fault: str = "none", at: str = "-", *extra: str) -> Any:
    return subprocess.run(
        _command(tmp, name, fault, at, *extra), capture_output=True, text=True, timeout=300
    )


def _losses(out: Path) -> dict[tuple[str, int], float]:
    """Every loss the run logged: validation at each step, training every 5."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(k, r["step"]): r[k] for r in rows for k in ("train_loss", "val_loss") if k in r}


def _checked(tmp: Path, name: str, result: Any, code: int, summary_steps: int) -> Path:
    """The run ended with ``code``, at most one line on stderr, no temp dir, its summary written."""
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    folder = tmp / f"{name}-ckpt" / "muon_adamw"
    assert not list(folder.glob(".tmp-*"))
    assert all(verify(p).ok for p in folder.glob("step_*"))
    summary = json.loads((tmp / name / "summary.json").read_text())
    assert summary["runs"]["muon+adamw"]["steps"] == summary_steps
    # a preempted run leaves at once, without drawing: the resumed run draws the whole curve
    assert (tmp / name / "loss_curves.png").is_file() == (code != 143)
    return folder


@pytest.fixture(scope="module")
def solo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the run without a fault wrote (``solo``, ``solo-ckpt``)."""
    tmp = tmp_path_factory.mktemp("solo")
    result = _train(tmp, "solo")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def solo(solo_run: Path) -> dict[tuple[str, int], float]:
    """The losses of the run without a fault."""
    return _losses(solo_run / "solo")


def _resumes_as_solo(tmp: Path, name: str, solo: dict[tuple[str, int], float]) -> None:
    result = _train(tmp, name, "none", "-", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(tmp / name) == solo  # the log is continued: every step as the solo run


def test_disk_full_in_a_save_is_one_line_and_the_run_resumes(
    tmp_path: Path, solo: dict[tuple[str, int], float]
) -> None:
    result = _train(tmp_path, "full", "enospc", "step_00000006")
    folder = _checked(tmp_path, "full", result, 1, 6)
    assert result.stderr.strip().splitlines() == [
        f"hyper-parallel train: The save of {folder / 'step_00000006'} failed: OSError: "
        f"[Errno 28] No space left on device: '{folder / '.tmp-step_00000006'}' (rank 0). "
        "The previous checkpoint is intact."
    ]
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000003"]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert "No space left on device" in summary["runs"]["muon+adamw"]["save_error"]
    _resumes_as_solo(tmp_path, "full", solo)


def test_a_file_system_turned_read_only_is_one_line_naming_it(tmp_path: Path) -> None:
    result = _train(tmp_path, "ro", "erofs", "step_00000006")
    folder = _checked(tmp_path, "ro", result, 1, 6)
    (line,) = result.stderr.strip().splitlines()
    assert (
        f"The save of {folder / 'step_00000006'} failed: OSError: [Errno 30] Read-only file "
        in line
    )
    assert line.endswith("The previous checkpoint is intact.")


def test_disk_full_in_an_async_save_is_the_same_error_heard_at_the_next_step(
    tmp_path: Path, solo: dict[tuple[str, int], float]
) -> None:
    result = _train(tmp_path, "async", "enospc", "step_00000006", "--checkpoint-async")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("hyper-parallel train: The asynchronous save of ")
    assert "No space left on device" in line and line.endswith("The previous checkpoint is intact.")
    steps = json.loads((tmp_path / "async" / "summary.json").read_text())["runs"]["muon+adamw"]
    assert 6 < steps["steps"] < 9  # heard of before the next save's step
    folder = tmp_path / "async-ckpt" / "muon_adamw"
    assert not list(folder.glob(".tmp-*"))
    assert [p.name for p in folder.glob("step_*")] == ["step_00000003"]
    assert verify(folder / "step_00000003").ok
    _resumes_as_solo(tmp_path, "async", solo)


def test_preemption_in_a_users_loop() -> None:
    """The API the command line uses: nothing requested until the signal; then the code."""
    import signal
    import threading

    from hyper_parallel.checkpoint import Preemption
    from hyper_parallel.core.errors import HyperParallelRuntimeError

    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        assert not preemption.requested() and preemption.exit_code == 0
        os.kill(os.getpid(), signal.SIGTERM)  # caught: the test process lives on
        assert preemption.requested() and preemption.signal == signal.SIGTERM
        assert preemption.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == before  # given back on leaving

    failures: list[BaseException] = []

    def elsewhere() -> None:
        try:
            Preemption().install()
        except HyperParallelRuntimeError as exc:
            failures.append(exc)

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert len(failures) == 1 and "main thread" in str(failures[0])


@pytest.mark.parametrize(("fault", "at"), [("SIGINT", "step_00000006"), ("SIGINT@step", "5")])
def test_ctrl_c_while_a_save_writes_or_between_steps_exits_130_and_resumes(
    tmp_path: Path, solo: dict[tuple[str, int], float], fault: str, at: str
) -> None:
    result = _train(tmp_path, "int", fault, at)
    folder = _checked(tmp_path, "int", result, 130, 6 if fault == "SIGINT" else 5)
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000003"]  # save abandoned
    _resumes_as_solo(tmp_path, "int", solo)


@pytest.mark.parametrize(("fault", "at"), [("SIGTERM", "step_00000006"), ("SIGTERM@step", "4")])
def test_sigterm_finishes_the_step_saves_it_and_exits_143(
    tmp_path: Path, solo: dict[tuple[str, int], float], fault: str, at: str
) -> None:
    result = _train(tmp_path, "term", fault, at)
    stopped = 6 if fault == "SIGTERM" else 4
    folder = _checked(tmp_path, "term", result, 143, stopped)
    assert result.stderr.strip() == ""
    assert (folder / f"step_{stopped:08d}").is_dir()  # this step's checkpoint, complete
    summary = json.loads((tmp_path / "term" / "summary.json").read_text())
    assert summary["runs"]["muon+adamw"]["preempted"]
    _resumes_as_solo(tmp_path, "term", solo)


def test_a_real_full_file_system(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"this machine does not allow a tmpfs mount: {made.stderr.decode().strip()}")
    try:
        args = ["--steps", "20", "--checkpoint-every", "1", "--checkpoint-dir", str(mount),
                "--out", str(tmp_path / "o"), *TINY_TRAIN_ARGS]  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "hyper_parallel", "train", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr[-3000:]
        (line,) = result.stderr.strip().splitlines()
        assert "No space left on device" in line and line.endswith(
            "The previous checkpoint is intact."
        )
        folder = mount / "muon_adamw"
        assert not list(folder.glob(".tmp-*"))
        kept = list(folder.glob("step_*"))
        assert kept and all(verify(p).ok for p in kept)
        assert (tmp_path / "o" / "summary.json").is_file()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_second_run_on_one_checkpoint_folder_is_refused_naming_the_first(
    tmp_path: Path, solo_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    monkeypatch.setenv("RELEASE", str(release))
    first = subprocess.Popen(
        _command(tmp_path, "first", "wait@step", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(1200):  # the first run is at step 2, holding its folder
            if Path(f"{release}.waiting").exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-3000:]
        folder = tmp_path / "first-ckpt" / "muon_adamw"
        second = subprocess.run(
            [*_command(tmp_path, "first", "none", "-")[:-len(TINY_TRAIN_ARGS) - 2],
             "--out", str(tmp_path / "second"), *TINY_TRAIN_ARGS],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.strip().splitlines() == [
            f"hyper-parallel: error: --checkpoint-dir {folder.parent}: {folder} is in use by "
            f"another run (pid {first.pid} on host "
            f"{socket.gethostname()}); wait for it to end, or save to another directory."
        ]
        assert not (tmp_path / "second" / "metrics.jsonl").exists()
    finally:
        release.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    # the first run's checkpoints are the solo run's, byte for byte
    solo_folder = solo_run / "solo-ckpt" / "muon_adamw"
    names = sorted(p.relative_to(folder) for p in folder.glob("step_*/*.distcp"))
    assert names == sorted(p.relative_to(solo_folder) for p in solo_folder.glob("step_*/*.distcp"))
    for name in names:
        assert (folder / name).read_bytes() == (solo_folder / name).read_bytes()
    # and a holder that has died leaves the folder free: the second run takes it
    taken = _train(tmp_path, "first", "none", "-", "--resume")
    assert taken.returncode == 0, taken.stderr[-3000:]


def test_sigterm_to_one_of_two_ranks_stops_both_after_one_saved_step(tmp_path: Path) -> None:
    """Under torchrun, one rank's SIGTERM: both stop after the same step, save it once, exit 143."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)

    def torchrun(name: str, fault: str, at: str, *extra: str) -> Any:
        args = _command(tmp_path, name, fault, at, "--sharding", "fsdp", *extra)[3:]
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", str(driver), *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    solo = torchrun("solo", "none", "-")
    assert solo.returncode == 0, solo.stderr[-4000:]
    stopped = torchrun("term", "SIGTERM@step:rank1", "4")
    assert stopped.returncode != 0  # the launcher reports its workers' 143
    assert stopped.stderr.count("exitcode  : 143") == 2, stopped.stderr[-4000:]
    assert "hyper_parallel/" not in stopped.stderr  # the launcher's own report, no trace of ours
    folder = tmp_path / "term-ckpt" / "muon_adamw"
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert all(verify(p).ok for p in folder.glob("step_*"))
    summary = json.loads((tmp_path / "term" / "summary.json").read_text())
    assert summary["runs"]["muon+adamw"]["steps"] == 4
    assert summary["runs"]["muon+adamw"]["preempted"]
    resumed = torchrun("term", "none", "-", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _losses(tmp_path / "term") == _losses(tmp_path / "solo")


def _docs_block(marker: str) -> str:
    """The code block of docs/faults.md that holds ``marker``."""
    text = (Path(__file__).parents[1] / "docs" / "faults.md").read_text(encoding="utf-8")
    blocks = text.split("```")[1::2]
    (block,) = [b for b in blocks if marker in b]
    return block.split("\n", 1)[1]


def _commands(bin_dir: Path, **scripts: str) -> dict[str, str]:
    """Executables named like the keys (``_`` for ``-``) in ``bin_dir``; the environment using them."""
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name.replace("_", "-")
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _container_command(k8s: str, out: str) -> str:
    """The Kubernetes recipe's container command, its output folder moved to ``out``."""
    (line,) = [line for line in k8s.splitlines() if "command:" in line]
    return str(json.loads(line.split("command:", 1)[1])[2]).replace("/ckpt/out", out)


def _rule_codes(k8s: str, action: str) -> list[int]:
    """The exit codes of the recipe's ``podFailurePolicy`` rule with ``action``."""
    line = k8s.split(f"action: {action}")[1].splitlines()[1]
    return [int(code) for code in line.split("values: [")[1].split("]")[0].split(",")]


def test_the_slurm_recipe_requeues_a_preempted_torchrun_job_and_not_a_failed_one(
    tmp_path: Path,
) -> None:
    """docs/faults.md's Slurm script, as written, with ``srun`` as two torchrun agents."""
    slurm, k8s = _docs_block("scontrol requeue"), _docs_block("podFailurePolicy")
    env = _commands(
        tmp_path / "bin",
        srun=f'exec "{sys.executable}" "{TESTS / "scripts" / "two_agents.py"}" "$@"',
        scontrol='echo "$@" >> requeued',
        hyper_parallel=f'exec "{sys.executable}" -m hyper_parallel.cli "$@"',
        torchrun="true  # the Slurm job ran the run: what is tested here is the decision",
    )
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    extra = ["--steps", str(STEPS), "--checkpoint-every", "3", "--sharding", "fsdp",
             *TINY_TRAIN_ARGS]  # fmt: skip
    env.update(DRIVER=str(driver), EXTRA=json.dumps(extra), SLURM_JOB_ID="42")

    def job(fault: str, at: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", slurm], cwd=tmp_path, env={**env, "FAULT": fault, "AT": at},
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    preempted = job("SIGTERM@step:rank1", "4")  # SIGTERM reaches one worker
    assert (tmp_path / "requeued").read_text() == "requeue 42\n", preempted.stderr[-4000:]
    answer = preempted.stdout.splitlines()[-1]
    assert answer == "preempted: requeue it with --resume (muon+adamw 4 steps); exit code 143"

    failed = job("raise@step:rank1", "7")  # the requeued run: a worker raises
    assert "RuntimeError: a bug in this worker" in failed.stderr
    assert (tmp_path / "requeued").read_text() == "requeue 42\n"  # not requeued again
    assert failed.stdout.splitlines()[-1].startswith("failed: "), failed.stdout[-2000:]
    # Kubernetes' container ends with the same answer: its policy fails the Job
    pod = subprocess.run(["bash", "-c", _container_command(k8s, "runs/job")], cwd=tmp_path, env=env)
    assert pod.returncode == 1 and 1 in _rule_codes(k8s, "FailJob")


def test_the_kubernetes_recipe_passes_sigterm_on_and_exits_143_for_a_new_pod(
    tmp_path: Path,
) -> None:
    """The container's command as written, torchrun with 2 workers; SIGTERM to its shell only."""
    k8s = _docs_block("podFailurePolicy")
    extra = " ".join(["--steps", "400", "--eval-every", "100", *TINY_TRAIN_ARGS])
    env = _commands(
        tmp_path / "bin",
        torchrun=f'exec "{sys.executable}" -m torch.distributed.run "$@" {extra}',
        hyper_parallel=f'exec "{sys.executable}" -m hyper_parallel.cli "$@"',
    )
    command = _container_command(k8s, "out").replace("/ckpt/run", "ckpt")
    command = command.replace("--nproc_per_node 8", "--nproc_per_node 2")
    container = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while (
        not metrics.is_file() or '"step": 5,' not in metrics.read_text()
    ) and time.monotonic() < deadline:
        assert container.poll() is None, container.communicate()[1][-4000:]
        time.sleep(0.1)
    container.send_signal(signal.SIGTERM)  # what the kubelet does: to the first process alone
    out, err = container.communicate(timeout=240)
    assert container.returncode == 143, err[-4000:]
    assert 143 in _rule_codes(k8s, "Ignore")  # not counted as a failure: a new pod resumes
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]["muon+adamw"]
    assert summary["preempted"] and 5 <= summary["steps"] < 400
    saved = sorted(p.name for p in (tmp_path / "ckpt" / "muon_adamw").glob("step_*"))
    assert saved[-1] == f"step_{summary['steps']:08d}"
    assert out.splitlines()[-1].startswith("preempted: requeue it with --resume")


def test_sigterm_at_the_last_step_is_a_finished_run_not_a_preempted_one(tmp_path: Path) -> None:
    """A requeue of it would find nothing to do: the run says it finished."""
    result = _train(tmp_path, "last", "SIGTERM@step", str(STEPS))
    _checked(tmp_path, "last", result, 0, STEPS)
    summary = json.loads((tmp_path / "last" / "summary.json").read_text())
    assert summary["exit_code"] == 0 and not summary["runs"]["muon+adamw"]["preempted"]
