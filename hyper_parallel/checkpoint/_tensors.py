"""A checkpoint's tensors, read back in one process: for NaN/Inf, and to name one that cannot be read.

DCP reads a whole plan at once and, when one tensor's bytes are bad, says
only what ``torch.load`` said. Read back one tensor at a time here, the bad
one is named with its file and why: missing, truncated or unreadable.
These run in the process that asks (no collectives), so a rank may call them
on its own after a collective load failed on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hyper_parallel.checkpoint._errors import reason
from hyper_parallel.checkpoint._state import SafeReader, quiet_single_process
from hyper_parallel.core.optimizer._nonfinite import NonFiniteTensors, non_finite

__all__ = [
    "REMOVED_WHILE_READ",
    "first_unreadable",
    "flat_tensors",
    "non_finite_saved",
    "read_metadata",
]

#: Why a checkpoint's files vanished under a reader: a run saving beside it pruned it.
REMOVED_WHILE_READ = "it was removed while it was read (a run saving beside it prunes old ones)"

#: Bytes read per batch by :func:`non_finite_saved`: its memory beyond one tensor larger than this.
BATCH_BYTES = 256 << 20


def flat_tensors(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a nested state dict under the dotted keys DCP stores them by."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flat_tensors(value, f"{name}.")
        elif isinstance(value, torch.Tensor):
            yield name, value


def read_metadata(ckpt: Path) -> Metadata:
    """DCP's metadata of ``ckpt``, through the restricted unpickler."""
    return SafeReader(ckpt).read_metadata()


def _saved(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {
        key: md
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _read(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read ``tensors`` (whole, by DCP key) from ``ckpt`` in this process alone."""
    with quiet_single_process():
        dcp_load(tensors, storage_reader=SafeReader(ckpt), no_dist=True)


def _empty(md: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(md.size, dtype=md.properties.dtype)


def non_finite_saved(ckpt: Path, metadata: Metadata | None = None) -> NonFiniteTensors:
    """The keys of ``ckpt``'s tensors that hold NaN or Inf, read in batches of about 256 MiB."""
    saved = _saved(metadata if metadata is not None else read_metadata(ckpt))
    bad = NonFiniteTensors()
    batch: dict[str, torch.Tensor] = {}
    for key in sorted(saved):
        batch[key] = _empty(saved[key])
        if sum(t.numel() * t.element_size() for t in batch.values()) >= BATCH_BYTES:
            bad.extend(_checked(ckpt, batch))
            batch = {}
    bad.extend(_checked(ckpt, batch))
    return bad


def _checked(ckpt: Path, batch: dict[str, torch.Tensor]) -> list[str]:
    if not batch:
        return []
    _read(ckpt, batch)
    return non_finite(batch, local=True)


def _files(metadata: Metadata, key: str) -> list[str]:
    """The files holding the pieces of tensor ``key``."""
    return sorted(
        {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key}
    )


def _why(ckpt: Path, metadata: Metadata, key: str, exc: BaseException) -> str:
    """Why ``key`` cannot be read: its file missing, cut short, or its bytes unreadable."""
    inner = exc
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))[0]
    if not ckpt.is_dir():
        return REMOVED_WHILE_READ
    for index, info in metadata.storage_data.items():
        if index.fqn != key:
            continue
        path = ckpt / info.relative_path
        if not path.is_file():
            return f"{path.name}, which holds {key}, is missing"
        end = info.offset + info.length
        if (size := os.path.getsize(path)) < end:
            return f"{path.name} is truncated: {key} ends at byte {end}, the file has {size}"
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return (
        f"{key} in {', '.join(_files(metadata, key))} cannot be read "
        f"({type(inner).__name__}: {first.split('. ')[0]})"
    )


def first_unreadable(ckpt: Path, keys: list[str]) -> str | None:
    """One line naming the first of ``keys`` that ``ckpt`` cannot give back, and why; else ``None``."""
    try:
        metadata = read_metadata(ckpt)
    except (OSError, EOFError) as exc:
        if not ckpt.is_dir():
            return REMOVED_WHILE_READ
        return f"its DCP metadata cannot be read ({reason(exc)})"
    saved = _saved(metadata)
    for key in keys:
        if key not in saved:
            continue
        try:
            _read(ckpt, {key: _empty(saved[key])})
        except (Exception, CheckpointException) as exc:
            return _why(ckpt, metadata, key, exc)
    return None
