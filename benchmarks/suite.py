"""The benchmark suite: every case against its peers, measured in one run.

Run from the repository root::

    python -m benchmarks                    # every case but against and quality (about 15
                                            # minutes on 2 cores)
    python -m benchmarks --cases quality    # Muon against an lr-tuned AdamW on real text
    python -m benchmarks --quick            # smaller shapes, fewer repeats
    python -m benchmarks --cases adamw,ns   # some cases
    python -m benchmarks --install-peers    # pip-install the peer libraries first

Prints one table: each case, our figure, each peer's figure from the same
run, the ratio, the target where the project sets one, and the command that
reproduces the row, each case's rows as it finishes. Peers that are not
installed or do not run are named under the table in one line, with the
reason. ``--json`` writes the rows, ``--plot`` a chart of the ratios.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.against import case_against
from benchmarks.checkpoint import case_checkpoint
from benchmarks.common import (
    FIGURE_BUDGET_S,
    MUON_LR,
    ROOT,
    Row,
    Settings,
    case_command,
    interleaved_medians,
    params_with_grads,
    short_repeats,
    stepper,
    sync,
    transformer_shapes,
)
from benchmarks.compile import case_compile
from benchmarks.muon_small import case_muon_small
from benchmarks.ns_paths import case_paths
from benchmarks.peers import MUON_PEER_NAMES, install_peers, muon_peers, peer_versions
from benchmarks.preemption import case_preemption
from benchmarks.qk_clip import case_qk_clip
from benchmarks.quality import case_quality, parse_lrs
from benchmarks.swap import case_swap
from hyper_parallel.core.errors import HyperParallelValueError

__all__ = ["CASES", "expert_shapes", "main", "plot", "plot_label", "zero_rows_note"]

# ---------------------------------------------------------------- helpers


def _faults_per_step(step: Callable[[], object], steps: int = 2) -> float:
    """Minor page faults of this process per call of ``step`` (after the calls already made).

    Every fault is a page of memory the step touched for the first time:
    buffers allocated afresh each step fault again each step.
    """
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def _step_peak_mib(step: Callable[[], object]) -> float | None:
    """MiB of resident memory one call of ``step`` adds at its peak (Linux; else ``None``).

    The process's peak RSS is reset first (``/proc/self/clear_refs``), so
    the figure is the step's own: the temporaries it makes, not what the
    process already holds (params, state, other optimizers).
    """
    status = Path("/proc/self/status")

    def field(name: str) -> float:
        line = next(x for x in status.read_text().splitlines() if x.startswith(name))
        return float(line.split()[1]) / 1024  # kB

    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = field("VmRSS:")
    except OSError:
        return None
    step()
    return max(field("VmHWM:") - before, 0.0)


def _workspace_bytes(step: Callable[[], object]) -> int:
    """The bytes of the Newton-Schulz workspace held by the optimizer ``step`` steps."""
    opt = getattr(step, "optimizer", None)
    workspace = getattr(opt, "workspace", None)
    return workspace.nbytes if workspace is not None else 0


def _projected_step_seconds(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    shapes: Sequence[tuple[int, int]],
    device: str,
) -> float:
    """A step on ``shapes``, projected from one timed step on each distinct shape.

    Each distinct shape gets its own optimizer and one warm-up step; the second
    step's time, times how often the shape occurs, is summed. For a peer that
    orthogonalizes its matrices one at a time (torch.optim.Muon, timm,
    heavyball) its step is that sum plus a little per-parameter work; one that
    batches the matrices of a shape (pytorch_optimizer 4.1.0) may take less.
    The projection lets a peer whose full step would take many minutes (bf16
    emulated on a CPU without native bf16) be compared; its rows say so.
    """
    total = 0.0
    for shape, count in Counter(shapes).items():
        params = params_with_grads([shape], device)
        step = stepper(make(params), params)
        step()
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        total += count * (time.perf_counter() - start)
    return total


# ---------------------------------------------------------------- cases


def expert_shapes(dim: int, experts: int = 8, aspect: int = 4) -> list[tuple[int, int]]:
    """An MoE layer's experts: gate and up ``(aspect d, d)`` and down ``(d, aspect d)`` each."""
    return [(aspect * dim, dim), (aspect * dim, dim), (dim, aspect * dim)] * experts


def _muon_sets(settings: Settings) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """(label, shapes, whether equal-dtype speed is held to 0.8x) of each Muon set."""
    sets = [
        (f"{len(transformer_shapes(d, settings.layers))} matrices ({settings.layers} layers, "
         f"d={d})", transformer_shapes(d, settings.layers), d >= 1024)
        for d in settings.dims
    ]  # fmt: skip
    dim = settings.dims[0]
    shapes = expert_shapes(dim)
    sets.append((f"{len(shapes)} expert matrices (8 experts, d={dim}, aspect 4)", shapes, True))
    return sets


def case_muon(settings: Settings) -> Iterator[Row]:
    """Muon step on transformer- and expert-shaped matrices: ours against every peer's Muon."""
    from hyper_parallel.core.compat import cpu_has_native_bf16
    from hyper_parallel_builtins.muon import Muon, default_ns_dtype

    device = settings.device
    peers = muon_peers(MUON_LR, settings.muon_peer_names) if settings.peers else []
    default_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[
        default_ns_dtype(torch.empty(0, device=device))
    ]
    # Defaults: on a CPU without native bf16 every peer runs bf16 emulated, and ours fp32.
    slow_bf16 = device == "cpu" and not cpu_has_native_bf16()
    for what, shapes, strict in _muon_sets(settings):
        what = f"Muon step, {what}, {device}"
        factories: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
            "ours": lambda params: Muon(params, lr=MUON_LR),
            "ours_bf16": lambda params: Muon(params, lr=MUON_LR, ns_dtype=torch.bfloat16),
        }
        factories.update({peer.name: peer.make for peer in peers if peer.make is not None})
        steps: dict[str, Callable[[], object]] = {}
        failed: dict[str, str] = {}
        projected: dict[str, float] = {}
        for name, make in factories.items():
            try:
                if not name.startswith("ours"):
                    estimate = _projected_step_seconds(make, shapes, device)
                    if estimate > FIGURE_BUDGET_S:
                        projected[name] = estimate
                        continue
                params = params_with_grads(shapes, device)  # each its own params: the same values
                steps[name] = stepper(make(params), params)
            except Exception as exc:  # reported in the table
                failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
        medians, first = interleaved_medians(steps, settings.repeats, device)
        medians.update(projected)
        command = case_command("muon", settings, f"--dims {settings.dims[0]}" if "expert" in what
                           else f"--dims {what.split('d=')[1].split(')')[0]}")  # fmt: skip
        if settings.muon_peer_names != MUON_PEER_NAMES:
            command += f" --muon-peers {','.join(settings.muon_peer_names)}"
        notes: dict[str, str] = {}
        for peer in peers or [None]:
            label = peer.name if peer else "every peer"
            value = medians.get(label)
            note = notes[label] = _muon_note(
                peer, label, failed, first, value,
                projected_from=len(set(shapes)) if label in projected else None,
            )  # fmt: skip
            target = "<= 1.0" if not slow_bf16 else "<= 0.1" if label == "torch.optim.Muon" else ""
            yield Row(f"{what}, defaults", f"ours ({default_dtype} NS)", medians["ours"],
                      f"{label} ({peer.ns_dtype if peer else '-'})", value, "s",
                      target, note, command)  # fmt: skip
        for peer in peers or [None]:
            label = peer.name if peer else "every peer"
            yield Row(f"{what}, equal NS dtype (bf16)", "ours (bf16 NS)", medians["ours_bf16"],
                      f"{label} (bf16)", medians.get(label), "s",
                      "<= 0.8" if strict else "<= 1.0",
                      "" if label in medians else notes[label], command)  # fmt: skip
        yield _matmul_limit_row(what, shapes, medians["ours"], device, command)
        faults = {name: _faults_per_step(step) for name, step in steps.items()}
        peaks = {name: _step_peak_mib(step) for name, step in steps.items()}
        workspace = _workspace_bytes(steps["ours"])
        for peer in peers:
            if peer.name in faults:
                yield Row(f"{what}, minor page faults per step", "ours", faults["ours"],
                          peer.name, faults[peer.name], "faults", command=command)  # fmt: skip
            if peaks["ours"] is not None and peer.name in peaks:
                yield Row(f"{what}, memory a step adds at its peak", "ours", peaks["ours"],
                          peer.name, peaks[peer.name], "MiB",
                          note=f"ours also keeps {workspace / 2**20:.0f} MiB of Newton-Schulz "
                               "work buffers across steps", command=command)  # fmt: skip
        del steps
        gc.collect()


def _muon_note(
    peer: Any,
    label: str,
    failed: dict[str, str],
    first: dict[str, float],
    value: float | None,
    *,
    projected_from: int | None,
) -> str:
    """Why a peer's Muon has no figure, or how its figure was taken where that differs."""
    if peer is None:
        return "--no-peers"
    if peer.make is None:
        return str(peer.reason)
    if label in failed:
        return failed[label]
    if projected_from is not None:
        return (f"projected from one step on each of its {projected_from} shapes "
                f"(a full step would take over {FIGURE_BUDGET_S:.0f} s)")  # fmt: skip
    if first[label] > FIGURE_BUDGET_S:
        return f"its first step only ({first[label]:.0f} s, over {FIGURE_BUDGET_S:.0f} s)"
    if value is not None and first[label] > 5 * value:
        return f"first step {first[label]:.1f} s (compilation), not counted"
    return ""


def _matmul_limit_row(
    what: str, shapes: Sequence[tuple[int, int]], step_s: float, device: str, command: str
) -> Row:
    """Our step against the matmul limit: the FLOPs our Newton-Schulz does, at bare GEMM speed.

    For each shape, the FLOPs of the path Muon's defaults take there (method,
    per-matrix symmetric products or batched, dtype), and the rate of the
    plain iteration's three products (``X X^T``, ``A A``, ``A X``) as
    batched ``torch.bmm`` into preallocated outputs on that shape and dtype.
    The limit is the time those FLOPs take at those rates; the ratio is the
    share of it our whole step reaches (momentum and the update included).
    """
    from hyper_parallel_builtins.muon import default_ns_dtype
    from hyper_parallel_builtins.newton_schulz import newton_schulz_flops, resolve_ns_method
    from hyper_parallel_builtins.newton_schulz._iterate import SYMMETRIC_BLOCK_ROWS
    from hyper_parallel_builtins.newton_schulz._paths import PER_MATRIX_FROM, cpu_path

    dtype = default_ns_dtype(torch.empty(0, device=device))
    steps, done, limit_s = 5, 0.0, 0.0
    for (rows, cols), count in Counter(shapes).items():
        small, large = min(rows, cols), max(rows, cols)
        method = resolve_ns_method("auto", rows, cols, torch.device(device))
        symmetric = (
            method == "standard"
            and small >= PER_MATRIX_FROM
            and cpu_path(dtype, torch.device(device)).per_matrix
        )
        flops = (
            _ns_flops(count, rows, cols, steps, SYMMETRIC_BLOCK_ROWS)
            if symmetric
            else count * newton_schulz_flops(rows, cols, steps, method)
        )
        done += flops
        rate = _ns_flops(count, rows, cols, 1) / _products_seconds(
            count, small, large, dtype, device
        )
        limit_s += flops / rate
    return Row(
        f"{what}, share of the matmul limit", "ours (its Newton-Schulz FLOPs per step time)",
        done / step_s / 1e9, "torch.bmm on the same shapes and dtype", done / limit_s / 1e9,
        "GFLOP/s", note=f"the limit: {limit_s:.3f} s of GEMMs in {dtype}".replace("torch.", ""),
        command=command,
    )  # fmt: skip


def _products_seconds(count: int, small: int, large: int, dtype: torch.dtype, device: str) -> float:
    """Seconds of one plain Newton-Schulz step's three products on ``count`` matrices, as bare bmm."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(count, small, large, generator=gen).to(device, dtype)
    a = torch.randn(count, small, small, generator=gen).to(device, dtype)
    gram_out, x_out = torch.empty_like(a), torch.empty_like(x)

    def products() -> None:
        torch.bmm(x, x.mT, out=gram_out)
        torch.bmm(a, a, out=gram_out)
        torch.bmm(a, x, out=x_out)

    return interleaved_medians({"mm": products}, 3, device)[0]["mm"]


def case_gram(settings: Settings) -> Iterator[Row]:
    """Gram Newton-Schulz against the standard iteration on long matrices, fp32 and bf16."""
    from hyper_parallel_builtins.newton_schulz import newton_schulz_batched, resolve_coefficients

    dim = settings.dims[0]
    coefficients = resolve_coefficients("keller", 5)
    sets = [
        ("MLP", 2.7, [(dim, -(-8 * dim // 3 // 32) * 32)] * 3 * settings.layers),
        ("MLP", 3.5, [(dim, dim * 7 // 2)] * 3 * settings.layers),
        ("experts", 4.0, [(dim, 4 * dim)] * 24),
        ("experts", 8.0, [(dim // 2, 4 * dim)] * 24),
    ]
    gen = torch.Generator().manual_seed(0)
    for kind, aspect, shapes in sets:
        for dtype in (torch.float32, torch.bfloat16):
            matrices = [torch.randn(s, generator=gen).to(settings.device) for s in shapes]
            steps = {
                method: functools.partial(
                    newton_schulz_batched, matrices, coefficients, dtype=dtype, method=method
                )
                for method in ("gram", "standard")
            }
            medians, _ = interleaved_medians(steps, settings.repeats, settings.device)
            name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
            yield Row(
                f"Newton-Schulz, {len(shapes)} {kind} matrices {shapes[0][0]} x {shapes[0][1]} "
                f"(aspect {aspect}), {name}, {settings.device}",
                "ns_method='gram'", medians["gram"], "ns_method='standard'",
                medians["standard"], "s", "<= 0.85" if aspect == 4.0 else "", "",
                case_command("gram", settings, f"--dims {dim}"),
            )  # fmt: skip
            del matrices
            gc.collect()


def _ns_flops(batch: int, rows: int, cols: int, steps: int, block_rows: int | None = None) -> float:
    """FLOPs of ``steps`` Newton-Schulz iterations on ``batch`` matrices.

    With ``block_rows``, ``X X^T`` and ``A A`` count only their lower block
    triangle in row stripes of that many rows, as the symmetric products do.
    """
    small, large = min(rows, cols), max(rows, cols)
    # entries of the s x s Gram-shaped products that are multiplied out
    entries = small * small
    if block_rows is not None and small > block_rows:
        edges = [*range(0, small, block_rows), small]
        entries = sum((stop - start) * stop for start, stop in itertools.pairwise(edges))
    # per step: X X^T (2 l per entry), A A (2 s per entry), B X (2 s^2 l)
    return float(steps * batch * (2 * large * entries + 2 * small * entries + 2 * small**2 * large))


# x, a, the Gram-shaped output, the x-shaped output, and how many matmul triples
_MmOperands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


def case_ns(settings: Settings) -> Iterator[Row]:
    """Newton-Schulz FLOP/s against torch.mm's on the same shapes and dtype."""
    from hyper_parallel_builtins.newton_schulz import KELLER_COEFFICIENTS

    steps = 5
    coefficients = [KELLER_COEFFICIENTS] * steps
    for dim in settings.dims:
        yield from _ns_rows(settings, dim, coefficients, steps)


def _ns_rows(
    settings: Settings, dim: int, coefficients: list[tuple[float, float, float]], steps: int
) -> Iterator[Row]:
    from hyper_parallel_builtins.newton_schulz import newton_schulz_batched
    from hyper_parallel_builtins.newton_schulz._iterate import SYMMETRIC_BLOCK_ROWS
    from hyper_parallel_builtins.newton_schulz._paths import PER_MATRIX_FROM

    device = settings.device
    # ours: the FLOPs it does; on CPU from PER_MATRIX_FROM the symmetric products skip some
    block_rows = SYMMETRIC_BLOCK_ROWS if dim >= PER_MATRIX_FROM and device == "cpu" else None
    shapes = transformer_shapes(dim, settings.layers)
    buckets: dict[tuple[int, int], int] = {}
    for shape in shapes:
        buckets[shape] = buckets.get(shape, 0) + 1
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        stacks = {s: [torch.randn(s, generator=gen).to(device, dtype) for _ in range(n)]
                  for s, n in buckets.items()}  # fmt: skip
        flops = sum(_ns_flops(n, *s, steps) for s, n in buckets.items())
        done = sum(_ns_flops(n, *s, steps, block_rows) for s, n in buckets.items())
        note = ""
        if done < flops:
            note = (
                f"ours does {done / flops:.0%} of the plain iteration's FLOPs (symmetric products)"
            )

        def ours(stacks: dict[tuple[int, int], list[torch.Tensor]] = stacks) -> None:
            for matrices in stacks.values():
                newton_schulz_batched(matrices, coefficients, dtype=matrices[0].dtype)

        # The limit: the same matmuls (X X^T, A A, B X per matrix and step) as bare
        # torch.mm into preallocated outputs.
        operands: list[_MmOperands] = []
        for (rows, cols), n in buckets.items():
            small, large = min(rows, cols), max(rows, cols)
            x = torch.randn(small, large, generator=gen).to(device, dtype)
            a = torch.randn(small, small, generator=gen).to(device, dtype)
            operands.append((x, a, torch.empty_like(a), torch.empty_like(x), n * steps))

        def mm_only(operands: list[_MmOperands] = operands) -> None:
            for x, a, gram_out, x_out, count in operands:
                for _ in range(count):
                    torch.mm(x, x.T, out=gram_out)
                    torch.mm(a, a, out=gram_out)
                    torch.mm(a, x, out=x_out)

        medians, _ = interleaved_medians({"ours": ours, "mm": mm_only}, settings.repeats, device)
        name = "fp32" if dtype == torch.float32 else "bf16"
        yield Row(
            f"Newton-Schulz FLOP/s, d={dim} x {settings.layers} layers' matrices, {name}, {device}",
            "ours (newton_schulz_batched)", done / medians["ours"] / 1e9,
            "torch.mm on the same shapes", flops / medians["mm"] / 1e9, "GFLOP/s",
            ">= 0.85", note, case_command("ns", settings, f"--dims {dim}"),
        )  # fmt: skip


def _model_tensors(dim: int, layers: int) -> list[tuple[int, ...]]:
    """Every param of the blocks: the matrices plus two norm weights per block."""
    return [*transformer_shapes(dim, layers), *[(dim,)] * 2 * layers]


def case_adamw(settings: Settings) -> Iterator[Row]:
    """AdamW step: ours against torch.optim.AdamW fused and foreach."""
    from hyper_parallel.core.optimizer import AdamW

    dim = settings.dims[0]
    shapes = _model_tensors(dim, settings.layers)
    device = settings.device
    params = params_with_grads(shapes, device)
    ours = AdamW(params, lr=1e-3)
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    foreach = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    medians, _ = interleaved_medians(
        {"ours": ours.step, "fused": fused.step, "foreach": foreach.step},
        short_repeats(settings), device,
    )  # fmt: skip
    what = f"AdamW step, {len(shapes)} tensors (d={dim} x {settings.layers} layers), {device}"
    command = case_command("adamw", settings)
    yield Row(what, "ours (AdamW)", medians["ours"], "torch AdamW fused", medians["fused"], "s",
              "<= 1.05", "", command)  # fmt: skip
    yield Row(what, "ours (AdamW)", medians["ours"], "torch AdamW foreach", medians["foreach"],
              "s", "", "", command)  # fmt: skip


def case_chained(settings: Settings) -> Iterator[Row]:
    """ChainedOptimizer step against stepping its sub-optimizers directly."""
    from hyper_parallel.core.optimizer import AdamW, ChainedOptimizer

    dim = settings.dims[0]
    device = settings.device
    params = params_with_grads(_model_tensors(dim, settings.layers), device)
    matrices = [p for p in params if p.ndim == 2]
    vectors = [p for p in params if p.ndim < 2]
    # AdamW on both sides keeps the step short, so the wrapper's own cost shows. Both
    # sides step the same two optimizers, so state, memory and caches are the same.
    chained = ChainedOptimizer({"matrices": AdamW(matrices, lr=1e-3),
                                "vectors": AdamW(vectors, lr=1e-3)})  # fmt: skip
    parts = list(chained.optimizers.values())

    def step_directly() -> None:
        for opt in parts:
            opt.step()

    medians, _ = interleaved_medians(
        {"chained": chained.step, "direct": step_directly}, short_repeats(settings), device
    )
    yield Row(
        f"ChainedOptimizer of 2 AdamWs (d={dim} x {settings.layers} layers), {device}",
        "ChainedOptimizer.step", medians["chained"], "the two steps called directly",
        medians["direct"], "s", "<= 1.03",
        f"overhead {1e6 * (medians['chained'] - medians['direct']):+.0f} us per step",
        case_command("chained", settings),
    )  # fmt: skip


#: Distributed Muon at 2 ranks against one process: the target by model width.
_DIST_TARGETS = {256: "<= 0.75", 512: "<= 0.6"}


def case_distributed(settings: Settings) -> Iterator[Row]:
    """Distributed Muon (benchmarks/distributed_muon.py): FSDP at 2 ranks, FSDP x TP at 4."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dist.json"
        args = ["--dim", *map(str, settings.dist_dims), "--layers", str(settings.dist_layers),
                "--tp-dim", str(settings.dist_tp_dim), "--tp-layers", str(settings.dist_tp_layers),
                "--repeats", str(max(1, settings.repeats // 2 + 1))]  # fmt: skip
        if not settings.peers:
            args.append("--skip-torch")
        command = "python -m benchmarks.distributed_muon " + " ".join(args)
        result = subprocess.run([sys.executable, "-m", "benchmarks.distributed_muon", *args,
                                 "--json", str(out)], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        if result.returncode != 0:
            # Every rank's traceback, not only the last line the row keeps.
            print(result.stderr[-4000:], file=sys.stderr)
            yield Row("Distributed Muon, 2 ranks", "ours", None, "-", None, "s",
                      note=result.stderr.strip().splitlines()[-1][:120], command=command)  # fmt: skip
            return
        data = json.loads(out.read_text())
    for dim in settings.dist_dims:
        yield from _fsdp_rows(data["fsdp"][str(dim)], dim, settings.dist_layers, command)
    tp = data["fsdp_tp"]
    what = (f"Distributed Muon step on FSDP x TP, 4 ranks (dp=2, tp=2) x 1 thread, gloo, "
            f"d={tp['dim']} x {tp['layers']} layers")  # fmt: skip
    note = f"same run; 4 processes on {os.cpu_count()} cores"
    for key, label in (
        ("ours", "ours (overlapped exchange)"),
        ("ours_no_overlap", "ours, no overlap"),
    ):
        yield Row(what, label, tp["seconds"][key], "every rank gathers every matrix",
                  tp["seconds"]["gather_all"], "s", "", note, command)  # fmt: skip


def _fsdp_rows(record: dict[str, Any], dim: int, layers: int, command: str) -> Iterator[Row]:
    s, state = record["seconds"], record["state_bytes"]
    what = f"Distributed Muon step, 2 ranks x 1 thread, gloo, d={dim} x {layers} layers"
    yield Row(what, "ours (fsdp, overlapped exchange)", s["ours"], "one process, 1 thread",
              s["one_process"], "s", _DIST_TARGETS.get(dim, ""), "", command)  # fmt: skip
    yield Row(what, "ours (fsdp, no overlap)", s["ours_no_overlap"], "one process, 1 thread",
              s["one_process"], "s", "", "HYPER_PARALLEL_EXCHANGE_OVERLAP=0", command)  # fmt: skip
    yield Row(what, "ours (fsdp, overlapped exchange)", s["ours"],
              "every rank gathers every matrix", s["gather_all"], "s", "<= 1.0", "", command)  # fmt: skip
    if "torch_muon" in s:
        yield Row(what, "ours, bf16 NS", s["ours_bf16"], "torch.optim.Muon on the DTensors (bf16)",
                  s["torch_muon"], "s", "<= 1.0", "", command)  # fmt: skip
    yield Row(f"Muon state per rank (MiB), d={dim}", "ours, per rank", state["ours"] / 2**20,
              "one process", state["one_process"] / 2**20, "MiB", "<= 0.5",
              "momentum buffers only, local shards", command)  # fmt: skip


_IMPORT_TORCH = "import torch"
_IMPORT_OURS = (
    "import hyper_parallel; r = hyper_parallel.get_registry(); "
    "assert len([e.name for e in r.entries()]) > 10"
)
#: The user guide's import line.
_IMPORT_GUIDE = (
    "from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer"
)


def _python_seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def case_import(settings: Settings) -> Iterator[Row]:
    """The guide's import, and ``import hyper_parallel`` listing every plugin, against ``import torch``."""
    runs = max(5, settings.repeats)
    guide, ours, torch_only = [], [], []
    _python_seconds(_IMPORT_OURS)  # warm the file cache for all three
    for _ in range(runs):
        torch_only.append(_python_seconds(_IMPORT_TORCH))
        ours.append(_python_seconds(_IMPORT_OURS))
        guide.append(_python_seconds(_IMPORT_GUIDE))
    baseline = statistics.median(torch_only)
    yield Row(
        "New process: the guide's import", "from hyper_parallel.core.optimizer import ...",
        statistics.median(guide), "import torch", baseline, "s", "<= 1.15",
        f"median of {runs} processes each", case_command("import", settings),
    )  # fmt: skip
    yield Row(
        "New process: import and list every plugin", "import hyper_parallel + list plugins",
        statistics.median(ours), "import torch", baseline, "s", "<= 1.15",
        f"median of {runs} processes each", case_command("import", settings),
    )  # fmt: skip


CASES: dict[str, Callable[[Settings], Iterator[Row]]] = {
    "muon": case_muon,
    "muon_small": case_muon_small,
    "ns": case_ns,
    "gram": case_gram,
    "adamw": case_adamw,
    "chained": case_chained,
    "distributed": case_distributed,
    "import": case_import,
    "checkpoint": case_checkpoint,
    "swap": case_swap,
    "paths": case_paths,
    "preemption": case_preemption,
    "compile": case_compile,
    "qk_clip": case_qk_clip,
    "against": case_against,
    "quality": case_quality,
}

#: What ``--cases`` runs when not given: every case but ``against``, which needs ``--against``,
#: and ``quality``, which trains for minutes.
DEFAULT_CASES = [name for name in CASES if name not in ("against", "quality")]


# ---------------------------------------------------------------- output


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
    return f"{value:,.1f} {unit}"


_HEADER = ("| case | ours | figure | peer | figure | ours / peer | target | note |\n"
           "|---|---|---|---|---|---|---|---|")  # fmt: skip


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (it also reads well in a terminal); see :func:`table_rows`."""
    return "\n".join([_HEADER, *table_rows(rows)])


def _unmeasured(rows: Sequence[Row]) -> list[Row]:
    """Rows of ours against a peer without a figure: the peers :func:`not_measured_line` names."""
    return [r for r in rows if r.ours is not None and r.peer is None]


def table_rows(rows: Sequence[Row]) -> list[str]:
    """The table's lines for ``rows``, without the header: one per figure compared.

    A row whose peer has no figure is left out, and its peer named under the
    table instead, unless no peer of that figure of ours was measured: then
    the figure's first row stays, against "(no peer measured)".
    """
    compared = {(r.case, r.ours_label) for r in rows if r.peer is not None}
    unmeasured = {id(r) for r in _unmeasured(rows)}
    shown: set[tuple[str, str]] = set()
    lines = []
    for r in rows:
        key = (r.case, r.ours_label)
        if id(r) in unmeasured:
            if key in compared or key in shown:
                continue
            r = replace(r, peer_label="(no peer measured)", note="")
        shown.add(key)
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        target = r.target and f"{r.target} ({'met' if r.met else 'not met'})"
        if r.target and r.met is None:
            target = f"{r.target} (no figure)"
        lines.append(f"| {r.case} | {r.ours_label} | {_fmt(r.ours, r.unit)} | {r.peer_label} | "
                     f"{_fmt(r.peer, r.unit)} | {ratio} | {target} | {r.note} |")  # fmt: skip
    return lines


def not_measured_line(rows: Sequence[Row]) -> str | None:
    """One line naming each peer left out of the table, with why; ``None`` if none was."""
    why: dict[str, str] = {}
    for r in _unmeasured(rows):
        name = r.peer_label.split(" (")[0]  # "timm (bf16)": timm
        why.setdefault(name, r.note or "no figure")
    if not why:
        return None
    return "Not measured: " + "; ".join(f"{name} ({note})" for name, note in why.items())


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        **{f"peer {k}": v for k, v in peer_versions().items()},
    }


_LABEL_TAGS = ("defaults", "equal NS dtype", "fp32", "bf16", "2 ranks")


def plot_label(row: Row) -> str:
    """A short label for ``row`` that still tells rows apart: size, dtype, both sides."""
    tags = re.findall(r"d=\d+", row.case)[:1] + [t for t in _LABEL_TAGS if t in row.case]
    name = re.sub(r"\s*\([^)]*\)", "", row.case.split(",")[0])
    head = " ".join([name, *tags])
    return f"{head}: {row.ours_label} vs {row.peer_label}"


def _has_zero(row: Row) -> bool:
    """Whether both sides of ``row`` have a figure and one of them is 0 (no log ratio)."""
    return row.ours is not None and row.peer is not None and 0 in (row.ours, row.peer)


def zero_rows_note(rows: Sequence[Row]) -> str | None:
    """The chart's line naming the rows it leaves out because a figure is 0; ``None`` if none.

    A ratio of 0 (ours 0, e.g. no page faults per step) or a peer of 0 has no
    logarithm, so such rows get no bar; their figures are in the table.
    """
    zeros = [r for r in rows if _has_zero(r)]
    if not zeros:
        return None
    named = "; ".join(f"{plot_label(r)} ({_fmt(r.ours, r.unit)} vs {_fmt(r.peer, r.unit)})"
                      for r in zeros)  # fmt: skip
    return f"Not drawn, a figure of 0 has no log ratio: {named}"


def plot(rows: Sequence[Row], path: Path) -> str | None:
    """A horizontal bar per row with a ratio: ours / peer, with the target marked.

    Rows with a figure of 0 are left out and named under the chart; returns
    that note (:func:`zero_rows_note`), ``None`` if every row was drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.ratio is not None and not _has_zero(r)]
    note = zero_rows_note(rows)
    fig, ax = plt.subplots(figsize=(13, 0.38 * len(shown) + 1.5))
    labels = [plot_label(r) for r in shown]
    labels = [label if len(label) <= 95 else label[:92] + "..." for label in labels]
    colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[r.met] for r in shown]
    ax.barh(range(len(shown)), [math.log2(r.ratio) for r in shown], color=colors)  # type: ignore[arg-type]
    for i, r in enumerate(shown):
        if r.target:
            bound = float(r.target.split()[1])
            ax.plot([math.log2(bound)] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "log2(ours / peer): left is less time (s) or fewer FLOP/s; black tick: target\n"
        "green: target met, red: not met, grey: no target"
    )
    ax.set_title("hyper_parallel against its peers, one run")
    if note is not None:
        ax.annotate(textwrap.fill(note, 180), (0, 0), xycoords="figure fraction",
                    xytext=(4, -4), textcoords="offset points", va="top", fontsize=7)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return note


def _plot_and_say(rows: Sequence[Row], path: Path) -> None:
    """:func:`plot` the rows to ``path``, and print the rows it leaves out (a figure of 0)."""
    if (note := plot(rows, path)) is not None:
        print(note, file=sys.stderr)


def _from_json(path: Path, plot_path: Path | None) -> int:
    """Print the table of a run saved with ``--json`` (and plot it): no new figures."""
    saved = json.loads(path.read_text())
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in saved["rows"]]
    print("Machine: " + "; ".join(f"{k} {v}" for k, v in saved["machine"].items()))
    print(format_table(rows))
    _print_footer(rows)
    if plot_path:
        _plot_and_say(rows, plot_path)
    return 0


def _print_footer(rows: Sequence[Row]) -> None:
    """Under the table: the peers it leaves out, and the command of each row."""
    if (line := not_measured_line(rows)) is not None:
        print(line)
    print()
    print("Reproduce a row:")
    for command in dict.fromkeys(r.command for r in rows if r.command):
        print(f"  {command}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, from {', '.join(CASES)} (default: all but "
                        "against and quality)")  # fmt: skip
    parser.add_argument("--against", metavar="REV",
                        help="with --cases against: the commit this checkout's Muon step is "
                        "timed against, in the same run")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="d=256 x 4 layers, fewer repeats: minutes, not tens of minutes")  # fmt: skip
    parser.add_argument("--dims", help="comma-separated model widths (default 512,1024)")
    parser.add_argument("--layers", type=int, help="blocks per model (default 8)")
    parser.add_argument("--repeats", type=int, help="timed steps per figure (default 5)")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, or auto: cuda where present, else cpu")  # fmt: skip
    parser.add_argument("--no-peers", action="store_true", help="measure ours alone")
    parser.add_argument("--muon-peers", metavar="NAMES",
                        help=f"comma-separated, from {', '.join(MUON_PEER_NAMES)} (default: all)")  # fmt: skip
    parser.add_argument("--install-peers", action="store_true",
                        help="pip-install the peers into .bench-peers/ first (--no-deps)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows and the machine here")
    parser.add_argument("--plot", type=Path, help="write a PNG chart of the ratios here")
    parser.add_argument("--seeds", type=int, metavar="N",
                        help="with --cases quality: train each run on seeds 0..N-1 and print "
                        "the spread (default 1)")  # fmt: skip
    parser.add_argument("--init", choices=("gpt2", "torch"),
                        help="with --cases quality: the model's init, gpt2 (N(0, 0.02), the "
                        "default) or torch (PyTorch's module defaults)")  # fmt: skip
    parser.add_argument("--muon-lrs", metavar="LRS",
                        help="with --cases quality: also train Muon at each of these "
                        "comma-separated lrs, the AdamW half at the tuned AdamW lr")  # fmt: skip
    parser.add_argument("--loss-plot", type=Path, metavar="PNG",
                        help="with --cases quality: write the loss curves here (default "
                        "runs/benchmarks/quality_losses.png)")  # fmt: skip
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="measure nothing: print the table (and --plot) of a --json file; "
                        "the options that choose what to measure are ignored")  # fmt: skip
    args = parser.parse_args(argv)
    if args.from_json:
        return _from_json(args.from_json, args.plot)

    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.install_peers and install_peers() != 0:
        print("installing the peers failed; they are listed with the reason", file=sys.stderr)
    settings = Settings()
    if args.quick:
        settings = Settings(dims=(256,), layers=4, repeats=3, dist_dims=(256,), dist_layers=2,
                            dist_tp_dim=128, checkpoint_params=5_000_000, quick_flag="--quick")  # fmt: skip
    if args.dims:
        settings.dims = tuple(int(d) for d in args.dims.split(","))
    if args.layers:
        settings.layers = args.layers
    if args.repeats:
        settings.repeats = args.repeats
    settings.peers = not args.no_peers
    if "against" in names and not args.against:
        parser.error("--cases against needs --against REV (a commit, tag or branch)")
    if args.against:
        settings.extra["against"] = args.against
    if args.seeds is not None:
        if args.seeds < 1:
            parser.error(f"--seeds must be >= 1, got {args.seeds}")
        settings.extra["seeds"] = str(args.seeds)
    if args.loss_plot:
        settings.extra["loss_plot"] = str(args.loss_plot)
    if args.init:
        settings.extra["init"] = args.init
    if args.muon_lrs is not None:
        try:
            parse_lrs(args.muon_lrs)
        except HyperParallelValueError as error:
            parser.error(str(error))
        settings.extra["muon_lrs"] = args.muon_lrs
    if args.muon_peers:
        chosen = tuple(n.strip() for n in args.muon_peers.split(",") if n.strip())
        if not chosen or set(chosen) - set(MUON_PEER_NAMES):
            parser.error(
                f"--muon-peers {args.muon_peers}: choose from {', '.join(MUON_PEER_NAMES)}"
            )
        settings.muon_peer_names = chosen
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    settings.device = device

    info = machine()
    print("Machine: " + "; ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    print(_HEADER, flush=True)
    rows: list[Row] = []
    for name in names:  # each case's rows as it finishes: the table is printed once
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        measured = list(CASES[name](settings))
        rows.extend(measured)
        for line in table_rows(measured):
            print(line, flush=True)
    _print_footer(rows)
    if args.json:
        args.json.write_text(json.dumps(
            {"machine": info, "rows": [asdict(r) | {"ratio": r.ratio, "met": r.met} for r in rows]},
            indent=2,
        ))  # fmt: skip
    if args.plot:
        _plot_and_say(rows, args.plot)
    return 0
