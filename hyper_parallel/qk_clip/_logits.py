"""Each query head's largest pre-softmax logit, computed a slice of queries at a time."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["max_logits"]

#: Logits held at once (float32 elements): the extra memory the max costs, about 64 MiB.
CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def max_logits(
    query: Tensor,
    key: Tensor,
    *,
    scaling: float,
    mask: Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
) -> Tensor:
    """The largest ``scaling * q . k`` of each query head over batch, queries and the keys it sees.

    Args:
        query: ``(batch, heads, q_len, head_dim)``, rotary already applied.
        key: ``(batch, kv_heads, k_len, head_dim)``; ``heads`` a multiple of
            ``kv_heads`` (query head ``h`` reads key head ``h // (heads // kv_heads)``).
        scaling: The factor on ``q . k`` (``head_dim ** -0.5`` usually).
        mask: Broadcastable to ``(batch, heads, q_len, k_len)``: boolean
            (``True`` attends) or additive (``0`` attends, large negative
            does not); or ``(batch, k_len)`` padding (nonzero attends).
        causal: Query ``i`` sees keys up to ``i + k_len - q_len`` (with no mask).
        sliding_window: With ``causal``, it sees the last ``sliding_window`` of them.

    Returns:
        ``(heads,)`` float32; ``-inf`` for a head that saw no key.

    The logits are formed ``CHUNK_ELEMENTS`` at a time in float32, so the
    extra memory is bounded whatever the sequence length.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.float().transpose(-1, -2).unsqueeze(2)  # (b, kv, 1, d, k)
    grouped = query.view(batch, kv_heads, group, q_len, dim)
    step = max(1, CHUNK_ELEMENTS // max(1, batch * heads * k_len))
    best = torch.full((kv_heads, group), float("-inf"), device=query.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        logits = (grouped[:, :, :, start:stop].float() @ keys_t) * scaling  # (b, kv, g, t, k)
        allowed = _allowed(mask, causal, sliding_window, (start, stop), q_len, k_len, query.device)
        if allowed is not None:
            logits = _masked(logits, allowed, batch, kv_heads, group)
        torch.maximum(best, logits.amax(dim=(0, 3, 4)), out=best)
    return best.flatten()


def _allowed(
    mask: Tensor | None,
    causal: bool,
    window: int | None,
    rows: tuple[int, int],
    q_len: int,
    k_len: int,
    device: torch.device,
) -> Tensor | None:
    """``mask`` cut to the query rows ``[start, stop)``, or the causal (window) rule as a bool."""
    start, stop = rows
    if mask is not None and mask.ndim != 2:
        return mask[..., start:stop, :] if mask.shape[-2] == q_len else mask
    allowed = None
    if causal:
        i = torch.arange(start, stop, device=device)[:, None] + (k_len - q_len)
        j = torch.arange(k_len, device=device)[None, :]
        allowed = j <= i
        if window is not None:
            allowed &= j > i - window
    if mask is not None:  # (batch, k_len) padding
        padding = (mask != 0)[:, None, None, :]
        allowed = padding if allowed is None else padding & allowed
    return allowed


def _masked(logits: Tensor, allowed: Tensor, batch: int, kv_heads: int, group: int) -> Tensor:
    """``logits`` ``(b, kv, g, t, k)`` with what ``allowed`` excludes at ``-inf`` (or added)."""
    if allowed.ndim == 4 and allowed.shape[1] != 1:  # per head: (b, kv * g, t, k)
        allowed = allowed.view(allowed.shape[0], kv_heads, group, *allowed.shape[2:])
    else:  # no head dim, or one for all heads
        allowed = allowed.unsqueeze(1) if allowed.ndim == 4 else allowed
    if allowed.dtype == torch.bool:
        return logits.masked_fill(~allowed, float("-inf"))
    return logits + allowed.float()
