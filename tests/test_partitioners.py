"""The built-in partitioners: which param goes to which optimizer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import TinyLM
from hyper_parallel import get_registry
from hyper_parallel.core.optimizer import get_hyper_optimizer


def partition(name: str, model: nn.Module, **options: Any) -> dict[str, list[Any]]:
    return get_registry().get("partitioner", name).obj(model, **options)


def names_of(model: nn.Module, items: list[Any]) -> set[str]:
    params = [p for item in items for p in (item["params"] if isinstance(item, dict) else [item])]
    lookup = {id(p): n for n, p in model.named_parameters()}
    return {lookup[id(p)] for p in params}


def groups(items: list[Any]) -> list[dict[str, Any]]:
    return [item for item in items if isinstance(item, dict)]


def test_by_name_is_the_guides_split(model: nn.Module) -> None:
    out = partition("by_name", model)
    proj_weights = {n for n, _ in model.named_parameters() if "proj.weight" in n}
    assert names_of(model, out["muon"]) == proj_weights
    # q_proj.bias matches the guide's keys but is 1-D: AdamW
    assert "layers.0.q_proj.bias" in names_of(model, out["adamw"])
    assert names_of(model, out["muon"]) | names_of(model, out["adamw"]) == {
        n for n, _ in model.named_parameters()
    }


def test_by_name_custom_keys_and_pattern(model: nn.Module) -> None:
    out = partition("by_name", model, keys=["gate_proj"])
    assert names_of(model, out["muon"]) == {
        "layers.0.gate_proj.weight",
        "layers.1.gate_proj.weight",
    }
    out = partition("by_name", model, pattern=r"layers\.1\.(q|k)_proj")
    assert names_of(model, out["muon"]) == {"layers.1.q_proj.weight", "layers.1.k_proj.weight"}
    with pytest.raises(ValueError, match="pattern '\\(' is not a valid regular expression"):
        partition("by_name", model, pattern="(")
    with pytest.raises(ValueError, match="keys must be a non-empty list"):
        partition("by_name", model, keys="q_proj")


def test_by_shape_sends_embeddings_head_norms_biases_to_adamw(model: nn.Module) -> None:
    out = partition("by_shape", model)
    assert names_of(model, out["muon"]) == {
        n for n, _ in model.named_parameters() if "proj.weight" in n
    }
    decay, no_decay = groups(out["adamw"])
    # norm weights decay (HyperParallel's rule, the one every partitioner shares)
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= names_of(model, [decay])
    assert no_decay["weight_decay"] == 0.0
    assert "layers.1.v_proj.bias" in names_of(model, [no_decay])
    assert not any("norm" in n for n in names_of(model, [no_decay]))
    assert "weight_decay" not in decay


def test_by_shape_finds_an_unnamed_head_by_vocab_size() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50))
    out = partition("by_shape", model)
    assert names_of(model, out["muon"]) == {"1.weight"}
    assert {"0.weight", "2.weight"} <= names_of(model, out["adamw"])


def test_by_shape_tied_embedding_counted_once() -> None:
    model = TinyLM(tied=True)
    out = partition("by_shape", model)
    everything = [p for item in out["adamw"] for p in item["params"]]
    assert sum(p is model.embed_tokens.weight for p in everything) == 1


def test_by_shape_without_no_decay_group(model: nn.Module) -> None:
    out = partition("by_shape", model, no_decay=False)
    assert len(out["adamw"]) == 1 and "weight_decay" not in out["adamw"][0]


def test_by_module_takes_linear_weights_except_the_head() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 8), nn.LayerNorm(8))
    model.add_module("classifier", nn.Linear(8, 2))
    out = partition("by_module", model)
    assert names_of(model, out["muon"]) == {"2.weight"}
    assert {"0.weight", "classifier.weight", "3.weight", "2.bias"} <= names_of(model, out["adamw"])


def test_frozen_params_are_left_out(model: nn.Module) -> None:
    model.embed_tokens.weight.requires_grad_(False)
    for name in ("by_name", "by_shape", "by_module"):
        out = partition(name, model)
        all_names = set().union(*(names_of(model, v) for v in out.values()))
        assert "embed_tokens.weight" not in all_names, name


def test_custom_optimizer_names_flow_into_the_factory(model: nn.Module) -> None:
    optimizer = get_hyper_optimizer(
        model,
        partitioner="by_module",
        partitioner_kwargs={"matrix_optimizer": "muon", "fallback_optimizer": "adam"},
        optimizers={"adam": {"lr": 1e-3}},
    )
    assert set(optimizer.optimizers) == {"muon", "adam"}
    assert isinstance(optimizer.optimizers["adam"], torch.optim.Adam)
    assert optimizer.optimizers["adam"].param_groups[0]["lr"] == 1e-3


def test_bad_options(model: nn.Module) -> None:
    with pytest.raises(ValueError, match="are both 'muon'"):
        partition("by_shape", model, matrix_optimizer="muon", fallback_optimizer="muon")
    with pytest.raises(TypeError, match="needs an nn.Module, got list"):
        partition("by_module", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="options were given for 'sgd'"):
        get_hyper_optimizer(model, partitioner="by_shape", optimizers={"sgd": {"lr": 0.1}})
