"""DTensor checks that do not import ``torch.distributed.tensor``.

That package (and sympy behind it) is most of the import time of a process
that never shards anything. A DTensor can exist only once its module has been
imported, so a check that looks the module up in ``sys.modules`` is exact and
free: nothing is imported until the caller actually has DTensors.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "local_tensor"]

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor's module."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place ops reach it), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]
