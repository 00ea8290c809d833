"""The clip: each tracked head's ``gamma`` from the step's maxima, and its rows scaled in place.

For query head ``h`` with largest logit ``S_h`` over the step (reduced with
max over every rank), ``gamma_h = min(1, tau / S_h)``. ``W_q``'s rows of head
``h`` are multiplied by ``gamma_h ** alpha``; a key head shared by the query
heads ``H_k`` (grouped-query attention) by ``min(gamma_h for h in H_k) **
(1 - alpha)``. Each head's logits then shrink by at least ``gamma_h``, so
none stays over ``tau``, and a head under ``tau`` whose key head is its own
is left bit for bit (its rows are multiplied by exactly 1).

:class:`ClipPlan` is worked out once, when an optimizer's groups or the
tracked layers change: which tensor the optimizer steps for each layer's
``W_q``/``W_k`` (and biases), and which of their rows this rank holds, so a
sharded param (FSDP rows that cut heads, tensor parallel, both) is scaled
on its local shard with no gather.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hyper_parallel.core.distributed.toolkit import Layout, local_layout, local_tensor
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.qk_clip._layers import QKLayer, tracked_layers

__all__ = ["ClipGroup", "ClipPlan", "QKClipStats", "plan_clip"]


@dataclass(frozen=True)
class QKClipStats:
    """What one step's QK-clip saw and did (over every rank and every tracked head)."""

    max_logit: float  #: the largest pre-softmax logit of the step, before the clip
    max_logit_after: float  #: the largest once each head's logits take the clip's factor
    heads_clipped: int  #: query heads whose largest logit exceeded the threshold
    heads: int  #: query heads clipped by this optimizer's threshold (all tracked layers it steps)

    def as_dict(self) -> dict[str, float | int]:
        """The fields by name (for logs: ``qk_max_logit``, ``qk_max_logit_after``, ...)."""
        return {
            "qk_max_logit": self.max_logit,
            "qk_max_logit_after": self.max_logit_after,
            "qk_heads_clipped": self.heads_clipped,
            "qk_heads": self.heads,
        }


@dataclass(frozen=True)
class ClipGroup:
    """One optimizer param group as the plan reads it: its params, their names, its options."""

    params: Sequence[Tensor]
    names: Sequence[str | None]
    threshold: float | None  # None: the group does not clip
    alpha: float


class _Role(enum.Enum):
    QUERY = "query"
    KEY = "key"


@dataclass(frozen=True)
class _Stretch:
    """Rows ``[first_row, first_row + heads * head_dim)`` of a tensor: one layer's query or key heads."""

    layer: int  # index into ClipPlan.layers
    role: _Role
    first_row: int


@dataclass(frozen=True)
class _Scaled:
    """A tensor the clip scales: its rows, the rows this rank holds, and the heads among them."""

    tensor: Tensor
    rows: int
    local_rows: Layout
    stretches: tuple[_Stretch, ...]


@dataclass(frozen=True)
class _LayerClip:
    layer: QKLayer
    threshold: float
    alpha: float


@dataclass(frozen=True)
class ClipPlan:
    """What an optimizer's QK-clip scales, worked out once (see :func:`plan_clip`)."""

    layers: tuple[_LayerClip, ...]
    tensors: tuple[_Scaled, ...]

    @torch.no_grad()
    def clip_(self) -> QKClipStats:
        """Read the layers' maxima, reduce them over the ranks, scale the heads over threshold.

        :meth:`check_ready` first: every layer has maxima.
        """
        maxima = torch.cat([entry.layer.take_maxima() for entry in self.layers])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        per_layer = maxima.split([entry.layer.layout.num_heads for entry in self.layers])
        factors = [_Factors.of(entry, s) for entry, s in zip(self.layers, per_layer, strict=True)]
        for scaled in self.tensors:
            _scale_rows_(scaled, factors, self.layers)
        after = maxima * torch.cat([f.logit for f in factors])
        clipped = torch.stack([f.clipped for f in factors]).sum()
        before_, after_, clipped = torch.stack(
            [maxima.max(), after.max(), clipped.float()]
        ).tolist()
        return QKClipStats(before_, after_, int(clipped), maxima.numel())

    def check_ready(self) -> None:
        """Raise, before the step changes anything, for a layer that recorded no logits since
        the last step."""
        for entry in self.layers:
            if not entry.layer.has_maxima:
                raise HyperParallelValueError(
                    f"QK-clip: attention layer {entry.layer.name!r} recorded no logits since the "
                    "last step; run the tracked model's forward pass in training mode "
                    "(model.train()) before optimizer.step(), or unset qk_clip_threshold."
                )


@dataclass(frozen=True)
class _Factors:
    """One layer's factors: per query head, per key head, and the logit factor of each query head."""

    query: Tensor
    key: Tensor
    logit: Tensor
    clipped: Tensor  # how many of the layer's query heads passed the threshold (0-d)

    @classmethod
    def of(cls, entry: _LayerClip, maxima: Tensor) -> _Factors:
        layout = entry.layer.layout
        over = maxima > entry.threshold
        gamma = torch.where(over, entry.threshold / maxima, torch.ones_like(maxima))
        shared = gamma.view(layout.kv_heads, -1).amin(dim=1)  # a key head: its heads' smallest
        query, key = gamma.pow(entry.alpha), shared.pow(1.0 - entry.alpha)
        logit = query * key.repeat_interleave(layout.num_heads // layout.kv_heads)
        return cls(query, key, logit, over.sum())

    def of_role(self, role: _Role) -> Tensor:
        return self.query if role is _Role.QUERY else self.key


def _scale_rows_(
    scaled: _Scaled, factors: Sequence[_Factors], layers: Sequence[_LayerClip]
) -> None:
    local = local_tensor(scaled.tensor)
    full = torch.ones(scaled.rows, device=local.device, dtype=torch.float32)
    for stretch in scaled.stretches:
        head_dim = layers[stretch.layer].layer.layout.head_dim
        per_row = factors[stretch.layer].of_role(stretch.role).repeat_interleave(head_dim)
        rows = full[stretch.first_row : stretch.first_row + per_row.numel()]
        rows.mul_(per_row.to(rows.device))
    mine = scaled.local_rows.take(full).to(local.dtype)
    local.mul_(mine.view(-1, *([1] * (local.ndim - 1))))


# -- the plan --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stepped:
    """A tensor an optimizer group steps, and whether it is the model's param itself."""

    group: ClipGroup
    tensor: Tensor
    itself: bool


class _Index:
    """The optimizer's stepped tensors by identity, and by param name those that are no tracked
    layer's own param (fp32 main copies): a twin model's layer of the same name is not ours."""

    def __init__(self, groups: Sequence[ClipGroup], layers: Sequence[QKLayer]) -> None:
        own = {id(layer.tensor(path)) for layer in layers
               for path in (layer.layout.query, layer.layout.key)}  # fmt: skip
        self.by_id = {id(p): (g, p) for g in groups for p in g.params}
        self.by_name = {n: (g, p) for g in groups for p, n in zip(g.params, g.names, strict=True)
                        if n is not None and id(p) not in own}  # fmt: skip

    def find(self, layer: QKLayer, path: str) -> _Stepped | None:
        hit = self.by_id.get(id(layer.tensor(path)))
        if hit is not None:
            return _Stepped(hit[0], hit[1], True)
        hit = self.by_name.get(f"{layer.name}.{path}" if layer.name else path)
        return None if hit is None else _Stepped(hit[0], hit[1], False)


def _layer_entry(
    layer: QKLayer, index: _Index
) -> tuple[_LayerClip, list[tuple[Tensor, _Role, int]]] | None:
    """The layer's clip options and ``(tensor, role, first_row)`` to scale, if this optimizer clips it."""
    layout = layer.layout
    query = index.find(layer, layout.query)
    if query is None or query.group.threshold is None:
        return None
    options = (query.group.threshold, query.group.alpha)
    key = index.find(layer, layout.key)
    if key is None or (key.group.threshold, key.group.alpha) != options:
        where = "not stepped by this optimizer" if key is None else "in a group with other options"
        raise HyperParallelValueError(
            f"QK-clip layer {layer.name!r}: W_q ({layout.query!r}) is clipped with "
            f"qk_clip_threshold={options[0]}, qk_clip_alpha={options[1]}, but W_k "
            f"({layout.key!r}) is {where}; give both to one Muon with the same "
            "qk_clip_threshold and qk_clip_alpha."
        )
    targets = [
        (query.tensor, _Role.QUERY, layout.query_row),
        (key.tensor, _Role.KEY, layout.key_row),
    ]
    for path, role, first_row in ((layout.query_bias, _Role.QUERY, layout.query_row),
                                  (layout.key_bias, _Role.KEY, layout.key_row)):  # fmt: skip
        if path is None:
            continue
        if not query.itself:
            raise HyperParallelValueError(
                f"QK-clip layer {layer.name!r} has a {role.value} bias ({path!r}), and the "
                "optimizer steps fp32 main copies of its params, whose biases it cannot reach; "
                "clip it without fp32_main_params, or with a model without q/k biases."
            )
        targets.append((layer.tensor(path), role, first_row))
    return _LayerClip(layer, options[0], options[1]), targets


def plan_clip(groups: Sequence[ClipGroup]) -> ClipPlan | None:
    """Which tracked layers an optimizer with ``groups`` clips, and the rows to scale.

    ``None`` where no group sets a threshold.

    Raises:
        ValueError: a threshold is set but no tracked layer's ``W_q`` is
            stepped here; or a layer's ``W_q`` and ``W_k`` are clipped with
            different options.
    """
    if all(group.threshold is None for group in groups):
        return None
    tracked = tracked_layers()
    index = _Index(groups, tracked)
    layers: list[_LayerClip] = []
    by_tensor: dict[int, tuple[Tensor, list[_Stretch]]] = {}
    for layer in tracked:
        entry = _layer_entry(layer, index)
        if entry is None:
            continue
        clip, targets = entry
        for tensor, role, first_row in targets:
            by_tensor.setdefault(id(tensor), (tensor, []))[1].append(
                _Stretch(len(layers), role, first_row)
            )
        layers.append(clip)
    if not layers:
        raise HyperParallelValueError(
            "qk_clip_threshold is set, but no tracked attention layer's W_q is stepped by this "
            "optimizer; call hyper_parallel.qk_clip.track(model) (or track_layer for your own "
            "attention) on the model whose params it steps, or unset qk_clip_threshold."
        )
    tensors = tuple(
        _Scaled(tensor, tensor.shape[0], Layout((local_layout(tensor).runs[0],)), tuple(stretches))
        for tensor, stretches in by_tensor.values()
    )
    return ClipPlan(tuple(layers), tensors)
