"""Which path the iteration takes where: per matrix or batched, layouts, standard or Gram.

Every choice rests on a figure measured on one kind of CPU (docs/benchmarks.md,
"Newton-Schulz paths by CPU kind" and "What the iteration's constants rest
on"; ``python -m benchmarks --cases paths`` and ``--cases gram`` run the
comparisons), and a kind or device no one has measured falls back to the
FLOP count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from hyper_parallel.core.compat import cpu_kind
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import did_you_mean

#: From this Gram size on, on CPU, each matrix is iterated with 2-D matmuls
#: rather than one batched matmul, which lets the symmetric products below
#: skip part of the work. At a Gram size of 512 that was slower than the
#: batched path; from 640 rows on it was mostly faster, in bf16 and fp32
#: (measured: docs/benchmarks.md, "What the iteration's constants rest on").
PER_MATRIX_FROM = 640


@dataclass(frozen=True)
class CpuPath:
    """How the standard iteration runs on one CPU kind in one dtype.

    Attributes:
        per_matrix: Stacks of :data:`PER_MATRIX_FROM` rows or more iterate one
            matrix at a time with symmetric products (fewer FLOPs, smaller
            GEMMs); else one batched GEMM per product.
        poly_transposed: ``a X + P X`` reads ``P`` through its transposed
            view (``P^T @ X``), else as stored (``P @ X``). ``P`` is
            symmetric, so the two agree up to rounding, but CPU BLAS picks
            different kernels for the two layouts.
        tall_transposed: A stack of tall matrices is laid out transposed
            (:func:`new_stack`), so the iteration on their wide transposes
            reads contiguous operands; else it reads the stack through a
            transposed view, and filling and reading it need no transposing
            copy.
    """

    per_matrix: bool
    poly_transposed: bool
    tall_transposed: bool = False


#: The path of each (CPU kind, dtype) that was measured: Newton-Schulz alone on
#: the benchmark's transformer sets, 2 threads (``python -m benchmarks --cases
#: paths``), against one batched GEMM per product reading ``P`` transposed.
#: AVX512-BF16 was measured on an AMX CPU with oneDNN capped below AMX; the
#: AVX2 figures are older, from a 2-core AVX2 CPU (measured: docs/benchmarks.md,
#: "Newton-Schulz paths by CPU kind").
CPU_PATHS: Mapping[tuple[str, torch.dtype], CpuPath] = MappingProxyType(
    {
        # batched P @ X was fastest; the Gram product of a transposed view was slow
        ("amx", torch.bfloat16): CpuPath(False, False, tall_transposed=True),
        # per matrix, P @ X was fastest
        ("avx512_bf16", torch.bfloat16): CpuPath(True, False),
        # per matrix, P^T @ X: on fp32, and on AVX2 whose fast layouts read P transposed
        **dict.fromkeys(
            [("amx", torch.float32), ("avx512_bf16", torch.float32),
             ("avx2", torch.float32), ("avx2", torch.bfloat16)],
            CpuPath(True, True),
        ),
    }
)  # fmt: skip

#: A (CPU kind, dtype) no one has measured: the FLOP count decides. Symmetric
#: products do fewer FLOPs, and the two layouts do the same FLOPs.
UNMEASURED_CPU_PATH = CpuPath(per_matrix=True, poly_transposed=True)

#: Accelerators (not measured): one batched GEMM per product, a few large
#: kernels rather than the many small ones of the symmetric products.
ACCELERATOR_PATH = CpuPath(per_matrix=False, poly_transposed=True)


def cpu_path(dtype: torch.dtype, device: torch.device, kind: str | None = None) -> CpuPath:
    """The path the standard iteration takes in ``dtype`` on ``device`` (:data:`CPU_PATHS`).

    ``kind`` is the CPU's (:func:`~hyper_parallel.core.compat.cpu_kind`),
    read from the machine where not given.
    """
    if device.type != "cpu":
        return ACCELERATOR_PATH
    return CPU_PATHS.get((kind or cpu_kind(), dtype), UNMEASURED_CPU_PATH)


def per_matrix(x: Tensor, path: CpuPath) -> bool:
    """Whether the stack ``x`` iterates matrix by matrix (:data:`PER_MATRIX_FROM`)."""
    return path.per_matrix and x.shape[-2] >= PER_MATRIX_FROM


#: The ways to run the iteration (``method`` of :func:`newton_schulz_batched`).
NS_METHODS = ("standard", "gram")

#: ``ns_method="auto"`` picks Gram Newton-Schulz for a matrix whose long side
#: is at least this many times its short side, by device type. On a 2-core
#: AVX2 CPU Gram took less time than the standard iteration from aspect 2.7
#: on, in fp32 and bf16 (measured: docs/benchmarks.md, "What the iteration's
#: constants rest on"). Elsewhere (not measured) the FLOP count decides: Gram
#: does fewer FLOPs from aspect 2 on; the margin is the CPU's.
GRAM_MIN_ASPECT: Mapping[str, float] = MappingProxyType({"cpu": 2.5})

#: :data:`GRAM_MIN_ASPECT` for device types it does not list.
GRAM_MIN_ASPECT_DEFAULT = 2.5

#: On a CPU, from :data:`PER_MATRIX_FROM` rows on the standard iteration
#: multiplies only half of each symmetric product, so Gram pays off later: in
#: fp32 it took longer than the standard iteration at aspect 2.7 and less at 4
#: (measured: docs/benchmarks.md, "What the iteration's constants rest on").
GRAM_MIN_ASPECT_CPU_LARGE = 3.5


def resolve_ns_method(method: str, rows: int, cols: int, device: torch.device) -> str:
    """``"standard"`` or ``"gram"`` for a ``rows x cols`` matrix on ``device``.

    ``method`` is one of :data:`NS_METHODS` (returned as is) or ``"auto"``:
    Gram from :data:`GRAM_MIN_ASPECT` of the device type on (on a CPU,
    :data:`GRAM_MIN_ASPECT_CPU_LARGE` for matrices of
    :data:`PER_MATRIX_FROM` rows or more).

    Raises:
        ValueError: an unknown ``method``.
    """
    if method in NS_METHODS:
        return method
    if method != "auto":
        choices = ("auto", *NS_METHODS)
        raise HyperParallelValueError(
            f"Unknown ns_method {method!r}. Use one of {', '.join(map(repr, choices))}."
            f"{did_you_mean(str(method), choices)}"
        )
    small = min(rows, cols)
    threshold = GRAM_MIN_ASPECT.get(device.type, GRAM_MIN_ASPECT_DEFAULT)
    if device.type == "cpu" and small >= PER_MATRIX_FROM:
        threshold = GRAM_MIN_ASPECT_CPU_LARGE
    return "gram" if max(rows, cols) >= threshold * small else "standard"


@dataclass(frozen=True)
class StackPath:
    """How a stack of one shape, dtype and device is iterated, decided once (:func:`stack_path`).

    Attributes:
        gram: Gram Newton-Schulz (:func:`resolve_ns_method`), else the standard iteration.
        per_matrix: The standard iteration runs matrix by matrix (:func:`per_matrix`).
        poly_transposed: ``a X + P X`` reads ``P`` transposed (:attr:`CpuPath.poly_transposed`).
        tall_transposed: A tall stack for the standard iteration is laid out transposed
            (:attr:`CpuPath.tall_transposed`).
    """

    gram: bool
    per_matrix: bool
    poly_transposed: bool
    tall_transposed: bool


def stack_path(
    method: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> StackPath:
    """Every choice :data:`CPU_PATHS` and :func:`resolve_ns_method` make for ``(rows, cols)`` stacks."""
    device = torch.device(device)
    standard = resolve_ns_method(method, rows, cols, device) == "standard"
    path = cpu_path(dtype, device)
    return StackPath(
        gram=not standard,
        per_matrix=path.per_matrix and min(rows, cols) >= PER_MATRIX_FROM,
        poly_transposed=path.poly_transposed,
        tall_transposed=rows > cols and path.tall_transposed and standard,
    )
