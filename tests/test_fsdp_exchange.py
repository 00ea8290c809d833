"""The FSDP backend's exchange: data a plan moves gives the transform's numbers on the whole tensor.

Every check runs in one spawn of 2 processes (gloo on CPU). The params hold
small whole numbers, so every sum in the transforms below is exact whatever
its order: a result differs from the one-process result only where the
exchange put a wrong number in a wrong place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from distributed import run_distributed

from hyper_parallel.core.distributed import Need, RowBlocks, WholeMatrices


def whole_block_transform(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reads each block whole, both ways: a piece missing or misplaced changes every result."""
    return [b @ b.mT @ b + b.sum(dim=(-2, -1), keepdim=True) for b in blocks]


class SumTeam:
    """A team form of :func:`scaled_by_sum`: each member scales its rows by the all-reduced sum."""

    dtype = torch.float32

    def split_dim(self, shape: torch.Size) -> int | None:
        return len(shape) - 2

    def cost(self, shape: torch.Size, members: int) -> float:
        return float(shape.numel()) / members

    def collectives(self, shape: torch.Size, members: int) -> list[tuple[str, int]]:
        return [("all_reduce", shape[:-2].numel())]

    def __call__(
        self, slices: list[torch.Tensor], shapes: list[torch.Size], group: Any
    ) -> list[torch.Tensor]:
        results = []
        for piece in slices:
            total = piece.sum(dim=(-2, -1), keepdim=True)
            dist.all_reduce(total, group=group)
            results.append(piece * total)
        return results


def scaled_by_sum(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each matrix times the sum of its elements: what :class:`SumTeam` computes, on whole blocks."""
    return [b * b.sum(dim=(-2, -1), keepdim=True) for b in blocks]


def whole_numbers(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).float()


def example_params(mesh: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Need]]:
    """Whole tensors, their DTensors on ``mesh``, and their needs: some in place, most travel."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cases: list[tuple[tuple[int, ...], Any, Need]] = [
        ((8, 4), Shard(0), RowBlocks((4, 4))),  # whole heads on each rank: in place
        ((32, 16), Shard(0), WholeMatrices()),  # row shards of a matrix
        ((6, 10), Shard(1), WholeMatrices()),  # column shards
        ((16, 8), Shard(0), RowBlocks((3, 13))),  # a row block across the shard boundary
        ((3, 5), Replicate(), WholeMatrices()),  # held whole everywhere: in place
        ((4, 10, 6), Shard(0), WholeMatrices(batch_dims=1)),  # an expert stack: in place
        ((4, 12, 6), Shard(1), WholeMatrices(batch_dims=1)),  # a stack split inside its matrices
        ((7, 5), Shard(0), WholeMatrices()),  # uneven shards: 4 rows and 3
    ]
    full = [whole_numbers(*shape, seed=k) for k, (shape, _, _) in enumerate(cases)]
    sharded = [distribute_tensor(t, mesh, [p]) for t, (_, p, _) in zip(full, cases, strict=True)]
    return full, sharded, [need for _, _, need in cases]


def _assert_bitwise(results: list[torch.Tensor], expected: list[torch.Tensor], label: str) -> None:
    assert len(results) == len(expected), label
    for k, (got, want) in enumerate(zip(results, expected, strict=True)):
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(full, want), f"{label}: param {k} differs"


@contextmanager
def small_buckets() -> Iterator[None]:
    """Lift the floor on bucket size: a small set of params travels in several buckets."""
    from hyper_parallel_builtins.fsdp_backend import _plan

    floor = _plan.MIN_BUCKET_BYTES
    _plan.MIN_BUCKET_BYTES = 1
    try:
        yield
    finally:
        _plan.MIN_BUCKET_BYTES = floor


def _check_every_way_of_moving(mesh: Any) -> None:
    """Whole matrices and row blocks, overlapped or in turn, either transport, one or more buckets."""
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend
    from hyper_parallel_builtins.local_backend import LocalBackend

    full, sharded, needs = example_params(mesh)
    expected = LocalBackend().map_blocks(whole_block_transform, full, needs)
    for small in (False, True):
        for overlap in (True, False):
            for transport in ("all_to_all", "all_gather"):
                label = f"small buckets={small}, overlap={overlap}, {transport}"
                backend = FSDPBackend(overlap=overlap, transport=transport, team_size=1)
                with small_buckets() if small else nullcontext():
                    plan = backend.exchange_plan(sharded, needs)
                    results = backend.map_blocks(whole_block_transform, sharded, needs)
                assert (len(plan.buckets) > 1) == small, (label, len(plan.buckets))
                _assert_bitwise(results, expected, label)


def _check_teams(mesh: Any) -> None:
    """Matrices shared by a team of both ranks: the team's numbers are one owner's."""
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend
    from hyper_parallel_builtins.local_backend import LocalBackend

    full, sharded, needs = example_params(mesh)
    whole = [k for k, need in enumerate(needs) if isinstance(need, WholeMatrices)]
    full, sharded = [full[k] for k in whole], [sharded[k] for k in whole]
    needs = [needs[k] for k in whole]
    expected = LocalBackend().map_blocks(scaled_by_sum, full, needs)
    for overlap in (True, False):
        backend = FSDPBackend(overlap=overlap, team_size=2)
        results = backend.map_prepared_blocks(
            scaled_by_sum, lambda ks: [sharded[k] for k in ks], sharded, needs, team=SumTeam()
        )
        assert backend.exchange_plan(sharded, needs, team=SumTeam()).team_size == 2
        _assert_bitwise(results, expected, f"team of 2, overlap={overlap}")


def _check_prepare_order(mesh: Any, world_size: int) -> None:
    """``map_prepared_blocks`` makes what travels first; with overlap, what is held while it travels."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    heads = whole_numbers(8 * world_size, 4, seed=10)  # row shards hold whole 8-row heads
    moving = whole_numbers(6, 5, seed=11)  # one matrix split over the ranks: travels
    plain = whole_numbers(3, 3, seed=12)  # a plain tensor: held whole
    layouts = [
        distribute_tensor(heads, mesh, [Shard(0)]),
        distribute_tensor(moving, mesh, [Shard(0)]),
        plain,
    ]
    needs = [RowBlocks((8,) * world_size), WholeMatrices(), WholeMatrices()]
    expected = [
        torch.cat(whole_block_transform(list((2 * heads).split(8)))),
        whole_block_transform([2 * moving])[0],
        whole_block_transform([2 * plain])[0],
    ]
    for overlap in (True, False):
        events: list[Any] = []

        def prepare(positions: list[int], events: list[Any] = events) -> list[torch.Tensor]:
            events.append(sorted(positions))
            return [2 * layouts[i] for i in positions]

        with recording_exchanges(events):
            backend = FSDPBackend(overlap=overlap)
            results = backend.map_prepared_blocks(whole_block_transform, prepare, layouts, needs)
        held_after = ["exchange", [0, 2]] if overlap else [[0, 2], "exchange"]
        assert events == [[1], *held_after, "exchange"], (overlap, events)
        _assert_bitwise(results, expected, f"prepared, overlap={overlap}")


@contextmanager
def watching_exchanges(watch: Callable[[str, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Call ``watch(name, output, input)`` at each owner-exchange collective, either transport."""
    real = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single")}

    def watched(name: str) -> Any:
        def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            watch(name, output, input)
            return real[name](output, input, *args, **kwargs)

        return call

    for name in real:
        setattr(dist, name, watched(name))
    try:
        yield
    finally:
        for name, collective in real.items():
            setattr(dist, name, collective)


def recording_exchanges(events: list[Any]) -> AbstractContextManager[None]:
    """Append ``"exchange"`` to ``events`` at each owner-exchange collective."""
    return watching_exchanges(lambda name, output, input: events.append("exchange"))


def _exchange(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    _check_every_way_of_moving(mesh)
    _check_teams(mesh)
    _check_prepare_order(mesh, world_size)


def test_an_exchanged_result_is_bitwise_the_transform_of_the_whole_tensor() -> None:
    run_distributed(_exchange, world_size=2)
