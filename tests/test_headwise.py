"""Head-wise Muon (``head_dim``, ``split_rows`` group keys) against a float64 per-block reference.

The reference is torch.optim.Muon's rule (``TORCH``); HyperParallel's ``head_wise`` keyword is
tested in test_muon_hyper_parallel.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_muon import reference_muon, relative_error

from hyper_parallel.core.optimizer import Muon, get_hyper_optimizer

STEPS = 3
TORCH = {"adjust_lr_fn": "original"}  # the convention of the float64 reference


def _grads(shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(STEPS)]


def _train(opt: torch.optim.Optimizer, param: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        param.grad = g.clone()
        opt.step()


def _per_block_reference(
    start: torch.Tensor, grads: list[torch.Tensor], heights: list[int], **kwargs: Any
) -> torch.Tensor:
    """Each block of rows trained alone, with torch.optim.Muon's rule, in float64."""
    blocks = []
    offset = 0
    for h in heights:
        rows = slice(offset, offset + h)
        blocks.append(
            reference_muon(start[rows], [g[rows] for g in grads], (1, h, start.shape[1]), **kwargs)
        )
        offset += h
    return torch.cat(blocks)


@pytest.mark.parametrize(
    ("shape", "head_dim"),
    [((32, 24), 8), ((64, 8), 16), ((12, 40), 4)],  # (64, 8) by 16: tall head blocks
    ids=["wide_heads", "tall_heads", "many_heads"],
)
@pytest.mark.parametrize("rms", [None, 0.2], ids=["original", "match_rms"])
def test_head_wise_equals_per_head_reference(
    shape: tuple[int, int], head_dim: int, rms: float | None
) -> None:
    start = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    grads = _grads(shape)
    param = start.clone().requires_grad_()
    convention = (
        TORCH if rms is None else {"adjust_lr_fn": "match_rms_adamw", "matched_adamw_rms": rms}
    )
    opt = Muon([{"params": [param], "head_dim": head_dim}], lr=0.02, **convention)
    _train(opt, param, grads)
    expected = _per_block_reference(
        start, grads, [head_dim] * (shape[0] // head_dim), rms_target=rms
    )
    assert relative_error(param.detach(), expected, start) < 1e-4


def test_head_wise_differs_from_whole_matrix_muon() -> None:
    start = torch.randn(32, 24)
    grads = _grads((32, 24))
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    _train(Muon([{"params": [a], "head_dim": 8}], lr=0.02), a, grads)
    _train(Muon([b], lr=0.02), b, grads)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("split_rows", "head_dim", "heights"),
    [((16, 8, 8), None, [16, 8, 8]), ((16, 8, 8), 4, [4] * 8), ((24, 8), 8, [8] * 4)],
    ids=["fused_qkv", "fused_qkv_heads", "fused_gqa_heads"],
)
def test_split_rows_equals_per_block_reference(
    split_rows: tuple[int, ...], head_dim: int | None, heights: list[int]
) -> None:
    start = torch.randn(32, 12, generator=torch.Generator().manual_seed(4))
    grads = _grads((32, 12))
    param = start.clone().requires_grad_()
    opt = Muon(
        [{"params": [param], "split_rows": split_rows, "head_dim": head_dim}], lr=0.02, **TORCH
    )
    _train(opt, param, grads)
    expected = _per_block_reference(start, grads, heights)
    assert relative_error(param.detach(), expected, start) < 1e-4


def test_head_wise_through_get_hyper_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(12, 16, bias=False),
                                 "o_proj": torch.nn.Linear(16, 12, bias=False)})  # fmt: skip
    q, o = model["q_proj"].weight, model["o_proj"].weight
    start_q, start_o = q.detach().clone(), o.detach().clone()
    optimizer = get_hyper_optimizer(
        model,
        muon_params=[{"params": [q], "head_dim": 4}, {"params": [o]}],
        muon_kwargs={"lr": 0.02, **TORCH},
    )
    grads_q, grads_o = _grads((16, 12), 1), _grads((12, 16), 2)
    for gq, go in zip(grads_q, grads_o, strict=True):
        q.grad, o.grad = gq.clone(), go.clone()
        optimizer.step()
    assert optimizer.optimizers["muon"].param_groups[0]["head_dim"] == 4
    expected_q = _per_block_reference(start_q, grads_q, [4] * 4)
    expected_o = reference_muon(start_o, grads_o, (1, 12, 16))
    assert relative_error(q.detach(), expected_q, start_q) < 1e-4
    assert relative_error(o.detach(), expected_o, start_o) < 1e-4


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (
            {"head_dim": 5},
            r"head_dim=5 does not divide its 16 rows of the param of shape \(16, 12\)",
        ),
        (
            {"split_rows": (8, 4)},
            r"split_rows=\(8, 4\) adds up to 12 rows, but the param of shape \(16, 12\) has 16",
        ),
        (
            {"split_rows": (8, 8), "head_dim": 3},
            r"head_dim=3 does not divide the split_rows block of 8 rows",
        ),
        ({"head_dim": 0}, r"head_dim should be a positive int or None, got 0"),
        ({"head_dim": True}, r"head_dim should be a positive int or None, got True"),
        ({"split_rows": "qkv"}, r"split_rows should be a tuple of row counts or None"),
        ({"split_rows": (8, -8)}, r"split_rows should hold positive ints"),
    ],
)
def test_bad_head_options_name_the_shape_and_key_and_add_nothing(
    group: dict[str, Any], message: str
) -> None:
    good = torch.nn.Parameter(torch.randn(4, 4))
    opt = Muon([good], lr=0.02)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(16, 12))], **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=message):
        Muon([{"params": [torch.nn.Parameter(torch.randn(16, 12))], **group}], lr=0.02)


def test_head_keys_round_trip_and_an_older_state_dict_still_loads() -> None:
    start = torch.randn(16, 12)
    a = start.clone().requires_grad_()
    opt = Muon([{"params": [a], "head_dim": 4, "split_rows": (8, 8)}], lr=0.02)
    _train(opt, a, _grads((16, 12)))
    saved = copy.deepcopy(opt.state_dict())  # load_state_dict may share the tensors

    b = a.detach().clone().requires_grad_()
    restored = Muon([b], lr=0.02)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["head_dim"] == 4
    assert restored.param_groups[0]["split_rows"] == (8, 8)
    grad = torch.randn(16, 12)
    for p, o in ((a, opt), (b, restored)):
        p.grad = grad.clone()
        o.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)

    older = Muon([start.clone().requires_grad_()], lr=0.02).state_dict()
    for group in older["param_groups"]:
        del group["head_dim"], group["split_rows"]
    fresh = Muon([start.clone().requires_grad_()], lr=0.02)
    fresh.load_state_dict(older)
    assert fresh.param_groups[0]["head_dim"] is None
    assert fresh.param_groups[0]["split_rows"] is None


def test_sharding_variable_set_after_construction_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = torch.randn(16, 12)
    grads = _grads((16, 12))
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt_a = Muon([a], lr=0.02)
    _train(opt_a, a, grads[:1])
    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "fsdp")  # no DTensors here: fsdp would refuse
    _train(opt_a, a, grads[1:])
    monkeypatch.delenv("HYPER_PARALLEL_SHARDING")
    _train(Muon([b], lr=0.02), b, grads)
    torch.testing.assert_close(a, b, rtol=0, atol=0)

    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "fsdp")
    with pytest.raises(
        ValueError, match=r"'fsdp' \(HYPER_PARALLEL_SHARDING='fsdp'\) does not match"
    ):
        Muon([start.clone().requires_grad_()], lr=0.02)  # read when the optimizer is built
