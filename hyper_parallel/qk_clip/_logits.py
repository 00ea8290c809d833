"""Each query head's largest pre-softmax logit, computed a slice of queries at a time."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["max_logits"]

#: Logits held at once: the extra memory the max costs (64 MiB in float32).
CHUNK_ELEMENTS = 1 << 24
#: Queries per slice at most: a causal slice multiplies only the keys it can see.
MAX_ROWS = 128


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
        scaling: The factor on ``q . k`` (``head_dim ** -0.5`` usually), > 0.
        mask: Broadcastable to ``(batch, heads, q_len, k_len)``: boolean
            (``True`` attends) or additive (``0`` attends, large negative
            does not); or ``(batch, k_len)`` padding (nonzero attends).
        causal: Query ``i`` sees keys up to ``i + k_len - q_len`` (with no mask).
        sliding_window: With ``causal``, it sees the last ``sliding_window`` of them.

    Returns:
        ``(heads,)`` float32; ``-inf`` for a head that saw no key.

    The logits are formed in the attention's own dtype (as it computes
    them) a slice of queries at a time (at most ``CHUNK_ELEMENTS``), so the
    extra memory is bounded whatever the sequence length; a causal slice
    with no mask multiplies only the keys it can see.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.transpose(-1, -2)  # (b, kv, d, k)
    grouped = query.view(batch, kv_heads, group, q_len, dim)
    rows = min(MAX_ROWS, max(1, CHUNK_ELEMENTS // max(1, batch * heads * k_len)))
    best = torch.full((kv_heads, group), float("-inf"), device=query.device)
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        # keys a causal slice can see without a mask: up to its last query's position
        seen = k_len if mask is not None or not causal else min(k_len, stop + k_len - q_len)
        flat = grouped[:, :, :, start:stop].reshape(batch, kv_heads, group * (stop - start), dim)
        logits = (flat @ keys_t[..., :seen]).view(batch, kv_heads, group, stop - start, seen)
        if mask is None and causal and sliding_window is None:  # only the diagonal block hides keys
            offset = start + k_len - q_len
            logits[..., max(0, offset) :].masked_fill_(
                _hidden(offset, stop - start, seen, query.device), float("-inf")
            )
            allowed = None
        else:
            allowed = _allowed(
                mask, causal, sliding_window, (start, stop), q_len, k_len, query.device
            )
        if allowed is not None and allowed.dtype != torch.bool:  # additive: scale, then add
            logits.mul_(scaling).add_(_by_head(allowed, kv_heads, group))
            chunk = logits.amax(dim=(0, 3, 4)).float()
        else:  # the max of the unscaled logits, scaled (scaling > 0): one pass over them
            if allowed is not None:
                logits.masked_fill_(~_by_head(allowed, kv_heads, group)[..., :seen], float("-inf"))
            chunk = logits.amax(dim=(0, 3, 4)).float().mul_(scaling)
        torch.maximum(best, chunk, out=best)
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


def _hidden(offset: int, rows: int, seen: int, device: torch.device) -> Tensor:
    """Of keys ``[max(0, offset), seen)``, those each of ``rows`` causal queries does not see
    (query ``r`` sees keys up to ``offset + r``)."""
    first = max(0, offset)
    i = torch.arange(rows, device=device)[:, None] + offset
    j = torch.arange(first, seen, device=device)[None, :]
    return j > i


def _by_head(allowed: Tensor, kv_heads: int, group: int) -> Tensor:
    """``allowed`` (``(t, k)``, or 4-D with one head or every head) shaped like ``(b, kv, g, t, k)``."""
    if allowed.ndim == 4 and allowed.shape[1] != 1:  # per head: (b, kv * g, t, k)
        return allowed.view(allowed.shape[0], kv_heads, group, *allowed.shape[2:])
    return allowed.unsqueeze(1) if allowed.ndim == 4 else allowed
