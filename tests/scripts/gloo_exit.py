"""A script whose last collective's tensors only gloo's worker holds as the script ends.

The worker frees them once it gets the GIL, and this script keeps the GIL from
it until the interpreter is finalizing: without hyper_parallel's exit handler
the process aborts ("terminate called without an active exception") although
all its work is done. The group is torch's own, brought up without
hyper_parallel, as a user's script may do.
"""

import sys
import time

import torch
import torch.distributed as dist

import hyper_parallel  # noqa: F401  (imported as any user script does)

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} started", flush=True)  # now: writing hands over the GIL
sys.setswitchinterval(1000.0)  # the main thread keeps the GIL until it blocks
send, out = torch.ones(4), torch.empty(8)
dist.all_gather_into_tensor(out, send, async_op=True)
del send, out  # only the worker refers to the tensors now
start = time.perf_counter()
while time.perf_counter() - start < 0.5:
    pass  # the collective completes, and its worker waits for the GIL to free the tensors


class _SleepsWhenCollected:
    def __del__(self) -> None:
        time.sleep(0.05)  # at finalization, hands the GIL to whoever waits for it


last_global = _SleepsWhenCollected()
