"""The Lion optimizer (EvoLved Sign Momentum; Chen et al., 2023, arXiv:2302.06675).

For each param ``theta`` with gradient ``g``, momentum ``m`` (zeros at first),
learning rate ``lr``, betas ``(b1, b2)`` and weight decay ``wd``, one step is::

    c     = b1 * m + (1 - b1) * g        # interpolate momentum and gradient
    theta = theta * (1 - lr * wd)        # decoupled weight decay, as in AdamW
    theta = theta - lr * sign(c)         # every coordinate moves by exactly lr (or 0)
    m     = b2 * m + (1 - b2) * g        # the momentum itself uses b2

Because the update is a sign, its size does not depend on the gradient's
scale: the paper recommends an lr 3-10x smaller than AdamW's and a weight
decay 3-10x larger, so that ``lr * wd`` stays about the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

__all__ = ["Lion"]


class Lion(Optimizer):
    """Lion: sign of an interpolated momentum, with decoupled weight decay.

    Args:
        params: Params or param-group dicts.
        lr: Learning rate: every coordinate moves by ``lr`` per step (before
            weight decay). Positive.
        betas: ``(b1, b2)``: ``b1`` interpolates momentum and gradient for the
            update, ``b2`` updates the momentum. Each in ``[0, 1)``.
        weight_decay: Decoupled weight decay: each step multiplies the param by
            ``1 - lr * weight_decay``. At least 0.
        maximize: Maximize the objective instead of minimizing it.
        foreach: Use torch's ``_foreach`` kernels (one launch per group and
            device/dtype instead of one per param). ``None`` turns them on for
            params off the CPU, where they pay off.

    The per-param state is ``exp_avg`` (the momentum ``m``); ``state_dict()``
    and ``load_state_dict()`` are torch's own.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"Lion: lr must be positive, got {lr!r}.")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two numbers in [0, 1), got {betas!r}.")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay!r}.")
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
            "maximize": maximize,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # state pickled by an older version
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Bucket by device and dtype: a foreach kernel needs them uniform.
            buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "Lion does not support sparse gradients; use a dense embedding "
                        "(sparse=False) or another optimizer for that param."
                    )
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bucket = buckets.setdefault((p.device, p.dtype), _Bucket())
                bucket.params.append(p)
                bucket.grads.append(p.grad)
                bucket.exp_avgs.append(state["exp_avg"])
            beta1, beta2 = group["betas"]
            for (device, _), bucket in buckets.items():
                foreach = group["foreach"]
                if foreach is None:
                    foreach = device.type != "cpu"
                update = _foreach_lion if foreach else _single_tensor_lion
                update(
                    bucket,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    maximize=group["maximize"],
                )
        return loss


class _Bucket:
    """Params of one group on one device and dtype, with their grads and momenta."""

    __slots__ = ("exp_avgs", "grads", "params")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []


def _single_tensor_lion(
    bucket: _Bucket, *, lr: float, beta1: float, beta2: float, weight_decay: float, maximize: bool
) -> None:
    for param, grad, exp_avg in zip(bucket.params, bucket.grads, bucket.exp_avgs, strict=True):
        if maximize:
            grad = -grad
        if weight_decay != 0.0:
            param.mul_(1.0 - lr * weight_decay)
        # lerp(m, g, 1 - b) = b * m + (1 - b) * g
        direction = exp_avg.lerp(grad, 1.0 - beta1).sign_()
        param.add_(direction, alpha=-lr)
        exp_avg.lerp_(grad, 1.0 - beta2)


def _foreach_lion(
    bucket: _Bucket, *, lr: float, beta1: float, beta2: float, weight_decay: float, maximize: bool
) -> None:
    grads = torch._foreach_neg(bucket.grads) if maximize else bucket.grads
    if weight_decay != 0.0:
        torch._foreach_mul_(bucket.params, 1.0 - lr * weight_decay)
    directions = torch._foreach_lerp(bucket.exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(directions)
    torch._foreach_add_(bucket.params, directions, alpha=-lr)
    torch._foreach_lerp_(bucket.exp_avgs, grads, 1.0 - beta2)
