"""Where an optimizer's gradients are: shared by clipping (distributed) and the optimizers.

Below both layers, so that ``core.distributed`` never imports ``core.optimizer``.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["MAIN_GRAD_ATTR", "grad_of", "grad_tensors"]

#: The attribute of a param that holds its fp32 gradient, where training keeps one
#: (``fully_shard`` with ``apply_grad_on_fp32_main_grad``, Megatron-style loops).
MAIN_GRAD_ATTR = "main_grad"


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s gradient: its fp32 ``main_grad`` where training keeps one, else ``.grad``."""
    main: torch.Tensor | None = getattr(param, MAIN_GRAD_ATTR, None)
    return main if main is not None else param.grad


def grad_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """The tensors that hold ``optimizer``'s gradients between ``backward`` and ``step``.

    Its params; for a :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`
    with main copies, the model params those stand for
    (:meth:`~hyper_parallel.core.optimizer.ChainedOptimizer.grad_params`).
    """
    own = getattr(optimizer, "grad_params", None)
    if callable(own):
        return list(own())
    return [p for group in optimizer.param_groups for p in group["params"]]
