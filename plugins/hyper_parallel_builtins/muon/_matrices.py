"""How Muon reads a param as matrices: views of N-D params, head and fused-row blocks."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from hyper_parallel.core.distributed import Need, RowBlocks, WholeMatrices
from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["MATRIX_VIEWS", "batch_dims", "matrix_shape", "need", "piece_shape", "row_heights"]

MATRIX_VIEWS = ("auto", "flatten", "batch")
"""Accepted values of ``matrix_view``."""


def batch_dims(ndim: int, matrix_view: str) -> int:
    """Leading dims Newton-Schulz treats independently under ``matrix_view``."""
    if ndim <= 2 or matrix_view == "flatten" or (matrix_view == "auto" and ndim >= 4):
        return 0
    return ndim - 2


def matrix_shape(shape: torch.Size | tuple[int, ...], matrix_view: str) -> tuple[int, int, int]:
    """How Muon reads a param of ``shape``: ``(batch, rows, cols)``.

    ``"auto"``: 2-D as is; 3-D ``(E, m, n)`` is ``E`` matrices ``(m, n)``
    (an expert stack); 4-D and more (conv kernels) is ``(shape[0], rest)``.
    ``"flatten"``: always one matrix ``(shape[0], rest)``. ``"batch"``: all
    dims but the last two are batch dims.
    """
    if len(shape) < 2:
        raise HyperParallelValueError(
            f"Muon needs params with at least 2 dims, got shape {tuple(shape)}."
        )
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if matrix_view == "flatten" or (matrix_view == "auto" and len(shape) >= 4):
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def piece_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
    """How Muon reads a tensor that ``reshape_fn`` or ``ns_transform_fn`` made: ``(batch, rows, cols)``.

    HyperParallel's rule for such pieces: 2-D as is; ``(A, 1, B)`` is one
    ``A x B`` matrix; any other N-D tensor is a batch of its last two dims
    (so ``(1, heads, head_dim, in)`` is ``heads`` matrices).
    """
    if len(shape) < 2:
        raise HyperParallelValueError(
            f"A Newton-Schulz input must have at least two dims, got shape {tuple(shape)}."
        )
    if len(shape) == 3 and shape[1] == 1:
        return 1, shape[0], shape[2]
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def row_heights(
    shape: torch.Size, group: Mapping[str, Any], head_dim: int | None
) -> tuple[int, ...] | None:
    """The independent row blocks of a param under ``split_rows`` and ``head_dim`` (``None``: one matrix).

    Raises:
        ValueError: row counts that do not add up, or a head size that does
            not divide a block, naming the param's shape.
    """
    split_rows = group["split_rows"]
    if head_dim is None and split_rows is None:
        return None
    rows = shape[batch_dims(len(shape), group["matrix_view"])]
    blocks = tuple(split_rows) if split_rows is not None else (rows,)
    if sum(blocks) != rows:
        raise HyperParallelValueError(
            f"split_rows={blocks} adds up to {sum(blocks)} rows, but the param of shape "
            f"{tuple(shape)} has {rows}; give one row count per fused part (e.g. q, k, v)."
        )
    if head_dim is None:
        return blocks
    for block in blocks:
        if block % head_dim:
            where = "its" if split_rows is None else "the split_rows block of"
            raise HyperParallelValueError(
                f"head_dim={head_dim} does not divide {where} {block} rows of the param of shape "
                f"{tuple(shape)} (they must be divisible by head_dim); give the head size of "
                "this projection, or leave the param whole."
            )
    return tuple(head_dim for block in blocks for _ in range(block // head_dim))


def need(
    shape: torch.Size,
    group: Mapping[str, Any],
    head_dim: int | None = None,
    key: Hashable = None,
) -> Need:
    """What Newton-Schulz needs of a param: whole matrices, or independent row blocks."""
    batch = batch_dims(len(shape), group["matrix_view"])
    heights = row_heights(shape, group, head_dim)
    if heights is None:
        return WholeMatrices(batch, key=key)
    return RowBlocks(heights, batch, key=key)


def check_blocks(options: dict[str, Any]) -> None:
    """Check a group's ``head_dim`` and ``split_rows``; store ``split_rows`` as a tuple."""
    head_dim, split_rows = options["head_dim"], options["split_rows"]
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
    ):
        raise HyperParallelValueError(
            f"head_dim should be a positive int or None, got {head_dim!r}."
        )
    if split_rows is not None:
        if isinstance(split_rows, (str, bytes)) or not isinstance(split_rows, Sequence):
            raise HyperParallelValueError(
                f"split_rows should be a tuple of row counts or None, got {split_rows!r}."
            )
        if not split_rows or any(
            isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in split_rows
        ):
            raise HyperParallelValueError(
                f"split_rows should hold positive ints, got {split_rows!r}."
            )
        options["split_rows"] = tuple(split_rows)
