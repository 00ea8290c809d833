"""The Newton-Schulz paths on this machine: what tuning chooses, what the table chose.

Run from the repository root::

    python -m benchmarks --cases paths
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python -m benchmarks --cases paths   # AMX off

On the matrices of the transformer sets, bucketed by shape as Muon buckets
them, per model width:

- **Tuning** (``newton_schulz.tune``), into a cache directory of its own, so
  it always measures: per stack the standard iteration runs, each
  candidate's seconds on the tuner's sample against the table's path
  (``CPU_PATHS``, what runs with tuning off), and which was chosen; then
  the whole tuning's seconds against one Muon step's Newton-Schulz on the
  set (the ratio is the cost in steps).
- **The whole set**: Newton-Schulz on every matrix of the set, as Muon runs
  it (Gram where ``ns_method="auto"`` picks it), on the tuned paths and
  dtypes against the table's.
- **The table's figures**: the standard iteration on every matrix, in the
  dtype Muon iterates in here and in float32, each path against one batched
  GEMM per product with ``P^T @ X``: batched or per matrix (symmetric
  products, from ``PER_MATRIX_FROM`` rows), ``a X + P X`` with ``P`` read as
  stored or through its transposed view. The note names the CPU kind
  (``hyper_parallel.core.compat.cpu_kind``) and the path the table gives it.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch

from benchmarks.common import (
    Row,
    Settings,
    case_command,
    interleaved_medians,
    transformer_shapes,
)
from hyper_parallel.core.compat import cpu_kind
from hyper_parallel_builtins.newton_schulz import (
    PathCache,
    ShapeReport,
    Tuning,
    TuningReport,
    stacks_of,
    tune,
)
from hyper_parallel_builtins.newton_schulz._coefficients import ASYM5_COEFFICIENTS
from hyper_parallel_builtins.newton_schulz._iterate import newton_schulz_batched
from hyper_parallel_builtins.newton_schulz._path_cache import device_name
from hyper_parallel_builtins.newton_schulz._paths import PER_MATRIX_FROM, StackPath, cpu_path
from hyper_parallel_builtins.newton_schulz._tuning import SAMPLE_MATRICES
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

__all__ = ["case_paths"]

_Buckets = Mapping[tuple[int, int], list[torch.Tensor]]


class _ForcedPaths(Workspace):
    """A workspace whose stacks take one given path: batched or per matrix, ``P`` read or not transposed.

    Per matrix applies, as in the library, from :data:`PER_MATRIX_FROM` rows and columns.
    """

    def __init__(self, per_matrix: bool, transposed: bool) -> None:
        super().__init__()
        self.per_matrix, self.transposed = per_matrix, transposed

    def path(
        self, method: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> StackPath:
        chosen = super().path(method, rows, cols, dtype, device)
        per = self.per_matrix and min(rows, cols) >= PER_MATRIX_FROM
        return dataclasses.replace(chosen, per_matrix=per, poly_transposed=self.transposed)


def _runner(
    buckets: _Buckets,
    dtypes: Mapping[tuple[int, int], torch.dtype],
    workspace: Workspace,
    method: str = "standard",
) -> Callable[[], None]:
    """Newton-Schulz on every bucket, each in its dtype, on the paths ``workspace`` gives."""

    def run() -> None:
        for shape, matrices in buckets.items():
            newton_schulz_batched(matrices, ASYM5_COEFFICIENTS, dtype=dtypes[shape],
                                  method=method, workspace=workspace)  # fmt: skip

    return run


def _threads() -> str:
    threads = torch.get_num_threads()
    return f"{threads} thread{'s' if threads > 1 else ''}"


def case_paths(settings: Settings) -> Iterator[Row]:
    """Per model width: tuning's choices and cost, tuned against the table, the table's figures."""
    from hyper_parallel_builtins.muon import default_ns_dtype

    device = torch.device(settings.device)
    default = default_ns_dtype(torch.empty(0, device=device))
    gen = torch.Generator().manual_seed(0)
    for dim in settings.dims:
        shapes = Counter(transformer_shapes(dim, settings.layers))
        buckets = {s: [torch.randn(s, generator=gen).to(device) for _ in range(n)]
                   for s, n in shapes.items()}  # fmt: skip
        command = case_command("paths", settings, f"--dims {dim}")
        yield from _tuning_rows(settings, dim, buckets, default, command)
        if device.type == "cpu":  # the table (tuning off) is CPU_PATHS, by CPU kind
            for dtype in dict.fromkeys([default, torch.float32]):
                yield from _table_rows(settings, dim, buckets, dtype, command)


def _tuning_rows(
    settings: Settings, dim: int, buckets: _Buckets, default: torch.dtype, command: str
) -> Iterator[Row]:
    """Tuning into an empty cache: each stack's candidates and choice, the cost, tuned vs table."""
    device = torch.device(settings.device)
    matrices = [(len(m), *shape, default, device) for shape, m in buckets.items()]
    with tempfile.TemporaryDirectory() as cache:
        report = tune(stacks_of(matrices, "auto", dtype_free=True), Tuning.ON, PathCache(cache))
    place = f"CPU {cpu_kind()}, {_threads()}" if device.type == "cpu" else device_name(device)
    for shape in report.shapes:
        yield from _candidate_rows(shape, dim, place, command)
    tuned_ws = Workspace()
    tuned = report.keep_in(tuned_ws)
    runs = {
        "tuned": _runner(buckets, {s: tuned.get((*s, default), default) for s in buckets},
                         tuned_ws, "auto"),
        "table": _runner(buckets, dict.fromkeys(buckets, default), Workspace(), "auto"),
    }  # fmt: skip
    medians, _ = interleaved_medians(runs, settings.repeats, settings.device)
    what = f"Newton-Schulz on the d={dim} x {settings.layers} layers set, {place}"
    yield Row(what, "tuned paths and dtypes", medians["tuned"], "the table's (tuning off)",
              medians["table"], "s", "", "ns_method='auto', as Muon runs it", command)  # fmt: skip
    yield _cost_row(report, what, medians["tuned"], command)


def _candidate_rows(shape: ShapeReport, dim: int, place: str, command: str) -> Iterator[Row]:
    """One row per candidate the tuner timed on ``shape``'s stack, against the table's path."""
    s = shape.stack
    table = next(iter(shape.seconds))  # the first candidate is the table's path
    what = (f"Newton-Schulz tuning, d={dim}, stack {s.count} x {s.rows} x {s.cols}, "
            f"{str(s.dtype).removeprefix('torch.')} default, {place}")  # fmt: skip
    sample = min(s.count, SAMPLE_MATRICES)
    for name, seconds in shape.seconds.items():
        notes = ["chosen"] * (name == shape.chosen.name) + ["the table's"] * (name == table)
        notes.append(f"{sample} of {s.count} matrices timed")
        yield Row(what, name, seconds, f"the table's: {table}", shape.seconds[table], "s",
                  note="; ".join(notes), command=command)  # fmt: skip


def _cost_row(report: TuningReport, what: str, step_ns_s: float, command: str) -> Row:
    """The whole tuning's seconds against one step's Newton-Schulz on the set (ratio: in steps)."""
    tried = sum(len(s.seconds) for s in report.shapes)
    return Row(f"{what}, tuning cost", f"tuning {len(report.shapes)} stacks ({tried} candidates)",
               report.cost_s, "one Muon step's Newton-Schulz (tuned)", step_ns_s, "s",
               note="ratio: the cost in steps' Newton-Schulz; paid once, then read from the cache",
               command=command)  # fmt: skip


def _table_rows(
    settings: Settings, dim: int, buckets: _Buckets, dtype: torch.dtype, command: str
) -> Iterator[Row]:
    """Each forced path of the standard iteration against batched ``P^T @ X`` (``CPU_PATHS``'s figures)."""
    kind = cpu_kind()
    dtypes = dict.fromkeys(buckets, dtype)
    keys = list(itertools.product((False, True), (True, False)))
    names = {key: f"{'per matrix' if key[0] else 'batched'}, "
                  f"{'P^T @ X' if key[1] else 'P @ X'}" for key in keys}  # fmt: skip
    runs = {names[k]: _runner(buckets, dtypes, _ForcedPaths(*k)) for k in keys}
    medians, _ = interleaved_medians(runs, settings.repeats, "cpu")
    chosen = cpu_path(dtype, torch.device("cpu"))
    picked = (chosen.per_matrix, chosen.poly_transposed)
    base = names[(False, True)]
    what = (f"Newton-Schulz paths, d={dim}, {str(dtype).removeprefix('torch.')}, CPU {kind}, "
            f"{_threads()}")  # fmt: skip
    for key, name in names.items():
        if name == base:
            continue
        note = f"the table's path for {kind} (tuning off)" if key == picked else ""
        yield Row(what, name, medians[name], base, medians[base], "s", "", note, command)
