"""The layout of a checkpoint root: ``step_<N>`` directories and the ``latest`` pointer."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["LATEST_FILE", "STEP_DIR", "candidates", "step_dirs"]

LATEST_FILE = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")


def candidates(root: Path) -> list[Path]:
    """The checkpoints under ``root`` to try, best first: ``latest``'s, then newest step first."""
    steps = [path for _, path in sorted(step_dirs(root), reverse=True)]
    pointer = root / LATEST_FILE
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in steps:
            steps.remove(named)
            steps.insert(0, named)
    return steps


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)
