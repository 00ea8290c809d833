"""Distributed Muon step time against its peers: 2 ranks (FSDP) and 4 ranks (FSDP x TP).

Measured in one run, on the same transformer-shaped matrices (``--layers``
blocks of q/k/v/o ``d x d``, gate/up ``h x d`` and down ``d x h``, h = 8d/3),
each process with gloo and one thread.

FSDP, ``--world-size`` ranks (2), params row-sharded like FSDP2 (``Shard(0)``),
at each ``--dim`` (256 and 512 by default):

* ours: :class:`~hyper_parallel_builtins.muon.Muon` with the ``fsdp`` backend
  (Newton-Schulz on one owner rank per matrix, ``all_to_all`` exchange),
  with the exchange overlapped with Newton-Schulz (the default) and without
  (``HYPER_PARALLEL_EXCHANGE_OVERLAP=0``), in fp32; and overlapped in bf16;
* (a) one process: the same Muon on whole tensors, one thread;
* (b) gather-all: every rank gathers every full matrix and orthogonalizes all
  of them (what a Muon unaware of sharding does), then keeps its piece;
* (c) ``torch.optim.Muon`` on the same DTensors (implicit redistribution,
  bf16 Newton-Schulz, as torch always does).

Ours with and without overlap, (a) and (b) are timed in turns (one step of
each per turn), so load changes hit them alike.

FSDP x TP, 4 ranks on a ``(dp=2, tp=2)`` mesh, at ``--tp-dim`` x
``--tp-layers``: each block is laid out by torch's ``parallelize_module``
(``ColwiseParallel`` for q, k, v, gate, up; ``RowwiseParallel`` for o, down)
on the ``tp`` dim and ``fully_shard`` on the ``dp`` dim, so column-parallel
weights are ``(_StridedShard(0), Shard(0))`` and row-parallel ones
``(Shard(0), Shard(1))``. Ours (with and without overlap) against (b) on that
layout. 4 processes share the machine's cores (oversubscribed on 2 cores),
so the defaults are small.

Before timing, ours and (b) each take one step from the same params and
grads and must give the same params (``assert_close``, to the rounding of
the Newton-Schulz dtype: the two batch the matrices differently), so both
compute the same update; ours without overlap must give bitwise the same params as ours
with it. Prints each figure, its ratio, and the command that reproduces it::

    python -m benchmarks.distributed_muon --dim 256 512 --layers 4

It also records the Muon state (momentum buffers) held per rank against one
process. ``python -m benchmarks`` runs it as its ``distributed`` case.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import transformer_shapes
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


def step_seconds(step: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``step`` after a warm-up, each between barriers."""
    step()  # warm up (state allocation, first-call overheads)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(step: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``step`` (:func:`step_seconds`)."""
    return statistics.median(step_seconds(step, repeats))


def _time_in_turns(steps: dict[str, Callable[[], None] | None], repeats: int) -> dict[str, float]:
    """Median seconds of each (warmed-up) step, timed in turns so that load changes hit all alike.

    Each turn runs every step once. A distributed step is bracketed by
    barriers; a step given as ``None`` on some ranks runs alone on the
    others (one process), timed without the closing barrier.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            if step is not None:
                step()
            alone = time.perf_counter() - start
            dist.barrier()
            together = time.perf_counter() - start
            times[name].append(alone if _alone(name) else together)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _alone(name: str) -> bool:
    return name == "one_process"


def _local_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.to_local() if is_dtensor(p) else p for p in _params_of(opt)]  # type: ignore[attr-defined]


def _same_step(ours: torch.optim.Optimizer, baseline: torch.optim.Optimizer) -> float:
    """Step both once (their warm-up) and assert equal params; the largest difference.

    Compares each rank's local shards: no communication.
    """
    before = [t.clone() for t in _local_params(ours)]
    ours.step()
    baseline.step()
    worst = 0.0
    pairs = zip(
        _local_params(ours), _local_params(baseline), before, _tolerances(ours), strict=True
    )
    for a, b, old, atol in pairs:
        torch.testing.assert_close(
            a, b, atol=atol, rtol=1.3e-6, msg=lambda m: f"ours and gather-all differ: {m}"
        )
        if a.numel():
            assert not torch.equal(a, old), "the step left a param unchanged"
            worst = max(worst, (a - b).abs().max().item())
    return worst


def _tolerances(opt: torch.optim.Optimizer) -> list[float]:
    """Per param, how far two correct steps may differ: the rounding of its Newton-Schulz dtype.

    Ours and gather-all batch the matrices differently, and in bf16 (the
    default where the CPU multiplies bf16 natively) a different batch may
    round differently. A wrong update differs by the update itself (~lr / 2).
    """
    from hyper_parallel_builtins.muon import default_ns_dtype

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            dtype = group["ns_dtype"] or default_ns_dtype(p)
            out.append(max(1e-5, 4 * group["lr"] * torch.finfo(dtype).eps))
    return out


def _bitwise_same_step(ours: torch.optim.Optimizer, other: torch.optim.Optimizer) -> None:
    """Step ``other`` once (its warm-up) and assert it holds bitwise ``ours``'s params.

    ``ours`` has taken its first step already, from the same params and grads.
    """
    other.step()
    for a, b in zip(_local_params(ours), _local_params(other), strict=True):
        assert torch.equal(a, b), "ours with and without overlap differ"


def _params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


@contextmanager
def _overlap(on: bool) -> Iterator[None]:
    """Backends made in the block overlap the owner exchange (``on``) or not."""
    from hyper_parallel_builtins.fsdp_backend._backend import OVERLAP_ENV

    before = os.environ.get(OVERLAP_ENV)
    os.environ[OVERLAP_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[OVERLAP_ENV]
        else:
            os.environ[OVERLAP_ENV] = before


def _quiet_logs() -> None:
    # full_tensor() of a strided shard logs a warning on every call (two all-gathers).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _ours_against_baselines(
    sharded: Callable[[], list[nn.Parameter]],
    repeats: int,
    alone: Callable[[], None] | None = None,
) -> tuple[torch.optim.Optimizer, dict[str, float], float]:
    """Time ours with and without overlap, gather-all and (if given) one process, in turns.

    Each optimizer gets fresh copies of the same params. Ours and gather-all
    take one step first (it doubles as the warm-up) and must agree; ours
    without overlap must then give bitwise ours's params. ``alone`` (a
    warmed-up one-process step on rank 0, ``None`` elsewhere) is timed as
    ``one_process`` when given on any rank. Returns our optimizer, the
    medians and the largest difference over ranks between ours and (b).
    """
    from hyper_parallel.testing import plugin_registered
    from hyper_parallel_builtins.muon import Muon

    with plugin_registered(_BenchmarkPlugin, name="benchmark_gather_all"):
        with _overlap(True):
            ours = Muon(sharded(), lr=LR, sharding="fsdp")
        with _overlap(False):
            in_turn = Muon(sharded(), lr=LR, sharding="fsdp")
        gather = Muon(sharded(), lr=LR, sharding="gather_all")
        diff = _max_over_ranks(_same_step(ours, gather))
        _bitwise_same_step(ours, in_turn)
        steps: dict[str, Callable[[], None] | None] = {}
        if _max_over_ranks(float(alone is not None)):
            steps["one_process"] = alone
        steps |= {"ours": ours.step, "ours_no_overlap": in_turn.step, "gather_all": gather.step}
        results = _time_in_turns(steps, repeats)
    return ours, results, diff


def _fsdp_worker(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    """FSDP rows at each ``--dim``: ``world`` ranks, ``Shard(0)`` params."""
    _quiet_logs()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    records = {str(dim): _fsdp_rows(rank, mesh, dim, args) for dim in args.dim}
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def _fsdp_rows(rank: int, mesh: Any, dim: int, args: argparse.Namespace) -> dict[str, Any]:
    """The FSDP figures at one ``dim`` (what rank 0 measured)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_builtins.muon import Muon

    gen = torch.Generator().manual_seed(0)
    shapes = transformer_shapes(dim, args.layers)
    full = [torch.randn(*s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]

    def sharded() -> list[nn.Parameter]:
        params = []
        for w, g in zip(full, grads, strict=True):
            p = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            params.append(p)
        return params

    state_bytes: dict[str, int] = {}
    alone = None
    if rank == 0:
        plain = [nn.Parameter(w.clone()) for w in full]
        for p, g in zip(plain, grads, strict=True):
            p.grad = g.clone()
        one = Muon(plain, lr=LR)
        one.step()  # warm up
        state_bytes["one_process"] = _state_bytes(one)
        alone = one.step
    ours, results, diff = _ours_against_baselines(sharded, args.repeats, alone)
    state_bytes["ours"] = _state_bytes(ours)
    del ours
    if not args.skip_bf16:
        with _overlap(True):
            ours_bf16 = Muon(sharded(), lr=LR, sharding="fsdp", ns_dtype=torch.bfloat16)
        results["ours_bf16"] = median_seconds(ours_bf16.step, args.repeats)
        del ours_bf16
    if not args.skip_torch:
        peer = torch.optim.Muon(sharded(), lr=LR)
        results["torch_muon"] = median_seconds(peer.step, max(1, args.repeats // 2))
    return {"seconds": results, "state_bytes": state_bytes, "max_abs_diff": diff}


def _tp_worker(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    """FSDP x TP rows: 4 ranks on a (dp=2, tp=2) mesh, laid out by torch's TP and FSDP2."""
    _quiet_logs()
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

    _, results, diff = _ours_against_baselines(sharded, args.repeats)
    if rank == 0:
        record = {"seconds": results, "max_abs_diff": diff, "placements": placements}
        Path(out).write_text(json.dumps(record))


def _spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``worker`` on ``world`` ranks; what rank 0 recorded."""
    from hyper_parallel.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        run_distributed(worker, world_size=world, args=(args, str(out)))
        recorded: dict[str, Any] = json.loads(out.read_text())
    return recorded


#: Most seconds two ranks may take per second of one process, by ``--dim`` (2 ranks).
TARGETS = {256: 0.75, 512: 0.6}

_LABELS = {
    "ours": "hyper_parallel Muon, owner per matrix, overlap",
    "ours_no_overlap": "  the same without overlap",
    "ours_bf16": "  the same, bf16 Newton-Schulz (torch's dtype)",
    "one_process": "(a) one process, whole tensors",
    "gather_all": "(b) every rank gathering every matrix",
    "torch_muon": "(c) torch.optim.Muon on the DTensors",
}


def _print_fsdp(dim: int, record: dict[str, Any], args: argparse.Namespace) -> None:
    results, state_bytes = record["seconds"], record["state_bytes"]
    base = results["one_process"]
    n = len(transformer_shapes(dim, args.layers))
    print(
        f"Muon step, FSDP: {n} matrices ({args.layers} layers, d={dim}), "
        f"{args.world_size} ranks, gloo, 1 thread each"
    )
    print(f"{'case':<48}{'seconds':>10}{'vs (a)':>9}  target")
    bound = TARGETS.get(dim) if args.world_size == 2 else None
    for key, label in _LABELS.items():
        if key in results:
            ratio = results[key] / base
            target = ""
            if bound is not None and key in ("ours", "ours_no_overlap"):
                target = f"  <= {bound} ({'met' if ratio <= bound else 'not met'})"
            print(f"{label:<48}{results[key]:>10.4f}{ratio:>8.2f}x{target}")
    print(
        "ours with and without overlap give bitwise the same params after one step; "
        f"ours and (b) the same (max |difference| {record['max_abs_diff']:.1e})"
    )
    print(
        f"Muon state per rank: {state_bytes['ours'] / 2**20:.1f} MiB "
        f"(one process: {state_bytes['one_process'] / 2**20:.1f} MiB)"
    )
    flags = [f"--dim {dim}", f"--layers {args.layers}", f"--repeats {args.repeats}", "--skip-tp"]
    if args.world_size != 2:
        flags.append(f"--world-size {args.world_size}")
    flags += [f"--{flag.replace('_', '-')}" for flag in ("skip_bf16", "skip_torch")
              if getattr(args, flag)]  # fmt: skip
    print(f"reproduce: python -m benchmarks.distributed_muon {' '.join(flags)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, nargs="+", default=[256, 512],
                        help="d of the FSDP rows, one or more (default 256 512)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the FSDP rows")
    parser.add_argument("--tp-dim", type=int, default=256, help="d of the FSDP x TP rows")
    parser.add_argument("--tp-layers", type=int, default=2, help="layers of the FSDP x TP rows")
    parser.add_argument("--skip-tp", action="store_true", help="leave out the FSDP x TP rows")
    parser.add_argument(
        "--skip-torch", action="store_true", help="leave out torch.optim.Muon (slow)"
    )
    parser.add_argument(
        "--skip-bf16", action="store_true", help="leave out ours in bf16 (slow without bf16 matmul)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.distributed_muon " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )

    by_dim = _spawn(_fsdp_worker, args.world_size, args)
    for k, dim in enumerate(args.dim):
        if k:
            print()
        _print_fsdp(dim, by_dim[str(dim)], args)
    first = by_dim[str(args.dim[0])]
    figures: dict[str, Any] = {
        "args": vars(args) | {"json": None},
        # the first --dim's figures, where one --dim put them before
        "seconds": first["seconds"],
        "state_bytes_per_rank": first["state_bytes"],
        "max_abs_diff": first["max_abs_diff"],
        "fsdp": by_dim,  # every --dim's, by d
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
        for key in ("ours", "ours_no_overlap", "gather_all"):
            print(f"{_LABELS[key]:<48}{s[key]:>10.4f}{s[key] / s['gather_all']:>8.2f}x")
        print(
            "ours with and without overlap give bitwise the same params after one step; "
            f"ours and (b) the same (max |difference| {tp['max_abs_diff']:.1e})"
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
