"""Newton-Schulz paths chosen by measurement on the machine they run on, and remembered.

:data:`~hyper_parallel_builtins.newton_schulz._paths.CPU_PATHS` holds the path
measured on a few CPU kinds; two CPUs of one kind can differ, and a device no
one has measured falls back to a FLOP count. :func:`tune` times instead the
ways the standard iteration can run a stack of one shape (:func:`candidates`:
batched or per matrix, ``P @ X`` or ``P^T @ X``, a tall stack transposed or
read through a view, and float32 where the default dtype is lower precision),
keeps the fastest, and writes it to a :class:`PathCache` in the per-user cache
directory, so a later run on the same machine reads it and measures nothing.
Every candidate computes the same numbers up to the iteration's own rounding.
Where ``ns_method="auto"``'s rule picks Gram Newton-Schulz, the rule's Gram
path is timed against the standard candidates: the standard iteration is what
Gram approximates, so choosing it never loses precision. A stack the rule runs
by the standard iteration never gets Gram (its numbers differ more).

``$HYPER_PARALLEL_NS_TUNING`` (:class:`Tuning`) turns it on (the default),
off (the table decides, bitwise as before) or to measure again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import json
import logging
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.core.compat import cpu_kind
from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError
from hyper_parallel.core.options import CACHE_DIR_ENV, default_cache_dir, did_you_mean
from hyper_parallel_builtins.newton_schulz._coefficients import ASYM5_COEFFICIENTS
from hyper_parallel_builtins.newton_schulz._iterate import (
    SYMMETRIC_BLOCK_ROWS,
    newton_schulz_batched,
)
from hyper_parallel_builtins.newton_schulz._paths import StackPath, resolve_ns_method, stack_path
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

__all__ = [
    "CACHE_DIR_ENV",
    "TUNING_ENV",
    "Candidate",
    "PathCache",
    "ShapeReport",
    "ShapeSet",
    "Stack",
    "Tuning",
    "TuningReport",
    "candidates",
    "default_cache_dir",
    "parse_tuning",
    "seconds_of",
    "stacks_of",
    "tune",
    "tuning_from_env",
]

_log = logging.getLogger(__name__)

#: Environment variable: ``on`` (the default), ``off`` or ``retune`` (:class:`Tuning`).
TUNING_ENV = "HYPER_PARALLEL_NS_TUNING"


#: The cache file's name in the cache directory, and its format version: a file of
#: another version (or written by another torch) is ignored and rewritten.
CACHE_FILE = "ns_paths.json"
CACHE_FORMAT = 2

#: Matrices of a stack each candidate is timed on (fewer where the stack has fewer):
#: a subset, so tuning a stack costs a few of its iterations, not a few steps of it.
SAMPLE_MATRICES = 2

#: Each candidate is timed once, in turn, then once more unless it took more than this
#: factor times the fastest (a burst of other work hits one round, not one candidate;
#: a figure is the fastest call). Float32's other layouts are not timed where its first
#: took more than this factor times the fastest: a layout moves the time by tens of
#: percent, not twofold.
DROP_FACTOR = 2.0

#: Another candidate replaces the table's path only where it took less than this
#: fraction of the table's time: a candidate's time on the sample moves by several
#: percent from one tuning to the next, so a smaller lead is as likely noise.
SWITCH_BELOW = 0.95

#: Dtypes below float32's precision, for which float32 is a candidate.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Tuning(enum.Enum):
    """Whether Newton-Schulz paths are measured (:data:`TUNING_ENV`, Muon's ``ns_tuning``).

    ``ON``: the cached choice, else measured and cached. ``OFF``: the table
    of ``_paths`` decides, bitwise as without tuning; nothing is measured or
    written. ``RETUNE``: measured again and the cache overwritten.
    """

    ON = "on"
    OFF = "off"
    RETUNE = "retune"


def parse_tuning(value: str | Tuning, origin: str = "ns_tuning") -> Tuning:
    """``value`` as a :class:`Tuning`; ``origin`` names where it came from in the error.

    Raises:
        ValueError: anything but ``"on"``, ``"off"`` or ``"retune"``.
    """
    if isinstance(value, Tuning):
        return value
    choices = [t.value for t in Tuning]
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in choices:
        raise HyperParallelValueError(
            f"{origin}={value!r} is not a tuning mode; use one of "
            f"{', '.join(map(repr, choices))}.{did_you_mean(str(value), choices)}"
        )
    return Tuning(name)


def tuning_from_env() -> Tuning:
    """What :data:`TUNING_ENV` says; :attr:`Tuning.ON` where it is unset or empty.

    Raises:
        ValueError: a value that is no :class:`Tuning`, naming the variable.
    """
    value = os.environ.get(TUNING_ENV, "").strip()
    return parse_tuning(value, TUNING_ENV) if value else Tuning.ON


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
                   s.rows, s.cols, s.count, _dtype_name(s.dtype), s.dtype_free, s.gram)  # fmt: skip

    @property
    def key(self) -> str:
        """The cache file's key."""
        free = ", float32 allowed" if self.dtype_free else ""
        gram = ", Gram by rule" if self.gram else ""
        return (
            f"{self.device} | torch {self.torch_version} | {self.threads} threads | "
            f"{self.rows}x{self.cols} x{self.count} | {self.dtype}{free}{gram}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
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
            return f"{_dtype_name(self.dtype)}, Gram"
        parts = [
            _dtype_name(self.dtype),
            "per matrix" if self.path.per_matrix else "batched",
            "P^T @ X" if self.path.poly_transposed else "P @ X",
        ]
        if self.path.tall_transposed:
            parts.append("tall transposed")
        return ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"dtype": _dtype_name(self.dtype), **dataclasses.asdict(self.path)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Candidate:
        flags = [data[f.name] for f in dataclasses.fields(StackPath)]
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or not all(isinstance(f, bool) for f in flags):
            raise HyperParallelValueError(f"not a candidate: {dict(data)}")
        return cls(dtype, StackPath(*flags))


def candidates(stack: Stack) -> list[Candidate]:
    """The ways the iteration can run ``stack``, all giving its numbers up to rounding.

    The standard iteration's: per matrix only where a symmetric product has
    more than one block of :data:`SYMMETRIC_BLOCK_ROWS` (else it multiplies
    what one batched GEMM does), a transposed layout only for tall stacks,
    float32 only where the dtype is free and lower precision; each dtype's
    first is the table's path. A stack the rule runs by Gram
    (:attr:`Stack.gram`) has the rule's Gram path first, then those.
    """
    free = stack.dtype_free and stack.dtype in _LOW_PRECISION
    pers = [False, True] if min(stack.rows, stack.cols) > SYMMETRIC_BLOCK_ROWS else [False]
    talls = [False, True] if stack.rows > stack.cols else [False]
    made = []
    if stack.gram:
        made.append(Candidate(stack.dtype, stack_path("gram", stack.rows, stack.cols, stack.dtype,
                                                      stack.device)))  # fmt: skip
    for dtype in [stack.dtype, torch.float32] if free else [stack.dtype]:
        made.append(Candidate(dtype, stack_path("standard", stack.rows, stack.cols, dtype,
                                                stack.device)))  # fmt: skip
        made += [Candidate(dtype, StackPath(False, per, poly, tall))
                 for per, poly, tall in itertools.product(pers, (False, True), talls)]  # fmt: skip
    return list(dict.fromkeys(made))


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CPU has none; torch_npu registers ``torch.npu``)."""
    synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
    if device.type != "cpu" and callable(synchronize):
        synchronize(device)


def seconds_of(candidate: Candidate, run: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``run`` (``candidate``'s iteration on a sample) on ``device``."""
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class ShapeReport:
    """What tuning decided for one stack.

    Attributes:
        stack: The stack (this rank's device).
        chosen: The candidate it runs from now on.
        seconds: Each candidate's measured seconds on the sample, by
            :attr:`Candidate.name` (from the cache where it came from there).
        cost_s: Seconds this measurement took here (0 from the cache).
        cached: The choice was read from the cache, not measured now.
    """

    stack: Stack
    chosen: Candidate
    seconds: Mapping[str, float]
    cost_s: float
    cached: bool


@dataclass(frozen=True)
class TuningReport:
    """What :func:`tune` decided for a set of stacks, and what it cost.

    ``cost_s`` is the wall time of the whole tuning on this rank (in a
    distributed run, waiting for rank 0's measurement included).
    """

    shapes: tuple[ShapeReport, ...] = ()
    cost_s: float = 0.0

    @property
    def cached(self) -> bool:
        """Every choice came from the cache: nothing was measured."""
        return all(s.cached for s in self.shapes)

    def __add__(self, other: TuningReport) -> TuningReport:
        return TuningReport(self.shapes + other.shapes, self.cost_s + other.cost_s)

    def keep_in(self, workspace: Workspace) -> dict[tuple[int, int, torch.dtype], torch.dtype]:
        """Hand each stack's chosen path to ``workspace`` (:meth:`Workspace.keep_path`).

        Returns:
            ``(rows, cols, dtype) -> float32`` for the stacks whose chosen
            dtype is not their default one.
        """
        dtypes = {}
        for shape in self.shapes:
            s, chosen = shape.stack, shape.chosen
            workspace.keep_path(s.rows, s.cols, chosen.dtype, s.device, chosen.path)
            if chosen.dtype != s.dtype:
                dtypes[(s.rows, s.cols, s.dtype)] = chosen.dtype
        return dtypes

    def __str__(self) -> str:
        """One line per stack: the shape, the choice, each candidate's milliseconds."""
        stacks = f"{len(self.shapes)} stack{'' if len(self.shapes) == 1 else 's'}"
        made = [f"Newton-Schulz tuning: {stacks}, {self.cost_s:.3f} s"]
        for s in self.shapes:
            where = "cached" if s.cached else f"measured in {s.cost_s:.3f} s"
            times = "; ".join(f"{name} {1e3 * t:.2f} ms" for name, t in s.seconds.items())
            made.append(
                f"  {s.stack.rows}x{s.stack.cols} x{s.stack.count} {_dtype_name(s.stack.dtype)}: "
                f"{s.chosen.name} ({where}) [{times}]"
            )
        return "\n".join(made)


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


def stacks_of(
    matrices: Sequence[tuple[int, int, int, torch.dtype, torch.device]],
    method: str,
    dtype_free: bool,
) -> list[Stack]:
    """The stacks ``(count, rows, cols, dtype, device)`` matrices make, bucketed by all but count.

    Under ``method="gram"`` none: the user chose Gram. Under ``"auto"``, a
    stack its rule runs by Gram is marked :attr:`Stack.gram`.
    """
    counts: dict[tuple[int, int, torch.dtype, torch.device], int] = {}
    for count, rows, cols, dtype, device in matrices:
        if method != "gram":
            key = (rows, cols, dtype, device)
            counts[key] = counts.get(key, 0) + count
    return [
        Stack(r, c, n, dt, dev, dtype_free, gram=resolve_ns_method(method, r, c, dev) == "gram")
        for (r, c, dt, dev), n in counts.items()
    ]


def _measure(stack: Stack) -> dict[str, tuple[Candidate, float]]:
    """The candidates' seconds on a sample of ``stack``, timed as :data:`DROP_FACTOR` says."""
    gen = torch.Generator().manual_seed(0)  # not the global one: a run's own draws stay
    shape = (min(stack.count, SAMPLE_MATRICES), stack.rows, stack.cols)
    sample = torch.randn(shape, generator=gen).to(stack.device)
    workspace, key = Workspace(), (stack.rows, stack.cols)

    def runner(candidate: Candidate) -> Callable[[], object]:
        def run() -> object:
            workspace.keep_path(*key, candidate.dtype, stack.device, candidate.path)
            method = "gram" if candidate.path.gram else "standard"
            return newton_schulz_batched([sample], ASYM5_COEFFICIENTS, dtype=candidate.dtype,
                                         method=method, workspace=workspace)  # fmt: skip

        return run

    runs = {c: runner(c) for c in candidates(stack)}
    next(iter(runs.values()))()  # warm-up: the buffers, the process's first products
    seconds: dict[Candidate, float] = {}
    hopeless: set[torch.dtype] = set()
    for candidate, run in runs.items():
        if candidate.dtype not in hopeless:
            seconds[candidate] = seconds_of(candidate, run, stack.device)
            best = min(seconds.values())
            if candidate.dtype != stack.dtype and seconds[candidate] > DROP_FACTOR * best:
                hopeless.add(candidate.dtype)
    for candidate in [c for c, t in seconds.items() if t <= DROP_FACTOR * best]:
        again = seconds_of(candidate, runs[candidate], stack.device)
        seconds[candidate] = min(seconds[candidate], again)
    return {c.name: (c, t) for c, t in seconds.items()}


def _chosen(measured: Sequence[tuple[Candidate, float]]) -> Candidate:
    """The fastest candidate where it beats the table's (the first) by :data:`SWITCH_BELOW`."""
    table, table_s = measured[0]
    fastest, fastest_s = min(measured, key=lambda pair: pair[1])
    return fastest if fastest_s < SWITCH_BELOW * table_s else table


def _tune_here(stacks: Sequence[Stack], mode: Tuning, cache: PathCache | None) -> list[ShapeReport]:
    """Each stack's choice: the cache's, else measured (and kept in the cache)."""
    reports = []
    for stack in stacks:
        key = ShapeSet.of(stack).key
        kept = cache.get(key, retune=mode is Tuning.RETUNE) if cache is not None else None
        if kept is not None:
            reports.append(ShapeReport(stack, kept.chosen, kept.seconds, 0.0, cached=True))
            continue
        start = time.perf_counter()
        measured = _measure(stack)
        chosen = _chosen(list(measured.values()))
        seconds = {name: t for name, (_, t) in measured.items()}
        reports.append(ShapeReport(stack, chosen, seconds, time.perf_counter() - start, False))
        if cache is not None:
            cache.put(key, chosen, seconds)
    if cache is not None and any(not r.cached for r in reports):
        cache.save()
    return reports


def tune(
    stacks: Sequence[Stack],
    mode: Tuning = Tuning.ON,
    cache: PathCache | None = None,
    group: dist.ProcessGroup | None = None,
) -> TuningReport:
    """The fastest candidate (:func:`candidates`) of each stack on this machine.

    ``mode`` :attr:`Tuning.ON` reads ``cache`` (where given) and measures
    only what it lacks; :attr:`Tuning.RETUNE` measures every stack again
    (a key measured since ``cache`` was made is not measured twice);
    :attr:`Tuning.OFF` decides nothing (an empty report). Measured choices
    are written to ``cache``.

    In a distributed run (``torch.distributed`` initialized, more than one
    rank in ``group``, default the world), every rank of ``group`` must call
    it with the same stacks: rank 0 of the group tunes (reading and writing
    its cache) and broadcasts its choices, so every rank runs the same paths.

    Raises:
        RuntimeError: ranks passed different numbers of stacks.
    """
    start = time.perf_counter()
    if mode is Tuning.OFF or not stacks:
        return TuningReport()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        shapes = _from_rank_0(stacks, mode, cache, group)
    else:
        shapes = tuple(_tune_here(stacks, mode, cache))
    report = TuningReport(shapes, time.perf_counter() - start)
    if not report.cached:
        _log.info("%s", report)
    return report


def _from_rank_0(
    stacks: Sequence[Stack], mode: Tuning, cache: PathCache | None, group: dist.ProcessGroup | None
) -> tuple[ShapeReport, ...]:
    """Rank 0's choices for ``stacks``, on every rank of ``group`` (rank 0 tunes)."""
    box: list[list[ShapeReport] | None] = [None]
    if dist.get_rank(group) == 0:
        box[0] = _tune_here(stacks, mode, cache)
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0),
                               group=group)  # fmt: skip
    theirs = box[0] or []
    if len(theirs) != len(stacks):
        raise HyperParallelRuntimeError(
            f"Newton-Schulz tuning: rank 0 tuned {len(theirs)} stacks, this rank has "
            f"{len(stacks)}; every rank must decide the same param groups in the same order."
        )
    return tuple(
        ShapeReport(mine, r.chosen, r.seconds, r.cost_s, r.cached)
        for mine, r in zip(stacks, theirs, strict=True)
    )
