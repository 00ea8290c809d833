"""Preemption: SIGTERM as a request to save and stop at the end of the current step.

Slurm (on preemption and at the time limit), Kubernetes and torchrun's agent
(when a peer fails) send SIGTERM, then SIGKILL after a grace period. Python's
default for SIGTERM is to die on the spot, between two instructions of a step
or a save. :class:`Preemption` turns the signal into a flag that the training
loop reads between steps, so the step finishes, a checkpoint of it is saved,
and the program exits with the signal's code.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.core.errors import HyperParallelRuntimeError

__all__ = ["Preemption"]


class Preemption:
    """Catch SIGTERM (or ``signals``) while in the ``with`` block; the loop asks :meth:`requested`.

    Under a process group :meth:`requested` is a collective: every rank
    calls it at the same point of each step and every rank gets the same
    answer, whichever rank got the signal, so all stop after the same step
    and none waits in a collective for one that has left.

    Args:
        signals: The signals to catch (default SIGTERM). Ctrl-C stays a
            ``KeyboardInterrupt``: it stops at once rather than after a step.

    Raises:
        RuntimeError: entered outside the main thread, where Python cannot
            install signal handlers.

    Examples:
        >>> with Preemption() as preemption:
        ...     for step in range(start, steps + 1):
        ...         train_step()
        ...         if preemption.requested():
        ...             manager.save(step, model=model, optimizer=optimizer)
        ...             manager.wait()
        ...             break
        >>> if preemption.signal is not None:
        ...     sys.exit(preemption.exit_code)
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.signal: signal.Signals | None = None  # what this process, or another rank, got
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> Preemption:
        """Catch the signals from now on (what entering the ``with`` block does)."""
        if threading.current_thread() is not threading.main_thread():
            raise HyperParallelRuntimeError(
                "Preemption must be entered in the main thread: Python delivers signals there "
                "only. Enter it around the training loop of the main thread."
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Give the signals their earlier handlers back (what leaving the ``with`` block does)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = signal.Signals(signum)

    def requested(self, device: torch.device | str | None = None) -> bool:
        """Whether to stop after this step: this process or, under a process group, any rank got a signal.

        Args:
            device: Where the collective's one-element tensor lives (the
                process group's device: a GPU under NCCL); default CPU.
        """
        code = int(self._received or 0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=device or "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        if code:
            self.signal = signal.Signals(code)
        return bool(code)

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal received (143 for SIGTERM); 0 without one."""
        return 128 + int(self.signal) if self.signal is not None else 0
