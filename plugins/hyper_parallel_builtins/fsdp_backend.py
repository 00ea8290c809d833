"""Built-in plugin: the ``fsdp`` and ``hsdp`` sharding backends (torch FSDP2).

``fsdp``: params row-sharded over a 1-D mesh (``Shard(0)``). ``hsdp``: a
2-D ``(replicate, shard)`` mesh, params ``(Replicate(), Shard(0))``. Both run
full-matrix work (Muon's Newton-Schulz) with one owner rank per matrix,
balanced over every rank of the mesh, replicas included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import FullTensorsFn, ShardingBackend
from hyper_parallel.core.distributed._dtensor import is_dtensor
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "FSDPBackend", "HSDPBackend"]

#: Environment variable choosing how shards travel to their owner for full-matrix work.
TRANSPORT_ENV = "HYPER_PARALLEL_TRANSPORT"
TRANSPORTS = ("all_to_all", "gather_broadcast")


class FSDPBackend(ShardingBackend):
    """FSDP2 on a 1-D mesh: every param a ``Shard(0)`` DTensor."""

    name: ClassVar[str] = "fsdp"
    mesh_ndim: ClassVar[int] = 1

    def __init__(self) -> None:
        self.transport = os.environ.get(TRANSPORT_ENV, "all_to_all")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"{TRANSPORT_ENV}={self.transport!r} is not a transport; use one of {', '.join(TRANSPORTS)}."
            )

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return bool(params) and all(self._fits(p) for p in params)

    def _fits(self, p: torch.Tensor) -> bool:
        if not is_dtensor(p):
            return False
        from torch.distributed.tensor import DTensor, Replicate, Shard

        assert isinstance(p, DTensor)
        if p.device_mesh.ndim != self.mesh_ndim:
            return False
        *replicated, sharded = p.placements
        return sharded == Shard(0) and all(isinstance(r, Replicate) for r in replicated)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        from hyper_parallel.core.distributed.fsdp import fully_shard

        mesh = options.get("mesh")
        if mesh is not None and mesh.ndim != self.mesh_ndim:
            raise ValueError(
                f"The {self.name!r} backend shards over a {self.mesh_ndim}-D mesh; got a "
                f"{mesh.ndim}-D mesh. Use {'hsdp' if mesh.ndim == 2 else 'fsdp'!r} for that mesh."
            )
        return fully_shard(module, **options)

    def full_matrix_map(
        self,
        fn: FullTensorsFn,
        tensors: Sequence[torch.Tensor],
        *,
        batch_dims: Sequence[int] | None = None,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        from hyper_parallel.core.distributed.full_matrix import sharded_full_matrix_map

        return sharded_full_matrix_map(
            fn, tensors, batch_dims=batch_dims, cost=cost, transport=self.transport
        )


class HSDPBackend(FSDPBackend):
    """FSDP2 on a 2-D ``(replicate, shard)`` mesh: params ``(Replicate(), Shard(0))``."""

    name: ClassVar[str] = "hsdp"
    mesh_ndim: ClassVar[int] = 2


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``fsdp`` and ``hsdp``."""
    register("fsdp", FSDPBackend, description="torch FSDP2 on a 1-D mesh: params Shard(0)")
    register("hsdp", HSDPBackend, description="FSDP2 on a 2-D (replicate, shard) mesh")
