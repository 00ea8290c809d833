"""``torch.compile(optimizer.step)`` against the eager step, for Muon + AdamW under a schedule.

Run from the repository root::

    python -m benchmarks --cases compile

A transformer-shaped stack (d=256, 4 blocks of d x d, d x 4d and 4d x d
matrices, an embedding and an output head) with ``get_hyper_optimizer``'s
Muon + AdamW and a cosine schedule that changes the lr every step, on one
thread. Rows: the compiled step's steady time (the median of the last
steps) against the eager step's, and the compiled run's first steps
(tracing and compiling included) against the eager run's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import torch
from torch import nn

from benchmarks.common import Row, Settings, case_command

__all__ = ["case_compile", "step_seconds"]

_DIM, _BLOCKS, _VOCAB = 256, 4, 512
_FIRST = 10  # the steps that pay for tracing and compiling


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        layer
        for _ in range(_BLOCKS)
        for layer in (nn.Linear(_DIM, _DIM), nn.Linear(_DIM, 4 * _DIM), nn.Linear(4 * _DIM, _DIM))
    ]
    return nn.Sequential(nn.Embedding(_VOCAB, _DIM), *blocks, nn.Linear(_DIM, _VOCAB))


def step_seconds(*, compiled: bool, steps: int) -> list[float]:
    """Each optimizer step's seconds over ``steps`` steps (the backward is not timed)."""
    from hyper_parallel import get_hyper_lr_scheduler, get_hyper_optimizer

    torch._dynamo.reset()
    model = _model()
    optimizer = get_hyper_optimizer(model)
    schedule = get_hyper_lr_scheduler(optimizer, "cosine", total_steps=steps, warmup_steps=2)
    step = torch.compile(optimizer.step) if compiled else optimizer.step
    ids = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(steps):
        batch = torch.randint(0, _VOCAB, (32,), generator=ids)
        nn.functional.cross_entropy(model(batch), batch).backward()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        schedule.step()
        optimizer.zero_grad()
    return seconds


def case_compile(settings: Settings) -> Iterator[Row]:
    steps = _FIRST + (10 if settings.quick_flag else 30)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager = step_seconds(compiled=False, steps=steps)
        compiled = step_seconds(compiled=True, steps=steps)
    finally:
        torch.set_num_threads(threads)
    shape = f"d={_DIM}, {_BLOCKS} blocks, cosine lr"
    yield Row(
        f"torch.compile(optimizer.step), steady step ({shape})",
        "compiled", statistics.median(compiled[_FIRST:]),
        "eager", statistics.median(eager[_FIRST:]), "s", "<= 1.05",
        f"median of {steps - _FIRST} steps after the first {_FIRST}, 1 thread",
        case_command("compile", settings),
    )  # fmt: skip
    yield Row(
        f"torch.compile(optimizer.step), first {_FIRST} steps ({shape})",
        "compiled (tracing, compiling)", sum(compiled[:_FIRST]),
        "eager", sum(eager[:_FIRST]), "s", "",
        "once per process; no recompile after them", case_command("compile", settings),
    )  # fmt: skip
