"""Replicas sharing the work on two nodes of 2 (``tests/test_replicas.py``), under torchrun.

Each rank appends its rank to the file named by argv[1] when every check holds.
"""

import os
import sys

import torch.distributed as dist
from test_replicas import check_replicas_equal_one_process

dist.init_process_group("gloo")
try:
    assert os.environ["LOCAL_WORLD_SIZE"] == "2" and dist.get_world_size() == 4
    check_replicas_equal_one_process(dist.get_rank(), dist.get_world_size())
    with open(sys.argv[1], "a", encoding="utf-8") as out:
        out.write(f"{dist.get_rank()}\n")
finally:
    dist.destroy_process_group()
