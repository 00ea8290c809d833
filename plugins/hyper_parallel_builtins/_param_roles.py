"""What a param is in its model: a norm's, an embedding, the output head, and whether it decays.

One definition, shared by every built-in partitioner (``by_family``,
``by_shape``, ``by_module``), and the one HyperParallel uses:

* **norm**: a param of a normalization module, any dims: ``torch.nn``'s
  norms, or a class whose name ends in ``Norm``, ``Norm1d/2d/3d`` or
  ``NormGated`` (any case: ``LlamaRMSNorm``, ``KimiRMSNormGated``);
* **embedding**: the weight of an ``nn.Embedding`` / ``nn.EmbeddingBag``;
* **output head**: the ``weight`` of a module named ``lm_head``, ``output``
  or ``output_layer`` (by any of a tied param's names), or of
  ``model.get_output_embeddings()``;
* **no weight decay**: a bias, a param named ``scale``, ``scales`` or
  ``scaling_factor``, or a 1-D or scalar param outside a norm. Norm weights
  decay like any other weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "EMBEDDING_TYPES",
    "NORM_TYPES",
    "NO_DECAY_NAMES",
    "OUTPUT_HEAD_NAMES",
    "NamedParam",
    "is_norm_module",
    "named_params",
    "output_head_ids",
]

#: Normalization layers torch ships (other libraries' are recognized by class name).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)

#: Embedding layers: their weight is a token table.
EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)

#: Module names (last path component) whose ``weight`` is the output head.
OUTPUT_HEAD_NAMES: tuple[str, ...] = ("lm_head", "output", "output_layer")

#: Param names (last path component) that are never decayed, wherever they are.
NO_DECAY_NAMES: tuple[str, ...] = ("bias", "scale", "scales", "scaling_factor")

_NORM_CLASS = re.compile(r"norm(?:[123]d|gated)?$", re.IGNORECASE)


def is_norm_module(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer (see the module docstring)."""
    return isinstance(module, NORM_TYPES) or bool(_NORM_CLASS.search(type(module).__name__))


@dataclass(frozen=True, kw_only=True)
class NamedParam:
    """A param once (tied params by identity), with all its names and its roles.

    Attributes:
        names: Every name it has in the model, first registered first.
        param: The param.
        module: The module that holds it under its first name.
        norm: It belongs to a normalization module.
        embedding: It is an embedding's weight.
    """

    names: tuple[str, ...]
    param: torch.Tensor
    module: nn.Module
    norm: bool
    embedding: bool

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def no_decay(self) -> bool:
        """Whether AdamW leaves it undecayed (a bias, a scale, a vector outside a norm)."""
        if any(n.rsplit(".", 1)[-1] in NO_DECAY_NAMES for n in self.names):
            return True
        return self.param.ndim < 2 and not self.norm


def named_params(model: nn.Module) -> Iterator[NamedParam]:
    """Every param of ``model`` once, frozen ones included, in registration order."""
    names: dict[int, list[str]] = {}
    owners: dict[int, tuple[nn.Module, torch.Tensor]] = {}
    norms: set[int] = set()
    embeddings: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{local}" if module_name else local
            names.setdefault(id(param), []).append(full)
            owners.setdefault(id(param), (module, param))
            if is_norm_module(module):
                norms.add(id(param))
            if isinstance(module, EMBEDDING_TYPES) and local == "weight":
                embeddings.add(id(param))
    for key, (module, param) in owners.items():
        yield NamedParam(
            names=tuple(dict.fromkeys(names[key])),
            param=param,
            module=module,
            norm=key in norms,
            embedding=key in embeddings,
        )


def output_head_ids(
    model: nn.Module,
    params: Iterable[NamedParam],
    head_names: Sequence[str] = OUTPUT_HEAD_NAMES,
    *,
    vocab_linear: bool = False,
) -> set[int]:
    """``id`` of the output head's weight: a ``<head name>.weight`` name, or ``get_output_embeddings()``.

    With ``vocab_linear``, also the last ``nn.Linear`` whose outputs match an
    embedding's vocabulary (a head named like nothing above).
    """
    pattern = re.compile(r"(?:^|\.)(?:" + "|".join(map(re.escape, head_names)) + r")\.weight$")
    heads = {id(p.param) for p in params if any(pattern.search(n) for n in p.names)}
    if vocab_linear:
        vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
        linears = [
            m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in vocab
        ]
        if linears:
            heads.add(id(linears[-1].weight))
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    weight = getattr(head, "weight", None) if isinstance(head, nn.Module) else None
    if isinstance(weight, torch.Tensor):
        heads.add(id(weight))
    return heads
