"""QK-clip (MuonClip): attention logits that cannot grow past a threshold.

After each optimizer step, every attention head whose largest pre-softmax
logit ``S_max`` over the step exceeded ``tau`` has its query and key rows
rescaled: ``W_q``'s by ``gamma ** alpha`` and ``W_k``'s by
``gamma ** (1 - alpha)``, ``gamma = tau / S_max``. Muon does it with
``qk_clip_threshold=tau`` (and ``qk_clip_alpha``); this package says where
the logits come from:

* :func:`track` makes a model record them: Hugging Face transformers models
  through transformers' attention-function registry, and any module that
  gives its layout with ``qk_layout()`` and calls attention through
  ``self.attention`` (SDPA's signature), as ``hyper-parallel train``'s model does;
* :func:`track_layer` and :meth:`QKLayer.report` for attention of your own.

Examples:
    >>> layers = track(model)  # doctest: +SKIP
    >>> optimizer = get_hyper_optimizer(  # doctest: +SKIP
    ...     model, muon={"qk_clip_threshold": 100.0}, adamw={}
    ... )
"""

from hyper_parallel.qk_clip._clip import ClipGroup, ClipPlan, QKClipStats, plan_clip
from hyper_parallel.qk_clip._layers import QKLayer, QKLayout, layer_of, tracked_layers, tracking
from hyper_parallel.qk_clip._logits import max_logits
from hyper_parallel.qk_clip._track import track, track_layer, untrack

__all__ = [
    "ClipGroup",
    "ClipPlan",
    "QKClipStats",
    "QKLayer",
    "QKLayout",
    "layer_of",
    "max_logits",
    "plan_clip",
    "track",
    "track_layer",
    "tracked_layers",
    "tracking",
    "untrack",
]
