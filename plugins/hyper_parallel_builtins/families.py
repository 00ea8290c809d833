"""Built-in plugin: the ``by_family`` partitioner behind family configuration.

``get_hyper_optimizer(model, muon={...}, sinkhorn={...}, adamw={...})``
calls it through the registry with each enabled family's routing keys
(``param_patterns``, ``param_groups``); everything else in a family's dict
is that optimizer's options and never reaches the partitioner. A family
left out, or ``None``, is off. The rules are HyperParallel's:

* a param whose name one family's ``param_patterns`` matches goes to that
  family (two families matching it is an error);
* else: a norm's params go to ``adamw``; embeddings and the output head to
  ``sinkhorn``, or ``adamw`` when ``sinkhorn`` is off; other params of two
  or more dims to ``muon`` when it is on; everything else to ``adamw``;
* a param whose family is off is an error, and so is a vector sent to a
  matrix-only family (Muon, Sinkhorn);
* ``adamw``'s params are split into a group with the configured weight
  decay and one with ``weight_decay=0`` (biases, scales, vectors outside a
  norm: :mod:`~hyper_parallel_builtins._param_roles`);
* ``param_groups`` entries (``{"param_patterns": [...], <options>}``) then
  give some of a family's own params options of their own; an entry that
  selects none of them is an error.

A selector (a ``param_patterns`` entry) is a regular expression, searched
(``re.search``) in each of a param's names, as in HyperParallel; or a glob,
matched against a whole name (``fnmatch`` rules, case-sensitive: ``*`` any
run of characters dots included, ``?`` one, ``[seq]``, ``[!seq]``), as
MindFormers' ``adamw_include`` is written. A glob is a pattern that starts
with ``*`` or ``?`` (no regular expression can, so no regular expression
changes meaning), or one written ``glob:<pattern>``.

Stricter than HyperParallel, deliberately: a ``param_patterns`` entry that
matches no param of the model is an error, not a silent no-op.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.errors import (
    HyperParallelConfigError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.options import FAMILY_KEYS, FAMILY_ORDER, did_you_mean, listed
from hyper_parallel.core.plugin import OptimizerEntry, PluginKind, RegisterFn, get_registry
from hyper_parallel_builtins._param_roles import NamedParam, named_params, output_head_ids

__all__ = ["by_family"]

_MATRIX_FAMILY = "muon"
_TOKEN_FAMILY = "sinkhorn"
_FALLBACK_FAMILY = "adamw"
_GROUP_EXAMPLE = "[{'param_patterns': ['embed_tokens'], 'lr': 0.01}]"

#: The prefix that makes any pattern a glob (one starting with ``*`` or ``?`` is one anyway).
GLOB_PREFIX = "glob:"
_GLOB_STARTS = ("*", "?")


@dataclass(frozen=True)
class _Pattern:
    """One selector as written, and how it matches a param name."""

    text: str
    glob: bool
    regex: re.Pattern[str]

    def matches(self, name: str) -> bool:
        """A glob matches the whole name; a regular expression is searched in it."""
        found = self.regex.match(name) if self.glob else self.regex.search(name)
        return found is not None

    @property
    def kind(self) -> str:
        """``"glob"`` or ``"regular expression"``, for messages."""
        return "glob" if self.glob else "regular expression"


@dataclass
class _Selector:
    """Compiled patterns, with how many params each matched (frozen ones too)."""

    where: str
    patterns: list[_Pattern]
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hits = [0] * len(self.patterns)

    def count(self, p: NamedParam) -> bool:
        """Whether any pattern matches one of ``p``'s names; each that does counts a hit."""
        matched = False
        for k, pattern in enumerate(self.patterns):
            if any(pattern.matches(name) for name in p.names):
                self.hits[k] += 1
                matched = True
        return matched


@dataclass
class _Family:
    name: str
    selector: _Selector  # its param_patterns
    groups: list[tuple[_Selector, dict[str, Any]]]  # its param_groups
    matrix_only: bool
    members: list[NamedParam] = field(default_factory=list)


def _compile_one(text: str, where: str) -> _Pattern:
    """A glob (``glob:...``, or starting with ``*`` / ``?``), else a regular expression."""
    body = text.removeprefix(GLOB_PREFIX)
    if body != text or text.startswith(_GLOB_STARTS):
        if not body:
            raise HyperParallelTypeError(
                f"{where} entry {text!r} is an empty glob; write {GLOB_PREFIX}<pattern>, "
                "e.g. 'glob:model.layers.*.mlp.*'."
            )
        return _Pattern(text, True, re.compile(fnmatch.translate(body)))
    try:
        return _Pattern(text, False, re.compile(text))
    except re.error as exc:
        raise HyperParallelValueError(
            f"{where} entry {text!r} is not a valid regular expression: {exc}; for a glob, "
            f"write {GLOB_PREFIX}{text}."
        ) from exc


def _compile(patterns: Any, where: str) -> list[_Pattern]:
    """A pattern or a list of them (HyperParallel takes one str as a list of one)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Sequence):
        raise HyperParallelTypeError(
            f"{where} must be a list of regular expressions or globs, got {patterns!r}."
        )
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise HyperParallelTypeError(
                f"{where} must hold non-empty str regular expressions or globs, got {pattern!r}."
            )
        compiled.append(_compile_one(pattern, where))
    return compiled


def _param_groups(name: str, raw: Any) -> list[tuple[_Selector, dict[str, Any]]]:
    """A family's ``param_groups``: ``[{"param_patterns": [...], <options>}, ...]``."""
    if isinstance(raw, Mapping) or not isinstance(raw, Sequence) or isinstance(raw, str):
        raise HyperParallelConfigError(
            f"Configured param_groups must be a list of mappings: {name}['param_groups'] is a "
            f"{type(raw).__name__}; write {_GROUP_EXAMPLE}."
        )
    groups = []
    for index, entry in enumerate(raw):
        where = f"{name}['param_groups'][{index}]"
        if not isinstance(entry, Mapping):
            raise HyperParallelConfigError(
                f"Each configured parameter group must be a mapping: {where} is a "
                f"{type(entry).__name__} ({entry!r}); write {_GROUP_EXAMPLE}."
            )
        options = dict(entry)
        patterns = options.pop("param_patterns", None)
        if not patterns or "params" in options:
            raise HyperParallelConfigError(
                f"Configured param_groups require param_patterns and cannot contain runtime "
                f"params: {where} has the keys {sorted(entry)}; select its params with "
                f"'param_patterns' (regular expressions or globs), e.g. {_GROUP_EXAMPLE}."
            )
        groups.append((_Selector(f"{where}['param_patterns']", _compile(patterns, where)), options))
    return groups


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
    where = f"{name}['param_patterns']"
    selector = _Selector(where, _compile(config.get("param_patterns", []), where))
    if name not in FAMILY_ORDER and not selector.patterns:
        raise HyperParallelValueError(
            f"Family {name!r} selects no params: only {', '.join(FAMILY_ORDER)} get params by "
            f"default; give {name}={{'param_patterns': [...]}}."
        )
    entry = get_registry().get(PluginKind.OPTIMIZER, name)
    return _Family(
        name=name,
        selector=selector,
        groups=_param_groups(name, config.get("param_groups", [])),
        matrix_only=isinstance(entry, OptimizerEntry) and entry.matrix_only,
    )


def _route(p: NamedParam, heads: set[int], enabled: Mapping[str, _Family]) -> str:
    """The family ``p`` belongs to: the one whose patterns select it, else by its role."""
    chosen = [family.name for family in enabled.values() if family.selector.count(p)]
    if len(chosen) > 1 and p.param.requires_grad:
        raise HyperParallelValueError(
            f"Overlapping optimizer selectors for {list(p.names)}: the param_patterns of "
            f"{', '.join(chosen)} all match it; make each family's patterns select it once."
        )
    if chosen:
        return chosen[0]
    if p.norm:
        return _FALLBACK_FAMILY
    if p.embedding or id(p.param) in heads:
        return _TOKEN_FAMILY if _TOKEN_FAMILY in enabled else _FALLBACK_FAMILY
    if p.param.ndim >= 2 and _MATRIX_FAMILY in enabled:
        return _MATRIX_FAMILY
    return _FALLBACK_FAMILY


def _how_it_matches(pattern: _Pattern) -> str:
    """How ``pattern`` is read, and the other reading, for an error about it."""
    if pattern.glob:
        return (
            "a glob is matched against whole param names such as "
            "'model.layers.0.self_attn.q_proj.weight'"
        )
    return (
        "a regular expression is searched in full param names such as "
        "'model.layers.0.self_attn.q_proj.weight'; a pattern is a glob when it starts with "
        f"'*' or '?' or is written '{GLOB_PREFIX}...'"
    )


def _check_patterns_matched(families: Sequence[_Family]) -> None:
    for family in families:
        selector = family.selector
        for pattern, hits in zip(selector.patterns, selector.hits, strict=True):
            if not hits:
                raise HyperParallelValueError(
                    f"{selector.where} entry {pattern.text!r} matches no param of the model; "
                    f"fix the {pattern.kind} ({_how_it_matches(pattern)}) or remove it."
                )


def _base_groups(family: _Family) -> list[dict[str, Any]]:
    """The family's groups before ``param_groups``: adamw's decayed and undecayed, else one."""
    if family.name != _FALLBACK_FAMILY:
        return [{"params": family.members}] if family.members else []
    decay = [p for p in family.members if not p.no_decay]
    exempt = [p for p in family.members if p.no_decay]
    groups: list[dict[str, Any]] = [{"params": decay}] if decay else []
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def _groups(
    family: _Family, params: Sequence[NamedParam], owner: Mapping[int, str]
) -> list[dict[str, Any]]:
    """The family's param-group dicts, its ``param_groups`` entries splitting its base groups.

    ``params`` are the model's and ``owner`` their families, for the error
    about an entry that selects none of this family's params.
    """
    out: list[dict[str, Any]] = []
    for base in _base_groups(family):
        parts: dict[int | None, list[NamedParam]] = {}
        for p in base["params"]:
            matched = [k for k, (selector, _) in enumerate(family.groups) if selector.count(p)]
            if len(matched) > 1:
                raise HyperParallelValueError(
                    f"Overlapping param_groups for {list(p.names)}: {family.name}['param_groups'] "
                    f"entries {matched[0]} and {matched[1]} both select it; select each param once."
                )
            parts.setdefault(matched[0] if matched else None, []).append(p)
        for index, members in parts.items():
            options = family.groups[index][1] if index is not None else {}
            out.append({**base, **options, "params": [p.param for p in members]})
    for selector, _ in family.groups:
        if not any(selector.hits):
            others = sorted(
                {owner[id(p.param)] for p in params if id(p.param) in owner and selector.count(p)}
            )
            hint = (
                f" it selects params of {', '.join(others)}; param_groups refine a family's own "
                f"params: move the entry there, or route the params with param_patterns."
                if others
                else f" fix its patterns ({_how_it_matches(selector.patterns[0])})."
            )
            raise HyperParallelValueError(
                f"Configured param_groups match no parameters in their optimizer family: "
                f"{selector.where} selects none of {family.name}'s params;{hint}"
            )
    return out


def by_family(
    model: nn.Module, *, families: Mapping[str, Mapping[str, Any] | None] | None = None
) -> dict[str, list[Any]]:
    """Route each trainable param to one optimizer family (HyperParallel's rules).

    Args:
        model: The model to partition.
        families: The enabled families, by optimizer name, each with its
            routing keys: ``param_patterns`` (a pattern or a list of them: a
            regular expression, searched in every name of a param, or a glob,
            ``*...`` / ``?...`` / ``glob:...``, matched against a whole name;
            a match sends the param to this family whatever its role) and
            ``param_groups``
            (``[{"param_patterns": [...], <group options>}, ...]``: some of
            this family's own params in groups of their own). A family that
            is missing or ``None`` is off; left out altogether, the families
            are ``adamw``, ``muon`` and ``sinkhorn`` with no routing keys.

    Returns:
        ``{family: [param-group dicts]}`` for every enabled family (an empty
        list when it gets no params), ``adamw``, ``muon``, ``sinkhorn`` first.
        Frozen params are left out; a tied param appears once; params keep
        the model's order within each group.

    Raises:
        ValueError: a param two families' patterns select, a trainable param
            whose family is off, a vector sent to a matrix-only family, a
            ``param_patterns`` entry that matches no param, or a
            ``param_groups`` entry that selects none of its family's params.
        TypeError: a family dict with an unknown key or a key of the wrong type.
        HyperParallelConfigError: a malformed ``param_groups`` (both a
            ``TypeError`` and a ``ValueError``).
    """
    if not isinstance(model, nn.Module):
        raise HyperParallelTypeError(f"by_family needs an nn.Module, got {type(model).__name__}.")
    if families is None:
        families = {name: {} for name in FAMILY_ORDER}
    if not isinstance(families, Mapping):
        raise HyperParallelTypeError(
            f"by_family needs families={{name: dict}}, got {type(families).__name__}."
        )
    order = [*FAMILY_ORDER, *(n for n in families if n not in FAMILY_ORDER)]
    enabled = {
        name: _family(name, config) for name in order if (config := families.get(name)) is not None
    }
    params = list(named_params(model))
    heads = output_head_ids(model, params)
    homeless: list[str] = []
    for p in params:
        name = _route(p, heads, enabled)
        if not p.param.requires_grad:
            continue
        family = enabled.get(name)
        if family is None:
            homeless.append(p.name)
        elif family.matrix_only and p.param.ndim < 2:
            raise HyperParallelValueError(
                f"{name} requires matrix parameters, got {p.name} of shape "
                f"{tuple(p.param.shape)}; leave it to adamw (drop the pattern that selects it)."
            )
        else:
            family.members.append(p)
    _check_patterns_matched(list(enabled.values()))
    if homeless:
        raise HyperParallelValueError(
            f"No enabled optimizer owns trainable parameter {homeless[0]}"
            f"{f' (nor {len(homeless) - 1} more: {listed(homeless[1:])})' if len(homeless) > 1 else ''}. "
            f"Norms, biases and other 1-D params go to {_FALLBACK_FAMILY!r}; turn it on "
            f"({_FALLBACK_FAMILY}={{}}), give another family param_patterns that match them, or "
            "freeze them (requires_grad=False)."
        )
    owner = {id(p.param): f.name for f in enabled.values() for p in f.members}
    return {name: _groups(family, params, owner) for name, family in enabled.items()}


@hookimpl
def hyper_parallel_register_partitioners(register: RegisterFn) -> None:
    """Register ``by_family``."""
    register(
        "by_family",
        by_family,
        description="family configuration: norms to AdamW, embeddings and head to Sinkhorn, "
        "matrices to Muon, the rest to AdamW; patterns override",
    )
