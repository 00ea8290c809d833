"""Checking checkpoints in one process: :func:`verify` and :func:`find_checkpoints`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from hyper_parallel.checkpoint._errors import CheckpointError, reason
from hyper_parallel.checkpoint._integrity import MANIFEST, verified_manifest
from hyper_parallel.checkpoint._layout import STEP_DIR
from hyper_parallel.checkpoint._tensors import first_unreadable, non_finite_saved, read_metadata
from hyper_parallel.core.optimizer._nonfinite import NonFiniteTensors

__all__ = ["Verified", "find_checkpoints", "verify"]

# -- verify ----------------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    """One checkpoint checked by :func:`verify`: intact, unverified, or why not."""

    path: Path
    error: str | None = None  # corrupt or unreadable (``CORRUPT``), or holds NaN/Inf (``BAD``)
    step: int | None = None
    files: int = 0
    bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what ``save(extra=...)`` kept
    checksums: bool = True  # False: saved before checksums (format 1), nothing to check against
    non_finite: bool = False  # the error is NaN/Inf in a tensor that reads back as saved

    @property
    def ok(self) -> bool:
        """Nothing wrong was found (an unverified checkpoint is ok, but not :attr:`intact`)."""
        return self.error is None

    @property
    def intact(self) -> bool:
        """Checked against its checksums and found as saved, every tensor finite."""
        return self.ok and self.checksums

    def line(self) -> str:
        """One line for a terminal: ``ok``, ``ok?`` (unverified), ``BAD`` or ``CORRUPT``, and why."""
        if self.non_finite:
            return f"BAD      {self.path}  {self.error}"
        if not self.ok:
            return f"CORRUPT  {self.path}  {self.error}"
        if not self.checksums:
            return f"ok?      {self.path}  (step {self.step}; saved without checksums, unverified)"
        return f"ok       {self.path}  (step {self.step}, {self.files} files, {self.bytes:,} bytes)"


def verify(path: str | os.PathLike[str], *, read_tensors: bool = True) -> Verified:
    """Check one checkpoint, in this process alone: its files, then every tensor read back.

    The files are checked against the manifest's sizes and checksums; then
    every tensor is read (in batches of about 256 MiB) and checked for NaN
    and Inf, which no checkpoint should hold.

    Args:
        path: The checkpoint directory.
        read_tensors: ``False`` checks the files only (what a load checks
            before it reads the tensors itself).

    Returns:
        What was found; :attr:`Verified.ok` is ``False`` for a corrupt one, a
        path that is no checkpoint, a tensor that cannot be read, or one that
        holds NaN or Inf (:attr:`Verified.non_finite`), with the reason.
    """
    ckpt = Path(path)
    try:
        meta = verified_manifest(ckpt, collective=False)
        metadata = read_metadata(ckpt)
    except (CheckpointError, OSError, EOFError) as exc:
        return Verified(ckpt, error=str(exc))
    try:
        bad = non_finite_saved(ckpt, metadata) if read_tensors else NonFiniteTensors()
    except (Exception, CheckpointException) as exc:  # a tensor that cannot be read: named here
        why = first_unreadable(ckpt, sorted(metadata.state_dict_metadata)) or reason(exc)
        return Verified(ckpt, error=f"Checkpoint {ckpt} cannot be loaded: {why}.")
    files = meta.get("files", {}).values()
    found = Verified(
        ckpt, None, int(meta["step"]), len(files), sum(f["bytes"] for f in files),
        dict(meta["extra"]), "files" in meta,
    )  # fmt: skip
    if bad:
        error = f"holds NaN or Inf in {bad.summary}; no run should resume from it"
        return replace(found, error=error, non_finite=True)
    return found


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
