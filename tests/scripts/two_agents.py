"""``srun`` in a test of a job script: the command as two torchrun agents on this host, one worker each.

Usage: two_agents.py hyper-parallel train ARGS...   (what a job script hands ``srun``)

Each agent (c10d rendezvous, ``--nnodes 2``) runs ``$DRIVER $FAULT $AT ARGS... $EXTRA``
(``$EXTRA``: JSON list of arguments the test adds) in its worker. Exits as ``srun``
would: 0 when both agents succeed, else the first non-zero code. Once one agent has
failed the other gets 20 s before it is killed: torchrun's exit barrier can hold it for
minutes. Used by ``tests/test_faults.py``.
"""

import json
import os
import subprocess
import sys
import time

from hyper_parallel.testing import free_port

command = sys.argv[1:]
if command[:2] != ["hyper-parallel", "train"]:
    sys.exit(f"two_agents.py runs 'hyper-parallel train ...', got {command}")
worker = [os.environ["DRIVER"], os.environ["FAULT"], os.environ["AT"], *command[2:]]
worker += json.loads(os.environ.get("EXTRA", "[]"))
endpoint = f"localhost:{free_port()}"
env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "TORCHELASTIC"))}
agents = [
    subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            "job-script-test",
            *worker,
        ],
        env=env,
    )
    for node in (0, 1)
]
deadline = time.monotonic() + 300
while time.monotonic() < deadline and any(a.poll() is None for a in agents):
    if any(a.returncode not in (None, 0) for a in agents):
        deadline = min(deadline, time.monotonic() + 20)
    time.sleep(0.2)
for agent in agents:
    if agent.poll() is None:
        agent.kill()
codes = [agent.wait() for agent in agents]
sys.exit(next((c for c in codes if c), 0))
