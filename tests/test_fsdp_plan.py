"""The FSDP backend's exchange plan: who computes each param, in which bucket, printed, made once.

The distributed checks run in one spawn of 2 processes (gloo on CPU), on the
params of ``test_fsdp_exchange.example_params``: three of them held in place,
five that travel.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_fsdp_exchange import (
    SumTeam,
    example_params,
    small_buckets,
    watching_exchanges,
    whole_block_transform,
)

from hyper_parallel.core.distributed import Need, WholeMatrices
from hyper_parallel.core.distributed.toolkit import assign_owners, exchange_rounds

IN_PLACE = (0, 4, 5)  # whole heads, a replicated matrix, an expert stack split on experts
TRAVELLING = [1, 2, 3, 6, 7]


def _ns_flops(rows: int, cols: int) -> float:
    small, large = min(rows, cols), max(rows, cols)
    return 4 * small * small * large + 2 * small**3


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_owner_assignment_balances_newton_schulz_flops(world_size: int) -> None:
    d = 512
    layer = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]  # q, k, v, o, up, down
    costs = [_ns_flops(r, c) for r, c in layer * 4]  # a 24-matrix transformer
    owners = assign_owners(costs, world_size)
    loads = [
        sum(c for c, o in zip(costs, owners, strict=True) if o == rank)
        for rank in range(world_size)
    ]
    mean = sum(costs) / world_size
    assert max(loads) <= 1.25 * mean, (loads, mean)
    assert set(owners) == set(range(world_size))
    assert assign_owners(costs, world_size) == owners  # every rank computes the same


def test_exchange_rounds_give_every_owner_work() -> None:
    nbytes = [64] * 6 + [32]
    dtypes = [torch.float32] * 6 + [torch.float64]
    owners = [0, 1, 0, 1, 1, 0, 1]
    rounds = exchange_rounds(nbytes, dtypes, owners, 2, bucket_bytes=64)  # one per owner per round
    assert rounds == [[0, 1], [2, 3], [4, 5], [6]]
    (whole,) = exchange_rounds(nbytes[:6], dtypes[:6], owners[:6], 2, bucket_bytes=10**9)
    assert whole == [0, 1, 2, 3, 4, 5]


def test_a_plan_is_asked_for_the_dtensors_of_one_mesh() -> None:
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    with pytest.raises(ValueError, match=r"exchange_plan takes DTensors of one device mesh; got 1"):
        FSDPBackend().exchange_plan([torch.ones(2, 2)], [WholeMatrices()])


def _keyed(needs: list[Need]) -> list[Need]:
    """Each need with its param's index as key, so a transform knows whose block it has."""
    return [dataclasses.replace(need, key=k) for k, need in enumerate(needs)]


def _gathered(value: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _check_each_param_is_computed_once(plan: Any) -> None:
    """Every rank plans the same, each param in one bucket; what the ranks compute covers it once.

    Each rank computes a region of a param (all of it for an owner, a part
    for a team member) where the plan names it among the param's members.
    """
    assigned = [(a.index, a.members) for b in plan.buckets for a in b.assigned]
    assert all(assigned == theirs for theirs in _gathered(assigned))
    members = dict(assigned)
    assert len(members) == len(assigned), assigned
    owned = [(o.index, o.region) for b in plan.buckets for o in b.owned]
    cover = {i: torch.zeros(plan.shapes[i]) for i in members}
    computing: dict[int, set[int]] = {i: set() for i in members}
    for rank, regions in enumerate(_gathered(owned)):
        for index, region in regions:
            computing[index].add(rank)
            region.copy_into(cover[index], region.take(cover[index]) + 1)
    for index, count in cover.items():
        assert computing[index] == set(members[index]), (index, computing[index])
        assert torch.equal(count, torch.ones_like(count)), f"param {index} is not covered once"


def _check_owners_compute_what_the_plan_says(
    backend: Any, sharded: list[Any], needs: list[Need]
) -> None:
    """The ranks that run the transform on a travelling param are the owners the plan names."""
    plan = backend.exchange_plan(sharded, needs)
    seen: set[Any] = set()

    def recording(blocks: Any) -> list[torch.Tensor]:
        seen.update(blocks.keys)
        return whole_block_transform(blocks)

    backend.map_blocks(recording, sharded, needs)
    computed = _gathered(seen)
    for bucket in plan.buckets:
        for a in bucket.assigned:
            ranks = {rank for rank, keys in enumerate(computed) if a.index in keys}
            assert ranks == set(a.members), (a.index, ranks, a.members)
    assert all(set(IN_PLACE) <= keys for keys in computed)  # each rank holds some of each


def _check_the_printed_plan(plan: Any) -> None:
    """Each param by index and shape, on its owner's line; each bucket with its transport."""
    text, shapes = str(plan), plan.shapes
    lines = text.splitlines()
    assert lines[0].startswith(f"ExchangePlan for rank {dist.get_rank()} of 2: 8 params"), text
    for index in IN_PLACE:
        assert f"#{index} {tuple(shapes[index])}" in lines[0], text
    buckets = [line for line in lines if re.match(r"  bucket \d+, ", line)]
    assert len(buckets) == len(plan.buckets), text
    for number, (line, bucket) in enumerate(zip(buckets, plan.buckets, strict=True)):
        assert line.startswith(f"  bucket {number}, {bucket.transport}: to the members sends")
        for a in bucket.assigned:
            (owner,) = a.members
            owner_lines = [ln for ln in lines if ln.startswith(f"    rank {owner} owns")]
            assert any(f"#{a.index} {tuple(shapes[a.index])}" in ln for ln in owner_lines), text


def _recording_bytes(moved: list[tuple[int, int]]) -> AbstractContextManager[None]:
    """Record what each exchange collective sends and receives from others, in bytes."""

    def record(name: str, output: torch.Tensor, input: torch.Tensor) -> None:
        sent, size = input.numel() * input.element_size(), output.element_size()
        moved.append((sent, output.numel() * size - (sent if name == "all_gather_single" else 0)))

    return watching_exchanges(record)


def _check_the_bytes_it_states(sharded: list[Any], needs: list[Need]) -> None:
    """The bytes the plan states for each trip are those its collectives move."""
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    for transport in ("all_to_all", "all_gather"):
        backend = FSDPBackend(overlap=False, transport=transport, team_size=1)
        plan = backend.exchange_plan(sharded, needs)
        moved: list[tuple[int, int]] = []
        with _recording_bytes(moved):
            backend.map_blocks(whole_block_transform, sharded, needs)
        stated = [
            (
                leg.bytes_sent(transport, b.element_size),
                leg.bytes_received(transport, b.element_size),
            )
            for b in plan.buckets
            for leg in (b.to_members, b.from_members)
        ]
        assert moved == stated, (transport, moved, stated)


def _check_made_once(sharded: list[Any], needs: list[Need], mesh: Any) -> None:
    """A layout's plan is made once, with one collective, and reused by every later call."""
    from torch.distributed.tensor import distribute_tensor

    from hyper_parallel_builtins.fsdp_backend import FSDPBackend, _plan

    made, real = [], _plan.gather_layouts

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    _plan.gather_layouts = counting  # type: ignore[assignment]
    try:
        backend = FSDPBackend(team_size=1)
        plan = backend.exchange_plan(sharded, needs)
        backend.map_blocks(whole_block_transform, sharded, needs)
        again = [distribute_tensor(2 * t.full_tensor(), mesh, t.placements) for t in sharded]
        backend.map_blocks(whole_block_transform, again, needs)  # new values, the same layout
        assert backend.exchange_plan(again, needs) is plan and len(made) == 1, made
        other = backend.exchange_plan(sharded[1:], needs[1:])  # another layout: another plan
        assert other is not plan and len(made) == 2, made
    finally:
        _plan.gather_layouts = real


def _check_teams(sharded: list[Any], needs: list[Need]) -> None:
    """With teams of both ranks, each rank computes a part of every travelling matrix."""
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    whole = [k for k in TRAVELLING if isinstance(needs[k], WholeMatrices)]
    plan = FSDPBackend(team_size=2).exchange_plan(
        [sharded[k] for k in whole], [needs[k] for k in whole], team=SumTeam()
    )
    assert plan.team_size == 2 and plan.in_place == ()
    _check_each_param_is_computed_once(plan)
    text = str(plan)
    assert "(teams of 2)" in text.splitlines()[0], text
    team_lines = [line for line in text.splitlines() if line.startswith("    ranks 0-1 share ")]
    for bucket in plan.buckets:
        for a in bucket.assigned:
            assert a.members == (0, 1), a
            named = f"#{a.index} {tuple(plan.shapes[a.index])}"
            assert any(named in line for line in team_lines), text


def _plan_checks(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    mesh = init_device_mesh("cpu", (world_size,))
    full, sharded, needs = example_params(mesh)
    needs = _keyed(needs)
    with small_buckets():
        backend = FSDPBackend(team_size=1)
        plan = backend.exchange_plan(sharded, needs)
        assert len(plan.buckets) > 1 and plan.in_place == IN_PLACE
        assert sorted(a.index for b in plan.buckets for a in b.assigned) == TRAVELLING
        assert plan.shapes == tuple(t.shape for t in full)
        _check_each_param_is_computed_once(plan)
        _check_owners_compute_what_the_plan_says(backend, sharded, needs)
        _check_the_printed_plan(plan)
        _check_the_bytes_it_states(sharded, needs)
    _check_made_once(sharded, needs, mesh)
    _check_teams(sharded, needs)


def test_the_plan_says_who_computes_what_and_is_made_once() -> None:
    run_distributed(_plan_checks, world_size=2)
