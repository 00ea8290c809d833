"""Which attention layers record their logits: :func:`track`, :func:`untrack`, :func:`track_layer`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.qk_clip import _hf
from hyper_parallel.qk_clip._layers import QKLayer, QKLayout, tracking
from hyper_parallel.qk_clip._logits import max_logits

__all__ = ["track", "track_layer", "untrack"]

_log = logging.getLogger(__name__)


def track_layer(module: nn.Module, layout: QKLayout, name: str = "") -> QKLayer:
    """Track one attention layer of your own; its forward reports with :meth:`QKLayer.report`.

    Args:
        module: The attention module (the paths of ``layout`` are inside it).
        layout: Where its query and key heads are.
        name: Its name in the model (``model.named_modules()``), which
            matches the optimizer's param names where it steps fp32 main copies.

    Returns:
        The layer (tracking the same module again replaces it).
    """
    layer = QKLayer(module, layout, name)
    tracking.add(module, layer)
    return layer


def _recording_sdpa(layer: QKLayer, attention: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``attention`` (SDPA's signature) that first records each head's largest logit."""

    def recorded(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if layer.module.training:
            scaling = query.shape[-1] ** -0.5 if scale is None else scale
            maxima = max_logits(query, key, scaling=scaling, mask=attn_mask, causal=is_causal)
            layer.report(maxima, first_head=layer.first_head(query.shape[1]))
        return attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, **kwargs,
        )  # fmt: skip

    return recorded


def _own_layout(name: str, module: nn.Module) -> QKLayout:
    """The layout of a module of the ``qk_layout()`` protocol, checked."""
    layout = module.qk_layout()  # type: ignore[operator]
    if not isinstance(layout, QKLayout):
        raise HyperParallelValueError(
            f"{name!r}.qk_layout() returned {type(layout).__name__}; return a QKLayout."
        )
    if not callable(getattr(type(module), "attention", None)):
        raise HyperParallelValueError(
            f"{name!r} ({type(module).__name__}) has qk_layout() but no class attribute "
            "'attention' (SDPA's signature) that its forward calls; add one, or track it with "
            "track_layer() and report its maxima yourself."
        )
    return layout


def track(model: nn.Module) -> list[QKLayer]:
    """Make ``model``'s attention layers record each head's largest pre-softmax logit.

    Hugging Face transformers models (Llama, Qwen2, Mistral, Phi-3's fused
    QKV, anything whose attention calls transformers' attention functions)
    are tracked through transformers' own registry: the config's attention
    implementation is swapped for one that records the maxima, computed a
    slice of queries at a time, and calls the original. A module with a
    ``qk_layout()`` method and an ``attention`` class attribute of SDPA's
    signature (``hyper-parallel train``'s model) gets a recording
    ``attention`` of its own. Only forward passes in training mode record.

    A model that is not tracked runs exactly the code it ran before.

    Returns:
        The tracked layers (also logged), in module order.

    Raises:
        ValueError: no attention layer found that can be tracked, or one
            that cannot be clipped (per-head QK-norm); nothing is tracked then.
    """
    found: list[tuple[str, nn.Module, QKLayout, bool]] = []  # name, module, layout, own protocol
    for name, module in model.named_modules():
        if callable(getattr(module, "qk_layout", None)):
            found.append((name, module, _own_layout(name, module), True))
        elif _hf.is_hf_attention(module):
            found.append((name, module, _hf.hf_layout(name, module), False))
    if not found:
        raise HyperParallelValueError(
            f"QK-clip found no attention layer to track in {type(model).__name__}: track() knows "
            "Hugging Face transformers attention (q_proj/k_proj or qkv_proj, through "
            "transformers' attention functions) and modules with a qk_layout() method. For "
            "attention of your own, call hyper_parallel.qk_clip.track_layer(module, QKLayout(...)) "
            "and report each forward's maxima with layer.report(max_logits(q, k, scaling=...))."
        )
    layers = [QKLayer(module, layout, name) for name, module, layout, _ in found]  # checks all
    configs = {}
    for layer, (_, module, _, own) in zip(layers, found, strict=True):
        tracking.add(module, layer)
        if own:
            attention = getattr(type(module), "attention")  # noqa: B009 (checked callable above)
            module.attention = _recording_sdpa(layer, attention)  # type: ignore[assignment]
        else:
            configs[id(module.config)] = module.config
    for config in configs.values():
        _hf.retarget(config)
    _log.info(
        "QK-clip tracks %d attention layers: %s",
        len(layers),
        ", ".join(layer.name for layer in layers),
    )
    return layers


def untrack(model: nn.Module) -> None:
    """Stop tracking ``model``: its attention runs the code it ran before :func:`track`."""
    for _, module in model.named_modules():
        if tracking.remove(module) is None:
            continue
        if "attention" in vars(module):
            del module.attention
        elif _hf.is_hf_attention(module):
            _hf.restore(module.config)
