"""Run a test function on N CPU processes with the gloo backend.

Usage::

    def _check(rank: int, world_size: int, tmp: str) -> None:
        ...  # runs in every process; torch.distributed is initialized

    def test_something(tmp_path):
        run_distributed(_check, world_size=2, args=(str(tmp_path),))

The function must be importable (module level). A failure on any rank fails
the test with that rank's traceback.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_distributed"]

# How long rank 0 waits for the other ranks to finish before it exits anyway.
_EXIT_WAIT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    # A crash in native code (an abort, a segfault) writes no traceback; this file gets
    # the Python stack of every thread at that moment instead. It stays open for the
    # process's whole life, so no context manager.
    fault_log = Path(errors, f"rank{rank}.fault").open("w")  # noqa: SIM115
    faulthandler.enable(file=fault_log, all_threads=True)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean finish. Rank 0 hosts the TCP store every rank's process group was built
    # on, so it leaves last. Then each rank ends without interpreter finalization: gloo's
    # native threads can abort a process there (SIGABRT, "terminate called without an
    # active exception") after its test has passed, which would fail the test with no
    # Python traceback to show for it.
    Path(errors, f"rank{rank}.done").touch()
    if rank == 0:
        deadline = time.monotonic() + _EXIT_WAIT_S
        while (
            time.monotonic() < deadline and len(list(Path(errors).glob("rank*.done"))) < world_size
        ):
            time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], *, world_size: int, args: tuple[Any, ...] = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes and wait."""
    tests_dir = str(Path(__file__).parent)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    with tempfile.TemporaryDirectory() as errors:
        try:
            mp.spawn(
                _worker,
                args=(world_size, free_port(), fn, args, errors),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:
            reports = [p for p in sorted(Path(errors).glob("rank*.*")) if p.read_text().strip()]
            detail = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in reports)
            detail = f"{exc}\n{detail}" if detail else str(exc)
            raise AssertionError(f"distributed test failed:\n{detail}") from None
