"""SwapOptimizer benchmark: peak memory and step time with the state on disk, against unswapped.

Run from the repository root::

    python -m benchmarks --cases swap           # Muon + AdamW state of about 1.1 GiB
    python -m benchmarks --cases swap --quick   # about 70 MiB

Each configuration runs in a process of its own (peak resident memory is a
process's), with glibc's mmap threshold fixed at 1 MiB for all of them: the
same model and gradients, 1 step to make the state, then ``repeats`` timed
steps. The model is 72 matrices of 1024 x 2048: 8 for Muon
(momentum, 4 bytes a param), 64 for AdamW (two moments, 8 bytes a param).

Rows:

- peak resident memory (``ru_maxrss``) with ``tier="disk"`` at
  ``swap_times`` 4 and 16, against the unswapped optimizer;
- median step time with the disk tier at ``swap_times`` 4 and 16, against
  unswapped.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import Row, Settings, case_command

__all__ = ["case_swap", "measure"]

_ROWS, _COLS = 1024, 2048


def measure(matrices: int, swap_times: int, repeats: int) -> dict[str, float]:
    """Build the model and optimizer, step, and report peak RSS (bytes) and the median step (s)."""
    from hyper_parallel.core.optimizer import SwapOptimizer, get_hyper_optimizer

    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(_ROWS, _COLS) * 0.02) for _ in range(matrices)
    )
    params = list(model)
    muon, adamw = params[: matrices // 9], params[matrices // 9 :]
    opt: Any = get_hyper_optimizer(model, muon_params=muon, adamw_params=adamw)
    if swap_times:
        opt = SwapOptimizer(opt, swap_times=swap_times, tier="disk", disk_path=tempfile.mkdtemp())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # makes the state
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_rss": float(peak), "step_s": statistics.median(seconds)}


def _in_process_of_its_own(matrices: int, swap_times: int, repeats: int) -> dict[str, float]:
    code = (
        "import json; from benchmarks.swap import measure; "
        f"print(json.dumps(measure({matrices}, {swap_times}, {repeats})))"
    )
    # glibc's malloc otherwise raises its mmap threshold as large blocks are freed and keeps
    # the freed memory in its heap: peak RSS then measures the allocator, not the optimizer
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=3600,
        env=env,
    )  # fmt: skip
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def case_swap(settings: Settings) -> Iterator[Row]:
    matrices = 72 if not settings.quick_flag else 4
    repeats = max(settings.repeats, 3)
    state_gib = (matrices // 9 * 4 + (matrices - matrices // 9) * 8) * _ROWS * _COLS / 2**30
    plain = _in_process_of_its_own(matrices, 0, repeats)
    command = case_command("swap", settings)
    what = f"swap: Muon + AdamW state {state_gib:.2f} GiB"
    for swap_times in (4, 16):
        swapped = _in_process_of_its_own(matrices, swap_times, repeats)
        yield Row(f"{what}, peak resident memory", f"tier='disk', swap_times={swap_times}",
                  swapped["peak_rss"] / 2**30, "unswapped", plain["peak_rss"] / 2**30, "GiB",
                  note="ru_maxrss of a process of its own", command=command)  # fmt: skip
        yield Row(f"{what}, step time", f"tier='disk', swap_times={swap_times}",
                  swapped["step_s"], "unswapped", plain["step_s"], "s",
                  note=f"median of {repeats} steps", command=command)  # fmt: skip
