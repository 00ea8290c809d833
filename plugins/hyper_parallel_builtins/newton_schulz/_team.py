"""Newton-Schulz shared by a team of ranks: each holds a band of the matrix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

from hyper_parallel_builtins.newton_schulz._coefficients import Coefficients
from hyper_parallel_builtins.newton_schulz._iterate import norm_divisor


def _band(size: int, parts: int, part: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` balanced bands of ``range(size)``."""
    return part * size // parts, (part + 1) * size // parts


def newton_schulz_team(
    slices: Sequence[Tensor],
    coefficients: Sequence[Coefficients],
    group: ProcessGroup,
    *,
    eps: float = 1e-7,
    eps_added: bool = False,
    dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """The standard iteration on column slices, shared by the ranks of ``group``.

    Each rank passes its slice ``X_j`` of shape ``(batch, m, n_j)`` of every
    matrix (``m`` no more than the whole width ``n``), the same matrices in
    the same order. Per step the ranks all-reduce the Gram matrices
    ``A = sum_j X_j X_j^T``, each forms its band of rows of
    ``P = b A + c A A``, one all-gather completes ``P``, and each updates
    its own slice: ``X_j = a X_j + P X_j``. A rank does ``1/ranks`` of the
    FLOPs of the whole matrix (:func:`newton_schulz_flops`, standard); the
    sums run in a different order from one rank's, so the result equals
    :func:`newton_schulz_batched`'s up to rounding.

    Returns:
        This rank's slices of the results, in ``dtype`` (default: the first
        slice's).
    """
    if not slices:
        return []
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    dtype = slices[0].dtype if dtype is None else dtype
    xs = [s.to(dtype, copy=True) for s in slices]
    wide = torch.promote_types(dtype, torch.float32)
    squares = torch.cat([x.to(wide).square().sum((-2, -1)) for x in xs])
    dist.all_reduce(squares, group=group)
    norms = norm_divisor(squares.sqrt_(), eps, eps_added).split([x.shape[0] for x in xs])
    for x, norm in zip(xs, norms, strict=True):
        x.div_(norm.to(dtype).view(-1, 1, 1))
    for a, b, c in coefficients:
        grams = [torch.bmm(x, x.mT) for x in xs]
        _all_reduce_each(grams, group)
        if c == 0.0:
            polys = [g.mul_(b) for g in grams]
        else:
            polys = _team_polynomial(grams, b, c, ranks, me, group)
        xs = [torch.baddbmm(x, p.mT, x, beta=a) for x, p in zip(xs, polys, strict=True)]
    return xs


def _all_reduce_each(tensors: list[Tensor], group: ProcessGroup) -> None:
    """Sum each tensor over ``group`` in place, all in one collective."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def _team_polynomial(
    grams: list[Tensor], b: float, c: float, ranks: int, me: int, group: ProcessGroup
) -> list[Tensor]:
    """``b A + c A A`` of each Gram matrix: this rank's band of rows, then one all-gather."""
    bands, heights = [], []
    for gram in grams:
        rows = gram.shape[-1]
        start, stop = _band(rows, ranks, me)
        height = -(-rows // ranks)
        band = gram.new_zeros(gram.shape[0], height, rows)
        mine = gram[:, start:stop]
        band[:, : stop - start] = torch.baddbmm(mine, mine, gram.mT, beta=b, alpha=c)
        bands.append(band.reshape(-1))
        heights.append(height)
    flat = torch.cat(bands)
    gathered = flat.new_empty(ranks * flat.numel())
    dist.all_gather_single(gathered, flat, group=group)
    per_rank = gathered.view(ranks, -1)
    polys, offset = [], 0
    for gram, height in zip(grams, heights, strict=True):
        batch, rows = gram.shape[0], gram.shape[-1]
        size = batch * height * rows
        padded = per_rank[:, offset : offset + size].view(ranks, batch, height, rows)
        heights_of = [stop - start for start, stop in (_band(rows, ranks, r) for r in range(ranks))]
        polys.append(torch.cat([padded[r, :, :h] for r, h in enumerate(heights_of)], dim=1))
        offset += size
    return polys


def newton_schulz_team_collectives(
    batch: int,
    short: int,
    coefficients: Sequence[Coefficients],
    ranks: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[str, int]]:
    """The collectives one rank makes in :func:`newton_schulz_team` for one matrix.

    ``(kind, elements)``, in elements of the iteration's ``dtype``: the
    norm's all-reduce (summed in at least float32), then per step the Gram
    all-reduce and (unless the step is cubic) the polynomial's all-gather.
    """
    wide = torch.promote_types(dtype, torch.float32)
    made = [("all_reduce", batch * wide.itemsize // dtype.itemsize)]
    for _, _, c in coefficients:
        made.append(("all_reduce", batch * short * short))
        if c != 0.0:
            made.append(("all_gather", ranks * batch * -(-short // ranks) * short))
    return made
