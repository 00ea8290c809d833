"""What a ``ChainedOptimizer`` shows torch as an optimizer's ``state``, ``defaults`` and groups.

Views over the sub-optimizers, never copies: what torch's schedulers,
``GradScaler`` and distributed-checkpoint helpers read and write through
them is the sub-optimizers' own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.optim import Optimizer

from hyper_parallel.core.errors import HyperParallelKeyError, HyperParallelValueError
from hyper_parallel.core.optimizer._main_params import MainParams

__all__ = ["ChainedDefaults", "ChainedState", "ModelGroup"]


class ChainedState(Mapping[torch.Tensor, Any]):
    """Read-only view of the sub-optimizers' ``state``, keyed by param."""

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: torch.Tensor) -> Any:
        for opt in self._optimizers.values():
            if param in opt.state:
                return opt.state[param]
        raise HyperParallelKeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers.values():
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers.values())


class ChainedDefaults(dict[str, Any]):
    """A chain's (empty) ``defaults``, which answers torch's cyclic schedulers.

    ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum=True`` ask whether
    ``"momentum"`` or ``"betas"`` is in ``optimizer.defaults`` and then cycle
    that key in every group. That works when every sub-optimizer has the key
    (Muon with Sinkhorn or SGD: each group's own momentum is cycled); a chain
    that mixes momentum and betas (Muon with AdamW) is an error that says
    what to do instead.
    """

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        super().__init__()
        self._optimizers = optimizers

    def __contains__(self, key: object) -> bool:
        if key not in ("momentum", "betas"):
            return super().__contains__(key)
        having = [name for name, opt in self._optimizers.items() if key in opt.defaults]
        if not having or len(having) == len(self._optimizers):
            return bool(having)
        others = [name for name in self._optimizers if name not in having]
        raise HyperParallelValueError(
            f"The sub-optimizers of this ChainedOptimizer cycle different momentum keys "
            f"({', '.join(having)}: {key!r}; {', '.join(others)}: not), and torch's "
            "OneCycleLR/CyclicLR cycle one key in every group. Pass cycle_momentum=False, or "
            "give each sub-optimizer its own scheduler, e.g. "
            f"OneCycleLR(optimizer.optimizers[{having[0]!r}], ...)."
        )


class ModelGroup(MutableMapping[str, Any]):
    """A sub-optimizer's param group whose ``"params"`` are the model params, not main copies."""

    def __init__(self, group: dict[str, Any], main_params: MainParams) -> None:
        self._group = group
        self._main_params = main_params

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return [self._main_params.param_of(p) for p in self._group["params"]]
        return self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise HyperParallelValueError(
                "The params of a ChainedOptimizer group with main copies are fixed; add params "
                "with add_param_group."
            )
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return repr({key: self[key] for key in self})
