"""Tracked attention layers: where each layer's heads live, and the logits its forward recorded.

A :class:`QKLayout` says where an attention layer's query and key heads are
(param paths inside the layer, head size, head counts, the first row of the
heads inside a fused weight). A :class:`QKLayer` pairs a layout with its
module and keeps the largest pre-softmax logit of each query head since the
last optimizer step. Every tracked layer is listed here, so that an
optimizer with ``qk_clip_threshold`` finds the layers whose params it steps;
:data:`tracking.generation` changes whenever the list does, so an optimizer
finds them again only then.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hyper_parallel.core.distributed.toolkit import is_dtensor, local_layout
from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["QKLayer", "QKLayout", "layer_of", "tracked_layers", "tracking"]


@dataclass(frozen=True, kw_only=True)
class QKLayout:
    """Where an attention layer's query and key heads live, relative to the layer's module.

    Args:
        query: Path of ``W_q`` inside the module (``"q_proj.weight"``).
        key: Path of ``W_k`` (``"k_proj.weight"``); the same path as
            ``query`` for a fused QKV weight.
        head_dim: Rows per head.
        num_heads: Query heads.
        num_kv_heads: Key heads (grouped-query attention: fewer than
            ``num_heads``, each shared by ``num_heads // num_kv_heads``
            consecutive query heads); ``None``: one per query head.
        query_row: First row of the query heads in ``query`` (a fused weight).
        key_row: First row of the key heads in ``key``.
        query_bias: Path of the query bias, if any (scaled with its rows).
        key_bias: Path of the key bias, if any.
    """

    query: str
    key: str
    head_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    query_row: int = 0
    key_row: int = 0
    query_bias: str | None = None
    key_bias: str | None = None

    def __post_init__(self) -> None:
        kv = self.kv_heads
        for name, value in (("head_dim", self.head_dim), ("num_heads", self.num_heads),
                            ("num_kv_heads", kv)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HyperParallelValueError(
                    f"QKLayout.{name} must be an int >= 1, got {value!r}."
                )
        if self.num_heads % kv:
            raise HyperParallelValueError(
                f"QKLayout: num_heads={self.num_heads} is not a multiple of num_kv_heads={kv}; "
                "each key head is shared by the same number of query heads."
            )
        if min(self.query_row, self.key_row) < 0:
            raise HyperParallelValueError("QKLayout.query_row and key_row must be >= 0.")

    @property
    def kv_heads(self) -> int:
        """Key heads (``num_kv_heads``, or ``num_heads`` where that is ``None``)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


class QKLayer:
    """One tracked attention layer: its module, its :class:`QKLayout`, and the step's maxima.

    Made by :func:`~hyper_parallel.qk_clip.track` or
    :func:`~hyper_parallel.qk_clip.track_layer`; an attention forward
    reports to it with :meth:`report`.
    """

    def __init__(self, module: nn.Module, layout: QKLayout, name: str) -> None:
        self._module = weakref.ref(module)
        self.layout = layout
        #: The module's name in the tracked model (``"model.layers.0.self_attn"``).
        self.name = name
        self._maxima: Tensor | None = None
        self._first_heads: dict[int, int] = {}  # heads computed here -> the first one's index
        for path in (layout.query, layout.key, layout.query_bias, layout.key_bias):
            if path is not None:
                self.tensor(path)  # a path that names nothing fails now
        self._check_rows()

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise HyperParallelValueError(f"the attention module of {self.name!r} no longer exists")
        return module

    def tensor(self, path: str) -> Tensor:
        """The module's param at ``path`` as it is now (a sharded one after ``fully_shard``)."""
        try:
            return self.module.get_parameter(path)
        except AttributeError as exc:
            raise HyperParallelValueError(
                f"QK-clip layer {self.name!r} has no param {path!r} ({exc}); give the path of "
                "W_q/W_k inside the attention module, e.g. 'q_proj.weight'."
            ) from None

    def _check_rows(self) -> None:
        layout = self.layout
        for role, path, first, heads in (("query", layout.query, layout.query_row, layout.num_heads),
                                         ("key", layout.key, layout.key_row, layout.kv_heads)):  # fmt: skip
            rows = self.tensor(path).shape[0]
            if first + heads * layout.head_dim > rows:
                raise HyperParallelValueError(
                    f"QK-clip layer {self.name!r}: {heads} {role} heads of {layout.head_dim} rows "
                    f"from row {first} do not fit {path!r}, which has {rows} rows."
                )

    @torch.no_grad()
    def report(self, maxima: Tensor, first_head: int = 0) -> None:
        """Record the largest pre-softmax logit of each query head in one forward pass.

        Kept as the running maximum until the optimizer's next step reads it,
        so every micro-batch of a step counts.

        Args:
            maxima: ``(heads,)``: the largest scaled ``q . k`` each head
                computed (masked positions excluded).
            first_head: The global index of ``maxima[0]`` (tensor parallel:
                this rank's first head).
        """
        heads = self.layout.num_heads
        if maxima.ndim != 1 or first_head < 0 or first_head + maxima.numel() > heads:
            raise HyperParallelValueError(
                f"QK-clip layer {self.name!r} has {heads} query heads, but got maxima of shape "
                f"{tuple(maxima.shape)} from head {first_head}; report one value per head."
            )
        if self._maxima is None:
            self._maxima = maxima.new_full((heads,), float("-inf"), dtype=torch.float32)
        part = self._maxima[first_head : first_head + maxima.numel()]
        torch.maximum(part, maxima.detach().float(), out=part)

    def first_head(self, heads_here: int) -> int:
        """The global index of the first of the ``heads_here`` query heads this rank computes.

        All of them (0) unless tensor parallel splits ``W_q``'s rows: then
        where this rank's rows start, read from the DTensor once.
        """
        if heads_here == self.layout.num_heads:
            return 0
        if heads_here not in self._first_heads:
            weight = self.tensor(self.layout.query)
            if not is_dtensor(weight):
                raise HyperParallelValueError(
                    f"QK-clip layer {self.name!r} computed {heads_here} of its "
                    f"{self.layout.num_heads} query heads, and its W_q is not a DTensor that says "
                    "which; shard it with torch's tensor parallel (ColwiseParallel)."
                )
            first_row = local_layout(weight).runs[0][0][0] - self.layout.query_row
            self._first_heads[heads_here] = first_row // self.layout.head_dim
        return self._first_heads[heads_here]

    @property
    def has_maxima(self) -> bool:
        """Whether a forward pass reported since the last :meth:`take_maxima`."""
        return self._maxima is not None

    def take_maxima(self) -> Tensor:
        """The maxima reported since the last call (``-inf`` for heads never seen); then forgets them.

        Raises:
            ValueError: nothing was reported.
        """
        maxima, self._maxima = self._maxima, None
        if maxima is None:
            raise HyperParallelValueError(f"QK-clip layer {self.name!r} recorded no logits.")
        return maxima

    def __repr__(self) -> str:
        layout = self.layout
        kv = "" if layout.num_kv_heads in (None, layout.num_heads) else f", {layout.kv_heads} kv"
        return (
            f"QKLayer({self.name!r}, {layout.num_heads} heads{kv} of {layout.head_dim}, "
            f"W_q={layout.query!r}, W_k={layout.key!r})"
        )


class _Tracking:
    """Every tracked layer, by module, and a count that changes whenever they do."""

    def __init__(self) -> None:
        self.layers: weakref.WeakKeyDictionary[nn.Module, QKLayer] = weakref.WeakKeyDictionary()
        #: Bumped by every track/untrack: optimizers find their layers again only then.
        self.generation = 0

    def add(self, module: nn.Module, layer: QKLayer) -> None:
        self.layers[module] = layer
        self.generation += 1

    def remove(self, module: nn.Module) -> QKLayer | None:
        self.generation += 1
        return self.layers.pop(module, None)


#: The process's tracked layers.
tracking = _Tracking()


def tracked_layers() -> list[QKLayer]:
    """Every attention layer tracked now, in the order they were tracked."""
    return list(tracking.layers.values())


def layer_of(module: nn.Module) -> QKLayer | None:
    """The :class:`QKLayer` of a tracked attention module, else ``None``."""
    return tracking.layers.get(module)
