"""The ``ShardingBackend`` contract that sharding plugins implement, and backend selection."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from hyper_parallel.core.distributed._dtensor import is_dtensor, local_tensor, shard_like
from hyper_parallel.core.distributed._needs import Need
from hyper_parallel.core.distributed.toolkit import Reducer
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.plugin import PluginKind, get_registry

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "SHARDING_ENV",
    "BlocksFn",
    "GroupBackends",
    "PrepareFn",
    "ReductionsFn",
    "ShardingBackend",
    "TeamTransform",
    "resolve_backend",
]

#: Maps whole blocks (plain tensors) to results of the same shapes. Backends built on
#: :func:`~hyper_parallel.core.distributed.toolkit.map_held_blocks` hand the list as
#: :class:`~hyper_parallel.core.distributed.Blocks`, with each block's need ``key``.
BlocksFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]

#: Makes the tensors at the given positions of a ``map_prepared_blocks`` call.
PrepareFn = Callable[[list[int]], list[torch.Tensor]]

#: Maps local matrices to results of their shapes, summing rows and columns through the Reducer.
ReductionsFn = Callable[[list[torch.Tensor], Reducer], list[torch.Tensor]]


class TeamTransform(Protocol):
    """A block transform that a team of ranks can compute together, each holding a slice.

    Optional for a matrix optimizer (``map_prepared_blocks(..., team=...)``):
    where one rank's share of whole blocks would leave others idle (fewer
    matrices than ranks, one matrix far larger than the rest), a backend may
    hand each block to a team of ranks instead of one owner. Member ``k`` of
    a team of ``n`` holds indices ``[k * size // n, (k + 1) * size // n)``
    of the block's :meth:`split_dim` and every index of the other dims; the
    team calls the transform at once, each member with its slices of the
    same blocks in the same order, and each gets back its slices of the
    results. The results equal the whole-block transform's up to rounding.

    Attributes:
        dtype: What it computes in (the matmul rate and the collectives'
            element size the backend plans with).
    """

    dtype: torch.dtype

    def split_dim(self, shape: torch.Size) -> int | None:
        """The dim of a block of ``shape`` that members slice; ``None``: only whole."""

    def cost(self, shape: torch.Size, members: int) -> float:
        """One member's FLOPs on a block of ``shape`` shared by ``members`` ranks."""

    def collectives(self, shape: torch.Size, members: int) -> list[tuple[str, int]]:
        """The collectives a member makes for one such block: ``("all_reduce"|"all_gather", elements)``.

        Elements are counted in :attr:`dtype`'s size (a float32 sum in a
        bfloat16 team counts as two elements).
        """

    def __call__(
        self, slices: list[torch.Tensor], shapes: list[torch.Size], group: ProcessGroup
    ) -> list[torch.Tensor]:
        """This member's slices of the results; ``shapes`` are the whole blocks', ``group`` the team."""


#: Environment variable naming the sharding backend when none is given; read when an
#: optimizer is built.
SHARDING_ENV = "HYPER_PARALLEL_SHARDING"


class ShardingBackend(abc.ABC):
    """How params are sharded, and how a matrix optimizer's transform reaches their data.

    A backend is registered by class through
    ``hyper_parallel_register_sharding_backends`` and instantiated without
    arguments, once per param group when an optimizer is built, so it may
    cache plans that depend only on the params' shapes and placements.
    Subclasses set ``name`` (the registered name, used in messages) and
    implement :meth:`accepts`, :meth:`shard_model` and :meth:`map_blocks`;
    :meth:`map_reductions` works for any DTensor layout as it is.
    :mod:`hyper_parallel.core.distributed.toolkit` has the parts to build
    them from.
    """

    name: ClassVar[str] = ""
    #: Whether :func:`resolve_backend` may pick this backend when none is named.
    auto_detect: ClassVar[bool] = True
    #: Whether this process holds every param whole, as a plain tensor, and steps it
    #: with no other rank: a matrix optimizer may then make, transform and apply each
    #: param's update in turn rather than through :meth:`map_prepared_blocks`.
    holds_whole: ClassVar[bool] = False

    @abc.abstractmethod
    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these params' layout (plain tensors, DTensor placements) is this backend's."""

    @abc.abstractmethod
    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        """Shard ``module`` in place and return it."""

    @abc.abstractmethod
    def map_blocks(
        self,
        fn: BlocksFn,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        """Apply ``fn`` to the whole blocks each tensor's ``Need`` names; lay results out like the inputs.

        Args:
            fn: Takes a list of whole blocks as plain tensors and returns
                results of the same shapes; it is called with as many blocks
                at once as possible, so it can batch same-shape work. Every
                block reaches ``fn`` exactly once over all ranks, except
                where replicas hold the same blocks in place.
            tensors: Plain tensors or DTensors; every rank of a mesh passes
                the same list in the same order.
            needs: One :data:`~hyper_parallel.core.distributed.Need` per tensor.
            cost: Work of one block from its shape, to balance ranks
                (default: element count).

        Returns:
            One result per input with the input's own (local) shape,
            placements and dtype.
        """

    def map_prepared_blocks(
        self,
        fn: BlocksFn,
        prepare: PrepareFn,
        layouts: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
        team: TeamTransform | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`map_blocks` on tensors made by ``prepare`` when the backend first needs them.

        A backend that overlaps communication with work makes first the
        tensors that must travel, starts moving them, and makes the rest
        (a matrix optimizer's momentum of the blocks a rank holds whole)
        while they travel. This default makes them all, then calls
        :meth:`map_blocks`.

        Args:
            fn: As for :meth:`map_blocks`.
            prepare: ``prepare(positions)`` returns the tensors at those
                positions; it is called once for every position, in one call
                or in several.
            layouts: One tensor per position with the shape, placements and
                dtype of the tensor ``prepare`` makes there (its data is not
                read).
            needs: One :data:`~hyper_parallel.core.distributed.Need` per position.
            cost: As for :meth:`map_blocks`.
            team: ``fn`` as a :class:`TeamTransform`, for a backend that
                may split one block's work over several ranks; a backend
                that never does (this default) ignores it.

        Returns:
            One result per position, laid out like its ``layouts`` tensor.
        """
        return self.map_blocks(fn, prepare(list(range(len(layouts)))), needs, cost=cost)

    def group_replicas(self, size: int) -> None:
        """Share an optimizer's work among groups of ``size`` replicas only (``hsdp_replica_count``).

        Each group computes every block and shares the results within
        itself, so no collective crosses groups. A backend whose params have
        no replicas accepts any size; this default, for a backend that
        cannot group them, raises ``ValueError``.
        """
        raise HyperParallelValueError(
            f"The {self.name!r} sharding backend cannot share work among groups of replicas "
            f"(hsdp_replica_count={size}); leave hsdp_replica_count unset, or use the 'hsdp' "
            "backend."
        )

    def map_reductions(
        self, fn: ReductionsFn, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Apply ``fn`` to each rank's part of 2-D tensors that need only row and column sums.

        ``fn(local, reducer)`` gets the local tensors and a
        :class:`~hyper_parallel.core.distributed.toolkit.Reducer` whose row
        and column sums are completed over the ranks that hold the rest of
        each row or column: nothing param-sized moves. Results are laid out
        like the inputs.
        """
        local = [local_tensor(t) for t in tensors]
        results = fn(local, Reducer(tensors))
        return [shard_like(r, t) for r, t in zip(results, tensors, strict=True)]


def resolve_backend(
    name: str | None,
    params: Sequence[torch.Tensor],
    *,
    param_names: Mapping[int, str] | None = None,
    origin: str = "sharding",
) -> ShardingBackend:
    """The backend named ``name``, else the one that fits ``params``.

    Detection tries every registered backend but ``local`` in name order and
    takes the first that accepts the params, then ``local``; backends with
    ``auto_detect = False`` (``ddp``) are used only when named.

    Args:
        name: A registered backend name, or ``None`` to detect.
        params: The params of one param group.
        param_names: ``id(param) -> name``, for messages.
        origin: Where ``name`` came from, for messages (``"sharding"`` or
            the environment variable).

    Raises:
        UnknownPluginError: no backend of that name.
        ValueError: the named backend does not match the params' layout, or
            no backend accepts them (naming the params no backend takes).
    """
    registry = get_registry()
    if name is not None:
        entry = registry.get(PluginKind.SHARDING_BACKEND, name)
        backend: ShardingBackend = entry.obj()
        if not backend.accepts(params):
            misfits = [p for p in params if not backend.accepts([p])] or list(params)
            raise HyperParallelValueError(
                f"Sharding backend {entry.name!r} ({origin}={name!r}) does not match the params: "
                f"{_describe(misfits, param_names)}. Shard the model with that backend first, or "
                "pick the backend that matches (leave sharding unset to detect it)."
            )
        return backend
    entries = registry.entries(PluginKind.SHARDING_BACKEND)
    ordered = [e for e in entries if e.name != "local"] + [e for e in entries if e.name == "local"]
    candidates = [b for b in (e.obj() for e in ordered) if b.auto_detect]
    for backend in candidates:
        if backend.accepts(params):
            return backend
    orphans = [p for p in params if not any(b.accepts([p]) for b in candidates)]
    raise HyperParallelValueError(
        f"No sharding backend accepts {_describe(orphans or params, param_names)}; installed: "
        f"{', '.join(e.name for e in entries) or '(none)'}. Lay these params out as one of "
        "them expects, or install a backend plugin for this layout."
    )


def _describe(params: Sequence[torch.Tensor], names: Mapping[int, str] | None) -> str:
    described = []
    for index, p in enumerate(params):
        who = (names or {}).get(id(p)) or getattr(p, "model_name", None) or f"param {index}"
        if is_dtensor(p):
            where = (
                f"a DTensor with placements {tuple(p.placements)} "  # type: ignore[attr-defined]
                f"on a {p.device_mesh.ndim}-D mesh"  # type: ignore[attr-defined]
            )
        else:
            where = "a plain tensor"
        described.append(f"{who} (shape {tuple(p.shape)}, {where})")
    if len(described) > 8:
        described = [*described[:8], f"... ({len(described) - 8} more)"]
    return ", ".join(described)


class GroupBackends:
    """The sharding backend of each param group of an optimizer.

    Call it with a group to get that group's backend. It is resolved the
    first time (build it in ``add_param_group``, so a mismatch fails when
    the optimizer is built) and again only when the group's params or its
    ``sharding`` option change, never on a plain ``step()``. The group's
    ``sharding`` option wins; without one, ``$HYPER_PARALLEL_SHARDING`` as it
    was when this object was made; without that, detection. With
    ``replica_group_size``, each backend is told to share work only among
    groups of that many replicas (:meth:`ShardingBackend.group_replicas`).
    """

    def __init__(self, replica_group_size: int | None = None) -> None:
        self._default = os.environ.get(SHARDING_ENV) or None
        self.replica_group_size = replica_group_size
        self._resolved: dict[int, tuple[tuple[int, ...], str | None, ShardingBackend]] = {}

    def __call__(self, group: Mapping[str, Any]) -> ShardingBackend:
        params = group["params"]
        key = tuple(id(p) for p in params)
        name = group.get("sharding") or self._default
        cached = self._resolved.get(id(group))
        if cached is not None and cached[0] == key and cached[1] == name:
            return cached[2]
        origin = "sharding" if group.get("sharding") else SHARDING_ENV
        backend = resolve_backend(name, params, origin=origin)
        if self.replica_group_size is not None:
            backend.group_replicas(self.replica_group_size)
        self._resolved[id(group)] = (key, name, backend)
        return backend

    def __getstate__(self) -> dict[str, Any]:
        # Backends may hold process groups and plans; a copy resolves its own.
        return {
            "_default": self._default,
            "replica_group_size": self.replica_group_size,
            "_resolved": {},
        }
