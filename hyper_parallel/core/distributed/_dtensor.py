"""DTensor helpers that import nothing until DTensors exist.

``torch.distributed.tensor`` (and sympy behind it) is most of the import time
of a process that never shards anything. A DTensor can exist only once its
module has been imported, so a check that looks the module up in
``sys.modules`` is exact and free: nothing is imported until the caller
actually has DTensors.

FSDP over a tensor-parallel param splits one tensor dim twice; torch writes
the outer split as ``_StridedShard``, a private placement, reached through
:mod:`hyper_parallel.core.compat`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.core.compat import strided_shard_type

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local_indices", "local_tensor", "shard_like", "split_dim"]

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor's module."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place ops reach it), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


def shard_like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) laid out like ``template``; ``local`` itself for plain tensors."""
    if not is_dtensor(template):
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(template, DTensor)
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False,
        shape=template.shape, stride=template.stride(),
    )  # fmt: skip


def split_dim(placement: Any) -> int | None:
    """The tensor dim a placement splits (``Shard`` or FSDP+TP's ``_StridedShard``), else ``None``."""
    from torch.distributed.tensor import Shard

    if isinstance(placement, (Shard, strided_shard_type())):
        return int(placement.dim)
    return None


def local_indices(t: DTensor, dim: int) -> torch.Tensor:
    """The global indices along ``dim`` of the rows (slices) this rank's shard of ``t`` holds.

    Computed by laying out ``arange(t.shape[dim])`` with the placements that
    split ``dim`` (the others read as ``Replicate``): DTensor's own split,
    strided ones included, with no communication.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    strided = strided_shard_type()

    placements: list[Any] = []
    for p in t.placements:
        if split_dim(p) != dim:
            placements.append(Replicate())
        elif isinstance(p, strided):
            placements.append(strided(0, split_factor=p.split_factor))
        else:
            placements.append(Shard(0))
    positions = torch.arange(t.shape[dim])
    laid_out = distribute_tensor(positions, t.device_mesh, placements, src_data_rank=None)
    return laid_out.to_local().cpu()
