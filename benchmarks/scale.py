"""A cost model of one distributed Muon + AdamW step, from 2 ranks to 16,384.

Nobody can run 16k ranks here, so the step is modeled, the model is checked
against what runs here, and its predictions say what to expect before launch.

For a model's matrices (Muon) and other params (AdamW), ``R`` ranks on the
default HSDP mesh (nodes of 8 ranks, or one node below that), and each
transport of the owner exchange, it predicts per rank:

* the bytes each rank sends and receives per step (the busiest rank);
* Newton-Schulz FLOPs (the busiest rank, after owner assignment by FLOPs,
  and with one owner per matrix over all ranks, replicas included);
* optimizer state bytes (the momentum and the moments of its shards);
* the step time: the exchange (:mod:`hyper_parallel_builtins.fsdp_backend.cost`)
  plus Newton-Schulz at the profile's matmul rate plus the element-wise work
  at its memory rate, without overlap (an upper bound).

The plan is the ``fsdp`` backend's own rule (owners by FLOPs, buckets of
:func:`~hyper_parallel_builtins.fsdp_backend._plan.bucket_bytes`, one sender per
distinct piece), computed for even ``Shard(0)`` row shards without
building the ranks' tensors.

Commands::

    python -m benchmarks.scale --calibrate --profile cpu.json
    python -m benchmarks.scale --validate --json validation.json
    python -m benchmarks.scale --model llama-70b --ranks 8,64,1024,16384 --json p.json --plot p.png
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import transformer_shapes
from benchmarks.distributed_muon import step_seconds
from hyper_parallel_builtins.fsdp_backend.cost import (
    TRANSPORTS,
    DeviceProfile,
    LinkCost,
    Trip,
    choose_replica_group,
    choose_team_size,
    device_profile,
    exchange_trips,
    named_profile,
    team_link,
    team_seconds,
    transport_bytes,
    transport_seconds,
)

#: Ranks per node of the default HSDP mesh in predictions.
RANKS_PER_NODE = 8
NS_STEPS = 5
#: Passes over each optimizer-state element per step (momentum lerp, look-ahead,
#: decay, update: read and write) and over each AdamW element (two moments, update).
MUON_PASSES, ADAMW_PASSES = 8, 14


@dataclass(frozen=True)
class Params:
    """A model's params: matrices for Muon (shape, count) and the element count for AdamW."""

    name: str
    matrices: tuple[tuple[tuple[int, int], int], ...]
    adamw_elements: int

    @property
    def muon_elements(self) -> int:
        return sum(r * c * n for (r, c), n in self.matrices)


def _dense(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int,
           head_dim: int | None = None, tied: bool = False) -> Params:  # fmt: skip
    head = head_dim or hidden // heads
    per_layer = [((heads * head, hidden), 1), ((kv * head, hidden), 2), ((hidden, heads * head), 1),
                 ((inter, hidden), 2), ((hidden, inter), 1)]  # fmt: skip
    matrices = tuple((shape, n * layers) for shape, n in per_layer)
    embeddings = vocab * hidden * (1 if tied else 2)
    return Params(name, matrices, embeddings + hidden * (2 * layers + 1))


def _moe(name: str, hidden: int, layers: int, dense_layers: int, dense_inter: int, experts: int,
         shared: int, expert_inter: int, heads: int, vocab: int) -> Params:  # fmt: skip
    # multi-head latent attention (DeepSeek-V3's shapes), then dense or expert MLPs
    attention = [((1536, hidden), 1), ((heads * 192, 1536), 1), ((576, hidden), 1),
                 ((heads * 256, 512), 1), ((hidden, heads * 128), 1)]  # fmt: skip
    mlp = [((dense_inter, hidden), 2 * dense_layers), ((hidden, dense_inter), dense_layers)]
    moe_layers = layers - dense_layers
    per_expert = (experts + shared) * moe_layers
    mlp += [((expert_inter, hidden), 2 * per_expert), ((hidden, expert_inter), per_expert),
            ((experts, hidden), moe_layers)]  # fmt: skip
    matrices = tuple((s, n * layers) for s, n in attention) + tuple(mlp)
    return Params(name, matrices, 2 * vocab * hidden + hidden * (2 * layers + 1))


#: Built-in shapes (public configurations: Llama 3 8B and 70B, DeepSeek-V3).
MODELS: dict[str, Callable[[], Params]] = {
    "llama-8b": lambda: _dense("llama-8b", 4096, 14336, 32, 32, 8, 128256),
    "llama-70b": lambda: _dense("llama-70b", 8192, 28672, 80, 64, 8, 128256),
    "deepseek-v3-moe": lambda: _moe(
        "deepseek-v3-moe", 7168, 61, 3, 18432, 256, 1, 2048, 128, 129280
    ),
}


def params_from_config(path: Path) -> Params:
    """A Hugging Face ``config.json``: a Llama-style dense model, or one with ``num_local_experts``."""
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads", heads))
        dense = _dense(path.stem, hidden, int(c["intermediate_size"]), layers, heads, kv,
                       int(c["vocab_size"]), c.get("head_dim"), bool(c.get("tie_word_embeddings")))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"--model {path}: not a usable config.json ({type(exc).__name__}: {exc})"
        ) from None
    experts = int(c.get("num_local_experts", 0))
    if not experts:
        return dense
    attention, mlp = dense.matrices[:3], dense.matrices[3:]
    routed = (*tuple((shape, n * experts) for shape, n in mlp), ((experts, hidden), layers))
    return dataclasses.replace(dense, matrices=attention + routed)


# ---------------------------------------------------------------- the plan


def _shard_rows(rows: int, shards: int) -> list[int]:
    """Rows of each ``Shard(0)`` shard, as torch chunks them (ceil division, the last short)."""
    chunk = -(-rows // shards)
    return [max(0, min(chunk, rows - s * chunk)) for s in range(shards)]


def rank_bytes(trip: Trip, transport: str, element_size: int = 4) -> torch.Tensor:
    """Per rank, sent plus received over one trip (what payload counting measures)."""
    return torch.tensor([sum(pair) for pair in transport_bytes(trip, element_size, transport)],
                        dtype=torch.float64)  # fmt: skip


@functools.cache
def muon_group() -> dict[str, Any]:
    """The Muon param group the model plans and calibrates with: Muon's defaults."""
    from hyper_parallel_builtins.muon import Muon

    group = dict(Muon([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0])
    del group["params"]
    return group


@dataclass
class ModeledExchange:
    """The exchange of one step in one group of replicas: each bucket's trips and spread, FLOPs.

    The group is ``replica_group`` rows (replicas) of ``shards`` ranks; the
    job's other groups do the same. With teams (``team_size > 1``) each
    matrix is shared by a team of consecutive ranks; a member's
    Newton-Schulz FLOPs and the team's own collectives are its share.
    """

    trips: list[tuple[Trip, Trip]]
    #: per bucket and column (shard), the elements of the all-gather's widest row
    spread: list[torch.Tensor]
    flops: torch.Tensor  # per rank of the group, over the step
    #: per bucket, the busiest member's seconds: without overlap every rank waits for it
    bucket_seconds: list[float]
    team_bytes: torch.Tensor  # per rank: the teams' all-reduces and all-gathers
    team_size: int
    replica_group: int
    shards: int


def plan_exchange(params: Params, ranks: int, shards: int, ns_dtype: torch.dtype,
                  profile: DeviceProfile, device: str = "cuda", team_size: int | None = None,
                  replica_group: int | None = None) -> ModeledExchange:  # fmt: skip
    """The ``fsdp`` backend's plan for ``params`` row-sharded over ``shards`` ranks, replicated.

    ``team_size``: ranks per matrix; ``replica_group``: replicas that share
    the work. ``None`` chooses as the backend's ``"auto"`` does with ``profile``.
    """
    from hyper_parallel.core.distributed.toolkit import assign_owners, exchange_rounds
    from hyper_parallel_builtins.fsdp_backend._plan import bucket_bytes
    from hyper_parallel_builtins.muon import MuonTeam
    from hyper_parallel_builtins.newton_schulz import newton_schulz_flops, resolve_ns_method

    team = MuonTeam(muon_group(), ns_dtype)
    shapes = [torch.Size(shape) for shape, n in params.matrices for _ in range(n)]
    methods = [resolve_ns_method("auto", r, c, torch.device(device)) for r, c in shapes]
    flops = [
        newton_schulz_flops(r, c, NS_STEPS, m) for (r, c), m in zip(shapes, methods, strict=True)
    ]
    node = min(RANKS_PER_NODE, ranks)
    group = replica_group or choose_replica_group(
        shapes, flops, team if team_size is None else None, shards, ranks // shards, profile,
        node, TRAVEL_BYTES, team_size or 1,
    )  # fmt: skip
    world = group * shards  # the ranks of one group of replicas
    size = team_size or choose_team_size(shapes, flops, team, world, profile, node)
    link = team_link(profile, size, node)
    if size > 1:  # teams run the standard iteration
        flops, methods = [team.cost(s, size) for s in shapes], ["standard"] * len(shapes)
    owners = assign_owners(flops, world // size, rows=group)
    element_size = torch.empty(0, dtype=ns_dtype).element_size()
    seconds, moved = [], []
    for shape, f, method in zip(shapes, flops, methods, strict=True):
        collectives = team.collectives(shape, size) if size > 1 else []
        rate = profile.matmul_rate(str(ns_dtype).removeprefix("torch."), min(shape), method)
        seconds.append(team_seconds(f, collectives, size, element_size, rate, link))
        moved.append(sum(_collective_bytes(kind, n, size) for kind, n in collectives)
                     * element_size)  # fmt: skip
    per_rank = torch.zeros(world, dtype=torch.float64)
    team_bytes = torch.zeros(world, dtype=torch.float64)
    for f, b, o in zip(flops, moved, owners, strict=True):
        per_rank[o * size : (o + 1) * size] += f
        team_bytes[o * size : (o + 1) * size] += b
    nbytes = [s.numel() * TRAVEL_BYTES // size for s in shapes]
    rounds = exchange_rounds(nbytes, [ns_dtype] * len(shapes), owners, world // size,
                             bucket_bytes(nbytes, owners, world // size))  # fmt: skip
    trips, spread, bucket_seconds = [], [], []
    for r in rounds:
        items = [(i, shapes[i], owners[i], team.split_dim(shapes[i])) for i in r]
        to, back, widths = _bucket_trips(items, world, shards, size)
        trips.append((to, back))
        spread.append(widths)
        load: dict[int, float] = {}
        for i in r:
            load[owners[i]] = load.get(owners[i], 0.0) + seconds[i]
        bucket_seconds.append(max(load.values(), default=0.0))
    return ModeledExchange(trips, spread, per_rank, bucket_seconds, team_bytes, size, group, shards)


def _collective_bytes(kind: str, elements: int, members: int) -> float:
    """Elements one rank sends plus receives in a ring all-reduce or all-gather of ``elements``."""
    steps = (members - 1) * (2 if kind == "all_reduce" else 1)
    return 2 * steps / members * elements


@dataclass(frozen=True)
class _MemberPieces:
    """What one team member of one matrix takes from each shard: elements, and who has any."""

    per_shard: torch.Tensor  # int64, one entry per shard; read only (shared by the cache)
    nonzero: tuple[tuple[int, int], ...]  # (shard, elements) of the shards that give any


@functools.cache
def _member_pieces(height: int, cols: int, shards: int, size: int, k: int,
                   along_rows: bool) -> _MemberPieces:  # fmt: skip
    """Member ``k`` of ``size``'s band of a ``height x cols`` matrix, cut by ``Shard(0)``.

    Thousands of matrices share a shape (experts, layers), so each shape's
    answer is worked out once.
    """
    shard_rows = _shard_rows(height, shards)
    length = height if along_rows else cols
    lo, hi = k * length // size, (k + 1) * length // size
    if along_rows:
        starts = itertools.accumulate(shard_rows[:-1], initial=0)
        pieces = [max(0, min(a + n, hi) - max(a, lo)) * cols
                  for a, n in zip(starts, shard_rows, strict=True)]  # fmt: skip
    else:
        pieces = [n * (hi - lo) for n in shard_rows]
    nonzero = tuple((s, n) for s, n in enumerate(pieces) if n)
    return _MemberPieces(torch.tensor(pieces, dtype=torch.int64), nonzero)


def _bucket_trips(items: list[tuple[int, torch.Size, int, int | None]], ranks: int, shards: int,
                  size: int) -> tuple[Trip, Trip, torch.Tensor]:  # fmt: skip
    """One bucket in a group of ``ranks // shards`` replica rows: trips, and the spread's widths.

    Each piece goes to its member once, from the holder in the member's own
    row (the member itself where it holds it); each part comes back to that
    row only. ``items``: ``(index, shape, owner or team, split dim)``;
    member ``k`` of a team takes band ``k`` of the split dim, as the backend
    cuts it. The widths: per column (shard), the most elements one row
    gives the all-gather that spreads the results over the column.
    """
    rows = torch.arange(ranks) // shards
    by_shard = torch.arange(ranks) % shards
    given = torch.zeros(ranks // shards, shards, dtype=torch.int64)
    works = []
    for _, (height, cols), owner, dim in items:
        along_rows = size == 1 or dim == 0
        for k in range(size):
            member = owner * size + k
            row = member // shards
            pieces = _member_pieces(height, cols, shards, size, k, along_rows)
            senders = [
                (member if member % shards == s else s + shards * row, n) for s, n in pieces.nonzero
            ]
            works.append((member, senders, pieces.per_shard[by_shard] * (rows == row)))
            given[row] += pieces.per_shard
    to, back = exchange_trips(works, ranks)
    return to, back, given.max(0).values


# ---------------------------------------------------------------- predictions

#: Bytes per element of what travels (the momentum update and the result, float32) and of
#: each optimizer state element; the params and gradients take ``--param-dtype``'s.
TRAVEL_BYTES = STATE_BYTES = 4


@dataclass(frozen=True)
class Prediction:
    ranks: int
    transport: str
    step_s: float | None  # None: it does not fit
    bytes_per_rank: int
    ns_flops_per_rank: float
    state_bytes_per_rank: int
    exchange_s: float
    ns_s: float
    elementwise_s: float
    team_size: int
    shard_size: int
    replica_group: int
    lower_bound_bytes: int
    memory_bytes_per_rank: int
    fits: bool

    @property
    def bytes_over_bound(self) -> float:
        return self.bytes_per_rank / self.lower_bound_bytes if self.lower_bound_bytes else 0.0


def memory_per_rank(params: Params, shards: int, param_bytes: int = 4) -> int:
    """Bytes of params, gradients and optimizer state on one rank, sharded ``shards`` ways.

    Params and gradients take ``param_bytes`` each; Muon keeps one float32
    buffer (momentum) per element, AdamW two (the moments). Activations and
    the transient unsharded params of forward and backward are not counted.
    """
    state = params.muon_elements + 2 * params.adamw_elements
    elements = params.muon_elements + params.adamw_elements
    return -(-(elements * 2 * param_bytes + state * STATE_BYTES) // shards)


def lower_bound_bytes(params: Params, shards: int) -> int:
    """Bytes a rank must move at least: its shard of every Muon gradient out, of its update back."""
    return 2 * -(-params.muon_elements // shards) * TRAVEL_BYTES


def predict(params: Params, ranks: int, shards: int, transport: str, profile: DeviceProfile,
            ns_dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
            exchange: ModeledExchange | None = None,
            param_bytes: int = 4) -> Prediction:  # fmt: skip
    """One step of ``params`` on ``ranks`` (shard groups of ``shards``) by ``transport``."""
    exchange = exchange or plan_exchange(params, ranks, shards, ns_dtype, profile, device)
    trips = sum(transport_seconds(t, TRAVEL_BYTES, transport, profile)
                for ts in exchange.trips for t in ts)  # fmt: skip
    spread_s, spread_bytes = _spread(exchange, profile)
    moved = (
        exchange.team_bytes
        + spread_bytes
        + sum(rank_bytes(t, transport, TRAVEL_BYTES) for ts in exchange.trips for t in ts)
    )
    busiest = float(exchange.flops.max())
    ns = sum(exchange.bucket_seconds)  # each bucket waits for its busiest member
    local = (params.muon_elements + 2 * params.adamw_elements) / shards
    elementwise = (params.muon_elements * MUON_PASSES + params.adamw_elements * ADAMW_PASSES) \
        * 4 / shards / profile.memory_bytes_per_s  # fmt: skip
    elementwise += profile.overhead_per_matrix_s * sum(n for _, n in params.matrices)
    memory = memory_per_rank(params, shards, param_bytes)
    fits = profile.device_memory_bytes is None or memory <= profile.device_memory_bytes
    step = trips + spread_s + ns + elementwise
    return Prediction(ranks, transport, step if fits else None, int(moved.max()), busiest,
                      int(local * STATE_BYTES), trips + spread_s, ns, elementwise,
                      exchange.team_size, shards, exchange.replica_group,
                      lower_bound_bytes(params, shards), memory, fits)  # fmt: skip


def _spread(exchange: ModeledExchange, profile: DeviceProfile) -> tuple[float, torch.Tensor]:
    """Seconds of the spreads, and each rank's bytes in them (a ring: sent and received).

    Each column's all-gather over ``replica_group`` ranks is a ring of
    ``replica_group - 1`` steps, each moving its widest row's elements; the
    columns run at once, so the widest column sets each bucket's time.
    """
    steps = exchange.replica_group - 1
    per_column = torch.zeros(exchange.shards, dtype=torch.float64)
    seconds = 0.0
    for widths in exchange.spread:
        if steps:
            nbytes = steps * float(widths.max()) * TRAVEL_BYTES
            seconds += profile.all_gather.seconds(steps, nbytes)
        per_column += 2 * steps * widths.double() * TRAVEL_BYTES
    return seconds, per_column.repeat(exchange.replica_group)


def shard_size(params: Params, ranks: int, profile: DeviceProfile, param_bytes: int = 4) -> int:
    """The smallest shard degree of at least a node's ranks whose state fits ``profile``'s memory.

    A divisor of ``ranks``; ``ranks`` itself (full sharding) where none fits
    (the prediction then says it does not fit). Sharding within a node
    moves nothing over the slower link, so a node's ranks are the least.
    """
    node = min(RANKS_PER_NODE, ranks)
    sizes = [s for s in range(node, ranks + 1) if ranks % s == 0 and s % node == 0]
    limit = profile.device_memory_bytes
    fitting = [
        s for s in sizes if limit is None or memory_per_rank(params, s, param_bytes) <= limit
    ]
    return fitting[0] if fitting else sizes[-1]


def predictions(params: Params, ranks: Sequence[int], profile: DeviceProfile,
                shards: int | str = "auto", param_bytes: int = 4) -> list[Prediction]:  # fmt: skip
    """Each transport at each rank count: HSDP with ``shards`` ranks per replica (``"auto"``:
    :func:`shard_size`), the replica groups and teams the backend's ``auto`` picks."""
    rows = []
    for n in ranks:
        s = shard_size(params, n, profile, param_bytes) if shards == "auto" else int(shards)
        if n % s:
            raise SystemExit(f"--shard-size {s} does not divide {n} ranks; choose a divisor")
        exchange = plan_exchange(params, n, s, torch.bfloat16, profile)
        rows += [predict(params, n, s, t, profile, exchange=exchange, param_bytes=param_bytes)
                 for t in TRANSPORTS]  # fmt: skip
    return rows


def pick(rows: Sequence[Prediction], ranks: int) -> Prediction:
    """The row with the shortest predicted step at ``ranks`` (the transport ``auto`` takes)."""
    mine = [r for r in rows if r.ranks == ranks]
    return min(mine, key=lambda r: (r.step_s is None, r.step_s or 0.0))


def plot(rows: Sequence[Prediction], title: str, path: Path) -> None:
    """Step time, bytes and Newton-Schulz FLOPs per rank against ranks, one line per transport.

    The bytes panel also draws the lower bound; rows that do not fit are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("step_s", "predicted step (s)"), ("bytes_per_rank", "bytes per rank per step"),
              ("ns_flops_per_rank", "Newton-Schulz FLOPs per rank"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
    fitting = [r for r in rows if r.fits]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for transport in TRANSPORTS:
            mine = [r for r in fitting if r.transport == transport]
            ax.plot([r.ranks for r in mine], [getattr(r, key) for r in mine], "o-", label=transport)
        if key == "bytes_per_rank":
            bound = [r for r in fitting if r.transport == TRANSPORTS[0]]
            ax.plot([r.ranks for r in bound], [r.lower_bound_bytes for r in bound], "k--",
                    label="lower bound")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: The keys of each prediction in ``--json``.
PREDICTION_KEYS = ("ranks", "transport", "step_s", "bytes_per_rank", "lower_bound_bytes",
                   "bytes_over_bound", "ns_flops_per_rank", "state_bytes_per_rank",
                   "memory_bytes_per_rank", "fits", "shard_size", "replica_group",
                   "team_size")  # fmt: skip


def describe(rows: Sequence[Prediction], ranks: int, profile: DeviceProfile) -> str:
    """One line for ``ranks``: the mesh, what ``auto`` picks, and each transport's figures."""
    best = pick(rows, ranks)
    memory = f"{best.memory_bytes_per_rank / 1e9:.1f} GB/rank"
    if profile.device_memory_bytes:
        memory += f" of {profile.device_memory_bytes / 1e9:.0f} GB"
    head = (f"at {ranks} ranks ({profile.name}): HSDP {ranks // best.shard_size} x "
            f"{best.shard_size}, {memory}")  # fmt: skip
    if not best.fits:
        every = " (every rank)" if best.shard_size == ranks else ""
        return f"{head}: does not fit sharded over {best.shard_size} ranks{every}"
    return (f"{head}; groups of {best.replica_group} replicas, {best.team_size} rank(s) per "
            f"matrix; picks {best.transport}; " + "; ".join(
                f"{r.transport} {r.step_s:.3f} s, {r.bytes_per_rank / 2**30:.1f} GiB/rank "
                f"({r.bytes_over_bound:.2f}x the bound of {r.lower_bound_bytes / 2**30:.1f}), "
                f"NS {r.ns_flops_per_rank / 1e12:.2f} TFLOP/rank"
                for r in rows if r.ranks == ranks))  # fmt: skip


# ---------------------------------------------------------------- measuring here


def _spawn(worker: Callable[..., None], *args: Any, world_size: int = 2) -> Any:
    """Run ``worker(rank, world_size, out, *args)`` on gloo ranks; what rank 0 wrote to ``out``."""
    from hyper_parallel.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        run_distributed(worker, world_size=world_size, args=(str(out), *args))
        return json.loads(out.read_text())


#: Workers ``--worker`` runs under torchrun, by name.
WORKERS: dict[str, Callable[..., None]] = {}


def _two_nodes(worker: Callable[..., None], *args: Any) -> Any:
    """Run ``worker`` under two torchrun agents of 2 ranks each on this host (a two-node job).

    What rank 0 wrote to ``out``; each agent's output if either fails.
    """
    import subprocess

    from hyper_parallel.testing import free_port

    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        call = json.dumps([worker.__name__, str(out), *args])
        endpoint = f"localhost:{free_port()}"
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                  "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                  "--rdzv_id", "scale-validate"]  # fmt: skip
        agents = [
            subprocess.Popen(
                [*launch, "--node_rank", str(node), "-m", "benchmarks.scale", "--worker", call],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = [agent.communicate(timeout=600)[0] for agent in agents]
        if any(agent.returncode for agent in agents):
            raise RuntimeError("two-node validation failed:\n" + "\n".join(outputs)[-4000:])
        return json.loads(out.read_text())


def _run_worker(call: str) -> int:
    """``--worker``: one rank of a torchrun job (one thread, gloo) running a named worker."""
    import torch.distributed as dist

    name, out, *args = json.loads(call)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        WORKERS[name](dist.get_rank(), dist.get_world_size(), out, *args)
    finally:
        dist.destroy_process_group()
    return 0


#: Timed calls per figure. Each figure is the fastest of them: on a shared machine
#: interference only adds time, and one quiet call is what the model describes.
REPEATS = 7


def fastest_seconds(step: Callable[[], object], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` calls of ``step`` after a warm-up, each between barriers."""
    return min(step_seconds(step, repeats))


def _fit(points: list[tuple[float, float]]) -> LinkCost:
    """Least-squares ``seconds = latency + seconds_per_byte * bytes``, per message or ring step."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return LinkCost(latency_s=max(my - slope * mx, 1e-6), seconds_per_byte=max(slope, 1e-13))


#: Rows of the ``(rows, 512)`` matrices whose owner exchange calibrates each transport.
TRIP_ROWS = (16, 128, 512, 2048)


def _calibrate_worker(rank: int, world_size: int, out: str, team_dtype: str, replicas: int) -> None:
    links = {t: [_trip_point(rows, t) for rows in TRIP_ROWS] for t in TRANSPORTS}
    # fixed costs per matrix: steps on 16 and on 64 tiny matrices (one bucket each), laid
    # out as the steps to predict are (HSDP where replicas share the work)
    overhead = [
        (float(n), _muon_step_seconds([(8, 8)] * n, "all_to_all", replicas)) for n in (16, 64)
    ]
    # Newton-Schulz on every rank at once, as the ranks of a step compute
    flops = {**_ns_points(torch.float32, (128, 256, 512, 1024)),
             **_ns_points(torch.bfloat16, (128, 256, 512))}  # fmt: skip
    team = []
    if world_size == 2:  # teams of both ranks
        team = [(side, _team_seconds(side, getattr(torch, team_dtype))) for side in TEAM_SIDES]
    memory = _memory_bandwidth()
    if rank == 0:
        Path(out).write_text(json.dumps({"links": links, "overhead": overhead, "flops": flops,
                                         "team": team, "memory": memory}))  # fmt: skip


def _memory_bandwidth() -> float:
    """Bytes per second of element-wise work (a momentum lerp), on every rank at once."""
    import torch.distributed as dist

    buffers = [torch.zeros(1 << 22) for _ in range(2)]
    grads = [torch.randn(1 << 22) for _ in range(2)]
    torch._foreach_lerp_(buffers, grads, 0.05)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        torch._foreach_lerp_(buffers, grads, 0.05)
    return 5 * 3 * 4 * (2 << 22) / (time.perf_counter() - start)


def _trip_point(rows: int, transport: str) -> tuple[float, float]:
    """Bytes and seconds of one trip of the owner exchange itself, by ``transport``.

    One ``(rows, 512)`` matrix, row-sharded over the ranks, goes to its
    owner and back unchanged (two trips; the owner receives, then sends,
    all but its own shard): what a step pays per trip, packing and landing
    included.
    """
    import torch.distributed as dist

    from hyper_parallel.core.distributed import WholeMatrices
    from hyper_parallel_builtins.fsdp_backend import FSDPBackend

    backend = FSDPBackend(overlap=False, transport=transport, team_size=1)
    (matrix,) = _sharded_matrices([(rows, 512)])
    trip = functools.partial(backend.map_blocks, lambda blocks: [b.clone() for b in blocks],
                             [matrix.detach()], [WholeMatrices()])  # fmt: skip
    world, nbytes = dist.get_world_size(), rows * 512 * 4
    # the model's count of the busiest rank's bytes per trip, over both trips: all_to_all,
    # the owner's (world - 1) / world of the matrix each way; all_gather, (world - 1) ring
    # steps of the widest contribution, a shard on the way there and all but one back
    moved = nbytes * (world - 1) // (world if transport == "all_to_all" else 2)
    return moved, fastest_seconds(trip, 2 * REPEATS) / 2  # cheap: more calls


def _sharded_matrices(shapes: Sequence[tuple[int, int]], replicas: int = 1) -> list[Any]:
    """Muon params of these shapes, row-sharded over the ranks, with gradients.

    ``replicas > 1``: HSDP, replicated over the first dim of a ``(replicas,
    ranks // replicas)`` mesh and row-sharded over the second.
    """
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    shape_of_mesh = (world,) if replicas == 1 else (replicas, world // replicas)
    mesh = init_device_mesh("cpu", shape_of_mesh)
    placements = [Shard(0)] if replicas == 1 else [Replicate(), Shard(0)]
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        full = torch.randn(shape, generator=gen) * 0.02
        p = nn.Parameter(distribute_tensor(full, mesh, placements))
        p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, placements)
        params.append(p)
    return params


def _muon_step_seconds(
    shapes: Sequence[tuple[int, int]], transport: str, replicas: int = 1
) -> float:
    """One Muon step (fsdp, no overlap, ``transport``) on these matrices, the fastest of 7.

    ``replicas > 1``: HSDP, every replica sharing the work (:func:`_sharded_matrices`).
    """
    from hyper_parallel_builtins.muon import Muon

    os.environ.update(HYPER_PARALLEL_EXCHANGE_OVERLAP="0", HYPER_PARALLEL_TRANSPORT=transport,
                      HYPER_PARALLEL_TEAM_SIZE="1")  # fmt: skip
    opt = Muon(_sharded_matrices(shapes, replicas), lr=0.02, sharding="fsdp",
               hsdp_replica_count=replicas)  # fmt: skip
    return fastest_seconds(opt.step)


#: Sides of the square matrices whose Newton-Schulz, shared by both ranks, calibrates
#: the link a team talks over (``node_link``).
TEAM_SIDES = (128, 192, 256, 384, 512)


def _team_seconds(side: int, dtype: torch.dtype) -> float:
    """Seconds of a ``side``-square matrix's Newton-Schulz in ``dtype``, shared by the 2 ranks."""
    import torch.distributed as dist

    from hyper_parallel_builtins.muon import MuonTeam

    team = MuonTeam(muon_group(), dtype)
    half = torch.randn(side, side // 2)
    run = functools.partial(team, [half], [torch.Size((side, side))], dist.group.WORLD)
    return _cold_median(run, 2 * REPEATS)  # its waits vary more than compute does


def fit_team_link(
    measured: list[tuple[int, float]], profile: DeviceProfile, dtype: torch.dtype
) -> LinkCost:
    """The team link that explains the measured team seconds beyond the members' FLOPs.

    Each matrix's collectives make the same number of ring steps, so the
    time left after its FLOPs (at ``profile``'s rate) fits ``steps x
    latency + bytes x seconds per byte`` as a line in bytes per step.
    """
    from hyper_parallel_builtins.muon import MuonTeam

    team, name = MuonTeam(muon_group(), dtype), str(dtype).removeprefix("torch.")
    points = []
    for side, seconds in measured:
        shape = torch.Size((side, side))
        made = team.collectives(shape, 2)
        # the model's own count: its ring steps (1 s each) and its bytes (1 s per byte)
        steps, nbytes = (team_seconds(0.0, made, 2, dtype.itemsize, 1.0, unit)
                         for unit in (LinkCost(1.0, 0.0), LinkCost(0.0, 1.0)))  # fmt: skip
        left = seconds - team.cost(shape, 2) / profile.matmul_rate(name, side)
        points.append((nbytes / steps, left / steps))
    return _fit(points)


def _ns_points(dtype: torch.dtype, sides: Sequence[int]) -> dict[str, list[list[float]]]:
    """Newton-Schulz FLOP/s at each short side ``s``, per iteration method (profile keys).

    ``"<dtype>"``: the standard iteration on an ``s x s`` matrix;
    ``"<dtype>/gram"``: the Gram iteration on a SwiGLU MLP's matrices, two
    ``8s/3 x s`` and one ``s x 8s/3``.
    """
    name = str(dtype).removeprefix("torch.")
    points: dict[str, list[list[float]]] = {name: [], f"{name}/gram": []}
    for side in sides:
        long = -(-8 * side // 3 // 32) * 32
        mlp = [(long, side), (long, side), (side, long)]
        points[name].append([float(side), _ns_rate([(side, side)], dtype, "standard")])
        points[f"{name}/gram"].append([float(side), _ns_rate(mlp, dtype, "gram")])
    return points


def _ns_rate(shapes: Sequence[tuple[int, int]], dtype: torch.dtype, method: str) -> float:
    """FLOP/s of Newton-Schulz by ``method`` over these matrices, as a step's owner runs it.

    One matrix per call, the result cast back to the param's dtype, each
    call on inputs out of cache (in a step they arrive after the rest of
    the step has passed through the caches): the median of 7 calls, made
    on every rank at once.
    """
    from hyper_parallel_builtins.newton_schulz import (
        newton_schulz_batched,
        newton_schulz_flops,
        resolve_coefficients,
    )

    coefficients = resolve_coefficients("keller", NS_STEPS)
    flops, seconds = 0.0, 0.0
    for rows, cols in shapes:
        matrix = torch.randn(rows, cols)

        def orthogonalize(matrix: torch.Tensor = matrix) -> None:
            (result,) = newton_schulz_batched([matrix], coefficients, dtype=dtype, method=method)
            result.reshape(matrix.shape).to(matrix.dtype, memory_format=torch.contiguous_format)

        seconds += _cold_median(orthogonalize)
        flops += newton_schulz_flops(rows, cols, NS_STEPS, method)
    return flops / seconds


def _cold_median(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median seconds of ``run`` on this rank, each call after 256 MiB have passed the caches."""
    import statistics

    import torch.distributed as dist

    flush = torch.empty(1 << 26)  # 256 MiB
    run()
    times = []
    for _ in range(repeats):
        flush.fill_(1.0)
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(
    team_dtype: torch.dtype | None = None, ranks: int = 2, replicas: int = 1
) -> DeviceProfile:
    """Measure this machine at ``ranks`` gloo ranks of one thread each, all at once.

    * each transport's latency (per message or ring step: the busiest
      rank's ``ranks - 1``) and seconds per byte, fitted over trips of the
      owner exchange itself (:data:`TRIP_ROWS`);
    * Newton-Schulz FLOP/s by dtype, short side and method (``_ns_points``);
    * at 2 ranks, the team link (``node_link``): what teams of both ranks
      take beyond their FLOPs, in ``team_dtype`` (default: Muon's default here);
    * element-wise bandwidth and the fixed cost per matrix of a step (on
      HSDP with ``replicas`` sharing the work, where ``replicas > 1``).

    Where the ranks outnumber the cores, they share them, and so do the figures.
    """
    team_dtype = team_dtype or _default_ns_dtype()
    dtype = str(team_dtype).removeprefix("torch.")
    measured = _spawn(_calibrate_worker, dtype, replicas, world_size=ranks)
    links = {
        t: dataclasses.replace(fit, latency_s=fit.latency_s / (ranks - 1))
        for t, fit in ((t, _fit(measured["links"][t])) for t in TRANSPORTS)
    }
    (few, t_few), (many, t_many) = measured["overhead"]
    profile = DeviceProfile(
        name="measured-here" if ranks == 2 else f"measured-here-{ranks}",
        all_to_all=links["all_to_all"],
        all_gather=links["all_gather"],
        matmul_flops=measured["flops"],
        memory_bytes_per_s=measured["memory"],
        overhead_per_matrix_s=max(0.0, (t_many - t_few) / (many - few)),
        source=f"python -m benchmarks.scale --calibrate ({ranks} gloo ranks of 1 thread, "
        "this machine)",
    )
    if not measured["team"]:
        return profile
    return dataclasses.replace(
        profile, node_link=fit_team_link(measured["team"], profile, team_dtype)
    )


class _Counting:
    """Payload bytes of this rank's collectives while active (handed over plus received).

    At 2 ranks this is what a ring moves: an all-reduce of ``n`` elements
    sends and receives ``n``, an all-gather receives the other's part.
    """

    def __init__(self) -> None:
        self.bytes = 0

    def __enter__(self) -> _Counting:
        import torch.distributed as dist

        names = ("all_to_all_single", "all_gather_single", "all_reduce")
        self._real = {n: getattr(dist, n) for n in names}

        def counted(collective: Callable[..., Any]) -> Callable[..., Any]:
            def call(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                # all_reduce: handed and received in place; all_gather: its own part stays
                handed = args[0] if collective is self._real["all_to_all_single"] else output
                if collective is self._real["all_gather_single"]:
                    handed = output[:0]
                self.bytes += (output.numel() + handed.numel()) * output.element_size()
                return collective(output, *args, **kwargs)

            return call

        for name, collective in self._real.items():
            setattr(dist, name, counted(collective))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, collective in self._real.items():
            setattr(dist, name, collective)


def _validate_worker(
    rank: int, world_size: int, out: str, cases: list[list[int]], ns_dtype: str
) -> None:
    """Each case ``(dim, layers, team size, replicas)`` by each transport: seconds and bytes.

    With ``replicas > 1`` the params are HSDP-sharded on a ``(replicas,
    world_size // replicas)`` mesh and all replicas share the work
    (``hsdp_replica_count=replicas``).
    """
    import torch.distributed as dist

    from hyper_parallel_builtins.muon import Muon

    records = []
    for dim, layers, team_size, replicas in cases:
        for transport in TRANSPORTS:
            shapes = transformer_shapes(dim, layers)
            os.environ.update(HYPER_PARALLEL_EXCHANGE_OVERLAP="0", HYPER_PARALLEL_TRANSPORT=transport,
                              HYPER_PARALLEL_TEAM_SIZE=str(team_size))  # fmt: skip
            opt = Muon(_sharded_matrices(shapes, replicas), lr=0.02, sharding="fsdp",
                       ns_dtype=getattr(torch, ns_dtype), hsdp_replica_count=replicas)  # fmt: skip
            opt.step()  # the plan and the momentum
            with _Counting() as counted:
                opt.step()
            seconds = fastest_seconds(opt.step)
            moved: list[Any] = [None] * world_size
            dist.all_gather_object(moved, counted.bytes)
            records.append({"dim": dim, "layers": layers, "team_size": team_size,
                            "replicas": replicas, "ranks": world_size, "transport": transport,
                            "measured_s": seconds, "measured_bytes": max(moved)})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(records))


WORKERS["_validate_worker"] = _validate_worker


def validate(profile: DeviceProfile, cases: Sequence[tuple[int, int, int, int]],
             ns_dtype: torch.dtype | None = None, ranks: int = 2,
             two_nodes: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Measured against predicted: each case (dim, layers, team size, replicas) by each transport.

    On ``ranks`` spawned processes, or (``two_nodes``) on two torchrun agents
    of 2. ``ns_dtype``: Muon's Newton-Schulz dtype (default: Muon's default
    here). Each row's ``"mesh"`` says where it ran.
    """
    ns_dtype = ns_dtype or _default_ns_dtype()
    args = ([list(c) for c in cases], str(ns_dtype).removeprefix("torch."))
    if two_nodes:
        records, mesh = _two_nodes(_validate_worker, *args), "2 nodes x 2"
    else:
        records, mesh = _spawn(_validate_worker, *args, world_size=ranks), f"{ranks} processes"
    rows = []
    for record in records:
        shapes = transformer_shapes(record["dim"], record["layers"])
        params = Params(f"d={record['dim']}", tuple((s, 1) for s in shapes), 0)
        n, replicas = record["ranks"], record["replicas"]
        shards = n // replicas
        exchange = plan_exchange(params, n, shards, ns_dtype, profile, device="cpu",
                                 team_size=record["team_size"], replica_group=replicas)  # fmt: skip
        p = predict(params, n, shards, record["transport"], profile, ns_dtype, exchange=exchange)
        assert p.step_s is not None
        rows.append({"mesh": mesh, "ranks": n, "replicas": replicas, "dim": record["dim"],
                     "layers": record["layers"], "team_size": record["team_size"],
                     "transport": record["transport"], "predicted_s": p.step_s,
                     "measured_s": record["measured_s"], "predicted_bytes": p.bytes_per_rank,
                     "measured_bytes": record["measured_bytes"]})  # fmt: skip
    return rows


# ---------------------------------------------------------------- command line

#: The validation's models at 2 ranks: (dim, layers, ranks per matrix, replicas), each a
#: few seconds a step; the last shares every matrix between both ranks (``team_size=2``).
VALIDATION_CASES = ((256, 2, 1, 1), (512, 1, 1, 1), (512, 1, 2, 1))
#: With replicas: HSDP (2, 2) on 4 processes, and on two torchrun agents of 2, where the
#: two replicas share the work (``hsdp_replica_count=2``) and spread the results. Four
#: processes share 2 cores here, so the models are those whose steps outweigh the fixed
#: costs of a collective that waits on a descheduled rank (``docs/scale.md``).
REPLICA_CASES = ((512, 1, 1, 2), (512, 2, 1, 2))


def _load_params(name: str) -> Params:
    if name in MODELS:
        return MODELS[name]()
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return params_from_config(path)
    raise SystemExit(f"--model {name}: choose from {', '.join(MODELS)} or give a config.json path")


def _print_validation(rows: list[dict[str, Any]]) -> None:
    print("mesh           ranks replicas  dim  layers  team  transport   predicted_s  measured_s  "
          "ratio  predicted_B  measured_B")  # fmt: skip
    for r in rows:
        print(f"{r['mesh']:14s} {r['ranks']:5d} {r['replicas']:8d} {r['dim']:4d} {r['layers']:6d} "
              f"{r['team_size']:5d}  {r['transport']:10s} "
              f"{r['predicted_s']:11.4f} {r['measured_s']:11.4f} "
              f"{r['predicted_s'] / r['measured_s']:6.2f} {r['predicted_bytes']:12d} "
              f"{r['measured_bytes']:11d}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine and write the profile to --profile")  # fmt: skip
    parser.add_argument("--validate", action="store_true",
                        help="2 ranks: predicted against measured step time and bytes")  # fmt: skip
    parser.add_argument("--model", help=f"{', '.join(MODELS)}, or a config.json path")
    parser.add_argument("--ranks", default="8,64,1024,16384", help="comma-separated rank counts")
    parser.add_argument("--profile", type=Path,
                        help="device profile JSON: read (or written by --calibrate)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="write a PNG of step time and bytes by ranks")
    parser.add_argument("--shard-size", default="auto", type=_shard_size,
                        help="ranks each param is sharded over (HSDP's shard dim): a number, or "
                             "auto (the default): the smallest multiple of a node of 8 whose "
                             "params, gradients and state fit the profile's device memory")  # fmt: skip
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the sharded params and their gradients in the memory "
                             "check (default float32; the optimizer state is float32)")  # fmt: skip
    parser.add_argument("--ns-dtype", choices=("float32", "bfloat16"),
                        help="Newton-Schulz dtype of --validate's steps and of the teams "
                             "--calibrate times (default: Muon's default here)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank of a torchrun job
    args = parser.parse_args(argv)
    if args.worker:
        return _run_worker(args.worker)
    ns_dtype = getattr(torch, args.ns_dtype) if args.ns_dtype else None
    if not (args.calibrate or args.validate or args.model):
        parser.error("give --calibrate, --validate or --model")
    result: dict[str, Any] = {}
    profile = DeviceProfile.from_json(args.profile) if args.profile and not args.calibrate else None
    if args.calibrate or (args.validate and profile is None):
        profile = calibrate(ns_dtype)
        if args.calibrate and args.profile:
            profile.to_json(args.profile)
        print(f"calibrated: {json.dumps(dataclasses.asdict(profile))}")
    if args.validate:
        assert profile is not None
        four = calibrate(ns_dtype, ranks=4, replicas=2)  # 4 ranks share this machine's cores
        print(f"calibrated at 4 ranks: {json.dumps(dataclasses.asdict(four))}")
        result["validation"] = [
            *validate(profile, VALIDATION_CASES, ns_dtype),
            *validate(four, REPLICA_CASES, ns_dtype, ranks=4),
            *validate(four, REPLICA_CASES, ns_dtype, two_nodes=True),
        ]
        _print_validation(result["validation"])
    if args.model:
        params = _load_params(args.model)
        cluster = profile or device_profile("cuda", named_profile()) or _default_cluster_profile()
        ranks = [int(r) for r in args.ranks.split(",")]
        param_bytes = getattr(torch, args.param_dtype).itemsize
        rows = predictions(params, ranks, cluster, args.shard_size, param_bytes)
        result["profile"] = cluster.name
        result["predictions"] = [
            {k: getattr(r, k) for k in PREDICTION_KEYS} for r in rows
        ]  # fmt: skip
        for n in ranks:
            print(f"{params.name} {describe(rows, n, cluster)}")
        if args.plot:
            plot(rows, f"{params.name}, one Muon+AdamW step ({cluster.name})", args.plot)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "reproduce: python -m benchmarks.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    return 0


def _shard_size(value: str) -> int | str:
    if value == "auto":
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not a shard size; give auto or a positive int")


def _default_ns_dtype() -> torch.dtype:
    from hyper_parallel_builtins.muon import default_ns_dtype

    return default_ns_dtype(torch.empty(0))


def _default_cluster_profile() -> DeviceProfile:
    return DeviceProfile.from_json(Path(__file__).parent / "profiles" / "h100-infiniband.json")


if __name__ == "__main__":
    raise SystemExit(main())
