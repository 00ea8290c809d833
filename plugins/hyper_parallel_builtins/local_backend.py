"""Built-in plugin: the ``local`` sharding backend (nothing sharded).

Params are whole tensors on this process (one process, or DDP-style
replicas that all hold the same values), so the full matrix is the tensor
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import FullTensorsFn, ShardingBackend
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["LocalBackend"]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


class LocalBackend(ShardingBackend):
    """No sharding: every param is a plain tensor held whole by this process."""

    name: ClassVar[str] = "local"

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return not any(_is_dtensor(p) for p in params)

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


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``local``."""
    register("local", LocalBackend, description="no sharding: whole tensors on every process")
