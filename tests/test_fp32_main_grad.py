"""``MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)`` under ``fully_shard``.

HyperParallel's flag: each reduced gradient shard lands in the sharded param's fp32 ``main_grad``
(added to it, so micro-batches accumulate in fp32) and ``.grad`` stays ``None``; fp32 main params
step with it. A bf16 model on 2 CPU processes against one process that feeds its main copies the
same gradients averaged and summed in fp32, at the main-params test's FSDP tolerance; one
spawn per mesh.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from conftest import TinyLM, lm_loss
from hyper_parallel import (
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
    get_hyper_optimizer,
    grads_are_finite,
)
from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelTypeError

#: tests/test_main_params.py's tolerance for sharded main copies against one process.
TOLERANCE: dict[str, Any] = {"rtol": 0, "atol": 1e-6}
STEPS, MICRO = 4, 2
FAMILIES: dict[str, Any] = {
    "muon": {"lr": 0.02},
    "sinkhorn": {"lr": 0.01},
    "adamw": {"lr": 3e-3, "weight_decay": 0.1},
}
POLICY = MixedPrecisionPolicy(reduce_dtype=torch.float32, apply_grad_on_fp32_main_grad=True)


def _batch(seed: int, rank: int) -> torch.Tensor:
    """A different batch on each rank, so that the mean gradient is not a bf16 number."""
    generator = torch.Generator().manual_seed(1000 * rank + seed)
    return torch.randint(0, 32, (4, 9), generator=generator)


def _bf16_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(torch.bfloat16)


def _fp32_sums(model: nn.Module, seeds: list[int], world_size: int) -> list[torch.Tensor]:
    """Each param's bf16 gradients, upcast, averaged over the ranks' batches and summed over
    the micro-batches in fp32: what FSDP's fp32 reduction of them holds (one process)."""
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for seed in seeds:
        for rank in range(world_size):
            lm_loss(model, _batch(seed, rank)).backward()
            for total, param in zip(sums, model.parameters(), strict=True):
                total += param.grad.float() / world_size
                param.grad = None
    return sums


def _main_grads(model: nn.Module) -> list[torch.Tensor]:
    grads = []
    for name, param in model.named_parameters():
        main_grad = param.main_grad  # type: ignore[attr-defined]
        assert param.grad is None, name  # released: the gradient is in main_grad
        assert isinstance(main_grad, DTensor) and main_grad.dtype == torch.float32, name
        assert main_grad.placements == param.placements, name
        grads.append(main_grad.full_tensor())
    return grads


def _check_landing(mesh: Any, rank: int, world_size: int) -> None:
    """main_grad holds the fp32 mean, summed over micro-batches; bf16 .grad would not."""
    one = _bf16_model()
    want = _fp32_sums(one, [1, 2, 3], world_size)
    sharded = fully_shard(copy.deepcopy(one), mesh=mesh, mp_policy=POLICY)
    for seed in (1, 2, 3):
        lm_loss(sharded, _batch(seed, rank)).backward()
    for got, ref in zip(_main_grads(sharded), want, strict=True):
        torch.testing.assert_close(got, ref, **TOLERANCE)

    plain = TorchMixedPrecisionPolicy(reduce_dtype=torch.float32)  # the same, into bf16 .grad
    rounded = fully_shard(copy.deepcopy(one), mesh=mesh, mp_policy=plain)
    for seed in (1, 2, 3):
        lm_loss(rounded, _batch(seed, rank)).backward()
    worst = max(
        (p.grad.full_tensor().float() - ref).abs().max().item()
        for p, ref in zip(rounded.parameters(), want, strict=True)
    )
    assert worst > 100 * TOLERANCE["atol"]  # so the check above can tell the two apart

    for param in sharded.parameters():
        param.main_grad = None  # type: ignore[attr-defined]
    sharded.set_gradient_scaling_factor(0.5)  # type: ignore[operator]
    lm_loss(sharded, _batch(4, rank)).backward()
    halves = [0.5 * g for g in _fp32_sums(one, [4], world_size)]
    for got, ref in zip(_main_grads(sharded), halves, strict=True):
        torch.testing.assert_close(got, ref, **TOLERANCE)
    _check_clipping_and_checks_read_main_grad(sharded, halves)


def _check_clipping_and_checks_read_main_grad(sharded: nn.Module, want: list[torch.Tensor]) -> None:
    """clip_grad_norm_ and grads_are_finite read main_grad where .grad is None."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want]))
    total = clip_grad_norm_(list(sharded.parameters()), max_norm=float(norm) / 2)
    torch.testing.assert_close(total.full_tensor() if isinstance(total, DTensor) else total, norm)
    for got, ref in zip(_main_grads(sharded), want, strict=True):
        torch.testing.assert_close(got, ref / 2, rtol=1e-5, atol=1e-6)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    assert grads_are_finite(optimizer)
    first = next(iter(sharded.parameters()))
    first.main_grad.to_local().view(-1)[0] = float("nan")  # type: ignore[attr-defined]
    assert not grads_are_finite(optimizer)  # every rank joins: one verdict


def _check_training(mesh: Any, rank: int, world_size: int) -> None:
    """fp32 main params step with main_grad: the same main copies as one process, step by step."""
    one = _bf16_model()
    sharded = fully_shard(copy.deepcopy(one), mesh=mesh, mp_policy=POLICY)
    one_opt = get_hyper_optimizer(one, **FAMILIES, fp32_main_params=True)
    sharded_opt = get_hyper_optimizer(sharded, **FAMILIES, fp32_main_params=True)
    for step in range(STEPS):
        seeds = [10 * step + k for k in range(MICRO)]
        sums = _fp32_sums(one, seeds, world_size)
        for param, total in zip(one.parameters(), sums, strict=True):
            param.main_grad = total  # type: ignore[attr-defined]
        for seed in seeds:
            lm_loss(sharded, _batch(seed, rank)).backward()
        one_opt.step()
        sharded_opt.step()
        one_opt.zero_grad()
        sharded_opt.zero_grad()
        assert all(getattr(p, "main_grad", None) is None for p in sharded.parameters())
    one_mains = {id(p): m for p, m in one_opt.main_params or ()}
    sharded_mains = {id(p): m for p, m in sharded_opt.main_params or ()}
    assert len(sharded_mains) == len(list(sharded.parameters()))
    for (name, p), q in zip(one.named_parameters(), sharded.parameters(), strict=True):
        main = sharded_mains[id(q)]
        torch.testing.assert_close(main.full_tensor(), one_mains[id(p)], **TOLERANCE)
        assert torch.equal(q.full_tensor(), main.full_tensor().to(torch.bfloat16)), name


def _check_optimizers_that_read_grad_are_stopped(mesh: Any, rank: int) -> None:
    sharded = fully_shard(_bf16_model(), mesh=mesh, mp_policy=POLICY)
    for optimizer in (
        torch.optim.SGD(sharded.parameters(), lr=0.1),
        get_hyper_optimizer(sharded, **FAMILIES),  # no fp32 main params: it steps .grad
    ):
        lm_loss(sharded, _batch(5, rank)).backward()
        before = [p.full_tensor() for p in sharded.parameters()]
        with pytest.raises(
            HyperParallelRuntimeError,
            match=r"\.step\(\): .*'s gradient is in its main_grad .* its \.grad is None.*"
            r"get_hyper_optimizer\(\.\.\., fp32_main_params=True\)",
        ) as info:
            optimizer.step()
        assert isinstance(info.value, RuntimeError)
        after = [p.full_tensor() for p in sharded.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        for param in sharded.parameters():
            param.main_grad = None  # type: ignore[attr-defined]


def _on_a_1d_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    _check_landing(mesh, rank, world_size)
    _check_training(mesh, rank, world_size)
    _check_optimizers_that_read_grad_are_stopped(mesh, rank)


def _on_an_hsdp_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    _check_landing(mesh, rank, world_size)  # through HSDP's all-reduce, not a reduce-scatter


def test_fsdp_main_grad_accumulates_in_fp32_and_trains_as_one_process() -> None:
    run_distributed(_on_a_1d_mesh, world_size=2)


def test_hsdp_main_grad_accumulates_in_fp32() -> None:
    run_distributed(_on_an_hsdp_mesh, world_size=2)


def test_the_policy_is_torchs_plus_hyper_parallels_flag() -> None:
    assert issubclass(MixedPrecisionPolicy, TorchMixedPrecisionPolicy)
    assert MixedPrecisionPolicy().apply_grad_on_fp32_main_grad is False
    # HyperParallel's field order: param_dtype, reduce_dtype, output_dtype, cast_forward_inputs
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, True, True)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert policy.apply_grad_on_fp32_main_grad is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.apply_grad_on_fp32_main_grad = False  # type: ignore[misc]
    with pytest.raises(HyperParallelTypeError, match=r"takes True or False, got 'yes'") as info:
        MixedPrecisionPolicy(apply_grad_on_fp32_main_grad="yes")  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
