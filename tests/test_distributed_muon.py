"""Distributed Muon on FSDP/HSDP: the same numbers as one process, the work spread over ranks."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_fsdp_exchange import recording_exchanges

from conftest import TinyLM, counting_newton_schulz, lm_loss
from hyper_parallel.core.optimizer import get_hyper_optimizer

STEPS = 5


@contextmanager
def exchange_options(
    *, overlap: bool, transport: str = "auto", team_size: str = "auto"
) -> Iterator[None]:
    """Backends made in the block overlap the exchange or not, with one matrix per bucket and owner.

    The default floor on bucket size makes a small model's exchange one
    bucket; lifting it gives the pipeline several buckets to overlap. Plans
    are made at the first step, so train inside the block too.
    """
    from hyper_parallel_builtins.fsdp_backend import _backend, _plan

    floor = _plan.MIN_BUCKET_BYTES
    names = (_backend.OVERLAP_ENV, _backend.TRANSPORT_ENV, _plan.TEAM_SIZE_ENV)
    before = {name: os.environ.get(name) for name in names}
    _plan.MIN_BUCKET_BYTES = 1
    values = ("1" if overlap else "0", transport, team_size)
    os.environ.update(zip(names, values, strict=True))
    try:
        yield
    finally:
        _plan.MIN_BUCKET_BYTES = floor
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def assert_bitwise_equal(model: torch.nn.Module, other: torch.nn.Module, label: str) -> None:
    """Every param of ``model`` holds bitwise the values of ``other``'s (local shards)."""
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        mine = p.to_local() if hasattr(p, "to_local") else p
        theirs = q.to_local() if hasattr(q, "to_local") else q
        assert torch.equal(mine, theirs), f"{label}: {name} differs"


def test_overlap_switch_is_read_when_the_backend_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend, HSDPBackend
    from hyper_parallel_builtins.fsdp_backend._backend import OVERLAP_ENV

    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert FSDPBackend().overlap and not FSDPBackend(overlap=False).overlap
    for value, expected in (("0", False), ("off", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv(OVERLAP_ENV, value)
        assert HSDPBackend().overlap is expected, value
        assert FSDPBackend(overlap=not expected).overlap is not expected  # the argument wins
    monkeypatch.setenv(OVERLAP_ENV, "2")
    with pytest.raises(ValueError, match=rf"{OVERLAP_ENV}='2' is not a switch: set it to 1"):
        FSDPBackend()
    with pytest.raises(ValueError, match=r"overlap should be True or False, got 'yes'"):
        FSDPBackend(overlap="yes")  # type: ignore[arg-type]


def test_transport_is_checked_when_the_backend_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend
    from hyper_parallel_builtins.fsdp_backend._backend import TRANSPORT_ENV

    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert FSDPBackend().transport == "auto"
    assert FSDPBackend(transport="all_gather").transport == "all_gather"
    monkeypatch.setenv(TRANSPORT_ENV, "all_to_all")
    assert FSDPBackend().transport == "all_to_all"
    with pytest.raises(ValueError, match=r"transport='ring' is not a transport; choose auto, "):
        FSDPBackend(transport="ring")
    monkeypatch.setenv(TRANSPORT_ENV, "gather_broadcast")
    with pytest.raises(ValueError, match=r"HYPER_PARALLEL_TRANSPORT='gather_broadcast' is not"):
        FSDPBackend()


def test_team_size_is_checked_when_the_backend_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend
    from hyper_parallel_builtins.fsdp_backend._plan import TEAM_SIZE_ENV

    monkeypatch.delenv(TEAM_SIZE_ENV, raising=False)
    assert FSDPBackend().team_size == "auto"
    assert FSDPBackend(team_size=4).team_size == 4
    monkeypatch.setenv(TEAM_SIZE_ENV, "2")
    assert FSDPBackend().team_size == 2
    for bad in (0, "two", 1.5, True):
        with pytest.raises(ValueError, match=r"team_size=.* is not a team size; use 'auto' or"):
            FSDPBackend(team_size=bad)  # type: ignore[arg-type]
    monkeypatch.setenv(TEAM_SIZE_ENV, "-1")
    with pytest.raises(ValueError, match=rf"{TEAM_SIZE_ENV}='-1' is not a team size"):
        FSDPBackend()


def test_a_backend_without_its_own_map_prepared_blocks_prepares_everything_first() -> None:
    from hyper_parallel.core.distributed import WholeMatrices
    from hyper_parallel_builtins.local_backend import LocalBackend

    tensors = [torch.randn(4, 3), torch.randn(2, 5)]
    calls: list[list[int]] = []

    def prepare(positions: list[int]) -> list[torch.Tensor]:
        calls.append(positions)
        return [2 * tensors[i] for i in positions]

    needs = [WholeMatrices()] * 2
    results = LocalBackend().map_prepared_blocks(_blockwise, prepare, tensors, needs)
    assert calls == [[0, 1]]
    for got, t in zip(results, tensors, strict=True):
        torch.testing.assert_close(got, _blockwise([2 * t])[0])


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 9), generator=gen)


def _optimizer(
    model: torch.nn.Module, muon_kwargs: dict[str, Any] | None = None, **extra: Any
) -> Any:
    return get_hyper_optimizer(
        model,
        partitioner="by_shape",
        muon_kwargs={"lr": 0.02, "weight_decay": 0.01, **(muon_kwargs or {})},
        adamw_kwargs={"lr": 3e-3},
        **extra,
    )


def _train(model: torch.nn.Module, optimizer: Any, batch: torch.Tensor) -> None:
    for _ in range(STEPS):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def _state_bytes(optimizer: Any) -> dict[str, int]:
    out = {}
    for name, opt in optimizer.optimizers.items():
        total = 0
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
        out[name] = total
    return out


def _sharded_copy(reference: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(reference)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check_against_one_process(mesh: Any, rows: slice, label: str) -> None:
    torch.manual_seed(0)
    # No k/q/v biases: k_proj.bias gets a mathematically zero gradient (softmax ignores a
    # per-query shift), and AdamW would blow its rounding noise up to lr-sized steps.
    reference = TinyLM(qkv_bias=False)
    model = _sharded_copy(reference, mesh)
    in_turn = _sharded_copy(reference, mesh)

    ref_opt = _optimizer(reference)
    batch = _batch()
    _train(reference, ref_opt, batch)
    with exchange_options(overlap=True):
        opt = _optimizer(model)
        _train(model, opt, batch[rows])
    with exchange_options(overlap=False, transport="all_gather"):
        _train(in_turn, _optimizer(in_turn), batch[rows])
    assert_bitwise_equal(model, in_turn, f"{label}: overlapped auto, all_gather in turn")

    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=f"{label}: {name}"
        )

    # optimizer state follows the param sharding: each rank holds its shard's share
    world = dist.get_world_size()
    shards = mesh.size(mesh.ndim - 1)
    mine = _state_bytes(opt)
    full = _state_bytes(ref_opt)
    gathered: list[dict[str, int]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    for name in full:
        per_replica = sum(g[name] for g in gathered) / (world // shards)
        assert per_replica == full[name], (label, name, per_replica, full[name])
        # up to padding: ceil-division rows per shard
        assert mine[name] <= full[name] / shards * 1.35 + 512, (label, name, mine[name], full[name])


def _check_teams(mesh: Any, rows: slice, sizes: tuple[int, ...], label: str) -> None:
    """Matrices shared by teams of ranks: one process's numbers, every rank computing."""
    import hyper_parallel_builtins.muon._team as muon_module

    torch.manual_seed(0)
    reference = TinyLM(qkv_bias=False)
    initial = copy.deepcopy(reference)
    batch = _batch()
    _train(reference, _optimizer(reference), batch)
    real, calls = muon_module.newton_schulz_team, []

    def counted(slices: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(slices))
        return real(slices, *args, **kwargs)

    for size in sizes:
        calls.clear()
        trained = {}
        for overlap in (True, False):
            model = _sharded_copy(initial, mesh)
            with exchange_options(overlap=overlap, team_size=str(size)):
                muon_module.newton_schulz_team = counted  # type: ignore[assignment]
                try:
                    _train(model, _optimizer(model), batch[rows])
                finally:
                    muon_module.newton_schulz_team = real
            trained[overlap] = model
        assert_bitwise_equal(trained[True], trained[False], f"{label}, teams of {size}")
        # without kept work buffers (Muon.workspace = None): bitwise the same numbers
        fresh = _sharded_copy(initial, mesh)
        with exchange_options(overlap=True, team_size=str(size)):
            opt = _optimizer(fresh)
            opt.optimizers["muon"].workspace = None
            _train(fresh, opt, batch[rows])
        assert_bitwise_equal(trained[True], fresh, f"{label}, teams of {size}, no workspace")
        for (name, p), q in zip(trained[True].named_parameters(), reference.parameters(),
                                strict=True):  # fmt: skip
            torch.testing.assert_close(
                p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5,
                msg=f"{label}, teams of {size}: {name}",
            )  # fmt: skip
        # every rank takes a slice of each of the step's 14 matrices that its team holds
        shared = [0] * dist.get_world_size()
        dist.all_gather_object(shared, sum(calls))
        assert all(n > 0 for n in shared), (label, size, shared)
        assert sum(shared) == 2 * STEPS * 14 * size, (label, size, shared)
    if mesh.ndim == 1:
        model = _sharded_copy(initial, mesh)
        lm_loss(model, batch[rows]).backward()
        with (
            exchange_options(overlap=True, team_size="3"),
            pytest.raises(
                ValueError,
                match=r"HYPER_PARALLEL_TEAM_SIZE=3: it does not divide the 4 ranks that exchange",
            ),
        ):
            _optimizer(model).step()


def _check_callables(mesh: Any, rows: slice, label: str) -> None:
    """HyperParallel's reshape_fn and post_update_fn on the owner path: whole matrices, one's numbers."""
    torch.manual_seed(0)
    reference = TinyLM(qkv_bias=False)
    model = _sharded_copy(reference, mesh)
    full_shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    seen: list[tuple[str, tuple[int, ...]]] = []
    updated: list[str | None] = []

    def halves(name: str, update: torch.Tensor) -> list[torch.Tensor]:
        seen.append((name, tuple(update.shape)))
        return list(update.chunk(2, dim=-1))

    def record(param: torch.Tensor, local: torch.Tensor, context: Any) -> None:
        updated.append(context.param_fqn)

    callables = {"reshape_fn": halves, "post_update_fn": record}
    _train(reference, _optimizer(reference, muon_kwargs=callables), _batch())
    seen.clear()
    updated.clear()
    _train(model, _optimizer(model, muon_kwargs=callables), _batch()[rows])
    assert seen and all(shape == full_shapes[name] for name, shape in seen), (label, seen)
    assert len(updated) == STEPS * 14, (label, len(updated))  # every Muon param, every step
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=f"{label}: {name}"
        )


def _initial() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyLM(qkv_bias=False)


def _fsdp_and_hsdp(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    per_rank = 4 // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    flat = init_device_mesh("cpu", (world_size,))
    _check_against_one_process(flat, rows, f"fsdp x{world_size}")
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        _check_against_one_process(mesh, rows, "hsdp 2x2")
        _check_teams(flat, rows, (2, 4), "fsdp x4")
        _check_teams(mesh, rows, (4,), "hsdp 2x2")
    else:
        _check_callables(flat, rows, f"fsdp x{world_size}")


def _work_is_spread(rank: int, world_size: int) -> None:
    """Every rank runs Newton-Schulz on some matrices, none on all of them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with counting_newton_schulz() as calls:
        torch.manual_seed(0)
        model = TinyLM()
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _optimizer(model, sharding="fsdp")
        lm_loss(model, _batch()[rank * 2 : rank * 2 + 2]).backward()
        opt.step()
    done = sum(calls)
    counts = [0] * world_size
    dist.all_gather_object(counts, done)
    assert sum(counts) == 14 and all(0 < c < 14 for c in counts), counts

    from torch.distributed.tensor import DTensor, Partial

    from hyper_parallel.core.distributed import WholeMatrices
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    partial = DTensor.from_local(torch.ones(3, 3), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"a Partial value is not a matrix yet"):
        FSDPBackend().map_blocks(lambda ts: ts, [partial], [WholeMatrices()])

    overlapped = _exchange_order(model, overlap=True)
    in_turn = _exchange_order(model, overlap=False)
    exchanges = overlapped.count("exchange")
    assert exchanges > 2 and exchanges == in_turn.count("exchange"), (overlapped, in_turn)
    # the second bucket is on its way before the first one computes; without overlap
    # each bucket's two exchanges come before the next bucket's
    assert overlapped[:2] == ["exchange", "exchange"], overlapped
    assert in_turn[:2] == ["exchange", "compute"], in_turn
    assert overlapped.count("compute") == in_turn.count("compute")


def _blockwise(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """A transform that reads its whole block: a wrong block shows in the result."""
    return [b * b.sum() for b in blocks]


def _exchange_order(model: torch.nn.Module, *, overlap: bool) -> list[str]:
    """The order of this rank's exchanges and Newton-Schulz calls in one Muon step."""
    import hyper_parallel_builtins.muon._update as muon_module
    from hyper_parallel.core.optimizer import Muon

    events: list[str] = []
    compute = muon_module.newton_schulz_stack_

    def computing(*args: Any, **kwargs: Any) -> Any:
        events.append("compute")
        return compute(*args, **kwargs)

    matrices = [p for p in model.parameters() if p.ndim == 2 and p.grad is not None]
    with exchange_options(overlap=overlap), recording_exchanges(events):  # type: ignore[arg-type]
        opt = Muon(matrices, lr=0.02)
        muon_module.newton_schulz_stack_ = computing  # type: ignore[assignment]
        try:
            opt.step()
        finally:
            muon_module.newton_schulz_stack_ = compute
    return events


def test_fsdp_two_ranks_equals_one_process() -> None:
    run_distributed(_fsdp_and_hsdp, world_size=2)


def test_fsdp_four_ranks_and_hsdp_2x2_equal_one_process() -> None:
    run_distributed(_fsdp_and_hsdp, world_size=4)


def test_newton_schulz_work_is_spread_over_ranks() -> None:
    run_distributed(_work_is_spread, world_size=2)


def _ddp_share(rank: int, world_size: int) -> None:
    """DDP-replicated params: each rank orthogonalizes a share; every rank ends equal to one process."""
    torch.manual_seed(0)
    reference = TinyLM(qkv_bias=False)
    model = copy.deepcopy(reference)
    ref_opt = _optimizer(reference)
    _train(reference, ref_opt, _batch())
    with counting_newton_schulz() as calls:
        opt = _optimizer(model, sharding="ddp")
        for _ in range(STEPS):  # DDP: the same full-batch grads on every rank
            lm_loss(model, _batch()).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-5, msg=f"ddp: {name}")
    counts = [0] * world_size
    dist.all_gather_object(counts, sum(calls))
    assert sum(counts) == 14 * STEPS and all(0 < c < 14 * STEPS for c in counts), counts


def test_ddp_replicas_split_the_work() -> None:
    run_distributed(_ddp_share, world_size=2)
