"""Preemption benchmark: how soon ``hyper-parallel train`` exits once its SIGTERM save is committed.

Run from the repository root::

    python -m benchmarks --cases preemption

A scheduler sends SIGKILL a grace period after SIGTERM, so what a preempted
run does after its checkpoint is committed is time it may not have. Each
run is a tiny ``hyper-parallel train`` in a process of its own, with
``--checkpoint-dir``; the figure is the time from the commit (the ``latest``
pointer's modification time) to the process's exit, as its parent sees it.

Row: a run stopped by SIGTERM (summary only, no interpreter shutdown) against
the same run left to finish, whose last save is followed by what every run
ends with: the plot, the summary and the interpreter's shutdown.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import Row, Settings, case_command

__all__ = ["case_preemption", "exit_after_commit"]

_STEPS = 60
_TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
         "--no-progress", "--eval-every", "1000"]  # fmt: skip


def exit_after_commit(*, preempt: bool) -> float:
    """Seconds from the last checkpoint's commit to the exit of one run (SIGTERM'd, or finished)."""
    folder = Path(tempfile.mkdtemp(prefix="hyper-parallel-preemption-"))
    command = [sys.executable, "-m", "hyper_parallel.cli", "train", "--steps", str(_STEPS),
               "--checkpoint-dir", str(folder / "ckpt"), "--out", str(folder / "out"), *_TINY]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = folder / "out" / "metrics.jsonl"
    while preempt and run.poll() is None:
        if metrics.is_file() and metrics.read_text().count("train_loss") >= 3:
            run.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    code = run.wait(timeout=600)
    ended = time.time()
    if code != (143 if preempt else 0):
        raise RuntimeError(f"{' '.join(command)} exited {code}")
    committed = (folder / "ckpt" / "muon_adamw" / "latest").stat().st_mtime
    return ended - committed


def case_preemption(settings: Settings) -> Iterator[Row]:
    repeats = 1 if settings.quick_flag else 3
    stopped = [exit_after_commit(preempt=True) for _ in range(repeats)]
    finished = [exit_after_commit(preempt=False) for _ in range(repeats)]
    yield Row(
        "preemption: exit after the checkpoint is committed",
        "SIGTERM: summary, then exit", statistics.median(stopped),
        "a finished run: plot, summary, shutdown", statistics.median(finished), "s",
        note=f"median of {repeats} runs, each a process of its own",
        command=case_command("preemption", settings),
    )  # fmt: skip
