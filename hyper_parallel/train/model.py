"""A small GPT-style decoder named the way Llama/Qwen checkpoints are.

Attention projections ``q_proj/k_proj/v_proj/o_proj``, a SwiGLU MLP
``gate_proj/up_proj/down_proj``, RMSNorm, positions learned (GPT-2's table),
rotary (Llama's) or none, and a tied or untied ``lm_head``: the layout the
user guide's param split expects.

The one toy decoder of the project: ``hyper-parallel train`` trains it,
:func:`hyper_parallel.testing.check_partitioner` splits it, and the tests
build it small (a subclass may rename the block norms through
:attr:`DecoderBlock.norm_names` and swap the block class through
:attr:`TinyGPT.block_type`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.qk_clip import QKLayout

__all__ = ["DecoderBlock", "GPTConfig", "Positions", "RMSNorm", "Rotary", "TinyGPT"]


class Positions(str, Enum):
    """How :class:`TinyGPT` tells token positions apart."""

    #: A learned table added to the token embeddings (GPT-2); it limits sequences to ``seq_len``.
    LEARNED = "learned"
    #: Each head's queries and keys rotated by their position (RoPE, as in Llama); no limit.
    ROTARY = "rotary"
    #: Nothing but the causal mask; no limit.
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of :class:`TinyGPT`."""

    vocab_size: int
    seq_len: int = 128  # the longest sequence: the size of the position table
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_hidden: int = 352
    tied_embeddings: bool = False
    qkv_bias: bool = False
    positions: Positions | str = Positions.LEARNED  # a name ("rotary") is made a Positions
    rope_theta: float = 10000.0  # the base of the rotary frequencies (Llama's)
    init_std: float | None = 0.02  # GPT-2's init (see TinyGPT); None: PyTorch's default init

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "positions", Positions(self.positions))
        except ValueError:
            choices = ", ".join(repr(p.value) for p in Positions)
            raise HyperParallelValueError(
                f"positions={self.positions!r} is not one of {choices}"
            ) from None
        if self.dim % self.heads:
            raise HyperParallelValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        if self.positions is Positions.ROTARY and (self.dim // self.heads) % 2:
            raise HyperParallelValueError(
                f"rotary positions need an even head size, got dim={self.dim} / "
                f"heads={self.heads} = {self.dim // self.heads}; change dim or heads"
            )
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


class Rotary(NamedTuple):
    """The cosines and sines that rotate a sequence's queries and keys, ``(seq, head_dim)`` each."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, seq: int, head_dim: int, theta: float, device: torch.device) -> Rotary:
        """Llama's rotation: pair ``i`` of a head (dims ``i`` and ``i + head_dim / 2``) turns
        by ``position * theta ** (-2 i / head_dim)``."""
        half = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), theta**-half)
        angles = torch.cat((angles, angles), dim=-1)
        return cls(angles.cos(), angles.sin())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(batch, heads, seq, head_dim)``, each position rotated."""
        first, second = x.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
        return x * self.cos.to(x.dtype) + turned * self.sin.to(x.dtype)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and SwiGLU MLP, each with a residual."""

    #: Names of the norm before attention and the norm before the MLP (Llama's).
    norm_names: ClassVar[tuple[str, str]] = ("input_layernorm", "post_attention_layernorm")
    #: The attention function; :func:`hyper_parallel.qk_clip.track` gives a tracked block
    #: one of its own that also records each head's largest logit.
    attention: ClassVar[Callable[..., torch.Tensor]] = staticmethod(F.scaled_dot_product_attention)

    def __init__(
        self, dim: int, mlp_hidden: int, qkv_bias: bool = False, *, heads: int = 1
    ) -> None:
        super().__init__()
        self.heads = heads
        self.add_module(self.norm_names[0], RMSNorm(dim))
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.add_module(self.norm_names[1], RMSNorm(dim))
        self.gate_proj = nn.Linear(dim, mlp_hidden, bias=False)
        self.up_proj = nn.Linear(dim, mlp_hidden, bias=False)
        self.down_proj = nn.Linear(mlp_hidden, dim, bias=False)

    def qk_layout(self) -> QKLayout:
        """Where this block's query and key heads are, for QK-clip."""
        bias = self.q_proj.bias is not None
        return QKLayout(
            query="q_proj.weight",
            key="k_proj.weight",
            head_dim=self.q_proj.out_features // self.heads,
            num_heads=self.heads,
            query_bias="q_proj.bias" if bias else None,
            key_bias="k_proj.bias" if bias else None,
        )

    def forward(self, x: torch.Tensor, rotary: Rotary | None = None) -> torch.Tensor:
        """``x`` of shape ``(batch, seq, dim)``; ``rotary`` turns the queries and keys."""
        b, t, d = x.shape
        attention_norm, mlp_norm = (self.get_submodule(name) for name in self.norm_names)
        h = attention_norm(x)

        def heads(proj: nn.Linear) -> torch.Tensor:
            out: torch.Tensor = proj(h)
            return out.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k = heads(self.q_proj), heads(self.k_proj)
        if rotary is not None:
            q, k = rotary(q), rotary(k)
        att = self.attention(q, k, heads(self.v_proj), is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        h = mlp_norm(x)
        mlp: torch.Tensor = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + mlp


class TinyGPT(nn.Module):
    """Token (+ position) embeddings, decoder blocks, final norm, ``lm_head``."""

    #: The class of each of :attr:`layers`.
    block_type: ClassVar[type[DecoderBlock]] = DecoderBlock

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        if config.positions is Positions.LEARNED:
            self.embed_positions = nn.Embedding(config.seq_len, config.dim)
        self.layers = nn.ModuleList(
            self.block_type(config.dim, config.mlp_hidden, config.qkv_bias, heads=config.heads)
            for _ in range(config.layers)
        )
        self.norm = RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.init_std is not None:
            self._init_weights(config.init_std)
        if config.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self, std: float) -> None:
        """GPT-2's init: matrices and embeddings ``N(0, std)``, biases zero.

        The residual projections (``o_proj``, ``down_proj``) start smaller, so the
        stack begins near identity.
        """

        def normal(module: nn.Module) -> None:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

        self.apply(normal)
        for block in self.layers:
            assert isinstance(block, DecoderBlock)
            for proj in (block.o_proj, block.down_proj):
                nn.init.normal_(proj.weight, std=std / (2 * self.config.layers) ** 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for token ids ``(batch, seq)``."""
        config, t = self.config, ids.shape[1]
        x = self.embed_tokens(ids)
        rotary = None
        if config.positions is Positions.LEARNED:
            if t > config.seq_len:
                raise HyperParallelValueError(
                    f"sequence of {t} tokens is longer than seq_len={config.seq_len}"
                )
            x = x + self.embed_positions(torch.arange(t, device=ids.device))
        elif config.positions is Positions.ROTARY:
            rotary = Rotary.of(t, config.dim // config.heads, config.rope_theta, ids.device)
        for block in self.layers:
            x = block(x, rotary)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of a ``(batch, seq + 1)`` window."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
