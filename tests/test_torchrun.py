"""Under ``torchrun``: the guide's distributed blocks, and ``hyper-parallel train --sharding``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def test_guide_distributed_blocks_run_as_written(tmp_path: Path) -> None:
    marks = tmp_path / "ok.txt"
    result = _torchrun(str(TESTS / "scripts" / "guide_distributed.py"), str(marks))
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(marks.read_text().split("\n")[:-1]) == ["ok 0", "ok 1"]


def test_train_under_torchrun_with_fsdp(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "8"]
    result = _torchrun(
        "-m", "hyper_parallel", "train", "--sharding", "fsdp", "--steps", "20", "--eval-every", "10",
        "--lr", "1e-2", "--out", str(out), "--no-progress", *tiny,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    val = [
        r["val_loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in r
    ]
    assert len(val) == 3 and val[-1] < val[0] - 0.3, val
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["sharding"] == "fsdp"
    assert result.stdout.count("muon+adamw: 20 steps") == 1  # only rank 0 reports
