"""Muon on small transformer shapes against torch.optim.Muon, at 1 and 2 threads.

Run from the repository root::

    python -m benchmarks --cases muon_small

The sets are 8 blocks at d=256 and 4 blocks at d=512 (q, k, v, o and a
SwiGLU MLP each, :func:`~benchmarks.common.transformer_shapes`). A step there
takes milliseconds, so what a step does besides its GEMMs shows. Ours runs at its
defaults: its Newton-Schulz dtype and the paths it tunes on its first step
(``HYPER_PARALLEL_NS_TUNING``; the tuned choices are read from the cache
directory when they were tuned before). torch.optim.Muon runs at its own
(bf16). Each gets its own params with the same values; steps are timed in
turns after one warm-up step, which for ours includes any tuning: the note
gives that step's time and what tuning chose, and whether it measured or
read the cache.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch

from benchmarks.common import (
    MUON_LR,
    Row,
    Settings,
    case_command,
    interleaved_medians,
    params_with_grads,
    short_repeats,
    stepper,
    transformer_shapes,
)
from benchmarks.peers import muon_peers

__all__ = ["SMALL_SETS", "THREADS", "case_muon_small", "thread_count"]

#: (model width, blocks) of each set the case steps.
SMALL_SETS: tuple[tuple[int, int], ...] = ((256, 8), (512, 4))

#: The torch thread counts each set is stepped at.
THREADS: tuple[int, ...] = (1, 2)

#: Ours / torch.optim.Muon that issue 42 aims at on these sets.
TARGET = "<= 0.9"


@contextlib.contextmanager
def thread_count(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_label(threads: int) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''}"


def _tuned(optimizer: object) -> str:
    """``"; tuned in 0.123 s: 256x256 bfloat16, batched, P @ X; ..."``, or ``""`` untuned."""
    report = getattr(optimizer, "ns_tuning_report", None)
    if not report or not report.shapes:
        return ""
    where = "read from the cache" if report.cached else f"tuned in {report.cost_s:.3f} s"
    chosen = "; ".join(f"{s.stack.rows}x{s.stack.cols} {s.chosen.name}" for s in report.shapes)
    return f"; {where}: {chosen}"


def case_muon_small(
    settings: Settings,
    sets: Sequence[tuple[int, int]] = SMALL_SETS,
    threads: Sequence[int] = THREADS,
) -> Iterator[Row]:
    """Our Muon step at its defaults against torch.optim.Muon's, per set and thread count."""
    from hyper_parallel_builtins.muon import Muon, default_ns_dtype

    device = settings.device
    peer = muon_peers(MUON_LR, ("torch.optim.Muon",))[0]
    dtype = str(default_ns_dtype(torch.empty(0, device=device))).removeprefix("torch.")
    command = case_command("muon_small", settings)
    for count, (dim, layers) in itertools.product(threads, sets):
        shapes = transformer_shapes(dim, layers)
        what = (f"Muon step, {len(shapes)} matrices ({layers} layers, d={dim}), "
                f"{_threads_label(count)}, {device}, defaults")  # fmt: skip
        factories: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
            "ours": lambda params: Muon(params, lr=MUON_LR)
        }
        if peer.make is not None:
            factories[peer.name] = peer.make
        with thread_count(count):
            steps = {}
            for name, make in factories.items():
                params = params_with_grads(shapes, device)
                steps[name] = stepper(make(params), params)
            medians, first = interleaved_medians(steps, short_repeats(settings), device)
        note = (f"ours' first step {first['ours'] * 1e3:.0f} ms; "
                f"median of {short_repeats(settings)} steps each"
                f"{_tuned(getattr(steps['ours'], 'optimizer', None))}")  # fmt: skip
        yield Row(what, f"ours ({dtype} NS)", medians["ours"], f"{peer.name} (bf16)",
                  medians.get(peer.name), "s", TARGET,
                  note if peer.make is not None else peer.reason, command)  # fmt: skip
