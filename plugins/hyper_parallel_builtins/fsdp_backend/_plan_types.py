"""The exchange plan's data: its options, and what each rank sends, computes and keeps.

:func:`~hyper_parallel_builtins.fsdp_backend._plan.make_plan` makes an
:class:`ExchangePlan` once per param list; ``Exchange``
(``fsdp_backend/_exchange.py``) runs it every step. ``print(plan)`` shows it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed.toolkit import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hyper_parallel.core.distributed import TeamTransform
    from hyper_parallel_builtins.fsdp_backend.cost import DeviceProfile


@dataclass(frozen=True)
class PlanOptions:
    """How a plan is made: the transport, the team size, and the team transform."""

    transport: str
    team_size: int | str
    team: TeamTransform | None
    team_size_origin: str = "team_size"  # or the environment variable it came from
    profile: DeviceProfile | None = None  # the file HYPER_PARALLEL_DEVICE_PROFILE named, if any


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


@dataclass(frozen=True)
class Piece:
    """The part of a work's region that one distinct holder layout covers, and who sends it."""

    part: Layout  # global indices, in the holder's order
    holder: Layout  # the holder's layout
    sender: int  # the member itself where it holds it, else a holder in the member's row


@dataclass(frozen=True)
class Work:
    """One rank's share of one param's transform: all of it (its owner) or a slice (a team member)."""

    index: int  # into the mesh's tensors
    member: int  # rank in the exchange group that computes it
    region: Layout  # the indices it computes
    arrivals: tuple[Piece, ...]  # what the member gathers: each distinct piece, and its sender
    held_by: tuple[Layout, ...]  # by rank: what of the region that rank holds, and gets back


@dataclass(frozen=True)
class RegionPiece:
    """One piece of a region this rank computes: where it goes, and where its data is."""

    into: Layout  # where in the region
    sender: int  # the rank that sends it; this rank where it is in its own shard
    in_shard: Layout | None  # in this rank's shard: where; None: it arrives from the sender
    offset: int  # arriving: where it starts in what the sender sends this rank


@dataclass(frozen=True)
class Assembly:
    """How this rank builds the region of one param it computes, from its shard and what arrives."""

    index: int
    region: Layout
    pieces: tuple[RegionPiece, ...]


class Source(enum.Enum):
    """Where a :class:`Landing`'s data comes from."""

    OWN = enum.auto()  # this rank computed it: a part of its own result
    BACK = enum.auto()  # the trip back, from the member of this rank's replica row that computed it
    SPREAD = enum.auto()  # the spread over the column of replicas, from the row that computed it


#: :class:`Source`'s members by their own names.
OWN, BACK, SPREAD = Source.OWN, Source.BACK, Source.SPREAD


@dataclass(frozen=True)
class Landing:
    """Where one part of a result lands in this rank's shard, and where it comes from."""

    index: int
    into: Layout  # where in this rank's shard
    source: Source
    peer: int  # BACK: the member that computed it; SPREAD: the column rank whose row did
    offset: int  # into what that peer sends here
    out_of: Layout | None  # OWN: where in this rank's own result


@dataclass(frozen=True)
class Outgoing:
    """A part of one param this rank sends a peer: the param, and where in this rank's data."""

    index: int
    where: Layout  # in this rank's shard (to a member) or in its result (back)


@dataclass(frozen=True)
class Leg:
    """One trip of a bucket as this rank sees it."""

    sends: tuple[int, ...]  # elements this rank sends each rank
    gets: tuple[int, ...]  # elements each rank sends this rank
    starts: tuple[int, ...]  # all_gather: where each rank's part for this one starts in its data
    width: int  # all_gather: every rank's contribution, padded to the longest

    def bytes_sent(self, transport: str, element_size: int) -> int:
        """What this rank hands the trip's collective: its parts, or its padded contribution."""
        elements = self.width if transport == "all_gather" else sum(self.sends)
        return elements * element_size

    def bytes_received(self, transport: str, element_size: int) -> int:
        """What this rank gets from the others: their parts for it, or all their contributions."""
        others = self.width * (len(self.gets) - 1)
        return (others if transport == "all_gather" else sum(self.gets)) * element_size


@dataclass(frozen=True)
class Assignment:
    """Who computes one param of a bucket: its owner, or its team's members in region order."""

    index: int
    members: tuple[int, ...]  # ranks of the exchange group


@dataclass(frozen=True)
class Bucket:
    """What this rank sends, receives, transforms and gets back for one bucket of params."""

    send: tuple[tuple[Outgoing, ...], ...]  # by member: what of this rank's shard goes to it
    owned: tuple[Assembly, ...]  # the regions this rank computes in the bucket
    back: tuple[tuple[Outgoing, ...], ...]  # by rank: what of this rank's results goes back to it
    land: tuple[Landing, ...]
    to_members: Leg  # the trip of the pieces to the members that compute them
    from_members: Leg  # the trip of the results back
    transport: str  # how both trips travel (hyper_parallel_builtins.fsdp_backend.cost)
    like: int  # the index of a param in the bucket (dtype and device of the buffers)
    empty: tuple[int, ...]  # the params of the bucket this rank holds nothing of
    spread: tuple[int, ...]  # by column rank: elements its row's results give the others
    assigned: tuple[Assignment, ...]  # the bucket's params and who computes each
    element_size: int  # bytes per element of the bucket's params (one dtype)


@dataclass(frozen=True)
class ExchangePlan:
    """What every rank of one mesh does with that mesh's params; ``str(plan)`` describes it."""

    group: ProcessGroup
    rank: int
    mine: tuple[Layout, ...]  # this rank's layout of each tensor
    in_place: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    team: ProcessGroup | None  # this rank's team, where matrices are shared by teams
    column: ProcessGroup | None  # this rank's replicas in its group, where rows share the work
    shapes: tuple[torch.Size, ...]  # each tensor's global shape
    team_size: int  # ranks that share each exchanged param (1: one owner each)

    def describe(self) -> str:
        """The plan in a few lines per bucket: its params by owner or team, its bytes, its transport.

        A param is ``#index (shape)``, its index into the plan's tensors. Ranks
        are the exchange group's (the header lists their global ranks where
        they differ); bytes are this rank's, as the bucket's transport moves them.
        """
        ranks = dist.get_process_group_ranks(self.group)
        world = f"{len(ranks)}" + ("" if ranks == list(range(len(ranks))) else f" {ranks}")
        count = len(self.buckets)
        moving = sum(len(b.assigned) for b in self.buckets)
        share = "one owner each" if self.team_size == 1 else f"teams of {self.team_size}"
        held = ", ".join(self._param(i) for i in self.in_place) or "none"
        lines = [
            f"ExchangePlan for rank {self.rank} of {world}: {len(self.shapes)} params, "
            f"{moving} exchanged in {count} bucket{'s' * (count != 1)} ({share}); "
            f"in place: {held}"
        ]
        for number, bucket in enumerate(self.buckets):
            lines += self._bucket_lines(number, bucket)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def _param(self, index: int) -> str:
        return f"#{index} {tuple(self.shapes[index])}"

    def _bucket_lines(self, number: int, bucket: Bucket) -> list[str]:
        """One line for the bucket's transport and bytes, one per owner or team of its params."""
        how, size = bucket.transport, bucket.element_size
        lines = [
            f"  bucket {number}, {how}: to the members sends "
            f"{_nbytes(bucket.to_members.bytes_sent(how, size))}, receives "
            f"{_nbytes(bucket.to_members.bytes_received(how, size))}; back sends "
            f"{_nbytes(bucket.from_members.bytes_sent(how, size))}, receives "
            f"{_nbytes(bucket.from_members.bytes_received(how, size))}" + _spread_bytes(bucket)
        ]
        computes: dict[tuple[int, ...], list[int]] = {}
        for assignment in bucket.assigned:
            computes.setdefault(assignment.members, []).append(assignment.index)
        for members, indices in computes.items():
            first, last = members[0], members[-1]
            who = f"rank {first} owns" if len(members) == 1 else f"ranks {first}-{last} share"
            lines.append(f"    {who} {', '.join(self._param(i) for i in indices)}")
        return lines


def _nbytes(n: int) -> str:
    """``n`` bytes, in B, KiB or MiB."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


def _spread_bytes(bucket: Bucket) -> str:
    """The spread's all-gather over the column of replicas, where rows share the work."""
    if not any(bucket.spread):
        return ""
    width = max(bucket.spread) * bucket.element_size
    others = width * (len(bucket.spread) - 1)
    return f"; spread sends {_nbytes(width)}, receives {_nbytes(others)}"
