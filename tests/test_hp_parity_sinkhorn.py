"""Sinkhorn as HyperParallel's scripts and tests use it: its options, checks and update.

The facts come from HyperParallel's ``hyper_parallel/core/optimizer/sinkhorn.py``
(``__init__``'s signature and defaults, ``_validate_balancing``,
``_validate_group`` run when the optimizer is built and at every step,
``reset_optimizer_parameters``' "non-empty 2D matrices", ``_update_parameter``),
``optimizer.py`` (``BaseDistributedOptimizer._split_replicate_groups``: the
checks of ``hsdp_replica_count``), and its tests
``tests/torch/optimizer/test_sinkhorn.py`` (the reference, the option sets
it refuses) and ``_test_sinkhorn_npu.py`` (sharded layouts, replicas).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.core.optimizer import Sinkhorn, get_hyper_optimizer


def balanced(
    matrix: torch.Tensor, steps: int = 11, eps: float = 1e-20, tau: float = 1e-3
) -> torch.Tensor:
    """The balanced update of HyperParallel's Algorithm 1, in float64, one row or column at a time.

    Rows whose norm is at most ``tau`` times the mean row norm are zeroed;
    then ``steps`` normalizations alternate rows (first) and columns; the
    result is scaled by ``sqrt(cols)``.
    """
    u = matrix.to(torch.float64).clone()
    norms = torch.stack([row.norm() for row in u])
    u[norms <= tau * norms.mean()] = 0.0
    for i in range(steps):
        if i % 2 == 0:
            u = torch.stack([row / (row.norm() + eps) for row in u])
        else:
            u = torch.stack([col / (col.norm() + eps) for col in u.T]).T
    return u * math.sqrt(matrix.shape[1])


def _matrix() -> nn.Parameter:
    return nn.Parameter(torch.ones(3, 2))


# -- the update ---------------------------------------------------------------------------


def test_several_steps_follow_the_reference_and_keep_only_the_ema() -> None:
    torch.manual_seed(41)
    param = nn.Parameter(torch.randn(7, 3))
    expected = param.detach().double().clone()
    ema = torch.zeros_like(expected)
    opt = Sinkhorn([param], lr=0.03, momentum=0.8)
    for _ in range(4):
        grad = torch.randn(7, 3)
        grad[0] = 0.0  # a zero row and a negligible one stay still
        grad[1] *= 1e-8
        param.grad = grad
        ema = 0.8 * ema + 0.2 * grad.double()
        expected -= 0.03 * 0.18 * balanced(0.8 * ema + 0.2 * grad.double())
        opt.step()
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-6, atol=2e-7)
        torch.testing.assert_close(opt.state[param]["momentum_buffer"].double(), ema)
    assert set(opt.state[param]) == {"momentum_buffer"}


def test_negligible_rows_stay_zero_and_the_others_have_unit_rms() -> None:
    grad = torch.tensor([[0.0, 0.0, 0.0], [1e-9, 2e-9, 3e-9], [1.0, -3.0, 4.0], [-2.0, 1.0, 5.0]])
    param = nn.Parameter(torch.zeros_like(grad))
    opt = Sinkhorn([param], lr=1.0, correction=1.0, momentum=0.0)
    param.grad = grad
    opt.step()
    assert torch.equal(param.detach()[:2], torch.zeros(2, 3))
    torch.testing.assert_close(param.detach()[2:].square().mean(dim=1), torch.ones(2))
    with torch.no_grad():
        param.zero_()
    param.grad = torch.zeros_like(grad)
    opt.step()
    assert torch.equal(param.detach(), torch.zeros_like(grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 3, 11])
def test_a_transposed_gradient_is_read_not_written(dtype: torch.dtype, steps: int) -> None:
    grad = torch.tensor([[0.0, 1.0, 2.0, -3.0], [0.0, -2.0, 4.0, 1.0]], dtype=dtype).T
    original = grad.clone()
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    Sinkhorn([param], lr=1.0, correction=1.0, momentum=0.0, steps=steps, eps=0.01, tau=0.5).step()
    want = -balanced(original, steps, eps=0.01, tau=0.5).to(dtype)
    torch.testing.assert_close(param.detach(), want)
    assert torch.equal(grad, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [False, True])
def test_the_gradient_stays_and_the_buffer_is_the_ema(dtype: torch.dtype, nesterov: bool) -> None:
    torch.manual_seed(43)
    param = nn.Parameter(torch.randn(7, 3).to(dtype))
    expected = param.detach().clone()
    ema = torch.zeros(7, 3, dtype=torch.float64)
    opt = Sinkhorn([param], lr=0.03, momentum=0.8, nesterov=nesterov)
    for _ in range(4):
        grad = torch.randn_like(param)
        original = grad.clone()
        param.grad = grad
        ema = 0.8 * ema + 0.2 * grad.double()
        update = 0.8 * ema + 0.2 * grad.double() if nesterov else ema
        expected.add_(balanced(update).float(), alpha=-0.03 * 0.18)
        opt.step()
        torch.testing.assert_close(param.detach(), expected)
        assert torch.equal(grad, original)
        torch.testing.assert_close(opt.state[param]["momentum_buffer"].double(), ema)


def test_a_resumed_optimizer_continues_and_a_missing_gradient_moves_nothing() -> None:
    first = nn.Parameter(torch.randn(5, 3))
    opt = Sinkhorn([first])
    first.grad = torch.randn_like(first)
    opt.step()
    second = nn.Parameter(first.detach().clone())
    resumed = Sinkhorn([second])
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    first.grad = second.grad = torch.randn_like(first)
    opt.step()
    resumed.step()
    torch.testing.assert_close(first, second)
    before = second.detach().clone()
    resumed.zero_grad()
    resumed.step()
    assert torch.equal(second.detach(), before)


def test_a_bf16_param_resumes_with_its_float32_momentum() -> None:
    param = nn.Parameter(torch.randn(4, 3).bfloat16())
    opt = Sinkhorn([param])
    param.grad = torch.randn_like(param)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    assert opt.state[param]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt.state[param]["momentum_buffer"], saved["state"][0]["momentum_buffer"])


# -- options and checks ------------------------------------------------------------------------


def test_the_signature_is_hyperparallels() -> None:
    import inspect

    params = inspect.signature(Sinkhorn).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["params", "lr", "momentum", "nesterov", "steps", "eps", "tau",
                          "correction", "hsdp_replica_count"]  # fmt: skip
    defaults = {n: params[n].default for n in positional[1:]}
    assert defaults == {"lr": 1e-3, "momentum": 0.95, "nesterov": True, "steps": 11,
                        "eps": 1e-20, "tau": 1e-3, "correction": 0.18,
                        "hsdp_replica_count": None}  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"steps": 2}, {"steps": 0}, {"eps": 0}, {"tau": -1}, {"momentum": 1},
        {"lr": float("nan")}, {"correction": -1},
        # finite, as HyperParallel's math.isfinite checks
        {"lr": float("inf")}, {"correction": float("inf")}, {"eps": float("inf")},
        {"tau": float("inf")}, {"tau": float("nan")}, {"momentum": float("nan")},
    ],
)  # fmt: skip
def test_hyperparallels_refused_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Sinkhorn([_matrix()], **options)
    with pytest.raises(ValueError):  # the same for a group's own value
        Sinkhorn([{"params": [_matrix()], **options}])


def test_weight_decay_and_vectors_are_refused_with_hyperparallels_words() -> None:
    with pytest.raises(ValueError, match="weight decay"):
        Sinkhorn([{"params": [_matrix()], "weight_decay": 0.1}])
    with pytest.raises(ValueError, match="2D"):
        Sinkhorn([nn.Parameter(torch.ones(3))])


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)])
def test_an_empty_matrix_is_refused(shape: tuple[int, int]) -> None:
    with pytest.raises(
        ValueError, match=rf"non-empty 2D matrices.*shape \({shape[0]}, {shape[1]}\)"
    ):
        Sinkhorn([nn.Parameter(torch.ones(shape))])
    opt = Sinkhorn([_matrix()])
    with pytest.raises(ValueError, match="non-empty 2D matrices"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(shape))]})
    assert len(opt.param_groups) == 1


def test_correction_zero_is_allowed_and_moves_no_param() -> None:
    param = nn.Parameter(torch.randn(4, 3))
    start = param.detach().clone()
    opt = Sinkhorn([param], correction=0)
    param.grad = torch.randn(4, 3)
    opt.step()
    assert torch.equal(param.detach(), start)
    # the momentum still steps: a later group correction moves the params by it
    torch.testing.assert_close(opt.state[param]["momentum_buffer"], 0.05 * param.grad)


def test_a_group_edited_to_a_bad_value_fails_at_step_and_moves_nothing() -> None:
    param = nn.Parameter(torch.randn(4, 3))
    opt = Sinkhorn([param])
    param.grad = torch.randn(4, 3)
    start = param.detach().clone()
    for key, value in (("lr", float("nan")), ("correction", -1.0), ("steps", 4)):
        edited = copy.deepcopy(opt.param_groups[0])
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=key if key != "lr" else "Learning rate"):
            opt.step()
        opt.param_groups[0].update({k: v for k, v in edited.items() if k != "params"})
    assert torch.equal(param.detach(), start)
    assert not opt.state[param]


def test_hsdp_replica_count_is_accepted_and_checked_as_hyperparallel_does() -> None:
    plain, replicated = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
    grad = torch.randn(6, 4)
    plain.grad, replicated.grad = grad.clone(), grad.clone()
    with torch.no_grad():
        replicated.copy_(plain)
    opt = Sinkhorn([replicated], 1e-2, 0.95, True, 11, 1e-20, 1e-3, 0.18, 2)  # positionally
    assert opt.hsdp_replica_count == 2
    opt.step()
    Sinkhorn([plain], lr=1e-2).step()
    assert torch.equal(replicated.detach(), plain.detach())  # one process: nothing to group
    assert copy.deepcopy(opt).hsdp_replica_count == 2
    for bad in ("2", 2.0, (2,)):
        with pytest.raises(TypeError, match=r"Unsupported hsdp_replica_count type"):
            Sinkhorn([_matrix()], hsdp_replica_count=bad)  # type: ignore[arg-type]
    for bad_count in (0, -1):
        with pytest.raises(
            ValueError, match=rf"hsdp_replica_count must be positive, got {bad_count}"
        ):
            Sinkhorn([_matrix()], hsdp_replica_count=bad_count)


def test_get_hyper_optimizer_passes_hsdp_replica_count_to_sinkhorn() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4, bias=False))
    optimizer = get_hyper_optimizer(
        model,
        sinkhorn_params=[{"params": [model[0].weight]}],
        sinkhorn_kwargs={"lr": 1e-3, "hsdp_replica_count": 2},
        adamw_params=[{"params": [model[1].weight]}],
    )
    assert optimizer.optimizers["sinkhorn"].hsdp_replica_count == 2


def _replicas(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat, square = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(7, 5, generator=gen), torch.randn(7, 5, generator=gen)

    # HSDP, (replicate=2, shard=2), with the count HyperParallel's e2e test uses: one process's numbers
    for count in (2, 3, None):
        param = nn.Parameter(distribute_tensor(start.clone(), square, [Replicate(), Shard(0)]))
        param.grad = distribute_tensor(grad.clone(), square, [Replicate(), Shard(0)])
        Sinkhorn([param], lr=0.04, hsdp_replica_count=count).step()
        plain = nn.Parameter(start.clone())
        plain.grad = grad.clone()
        Sinkhorn([plain], lr=0.04).step()
        torch.testing.assert_close(param.detach().full_tensor(), plain.detach(), rtol=0, atol=1e-6)

    # 4 replicas cannot be split into groups of 3
    replicated = nn.Parameter(distribute_tensor(start.clone(), flat, [Replicate()]))
    with pytest.raises(
        ValueError,
        match=r"hsdp_replica_count=3 must evenly divide the 4 "
        r"replicas of mesh dim 0 of the param of shape \(7, 5\)",
    ):
        Sinkhorn([replicated], hsdp_replica_count=3)
    Sinkhorn([replicated], hsdp_replica_count=2)


def test_hsdp_replica_count_on_sharded_replicas() -> None:
    from distributed import run_distributed

    run_distributed(_replicas, world_size=4)


def test_an_edited_bad_option_stops_the_step_before_any_group_changes() -> None:
    torch.manual_seed(0)
    first, second = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(5, 3))
    optimizer = Sinkhorn([{"params": [first]}, {"params": [second]}], lr=0.1)
    first.grad, second.grad = torch.randn(4, 6), torch.randn(5, 3)
    before = first.detach().clone()
    optimizer.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="Learning rate should be finite"):
        optimizer.step()
    assert torch.equal(first, before) and optimizer.state[first] == {}
