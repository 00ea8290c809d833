"""Muon's Newton-Schulz as a team of ranks computes it: the ``TeamTransform`` Muon hands its backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hyper_parallel_builtins.muon._matrices import batch_dims, matrix_shape
from hyper_parallel_builtins.muon._options import resolve_settings
from hyper_parallel_builtins.muon._update import MuonSettings, as_update, live_lr
from hyper_parallel_builtins.newton_schulz import (
    Workspace,
    newton_schulz_flops,
    newton_schulz_team,
    newton_schulz_team_collectives,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MuonTeam"]


class MuonTeam:
    """Newton-Schulz of a group's whole matrices as a team of ranks computes it.

    The :class:`~hyper_parallel.core.distributed.TeamTransform` Muon hands
    its sharding backend. Members slice the columns of the iterated matrix
    (the rows of a tall param, which is iterated transposed; else its first
    column dim) and run :func:`newton_schulz_team`; each result is scaled
    like a whole one's. A team always runs the standard iteration (whatever
    ``ns_method``), in one dtype for the group (``ns_dtype``, else the
    default for its first param), and sums its Gram matrices in that dtype.

    Args:
        group: A Muon param group (its coefficients, normalization, scale
            and ``matrix_view``; its lr, read at each call, for
            ``apply_lr_in_update``).
        dtype: The Newton-Schulz dtype.
        workspace: Work buffers kept across steps (the optimizer's), or ``None``.
        settings: What the group's options decide; ``None``: worked out from
            ``group`` now (Muon passes the ones it keeps).
    """

    def __init__(
        self,
        group: Mapping[str, Any],
        dtype: torch.dtype,
        workspace: Workspace | None = None,
        settings: MuonSettings | None = None,
    ) -> None:
        if settings is None:
            settings = resolve_settings(group)
        self.group, self.dtype = group, dtype
        self.workspace = workspace
        self.settings = settings
        self.coefficients = settings.coefficients

    def split_dim(self, shape: torch.Size) -> int | None:
        _, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        batch = batch_dims(len(shape), self.group["matrix_view"])
        return batch if rows > cols else batch + 1

    def cost(self, shape: torch.Size, members: int) -> float:
        batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        return batch * newton_schulz_flops(rows, cols, len(self.coefficients), "standard") / members

    def collectives(self, shape: torch.Size, members: int) -> list[tuple[str, int]]:
        batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
        return newton_schulz_team_collectives(
            batch, min(rows, cols), self.coefficients, members, self.dtype
        )

    def __call__(
        self, slices: list[Tensor], shapes: list[torch.Size], group: ProcessGroup
    ) -> list[Tensor]:
        views, talls, scales, lr = [], [], [], live_lr(self.group)
        for piece, shape in zip(slices, shapes, strict=True):
            batch, rows, cols = matrix_shape(shape, self.group["matrix_view"])
            tall = rows > cols
            x = piece.reshape(batch, -1, cols) if tall else piece.reshape(batch, rows, -1)
            views.append(x.mT if tall else x)
            talls.append(tall)
            scales.append(self.settings.scale(rows, cols, lr))
        results = newton_schulz_team(
            views,
            self.coefficients,
            group,
            eps=self.settings.eps,
            eps_added=self.settings.eps_added,
            dtype=self.dtype,
            workspace=self.workspace,
        )
        return [
            as_update((r.mT if tall else r).reshape(piece.shape), piece.dtype, scale)
            for r, tall, piece, scale in zip(results, talls, slices, scales, strict=True)
        ]
