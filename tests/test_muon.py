"""Muon with torch.optim.Muon's keywords (torch's update, bitwise), N-D params, NS dtype,
coefficient sets, errors. HyperParallel's convention: test_muon_hyper_parallel.py."""

from __future__ import annotations

import copy
import inspect
import io
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hyper_parallel_builtins.muon._options as options_module
import hyper_parallel_builtins.muon._update as muon_module
from hyper_parallel import get_registry
from hyper_parallel_builtins.muon import Muon
from hyper_parallel_builtins.muon._options import NS_DTYPE_ENV, default_ns_dtype
from hyper_parallel_builtins.newton_schulz import (
    COEFFICIENT_SETS,
    KELLER_COEFFICIENTS,
    Workspace,
    new_stack,
    newton_schulz,
    newton_schulz_batched,
    newton_schulz_stack_,
    normalize_,
    resolve_coefficients,
    stack_into,
)
from hyper_parallel_builtins.newton_schulz._iterate import newton_schulz_flops
from hyper_parallel_builtins.newton_schulz._paths import (
    GRAM_MIN_ASPECT,
    GRAM_MIN_ASPECT_CPU_LARGE,
    PER_MATRIX_FROM,
    resolve_ns_method,
)

# -- a float64 reference of torch.optim.Muon's update rule ---------------------


def reference_orthogonalize(
    update: Tensor, coefficients: Sequence[tuple[float, float, float]], eps: float
) -> Tensor:
    """Newton-Schulz on one float64 matrix, written out step by step."""
    x = update.T if update.shape[0] > update.shape[1] else update
    x = x / max(x.norm().item(), eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if update.shape[0] > update.shape[1] else x


def reference_muon(
    param: Tensor,
    grads: Sequence[Tensor],
    matrices: tuple[int, int, int],
    *,
    lr: float = 0.02,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    coefficients: Sequence[tuple[float, float, float]] = (KELLER_COEFFICIENTS,) * 5,
    eps: float = 1e-7,
    rms_target: float | None = None,
) -> Tensor:
    """``param`` after one step per grad; ``matrices`` = (count, rows, cols) it is read as."""
    count, rows, cols = matrices
    p = param.double().reshape(count, rows, cols)
    buf = torch.zeros_like(p)
    if rms_target is None:
        scale = math.sqrt(max(1.0, rows / cols))
    else:
        scale = rms_target * math.sqrt(max(rows, cols))
    for grad in grads:
        g = grad.double().reshape(count, rows, cols)
        buf = momentum * buf + (1 - momentum) * g
        update = (1 - momentum) * g + momentum * buf if nesterov else buf
        ortho = torch.stack([reference_orthogonalize(u, coefficients, eps) for u in update])
        p = p * (1 - lr * weight_decay) - lr * scale * ortho
    return p.reshape(param.shape)


def run_muon(
    params: Sequence[Tensor], grads: Sequence[Sequence[Tensor]], **kwargs: Any
) -> list[Tensor]:
    """Copies of ``params`` after one ``Muon`` step per entry of ``grads``."""
    trained = [p.detach().clone().requires_grad_() for p in params]
    opt = Muon(trained, **kwargs)
    for step_grads in grads:
        for p, g in zip(trained, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in trained]


def relative_error(actual: Tensor, expected: Tensor, start: Tensor) -> float:
    """Error of the change ``actual - start`` relative to the expected change.

    Stricter than comparing params: with lr 0.02 the change is ~1% of a
    param, so 5e-5 of the change is ~5e-7 of the param. fp32 Newton-Schulz
    itself is only good to ~1e-5 (each of Keller's steps amplifies round-off
    of the small singular values by up to a = 3.4).
    """
    change = expected.double() - start.double()
    return ((actual.double() - expected.double()).norm() / change.norm()).item()


def random_grads(shape: Sequence[int], steps: int, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(steps)]


SHAPES_AND_VIEWS = [
    # (param shape, matrix_view, how it is read: (count, rows, cols))
    ((24, 40), "auto", (1, 24, 40)),
    ((48, 16), "auto", (1, 48, 16)),  # tall: rows > cols
    ((16, 4, 3, 3), "auto", (1, 16, 36)),  # conv kernel -> (out, -1)
    ((4, 12, 20), "auto", (4, 12, 20)),  # MoE expert stack -> 4 matrices
    ((12, 4, 5), "flatten", (1, 12, 20)),  # Conv1d kernel -> (out, -1)
    ((2, 3, 10, 6), "batch", (6, 10, 6)),
]

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "no_nesterov": ({"nesterov": False}, {"nesterov": False}),
    "match_rms_adamw": ({"adjust_lr_fn": "match_rms_adamw"}, {"rms_target": 0.2}),
    "matched_adamw_rms": (
        {"adjust_lr_fn": "match_rms_adamw", "matched_adamw_rms": 0.3},
        {"rms_target": 0.3},
    ),
    "eps_alone": ({"adjust_lr_fn": None, "eps": 1e-7}, {}),
    "no_weight_decay": ({"weight_decay": 0.0}, {"weight_decay": 0.0}),
    "momentum_0.5": (
        {"momentum": 0.5, "ns_steps": 3},
        {"momentum": 0.5, "coefficients": (KELLER_COEFFICIENTS,) * 3},
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("shape", "view", "matrices"), SHAPES_AND_VIEWS)
def test_matches_float64_reference_of_torch_update_rule(
    shape: tuple[int, ...], view: str, matrices: tuple[int, int, int], config: str
) -> None:
    ours, theirs = dict(CONFIGS[config][0]), CONFIGS[config][1]
    start = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    grads = random_grads(shape, 3)
    (result,) = run_muon(
        [start],
        [[g] for g in grads],
        lr=0.02,
        adjust_lr_fn=ours.pop("adjust_lr_fn", "original"),
        ns_dtype=torch.float32,
        matrix_view=view,
        **ours,
    )
    expected = reference_muon(start, grads, matrices, **theirs)
    assert result.dtype == torch.float32
    assert relative_error(result, expected, start) < 5e-5


TORCH_KEYWORDS = [
    {"adjust_lr_fn": "original"},
    {"eps": 1e-7},
    {"ns_coefficients": KELLER_COEFFICIENTS},
    {"adjust_lr_fn": "original", "eps": 1e-7, "ns_coefficients": KELLER_COEFFICIENTS},
]


def test_each_torch_keyword_alone_gives_torch_rule_bitwise() -> None:
    params = [torch.randn(16, 32), torch.randn(40, 8)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    runs = [run_muon(params, grads, **keywords) for keywords in TORCH_KEYWORDS]
    hyper_parallel = run_muon(params, grads, lr=1e-3)  # the same lr, HyperParallel's rule
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(runs[0], hyper_parallel, strict=True):
        assert not torch.allclose(a, b)


def test_match_rms_adamw_takes_matched_adamw_rms_as_its_target() -> None:
    params = [torch.randn(16, 32)]
    grads = [[torch.randn(16, 32)] for _ in range(2)]
    torch_default = run_muon(params, grads, lr=0.01, adjust_lr_fn="match_rms_adamw")
    spelled = run_muon(
        params, grads, lr=0.01, adjust_lr_fn="match_rms_adamw", matched_adamw_rms=0.2
    )
    assert torch.equal(torch_default[0], spelled[0])


def test_weight_decay_shrinks_params_by_one_minus_lr_times_decay() -> None:
    # A zero gradient orthogonalizes to zero, leaving only the decay.
    start = torch.randn(8, 12)
    (decayed,) = run_muon([start], [[torch.zeros(8, 12)]] * 2, lr=0.1, weight_decay=0.5)
    torch.testing.assert_close(decayed, start * 0.95**2)


def test_tensor_lr_gives_the_same_step_as_a_float() -> None:
    params = [torch.randn(8, 12)]
    grads = [[torch.randn(8, 12)] for _ in range(2)]
    as_float = run_muon(params, grads, lr=0.02)
    as_tensor = run_muon(params, grads, lr=torch.tensor(0.02))
    torch.testing.assert_close(as_tensor[0], as_float[0], rtol=1e-6, atol=1e-7)


# -- drop-in for torch.optim.Muon ----------------------------------------------


def test_accepts_every_torch_muon_keyword_and_takes_torchs_defaults_with_them() -> None:
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    ours = inspect.signature(Muon.__init__).parameters
    assert set(theirs) <= set(ours)
    reference = torch.optim.Muon([torch.zeros(4, 4, requires_grad=True)]).param_groups[0]
    for keywords in TORCH_KEYWORDS:
        group = Muon([torch.zeros(4, 4, requires_grad=True)], **keywords).param_groups[0]
        for name in ("lr", "weight_decay", "momentum", "nesterov", "ns_steps"):
            assert group[name] == reference[name], (keywords, name)


def test_matches_torch_muon_when_newton_schulz_runs_in_bfloat16() -> None:
    torch.manual_seed(0)
    shapes = [(32, 64), (64, 32), (32, 64), (48, 48)]
    starts = [torch.randn(*s) for s in shapes]
    ours = [p.clone().requires_grad_() for p in starts]
    theirs = [p.clone().requires_grad_() for p in starts]
    opt_ours = Muon(ours, lr=0.02, adjust_lr_fn="original", ns_dtype=torch.bfloat16)
    opt_theirs = torch.optim.Muon(theirs, lr=0.02)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, start in zip(ours, theirs, starts, strict=True):
        assert relative_error(a.detach(), b.detach(), start) < 1e-2


def test_loads_a_torch_muon_state_dict_and_continues_the_same() -> None:
    torch.manual_seed(0)
    start = torch.randn(16, 24)
    theirs = start.clone().requires_grad_()
    opt_theirs = torch.optim.Muon([theirs], lr=0.02)
    theirs.grad = torch.randn_like(theirs)
    opt_theirs.step()

    ours = theirs.detach().clone().requires_grad_()
    opt_ours = Muon([ours], ns_dtype=torch.bfloat16)
    # A copy, as from a checkpoint: load_state_dict keeps the tensors it is given.
    opt_ours.load_state_dict(copy.deepcopy(opt_theirs.state_dict()))
    assert opt_ours.param_groups[0]["lr"] == 0.02
    before = theirs.detach().clone()
    theirs.grad = torch.randn_like(theirs)
    ours.grad = theirs.grad.clone()
    opt_theirs.step()
    opt_ours.step()
    assert relative_error(ours.detach(), theirs.detach(), before) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(3, 96, 40), (3, 40, 96), (2, 64, 64)])
def test_a_stack_normalized_part_by_part_as_it_fills_gives_the_same_bits(
    dtype: torch.dtype, method: str, shape: tuple[int, int, int]
) -> None:
    """Muon normalizes each param's part of a stack as it writes it; the results are those of
    the iteration normalizing the whole stack, bit for bit (tall stacks laid out transposed too)."""
    torch.manual_seed(0)
    parts = [torch.randn(1, *shape[1:]) * 10**k for k in range(shape[0])]
    coefficients = resolve_coefficients("keller", 5)
    results = []
    for by_part in (False, True):
        workspace = Workspace()
        stack = new_stack(shape, dtype, torch.device("cpu"), workspace, method)
        for part, matrix in zip(stack.split(1), parts, strict=True):
            stack_into(part, matrix, workspace)
            if by_part:
                normalize_(part, 1e-7, eps_added=True)
        result = newton_schulz_stack_(stack, coefficients, eps=1e-7, eps_added=True,
                                      method=method, workspace=workspace, normalized=by_part)  # fmt: skip
        results.append(result.clone())
    assert torch.equal(results[0], results[1])
    assert results[0].dtype == dtype and results[0].shape == shape


# -- Newton-Schulz dtype -------------------------------------------------------


@pytest.fixture
def ns_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype each batched Newton-Schulz call of Muon returned (= ran in)."""
    seen: list[torch.dtype] = []
    real = muon_module.newton_schulz_stack_

    def spy(stack: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = real(stack, *args, **kwargs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(muon_module, "newton_schulz_stack_", spy)
    return seen


@pytest.mark.parametrize(
    ("param_dtype", "ns_dtype", "native_bf16", "expected"),
    [
        (torch.float32, None, False, torch.float32),
        (torch.float32, None, True, torch.bfloat16),
        (torch.float64, None, True, torch.float64),
        (torch.bfloat16, None, False, torch.float32),
        (torch.float32, torch.bfloat16, False, torch.bfloat16),
        (torch.float32, torch.float32, True, torch.float32),
    ],
)
def test_newton_schulz_dtype_and_params_keep_their_own(
    ns_dtypes: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
    param_dtype: torch.dtype,
    ns_dtype: torch.dtype | None,
    native_bf16: bool,
    expected: torch.dtype,
) -> None:
    monkeypatch.delenv(NS_DTYPE_ENV)  # the machine's own default
    monkeypatch.setattr(options_module, "cpu_has_native_bf16", lambda: native_bf16)
    param = torch.randn(8, 16, dtype=param_dtype, requires_grad=True)
    opt = Muon([param], lr=0.02, ns_dtype=ns_dtype)
    param.grad = torch.randn_like(param)
    start = param.detach().clone()
    opt.step()
    assert ns_dtypes == [expected]
    assert param.dtype == param_dtype
    assert opt.state[param]["momentum_buffer"].dtype == param_dtype
    assert not torch.equal(param.detach(), start)


def test_default_ns_dtype_is_the_fastest_the_device_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NS_DTYPE_ENV)
    for native_bf16, on_cpu in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(options_module, "cpu_has_native_bf16", lambda n=native_bf16: n)
        assert default_ns_dtype(torch.empty(4, 4)) == on_cpu
        assert default_ns_dtype(torch.empty(4, 4, dtype=torch.bfloat16)) == on_cpu
        assert default_ns_dtype(torch.empty(4, 4, device="meta")) == torch.bfloat16
        for device in ("cpu", "meta"):
            float64 = torch.empty(4, 4, device=device, dtype=torch.float64)
            assert default_ns_dtype(float64) == torch.float64


def test_the_environment_names_the_default_ns_dtype_on_every_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for native_bf16 in (False, True):
        monkeypatch.setattr(options_module, "cpu_has_native_bf16", lambda n=native_bf16: n)
        monkeypatch.setenv(NS_DTYPE_ENV, "bfloat16")
        assert default_ns_dtype(torch.empty(4, 4)) == torch.bfloat16
        monkeypatch.setenv(NS_DTYPE_ENV, "float32")
        assert default_ns_dtype(torch.empty(4, 4, device="meta")) == torch.float32
        assert default_ns_dtype(torch.empty(4, 4, dtype=torch.float64)) == torch.float64
    param = nn.Parameter(torch.randn(8, 8))
    monkeypatch.setenv(NS_DTYPE_ENV, "bf16")
    with pytest.raises(ValueError, match=r"HYPER_PARALLEL_NS_DTYPE='bf16' is not a Newton-Schulz "
                       r"dtype; set it to one of float32, bfloat16, float16, float64"):  # fmt: skip
        Muon([param], lr=0.02)  # at construction, before any step
    Muon([param], lr=0.02, ns_dtype=torch.float32)  # a group that names its dtype ignores it


# -- Gram Newton-Schulz ----------------------------------------------------------


@pytest.mark.parametrize("coefficients", [*sorted(COEFFICIENT_SETS), "per-step triples"])
@pytest.mark.parametrize("shape", [(3, 16, 64), (2, 96, 24), (40, 40)])
def test_gram_equals_standard_within_1e_3_in_fp32(
    coefficients: str, shape: tuple[int, ...]
) -> None:
    spec: Any = coefficients
    steps = 12 if coefficients == "cubic" else 5
    if coefficients == "per-step triples":
        spec = [(4.0, -4.5, 1.8), (3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)]
        steps = 3
    triples = resolve_coefficients(spec, steps)
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    standard = newton_schulz(g, triples, method="standard")
    gram = newton_schulz(g, triples, method="gram")
    assert gram.shape == g.shape and gram.dtype == torch.float32
    reference = torch.stack(
        [reference_orthogonalize(m, triples, 1e-7) for m in g.double().reshape(-1, *shape[-2:])]
    ).reshape(shape)
    assert (gram.double() - standard.double()).norm() <= 1e-3 * standard.double().norm()
    assert (gram.double() - reference).norm() <= 1e-5 * reference.norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gram_is_stable_in_half_precision(dtype: torch.dtype) -> None:
    g = torch.randn(4, 32, 160, generator=torch.Generator().manual_seed(2))
    for name in ("keller", "polar_express"):
        triples = resolve_coefficients(name, 8)
        reference = newton_schulz(g.double(), triples, method="standard")
        gram = newton_schulz(g, triples, dtype=dtype, method="gram")
        standard = newton_schulz(g, triples, dtype=dtype, method="standard")
        assert gram.dtype == dtype and torch.isfinite(gram).all()
        err_gram = (gram.double() - reference).norm() / reference.norm()
        err_standard = (standard.double() - reference).norm() / reference.norm()
        assert err_gram < max(4 * err_standard, 1e-2), (name, err_gram, err_standard)


def test_auto_takes_gram_from_the_measured_aspect_ratio() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    threshold = GRAM_MIN_ASPECT["cpu"]
    assert resolve_ns_method("auto", 256, int(256 * threshold), cpu) == "gram"
    assert resolve_ns_method("auto", int(256 * threshold), 256, cpu) == "gram"  # tall too
    assert resolve_ns_method("auto", 256, int(256 * threshold) - 1, cpu) == "standard"
    assert resolve_ns_method("auto", 64, 64, meta) == "standard"
    large = PER_MATRIX_FROM  # where the CPU's standard iteration halves its symmetric products
    assert resolve_ns_method("auto", large, int(large * threshold), cpu) == "standard"
    assert resolve_ns_method("auto", large, int(large * GRAM_MIN_ASPECT_CPU_LARGE), cpu) == "gram"
    assert resolve_ns_method("standard", 8, 800, cpu) == "standard"
    assert resolve_ns_method("gram", 8, 8, cpu) == "gram"
    with pytest.raises(ValueError, match=r"Unknown ns_method 'grma'.*Did you mean 'gram'"):
        resolve_ns_method("grma", 8, 8, cpu)
    with pytest.raises(ValueError, match="ns_method"):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], ns_method="fast")


def test_muon_with_gram_matches_standard_per_head_and_batched() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 16), (3, 8, 40), (32, 8)]  # tall, an expert stack, and a q-projection
    standard = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    params = {
        "standard": standard,
        "gram": [torch.nn.Parameter(p.detach().clone()) for p in standard],
    }
    opts = {
        m: Muon([{"params": ps[:2]}, {"params": ps[2:], "head_dim": 4}], lr=0.02, ns_method=m)
        for m, ps in params.items()
    }
    for _ in range(3):
        for p, q in zip(params["standard"], params["gram"], strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        for opt in opts.values():
            opt.step()
    for p, q in zip(params["standard"], params["gram"], strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)
    assert all(g["ns_method"] == "gram" for g in opts["gram"].param_groups)


def test_gram_flops_undercut_standard_where_auto_takes_it() -> None:
    gram, standard = (newton_schulz_flops(256, 1024, 5, m) for m in ("gram", "standard"))
    assert gram < standard
    assert newton_schulz_flops(512, 512, 5, "gram") > newton_schulz_flops(512, 512, 5, "standard")
    # standard: 5 steps of X X^T (2 s^2 l), A A (2 s^3) and B X (2 s^2 l)
    assert newton_schulz_flops(1024, 256, 5, "standard") == 5 * (4 * 256**2 * 1024 + 2 * 256**3)


def test_batched_gram_refuses_an_unknown_method_before_any_work() -> None:
    with pytest.raises(ValueError, match="Unknown ns_method"):
        newton_schulz_batched([torch.randn(4, 8)], resolve_coefficients("keller", 5), method="x")


# -- coefficient sets ----------------------------------------------------------


def polar_factor(matrix: Tensor) -> Tensor:
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u @ vh


def one_step_update(grad: Tensor, **kwargs: Any) -> Tensor:
    """The orthogonalized update Muon applies for ``grad`` (no momentum, no decay)."""
    (after,) = run_muon(
        [torch.zeros_like(grad)],
        [[grad]],
        lr=1.0,
        weight_decay=0.0,
        momentum=0.0,
        nesterov=False,
        adjust_lr_fn="match_rms_adamw",
        **kwargs,
    )
    return -after.double() / (0.2 * math.sqrt(max(grad.shape)))


@pytest.mark.parametrize("shape", [(64, 32), (32, 96)])
def test_polar_express_is_closer_to_the_polar_factor_than_keller(shape: tuple[int, int]) -> None:
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    target = polar_factor(grad)
    keller = (one_step_update(grad) - target).norm() / target.norm()
    polar = (one_step_update(grad, ns_variant="polar_express") - target).norm()
    assert polar / target.norm() < keller / 2
    # With all 8 of its steps it is orthogonal to fp32 precision.
    full = one_step_update(grad, ns_variant="polar_express", ns_steps=8)
    torch.testing.assert_close(full, target, rtol=0, atol=1e-4)


def test_cubic_with_many_steps_converges_to_the_polar_factor() -> None:
    grad = torch.randn(48, 48, generator=torch.Generator().manual_seed(4))
    update = one_step_update(grad, ns_variant="cubic", ns_steps=40)
    torch.testing.assert_close(update, polar_factor(grad), rtol=0, atol=1e-4)


def test_a_set_name_means_the_same_as_its_triples() -> None:
    grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one_step_update(grad, ns_variant="legacy"), one_step_update(grad))
    assert torch.equal(
        one_step_update(grad, ns_variant="polar_express"),
        one_step_update(
            grad, ns_variant="custom", ns_coefficients=COEFFICIENT_SETS["polar_express"][:5]
        ),
    )
    assert resolve_coefficients("Polar-Express", 3) == COEFFICIENT_SETS["polar_express"][:3]


def test_custom_coefficients_are_cut_to_ns_steps_and_one_triple_repeats() -> None:
    triples = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.5, -0.5, 0.0)]
    assert resolve_coefficients(triples, 2) == ((3.0, -3.2, 1.2), (2.0, -1.5, 0.5))
    assert resolve_coefficients((1.5, -0.5, 0.0), 2) == ((1.5, -0.5, 0.0),) * 2
    grad = torch.randn(8, 12, generator=torch.Generator().manual_seed(6))
    expected = reference_orthogonalize(grad.double(), triples, 1e-7)
    update = one_step_update(grad, ns_variant="custom", ns_coefficients=triples, ns_steps=3)
    torch.testing.assert_close(update, expected, rtol=0, atol=1e-5)


def test_unknown_coefficient_set_names_it_and_lists_the_sets() -> None:
    with pytest.raises(ValueError, match="polar_expres") as info:
        Muon([torch.zeros(4, 4, requires_grad=True)], ns_variant="polar_expres")
    message = str(info.value)
    assert "ns_variant must be 'legacy', 'asym5', or 'custom'" in message
    assert "Did you mean 'polar_express'?" in message
    with pytest.raises(ValueError, match="Available: asym5, cubic, keller, legacy, polar_express"):
        resolve_coefficients("polar_expres", 5)


def test_newton_schulz_leaves_its_input_alone() -> None:
    matrix = torch.randn(12, 8)
    before = matrix.clone()
    out = newton_schulz(matrix, resolve_coefficients("keller", 5))
    assert torch.equal(matrix, before)
    assert out.shape == matrix.shape


# -- batching ------------------------------------------------------------------


def test_same_shape_matrices_are_batched_and_match_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch_sizes: list[int] = []
    real = muon_module.newton_schulz_stack_

    def count(stack: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        batch_sizes.append(stack.shape[0])
        return real(stack, *args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz_stack_", count)
    gen = torch.Generator().manual_seed(7)
    shapes = [(16, 24), (40, 8), (16, 24), (2, 16, 24), (40, 8)]
    params = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(2)]
    together = run_muon(params, grads, lr=0.02)
    assert sorted(batch_sizes[:2]) == [2, 4]  # one call per shape in the first step

    for i, param in enumerate(params):
        (alone,) = run_muon([param], [[g[i]] for g in grads], lr=0.02)
        torch.testing.assert_close(together[i], alone, rtol=1e-6, atol=1e-6)


def test_group_options_are_per_group() -> None:
    # The same 3-D param read as 3 matrices in one group, as 1 in another.
    start = torch.randn(3, 8, 10, generator=torch.Generator().manual_seed(8))
    grads = random_grads(start.shape, 2, seed=9)
    a = start.clone().requires_grad_()
    b = start.clone().requires_grad_()
    opt = Muon(
        [{"params": [a]}, {"params": [b], "matrix_view": "flatten", "lr": 0.01}],
        lr=0.02,
        adjust_lr_fn="original",
        ns_dtype=torch.float32,
    )
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
    assert relative_error(a.detach(), reference_muon(start, grads, (3, 8, 10)), start) < 5e-5
    expected_b = reference_muon(start, grads, (1, 3, 80), lr=0.01)
    assert relative_error(b.detach(), expected_b, start) < 5e-5


# -- errors ----------------------------------------------------------------------


def test_a_vector_param_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"shape \(8,\)") as info:
        Muon([torch.zeros(4, 8, requires_grad=True), torch.zeros(8, requires_grad=True)])
    assert "AdamW" in str(info.value)
    assert "partitioner='by_shape'" in str(info.value)
    assert "adamw_params" in str(info.value)


def test_add_param_group_refuses_a_vector_and_adds_nothing() -> None:
    opt = Muon([torch.zeros(4, 8, requires_grad=True)])
    with pytest.raises(ValueError, match=r"shape \(\)"):
        opt.add_param_group({"params": [torch.tensor(1.0, requires_grad=True)]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [torch.zeros(2, 3, requires_grad=True)], "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5
    assert opt.param_groups[1]["matrix_view"] == "auto"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr should be a finite number >= 0"),
        ({"lr": torch.tensor([0.1, 0.2])}, "1 element"),
        ({"momentum": -0.1}, "momentum should be a finite number >= 0"),
        ({"momentum": (0.9, 0.95, 0.99)}, r"a float or a pair \(m1, m2\)"),
        ({"momentum": (0.9, 0.95), "eps": 1e-7}, "has one momentum"),
        ({"weight_decay": -0.1}, "weight_decay should be a finite number >= 0"),
        ({"eps": 0.0}, "eps should be > 0"),
        ({"ns_steps": 0}, r"ns_steps must be in 1\.\.99"),
        ({"ns_steps": 100}, r"ns_steps must be in 1\.\.99"),
        ({"adjust_lr_fn": "orignal"}, "Did you mean 'original'"),
        ({"matched_adamw_rms": -0.2}, "matched_adamw_rms should be a finite number >= 0"),
        ({"matrix_view": "flat"}, "matrix_view must be one of.*Did you mean 'flatten'"),
        ({"ns_coefficients": (1.0, 2.0)}, "can only be provided when ns_variant='custom'"),
        ({"ns_coefficients": "keller"}, "ns_variant='keller'"),
        (
            {
                "ns_variant": "custom",
                "ns_steps": 2,
                "ns_coefficients": [(1.0, 2.0, 3.0), (1.0, 2.0)],
            },
            r"ns_coefficients\[1\] must contain exactly three values",
        ),
        ({"ns_dtype": torch.int32}, "floating-point torch.dtype"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([torch.zeros(4, 4, requires_grad=True)], **kwargs)


def test_bad_group_option_is_refused_in_that_group() -> None:
    with pytest.raises(ValueError, match="matrix_view must be one of .*got 'stack'"):
        Muon([{"params": [torch.zeros(2, 2, requires_grad=True)], "matrix_view": "stack"}])


def test_complex_params_and_sparse_grads_are_refused() -> None:
    with pytest.raises(ValueError, match="complex"):
        Muon([torch.zeros(4, 4, dtype=torch.complex64, requires_grad=True)])
    param = torch.zeros(4, 4, requires_grad=True)
    opt = Muon([param])
    param.grad = torch.eye(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


# -- optimizer behaviour ---------------------------------------------------------


def test_state_dict_round_trip_makes_the_identical_next_step() -> None:
    torch.manual_seed(0)
    shapes = [(16, 24), (2, 8, 12)]
    params = [torch.randn(*s, requires_grad=True) for s in shapes]
    opt = Muon(params, lr=0.02, ns_variant="polar_express", ns_dtype=torch.float32)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)

    copies = [p.detach().clone().requires_grad_() for p in params]
    fresh = Muon(copies)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for p, q in zip(params, copies, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    fresh.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh.state[q]["momentum_buffer"])


def test_step_returns_the_closure_loss_and_skips_params_without_grad() -> None:
    used = torch.randn(4, 6, requires_grad=True)
    unused = torch.randn(4, 6, requires_grad=True)
    before = unused.detach().clone()
    opt = Muon([used, unused])

    def closure() -> float:
        opt.zero_grad()
        loss = (used**2).sum()
        loss.backward()
        return float(loss.detach())

    expected_loss = float((used.detach() ** 2).sum())
    assert opt.step(closure) == expected_loss
    assert torch.equal(unused.detach(), before)
    assert unused not in opt.state


def test_registry_finds_muon_as_a_matrix_only_optimizer() -> None:
    entry = get_registry().get("optimizer", "muon")
    assert entry.obj is Muon
    assert entry.matrix_only and entry.requires == ("matrices_only",)
    assert entry.unusable_in_plain_loop() is None  # its vectors go to AdamW


@pytest.mark.parametrize(
    ("block_rows", "spec", "steps"),
    [(2, "polar_express", 5), (3, "keller", 4), (4, "cubic", 3), (100, "keller", 5)],
)
def test_large_matrices_iterate_one_by_one_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, block_rows: int, spec: str, steps: int
) -> None:
    """The per-matrix path, its symmetric block products and odd/even step counts agree."""
    from hyper_parallel_builtins.newton_schulz import _iterate as ns
    from hyper_parallel_builtins.newton_schulz import _paths as paths
    from hyper_parallel_builtins.newton_schulz import resolve_coefficients

    gen = torch.Generator().manual_seed(3)
    # a tall stack (transposed to 7 x 9) and a wide one, float64 so the paths compare exactly
    matrices = [torch.randn(3, 9, 7, generator=gen, dtype=torch.float64),
                torch.randn(7, 9, generator=gen, dtype=torch.float64)]  # fmt: skip
    coefficients = resolve_coefficients(spec, steps)
    batched = [ns.newton_schulz_batched([m], coefficients)[0] for m in matrices]
    monkeypatch.setattr(paths, "PER_MATRIX_FROM", 6)
    monkeypatch.setattr(ns, "SYMMETRIC_BLOCK_ROWS", block_rows)  # 7 rows: ragged last block
    calls = {"matrices": 0, "stripes": 0}
    iterate_one, mm = ns._iterate_one, torch.mm

    def counting_iterate_one(*args: Any) -> None:
        calls["matrices"] += 1
        iterate_one(*args)

    def counting_mm(a: Tensor, b: Tensor, **kwargs: Any) -> Tensor:
        calls["stripes"] += a.shape[0] < 7  # a product of a row stripe, not the whole matrix
        return mm(a, b, **kwargs)

    monkeypatch.setattr(ns, "_iterate_one", counting_iterate_one)
    monkeypatch.setattr(ns.torch, "mm", counting_mm)
    one_by_one = [ns.newton_schulz_batched([m], coefficients)[0] for m in matrices]
    monkeypatch.undo()
    assert calls["matrices"] == 4  # 3 + 1 matrices took the per-matrix path
    assert (calls["stripes"] > 0) == (block_rows < 7)
    for b, o in zip(batched, one_by_one, strict=True):
        torch.testing.assert_close(o, b, rtol=1e-12, atol=1e-12)
    if spec != "cubic":  # a few cubic steps converge slowly
        singular = torch.linalg.svdvals(one_by_one[1])
        assert bool(((singular > 0.6) & (singular < 1.3)).all()), singular


@pytest.mark.parametrize(
    ("kind", "bf16_one_by_one"),
    [("amx", False), ("avx512_bf16", True), ("avx2", True), ("other", True)],
)
def test_each_cpu_kind_takes_its_documented_path(
    monkeypatch: pytest.MonkeyPatch, kind: str, bf16_one_by_one: bool
) -> None:
    from hyper_parallel_builtins.newton_schulz import _iterate as ns
    from hyper_parallel_builtins.newton_schulz import _paths as paths
    from hyper_parallel_builtins.newton_schulz import resolve_coefficients

    monkeypatch.setattr(paths, "PER_MATRIX_FROM", 6)
    monkeypatch.setattr(paths, "cpu_kind", lambda: kind)
    calls, layouts = [], []
    iterate_one, update = ns._iterate_one, ns._update
    monkeypatch.setattr(ns, "_iterate_one", lambda *a: calls.append(1) or iterate_one(*a))
    monkeypatch.setattr(ns, "_update", lambda *a: layouts.append(a[-1]) or update(*a))
    stack = [torch.randn(2, 8, 12)]
    coefficients = resolve_coefficients("keller", 5)
    bf16 = ns.newton_schulz_batched(stack, coefficients, dtype=torch.bfloat16)
    assert len(calls) == (2 if bf16_one_by_one else 0)  # one by one, or one batched GEMM
    # P read as stored on the kinds that multiply bf16 natively, transposed elsewhere
    assert set(layouts) == {kind not in ("amx", "avx512_bf16")}
    calls.clear()
    fp32 = ns.newton_schulz_batched(stack, coefficients, dtype=torch.float32)
    assert len(calls) == 2  # float32 goes one by one on any CPU
    # every path orthogonalizes alike: the bf16 result is the float32 one, rounded
    torch.testing.assert_close(bf16[0].float(), fp32[0], atol=0.05, rtol=0.05)


def test_the_cpu_kind_follows_the_capability_and_onednns_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyper_parallel.core.compat import cpu_kind_of

    every = {"avx2": True, "avx512_bf16": True, "amx_bf16": True}
    assert cpu_kind_of(every, "") == "amx"
    for cap, kind in [
        ("AVX512_CORE_BF16", "avx512_bf16"),
        ("avx10_1_512_amx", "amx"),
        ("AVX2", "avx2"),
        ("AVX512_CORE", "avx2"),
        ("ALL", "amx"),
    ]:
        assert cpu_kind_of(every, cap) == kind, cap
    assert cpu_kind_of({"avx2": True, "avx512_bf16": True}, "") == "avx512_bf16"
    assert cpu_kind_of({"avx2": True}, "") == "avx2"
    assert cpu_kind_of({}, "") == "other"


def test_the_cpu_kind_is_worked_out_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel.core import compat

    compat.cpu_kind.cache_clear()
    monkeypatch.setattr(compat.torch._C._cpu, "_get_cpu_capability", lambda: {"avx2": True})
    try:
        assert compat.cpu_kind() == "avx2" and not compat.cpu_has_native_bf16()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # as oneDNN, which read its cap once
        monkeypatch.setattr(compat.torch._C._cpu, "_get_cpu_capability", lambda: {})
        assert compat.cpu_kind() == "avx2"
    finally:
        compat.cpu_kind.cache_clear()


def test_unmeasured_kinds_and_accelerators_fall_back_as_documented() -> None:
    from hyper_parallel_builtins.newton_schulz._paths import (
        ACCELERATOR_PATH,
        CPU_PATHS,
        UNMEASURED_CPU_PATH,
        cpu_path,
    )

    cpu = torch.device("cpu")
    for kind in ("amx", "avx512_bf16", "avx2"):
        assert cpu_path(torch.bfloat16, cpu, kind) is CPU_PATHS[(kind, torch.bfloat16)]
    assert cpu_path(torch.float16, cpu, "amx") is UNMEASURED_CPU_PATH
    assert cpu_path(torch.bfloat16, cpu, "other") is UNMEASURED_CPU_PATH
    assert UNMEASURED_CPU_PATH.per_matrix  # the symmetric products do fewer FLOPs
    assert cpu_path(torch.bfloat16, torch.device("meta")) is ACCELERATOR_PATH


def test_symmetric_product_equals_the_full_product_and_mirrors_the_upper_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyper_parallel_builtins.newton_schulz import _iterate as ns

    monkeypatch.setattr(ns, "SYMMETRIC_BLOCK_ROWS", 3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 5, generator=gen)
    add_to = torch.randn(8, 8, generator=gen)
    add_to = add_to + add_to.T
    out = torch.full((8, 8), float("nan"))
    ns._symmetric_product(out, x, add_to=add_to, beta=-0.5, alpha=2.0)
    torch.testing.assert_close(out, -0.5 * add_to + 2.0 * x @ x.T)
    # blocks of rows 0-2, 3-5, 6-7: those above the diagonal mirror those below
    block = torch.arange(8) // 3
    off_diagonal = block[:, None] != block[None, :]
    assert torch.equal(out[off_diagonal], out.T[off_diagonal])
    gram = torch.full((8, 8), float("nan"))
    ns._symmetric_product(gram, x)
    torch.testing.assert_close(gram, x @ x.T)


def test_newton_schulz_refuses_autograd_and_says_how_to_call_it() -> None:
    from hyper_parallel_builtins.newton_schulz import _iterate as ns
    from hyper_parallel_builtins.newton_schulz import resolve_coefficients

    coefficients = resolve_coefficients("keller", 5)
    x = torch.randn(8, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"not differentiable.*torch.no_grad\(\)"):
        ns.newton_schulz(x, coefficients)
    with torch.no_grad():
        under_no_grad = ns.newton_schulz(x, coefficients)
    torch.testing.assert_close(ns.newton_schulz(x.detach(), coefficients), under_no_grad)


def _gram_on_fsdp_owners(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    torch.manual_seed(0)
    one = torch.nn.Sequential(
        torch.nn.Linear(16, 64, bias=False), torch.nn.Linear(64, 16, bias=False)
    )
    sharded = fully_shard(copy.deepcopy(one), mesh=init_device_mesh("cpu", (world_size,)))
    opts = [Muon(m.parameters(), lr=0.02, ns_method="gram") for m in (one, sharded)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, opt in zip((one, sharded), opts, strict=True):
            model(x).square().mean().backward()  # every rank the same batch
            opt.step()
            opt.zero_grad()
    for p, q in zip(one.parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=1e-6)


def test_gram_on_the_distributed_owner_path_equals_one_process() -> None:
    from distributed import run_distributed

    run_distributed(_gram_on_fsdp_owners, world_size=2)


def test_the_ns_dtype_variable_is_read_when_muon_is_built_never_at_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NS_DTYPE_ENV, "float32")
    param = nn.Parameter(torch.randn(8, 8))
    param.grad = torch.randn(8, 8)
    opt = Muon([param], lr=0.02)
    monkeypatch.setenv(NS_DTYPE_ENV, "not-a-dtype")  # a step that read it would raise
    before = param.detach().clone()
    opt.step()
    assert opt.env_ns_dtype == torch.float32 and not torch.equal(param.detach(), before)
