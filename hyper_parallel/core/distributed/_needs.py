"""What a matrix optimizer's transform needs of each param: the transform contract.

A matrix optimizer declares, per param, which parts of the full tensor its
transform must see together; a sharding backend plans the communication from
that and the param's placements:

* :class:`WholeMatrices`: each matrix whole (Muon's Newton-Schulz). Leading
  batch dims (a stack of expert matrices) are independent.
* :class:`RowBlocks`: independent blocks of rows of given heights (head-wise
  Muon, the q/k/v parts of a fused projection).
* Row and column sums only (Sinkhorn's norms): no ``Need``; the optimizer
  calls :meth:`ShardingBackend.map_reductions
  <hyper_parallel.core.distributed.ShardingBackend.map_reductions>`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeAlias

from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["Need", "RowBlocks", "WholeMatrices"]


@dataclass(frozen=True)
class WholeMatrices:
    """The transform needs every matrix whole.

    Attributes:
        batch_dims: Leading dims whose slices are independent matrices (1 for
            an ``(experts, rows, cols)`` stack). A param split only along
            them needs no communication.
        key: Handed back with each of the param's blocks (:class:`Blocks`
            ``.keys``), so the transform knows whose block it has, e.g. to
            look up a per-param setting; ``None`` when it need not know.
    """

    batch_dims: int = 0
    key: Hashable = None

    def __post_init__(self) -> None:
        if self.batch_dims < 0:
            raise HyperParallelValueError(f"batch_dims must be >= 0, got {self.batch_dims}.")


@dataclass(frozen=True)
class RowBlocks:
    """The transform treats blocks of rows independently.

    Attributes:
        heights: Row count of each block, in order; they sum to the size of
            the block dim (dim ``batch_dims``). A param split only at block
            boundaries (FSDP row shards holding whole heads, tensor-parallel
            column-wise shards) needs no communication.
        batch_dims: Leading dims whose slices are independent, as in
            :class:`WholeMatrices`.
        key: As in :class:`WholeMatrices`.
    """

    heights: tuple[int, ...]
    batch_dims: int = 0
    key: Hashable = None

    def __post_init__(self) -> None:
        if not self.heights or any(h <= 0 for h in self.heights):
            raise HyperParallelValueError(
                f"heights must be positive row counts, got {self.heights}."
            )
        if self.batch_dims < 0:
            raise HyperParallelValueError(f"batch_dims must be >= 0, got {self.batch_dims}.")


Need: TypeAlias = WholeMatrices | RowBlocks
"""What a transform needs of one param."""
