"""Shared fixtures: a small guide-style transformer, a clean plugin registry, torchrun's
environment for one process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import free_port
from torch import nn

from hyper_parallel import get_registry

#: ``hyper-parallel train`` arguments for a model small enough for a test.
TINY_TRAIN_ARGS = [
    "--dim",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--no-progress",
]


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Reload plugins before and after the test (env changes, monkeypatched discovery)."""
    get_registry().reset()
    try:
        yield
    finally:
        get_registry().reset()


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchrun's environment for a world of one; the process group is torn down after."""
    assert not dist.is_initialized()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Attention-shaped and SwiGLU-shaped projections, named like Llama/Qwen layers."""

    def __init__(self, dim: int, hidden: int, qkv_bias: bool) -> None:
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_norm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_norm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.o_proj(att @ v)
        h = self.post_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):
    """A two-layer decoder-shaped model: embedding, blocks, final norm, lm_head."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        hidden: int = 32,
        layers: int = 2,
        qkv_bias: bool = True,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, qkv_bias) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


@pytest.fixture
def batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 9), generator=gen)


@contextmanager
def counting_newton_schulz() -> Iterator[list[int]]:
    """Record how many matrices each Newton-Schulz call of Muon gets on this process."""
    import hyper_parallel_builtins.muon as muon_module

    counted: list[int] = []
    real = muon_module.newton_schulz_batched

    def counting(matrices: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        counted.append(sum(m.shape[0] for m in matrices))
        return real(matrices, *args, **kwargs)

    muon_module.newton_schulz_batched = counting  # type: ignore[assignment]
    try:
        yield counted
    finally:
        muon_module.newton_schulz_batched = real  # type: ignore[assignment]
