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

from hyper_parallel.core.errors import (
    HyperParallelKeyError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.optimizer._main_params import MainParams
from hyper_parallel.core.options import check_group_keys

__all__ = ["ChainedDefaults", "ChainedState", "ModelGroup", "assigned_groups"]


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


class ChainedDefaults(MutableMapping[str, Any]):
    """A chain's ``defaults``: its first sub-optimizer's (as HyperParallel's), read and written through.

    It also answers torch's cyclic schedulers for the whole chain:
    ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum=True`` ask whether
    ``"momentum"`` or ``"betas"`` is in ``optimizer.defaults`` and then cycle
    that key in every group. That works when every sub-optimizer has the key
    (Muon with Sinkhorn or SGD: each group's own momentum is cycled); a chain
    that mixes momentum and betas (Muon with AdamW) is an error that says
    what to do instead, where the first sub-optimizer's answer alone would
    have the scheduler write a key the others never read.
    """

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        self._optimizers = optimizers

    def _first(self) -> dict[str, Any]:
        return next(iter(self._optimizers.values())).defaults

    def __getitem__(self, key: str) -> Any:
        return self._first()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._first()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._first()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._first())

    def __len__(self) -> int:
        return len(self._first())

    def __repr__(self) -> str:
        return repr(self._first())

    def copy(self) -> dict[str, Any]:
        """A plain dict of the first sub-optimizer's defaults (as ``dict.copy``)."""
        return dict(self._first())

    def __contains__(self, key: object) -> bool:
        if key not in ("momentum", "betas"):
            return key in self._first()
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


def assigned_groups(
    groups: Any, optimizers: Mapping[str, Optimizer], main_params: MainParams | None
) -> dict[str, list[dict[str, Any]]]:
    """``groups`` (a new ``param_groups`` for a chain) cut into each sub-optimizer's part.

    The parts follow the chain's order, each as long as that sub-optimizer's
    groups now (HyperParallel's setter). A :class:`ModelGroup` gives back the
    group it shows; with main copies, a group naming model params gets their
    copies in a new dict. Each sub-optimizer must keep exactly its own params,
    regrouped as wished: its state is keyed by them, so a param moved or left
    out would lose its state without a word. A group may set only the keys
    its sub-optimizer's groups or defaults hold (a typo is refused, with a
    suggestion); what it leaves out is its sub-optimizer's default, as
    ``add_param_group`` fills it. Every part is checked before any group
    dict is changed.

    Raises:
        TypeError: ``groups`` is not a list of groups with ``"params"``.
        ValueError: another number of groups, or of params for a sub-optimizer,
            or a key its sub-optimizer does not know.
    """
    have = sum(len(opt.param_groups) for opt in optimizers.values())
    if not isinstance(groups, list):
        raise HyperParallelTypeError(
            f"ChainedOptimizer.param_groups must be set to a list of param groups, got "
            f"{type(groups).__name__}."
        )
    if len(groups) != have:
        raise HyperParallelValueError(
            f"ChainedOptimizer.param_groups has {have} groups; it was set to {len(groups)}. Set "
            "one group for each (change their options, or regroup a sub-optimizer's params)."
        )
    parts: dict[str, list[dict[str, Any]]] = {}
    start = 0
    for name, opt in optimizers.items():
        count = len(opt.param_groups)
        parts[name] = [_own_group(g, main_params) for g in groups[start : start + count]]
        start += count
        _check_same_params(name, opt, parts[name])
        known = set(opt.defaults).union(*(g.keys() for g in opt.param_groups))
        for group in parts[name]:
            check_group_keys(group, known, where=f"sub-optimizer {name!r}")
    for name, part in parts.items():  # all checked: now complete them
        for group in part:
            for key, value in optimizers[name].defaults.items():
                group.setdefault(key, value)
    return parts


def _own_group(group: Any, main_params: MainParams | None) -> dict[str, Any]:
    """The group dict a sub-optimizer holds for ``group``."""
    if isinstance(group, ModelGroup):
        return group.group
    if not isinstance(group, dict) or "params" not in group:
        raise HyperParallelTypeError(
            "Each group set into ChainedOptimizer.param_groups must be a dict with 'params', "
            f"got {type(group).__name__}."
        )
    params = group["params"]
    listed = [params] if isinstance(params, torch.Tensor) else list(params)
    if main_params is not None and any(main_params.main_of(p) is not p for p in listed):
        return {**group, "params": [main_params.main_of(p) for p in listed]}
    if not isinstance(params, list):  # a tensor, tuple or generator: read once, here
        return {**group, "params": listed}
    return group


def _check_same_params(name: str, opt: Optimizer, groups: list[dict[str, Any]]) -> None:
    """``groups`` hold ``opt``'s params, each once."""
    now = sorted(id(p) for g in opt.param_groups for p in g["params"])
    new = sorted(id(p) for g in groups for p in g["params"])
    if now != new:
        raise HyperParallelValueError(
            f"The groups set for sub-optimizer {name!r} hold {len(new)} params, not its own "
            f"{len(now)}, each once: a sub-optimizer keeps its params (its state is keyed by "
            "them). Regroup its own params as you like; to give a param to another "
            "sub-optimizer, build the chain with it there."
        )


class ModelGroup(MutableMapping[str, Any]):
    """A sub-optimizer's param group whose ``"params"`` are the model params, not main copies."""

    def __init__(self, group: dict[str, Any], main_params: MainParams) -> None:
        self.group = group  # the sub-optimizer's own dict
        self._main_params = main_params

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return [self._main_params.param_of(p) for p in self.group["params"]]
        return self.group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise HyperParallelValueError(
                "The params of a ChainedOptimizer group with main copies are fixed; add params "
                "with add_param_group."
            )
        self.group[key] = value

    def __delitem__(self, key: str) -> None:
        del self.group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.group)

    def __len__(self) -> int:
        return len(self.group)

    def __repr__(self) -> str:
        return repr({key: self[key] for key in self})
