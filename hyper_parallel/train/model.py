"""A small GPT-style decoder named the way Llama/Qwen checkpoints are.

Attention projections ``q_proj/k_proj/v_proj/o_proj``, a SwiGLU MLP
``gate_proj/up_proj/down_proj``, RMSNorm, learned positions, and a tied or
untied ``lm_head``: the layout the user guide's param split expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["DecoderBlock", "GPTConfig", "TinyGPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of :class:`TinyGPT`."""

    vocab_size: int
    seq_len: int = 128
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_hidden: int = 352
    tied_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise HyperParallelValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        for name in ("vocab_size", "seq_len", "dim", "layers", "heads", "mlp_hidden"):
            if getattr(self, name) < 1:
                raise HyperParallelValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and SwiGLU MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.dim
        self.heads = config.heads
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)

        def heads(proj: nn.Linear) -> torch.Tensor:
            out: torch.Tensor = proj(h)
            return out.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), is_causal=True
        )
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        mlp: torch.Tensor = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + mlp


class TinyGPT(nn.Module):
    """Token + position embeddings, decoder blocks, final norm, ``lm_head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.embed_positions = nn.Embedding(config.seq_len, config.dim)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # GPT-2 style: residual projections start small so the stack begins near identity.
        for block in self.layers:
            assert isinstance(block, DecoderBlock)
            for proj in (block.o_proj, block.down_proj):
                nn.init.normal_(proj.weight, std=0.02 / (2 * config.layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for token ids ``(batch, seq)``."""
        t = ids.shape[1]
        if t > self.config.seq_len:
            raise HyperParallelValueError(
                f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}"
            )
        x = self.embed_tokens(ids) + self.embed_positions(torch.arange(t, device=ids.device))
        for block in self.layers:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of a ``(batch, seq + 1)`` window."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
