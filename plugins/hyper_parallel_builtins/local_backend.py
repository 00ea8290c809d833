"""Built-in plugin: the ``local`` and ``ddp`` sharding backends (whole tensors on every process).

``local``: one process, or replicas that each do all the work themselves.
``ddp``: DDP replicas, every rank of the default group holding the same
values; each block-transform gets one owner rank (balanced by cost), owners
compute their share and broadcast the results, one broadcast per owner and
round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import BlocksFn, Need, ShardingBackend
from hyper_parallel.core.distributed.toolkit import (
    Layout,
    assign_owners,
    exchange_rounds,
    is_dtensor,
    map_held_blocks,
)
from hyper_parallel.core.errors import HyperParallelTypeError
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["DDPBackend", "LocalBackend"]


def map_whole(
    fn: BlocksFn, tensors: Sequence[torch.Tensor], needs: Sequence[Need]
) -> list[torch.Tensor]:
    """``fn`` on the blocks of whole (plain) tensors, in one call; results joined per tensor."""
    return map_held_blocks(fn, tensors, [Layout.whole(t.shape) for t in tensors], needs)


class LocalBackend(ShardingBackend):
    """No sharding: every param is a plain tensor held whole by this process."""

    name: ClassVar[str] = "local"
    holds_whole: ClassVar[bool] = True

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return not any(is_dtensor(p) for p in params)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        if options:
            raise HyperParallelTypeError(
                f"The 'local' backend does not shard and takes no options; got {sorted(options)}. "
                "Select a sharding backend by name to shard a model (hyper-parallel plugins "
                "lists the installed ones)."
            )
        return module

    def group_replicas(self, size: int) -> None:
        """Nothing to group: one process holds no replicas (any ``hsdp_replica_count`` holds)."""

    def map_blocks(
        self,
        fn: BlocksFn,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        return map_whole(fn, tensors, needs)


class DDPBackend(LocalBackend):
    """Whole tensors replicated on every rank (DDP): each rank does a share of the work.

    Used only when named (``sharding="ddp"``): the params must be identical on
    every rank of the default process group, which nothing can check cheaply.
    """

    name: ClassVar[str] = "ddp"
    auto_detect: ClassVar[bool] = False
    holds_whole: ClassVar[bool] = False  # each rank transforms a share of the params

    group_replicas = ShardingBackend.group_replicas  # replicas here are every rank: not grouped

    def map_blocks(
        self,
        fn: BlocksFn,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return map_whole(fn, tensors, needs)
        world, me = dist.get_world_size(), dist.get_rank()
        measure = cost or (lambda shape: float(shape.numel()))
        owners = assign_owners([measure(t.shape) for t in tensors], world)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        nbytes = [t.numel() * t.element_size() for t in tensors]
        for round_ in exchange_rounds(nbytes, [t.dtype for t in tensors], owners, world):
            mine = [i for i in round_ if owners[i] == me]
            done = dict(
                zip(
                    mine,
                    map_whole(fn, [tensors[i] for i in mine], [needs[i] for i in mine]),
                    strict=True,
                )
            )
            for owner in range(world):
                owned = [i for i in round_ if owners[i] == owner]
                if not owned:
                    continue
                sizes = [tensors[i].numel() for i in owned]
                if owner == me:
                    flat = torch.cat([done[i].reshape(-1) for i in owned])
                else:
                    first = tensors[owned[0]]
                    flat = first.new_empty(sum(sizes))
                dist.broadcast(flat, src=owner)
                for i, piece in zip(owned, flat.split(sizes), strict=True):
                    out[i] = piece.view(tensors[i].shape)
        return [r for r in out if r is not None]


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``local`` and ``ddp``."""
    register("local", LocalBackend, description="no sharding: whole tensors on every process")
    register(
        "ddp",
        DDPBackend,
        description="DDP-replicated whole tensors: ranks split the work (by name only)",
    )
