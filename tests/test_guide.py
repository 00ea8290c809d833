"""The user guide's code blocks (sections 1-4) run as written, on one process."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from sybil import Document
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer
from torch import nn

from conftest import TinyLM
from hyper_parallel.core.optimizer import AdamW, ChainedOptimizer, Muon

GUIDE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "optimizer-guide.md"

# The guide's blocks, verbatim (checked against the guide itself when it is present).
BLOCK_1 = """from hyper_parallel.core.optimizer import get_hyper_optimizer

optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_param_groups,   # params for Muon
    adamw_params=adamw_param_groups,  # params for AdamW
    muon_kwargs={"lr": 0.02, "momentum": 0.95},
    adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
)
"""
BLOCK_2 = """from hyper_parallel.core.optimizer import get_hyper_lr_scheduler

scheduler = get_hyper_lr_scheduler(
    optimizer=optimizer,
    scheduler_type="cosine",
    total_steps=10000,
    warmup_steps=500,
)
"""
BLOCK_3 = """muon_params = []
adamw_params = []

for name, param in model.named_parameters():
    if not param.requires_grad:
        continue
    # large projections use Muon
    if any(key in name for key in ["q_proj", "k_proj", "v_proj", "o_proj",
                                    "gate_proj", "up_proj", "down_proj"]):
        muon_params.append(param)
    else:
        # embedding, bias, norm, ... use AdamW
        adamw_params.append(param)

optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_params,
    adamw_params=adamw_params,
    muon_kwargs={"lr": 0.02, "momentum": 0.95},
    adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
)
"""
BLOCK_4 = """for epoch in range(num_epochs):
    for batch in dataloader:
        output = model(batch)
        loss = criterion(output)
        loss.backward()

        # ChainedOptimizer steps both optimizers
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
"""


# The "Sharded optimizer" and "Gradient scaling factor + clip_grad" blocks, verbatim but for
# "cpu" in place of "npu" and without the "..." placeholder line (not Python).
DISTRIBUTED_BLOCKS = [
    """from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.optimizer import get_hyper_optimizer

mesh = init_device_mesh("cpu", (dp_size,), mesh_dim_names=("dp",))
model = fully_shard(model, mesh=mesh)

# after FSDP sharding, the optimizer state is sharded too
optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_param_groups,
    adamw_params=adamw_param_groups,
)
""",
    """from hyper_parallel import fully_shard, init_device_mesh

mesh = init_device_mesh("cpu", (dp_size,), mesh_dim_names=("dp",))
model = fully_shard(model, mesh=mesh)

# set the gradient scaling factor
model.set_gradient_scaling_factor(scale_factor=0.5)

# clip_grad enhancement: align the clip_grad_norm_ reduction with each grad's
# process group, so clip_grad works under mixed parallelism
""",
]


def _guide_blocks() -> list[str]:
    """The guide's Python blocks, as Sybil's Markdown lexer reads them."""
    document = Document(GUIDE.read_text(encoding="utf-8"), str(GUIDE))
    return [str(r.lexemes["source"]) for r in FencedCodeBlockLexer(language="python")(document)]


@pytest.mark.skipif(
    not GUIDE.exists(),
    reason="the HyperParallel optimizer user guide these blocks quote is not available "
    "next to this checkout",
)
def test_blocks_are_the_guides_own() -> None:
    blocks = _guide_blocks()
    assert blocks[:4] == [BLOCK_1, BLOCK_2, BLOCK_3, BLOCK_4]
    as_run = [b.replace('"npu"', '"cpu"').replace("    ...\n", "") for b in blocks[4:6]]
    assert as_run == DISTRIBUTED_BLOCKS


class GuideLM(TinyLM):
    """The guide's loop calls ``model(batch)`` then ``criterion(output)``."""

    def forward(self, ids: torch.Tensor) -> Any:  # type: ignore[override]
        return super().forward(ids[:, :-1]), ids[:, 1:]


def criterion(output: Any) -> torch.Tensor:
    logits, targets = output
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.fixture
def namespace() -> dict[str, Any]:
    torch.manual_seed(0)
    model = GuideLM()
    gen = torch.Generator().manual_seed(0)
    dataloader = [torch.randint(0, 32, (4, 9), generator=gen) for _ in range(3)]
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
    others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "proj" in n)]
    return {
        "model": model,
        "muon_param_groups": matrices,
        "adamw_param_groups": others,
        "num_epochs": 4,
        "dataloader": dataloader,
        "criterion": criterion,
    }


def test_section_1_creates_a_chained_muon_adamw(namespace: dict[str, Any]) -> None:
    exec(BLOCK_1, namespace)
    optimizer = namespace["optimizer"]
    assert isinstance(optimizer, ChainedOptimizer)
    assert isinstance(optimizer.optimizers["muon"], Muon) and isinstance(
        optimizer.optimizers["adamw"], AdamW
    )
    assert optimizer.optimizers["muon"].param_groups[0]["lr"] == 0.02
    assert optimizer.optimizers["adamw"].param_groups[0]["weight_decay"] == 0.1


def test_section_2_warms_up_every_sub_optimizer(namespace: dict[str, Any]) -> None:
    exec(BLOCK_1, namespace)
    exec(BLOCK_2, namespace)
    optimizer, scheduler = namespace["optimizer"], namespace["scheduler"]
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]
    for _ in range(250):
        optimizer.step()
        scheduler.step()
    muon_lr = optimizer.optimizers["muon"].param_groups[0]["lr"]
    adamw_lr = optimizer.optimizers["adamw"].param_groups[0]["lr"]
    assert muon_lr == pytest.approx(0.01) and adamw_lr == pytest.approx(1.5e-4)


def test_section_3_name_split_moves_q_proj_bias_to_adamw(namespace: dict[str, Any]) -> None:
    model = namespace["model"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exec("from hyper_parallel.core.optimizer import get_hyper_optimizer\n" + BLOCK_3, namespace)
    optimizer = namespace["optimizer"]
    biases = {id(model.layers[i].q_proj.bias) for i in range(2)}
    adamw_ids = {id(p) for g in optimizer.optimizers["adamw"].param_groups for p in g["params"]}
    assert biases <= adamw_ids
    assert sum("fewer than 2 dims" in str(w.message) for w in record) == 1


def test_section_4_training_loop_learns(namespace: dict[str, Any]) -> None:
    exec(BLOCK_1, namespace)
    exec(BLOCK_2, namespace)
    model, batches = namespace["model"], namespace["dataloader"]

    def mean_loss() -> float:
        with torch.no_grad():
            return sum(float(criterion(model(b))) for b in batches) / len(batches)

    before = mean_loss()
    exec(BLOCK_4, namespace)
    assert mean_loss() < before
    optimizer = namespace["optimizer"]
    assert namespace["scheduler"].last_epoch == 12
    assert optimizer.optimizers["muon"].param_groups[0]["lr"] == pytest.approx(0.02 * 12 / 500)
    assert optimizer.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(3e-4 * 12 / 500)
