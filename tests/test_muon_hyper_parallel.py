"""Muon is HyperParallel's Muon: its defaults, update rule, options, checks and callables.

``hp_reference`` is an independent float64 statement of HyperParallel's rule
(``hyper_parallel/core/optimizer/muon.py`` in mindspore-ai/hyper-parallel):
momentum ``U = G + m1 B; B = m2 B + G``, Nesterov ``U = G + m1 U``, the
matrix divided by ``||U|| + ns_epsilon``, its per-iteration coefficients,
and the update scaled by ``matched_adamw_rms * sqrt(max(A, B))``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from hyper_parallel.core.optimizer import Muon, get_hyper_optimizer
from hyper_parallel_builtins.muon import MuonPostUpdateContext, NSInputTransform

# The five triples of HyperParallel's "asym5", and Keller Jordan's "legacy" triple.
ASYM5 = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
LEGACY = (3.4445, -4.7750, 2.0315)
STEPS = 5


def hp_orthogonalize(
    u: Tensor, coefficients: Sequence[tuple[float, float, float]], eps: float
) -> Tensor:
    """HyperParallel's Newton-Schulz on one matrix, in ``u``'s dtype."""
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (x.norm() + eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def hp_reference(
    start: Tensor,
    grads: Sequence[Tensor],
    *,
    lr: float = 2e-2,
    weight_decay: float = 0.1,
    rms: float = 0.2,
    momentum: tuple[float, float] = (0.95, 0.95),
    nesterov: bool = True,
    coefficients: Sequence[tuple[float, float, float]] = ASYM5,
    eps: float = 1e-10,
    ns_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """``start`` after one HyperParallel Muon step per gradient (a 3-D param is a stack)."""
    m1, m2 = momentum
    rows, cols = start.shape[-2:]
    p = start.double().reshape(-1, rows, cols)
    buffer = torch.zeros_like(p)
    for grad in grads:
        g = grad.double().reshape(p.shape)
        u = g + m1 * buffer
        buffer = m2 * buffer + g
        if nesterov:
            u = g + m1 * u
        ortho = torch.stack(
            [hp_orthogonalize(m.to(ns_dtype), coefficients, eps).double() for m in u]
        )
        p = p * (1 - lr * weight_decay) - lr * rms * math.sqrt(max(rows, cols)) * ortho
    return p.reshape(start.shape)


def train(start: Tensor, grads: Sequence[Tensor], **options: Any) -> Tensor:
    param = nn.Parameter(start.clone())
    opt = Muon([param], **options)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach()


def change_error(actual: Tensor, expected: Tensor, start: Tensor) -> float:
    """The error relative to the change the reference makes."""
    change = expected.double() - start.double()
    return float((actual.double() - expected.double()).norm() / change.norm())


def data(shape: tuple[int, ...], seed: int = 0) -> tuple[Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen), [
        torch.randn(*shape, generator=gen) for _ in range(STEPS)
    ]


SHAPES = {"square": (32, 32), "tall": (48, 16), "wide": (16, 48), "experts": (4, 12, 20)}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize(
    "options", [{}, {"lr": 0.02, "momentum": 0.95}], ids=["defaults", "guide_muon_kwargs"]
)
def test_defaults_and_the_guides_kwargs_are_hyper_parallels_update(
    shape: tuple[int, ...], options: dict[str, Any]
) -> None:
    start, grads = data(shape)
    ours = train(start, grads, ns_dtype=torch.float32, **options)
    assert change_error(ours, hp_reference(start, grads), start) < 1e-4


@pytest.mark.parametrize(
    ("options", "reference"),
    [
        ({"momentum": (0.9, 0.99)}, {"momentum": (0.9, 0.99)}),
        ({"momentum": [0.8]}, {"momentum": (0.8, 0.8)}),
        (
            {"nesterov": False, "momentum": (0.9, 0.95)},
            {"nesterov": False, "momentum": (0.9, 0.95)},
        ),
        ({"ns_variant": "legacy"}, {"coefficients": [LEGACY] * 5}),
        ({"ns_variant": "asym5", "ns_steps": 3}, {"coefficients": ASYM5[:3]}),
        (
            {"ns_variant": "custom", "ns_coefficients": [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)] * 3},
            {"coefficients": [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)] * 2 + [(3.0, -3.2, 1.2)]},
        ),
        ({"matched_adamw_rms": 0.3, "weight_decay": 0.0}, {"rms": 0.3, "weight_decay": 0.0}),
        ({"ns_epsilon": 30.0}, {"eps": 30.0}),  # large enough to change the step
        ({"lr": 0.01, "apply_lr_in_update": True}, {"lr": 0.01}),
    ],
)
def test_each_option_follows_hyper_parallels_rule(
    options: dict[str, Any], reference: dict[str, Any]
) -> None:
    start, grads = data((24, 40), seed=1)
    ours = train(start, grads, ns_dtype=torch.float32, **options)
    assert change_error(ours, hp_reference(start, grads, **reference), start) < 1e-4


def test_bf16_is_within_hyper_parallels_own_bf16_difference() -> None:
    errors = []
    for seed, shape in enumerate(SHAPES.values()):
        start, grads = data(shape, seed)
        exact = hp_reference(start, grads)
        theirs = change_error(hp_reference(start, grads, ns_dtype=torch.bfloat16), exact, start)
        ours = change_error(train(start, grads, ns_dtype=torch.bfloat16), exact, start)
        errors.append((ours, theirs))
    assert all(ours <= 1.5 * theirs for ours, theirs in errors), errors


@pytest.mark.parametrize("rms", [0.0, None])
def test_without_matched_adamw_rms_the_zero_rms_scale_mode_decides(rms: float | None) -> None:
    start, grads = data((16, 24), seed=2)
    decayed = train(start, grads, matched_adamw_rms=rms, ns_dtype=torch.float32)
    torch.testing.assert_close(decayed, start * (1 - 0.02 * 0.1) ** STEPS)
    with_lr = train(
        start, grads, matched_adamw_rms=rms, zero_rms_scale_mode="use_lr", ns_dtype=torch.float32
    )
    # a scale of 1: the update is -lr * NS(u), as if rms * sqrt(max(A, B)) were 1
    expected = hp_reference(start, grads, rms=1 / math.sqrt(24))
    assert change_error(with_lr, expected, start) < 1e-4


# -- HyperParallel's checks ------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ns_variant": "unknown"}, "ns_variant"),
        ({"ns_variant": "asym5", "ns_coefficients": [LEGACY]}, "ns_coefficients"),
        ({"ns_variant": "custom"}, "ns_coefficients"),
        ({"ns_variant": "custom", "ns_steps": 2, "ns_coefficients": [LEGACY]}, "exceeds"),
        (
            {"ns_variant": "custom", "ns_steps": 1, "ns_coefficients": [(3.4, -4.7)]},
            "exactly three",
        ),
        (
            {"ns_variant": "custom", "ns_steps": 1, "ns_coefficients": [(3.4, float("inf"), 2.0)]},
            "finite",
        ),
        ({"ns_epsilon": -1e-10}, "ns_epsilon"),
        ({"ns_epsilon": float("nan")}, "ns_epsilon"),
        ({"zero_rms_scale_mode": "keep"}, "zero_rms_scale_mode"),
        ({"hsdp_replica_count": 0}, "hsdp_replica_count must be positive"),
        # stricter than HyperParallel, which would run 5 iterations silently
        ({"ns_steps": 6}, "define 5 iterations, but ns_steps=6"),
    ],
)
def test_bad_options_are_refused_as_hyper_parallel_refuses_them(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([nn.Parameter(torch.ones(2, 2))], **options)


def test_an_unknown_keyword_and_a_tuple_replica_count_are_type_errors() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'ns_varaint'"):
        Muon([nn.Parameter(torch.ones(2, 2))], ns_varaint="asym5")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="Unsupported hsdp_replica_count type: tuple"):
        Muon([nn.Parameter(torch.ones(2, 2))], hsdp_replica_count=(2, 2))  # type: ignore[arg-type]


def test_a_hyper_parallel_state_dict_loads_and_continues() -> None:
    start, grads = data((16, 24), seed=3)
    param = nn.Parameter(start.clone())
    opt = Muon([param], ns_dtype=torch.float32)
    param.grad = grads[0].clone()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    group = saved["param_groups"][0]
    # HyperParallel's group keys: the pair momentum, its variant and no torch keys.
    for key in ("eps", "adjust_lr_fn", "ns_dtype", "ns_method", "matrix_view", "sharding",
                "head_dim", "split_rows"):  # fmt: skip
        del group[key]
    group.update(momentum=(0.95, 0.95), ns_variant="asym5")
    resumed = nn.Parameter(param.detach().clone())
    fresh = Muon([resumed], ns_dtype=torch.float32)
    fresh.load_state_dict(saved)
    for p, o in ((param, opt), (resumed, fresh)):
        for grad in grads[1:]:
            p.grad = grad.clone()
            o.step()
    torch.testing.assert_close(resumed, param, rtol=0, atol=1e-6)
    assert change_error(param.detach(), hp_reference(start, grads), start) < 1e-4


# -- the callables -----------------------------------------------------------------------


def test_zeropower_fn_replaces_newton_schulz_and_gets_whole_stacks() -> None:
    seen: list[tuple[int, ...]] = []

    def double(x: Tensor, *, steps: int) -> Tensor:
        seen.append((*x.shape, steps))
        return 2 * x

    params = [nn.Parameter(torch.zeros(8, 6)), nn.Parameter(torch.zeros(8, 6)),
              nn.Parameter(torch.zeros(4, 5))]  # fmt: skip
    grads = [torch.randn_like(p) for p in params]
    opt = Muon(params, momentum=0.5, zeropower_fn=double, ns_dtype=torch.float32)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    assert sorted(seen) == [(2, 8, 6, 5), (4, 5, 5)]  # a stack of two, and one matrix
    for p, g in zip(params, grads, strict=True):
        scale = 0.2 * math.sqrt(max(p.shape))
        # zero buffer, Nesterov: U = G + 0.5 G
        torch.testing.assert_close(p.detach(), -0.02 * scale * 2 * 1.5 * g)


def test_momentum_update_fn_replaces_the_momentum_rule() -> None:
    start, grads = data((12, 20), seed=4)
    calls: list[tuple[float, float, bool]] = []

    def no_momentum(
        local_grads: list[Tensor], buffers: list[Tensor], m1: float, m2: float, nesterov: bool
    ) -> list[Tensor]:
        calls.append((m1, m2, nesterov))
        return [g.clone() for g in local_grads]

    ours = train(start, grads, momentum=(0.9, 0.8), momentum_update_fn=no_momentum)
    assert calls == [(0.9, 0.8, True)] * STEPS
    assert torch.equal(ours, train(start, grads, momentum=0.0))
    with pytest.raises(ValueError, match="one update tensor per input gradient, got 0 updates"):
        train(start, grads, momentum_update_fn=lambda *args: [])


def _split_columns(name: str, working: Tensor) -> list[Tensor]:
    assert name == "qkv.weight"
    return list(working.split(3, dim=1))


def _separate(start: Tensor, grads: list[Tensor], parts: int) -> Tensor:
    """Each column block of ``start`` trained as its own Muon param."""
    blocks = [
        train(block, [g.split(3, dim=1)[i] for g in grads], ns_dtype=torch.float32)
        for i, block in enumerate(start.split(3, dim=1))
    ]
    assert len(blocks) == parts
    return torch.cat(blocks, dim=1)


def test_reshape_fn_orthogonalizes_each_view_like_a_param_of_its_own() -> None:
    start, grads = data((8, 9), seed=5)
    param = nn.Parameter(start.clone())
    opt = Muon([("qkv.weight", param)], reshape_fn=_split_columns, ns_dtype=torch.float32)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    torch.testing.assert_close(param.detach(), _separate(start, grads, 3), rtol=0, atol=1e-6)

    copies = Muon([("qkv.weight", nn.Parameter(start.clone()))],
                  reshape_fn=lambda name, x: [x.clone()])  # fmt: skip
    copies.param_groups[0]["params"][0].grad = grads[0].clone()
    with pytest.raises(ValueError, match="must return views that share storage"):
        copies.step()


def test_ns_transform_fn_pieces_and_restore_equal_separate_params() -> None:
    start, grads = data((8, 9), seed=6)
    param = nn.Parameter(start.clone())
    param.model_name = "qkv.weight"  # type: ignore[attr-defined]  # HyperParallel's binding

    def transform(name: str, working: Tensor) -> NSInputTransform | None:
        if name != "qkv.weight":
            return None

        def restore(updates: list[Tensor], output: Tensor) -> None:
            output.copy_(torch.cat(updates, dim=1))

        return NSInputTransform([t.clone() for t in working.split(3, dim=1)], restore)

    opt = Muon([param], ns_transform_fn=transform, ns_dtype=torch.float32)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    torch.testing.assert_close(param.detach(), _separate(start, grads, 3), rtol=0, atol=1e-6)

    bad = Muon([param], ns_transform_fn=lambda name, x: [x])  # type: ignore[arg-type,return-value]
    param.grad = grads[0].clone()
    with pytest.raises(ValueError, match="ns_transform_fn must return NSInputTransform or None"):
        bad.step()


def test_post_update_fn_gets_each_updated_param_with_its_context() -> None:
    seen: list[tuple[Any, ...]] = []

    def record(param: Tensor, local: Tensor, context: MuonPostUpdateContext) -> None:
        assert local.data_ptr() == param.data_ptr()
        seen.append(
            (
                context.param_fqn,
                context.logical_shape,
                context.lr,
                context.weight_decay,
                context.step,
            )
        )

    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False))
    opt = Muon(model.named_parameters(), lr=0.01, post_update_fn=record)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert seen == [
        ("0.weight", (6, 4), 0.01, 0.1, 1),
        ("1.weight", (3, 6), 0.01, 0.1, 1),
        ("0.weight", (6, 4), 0.01, 0.1, 2),
        ("1.weight", (3, 6), 0.01, 0.1, 2),
    ]


# -- head-wise Muon --------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [1, 4])
def test_head_wise_matches_independent_heads(head_dim: int) -> None:
    torch.manual_seed(2)
    model = nn.Module()
    model.q_proj = nn.Linear(6, 8, bias=False)
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": head_dim})
    heads = [nn.Parameter(h.clone()) for h in model.q_proj.weight.detach().split(head_dim)]
    reference = Muon(heads)
    for _ in range(3):
        gradient = torch.randn_like(model.q_proj.weight)
        model.q_proj.weight.grad = gradient
        for head, grad in zip(heads, gradient.split(head_dim), strict=True):
            head.grad = grad.clone()
        optimizer.step()
        reference.step()
        torch.testing.assert_close(model.q_proj.weight, torch.cat(heads))


def test_head_wise_selects_by_name_and_patterns_replace_the_default() -> None:
    q, o = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(8, 6))
    named = [("attn.q_proj.weight", q), ("attn.o_proj.weight", o)]
    opt = Muon(named, head_wise=True, head_dim=4)
    assert opt._head_dims == {q: 4}
    custom = Muon(named, head_wise=True, head_wise_patterns={r"o_proj": 2})
    assert custom._head_dims == {o: 2}
    assert custom.head_wise_patterns == {r"o_proj": 2}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"head_wise": True, "head_wise_patterns": {r"^weight$": 3}}, "divisible"),
        ({"head_wise": True, "head_dim": 4, "reshape_fn": lambda n, t: [t]}, "cannot be combined"),
        ({"head_wise_patterns": {r"^weight$": 2}}, "head_wise_patterns requires head_wise=True"),
        (
            {"head_wise": True, "head_wise_patterns": {r"^weight$": None}},
            "A positive integer head_dim is required for weight",
        ),
        ({"head_wise": True, "head_wise_patterns": {"weight": 2, "^w": 4}}, "Overlapping"),
    ],
)
def test_head_wise_checks(options: dict[str, Any], message: str) -> None:
    model = nn.Linear(6, 8, bias=False)
    with pytest.raises(ValueError, match=message):
        if "reshape_fn" in options or (
            "head_wise_patterns" in options and "head_wise" not in options
        ):
            Muon([model.weight], **options)
        else:
            get_hyper_optimizer(model, muon=options)


def test_head_wise_needs_names_when_built_directly() -> None:
    with pytest.raises(ValueError, match="head_wise requires model_name"):
        Muon([nn.Parameter(torch.randn(8, 6))], head_wise=True, head_dim=4)
