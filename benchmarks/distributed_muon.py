"""Distributed Muon step time against its peers: 2 ranks (FSDP) and 4 ranks (FSDP x TP).

Measured in one run, on the same transformer-shaped matrices (``--layers``
blocks of q/k/v/o ``d x d``, gate/up ``h x d`` and down ``d x h``, h = 8d/3),
each process with gloo and one thread.

FSDP, ``--world-size`` ranks (2), params row-sharded like FSDP2 (``Shard(0)``):

* ours: :class:`~hyper_parallel_builtins.muon.Muon` with the ``fsdp`` backend
  (Newton-Schulz on one owner rank per matrix, ``all_to_all`` exchange), in
  fp32 and in bf16;
* (a) one process: the same Muon on whole tensors, one thread;
* (b) gather-all: every rank gathers every full matrix and orthogonalizes all
  of them (what a Muon unaware of sharding does), then keeps its piece;
* (c) ``torch.optim.Muon`` on the same DTensors (implicit redistribution,
  bf16 Newton-Schulz, as torch always does).

FSDP x TP, 4 ranks on a ``(dp=2, tp=2)`` mesh, at ``--tp-dim`` x
``--tp-layers``: each block is laid out by torch's ``parallelize_module``
(``ColwiseParallel`` for q, k, v, gate, up; ``RowwiseParallel`` for o, down)
on the ``tp`` dim and ``fully_shard`` on the ``dp`` dim, so column-parallel
weights are ``(_StridedShard(0), Shard(0))`` and row-parallel ones
``(Shard(0), Shard(1))``. Ours (the ``fsdp`` backend) against (b) on that
layout. 4 processes share the machine's cores (oversubscribed on 2 cores),
so the defaults are small.

Before timing, ours and (b) each take one step from the same params and
grads and must give the same params (``assert_close``), so both compute the
same update. Prints each figure, its ratio, and the command that reproduces
it::

    python -m benchmarks.distributed_muon --dim 256 --layers 4

It also records the Muon state (momentum buffers) held per rank against one
process. ``python -m benchmarks`` runs it as its ``distributed`` case.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from torch import nn

from benchmarks.suite import transformer_shapes
from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import BlocksFn, Need, ShardingBackend
from hyper_parallel.core.distributed.toolkit import Layout, is_dtensor, join_blocks, split_blocks

LR = 0.02
TP_MESH = (2, 2)  # (dp, tp)


class GatherAll(ShardingBackend):
    """Baseline (b): every rank gathers every full matrix and transforms all of them.

    Each rank then keeps its own piece with
    ``distribute_tensor(result, mesh, placements, src_data_rank=None)``. The
    needs are applied (a ``RowBlocks`` param is cut into its blocks), so the
    update is the same as any backend's.
    """

    name: ClassVar[str] = "gather_all"

    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        return True

    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        raise TypeError("benchmark backend: does not shard")

    def map_blocks(
        self,
        fn: BlocksFn,
        tensors: Sequence[torch.Tensor],
        needs: Sequence[Need],
        *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        from torch.distributed.tensor import distribute_tensor

        fulls = [t.full_tensor() if is_dtensor(t) else t for t in tensors]  # type: ignore[attr-defined]
        blocks = [
            split_blocks(f, Layout.whole(f.shape), need)
            for f, need in zip(fulls, needs, strict=True)
        ]
        results = iter(fn([b for bs in blocks for b in bs]))
        out = []
        for t, bs, need in zip(tensors, blocks, needs, strict=True):
            full = join_blocks([next(results) for _ in bs], need).to(t.dtype)
            if is_dtensor(t):
                mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
                full = distribute_tensor(full, mesh, placements, src_data_rank=None)
            out.append(full)
        return out


class _BenchmarkPlugin:
    @staticmethod
    @hookimpl
    def hyper_parallel_register_sharding_backends(register: Any) -> None:
        register("gather_all", GatherAll)


class _Block(nn.Module):
    """The matrices of one transformer block, shaped as :func:`transformer_shapes` lists them."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = (nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called: only the layout matters
        x = x + self.o(self.q(x) + self.k(x) + self.v(x))
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


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


def _time(step: Callable[[], None], repeats: int, *, sync: bool = True, warm: bool = True) -> float:
    """Median seconds of ``step`` (after one warm-up call unless ``warm`` is false).

    ``sync`` brackets each call with barriers.
    """
    if warm:
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


def _same_step(ours: torch.optim.Optimizer, baseline: torch.optim.Optimizer) -> float:
    """Step both once (their warm-up) and assert equal params; the largest difference.

    Compares each rank's local shards: no communication.
    """

    def local(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.to_local() if is_dtensor(p) else p for p in _params_of(opt)]  # type: ignore[attr-defined]

    before = [t.clone() for t in local(ours)]
    ours.step()
    baseline.step()
    worst = 0.0
    for a, b, old in zip(local(ours), local(baseline), before, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m: f"ours and gather-all differ: {m}")
        if a.numel():
            assert not torch.equal(a, old), "the step left a param unchanged"
            worst = max(worst, (a - b).abs().max().item())
    return worst


def _params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # full_tensor() of a strided shard logs a warning on every call (two all-gathers).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _ours_against_gather_all(
    sharded: Callable[[], list[nn.Parameter]], repeats: int, results: dict[str, float]
) -> tuple[torch.optim.Optimizer, float]:
    """Time ours and the gather-all baseline on fresh copies of the same params.

    Both take one step first (it doubles as the warm-up) and must agree;
    returns our optimizer and the largest difference over ranks.
    """
    from hyper_parallel.testing import plugin_registered
    from hyper_parallel_builtins.muon import Muon

    with plugin_registered(_BenchmarkPlugin, name="benchmark_gather_all"):
        ours = Muon(sharded(), lr=LR, sharding="fsdp")
        gather = Muon(sharded(), lr=LR, sharding="gather_all")
        diff = _max_over_ranks(_same_step(ours, gather))
        results["ours"] = _time(ours.step, repeats, warm=False)
        results["gather_all"] = _time(gather.step, repeats, warm=False)
    return ours, diff


def _fsdp_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """FSDP rows: ``world`` ranks, ``Shard(0)`` params."""
    _init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_builtins.muon import Muon

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = transformer_shapes(args.dim, args.layers)
    full = [torch.randn(*s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]

    def sharded() -> list[nn.Parameter]:
        params = []
        for w, g in zip(full, grads, strict=True):
            p = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            params.append(p)
        return params

    results: dict[str, float] = {}
    state_bytes: dict[str, int] = {}
    if rank == 0:
        plain = [nn.Parameter(w.clone()) for w in full]
        for p, g in zip(plain, grads, strict=True):
            p.grad = g.clone()
        one = Muon(plain, lr=LR)
        results["one_process"] = _time(one.step, args.repeats, sync=False)
        state_bytes["one_process"] = _state_bytes(one)
    dist.barrier()
    ours, diff = _ours_against_gather_all(sharded, args.repeats, results)
    state_bytes["ours"] = _state_bytes(ours)
    del ours
    ours_bf16 = Muon(sharded(), lr=LR, sharding="fsdp", ns_dtype=torch.bfloat16)
    results["ours_bf16"] = _time(ours_bf16.step, args.repeats)
    del ours_bf16
    if not args.skip_torch:
        peer = torch.optim.Muon(sharded(), lr=LR)
        results["torch_muon"] = _time(peer.step, max(1, args.repeats // 2))
    if rank == 0:
        record = {"seconds": results, "state_bytes": state_bytes, "max_abs_diff": diff}
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def _tp_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """FSDP x TP rows: 4 ranks on a (dp=2, tp=2) mesh, laid out by torch's TP and FSDP2."""
    _init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", TP_MESH, mesh_dim_names=("dp", "tp"))
    hidden = transformer_shapes(args.tp_dim, 1)[4][0]
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(args.tp_dim, hidden) for _ in range(args.tp_layers)))
    plan: dict[str, Any] = {n: ColwiseParallel() for n in ("q", "k", "v", "gate", "up")}
    plan |= {n: RowwiseParallel() for n in ("o", "down")}
    for block in model:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    named = list(model.named_parameters())
    placements: dict[str, str] = {}
    for name, p in named:
        placements.setdefault(name.split(".")[-2], str(tuple(p.placements)))  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for _, p in named]

    def sharded() -> list[nn.Parameter]:
        params = []
        for (_, p), g in zip(named, grads, strict=True):
            copy = nn.Parameter(p.detach().clone())
            copy.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)  # type: ignore[attr-defined]
            params.append(copy)
        return params

    results: dict[str, float] = {}
    _, diff = _ours_against_gather_all(sharded, args.repeats, results)
    if rank == 0:
        record = {"seconds": results, "max_abs_diff": diff, "placements": placements}
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def _spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``worker`` on ``world`` ranks; what rank 0 recorded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"hp_bench_{os.getpid()}_{world}.json"
    mp.spawn(worker, args=(world, port, args, str(out)), nprocs=world, join=True)
    recorded: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the FSDP rows")
    parser.add_argument("--tp-dim", type=int, default=256, help="d of the FSDP x TP rows")
    parser.add_argument("--tp-layers", type=int, default=2, help="layers of the FSDP x TP rows")
    parser.add_argument("--skip-tp", action="store_true", help="leave out the FSDP x TP rows")
    parser.add_argument(
        "--skip-torch", action="store_true", help="leave out torch.optim.Muon (slow)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.distributed_muon " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )

    recorded = _spawn(_fsdp_worker, args.world_size, args)
    results, state_bytes = recorded["seconds"], recorded["state_bytes"]
    base = results["one_process"]
    n = len(transformer_shapes(args.dim, args.layers))
    print(
        f"Muon step, FSDP: {n} matrices ({args.layers} layers, d={args.dim}), "
        f"{args.world_size} ranks, gloo, 1 thread each"
    )
    print(f"{'case':<48}{'seconds':>10}{'vs (a)':>9}")
    labels = {
        "ours": "hyper_parallel Muon, owner per matrix",
        "ours_bf16": "  the same, bf16 Newton-Schulz (torch's dtype)",
        "one_process": "(a) one process, whole tensors",
        "gather_all": "(b) every rank gathering every matrix",
        "torch_muon": "(c) torch.optim.Muon on the DTensors",
    }
    for key, label in labels.items():
        if key in results:
            print(f"{label:<48}{results[key]:>10.4f}{results[key] / base:>8.2f}x")
    print(
        f"ours and (b) give the same params after one step "
        f"(max |difference| {recorded['max_abs_diff']:.1e})"
    )
    print(
        f"Muon state per rank: {state_bytes['ours'] / 2**20:.1f} MiB "
        f"(one process: {state_bytes['one_process'] / 2**20:.1f} MiB)"
    )
    figures: dict[str, Any] = {
        "args": vars(args) | {"json": None},
        "seconds": results,
        "state_bytes_per_rank": state_bytes,
        "max_abs_diff": recorded["max_abs_diff"],
    }

    if not args.skip_tp:
        world = TP_MESH[0] * TP_MESH[1]
        tp = _spawn(_tp_worker, world, args)
        s = tp["seconds"]
        n = len(transformer_shapes(args.tp_dim, args.tp_layers))
        print()
        print(
            f"Muon step, FSDP x TP: {n} matrices ({args.tp_layers} layers, d={args.tp_dim}), "
            f"{world} ranks on a (dp={TP_MESH[0]}, tp={TP_MESH[1]}) mesh, gloo, 1 thread each "
            f"({world} processes on {os.cpu_count()} cores)"
        )
        for name, where in tp["placements"].items():
            print(f"  {name}: {where}")
        print(f"{'case':<48}{'seconds':>10}{'vs (b)':>9}")
        for key, label in (("ours", "hyper_parallel Muon (fsdp backend)"),
                           ("gather_all", "(b) every rank gathering every matrix")):  # fmt: skip
            print(f"{label:<48}{s[key]:>10.4f}{s[key] / s['gather_all']:>8.2f}x")
        print(
            f"ours and (b) give the same params after one step "
            f"(max |difference| {tp['max_abs_diff']:.1e})"
        )
        figures["fsdp_tp"] = {
            "dim": args.tp_dim, "layers": args.tp_layers, "mesh": list(TP_MESH),
            "seconds": s, "max_abs_diff": tp["max_abs_diff"], "placements": tp["placements"],
        }  # fmt: skip
    print(f"reproduce: {command.strip()}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
