"""Newton-Schulz work buffers kept across steps: the same numbers, nothing shared that must not be."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

from hyper_parallel_builtins.muon import Muon
from hyper_parallel_builtins.newton_schulz import newton_schulz_batched, resolve_coefficients
from hyper_parallel_builtins.newton_schulz._coefficients import ASYM5_COEFFICIENTS
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

CPU = torch.device("cpu")


def test_buffers_are_not_shared_across_shapes_dtypes_or_devices() -> None:
    ws = Workspace()
    a = ws.take("gram", (2, 8, 8), torch.float32, CPU)
    assert ws.take("gram", (2, 8, 8), torch.float32, CPU) is a
    others = [
        ws.take("gram", (2, 8, 4), torch.float32, CPU),  # shape
        ws.take("gram", (4, 8, 8), torch.float32, CPU),  # batch
        ws.take("gram", (2, 8, 8), torch.bfloat16, CPU),  # dtype
        ws.take("gram", (2, 8, 8), torch.float32, torch.device("meta")),  # device
        ws.take("poly", (2, 8, 8), torch.float32, CPU),  # role
    ]
    pointers = {t.data_ptr() for t in [a, *others] if t.device.type == "cpu"}
    assert len(pointers) == 5
    assert len(ws) == 6
    assert ws.nbytes == 2 * 64 * 4 * 3 + 2 * 32 * 4 + 4 * 64 * 4 + 2 * 64 * 2
    transposed = torch.empty(3, 16, 8).mT
    like = ws.take_like("spare", transposed, torch.bfloat16)
    assert like.shape == transposed.shape and like.stride() == transposed.stride()
    assert like.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("shape", "dtype", "method"),
    [
        ((6, 32, 48), torch.float32, "standard"),  # batched, wide
        ((6, 48, 32), torch.float32, "standard"),  # batched, tall (its transposed view)
        ((2, 640, 700), torch.float32, "standard"),  # per matrix, symmetric products
        ((4, 32, 128), torch.float32, "gram"),  # Gram iteration, wide
        ((4, 128, 32), torch.bfloat16, "gram"),  # Gram iteration, tall
    ],
)
def test_results_are_bitwise_those_without_a_workspace_call_after_call(
    shape: tuple[int, ...], dtype: torch.dtype, method: str
) -> None:
    ws = Workspace()
    for seed in range(3):  # the buffers hold the last call's values: they must not leak
        gen = torch.Generator().manual_seed(seed)
        matrices = list(torch.randn(shape, generator=gen))
        fresh = newton_schulz_batched(matrices, ASYM5_COEFFICIENTS, dtype=dtype, method=method)
        kept = newton_schulz_batched(
            matrices, ASYM5_COEFFICIENTS, dtype=dtype, method=method, workspace=ws
        )
        for f, k in zip(fresh, kept, strict=True):
            assert torch.equal(f, k)
        if seed == 0:
            pointers = {(key, t.data_ptr()) for key, t in ws._buffers.items()}
        else:  # the same buffers, no new ones
            assert {(key, t.data_ptr()) for key, t in ws._buffers.items()} == pointers


def _model() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 64)] * 3 + [(160, 64), (64, 160), (2, 96, 32)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_keeps_its_buffers_and_gives_the_numbers_of_fresh_ones(ns_dtype: torch.dtype) -> None:
    params, twin = _model(), _model()
    opt = Muon(params, lr=0.02, ns_dtype=ns_dtype)
    fresh = Muon(twin, lr=0.02, ns_dtype=ns_dtype)
    fresh.workspace = None
    _steps(opt, params, 1)
    _steps(fresh, twin, 1)
    assert opt.workspace is not None and len(opt.workspace) > 0
    pointers = {key: t.data_ptr() for key, t in opt.workspace._buffers.items()}
    _steps(opt, params, 3)
    _steps(fresh, twin, 3)
    assert {key: t.data_ptr() for key, t in opt.workspace._buffers.items()} == pointers
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p, q)


def test_buffers_go_with_the_optimizer_and_copies_start_without_them() -> None:
    params = _model()
    opt = Muon(params, lr=0.02)
    _steps(opt, params, 1)
    assert opt.workspace is not None
    held = [weakref.ref(t) for t in opt.workspace._buffers.values()]
    assert held
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.workspace is not None and len(copied.workspace) == 0
    del opt
    gc.collect()
    assert all(ref() is None for ref in held)


# -- a step on one process: param by param ------------------------------------

#: Wide, tall, square and an expert stack, two of each: each shape one Newton-Schulz call.
STEP_SHAPES = [(24, 40), (24, 40), (56, 16), (56, 16), (32, 32), (32, 32), (3, 20, 36), (3, 20, 36)]


def _three_steps(
    holds_whole: bool, monkeypatch: pytest.MonkeyPatch, **options: object
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Params and momentum buffers after 3 Muon steps, stepped param by param or all at once."""
    from hyper_parallel_builtins.local_backend import LocalBackend

    monkeypatch.setattr(LocalBackend, "holds_whole", holds_whole)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in STEP_SHAPES]
    opt = Muon(params, lr=0.02, **options)  # type: ignore[arg-type]
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]


@pytest.mark.parametrize(
    "options",
    [
        {},  # HyperParallel's rule: Nesterov, the update apart from the buffer
        {"ns_dtype": torch.bfloat16, "weight_decay": 0.1},
        {"nesterov": False},  # the update is the buffer itself
        {"adjust_lr_fn": "original"},  # torch's rule (lerp)
        {"adjust_lr_fn": "original", "nesterov": False, "ns_method": "gram"},
        {"apply_lr_in_update": True, "ns_dtype": torch.float32},
    ],
)
def test_a_step_param_by_param_gives_the_numbers_of_one_over_all_updates(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, object]
) -> None:
    streamed = _three_steps(True, monkeypatch, **options)
    together = _three_steps(False, monkeypatch, **options)
    for a, b in zip(streamed[0] + streamed[1], together[0] + together[1], strict=True):
        assert torch.equal(a, b)


def test_a_step_allocates_nothing_the_size_of_a_param(monkeypatch: pytest.MonkeyPatch) -> None:
    """The updates go through one buffer per shape: none made per param per step."""
    from hyper_parallel_builtins.local_backend import LocalBackend

    def largest_allocation(holds_whole: bool) -> int:
        monkeypatch.setattr(LocalBackend, "holds_whole", holds_whole)
        params = [torch.nn.Parameter(torch.randn(64, 96)) for _ in range(6)]
        opt = Muon(params, lr=0.02, ns_dtype=torch.float32)
        for _ in range(2):  # the first step makes the workspace's buffers
            for p in params:
                p.grad = torch.randn_like(p)
            with torch.profiler.profile(profile_memory=True) as prof:
                opt.step()
        return max(e.cpu_memory_usage for e in prof.events())

    param_bytes = 64 * 96 * 4
    assert largest_allocation(True) < param_bytes / 4  # scalars and norms only
    assert largest_allocation(False) >= param_bytes  # what the same step made all at once


def test_tall_stacks_are_laid_out_transposed_only_where_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyper_parallel_builtins.newton_schulz import _iterate as ns
    from hyper_parallel_builtins.newton_schulz import _paths as paths

    monkeypatch.setattr(paths, "cpu_kind", lambda: "amx")
    assert paths.CPU_PATHS[("amx", torch.bfloat16)].tall_transposed
    stack = ns.new_stack((3, 48, 16), torch.bfloat16, CPU, None)
    assert stack.shape == (3, 48, 16) and stack.mT.is_contiguous()  # iterated contiguous
    for laid_out_as_is in [
        ns.new_stack((3, 16, 48), torch.bfloat16, CPU, None),  # wide
        ns.new_stack((3, 48, 16), torch.float32, CPU, None),  # float32: not measured faster
        ns.new_stack((3, 64, 16), torch.bfloat16, CPU, None, "auto"),  # Gram's aspect
    ]:
        assert laid_out_as_is.is_contiguous()
    for kind in ("avx512_bf16", "avx2", "other"):
        monkeypatch.setattr(paths, "cpu_kind", lambda kind=kind: kind)
        assert ns.new_stack((3, 48, 16), torch.bfloat16, CPU, None).is_contiguous()

    # the numbers do not depend on the layout beyond rounding: the iteration is the same
    coefficients = resolve_coefficients("keller", 5)
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.randn(2, 48, 16, generator=gen), torch.randn(48, 16, generator=gen)]
    monkeypatch.setattr(paths, "cpu_kind", lambda: "amx")
    transposed = ns.newton_schulz_batched(matrices, coefficients, dtype=torch.bfloat16)
    monkeypatch.setattr(paths, "cpu_kind", lambda: "avx2")
    as_is = ns.newton_schulz_batched(matrices, coefficients, dtype=torch.bfloat16)
    for a, b in zip(transposed, as_is, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)
