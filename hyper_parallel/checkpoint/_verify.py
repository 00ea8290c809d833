"""Checking checkpoints in one process: :func:`verify` and :func:`find_checkpoints`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyper_parallel.checkpoint._errors import (
    CheckpointError,
)
from hyper_parallel.checkpoint._integrity import (
    MANIFEST,
    verified_manifest,
)
from hyper_parallel.checkpoint._layout import STEP_DIR

__all__ = ["Verified", "find_checkpoints", "verify"]

# -- verify ----------------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    """One checkpoint checked by :func:`verify`: intact, or why not."""

    path: Path
    error: str | None = None
    step: int | None = None
    files: int = 0
    bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what ``save(extra=...)`` kept
    checksums: bool = True  # False: saved before checksums (format 1), nothing to check against

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        """One line for a terminal: ``ok`` or ``CORRUPT``, the path, and what was found."""
        if not self.ok:
            return f"CORRUPT  {self.path}  {self.error}"
        if not self.checksums:
            return f"ok?      {self.path}  (step {self.step}; saved without checksums, unverified)"
        return f"ok       {self.path}  (step {self.step}, {self.files} files, {self.bytes:,} bytes)"


def verify(path: str | os.PathLike[str]) -> Verified:
    """Check one checkpoint's files against its manifest, in this process alone.

    Returns:
        What was found; :attr:`Verified.ok` is ``False`` for a corrupt one (or
        a path that is no checkpoint), with the reason.
    """
    ckpt = Path(path)
    try:
        meta = verified_manifest(ckpt, collective=False)
    except CheckpointError as exc:
        return Verified(ckpt, error=str(exc))
    files = meta.get("files", {}).values()
    total = sum(f["bytes"] for f in files)
    return Verified(
        ckpt, None, int(meta["step"]), len(files), total, dict(meta["extra"]), "files" in meta
    )


def _looks_like_checkpoint(path: Path) -> bool:
    return bool(STEP_DIR.match(path.name)) or any(
        (path / name).is_file() for name in (MANIFEST, ".metadata")
    )


def find_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """``root`` if it is a checkpoint, else every checkpoint below it, sorted.

    Unfinished saves (``.tmp-*``) are not checkpoints and are left out.
    """
    top = Path(root)
    if _looks_like_checkpoint(top):
        return [top]
    found = []
    for directory, subdirs, _ in os.walk(top):
        here = Path(directory)
        kept = []
        for name in sorted(subdirs):
            if name.startswith((".tmp-", ".old-")):
                continue
            if _looks_like_checkpoint(here / name):
                found.append(here / name)
            else:
                kept.append(name)
        subdirs[:] = kept
    return found
