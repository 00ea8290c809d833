"""The tuned Newton-Schulz choices kept across runs, and what they are keyed and made of.

A :class:`Stack` is what the iteration runs, a :class:`Candidate` one way to
run it, a :class:`ShapeSet` what decides the choice on this machine (its
:attr:`~ShapeSet.key`), and a :class:`PathCache` the JSON file in the
per-user cache directory that keeps each key's choice and timings
(``_tuning`` measures them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.core.compat import cpu_kind
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import CACHE_DIR_ENV, default_cache_dir
from hyper_parallel_builtins.newton_schulz._paths import StackPath

__all__ = [
    "CACHE_FILE",
    "CACHE_FORMAT",
    "Candidate",
    "PathCache",
    "ShapeSet",
    "Stack",
    "device_name",
    "dtype_name",
]

#: The cache file's name in the cache directory, and its format version: a file of
#: another version (or written by another torch) is ignored and rewritten.
CACHE_FILE = "ns_paths.json"
CACHE_FORMAT = 2


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one), read once per process."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """The device's name and capability: what makes two machines' timings differ."""
    if device.type == "cpu":
        return f"{_cpu_model()} ({cpu_kind()})"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    module = getattr(torch, device.type, None)  # torch_npu registers torch.npu
    name = getattr(module, "get_device_name", None)
    return f"{name(device)}" if callable(name) else device.type


@dataclass(frozen=True)
class Stack:
    """A stack the iteration runs: ``count`` matrices of ``rows x cols`` in ``dtype`` on ``device``.

    ``dtype_free``: no one named the dtype (it is the device's default), so
    float32 may be chosen where it is faster than a lower-precision default.
    ``gram``: ``ns_method="auto"``'s rule runs Gram Newton-Schulz here, so the
    standard iteration may be chosen where it is faster.
    """

    rows: int
    cols: int
    count: int
    dtype: torch.dtype
    device: torch.device
    dtype_free: bool = False
    gram: bool = False


@dataclass(frozen=True)
class ShapeSet:
    """What decides a stack's choice: the machine, torch, threads, the shape and the dtype."""

    device: str  # device_name
    torch_version: str
    threads: int
    rows: int
    cols: int
    count: int
    dtype: str
    dtype_free: bool
    gram: bool

    @classmethod
    def of(cls, stack: Stack) -> ShapeSet:
        """The key of ``stack`` on this machine, now."""
        s = stack
        return cls(device_name(s.device), torch.__version__, torch.get_num_threads(),
                   s.rows, s.cols, s.count, dtype_name(s.dtype), s.dtype_free, s.gram)  # fmt: skip

    @property
    def key(self) -> str:
        """The cache file's key."""
        free = ", float32 allowed" if self.dtype_free else ""
        gram = ", Gram by rule" if self.gram else ""
        return (
            f"{self.device} | torch {self.torch_version} | {self.threads} threads | "
            f"{self.rows}x{self.cols} x{self.count} | {self.dtype}{free}{gram}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Candidate:
    """One way to run the iteration on a stack: its dtype and :class:`StackPath`."""

    dtype: torch.dtype
    path: StackPath

    @property
    def name(self) -> str:
        """E.g. ``"bfloat16, per matrix, P^T @ X, tall transposed"`` or ``"bfloat16, Gram"``."""
        if self.path.gram:
            return f"{dtype_name(self.dtype)}, Gram"
        parts = [
            dtype_name(self.dtype),
            "per matrix" if self.path.per_matrix else "batched",
            "P^T @ X" if self.path.poly_transposed else "P @ X",
        ]
        if self.path.tall_transposed:
            parts.append("tall transposed")
        return ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), **dataclasses.asdict(self.path)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Candidate:
        flags = [data[f.name] for f in dataclasses.fields(StackPath)]
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or not all(isinstance(f, bool) for f in flags):
            raise HyperParallelValueError(f"not a candidate: {dict(data)}")
        return cls(dtype, StackPath(*flags))


@dataclass
class _Entry:
    chosen: Candidate
    seconds: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"choice": self.chosen.as_json(), "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _Entry:
        seconds = {str(k): float(v) for k, v in dict(data.get("seconds", {})).items()}
        return cls(Candidate.from_json(data["choice"]), seconds)


class PathCache:
    """Tuned choices kept in a JSON file across runs: ``directory / ns_paths.json``.

    The file holds its format version (:data:`CACHE_FORMAT`) and torch's
    version; a file it cannot read, of another format or another torch is
    ignored with one warning line and rewritten at the next :meth:`save`.
    Writes are atomic (a temporary file, then ``os.replace``). It is read
    once, when first asked.

    Args:
        directory: Where the file lives; default :func:`default_cache_dir`.
    """

    def __init__(self, directory: Path | str | None = None) -> None:
        self.file = Path(directory if directory is not None else default_cache_dir()) / CACHE_FILE
        self._entries: dict[str, _Entry] | None = None
        self._fresh: set[str] = set()  # keys measured by this cache's owner

    def _read(self, quiet: bool) -> dict[str, _Entry]:
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            return self._ignored(f"it cannot be read ({error})", quiet)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            return self._ignored("it is not a path cache", quiet)
        if data.get("format") != CACHE_FORMAT or data.get("torch") != torch.__version__:
            return self._ignored(
                f"it was written in format {data.get('format')!r} by torch "
                f"{data.get('torch')!r} (this is format {CACHE_FORMAT}, torch {torch.__version__})",
                quiet,
            )
        try:
            return {str(k): _Entry.from_json(v) for k, v in data["entries"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            return self._ignored(f"an entry is malformed ({error!r})", quiet)

    def _ignored(self, why: str, quiet: bool) -> dict[str, _Entry]:
        if not quiet:
            warnings.warn(
                f"Ignoring the Newton-Schulz path cache {self.file}: {why}; the paths are "
                "measured again and the file rewritten.",
                UserWarning,
                stacklevel=4,
            )
        return {}

    @property
    def entries(self) -> dict[str, _Entry]:
        if self._entries is None:
            self._entries = self._read(quiet=False)
        return self._entries

    def get(self, key: str, retune: bool = False) -> _Entry | None:
        """The kept choice for ``key``; with ``retune``, only one measured since this cache was made."""
        if retune and key not in self._fresh:
            return None
        return self.entries.get(key)

    def put(self, key: str, chosen: Candidate, seconds: Mapping[str, float]) -> None:
        """Keep a choice just measured (written at :meth:`save`)."""
        self.entries[key] = _Entry(chosen, dict(seconds))
        self._fresh.add(key)

    def save(self) -> None:
        """Write the file atomically, with what another process wrote since (ours win).

        A directory that cannot be written is reported with one warning line;
        the choices stay in memory.
        """
        merged = {**self._read(quiet=True), **{k: self.entries[k] for k in self._fresh}}
        data = {"format": CACHE_FORMAT, "torch": torch.__version__,
                "entries": {k: e.as_json() for k, e in sorted(merged.items())}}  # fmt: skip
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.file.parent, prefix=".ns_paths.")
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(data, out, indent=1)
            os.replace(temporary, self.file)
        except OSError as error:
            warnings.warn(
                f"Cannot write the Newton-Schulz path cache {self.file} ({error}); set "
                f"{CACHE_DIR_ENV} to a writable directory to keep the tuned paths across runs.",
                UserWarning,
                stacklevel=3,
            )
