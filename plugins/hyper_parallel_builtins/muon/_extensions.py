"""What a caller can plug into Muon: per-param names, head-wise blocks, and HyperParallel's callables.

A param's name is its group's ``param_names`` entry (torch's named param
groups: ``Muon(model.named_parameters())``), else its ``model_name``
attribute, which ``get_hyper_optimizer`` sets as HyperParallel's factory
does. Names select head-wise params and are what ``reshape_fn``,
``ns_transform_fn`` and ``post_update_fn`` are told.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError

__all__ = [
    "DEFAULT_HEAD_WISE_PATTERN",
    "MomentumUpdateFn",
    "MuonPostUpdateContext",
    "NSInputTransform",
    "NSTransformFn",
    "PostUpdateFn",
    "ReshapeFn",
    "ZeropowerFn",
    "check_head_wise",
    "check_head_wise_selects",
    "check_transform",
    "head_wise_dims",
    "param_names",
]

DEFAULT_HEAD_WISE_PATTERN = r"(?:^|\.)(?:q_proj|k_proj|q_b_proj|wq|wk)\.weight$"
"""The params ``head_wise=True`` selects without ``head_wise_patterns``: separate q/k projection weights."""


@dataclass
class NSInputTransform:
    """What ``ns_transform_fn`` returns: the tensors to orthogonalize, and how to put the results back.

    Attributes:
        tensors: Newton-Schulz inputs made from the param's whole update
            (the ``working_input`` it was given): each at least 2-D, on its
            device and in its dtype. Each is read as matrices (2-D as is,
            ``(A, 1, B)`` as ``A x B``, otherwise a batch of its last two
            dims) and scaled by its own matrix shape.
        restore: ``restore(updates, output)`` gets the scaled results, one
            per tensor in order, and writes the param's update into
            ``output`` (the working input, in place).
    """

    tensors: list[Tensor]
    restore: Callable[[list[Tensor], Tensor], None]


@dataclass(frozen=True)
class MuonPostUpdateContext:
    """What ``post_update_fn`` is told about the param it gets.

    Attributes:
        param_fqn: The param's name, or ``None`` if it has none.
        logical_shape: The param's full shape (a sharded param's global shape).
        lr: The group's lr at this step.
        weight_decay: The group's weight decay.
        step: The group's step count, from 1.
    """

    param_fqn: str | None
    logical_shape: tuple[int, ...]
    lr: float
    weight_decay: float
    step: int


class ZeropowerFn(Protocol):
    """``zeropower_fn(x, steps=ns_steps)``: orthogonalize a ``(m, n)`` matrix or a ``(B, m, n)`` stack.

    It replaces Newton-Schulz entirely (normalization included) and returns
    a tensor of ``x``'s shape.
    """

    def __call__(self, x: Tensor, *, steps: int) -> Tensor: ...


class MomentumUpdateFn(Protocol):
    """``momentum_update_fn(grads, buffers, m1, m2, nesterov)``: step the buffers, return the updates.

    Gets each rank's local gradient and momentum-buffer tensors; must update
    the buffers in place and return one update per gradient, shaped like it.
    """

    def __call__(
        self, grads: list[Tensor], buffers: list[Tensor], m1: float, m2: float, nesterov: bool
    ) -> Iterable[Tensor]: ...


class ReshapeFn(Protocol):
    """``reshape_fn(name, working_input)``: views of the whole update to orthogonalize one by one."""

    def __call__(self, name: str, working_input: Tensor) -> Iterable[Tensor]: ...


class NSTransformFn(Protocol):
    """``ns_transform_fn(name, working_input)``: an :class:`NSInputTransform`, or ``None`` for none."""

    def __call__(self, name: str, working_input: Tensor) -> NSInputTransform | None: ...


class PostUpdateFn(Protocol):
    """``post_update_fn(param, local_tensor, context)``: called after each updated param's step."""

    def __call__(self, param: Tensor, local: Tensor, context: MuonPostUpdateContext) -> None: ...


def param_names(group: Mapping[str, Any]) -> list[str | None]:
    """The name of each param of ``group`` (``None`` where it has none)."""
    given = group.get("param_names")
    if given is not None and len(given) == len(group["params"]):
        return list(given)
    return [getattr(p, "model_name", None) for p in group["params"]]


def _compiled(patterns: Mapping[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    if not isinstance(patterns, Mapping):
        raise HyperParallelTypeError(
            f"head_wise_patterns must be a dict {{regex: head_dim}}, got {type(patterns).__name__}."
        )
    compiled = []
    for pattern, dim in patterns.items():
        try:
            compiled.append((re.compile(pattern), dim))
        except (re.error, TypeError) as exc:
            raise HyperParallelValueError(
                f"head_wise_patterns key {pattern!r} is not a valid regular expression: {exc}."
            ) from exc
    return compiled


def check_head_wise(
    head_wise: object, head_dim: object, patterns: object, callables: Sequence[object]
) -> None:
    """HyperParallel's checks of Muon's head-wise keywords, before any param is looked at."""
    if not isinstance(head_wise, bool):
        raise HyperParallelValueError(f"head_wise should be True or False, got {head_wise!r}.")
    if head_wise and any(fn is not None for fn in callables):
        raise HyperParallelValueError(
            "head_wise cannot be combined with reshape_fn or ns_transform_fn: both decide how a "
            "param is cut into matrices. Drop head_wise and split heads in your function, or "
            "drop the function."
        )
    if patterns is not None and not head_wise:
        raise HyperParallelValueError(
            "head_wise_patterns requires head_wise=True; pass head_wise=True or drop the patterns."
        )
    if head_dim is not None and not head_wise:
        raise HyperParallelValueError(
            f"head_dim={head_dim!r} is the head size of head_wise=True's default q/k selection; "
            "pass head_wise=True, or give head_dim in the param group of the params to split "
            "({'params': [...], 'head_dim': ...})."
        )


def head_wise_dims(
    groups: Iterable[Mapping[str, Any]],
    head_dim: int | None,
    patterns: Mapping[str, Any] | None,
) -> dict[Tensor, int]:
    """Which params ``head_wise=True`` splits into heads, and each one's head size.

    Every param must have a name. A param is selected by the patterns
    ``{regex: head_dim}`` searched in its name (default
    :data:`DEFAULT_HEAD_WISE_PATTERN` with ``head_dim``); one pattern at
    most may select it, and its rows must be a multiple of the head size.

    Raises:
        ValueError: a param without a name, a param two patterns select, a
            missing or non-positive head size, or rows the head size does
            not divide.
    """
    compiled = _compiled({DEFAULT_HEAD_WISE_PATTERN: head_dim} if patterns is None else patterns)
    dims: dict[Tensor, int] = {}
    for group in groups:
        for param, name in zip(group["params"], param_names(group), strict=True):
            if name is None:
                raise HyperParallelValueError(
                    f"head_wise requires model_name: a param of shape {tuple(param.shape)} has no "
                    "name. Build the optimizer with get_hyper_optimizer (which names every param), "
                    "pass named params (model.named_parameters()), or set param.model_name."
                )
            chosen = [dim for pattern, dim in compiled if pattern.search(name)]
            if not chosen:
                continue
            if len(chosen) > 1:
                raise HyperParallelValueError(
                    f"Overlapping head_wise_patterns for {name}: {len(chosen)} patterns select it; "
                    "make them select each param once."
                )
            dim = chosen[0]
            if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
                raise HyperParallelValueError(
                    f"A positive integer head_dim is required for {name}, got {dim!r}: give "
                    "head_dim=..., a head size per head_wise_patterns entry, or (through "
                    "get_hyper_optimizer) a model whose config has head_dim."
                )
            if param.ndim != 2 or param.shape[0] % dim:
                raise HyperParallelValueError(
                    f"{name} must be a 2D matrix with rows divisible by head_dim={dim}, got shape "
                    f"{tuple(param.shape)}."
                )
            dims[param] = dim
    return dims


def check_head_wise_selects(
    groups: Iterable[Mapping[str, Any]], patterns: Mapping[str, Any] | None
) -> None:
    """Every head-wise pattern selects some param (stricter than HyperParallel, which skips it).

    Raises:
        ValueError: naming the pattern that selects none.
    """
    names = [name for group in groups for name in param_names(group) if name is not None]
    for pattern, _ in _compiled(
        {DEFAULT_HEAD_WISE_PATTERN: None} if patterns is None else patterns
    ):
        if any(pattern.search(name) for name in names):
            continue
        if patterns is None:
            raise HyperParallelValueError(
                "head_wise=True selects no Muon param: its default selection is the q/k "
                "projection weights (names ending in q_proj, k_proj, q_b_proj, wq or wk + "
                "'.weight'); name yours with head_wise_patterns={regex: head_dim}."
            )
        raise HyperParallelValueError(
            f"head_wise_patterns entry {pattern.pattern!r} selects no Muon param; fix the regular "
            "expression (searched in full param names) or remove it."
        )


def check_transform(transform: object, working: Tensor) -> NSInputTransform:
    """``ns_transform_fn``'s result, checked as HyperParallel checks it.

    Raises:
        ValueError: not an :class:`NSInputTransform`, no tensors, a tensor on
            another device or in another dtype or with fewer than 2 dims, or
            a ``restore`` that cannot be called.
    """
    if not isinstance(transform, NSInputTransform):
        raise HyperParallelValueError(
            f"ns_transform_fn must return NSInputTransform or None, got {type(transform).__name__}."
        )
    if not transform.tensors:
        raise HyperParallelValueError("NSInputTransform.tensors must not be empty.")
    for index, tensor in enumerate(transform.tensors):
        if not isinstance(tensor, torch.Tensor):
            raise HyperParallelValueError(
                f"NSInputTransform.tensors[{index}] must be a torch.Tensor, got "
                f"{type(tensor).__name__}."
            )
        if tensor.device != working.device:
            raise HyperParallelValueError(
                f"NSInputTransform tensors must be on the same device as the NS input "
                f"({working.device}); tensors[{index}] is on {tensor.device}."
            )
        if tensor.dtype != working.dtype:
            raise HyperParallelValueError(
                f"NSInputTransform tensors must have the same dtype as the NS input "
                f"({working.dtype}); tensors[{index}] is {tensor.dtype}."
            )
        if tensor.dim() < 2:
            raise HyperParallelValueError(
                f"NSInputTransform tensors must have at least two dimensions; tensors[{index}] has "
                f"shape {tuple(tensor.shape)}."
            )
    if not callable(transform.restore):
        raise HyperParallelValueError("NSInputTransform.restore must be callable.")
    return transform
