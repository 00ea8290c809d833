"""``--cases against --against REV``: this checkout's Muon step against another commit's, in one run.

A change that should cost no speed is measured against the commit before
it on the same machine at the same time: the other commit is checked out
into a temporary git worktree, and ``benchmarks/step_timer.py`` (this
checkout's) times a Muon step once with each on ``PYTHONPATH``, the two
alternating for a few rounds so that a machine that slows down slows both.
The figure is the median over rounds of each process's median step; the
ratio is this checkout's over the other's (target at most 1.02).

Workloads: a transformer's matrices at each ``--dims`` (``--layers``
blocks), and 400 small 64 x 64 matrices, where per-matrix overhead shows.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import ROOT, Row, Settings, case_command, transformer_shapes

__all__ = ["case_against"]

ROUNDS = 3
TIMER = ROOT / "benchmarks" / "step_timer.py"


def _spec(shapes: list[tuple[int, int]]) -> str:
    return ",".join(f"{r}x{c}*{n}" for (r, c), n in Counter(shapes).items())


def _time(checkout: Path, spec: str, repeats: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(checkout / "plugins")]))
    result = subprocess.run(
        [sys.executable, str(TIMER), spec, "--repeats", str(repeats)],
        cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"timing {checkout} failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.split()[-1])


def _worktree(rev: str, where: Path) -> None:
    made = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if made.returncode != 0:
        raise SystemExit(f"--against {rev}: git could not check it out: {made.stderr.strip()}")


def case_against(settings: Settings) -> Iterator[Row]:
    rev = settings.extra.get("against")
    if not rev:
        raise SystemExit("--cases against needs --against REV (a commit, tag or branch)")
    workloads = [
        (
            f"{settings.layers} layers, d={d}",
            transformer_shapes(d, settings.layers),
            settings.repeats,
        )
        for d in settings.dims
    ] + [("400 matrices 64x64", [(64, 64)] * 400, 4 * settings.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        _worktree(rev, other)
        try:
            for what, shapes, repeats in workloads:
                spec = _spec(shapes)
                theirs, ours = [], []
                for _ in range(ROUNDS):
                    theirs.append(_time(other, spec, repeats))
                    ours.append(_time(ROOT, spec, repeats))
                yield Row(
                    f"Muon step, {what}, {settings.device}, this checkout against {rev}",
                    "this checkout", statistics.median(ours), rev, statistics.median(theirs),
                    "s", "<= 1.02", f"median of {ROUNDS} interleaved processes each",
                    case_command("against", settings, f"--against {rev}"),
                )  # fmt: skip
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                capture_output=True, check=False,
            )  # fmt: skip
