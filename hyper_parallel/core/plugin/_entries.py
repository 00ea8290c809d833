"""What the registry holds: the kinds of plugin, one record per registered name, loaded plugins."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.plugin import hookspecs

__all__ = [
    "ENTRY_TYPES",
    "OPTIMIZER_REQUIREMENTS",
    "BackendEntry",
    "LoadedPlugin",
    "OptimizerEntry",
    "PartitionerEntry",
    "PluginKind",
    "RegistryEntry",
    "ScheduleEntry",
    "normalize_name",
]


class PluginKind(str, enum.Enum):
    """The four kinds of named things a plugin can register."""

    OPTIMIZER = "optimizer"
    LR_SCHEDULER = "lr_scheduler"
    PARTITIONER = "partitioner"
    SHARDING_BACKEND = "sharding_backend"

    @property
    def label(self) -> str:
        """Human-readable name used in messages."""
        return _LABELS[self]

    @property
    def hook_name(self) -> str:
        """The hookspec that registers this kind."""
        return _HOOK_NAMES[self]


_LABELS = {
    PluginKind.OPTIMIZER: "optimizer",
    PluginKind.LR_SCHEDULER: "LR schedule",
    PluginKind.PARTITIONER: "partitioner",
    PluginKind.SHARDING_BACKEND: "sharding backend",
}
_HOOK_NAMES = {
    PluginKind.OPTIMIZER: hookspecs.hyper_parallel_register_optimizers.__name__,
    PluginKind.LR_SCHEDULER: hookspecs.hyper_parallel_register_lr_schedulers.__name__,
    PluginKind.PARTITIONER: hookspecs.hyper_parallel_register_partitioners.__name__,
    PluginKind.SHARDING_BACKEND: hookspecs.hyper_parallel_register_sharding_backends.__name__,
}


def normalize_name(name: str) -> str:
    """Canonical form of a registry name: lower case, ``-`` read as ``_``."""
    return name.strip().lower().replace("-", "_")


@dataclass(frozen=True, kw_only=True)
class RegistryEntry:
    """One registered optimizer, schedule, partitioner or backend (each kind has its subclass)."""

    kind: PluginKind
    name: str
    obj: Any
    description: str
    aliases: tuple[str, ...]
    plugin: str
    distribution: str | None

    @property
    def source(self) -> str:
        """Where the entry came from, for messages and ``hyper-parallel plugins``."""
        where = self.distribution or "registered in-process"
        return f"plugin {self.plugin!r} ({where})"


#: What an optimizer may need of the loop that steps it (``register(..., requires=...)``).
OPTIMIZER_REQUIREMENTS: dict[str, str] = {
    "closure": "its step needs a closure that re-evaluates the loss",
    "sparse_grads": "it takes sparse gradients only",
    "matrices_only": "it takes only params with two or more dims",
}

#: Requirements ``get_hyper_optimizer`` (and so ``hyper-parallel train``) meets for a plain
#: loop: a matrix-only optimizer's other params go to AdamW.
_MET_BY_THE_FACTORY = frozenset({"matrices_only"})


@dataclass(frozen=True, kw_only=True)
class OptimizerEntry(RegistryEntry):
    """A registered optimizer: ``obj(params, **kwargs) -> torch.optim.Optimizer``.

    ``requires`` names what it needs of the loop that steps it, from
    :data:`OPTIMIZER_REQUIREMENTS`; a plain loop (dense gradients on every
    param, ``step()`` without a closure) can use it when that is empty.
    """

    requires: tuple[str, ...] = ()

    @property
    def matrix_only(self) -> bool:
        """Whether it takes only params with two or more dims (``requires=("matrices_only",)``).

        :func:`get_hyper_optimizer` gives such an optimizer's vectors to AdamW.
        """
        return "matrices_only" in self.requires

    def unusable_in_plain_loop(self) -> str | None:
        """Why a plain training loop cannot step this optimizer, or ``None`` if it can.

        A matrix-only optimizer can: ``get_hyper_optimizer`` gives its vectors to AdamW.
        """
        reasons = [OPTIMIZER_REQUIREMENTS[r] for r in self.requires if r not in _MET_BY_THE_FACTORY]
        return "; ".join(reasons) or None


@dataclass(frozen=True, kw_only=True)
class ScheduleEntry(RegistryEntry):
    """A registered LR schedule: ``obj(step, *, total_steps, warmup_steps, **options) -> float``."""


@dataclass(frozen=True, kw_only=True)
class PartitionerEntry(RegistryEntry):
    """A registered partitioner: ``obj(model, **options) -> dict[str, list]``."""


@dataclass(frozen=True, kw_only=True)
class BackendEntry(RegistryEntry):
    """A registered sharding backend: ``obj`` is a ``ShardingBackend`` subclass."""


#: The record type of each kind; an entry's object was checked for its kind when registered.
ENTRY_TYPES: dict[PluginKind, type[RegistryEntry]] = {
    PluginKind.OPTIMIZER: OptimizerEntry,
    PluginKind.LR_SCHEDULER: ScheduleEntry,
    PluginKind.PARTITIONER: PartitionerEntry,
    PluginKind.SHARDING_BACKEND: BackendEntry,
}


@dataclass(frozen=True, kw_only=True)
class LoadedPlugin:
    """A plugin the registry found, whether it loaded or not."""

    name: str
    distribution: str | None
    entry_point: str | None
    status: str  # "loaded", "failed" or "disabled"
    error: str | None = None
