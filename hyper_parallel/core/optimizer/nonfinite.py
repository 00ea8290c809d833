"""Skipping an optimizer step when a gradient is NaN or Inf."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from hyper_parallel.core.distributed._dtensor import local_tensor

__all__ = ["grads_are_finite", "step_if_finite"]


def grads_are_finite(optimizer: Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s params is finite, on every rank.

    Sharded gradients (DTensors) are checked on their local shards and the
    verdict is combined over the default process group, so all ranks agree
    (and must all call this).
    """
    local_ok = True
    for group in optimizer.param_groups:
        grads = [p.grad for p in group["params"] if p.grad is not None]
        locals_ = [local_tensor(g) for g in grads]
        if locals_ and not all(bool(torch.isfinite(g).all()) for g in locals_ if g.numel()):
            local_ok = False
            break
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = next(
            (
                g.device
                for grp in optimizer.param_groups
                for p in grp["params"]
                if (g := p.grad) is not None
            ),
            torch.device("cpu"),
        )
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
