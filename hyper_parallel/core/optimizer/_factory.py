"""``get_hyper_optimizer``: build a ChainedOptimizer of named optimizers."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.optim import Optimizer

from hyper_parallel.core.distributed._backend import SHARDING_ENV, resolve_backend
from hyper_parallel.core.distributed._presharding import follow_sharding
from hyper_parallel.core.errors import (
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.optimizer._chained import ChainedOptimizer
from hyper_parallel.core.optimizer._main_params import MainParams
from hyper_parallel.core.optimizer._request import (
    OptimizerSpec,
    Request,
    as_groups,
    parse_request,
)
from hyper_parallel.core.optimizer._swap import SwapOptimizer, SwapOptimizerConfig
from hyper_parallel.core.options import (
    accepted_group_keys,
    accepted_keywords,
    check_group_keys,
    check_keywords,
    listed,
)
from hyper_parallel.core.plugin import (
    OptimizerEntry,
    PluginKind,
    get_registry,
)

__all__ = ["detect_dtensor_backend", "get_hyper_optimizer", "swap_optimizer"]

#: Where params with fewer than two dims go when a matrix-only optimizer (Muon) is given them.
FALLBACK_OPTIMIZER = "adamw"


@overload
def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Iterable[Any] | None = None,
    adamw_params: Iterable[Any] | None = None,
    muon_kwargs: Mapping[str, Any] | None = None,
    adamw_kwargs: Mapping[str, Any] | None = None,
    *,
    sinkhorn_params: Iterable[Any] | None = None,
    sinkhorn_kwargs: Mapping[str, Any] | None = None,
    optimizers: Mapping[str, Mapping[str, Any]] | None = None,
    partitioner: str | None = None,
    partitioner_kwargs: Mapping[str, Any] | None = None,
    sharding: str | None = None,
    fp32_main_params: bool = False,
    swap_optimizer: Literal[False] | None = None,
    **prefixed_kwargs: Any,
) -> ChainedOptimizer: ...


@overload
def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Iterable[Any] | None = None,
    adamw_params: Iterable[Any] | None = None,
    muon_kwargs: Mapping[str, Any] | None = None,
    adamw_kwargs: Mapping[str, Any] | None = None,
    *,
    sinkhorn_params: Iterable[Any] | None = None,
    sinkhorn_kwargs: Mapping[str, Any] | None = None,
    optimizers: Mapping[str, Mapping[str, Any]] | None = None,
    partitioner: str | None = None,
    partitioner_kwargs: Mapping[str, Any] | None = None,
    sharding: str | None = None,
    fp32_main_params: bool = False,
    swap_optimizer: Literal[True] | Mapping[str, Any] | SwapOptimizerConfig,
    **prefixed_kwargs: Any,
) -> SwapOptimizer: ...


def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Iterable[Any] | None = None,
    adamw_params: Iterable[Any] | None = None,
    muon_kwargs: Mapping[str, Any] | None = None,
    adamw_kwargs: Mapping[str, Any] | None = None,
    *,
    sinkhorn_params: Iterable[Any] | None = None,
    sinkhorn_kwargs: Mapping[str, Any] | None = None,
    optimizers: Mapping[str, Mapping[str, Any]] | None = None,
    partitioner: str | None = None,
    partitioner_kwargs: Mapping[str, Any] | None = None,
    sharding: str | None = None,
    fp32_main_params: bool = False,
    swap_optimizer: bool | Mapping[str, Any] | SwapOptimizerConfig | None = None,
    **prefixed_kwargs: Any,
) -> ChainedOptimizer | SwapOptimizer:
    """Build the optimizers for ``model`` and chain them.

    Four ways to say which params go where:

    * the guide's form: ``muon_params=[...]``, ``adamw_params=[...]`` with
      ``muon_kwargs`` / ``adamw_kwargs`` (and HyperParallel's
      ``sinkhorn_params`` / ``sinkhorn_kwargs``); chained adamw, muon, sinkhorn.
      A key of ``<name>_kwargs`` may carry that optimizer's prefix, as
      HyperParallel writes it: ``muon_kwargs={"muon_lr": 0.02}`` is
      ``{"lr": 0.02}``;
    * any registered optimizers by name:
      ``optimizers={"muon": {"params": [...], "lr": 0.02}, "lion": {...}}``;
    * a partitioner when no params are given: ``partitioner="by_shape"``
      (the default when no params are given at all), with
      ``partitioner_kwargs``; ``optimizers`` then only carries kwargs;
    * family configuration (HyperParallel's): a keyword named after a
      registered optimizer, ``muon={"lr": 0.02}, adamw={"weight_decay": 0.1}``.
      A family's dict holds its options plus ``param_patterns`` (regular
      expressions searched in param names, or globs ``*...``, ``?...``,
      ``glob:...`` matched against whole names, that override the default
      routing) and
      ``param_groups`` (``[{"param_patterns": [...], <group options>}]``, some
      of the family's own params with options of their own); ``{}`` is the
      defaults, and a family left out or ``None`` is off. Norms go to
      ``adamw``, embeddings and the output head to ``sinkhorn`` (to ``adamw``
      when it is off), other matrices to ``muon``; any other family gets only
      what its patterns match. With ``muon={"head_wise": True}`` and no
      ``head_dim``, the head size is ``model.config.head_dim`` (else
      ``hidden_size // num_attention_heads``). The registered ``by_family``
      partitioner does the routing; this mode excludes every argument of the
      three above.

    Keyword arguments prefixed with an optimizer's name (``muon_lr=0.02``,
    ``adamw_weight_decay=0.1``) are that optimizer's options.

    ``sharding`` names the sharding backend of a sharded model (``"fsdp"``,
    ``"hsdp"``, ...); it must match the params' layout and is passed to every
    optimizer that takes a ``sharding`` option (Muon). Left out, it is
    ``$HYPER_PARALLEL_SHARDING`` or detected from the params' placements.

    ``swap_optimizer=True`` (or a dict of :class:`SwapOptimizerConfig`'s
    options, or a config) wraps the chain in a
    :class:`~hyper_parallel.core.optimizer.SwapOptimizer`, which keeps the
    optimizer state in host memory or on disk between steps.

    ``fp32_main_params=True`` gives each low-precision (bf16, fp16) param an
    fp32 main copy, which the optimizers step instead (their state is fp32
    too); after each step the param is its main copy rounded. The copies are
    sharded like their params, and checkpoints keep them.

    Rules: frozen params are skipped; a tied param counts once; an empty
    list means that optimizer is not created. A param with fewer than two
    dims given to a matrix-only optimizer (Muon) is optimized by AdamW instead,
    with one warning naming it. Every param's ``model_name`` is set to its
    name in ``model`` (as HyperParallel does), so optimizers can select by
    name (Muon's ``head_wise``).

    Returns:
        A :class:`ChainedOptimizer` whose ``optimizers`` are keyed by name.

    Raises:
        TypeError: ``model`` is not a module, or an unknown keyword argument
            (with a hint).
        HyperParallelConfigError: family keywords mixed with another form,
            or a malformed ``param_groups`` (a ``TypeError`` and a
            ``ValueError``).
        ValueError: a param in two groups, a trainable param in no group (the
            first names are listed), a param not in ``model``, or no params at all;
            in family configuration, a pattern that matches no param or a param
            two families' patterns match.
        UnknownPluginError: an optimizer or partitioner name nobody registered.
    """
    if not isinstance(model, nn.Module):
        raise HyperParallelTypeError(
            f"get_hyper_optimizer() needs model=<nn.Module>, got {type(model).__name__}."
        )
    request = parse_request(
        {
            "muon_params": muon_params, "adamw_params": adamw_params, "muon_kwargs": muon_kwargs,
            "adamw_kwargs": adamw_kwargs, "sinkhorn_params": sinkhorn_params,
            "sinkhorn_kwargs": sinkhorn_kwargs, "optimizers": optimizers,
            "partitioner": partitioner, "partitioner_kwargs": partitioner_kwargs,
        },
        prefixed_kwargs,
    )  # fmt: skip
    builder = _ChainBuilder(model, request)
    builder.settle()
    builder.pass_sharding(sharding)
    mains = builder.main_copies() if fp32_main_params else None
    chain = ChainedOptimizer(
        builder.build(), param_names=model.named_parameters(), main_params=mains
    )
    if swap_optimizer is None or swap_optimizer is False:
        return chain
    return SwapOptimizer(chain, None if swap_optimizer is True else swap_optimizer)


class _ChainBuilder:
    """The optimizers get_hyper_optimizer() builds, with each one's groups and options.

    Filled from the arguments (or a partitioner), then settled: sharded
    params followed, frozen and repeated params dropped, vectors moved off
    matrix-only optimizers, and every option and param checked, before any
    optimizer is built.
    """

    def __init__(self, model: nn.Module, request: Request) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        # Copies of the request's specs (their options are filled in here).
        self.specs: dict[str, OptimizerSpec] = {
            spec.name: replace(spec, kwargs=dict(spec.kwargs)) for spec in request.optimizers
        }
        if request.partitioner is not None:
            self.partition(request.partitioner, request.partitioner_kwargs)

    # -- filling ------------------------------------------------------------------

    def add(self, name: str) -> OptimizerSpec:
        """An optimizer a partitioner fills that the call did not name."""
        entry = get_registry().get(PluginKind.OPTIMIZER, name)
        self.specs[entry.name] = OptimizerSpec(name=entry.name, entry=entry)
        return self.specs[entry.name]

    def partition(self, name: str, options: Mapping[str, Any]) -> None:
        entry = get_registry().get(PluginKind.PARTITIONER, name)
        where = f"partitioner {entry.name!r}"
        check_keywords(options, accepted_keywords(entry.obj, skip=1), where=where)
        assignment = entry.obj(self.model, **options)
        if not isinstance(assignment, Mapping):
            raise HyperParallelTypeError(
                f"Partitioner {entry.name!r} returned {type(assignment).__name__}, not a dict."
            )
        chained: list[str] = []
        for opt_name, params in assignment.items():
            output = f"{where} output for {opt_name!r}"
            key = get_registry().get(PluginKind.OPTIMIZER, opt_name).name
            spec = self.specs.get(key) or self.add(key)
            spec.groups = as_groups(params, output)
            spec.params_given = True
            chained.append(key)
        # Chained in the partitioner's order (by_family: HyperParallel's).
        self.specs = {
            k: self.specs[k] for k in [*chained, *(k for k in self.specs if k not in chained)]
        }
        unassigned = [n for n, s in self.specs.items() if not s.params_given]
        if unassigned:
            raise HyperParallelValueError(
                f"Partitioner {entry.name!r} assigns params to {', '.join(map(repr, assignment))}, "
                f"but options were given for {', '.join(map(repr, unassigned))}; "
                "configure only the optimizers it fills (by_shape, by_name, by_module: see their "
                "matrix_optimizer/fallback_optimizer options; family configuration: a family set "
                "to None gets no params)."
            )

    # -- settling -----------------------------------------------------------------

    def settle(self) -> None:
        """Make the groups final and check them; nothing is built yet."""
        self.names = _first_names(self.model)
        self._infer_head_dim()
        self._follow_sharding()
        self._drop_frozen_and_repeated()
        self._move_vectors_off_matrix_optimizers()
        self._check_options()
        self._check_coverage()

    def _infer_head_dim(self) -> None:
        """``head_wise=True`` without a ``head_dim``: the model config's, as HyperParallel infers it."""
        for spec in self.specs.values():
            if spec.kwargs.get("head_wise") and spec.kwargs.get("head_dim") is None:
                spec.kwargs["head_dim"] = config_head_dim(self.model)

    def _label(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"<param of shape {tuple(p.shape)}>")

    def _follow_sharding(self) -> None:
        """Swap params listed before ``fully_shard`` for the sharded params that replaced them."""
        now = follow_sharding(self.model)
        if now is None:
            return
        for spec in self.specs.values():
            for group in spec.groups:
                group["params"] = [now(p) for p in group["params"]]

    def _drop_frozen_and_repeated(self) -> None:
        owner: dict[int, str] = {}
        for spec in self.specs.values():
            for group in spec.groups:
                kept: list[torch.Tensor] = []
                for p in group["params"]:
                    if id(p) not in self.names:
                        raise HyperParallelValueError(
                            f"A param of shape {tuple(p.shape)} given to optimizer {spec.name!r} is "
                            "not a parameter of model; pass params from the model you train."
                        )
                    previous = owner.get(id(p))
                    if not p.requires_grad or previous == spec.name:
                        continue  # frozen, or a tied param listed twice: counted once
                    if previous is not None:
                        raise HyperParallelValueError(
                            f"Param {self._label(p)!r} is in the groups of both {previous!r} and "
                            f"{spec.name!r}; give each param to exactly one optimizer."
                        )
                    owner[id(p)] = spec.name
                    kept.append(p)
                group["params"] = kept

    def _move_vectors_off_matrix_optimizers(self) -> None:
        moved: list[tuple[str, torch.Tensor]] = []
        for spec in list(self.specs.values()):
            if isinstance(spec.entry, OptimizerEntry) and spec.entry.matrix_only:
                for group in spec.groups:
                    moved.extend((spec.name, p) for p in group["params"] if p.ndim < 2)
                    group["params"] = [p for p in group["params"] if p.ndim >= 2]
        if not moved:
            return
        fallback = self.specs.get(FALLBACK_OPTIMIZER) or self.add(FALLBACK_OPTIMIZER)
        fallback.groups.append({"params": [p for _, p in moved]})
        warnings.warn(
            f"{len(moved)} param(s) with fewer than 2 dims were listed for "
            f"{', '.join(sorted({name for name, _ in moved}))}, which only updates matrices; "
            f"optimizing them with {FALLBACK_OPTIMIZER!r} instead: "
            f"{listed([self._label(p) for _, p in moved])}.",
            UserWarning,
            stacklevel=4,
        )

    def _check_options(self) -> None:
        """Every option and group key of every optimizer is one it accepts."""
        for spec in self.specs.values():
            where = f"optimizer {spec.name!r}"
            check_keywords(spec.kwargs, accepted_keywords(spec.entry.obj, skip=1), where=where)
            group_keys = accepted_group_keys(spec.entry.obj)
            if group_keys is not None:
                for group in spec.groups:
                    check_group_keys(group, group_keys, where=where)
            if "params" in spec.kwargs:
                raise HyperParallelTypeError(
                    f"Give the params of optimizer {spec.name!r} via its params list, not as a "
                    "keyword."
                )

    def _check_coverage(self) -> None:
        assigned = {id(p) for s in self.specs.values() for g in s.groups for p in g["params"]}
        missing = [
            name
            for name, p in self.model.named_parameters()
            if p.requires_grad and id(p) not in assigned
        ]
        if missing:
            raise HyperParallelValueError(
                f"{len(missing)} trainable param(s) are in no optimizer group and would never "
                f"train: {listed(missing)}. Add them to muon_params/adamw_params, freeze them "
                "(requires_grad=False), or use a partitioner (partitioner='by_shape')."
            )

    # -- building -----------------------------------------------------------------

    def pass_sharding(self, sharding: str | None) -> None:
        """Give ``sharding=`` to each optimizer that takes one.

        Each resolves its backend (the named one, else
        ``$HYPER_PARALLEL_SHARDING``, else detection) once, as its groups are
        added; a mismatch names the params (their ``model_name``).
        """
        if sharding is None:
            return
        for spec in self.specs.values():
            if "sharding" in (accepted_keywords(spec.entry.obj, skip=1) or ()):
                spec.kwargs.setdefault("sharding", sharding)

    def main_copies(self) -> MainParams:
        """Give each low-precision param an fp32 main copy, which its optimizer gets instead."""
        mains = MainParams()
        for spec in self.specs.values():
            for group in spec.groups:
                group["params"] = [mains.add(p) for p in group["params"]]
        for param, main in mains:
            self.names[id(main)] = self._label(param)
        return mains

    def build(self) -> dict[str, Optimizer]:
        """Name every param (``model_name``), then build each optimizer that has params."""
        for spec in self.specs.values():
            for group in spec.groups:
                for p in group["params"]:
                    p.model_name = self._label(p)  # type: ignore[attr-defined]
        built: dict[str, Optimizer] = {}
        for spec in self.specs.values():
            groups = [g for g in spec.groups if g["params"]]
            if not groups:
                continue
            optimizer = spec.entry.obj(groups, **spec.kwargs)
            if not isinstance(optimizer, Optimizer):
                raise HyperParallelTypeError(
                    f"Optimizer {spec.name!r} from {spec.entry.source} returned "
                    f"{type(optimizer).__name__}, not a torch.optim.Optimizer."
                )
            built[spec.name] = optimizer
        if not built:
            raise HyperParallelValueError(
                "get_hyper_optimizer() got no params to optimize: every group is empty "
                "(or every param is frozen)."
            )
        return built


def config_head_dim(model: nn.Module) -> int | None:
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


def _first_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its first name in ``model`` (tied params share one entry)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def swap_optimizer(
    optimizer: Optimizer, config: SwapOptimizerConfig | Mapping[str, Any] | None = None
) -> SwapOptimizer:
    """Wrap ``optimizer`` so that its state lives in host memory or on disk between steps.

    HyperParallel's function form of :class:`SwapOptimizer`, with its
    arguments: ``swap_optimizer(optimizer, config)`` is
    ``SwapOptimizer(optimizer, config)``.

    Args:
        optimizer: Any optimizer of this library (a ``ChainedOptimizer``
            included) or a torch optimizer whose state is tensors.
        config: A :class:`SwapOptimizerConfig`, a dict of its fields, or
            ``None`` for its defaults.

    Returns:
        The :class:`SwapOptimizer` wrapping ``optimizer``.

    Raises:
        TypeError, ValueError: as :class:`SwapOptimizer` documents.
    """
    return SwapOptimizer(optimizer, config)


def detect_dtensor_backend(adamw_params: Iterable[Any], muon_params: Iterable[Any]) -> str:
    """The name of the sharding backend that the params are laid out for.

    HyperParallel's helper, with its arguments: two lists of params or
    param-group dicts, either of which may be empty. As there, the first
    param of ``muon_params`` decides, else the first of ``adamw_params``.
    The answer is a registered sharding backend's name: ``"local"`` for a
    plain tensor, ``"fsdp"`` for a DTensor of ``fully_shard``, a plugin's
    backend for its layout. (HyperParallel answers ``"torch"`` or
    ``"hyper"``, which of its two DTensor classes the params are; here
    every DTensor is torch's.) Nothing is set by it: each optimizer resolves
    the backend of its own groups.

    With ``$HYPER_PARALLEL_SHARDING`` set, that backend is returned once it
    is checked against the param; with no params at all, it, else
    ``"local"``.

    Raises:
        ValueError: the backend ``$HYPER_PARALLEL_SHARDING`` names does not
            match the param, or no backend accepts it.
        UnknownPluginError: ``$HYPER_PARALLEL_SHARDING`` names no backend.
    """
    named = os.environ.get(SHARDING_ENV) or None
    for where, params in (("muon_params", muon_params), ("adamw_params", adamw_params)):
        for group in as_groups(params, where):
            if group["params"]:
                return resolve_backend(named, group["params"][:1], origin=SHARDING_ENV).name
    if named is None:
        return "local"
    return get_registry().get(PluginKind.SHARDING_BACKEND, named).name
