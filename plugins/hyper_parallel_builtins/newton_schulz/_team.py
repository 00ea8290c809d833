"""Newton-Schulz shared by a team of ranks: each holds a band of the matrix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

from hyper_parallel_builtins.newton_schulz._coefficients import Coefficients
from hyper_parallel_builtins.newton_schulz._iterate import buffer_like, new_buffer, norm_divisor
from hyper_parallel_builtins.newton_schulz._workspace import Workspace


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
    workspace: Workspace | None = None,
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
        slice's). With a ``workspace`` they are views of its buffers, valid
        until its next call on these shapes.
    """
    if not slices:
        return []
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    dtype = slices[0].dtype if dtype is None else dtype
    xs = [buffer_like(workspace, f"team_in{i}", s, dtype).copy_(s) for i, s in enumerate(slices)]
    wide = torch.promote_types(dtype, torch.float32)
    squares = torch.cat([x.to(wide).square().sum((-2, -1)) for x in xs])
    dist.all_reduce(squares, group=group)
    norms = norm_divisor(squares.sqrt_(), eps, eps_added).split([x.shape[0] for x in xs])
    for x, norm in zip(xs, norms, strict=True):
        x.div_(norm.to(dtype).view(-1, 1, 1))
    grams_flat = new_buffer(
        workspace, "team_grams", (sum(x.shape[0] * x.shape[1] ** 2 for x in xs),), xs[0]
    )
    for step, (a, b, c) in enumerate(coefficients):
        grams = _views(grams_flat, [(x.shape[0], x.shape[1], x.shape[1]) for x in xs])
        for x, gram in zip(xs, grams, strict=True):
            torch.bmm(x, x.mT, out=gram)
        dist.all_reduce(grams_flat, group=group)
        if c == 0.0:
            polys = [g.mul_(b) for g in grams]
        else:
            polys = _team_polynomial(grams, b, c, ranks, me, group, workspace)
        xs = [
            torch.baddbmm(
                x, p.mT, x, beta=a, out=new_buffer(workspace, f"team_x{i}_{step % 2}", x.shape, x)
            )
            for i, (x, p) in enumerate(zip(xs, polys, strict=True))
        ]
    return xs


def _views(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Consecutive views of ``flat``, one per shape."""
    sizes = [math.prod(shape) for shape in shapes]
    return [
        part.view(shape)
        for part, shape in zip(flat[: sum(sizes)].split(sizes), shapes, strict=True)
    ]


def _team_polynomial(
    grams: list[Tensor],
    b: float,
    c: float,
    ranks: int,
    me: int,
    group: ProcessGroup,
    workspace: Workspace | None,
) -> list[Tensor]:
    """``b A + c A A`` of each Gram matrix: this rank's band of rows, then one all-gather."""
    heights = [-(-gram.shape[-1] // ranks) for gram in grams]
    band_shapes = [(g.shape[0], h, g.shape[-1]) for g, h in zip(grams, heights, strict=True)]
    flat = new_buffer(workspace, "team_bands", (sum(map(math.prod, band_shapes)),), grams[0])
    flat.zero_()  # the rows a band pads out travel but are never read
    for gram, band in zip(grams, _views(flat, band_shapes), strict=True):
        start, stop = _band(gram.shape[-1], ranks, me)
        mine = gram[:, start:stop]
        torch.baddbmm(mine, mine, gram.mT, beta=b, alpha=c, out=band[:, : stop - start])
    gathered = new_buffer(workspace, "team_gathered", (ranks * flat.numel(),), flat)
    dist.all_gather_single(gathered, flat, group=group)
    per_rank = gathered.view(ranks, -1)
    polys, offset = [], 0
    for i, (gram, height) in enumerate(zip(grams, heights, strict=True)):
        batch, rows = gram.shape[0], gram.shape[-1]
        size = batch * height * rows
        padded = per_rank[:, offset : offset + size].view(ranks, batch, height, rows)
        heights_of = [stop - start for start, stop in (_band(rows, ranks, r) for r in range(ranks))]
        parts = [padded[r, :, :h] for r, h in enumerate(heights_of)]
        polys.append(
            torch.cat(parts, dim=1, out=new_buffer(workspace, f"team_poly{i}", gram.shape, gram))
        )
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
