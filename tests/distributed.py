"""Run a test function on N CPU processes with the gloo backend (``hyper_parallel.testing``).

Usage::

    def _check(rank: int, world_size: int, tmp: str) -> None:
        ...  # runs in every process; torch.distributed is initialized

    def test_something(tmp_path):
        run_distributed(_check, world_size=2, args=(str(tmp_path),))

The function must be importable (module level). A failure on any rank fails
the test with that rank's traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hyper_parallel.testing import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]

# The spawned processes import the test modules by name.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
