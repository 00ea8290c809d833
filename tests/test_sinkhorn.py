"""Sinkhorn: the documented update, frozen negligible rows, every bad option, state round trip."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel import get_registry
from hyper_parallel.core.optimizer import AdamW, ChainedOptimizer, Sinkhorn, get_hyper_optimizer

# -- the reference: the rule as written, on float64 copies -----------------------------


def reference_steps(
    weight: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    steps: int,
    eps: float,
    tau: float,
    correction: float,
) -> torch.Tensor:
    """The weight after one step per gradient, computed in float64 with plain torch ops."""
    w = weight.detach().to(torch.float64).clone()
    buf = torch.zeros_like(w)
    m, n = w.shape
    for g in grads:
        g = g.to(torch.float64)
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf.clone()
        r = torch.sqrt((u * u).sum(dim=1))
        u[r <= tau * (r.sum() / m)] = 0.0
        u = u / (r + eps)[:, None]
        for _ in range((steps - 1) // 2):
            u = u / (torch.sqrt((u * u).sum(dim=0)) + eps)[None, :]
            u = u / (torch.sqrt((u * u).sum(dim=1)) + eps)[:, None]
        w = w - lr * correction * math.sqrt(n) * u
    return w


def _grads(shape: tuple[int, int], count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(count)]


def _run(opt: torch.optim.Optimizer, param: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        param.grad = g.to(param.dtype).clone()
        opt.step()


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (24, 24)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("steps", [7, 11])
def test_matches_a_float64_reference(shape: tuple[int, int], nesterov: bool, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
    start = param.detach().clone()
    grads = _grads(shape, 3, seed=1)
    options: dict[str, Any] = {
        "lr": 0.05,
        "momentum": 0.9,
        "nesterov": nesterov,
        "steps": steps,
        "eps": 1e-20,
        "tau": 1e-3,
        "correction": 0.18,
    }
    _run(Sinkhorn([param], **options), param, grads)
    expected = reference_steps(start, grads, **options)
    moved = param.detach() - start
    assert moved.abs().max() > 0
    torch.testing.assert_close(moved, expected - start, rtol=1e-9, atol=0.0)
    assert param.dtype == torch.float64


def test_defaults_match_the_reference_too() -> None:
    gen = torch.Generator().manual_seed(2)
    param = nn.Parameter(torch.randn(12, 20, generator=gen, dtype=torch.float64))
    start = param.detach().clone()
    grads = _grads((12, 20), 3, seed=3)
    _run(Sinkhorn([param]), param, grads)
    expected = reference_steps(
        start, grads, lr=1e-3, momentum=0.95, nesterov=True, steps=11, eps=1e-20, tau=1e-3,
        correction=0.18,
    )  # fmt: skip
    torch.testing.assert_close(param.detach() - start, expected - start, rtol=1e-9, atol=0.0)


def test_update_rows_are_unit_norm_times_the_scale() -> None:
    param = nn.Parameter(torch.zeros(32, 8, dtype=torch.float64))
    lr, correction = 0.1, 0.18
    _run(Sinkhorn([param], lr=lr, correction=correction), param, _grads((32, 8), 1, seed=4))
    row_norms = param.detach().norm(dim=1) / (lr * correction * math.sqrt(8))
    torch.testing.assert_close(row_norms, torch.ones(32, dtype=torch.float64))


def test_rows_below_tau_times_the_mean_norm_never_move() -> None:
    gen = torch.Generator().manual_seed(5)
    param = nn.Parameter(torch.randn(20, 12, generator=gen))
    start = param.detach().clone()
    quiet = [0, 7, 19]
    opt = Sinkhorn([param], lr=0.1, tau=1e-3)
    for _ in range(4):
        grad = torch.randn(20, 12, generator=gen)
        grad[quiet] *= 1e-6  # norms far below tau * mean
        param.grad = grad
        opt.step()
    moved = [i for i in range(20) if i not in quiet]
    assert torch.equal(param.detach()[quiet], start[quiet])
    assert (param.detach()[moved] != start[moved]).any(dim=1).all()


def test_tau_is_relative_to_the_mean_row_norm() -> None:
    # momentum=0: U is the gradient. Row norms: eight 1s, then 0.05 and 0.2; mean 0.825.
    grad = torch.zeros(10, 4, dtype=torch.float64)
    grad[:8, 0] = 1.0
    grad[8, 1], grad[9, 2] = 0.05, 0.2
    param = nn.Parameter(torch.zeros(10, 4, dtype=torch.float64))
    param.grad = grad
    Sinkhorn([param], lr=1.0, momentum=0.0, tau=0.1).step()  # threshold 0.0825
    moved = (param.detach() != 0).any(dim=1).tolist()
    assert moved == [True] * 8 + [False, True]


def test_a_zero_gradient_moves_nothing() -> None:
    param = nn.Parameter(torch.randn(6, 5))
    start = param.detach().clone()
    param.grad = torch.zeros(6, 5)
    Sinkhorn([param], lr=1.0).step()
    assert torch.equal(param.detach(), start)


def test_param_groups_override_options() -> None:
    gen = torch.Generator().manual_seed(6)
    a = nn.Parameter(torch.randn(10, 6, generator=gen, dtype=torch.float64))
    b = nn.Parameter(torch.randn(6, 10, generator=gen, dtype=torch.float64))
    start_a, start_b = a.detach().clone(), b.detach().clone()
    ga, gb = _grads((10, 6), 2, seed=7), _grads((6, 10), 2, seed=8)
    opt = Sinkhorn(
        [{"params": [a]}, {"params": [b], "lr": 0.3, "steps": 3, "nesterov": False}], lr=0.01
    )
    for x, y in zip(ga, gb, strict=True):
        a.grad, b.grad = x.clone(), y.clone()
        opt.step()
    base: dict[str, Any] = {
        "momentum": 0.95, "eps": 1e-20, "tau": 1e-3, "correction": 0.18,
    }  # fmt: skip
    want_a = reference_steps(start_a, ga, lr=0.01, nesterov=True, steps=11, **base)
    want_b = reference_steps(start_b, gb, lr=0.3, nesterov=False, steps=3, **base)
    torch.testing.assert_close(a.detach() - start_a, want_a - start_a, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(b.detach() - start_b, want_b - start_b, rtol=1e-9, atol=0.0)


def test_params_without_grad_are_skipped_and_closure_loss_is_returned() -> None:
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    start_b = b.detach().clone()
    opt = Sinkhorn([a, b], lr=0.1)

    def closure() -> float:
        opt.zero_grad()
        loss = (a * a).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) > 0
    assert torch.equal(b.detach(), start_b)
    assert "momentum_buffer" not in opt.state[b]


# -- errors -------------------------------------------------------------------------


def _matrix() -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 3))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"weight_decay": 0.1}, r"Sinkhorn has no weight decay.*weight_decay=0.*AdamW"),
        ({"weight_decay": -1e-4}, r"no weight decay"),
        ({"steps": 10}, r"steps should be an odd int >= 1.*got 10"),
        ({"steps": 0}, r"steps should be an odd int"),
        ({"steps": -3}, r"steps should be an odd int"),
        ({"steps": 5.0}, r"steps should be an odd int"),
        ({"steps": True}, r"steps should be an odd int"),
        ({"momentum": 1.0}, r"momentum should be a float in \[0, 1\)"),
        ({"momentum": -0.1}, r"momentum should be"),
        ({"momentum": float("nan")}, r"momentum should be"),
        ({"lr": -1e-3}, r"Learning rate should be finite and >= 0"),
        ({"lr": float("inf")}, r"Learning rate should be finite"),
        ({"lr": "fast"}, r"lr should be a finite float"),
        ({"lr": torch.tensor([0.1, 0.2])}, r"tensor lr must have 1 element"),
        ({"eps": 0.0}, r"eps should be a finite float > 0"),
        ({"tau": -0.5}, r"tau should be a finite float >= 0"),
        ({"correction": -1.0}, r"correction should be a finite float >= 0 \(0: params stay"),
        ({"correction": float("nan")}, r"correction should be"),
        ({"sharding": 3}, r"sharding should be a backend name"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sinkhorn([_matrix()], **options)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_params_that_are_not_matrices_are_refused(shape: tuple[int, ...]) -> None:
    pattern = rf"only updates non-empty 2D matrices.*shape {re.escape(str(shape))}.*AdamW"
    with pytest.raises(ValueError, match=pattern):
        Sinkhorn([nn.Parameter(torch.randn(shape))])


def test_complex_params_are_refused() -> None:
    with pytest.raises(ValueError, match=r"real floating-point params.*complex64"):
        Sinkhorn([nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])


def test_a_failing_add_param_group_leaves_the_groups_unchanged() -> None:
    opt = Sinkhorn([_matrix()])
    before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    with pytest.raises(ValueError, match=r"steps should be an odd int"):
        opt.add_param_group({"params": [_matrix()], "steps": 4})
    with pytest.raises(ValueError, match=r"only updates non-empty 2D matrices.*\(7,\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(7))]})
    with pytest.raises(ValueError, match=r"no weight decay"):
        opt.add_param_group({"params": [_matrix()], "weight_decay": 0.01})
    assert len(opt.param_groups) == 1
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before
    opt.add_param_group({"params": [_matrix()], "steps": 5})
    assert [g["steps"] for g in opt.param_groups] == [11, 5]


def test_sparse_gradients_are_refused() -> None:
    param = _matrix()
    param.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(ValueError, match=r"does not support sparse gradients.*\(4, 3\)"):
        Sinkhorn([param]).step()


def test_partial_dtensor_gradients_are_refused(tmp_path: Any) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        opt = Sinkhorn([param], lr=0.1)
        param.grad = DTensor.from_local(torch.randn(4, 3), mesh, [Partial()])
        with pytest.raises(
            ValueError, match=r"param of shape \(4, 3\) is a Partial DTensor.*Reduce"
        ):
            opt.step()
        # A reduced (sharded) gradient is fine, and gives the plain tensor's update.
        plain = nn.Parameter(param.detach().full_tensor().clone())
        grad = torch.randn(4, 3)
        param.grad = distribute_tensor(grad, mesh, [Shard(0)])
        plain.grad = grad.clone()
        opt.step()
        Sinkhorn([plain], lr=0.1).step()
        torch.testing.assert_close(param.detach().full_tensor(), plain.detach())
    finally:
        dist.destroy_process_group()


def _sharded_equals_one_process(rank: int, world_size: int) -> None:
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat, square = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    layouts = [
        (flat, [Shard(0)]),  # 13 rows over 4 ranks: uneven, one rank holds 1 row
        (flat, [Shard(1)]),
        (square, [Shard(0), Shard(1)]),
        (square, [Replicate(), Shard(0)]),  # HSDP-style
        (square, [Shard(1), Shard(0)]),
    ]
    shapes = [(13, 7), (8, 9), (6, 10), (10, 6), (5, 3)]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(2)]
    for step_grads in grads:
        step_grads[0][[1, 5, 9]] *= 1e-8  # rows dropped by tau, on several ranks
    sharded = [
        nn.Parameter(distribute_tensor(w.clone(), mesh, placements))
        for w, (mesh, placements) in zip(start, layouts, strict=True)
    ]
    plain = [nn.Parameter(w.clone()) for w in start]
    options: dict[str, Any] = {"lr": 0.1, "steps": 7}
    opts = [Sinkhorn(sharded, **options), Sinkhorn(plain, **options)]
    for step_grads in grads:
        for p, g, (mesh, placements) in zip(sharded, step_grads, layouts, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh, placements)
        for p, g in zip(plain, step_grads, strict=True):
            p.grad = g.clone()
        for opt in opts:
            opt.step()
    for s, p in zip(sharded, plain, strict=True):
        torch.testing.assert_close(s.detach().full_tensor(), p.detach(), rtol=1e-12, atol=1e-14)

    # Row-sharded matrices share their all-reduces: one per column-norm phase, not per param.
    rows_split = [
        nn.Parameter(distribute_tensor(torch.randn(9, 5), flat, [Shard(0)])) for _ in "abc"
    ]
    for p in rows_split:
        p.grad = distribute_tensor(torch.randn(9, 5), flat, [Shard(0)])
    opt = Sinkhorn(rows_split, steps=7)
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        opt.step()
    assert all_reduce.call_count == 1 + 3  # the mean row norm, then 3 column sweeps


def test_sharded_params_equal_one_process() -> None:
    from distributed import run_distributed

    run_distributed(_sharded_equals_one_process, world_size=4)


# -- state ----------------------------------------------------------------------------


def test_state_dict_round_trip_makes_the_identical_next_step() -> None:
    gen = torch.Generator().manual_seed(9)
    param = nn.Parameter(torch.randn(16, 8, generator=gen, dtype=torch.bfloat16))
    opt = Sinkhorn([param], lr=0.02)
    grads = [torch.randn(16, 8, generator=gen, dtype=torch.bfloat16) for _ in range(4)]
    _run(opt, param, grads[:3])
    (buffer,) = (s["momentum_buffer"] for s in opt.state.values())
    assert buffer.dtype == torch.float32 and param.dtype == torch.bfloat16

    twin = nn.Parameter(param.detach().clone())
    restored = Sinkhorn([twin], lr=0.5)  # the loaded group's lr wins
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert restored.state[twin]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(restored.state[twin]["momentum_buffer"], buffer)
    assert restored.param_groups[0]["lr"] == 0.02
    _run(opt, param, grads[3:])
    _run(restored, twin, grads[3:])
    assert torch.equal(param.detach(), twin.detach())
    assert param.dtype == twin.dtype == torch.bfloat16


def test_a_state_dict_without_sharding_loads() -> None:
    param = _matrix()
    opt = Sinkhorn([param])
    state = opt.state_dict()
    del state["param_groups"][0]["sharding"]
    opt.load_state_dict(state)
    assert opt.param_groups[0]["sharding"] is None
    param.grad = torch.randn(4, 3)
    opt.step()


def test_float64_params_keep_a_float64_buffer() -> None:
    param = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    opt = Sinkhorn([param])
    param.grad = torch.randn(3, 3, dtype=torch.float64)
    opt.step()
    assert opt.state[param]["momentum_buffer"].dtype == torch.float64


# -- how users reach it ---------------------------------------------------------------


def test_registered_and_importable() -> None:
    entry = get_registry().get("optimizer", "sinkhorn")
    assert entry.obj is Sinkhorn
    assert entry.matrix_only and entry.unusable_in_plain_loop() is None
    assert issubclass(Sinkhorn, torch.optim.Optimizer)


def test_get_hyper_optimizer_builds_sinkhorn_with_adamw() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    matrices = [model[0].weight, model[2].weight]
    others = [model[0].bias, model[2].bias]
    optimizer = get_hyper_optimizer(
        model,
        optimizers={
            "sinkhorn": {"params": matrices, "lr": 0.02, "steps": 5},
            "adamw": {"params": others, "lr": 3e-4},
        },
    )
    assert isinstance(optimizer, ChainedOptimizer)
    assert list(optimizer.optimizers) == ["sinkhorn", "adamw"]
    sinkhorn = optimizer.optimizers["sinkhorn"]
    assert isinstance(sinkhorn, Sinkhorn) and isinstance(optimizer.optimizers["adamw"], AdamW)
    assert sinkhorn.param_groups[0]["lr"] == 0.02 and sinkhorn.param_groups[0]["steps"] == 5
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_vectors_given_to_sinkhorn_go_to_adamw() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="fewer than 2 dims"):
        optimizer = get_hyper_optimizer(
            model, optimizers={"sinkhorn": {"params": list(model.parameters())}}
        )
    assert set(optimizer.optimizers) == {"sinkhorn", "adamw"}
    assert {p.ndim for g in optimizer.optimizers["sinkhorn"].param_groups for p in g["params"]} == {
        2
    }
