"""torch's distributed-checkpoint helpers on our optimizers: saved, loaded, resumed bitwise.

``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and ``get_state_dict`` /
``set_state_dict`` with a ``ChainedOptimizer`` (plain, with fp32 main params, inside
a ``SwapOptimizer``), with each of their options, on one process and under FSDP2 at
2 ranks (one spawn), including ``torch.distributed.checkpoint.save``/``load`` through
files, the way torchtitan saves. "Resumes bitwise": a run saved after 3 steps and
loaded into a fresh model and optimizer (another seed) steps on to the same params
as the run that was never interrupted.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from conftest import TinyLM, lm_loss
from hyper_parallel import fully_shard, get_hyper_optimizer, init_device_mesh
from hyper_parallel.core.optimizer import SwapOptimizer, SwapOptimizerConfig

Build = Callable[[int], tuple[nn.Module, torch.optim.Optimizer]]

OPTIONS = {
    "default": None,
    "full_state_dict": StateDictOptions(full_state_dict=True),
    "cpu_offload": StateDictOptions(cpu_offload=True),
    "full_and_offload": StateDictOptions(full_state_dict=True, cpu_offload=True),
    "flatten": StateDictOptions(flatten_optimizer_state_dict=True),
}


def _batches(rank: int = 0, world_size: int = 1) -> list[torch.Tensor]:
    ids = torch.randint(0, 32, (5, 4, 9), generator=torch.Generator().manual_seed(7))
    return [step.chunk(world_size)[rank] for step in ids]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for ids in batches:
        lm_loss(model, ids).float().backward()
        optimizer.step()
        optimizer.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(_local(p), _local(q))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _plain(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    return model, get_hyper_optimizer(model)


def _bf16_mains(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM().to(torch.bfloat16)
    return model, get_hyper_optimizer(model, fp32_main_params=True)


def _swapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, chained = _plain(seed)
    return model, SwapOptimizer(chained, SwapOptimizerConfig(tier="disk", min_numel=1))


def _loading(options: StateDictOptions | None) -> StateDictOptions | None:
    """How a state dict saved with ``options`` is loaded.

    A full state dict offloaded to the CPU is on rank 0 only (the other ranks
    get an empty one); loading it broadcasts from rank 0.
    """
    if options is None or not (options.full_state_dict and options.cpu_offload):
        return options
    if not dist.is_initialized():
        return options
    return dataclasses.replace(options, broadcast_from_rank0=True)


def _resumes_bitwise(build: Build, options: StateDictOptions | None, batches: list[Any]) -> None:
    """Save after 3 steps with torch's helpers, load into a fresh run, step on: same params."""
    model, optimizer = build(0)
    _train(model, optimizer, batches[:3])
    msd, osd = copy.deepcopy(get_state_dict(model, optimizer, options=options))
    alone = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))
    weights = copy.deepcopy(model.state_dict())
    _train(model, optimizer, batches[3:])

    options = _loading(options)
    for load in ("set_state_dict", "set_optimizer_state_dict"):
        resumed, fresh = build(1)
        if load == "set_state_dict" and not (options and options.broadcast_from_rank0):
            set_state_dict(
                resumed, fresh, model_state_dict=msd, optim_state_dict=osd, options=options
            )
        elif load == "set_state_dict":
            # set_state_dict takes a rank's empty model state dict (all but rank 0's when
            # broadcasting) as "optimizer only": it would skip the broadcast rank 0 makes.
            set_model_state_dict(resumed, msd, options=options)
            set_optimizer_state_dict(resumed, fresh, osd, options=options)
        else:
            resumed.load_state_dict(weights)
            set_optimizer_state_dict(resumed, fresh, alone, options=options)
        _train(resumed, fresh, batches[3:])
        assert _same_params(model, resumed), f"{load} with {options} did not resume bitwise"


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_chained_optimizer_round_trips_through_torchs_helpers(options: Any) -> None:
    _resumes_bitwise(_plain, options, _batches())


@pytest.mark.parametrize("build", [_bf16_mains, _swapped], ids=["fp32_main_params", "swap"])
def test_main_params_and_swap_round_trip_through_torchs_helpers(build: Build) -> None:
    _resumes_bitwise(build, None, _batches())
    _resumes_bitwise(build, OPTIONS["full_and_offload"], _batches())


def test_state_is_named_by_the_model_and_keeps_main_copies() -> None:
    model, optimizer = _bf16_mains(0)
    _train(model, optimizer, _batches()[:1])
    osd = get_optimizer_state_dict(model, optimizer)
    names = {name for name, _ in model.named_parameters()}
    assert set(osd["state"]) == names
    for name, param in model.named_parameters():
        main = osd["state"][name]["main_param"]
        assert main.dtype == torch.float32 and torch.equal(main.to(param.dtype), param)
    owners = {group["optimizer"] for group in osd["param_groups"]}
    assert owners == set(optimizer.optimizers)  # type: ignore[attr-defined]


# -- FSDP2, 2 ranks: one spawn ----------------------------------------------------


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard(TinyLM(), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, get_hyper_optimizer(model)


def _sharded_mains(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM().to(torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, get_hyper_optimizer(model, fp32_main_params=True)


def _check_fsdp(rank: int, world_size: int, tmp: str) -> None:
    batches = _batches(rank, world_size)
    for options in OPTIONS.values():
        _resumes_bitwise(_sharded, options, batches)
    _resumes_bitwise(_sharded_mains, None, batches)
    _resumes_bitwise(_sharded_mains, OPTIONS["full_and_offload"], batches)

    # Through files, as torchtitan saves: DCP writes each rank's shards of the state.
    model, optimizer = _sharded(0)
    _train(model, optimizer, batches[:3])
    msd, osd = get_state_dict(model, optimizer)
    assert all(isinstance(v, DTensor) for s in osd["state"].values() for v in s.values() if v.dim())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=Path(tmp, "step3"))
    _train(model, optimizer, batches[3:])

    resumed, fresh = _sharded(1)
    msd, osd = get_state_dict(resumed, fresh)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=Path(tmp, "step3"))
    set_state_dict(resumed, fresh, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(resumed, fresh, batches[3:])
    assert _same_params(model, resumed)


def test_fsdp_two_ranks_resume_bitwise_through_torchs_helpers(tmp_path: Path) -> None:
    run_distributed(_check_fsdp, world_size=2, args=(str(tmp_path),))
