"""The layout of a checkpoint root: ``step_<N>`` directories and the ``latest`` pointer."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["LATEST_FILE", "STEP_DIR", "candidates", "step_dirs"]

LATEST_FILE = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")


def candidates(root: Path) -> list[Path]:
    """The checkpoints under ``root`` to try, best first: the newest step first.

    ``latest`` is not consulted: a ``step_<N>`` directory exists only once its
    save committed (the rename is the commit), so the newest one is the newest
    save, even when writing ``latest`` after it failed (a full disk) or never
    happened (a crash between the two).
    """
    return [path for _, path in sorted(step_dirs(root), reverse=True)]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)
