"""Matrix optimizers on every layout: FSDP (uneven shards), FSDP x TP, head-wise blocks in place.

Each check trains a small multi-head decoder for a few steps sharded, and the
same model in one process, with the optimizers split as a large-model
recipe does: Sinkhorn on the embedding and the head, head-wise Muon on q/k,
Muon on the other matrices, AdamW on the rest. The sharded params must equal
the one-process ones.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_distributed_muon import assert_bitwise_equal, exchange_options
from torch import nn

from conftest import RMSNorm, counting_newton_schulz, lm_loss
from hyper_parallel.core.optimizer import get_hyper_optimizer

STEPS = 5
HEAD_DIM = 4


class Attention(nn.Module):
    """Multi-head attention whose head count follows the local q/k/v width (tensor parallel)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, HEAD_DIM).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.attn = Attention(dim)
        self.post_norm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class HeadsLM(nn.Module):
    """Embedding, multi-head blocks, final norm, head. 30 tokens: uneven shards at 4 ranks."""

    def __init__(self, vocab: int = 30, dim: int = 16, hidden: int = 24, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _optimizer(model: nn.Module, *, head_dim: int = HEAD_DIM) -> Any:
    """Sinkhorn on embedding and head, head-wise Muon on q/k, Muon on other matrices, AdamW else."""
    families: dict[str, list[nn.Parameter]] = {"sinkhorn": [], "heads": [], "muon": [], "adamw": []}
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            families["sinkhorn"].append(p)
        elif "q_proj" in name or "k_proj" in name:
            families["heads"].append(p)
        elif p.ndim >= 2:
            families["muon"].append(p)
        else:
            families["adamw"].append(p)
    return get_hyper_optimizer(
        model,
        optimizers={
            "sinkhorn": {"params": families["sinkhorn"], "lr": 0.01},
            "muon": {
                "params": [
                    {"params": families["heads"], "head_dim": head_dim},
                    {"params": families["muon"]},
                ],
                "lr": 0.02,
                "weight_decay": 0.01,
            },
            "adamw": {"params": families["adamw"], "lr": 3e-3},
        },
    )


def _batch() -> torch.Tensor:
    return torch.randint(0, 30, (4, 9), generator=torch.Generator().manual_seed(1))


def _train(model: nn.Module, optimizer: Any, batch: torch.Tensor, steps: int = STEPS) -> None:
    for _ in range(steps):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_equal_to_one_process(model: nn.Module, reference: nn.Module, label: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full, q.detach(), rtol=1e-5, atol=1e-5, msg=f"{label}: {name}")


_COLLECTIVES = ("all_reduce", "all_to_all_single", "broadcast", "all_gather_into_tensor",
                "all_gather", "all_gather_single", "gather", "reduce_scatter_tensor", "send",
                "recv")  # fmt: skip


@contextmanager
def _collective_sizes() -> Iterator[list[tuple[str, int]]]:
    """Record the element count of every tensor collective called through ``torch.distributed``."""
    seen: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [
                a for a in args if isinstance(a, list) for a in a if isinstance(a, torch.Tensor)
            ]
            seen.append((name, max((t.numel() for t in tensors), default=0)))
            return originals[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, spy(name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# -- FSDP --------------------------------------------------------------------------------


def _fsdp(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    torch.manual_seed(0)
    reference = HeadsLM()
    mesh = init_device_mesh("cpu", (world_size,))
    model, overlapped, in_turn = (fully_shard(copy.deepcopy(reference), mesh=mesh) for _ in "abc")
    per_rank = 4 // world_size
    batch = _batch()[rank * per_rank : (rank + 1) * per_rank]
    _train(reference, _optimizer(reference), _batch())
    _train(model, _optimizer(model), batch)
    _assert_equal_to_one_process(model, reference, f"fsdp x{world_size}")
    _overlap_changes_no_bit(overlapped, in_turn, batch, reference, f"fsdp x{world_size}")
    if world_size == 4:
        _nothing_param_sized_moves(model)
    else:
        _a_layout_no_backend_takes_is_named()


def _overlap_changes_no_bit(
    overlapped: nn.Module, in_turn: nn.Module, batch: torch.Tensor, reference: nn.Module, label: str
) -> None:
    """Training with the exchange in several buckets, overlapped or not, gives the same bits."""
    with exchange_options(overlap=True):
        _train(overlapped, _optimizer(overlapped), batch)
    with exchange_options(overlap=False):
        _train(in_turn, _optimizer(in_turn), batch)
    assert_bitwise_equal(overlapped, in_turn, f"{label}: with and without overlap")
    _assert_equal_to_one_process(overlapped, reference, f"{label}, small buckets")


def _a_layout_no_backend_takes_is_named() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from hyper_parallel.core.optimizer import Muon

    mesh = init_device_mesh("cpu", (2,))
    partial = nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Partial()]))
    layout = r"\(shape \(4, 3\), a DTensor with placements \(Partial\(sum\),\) on a 1-D mesh\)"
    installed = r"installed: ddp, fsdp, hsdp, local"
    with pytest.raises(
        ValueError, match=rf"No sharding backend accepts param 0 {layout}; {installed}"
    ):
        Muon([partial], lr=0.02)
    model = nn.Linear(3, 4, bias=False)
    model.weight = partial
    with pytest.raises(
        ValueError, match=rf"No sharding backend accepts weight {layout}; {installed}"
    ):
        get_hyper_optimizer(model, optimizers={"muon": {"params": [partial]}})


def _nothing_param_sized_moves(model: nn.Module) -> None:
    """Sinkhorn and head-aligned head-wise Muon communicate norm vectors only."""
    from hyper_parallel.core.optimizer import Muon, Sinkhorn

    embed, head = model.embed_tokens.weight, model.lm_head.weight
    heads = [p for n, p in model.named_parameters() if "q_proj" in n or "k_proj" in n]
    lm_loss(model, _batch()[:1]).backward()
    sinkhorn, muon = (
        Sinkhorn([embed, head], lr=0.01),
        Muon([{"params": heads, "head_dim": HEAD_DIM}], lr=0.02),
    )
    sizes = {}
    for opt in (sinkhorn, muon):
        opt.step()  # the first step makes the plans
        with _collective_sizes() as seen:
            opt.step()
        sizes[type(opt).__name__] = seen
    # Sinkhorn on row shards: all-reduces of column-norm vectors, both params' in one
    assert sizes["Sinkhorn"], "Sinkhorn on row shards must complete its column norms"
    assert {name for name, _ in sizes["Sinkhorn"]} == {"all_reduce"}, sizes
    assert max(n for _, n in sizes["Sinkhorn"]) == embed.shape[1] + head.shape[1], sizes
    # head-wise Muon with whole heads on every rank: nothing at all
    assert sizes["Muon"] == [], sizes


def test_fsdp_two_ranks_equals_one_process_with_every_optimizer_family() -> None:
    run_distributed(_fsdp, world_size=2)


def test_fsdp_four_uneven_ranks_equals_one_process_and_moves_no_param_sized_tensors() -> None:
    run_distributed(_fsdp, world_size=4)


# -- FSDP x TP ---------------------------------------------------------------------------


def _tensor_parallel(model: HeadsLM, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(),
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


def _fsdp_x_tp(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = HeadsLM()
    model, overlapped, in_turn, teamed = (copy.deepcopy(reference) for _ in "abcd")
    for copied in (model, overlapped, in_turn, teamed):
        _tensor_parallel(copied, mesh["tp"])
        fully_shard(copied, mesh=mesh["dp"])
    dp = mesh.get_local_rank("dp")
    batch = _batch()[dp * 2 : dp * 2 + 2]

    with counting_newton_schulz() as one_process:
        _train(reference, _optimizer(reference), _batch())
    with counting_newton_schulz() as sharded:
        _train(model, _optimizer(model), batch)
    _assert_equal_to_one_process(model, reference, "fsdp x tp")
    _overlap_changes_no_bit(overlapped, in_turn, batch, reference, "fsdp x tp")
    # matrices shared by teams of 2 ranks: each member's band cut from strided shards
    with exchange_options(overlap=True, team_size="2"):
        _train(teamed, _optimizer(teamed), batch)
    _assert_equal_to_one_process(teamed, reference, "fsdp x tp, teams of 2")

    counts: list[int] = [0] * world_size
    dist.all_gather_object(counts, sum(sharded))
    assert sum(counts) == sum(one_process), (counts, sum(one_process))
    assert all(c > 0 for c in counts), counts
    _one_group_on_two_meshes(model, reference)


def _one_group_on_two_meshes(model: HeadsLM, reference: HeadsLM) -> None:
    """One Muon group holding a dp-only param and a dp x tp param equals one process."""
    from torch.distributed.tensor import distribute_tensor

    from hyper_parallel.core.optimizer import Muon

    names = ("lm_head.weight", "layers.0.down_proj.weight", "layers.1.attn.q_proj.weight")
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    gen = torch.Generator().manual_seed(7)
    for name in names:
        grad = torch.randn(theirs[name].shape, generator=gen)
        theirs[name].grad = grad
        p = ours[name]
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
    assert len({ours[n].device_mesh.ndim for n in names}) == 2  # really two meshes
    Muon([ours[n] for n in names], lr=0.02).step()
    Muon([theirs[n] for n in names], lr=0.02).step()
    _assert_equal_to_one_process(model, reference, "one group, two meshes")


def test_fsdp_x_tp_equals_one_process_and_runs_each_newton_schulz_once() -> None:
    run_distributed(_fsdp_x_tp, world_size=4)


def test_a_region_of_any_layout_is_found_in_its_local_tensor() -> None:
    """``locate`` finds a layout's share of a region inside its own local tensor, strided or not."""
    from hyper_parallel.core.distributed.toolkit import Layout

    full = torch.arange(12 * 6.0).reshape(12, 6)
    strided = Layout((((0, 2), (6, 8), (3, 4)), ((0, 6),)))  # FSDP x TP: runs out of order
    plain = Layout((((4, 10),), ((0, 6),)))
    for layout in (strided, plain):
        local = layout.take(full)
        for dim, (start, stop) in ((0, (1, 7)), (1, (2, 5)), (0, (11, 12))):
            part = layout.intersect(Layout.whole(full.shape).region(dim, start, stop))
            assert torch.equal(layout.locate(part).take(local), part.take(full)), (layout, part)
            region = Layout.whole(full.shape).region(dim, start, stop)
            assert torch.equal(region.locate(part).take(region.take(full)), part.take(full))
    assert strided.intersect(Layout.whole(full.shape).region(0, 1, 7)).runs[0] == (
        (1, 2),
        (6, 7),
        (3, 4),
    )
    assert plain.intersect(Layout.whole(full.shape).region(0, 11, 12)).numel == 0
