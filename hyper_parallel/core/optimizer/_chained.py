"""``ChainedOptimizer``: several named optimizers that step as one."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch.optim import Optimizer

from hyper_parallel.core.compat import OPTIMIZER_HOOKS, init_optimizer_hooks, optimizer_hook_dict
from hyper_parallel.core.errors import (
    HyperParallelAttributeError,
    HyperParallelKeyError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.optimizer._main_params import (
    MainParams,
    warn_main_params_dropped,
    warn_main_params_rebuilt,
)

__all__ = ["MAIN_PARAMS_KEY", "ChainedOptimizer"]

#: The key of the main copies in :meth:`ChainedOptimizer.state_dict` (when it has them).
MAIN_PARAMS_KEY = "main_params"

# torch.optim.Optimizer's hook registries, by attribute name.


class _ChainedState(Mapping[torch.Tensor, Any]):
    """Read-only view of the sub-optimizers' ``state``, keyed by param."""

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: torch.Tensor) -> Any:
        for opt in self._optimizers.values():
            if param in opt.state:
                return opt.state[param]
        raise HyperParallelKeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers.values():
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers.values())


class _ChainedDefaults(dict[str, Any]):
    """A chain's (empty) ``defaults``, which answers torch's cyclic schedulers.

    ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum=True`` ask whether
    ``"momentum"`` or ``"betas"`` is in ``optimizer.defaults`` and then cycle
    that key in every group. That works when every sub-optimizer has the key
    (Muon with Sinkhorn or SGD: each group's own momentum is cycled); a chain
    that mixes momentum and betas (Muon with AdamW) is an error that says
    what to do instead.
    """

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        super().__init__()
        self._optimizers = optimizers

    def __contains__(self, key: object) -> bool:
        if key not in ("momentum", "betas"):
            return super().__contains__(key)
        having = [name for name, opt in self._optimizers.items() if key in opt.defaults]
        if not having or len(having) == len(self._optimizers):
            return bool(having)
        others = [name for name in self._optimizers if name not in having]
        raise HyperParallelValueError(
            f"The sub-optimizers of this ChainedOptimizer cycle different momentum keys "
            f"({', '.join(having)}: {key!r}; {', '.join(others)}: not), and torch's "
            "OneCycleLR/CyclicLR cycle one key in every group. Pass cycle_momentum=False, or "
            "give each sub-optimizer its own scheduler, e.g. "
            f"OneCycleLR(optimizer.optimizers[{having[0]!r}], ...)."
        )


class ChainedOptimizer(Optimizer):
    """Named optimizers (e.g. Muon for matrices, AdamW for the rest) stepped as one.

    To torch's LR schedulers, ``torch.amp.GradScaler`` and user code it is an
    ordinary :class:`torch.optim.Optimizer`:

    * ``param_groups`` is the concatenation of the sub-optimizers' *own* group
      dicts, so setting ``group["lr"]`` (as every scheduler does) reaches the
      sub-optimizer that owns the group;
    * ``step(closure)`` evaluates the closure once, then steps every
      sub-optimizer in order; step pre/post hooks work as usual;
    * ``state_dict()`` is keyed by sub-optimizer name.

    Args:
        optimizers: A mapping of name to optimizer, e.g.
            ``{"muon": Muon(...), "adamw": AdamW(...)}``, or a sequence of
            optimizers (named ``"0"``, ``"1"``, ...).
        param_names: The params' names, for :attr:`param_names_by_optimizer`:
            ``model.named_parameters()`` or any ``(name, param)`` pairs (a
            tied param keeps its first name). ``get_hyper_optimizer`` passes
            them.
        main_params: fp32 main copies (:class:`MainParams`) that the
            sub-optimizers hold in place of low-precision params. Each
            ``step`` then upcasts the params' gradients into the copies, steps
            them, and rounds them back into the params; ``state_dict`` holds
            them. ``get_hyper_optimizer(..., fp32_main_params=True)`` builds
            them.

    Examples:
        >>> opt = ChainedOptimizer({"muon": muon, "adamw": adamw})
        >>> opt.optimizers["muon"].param_groups[0]["lr"]
        0.02
    """

    def __init__(
        self,
        optimizers: Mapping[str, Optimizer] | Sequence[Optimizer],
        *,
        param_names: Iterable[tuple[str, torch.Tensor]] | None = None,
        main_params: MainParams | None = None,
    ) -> None:
        named = _checked_optimizers(optimizers)
        seen = {id(p): name for name, opt in named.items() for p in _group_params(opt)}
        if main_params is not None:
            _check_main_params(main_params, named, seen)
        # Not Optimizer.__init__: it would build new param groups; ours are views.
        self.optimizers: dict[str, Optimizer] = named
        self.main_params = main_params
        self._names: dict[int, str] = {}
        for param_name, param in param_names or ():
            self._names.setdefault(id(param), param_name)
        self.defaults: dict[str, Any] = _ChainedDefaults(named)
        init_optimizer_hooks(self)

    # -- the Optimizer surface ----------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every sub-optimizer's group dicts (the same objects, not copies)."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> Mapping[torch.Tensor, Any]:  # type: ignore[override]
        """Read-only view of every sub-optimizer's per-param state."""
        return _ChainedState(self.optimizers)

    def __getstate__(self) -> dict[str, Any]:
        # Unlike torch's Optimizer, a copy (deepcopy, pickle) keeps the hooks: a hook
        # that counts steps or logs lrs would otherwise stop silently in the copy.
        hooks = {kind: optimizer_hook_dict(self, kind) for kind in OPTIMIZER_HOOKS}
        held = {id(param): param for param in map(self._model_param, self._params())}
        names = [(held[key], name) for key, name in self._names.items() if key in held]
        return {
            "optimizers": self.optimizers,
            "hooks": hooks,
            "names": names,  # (model param, name) in the model's order
            "main_params": self.main_params,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizers"], main_params=state.get("main_params"))  # type: ignore[misc]
        for kind, hooks in state.get("hooks", {}).items():
            optimizer_hook_dict(
                self, kind.removeprefix("_optimizer_").removesuffix("_hooks")
            ).update(hooks)
        for param, param_name in state.get("names", ()):
            self._names[id(param)] = param_name

    def _params(self, name: str | None = None) -> Iterator[torch.Tensor]:
        for opt_name, opt in self.optimizers.items():
            if name is None or name == opt_name:
                yield from _group_params(opt)

    def _model_param(self, param: torch.Tensor) -> torch.Tensor:
        return param if self.main_params is None else self.main_params.param_of(param)

    def _name_of(self, param: torch.Tensor) -> str | None:
        return self._names.get(id(self._model_param(param)))

    def grad_params(self, name: str | None = None) -> list[torch.Tensor]:
        """The tensors that hold the gradients between ``backward`` and ``step``.

        These are the params of every sub-optimizer (or of the one named
        ``name``), except that a main copy is replaced by the model param it
        stands for: backward writes the gradient there, and ``step`` moves it
        into the copy. Clip, check or unscale gradients through these.
        """
        if name is not None and name not in self.optimizers:
            raise HyperParallelKeyError(
                f"No sub-optimizer named {name!r}; have: {', '.join(self.optimizers)}."
            )
        return [self._model_param(p) for p in self._params(name)]

    @property
    def param_names_by_optimizer(self) -> dict[str, list[str]]:
        """``{sub-optimizer name: [names of its params]}``, in the model's order, each param once.

        Names come from ``param_names`` (which ``get_hyper_optimizer`` gives,
        in ``model.named_parameters()`` order), else from a group's own
        ``"param_names"`` (torch's named param groups), which follow the
        named ones in group order.

        Raises:
            ValueError: a param has no known name; pass
                ``param_names=model.named_parameters()``.
        """
        order = {pid: i for i, pid in enumerate(self._names)}
        out: dict[str, list[str]] = {}
        for opt_name, opt in self.optimizers.items():
            named: list[tuple[int, str]] = []
            for group in opt.param_groups:
                own = group.get("param_names") or [None] * len(group["params"])
                for param, own_name in zip(group["params"], own, strict=True):
                    param_name = self._name_of(param) or own_name
                    if param_name is None:
                        raise HyperParallelValueError(
                            f"A param of shape {tuple(param.shape)} in optimizer {opt_name!r} has "
                            "no name; build the chain with "
                            "ChainedOptimizer(..., param_names=model.named_parameters())."
                        )
                    rank = order.get(id(self._model_param(param)), len(order) + len(named))
                    named.append((rank, param_name))
            out[opt_name] = [name for _, name in sorted(named)]
        return out

    @property
    def optimizers_dict(self) -> dict[str, Optimizer]:
        """HyperParallel's name for :attr:`optimizers`: the sub-optimizers by name."""
        return self.optimizers

    @property
    def optimizer(self) -> Optimizer:
        """The one sub-optimizer of a chain that has one (HyperParallel's ``.optimizer``).

        Raises:
            AttributeError: the chain has more than one; pick one from
                :attr:`optimizers`. An ``AttributeError``, so that wrappers that
                ask ``hasattr(optimizer, "optimizer")`` (accelerate's, under
                Hugging Face ``Trainer``) hear "no" rather than crash.
        """
        if len(self.optimizers) != 1:
            raise HyperParallelAttributeError(
                f"ChainedOptimizer has more than one optimizer ({', '.join(self.optimizers)}); "
                "pick one with optimizer.optimizers[name]."
            )
        return next(iter(self.optimizers.values()))

    def __repr__(self) -> str:
        inner = "\n".join(
            "  " + f"{name}: {opt!r}".replace("\n", "\n  ") for name, opt in self.optimizers.items()
        )
        return f"{type(self).__name__}(\n{inner}\n)"

    def __getitem__(self, name: str) -> Optimizer:
        return self.optimizers[name]

    def __len__(self) -> int:
        return len(self.optimizers)

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        return iter(self.optimizers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Evaluate ``closure`` (if given) once, then step every sub-optimizer.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.main_params is not None:
            self.main_params.grads_to_mains()
        for opt in self.optimizers.values():
            opt.step()
        if self.main_params is not None:
            self.main_params.mains_to_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every sub-optimizer's params (and of the main copies' params)."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)
        if self.main_params is not None:
            self.main_params.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any], optimizer: str | None = None) -> None:
        """Add a param group to the sub-optimizer named ``optimizer``.

        ``optimizer`` may be left out only when there is a single sub-optimizer.
        With main copies, a low-precision param of the group gets one, which
        the sub-optimizer holds in its place.
        """
        if optimizer is None:
            if len(self.optimizers) != 1:
                raise HyperParallelValueError(
                    "ChainedOptimizer.add_param_group needs optimizer=<name> to know which "
                    f"sub-optimizer gets the group; one of: {', '.join(self.optimizers)}."
                )
            optimizer = next(iter(self.optimizers))
        if optimizer not in self.optimizers:
            raise HyperParallelKeyError(
                f"No sub-optimizer named {optimizer!r}; have: {', '.join(self.optimizers)}."
            )
        new = param_group["params"]
        new_params = [new] if isinstance(new, torch.Tensor) else list(new)
        for name in self.optimizers:
            owned = {id(p) for p in self.grad_params(name)}
            for p in new_params:
                if id(p) in owned:
                    raise HyperParallelValueError(
                        f"A parameter of shape {tuple(p.shape)} is already optimized by {name!r}."
                    )
        if self.main_params is not None:
            mains = self.main_params
            param_group = {**param_group, "params": [mains.add(p) for p in new_params]}
        self.optimizers[optimizer].add_param_group(param_group)

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The sub-optimizers' state dicts, keyed by name.

        With main copies, ``state_dict()["main_params"]`` is the list of them,
        in the order they were made.
        """
        for pre_hook in optimizer_hook_dict(self, "state_dict_pre").values():
            pre_hook(self)
        state: dict[str, Any] = {name: opt.state_dict() for name, opt in self.optimizers.items()}
        if self.main_params is not None:
            state[MAIN_PARAMS_KEY] = [main.detach() for _, main in self.main_params]
        for post_hook in optimizer_hook_dict(self, "state_dict_post").values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict produced by :meth:`state_dict`.

        Everything is validated before any sub-optimizer is changed, so a
        mismatched state dict leaves this optimizer as it was. A state dict
        saved without fp32 main params loads into a chain that keeps them:
        the copies are remade from the (already loaded) model params, with a
        warning. One saved with them loads into a chain without: they are
        dropped, with a warning.
        """
        sd: Mapping[str, Any] = state_dict
        for pre_hook in optimizer_hook_dict(self, "load_state_dict_pre").values():
            result = pre_hook(self, sd)  # type: ignore[arg-type]
            if result is not None:
                sd = result
        expected = set(self.optimizers)
        missing = sorted(expected - set(sd))
        unexpected = sorted(set(sd) - expected - {MAIN_PARAMS_KEY})
        if missing or unexpected:
            raise HyperParallelValueError(
                "ChainedOptimizer state dict does not match its sub-optimizers: "
                f"missing {missing or 'none'}, unexpected {unexpected or 'none'}; "
                f"this optimizer has {', '.join(sorted(expected))}."
            )
        for name, opt in self.optimizers.items():
            _check_compatible(name, opt, sd[name])
        mains = self.main_params if self.main_params is not None and len(self.main_params) else None
        saved_mains = sd.get(MAIN_PARAMS_KEY)
        if mains is not None and saved_mains is not None:
            _check_mains_compatible(mains, saved_mains)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(sd[name])
        if mains is not None and saved_mains is not None:
            with torch.no_grad():
                for (_, main), saved in zip(mains, saved_mains, strict=True):
                    main.copy_(saved)
        elif mains is not None:
            mains.params_to_mains()
            warn_main_params_rebuilt("The state dict")
        elif saved_mains:
            warn_main_params_dropped("The state dict")
        for post_hook in optimizer_hook_dict(self, "load_state_dict_post").values():
            post_hook(self)


def _group_params(opt: Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        yield from group["params"]


def _checked_optimizers(
    optimizers: Mapping[str, Optimizer] | Sequence[Optimizer],
) -> dict[str, Optimizer]:
    """The chain's optimizers by name: each flat, stepped without a closure, with its own params."""
    named = (
        dict(optimizers)
        if isinstance(optimizers, Mapping)
        else {str(i): opt for i, opt in enumerate(optimizers)}
    )
    if not named:
        raise HyperParallelValueError("ChainedOptimizer needs at least one optimizer; got none.")
    seen: dict[int, str] = {}
    for name, opt in named.items():
        if not isinstance(name, str) or not name:
            raise HyperParallelTypeError(
                f"ChainedOptimizer names must be non-empty str, got {name!r}."
            )
        if not isinstance(opt, Optimizer):
            raise HyperParallelTypeError(
                f"ChainedOptimizer entry {name!r} must be a torch.optim.Optimizer, "
                f"got {type(opt).__name__}."
            )
        if isinstance(opt, ChainedOptimizer):
            raise HyperParallelTypeError(
                f"ChainedOptimizer entry {name!r} is itself chained; flatten it."
            )
        if _needs_closure(opt):
            raise HyperParallelTypeError(
                f"ChainedOptimizer entry {name!r} ({type(opt).__name__}) re-evaluates a closure "
                "inside every step, which a chain cannot give each part; step it on its own."
            )
        for p in _group_params(opt):
            if id(p) in seen:
                raise HyperParallelValueError(
                    f"A parameter of shape {tuple(p.shape)} is in both optimizer "
                    f"{seen[id(p)]!r} and {name!r}; give each param to one optimizer."
                )
            seen[id(p)] = name
    return named


def _needs_closure(opt: Optimizer) -> bool:
    """Whether ``opt.step`` has a required ``closure`` argument (LBFGS)."""
    try:
        closure = inspect.signature(type(opt).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_main_params(
    main_params: MainParams, named: Mapping[str, Optimizer], seen: Mapping[int, str]
) -> None:
    """Each main copy is in a sub-optimizer, and no sub-optimizer also holds its param."""
    if MAIN_PARAMS_KEY in named:
        raise HyperParallelValueError(
            f"A sub-optimizer is named {MAIN_PARAMS_KEY!r}, which the chain's state dict uses for "
            "its main copies; rename that sub-optimizer."
        )
    for param, main in main_params:
        if id(param) in seen:
            raise HyperParallelValueError(
                f"A parameter of shape {tuple(param.shape)} is in optimizer {seen[id(param)]!r} "
                "although it has a main copy; give the optimizer main_params.main_of(param)."
            )
        if id(main) not in seen:
            raise HyperParallelValueError(
                f"The main copy of a parameter of shape {tuple(param.shape)} is in no "
                "sub-optimizer; build main_params from the optimizers' params only."
            )


def _check_mains_compatible(main_params: MainParams, saved: Any) -> None:
    mains = [main for _, main in main_params]
    if not isinstance(saved, Sequence) or len(saved) != len(mains):
        count = len(saved) if isinstance(saved, Sequence) else type(saved).__name__
        raise HyperParallelValueError(
            f"This ChainedOptimizer has {len(mains)} main copies; the state dict's "
            f"{MAIN_PARAMS_KEY!r} holds {count}."
        )
    for index, (main, value) in enumerate(zip(mains, saved, strict=True)):
        if not isinstance(value, torch.Tensor) or value.shape != main.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise HyperParallelValueError(
                f"Main copy {index} has shape {tuple(main.shape)}; the state dict holds {got}."
            )


def _check_compatible(name: str, opt: Optimizer, saved: Any) -> None:
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        raise HyperParallelValueError(
            f"State of sub-optimizer {name!r} is not an optimizer state dict."
        )
    groups = cast(list[dict[str, Any]], saved["param_groups"])
    if len(groups) != len(opt.param_groups):
        raise HyperParallelValueError(
            f"Sub-optimizer {name!r} has {len(opt.param_groups)} param groups but the "
            f"state dict has {len(groups)}."
        )
    for index, (mine, theirs) in enumerate(zip(opt.param_groups, groups, strict=True)):
        if len(mine["params"]) != len(theirs["params"]):
            raise HyperParallelValueError(
                f"Param group {index} of sub-optimizer {name!r} has {len(mine['params'])} params "
                f"but the state dict has {len(theirs['params'])}."
            )
