"""How many CPU threads torch uses while ``hyper-parallel train`` runs.

torch starts one intra-op thread per core. On a machine doing anything else,
those threads wait on each other at every parallel operation whenever one of
them is descheduled, and a step slows several-fold; one thread fewer than the
free cores costs far less. So ``train`` takes ``--threads`` when given, else
``OMP_NUM_THREADS`` (torchrun sets it to 1 for several processes per node),
else this process's share of the CPUs it may use, less the share that is
busy as it starts.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Threads", "choose_threads", "resumed_threads", "torch_threads", "usable_cpus"]


@dataclass(frozen=True)
class Threads:
    """A thread count and what chose it, as the run's header line says it."""

    count: int
    why: str  # "--threads", "OMP_NUM_THREADS", or the CPUs and load it was worked out from
    given: bool = False  # by --threads or OMP_NUM_THREADS, not worked out here

    def __str__(self) -> str:
        return f"{self.count} torch thread{'s' if self.count != 1 else ''} ({self.why})"


def choose_threads(
    *,
    requested: int | None,
    env: Mapping[str, str],
    cpus: int,
    machine_cpus: int,
    load: float | None,
) -> Threads:
    """The threads for one process: ``requested``, else ``OMP_NUM_THREADS``, else worked out.

    Args:
        requested: ``--threads``, or ``None``.
        env: the environment (``OMP_NUM_THREADS``, torchrun's ``LOCAL_WORLD_SIZE``).
        cpus: the CPUs this process may use (its affinity, or its cgroup's quota).
        machine_cpus: every CPU of the machine, which the load counts over.
        load: the CPUs busy at the start (:func:`_load`), or ``None`` where unknown.

    Worked out, it is ``cpus / LOCAL_WORLD_SIZE`` times the share of the
    machine the load leaves free, rounded, and at least 1: on 2 CPUs, a load
    above 0.5 leaves 1 thread.
    """
    if requested is not None:
        return Threads(requested, "--threads", given=True)
    if (omp := _positive(env.get("OMP_NUM_THREADS", "").split(",")[0])) is not None:
        return Threads(omp, "OMP_NUM_THREADS", given=True)
    local = _positive(env.get("LOCAL_WORLD_SIZE", "")) or 1
    share = max(cpus / local, 1.0)
    busy = min(max(load or 0.0, 0.0) / max(machine_cpus, 1), 1.0)
    count = max(1, min(int(share * (1 - busy) + 0.5), int(share)))
    said = f"{cpus} CPUs" + (f" / {local} processes" if local > 1 else "")
    return Threads(count, said + (f", load {load:.1f}" if load is not None else ""))


def _positive(text: str) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, within its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, round(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


#: How long :func:`_load` watches the machine's CPUs before the run starts.
_LOAD_WINDOW_S = 0.25


def _load() -> float | None:
    """How many CPUs are busy now: over a quarter second (Linux), else the 1-minute load average.

    The load average lags by a minute: right after ``pip install`` it still
    counts the install's work and would cost a quiet machine its threads.
    """
    before = _cpu_times()
    if before is not None:
        time.sleep(_LOAD_WINDOW_S)
        after = _cpu_times()
        if after is not None and after[0] > before[0]:
            total, idle = after[0] - before[0], after[1] - before[1]
            return (os.cpu_count() or 1) * (total - idle) / total
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows, or a platform that does not say
        return None


def _cpu_times() -> tuple[int, int] | None:
    """(all, idle) CPU time of the whole machine so far, from ``/proc/stat``; ``None`` elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(v) for v in fields]
    except (OSError, ValueError):
        return None
    return sum(ticks[:8]), ticks[3] + ticks[4]  # idle and iowait; guest time is in user already


@contextlib.contextmanager
def torch_threads(requested: int | None) -> Iterator[Threads]:
    """torch's intra-op threads set for the run (:func:`choose_threads`), then put back."""
    threads = choose_threads(
        requested=requested,
        env=os.environ,
        cpus=usable_cpus(),
        machine_cpus=os.cpu_count() or 1,
        load=_load(),
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads.count)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def resumed_threads(threads: Threads, saved: object) -> Threads:
    """The threads of a resumed run: those its checkpoint was saved with, unless given.

    The thread count changes how torch splits its reductions, so the last bits
    of the numbers; a resume worked out on a busier or quieter machine would
    not continue the run bit for bit. ``--threads`` or ``OMP_NUM_THREADS``
    still decide when given. Sets torch's count; ``saved`` is the
    checkpoint's record (``None`` when it has none).
    """
    if threads.given or not isinstance(saved, int) or saved < 1 or saved == threads.count:
        return threads
    torch.set_num_threads(saved)
    return Threads(saved, "as the run was saved with")
