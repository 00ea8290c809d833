"""Skipping an optimizer step when a gradient is NaN or Inf."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from hyper_parallel.core._grads import grad_tensors
from hyper_parallel.core.distributed._dtensor import local_tensor

__all__ = ["grads_are_finite", "step_if_finite"]


def grads_are_finite(optimizer: Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s params is finite, on every rank.

    With fp32 main params, the gradients checked are the model params' (see
    :func:`~hyper_parallel.core.optimizer._main_params.grad_tensors`).

    Sharded gradients (DTensors) are checked on their local shards and the
    verdict is combined over the default process group, so all ranks agree
    (and must all call this).
    """
    grads = [g for p in grad_tensors(optimizer) if (g := p.grad) is not None]
    local_ok = all(bool(torch.isfinite(g).all()) for g in map(local_tensor, grads) if g.numel())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = grads[0].device if grads else torch.device("cpu")
        flag = torch.tensor([0.0 if local_ok else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() == 0.0)
    return local_ok


def step_if_finite(optimizer: Optimizer) -> bool:
    """Step ``optimizer`` unless a gradient is NaN/Inf; returns whether it stepped.

    A skipped step leaves params and optimizer state untouched (the
    gradients are kept for the caller to inspect and then zero).

    Examples:
        >>> loss.backward()
        >>> if not step_if_finite(optimizer):
        ...     print("skipped a step: non-finite gradient")
        >>> optimizer.zero_grad()
    """
    if not grads_are_finite(optimizer):
        return False
    optimizer.step()
    return True
