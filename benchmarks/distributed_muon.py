"""Distributed Muon step time at 2 ranks (gloo, one thread each) against its peers.

Measured in one run, on the same transformer-shaped matrices (``--layers``
blocks of q/k/v/o ``d x d``, gate/up ``h x d`` and down ``d x h``, h = 8d/3):

* ours: :class:`~hyper_parallel_builtins.muon.Muon` on FSDP-style ``Shard(0)``
  DTensors, Newton-Schulz on one owner rank per matrix (the ``fsdp`` backend),
  with each transport (``all_to_all``, the default, and ``gather_broadcast``);
* (a) one process: the same Muon on whole tensors, one thread;
* (b) gather-all: every rank gathers every full matrix and orthogonalizes all
  of them (what a Muon unaware of sharding does), then keeps its rows;
* (c) ``torch.optim.Muon`` on the same DTensors (implicit redistribution,
  bf16 Newton-Schulz, as torch always does).

Prints each figure, the ratio to (a), and the command that reproduces it::

    python -m benchmarks.distributed_muon --dim 256 --layers 4

It also records the Muon state (momentum buffers) held per rank against one
process. ``python -m benchmarks`` runs it as its ``distributed`` case.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.suite import transformer_shapes


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this process holds (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def _time(step: Callable[[], None], repeats: int, *, sync: bool = True) -> float:
    """Median seconds of ``step`` (after one warm-up call); ``sync`` brackets it with barriers."""
    step()  # warm up (state allocation, first-call overheads)
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        step()
        if sync:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel.core.distributed import FullTensorsFn, ShardingBackend
    from hyper_parallel.core.distributed.full_matrix import _local_fallback
    from hyper_parallel.testing import plugin_registered
    from hyper_parallel_builtins.muon import Muon

    class GatherAll(ShardingBackend):
        """Every rank gathers and orthogonalizes every matrix."""

        name: ClassVar[str] = "gather_all"

        def accepts(self, params: Sequence[torch.Tensor]) -> bool:
            return True

        def shard_model(self, module: Any, **options: Any) -> Any:
            raise TypeError("benchmark backend: does not shard")

        def full_matrix_map(
            self, fn: FullTensorsFn, tensors: Sequence[torch.Tensor], **_: Any
        ) -> list[torch.Tensor]:
            return _local_fallback(fn, list(tensors))  # type: ignore[arg-type]

    class BenchmarkPlugin:
        from hyper_parallel import hookimpl

        @staticmethod
        @hookimpl
        def hyper_parallel_register_sharding_backends(register: Any) -> None:
            register("gather_all", GatherAll)

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = [
        torch.randn(*s, generator=gen) * 0.02 for s in transformer_shapes(args.dim, args.layers)
    ]
    grads = [torch.randn(*s, generator=gen) for s in transformer_shapes(args.dim, args.layers)]

    def sharded() -> list[torch.nn.Parameter]:
        params = []
        for w, g in zip(full, grads, strict=True):
            p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            params.append(p)
        return params

    results: dict[str, float] = {}
    state_bytes: dict[str, int] = {}
    if rank == 0:
        plain = [torch.nn.Parameter(w.clone()) for w in full]
        for p, g in zip(plain, grads, strict=True):
            p.grad = g.clone()
        one = Muon(plain, lr=0.02)
        results["one_process"] = _time(one.step, args.repeats, sync=False)
        state_bytes["one_process"] = _state_bytes(one)
    dist.barrier()
    ours = Muon(sharded(), lr=0.02, sharding="fsdp")
    results["ours"] = _time(ours.step, args.repeats)
    state_bytes["ours"] = _state_bytes(ours)
    os.environ["HYPER_PARALLEL_TRANSPORT"] = "gather_broadcast"
    ours_gather = Muon(sharded(), lr=0.02, sharding="fsdp")
    results["ours_gather_broadcast"] = _time(ours_gather.step, args.repeats)
    del os.environ["HYPER_PARALLEL_TRANSPORT"]
    ours_bf16 = Muon(sharded(), lr=0.02, sharding="fsdp", ns_dtype=torch.bfloat16)
    results["ours_bf16"] = _time(ours_bf16.step, args.repeats)
    with plugin_registered(BenchmarkPlugin, name="benchmark_gather_all"):
        gather = Muon(sharded(), lr=0.02, sharding="gather_all")
        results["gather_all"] = _time(gather.step, args.repeats)
    if not args.skip_torch:
        peer = torch.optim.Muon(sharded(), lr=0.02)
        results["torch_muon"] = _time(peer.step, max(1, args.repeats // 2))
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": results, "state_bytes": state_bytes}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--skip-torch", action="store_true", help="leave out torch.optim.Muon (slow)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"hp_bench_{os.getpid()}.json"
    mp.spawn(
        _worker, args=(args.world_size, port, args, str(out)), nprocs=args.world_size, join=True
    )
    recorded = json.loads(out.read_text())
    out.unlink()
    results, state_bytes = recorded["seconds"], recorded["state_bytes"]
    base = results["one_process"]
    command = "python -m benchmarks.distributed_muon " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    n = len(transformer_shapes(args.dim, args.layers))
    print(
        f"Muon step, {n} matrices ({args.layers} layers, d={args.dim}), {args.world_size} ranks, gloo, 1 thread each"
    )
    print(f"{'case':<44}{'seconds':>10}{'vs (a)':>9}")
    labels = {
        "ours": "hyper_parallel Muon, owner per matrix",
        "ours_gather_broadcast": "  the same, gather + broadcast transport",
        "ours_bf16": "  the same, bf16 Newton-Schulz (torch's dtype)",
        "one_process": "(a) one process, whole tensors",
        "gather_all": "(b) gather every matrix on every rank",
        "torch_muon": "(c) torch.optim.Muon on the DTensors",
    }
    for key in (
        "ours",
        "ours_gather_broadcast",
        "ours_bf16",
        "one_process",
        "gather_all",
        "torch_muon",
    ):
        if key in results:
            print(f"{labels[key]:<44}{results[key]:>10.4f}{results[key] / base:>8.2f}x")
    print(
        f"Muon state per rank: {state_bytes['ours'] / 2**20:.1f} MiB "
        f"(one process: {state_bytes['one_process'] / 2**20:.1f} MiB)"
    )
    print(f"reproduce: {command.strip()}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": None},
                    "seconds": results,
                    "state_bytes_per_rank": state_bytes,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
