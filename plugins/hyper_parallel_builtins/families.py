"""Built-in plugin: the ``by_family`` partitioner behind family configuration.

``get_hyper_optimizer(model, muon={...}, sinkhorn={...}, adamw={...})``
calls it through the registry with each enabled family's routing keys
(``param_patterns``, ``param_groups``, ``head_wise``, ``head_dim``,
``head_wise_patterns``); everything else in a family's dict is that
optimizer's options and never reaches the partitioner.

Default routing, for each trainable param no pattern claims:

* ``nn.Embedding`` weights and the output head's weight (a module named
  ``lm_head``, ``output`` or ``output_layer``, or ``model.get_output_embeddings()``)
  go to ``sinkhorn``, or to ``adamw`` when that family is off;
* params of normalization modules go to ``adamw``;
* other params with two or more dims go to ``muon``, or to ``adamw`` when
  that family is off;
* everything else goes to ``adamw``.

In ``adamw``, biases, params named ``scale``/``scales``/``scaling_factor``
and 1-D or scalar params outside normalization modules get a group with
``weight_decay=0``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core._suggest import did_you_mean
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.plugin import PluginKind, RegisterFn, get_registry
from hyper_parallel_builtins.partitioners import NORM_TYPES

__all__ = [
    "FAMILY_KEYS",
    "HEAD_WISE_NAMES",
    "NO_DECAY_NAMES",
    "OUTPUT_HEAD_NAMES",
    "by_family",
    "is_norm_module",
]

#: The keys of a family dict that route params; the partitioner reads these and nothing else.
FAMILY_KEYS: tuple[str, ...] = (
    "param_patterns",
    "param_groups",
    "head_wise",
    "head_dim",
    "head_wise_patterns",
)

#: Module names (last path component) whose ``weight`` is the output head.
OUTPUT_HEAD_NAMES: tuple[str, ...] = ("lm_head", "output", "output_layer")

#: Module names whose ``weight`` is made head-wise by ``head_wise=True``.
HEAD_WISE_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "q_b_proj", "wq", "wk")

#: Param names (last path component) that AdamW never decays, wherever they are.
NO_DECAY_NAMES: tuple[str, ...] = ("bias", "scale", "scales", "scaling_factor")

_MATRIX_FAMILY = "muon"
_TOKEN_FAMILY = "sinkhorn"
_FALLBACK_FAMILY = "adamw"
_DEFAULT_ROUTES = (_MATRIX_FAMILY, _TOKEN_FAMILY, _FALLBACK_FAMILY)
_DEFAULT_HEAD_WISE = r"(^|\.)(" + "|".join(HEAD_WISE_NAMES) + r")\.weight$"
_MAX_NAMES_SHOWN = 5
_GROUP_EXAMPLE = "{'param_patterns': ['embed_tokens'], 'lr': 0.01}"


def is_norm_module(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer.

    The ``torch.nn`` norms (LayerNorm, RMSNorm, GroupNorm, the BatchNorm and
    InstanceNorm family) and any module whose class name ends in ``Norm``
    (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, ...).
    """
    return isinstance(module, NORM_TYPES) or type(module).__name__.endswith("Norm")


@dataclass(frozen=True, kw_only=True)
class _Param:
    """A param once (tied params by identity), with every name it has in the model."""

    names: tuple[str, ...]
    param: torch.Tensor
    module: nn.Module
    local: str

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class _Group:
    """A family's group: its options and the patterns that select its params (none: default)."""

    options: dict[str, Any]
    patterns: list[re.Pattern[str]]
    hits: list[int] = field(default_factory=list)


@dataclass
class _Family:
    name: str
    groups: list[_Group]  # [0] is the family's own param_patterns, then its param_groups
    head_wise: list[tuple[re.Pattern[str], int | None]]
    head_dim: int | None
    default_head_wise: bool
    matrix_only: bool


def _shown(names: Sequence[str]) -> str:
    head = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return head + (f" and {more} more" if more > 0 else "")


def _all_params(model: nn.Module) -> Iterator[_Param]:
    """Every param once, frozen ones included, under its first name and module."""
    names: dict[int, list[str]] = {}
    owners: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{local}" if module_name else local
            names.setdefault(id(param), []).append(full)
            owners.setdefault(id(param), (module, local, param))
    for key, (module, local, param) in owners.items():
        yield _Param(
            names=tuple(dict.fromkeys(names[key])), param=param, module=module, local=local
        )


def _compile(patterns: Any, where: str) -> list[re.Pattern[str]]:
    if isinstance(patterns, str) or not isinstance(patterns, Sequence):
        raise HyperParallelTypeError(
            f"{where} must be a list of regular expressions, got {patterns!r}; "
            f"e.g. [{patterns!r}] for one."
        )
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise HyperParallelTypeError(
                f"{where} must hold non-empty str regular expressions, got {pattern!r}."
            )
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise HyperParallelValueError(
                f"{where} entry {pattern!r} is not a valid regular expression: {exc}."
            ) from exc
    return compiled


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HyperParallelValueError(f"{where} must be a positive int, got {value!r}.")
    return value


def _family(name: str, config: Mapping[str, Any]) -> _Family:
    """Check one family's routing keys and compile its patterns."""
    if not isinstance(config, Mapping):
        raise HyperParallelTypeError(
            f"Family {name!r} must be a dict of routing keys, got {type(config).__name__}."
        )
    for key in config:
        if key not in FAMILY_KEYS:
            raise HyperParallelTypeError(
                f"Unknown key {key!r} for family {name!r}.{did_you_mean(str(key), FAMILY_KEYS)} "
                f"by_family reads: {', '.join(FAMILY_KEYS)}."
            )
    groups = [_Group({}, _compile(config.get("param_patterns", []), f"{name}['param_patterns']"))]
    raw_groups = config.get("param_groups", [])
    if isinstance(raw_groups, Mapping) or not isinstance(raw_groups, Sequence):
        raise HyperParallelTypeError(
            f"{name}['param_groups'] must be a list of dicts, got {type(raw_groups).__name__}."
        )
    for index, raw in enumerate(raw_groups):
        where = f"{name}['param_groups'][{index}]"
        if not isinstance(raw, Mapping):
            raise HyperParallelTypeError(
                f"{where} must be a dict such as {_GROUP_EXAMPLE}, got {type(raw).__name__}."
            )
        if "params" in raw or "param_patterns" not in raw:
            raise HyperParallelValueError(
                f"{where} must select its params with 'param_patterns' (regular expressions), "
                f"not 'params', e.g. {_GROUP_EXAMPLE}; got the keys {sorted(raw)}."
            )
        options = {k: v for k, v in raw.items() if k != "param_patterns"}
        groups.append(
            _Group(options, _compile(raw["param_patterns"], f"{where}['param_patterns']"))
        )
    for group in groups:
        group.hits = [0] * len(group.patterns)
    if name not in _DEFAULT_ROUTES and not any(g.patterns for g in groups):
        raise HyperParallelValueError(
            f"Family {name!r} selects no params: only {', '.join(_DEFAULT_ROUTES)} get params by "
            f"default; give {name}={{'param_patterns': [...]}}."
        )

    head_dim = config.get("head_dim")
    if head_dim is not None:
        head_dim = _positive_int(head_dim, f"{name}['head_dim']")
    raw_head_wise = config.get("head_wise_patterns")
    head_wise_on = config.get("head_wise", raw_head_wise is not None)
    if not isinstance(head_wise_on, bool):
        raise HyperParallelTypeError(f"{name}['head_wise'] must be a bool, got {head_wise_on!r}.")
    if raw_head_wise is not None and not head_wise_on:
        raise HyperParallelValueError(
            f"{name} has head_wise_patterns but head_wise=False; drop one of them."
        )
    head_wise: list[tuple[re.Pattern[str], int | None]] = []
    if head_wise_on:
        if raw_head_wise is None:
            raw_head_wise = {_DEFAULT_HEAD_WISE: None}
        if not isinstance(raw_head_wise, Mapping):
            raise HyperParallelTypeError(
                f"{name}['head_wise_patterns'] must be a dict {{regex: head_dim}} (head_dim may "
                f"be None for the family's or model's), got {type(raw_head_wise).__name__}."
            )
        where = f"{name}['head_wise_patterns']"
        for pattern, dim in raw_head_wise.items():
            (compiled,) = _compile([pattern], where)
            head_wise.append((compiled, None if dim is None else _positive_int(dim, where)))
    return _Family(
        name=name,
        groups=groups,
        head_wise=head_wise,
        head_dim=head_dim,
        default_head_wise=head_wise_on and "head_wise_patterns" not in config,
        matrix_only=bool(
            getattr(get_registry().get(PluginKind.OPTIMIZER, name).obj, "matrix_only", False)
        ),
    )


def _config_head_dim(model: nn.Module) -> int | None:
    """``model.config.head_dim``, else ``hidden_size // num_attention_heads`` (Hugging Face)."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
        return head_dim
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _head_ids(model: nn.Module) -> set[int]:
    """The output head's weight: modules named like a head, and ``get_output_embeddings()``."""
    heads: set[int] = set()
    for module_name, module in model.named_modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if module_name.rsplit(".", 1)[-1] in OUTPUT_HEAD_NAMES and weight is not None:
            heads.add(id(weight))
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    weight = getattr(head, "weight", None) if isinstance(head, nn.Module) else None
    if isinstance(weight, torch.Tensor):
        heads.add(id(weight))
    return heads


def _claim(p: _Param, families: list[_Family]) -> tuple[_Family, int] | None:
    """The family and group whose patterns select ``p``, or None; two is an error if it trains.

    Every pattern that matches one of ``p``'s names counts a hit, frozen params included.
    A matrix-only family (Muon, Sinkhorn) does not claim a param with fewer than two dims.
    """
    claims: list[tuple[_Family, int]] = []
    for family in families:
        matched = []
        for index, group in enumerate(family.groups):
            for k, pattern in enumerate(group.patterns):
                if any(pattern.search(name) for name in p.names):
                    group.hits[k] += 1
                    matched.append(index)
        if matched and not (family.matrix_only and p.param.ndim < 2):
            given = sorted(set(matched) - {0})
            if len(given) > 1 and p.param.requires_grad:
                raise HyperParallelValueError(
                    f"Param {p.name!r} matches the param_patterns of {family.name}['param_groups'] "
                    f"entries {given[0] - 1} and {given[1] - 1}; make the patterns select each "
                    "param once."
                )
            claims.append((family, given[0] if given else 0))
    if len(claims) > 1 and p.param.requires_grad:
        first, second = claims[0][0].name, claims[1][0].name
        raise HyperParallelValueError(
            f"Param {p.name!r} matches the param patterns of both families {first!r} and "
            f"{second!r}; make the patterns select each param for one family."
        )
    return claims[0] if claims else None


def _default_family(p: _Param, heads: set[int], enabled: Mapping[str, _Family]) -> _Family | None:
    if isinstance(p.module, (nn.Embedding, nn.EmbeddingBag)) or id(p.param) in heads:
        wanted = _TOKEN_FAMILY
    elif is_norm_module(p.module) or p.param.ndim < 2:
        wanted = _FALLBACK_FAMILY
    else:
        wanted = _MATRIX_FAMILY
    return enabled.get(wanted) or enabled.get(_FALLBACK_FAMILY)


def _check_patterns_matched(families: list[_Family]) -> None:
    for family in families:
        for index, group in enumerate(family.groups):
            where = (
                f"{family.name}['param_patterns']"
                if index == 0
                else f"{family.name}['param_groups'][{index - 1}]['param_patterns']"
            )
            for pattern, hits in zip(group.patterns, group.hits, strict=True):
                if not hits:
                    raise HyperParallelValueError(
                        f"{where} entry {pattern.pattern!r} matches no param of the model; fix the "
                        "regular expression (it is searched in full param names such as "
                        "'model.layers.0.self_attn.q_proj.weight') or remove it."
                    )


def _head_dims(model: nn.Module, family: _Family, params: list[_Param]) -> dict[int, int]:
    """id(param) -> head_dim for the family's params its head-wise patterns select."""
    if not family.head_wise:
        return {}
    fallback = family.head_dim or _config_head_dim(model)
    out: dict[int, int] = {}
    for pattern, dim in family.head_wise:
        selected = [
            p for p in params if p.param.ndim >= 2 and any(pattern.search(n) for n in p.names)
        ]
        if not selected:
            if family.default_head_wise:
                raise HyperParallelValueError(
                    f"{family.name}={{'head_wise': True}} found no q/k projection weight among "
                    f"the family's params (names ending in {', '.join(HEAD_WISE_NAMES)} + "
                    "'.weight'); name them with head_wise_patterns={regex: head_dim}."
                )
            raise HyperParallelValueError(
                f"{family.name}['head_wise_patterns'] entry {pattern.pattern!r} matches no "
                f"param of family {family.name!r} with 2 or more dims; fix or remove it."
            )
        if dim is None and fallback is None:
            raise HyperParallelValueError(
                f"{family.name} is head-wise but has no head_dim: give "
                f"{family.name}={{'head_wise': True, 'head_dim': ...}}, a head_dim per "
                "head_wise_patterns entry, or a model whose config has head_dim (or hidden_size "
                "and num_attention_heads)."
            )
        for p in selected:
            out.setdefault(id(p.param), dim or fallback or 0)
    return out


def _no_decay(p: _Param) -> bool:
    if p.local in NO_DECAY_NAMES:
        return True
    return p.param.ndim < 2 and not is_norm_module(p.module)


def _groups(model: nn.Module, family: _Family, members: list[tuple[_Param, int]]) -> list[Any]:
    """The family's param-group dicts: its groups, split by head_dim and, in adamw, by decay."""
    head_dims = _head_dims(model, family, [p for p, _ in members])
    buckets: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
    for p, index in members:
        no_decay = family.name == _FALLBACK_FAMILY and _no_decay(p)
        key = (index, head_dims.get(id(p.param), 0), no_decay)
        buckets.setdefault(key, []).append(p.param)
    out: list[Any] = []
    for (index, head_dim, no_decay), params in sorted(buckets.items(), key=lambda kv: kv[0]):
        group: dict[str, Any] = {"params": params}
        if head_dim:
            group["head_dim"] = head_dim
        group.update(family.groups[index].options)
        if no_decay:
            group["weight_decay"] = 0.0
        out.append(group)
    return out


def by_family(
    model: nn.Module, *, families: Mapping[str, Mapping[str, Any] | None] | None = None
) -> dict[str, list[Any]]:
    """Route each trainable param to one optimizer family.

    Args:
        model: The model to partition.
        families: The enabled families, by optimizer name, each with its
            routing keys: ``param_patterns`` (regular expressions searched in
            full param names; a matching param goes to this family whatever
            the default routing says), ``param_groups`` (``[{"param_patterns":
            [...], <group options>}, ...]``: matching params go to this family
            in a group of their own), ``head_wise``, ``head_dim`` and
            ``head_wise_patterns`` (``{regex: head_dim or None}``). A family
            that is missing or ``None`` is off; left out altogether, the
            families are ``muon``, ``sinkhorn`` and ``adamw`` with no routing
            keys. A matrix-only family (Muon, Sinkhorn) never gets a param
            with fewer than two dims: its patterns leave such a param to the
            default routing.

    Returns:
        ``{family: [param-group dicts]}`` for every enabled family (an empty
        list when it gets no params). Frozen params are left out; a tied
        param appears once.

    Raises:
        ValueError: a pattern that matches no param, a param matched by two
            families, a trainable param in no family, or a head-wise family
            with no head_dim to be found.
        TypeError: a family dict with an unknown key or a key of the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise HyperParallelTypeError(f"by_family needs an nn.Module, got {type(model).__name__}.")
    if families is None:
        families = {name: {} for name in _DEFAULT_ROUTES}
    if not isinstance(families, Mapping):
        raise HyperParallelTypeError(
            f"by_family needs families={{name: dict}}, got {type(families).__name__}."
        )
    enabled = {name: _family(name, cfg) for name, cfg in families.items() if cfg is not None}
    heads = _head_ids(model)
    members: dict[str, list[tuple[_Param, int]]] = {name: [] for name in enabled}
    homeless: list[str] = []
    family: _Family | None
    for p in _all_params(model):
        claim = _claim(p, list(enabled.values()))
        if not p.param.requires_grad:
            continue
        family, index = claim if claim else (_default_family(p, heads, enabled), 0)
        if family is None:
            homeless.append(p.name)
        else:
            members[family.name].append((p, index))
    _check_patterns_matched(list(enabled.values()))
    if homeless:
        raise HyperParallelValueError(
            f"{len(homeless)} trainable param(s) belong to no optimizer family: "
            f"{_shown(homeless)}. "
            f"Norms, biases and other 1-D params go to {_FALLBACK_FAMILY!r}; turn it on "
            f"({_FALLBACK_FAMILY}={{}}), give another family param_patterns that match them, or "
            "freeze them (requires_grad=False)."
        )
    return {name: _groups(model, enabled[name], members[name]) for name in enabled}


@hookimpl
def hyper_parallel_register_partitioners(register: RegisterFn) -> None:
    """Register ``by_family``."""
    register(
        "by_family",
        by_family,
        description="family configuration: embeddings and head to Sinkhorn, matrices to Muon, "
        "the rest to AdamW; patterns override",
    )
