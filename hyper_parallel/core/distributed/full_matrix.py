"""Run a function on the full matrices behind sharded tensors, the work spread over ranks.

Newton-Schulz needs whole matrices, but FSDP/HSDP hold each param as row
shards (``Shard(0)`` on the shard mesh dim, ``Replicate`` on any replicate
dim). :func:`sharded_full_matrix_map` gives every matrix one *owner* rank,
chosen greedily by cost so the work is balanced over every rank of the mesh
(HSDP replicas split the work instead of repeating it). In each bucket of
bounded size:

1. one ``all_to_all_single`` sends every row shard to its matrix's owner
   (only the owner's replica sends, since replicas hold the same rows);
2. each owner assembles its full matrices and calls ``fn`` once on all of
   them (so same-shape matrices can be batched);
3. a second ``all_to_all_single`` returns each result's rows to every rank
   that holds that shard, in every replica.

Tensors sharded only on batch dims (a stack of expert matrices split on the
expert dim) need no communication: ``fn`` runs on the local shard. Any
other layout (tensor parallel ``Shard(1)``, several shard dims) falls back to
gathering the full tensor on every rank, which is correct but repeats work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FullTensorsFn",
    "assign_owners",
    "replicated_full_matrix_map",
    "row_shard_layout",
    "sharded_full_matrix_map",
]

#: Full-tensor bytes each owner takes per exchange round (bounds its extra memory).
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

#: Maps a list of full (plain) tensors to results of the same shapes.
FullTensorsFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def assign_owners(
    costs: Sequence[float], world_size: int, loads: list[float] | None = None
) -> list[int]:
    """Greedy longest-processing-time assignment: each item to the least-loaded rank.

    Items are taken from the most to the least costly; ties go to the lower
    rank, so every rank computes the same assignment. ``loads`` (one per
    rank) carries the load of earlier buckets and is updated in place.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    current = loads if loads is not None else [0.0] * world_size
    heap = [(load, rank) for rank, load in enumerate(current)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        current[rank] = load + costs[index]
        heapq.heappush(heap, (current[rank], rank))
    return owners


@dataclass(frozen=True)
class _RowLayout:
    """Where the row shards of a ``Shard(0)`` tensor live on its mesh."""

    shard_dim: int  # the mesh dim that splits tensor dim 0
    ranks: torch.Tensor  # global ranks, shape (replicas, shards)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(replica, shard)`` of a global rank."""
        where = (self.ranks == rank).nonzero()
        return int(where[0, 0]), int(where[0, 1])


def row_shard_layout(t: DTensor) -> _RowLayout | None:
    """The layout if ``t`` is row-sharded on one mesh dim and replicated on the others."""
    shard_dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(shard_dims) != 1 or t.placements[shard_dims[0]] != Shard(0):
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
        return None
    mesh_ranks = t.device_mesh.mesh
    shard_dim = shard_dims[0]
    ranks = mesh_ranks.movedim(shard_dim, -1).reshape(-1, mesh_ranks.shape[shard_dim])
    return _RowLayout(shard_dim=shard_dim, ranks=ranks)


def _rows(total: int, shards: int) -> list[int]:
    """Row counts of ``torch.chunk`` (DTensor's ``Shard`` split) of ``total`` rows."""
    size = -(-total // shards) if total else 0
    return [max(0, min(size, total - k * size)) for k in range(shards)]


def _local_fallback(fn: FullTensorsFn, tensors: list[DTensor]) -> list[torch.Tensor]:
    """Gather every full tensor on every rank, apply ``fn``, keep this rank's piece."""
    fulls = [t.full_tensor() for t in tensors]
    results = fn(fulls)
    return [
        distribute_tensor(r.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
        for r, t in zip(results, tensors, strict=True)
    ]


def sharded_full_matrix_map(
    fn: FullTensorsFn,
    tensors: Sequence[torch.Tensor],
    *,
    batch_dims: Sequence[int] | None = None,
    cost: Callable[[torch.Size], float] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "all_to_all",
) -> list[torch.Tensor]:
    """Apply ``fn`` to the full tensor behind each (sharded) tensor.

    Args:
        fn: Takes full plain tensors, returns results of the same shapes
            (any floating dtype; results are cast back to each input's dtype).
        tensors: DTensors (or plain tensors, mapped locally). All ranks must
            pass the same list in the same order.
        batch_dims: Per tensor, how many leading dims ``fn`` treats as
            independent batch dims (0 for a matrix, 1 for an expert stack);
            a tensor sharded only on those dims is mapped locally.
        cost: Work of one tensor from its full shape, for the owner
            assignment (default: element count).
        bucket_bytes: Full-tensor bytes each owner takes per exchange round.
        transport: How shards travel for row-sharded tensors:
            ``"all_to_all"`` (two ``all_to_all_single`` per round, the
            default, faster in ``benchmarks/distributed_muon.py``) or
            ``"gather_broadcast"`` (per tensor, a ``gather`` to the owner in
            its shard group and a ``broadcast`` of the result).

    Returns:
        One result per input, laid out like it (same placements, local shape).
    """
    tensors = list(tensors)
    dims = list(batch_dims) if batch_dims is not None else [0] * len(tensors)
    if len(dims) != len(tensors):
        raise ValueError(f"batch_dims has {len(dims)} entries for {len(tensors)} tensors")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    local: list[int] = []
    fallback: list[int] = []
    rowwise: dict[tuple[DeviceMesh, int], list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            local.append(i)
            continue
        if any(isinstance(p, Partial) for p in t.placements):
            raise ValueError(
                f"Tensor {i} (shape {tuple(t.shape)}) has placements {t.placements}: a Partial "
                "value is not a matrix yet. Reduce it first (redistribute to Replicate or Shard)."
            )
        sharded = [p.dim for p in t.placements if isinstance(p, Shard)]
        if all(d < dims[i] for d in sharded):
            local.append(i)
            continue
        layout = row_shard_layout(t)
        if layout is None or t.device_mesh.size() != dist.get_world_size():
            fallback.append(i)
        else:
            rowwise.setdefault((t.device_mesh, layout.shard_dim), []).append(i)

    if local:
        pieces = [
            t.to_local() if isinstance(t, DTensor) else t for t in (tensors[i] for i in local)
        ]
        for i, piece, result in zip(local, pieces, fn(pieces), strict=True):
            t = tensors[i]
            r = result.to(piece.dtype)
            out[i] = _shard_like(r, t) if isinstance(t, DTensor) else r
    if fallback:
        gathered = _local_fallback(fn, [cast(DTensor, tensors[i]) for i in fallback])
        for i, r in zip(fallback, gathered, strict=True):
            out[i] = r
    for indices in rowwise.values():
        group = [cast(DTensor, tensors[i]) for i in indices]
        if transport == "all_to_all":
            mapped = _row_sharded_map(fn, group, cost, bucket_bytes)
        elif transport == "gather_broadcast":
            mapped = _row_sharded_map_gather(fn, group, cost, bucket_bytes)
        else:
            raise ValueError(
                f"Unknown transport {transport!r}: use 'all_to_all' or 'gather_broadcast'."
            )
        for i, r in zip(indices, mapped, strict=True):
            out[i] = r
    return [r for r in out if r is not None]


def _row_sharded_map(
    fn: FullTensorsFn,
    tensors: list[DTensor],
    cost: Callable[[torch.Size], float] | None,
    bucket_bytes: int,
) -> list[torch.Tensor]:
    """The owner-based path for tensors row-sharded on one mesh dim of a world-sized mesh."""
    layout = row_shard_layout(tensors[0])
    assert layout is not None
    world = dist.get_world_size()
    me = dist.get_rank()
    my_replica, my_shard = layout.coordinates(me)
    shards = layout.ranks.shape[1]
    costs = _costs(tensors, cost)
    results: list[torch.Tensor | None] = [None] * len(tensors)

    for bucket, owners in _rounds(tensors, assign_owners(costs, world), world, bucket_bytes):
        dtype = tensors[bucket[0]].dtype
        # -- send row shards to owners (only the owner's replica sends) ------------
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        recv_sizes = [0] * world
        for i, owner in zip(bucket, owners, strict=True):
            t = tensors[i]
            rows = _rows(t.shape[0], shards)
            row_numel = math.prod(t.shape[1:])
            owner_replica = layout.coordinates(owner)[0]
            if my_replica == owner_replica:
                send_parts[owner].append(t.to_local().reshape(-1))
            if owner == me:
                for k in range(shards):
                    recv_sizes[int(layout.ranks[owner_replica, k])] += rows[k] * row_numel
        device = tensors[bucket[0]].to_local().device
        received = _exchange(send_parts, recv_sizes, dtype, device)
        # -- assemble full tensors on the owner and apply fn ------------------------
        mine = [i for i, owner in zip(bucket, owners, strict=True) if owner == me]
        offsets = [0] * world
        fulls: list[torch.Tensor] = []
        for i in mine:
            t = tensors[i]
            rows = _rows(t.shape[0], shards)
            row_numel = math.prod(t.shape[1:])
            owner_replica = my_replica
            pieces = []
            for k in range(shards):
                src = int(layout.ranks[owner_replica, k])
                n = rows[k] * row_numel
                pieces.append(received[src][offsets[src] : offsets[src] + n])
                offsets[src] += n
            fulls.append(torch.cat(pieces).view(t.shape))
        computed = dict(zip(mine, fn(fulls), strict=True)) if mine else {}
        # -- return each result's rows to every holder of that shard --------------
        send_back: list[list[torch.Tensor]] = [[] for _ in range(world)]
        back_sizes = [0] * world
        for i, owner in zip(bucket, owners, strict=True):
            t = tensors[i]
            rows = _rows(t.shape[0], shards)
            row_numel = math.prod(t.shape[1:])
            if owner == me:
                parts = computed[i].to(dtype).reshape(t.shape[0], -1).split(rows)
                for replica in range(layout.ranks.shape[0]):
                    for k in range(shards):
                        send_back[int(layout.ranks[replica, k])].append(parts[k].reshape(-1))
            back_sizes[owner] += rows[my_shard] * row_numel
        returned = _exchange(send_back, back_sizes, dtype, device)
        offsets = [0] * world
        for i, owner in zip(bucket, owners, strict=True):
            t = tensors[i]
            local_shape = t.to_local().shape
            n = math.prod(local_shape)
            piece = returned[owner][offsets[owner] : offsets[owner] + n].view(local_shape)
            offsets[owner] += n
            results[i] = _shard_like(piece, t)
    return [r for r in results if r is not None]


def _row_sharded_map_gather(
    fn: FullTensorsFn,
    tensors: list[DTensor],
    cost: Callable[[torch.Size], float] | None,
    bucket_bytes: int,
) -> list[torch.Tensor]:
    """The owner-based path with a ``gather`` per tensor and a ``broadcast`` of each result."""
    layout = row_shard_layout(tensors[0])
    assert layout is not None
    mesh = tensors[0].device_mesh
    shard_group = mesh.get_group(layout.shard_dim)
    me = dist.get_rank()
    my_replica, my_shard = layout.coordinates(me)
    shards = layout.ranks.shape[1]
    costs = _costs(tensors, cost)
    owners = assign_owners(costs, dist.get_world_size())
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket, bucket_owners in _rounds(tensors, owners, dist.get_world_size(), bucket_bytes):
        fulls: dict[int, torch.Tensor] = {}
        for i, owner in zip(bucket, bucket_owners, strict=True):
            t = tensors[i]
            owner_replica = layout.coordinates(owner)[0]
            if owner_replica != my_replica:
                continue  # the owner's replica holds the same rows
            rows = _rows(t.shape[0], shards)
            padded = t.to_local().new_zeros((max(rows), *t.shape[1:]))
            padded[: t.to_local().shape[0]] = t.to_local()
            gathered = [torch.empty_like(padded) for _ in range(shards)] if owner == me else None
            dist.gather(padded, gathered, dst=owner, group=shard_group)
            if gathered is not None:
                fulls[i] = torch.cat([g[:n] for g, n in zip(gathered, rows, strict=True)])
        mine = sorted(fulls)
        computed = dict(zip(mine, fn([fulls[i] for i in mine]), strict=True)) if mine else {}
        for i, owner in zip(bucket, bucket_owners, strict=True):
            t = tensors[i]
            local = t.to_local()
            full = computed[i].to(t.dtype).contiguous() if owner == me else local.new_empty(t.shape)
            dist.broadcast(full, src=owner)
            start = sum(_rows(t.shape[0], shards)[:my_shard])
            piece = full[start : start + local.shape[0]].clone()
            results[i] = _shard_like(piece, t)
    return [r for r in results if r is not None]


def _costs(
    tensors: Sequence[torch.Tensor], cost: Callable[[torch.Size], float] | None
) -> list[float]:
    return [float(cost(t.shape)) if cost else float(t.numel()) for t in tensors]


def _shard_like(piece: torch.Tensor, t: DTensor) -> DTensor:
    """``piece`` (this rank's local part) as a DTensor laid out like ``t``."""
    return DTensor.from_local(
        piece, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def _rounds(
    tensors: Sequence[torch.Tensor], owners: Sequence[int], world: int, bucket_bytes: int
) -> list[tuple[list[int], list[int]]]:
    """Split the work into exchange rounds in which every owner has work.

    Each round holds, for every rank, up to ``bucket_bytes`` of the full
    tensors it owns (at least one while it has any left), all of one dtype,
    so all ranks compute in every round and an owner's extra memory stays
    near ``bucket_bytes``. Returns ``(indices, their owners)`` per round.
    """
    rounds: list[tuple[list[int], list[int]]] = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        queues = [
            [i for i, t in enumerate(tensors) if t.dtype == dtype and owners[i] == r]
            for r in range(world)
        ]
        while any(queues):
            indices: list[int] = []
            for queue in queues:
                size = 0
                while queue and (size == 0 or size + _nbytes(tensors[queue[0]]) <= bucket_bytes):
                    size += _nbytes(tensors[queue[0]])
                    indices.append(queue.pop(0))
            indices.sort()
            rounds.append((indices, [owners[i] for i in indices]))
    return rounds


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _exchange(
    parts: list[list[torch.Tensor]], recv_sizes: list[int], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One ``all_to_all_single``: ``parts[r]`` go to rank ``r``; returns what each rank sent here."""
    send_sizes = [sum(p.numel() for p in ps) for ps in parts]
    flat = [p.to(dtype) for ps in parts for p in ps]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    return list(recv.split(recv_sizes))


def replicated_full_matrix_map(
    fn: FullTensorsFn,
    tensors: Sequence[torch.Tensor],
    *,
    cost: Callable[[torch.Size], float] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """``fn`` on whole tensors that every rank of ``group`` holds identically (DDP).

    Each tensor gets one owner rank (balanced by ``cost``); owners compute
    their share and broadcast the results, one broadcast per owner and bucket.
    """
    tensors = list(tensors)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    costs = _costs(tensors, cost)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket, owners in _rounds(tensors, assign_owners(costs, world), world, bucket_bytes):
        mine = [i for i, o in zip(bucket, owners, strict=True) if o == me]
        computed = dict(zip(mine, fn([tensors[i] for i in mine]), strict=True)) if mine else {}
        dtype, device = tensors[bucket[0]].dtype, tensors[bucket[0]].device
        for owner in range(world):
            owned = [i for i, o in zip(bucket, owners, strict=True) if o == owner]
            if not owned:
                continue
            sizes = [tensors[i].numel() for i in owned]
            if owner == me:
                flat = torch.cat([computed[i].to(dtype).reshape(-1) for i in owned])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(
                flat, src=dist.get_global_rank(group, owner) if group else owner, group=group
            )
            for i, piece in zip(owned, flat.split(sizes), strict=True):
                out[i] = piece.view(tensors[i].shape)
    return [r for r in out if r is not None]
