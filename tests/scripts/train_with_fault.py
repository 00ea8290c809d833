"""``hyper-parallel train`` under torchrun, with rank 1 killed mid-way on the first attempt.

Usage: torchrun --max-restarts 1 ... train_with_fault.py KILL_AT_STEP -- <train arguments>
On the first attempt (TORCHELASTIC_RESTART_COUNT == 0) rank 1 exits hard at
its KILL_AT_STEP-th training step; torchrun restarts every rank, and
``--resume`` continues from the last checkpoint. Used by
``tests/test_torchrun.py``.
"""

import os
import sys

import torch

from hyper_parallel.cli import main
from hyper_parallel.train import TinyGPT

kill_at = int(sys.argv[1])
args = sys.argv[sys.argv.index("--") + 1 :]
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
real_loss = TinyGPT.loss
calls = {"n": 0}


def loss_with_fault(self: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
    if self.training and first_attempt and os.environ.get("RANK") == "1":
        calls["n"] += 1
        if calls["n"] == kill_at:
            os._exit(17)  # a dead rank: no cleanup, no exception
    return real_loss(self, batch)


TinyGPT.loss = loss_with_fault  # type: ignore[method-assign]
raise SystemExit(main(args))
