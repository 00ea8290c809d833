"""Where a ``hyper-parallel train`` process trains: alone, or as one rank of a sharded run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.core.plugin import PluginKind, get_registry
from hyper_parallel.train.config import TrainConfig, TrainError
from hyper_parallel.train.preflight import launched_world_size

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """Where this process trains: one process, or one rank of a sharded run."""

    mesh: Any = None  # a DeviceMesh when sharded
    backend: Any = None  # the ShardingBackend that shards the model
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: float) -> float:
        """The average of ``value`` over ranks (a no-op on one process)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size


def place(config: TrainConfig) -> Placement:
    """Set up the mesh for ``--sharding`` (the process group comes from torchrun)."""
    world = launched_world_size()
    if config.sharding is None or config.sharding == "local":
        if world > 1:
            raise TrainError(
                f"{world} processes were launched but --sharding is "
                f"{config.sharding or 'not set'}: pass --sharding fsdp or hsdp, or run one process"
            )
        return Placement()
    import torch.distributed as dist

    backend = get_registry().get(PluginKind.SHARDING_BACKEND, config.sharding).obj()
    if backend.name not in ("fsdp", "hsdp"):
        raise TrainError(
            f"--sharding {config.sharding}: train shards its model with fsdp or hsdp; "
            f"{backend.name!r} is not supported here"
        )
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise TrainError(
            f"--sharding {config.sharding} shards the model over the processes torchrun starts; "
            f"run: torchrun --nproc_per_node 2 -m hyper_parallel train --sharding "
            f"{config.sharding} (and your other options)"
        )
    mesh = _mesh(config.sharding, backend.name, world)
    device = (
        torch.device(mesh.device_type, torch.accelerator.current_device_index())
        if mesh.device_type != "cpu"
        else torch.device("cpu")
    )
    return Placement(
        mesh=mesh, backend=backend, rank=dist.get_rank(), world_size=world, device=device
    )


def _mesh(sharding: str, backend: str, world: int) -> Any:
    """A 1-D mesh for fsdp; for hsdp, (nodes, processes per node) (``hsdp_mesh``)."""
    from hyper_parallel.core.distributed._mesh import hsdp_mesh, init_device_mesh

    try:
        if backend == "hsdp":
            return hsdp_mesh()
        return init_device_mesh("auto", (world,), mesh_dim_names=("shard",))
    except (RuntimeError, ValueError, ImportError) as exc:
        raise TrainError(f"--sharding {sharding}: {exc}") from None
