"""Registers ``signsgd`` and ``halving`` with hyper_parallel."""

import torch

from hyper_parallel import hookimpl


class SignSGD(torch.optim.Optimizer):
    """Steps each param by ``-lr * sign(grad)``."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss


def halving(step, *, total_steps, warmup_steps, every=10):
    """Halve the lr every ``every`` steps after warmup."""
    if step < warmup_steps:
        return step / warmup_steps
    return 0.5 ** ((step - warmup_steps) // every)


@hookimpl
def hyper_parallel_register_optimizers(register):
    register("signsgd", SignSGD, description="sign of the gradient")


@hookimpl
def hyper_parallel_register_lr_schedulers(register):
    register("halving", halving, aliases=("step_halving",))
