"""Newton-Schulz work buffers kept across steps: the same numbers, nothing shared that must not be."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

from hyper_parallel_builtins.muon import Muon
from hyper_parallel_builtins.newton_schulz import (
    ASYM5_COEFFICIENTS,
    Workspace,
    newton_schulz_batched,
)

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
