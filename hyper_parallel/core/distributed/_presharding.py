"""The params ``fully_shard`` replaced, so that lists built before sharding still resolve.

The user guide builds its param lists and then shards the model; the factory
follows each listed param to the sharded param that replaced it. This module
loads nothing of FSDP, so the factory can ask any model without loading it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["follow_sharding", "remember_params_before_sharding"]

#: On a sharded module: id(param before sharding) -> (weakref to it, its name).
_BEFORE_ATTR = "_hyper_parallel_presharding_params"


def remember_params_before_sharding(module: nn.Module) -> None:
    """Record ``module``'s params, by id and name, before :func:`fully_shard` replaces them."""
    before = {id(p): (weakref.ref(p), name) for name, p in module.named_parameters()}
    setattr(module, _BEFORE_ATTR, before)


def follow_sharding(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A map from a param as it was before sharding to the one that stands for it now.

    ``None`` when ``model`` was never sharded by :func:`fully_shard`; a param
    it did not replace maps to itself.
    """
    before = getattr(model, _BEFORE_ATTR, None)
    if not before:
        return None
    current = dict(model.named_parameters(remove_duplicate=False))

    def now(p: torch.Tensor) -> torch.Tensor:
        ref_and_name = before.get(id(p))
        if ref_and_name is None or ref_and_name[0]() is not p:
            return p
        sharded: torch.Tensor = current.get(ref_and_name[1], p)
        return sharded

    return now
