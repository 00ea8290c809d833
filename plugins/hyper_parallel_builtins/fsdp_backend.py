"""Built-in plugin: the ``fsdp`` and ``hsdp`` sharding backends (DTensor params, any layout).

``fsdp`` takes DTensor params of any layout made of ``Shard``, FSDP+TP's
strided shards and ``Replicate``, on a mesh that spans the world or on a 1-D
sub-mesh: FSDP, HSDP, tensor parallel, FSDP+TP, expert stacks split on the
expert dim. ``hsdp`` is the same backend limited to 2-D
``(replicate, shard)`` meshes, for ``shard_model``.

Who computes what, for each param a matrix optimizer hands over:

* **In place.** A rank that holds whole blocks of a param (row shards that
  hold whole heads, expert stacks split on the expert dim, any param split
  only along dims its transform treats independently) computes them where
  they are. Nothing moves.
* **Owner exchange.** Every other param gets one owner rank, chosen
  greedily by cost so the work is balanced over every rank of the mesh
  (replicas included). The owned params are taken in buckets, each giving
  every owner a share of its work: per bucket, one collective brings each
  distinct piece of a param to its owner (one holder sends each piece, the
  owner itself where it holds one); the owner assembles the whole tensors,
  runs the transform on all it owns in the bucket in one call, and a second
  collective returns to every rank its own piece of the result.
* **Teams.** Where one owner per param would leave ranks idle (fewer
  params than ranks, one far larger than the rest), each param goes to a
  team of consecutive ranks instead, if the optimizer offers its transform
  as a :class:`~hyper_parallel.core.distributed.TeamTransform`: each member
  receives a band of the param (its *region*) the same way an owner
  receives the whole, the team runs the transform together, and each
  member returns its band. An owner is the team of one whose region is the
  whole param. ``team_size="auto"`` (the default) sizes teams by the cost
  model.

**Transport:** both trips of a bucket travel by ``all_to_all_single`` (each
rank sends each owner what it needs) or ``all_gather_single`` (every rank
gets everything, padded, and keeps its part: more bytes, fewer costly
messages). ``transport="auto"`` (the default) picks per bucket by the cost
model of :mod:`hyper_parallel.core.distributed.cost` and the device's
profile; every rank predicts the same, so they agree without talking.

**Overlap** (the default): the collectives are asynchronous. The first
bucket is sent before the in-place blocks are made (``map_prepared_blocks``:
a matrix optimizer's momentum) and transformed, and the next
bucket travels while the current one computes, while the results of the
one before travel back. Without overlap (``FSDPBackend(overlap=False)`` or
``HYPER_PARALLEL_EXCHANGE_OVERLAP=0``) every exchange is waited for as soon
as it is started. Both run the same plan and call the transform on the same
tensors, so their results are bitwise equal.

The plan (every rank's layout, who owns and who sends what, the buckets)
depends only on the params' shapes and placements; it is made once, with
one collective, and reused every step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import (
    BlocksFn,
    Need,
    PrepareFn,
    RowBlocks,
    ShardingBackend,
    TeamTransform,
    WholeMatrices,
)
from hyper_parallel.core.distributed.cost import (
    TRANSPORTS,
    Trip,
    choose_team_size,
    choose_transport,
    device_profile,
    exchange_trips,
)
from hyper_parallel.core.distributed.toolkit import (
    DEFAULT_BUCKET_BYTES,
    Layout,
    assign_owners,
    blocks_in_place,
    check_not_partial,
    exchange_group,
    exchange_rounds,
    gather_layouts,
    is_dtensor,
    local_tensor,
    map_held_blocks,
    shard_like,
)
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import env_switch
from hyper_parallel.core.plugin import RegisterFn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = [
    "MIN_BUCKET_BYTES",
    "OVERLAP_BUCKETS",
    "OVERLAP_ENV",
    "TEAM_SIZE_ENV",
    "TRANSPORT_ENV",
    "FSDPBackend",
    "HSDPBackend",
    "bucket_bytes",
]

#: Environment variable read when a backend is made without ``overlap``: ``1`` (the
#: default when unset) overlaps the owner exchange with the transform, ``0`` does not.
OVERLAP_ENV = "HYPER_PARALLEL_EXCHANGE_OVERLAP"

#: Environment variable read when a backend is made without ``transport``: ``auto`` (the
#: default when unset), ``all_to_all`` or ``all_gather``.
TRANSPORT_ENV = "HYPER_PARALLEL_TRANSPORT"

#: Environment variable read when a backend is made without ``team_size``: ``auto`` (the
#: default when unset) or a whole number of ranks that share each matrix.
TEAM_SIZE_ENV = "HYPER_PARALLEL_TEAM_SIZE"

#: Buckets the owner exchange is cut into, each giving every owner about this share of
#: its work: the first bucket's trip to its owners and the last one's trip back are what
#: overlap cannot hide. A bucket holds at least ``MIN_BUCKET_BYTES`` (each exchange has
#: a fixed cost, about 0.5 ms with gloo) and at most a quarter of ``DEFAULT_BUCKET_BYTES``
#: per owner (up to three buckets are in flight at once).
OVERLAP_BUCKETS = 4

#: Fewest bytes of whole tensors per owner in a bucket (a smaller total is one bucket).
MIN_BUCKET_BYTES = 1024 * 1024


def _overlap_from_env() -> bool:
    return env_switch(
        OVERLAP_ENV,
        default=True,
        meaning="overlap the owner exchange with the transform, the default",
    )


@dataclass(frozen=True)
class _Piece:
    """The part of a work's region that one distinct holder layout covers, and who sends it."""

    part: Layout  # global indices, in the holder's order
    holder: Layout  # the holder's layout
    sender: int


@dataclass(frozen=True)
class _Work:
    """One rank's share of one param's transform: all of it (its owner) or a slice (a team member)."""

    index: int  # into the mesh's tensors
    member: int  # rank in the exchange group that computes it
    region: Layout  # the indices it computes
    pieces: tuple[_Piece, ...]
    parts: tuple[Layout, ...]  # by rank: what of the region that rank holds, and gets back


#: Where a piece goes in the region; where it is in this rank's shard (sent by this
#: rank) or its global indices (received); its sender, -1 for this rank; its offset
#: in what that sender sends.
_Source = tuple[Layout, Layout, int, int]


@dataclass(frozen=True)
class _Assembly:
    """How this rank builds the region of one param it computes, from its shard and what arrives."""

    index: int
    region: Layout
    parts: tuple[_Source, ...]


@dataclass(frozen=True)
class _Landing:
    """Where one part of a result lands in this rank's shard, and where it comes from."""

    index: int
    member: int  # who computed it
    offset: int  # into what that member returns here
    into: Layout  # where in this rank's shard
    out_of: Layout | None  # where in this rank's own result (member is this rank)


@dataclass(frozen=True)
class _Leg:
    """One trip of a bucket as this rank sees it."""

    sends: tuple[int, ...]  # elements this rank sends each rank
    gets: tuple[int, ...]  # elements each rank sends this rank
    starts: tuple[int, ...]  # all_gather: where each rank's part for this one starts in its data
    width: int  # all_gather: every rank's contribution, padded to the longest


@dataclass(frozen=True)
class _Bucket:
    """What this rank sends, receives, transforms and gets back for one bucket of params."""

    send: tuple[tuple[tuple[int, Layout], ...], ...]  # by rank: (index, where in my shard)
    owned: tuple[_Assembly, ...]  # the regions this rank computes in the bucket
    back: tuple[tuple[tuple[int, Layout], ...], ...]  # by rank: (index, where in my result)
    land: tuple[_Landing, ...]
    legs: tuple[_Leg, _Leg]  # to the members, and back
    transport: str  # how both trips travel (hyper_parallel.core.distributed.cost)
    like: int  # the index of a param in the bucket (dtype and device of the buffers)
    empty: tuple[int, ...]  # the params of the bucket this rank holds nothing of


@dataclass(frozen=True)
class _Plan:
    """What every rank of one mesh does with that mesh's params."""

    group: ProcessGroup
    rank: int
    mine: tuple[Layout, ...]  # this rank's layout of each tensor
    in_place: tuple[int, ...]
    buckets: tuple[_Bucket, ...]
    team: ProcessGroup | None  # this rank's team, where matrices are shared by teams


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
            :mod:`hyper_parallel.core.distributed.cost` and this device's
            profile). ``None``: ``$HYPER_PARALLEL_TRANSPORT``, else
            ``"auto"``. The results are bitwise the same whichever travels.
        team_size: Ranks that share each exchanged matrix's transform
            (a :class:`~hyper_parallel.core.distributed.TeamTransform`):
            ``1`` for one owner each, a divisor of the exchange's ranks, or
            ``"auto"`` (what :func:`~hyper_parallel.core.distributed.cost.choose_team_size`
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
        self.team_size = _team_size_option(team_size)
        self._team_size_origin = "team_size" if team_size is not None else TEAM_SIZE_ENV
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._teams: dict[tuple[int, int], ProcessGroup] = {}  # (size, first rank): its group
        self.replica_group_size: int | None = None
        self._replica_groups: dict[tuple[DeviceMesh, int], ProcessGroup] = {}

    def group_replicas(self, size: int) -> None:
        """Share the work among groups of ``size`` replicas only (on a 2-D ``(replicate, shard)`` mesh).

        Each group of ``size`` consecutive replicas computes every matrix once
        and shares the results among its own ranks; other groups do the
        same, so no collective leaves a group (keep a group within a node).
        ``size`` must divide the replicate dim; at least its size is one group.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise HyperParallelValueError(f"hsdp_replica_count must be positive, got {size!r}.")
        self.replica_group_size = size
        self._plans.clear()

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return any(is_dtensor(p) for p in params) and all(_supported(p) for p in params)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        from hyper_parallel.core.distributed import fully_shard

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
        tensors = _Prepared(prepare, layouts)
        tensors.make([i for i in range(len(layouts)) if i not in in_place])
        out: list[torch.Tensor | None] = [None] * len(layouts)
        exchange = _Exchange(fn, team, layouts, tensors.local, needs, out)
        steps = [(plan, indices, bucket) for indices, plan in plans for bucket in plan.buckets]

        def held_blocks() -> None:
            tensors.make(list(in_place))
            _map_in_place(fn, tensors.made, needs, in_place, out)

        if self.overlap:
            exchange.overlapped(steps, held_blocks)
        else:
            held_blocks()
            exchange.in_turn(steps)
        return [r for r in out if r is not None]

    def _plan(
        self,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        indices: list[int],
        cost: Callable[[torch.Size], float] | None,
        team: TeamTransform | None,
    ) -> _Plan:
        dts = [cast("DTensor", tensors[i]) for i in indices]
        layout = [(t.shape, t.dtype, t.placements, t.device_mesh, needs[i])
                  for t, i in zip(dts, indices, strict=True)]  # fmt: skip
        key = (*layout, team.dtype if team else None)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _make_plan(
                self._exchange_group(dts),
                [tensors[i] for i in indices],
                [needs[i] for i in indices],
                cost,
                _Options(self.transport, self.team_size, team, self._team_size_origin),
                self._teams,
            )
        return plan

    def _exchange_group(self, tensors: Sequence[DTensor]) -> ProcessGroup:
        """The ranks that share these params' work: the mesh's, or this rank's group of replicas."""
        mesh = tensors[0].device_mesh
        size = self.replica_group_size
        if size is None or mesh.ndim != 2 or size >= mesh.size(0):
            return exchange_group(mesh)
        replicas = mesh.size(0)
        if replicas % size:
            raise HyperParallelValueError(
                f"hsdp_replica_count {size} must evenly divide the replicate dim of the mesh "
                f"({replicas} replicas); choose a divisor of {replicas}."
            )
        for t in tensors:
            if not t.placements[0].is_replicate():
                raise HyperParallelValueError(
                    f"hsdp_replica_count={size} groups the replicas of an HSDP (replicate, shard) "
                    f"mesh, but a param of shape {tuple(t.shape)} has placements {t.placements}; "
                    "leave hsdp_replica_count unset for this layout."
                )
        if (mesh, size) not in self._replica_groups:
            blocks = [mesh.mesh[r : r + size].flatten().tolist() for r in range(0, replicas, size)]
            mine, _ = dist.new_subgroups_by_enumeration(blocks)
            self._replica_groups[mesh, size] = mine
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


# -- the plan ------------------------------------------------------------------------


def _block_shapes(shape: torch.Size, need: Need) -> list[torch.Size]:
    if not isinstance(need, RowBlocks):
        return [shape]
    dim = need.batch_dims
    return [torch.Size((*shape[:dim], h, *shape[dim + 1 :])) for h in need.heights]


@dataclass(frozen=True)
class _Options:
    """How a plan is made: the transport, the team size, and the team transform."""

    transport: str
    team_size: int | str
    team: TeamTransform | None
    team_size_origin: str = "team_size"  # or the environment variable it came from


def _team_size_option(value: int | str | None) -> int | str:
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


def _make_plan(
    group: ProcessGroup,
    tensors: list[torch.Tensor],
    needs: list[Need],
    cost: Callable[[torch.Size], float] | None,
    options: _Options,
    teams: dict[tuple[int, int], ProcessGroup],
) -> _Plan:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layouts = gather_layouts(tensors, group)
    in_place = tuple(
        i for i, t in enumerate(tensors) if blocks_in_place(needs[i], t.shape, layouts[i])
    )
    moving = [i for i in range(len(tensors)) if i not in in_place]
    measure = cost or (lambda shape: float(math.prod(shape)))
    costs = [sum(measure(s) for s in _block_shapes(tensors[i].shape, needs[i])) for i in moving]
    size = _team_size([tensors[i] for i in moving], [needs[i] for i in moving], costs, group,
                      options)  # fmt: skip
    team = options.team
    if size > 1:
        assert team is not None
        costs = [team.cost(tensors[i].shape, size) for i in moving]
    owners = assign_owners(costs, world // size)
    works = [
        _works(i, tensors[i].shape, owner, size, layouts[i], team)
        for i, owner in zip(moving, owners, strict=True)
    ]
    nbytes = [tensors[i].numel() * tensors[i].element_size() // size for i in moving]
    dtypes = [tensors[i].dtype for i in moving]
    rounds = exchange_rounds(
        nbytes, dtypes, owners, world // size, bucket_bytes(nbytes, owners, world // size)
    )
    mine = tuple(layouts[i][rank] for i in range(len(tensors)))
    buckets = tuple(
        _bucket(
            [w for k in round_ for w in works[k]], tensors, mine, rank, world, options.transport
        )
        for round_ in rounds
    )
    return _Plan(group, rank, mine, in_place, buckets, _team_group(group, rank, size, teams))


def _team_size(
    tensors: list[torch.Tensor],
    needs: list[Need],
    costs: list[float],
    group: ProcessGroup,
    options: _Options,
) -> int:
    """How many ranks share each matrix: the option, checked, or the cost model's choice.

    The choice is rank 0's, so every rank plans the same even where their
    environments differ.
    """
    team, shapes = options.team, [t.shape for t in tensors]
    world = dist.get_world_size(group)
    whole = all(isinstance(n, WholeMatrices) for n in needs)
    if options.team_size == "auto":
        size = 1
        if tensors and whole:
            profile = device_profile(tensors[0].device.type)
            size = choose_team_size(shapes, costs, team, world, profile, _node_size(group))
        agreed = [size]
        dist.broadcast_object_list(agreed, src=dist.get_global_rank(group, 0), group=group)
        return int(agreed[0])
    size = int(options.team_size)
    if size == 1 or not tensors:
        return 1
    problem = None
    if world % size:
        problem = f"it does not divide the {world} ranks that exchange these params"
    elif team is None:
        problem = "this optimizer's transform has no team form (TeamTransform)"
    elif not whole:
        problem = "some params need row blocks, which a team does not split"
    else:
        for shape in shapes:
            dim = team.split_dim(shape)
            if dim is None or shape[dim] < size:
                problem = f"a param of shape {tuple(shape)} cannot be split {size} ways"
                break
    if problem:
        raise HyperParallelValueError(
            f"{options.team_size_origin}={size}: {problem}. Use 'auto' or 1, or a size that fits."
        )
    return size


def _node_size(group: ProcessGroup) -> int:
    """The most consecutive ranks of ``group`` that always share a node (``LOCAL_WORLD_SIZE``)."""
    ranks = dist.get_process_group_ranks(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())

    def one_node_each(n: int) -> bool:
        return all(
            len({r // local for r in ranks[f : f + n]}) == 1 for f in range(0, len(ranks), n)
        )

    return max(n for n in range(1, len(ranks) + 1) if len(ranks) % n == 0 and one_node_each(n))


def _team_group(
    group: ProcessGroup, rank: int, size: int, teams: dict[tuple[int, int], ProcessGroup]
) -> ProcessGroup | None:
    """The process group of this rank's team: ``size`` consecutive ranks of ``group``.

    Over the whole world every rank makes every team's group, in the same
    order (``new_subgroups``); over a sub-mesh's group only the members
    meet. A team's collectives get their own group even where it is the
    whole exchange group, so they never queue behind the exchange's.
    """
    if size == 1:
        return None
    first = rank // size * size
    if (size, first) not in teams:
        if dist.get_world_size(group) == dist.get_world_size():
            mine, _ = dist.new_subgroups(group_size=size)
            teams[size, first] = mine
        else:
            members = dist.get_process_group_ranks(group)[first : first + size]
            teams[size, first] = dist.new_group(members, use_local_synchronization=True)
    return teams[size, first]


def bucket_bytes(nbytes: list[int], owners: list[int], world: int) -> int:
    """Whole-tensor bytes per owner and bucket: the busiest owner's share, within bounds."""
    per_owner = [0] * world
    for n, owner in zip(nbytes, owners, strict=True):
        per_owner[owner] += n
    share = math.ceil(max(per_owner, default=0) / OVERLAP_BUCKETS)
    return min(DEFAULT_BUCKET_BYTES // OVERLAP_BUCKETS, max(MIN_BUCKET_BYTES, share))


def _works(
    index: int,
    shape: torch.Size,
    owner: int,
    size: int,
    layouts: list[Layout],
    team: TeamTransform | None,
) -> list[_Work]:
    """The works of one param: all of it for ``owner``, or a slice for each member of team ``owner``.

    Each distinct part of a region is sent by the member if it holds it,
    else by one of its holders.
    """
    whole = Layout.whole(shape)
    regions = [(owner, whole)]
    if size > 1:
        dim = team.split_dim(shape) if team else None
        assert dim is not None
        n = shape[dim]
        regions = [
            (owner * size + k, whole.region(dim, k * n // size, (k + 1) * n // size))
            for k in range(size)
        ]
    holders: dict[Layout, list[int]] = {}
    for rank, layout in enumerate(layouts):
        if layout.numel:
            holders.setdefault(layout, []).append(rank)
    works = []
    for member, region in regions:
        cut = {layout: layout.intersect(region) for layout in dict.fromkeys(layouts)}
        pieces = tuple(
            _Piece(cut[lay], lay, member if layouts[member] == lay else ranks[index % len(ranks)])
            for lay, ranks in holders.items()
            if cut[lay].numel
        )
        works.append(_Work(index, member, region, pieces, tuple(cut[lay] for lay in layouts)))
    return works


def _bucket(
    works: list[_Work],
    tensors: list[torch.Tensor],
    mine: tuple[Layout, ...],
    me: int,
    world: int,
    transport: str,
) -> _Bucket:
    """This rank's part of exchanging ``works``: the orders and offsets both trips use.

    Both trips list each rank's data work by work, in the bucket's order.
    ``transport="auto"`` takes the one the cost model predicts faster for
    these trips on this device (every rank predicts the same).
    """
    send: list[list[tuple[int, Layout]]] = [[] for _ in range(world)]
    sends, recv_sizes, back_sizes = [0] * world, [0] * world, [0] * world
    owned: list[_Assembly] = []
    back: list[list[tuple[int, Layout]]] = [[] for _ in range(world)]
    land: list[_Landing] = []
    for work in works:
        if work.member == me:
            owned.append(_assembly(work, me, recv_sizes))
            for rank, part in enumerate(work.parts):
                if rank != me and part.numel:
                    back[rank].append((work.index, work.region.locate(part)))
        for piece in work.pieces:
            if piece.sender == me and work.member != me:
                send[work.member].append((work.index, piece.holder.locate(piece.part)))
                sends[work.member] += piece.part.numel
        part = work.parts[me]
        if not part.numel:
            continue
        into = mine[work.index].locate(part)
        if work.member == me:
            land.append(_Landing(work.index, me, 0, into, work.region.locate(part)))
        else:
            land.append(_Landing(work.index, work.member, back_sizes[work.member], into, None))
            back_sizes[work.member] += part.numel
    returns = [sum(where.numel for _, where in to) for to in back]
    legs, trips = _legs(works, me, world, (sends, recv_sizes), (returns, back_sizes))
    like = tensors[works[0].index]
    if transport == "auto":
        transport = choose_transport(trips, like.element_size(), device_profile(like.device.type))
    return _Bucket(
        tuple(map(tuple, send)), tuple(owned), tuple(map(tuple, back)), tuple(land), legs,
        transport, works[0].index,
        tuple(dict.fromkeys(w.index for w in works if not mine[w.index].numel)),
    )  # fmt: skip


def _assembly(work: _Work, me: int, recv_sizes: list[int]) -> _Assembly:
    """Where each piece of ``work``'s region comes from; advances ``recv_sizes`` by what arrives."""
    parts = []
    for piece in work.pieces:
        where = work.region.locate(piece.part)
        if piece.sender == me:
            parts.append((where, piece.holder.locate(piece.part), -1, 0))
        else:
            parts.append((where, piece.part, piece.sender, recv_sizes[piece.sender]))
            recv_sizes[piece.sender] += piece.part.numel
    return _Assembly(work.index, work.region, tuple(parts))


def _legs(
    works: list[_Work],
    me: int,
    world: int,
    to_members: tuple[list[int], list[int]],
    back: tuple[list[int], list[int]],
) -> tuple[tuple[_Leg, _Leg], tuple[Trip, Trip]]:
    """Both trips as this rank sees them (``(sends, gets)`` of each), and as the cost model does."""
    pieces = [[(p.sender, p.part.numel) for p in work.pieces] for work in works]
    parts = [torch.tensor([lay.numel for lay in work.parts]) for work in works]
    trips = exchange_trips(
        [(work.member, ps, pa) for work, ps, pa in zip(works, pieces, parts, strict=True)], world
    )
    # all_gather: each rank's data is its parts in rank order; mine starts after the lower ranks'
    to_start, back_start = [0] * world, [0] * world
    for work, ps, pa in zip(works, pieces, parts, strict=True):
        if work.member < me:
            for sender, numel in ps:
                if sender != work.member:
                    to_start[sender] += numel
        below = int(pa[:me].sum()) - (int(pa[work.member]) if work.member < me else 0)
        back_start[work.member] += below
    legs = (
        _Leg(tuple(to_members[0]), tuple(to_members[1]), tuple(to_start), trips[0].width),
        _Leg(tuple(back[0]), tuple(back[1]), tuple(back_start), trips[1].width),
    )
    return legs, trips


# -- running it ----------------------------------------------------------------------


class _Prepared:
    """The tensors of one ``map_prepared_blocks`` call, made in parts."""

    def __init__(self, prepare: PrepareFn, layouts: Sequence[torch.Tensor]) -> None:
        self.prepare = prepare
        self.made: list[torch.Tensor] = list(layouts)  # placeholders until made
        self.local: list[torch.Tensor] = [torch.empty(0)] * len(layouts)

    def make(self, positions: list[int]) -> None:
        if not positions:
            return
        for i, t in zip(positions, self.prepare(positions), strict=True):
            self.made[i], self.local[i] = t, local_tensor(t)


def _map_in_place(
    fn: BlocksFn,
    tensors: Sequence[torch.Tensor],
    needs: Sequence[Need],
    layouts: dict[int, Layout],
    out: list[torch.Tensor | None],
) -> None:
    """One ``fn`` call on the whole blocks this rank already holds (``layouts``: index -> its layout)."""
    indices = list(layouts)
    results = map_held_blocks(
        fn,
        [local_tensor(tensors[i]) for i in indices],
        [layouts[i] for i in indices],
        [needs[i] for i in indices],
    )
    for i, result in zip(indices, results, strict=True):
        out[i] = shard_like(result, tensors[i])


class _InFlight:
    """One trip of a bucket, started asynchronously; :meth:`wait` gives what arrived from each rank.

    ``parts`` are this rank's, by destination. ``all_to_all`` sends each rank
    its part; ``all_gather`` gives every rank every rank's parts (padded to
    the longest), and this rank keeps what was meant for it.
    """

    def __init__(
        self,
        parts: Sequence[Sequence[torch.Tensor]],
        leg: _Leg,
        transport: str,
        like: torch.Tensor,
        group: ProcessGroup,
    ) -> None:
        flat = [p.reshape(-1) for ps in parts for p in ps]
        send = torch.cat(flat) if flat else like.new_empty(0)
        self._sizes = leg.gets
        if transport == "all_gather":
            self._starts = [q * leg.width + start for q, start in enumerate(leg.starts)]
            self._recv = like.new_empty(leg.width * len(leg.gets))
            send = torch.cat([send, send.new_zeros(leg.width - send.numel())])
            self._work = dist.all_gather_single(self._recv, send, group=group, async_op=True)
        else:
            self._starts = [sum(leg.gets[:q]) for q in range(len(leg.gets))]
            self._recv = like.new_empty(sum(leg.gets))
            self._work = dist.all_to_all_single(
                self._recv, send, output_split_sizes=list(leg.gets),
                input_split_sizes=list(leg.sends), group=group, async_op=True,
            )  # fmt: skip
        self._send = send  # alive until the collective is done

    def wait(self) -> list[torch.Tensor]:
        """Block until the trip is done; what each rank sent here, one flat tensor per rank."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            del self._send
        return [self._recv[a : a + n] for a, n in zip(self._starts, self._sizes, strict=True)]


_Step = tuple[_Plan, list[int], _Bucket]  # a plan, its tensors' positions, one of its buckets


class _Exchange:
    """The owner exchange of one ``map_blocks`` call, bucket by bucket; results land in ``out``."""

    def __init__(
        self,
        fn: BlocksFn,
        team: TeamTransform | None,
        tensors: Sequence[torch.Tensor],
        local: list[torch.Tensor],
        needs: Sequence[Need],
        out: list[torch.Tensor | None],
    ) -> None:
        self.fn, self.team, self.tensors, self.local = fn, team, tensors, local
        self.needs, self.out = needs, out

    def in_turn(self, steps: list[_Step]) -> None:
        """Each bucket's trip to its members, transform and trip back, one after the other."""
        for step in steps:
            results = self._transform(step, self._send(step).wait())
            self._land(step, results, self._return(step, results).wait())

    def overlapped(self, steps: list[_Step], meanwhile: Callable[[], None]) -> None:
        """:meth:`in_turn` with the next bucket travelling while the current one computes.

        ``meanwhile`` (the in-place work) runs while the first bucket travels.
        At most three buckets are in flight: the next one arriving, the
        current one computing, the previous one's results returning.
        """
        incoming = self._send(steps[0]) if steps else None
        meanwhile()
        returning: tuple[_Step, dict[int, torch.Tensor], _InFlight] | None = None
        for k, step in enumerate(steps):
            assert incoming is not None
            received = incoming.wait()
            incoming = self._send(steps[k + 1]) if k + 1 < len(steps) else None
            results = self._transform(step, received)
            sent_back = self._return(step, results)
            if returning is not None:
                self._land(returning[0], returning[1], returning[2].wait())
            returning = (step, results, sent_back)
        if returning is not None:
            self._land(returning[0], returning[1], returning[2].wait())

    def _send(self, step: _Step) -> _InFlight:
        """Start sending this rank's pieces of the bucket to their members."""
        plan, positions, bucket = step
        parts = [[where.take(self.local[positions[i]]) for i, where in to] for to in bucket.send]
        like = self.local[positions[bucket.like]]
        return _InFlight(parts, bucket.legs[0], bucket.transport, like, plan.group)

    def _transform(self, step: _Step, received: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Assemble the regions this rank computes in the bucket; the transform on all, in one call."""
        plan, positions, bucket = step
        regions = []
        for owned in bucket.owned:
            mine = self.local[positions[owned.index]]
            region = mine.new_empty(owned.region.shape)
            for where, source, sender, offset in owned.parts:
                if sender < 0:
                    data = source.take(mine)
                else:
                    data = received[sender][offset : offset + where.numel].view(where.shape)
                where.copy_into(region, data)
            regions.append(region)
        if plan.team is not None:
            assert self.team is not None
            shapes = [self.tensors[positions[o.index]].shape for o in bucket.owned]
            results = self.team(regions, shapes, plan.team)
        else:
            results = map_held_blocks(
                self.fn,
                regions,
                [Layout.whole(r.shape) for r in regions],
                [self.needs[positions[o.index]] for o in bucket.owned],
            )
        return {o.index: r for o, r in zip(bucket.owned, results, strict=True)}

    def _return(self, step: _Step, results: dict[int, torch.Tensor]) -> _InFlight:
        """Start sending every rank its piece of each result this rank computed."""
        plan, positions, bucket = step
        parts = [[where.take(results[i]) for i, where in to] for to in bucket.back]
        like = self.local[positions[bucket.like]]
        return _InFlight(parts, bucket.legs[1], bucket.transport, like, plan.group)

    def _land(
        self, step: _Step, results: dict[int, torch.Tensor], returned: list[torch.Tensor]
    ) -> None:
        """Each param's result for this rank, from its own results or from what came back."""
        plan, positions, bucket = step
        landed: dict[int, list[tuple[Layout, torch.Tensor]]] = {}
        for landing in bucket.land:
            into = landing.into
            if landing.out_of is not None:
                data = landing.out_of.take(results[landing.index])
            else:
                start = landing.offset
                data = returned[landing.member][start : start + into.numel].view(into.shape)
            landed.setdefault(landing.index, []).append((into, data))
        like = self.local[positions[bucket.like]]
        for index in bucket.empty:
            landed[index] = [(plan.mine[index], like.new_empty(plan.mine[index].shape))]
        for index, parts in landed.items():
            mine = plan.mine[index]
            if len(parts) == 1 and parts[0][0] == Layout.whole(mine.shape):
                part = parts[0][1]
            else:
                part = parts[0][1].new_empty(mine.shape)
                for into, data in parts:
                    into.copy_into(part, data)
            position = positions[index]
            self.out[position] = shard_like(part, self.tensors[position])


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``fsdp`` and ``hsdp``."""
    register(
        "fsdp",
        FSDPBackend,
        description="DTensor params of any layout (FSDP2, HSDP, TP, FSDP+TP): owner exchange",
    )
    register("hsdp", HSDPBackend, description="the fsdp backend on a 2-D (replicate, shard) mesh")
