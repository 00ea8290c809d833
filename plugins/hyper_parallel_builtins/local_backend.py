"""Built-in plugin: the ``local`` sharding backend (nothing sharded).

Params are whole tensors on this process (one process, or DDP-style
replicas that all hold the same values), so the full matrix is the tensor
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import FullTensorsFn, ShardingBackend
from hyper_parallel.core.distributed._dtensor import is_dtensor
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["DDPBackend", "LocalBackend"]


class LocalBackend(ShardingBackend):
    """No sharding: every param is a plain tensor held whole by this process."""

    name: ClassVar[str] = "local"

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return not any(is_dtensor(p) for p in params)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        if options:
            raise TypeError(
                f"The 'local' backend does not shard and takes no options; got {sorted(options)}. "
                "Select a sharding backend by name to shard a model (hyper-parallel plugins "
                "lists the installed ones)."
            )
        return module

    def full_matrix_map(
        self,
        fn: FullTensorsFn,
        tensors: Sequence[torch.Tensor],
        *,
        batch_dims: Sequence[int] | None = None,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        return fn(list(tensors))


class DDPBackend(LocalBackend):
    """Whole tensors replicated on every rank (DDP): each rank does a share of the work.

    Used only when named (``sharding="ddp"``): the params must be identical on
    every rank of the default process group, which nothing can check cheaply.
    """

    name: ClassVar[str] = "ddp"
    auto_detect: ClassVar[bool] = False

    def full_matrix_map(
        self,
        fn: FullTensorsFn,
        tensors: Sequence[torch.Tensor],
        *,
        batch_dims: Sequence[int] | None = None,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return fn(list(tensors))
        from hyper_parallel.core.distributed.full_matrix import replicated_full_matrix_map

        return replicated_full_matrix_map(fn, tensors, cost=cost)


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``local`` and ``ddp``."""
    register("local", LocalBackend, description="no sharding: whole tensors on every process")
    register(
        "ddp",
        DDPBackend,
        description="DDP-replicated whole tensors: ranks split the work (by name only)",
    )
