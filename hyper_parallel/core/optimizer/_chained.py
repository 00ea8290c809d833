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
from hyper_parallel.core.optimizer._chained_views import (
    ChainedDefaults,
    ChainedState,
    ModelGroup,
    assigned_groups,
)
from hyper_parallel.core.optimizer._main_params import (
    MainParams,
    warn_main_params_dropped,
    warn_main_params_rebuilt,
)
from hyper_parallel.core.optimizer._matrix import check_steps

__all__ = ["MAIN_PARAM_KEY", "OWNER_KEY", "ChainedOptimizer", "NotOneOptimizerError"]

#: The key of a param's fp32 main copy in its state in :meth:`ChainedOptimizer.state_dict`.
MAIN_PARAM_KEY = "main_param"
#: The key of a saved param group that names the sub-optimizer it belongs to.
OWNER_KEY = "optimizer"


class NotOneOptimizerError(HyperParallelAttributeError, HyperParallelValueError):
    """``ChainedOptimizer.optimizer`` of a chain of several sub-optimizers.

    An ``AttributeError``, so that ``hasattr(optimizer, "optimizer")`` hears
    "no", and a ``ValueError``, which HyperParallel raises and its users catch.
    """


class ChainedOptimizer(Optimizer):
    """Named optimizers (e.g. Muon for matrices, AdamW for the rest) stepped as one.

    To torch's LR schedulers, ``torch.amp.GradScaler`` and user code it is an
    ordinary :class:`torch.optim.Optimizer`:

    * ``param_groups`` is the concatenation of the sub-optimizers' *own* group
      dicts, so setting ``group["lr"]`` (as every scheduler does) reaches the
      sub-optimizer that owns the group;
    * ``step(closure)`` evaluates the closure once, then steps every
      sub-optimizer in order; step pre/post hooks work as usual;
    * ``state_dict()`` has torch's optimizer format (each group marked with
      its sub-optimizer's name), so torch's distributed-checkpoint helpers
      save and load it.

    As in HyperParallel, iterating over it gives the sub-optimizers,
    ``defaults`` is the first sub-optimizer's, and ``param_groups`` can be
    set (each sub-optimizer gets its part). Sub-optimizers by name:
    :attr:`optimizers` (or ``optimizers_dict``, ``optimizer["muon"]``).

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
        init_optimizer_hooks(self)

    # -- the Optimizer surface ----------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every sub-optimizer's group dicts (the same objects, not copies).

        With main copies, each group is seen through a view whose ``"params"``
        are the model params the copies stand for (where backward writes the
        gradients, which ``GradScaler`` unscales and torch's
        distributed-checkpoint helpers name); every other key is the
        sub-optimizer's group's own, read and written through.
        """
        groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        if self.main_params is None or not len(self.main_params):
            return groups
        return [ModelGroup(g, self.main_params) for g in groups]  # type: ignore[misc]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Give each sub-optimizer its part of ``groups``, in order (HyperParallel's setter).

        ``groups`` has one group for each of :attr:`param_groups` (those read
        from it, changed or regrouped); each sub-optimizer must keep exactly
        its own params, since its state is keyed by them.
        """
        for name, part in assigned_groups(groups, self.optimizers, self.main_params).items():
            self.optimizers[name].param_groups = part

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The first sub-optimizer's ``defaults`` (HyperParallel's), read and written through.

        ``"momentum" in defaults`` and ``"betas" in defaults`` (what torch's
        cyclic schedulers ask) answer for the whole chain, and are an error
        that says what to do when the sub-optimizers disagree.
        """
        return ChainedDefaults(self.optimizers)  # type: ignore[return-value]

    @property
    def state(self) -> Mapping[torch.Tensor, Any]:  # type: ignore[override]
        """Read-only view of every sub-optimizer's per-param state."""
        return ChainedState(self.optimizers)

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
            NotOneOptimizerError: the chain has more than one; pick one from
                :attr:`optimizers`. An ``AttributeError``, so that wrappers that
                ask ``hasattr(optimizer, "optimizer")`` (accelerate's, under
                Hugging Face ``Trainer``) hear "no" rather than crash, and a
                ``ValueError``, as HyperParallel raises.
        """
        if len(self.optimizers) != 1:
            raise NotOneOptimizerError(
                f"ChainedOptimizer has more than one optimizer ({', '.join(self.optimizers)}); "
                "pick one with optimizer.optimizers[name]."
            )
        return next(iter(self.optimizers.values()))

    @property
    def chained_optimizers(self) -> list[Optimizer]:
        """HyperParallel's list of the sub-optimizers, in order (a new list each time)."""
        return list(self.optimizers.values())

    @property
    def optimizers_keys(self) -> list[str]:
        """HyperParallel's list of the sub-optimizers' names, in order (a new list each time)."""
        return list(self.optimizers)

    def __repr__(self) -> str:
        inner = "\n".join(
            "  " + f"{name}: {opt!r}".replace("\n", "\n  ") for name, opt in self.optimizers.items()
        )
        return f"{type(self).__name__}(\n{inner}\n)"

    def __getitem__(self, name: str) -> Optimizer:
        """The sub-optimizer named ``name`` (as ``optimizers[name]``)."""
        return self.optimizers[name]

    def __len__(self) -> int:
        return len(self.optimizers)

    def __iter__(self) -> Iterator[Optimizer]:  # type: ignore[override]
        """The sub-optimizers, in order (HyperParallel's); their names: :attr:`optimizers`."""
        return iter(self.optimizers.values())

    def __contains__(self, item: object) -> bool:
        """Whether ``item`` is one of the sub-optimizers, or the name of one."""
        if isinstance(item, str):
            return item in self.optimizers
        return any(item is opt for opt in self.optimizers.values())

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
        check_steps(self.optimizers.values())  # what would fail, before any of them changes
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
        """The chain's state in torch's optimizer format, as one optimizer would give it.

        ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``,
        the params numbered in :attr:`param_groups` order, each group marked
        with the name of the sub-optimizer it belongs to (``"optimizer"``), and
        each main copy (if any) in its param's state as ``"main_param"``. This is
        the format torch's distributed-checkpoint helpers
        (``get_optimizer_state_dict`` and the rest) expect of an optimizer.
        """
        for pre_hook in optimizer_hook_dict(self, "state_dict_pre").values():
            pre_hook(self)
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        count = 0
        for name, opt in self.optimizers.items():
            saved = opt.state_dict()
            for group, live in zip(saved["param_groups"], opt.param_groups, strict=True):
                ids = list(range(count, count + len(live["params"])))
                count += len(ids)
                for old, new, param in zip(group["params"], ids, live["params"], strict=True):
                    entry = dict(saved["state"].get(old, {}))
                    if self._is_main(param):
                        entry[MAIN_PARAM_KEY] = param.detach()
                    if entry:
                        state[new] = entry
                groups.append({**group, "params": ids, OWNER_KEY: name})
        sd: dict[str, Any] = {"state": state, "param_groups": groups}
        for post_hook in optimizer_hook_dict(self, "state_dict_post").values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict in the format of :meth:`state_dict`.

        Its params may be keyed by index or by name (torch's
        distributed-checkpoint helpers key them by name); they are matched to
        this chain's params by position, group by group. Everything is
        validated before any sub-optimizer is changed, so a mismatched state
        dict leaves this optimizer as it was. Loaded main copies are rounded
        into their params (as every step does). A state dict saved without fp32
        main params loads into a chain that keeps them: the copies are remade
        from the (already loaded) model params, with a warning. One saved with
        them loads into a chain without: they are dropped, with a warning.
        """
        sd: Mapping[str, Any] = state_dict
        for pre_hook in optimizer_hook_dict(self, "load_state_dict_pre").values():
            result = pre_hook(self, sd)  # type: ignore[arg-type]
            if result is not None:
                sd = result
        parts, saved_mains = self._split(sd)
        for name, opt in self.optimizers.items():
            _check_compatible(name, opt, parts[name])
        mains = [param for param in self._params() if self._is_main(param)]
        if mains and saved_mains:
            _check_mains_compatible(mains, saved_mains)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(parts[name])
        if mains and saved_mains:
            with torch.no_grad():
                for main in mains:
                    main.copy_(saved_mains[id(main)])
            cast(MainParams, self.main_params).mains_to_params()
        elif mains:
            cast(MainParams, self.main_params).params_to_mains()
            warn_main_params_rebuilt("The state dict")
        elif saved_mains:
            warn_main_params_dropped("The state dict")
        for post_hook in optimizer_hook_dict(self, "load_state_dict_post").values():
            post_hook(self)

    def _is_main(self, param: torch.Tensor) -> bool:
        return self.main_params is not None and self.main_params.param_of(param) is not param

    def _split(
        self, sd: Mapping[str, Any]
    ) -> tuple[dict[str, dict[str, Any]], dict[int, torch.Tensor]]:
        """``sd`` as each sub-optimizer's own state dict, and the saved main copies by main's id."""
        groups = _saved_groups(sd, self.optimizers)
        parts: dict[str, dict[str, Any]] = {}
        mains: dict[int, torch.Tensor] = {}
        for name, opt in self.optimizers.items():
            own, groups = groups[: len(opt.param_groups)], groups[len(opt.param_groups) :]
            state: dict[Any, Any] = {}
            for index, group in enumerate(own):
                owner = group.get(OWNER_KEY, name)
                if owner != name:
                    raise HyperParallelValueError(
                        f"Param group {index} of sub-optimizer {name!r} belongs to {owner!r} in the "
                        f"state dict; load it into a chain with the same sub-optimizers, in the "
                        f"same order ({', '.join(self.optimizers)})."
                    )
                live = opt.param_groups[index]["params"]
                for key, param in zip(group["params"], live, strict=False):
                    entry = dict(sd["state"].get(key, {}))
                    main = entry.pop(MAIN_PARAM_KEY, None)
                    if main is not None:
                        mains[id(param)] = main
                    if entry:
                        state[key] = entry
            parts[name] = {
                "state": state,
                "param_groups": [
                    {k: v for k, v in group.items() if k != OWNER_KEY} for group in own
                ],
            }
        return parts, mains


def _saved_groups(sd: Mapping[str, Any], optimizers: Mapping[str, Optimizer]) -> list[Any]:
    """The saved param groups, as many as the chain's sub-optimizers have together."""
    if not isinstance(sd, Mapping) or "state" not in sd or "param_groups" not in sd:
        keys = ", ".join(map(repr, sd)) if isinstance(sd, Mapping) else type(sd).__name__
        raise HyperParallelValueError(
            "A ChainedOptimizer state dict has torch's optimizer format, 'state' and "
            f"'param_groups' (what ChainedOptimizer.state_dict() returns); got {keys}."
        )
    groups = list(sd["param_groups"])
    have = {name: len(opt.param_groups) for name, opt in optimizers.items()}
    if len(groups) != sum(have.values()):
        counts = ", ".join(f"{name}: {count}" for name, count in have.items())
        raise HyperParallelValueError(
            f"This ChainedOptimizer has {sum(have.values())} param groups ({counts}); the state "
            f"dict has {len(groups)}."
        )
    return groups


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


def _check_mains_compatible(mains: Sequence[torch.Tensor], saved: Mapping[int, Any]) -> None:
    """Every main copy has a saved value of its shape."""
    for index, main in enumerate(mains):
        value = saved.get(id(main))
        if not isinstance(value, torch.Tensor) or value.shape != main.shape:
            got = "none" if value is None else getattr(value, "shape", type(value).__name__)
            raise HyperParallelValueError(
                f"Main copy {index} has shape {tuple(main.shape)}; the state dict holds "
                f"{tuple(got) if isinstance(got, torch.Size) else got}."
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
