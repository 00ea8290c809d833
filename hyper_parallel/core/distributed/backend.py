"""The ``ShardingBackend`` contract that sharding plugins implement."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["FullMatrixFn", "ShardingBackend"]

#: A function from a batch of full matrices ``(B, m, n)`` to a tensor of the same shape.
FullMatrixFn = Callable[[torch.Tensor], torch.Tensor]


class ShardingBackend(abc.ABC):
    """How params are sharded, and how to compute on the full matrix behind a shard.

    A backend is registered by class through
    ``hyper_parallel_register_sharding_backends`` and instantiated without
    arguments. Subclasses implement all three methods and set ``name`` (the
    name they are registered under, used in messages).
    """

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these params' layout (plain tensors, DTensor placements) is this backend's."""

    @abc.abstractmethod
    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        """Shard ``module`` in place and return it."""

    @abc.abstractmethod
    def full_matrix_map(
        self, fn: FullMatrixFn, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Apply ``fn`` to the full matrix behind each tensor; return results laid out like the inputs.

        Each input is a local tensor or shard of shape ``(B, m, n)`` once
        assembled; the result for each input has the input's own (local)
        shape, placement and dtype.
        """
