"""HSDP replicas share the work: groups of replicas, the spread over the column, and the choice.

Each group of ``hsdp_replica_count`` replicas computes every matrix once; a
member returns its results to its own replica row only, and an all-gather
over the column of replicas carries them to the others. The numbers are one
process's, on HSDP 2x2 (4 processes) and on two torchrun nodes of 2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from conftest import TinyLM, counting_newton_schulz, lm_loss
from hyper_parallel.core.optimizer import get_hyper_optimizer
from hyper_parallel_builtins.fsdp_backend import FSDPBackend
from hyper_parallel_builtins.fsdp_backend._plan import BACK, SPREAD, ExchangePlan
from hyper_parallel_builtins.fsdp_backend.cost import (
    DeviceProfile,
    LinkCost,
    choose_replica_group,
)
from hyper_parallel_builtins.muon import MuonTeam

STEPS = 3
TESTS = Path(__file__).resolve().parent


# -- the choice, from shapes alone ---------------------------------------------------


def _profile(seconds_per_byte: float, flops: float) -> DeviceProfile:
    link = LinkCost(latency_s=1e-6, seconds_per_byte=seconds_per_byte)
    rates = {"bfloat16": [[1024.0, flops]], "float32": [[1024.0, flops]]}
    return DeviceProfile("test", link, link, matmul_flops=rates)


def _llama_like(layers: int) -> list[torch.Size]:
    per_layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
                 (14336, 4096), (4096, 14336)]  # fmt: skip
    return [torch.Size(s) for _ in range(layers) for s in per_layer]


def _choice(layers: int, profile: DeviceProfile | None, replicas: int = 16) -> int:
    from benchmarks.scale import muon_group
    from hyper_parallel_builtins.newton_schulz._iterate import newton_schulz_flops

    shapes = _llama_like(layers)
    flops = [newton_schulz_flops(r, c, 5, "standard") for r, c in shapes]
    team = MuonTeam(muon_group(), torch.bfloat16)
    return choose_replica_group(shapes, flops, team, 8, replicas, profile, node_size=8)


def test_replica_groups_weigh_the_flops_they_save_against_the_bytes_that_spread_them() -> None:
    fast_link_slow_matmul, slow_link = _profile(1e-12, 1e12), _profile(1e-8, 1e14)
    # more matrices than ranks: every replica shares the work, whatever the link
    assert _choice(32, fast_link_slow_matmul) == _choice(32, slow_link) == 16
    # 7 matrices over 16 nodes of 8: sharing saves FLOPs, but past a few rows the rows
    # that own a matrix spread it to padded rows; a slow matmul on a fast link pays for it
    assert _choice(1, fast_link_slow_matmul) == 16
    few = _choice(1, slow_link)
    assert 1 < few < 16 and 16 % few == 0
    assert _choice(4, None) == 16  # no profile: every replica shares the work once
    # a fixed team size must divide the group's ranks: teams of 64 need 8 rows of 8
    from benchmarks.scale import muon_group

    shapes, team = _llama_like(1), MuonTeam(muon_group(), torch.bfloat16)
    flops = [1e12] * len(shapes)
    assert choose_replica_group(shapes, flops, team, 8, 16, slow_link, 8, 4, 64) == 8


# -- the exchange against one process, on HSDP 2x2 and two nodes of 2 -----------------

#: Each optimizer the fsdp backend carries, by name: how to make it for a model.
Factory = Callable[[torch.nn.Module, "int | None"], Any]


def _muon(model: torch.nn.Module, count: int | None, **extra: Any) -> Any:
    return get_hyper_optimizer(
        model,
        partitioner="by_shape",
        muon_kwargs={"lr": 0.02, "weight_decay": 0.01, "hsdp_replica_count": count, **extra},
        adamw_kwargs={"lr": 3e-3},
    )


def _head_wise(model: torch.nn.Module, count: int | None) -> Any:
    return _muon(model, count, head_wise=True, head_dim=8)


def _matrices(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
    return mats, [p for p in model.parameters() if all(p is not m for m in mats)]


def _sinkhorn(model: torch.nn.Module, count: int | None) -> Any:
    mats, rest = _matrices(model)
    return get_hyper_optimizer(model, muon_params=[], sinkhorn_params=mats, adamw_params=rest,
                               sinkhorn_kwargs={"lr": 0.01})  # fmt: skip


def _adamw(model: torch.nn.Module, count: int | None) -> Any:
    return get_hyper_optimizer(model, muon_params=[], adamw_params=list(model.parameters()),
                               adamw_kwargs={"lr": 3e-3})  # fmt: skip


OPTIMIZERS: dict[str, Factory] = {
    "muon": _muon,
    "head-wise": _head_wise,
    "sinkhorn": _sinkhorn,
    "adamw": _adamw,
}


def _train(model: torch.nn.Module, optimizer: Any, batch: torch.Tensor) -> None:
    for _ in range(STEPS):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def _plans(optimizer: Any) -> list[ExchangePlan]:
    muon = optimizer.optimizers["muon"]
    backend = muon.sharding_backend(muon.param_groups[0])
    assert isinstance(backend, FSDPBackend)
    return list(backend._plans.values())


def _check_spread(optimizer: Any, count: int, shards: int) -> None:
    """Results go back within the member's replica row; the other rows get them by the spread."""
    (plan,) = _plans(optimizer)
    assert (plan.column is not None) == (count > 1)
    row = plan.rank // shards
    for bucket in plan.buckets:
        for rank, parts in enumerate(bucket.back):
            assert not parts or rank // shards == row, (rank, row)
        spread = [g for g in bucket.land if g.source == SPREAD]
        assert bool(spread) == (count > 1)
        assert all(g.source != BACK or g.peer // shards == row for g in bucket.land)


def _check_buckets_in_turn(
    initial: torch.nn.Module, mesh: Any, batch: torch.Tensor, count: int, overlapped: Any
) -> None:
    """One matrix per bucket, overlapped and in turn: bitwise the params of one bucket."""
    from test_distributed_muon import assert_bitwise_equal, exchange_options
    from torch.distributed.fsdp import fully_shard

    trained = []
    for overlap in (True, False):
        model = copy.deepcopy(initial)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with exchange_options(overlap=overlap, team_size="1"):
            _train(model, _muon(model, count), batch)
        trained.append(model)
    assert_bitwise_equal(trained[0], trained[1], f"hsdp_replica_count={count}, in turn")
    assert_bitwise_equal(trained[0], overlapped, f"hsdp_replica_count={count}, buckets")


def check_replicas_equal_one_process(rank: int, world_size: int) -> None:
    """Every optimizer on a (2, 2) HSDP mesh, each replica count: one process's params."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 32, (4, 9), generator=gen)
    torch.manual_seed(0)
    initial = TinyLM(dim=24, hidden=48, qkv_bias=False)  # 8-row heads cut by 12-row shards
    for name, factory in OPTIMIZERS.items():
        reference = copy.deepcopy(initial)
        _train(reference, factory(reference, None), batch)
        counts: tuple[int | None, ...] = (1, 2, None) if name in ("muon", "head-wise") else (None,)
        for count in counts:
            model = copy.deepcopy(initial)
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            with counting_newton_schulz() as calls:
                optimizer = factory(model, count)
                _train(model, optimizer, batch[rank : rank + 1])
            label = f"{name}, hsdp_replica_count={count}"
            for (param, p), q in zip(model.named_parameters(), reference.parameters(),
                                     strict=True):  # fmt: skip
                torch.testing.assert_close(
                    p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=f"{label}: {param}"
                )
            if name == "muon" and count is not None:
                _check_spread(optimizer, count, mesh.size(1))
                done = [0] * world_size
                dist.all_gather_object(done, sum(calls))
                # 14 matrices a step, computed once per group of replicas
                assert sum(done) == STEPS * 14 * (2 // count), (label, done)
                _check_buckets_in_turn(initial, mesh, batch[rank : rank + 1], count, model)


def test_replicas_share_the_work_and_equal_one_process_on_hsdp_2x2() -> None:
    run_distributed(check_replicas_equal_one_process, world_size=4)


def test_replicas_on_two_nodes_of_two_equal_one_process(tmp_path: Path) -> None:
    from test_multinode import _two_nodes

    script = TESTS / "scripts" / "replicas_two_nodes.py"
    output = _two_nodes(tmp_path, str(script), str(tmp_path / "done"))
    marks = sorted((tmp_path / "done").read_text().split())
    assert marks == ["0", "1", "2", "3"], output[-4000:]


@pytest.mark.parametrize("count", [0, -1])
def test_a_replica_count_below_one_is_refused_where_the_optimizer_is_built(count: int) -> None:
    with pytest.raises(ValueError, match="hsdp_replica_count must be positive"):
        _muon(TinyLM(), count)
