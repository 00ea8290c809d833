"""HyperParallel's SwapOptimizer and ChainedOptimizer behaviour, here.

Facts from HyperParallel's ``core/optimizer/swap_optimizer.py`` (its config
normalizes ``state_keys`` to a tuple and ``packed_swap=None`` to the
backend's default, ``True`` on torch), its torch swap runtime (a state tensor
on the CPU is not swappable: it stays where it is), its MindSpore adapter and
Trainer config (``include_master_params`` swaps the optimizer's fp32 master
params too, each batch rounding its own into the model), its
``tests/.../test_swap_optimizer.py``, and its ``core/optimizer/optimizer.py``
(``ChainedOptimizer``: iterating gives the sub-optimizers, ``defaults`` is
the first one's, ``param_groups`` has a setter).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from test_swap import failing_at_its_second_step
from torch import nn

from conftest import TinyLM, lm_loss
from hyper_parallel import checkpoint
from hyper_parallel.core.optimizer import (
    AdamW,
    ChainedOptimizer,
    Muon,
    SwapOptimizer,
    SwapOptimizerConfig,
    get_hyper_optimizer,
)

STEPS = 6


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(seed))


def _train(model: nn.Module, opt: Any, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        lm_loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys(), index
        for key, value in entry.items():
            other = b["state"][index][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, (index, key)


# -- SwapOptimizerConfig ------------------------------------------------------------------


def test_the_config_has_hyperparallels_defaults_and_normalizations() -> None:
    config = SwapOptimizerConfig()
    assert (config.swap_times, config.min_numel, config.include_master_params) == (16, 1024, False)
    assert config.state_keys is None and config.packed_swap is True
    assert SwapOptimizerConfig(packed_swap=False).packed_swap is False
    assert SwapOptimizerConfig(packed_swap=None).packed_swap is True  # torch's backend default
    keys = SwapOptimizerConfig(state_keys=["exp_avg_sq", "exp_avg"]).state_keys
    assert keys == ("exp_avg_sq", "exp_avg") and isinstance(keys, tuple)
    both = SwapOptimizerConfig(include_master_params=True, state_keys=("exp_avg", "master_param"))
    assert both.state_keys == ("exp_avg", "master_param")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.swap_times = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="swap_times must be positive"):
        SwapOptimizerConfig(swap_times=0)
    with pytest.raises(ValueError, match="min_numel must be non-negative"):
        SwapOptimizerConfig(min_numel=-1)


def test_naming_the_main_copies_without_swapping_them_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"'master_param'.*include_master_params=True"):
        SwapOptimizerConfig(state_keys=("exp_avg", "master_param"))
    with pytest.raises(TypeError, match="include_master_params must be True or False"):
        SwapOptimizerConfig(include_master_params="yes")  # type: ignore[arg-type]


# -- the host tier on a CPU: the state stays where it is ----------------------------------


def _adam_with_state(param: nn.Parameter) -> torch.optim.Adam:
    """HyperParallel's test set-up: Adam state made before wrapping."""
    optimizer = torch.optim.Adam([param], lr=0.01)
    values = torch.arange(1, param.numel() + 1, dtype=param.dtype).view_as(param)
    optimizer.state[param].update(
        step=torch.tensor(1.0), exp_avg=values.clone(), exp_avg_sq=values.square()
    )
    return optimizer


def test_a_cpu_adam_wraps_with_the_default_config_and_steps_as_unwrapped() -> None:
    torch.manual_seed(0)
    plain_param = nn.Parameter(torch.randn(64, 48))
    param = nn.Parameter(plain_param.detach().clone())
    plain = _adam_with_state(plain_param)
    inner = _adam_with_state(param)
    exp_avg = inner.state[param]["exp_avg"]
    wrapped = SwapOptimizer(inner, SwapOptimizerConfig())  # tier="host", on a CPU
    assert wrapped.state[param]["exp_avg"] is exp_avg  # already in host memory: left in place
    for step in range(5):
        for p in (plain_param, param):
            p.grad = torch.full_like(p, 0.1 * (step + 1)) + p.detach() * 0.01
        plain.step()
        wrapped.step()
    assert torch.equal(plain_param, param)
    assert wrapped.peak_resident_bytes == 0  # nothing came in from a tier
    _same_state(plain.state_dict(), wrapped.state_dict())
    # HyperParallel's round trip through the wrapper's checkpoint API
    twin_param = nn.Parameter(torch.ones(64, 48))
    twin = SwapOptimizer(_adam_with_state(twin_param), SwapOptimizerConfig())
    twin.load_state_dict(wrapped.state_dict())
    assert torch.equal(twin.state[twin_param]["exp_avg"], wrapped.state[param]["exp_avg"])


def test_the_factorys_swap_keyword_works_on_a_cpu_too() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    twin = copy.deepcopy(model)
    plain = get_hyper_optimizer(model, partitioner="by_shape")
    swapped = get_hyper_optimizer(twin, partitioner="by_shape", swap_optimizer=True)
    assert isinstance(swapped, SwapOptimizer) and swapped.config.tier == "host"
    for group in plain.param_groups:
        group["lr"] /= 2
    swapped.param_groups = [{**g, "lr": g["lr"] / 2} for g in swapped.param_groups]  # as HP's
    _train(model, plain, 3)
    _train(twin, swapped, 3)
    _same_params(model, twin)


# -- include_master_params: the fp32 main copies in the tier ------------------------------


def _bf16(**kwargs: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    families = {"muon": {"lr": 0.02}, "adamw": {"lr": 3e-3, "weight_decay": 0.1}}
    return model, get_hyper_optimizer(model, **families, fp32_main_params=True, **kwargs)


def _swapping_mains(path: Path, **options: Any) -> tuple[nn.Module, SwapOptimizer]:
    model, inner = _bf16()
    options = {"swap_times": 3, "tier": "disk", "disk_path": path, "min_numel": 0, **options}
    return model, SwapOptimizer(inner, include_master_params=True, **options)


def _mains_in_the_tier(opt: SwapOptimizer) -> bool:
    """Every main copy's values are file-backed (the disk tier), none resident."""
    return all(not main.untyped_storage().resizable() for _, main in opt.main_params)


def test_swapped_main_copies_train_to_the_same_numbers(tmp_path: Path) -> None:
    plain = _bf16()
    model, opt = _swapping_mains(tmp_path)
    held = [main for _, main in opt.main_params]
    assert _mains_in_the_tier(opt)  # from the start
    _train(*plain, STEPS)
    _train(model, opt, STEPS)
    _same_params(plain[0], model)
    _same_state(plain[1].state_dict(), opt.state_dict())  # "main_param" entries included
    assert _mains_in_the_tier(opt)
    assert [main for _, main in opt.main_params] == held  # the same objects the optimizers hold
    state_bytes = sum(s.local_bytes for s in opt._slots.values())
    main_bytes = sum(main.numel() * 4 for main in held)
    assert 0 < opt.peak_resident_bytes < state_bytes
    assert state_bytes > main_bytes  # the copies are among what is swapped
    # the copies' gradients are gone after each batch, as after an unswapped step
    assert all(main.grad is None for main in held)


def test_only_the_main_copies_swap_when_state_keys_names_nothing_else(tmp_path: Path) -> None:
    plain = _bf16()
    model, opt = _swapping_mains(tmp_path, state_keys=("master_param",))
    _train(*plain, 3)
    _train(model, opt, 3)
    _same_params(plain[0], model)
    assert {key for _, _, key in opt._slots} == {"master_param"}
    assert all(
        value.untyped_storage().resizable()
        for sub in opt.optimizers.values()
        for state in sub.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )  # the optimizer state stayed resident


def test_swapped_main_copies_round_trip_checkpoints(tmp_path: Path) -> None:
    first = _swapping_mains(tmp_path / "a")
    _train(*first, 3)
    checkpoint.save(tmp_path / "ckpt", model=first[0], optimizer=first[1], step=3)
    unswapped, swapped = _bf16(), _swapping_mains(tmp_path / "b")
    for second in (unswapped, swapped):
        assert checkpoint.load(tmp_path / "ckpt", model=second[0], optimizer=second[1]) == 3
    assert _mains_in_the_tier(swapped[1])  # loaded into the tier's copies
    # torch's format: the swapped chain's state_dict() loads into an unswapped chain
    again = _bf16()
    again[0].load_state_dict(first[0].state_dict())
    again[1].load_state_dict(copy.deepcopy(first[1].state_dict()))  # not sharing its tensors
    for pair in (first, unswapped, swapped, again):
        _train(*pair, 2, first=3)
    for pair in (unswapped, swapped, again):
        _same_params(first[0], pair[0])


def test_a_failed_batch_leaves_the_main_copies_in_the_tier_and_rounded(tmp_path: Path) -> None:
    model, opt = _swapping_mains(tmp_path, swap_times=4)
    _train(model, opt, 1)
    lm_loss(model, _batch(1)).backward()
    injected = pytest.raises(RuntimeError, match="injected")
    with failing_at_its_second_step(opt.optimizers["muon"]), injected:
        opt.step()
    assert _mains_in_the_tier(opt)
    for param, main in opt.main_params:
        assert torch.equal(param, main.to(param.dtype))  # each param is its copy, rounded
    opt.zero_grad()
    _train(model, opt, 1, first=2)  # and it steps on


def test_include_master_params_needs_an_optimizer_with_main_copies(tmp_path: Path) -> None:
    model = TinyLM()
    with pytest.raises(
        ValueError, match=r"include_master_params=True.*keeps none.*fp32_main_params"
    ):
        SwapOptimizer(
            get_hyper_optimizer(model, partitioner="by_shape"),
            include_master_params=True,
            tier="disk",
            disk_path=tmp_path,
        )


def _fsdp_main_copies_swap(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = fully_shard(TinyLM(qkv_bias=False).to(torch.bfloat16), mesh=mesh)
        return model, get_hyper_optimizer(
            model, partitioner="by_shape", muon_lr=0.02, fp32_main_params=True
        )

    plain = build()
    model, inner = build()
    opt = SwapOptimizer(
        inner, swap_times=3, tier="disk", disk_path=f"{root}/rank{rank}",
        include_master_params=True, min_numel=0,
    )  # fmt: skip
    per = 4 // world_size
    for step in range(3):
        for m, o in (plain, (model, opt)):
            lm_loss(m, _batch(step)[rank * per : (rank + 1) * per]).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(plain[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    for (_, a), (_, b) in zip(plain[1].main_params, opt.main_params, strict=True):
        assert b.placements == a.placements
        assert torch.equal(a.to_local(), b.to_local())
        assert not b.to_local().untyped_storage().resizable()  # the shard is in the tier


def test_fsdp_main_copies_swap_each_ranks_shard(tmp_path: Path) -> None:
    run_distributed(_fsdp_main_copies_swap, world_size=2, args=(str(tmp_path),))


# -- ChainedOptimizer ---------------------------------------------------------------------


def _chain(model: nn.Module) -> ChainedOptimizer:
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "proj" in n)]
    return ChainedOptimizer(
        {"muon": Muon(matrices, lr=0.02), "adamw": AdamW(rest, lr=3e-3, weight_decay=0.1)}
    )


def test_iterating_a_chain_gives_its_sub_optimizers_and_names_still_work() -> None:
    chain = _chain(TinyLM())
    muon, adamw = chain.optimizers["muon"], chain.optimizers["adamw"]
    assert list(chain) == [muon, adamw] and len(chain) == 2
    assert chain.chained_optimizers == [muon, adamw]
    assert chain.optimizers_keys == ["muon", "adamw"]
    assert chain["muon"] is muon and chain.optimizers_dict["adamw"] is adamw
    assert "muon" in chain and muon in chain and "sgd" not in chain
    total = sum(len(opt.param_groups) for opt in chain)  # HyperParallel's loop over the chain
    assert total == len(chain.param_groups)


def test_defaults_are_the_first_sub_optimizers() -> None:
    chain = _chain(TinyLM())
    muon = chain.optimizers["muon"]
    assert chain.defaults == muon.defaults and chain.defaults["lr"] == 0.02
    assert "nesterov" in chain.defaults and "amsgrad" not in chain.defaults
    chain.defaults["lr"] = 0.5  # written through, as to HyperParallel's same dict
    assert muon.defaults["lr"] == 0.5
    with pytest.raises(ValueError, match="cycle_momentum=False"):
        _ = "momentum" in chain.defaults  # Muon cycles momentum, AdamW betas


def test_the_param_groups_setter_gives_each_sub_optimizer_its_part() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    twin = copy.deepcopy(model)
    direct, setter = _chain(model), _chain(twin)
    for group in direct.param_groups:
        group["lr"] = group["lr"] / 2
    setter.param_groups = [{**group, "lr": group["lr"] / 2} for group in setter.param_groups]
    assert [g["lr"] for g in setter.optimizers["muon"].param_groups] == [0.01]
    _train(model, direct, 3)
    _train(twin, setter, 3)
    _same_params(model, twin)


def test_setting_param_groups_checks_what_hyperparallel_checks_and_more() -> None:
    chain = _chain(TinyLM())
    groups = chain.param_groups
    with pytest.raises(TypeError, match="must be set to a list"):
        chain.param_groups = tuple(groups)  # type: ignore[assignment]
    with pytest.raises(ValueError, match="has 2 groups; it was set to 1"):
        chain.param_groups = groups[:1]
    swapped = [{**groups[1]}, {**groups[0]}]  # Muon's params to AdamW and back
    with pytest.raises(ValueError, match="sub-optimizer 'muon' hold .* not its own"):
        chain.param_groups = swapped
    assert chain.param_groups == groups  # nothing changed


def test_the_setter_maps_model_params_to_their_main_copies() -> None:
    plain = _bf16()
    model, opt = _bf16()
    opt.param_groups = [dict(group) for group in opt.param_groups]  # model params, as shown
    held = [p for sub in opt for group in sub.param_groups for p in group["params"]]
    for param, main in opt.main_params:
        assert any(main is p for p in held) and not any(param is p for p in held)
    _train(*plain, 3)
    _train(model, opt, 3)
    _same_params(plain[0], model)


def test_optimizer_of_several_is_hyperparallels_value_error_and_an_attribute_error() -> None:
    chain = _chain(TinyLM())
    with pytest.raises(ValueError, match="more than one optimizer"):
        _ = chain.optimizer
    assert not hasattr(chain, "optimizer")


def test_setting_param_groups_refuses_a_typo_before_changing_anything_and_fills_defaults() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    chain = get_hyper_optimizer(model, muon={}, adamw={})
    groups = [dict(g) for g in chain.param_groups]
    before = [dict(g) for g in groups]
    groups[-1]["lrr"] = 0.1
    with pytest.raises(ValueError, match="lrr"):
        chain.param_groups = groups
    assert [set(g) for g in groups[:-1]] == [set(g) for g in before[:-1]]  # nothing filled in
    del groups[-1]["lrr"]
    trimmed = [{"params": g["params"], "lr": 0.5} for g in groups]
    chain.param_groups = trimmed
    for group, sub in zip(trimmed, [g for o in chain for g in o.param_groups], strict=True):
        assert group is sub and group["lr"] == 0.5  # the caller's dicts, completed
        assert ("weight_decay" in group and "betas" in group) or "momentum" in group


def test_a_swapped_chain_is_iterated_and_indexed_like_the_chain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    chain = get_hyper_optimizer(model, muon={}, adamw={})
    swapped = SwapOptimizer(chain, SwapOptimizerConfig())
    assert list(swapped) == list(chain) and len(swapped) == len(chain) == 2
    assert swapped["muon"] is chain["muon"] and "adamw" in swapped
    plain = SwapOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), SwapOptimizerConfig())
    assert plain  # true, though what it wraps has no len
    with pytest.raises(TypeError):
        iter(plain)
