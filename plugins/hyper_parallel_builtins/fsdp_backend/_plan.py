"""Making the exchange plan: who holds, owns, sends and receives what, in which bucket.

It depends only on the params' shapes and placements: made once, with one
collective, and reused every step. What a plan holds, and its printed form:
``fsdp_backend/_plan_types.py``.
"""

from __future__ import annotations

import functools
import math
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
from hyper_parallel_builtins.fsdp_backend._plan_types import (
    BACK,
    OWN,
    SPREAD,
    Assembly,
    Assignment,
    Bucket,
    ExchangePlan,
    Landing,
    Leg,
    Outgoing,
    Piece,
    PlanOptions,
    RegionPiece,
    Replicas,
    Work,
)
from hyper_parallel_builtins.fsdp_backend.cost import (
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
#: overlap cannot hide. A bucket holds at least ``MIN_BUCKET_BYTES`` and at most a
#: quarter of ``DEFAULT_BUCKET_BYTES`` per owner (up to four buckets are in flight at
#: once: ``Exchange.overlapped``).
OVERLAP_BUCKETS = 4

#: Fewest bytes of whole tensors per owner in a bucket (a smaller total is one bucket):
#: each exchange has a fixed cost, which a smaller bucket would pay for too few bytes
#: (measured: docs/benchmarks.md, "The FSDP backend's constants").
MIN_BUCKET_BYTES = 1024 * 1024


# -- the plan ------------------------------------------------------------------------


def _block_shapes(shape: torch.Size, need: Need) -> list[torch.Size]:
    if not isinstance(need, RowBlocks):
        return [shape]
    dim = need.batch_dims
    return [torch.Size((*shape[:dim], h, *shape[dim + 1 :])) for h in need.heights]


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
    moving = _moving(tensors, needs, in_place, cost)
    rows = [0] * dist.get_world_size(group)
    where = _Where(group, column=None, me=dist.get_rank(group), rows=rows, column_rows=())
    if replicas is not None and moving.indices:
        where = _replica_group(replicas, _replica_group_size(replicas, moving, group, options))
        members = dist.get_process_group_ranks(where.group)
        layouts = [[lay[r] for r in members] for lay in layouts]
    size = _team_size(moving, where.group, options)
    mine = tuple(layouts[i][where.me] for i in range(len(tensors)))
    return ExchangePlan(
        group=where.group,
        rank=where.me,
        mine=mine,
        in_place=in_place,
        buckets=_buckets(tensors, moving, layouts, mine, size, where, options),
        team=_team_group(where.group, where.me, size, teams),
        column=where.column,
        shapes=tuple(t.shape for t in tensors),
        team_size=size,
    )


def _moving(
    tensors: list[torch.Tensor],
    needs: list[Need],
    in_place: tuple[int, ...],
    cost: Callable[[torch.Size], float] | None,
) -> _Moving:
    """The tensors that are not in place, with the cost of each one's blocks."""
    indices = [i for i in range(len(tensors)) if i not in in_place]
    measure = cost or (lambda shape: float(math.prod(shape)))
    costs = [sum(measure(s) for s in _block_shapes(tensors[i].shape, needs[i])) for i in indices]
    return _Moving(
        indices=indices,
        tensors=[tensors[i] for i in indices],
        needs=[needs[i] for i in indices],
        costs=costs,
    )


def _buckets(
    tensors: list[torch.Tensor],
    moving: _Moving,
    layouts: list[list[Layout]],
    mine: tuple[Layout, ...],
    size: int,
    where: _Where,
    options: PlanOptions,
) -> tuple[Bucket, ...]:
    """Owners (or teams) for the moving tensors, their works, and the buckets they travel in."""
    owners_count = len(where.rows) // size
    costs = moving.costs
    if size > 1:
        assert options.team is not None
        costs = [options.team.cost(t.shape, size) for t in moving.tensors]
    owners = assign_owners(costs, owners_count, rows=len(set(where.rows)))
    works = [
        _works(i, tensors[i].shape, owner, size, layouts[i], options.team, where.rows)
        for i, owner in zip(moving.indices, owners, strict=True)
    ]
    nbytes = [t.numel() * t.element_size() // size for t in moving.tensors]
    dtypes = [t.dtype for t in moving.tensors]
    per_owner = bucket_bytes(nbytes, owners, owners_count)
    rounds = exchange_rounds(nbytes, dtypes, owners, owners_count, per_owner)
    return tuple(
        _bucket([w for k in round_ for w in works[k]], tensors, mine, where, options)
        for round_ in rounds
    )


@dataclass(frozen=True)
class _Where:
    """This rank among the ranks a plan is made over: its exchange group, column and rank."""

    group: ProcessGroup
    column: ProcessGroup | None  # this rank's replicas in the group; None: one row computes all
    me: int  # this rank in the group
    rows: list[int]  # by rank of the group: its replica row
    column_rows: tuple[int, ...]  # by rank of the column: its replica row


def _replica_group(replicas: Replicas, count: int) -> _Where:
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
    me = dist.get_rank(group)
    return _Where(group=group, column=column, me=me, rows=rows, column_rows=column_rows)


@dataclass(frozen=True)
class _Moving:
    """The tensors a plan sends to owners: their needs and the cost of each one's work."""

    indices: list[int]  # into the plan's tensors
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
        shapes=[t.shape for t in moving.tensors],
        whole_flops=moving.costs,
        team=options.team if moving.whole and auto else None,
        shards=replicas.shards,
        replicas=count,
        profile=device_profile(like.device.type, options.profile),
        node_size=_node_size(group),
        element_size=like.element_size(),
        team_size=1 if auto else int(options.team_size),
    )
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
    regions = _regions(shape, owner, size, team)
    holders: dict[Layout, list[int]] = {}
    for rank, layout in enumerate(layouts):
        if layout.numel:
            holders.setdefault(layout, []).append(rank)
    works = []
    for member, region in regions.items():
        cut = {layout: layout.intersect(region) for layout in dict.fromkeys(layouts)}
        arrivals = []
        for lay, ranks in holders.items():
            if not cut[lay].numel:
                continue
            near = [r for r in ranks if rows[r] == rows[member]] or ranks
            sender = member if layouts[member] == lay else near[index % len(near)]
            arrivals.append(Piece(part=cut[lay], holder=lay, sender=sender))
        held_by = tuple(cut[lay] for lay in layouts)
        works.append(Work(index, member, region, arrivals=tuple(arrivals), held_by=held_by))
    return works


def _regions(
    shape: torch.Size, owner: int, size: int, team: TeamTransform | None
) -> dict[int, Layout]:
    """By member: the whole param for ``owner``, or each team member's band of its split dim."""
    whole = Layout.whole(shape)
    if size == 1:
        return {owner: whole}
    dim = team.split_dim(shape) if team else None
    assert dim is not None
    n = shape[dim]
    return {
        owner * size + k: whole.region(dim, k * n // size, (k + 1) * n // size) for k in range(size)
    }


@dataclass
class _Tally:
    """This rank's lists of one bucket, growing work by work in the bucket's order.

    Both trips and the spread list each rank's data work by work, so each
    part's offset is what was listed for its peer before it.
    """

    where: _Where
    column: dict[int, int]  # by replica row: its rank in this rank's column
    send: list[list[Outgoing]]  # by member: what of this rank's shard goes to it
    sends: list[int]  # by member: elements this rank sends it
    arriving: list[int]  # by rank: elements it sends this rank, to the regions this rank computes
    owned: list[Assembly]
    back: list[list[Outgoing]]  # by rank: what of this rank's results goes back to it
    returning: list[int]  # by member: elements it returns this rank
    land: list[Landing]
    spread: list[int]  # by column rank: elements its row's results give the others

    @classmethod
    def start(cls, where: _Where) -> _Tally:
        world = len(where.rows)
        return cls(
            where=where,
            column={row: k for k, row in enumerate(where.column_rows)},
            send=[[] for _ in range(world)],
            sends=[0] * world,
            arriving=[0] * world,
            owned=[],
            back=[[] for _ in range(world)],
            returning=[0] * world,
            land=[],
            spread=[0] * len(where.column_rows),
        )

    def take(self, work: Work, mine: Layout) -> None:
        """List what this rank does for ``work``: computes, sends, returns and keeps of it."""
        me, rows = self.where.me, self.where.rows
        if work.member == me:
            self.owned.append(_assembly(work, me, self.arriving))
            for rank, part in enumerate(work.held_by):
                if rank != me and part.numel and rows[rank] == rows[me]:
                    self.back[rank].append(Outgoing(work.index, work.region.locate(part)))
        for piece in work.arrivals:
            if piece.sender == me and work.member != me:
                where = piece.holder.locate(piece.part)
                self.send[work.member].append(Outgoing(work.index, where))
                self.sends[work.member] += piece.part.numel
        if work.held_by[me].numel:
            self._land(work, mine)

    def leg_to_members(self, works: list[Work], width: int) -> Leg:
        """The trip to the members as this rank sees it, once every work is taken."""
        starts = _starts_to_members(works, self.where.me, len(self.where.rows))
        return Leg(
            sends=tuple(self.sends), gets=tuple(self.arriving), starts=tuple(starts), width=width
        )

    def leg_back(self, works: list[Work], width: int) -> Leg:
        """The trip back as this rank sees it, once every work is taken."""
        sends = tuple(sum(o.where.numel for o in to) for to in self.back)
        starts = tuple(_starts_back(works, self.where))
        return Leg(sends=sends, gets=tuple(self.returning), starts=starts, width=width)

    def _land(self, work: Work, mine: Layout) -> None:
        """Where this rank's part of ``work``'s result lands, and which trip brings it."""
        me, row = self.where.me, self.where.rows[work.member]
        part = work.held_by[me]
        into = mine.locate(part)
        lands = functools.partial(Landing, index=work.index, into=into)
        if self.column:
            peer = self.column[row]
            elsewhere = row != self.where.rows[me]  # another replica row computed it
            if elsewhere:
                offset = self.spread[peer]
                self.land.append(lands(source=SPREAD, peer=peer, offset=offset, out_of=None))
            self.spread[peer] += part.numel
            if elsewhere:
                return
        if work.member == me:
            out_of = work.region.locate(part)
            self.land.append(lands(source=OWN, peer=me, offset=0, out_of=out_of))
        else:
            member, offset = work.member, self.returning[work.member]
            self.land.append(lands(source=BACK, peer=member, offset=offset, out_of=None))
            self.returning[member] += part.numel


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
    over the column of replicas. ``transport="auto"`` takes the one the cost
    model predicts faster for these trips on this device (every rank
    predicts the same).
    """
    tally = _Tally.start(where)
    for work in works:
        tally.take(work, mine[work.index])
    to_trip, back_trip = _trips(works, where)
    like = tensors[works[0].index]
    transport = options.transport
    if transport == "auto":
        profile = device_profile(like.device.type, options.profile)
        transport = choose_transport([to_trip, back_trip], like.element_size(), profile)
    return Bucket(
        send=tuple(map(tuple, tally.send)),
        owned=tuple(tally.owned),
        back=tuple(map(tuple, tally.back)),
        land=tuple(tally.land),
        to_members=tally.leg_to_members(works, to_trip.width),
        from_members=tally.leg_back(works, back_trip.width),
        transport=transport,
        like=works[0].index,
        empty=tuple(dict.fromkeys(w.index for w in works if not mine[w.index].numel)),
        spread=tuple(tally.spread),
        assigned=_assigned(works),
        element_size=like.element_size(),
    )


def _assigned(works: list[Work]) -> tuple[Assignment, ...]:
    """Each param of the works, in order, and the members that compute it."""
    members: dict[int, list[int]] = {}
    for work in works:
        members.setdefault(work.index, []).append(work.member)
    return tuple(Assignment(index=i, members=tuple(m)) for i, m in members.items())


def _assembly(work: Work, me: int, arriving: list[int]) -> Assembly:
    """Where each piece of ``work``'s region comes from; advances ``arriving`` by what arrives."""
    pieces = []
    for piece in work.arrivals:
        into = work.region.locate(piece.part)
        if piece.sender == me:
            in_shard = piece.holder.locate(piece.part)
            pieces.append(RegionPiece(into=into, sender=me, in_shard=in_shard, offset=0))
        else:
            offset = arriving[piece.sender]
            pieces.append(RegionPiece(into=into, sender=piece.sender, in_shard=None, offset=offset))
            arriving[piece.sender] += piece.part.numel
    return Assembly(index=work.index, region=work.region, pieces=tuple(pieces))


def returned_parts(work: Work, rows: list[int]) -> torch.Tensor:
    """Elements of ``work``'s result its member returns to each rank: its own row's parts."""
    row = rows[work.member]
    return torch.tensor([lay.numel if rows[r] == row else 0 for r, lay in enumerate(work.held_by)])


def _trips(works: list[Work], where: _Where) -> tuple[Trip, Trip]:
    """Both trips of a bucket as the cost model sees them: to the members, and back."""
    items = [
        (
            work.member,
            [(piece.sender, piece.part.numel) for piece in work.arrivals],
            returned_parts(work, where.rows),
        )
        for work in works
    ]
    return exchange_trips(items, len(where.rows))


def _starts_to_members(works: list[Work], me: int, world: int) -> list[int]:
    """Where each rank's pieces for this rank start in its data, for an ``all_gather`` trip.

    A rank's data is its pieces in member order: this rank's start after
    those it sends the lower ranks.
    """
    starts = [0] * world
    for work in works:
        if work.member < me:
            for piece in work.arrivals:
                if piece.sender != work.member:
                    starts[piece.sender] += piece.part.numel
    return starts


def _starts_back(works: list[Work], where: _Where) -> list[int]:
    """Where each member's parts for this rank start in its data, for an ``all_gather`` back.

    A member's data is the parts it returns, in rank order: this rank's
    start after those it returns the lower ranks (not itself).
    """
    me, starts = where.me, [0] * len(where.rows)
    for work in works:
        returned = returned_parts(work, where.rows)
        below = int(returned[:me].sum()) - (int(returned[work.member]) if work.member < me else 0)
        starts[work.member] += below
    return starts
