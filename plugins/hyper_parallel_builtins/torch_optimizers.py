"""Built-in plugin: every ``torch.optim`` optimizer, by its lowercase name.

``sgd``, ``adam``, ``adagrad``, ``rmsprop``, ... are torch's classes as they
are. Two names belong to other built-ins (``adamw``, ``muon``), so torch's
own Muon is registered as ``torch_muon``.
"""

from __future__ import annotations

import inspect

import torch

from hyper_parallel import hookimpl
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["torch_optimizer_classes"]

# Names the dedicated built-in plugins provide; torch's class is renamed or skipped.
_RENAMED = {"muon": "torch_muon"}
_PROVIDED_ELSEWHERE = {"adamw"}


def torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every public optimizer class in ``torch.optim``, keyed by registry name."""
    found: dict[str, type[torch.optim.Optimizer]] = {}
    for attr in sorted(getattr(torch.optim, "__all__", dir(torch.optim))):
        cls = getattr(torch.optim, attr, None)
        if (
            inspect.isclass(cls)
            and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
        ):
            name = attr.lower()
            if name in _PROVIDED_ELSEWHERE:
                continue
            found[_RENAMED.get(name, name)] = cls
    return found


#: What torch's optimizers need that a plain loop does not give (see ``register``).
_SPARSE_ONLY = {"sparseadam"}
_MATRICES_ONLY = {"torch_muon"}


def _requirements(name: str, cls: type[torch.optim.Optimizer]) -> list[str]:
    closure = inspect.signature(cls.step).parameters.get("closure")
    requires = []
    if closure is not None and closure.default is inspect.Parameter.empty:
        requires.append("closure")  # LBFGS
    if name in _SPARSE_ONLY:
        requires.append("sparse_grads")
    if name in _MATRICES_ONLY:
        requires.append("matrices_only")
    return requires


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register each ``torch.optim`` optimizer, with what it needs of its loop."""
    for name, cls in torch_optimizer_classes().items():
        register(
            name,
            cls,
            description=f"torch.optim.{cls.__name__}",
            requires=_requirements(name, cls),
        )
