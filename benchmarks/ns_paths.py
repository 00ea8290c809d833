"""The Newton-Schulz paths on this CPU: the figures ``CPU_PATHS`` rests on.

Run from the repository root::

    python -m benchmarks --cases paths
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python -m benchmarks --cases paths   # AMX off

Newton-Schulz alone (the standard iteration, HyperParallel's 5 steps) on the
matrices of the transformer sets, bucketed by shape as Muon buckets them, in
the dtype Muon iterates in here and in float32. Each row times one path
against one batched GEMM per product with ``P^T @ X``:

- batched or per matrix (symmetric products, from ``PER_MATRIX_FROM`` rows);
- ``a X + P X`` with ``P`` read as stored or through its transposed view.

The note names the CPU kind (``hyper_parallel.core.compat.cpu_kind``) and the
path the table in ``newton_schulz._paths`` chose for it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from benchmarks.common import (
    Row,
    Settings,
    case_command,
    interleaved_medians,
    transformer_shapes,
)
from hyper_parallel_builtins.newton_schulz._coefficients import ASYM5_COEFFICIENTS
from hyper_parallel_builtins.newton_schulz._iterate import newton_schulz_batched
from hyper_parallel_builtins.newton_schulz._paths import PER_MATRIX_FROM, StackPath, cpu_path
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

__all__ = ["case_paths"]


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
    buckets: list[list[torch.Tensor]], dtype: torch.dtype, per_matrix: bool, transposed: bool
) -> Callable[[], None]:
    ws = _ForcedPaths(per_matrix, transposed)

    def run() -> None:
        for matrices in buckets:
            newton_schulz_batched(
                matrices, ASYM5_COEFFICIENTS, dtype=dtype, method="standard", workspace=ws
            )

    return run


def case_paths(settings: Settings) -> Iterator[Row]:
    from hyper_parallel.core.compat import cpu_kind
    from hyper_parallel_builtins.muon import default_ns_dtype

    kind = cpu_kind()
    dtypes = dict.fromkeys([default_ns_dtype(torch.empty(0)), torch.float32])
    gen = torch.Generator().manual_seed(0)
    for dim, dtype in itertools.product(settings.dims, dtypes):
        shapes = Counter(transformer_shapes(dim, settings.layers))
        buckets = [[torch.randn(s, generator=gen) for _ in range(n)] for s, n in shapes.items()]
        runs = {
            (per, transposed): _runner(buckets, dtype, per, transposed)
            for per in (False, True)
            for transposed in (True, False)
        }
        names = {key: f"{'per matrix' if key[0] else 'batched'}, "
                      f"{'P^T @ X' if key[1] else 'P @ X'}" for key in runs}  # fmt: skip
        medians, _ = interleaved_medians(
            {names[k]: run for k, run in runs.items()}, settings.repeats, "cpu"
        )
        chosen = cpu_path(dtype, torch.device("cpu"))
        picked = (chosen.per_matrix, chosen.poly_transposed)
        base = names[(False, True)]
        what = f"Newton-Schulz paths, d={dim}, {str(dtype).removeprefix('torch.')}, CPU {kind}"
        for key, name in names.items():
            if name == base:
                continue
            note = f"the path chosen for {kind}" if key == picked else ""
            yield Row(what, name, medians[name], base, medians[base], "s", "", note,
                      case_command("paths", settings, f"--dims {dim}"))  # fmt: skip
