"""Hugging Face transformers' attention, tracked through its own extension point.

transformers' attention layers call the function that
``ALL_ATTENTION_FUNCTIONS`` holds under the config's ``_attn_implementation``
("sdpa", "eager", "flash_attention_2", ...). Tracking registers one more
function under ``"hyper_parallel_qk_clip_<original>"`` that records the
maxima and calls the original, with the original's mask function, and
points the model's config at it. An untracked model never reaches it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.qk_clip._layers import QKLayout, layer_of
from hyper_parallel.qk_clip._logits import max_logits

__all__ = ["PREFIX", "hf_layout", "is_hf_attention", "restore", "retarget"]

#: The start of the attention implementations tracking registers.
PREFIX = "hyper_parallel_qk_clip_"


def is_hf_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers attention layer that calls ``ALL_ATTENTION_FUNCTIONS``."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    modeling = sys.modules.get(type(module).__module__)
    return (
        getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None) is not None
        and hasattr(module, "head_dim")
        and (hasattr(module, "q_proj") or hasattr(module, "qkv_proj"))
    )


def hf_layout(name: str, module: nn.Module) -> QKLayout:
    """Where a transformers attention layer's heads are (``q_proj``/``k_proj``, or fused ``qkv_proj``)."""
    for norm in ("q_norm", "k_norm"):
        if getattr(module, norm, None) is not None:
            raise HyperParallelValueError(
                f"QK-clip cannot clip {name!r} ({type(module).__name__}): it normalizes each "
                f"head's queries and keys ({norm}), so scaling W_q/W_k does not change its logits "
                "(QK-norm already bounds them). Train this model without qk_clip_threshold."
            )
    config: Any = module.config
    head_dim = int(getattr(module, "head_dim"))  # noqa: B009
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if hasattr(module, "q_proj"):
        return QKLayout(
            query="q_proj.weight",
            key="k_proj.weight",
            head_dim=head_dim,
            num_heads=heads,
            num_kv_heads=kv_heads,
            query_bias="q_proj.bias" if getattr(module.q_proj, "bias", None) is not None else None,
            key_bias="k_proj.bias" if getattr(module.k_proj, "bias", None) is not None else None,
        )
    # fused rows [queries | keys | values] (Phi-3's qkv_proj)
    bias = "qkv_proj.bias" if getattr(module.qkv_proj, "bias", None) is not None else None
    return QKLayout(
        query="qkv_proj.weight",
        key="qkv_proj.weight",
        head_dim=head_dim,
        num_heads=heads,
        num_kv_heads=kv_heads,
        key_row=heads * head_dim,
        query_bias=bias,
        key_bias=bias,
    )


def _original(implementation: str, module: nn.Module) -> Callable[..., Any]:
    """The attention function ``implementation`` names for ``module``'s model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation == "eager":
        modeling = sys.modules[type(module).__module__]
        eager: Callable[..., Any] = modeling.eager_attention_forward
        return eager
    return ALL_ATTENTION_FUNCTIONS[implementation]  # type: ignore[no-any-return]


def _recording(implementation: str) -> Callable[..., Any]:
    """An attention function that records each head's largest logit, then runs ``implementation``."""

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        layer = layer_of(module)
        if layer is not None and module.training:
            scaling = kwargs.get("scaling")
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else causal
            maxima = max_logits(
                query,
                key,
                scaling=float(query.shape[-1] ** -0.5 if scaling is None else scaling),
                mask=attention_mask,
                causal=bool(causal) and query.shape[2] > 1,
                sliding_window=kwargs.get("sliding_window"),
            )
            layer.report(maxima, first_head=layer.first_head(query.shape[1]))
        original = _original(implementation, module)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__name__ = f"{PREFIX}{implementation}"
    return attention


def retarget(config: Any) -> str:
    """Point ``config`` at the recording twin of its attention implementation; return the original."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = config._attn_implementation or "eager"
    if original.startswith(PREFIX):
        return str(original[len(PREFIX) :])
    name = f"{PREFIX}{original}"
    ALL_ATTENTION_FUNCTIONS.register(name, _recording(original))
    if original in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    config._attn_implementation = name
    return str(original)


def restore(config: Any) -> None:
    """Point ``config`` back at the attention implementation it had before :func:`retarget`."""
    current = config._attn_implementation or ""
    if current.startswith(PREFIX):
        config._attn_implementation = current[len(PREFIX) :]
