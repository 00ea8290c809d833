"""Built-in plugin: param-group partitioners ``by_name``, ``by_shape``, ``by_module``.

A partitioner decides which optimizer gets each trainable param:
``fn(model, **options) -> {"muon": [...], "adamw": [...]}``. Values are
lists of params or param-group dicts. Tied params appear once; frozen params
are left out. What a norm, an embedding, the head and an undecayed param
are is :mod:`~hyper_parallel_builtins._param_roles`'s one definition.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel_builtins._param_roles import (
    OUTPUT_HEAD_NAMES,
    NamedParam,
    named_params,
    output_head_ids,
)

__all__ = ["by_module", "by_name", "by_shape"]

#: Module names ``by_shape`` and ``by_module`` take for the output head: HyperParallel's
#: (:data:`~hyper_parallel_builtins._param_roles.OUTPUT_HEAD_NAMES`) and classifiers'.
DEFAULT_HEAD_NAMES: tuple[str, ...] = (
    *OUTPUT_HEAD_NAMES,
    "head",
    "classifier",
    "fc_out",
    "score",
)

#: The projection names the user guide sends to Muon.
DEFAULT_MUON_KEYS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def _trainable(model: nn.Module) -> Iterator[NamedParam]:
    """Each trainable param once (tied params under their first name), in the model's order."""
    return (p for p in named_params(model) if p.param.requires_grad)


def _check_options(model: nn.Module, matrix_optimizer: str, fallback_optimizer: str) -> None:
    if not isinstance(model, nn.Module):
        raise HyperParallelTypeError(
            f"A partitioner needs an nn.Module, got {type(model).__name__}."
        )
    for label, value in (
        ("matrix_optimizer", matrix_optimizer),
        ("fallback_optimizer", fallback_optimizer),
    ):
        if not isinstance(value, str) or not value:
            raise HyperParallelValueError(f"{label} must be an optimizer name, got {value!r}.")
    if matrix_optimizer == fallback_optimizer:
        raise HyperParallelValueError(
            f"matrix_optimizer and fallback_optimizer are both {matrix_optimizer!r}; "
            "a partitioner splits params between two different optimizers."
        )


def _partition(
    model: nn.Module,
    to_matrix_optimizer: Callable[[NamedParam], bool],
    matrix_optimizer: str,
    fallback_optimizer: str,
    no_decay: bool,
) -> dict[str, list[Any]]:
    """Each trainable param to the matrix optimizer if the predicate says so, else the fallback."""
    matrices: list[torch.Tensor] = []
    rest: list[NamedParam] = []
    for p in _trainable(model):
        if to_matrix_optimizer(p):
            matrices.append(p.param)
        else:
            rest.append(p)
    return {matrix_optimizer: matrices, fallback_optimizer: _split_decay(rest, no_decay)}


def _split_decay(params: list[NamedParam], no_decay: bool) -> list[dict[str, Any]]:
    """The fallback optimizer's groups: decayed, and (optionally) biases, scales and vectors
    outside norms without decay (:mod:`~hyper_parallel_builtins._param_roles`)."""
    if not no_decay:
        return [{"params": [p.param for p in params]}] if params else []
    decay = [p.param for p in params if not p.no_decay]
    exempt = [p.param for p in params if p.no_decay]
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay})
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def by_name(
    model: nn.Module,
    *,
    keys: Sequence[str] = DEFAULT_MUON_KEYS,
    pattern: str | None = None,
    matrix_optimizer: str = "muon",
    fallback_optimizer: str = "adamw",
    no_decay: bool = False,
) -> dict[str, list[Any]]:
    """The user guide's split: params whose name contains one of ``keys`` go to Muon.

    Args:
        model: The model to partition.
        keys: Name substrings that select Muon params (the guide's projection names).
        pattern: A regular expression (``re.search`` on the full param name)
            used instead of ``keys``.
        matrix_optimizer: Optimizer name for the selected matrices.
        fallback_optimizer: Optimizer name for everything else.
        no_decay: Put biases, scales and 1-D params outside norms in a group
            with ``weight_decay=0``.

    A selected param with fewer than two dims (``q_proj.bias``) goes to the
    fallback optimizer: Muon only updates matrices.
    """
    _check_options(model, matrix_optimizer, fallback_optimizer)
    if pattern is not None:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise HyperParallelValueError(
                f"by_name pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from exc

        def selected(name: str) -> bool:
            return regex.search(name) is not None
    else:
        if isinstance(keys, str) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise HyperParallelValueError(
                f"by_name keys must be a non-empty list of non-empty str, got {keys!r}."
            )
        key_list = tuple(keys)

        def selected(name: str) -> bool:
            return any(k in name for k in key_list)

    return _partition(
        model,
        lambda p: selected(p.name) and p.param.ndim >= 2,
        matrix_optimizer,
        fallback_optimizer,
        no_decay,
    )


def by_shape(
    model: nn.Module,
    *,
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    matrix_optimizer: str = "muon",
    fallback_optimizer: str = "adamw",
    no_decay: bool = True,
) -> dict[str, list[Any]]:
    """Hidden matrices (ndim >= 2) go to Muon; embeddings, the head, norms, biases and 1-D to AdamW.

    Args:
        model: The model to partition.
        head_names: Module names whose ``weight`` is the output head
            (``model.get_output_embeddings()``, and the last ``nn.Linear``
            onto an embedding's vocabulary, are too).
        matrix_optimizer: Optimizer name for hidden matrices.
        fallback_optimizer: Optimizer name for everything else.
        no_decay: Give biases, scales and 1-D params outside norms their own
            group with ``weight_decay=0``; norm weights decay.
    """
    _check_options(model, matrix_optimizer, fallback_optimizer)
    heads = output_head_ids(model, named_params(model), head_names, vocab_linear=True)

    def hidden_matrix(p: NamedParam) -> bool:
        return p.param.ndim >= 2 and not (p.embedding or p.norm or id(p.param) in heads)

    return _partition(model, hidden_matrix, matrix_optimizer, fallback_optimizer, no_decay)


def by_module(
    model: nn.Module,
    *,
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    matrix_optimizer: str = "muon",
    fallback_optimizer: str = "adamw",
    no_decay: bool = True,
) -> dict[str, list[Any]]:
    """``nn.Linear`` weights go to Muon, except the output head; everything else to AdamW.

    Args:
        model: The model to partition.
        head_names: Module names taken to be the output head (see :func:`by_shape`).
        matrix_optimizer: Optimizer name for Linear weights.
        fallback_optimizer: Optimizer name for everything else.
        no_decay: Give biases, scales and 1-D params outside norms their own
            group with ``weight_decay=0``.
    """
    _check_options(model, matrix_optimizer, fallback_optimizer)
    heads = output_head_ids(model, named_params(model), head_names, vocab_linear=True)

    def linear_weight(p: NamedParam) -> bool:
        return (
            isinstance(p.module, nn.Linear)
            and p.param is p.module.weight
            and id(p.param) not in heads
        )

    return _partition(model, linear_weight, matrix_optimizer, fallback_optimizer, no_decay)


@hookimpl
def hyper_parallel_register_partitioners(register: RegisterFn) -> None:
    """Register ``by_name``, ``by_shape`` and ``by_module``."""
    register(
        "by_name",
        by_name,
        description="the guide's split: q/k/v/o and gate/up/down projections to Muon",
    )
    register(
        "by_shape",
        by_shape,
        description="hidden matrices to Muon; embeddings, head, norms, biases to AdamW",
    )
    register(
        "by_module",
        by_module,
        description="nn.Linear weights (not the head) to Muon; the rest to AdamW",
    )
