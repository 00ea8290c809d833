"""The cost model of the owner exchange: bytes and seconds of each transport, from a device profile.

A matrix optimizer's owner exchange (the ``fsdp`` backend) moves each bucket
twice: pieces to their owners, results back. Either trip can travel by

* ``all_to_all``: one ``all_to_all_single``; each rank sends each owner only
  what that owner needs, in one message per peer;
* ``all_gather``: one ``all_gather_single`` of every rank's pieces,
  padded to the longest; every rank receives everything and keeps its part.
  More bytes, but a ring collective: where per-peer messages are costly
  (many ranks, small pieces) it is the faster.

Where whole matrices would leave ranks idle (fewer matrices than ranks), a
matrix can go to a *team* of ranks that share its work
(:class:`~hyper_parallel.core.distributed.TeamTransform`):
:func:`choose_team_size` picks the team size whose busiest team finishes
first, counting each member's FLOPs at the profile's matmul rate and the
team's own collectives (ring all-reduce and all-gather) over the
all-gather link.

A trip is described per rank (:class:`Trip`: elements sent, received,
peers), never as a ranks x ranks matrix. The model is alpha-beta: a collective's seconds are
its latency per message (all-to-all: per peer; all-gather: per ring step)
plus seconds per byte of what the busiest rank moves. The figures come from
a :class:`DeviceProfile`: built in per device type, measured by
``python -m benchmarks.scale --calibrate``, or a JSON file named by
``HYPER_PARALLEL_DEVICE_PROFILE``.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hyper_parallel.core.distributed.toolkit import assign_owners
from hyper_parallel.core.errors import HyperParallelValueError

if TYPE_CHECKING:
    from hyper_parallel.core.distributed import TeamTransform

__all__ = [
    "PROFILE_ENV",
    "TRANSPORTS",
    "DeviceProfile",
    "LinkCost",
    "Trip",
    "choose_replica_group",
    "choose_team_size",
    "choose_transport",
    "device_profile",
    "exchange_trips",
    "named_profile",
    "replica_group_seconds",
    "team_link",
    "team_seconds",
    "transport_bytes",
    "transport_seconds",
]

#: The ways a bucket's trip can travel (see the module docstring).
TRANSPORTS = ("all_to_all", "all_gather")

#: Environment variable naming a JSON device profile (see :meth:`DeviceProfile.from_json`).
PROFILE_ENV = "HYPER_PARALLEL_DEVICE_PROFILE"


@dataclass(frozen=True)
class LinkCost:
    """Seconds of a collective: ``latency_s`` per message or step, ``seconds_per_byte`` moved."""

    latency_s: float
    seconds_per_byte: float

    def seconds(self, messages: int, nbytes: float) -> float:
        return self.latency_s * messages + self.seconds_per_byte * nbytes


@dataclass(frozen=True)
class DeviceProfile:
    """What a device and its links do per second; :mod:`hyper_parallel_builtins.fsdp_backend.cost`.

    Attributes:
        name: What it describes (``"cpu-gloo"``, ``"h100-nvlink"``, ...).
        all_to_all: Latency per peer message and seconds per byte.
        all_gather: Latency per ring step and seconds per byte.
        matmul_flops: Newton-Schulz FLOP/s by dtype name (``"float32"``,
            ``"bfloat16"``), as ``[short side, FLOP/s]`` points: the rate of
            matrices of that short side (interpolated between points). A key
            ``"<dtype>/<method>"`` (``"bfloat16/gram"``) gives the rate of
            one iteration method where it differs from the dtype's.
        memory_bytes_per_s: Bytes per second of element-wise work.
        overhead_per_matrix_s: Fixed seconds per matrix and step on every
            rank (dispatch, slicing, wrapping shards), whatever its size.
        node_link: Latency per ring step and seconds per byte of collectives
            among the ranks of one node (NVLink, HCCS), which a team that
            fits in a node uses; ``None``: the same as ``all_gather``.
        device_memory_bytes: Memory of one device, which the params, their
            gradients and the optimizer state of a rank must fit in;
            ``None``: not stated (nothing is checked).
        source: Where the figures come from (a measurement command, or the
            public documents they are taken from).
    """

    name: str
    all_to_all: LinkCost
    all_gather: LinkCost
    matmul_flops: dict[str, list[list[float]]] = field(default_factory=dict)
    memory_bytes_per_s: float = 1e10
    overhead_per_matrix_s: float = 0.0
    node_link: LinkCost | None = None
    device_memory_bytes: float | None = None
    source: str = ""

    @classmethod
    def from_json(cls, path: str | Path) -> DeviceProfile:
        """Read a profile written by :meth:`to_json` (or by hand: the same keys).

        Raises:
            ValueError: a file that is not such a profile, naming what is wrong.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                name=str(data["name"]),
                all_to_all=LinkCost(**data["all_to_all"]),
                all_gather=LinkCost(**data["all_gather"]),
                matmul_flops={
                    str(k): [[float(x), float(y)] for x, y in v]
                    for k, v in data.get("matmul_flops", {}).items()
                },
                memory_bytes_per_s=float(data.get("memory_bytes_per_s", 1e10)),
                overhead_per_matrix_s=float(data.get("overhead_per_matrix_s", 0.0)),
                node_link=LinkCost(**data["node_link"]) if data.get("node_link") else None,
                device_memory_bytes=(
                    float(data["device_memory_bytes"]) if data.get("device_memory_bytes") else None
                ),
                source=str(data.get("source", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HyperParallelValueError(
                f"device profile {path}: {type(exc).__name__}: {exc}. A profile is JSON with "
                '"name", "all_to_all" and "all_gather" ({"latency_s": ..., "seconds_per_byte": '
                '...}), and optional "matmul_flops", "memory_bytes_per_s", '
                '"overhead_per_matrix_s", "node_link", "device_memory_bytes" and "source".'
            ) from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    def matmul_rate(self, dtype: str, short_side: int, method: str = "standard") -> float:
        """FLOP/s of Newton-Schulz in ``dtype`` on matrices of ``short_side`` (log-interpolated).

        ``method``'s own figures (``"<dtype>/<method>"``) where the profile
        has them, else the dtype's.

        Raises:
            ValueError: the profile has no figure for ``dtype``.
        """
        points = sorted(
            self.matmul_flops.get(f"{dtype}/{method}") or self.matmul_flops.get(dtype, [])
        )
        if not points:
            raise HyperParallelValueError(
                f"device profile {self.name!r} has no matmul_flops for {dtype}; it has "
                f"{sorted(self.matmul_flops) or 'none'}."
            )
        logs = [(math.log(side), rate) for side, rate in points]
        x = min(max(math.log(short_side), logs[0][0]), logs[-1][0])
        for (la, fa), (lb, fb) in itertools.pairwise(logs):
            if x <= lb:
                return fa + (fb - fa) * (x - la) / (lb - la) if lb > la else fa
        return logs[-1][1]

    def link(self, transport: str) -> LinkCost:
        if transport not in TRANSPORTS:
            raise HyperParallelValueError(
                f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}."
            )
        cost: LinkCost = getattr(self, transport)
        return cost


#: The profile of a CPU with gloo, built in: what ``auto`` predicts with when no file is
#: named. Its figures come from ``python -m benchmarks.scale --calibrate`` (measured:
#: docs/benchmarks.md, "The FSDP backend's constants", which names the machine).
_CPU_GLOO = DeviceProfile(
    name="cpu-gloo",
    all_to_all=LinkCost(latency_s=5.9e-4, seconds_per_byte=8.4e-10),
    all_gather=LinkCost(latency_s=4.7e-4, seconds_per_byte=2.0e-9),
    matmul_flops={
        "float32": [[128.0, 4.5e10], [256.0, 5.1e10], [512.0, 5.5e10], [1024.0, 6.5e10]],
        "bfloat16": [[128.0, 5.4e9], [256.0, 8.9e9], [512.0, 9.7e9]],
    },
    memory_bytes_per_s=1.8e10,
    overhead_per_matrix_s=3.8e-4,
    source="python -m benchmarks.scale --calibrate (2 cores, AVX2, gloo over loopback)",
)

_BUILTIN: dict[str, DeviceProfile] = {"cpu": _CPU_GLOO}


def named_profile() -> DeviceProfile | None:
    """The profile the file ``HYPER_PARALLEL_DEVICE_PROFILE`` names, read now; ``None`` if unset.

    The FSDP backend reads it once, when it is made.
    """
    path = os.environ.get(PROFILE_ENV)
    return DeviceProfile.from_json(path) if path else None


def device_profile(
    device_type: str = "cpu", named: DeviceProfile | None = None
) -> DeviceProfile | None:
    """The profile the ``auto`` transport uses: ``named`` (:func:`named_profile`), else built in.

    Returns ``None`` for a device type with no built-in profile and no file
    named (``auto`` then takes ``all_to_all``).
    """
    return named or _BUILTIN.get(device_type)


@dataclass(frozen=True)
class Trip:
    """One trip of a bucket: per rank, the elements it sends and receives, and its peers.

    ``sent``, ``received`` and ``peers`` are int64 tensors with one entry per
    rank. Built by :func:`exchange_trips` (or :meth:`from_sizes` for a
    small world) in ``O(items x world)``, never ``world x world``.
    """

    sent: torch.Tensor
    received: torch.Tensor
    peers: torch.Tensor

    @classmethod
    def from_sizes(cls, sizes: Sequence[Sequence[int]]) -> Trip:
        """The trip of a size matrix: ``sizes[q][o]`` elements from rank ``q`` to rank ``o``."""
        m = torch.tensor(sizes, dtype=torch.int64).reshape(len(sizes), len(sizes))
        m.fill_diagonal_(0)
        talks = (m > 0) | (m.T > 0)
        return cls(m.sum(1), m.sum(0), talks.sum(1))

    @property
    def world(self) -> int:
        return int(self.sent.numel())

    @property
    def width(self) -> int:
        """Elements every rank contributes to an ``all_gather`` trip: the longest rank's."""
        return int(self.sent.max()) if self.world else 0


def exchange_trips(
    items: Sequence[tuple[int, Sequence[tuple[int, int]], torch.Tensor]], world: int
) -> tuple[Trip, Trip]:
    """The two trips of one bucket of the owner exchange.

    Args:
        items: Per matrix, ``(owner, pieces, parts)``: ``pieces`` are the
            ``(sender, elements)`` of each distinct piece sent to the owner,
            ``parts`` (int64, one per rank) each rank's elements of the
            result, returned by the owner.
        world: Ranks of the exchange.

    Returns:
        The trip to the owners and the trip back. Peers of the trip back: an
        owner's are the ranks it returns a part to, anyone else's the owners
        that return one to it (the larger where a rank is both).
    """
    zeros = torch.zeros(world, dtype=torch.int64)
    to_sent, to_received, back_sent = [0] * world, [0] * world, [0] * world
    back_received = zeros.clone()
    pairs: set[tuple[int, int]] = set()
    targets: dict[int, torch.Tensor] = {}
    for owner, pieces, parts in items:
        for sender, elements in pieces:
            if sender != owner and elements:
                to_sent[sender] += elements
                to_received[owner] += elements
                pairs.update(((sender, owner), (owner, sender)))
        others = parts.clone()
        others[owner] = 0
        back_received += others
        back_sent[owner] += int(others.sum())
        targets[owner] = targets.get(owner, zeros > 0) | (others > 0)
    to_peers = collections.Counter(rank for rank, _ in pairs)
    sources, reach = zeros.clone(), zeros.clone()
    for owner, mask in targets.items():
        sources += mask.long()
        reach[owner] = int(mask.sum())
    to_owners = Trip(
        sent=torch.tensor(to_sent),
        received=torch.tensor(to_received),
        peers=torch.tensor([to_peers[r] for r in range(world)], dtype=torch.int64),
    )
    back = Trip(
        sent=torch.tensor(back_sent),
        received=back_received,
        peers=torch.maximum(reach, sources),
    )
    return to_owners, back


def transport_bytes(trip: Trip, element_size: int, transport: str) -> list[tuple[int, int]]:
    """Per rank, the bytes it hands the trip's collective and the bytes it gets from others.

    ``all_to_all``: what it sends its peers, what its peers send it.
    ``all_gather``: its padded contribution, and every other rank's.
    """
    if transport == "all_to_all":
        return [
            (s * element_size, r * element_size)
            for s, r in zip(trip.sent.tolist(), trip.received.tolist(), strict=True)
        ]
    padded = trip.width * element_size
    return [(padded, padded * (trip.world - 1))] * trip.world


def transport_seconds(
    trip: Trip, element_size: int, transport: str, profile: DeviceProfile
) -> float:
    """Predicted seconds of one trip: the busiest rank's latency plus its bytes over the link."""
    link = profile.link(transport)
    if trip.world < 2:
        return 0.0
    if transport == "all_gather":
        return link.seconds(trip.world - 1, (trip.world - 1) * trip.width * element_size)
    moved = torch.maximum(trip.sent, trip.received).double() * element_size
    seconds = link.latency_s * trip.peers.double() + link.seconds_per_byte * moved
    return float(seconds.max())


def choose_transport(
    trips: Sequence[Trip], element_size: int, profile: DeviceProfile | None
) -> str:
    """The transport with the fewer predicted seconds over ``trips`` (``all_to_all`` on a tie).

    Without a profile: ``all_to_all``.
    """
    if profile is None:
        return "all_to_all"
    seconds = {
        t: sum(transport_seconds(s, element_size, t, profile) for s in trips) for t in TRANSPORTS
    }
    return min(TRANSPORTS, key=lambda t: (seconds[t], TRANSPORTS.index(t)))


#: A team size is taken only where its busiest team is predicted this much faster
#: than the best smaller size's (the model leaves out each collective's launch).
TEAM_MIN_GAIN = 0.1


def team_seconds(
    flops: float,
    collectives: Sequence[tuple[str, int]],
    members: int,
    element_size: int,
    rate: float,
    link: LinkCost,
) -> float:
    """Predicted seconds of one member's share of a team's block.

    Its FLOPs at ``rate``, plus each collective as a ring over ``members``
    on ``link``: an all-gather of ``n`` elements is ``members - 1`` steps
    moving ``(members - 1) / members * n``, an all-reduce twice that.
    """
    seconds = flops / rate
    if members < 2:
        return seconds
    for kind, elements in collectives:
        steps = (members - 1) * (2 if kind == "all_reduce" else 1)
        seconds += link.seconds(steps, steps / members * elements * element_size)
    return seconds


def choose_team_size(
    shapes: Sequence[torch.Size],
    whole_flops: Sequence[float],
    team: TeamTransform | None,
    world: int,
    profile: DeviceProfile | None,
    node_size: int | None = None,
) -> int:
    """How many ranks share each matrix: ``1`` (one owner each) or a divisor of ``world``.

    For each size, matrices go to teams of consecutive ranks by LPT (as
    owners do), and the busiest team's predicted seconds
    (:func:`team_seconds`) decide; a larger size must beat the best so far
    by :data:`TEAM_MIN_GAIN`. A team within one node (``node_size``
    consecutive ranks; default all of ``world``) talks over the profile's
    ``node_link``, a larger one over ``all_gather``'s. ``1`` where there is
    nothing to decide by: no profile, no matmul rate for the team's dtype in
    it, no ``team``, or a matrix the team cannot split.
    """
    return _team_choice(shapes, whole_flops, team, world, profile, node_size)[0]


def _team_choice(
    shapes: Sequence[torch.Size],
    whole_flops: Sequence[float],
    team: TeamTransform | None,
    world: int,
    profile: DeviceProfile | None,
    node_size: int | None,
) -> tuple[int, float]:
    """:func:`choose_team_size`'s size and its busiest team's seconds (0 where nothing decides)."""
    dtype = _work_dtype(team)
    if profile is None or team is None or world < 2 or not shapes:
        return 1, 0.0
    dims = [team.split_dim(s) for s in shapes]
    if any(d is None for d in dims) or not profile.matmul_flops.get(dtype):
        return 1, 0.0
    rates = [profile.matmul_rate(dtype, min(s[-2:])) for s in shapes]
    whole = _owner_seconds(shapes, whole_flops, profile, dtype)
    best, best_seconds = 1, _busiest(whole, world)
    smallest = min(s[d] for s, d in zip(shapes, dims, strict=True) if d is not None)
    element_size = torch.empty(0, dtype=team.dtype).element_size()
    for size in range(2, min(world, smallest) + 1):
        if world % size:
            continue
        link = team_link(profile, size, node_size or world)
        # Models repeat a few shapes thousands of times (layers, experts): one answer per shape.
        per_shape = {
            (s, r): team_seconds(
                team.cost(s, size), team.collectives(s, size), size, element_size, r, link
            )
            for s, r in dict.fromkeys(zip(shapes, rates, strict=True))
        }
        seconds = [per_shape[key] for key in zip(shapes, rates, strict=True)]
        busiest = _busiest(seconds, world // size)
        if busiest < (1 - TEAM_MIN_GAIN) * best_seconds:
            best, best_seconds = size, busiest
    return best, best_seconds


def replica_group_seconds(
    shapes: Sequence[torch.Size],
    whole_flops: Sequence[float],
    team: TeamTransform | None,
    shards: int,
    replicas: int,
    profile: DeviceProfile,
    node_size: int | None = None,
    element_size: int = 4,
) -> float:
    """Predicted seconds of the exchange and transform when groups of ``replicas`` share the work.

    A group of ``replicas`` rows of ``shards`` ranks gives each matrix to
    one owner (or team, :func:`choose_team_size`) among its ranks, by LPT
    as the plan does. The busiest row decides the bytes: each of its ranks
    sends its shard of the row's matrices and gets its part back
    (``all_to_all``), then the rows all-gather their results over a ring of
    ``replicas`` ranks, each contribution padded to the busiest row's
    (``all_gather``'s link). More replicas per group: fewer FLOPs per rank,
    until rows outnumber the matrices and the padding grows the bytes.
    """
    world = replicas * shards
    size, busiest = _team_choice(shapes, whole_flops, team, world, profile, node_size)
    seconds = _owner_seconds(shapes, whole_flops, profile, _work_dtype(team))
    costs = [team.cost(s, size) for s in shapes] if team and size > 1 else seconds
    rows = [0.0] * replicas
    owners = assign_owners(costs, world // size, rows=replicas)
    for shape, owner in zip(shapes, owners, strict=True):
        rows[owner * size // shards] += shape.numel()
    share = max(rows) / shards * element_size  # a rank's part of its row's matrices
    busiest = busiest or _busiest(seconds, world)
    trips = 2 * profile.all_to_all.seconds(shards - 1, share) if shards > 1 else 0.0
    return busiest + trips + profile.all_gather.seconds(replicas - 1, (replicas - 1) * share)


def choose_replica_group(
    shapes: Sequence[torch.Size],
    whole_flops: Sequence[float],
    team: TeamTransform | None,
    shards: int,
    replicas: int,
    profile: DeviceProfile | None,
    node_size: int | None = None,
    element_size: int = 4,
    team_size: int = 1,
) -> int:
    """How many replicas share each matrix's work: a divisor of ``replicas``.

    The one with the fewest :func:`replica_group_seconds` (the smaller on a
    tie), among those whose ranks a fixed ``team_size`` divides. Without a
    profile, or without a matmul rate for the work's dtype in it:
    ``replicas`` (every replica shares the work once).
    """
    dtype = _work_dtype(team)
    if profile is None or not profile.matmul_flops.get(dtype) or not shapes or replicas < 2:
        return replicas
    sizes = [g for g in range(1, replicas + 1) if replicas % g == 0 and g * shards % team_size == 0]
    if not sizes:
        return replicas
    seconds = {
        g: replica_group_seconds(
            shapes=shapes,
            whole_flops=whole_flops,
            team=team,
            shards=shards,
            replicas=g,
            profile=profile,
            node_size=node_size,
            element_size=element_size,
        )
        for g in sizes
    }
    return min(sizes, key=lambda g: (seconds[g], g))


def _work_dtype(team: TeamTransform | None) -> str:
    """The profile's key for the work's matmul rate: the team's dtype, else ``float32``."""
    return str(team.dtype).removeprefix("torch.") if team else "float32"


def _owner_seconds(
    shapes: Sequence[torch.Size], flops: Sequence[float], profile: DeviceProfile, dtype: str
) -> list[float]:
    """Each matrix's seconds on one owner at ``profile``'s rate for its short side."""
    return [f / profile.matmul_rate(dtype, min(s[-2:])) for s, f in zip(shapes, flops, strict=True)]


def team_link(profile: DeviceProfile, size: int, node_size: int) -> LinkCost:
    """The link a team of ``size`` consecutive ranks talks over: the node's if it fits in one."""
    fits = size <= node_size and node_size % size == 0
    return profile.node_link if fits and profile.node_link else profile.all_gather


def _busiest(seconds: Sequence[float], bins: int) -> float:
    """The largest load when ``seconds`` go to ``bins`` by :func:`assign_owners`."""
    loads = [0.0] * bins
    assign_owners(seconds, bins, loads)
    return max(loads)
