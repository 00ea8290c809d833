"""SwapOptimizer: state on disk between steps, the same numbers as without it."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

from conftest import TinyLM, lm_loss
from hyper_parallel import checkpoint
from hyper_parallel.core.optimizer import SwapOptimizer, SwapOptimizerConfig, get_hyper_optimizer
from hyper_parallel.core.optimizer._swap import is_swap_optimizer

STEPS = 20


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(seed))


def _build(**kwargs: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    return model, get_hyper_optimizer(model, **kwargs)


def _train(model: nn.Module, opt: Any, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        lm_loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _assert_same(a: tuple[nn.Module, Any], b: tuple[nn.Module, Any]) -> None:
    for (name, p), q in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert _flat(sa).keys() == _flat(sb).keys()
    for key, value in _flat(sa).items():
        other = _flat(sb)[key]
        same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        assert same, key


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix: tree}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"partitioner": "by_shape", "muon_lr": 0.02, "adamw_lr": 3e-3},  # Muon + AdamW
        {"muon": {"lr": 0.02}, "sinkhorn": {"lr": 0.01}, "adamw": {}},  # with Sinkhorn
    ],
    ids=["muon+adamw", "muon+sinkhorn+adamw"],
)
def test_twenty_steps_on_disk_equal_the_unswapped_optimizer_bitwise(
    kwargs: dict[str, Any], tmp_path: Path
) -> None:
    plain = _build(**kwargs)
    model, inner = _build(**kwargs)
    swapped = SwapOptimizer(inner, swap_times=4, tier="disk", disk_path=tmp_path, min_numel=0)
    _train(*plain, STEPS)
    _train(model, swapped, STEPS)
    _assert_same(plain, (model, swapped))
    # between steps every state tensor is the tier's file-backed copy
    stored = [t for t in _flat(swapped.state_dict()).values() if isinstance(t, torch.Tensor)]
    assert stored and all(not t.untyped_storage().resizable() for t in stored)
    assert len(list(tmp_path.iterdir())) >= len(stored) // 2


def test_fp32_main_params_swap_to_the_same_numbers(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, Any]:
        model, _ = _build()
        model.to(torch.bfloat16)
        return model, get_hyper_optimizer(model, partitioner="by_shape", fp32_main_params=True)

    plain, (model, inner) = build(), build()
    swapped = SwapOptimizer(inner, swap_times=3, tier="disk", disk_path=tmp_path)
    _train(*plain, 6)
    _train(model, swapped, 6)
    _assert_same(plain, (model, swapped))


def test_at_most_two_batches_are_resident(tmp_path: Path) -> None:
    model, inner = _build(partitioner="by_shape")
    opt = SwapOptimizer(inner, swap_times=4, tier="disk", disk_path=tmp_path, min_numel=0)
    _train(model, opt, 2)
    sizes = sorted(
        (sum(s.local_bytes for (i, pid, _), s in opt._slots.items() if (i, pid) in ids) for ids in (
            {(i, id(p)) for i, p in batch} for batch in opt._batches()
        )),
        reverse=True,
    )  # fmt: skip
    assert len(sizes) == 4
    assert 0 < opt.peak_resident_bytes <= sizes[0] + sizes[1]
    total = sum(s.local_bytes for s in opt._slots.values())
    assert opt.peak_resident_bytes < total


@pytest.mark.parametrize(
    ("save_swapped", "load_swapped"), [(True, False), (False, True), (True, True)]
)
def test_checkpoints_round_trip_with_and_without_swapping(
    save_swapped: bool, load_swapped: bool, tmp_path: Path
) -> None:
    def build(swapped: bool, where: str) -> tuple[nn.Module, Any]:
        model, opt = _build(partitioner="by_shape")
        if swapped:
            opt = SwapOptimizer(opt, swap_times=2, tier="disk", disk_path=tmp_path / where)
        return model, opt

    first = build(save_swapped, "a")
    _train(*first, 3)
    checkpoint.save(tmp_path / "ckpt", model=first[0], optimizer=first[1], step=3)
    second = build(load_swapped, "b")
    assert checkpoint.load(tmp_path / "ckpt", model=second[0], optimizer=second[1]) == 3
    _train(*first, 2, first=3)
    _train(*second, 2, first=3)
    for p, q in zip(first[0].parameters(), second[0].parameters(), strict=True):
        assert torch.equal(p, q)


@contextmanager
def failing_at_its_second_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer.step`` raises ``RuntimeError("injected")`` at its second call (a swapped
    step's second batch); the step is restored on leaving."""
    real_step, calls = optimizer.step, [0]

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        return real_step(*args, **kwargs)

    optimizer.step = failing_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        optimizer.step = real_step  # type: ignore[method-assign]


def test_an_exception_mid_step_leaves_a_working_optimizer(tmp_path: Path) -> None:
    model, inner = _build(partitioner="by_shape")
    opt = SwapOptimizer(inner, swap_times=4, tier="disk", disk_path=tmp_path, min_numel=0)
    _train(model, opt, 2)
    lm_loss(model, _batch(2)).backward()
    injected = pytest.raises(RuntimeError, match="injected")
    with failing_at_its_second_step(inner.optimizers["muon"]), injected:
        opt.step()
    opt.zero_grad()
    # every state tensor is back in the tier, none resident
    for index, sub in enumerate(opt._subs):
        for p, state in sub.state.items():
            for key, value in state.items():
                slot = opt._slots.get((index, id(p), key))
                assert slot is None or value is slot.stored, key
    # state_dict() is the state the optimizer steps from: an unswapped optimizer that loads it
    # (and the params) continues exactly as the swapped one does
    twin = _build(partitioner="by_shape")
    twin[1].load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), twin[0].parameters(), strict=True):
        q.data.copy_(p.data)
    _train(*twin, 2, first=3)
    _train(model, opt, 2, first=3)
    _assert_same(twin, (model, opt))


def test_options_are_checked() -> None:
    _, inner = _build()
    with pytest.raises(ValueError, match=r"swap_times must be positive \(>= 1\), got 0"):
        SwapOptimizer(inner, swap_times=0, tier="disk")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['swap_time'\]"):
        SwapOptimizer(inner, swap_time=4)
    with pytest.raises(ValueError, match=r"tier must be 'host' or 'disk', got 'ssd'"):
        SwapOptimizer(inner, tier="ssd")


def test_hyper_parallels_config_form_and_the_factory_keyword(tmp_path: Path) -> None:
    _, inner = _build()
    config = SwapOptimizerConfig(swap_times=2, tier="disk", disk_path=tmp_path)
    wrapped = SwapOptimizer(inner, config)
    assert is_swap_optimizer(wrapped) and wrapped.config.swap_times == 2
    assert SwapOptimizer(_build()[1], {"swap_times": 3, "tier": "disk"}).config.swap_times == 3
    plain = _build(partitioner="by_shape")
    model, opt = _build(
        partitioner="by_shape",
        swap_optimizer={"swap_times": 4, "tier": "disk", "disk_path": tmp_path},
    )
    assert is_swap_optimizer(opt) and set(opt.optimizers) == {"muon", "adamw"}
    _train(*plain, 3)
    _train(model, opt, 3)
    _assert_same(plain, (model, opt))


def _fsdp_swap_equals_plain(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = TinyLM(qkv_bias=False)
        fully_shard(model, mesh=mesh)  # every block, then the root
        return model, get_hyper_optimizer(model, partitioner="by_shape", muon_lr=0.02)

    plain = build()
    model, inner = build()
    opt = SwapOptimizer(inner, swap_times=3, tier="disk", disk_path=f"{root}/rank{rank}")
    per = 4 // world_size
    for step in range(4):
        for m, o in (plain, (model, opt)):
            lm_loss(m, _batch(step)[rank * per : (rank + 1) * per]).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(plain[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())


def test_fsdp_at_two_ranks_swaps_each_ranks_shards_to_the_same_numbers(tmp_path: Path) -> None:
    run_distributed(_fsdp_swap_equals_plain, world_size=2, args=(str(tmp_path),))
