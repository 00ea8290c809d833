"""What a ``get_hyper_optimizer()`` call asks for, parsed once, whichever of its four forms it used.

:func:`parse_request` turns the guide's ``<name>_params`` / ``<name>_kwargs``,
``optimizers=``, a partitioner, or family configuration (``muon={...}``), plus
``<name>_<option>`` keywords, into one :class:`Request`. Every exclusion
between the forms is checked here; the factory reads only the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.core.errors import (
    HyperParallelConfigError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.options import FAMILY_KEYS, FAMILY_ORDER, did_you_mean
from hyper_parallel.core.plugin import PluginKind, RegistryEntry, get_registry
from hyper_parallel.core.plugin._entries import normalize_name

__all__ = [
    "DEFAULT_PARTITIONER",
    "FAMILY_PARTITIONER",
    "GUIDE_ARGUMENTS",
    "OptimizerSpec",
    "Request",
    "as_groups",
    "parse_request",
    "unprefixed",
]


#: The partitioner used when no params are given at all.
DEFAULT_PARTITIONER = "by_shape"

#: The partitioner that routes params in family configuration.
FAMILY_PARTITIONER = "by_family"


#: The keyword arguments of the forms other than family configuration.
GUIDE_ARGUMENTS: tuple[str, ...] = (
    "muon_params",
    "adamw_params",
    "muon_kwargs",
    "adamw_kwargs",
    "sinkhorn_params",
    "sinkhorn_kwargs",
    "optimizers",
    "partitioner",
    "partitioner_kwargs",
)


@dataclass
class OptimizerSpec:
    """One optimizer to build: its registry entry, param groups and keyword arguments.

    The request holds one per optimizer the call names; the factory adds the
    ones a partitioner fills and the fallback for vectors. ``params_given``
    says whether its groups are set (by the call or a partitioner); until
    then ``groups`` is empty.
    """

    name: str
    entry: RegistryEntry
    groups: list[dict[str, Any]] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    params_given: bool = False


@dataclass(frozen=True)
class Request:
    """A call to ``get_hyper_optimizer()``, parsed: the factory reads nothing else.

    ``optimizers`` are in the call's order; with a ``partitioner`` none has
    its params given until it fills them (and it may add optimizers).
    """

    optimizers: tuple[OptimizerSpec, ...]
    partitioner: str | None = None
    partitioner_kwargs: Mapping[str, Any] = field(default_factory=dict)


def parse_request(given: Mapping[str, Any], prefixed: Mapping[str, Any]) -> Request:
    """Parse the arguments of one call.

    Args:
        given: The named arguments of :data:`GUIDE_ARGUMENTS` the call passed
            (``None`` values are not given).
        prefixed: Every other keyword: family dicts (``muon={...}``) and
            ``<name>_<option>`` options.

    Raises:
        HyperParallelConfigError: family configuration mixed with another form.
        TypeError, ValueError: as :func:`get_hyper_optimizer` documents.
    """
    given = {k: v for k, v in given.items() if v is not None}
    rest = dict(prefixed)
    families = _pop_families(rest)
    if families:
        if given:
            raise HyperParallelConfigError(
                f"Family configs cannot be mixed with explicit groups/kwargs: "
                f"get_hyper_optimizer() got family keywords "
                f"({', '.join(f'{n}=' for n in families)}) and "
                f"{', '.join(f'{n}=' for n in given)}; use one or the other. In family "
                "configuration a family's dict holds its options, and its param_patterns / "
                "param_groups say which params it gets."
            )
        options, routing = _family_options(families)
        given = {
            "optimizers": options,
            "partitioner": FAMILY_PARTITIONER,
            "partitioner_kwargs": routing,
        }
    requested = _Collected()
    for name in FAMILY_ORDER:
        params, kwargs = given.get(f"{name}_params"), given.get(f"{name}_kwargs")
        if params is not None or kwargs is not None:
            requested.add(name, params, unprefixed(name, kwargs), f"{name}_params")
    for name, config in (given.get("optimizers") or {}).items():
        if not isinstance(config, Mapping):
            raise HyperParallelTypeError(
                f"optimizers[{name!r}] must be a dict of options, got {type(config).__name__}."
            )
        config = dict(config)
        requested.add(name, config.pop("params", None), config, f"optimizers[{name!r}]")
    requested.add_prefixed(rest)
    return Request(tuple(requested.values()), *_partitioner(given, requested))


class _Collected(dict[str, OptimizerSpec]):
    """The optimizers requested so far, by registered name, each configured once."""

    def add(
        self, name: str, params: Any, kwargs: Mapping[str, Any] | None, where: str
    ) -> OptimizerSpec:
        entry = get_registry().get(PluginKind.OPTIMIZER, name)
        if entry.name in self:
            raise HyperParallelValueError(
                f"Optimizer {entry.name!r} is configured twice ({where} and an earlier argument); "
                "configure each optimizer once."
            )
        given = params is not None
        groups = as_groups(params, where) if given else []
        self[entry.name] = OptimizerSpec(entry.name, entry, groups, dict(kwargs or {}), given)
        return self[entry.name]

    def add_prefixed(self, prefixed: Mapping[str, Any]) -> None:
        """``muon_lr=0.02``: an option of that optimizer (requested here if it is not yet)."""
        for name, extra in _split_prefixed(prefixed, [*self, *FAMILY_ORDER]).items():
            requested = self.get(name) or self.add(name, None, None, f"{name}_* keyword arguments")
            for key, value in extra.items():
                if key in requested.kwargs:
                    raise HyperParallelValueError(
                        f"Option {key!r} of optimizer {name!r} is given twice ({name}_{key} and a dict)."
                    )
                requested.kwargs[key] = value


def _partitioner(
    given: Mapping[str, Any], requested: Mapping[str, OptimizerSpec]
) -> tuple[str | None, dict[str, Any]]:
    """The partitioner that fills the groups (``None``: the params were given), and its options."""
    any_given = any(r.params_given for r in requested.values())
    partitioner, options = given.get("partitioner"), given.get("partitioner_kwargs")
    if partitioner is not None and any_given:
        raise HyperParallelValueError(
            "get_hyper_optimizer() got both explicit params and partitioner="
            f"{partitioner!r}; use one of them."
        )
    if options is not None and partitioner is None and any_given:
        raise HyperParallelValueError(
            "partitioner_kwargs was given without partitioner=...; name the partitioner."
        )
    if any_given:
        return None, {}
    return partitioner or DEFAULT_PARTITIONER, dict(options or {})


def unprefixed(name: str, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``<name>_kwargs`` with HyperParallel's ``<name>_`` prefix dropped from its keys.

    ``muon_kwargs={"muon_lr": 0.02, "nesterov": True}`` is ``{"lr": 0.02,
    "nesterov": True}``, as HyperParallel reads it (its docstring example, its
    Trainer builders and its end-to-end test write the prefix). Only the
    optimizer's own prefix is dropped: ``"adamw_lr"`` in ``muon_kwargs`` stays,
    and is reported as an unknown option of Muon.

    Raises:
        HyperParallelTypeError: ``kwargs`` is not a dict.
        HyperParallelValueError: one option given both with and without the prefix.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise HyperParallelTypeError(
            f"{name}_kwargs must be a dict of {name}'s options, got {type(kwargs).__name__}."
        )
    prefix = f"{name}_"
    options: dict[str, Any] = {}
    for key, value in kwargs.items():
        option = key
        if isinstance(key, str) and key.startswith(prefix) and len(key) > len(prefix):
            option = key[len(prefix) :]
        if option in options:
            raise HyperParallelValueError(
                f"{name}_kwargs sets option {option!r} twice, as {option!r} and "
                f"{prefix + option!r}; keep one of them."
            )
        options[option] = value
    return options


def _split_prefixed(prefixed: Mapping[str, Any], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``muon_lr=0.02`` -> ``{"muon": {"lr": 0.02}}``; longest optimizer name wins."""
    by_length = sorted(set(names), key=len, reverse=True)
    out: dict[str, dict[str, Any]] = {}
    for key, value in prefixed.items():
        for name in by_length:
            if key.startswith(name + "_") and len(key) > len(name) + 1:
                out.setdefault(name, {})[key[len(name) + 1 :]] = value
                break
        else:
            known = [
                *GUIDE_ARGUMENTS,
                "sharding",
                *by_length,
                *(f"{n}_<option>" for n in by_length),
            ]
            raise HyperParallelTypeError(
                f"get_hyper_optimizer() got an unexpected keyword argument {key!r}."
                f"{did_you_mean(key, known)} Keyword arguments prefixed with an optimizer's name "
                f"(e.g. 'muon_lr') configure that optimizer; optimizers here: {', '.join(by_length)}."
            )
    return out


def _pop_families(kwargs: dict[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """Take the family keywords (a registered optimizer's name: ``muon={...}``) out of kwargs."""
    names = {
        normalize_name(alias): entry.name
        for entry in get_registry().entries(PluginKind.OPTIMIZER)
        for alias in (entry.name, *entry.aliases)
    }
    families: dict[str, Mapping[str, Any] | None] = {}
    for key in [k for k in kwargs if normalize_name(k) in names]:
        config, name = kwargs.pop(key), names[normalize_name(key)]
        if config is not None and not isinstance(config, Mapping):
            raise HyperParallelTypeError(
                f"{key}= must be a dict of {name}'s options and param_patterns ({{}} for its "
                f"defaults), or None to turn the family off; got {type(config).__name__}."
            )
        if name in families:
            raise HyperParallelValueError(
                f"Family {name!r} is configured twice; configure it once."
            )
        families[name] = config
    return families


def _family_options(
    families: Mapping[str, Mapping[str, Any] | None],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Family dicts -> each enabled family's optimizer options, and the partitioner's options."""
    options: dict[str, dict[str, Any]] = {}
    routing: dict[str, dict[str, Any]] = {}
    for name, config in families.items():
        if config is not None and "params" in config:
            raise HyperParallelTypeError(
                f"{name}= takes no 'params'; select the family's params with 'param_patterns' "
                "(regular expressions searched in param names, or globs such as '*.mlp.*' "
                "matched against whole names)."
            )
        if config is not None:
            routing[name] = {k: v for k, v in config.items() if k in FAMILY_KEYS}
            options[name] = {k: v for k, v in config.items() if k not in FAMILY_KEYS}
    return options, {"families": routing}


def as_groups(params: Any, where: str) -> list[dict[str, Any]]:
    """Normalize params / (name, param) pairs / group dicts into group dicts."""
    if isinstance(params, torch.Tensor):
        raise HyperParallelTypeError(
            f"{where} must be a list of params or param-group dicts, got a single Tensor; wrap it in a list."
        )
    if isinstance(params, Mapping):
        raise HyperParallelTypeError(
            f"{where} must be a list; got a dict. For one group pass [{{'params': ...}}]."
        )
    groups: list[dict[str, Any]] = []
    loose: list[torch.Tensor] = []
    for item in list(params):
        if isinstance(item, Mapping):
            if "params" not in item:
                raise HyperParallelValueError(f"A param group in {where} has no 'params' key.")
            group = dict(item)
            group["params"] = [_as_tensor(p, where) for p in _iter_params(group["params"])]
            groups.append(group)
        else:
            loose.append(_as_tensor(item, where))
    if loose:
        groups.insert(0, {"params": loose})
    return groups


def _iter_params(params: Any) -> Iterable[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _as_tensor(item: Any, where: str) -> torch.Tensor:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        item = item[1]  # from named_parameters()
    if not isinstance(item, torch.Tensor):
        raise HyperParallelTypeError(
            f"{where} holds a {type(item).__name__}, expected parameters (tensors)."
        )
    return item
