"""``torch.compile(optimizer.step)`` gives eager's numbers for our optimizers and the chain."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from hyper_parallel import AdamW, ChainedOptimizer, Muon, Sinkhorn

BUILDERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "muon": lambda ps: Muon([{"params": ps[:2], "head_dim": 4}], lr=0.02),
    "muon_gram": lambda ps: Muon(ps[:2], lr=0.02, ns_method="gram"),
    "sinkhorn": lambda ps: Sinkhorn(ps[:2], lr=0.01),
    "chained": lambda ps: ChainedOptimizer(
        {"muon": Muon(ps[:2], lr=0.02), "adamw": AdamW(ps[2:], lr=1e-3)}
    ),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_compiled_step_equals_eager(name: str) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8, 8), (8,)]
    eager = [nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    compiled = [nn.Parameter(p.detach().clone()) for p in eager]
    eager_opt, compiled_opt = BUILDERS[name](eager), BUILDERS[name](compiled)
    step = torch.compile(compiled_opt.step)
    for _ in range(3):
        for p, q in zip(eager, compiled, strict=True):
            grad = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = grad, grad.clone()
        eager_opt.step()
        step()
    for p, q in zip(eager, compiled, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


def test_compiled_step_of_many_shapes_under_a_schedule_stays_within_the_recompile_limit() -> None:
    """Ten matrix shapes and an lr that changes every step: compiled without falling back."""
    from hyper_parallel import get_hyper_lr_scheduler, get_hyper_optimizer

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    widths = [8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48]

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))

    runs = []
    for compiled in (False, True):
        net = model()
        opt = get_hyper_optimizer(net)
        schedule = get_hyper_lr_scheduler(opt, "cosine", total_steps=12, warmup_steps=2)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        gen.manual_seed(0)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for _ in range(12):
                net(torch.randn(4, widths[0], generator=gen)).square().mean().backward()
                step()
                schedule.step()
                opt.zero_grad()
        runs.append(net)
    for p, q in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
