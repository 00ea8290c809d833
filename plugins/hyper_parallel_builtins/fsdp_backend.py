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
  (replicas included). In rounds of bounded size, one ``all_to_all_single``
  brings each distinct piece of a param to its owner (one holder sends each
  piece, the owner itself where it holds one); the owner assembles the
  whole tensor, runs the transform on all it owns in one call, and a second
  ``all_to_all_single`` returns to every rank its own piece of the result.

The plan (every rank's layout, who owns and who sends what) depends only on
the params' shapes and placements; it is made once, with one collective,
and reused every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import BlocksFn, Need, RowBlocks, ShardingBackend
from hyper_parallel.core.distributed.toolkit import (
    Layout,
    all_to_all,
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
from hyper_parallel.core.plugin import RegisterFn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["FSDPBackend", "HSDPBackend"]


@dataclass(frozen=True)
class _Piece:
    """One distinct part of a param, and the rank that sends it to the owner."""

    layout: Layout
    sender: int


@dataclass(frozen=True)
class _Owned:
    """A param that goes through its owner, and every rank's part of it."""

    index: int  # into the mesh's tensors
    owner: int  # rank in the exchange group
    pieces: tuple[_Piece, ...]
    layouts: tuple[Layout, ...]  # by rank in the exchange group


@dataclass(frozen=True)
class _Plan:
    """What every rank of one mesh does with that mesh's params."""

    group: ProcessGroup
    rank: int
    mine: tuple[Layout, ...]  # this rank's layout of each tensor
    in_place: tuple[int, ...]
    owned: tuple[_Owned, ...]
    rounds: tuple[tuple[int, ...], ...]  # indices into ``owned``


def _supported(p: torch.Tensor) -> bool:
    if not is_dtensor(p):
        return True
    if any(pl.is_partial() for pl in p.placements):  # type: ignore[attr-defined]
        return False
    mesh = p.device_mesh  # type: ignore[attr-defined]
    return bool(mesh.ndim == 1 or mesh.size() == dist.get_world_size())


class FSDPBackend(ShardingBackend):
    """DTensor params of any ``Shard``/strided/``Replicate`` layout: in place where blocks are whole, else owners."""

    name: ClassVar[str] = "fsdp"

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], _Plan] = {}

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
        out: list[torch.Tensor | None] = [None] * len(tensors)
        by_mesh: dict[DeviceMesh | None, list[int]] = {}
        for i, t in enumerate(tensors):
            check_not_partial(t)
            by_mesh.setdefault(t.device_mesh if is_dtensor(t) else None, []).append(i)  # type: ignore[attr-defined]
        in_place = {i: Layout.whole(tensors[i].shape) for i in by_mesh.pop(None, [])}
        plans = [
            (indices, self._plan(tensors, needs, indices, cost)) for indices in by_mesh.values()
        ]
        for indices, plan in plans:
            in_place.update((indices[k], plan.mine[k]) for k in plan.in_place)
        _map_in_place(fn, tensors, needs, in_place, out)
        for indices, plan in plans:
            _exchange(
                fn, [tensors[i] for i in indices], [needs[i] for i in indices], plan, out, indices
            )
        return [r for r in out if r is not None]

    def _plan(
        self,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        indices: list[int],
        cost: Callable[[torch.Size], float] | None,
    ) -> _Plan:
        dts = [cast("DTensor", tensors[i]) for i in indices]
        key = tuple(
            (t.shape, t.dtype, t.placements, t.device_mesh, needs[i])
            for t, i in zip(dts, indices, strict=True)
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _make_plan(
                [tensors[i] for i in indices], [needs[i] for i in indices], cost
            )
        return plan


class HSDPBackend(FSDPBackend):
    """The ``fsdp`` backend on a 2-D ``(replicate, shard)`` mesh."""

    name: ClassVar[str] = "hsdp"

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        meshes = [cast("DTensor", p).device_mesh for p in params if is_dtensor(p)]
        return super().accepts(params) and all(mesh.ndim == 2 for mesh in meshes)

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        mesh = options.get("mesh")
        if mesh is not None and mesh.ndim != 2:
            raise HyperParallelValueError(
                f"The 'hsdp' backend shards over a 2-D (replicate, shard) mesh; got a "
                f"{mesh.ndim}-D mesh. Use 'fsdp' for a 1-D mesh."
            )
        return super().shard_model(module, **options)


def _block_shapes(shape: torch.Size, need: Need) -> list[torch.Size]:
    if not isinstance(need, RowBlocks):
        return [shape]
    dim = need.batch_dims
    return [torch.Size((*shape[:dim], h, *shape[dim + 1 :])) for h in need.heights]


def _make_plan(
    tensors: list[torch.Tensor], needs: list[Need], cost: Callable[[torch.Size], float] | None
) -> _Plan:
    group = exchange_group(cast("DTensor", tensors[0]).device_mesh)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layouts = gather_layouts(tensors, group)
    in_place = tuple(
        i for i, t in enumerate(tensors) if blocks_in_place(needs[i], t.shape, layouts[i])
    )
    moving = [i for i in range(len(tensors)) if i not in in_place]
    measure = cost or (lambda shape: float(math.prod(shape)))
    costs = [sum(measure(s) for s in _block_shapes(tensors[i].shape, needs[i])) for i in moving]
    owners = assign_owners(costs, world)
    owned = tuple(
        _Owned(i, owner, _pieces(layouts[i], owner, i), tuple(layouts[i]))
        for i, owner in zip(moving, owners, strict=True)
    )
    rounds = exchange_rounds(
        [tensors[o.index].numel() * tensors[o.index].element_size() for o in owned],
        [tensors[o.index].dtype for o in owned],
        owners,
        world,
    )
    mine = tuple(layouts[i][rank] for i in range(len(tensors)))
    return _Plan(group, rank, mine, in_place, owned, tuple(tuple(r) for r in rounds))


def _pieces(layouts: list[Layout], owner: int, salt: int) -> tuple[_Piece, ...]:
    """The distinct non-empty parts, each sent by the owner if it holds it, else by one holder."""
    holders: dict[Layout, list[int]] = {}
    for rank, layout in enumerate(layouts):
        if layout.numel:
            holders.setdefault(layout, []).append(rank)
    return tuple(
        _Piece(layout, owner if owner in ranks else ranks[salt % len(ranks)])
        for layout, ranks in holders.items()
    )


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


def _exchange(
    fn: BlocksFn,
    tensors: list[torch.Tensor],
    needs: list[Need],
    plan: _Plan,
    out: list[torch.Tensor | None],
    positions: list[int],
) -> None:
    """The owner exchange, round by round; results land in ``out[positions[i]]``."""
    me, world = plan.rank, dist.get_world_size(plan.group)
    local = [local_tensor(t) for t in tensors]
    for round_ in plan.rounds:
        items = [plan.owned[k] for k in round_]
        dtype, device = local[items[0].index].dtype, local[items[0].index].device
        # -- each distinct piece to its owner --------------------------------------
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        sizes = [0] * world
        for item in items:
            for piece in item.pieces:
                if piece.sender == me and item.owner != me:
                    send[item.owner].append(local[item.index])
                elif item.owner == me and piece.sender != me:
                    sizes[piece.sender] += piece.layout.numel
        received = all_to_all(send, sizes, dtype, device, plan.group)
        # -- the owner assembles its tensors and transforms them in one call ------
        offsets = [0] * world
        results = _transform_owned(fn, tensors, needs, local, items, me, received, offsets)
        # -- every rank's part of each result back to it --------------------------
        send = [[] for _ in range(world)]
        sizes = [0] * world
        for item in items:
            if item.owner == me:
                for rank in range(world):
                    if rank != me:
                        send[rank].append(item.layouts[rank].take(results[item.index]))
            else:
                sizes[item.owner] += item.layouts[me].numel
        returned = all_to_all(send, sizes, dtype, device, plan.group)
        offsets = [0] * world
        for item in items:
            mine = item.layouts[me]
            if item.owner == me:
                part = mine.take(results[item.index])
            else:
                start = offsets[item.owner]
                offsets[item.owner] += mine.numel
                part = returned[item.owner][start : start + mine.numel].view(mine.shape)
            out[positions[item.index]] = shard_like(part, tensors[item.index])


def _transform_owned(
    fn: BlocksFn,
    tensors: list[torch.Tensor],
    needs: list[Need],
    local: list[torch.Tensor],
    items: list[_Owned],
    me: int,
    received: list[torch.Tensor],
    offsets: list[int],
) -> dict[int, torch.Tensor]:
    """Assemble the whole tensors this rank owns in a round and apply ``fn`` to their blocks."""
    fulls: dict[int, torch.Tensor] = {}
    for item in (it for it in items if it.owner == me):
        t = local[item.index]
        full = t.new_empty(tensors[item.index].shape)
        for piece in item.pieces:
            if piece.sender == me:
                data = t
            else:
                start = offsets[piece.sender]
                offsets[piece.sender] += piece.layout.numel
                data = received[piece.sender][start : start + piece.layout.numel]
            piece.layout.copy_into(full, data.view(piece.layout.shape))
        fulls[item.index] = full
    indices = list(fulls)
    results = map_held_blocks(
        fn,
        [fulls[i] for i in indices],
        [Layout.whole(fulls[i].shape) for i in indices],
        [needs[i] for i in indices],
    )
    return dict(zip(indices, results, strict=True))


@hookimpl
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register ``fsdp`` and ``hsdp``."""
    register(
        "fsdp",
        FSDPBackend,
        description="DTensor params of any layout (FSDP2, HSDP, TP, FSDP+TP): owner exchange",
    )
    register("hsdp", HSDPBackend, description="the fsdp backend on a 2-D (replicate, shard) mesh")
