"""``hyper-parallel train`` under torchrun, with one rank killed mid-way on the first attempt.

Usage: torchrun --max-restarts 1 ... train_with_fault.py KILL_AT_STEP RANK -- <train arguments>
On its node's first attempt (TORCHELASTIC_RESTART_COUNT == 0) global rank
RANK exits hard at its KILL_AT_STEP-th training step; torchrun restarts every
rank, and ``--resume`` continues from the last checkpoint. Without torchrun the
one process is rank 0. Used by ``tests/test_torchrun.py``,
``tests/test_multinode.py`` and ``tests/test_resume.py``.
"""

import os
import sys

import torch

from hyper_parallel.cli import run
from hyper_parallel.train import TinyGPT

kill_at, kill_rank = int(sys.argv[1]), sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1 :]
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
real_loss = TinyGPT.loss
calls = {"n": 0}


def loss_with_fault(self: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
    if self.training and first_attempt and os.environ.get("RANK", "0") == kill_rank:
        calls["n"] += 1
        if calls["n"] == kill_at:
            os._exit(17)  # a dead rank: no cleanup, no exception
    return real_loss(self, batch)


TinyGPT.loss = loss_with_fault  # type: ignore[method-assign]
run(args)
