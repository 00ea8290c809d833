"""How a run of ``hyper-parallel train`` ended: its exit code, and the one line that says why.

The code is the process's exit status and is kept in the run's
``summary.json``, so a job script can tell "preempted: requeue" from "failed"
whatever launched the run: torchrun exits 1 when any worker exits non-zero,
143 included, but ``hyper-parallel outcome OUT`` answers with the run's own
code (docs/faults.md).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Exit", "exit_code", "stop_line"]


class Exit(enum.IntEnum):
    """``hyper-parallel train``'s exit codes (docs/faults.md has the table)."""

    FINISHED = 0
    SAVE_FAILED = 1  # a checkpoint could not be written
    USAGE = 2  # refused before anything was written: an option, a path, a lock
    NON_FINITE = 3  # params, optimizer state or every gradient went NaN/Inf: stopped, nothing kept
    INTERRUPTED = 130  # Ctrl-C
    PREEMPTED = 143  # SIGTERM: stopped after a step, saved there


def _code(run: Mapping[str, Any]) -> Exit:
    if run.get("save_error"):
        return Exit.SAVE_FAILED
    if run.get("non_finite"):
        return Exit.NON_FINITE
    if run.get("preempted"):
        return Exit.PREEMPTED
    if run.get("interrupted"):
        return Exit.INTERRUPTED
    return Exit.FINISHED


def exit_code(runs: Sequence[Mapping[str, Any]]) -> Exit:
    """The code of the first run (summary entries, in run order) that stopped early, else 0."""
    return next((code for code in map(_code, runs) if code), Exit.FINISHED)


def stop_line(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """The one line that says why the run stopped, for the codes that print one (1 and 3)."""
    for run in runs:
        if _code(run) in (Exit.SAVE_FAILED, Exit.NON_FINITE):
            return str(run.get("save_error") or run.get("non_finite"))
        if _code(run):
            return None
    return None
