"""ChainedOptimizer behaves like one torch Optimizer to schedulers, GradScaler and users."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from conftest import TinyLM, lm_loss
from hyper_parallel.core.optimizer import AdamW, ChainedOptimizer, Muon


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "proj" in n)]
    return matrices, rest


def _chained(model: nn.Module, **muon: Any) -> ChainedOptimizer:
    matrices, rest = _split(model)
    return ChainedOptimizer(
        {
            "muon": Muon(matrices, lr=0.02, momentum=0.95, **muon),
            "adamw": AdamW(rest, lr=3e-3, weight_decay=0.1),
        }
    )


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int
) -> None:
    for _ in range(steps):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_step_equals_stepping_the_parts(batch: torch.Tensor) -> None:
    torch.manual_seed(0)
    a = TinyLM()
    b = copy.deepcopy(a)
    chained = _chained(a)
    matrices, rest = _split(b)
    muon, adamw = Muon(matrices, lr=0.02, momentum=0.95), AdamW(rest, lr=3e-3, weight_decay=0.1)
    _train(a, chained, batch, 3)
    for _ in range(3):
        lm_loss(b, batch).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_param_groups_are_the_sub_optimizers_own_dicts(model: nn.Module) -> None:
    chained = _chained(model)
    muon_group = chained.optimizers["muon"].param_groups[0]
    adamw_group = chained.optimizers["adamw"].param_groups[0]
    assert chained.param_groups[0] is muon_group
    assert chained.param_groups[1] is adamw_group
    chained.param_groups[1]["lr"] = 1.0
    assert chained.optimizers["adamw"].param_groups[0]["lr"] == 1.0
    assert isinstance(chained, torch.optim.Optimizer)


_SCHEDULERS = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lr_scheduler.PolynomialLR(o, total_iters=5, power=2.0),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lambda s: 0.9),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(
        o, base_lr=[1e-3, 1e-4], max_lr=[1e-2, 1e-3], step_size_up=2, cycle_momentum=False
    ),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(
        o, max_lr=[0.02, 3e-3], total_steps=10, cycle_momentum=False
    ),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o,
        [
            lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            lr_scheduler.ExponentialLR(o, gamma=0.9),
        ],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(
        [
            lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
            lr_scheduler.ExponentialLR(o, gamma=0.9),
        ]
    ),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


def test_every_torch_scheduler_class_is_covered() -> None:
    classes = {
        name
        for name, obj in vars(lr_scheduler).items()
        if inspect.isclass(obj)
        and issubclass(obj, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))
        and obj not in (lr_scheduler.LRScheduler, lr_scheduler._LRScheduler)
        and not name.startswith("_")
    }
    assert classes <= set(_SCHEDULERS)


@pytest.mark.parametrize("name", sorted(_SCHEDULERS))
def test_torch_schedulers_drive_every_sub_optimizer(name: str, batch: torch.Tensor) -> None:
    """Each torch scheduler gives the chained groups the lrs it gives the parts stepped directly."""
    torch.manual_seed(0)
    a = TinyLM()
    b = copy.deepcopy(a)
    chained = _chained(a)
    matrices, rest = _split(b)
    # reference: one plain optimizer holding the same two groups
    plain = torch.optim.SGD([{"params": matrices, "lr": 0.02}, {"params": rest, "lr": 3e-3}])
    sched_a, sched_b = _SCHEDULERS[name](chained), _SCHEDULERS[name](plain)
    seen = []
    for step in range(6):
        lm_loss(a, batch).backward()
        chained.step()
        chained.zero_grad()
        plain.step()
        if name == "ReduceLROnPlateau":
            sched_a.step(1.0)
            sched_b.step(1.0)
        else:
            sched_a.step()
            sched_b.step()
        got = [
            g["lr"]
            for g in chained.optimizers["muon"].param_groups
            + chained.optimizers["adamw"].param_groups
        ]
        want = [g["lr"] for g in plain.param_groups]
        assert got == pytest.approx(want, rel=1e-12), f"step {step}"
        seen.append(got)
    assert any(lrs != [0.02, 3e-3] for lrs in seen), "the scheduler never changed an lr"


def test_grad_scaler_unscale_step_update(batch: torch.Tensor) -> None:
    """Scaling by a power of two is exact, so the scaled step equals the plain one bit for bit."""
    torch.manual_seed(0)
    a = TinyLM()
    b = copy.deepcopy(a)
    chained_a, chained_b = _chained(a), _chained(b)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaler.scale(lm_loss(a, batch)).backward()
    scaler.unscale_(chained_a)
    scaler.step(chained_a)
    scaler.update()
    lm_loss(b, batch).backward()
    chained_b.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert scaler.get_scale() == 2048.0


def test_grad_scaler_skips_the_step_on_inf(batch: torch.Tensor, model: nn.Module) -> None:
    chained = _chained(model)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(lm_loss(model, batch)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(chained)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == 4.0


def test_closure_is_evaluated_once(model: nn.Module, batch: torch.Tensor) -> None:
    chained = _chained(model)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        chained.zero_grad()
        loss = lm_loss(model, batch)
        loss.backward()
        return loss

    loss = chained.step(closure)
    assert calls == [1] and isinstance(loss, torch.Tensor)


def test_step_hooks_run(model: nn.Module, batch: torch.Tensor) -> None:
    chained = _chained(model)
    seen: list[str] = []
    chained.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    chained.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    lm_loss(model, batch).backward()
    chained.step()
    assert seen == ["pre", "post"]


def test_state_dict_round_trip_gives_identical_next_step(batch: torch.Tensor) -> None:
    torch.manual_seed(0)
    a = TinyLM()
    chained = _chained(a)
    _train(a, chained, batch, 2)
    state = copy.deepcopy(chained.state_dict())
    assert set(state) == {"state", "param_groups"}
    owners = [group["optimizer"] for group in state["param_groups"]]
    assert owners == [name for name, opt in chained.optimizers.items() for _ in opt.param_groups]
    numbered = [i for group in state["param_groups"] for i in group["params"]]
    assert numbered == list(range(len(numbered))) and set(state["state"]) <= set(numbered)
    b = copy.deepcopy(a)
    restored = _chained(b)
    restored.load_state_dict(state)
    _train(a, chained, batch, 1)
    _train(b, restored, batch, 1)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert len(chained.state) == len(restored.state) > 0


def test_load_state_dict_mismatch_leaves_state_unchanged(
    model: nn.Module, batch: torch.Tensor
) -> None:
    chained = _chained(model)
    _train(model, chained, batch, 1)
    before = copy.deepcopy(chained.state_dict())
    with pytest.raises(ValueError, match="torch's optimizer format, 'state' and 'param_groups'"):
        chained.load_state_dict({"muon": before, "adamw": before})
    with pytest.raises(ValueError, match=r"has 2 param groups \(muon: 1, adamw: 1\); .* has 1"):
        chained.load_state_dict({**before, "param_groups": before["param_groups"][:1]})
    swapped = {**before, "param_groups": before["param_groups"][::-1]}
    with pytest.raises(
        ValueError, match="sub-optimizer 'muon' belongs to 'adamw' in the state dict"
    ):
        chained.load_state_dict(swapped)
    broken = copy.deepcopy(before)
    broken["param_groups"][1]["params"] = broken["param_groups"][1]["params"][:1]
    broken["param_groups"][0]["lr"] = 123.0
    with pytest.raises(ValueError, match="Param group 0 of sub-optimizer 'adamw'"):
        chained.load_state_dict(broken)
    assert chained.optimizers["muon"].param_groups[0]["lr"] == 0.02


def test_constructor_errors(model: nn.Module) -> None:
    matrices, _ = _split(model)
    with pytest.raises(ValueError, match="at least one optimizer"):
        ChainedOptimizer({})
    with pytest.raises(TypeError, match="entry 'x' must be a torch.optim.Optimizer"):
        ChainedOptimizer({"x": object()})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"entry 'lbfgs' \(LBFGS\) re-evaluates a closure"):
        ChainedOptimizer({"lbfgs": torch.optim.LBFGS(matrices)})
    with pytest.raises(ValueError, match="in both optimizer 'a' and 'b'"):
        ChainedOptimizer(
            {"a": torch.optim.SGD(matrices, lr=1), "b": torch.optim.SGD(matrices[:1], lr=1)}
        )


def test_add_param_group_needs_a_name(model: nn.Module) -> None:
    chained = _chained(model)
    extra = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="needs optimizer=<name>"):
        chained.add_param_group({"params": [extra]})
    with pytest.raises(KeyError, match="No sub-optimizer named 'lion'"):
        chained.add_param_group({"params": [extra]}, optimizer="lion")
    chained.add_param_group({"params": [extra], "lr": 0.5}, optimizer="muon")
    assert chained.optimizers["muon"].param_groups[-1]["lr"] == 0.5
    assert chained.param_groups[1]["params"] == [extra]
    with pytest.raises(ValueError, match="already optimized by 'muon'"):
        chained.add_param_group({"params": [extra]}, optimizer="adamw")


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    optimizer.counted = getattr(optimizer, "counted", 0) + 1


@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
def test_a_copy_keeps_its_hooks(copier: str) -> None:
    import pickle

    param = nn.Parameter(torch.randn(4, 4))
    chained = ChainedOptimizer({"sgd": torch.optim.SGD([param], lr=0.1)})
    chained.register_step_pre_hook(_count_step)
    clone = copy.deepcopy(chained) if copier == "deepcopy" else pickle.loads(pickle.dumps(chained))
    clone_param = clone.param_groups[0]["params"][0]
    clone_param.grad = torch.ones(4, 4)
    clone.step()
    assert clone.counted == 1  # the hook ran, on the copy it was called for
    assert not hasattr(chained, "counted")


def test_cyclic_schedulers_cycle_each_groups_momentum_when_all_have_one() -> None:
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    chained = ChainedOptimizer(
        {
            "muon": Muon([a], lr=0.02, momentum=0.95),
            "sgd": torch.optim.SGD([b], lr=0.1, momentum=0.9),
        }
    )
    scheduler = lr_scheduler.OneCycleLR(chained, max_lr=0.1, total_steps=10)
    assert [g["momentum"] for g in chained.param_groups] == [0.95, 0.95]  # max_momentum first
    for p in (a, b):
        p.grad = torch.ones(4, 4)
    chained.step()
    scheduler.step()
    assert all(0.85 < g["momentum"] < 0.95 for g in chained.param_groups)
    lr_scheduler.CyclicLR(chained, base_lr=0.01, max_lr=0.1)  # the same check passes


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_cyclic_schedulers_on_momentum_and_betas_say_what_to_do(scheduler: str) -> None:
    from hyper_parallel.core.errors import HyperParallelError

    chained = ChainedOptimizer(
        {
            "muon": Muon([nn.Parameter(torch.randn(4, 4))], lr=0.02),
            "adamw": AdamW([nn.Parameter(torch.randn(4))], lr=1e-3),
        }
    )
    kwargs = (
        {"max_lr": 0.1, "total_steps": 10}
        if scheduler == "OneCycleLR"
        else {"base_lr": 0.01, "max_lr": 0.1}
    )
    with pytest.raises(
        HyperParallelError, match=r"muon: 'momentum'; adamw: not.*cycle_momentum=False"
    ):
        getattr(lr_scheduler, scheduler)(chained, **kwargs)
    getattr(lr_scheduler, scheduler)(chained, cycle_momentum=False, **kwargs)  # what it says works


def test_param_names_by_optimizer_lists_each_tied_param_once() -> None:
    import pickle

    from hyper_parallel import get_hyper_optimizer

    torch.manual_seed(0)
    model = TinyLM(tied=True)
    chained = get_hyper_optimizer(model, partitioner="by_shape")
    names = chained.param_names_by_optimizer
    everything = [n for ns in names.values() for n in ns]
    assert sorted(everything) == sorted(n for n, _ in model.named_parameters())
    assert everything.count("embed_tokens.weight") == 1 and "lm_head.weight" not in everything
    assert "layers.0.q_proj.weight" in names["muon"] and "norm.weight" in names["adamw"]
    assert pickle.loads(pickle.dumps(chained)).param_names_by_optimizer == names


def test_param_names_need_a_source() -> None:
    model = nn.Linear(4, 4)
    chained = ChainedOptimizer({"sgd": torch.optim.SGD(model.parameters(), lr=0.1)})
    with pytest.raises(ValueError, match=r"has no name; build the chain with .*param_names="):
        _ = chained.param_names_by_optimizer
    named = ChainedOptimizer(
        {"sgd": torch.optim.SGD(model.parameters(), lr=0.1)}, param_names=model.named_parameters()
    )
    assert named.param_names_by_optimizer == {"sgd": ["weight", "bias"]}
    by_torch = ChainedOptimizer({"sgd": torch.optim.SGD(model.named_parameters(), lr=0.1)})
    assert by_torch.param_names_by_optimizer == {"sgd": ["weight", "bias"]}
