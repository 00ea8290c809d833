"""The exchange plan: who holds, owns, sends and receives what, in which bucket.

It depends only on the params' shapes and placements: made once, with one
collective, and reused every step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed import (
    Need,
    RowBlocks,
    TeamTransform,
    WholeMatrices,
    ranks_per_node,
)
from hyper_parallel.core.distributed.toolkit import (
    DEFAULT_BUCKET_BYTES,
    Layout,
    assign_owners,
    blocks_in_place,
    exchange_rounds,
    gather_layouts,
)
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel_builtins.fsdp_backend.cost import (
    DeviceProfile,
    Trip,
    choose_replica_group,
    choose_team_size,
    choose_transport,
    device_profile,
    exchange_trips,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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


@dataclass(frozen=True)
class Piece:
    """The part of a work's region that one distinct holder layout covers, and who sends it."""

    part: Layout  # global indices, in the holder's order
    holder: Layout  # the holder's layout
    sender: int


@dataclass(frozen=True)
class Work:
    """One rank's share of one param's transform: all of it (its owner) or a slice (a team member)."""

    index: int  # into the mesh's tensors
    member: int  # rank in the exchange group that computes it
    region: Layout  # the indices it computes
    pieces: tuple[Piece, ...]
    parts: tuple[Layout, ...]  # by rank: what of the region that rank holds, and gets back


#: Where a piece goes in the region; where it is in this rank's shard (sent by this
#: rank) or its global indices (received); its sender, -1 for this rank; its offset
#: in what that sender sends.
_Source = tuple[Layout, Layout, int, int]


@dataclass(frozen=True)
class Assembly:
    """How this rank builds the region of one param it computes, from its shard and what arrives."""

    index: int
    region: Layout
    parts: tuple[_Source, ...]


#: Where a landing's data comes from: this rank's own result, the trip back from the
#: member that computed it, or the spread from the replica row that did.
OWN, BACK, SPREAD = 0, 1, 2


@dataclass(frozen=True)
class Landing:
    """Where one part of a result lands in this rank's shard, and where it comes from."""

    index: int
    into: Layout  # where in this rank's shard
    source: int  # OWN, BACK or SPREAD
    peer: int  # BACK: the member that computed it; SPREAD: the column rank whose row did
    offset: int  # into what that peer sends here
    out_of: Layout | None  # OWN: where in this rank's own result


@dataclass(frozen=True)
class Leg:
    """One trip of a bucket as this rank sees it."""

    sends: tuple[int, ...]  # elements this rank sends each rank
    gets: tuple[int, ...]  # elements each rank sends this rank
    starts: tuple[int, ...]  # all_gather: where each rank's part for this one starts in its data
    width: int  # all_gather: every rank's contribution, padded to the longest


@dataclass(frozen=True)
class Bucket:
    """What this rank sends, receives, transforms and gets back for one bucket of params."""

    send: tuple[tuple[tuple[int, Layout], ...], ...]  # by rank: (index, where in my shard)
    owned: tuple[Assembly, ...]  # the regions this rank computes in the bucket
    back: tuple[tuple[tuple[int, Layout], ...], ...]  # by rank: (index, where in my result)
    land: tuple[Landing, ...]
    legs: tuple[Leg, Leg]  # to the members, and back
    transport: str  # how both trips travel (hyper_parallel_builtins.fsdp_backend.cost)
    like: int  # the index of a param in the bucket (dtype and device of the buffers)
    empty: tuple[int, ...]  # the params of the bucket this rank holds nothing of
    spread: tuple[int, ...]  # by column rank: elements its row's results give the others


@dataclass(frozen=True)
class ExchangePlan:
    """What every rank of one mesh does with that mesh's params."""

    group: ProcessGroup
    rank: int
    mine: tuple[Layout, ...]  # this rank's layout of each tensor
    in_place: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    team: ProcessGroup | None  # this rank's team, where matrices are shared by teams
    column: ProcessGroup | None  # this rank's replicas in its group, where rows share the work


# -- the plan ------------------------------------------------------------------------


def _block_shapes(shape: torch.Size, need: Need) -> list[torch.Size]:
    if not isinstance(need, RowBlocks):
        return [shape]
    dim = need.batch_dims
    return [torch.Size((*shape[:dim], h, *shape[dim + 1 :])) for h in need.heights]


@dataclass(frozen=True)
class PlanOptions:
    """How a plan is made: the transport, the team size, and the team transform."""

    transport: str
    team_size: int | str
    team: TeamTransform | None
    team_size_origin: str = "team_size"  # or the environment variable it came from
    profile: DeviceProfile | None = None  # the file HYPER_PARALLEL_DEVICE_PROFILE named, if any


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


@dataclass(frozen=True)
class Replicas:
    """An HSDP layout's replicas: ``count`` rows of the mesh, each holding every shard once.

    ``size`` is how many consecutive replicas share the work (an int, or
    ``"auto"``), from ``origin``. ``split(g)`` gives this rank's group of
    ``g`` replicas (their ranks, in any order) and its column in that group
    (the ``g`` ranks that hold its shard; ``None`` for ``g == 1``);
    ``row_of`` the replica (mesh row) of each global rank.
    """

    count: int
    shards: int
    size: int | str
    origin: str
    split: Callable[[int], tuple[ProcessGroup, ProcessGroup | None]]
    row_of: Callable[[int], int]


def make_plan(
    group: ProcessGroup,
    tensors: list[torch.Tensor],
    needs: list[Need],
    cost: Callable[[torch.Size], float] | None,
    options: PlanOptions,
    teams: dict[tuple[int, ...], ProcessGroup],
    replicas: Replicas | None = None,
) -> ExchangePlan:
    """The plan of ``tensors`` over ``group`` (with ``replicas``: over the world, split in groups)."""
    layouts = gather_layouts(tensors, group)
    in_place = tuple(
        i for i, t in enumerate(tensors) if blocks_in_place(needs[i], t.shape, layouts[i])
    )
    moving = [i for i in range(len(tensors)) if i not in in_place]
    measure = cost or (lambda shape: float(math.prod(shape)))
    costs = [sum(measure(s) for s in _block_shapes(tensors[i].shape, needs[i])) for i in moving]
    travelling = _Moving([tensors[i] for i in moving], [needs[i] for i in moving], costs)
    rows: list[int] = [0] * dist.get_world_size(group)
    column: ProcessGroup | None = None
    column_rows: tuple[int, ...] = ()
    if replicas is not None and moving:
        count = _replica_group_size(replicas, travelling, group, options)
        group, column, rows, column_rows = _replica_group(replicas, count)
        members = dist.get_process_group_ranks(group)
        layouts = [[lay[r] for r in members] for lay in layouts]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = _team_size(travelling, group, options)
    team = options.team
    if size > 1:
        assert team is not None
        costs = [team.cost(tensors[i].shape, size) for i in moving]
    owners = assign_owners(costs, world // size, rows=len(set(rows)))
    works = [
        _works(i, tensors[i].shape, owner, size, layouts[i], team, rows)
        for i, owner in zip(moving, owners, strict=True)
    ]
    nbytes = [tensors[i].numel() * tensors[i].element_size() // size for i in moving]
    dtypes = [tensors[i].dtype for i in moving]
    rounds = exchange_rounds(
        nbytes, dtypes, owners, world // size, bucket_bytes(nbytes, owners, world // size)
    )
    mine = tuple(layouts[i][rank] for i in range(len(tensors)))
    where = _Where(rank, rows, column_rows)
    buckets = tuple(
        _bucket([w for k in round_ for w in works[k]], tensors, mine, where, options)
        for round_ in rounds
    )
    return ExchangePlan(
        group, rank, mine, in_place, buckets, _team_group(group, rank, size, teams), column
    )


def _replica_group(
    replicas: Replicas, count: int
) -> tuple[ProcessGroup, ProcessGroup | None, list[int], tuple[int, ...]]:
    """This rank's group of ``count`` replicas, its column, and the row of each of their ranks."""
    group, column = replicas.split(count)
    members = dist.get_process_group_ranks(group)
    first = min(replicas.row_of(r) for r in members)
    rows = [replicas.row_of(r) - first for r in members]
    column_rows: tuple[int, ...] = ()
    if column is not None:
        column_rows = tuple(
            replicas.row_of(r) - first for r in dist.get_process_group_ranks(column)
        )
    return group, column, rows, column_rows


@dataclass(frozen=True)
class _Moving:
    """The tensors a plan sends to owners: their needs and the cost of each one's work."""

    tensors: list[torch.Tensor]
    needs: list[Need]
    costs: list[float]

    @property
    def whole(self) -> bool:
        return all(isinstance(n, WholeMatrices) for n in self.needs)


def _agreed(value: int, group: ProcessGroup) -> int:
    """Rank 0's ``value``, so every rank plans the same even where their environments differ."""
    agreed = [value]
    dist.broadcast_object_list(agreed, src=dist.get_global_rank(group, 0), group=group)
    return int(agreed[0])


def _replica_group_size(
    replicas: Replicas, moving: _Moving, group: ProcessGroup, options: PlanOptions
) -> int:
    """Replicas per group: the option, checked, or the cost model's choice (rank 0's)."""
    count = replicas.count
    if replicas.size != "auto":
        size = int(replicas.size)
        if size < count and count % size:
            raise HyperParallelValueError(
                f"{replicas.origin} {size} must evenly divide the replicate dim of the mesh "
                f"({count} replicas); choose a divisor of {count}."
            )
        return min(size, count)
    auto = options.team_size == "auto"
    like = moving.tensors[0]
    chosen = choose_replica_group(
        [t.shape for t in moving.tensors], moving.costs,
        options.team if moving.whole and auto else None, replicas.shards, count,
        device_profile(like.device.type, options.profile), _node_size(group), like.element_size(),
        1 if auto else int(options.team_size),
    )  # fmt: skip
    return _agreed(chosen, group)


def _team_size(moving: _Moving, group: ProcessGroup, options: PlanOptions) -> int:
    """How many ranks share each matrix: the option, checked, or the cost model's choice (rank 0's)."""
    team, shapes = options.team, [t.shape for t in moving.tensors]
    world = dist.get_world_size(group)
    if options.team_size == "auto":
        size = 1
        if shapes and moving.whole:
            profile = device_profile(moving.tensors[0].device.type, options.profile)
            size = choose_team_size(shapes, moving.costs, team, world, profile, _node_size(group))
        return _agreed(size, group)
    size = int(options.team_size)
    if size == 1 or not shapes:
        return 1
    problem = None
    if world % size:
        problem = f"it does not divide the {world} ranks that exchange these params"
    elif team is None:
        problem = "this optimizer's transform has no team form (TeamTransform)"
    elif not moving.whole:
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
    local = ranks_per_node(dist.get_world_size())

    def one_node_each(n: int) -> bool:
        return all(
            len({r // local for r in ranks[f : f + n]}) == 1 for f in range(0, len(ranks), n)
        )

    return max(n for n in range(1, len(ranks) + 1) if len(ranks) % n == 0 and one_node_each(n))


def _team_group(
    group: ProcessGroup, rank: int, size: int, teams: dict[tuple[int, ...], ProcessGroup]
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
    members = tuple(dist.get_process_group_ranks(group)[first : first + size])
    if members not in teams:
        if dist.get_world_size(group) == dist.get_world_size():
            teams[members], _ = dist.new_subgroups(group_size=size)
        else:
            teams[members] = dist.new_group(list(members), use_local_synchronization=True)
    return teams[members]


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
    rows: list[int],
) -> list[Work]:
    """The works of one param: all of it for ``owner``, or a slice for each member of team ``owner``.

    Each distinct part of a region is sent once: by the member if it holds
    it, else by a holder in the member's replica row (``rows``: each rank's).
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
        pieces = []
        for lay, ranks in holders.items():
            if not cut[lay].numel:
                continue
            near = [r for r in ranks if rows[r] == rows[member]] or ranks
            sender = member if layouts[member] == lay else near[index % len(near)]
            pieces.append(Piece(cut[lay], lay, sender))
        works.append(Work(index, member, region, tuple(pieces), tuple(cut[lay] for lay in layouts)))
    return works


@dataclass(frozen=True)
class _Where:
    """This rank in its exchange group: its rank, each rank's replica row, each column rank's."""

    me: int
    rows: list[int]
    column_rows: tuple[int, ...]  # empty where one row computes everything


def _bucket(
    works: list[Work],
    tensors: list[torch.Tensor],
    mine: tuple[Layout, ...],
    where: _Where,
    options: PlanOptions,
) -> Bucket:
    """This rank's part of exchanging ``works``: the orders and offsets of its trips.

    A member returns each part of its result only to the ranks of its own
    replica row; the other rows get theirs in the spread, an all-gather
    over the column of replicas. Both trips and the spread list each rank's
    data work by work, in the bucket's order. ``transport="auto"`` takes
    the one the cost model predicts faster for these trips on this device
    (every rank predicts the same).
    """
    me, rows = where.me, where.rows
    world = len(rows)
    send: list[list[tuple[int, Layout]]] = [[] for _ in range(world)]
    sends, recv_sizes, back_sizes = [0] * world, [0] * world, [0] * world
    owned: list[Assembly] = []
    back: list[list[tuple[int, Layout]]] = [[] for _ in range(world)]
    land: list[Landing] = []
    column = {row: k for k, row in enumerate(where.column_rows)}
    spread = [0] * len(column)
    for work in works:
        row = rows[work.member]
        if work.member == me:
            owned.append(_assembly(work, me, recv_sizes))
            for rank, part in enumerate(work.parts):
                if rank != me and part.numel and rows[rank] == row:
                    back[rank].append((work.index, work.region.locate(part)))
        for piece in work.pieces:
            if piece.sender == me and work.member != me:
                send[work.member].append((work.index, piece.holder.locate(piece.part)))
                sends[work.member] += piece.part.numel
        part = work.parts[me]
        if not part.numel:
            continue
        into = mine[work.index].locate(part)
        if column:
            source = column[row]
            if row != rows[me]:
                land.append(Landing(work.index, into, SPREAD, source, spread[source], None))
            spread[source] += part.numel
            if row != rows[me]:
                continue
        if work.member == me:
            land.append(Landing(work.index, into, OWN, me, 0, work.region.locate(part)))
        else:
            member = work.member
            land.append(Landing(work.index, into, BACK, member, back_sizes[member], None))
            back_sizes[member] += part.numel
    returns = [sum(w.numel for _, w in to) for to in back]
    legs, trips = _legs(works, where, (sends, recv_sizes), (returns, back_sizes))
    like = tensors[works[0].index]
    transport = options.transport
    if transport == "auto":
        profile = device_profile(like.device.type, options.profile)
        transport = choose_transport(trips, like.element_size(), profile)
    return Bucket(
        tuple(map(tuple, send)), tuple(owned), tuple(map(tuple, back)), tuple(land), legs,
        transport, works[0].index,
        tuple(dict.fromkeys(w.index for w in works if not mine[w.index].numel)), tuple(spread),
    )  # fmt: skip


def _assembly(work: Work, me: int, recv_sizes: list[int]) -> Assembly:
    """Where each piece of ``work``'s region comes from; advances ``recv_sizes`` by what arrives."""
    parts = []
    for piece in work.pieces:
        where = work.region.locate(piece.part)
        if piece.sender == me:
            parts.append((where, piece.holder.locate(piece.part), -1, 0))
        else:
            parts.append((where, piece.part, piece.sender, recv_sizes[piece.sender]))
            recv_sizes[piece.sender] += piece.part.numel
    return Assembly(work.index, work.region, tuple(parts))


def returned_parts(work: Work, rows: list[int]) -> torch.Tensor:
    """Elements of ``work``'s result its member returns to each rank: its own row's parts."""
    row = rows[work.member]
    return torch.tensor([lay.numel if rows[r] == row else 0 for r, lay in enumerate(work.parts)])


def _legs(
    works: list[Work],
    where: _Where,
    to_members: tuple[list[int], list[int]],
    back: tuple[list[int], list[int]],
) -> tuple[tuple[Leg, Leg], tuple[Trip, Trip]]:
    """Both trips as this rank sees them (``(sends, gets)`` of each), and as the cost model does."""
    me, world = where.me, len(where.rows)
    pieces = [[(p.sender, p.part.numel) for p in work.pieces] for work in works]
    parts = [returned_parts(work, where.rows) for work in works]
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
        Leg(tuple(to_members[0]), tuple(to_members[1]), tuple(to_start), trips[0].width),
        Leg(tuple(back[0]), tuple(back[1]), tuple(back_start), trips[1].width),
    )
    return legs, trips
