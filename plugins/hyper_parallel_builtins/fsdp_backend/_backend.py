"""The ``fsdp`` and ``hsdp`` backends: options, plans per param list, and the hook that registers them."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import (
    BlocksFn,
    Need,
    PrepareFn,
    ShardingBackend,
    TeamTransform,
)
from hyper_parallel.core.distributed.toolkit import (
    Layout,
    check_not_partial,
    exchange_group,
    is_dtensor,
)
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import env_switch
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel_builtins.fsdp_backend._exchange import Exchange, Prepared, Step, map_in_place
from hyper_parallel_builtins.fsdp_backend._plan import TEAM_SIZE_ENV, make_plan
from hyper_parallel_builtins.fsdp_backend._plan_types import ExchangePlan, PlanOptions, Replicas
from hyper_parallel_builtins.fsdp_backend.cost import TRANSPORTS, named_profile

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


#: Environment variable read when a backend is made without ``overlap``: ``1`` (the
#: default when unset) overlaps the owner exchange with the transform, ``0`` does not.
OVERLAP_ENV = "HYPER_PARALLEL_EXCHANGE_OVERLAP"

#: Environment variable read when a backend is made without ``transport``: ``auto`` (the
#: default when unset), ``all_to_all`` or ``all_gather``.
TRANSPORT_ENV = "HYPER_PARALLEL_TRANSPORT"


def _overlap_from_env() -> bool:
    return env_switch(
        OVERLAP_ENV,
        default=True,
        meaning="overlap the owner exchange with the transform, the default",
    )


def team_size_option(value: int | str | None) -> int | str:
    """``team_size`` (or ``$HYPER_PARALLEL_TEAM_SIZE``) as ``"auto"`` or a positive int."""
    origin = "team_size"
    if value is None:
        value, origin = os.environ.get(TEAM_SIZE_ENV) or "auto", TEAM_SIZE_ENV
    if value == "auto":
        return value
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or isinstance(value, (bool, float)):
        raise HyperParallelValueError(
            f"{origin}={value!r} is not a team size; use 'auto' or a whole number >= 1 "
            "(1: one owner per matrix)."
        )
    return size


def _supported(p: torch.Tensor) -> bool:
    if not is_dtensor(p):
        return True
    if any(pl.is_partial() for pl in p.placements):  # type: ignore[attr-defined]
        return False
    mesh = p.device_mesh  # type: ignore[attr-defined]
    return bool(mesh.ndim == 1 or mesh.size() == dist.get_world_size())


class FSDPBackend(ShardingBackend):
    """DTensor params of any ``Shard``/strided/``Replicate`` layout: in place where blocks are whole, else owners.

    Args:
        overlap: Overlap the owner exchange with the transform (asynchronous
            collectives, bucket by bucket). ``None`` (how the registry makes
            it): ``$HYPER_PARALLEL_EXCHANGE_OVERLAP`` as it is now, ``1``
            (the default when unset) or ``0``. The results are bitwise the
            same either way.
        transport: How each bucket travels: ``"all_to_all"``,
            ``"all_gather"``, or ``"auto"`` (the faster for that bucket by
            :mod:`hyper_parallel_builtins.fsdp_backend.cost` and this device's
            profile). ``None``: ``$HYPER_PARALLEL_TRANSPORT``, else
            ``"auto"``. The results are bitwise the same whichever travels.
        team_size: Ranks that share each exchanged matrix's transform
            (a :class:`~hyper_parallel.core.distributed.TeamTransform`):
            ``1`` for one owner each, a divisor of the exchange's ranks, or
            ``"auto"`` (what :func:`~hyper_parallel_builtins.fsdp_backend.cost.choose_team_size`
            predicts fastest with this device's profile; ``1`` without one).
            ``None``: ``$HYPER_PARALLEL_TEAM_SIZE``, else ``"auto"``. A team's
            results equal one owner's up to rounding.

    Raises:
        ValueError: ``overlap`` is not a bool, ``transport`` or
            ``team_size`` (or their variables) is none of those, or the
            overlap variable is set to something other than ``1``/``0``
            (``true``/``false``, ``on``/``off``).
    """

    name: ClassVar[str] = "fsdp"

    def __init__(
        self,
        overlap: bool | None = None,
        transport: str | None = None,
        team_size: int | str | None = None,
    ) -> None:
        if overlap is None:
            overlap = _overlap_from_env()
        elif not isinstance(overlap, bool):
            raise HyperParallelValueError(f"overlap should be True or False, got {overlap!r}.")
        origin = "transport"
        if transport is None:
            transport, origin = os.environ.get(TRANSPORT_ENV) or "auto", TRANSPORT_ENV
        if transport not in ("auto", *TRANSPORTS):
            raise HyperParallelValueError(
                f"{origin}={transport!r} is not a transport; choose auto, {', '.join(TRANSPORTS)}."
            )
        self.overlap, self.transport = overlap, transport
        self.team_size = team_size_option(team_size)
        self._team_size_origin = "team_size" if team_size is not None else TEAM_SIZE_ENV
        self._profile = named_profile()  # the cost model's file, read once
        self._plans: dict[tuple[Any, ...], ExchangePlan] = {}
        self._teams: dict[tuple[int, ...], ProcessGroup] = {}  # by the team's global ranks
        self.replica_group_size: int | None = None
        self._replica_groups: dict[
            tuple[DeviceMesh, int], tuple[ProcessGroup, ProcessGroup | None]
        ] = {}

    def group_replicas(self, size: int) -> None:
        """Share the work among groups of ``size`` replicas (on a 2-D ``(replicate, shard)`` mesh).

        Each group of ``size`` consecutive replicas computes every matrix once:
        its owners get each distinct shard once (from their own replica
        row), return results to their own row, and an all-gather over the
        group's column of replicas spreads them to the other rows. No
        collective leaves a group. ``size`` must divide the replicate dim; at
        least its size is one group. Unset, the cost model picks the size
        (:func:`~hyper_parallel_builtins.fsdp_backend.cost.choose_replica_group`).
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise HyperParallelValueError(f"hsdp_replica_count must be positive, got {size!r}.")
        self.replica_group_size = size
        self._plans.clear()

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return any(is_dtensor(p) for p in params) and all(_supported(p) for p in params)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        from hyper_parallel import fully_shard

        return fully_shard(module, **options)

    def map_blocks(
        self,
        fn: BlocksFn,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        return self.map_prepared_blocks(
            fn, lambda positions: [tensors[i] for i in positions], tensors, needs, cost=cost
        )

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
        """Make the tensors that travel, start the exchange, then make and transform the rest."""
        by_mesh: dict[DeviceMesh | None, list[int]] = {}
        for i, t in enumerate(layouts):
            check_not_partial(t)
            by_mesh.setdefault(t.device_mesh if is_dtensor(t) else None, []).append(i)  # type: ignore[attr-defined]
        in_place = {i: Layout.whole(layouts[i].shape) for i in by_mesh.pop(None, [])}
        plans = [(idx, self._plan(layouts, needs, idx, cost, team)) for idx in by_mesh.values()]
        for indices, plan in plans:
            in_place.update((indices[k], plan.mine[k]) for k in plan.in_place)
        tensors = Prepared(prepare, layouts)
        tensors.make([i for i in range(len(layouts)) if i not in in_place])
        out: list[torch.Tensor | None] = [None] * len(layouts)
        exchange = Exchange(fn, team, layouts, tensors.local, needs, out)
        steps = [
            Step(plan=plan, positions=indices, bucket=bucket)
            for indices, plan in plans
            for bucket in plan.buckets
        ]

        def held_blocks() -> None:
            tensors.make(list(in_place))
            map_in_place(fn, tensors.made, needs, in_place, out)

        if self.overlap:
            exchange.overlapped(steps, held_blocks)
        else:
            held_blocks()
            exchange.in_turn(steps)
        return [r for r in out if r is not None]

    def exchange_plan(
        self,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
        team: TeamTransform | None = None,
    ) -> ExchangePlan:
        """The exchange plan :meth:`map_prepared_blocks` runs for ``tensors``, DTensors of one mesh.

        ``print(plan)`` shows it: per bucket its transport, the bytes this
        rank sends and receives on each trip, and its params (``#index
        (shape)``, the index into ``tensors``) by the rank that owns them or
        the ranks of their team; and the params computed in place. Its
        fields (``buckets``, ``in_place``, ``team_size``, ...) are the
        same data, for a test.

        Plans are cached by each tensor's shape, dtype, placements, mesh and
        need, and the team's dtype. The first call for a layout makes its
        plan, with one collective that every rank of the mesh must join;
        later calls, and ``map_blocks`` on the same layout, reuse it. Called
        after a step with the tensors and needs the optimizer handed over
        (and its ``team``), it returns the plan that step ran and
        communicates nothing. ``cost`` and ``team`` are those of
        :meth:`map_prepared_blocks`; ``cost`` shapes a plan only as it is made.

        Raises:
            ValueError: a tensor is plain or Partial, or the tensors span
                several meshes (``map_prepared_blocks`` makes one plan per
                mesh: ask for each mesh's tensors in turn).
        """
        meshes = {t.device_mesh if is_dtensor(t) else None for t in tensors}  # type: ignore[attr-defined]
        if len(meshes) != 1 or None in meshes:
            plain = sum(not is_dtensor(t) for t in tensors)
            raise HyperParallelValueError(
                f"exchange_plan takes DTensors of one device mesh; got {plain} plain tensors "
                f"and DTensors on {len(meshes - {None})} meshes. map_prepared_blocks makes one "
                "plan per mesh: ask for each mesh's DTensors in turn."
            )
        for t in tensors:
            check_not_partial(t)
        return self._plan(tensors, needs, list(range(len(tensors))), cost, team)

    def _plan(
        self,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        indices: list[int],
        cost: Callable[[torch.Size], float] | None,
        team: TeamTransform | None,
    ) -> ExchangePlan:
        """The plan of ``tensors[indices]`` (one mesh's): the cached one, else made now."""
        dts = [cast("DTensor", tensors[i]) for i in indices]
        layout = [
            (t.shape, t.dtype, t.placements, t.device_mesh, needs[i])
            for t, i in zip(dts, indices, strict=True)
        ]
        key = (*layout, team.dtype if team else None)
        plan = self._plans.get(key)
        if plan is None:
            group, replicas = self._groups(dts)
            options = PlanOptions(
                transport=self.transport,
                team_size=self.team_size,
                team=team,
                team_size_origin=self._team_size_origin,
                profile=self._profile,
            )
            plan = self._plans[key] = make_plan(
                group,
                [tensors[i] for i in indices],
                [needs[i] for i in indices],
                cost,
                options,
                self._teams,
                replicas,
            )
        return plan

    def _groups(self, tensors: Sequence[DTensor]) -> tuple[ProcessGroup, Replicas | None]:
        """The ranks that plan these params' work together, and their replicas where rows share it.

        On an HSDP layout (every param replicated on the first dim of a 2-D
        mesh over the world) the replicas are split into groups
        (``hsdp_replica_count``, else the cost model's choice), each group
        computing every matrix once.
        """
        mesh = tensors[0].device_mesh
        size = self.replica_group_size
        replicated = all(t.placements[0].is_replicate() for t in tensors)
        if mesh.ndim == 2 and size is not None and size < mesh.size(0) and not replicated:
            t = next(t for t in tensors if not t.placements[0].is_replicate())
            raise HyperParallelValueError(
                f"hsdp_replica_count={size} groups the replicas of an HSDP (replicate, shard) "
                f"mesh, but a param of shape {tuple(t.shape)} has placements {t.placements}; "
                "leave hsdp_replica_count unset for this layout."
            )
        group = exchange_group(mesh)
        if mesh.ndim != 2 or not replicated or mesh.size(0) < 2 or mesh.size(1) < 2:
            return group, None
        if mesh.size() != dist.get_world_size():
            return group, None
        rows = {int(r): q for q, row in enumerate(mesh.mesh.tolist()) for r in row}
        return group, Replicas(
            count=mesh.size(0),
            shards=mesh.size(1),
            size="auto" if size is None else size,
            origin="hsdp_replica_count",
            split=functools.partial(self._split, mesh),
            row_of=rows.__getitem__,
        )

    def _split(self, mesh: DeviceMesh, size: int) -> tuple[ProcessGroup, ProcessGroup | None]:
        """This rank's group of ``size`` consecutive replicas of ``mesh``, and its column in it.

        Every rank makes every group, in the same order.
        """
        if (mesh, size) not in self._replica_groups:
            grid, replicas = mesh.mesh, mesh.size(0)
            starts = range(0, replicas, size)
            if size == replicas:
                group = exchange_group(mesh)
            else:
                group, _ = dist.new_subgroups_by_enumeration(
                    [grid[r : r + size].flatten().tolist() for r in starts]
                )
            column = None
            if size == replicas:
                column = mesh.get_group(0)
            elif size > 1:
                column, _ = dist.new_subgroups_by_enumeration(
                    [grid[r : r + size, s].tolist() for r in starts for s in range(mesh.size(1))]
                )
            self._replica_groups[mesh, size] = (group, column)
        return self._replica_groups[mesh, size]


class HSDPBackend(FSDPBackend):
    """The ``fsdp`` backend on a 2-D ``(replicate, shard)`` mesh."""

    name: ClassVar[str] = "hsdp"

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        meshes = [cast("DTensor", p).device_mesh for p in params if is_dtensor(p)]
        return super().accepts(params) and all(mesh.ndim == 2 for mesh in meshes)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        """HSDP on ``mesh``; without one, on ``(nodes, processes per node)`` (``hsdp_mesh``)."""
        mesh = options.setdefault("mesh", "hsdp")
        if mesh != "hsdp" and mesh.ndim != 2:
            raise HyperParallelValueError(
                f"The 'hsdp' backend shards over a 2-D (replicate, shard) mesh; got a "
                f"{mesh.ndim}-D mesh. Use 'fsdp' for a 1-D mesh."
            )
        return super().shard_model(module, **options)


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``fsdp`` and ``hsdp``."""
    register(
        "fsdp",
        FSDPBackend,
        description="DTensor params of any layout (FSDP2, HSDP, TP, FSDP+TP): owner exchange",
    )
    register("hsdp", HSDPBackend, description="the fsdp backend on a 2-D (replicate, shard) mesh")
