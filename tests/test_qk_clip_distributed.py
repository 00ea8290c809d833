"""QK-clip under FSDP (2 ranks) and FSDP x TP (dp=2, tp=2): the same numbers as one process.

Each data-parallel rank trains on its own half of the batch and the
one-process reference on the whole of it. The threshold is chosen from the
first batch's logits so that a head passes it on one rank's half only: its
rows must be clipped on every rank, which only the max over the ranks gives.
FSDP's row shards cut query and key heads (a tiny grouped-query Llama, 3
query heads over 1 key head at 2 ranks; 6 over 2 at dp x tp) and a fused
QKV weight's key head; every shard is scaled where it lies, and the clip
adds exactly one collective to the optimizer step: the all-reduce of the
maxima, nothing gathered.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_layouts import _assert_equal_to_one_process, _collective_sizes
from torch import Tensor, nn

from conftest import RMSNorm, lm_loss
from hyper_parallel.core.distributed.toolkit import local_tensor
from hyper_parallel.core.optimizer import Muon, get_hyper_optimizer
from hyper_parallel.qk_clip import (
    QKLayer,
    QKLayout,
    layer_of,
    max_logits,
    track,
    track_layer,
    untrack,
)

STEPS = 3
VOCAB = 40
#: How far (relative) the threshold stays from every head's maximum on either rank's half.
MARGIN = 0.02

Loss = Callable[[nn.Module, Tensor], Tensor]
MakeOptimizer = Callable[[nn.Module, float | None], Any]


def _batch() -> Tensor:
    """The step's whole batch; data-parallel rank ``r`` trains on rows ``[2r, 2r + 2)``."""
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(3))


def _llama(heads: int, kv_heads: int, head_dim: int) -> nn.Module:
    """A tiny Llama whose heads' W_q/W_k rows are scaled up unevenly, so their logits spread."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for block in model.model.layers:
            attn = block.self_attn
            _spread_heads(attn.q_proj.weight, attn.k_proj.weight, head_dim, gain=5.0)
    return model  # type: ignore[no-any-return]


def _spread_heads(query: Tensor, key: Tensor, head_dim: int, gain: float = 1.0) -> None:
    """Scale query head ``h``'s rows by ``(2 + 3h) * gain`` and every key row by ``4 * gain``."""
    per_head = 2.0 + 3.0 * torch.arange(query.shape[0] // head_dim, dtype=query.dtype)
    query.mul_(gain * per_head.repeat_interleave(head_dim)[:, None])
    key.mul_(4.0 * gain)


def _hf_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(ids, labels=ids).loss  # type: ignore[no-any-return]


# -- a fused QKV attention of our own ------------------------------------------------------

FUSED_HEADS, FUSED_HEAD_DIM, FUSED_DIM = 3, 4, 12
#: q, k and v rows of the fused weight: 36 rows, cut at row 18 at 2 ranks (inside key head 1)
FUSED_SPLIT = (FUSED_HEADS * FUSED_HEAD_DIM,) * 3


class FusedAttention(nn.Module):
    """Causal attention with one ``qkv`` Linear, rows ``[queries | keys | values]``.

    Once tracked (:func:`track_layer`), its forward reports each head's
    largest logit in training mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(FUSED_DIM, sum(FUSED_SPLIT), bias=False)
        self.out = nn.Linear(FUSED_SPLIT[0], FUSED_DIM, bias=False)
        rows = FUSED_SPLIT[0]
        with torch.no_grad():
            _spread_heads(self.qkv.weight[:rows], self.qkv.weight[rows : 2 * rows], FUSED_HEAD_DIM)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (
            part.view(b, t, FUSED_HEADS, FUSED_HEAD_DIM).transpose(1, 2)
            for part in self.qkv(x).split(FUSED_SPLIT, dim=-1)
        )
        layer = layer_of(self)
        if layer is not None and self.training:
            layer.report(max_logits(q, k, scaling=FUSED_HEAD_DIM**-0.5, causal=True))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]

    @staticmethod
    def layout() -> QKLayout:
        rows = FUSED_SPLIT[0]
        return QKLayout(
            query="qkv.weight", key="qkv.weight", head_dim=FUSED_HEAD_DIM,
            num_heads=FUSED_HEADS, key_row=rows,
        )  # fmt: skip


class FusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(FUSED_DIM)
        self.attn = FusedAttention()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm(x))  # type: ignore[no-any-return]


class FusedLM(nn.Module):
    """Embedding, two fused-QKV blocks, final norm, head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, FUSED_DIM)
        self.layers = nn.ModuleList(FusedBlock() for _ in range(2))
        self.norm = RMSNorm(FUSED_DIM)
        self.lm_head = nn.Linear(FUSED_DIM, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))  # type: ignore[no-any-return]


def _track_fused(model: nn.Module) -> list[QKLayer]:
    return [
        track_layer(module, FusedAttention.layout(), name)
        for name, module in model.named_modules()
        if isinstance(module, FusedAttention)
    ]


def _fused_optimizer(model: nn.Module, tau: float | None) -> Any:
    """Muon on the fused weights (``split_rows``) and the other matrices, AdamW on the rest."""
    fused = [p for n, p in model.named_parameters() if n.endswith("qkv.weight")]
    matrices = [p for n, p in model.named_parameters() if n.endswith("out.weight")]
    rest = [p for n, p in model.named_parameters() if "qkv" not in n and "out." not in n]
    return get_hyper_optimizer(
        model,
        optimizers={
            "muon": {
                "params": [{"params": fused, "split_rows": FUSED_SPLIT}, {"params": matrices}],
                "lr": 0.02,
                "qk_clip_threshold": tau,
                "qk_clip_alpha": 0.25,
            },
            "adamw": {"params": rest, "lr": 3e-3},
        },
    )


def _llama_optimizer(**muon: Any) -> MakeOptimizer:
    def make(model: nn.Module, tau: float | None) -> Any:
        return get_hyper_optimizer(model, muon={**muon, "qk_clip_threshold": tau}, adamw={})

    return make


# -- training, the threshold, the comparisons ------------------------------------------------


@contextmanager
def _tracked(
    model: nn.Module, track_fn: Callable[[nn.Module], list[QKLayer]]
) -> Iterator[list[QKLayer]]:
    """``model`` tracked for the block; one tracked model at a time (their layers share names)."""
    layers = track_fn(model)
    try:
        yield layers
    finally:
        untrack(model)


def _peek(layers: list[QKLayer]) -> Tensor:
    """The maxima the layers recorded since the last step, left in place for the step."""
    seen = []
    for layer in layers:
        maxima = layer.take_maxima()
        assert maxima is not None, f"{layer.name} recorded nothing"
        layer.report(maxima)
        seen.append(maxima.clone())
    return torch.cat(seen)


def _threshold(model: nn.Module, layers: list[QKLayer], loss: Loss, halves: list[Tensor]) -> float:
    """A ``tau`` that one head passes on one half of the first batch only and some head on neither.

    Of the midpoints between a head's maxima on the two halves, the one
    farthest (relatively) from every head's maxima.
    """
    per_half = []
    for half in halves:
        with torch.no_grad():
            loss(model, half)
        per_half.append(torch.cat([layer.take_maxima() for layer in layers]))  # type: ignore[misc]
    seen = torch.stack(per_half)
    low, high = seen.amin(dim=0), seen.amax(dim=0)
    best, room = 0.0, -1.0
    for tau in ((low + high) / 2).tolist():
        if not (high < tau).any():
            continue
        distance = float(((seen - tau).abs() / tau).min())
        if distance > room:
            best, room = tau, distance
    assert room > MARGIN, f"no threshold splits the halves' maxima well: {seen}"
    return best


@dataclass
class Run:
    """One training run: each step's clip figures and collectives, the first step's maxima."""

    stats: list[dict[str, float | int]]
    #: per step: every collective the dispatcher saw (any route: c10d, functional, DTensor) by op
    collectives: list[Counter[str]]
    #: per step: ``(name, elements)`` of those called through ``torch.distributed``'s functions
    sizes: list[Counter[tuple[str, int]]]
    first_maxima: Tensor | None


def _train(
    model: nn.Module,
    optimizer: Any,
    batch: Tensor,
    loss: Loss,
    layers: list[QKLayer] | None = None,
) -> Run:
    from torch.distributed.tensor.debug import CommDebugMode

    (muon,) = [part for part in optimizer if isinstance(part, Muon)]
    run = Run([], [], [], None)
    for step in range(STEPS):
        loss(model, batch).backward()
        if step == 0 and layers:
            run.first_maxima = _peek(layers)
        with CommDebugMode() as comms, _collective_sizes() as seen:
            optimizer.step()
        optimizer.zero_grad()
        run.collectives.append(Counter({str(op): n for op, n in comms.get_comm_counts().items()}))
        run.sizes.append(Counter(seen))
        if muon.qk_clip_stats is not None:
            run.stats.append(muon.qk_clip_stats.as_dict())
    return run


def _all(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@dataclass(frozen=True)
class Case:
    """A model, how to shard it, track it, train it, and who holds which half of the batch."""

    label: str
    make: Callable[[], nn.Module]
    shard: Callable[[nn.Module], None]
    track: Callable[[nn.Module], list[QKLayer]]
    optimizer: MakeOptimizer
    loss: Loss
    dp_rank: int


def _check(case: Case) -> list[Tensor]:
    """Train ``case`` sharded and in one process; compare; return every rank's first maxima."""
    reference = case.make()
    sharded, unclipped = copy.deepcopy(reference), copy.deepcopy(reference)
    full = _batch()
    halves = list(full.chunk(2))
    with _tracked(reference, case.track) as layers:
        tau = _threshold(reference, layers, case.loss, halves)
        one = _train(reference, case.optimizer(reference, tau), full, case.loss)
    with _tracked(sharded, case.track) as layers:
        case.shard(sharded)
        _assert_shards_cut_heads(layers, case.label)
        ours = _train(
            sharded, case.optimizer(sharded, tau), halves[case.dp_rank], case.loss, layers
        )
    case.shard(unclipped)
    plain = _train(unclipped, case.optimizer(unclipped, None), halves[case.dp_rank], case.loss)

    _assert_equal_to_one_process(sharded, reference, case.label)
    heads = sum(layer.layout.num_heads for layer in layers)
    _assert_same_stats(_all(ours.stats), one.stats, heads, case.label)
    _assert_one_all_reduce_more(ours, plain, heads, case.label)
    maxima = _all(ours.first_maxima)
    _assert_ranks_disagree_but_clip_alike(maxima, one.stats[0], tau, case)
    return maxima


def _assert_shards_cut_heads(layers: list[QKLayer], label: str) -> None:
    """Each tracked W_q and W_k shard this rank holds ends inside a head."""
    for layer in layers:
        for path in (layer.layout.query, layer.layout.key):
            rows = local_tensor(layer.tensor(path)).shape[0]
            assert rows % layer.layout.head_dim, (label, layer.name, path, rows)


def _assert_one_all_reduce_more(clipped: Run, plain: Run, heads: int, label: str) -> None:
    """Each step of the clipped run made the plain run's collectives and one all-reduce of
    ``heads`` maxima: nothing gathered, whatever route a gather would take."""
    for step in range(STEPS):
        ops, plain_ops = clipped.collectives[step], plain.collectives[step]
        assert ops - plain_ops == Counter({"c10d.allreduce_": 1}), (label, step, ops, plain_ops)
        assert not plain_ops - ops, (label, step, ops, plain_ops)
        sizes, plain_sizes = clipped.sizes[step], plain.sizes[step]
        assert sizes - plain_sizes == Counter({("all_reduce", heads): 1}), (label, step, sizes)
        assert not plain_sizes - sizes, (label, step, sizes, plain_sizes)


def _assert_same_stats(
    per_rank: list[list[dict[str, float | int]]],
    one: list[dict[str, float | int]],
    heads: int,
    label: str,
) -> None:
    assert len(one) == STEPS and 0 < one[0]["qk_heads_clipped"] < heads, (label, one)
    assert one[0]["qk_max_logit_after"] < one[0]["qk_max_logit"], (label, one)
    for rank, stats in enumerate(per_rank):
        assert len(stats) == STEPS, (label, rank, stats)
        for got, want in zip(stats, one, strict=True):
            assert got["qk_heads"] == want["qk_heads"] == heads, (label, rank, got, want)
            assert got["qk_heads_clipped"] == want["qk_heads_clipped"], (label, rank, got, want)
            for key in ("qk_max_logit", "qk_max_logit_after"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (label, rank, key, got, want)


def _assert_ranks_disagree_but_clip_alike(
    maxima: list[Tensor], first: dict[str, float | int], tau: float, case: Case
) -> None:
    """The dp ranks' own maxima pass ``tau`` at different heads; the step clipped their union."""
    dp_ranks = _all(case.dp_rank)
    per_dp = [
        torch.stack([m for m, dp in zip(maxima, dp_ranks, strict=True) if dp == r]).amax(dim=0)
        for r in (0, 1)
    ]
    over = [set((m > tau).nonzero().flatten().tolist()) for m in per_dp]
    assert over[0] != over[1], (case.label, tau, per_dp)
    assert len(over[0] | over[1]) == first["qk_heads_clipped"], (case.label, over, first)
    assert len(over[0] | over[1]) > min(len(over[0]), len(over[1])), (case.label, over)


# -- FSDP at 2 ranks ---------------------------------------------------------------------


def _fsdp_two_ranks(rank: int, world_size: int) -> None:
    """GQA Llama with Muon and head-wise Muon, and the fused-QKV model, under FSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def shard(model: nn.Module) -> None:
        fully_shard(model, mesh=mesh)

    llama = functools.partial(_llama, heads=3, kv_heads=1, head_dim=8)
    cases = (
        Case("fsdp x2, Muon", llama, shard, track, _llama_optimizer(), _hf_loss, rank),
        Case("fsdp x2, head-wise Muon", llama, shard, track,
             _llama_optimizer(head_wise=True), _hf_loss, rank),
        Case("fsdp x2, fused QKV", FusedLM, shard, _track_fused, _fused_optimizer, lm_loss, rank),
    )  # fmt: skip
    for case in cases:
        _check(case)


def test_fsdp_two_ranks_clips_like_one_process_gqa_head_wise_and_fused_qkv() -> None:
    pytest.importorskip("transformers")
    run_distributed(_fsdp_two_ranks, world_size=2)


# -- FSDP x TP -----------------------------------------------------------------------------


def _fsdp_x_tp(rank: int, world_size: int) -> None:
    """GQA Llama (6 query heads over 2 key heads) with tensor parallel inside FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {
        **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }

    def shard(model: nn.Module) -> None:
        for block in model.model.layers:  # type: ignore[union-attr]
            parallelize_module(block, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])

    heads, head_dim = 6, 4
    case = Case(
        "fsdp x tp",
        functools.partial(_llama, heads=heads, kv_heads=2, head_dim=head_dim),
        shard,
        track,
        _llama_optimizer(),
        _hf_loss,
        mesh.get_local_rank("dp"),
    )
    maxima = _check(case)
    # each tp rank computed its own heads only (the others stay -inf): 3 of 6 in each layer
    tp = mesh.get_local_rank("tp")
    computed = torch.isfinite(maxima[rank]).view(2, heads)
    expected = torch.zeros(heads, dtype=torch.bool)
    expected[tp * heads // 2 : (tp + 1) * heads // 2] = True
    assert torch.equal(computed, expected.expand(2, heads)), (rank, maxima[rank])
    _hsdp(rank)


def _hsdp(rank: int) -> None:
    """HSDP, 2 replicas x 2 shards: the shards cut heads, the maxima come from all four ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def shard(model: nn.Module) -> None:
        fully_shard(model, mesh=mesh)

    llama = functools.partial(_llama, heads=3, kv_heads=1, head_dim=8)
    replica = mesh.get_local_rank("replicate")  # each replica a half of the batch
    _check(Case("hsdp 2 x 2", llama, shard, track, _llama_optimizer(), _hf_loss, replica))


def test_fsdp_x_tp_and_hsdp_clip_like_one_process() -> None:
    pytest.importorskip("transformers")
    run_distributed(_fsdp_x_tp, world_size=4)
