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

import enum
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean
from hyper_parallel_builtins.newton_schulz._coefficients import ASYM5_COEFFICIENTS
from hyper_parallel_builtins.newton_schulz._iterate import (
    SYMMETRIC_BLOCK_ROWS,
    newton_schulz_batched,
)
from hyper_parallel_builtins.newton_schulz._path_cache import (
    Candidate,
    PathCache,
    ShapeSet,
    Stack,
    dtype_name,
)
from hyper_parallel_builtins.newton_schulz._paths import StackPath, resolve_ns_method, stack_path
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

__all__ = [
    "TUNING_ENV",
    "ShapeReport",
    "Tuning",
    "TuningReport",
    "candidates",
    "parse_tuning",
    "seconds_of",
    "stacks_of",
    "tune",
    "tuning_from_env",
]

_log = logging.getLogger(__name__)

#: Environment variable: ``on`` (the default), ``off`` or ``retune`` (:class:`Tuning`).
TUNING_ENV = "HYPER_PARALLEL_NS_TUNING"


#: Matrices of a stack each candidate is timed on (fewer where the stack has fewer):
#: a subset, so tuning a stack costs a few of its iterations, not a few steps of it.
SAMPLE_MATRICES = 2

#: Each candidate is timed once, in turn, then once more unless it took more than this
#: factor times the fastest (a burst of other work hits one round, not one candidate;
#: a figure is the fastest call). Float32's other layouts are not timed where its first
#: took more than this factor times the fastest: a layout moves the time by tens of
#: percent, not twofold.
DROP_FACTOR = 2.0

#: Another candidate replaces the default path (the table's; where that is Gram, the
#: fastest standard candidate) only where it took less than this fraction of the
#: default's time: a candidate's time on the sample moves by several percent from one
#: tuning to the next, so a smaller lead is as likely noise.
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
                f"  {s.stack.rows}x{s.stack.cols} x{s.stack.count} {dtype_name(s.stack.dtype)}: "
                f"{s.chosen.name} ({where}) [{times}]"
            )
        return "\n".join(made)


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
    """The fastest candidate where it beats the default by :data:`SWITCH_BELOW`, else the default.

    The default is the table's path (the first), except where that is Gram:
    then it is the fastest standard candidate, and Gram is kept only where
    it is clearly faster. A tie goes to the standard iteration, the reference
    Gram approximates (on the d=512 MLP stacks on one thread, the two
    sampled within 2% of each other while the standard one ran 5-8% faster
    on the whole stacks).
    """
    default, default_s = measured[0]
    if default.path.gram:
        standard = [pair for pair in measured if not pair[0].path.gram]
        if standard:
            default, default_s = min(standard, key=lambda pair: pair[1])
    fastest, fastest_s = min(measured, key=lambda pair: pair[1])
    return fastest if fastest_s < SWITCH_BELOW * default_s else default


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
