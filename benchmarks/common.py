"""What the benchmark cases share: the row they yield, the settings they read, how they time.

:mod:`benchmarks.suite` runs the cases and prints their rows; each case
module (``checkpoint``, ``compile``, ``ns_paths``, ``preemption``,
``swap``, ...) and the stand-alone benchmarks (``distributed_muon``,
``scale``) import what they need from here, never from the suite.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.peers import MUON_PEER_NAMES

__all__ = [
    "FIGURE_BUDGET_S",
    "MUON_LR",
    "ROOT",
    "Row",
    "Settings",
    "case_command",
    "interleaved_medians",
    "params_with_grads",
    "short_repeats",
    "stepper",
    "sync",
    "transformer_shapes",
]

#: The repository root: the working directory of the processes the benchmarks start.
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One comparison: our figure against one peer's, from the same run."""

    case: str
    ours_label: str
    ours: float | None
    peer_label: str
    peer: float | None
    unit: str  # "s" (lower is better) or "GFLOP/s" (higher is better)
    target: str = ""  # e.g. "<= 1.0": the ratio ours / peer the project aims at
    note: str = ""
    command: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.peer is None or self.peer == 0:
            return None
        return self.ours / self.peer

    @property
    def met(self) -> bool | None:
        if not self.target or self.ratio is None:
            return None
        op, bound = self.target.split()
        return self.ratio <= float(bound) if op == "<=" else self.ratio >= float(bound)


@dataclass
class Settings:
    """What one run of the suite measures: sizes, repeats, device, peers (its command line)."""

    dims: tuple[int, ...] = (512, 1024)
    layers: int = 8
    repeats: int = 5
    device: str = "cpu"
    peers: bool = True
    muon_peer_names: tuple[str, ...] = MUON_PEER_NAMES
    dist_dims: tuple[int, ...] = (256, 512)
    dist_layers: int = 4
    dist_tp_dim: int = 256  # FSDP x TP rows: 4 processes, so smaller
    dist_tp_layers: int = 2
    checkpoint_params: int = 100_000_000
    quick_flag: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def case_command(cases: str, settings: Settings, *extra: str) -> str:
    """The command line that measures ``cases`` again with ``settings`` (a row's ``command``)."""
    parts = ["python -m benchmarks", f"--cases {cases}", *extra]
    if settings.quick_flag:
        parts.append(settings.quick_flag)
    return " ".join(parts)


def transformer_shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    """The matrices of ``layers`` pre-norm blocks: q, k, v, o and a SwiGLU MLP.

    The MLP width is ``8 d / 3`` rounded up to a multiple of 32 (1376 at d=512).
    """
    hidden = -(-8 * dim // 3 // 32) * 32
    return [(dim, dim)] * 4 * layers + [(hidden, dim), (hidden, dim), (dim, hidden)] * layers


#: The learning rate of every Muon the benchmarks step, ours and the peers'.
MUON_LR = 0.02


def params_with_grads(
    shapes: Sequence[tuple[int, ...]], device: str, seed: int = 0
) -> list[torch.nn.Parameter]:
    """Params of ``shapes`` (values 0.02 N(0, 1)), each with a N(0, 1) gradient; the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def stepper(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """``opt.step`` with the gradients put back first: some optimizers drop them after a step.

    The optimizer is the returned function's ``optimizer`` attribute.
    """
    grads = [p.grad for p in params]

    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def short_repeats(settings: Settings) -> int:
    """Repeats for a millisecond-scale step: enough that a 3% difference stands out of the noise."""
    return max(25 * settings.repeats, 40)


def sync(device: str) -> None:
    """Wait for the device's queued work, so that a timer read after it counts that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


#: Seconds of timed calls one step may take per figure: a slower step is timed fewer
#: times, and one whose first call alone took longer is not run again (its first call
#: is its figure). Peers' bf16 Newton-Schulz on a CPU without native bf16 takes minutes.
FIGURE_BUDGET_S = 120.0


def interleaved_medians(
    steps: Mapping[str, Callable[[], object]], repeats: int, device: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of each step, timed in turns so that load changes hit all alike.

    Each step is timed ``repeats`` times, or as often as
    :data:`FIGURE_BUDGET_S` allows it (see there). Returns the medians and
    each step's first (warm-up) call time.
    """
    first: dict[str, float] = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        sync(device)
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {
        name: [t] if t > FIGURE_BUDGET_S else [] for name, t in first.items()
    }
    quota = {name: min(repeats, max(1, int(FIGURE_BUDGET_S / t))) for name, t in first.items()}
    order = [name for name in steps if not times[name]]
    for repeat in range(repeats):
        # forward, then backward: whichever runs after another finds its caches warm
        for name in order if repeat % 2 == 0 else reversed(order):
            if len(times[name]) == quota[name]:
                continue
            step = steps[name]
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}, first
