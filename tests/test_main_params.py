"""fp32 main params: a bf16 model trained through fp32 main copies."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

from conftest import TinyLM, lm_loss
from hyper_parallel import (
    ChainedOptimizer,
    MainParams,
    checkpoint,
    clip_grad_norm_,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    grads_are_finite,
)
from hyper_parallel.checkpoint import CheckpointManager

STEPS = 60
FAMILIES: dict[str, Any] = {
    "muon": {"lr": 0.02},
    "sinkhorn": {"lr": 0.01},
    "adamw": {"lr": 3e-3, "weight_decay": 0.1},
}


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(seed))


def _bf16_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(torch.bfloat16)


def _build(model: nn.Module | None = None, **kwargs: Any) -> tuple[nn.Module, ChainedOptimizer]:
    model = _bf16_model() if model is None else model
    return model, get_hyper_optimizer(model, **FAMILIES, fp32_main_params=True, **kwargs)


def _mains(opt: ChainedOptimizer) -> dict[int, torch.Tensor]:
    assert opt.main_params is not None
    return {id(param): main for param, main in opt.main_params}


def _train(model: nn.Module, opt: Any, steps: int, sched: Any = None) -> None:
    for _ in range(steps):
        lm_loss(model, _batch()).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def test_main_copies_match_an_fp32_run_bitwise_and_round_into_the_params() -> None:
    model, opt = _build()
    reference = copy.deepcopy(model).float()
    ref_opt = get_hyper_optimizer(reference, **FAMILIES)
    for _ in range(STEPS):
        lm_loss(model, _batch()).backward()
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            ref.grad = param.grad.float()  # the same gradients, upcast
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    mains = _mains(opt)
    assert len(mains) == len(list(model.parameters()))  # every bf16 param has one
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        main = mains[id(param)]
        assert param.dtype == torch.bfloat16 and main.dtype == torch.float32, name
        assert torch.equal(main, ref), name
        assert torch.equal(param, main.to(torch.bfloat16)), name
        assert main.grad is None and param.grad is None, name
    for sub in opt.optimizers.values():
        buffers = [t for s in sub.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert buffers and all(t.dtype == torch.float32 for t in buffers if t.is_floating_point())


def test_adamw_updates_below_half_a_bf16_ulp_still_land() -> None:
    def run(fp32_main_params: bool) -> tuple[torch.Tensor, ChainedOptimizer]:
        weight = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        model = nn.ParameterDict({"scale": weight})
        opt = get_hyper_optimizer(
            model, muon=None, sinkhorn=None, adamw={"lr": 1e-4}, fp32_main_params=fp32_main_params
        )
        for _ in range(STEPS):
            weight.grad = torch.ones_like(weight)  # Adam's step: lr each time
            opt.step()
        return weight, opt

    half_ulp = torch.finfo(torch.bfloat16).eps / 2  # at 1.0
    assert half_ulp / 10 > 1e-4
    plain, _ = run(False)
    assert torch.equal(plain, torch.ones_like(plain))  # every update rounded away
    landed, opt = run(True)
    main = _mains(opt)[id(landed)]
    torch.testing.assert_close(main, torch.full_like(main, 1 - STEPS * 1e-4), rtol=0, atol=5e-6)
    assert torch.equal(landed, main.to(torch.bfloat16))
    assert (landed < 1).all()


def test_resume_is_bitwise_through_hyper_parallel_checkpoint(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, ChainedOptimizer, Any]:
        model, opt = _build()
        return model, opt, get_hyper_lr_scheduler(opt, "cosine", total_steps=STEPS, warmup_steps=5)

    straight = build()
    _train(straight[0], straight[1], STEPS, straight[2])
    first = build()
    _train(first[0], first[1], STEPS // 2, first[2])
    manager = CheckpointManager(tmp_path)
    manager.save(STEPS // 2, model=first[0], optimizer=first[1], scheduler=first[2])

    resumed = build()
    step = manager.load_latest(model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    assert step == STEPS // 2
    for (_, a), (_, b) in zip(
        first[1].main_params or (), resumed[1].main_params or (), strict=True
    ):
        assert torch.equal(a, b)  # the main copies themselves, not the bf16 params upcast
    _train(resumed[0], resumed[1], STEPS - STEPS // 2, resumed[2])
    for (name, p), q in zip(straight[0].named_parameters(), resumed[0].parameters(), strict=True):
        assert torch.equal(p, q), name
    ends = zip(straight[1].main_params or (), resumed[1].main_params or (), strict=True)
    for (_, a), (_, b) in ends:
        assert torch.equal(a, b)


def test_a_checkpoint_without_main_copies_rebuilds_them_and_the_reverse_drops_them(
    tmp_path: Path,
) -> None:
    model, opt = _build()
    _train(model, opt, 2)
    checkpoint.save(tmp_path / "mains", model=model, optimizer=opt, step=2)
    plain_model = _bf16_model()
    plain = get_hyper_optimizer(plain_model, **FAMILIES)
    with pytest.warns(UserWarning, match="holds fp32 main params, but this optimizer keeps none"):
        checkpoint.load(tmp_path / "mains", model=plain_model, optimizer=plain)
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)  # the model, rounded as saved
    _train(plain_model, plain, 1)

    checkpoint.save(tmp_path / "plain", model=plain_model, optimizer=plain, step=3)
    fresh_model, fresh = _build()
    with pytest.warns(
        UserWarning, match="initialized the fp32 main parameters.*cannot be recovered"
    ):
        checkpoint.load(tmp_path / "plain", model=fresh_model, optimizer=fresh)
    for param, main in fresh.main_params or ():
        assert torch.equal(main, param.float())  # remade from the loaded params
    _train(fresh_model, fresh, 1)


def test_state_dicts_with_and_without_main_copies_load_both_ways() -> None:
    model, opt = _build()
    _train(model, opt, 2)
    plain_model = copy.deepcopy(model)
    plain = get_hyper_optimizer(plain_model, **FAMILIES)
    with pytest.warns(UserWarning, match="this optimizer keeps none"):
        plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    saved = copy.deepcopy(plain.state_dict())
    assert "main_params" not in saved
    with pytest.warns(UserWarning, match="has no fp32 main params"):
        opt.load_state_dict(saved)
    for param, main in opt.main_params or ():
        assert torch.equal(main, param.float())


def test_main_grad_is_the_gradient_of_the_main_copies_and_of_fp32_params() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 2)).to(torch.bfloat16)
    model[1].bias.data = model[1].bias.data.float()  # an fp32 param among bf16 ones
    reference = copy.deepcopy(model).float()
    opt = get_hyper_optimizer(model, muon={}, adamw={}, fp32_main_params=True)
    ref_opt = get_hyper_optimizer(reference, muon={}, adamw={})
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        main_grad = torch.randn(param.shape)  # fp32: finer than a bf16 .grad could hold
        param.main_grad = main_grad  # type: ignore[attr-defined]
        param.grad = torch.full_like(param, 1e3)  # not read where a main_grad is present
        ref.grad = main_grad.clone()
    opt.step()
    ref_opt.step()
    mains = {id(p): m for p, m in opt.main_params or ()}
    assert len(mains) == 2
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        stepped = mains.get(id(param), param)
        assert torch.equal(stepped, ref)
        if id(param) in mains:
            assert param.grad is None  # released: its main copy held the gradient
    opt.zero_grad()
    assert all(getattr(p, "main_grad", None) is None for p in model.parameters())


def test_state_dict_round_trip_and_copies_keep_their_own_main_copies() -> None:
    model, opt = _build()
    _train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    saved_mains = [s["main_param"] for s in saved["state"].values() if "main_param" in s]
    assert len(saved_mains) == len(opt.main_params or ())
    _train(model, opt, 2)
    opt.load_state_dict(saved)
    held = {id(main) for _, main in opt.main_params or ()}
    subs = [g for sub in opt.optimizers.values() for g in sub.param_groups]
    in_order = [p for g in subs for p in g["params"] if id(p) in held]
    for main, value in zip(in_order, saved_mains, strict=True):
        assert torch.equal(main, value)
    short = copy.deepcopy(saved)
    short["state"][max(short["state"])]["main_param"] = torch.zeros(1)
    before = [main.clone() for main in in_order]
    with pytest.raises(ValueError, match=r"Main copy \d+ has shape .* holds \(1,\)"):
        opt.load_state_dict(short)
    assert all(torch.equal(m, b) for m, b in zip(in_order, before, strict=True))

    for twin in (copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))):
        twin_model, twin_opt = twin
        before = [p.clone() for p in model.parameters()]
        _train(twin_model, twin_opt, 1)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        for param, main in twin_opt.main_params or ():
            assert torch.equal(param, main.to(torch.bfloat16))
        assert twin_opt.param_names_by_optimizer == opt.param_names_by_optimizer


def test_param_groups_show_the_model_params_and_write_through() -> None:
    model, opt = _build()
    shown = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, shown)) == sorted(map(id, model.parameters()))
    for group, own in zip(
        opt.param_groups, [g for s in opt.optimizers.values() for g in s.param_groups], strict=True
    ):
        group["lr"] = 0.5
        assert own["lr"] == 0.5 and dict(group).keys() == own.keys()
        with pytest.raises(ValueError, match="params of a ChainedOptimizer group"):
            group["params"] = []


def test_every_interface_takes_fp32_main_params() -> None:
    model = _bf16_model()
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    built = [
        get_hyper_optimizer(
            model, muon_params=matrices, adamw_params=others, fp32_main_params=True
        ),
        get_hyper_optimizer(
            model,
            optimizers={"muon": {"params": matrices}, "adamw": {"params": others}},
            fp32_main_params=True,
        ),
        get_hyper_optimizer(model, partitioner="by_shape", fp32_main_params=True),
        get_hyper_optimizer(model, **FAMILIES, fp32_main_params=True),
    ]
    names = [name for name, _ in model.named_parameters()]
    for opt in built:
        assert len(opt.main_params or ()) == len(names)
        held = [p for sub in opt.optimizers.values() for g in sub.param_groups for p in g["params"]]
        assert all(p.dtype == torch.float32 for p in held)
        assert sorted(n for ns in opt.param_names_by_optimizer.values() for n in ns) == sorted(
            names
        )


def test_gradient_checks_and_clipping_see_the_model_gradients() -> None:
    model, opt = _build()
    lm_loss(model, _batch()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norms = clip_grad_norm_(opt, max_norm=1e9, per_optimizer=True)
    for sub_name, param_names in opt.param_names_by_optimizer.items():
        want = torch.linalg.vector_norm(torch.stack([grads[n].float().norm() for n in param_names]))
        torch.testing.assert_close(norms[sub_name].float(), want, rtol=1e-2, atol=0)
    assert grads_are_finite(opt)
    model.norm.weight.grad[0] = float("nan")
    assert not grads_are_finite(opt)


def test_added_group_gets_main_copies_and_misuse_is_refused() -> None:
    model = _bf16_model()
    extra = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    opt = get_hyper_optimizer(model, **FAMILIES, fp32_main_params=True)
    opt.add_param_group({"params": [extra]}, optimizer="adamw")
    main = _mains(opt)[id(extra)]
    assert main.dtype == torch.float32 and opt.grad_params("adamw")[-1] is extra
    extra.grad = torch.ones_like(extra)
    opt.step()
    assert torch.equal(extra, main.to(torch.bfloat16)) and not torch.equal(
        extra, torch.zeros_like(extra)
    )

    weight = nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    mains = MainParams([weight])
    with pytest.raises(ValueError, match="has a main copy"):
        ChainedOptimizer({"sgd": torch.optim.SGD([weight], lr=0.1)}, main_params=mains)
    with pytest.raises(ValueError, match="in no sub-optimizer"):
        ChainedOptimizer(
            {"sgd": torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)}, main_params=mains
        )


# -- FSDP ------------------------------------------------------------------------


def _fsdp_matches_one_process(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    one, one_opt = _build()
    sharded = fully_shard(copy.deepcopy(one), mesh=mesh)
    _, sharded_opt = _build(sharded)
    _train(one, one_opt, STEPS)
    _train(sharded, sharded_opt, STEPS)  # every rank the same batch: the mean is exact
    one_mains = _mains(one_opt)
    sharded_mains = _mains(sharded_opt)
    for (name, p), q in zip(one.named_parameters(), sharded.parameters(), strict=True):
        main = sharded_mains[id(q)]
        assert main.placements == q.placements and main.dtype == torch.float32, name
        torch.testing.assert_close(main.full_tensor(), one_mains[id(p)], rtol=0, atol=1e-6)
        assert torch.equal(q.full_tensor(), main.full_tensor().to(torch.bfloat16)), name


def test_fsdp_two_ranks_equal_one_process() -> None:
    run_distributed(_fsdp_matches_one_process, world_size=2)


def test_a_main_grad_is_used_once_however_the_loop_clears_gradients() -> None:
    """main_grad moves into the main copy at the step and is released: a trainer that clears
    gradients with model.zero_grad() (which knows nothing of main_grad) does not add it twice."""
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    optimizers = [
        get_hyper_optimizer(m, adamw={"lr": 1e-2}, fp32_main_params=True) for m in (model, twin)
    ]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
        for m in (model, twin):
            for p, g in zip(m.parameters(), grads, strict=True):
                p.main_grad = g.clone()  # type: ignore[attr-defined]
        optimizers[0].step()
        model.zero_grad()  # a trainer's way: main_grad untouched
        optimizers[1].step()
        optimizers[1].zero_grad()
        assert all(getattr(p, "main_grad", None) is None for p in model.parameters())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
