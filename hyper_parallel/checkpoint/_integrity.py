"""A checkpoint's manifest: its plain values and a checksum of every file, verified before a load.

The manifest (``hyper_parallel.json``) lists each file of the checkpoint with
its size and its XXH3-64 checksum, and carries a checksum of its own text, so
a change anywhere (a flipped bit, a truncated copy, a missing file, an edited
manifest) is found before any value is read. XXH3-64 was picked by speed:
``python -m benchmarks --cases checkpoint`` measures it against CRC32C and
SHA-256 (``docs/benchmarks.md``).

Every rank checksums (and fsyncs) a share of the files, so the work is spread
the way the writing was; the ranks then agree, so a corruption one rank sees
fails every rank alike.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash

from hyper_parallel.checkpoint._errors import (
    CheckpointError,
    CorruptCheckpointError,
    is_dist,
    rank,
    world_size,
)

__all__ = [
    "ALGORITHM",
    "FORMAT_VERSION",
    "MANIFEST",
    "checksum_share",
    "digest_file",
    "fsync_dir",
    "read_manifest",
    "verified_manifest",
    "write_manifest",
]

MANIFEST = "hyper_parallel.json"
FORMAT_VERSION = 2
_UNCHECKED_VERSION = 1  # written before checksums: still read, with a warning
ALGORITHM = "xxh3_64"
_SELF = "manifest_" + ALGORITHM
_WARNED_UNCHECKED: set[Path] = set()  # checkpoints without checksums this process warned of


def digest_file(path: Path, *, sync: bool = False) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_64": hex digest}`` of one file; ``sync`` fsyncs it first.

    The file is mapped, not read: the checksum runs over the page cache without a copy.
    """
    with open(path, "rb") as file:
        if sync:
            os.fsync(file.fileno())
        size = os.fstat(file.fileno()).st_size
        if not size:  # an empty file cannot be mapped
            return {"bytes": 0, ALGORITHM: xxhash.xxh3_64_hexdigest(b"")}
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return {"bytes": size, ALGORITHM: xxhash.xxh3_64_hexdigest(mapped)}


def _seal_field(digest: bytes) -> bytes:
    return b'"' + _SELF.encode() + b'": "' + digest + b'"'


_UNSEALED = b"0" * 16
_SEAL = re.compile(re.escape(_seal_field(b"@")).replace(b"@", b"([0-9a-f]{16})"))


def _sealed(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON text carrying the checksum of its own bytes (with that field zeroed)."""
    text = json.dumps({**body, _SELF: _UNSEALED.decode()}, indent=1, sort_keys=True).encode()
    digest = xxhash.xxh3_64_hexdigest(text).encode()
    return text.replace(_seal_field(_UNSEALED), _seal_field(digest))


def _seal_holds(raw: bytes) -> bool:
    """Whether ``raw`` carries exactly one seal, and it is the checksum of the rest."""
    found = _SEAL.findall(raw)
    if len(found) != 1:
        return False
    unsealed = raw.replace(_seal_field(found[0]), _seal_field(_UNSEALED))
    return bool(xxhash.xxh3_64_hexdigest(unsealed).encode() == found[0])


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _data_files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory but its manifest, by name, sorted."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)


def _my_share(names: list[str]) -> list[str]:
    return names[rank() :: world_size()]


def _gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """``value`` from every rank of ``group`` (a list of one without a process group)."""
    if not is_dist():
        return [value]
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def checksum_share(
    directory: Path, group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, Any]]:
    """Fsync and checksum this rank's share of ``directory``'s files; every rank's, merged.

    Collective over ``group`` (all ranks) when a process group is up.
    """
    names = _my_share(_data_files(directory))
    mine = {name: digest_file(directory / name, sync=True) for name in names}
    merged: dict[str, dict[str, Any]] = {}
    for share in _gather(mine, group):
        merged.update(share)
    return merged


def write_manifest(directory: Path, meta: Mapping[str, Any], files: Mapping[str, Any]) -> None:
    """Write the manifest of ``meta`` and ``files`` into ``directory``, durably (one rank)."""
    body = {**meta, "files": dict(files), "checksum_algorithm": ALGORITHM}
    path = directory / MANIFEST
    with open(path, "wb") as file:
        file.write(_sealed(body))
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(directory)


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    """The manifest of ``checkpoint``, checked against its own checksum.

    Raises:
        CheckpointError: ``checkpoint`` does not exist or is not a checkpoint,
            or was written by another format version.
        CorruptCheckpointError: the manifest cannot be read, or does not match
            its own checksum.
    """
    if not checkpoint.exists():
        raise CheckpointError(f"No checkpoint at {checkpoint}: the path does not exist.")
    path = checkpoint / MANIFEST
    if not checkpoint.is_dir() or not (path.is_file() or (checkpoint / ".metadata").is_file()):
        raise CheckpointError(
            f"{checkpoint} is not a hyper_parallel checkpoint (expected a directory with "
            f"{MANIFEST} and DCP's .metadata)."
        )
    try:
        raw = path.read_bytes()
        meta = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"Checkpoint {checkpoint} is corrupt: its manifest {MANIFEST} cannot be read "
            f"({type(exc).__name__}: {exc})."
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != "hyper_parallel.checkpoint":
        raise CorruptCheckpointError(
            f"Checkpoint {checkpoint} is corrupt: {MANIFEST} is not hyper_parallel checkpoint "
            "metadata."
        )
    if meta.get("version") == _UNCHECKED_VERSION and _SELF not in meta:
        if checkpoint.resolve() in _WARNED_UNCHECKED:
            return meta
        _WARNED_UNCHECKED.add(checkpoint.resolve())
        warnings.warn(
            f"{checkpoint} was saved without checksums (format version {_UNCHECKED_VERSION}); it "
            "is loaded unverified. Save it again to add them.",
            UserWarning,
            stacklevel=3,
        )
        return meta
    if not _seal_holds(raw):
        raise CorruptCheckpointError(
            f"Checkpoint {checkpoint} is corrupt: {MANIFEST} does not match its own checksum "
            "(it changed after it was written)."
        )
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{checkpoint} has checkpoint format version {meta.get('version')!r}; this "
            f"hyper_parallel reads versions {_UNCHECKED_VERSION} and {FORMAT_VERSION}."
        )
    return meta


def _file_problem(checkpoint: Path, name: str, recorded: Mapping[str, Any]) -> str | None:
    """Why ``name`` is not the file the manifest recorded, or ``None`` if it is."""
    path = checkpoint / name
    try:
        size = path.stat().st_size
        if size != recorded["bytes"]:
            verb = "truncated" if size < recorded["bytes"] else "longer than saved"
            return f"{path} is {verb}: {size} bytes, the manifest recorded {recorded['bytes']}"
        found = digest_file(path)[ALGORITHM]
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} cannot be read ({exc})"
    if found != recorded[ALGORITHM]:
        return f"{path} has checksum {found}, the manifest recorded {recorded[ALGORITHM]}"
    return None


def verified_manifest(checkpoint: Path, *, collective: bool = True) -> dict[str, Any]:
    """The manifest of ``checkpoint`` once every file it lists is checked against it.

    Args:
        checkpoint: The checkpoint directory.
        collective: Share the files among the ranks of the process group and
            agree on the outcome (call it on every rank); ``False`` checks
            every file in this process alone.

    Raises:
        CheckpointError: see :func:`read_manifest`; raised on every rank alike.
        CorruptCheckpointError: a file is missing, truncated or changed, naming
            the first bad file any rank found; raised on every rank alike.
    """
    # (kind, message): "file" for a file that is not as recorded, else the error raised here
    failures: list[tuple[str, str]] = []
    meta: dict[str, Any] = {}
    try:
        meta = read_manifest(checkpoint)
        files: Mapping[str, Any] = meta.get("files", {})
        names = sorted(files)
        for name in _my_share(names) if collective else names:
            if problem := _file_problem(checkpoint, name, files[name]):
                failures.append(("file", problem))
    except CheckpointError as exc:
        failures.append((type(exc).__name__, str(exc)))
    found = [f for share in (_gather(failures) if collective else [failures]) for f in share]
    if not found:
        return meta
    kind, message = found[0]
    if kind != "file":
        raise {"CorruptCheckpointError": CorruptCheckpointError}.get(kind, CheckpointError)(message)
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise CorruptCheckpointError(
        f"Checkpoint {checkpoint} is corrupt: {message}{more}. It changed after it was saved; "
        "load an earlier checkpoint."
    )
