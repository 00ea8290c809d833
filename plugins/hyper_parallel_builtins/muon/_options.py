"""Muon's options: the two update conventions, their defaults and checks, the Newton-Schulz dtype.

A Muon param group follows one of two conventions, decided by its keys:

* **HyperParallel's** (the default): lr 2e-2, each matrix's update scaled by
  ``matched_adamw_rms * sqrt(max(A, B))``, the coefficient set
  ``ns_variant`` (``"asym5"`` unless named), ``ns_epsilon`` added to the norm, and
  momentum ``B <- m2 B + G`` with the update ``G + m1 B`` (Nesterov:
  ``G + m1 (G + m1 B)``).
* **torch.optim.Muon's**, chosen by any of torch's own keywords: an
  ``adjust_lr_fn``, an ``eps``, or ``ns_coefficients`` as one ``(a, b, c)``
  triple. Then lr defaults to 1e-3, the update is scaled by
  ``sqrt(max(1, A / B))`` (or 0.2 ``sqrt(max(A, B))`` for
  ``"match_rms_adamw"``), the norm is floored at ``eps`` (1e-7), the one
  triple (Keller Jordan's unless ``ns_variant`` names a set) is used at
  every step, and momentum
  is torch's interpolation ``B <- mu B + (1 - mu) G``.

Both give the same direction up to the norm's epsilon and round-off where
their settings agree: the conventions differ in defaults and scale.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hyper_parallel.core.compat import cpu_has_native_bf16
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean
from hyper_parallel_builtins.muon._matrices import MATRIX_VIEWS, check_blocks
from hyper_parallel_builtins.muon._update import MuonSettings, ScaleRule, ns_dtype_of
from hyper_parallel_builtins.newton_schulz._coefficients import (
    COEFFICIENT_SETS,
    KELLER_COEFFICIENTS,
    Coefficients,
    custom_coefficients,
    is_schedule,
    is_triple,
    resolve_coefficients,
)
from hyper_parallel_builtins.newton_schulz._paths import resolve_ns_method

__all__ = [
    "ADJUST_LR_FNS",
    "HYPER_PARALLEL_LR",
    "NS_DTYPE_ENV",
    "NS_VARIANTS",
    "TORCH_EPS",
    "TORCH_LR",
    "ZERO_RMS_SCALE_MODES",
    "check_options",
    "coefficients_of",
    "default_ns_dtype",
    "follows_torch",
    "normalization_of",
    "ns_dtype_for",
    "ns_dtype_from_env",
    "resolve_settings",
    "update_scale",
]

HYPER_PARALLEL_LR = 2e-2
"""Muon's lr when none is given (HyperParallel's)."""

TORCH_LR = 1e-3
"""Muon's lr when none is given and the call uses torch.optim.Muon's keywords."""

TORCH_EPS = 1e-7
"""torch.optim.Muon's floor on the norm: the ``eps`` of a torch-convention group without one."""

_TORCH_MATCH_RMS = 0.2  # torch's "match_rms_adamw" target (Moonlight's)

ADJUST_LR_FNS = ("original", "match_rms_adamw")
"""Accepted values of ``adjust_lr_fn`` besides ``None`` (as ``torch.optim.Muon``)."""

NS_VARIANTS = ("asym5", "legacy", "custom", *sorted(set(COEFFICIENT_SETS) - {"asym5", "legacy"}))
"""Accepted values of ``ns_variant``: HyperParallel's three and the other named coefficient sets."""

ZERO_RMS_SCALE_MODES = ("zero", "use_lr")
"""Accepted values of ``zero_rms_scale_mode``."""


def follows_torch(group: Mapping[str, Any]) -> bool:
    """Whether ``group`` follows torch.optim.Muon's convention (it has one of torch's keywords)."""
    return (
        group["adjust_lr_fn"] is not None
        or group["eps"] is not None
        or is_triple(group["ns_coefficients"])
    )


def coefficients_of(group: Mapping[str, Any]) -> tuple[Coefficients, ...]:
    """The ``(a, b, c)`` of each of the group's ``ns_steps`` iterations."""
    spec = group["ns_coefficients"]
    if spec is None:
        spec = group["ns_variant"] or (KELLER_COEFFICIENTS if follows_torch(group) else "asym5")
    return resolve_coefficients(spec, group["ns_steps"])


def normalization_of(group: Mapping[str, Any]) -> tuple[float, bool]:
    """``(eps, eps_added)``: torch's floor ``max(||X||, eps)`` or HyperParallel's ``||X|| + ns_epsilon``."""
    if follows_torch(group):
        eps = group["eps"]
        return (TORCH_EPS if eps is None else float(eps)), False
    return float(group["ns_epsilon"]), True


def _scale_rule(group: Mapping[str, Any]) -> tuple[ScaleRule, float]:
    """The group's update scale: HyperParallel's ``matched_adamw_rms * sqrt(max(rows, cols))``
    (no or a zero rms: 0, or 1 with ``zero_rms_scale_mode="use_lr"``); torch's
    ``sqrt(max(1, rows / cols))``, or ``0.2 * sqrt(max(rows, cols))`` for
    ``adjust_lr_fn="match_rms_adamw"``."""
    rms = group["matched_adamw_rms"]
    if follows_torch(group):
        if group["adjust_lr_fn"] == "match_rms_adamw":
            return ScaleRule.MATCHED_RMS, float(_TORCH_MATCH_RMS if rms is None else rms)
        return ScaleRule.ASPECT, 0.0
    if not rms:
        return (ScaleRule.ONE if group["zero_rms_scale_mode"] == "use_lr" else ScaleRule.ZERO), 0.0
    return ScaleRule.MATCHED_RMS, float(rms)


def resolve_settings(
    group: Mapping[str, Any], env_dtype: torch.dtype | None = None
) -> MuonSettings:
    """What ``group``'s options decide (:class:`MuonSettings`), worked out once.

    ``env_dtype`` is what ``$HYPER_PARALLEL_NS_DTYPE`` named (Muon reads it
    when the group is added).
    """
    _check_qk_clip(group["qk_clip_threshold"], group["qk_clip_alpha"])  # an edited group's too
    eps, eps_added = normalization_of(group)
    rule, rms = _scale_rule(group)
    return MuonSettings(
        torch_momentum=follows_torch(group),
        coefficients=coefficients_of(group),
        eps=eps,
        eps_added=eps_added,
        scale_rule=rule,
        rms=rms,
        lr_in_update=bool(group["apply_lr_in_update"]),
        group_ns_dtype=group["ns_dtype"],
        env_ns_dtype=env_dtype,
        cpu_ns_dtype=torch.bfloat16 if cpu_has_native_bf16() else torch.float32,
        qk_clip_threshold=(
            None if group["qk_clip_threshold"] is None else float(group["qk_clip_threshold"])
        ),
        qk_clip_alpha=float(group["qk_clip_alpha"]),
    )


def update_scale(rows: int, cols: int, group: Mapping[str, Any], lr: float) -> float:
    """The factor on a ``(rows, cols)`` matrix's orthogonalized update (head blocks: their own shape).

    HyperParallel: ``matched_adamw_rms * sqrt(max(rows, cols))``; with no
    (or a zero) ``matched_adamw_rms``, 0 (``zero_rms_scale_mode="zero"``) or
    1 (``"use_lr"``). torch: ``sqrt(max(1, rows / cols))``, or
    ``0.2 * sqrt(max(rows, cols))`` for ``adjust_lr_fn="match_rms_adamw"``.
    With ``apply_lr_in_update`` the factor also carries ``-lr``. (A step
    uses the group's :class:`MuonSettings`, made once.)
    """
    return resolve_settings(group).scale(rows, cols, lr)


#: Environment variable naming the Newton-Schulz dtype of every group with
#: ``ns_dtype=None`` (float64 params excepted): the same numbers on every machine.
NS_DTYPE_ENV = "HYPER_PARALLEL_NS_DTYPE"
_NS_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16, "float64": torch.float64}  # fmt: skip


def default_ns_dtype(param: Tensor) -> torch.dtype:
    """The Newton-Schulz dtype used for ``param`` when ``ns_dtype=None``: the fastest here.

    * float64 for a float64 param, anywhere;
    * else ``$HYPER_PARALLEL_NS_DTYPE`` where set (``float32``, ``bfloat16``,
      ``float16`` or ``float64``), so that machines of different kinds give
      the same numbers;
    * bfloat16 on an accelerator (CUDA, NPU, anything not a CPU), as
      HyperParallel iterates;
    * on a CPU, bfloat16 where it multiplies bf16 in hardware (AVX512-BF16
      or AMX-BF16), float32 otherwise: without them torch emulates bf16
      matmul, many times slower than fp32 (figures in the benchmarks page).

    Pass ``ns_dtype`` to choose.

    Raises:
        ValueError: ``$HYPER_PARALLEL_NS_DTYPE`` names no such dtype.
    """
    return ns_dtype_for(param, ns_dtype_from_env())


def ns_dtype_for(param: Tensor, env_dtype: torch.dtype | None) -> torch.dtype:
    """:func:`default_ns_dtype` with ``$HYPER_PARALLEL_NS_DTYPE`` already read (``env_dtype``)."""
    return ns_dtype_of(param, env_dtype, torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def ns_dtype_from_env() -> torch.dtype | None:
    """The dtype ``$HYPER_PARALLEL_NS_DTYPE`` names; ``None`` where it is unset or empty.

    Raises:
        ValueError: a value that names no dtype Newton-Schulz runs in.
    """
    name = os.environ.get(NS_DTYPE_ENV, "").strip()
    if not name:
        return None
    if name not in _NS_DTYPE_NAMES:
        raise HyperParallelValueError(
            f"{NS_DTYPE_ENV}={name!r} is not a Newton-Schulz dtype; set it to one of "
            f"{', '.join(_NS_DTYPE_NAMES)}, or unset it for the fastest here."
            f"{did_you_mean(name, list(_NS_DTYPE_NAMES))}"
        )
    return _NS_DTYPE_NAMES[name]


# -- checks ----------------------------------------------------------------------------


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_number(name: str, value: object, *, minimum: float = 0.0) -> None:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) < minimum:  # type: ignore[arg-type]
        raise HyperParallelValueError(
            f"{name} should be a finite number >= {minimum:g}, got {value!r}."
        )


def _check_lr(lr: object) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise HyperParallelValueError(
                f"A tensor lr must have 1 element, got shape {tuple(lr.shape)}."
            )
        lr = float(lr.item())
    _check_number("lr", lr)


def _check_momentum(options: dict[str, Any], torch_rule: bool) -> None:
    """A float, or HyperParallel's ``(m1, m2)``; a one-element list is stored as its float."""
    momentum = options["momentum"]
    if isinstance(momentum, Sequence) and not isinstance(momentum, str):
        if len(momentum) not in (1, 2):
            raise HyperParallelValueError(
                f"momentum should be a float or a pair (m1, m2), got {momentum!r}."
            )
        for value in momentum:
            _check_number("each momentum of the pair", value)
        if len(momentum) == 1:
            options["momentum"] = momentum = float(momentum[0])
        else:
            options["momentum"] = momentum = (float(momentum[0]), float(momentum[1]))
            if torch_rule and momentum[0] != momentum[1]:
                raise HyperParallelValueError(
                    f"momentum={momentum} is HyperParallel's (m1, m2), but this group follows "
                    "torch.optim.Muon's convention (it has adjust_lr_fn, eps or one "
                    "ns_coefficients triple), which has one momentum; give one float, or drop "
                    "torch's keywords."
                )
        return
    _check_number("momentum", momentum)


def _check_coefficients(options: Mapping[str, Any]) -> None:
    """``ns_variant`` with ``ns_coefficients``, as HyperParallel checks them.

    Beyond HyperParallel's forms: torch's single triple, and with
    ``ns_variant="custom"`` a schedule of ``((a, b, c), repeat)`` pairs
    (:func:`~hyper_parallel_builtins.newton_schulz._coefficients.expand_schedule`).
    """
    variant, spec, steps = options["ns_variant"], options["ns_coefficients"], options["ns_steps"]
    if variant is not None and variant not in NS_VARIANTS:
        raise HyperParallelValueError(
            f"ns_variant must be 'legacy', 'asym5', or 'custom' (or another coefficient set: "
            f"{', '.join(NS_VARIANTS[3:])}), got {variant!r}.{did_you_mean(str(variant), NS_VARIANTS)}"
        )
    if isinstance(spec, str):
        raise HyperParallelValueError(
            f"ns_coefficients={spec!r} names a coefficient set; name it with "
            f"ns_variant={spec!r}. ns_coefficients takes the triples themselves."
        )
    if is_triple(spec):
        if variant == "custom":
            raise HyperParallelValueError(
                f"ns_variant='custom' takes one (a, b, c) triple per iteration, got the single "
                f"triple {tuple(spec)}; give [{tuple(spec)}] * ns_steps (or the schedule "
                f"[({tuple(spec)}, ns_steps)]), or drop ns_variant to use one triple at every "
                "step as torch.optim.Muon does."
            )
        resolve_coefficients(spec, steps)
    elif spec is not None:
        if variant != "custom":
            form = "a schedule of ((a, b, c), repeat) pairs" if is_schedule(spec) else repr(spec)
            raise HyperParallelValueError(
                f"ns_coefficients can only be provided when ns_variant='custom' (or as one "
                f"(a, b, c) triple, torch.optim.Muon's form); got {form} with "
                f"ns_variant={variant!r}. Add ns_variant='custom'."
            )
        custom_coefficients(spec, steps)
    elif variant == "custom":
        raise HyperParallelValueError(
            "ns_coefficients must be provided when ns_variant='custom': one (a, b, c) triple "
            "per iteration, or a schedule of ((a, b, c), repeat) pairs."
        )
    else:
        resolve_coefficients(variant or "asym5", steps)


def _check_choice(name: str, value: object, choices: Sequence[str], none_ok: bool) -> None:
    if (value is None and none_ok) or value in choices:
        return
    allowed = ", ".join(repr(c) for c in ([None] if none_ok else []) + list(choices))
    raise HyperParallelValueError(
        f"{name} must be one of {allowed}, got {value!r}.{did_you_mean(str(value), choices)}"
    )


def _check_qk_clip(threshold: object, alpha: object) -> None:
    """``qk_clip_threshold``: ``None`` or a finite number > 0; ``qk_clip_alpha`` in [0, 1]."""
    if threshold is not None and not (
        _is_real(threshold) and math.isfinite(float(threshold)) and float(threshold) > 0  # type: ignore[arg-type]
    ):
        raise HyperParallelValueError(
            f"qk_clip_threshold should be None (off) or a finite number > 0 (the largest "
            f"attention logit a head may keep, e.g. 100), got {threshold!r}."
        )
    if not _is_real(alpha) or not 0 <= float(alpha) <= 1:  # type: ignore[arg-type]
        raise HyperParallelValueError(
            f"qk_clip_alpha should be a number in [0, 1] (the share of the clip W_q takes; "
            f"W_k takes the rest), got {alpha!r}."
        )


def check_options(options: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an out-of-range or unknown option of Muon or one of its groups.

    Normalizes in place what has two spellings: a one-element ``momentum``
    list becomes its float, ``split_rows`` a tuple.
    """
    _check_lr(options["lr"])
    _check_number("weight_decay", options["weight_decay"])
    torch_rule = follows_torch(options)
    _check_momentum(options, torch_rule)
    _check_coefficients(options)
    _check_number("ns_epsilon", options["ns_epsilon"])
    if options["eps"] is not None:
        _check_number("eps", options["eps"])
        if not options["eps"] > 0:
            raise HyperParallelValueError(f"eps should be > 0 but is: {options['eps']}")
    _check_choice("adjust_lr_fn", options["adjust_lr_fn"], ADJUST_LR_FNS, none_ok=True)
    _check_choice(
        "zero_rms_scale_mode", options["zero_rms_scale_mode"], ZERO_RMS_SCALE_MODES, none_ok=False
    )
    if not isinstance(options["apply_lr_in_update"], bool):
        raise HyperParallelValueError(
            f"apply_lr_in_update should be True or False, got {options['apply_lr_in_update']!r}."
        )
    if options["matched_adamw_rms"] is not None:
        _check_number("matched_adamw_rms", options["matched_adamw_rms"])
    ns_dtype = options["ns_dtype"]
    if ns_dtype is None:
        ns_dtype_from_env()  # a bad value fails here, before any step
    elif not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
        raise HyperParallelValueError(
            f"ns_dtype should be a floating-point torch.dtype or None, got {ns_dtype!r}."
        )
    resolve_ns_method(options["ns_method"], 1, 1, torch.device("cpu"))  # a known name
    sharding = options["sharding"]
    if sharding is not None and not isinstance(sharding, str):
        raise HyperParallelValueError(
            f"sharding should be a backend name or None, got {sharding!r}."
        )
    check_blocks(options)
    _check_qk_clip(options["qk_clip_threshold"], options["qk_clip_alpha"])
    _check_choice("matrix_view", options["matrix_view"], MATRIX_VIEWS, none_ok=False)


def check_replica_count(value: object) -> int | None:
    """``hsdp_replica_count``: ``None`` or a positive int.

    Raises:
        TypeError: not an int (HyperParallel takes no tuple either).
        ValueError: zero or negative.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HyperParallelTypeError(
            f"Unsupported hsdp_replica_count type: {type(value).__name__}; give the number of "
            "replicas (an int) that share one copy of the optimizer's work, or None."
        )
    if value <= 0:
        raise HyperParallelValueError(f"hsdp_replica_count must be positive, got {value}.")
    return value
