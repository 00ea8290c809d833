"""Past one machine: the attempt handshake in torchrun's shared store, two-node HSDP, restarts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from distributed import free_port
from test_torchrun import TESTS, _checkpoint_values, _torchrun

from conftest import TINY_TRAIN_ARGS
from hyper_parallel.core.compat import TCPStore
from hyper_parallel.core.distributed._mesh import agree_on_attempt_token, hsdp_mesh, hsdp_mesh_shape

TRAIN = ["train", "--sharding", "hsdp", "--steps", "12", "--eval-every", "4",
         "--checkpoint-every", "4", *TINY_TRAIN_ARGS]  # fmt: skip


def _attempt(port: int, world_size: int) -> list[str]:
    """Every rank of one attempt runs the handshake, each with its own client; their tokens."""
    tokens = [""] * world_size

    def rank_main(rank: int) -> None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        tokens[rank] = agree_on_attempt_token(store, rank, world_size)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in reversed(threads):  # the others ask before rank 0 is there
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return tokens


def test_every_attempt_agrees_on_a_token_of_its_own_whatever_a_dead_attempt_left() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    first = _attempt(server.port, 4)
    assert len(set(first)) == 1 and first[0]
    # a killed attempt: two ranks asked, rank 0 never answered
    TCPStore("127.0.0.1", server.port, is_master=False).append(
        "hyper_parallel/attempt/asks", "deadbeef,cafebabe,"
    )
    second = _attempt(server.port, 4)
    assert len(set(second)) == 1 and second[0] != first[0]
    assert _attempt(server.port, 1)[0] not in (first[0], second[0])


def _two_nodes(tmp: Path, *args: str, restarts: int = 0) -> str:
    """Two torchrun agents on this host, 2 processes each, that must succeed; their output."""
    codes, output = _two_agents(tmp, lambda node: list(args), restarts=restarts)
    assert codes == [0, 0], output[-6000:]
    return output


def _two_agents(
    tmp: Path, args: Callable[[int], list[str]], *, restarts: int = 0, timeout: float = 420
) -> tuple[list[int | None], str]:
    """Two torchrun agents on this host, 2 processes each (c10d rendezvous), node ``n``
    running ``args(n)``; their exit codes (``None``: still running at ``timeout``) and output.

    Only torchrun's own environment: nothing like ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    endpoint = f"localhost:{free_port()}"
    logs, agents = [], []
    for node in (0, 1):
        log = (tmp / f"node{node}.log").open("w")
        logs.append(log)
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
             "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
             "--rdzv_id", "hyper-parallel-test", "--max-restarts", str(restarts), *args(node)],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
        ))  # fmt: skip
    try:
        codes = _wait_for_agents(agents, timeout=timeout)
    finally:
        for agent, log in zip(agents, logs, strict=True):
            agent.kill()
            log.close()
    return codes, "\n".join((tmp / f"node{n}.log").read_text() for n in (0, 1))


def _wait_for_agents(agents: list[subprocess.Popen[str]], timeout: float) -> list[int | None]:
    """Every agent's exit code; once one has failed, the others get 20 s before they are killed.

    A failed node can leave the other's agent waiting in torchrun's exit barrier
    for minutes: the test says what failed at once instead.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(a.poll() is None for a in agents):
        if any(a.returncode not in (None, 0) for a in agents):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.2)
    return [a.poll() for a in agents]


def _val_losses(out: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2 x 2 HSDP run: its --out (checkpoints under ckpt/)."""
    tmp = tmp_path_factory.mktemp("two_nodes")
    _two_nodes(tmp, "-m", "hyper_parallel", *TRAIN, "--out", str(tmp / "run"),
               "--checkpoint-dir", str(tmp / "run" / "ckpt"))  # fmt: skip
    return tmp / "run"


def test_two_nodes_of_two_equal_one_node_of_four_under_hsdp(
    two_nodes: Path, tmp_path: Path
) -> None:
    one_node = _torchrun("-m", "hyper_parallel", *TRAIN, "--out", str(tmp_path / "run"),
                         "--checkpoint-dir", str(tmp_path / "ckpt"), nproc=4, timeout=420)  # fmt: skip
    assert one_node.returncode == 0, one_node.stderr[-4000:]
    # the same training: only the order of the gradient sums differs ((2, 2) and (1, 4) meshes)
    two, one = _val_losses(two_nodes), _val_losses(tmp_path / "run")
    assert [s for s, _ in two] == [s for s, _ in one] == [0, 4, 8, 12]
    assert [v for _, v in two] == pytest.approx([v for _, v in one], rel=1e-6, abs=0)
    # the default HSDP mesh is (nodes, processes per node)
    mesh = json.loads((two_nodes / "summary.json").read_text())["mesh"]
    assert mesh == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mesh"]["shape"] == [1, 4]


def test_a_rank_killed_on_the_second_node_restarts_both_and_ends_bitwise_equal(
    two_nodes: Path, tmp_path: Path
) -> None:
    # global rank 2 (the second node's first) dies at its 9th step; both agents restart
    # their workers, which resume from the step-8 checkpoint
    output = _two_nodes(
        tmp_path, str(TESTS / "scripts" / "train_with_fault.py"), "9", "2", "--", *TRAIN,
        "--out", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "run" / "ckpt"),
        "--resume", restarts=1,
    )  # fmt: skip
    # the first attempt really lost a rank (the launcher may see a survivor stop first)
    assert any(line in output for line in ("exitcode: 17", "another process of this job stopped"))
    assert "resuming from step 8 (" in output
    assert [step for step, _ in _val_losses(tmp_path / "run")] == [0, 4, 8, 12]  # no row twice
    final = "ckpt/muon_adamw/step_00000012"
    want = _checkpoint_values(two_nodes / final)
    got = _checkpoint_values(tmp_path / "run" / final)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        same = (
            torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        )
        assert same, key


def test_node_local_checkpoint_dirs_stop_every_rank_with_one_line_naming_the_dir(
    tmp_path: Path,
) -> None:
    # as on nodes with local disks: each node's --checkpoint-dir is its own; a rank dies at
    # step 9 and torchrun may restart once. Every rank must stop, long before any timeout.
    def node_args(node: int) -> list[str]:
        local = tmp_path / f"node{node}-disk" / "ckpt"
        return [str(TESTS / "scripts" / "train_with_fault.py"), "9", "2", "--", *TRAIN,
                "--out", str(tmp_path / f"run{node}"), "--checkpoint-dir", str(local), "--resume"]  # fmt: skip

    codes, output = _two_agents(tmp_path, node_args, restarts=1, timeout=200)
    assert None not in codes and 0 not in codes, output[-6000:]  # both ended, both failed
    errors = [line for line in output.splitlines() if line.startswith("hyper-parallel: error:")]
    assert len(errors) >= 4 and "Traceback" not in "".join(errors), output[-6000:]  # every rank
    for line in errors:
        assert re.search(r"Checkpoint directory \S+node[01]-disk/ckpt/muon_adamw: rank \d", line)
        assert "must be one directory on storage all ranks share" in line
    assert not list(tmp_path.glob("node*-disk/ckpt/muon_adamw/*")), "nothing may be written"
    assert "[rank" not in output  # no worker printed a traceback (torchrun's own agents may)


@pytest.mark.usefixtures("no_process_group")
def test_hsdp_mesh_shape_is_nodes_by_processes_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert hsdp_mesh_shape() == (2, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(
        ValueError, match=r"world size 8 is not a whole number of nodes of LOCAL_WORLD_SIZE=3"
    ):
        hsdp_mesh_shape()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert hsdp_mesh_shape() == (1, 8)  # one node
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match=r"hsdp_mesh needs torchrun's environment"):
        hsdp_mesh()
