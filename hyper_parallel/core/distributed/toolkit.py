"""The parts sharding backends are built from: layouts, blocks, owners, rounds, collectives.

A backend plugin (built-in or third party) answers two requests of a matrix
optimizer (see :class:`~hyper_parallel.core.distributed.ShardingBackend`):
run a function on whole blocks of each param, and sum along rows and
columns. Everything here is layout arithmetic or one collective, so a
backend's own module holds only its strategy:

* :class:`Layout`: the index runs of each tensor dim a rank holds, for any
  DTensor placement (``Shard``, FSDP+TP's strided shards, ``Replicate``);
  :func:`gather_layouts` learns every rank's in one collective.
* :func:`blocks_in_place`, :func:`split_blocks`, :func:`join_blocks`,
  :func:`map_held_blocks`: which blocks a layout already holds whole,
  cutting a tensor into the blocks a
  :data:`~hyper_parallel.core.distributed.Need` names, and one transform
  call over all of them.
* :func:`assign_owners` and :func:`exchange_rounds`: one owner per matrix,
  balanced by cost, in rounds of bounded size.
* :class:`AsyncExchange` and :func:`exchange_group`: the transport.
* :class:`Reducer`: row and column sums completed over exactly the ranks that
  hold the rest of each row or column.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed._dtensor import (
    is_dtensor,
    local_indices,
    local_tensor,
    shard_like,
    split_dim,
)
from hyper_parallel.core.distributed._needs import Need, RowBlocks
from hyper_parallel.core.errors import HyperParallelValueError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AsyncExchange",
    "Blocks",
    "Layout",
    "Reducer",
    "assign_owners",
    "blocks_in_place",
    "check_not_partial",
    "exchange_group",
    "exchange_rounds",
    "gather_layouts",
    "is_dtensor",
    "join_blocks",
    "local_layout",
    "local_tensor",
    "map_held_blocks",
    "shard_like",
    "split_blocks",
]

#: Full-tensor bytes each owner takes per exchange round (bounds its extra memory).
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

Run = tuple[int, int]  # [start, stop) of global indices, in the order the shard holds them


# -- layouts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The part of a tensor one rank holds: per dim, runs of consecutive global indices.

    The rank's local tensor is the product of the runs, in order: for a 2-D
    tensor with row runs ``R`` and column runs ``C`` it is
    ``cat([cat([full[r0:r1, c0:c1] for c in C], 1) for r in R], 0)``. Plain
    tensors and ``Shard`` hold one run per dim; a strided shard may hold more.
    """

    runs: tuple[tuple[Run, ...], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Layout:
        """The layout of a rank that holds all of a tensor of ``shape``."""
        return cls(tuple(((0, n),) for n in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """The local tensor's shape."""
        return tuple(sum(b - a for a, b in dim) for dim in self.runs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def holds_whole(self, dim: int, size: int) -> bool:
        """Whether every index of ``dim`` (of ``size``) is here."""
        return self.runs[dim] == ((0, size),) or size == 0

    def _pieces(self) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """``(global slices, local slices)`` for each product of runs."""
        per_dim: list[list[tuple[slice, slice]]] = []
        for dim in self.runs:
            offset, pairs = 0, []
            for a, b in dim:
                pairs.append((slice(a, b), slice(offset, offset + b - a)))
                offset += b - a
            per_dim.append(pairs)
        return [
            (tuple(g for g, _ in combo), tuple(loc for _, loc in combo))
            for combo in itertools.product(*per_dim)
        ]

    def region(self, dim: int, start: int, stop: int) -> Layout:
        """This layout cut to indices ``[start, stop)`` of ``dim`` (a team member's share)."""
        runs = list(self.runs)
        runs[dim] = ((start, stop),)
        return self.intersect(Layout(tuple(runs)))

    def intersect(self, other: Layout) -> Layout:
        """The indices both hold, in this layout's order (empty runs where nothing is shared)."""
        return Layout(
            tuple(
                tuple(
                    (max(a, c), min(b, d))
                    for a, b in mine
                    for c, d in theirs
                    if max(a, c) < min(b, d)
                )
                for mine, theirs in zip(self.runs, other.runs, strict=True)
            )
        )

    def locate(self, sub: Layout) -> Layout:
        """Where ``sub``'s indices sit in this layout's local tensor, as a layout of that tensor.

        ``sub`` holds a subset of this layout's indices, each of its runs
        inside one of this layout's runs (as :meth:`intersect` makes them);
        ``self.locate(sub).take(local)`` is ``sub``'s local tensor.
        """
        located = []
        for mine, theirs in zip(self.runs, sub.runs, strict=True):
            starts = list(itertools.accumulate((b - a for a, b in mine), initial=0))
            dim = []
            for c, d in theirs:
                k = next(k for k, (a, b) in enumerate(mine) if a <= c and d <= b)
                offset = starts[k] - mine[k][0]
                dim.append((c + offset, d + offset))
            located.append(tuple(dim))
        return Layout(tuple(located))

    def copy_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` (this layout's tensor) into its place in ``full``."""
        for where, here in self._pieces():
            full[where] = local[here]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This layout's part of ``full``, as a new contiguous tensor."""
        pieces = self._pieces()
        if len(pieces) == 1:
            return full[pieces[0][0]].contiguous()
        out = full.new_empty(self.shape)
        for where, here in pieces:
            out[here] = full[where]
        return out


def _runs(indices: torch.Tensor) -> tuple[Run, ...]:
    values = indices.tolist()
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1][1] = v + 1
        else:
            runs.append([v, v + 1])
    return tuple((a, b) for a, b in runs)


def local_layout(t: torch.Tensor) -> Layout:
    """The layout of this rank's part of ``t`` (whole for plain tensors)."""
    if not is_dtensor(t):
        return Layout.whole(t.shape)
    split = {split_dim(p) for p in t.placements}  # type: ignore[attr-defined]
    return Layout(
        tuple(
            _runs(local_indices(t, d)) if d in split else ((0, n),)  # type: ignore[arg-type]
            for d, n in enumerate(t.shape)
        )
    )


def gather_layouts(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> list[list[Layout]]:
    """Every rank's layout of each tensor: ``[tensor][rank in group]``. One collective."""
    mine = [local_layout(t) for t in tensors]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [[everyone[r][i] for r in range(len(everyone))] for i in range(len(tensors))]


def check_not_partial(t: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``ValueError`` if ``t`` is a DTensor holding unreduced (``Partial``) values."""
    if is_dtensor(t) and any(p.is_partial() for p in t.placements):  # type: ignore[attr-defined]
        raise HyperParallelValueError(
            f"A {what} of shape {tuple(t.shape)} has placements {t.placements}: a Partial "  # type: ignore[attr-defined]
            "value is not a matrix yet. Reduce it first (redistribute to Replicate or Shard)."
        )


# -- blocks --------------------------------------------------------------------------


def _starts(need: RowBlocks) -> dict[int, int]:
    """Each block's first row (along the block dim) -> its height."""
    return dict(zip(itertools.accumulate((0, *need.heights)), need.heights, strict=False))


def blocks_in_place(need: Need, shape: Sequence[int], layouts: Sequence[Layout]) -> bool:
    """Whether every rank of ``layouts`` holds whole blocks, so no rank needs another's data.

    Batch dims may be split any way; the dims after the block dim must be
    whole; the block dim may be split only at block boundaries.
    """
    dim = need.batch_dims
    bounds = set(_starts(need)) | {shape[dim]} if isinstance(need, RowBlocks) else {0, shape[dim]}
    for layout in layouts:
        if not all(layout.holds_whole(d, shape[d]) for d in range(dim + 1, len(shape))):
            return False
        if not all(a in bounds and b in bounds for a, b in layout.runs[dim]):
            return False
    return True


def split_blocks(local: torch.Tensor, layout: Layout, need: Need) -> list[torch.Tensor]:
    """The whole blocks in ``local`` (laid out as ``layout``), as views, in order.

    The layout must hold whole blocks (:func:`blocks_in_place`).
    """
    if not isinstance(need, RowBlocks):
        return [local]
    dim, heights = need.batch_dims, _starts(need)
    blocks, offset = [], 0
    for a, b in layout.runs[dim]:
        start = a
        while start < b:
            h = heights[start]
            blocks.append(local.narrow(dim, offset, h))
            offset, start = offset + h, start + h
    return blocks


def join_blocks(results: Sequence[torch.Tensor], need: Need) -> torch.Tensor:
    """The inverse of :func:`split_blocks`: the blocks' results as one tensor."""
    if len(results) == 1:
        return results[0]
    return torch.cat(list(results), dim=need.batch_dims)


class Blocks(list):  # type: ignore[type-arg]
    """The whole blocks a :data:`BlocksFn` is called with: a list, plus each block's key.

    ``keys[i]`` is the ``key`` of the :data:`Need` of the param that block
    ``i`` belongs to (the blocks of one param share it). A transform that
    needs no keys reads it as a plain list.
    """

    def __init__(self, blocks: Iterable[torch.Tensor] = (), keys: Iterable[Hashable] = ()) -> None:
        super().__init__(blocks)
        self.keys: tuple[Hashable, ...] = tuple(keys)
        if len(self.keys) != len(self):
            raise HyperParallelValueError(
                f"Blocks got {len(self)} blocks but {len(self.keys)} keys; give one key per block."
            )


def map_held_blocks(
    fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    tensors: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    needs: Sequence[Need],
) -> list[torch.Tensor]:
    """``fn`` once on all the whole blocks these tensors hold; each result joined and cast back.

    ``fn`` gets them as :class:`Blocks`, each with its need's ``key``.

    ``tensors`` are plain (local) tensors, each laid out as its layout, which
    holds whole blocks (:func:`blocks_in_place`).
    """
    split = [split_blocks(t, lay, n) for t, lay, n in zip(tensors, layouts, needs, strict=True)]
    if not split:
        return []
    keyed = Blocks(
        [b for blocks in split for b in blocks],
        [n.key for n, blocks in zip(needs, split, strict=True) for _ in blocks],
    )
    results = iter(fn(keyed))
    return [
        join_blocks([next(results) for _ in blocks], n).to(t.dtype)
        for t, n, blocks in zip(tensors, needs, split, strict=True)
    ]


# -- owners and rounds ---------------------------------------------------------------


def assign_owners(
    costs: Sequence[float], world_size: int, loads: list[float] | None = None, rows: int = 1
) -> list[int]:
    """Greedy longest-processing-time assignment: each item to the least-loaded rank.

    Items are taken from the most to the least costly; ties go to the lower
    rank, so every rank computes the same assignment. ``loads`` (one per
    rank) carries the load of earlier calls and is updated in place.

    ``rows``: the ranks are that many rows of consecutive ranks, and ties go
    round the rows first (rank 0, then the first of row 1, ...), so each
    row gets a like mix of large and small items. Rows that do not divide
    ``world_size`` are one row. Not with ``loads``.
    """
    if world_size < 1:
        raise HyperParallelValueError(f"world_size must be >= 1, got {world_size}")
    if rows > 1 and loads is not None:
        raise HyperParallelValueError("assign_owners takes rows or loads, not both")
    rows = rows if world_size % rows == 0 else 1
    current = loads if loads is not None else [0.0] * world_size
    heap = [(load, rank) for rank, load in enumerate(current)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        current[rank] = load + costs[index]
        heapq.heappush(heap, (current[rank], rank))
    per_row = world_size // rows
    return [b % rows * per_row + b // rows for b in owners]


def exchange_rounds(
    nbytes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    owners: Sequence[int],
    world_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[list[int]]:
    """Split owned items into exchange rounds in which every owner has work.

    Each round holds, for every rank, up to ``bucket_bytes`` of the items it
    owns (at least one while it has any left), all of one dtype, so all ranks
    compute in every round and an owner's extra memory stays near
    ``bucket_bytes``. Returns each round's item indices, ascending.
    """
    rounds: list[list[int]] = []
    for dtype in dict.fromkeys(dtypes):
        queues = [
            [i for i in range(len(owners)) if dtypes[i] == dtype and owners[i] == r]
            for r in range(world_size)
        ]
        while any(queues):
            indices: list[int] = []
            for queue in queues:
                size = 0
                while queue and (size == 0 or size + nbytes[queue[0]] <= bucket_bytes):
                    size += nbytes[queue[0]]
                    indices.append(queue.pop(0))
            rounds.append(sorted(indices))
    return rounds


# -- transport -----------------------------------------------------------------------


def exchange_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group joining every rank of ``mesh``.

    The default group when the mesh spans the world, the mesh's own group
    when it is 1-D.

    Raises:
        ValueError: a mesh of several dims that spans part of the world (no
            single group joins its ranks).
    """
    if mesh.size() == dist.get_world_size():
        group = dist.group.WORLD
        assert group is not None
        return group
    if mesh.ndim == 1:
        return mesh.get_group()
    raise HyperParallelValueError(
        f"A {mesh.ndim}-D mesh of {mesh.size()} ranks inside a world of "
        f"{dist.get_world_size()} has no process group joining its ranks; lay the params "
        "out on a mesh that spans the world, or on a 1-D sub-mesh."
    )


class AsyncExchange:
    """One exchange among the ranks of ``group``, started asynchronously: ``parts[r]`` go to rank ``r``.

    Args:
        parts: This rank's tensors for each rank of ``group``, in rank order;
            they travel flattened and concatenated.
        recv_sizes: How many elements each rank sends this one.
        group: The process group.
        like: A tensor of the dtype and device the exchange travels in.
        transport: ``"all_to_all"`` (``all_to_all_single``: each rank gets
            only its parts) or ``"all_gather"`` (``all_gather_single``: every
            rank gets every rank's parts, padded to ``gather_width`` elements,
            and keeps its own: more bytes, fewer messages).
        gather_width: With ``all_gather``: the most elements any rank sends.
        gather_offsets: With ``all_gather``: where, in rank ``q``'s data, its
            part for this rank starts.

    :meth:`wait` blocks until it is done and returns what each rank sent
    here, one flat tensor per rank.
    """

    def __init__(
        self,
        parts: Sequence[Sequence[torch.Tensor]],
        recv_sizes: Sequence[int],
        *,
        group: ProcessGroup,
        like: torch.Tensor,
        transport: str = "all_to_all",
        gather_width: int = 0,
        gather_offsets: Sequence[int] = (),
    ) -> None:
        flat = [p.reshape(-1) for ps in parts for p in ps]
        send = torch.cat(flat) if flat else like.new_empty(0)
        self._sizes = list(recv_sizes)
        if transport == "all_gather":
            self._starts = [q * gather_width + start for q, start in enumerate(gather_offsets)]
            self._recv = like.new_empty(gather_width * len(self._sizes))
            send = torch.cat([send, send.new_zeros(gather_width - send.numel())])
            self._work = dist.all_gather_single(self._recv, send, group=group, async_op=True)
        elif transport == "all_to_all":
            self._starts = list(itertools.accumulate(self._sizes, initial=0))[:-1]
            self._recv = like.new_empty(sum(self._sizes))
            self._work = dist.all_to_all_single(
                self._recv, send, output_split_sizes=self._sizes,
                input_split_sizes=[sum(p.numel() for p in ps) for ps in parts], group=group,
                async_op=True,
            )  # fmt: skip
        else:
            raise HyperParallelValueError(
                f"transport must be 'all_to_all' or 'all_gather', got {transport!r}."
            )
        self._send = send  # alive until the collective is done

    def wait(self) -> list[torch.Tensor]:
        """Block until the exchange is done; what each rank sent here, one flat tensor per rank."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            del self._send
        return [self._recv[a : a + n] for a, n in zip(self._starts, self._sizes, strict=True)]


# -- reductions ----------------------------------------------------------------------


def _groups_splitting(t: torch.Tensor, dim: int) -> tuple[ProcessGroup, ...]:
    if not is_dtensor(t):
        return ()
    dt: DTensor = t  # type: ignore[assignment]
    return tuple(
        dt.device_mesh.get_group(i) for i, p in enumerate(dt.placements) if split_dim(p) == dim
    )


class Reducer:
    """Row and column sums of sharded matrices, completed over the ranks holding the rest.

    Built from the (2-D) tensors a matrix optimizer works on; each call
    takes one local tensor per matrix, in the same order. A row sum is
    all-reduced over the mesh dims that split the columns, a column sum over
    those that split the rows; tensors that share a group share one
    all-reduce. Plain tensors need no collective.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            check_not_partial(t)
        self._over_cols = [_groups_splitting(t, 1) for t in tensors]
        self._over_rows = [_groups_splitting(t, 0) for t in tensors]

    def row_sums(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``x.sum(1)`` of each full matrix, the part for this rank's rows."""
        return _sum_over([x.sum(1) for x in local], self._over_cols)

    def col_sums(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``x.sum(0)`` of each full matrix, the part for this rank's columns."""
        return _sum_over([x.sum(0) for x in local], self._over_rows)

    def row_totals(self, per_row: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The sum over all rows of each matrix of a per-row vector (this rank's rows' part).

        ``per_row[i]`` holds one value per local row of matrix ``i`` (as
        :meth:`row_sums` returns them); the result is a 1-element tensor per
        matrix, the same on every rank.
        """
        return _sum_over([v.sum().reshape(1) for v in per_row], self._over_rows)


def _sum_over(
    vectors: list[torch.Tensor], groups: Sequence[tuple[ProcessGroup, ...]]
) -> list[torch.Tensor]:
    """Sum each vector over its groups; vectors with the same groups share the collectives."""
    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for i, gs in enumerate(groups):
        if gs:
            key = (vectors[i].dtype, vectors[i].device, *(id(g) for g in gs))
            by_groups.setdefault(key, []).append(i)
    for indices in by_groups.values():
        sizes = [vectors[i].numel() for i in indices]
        flat = torch.cat([vectors[i] for i in indices])
        for group in groups[indices[0]]:
            dist.all_reduce(flat, group=group)
        for i, piece in zip(indices, flat.split(sizes), strict=True):
            vectors[i] = piece
    return vectors
