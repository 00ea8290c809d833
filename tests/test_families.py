"""Family configuration: ``get_hyper_optimizer(model, muon=..., sinkhorn=..., adamw=...)``.

Each routing, decay and head-wise rule, and each error, on tiny Hugging Face
Llama and Qwen2 models built in-process from a config (nothing downloaded).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.optimizer import ChainedOptimizer, Sinkhorn, get_hyper_optimizer
from hyper_parallel.core.optimizer._factory import FAMILY_ROUTING_KEYS
from hyper_parallel.testing import check_partitioner, plugin_registered

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama(tied: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)  # type: ignore[no-any-return]


def qwen2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))  # type: ignore[no-any-return]


def routed(optimizer: ChainedOptimizer) -> dict[str, set[str]]:
    return {name: set(names) for name, names in optimizer.param_names_by_optimizer.items()}


def names(model: nn.Module, *parts: str, end: str = "") -> set[str]:
    return {
        n for n, _ in model.named_parameters() if any(p in n for p in parts) and n.endswith(end)
    }


def group_of(optimizer: ChainedOptimizer, family: str, param: torch.Tensor) -> dict[str, Any]:
    (group,) = [g for g in optimizer[family].param_groups if any(p is param for p in g["params"])]
    return group


# -- routing ------------------------------------------------------------------------------


def test_llama_embedding_and_head_to_sinkhorn_norms_to_adamw_projections_to_muon() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={"lr": 0.02}, sinkhorn={"lr": 3e-3}, adamw={})
    assert list(optimizer.optimizers) == ["muon", "sinkhorn", "adamw"]
    assert isinstance(optimizer["sinkhorn"], Sinkhorn)
    assert routed(optimizer) == {
        "muon": names(model, *PROJECTIONS, end=".weight"),
        "sinkhorn": {"model.embed_tokens.weight", "lm_head.weight"},
        "adamw": names(model, "norm"),
    }
    assert len(routed(optimizer)["adamw"]) == 5  # two norms a layer, and the final one
    assert optimizer["muon"].param_groups[0]["lr"] == 0.02
    assert optimizer["sinkhorn"].param_groups[0]["lr"] == 3e-3


def test_families_not_mentioned_are_on_with_their_defaults() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, adamw={"lr": 1e-3})
    assert list(optimizer.optimizers) == ["muon", "sinkhorn", "adamw"]
    assert (
        optimizer["sinkhorn"].defaults["lr"]
        == Sinkhorn([nn.Parameter(torch.ones(2, 2))]).defaults["lr"]
    )
    assert get_hyper_optimizer(model, muon={}).param_names_by_optimizer == (
        optimizer.param_names_by_optimizer
    )


def test_sinkhorn_none_sends_embedding_and_head_to_adamw() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, sinkhorn=None)
    assert list(optimizer.optimizers) == ["muon", "adamw"]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= routed(optimizer)["adamw"]
    assert routed(optimizer)["muon"] == names(model, *PROJECTIONS)


def test_muon_none_sends_hidden_matrices_to_adamw() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon=None)
    assert list(optimizer.optimizers) == ["sinkhorn", "adamw"]
    assert names(model, *PROJECTIONS) <= routed(optimizer)["adamw"]
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight", "lm_head.weight"}


def test_norm_classes_by_type_and_by_name() -> None:
    class ScaleNorm(nn.Module):  # a norm by its class name only
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    model = nn.ModuleDict(
        {
            "ln": nn.LayerNorm(4),
            "gn": nn.GroupNorm(2, 4),
            "bn": nn.BatchNorm1d(4),
            "rms": nn.RMSNorm(4),
            "custom": ScaleNorm(),
            "proj": nn.Linear(4, 4, bias=False),
        }
    )
    optimizer = get_hyper_optimizer(model, muon={}, adamw={})
    assert routed(optimizer)["muon"] == {"proj.weight"}
    assert routed(optimizer)["adamw"] == {n for n, _ in model.named_parameters()} - {"proj.weight"}


def test_output_head_from_get_output_embeddings_and_by_name() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(8, 8, bias=False)
            self.unembed = nn.Linear(8, 16, bias=False)  # named like nothing: found by the method
            self.output_layer = nn.Linear(8, 2, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.unembed

    model = Model()
    optimizer = get_hyper_optimizer(model, muon={})
    assert routed(optimizer) == {
        "muon": {"hidden.weight"},
        "sinkhorn": {"unembed.weight", "output_layer.weight"},
    }


def test_tied_model_optimizes_the_shared_weight_once() -> None:
    model = llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = get_hyper_optimizer(model, muon={})
    sinkhorn_params = [p for g in optimizer["sinkhorn"].param_groups for p in g["params"]]
    assert len(sinkhorn_params) == 1 and sinkhorn_params[0] is model.lm_head.weight
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight"}
    every = [
        p for opt in optimizer.optimizers.values() for g in opt.param_groups for p in g["params"]
    ]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    # a pattern naming the head by its other name selects the same (one) param
    by_head_name = get_hyper_optimizer(model, adamw={"param_patterns": [r"^lm_head\."]})
    assert "model.embed_tokens.weight" in routed(by_head_name)["adamw"]


def test_frozen_params_are_left_out() -> None:
    model = llama()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = get_hyper_optimizer(model, muon={}, adamw={"param_patterns": ["embed_tokens"]})
    everything = set().union(*routed(optimizer).values())
    assert "model.layers.0.self_attn.q_proj.weight" not in everything
    assert "model.embed_tokens.weight" not in everything  # matched, but frozen: no error either


def test_param_patterns_override_the_default_routing() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        adamw={"param_patterns": [r"layers\.1\.mlp\."]},
        sinkhorn={"param_patterns": ["o_proj"]},
    )
    assert names(model, "layers.1.mlp.") <= routed(optimizer)["adamw"]
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight", "lm_head.weight"} | names(
        model, "o_proj"
    )
    assert not (names(model, "layers.1.mlp.", "o_proj") & routed(optimizer)["muon"])


def test_a_matrix_only_family_leaves_vectors_its_patterns_match_to_the_default() -> None:
    import warnings

    model = qwen2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fewer than 2 dims" warning from the factory
        optimizer = get_hyper_optimizer(model, muon={"param_patterns": [r"self_attn\.q_proj\."]})
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert "model.layers.0.self_attn.q_proj.bias" in routed(optimizer)["adamw"]
    assert group_of(optimizer, "adamw", bias)["weight_decay"] == 0.0


def test_any_registered_optimizer_is_a_family() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, sgd={"param_patterns": ["down_proj"], "lr": 0.1})
    assert list(optimizer.optimizers) == ["muon", "sinkhorn", "adamw", "sgd"]
    assert isinstance(optimizer["sgd"], torch.optim.SGD)
    assert routed(optimizer)["sgd"] == names(model, "down_proj")
    assert optimizer["sgd"].defaults["lr"] == 0.1


def test_prefixed_keywords_configure_an_enabled_family() -> None:
    optimizer = get_hyper_optimizer(llama(), muon={"momentum": 0.9}, muon_lr=0.05)
    assert (
        optimizer["muon"].defaults["lr"] == 0.05 and optimizer["muon"].defaults["momentum"] == 0.9
    )


# -- weight decay -------------------------------------------------------------------------


def test_qwen2_biases_have_no_decay_and_norm_weights_keep_it() -> None:
    model = qwen2()
    optimizer = get_hyper_optimizer(model, adamw={"weight_decay": 0.1})
    biases = names(model, "q_proj", "k_proj", "v_proj", end=".bias")
    assert len(biases) == 6 and biases <= routed(optimizer)["adamw"]
    params = dict(model.named_parameters())
    for name in biases:
        assert group_of(optimizer, "adamw", params[name])["weight_decay"] == 0.0
    for name in names(model, "norm"):
        assert group_of(optimizer, "adamw", params[name])["weight_decay"] == 0.1
    # the embedding and head go to sinkhorn, which has no weight decay at all
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight", "lm_head.weight"}


def test_scale_names_and_vectors_outside_norms_have_no_decay() -> None:
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.scale = nn.Parameter(torch.ones(4))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Norm()
            self.gate = nn.Parameter(torch.ones(4))  # 1-D outside a norm
            self.temperature = nn.Parameter(torch.tensor(1.0))  # a scalar
            self.scaling_factor = nn.Parameter(torch.ones(4, 4))
            self.proj = nn.Linear(4, 4, bias=False)

    model = Model()
    optimizer = get_hyper_optimizer(
        model, muon={}, adamw={"weight_decay": 0.2, "param_patterns": ["^scaling_factor$"]}
    )
    decay = {
        name: group_of(optimizer, "adamw", p)["weight_decay"]
        for name, p in model.named_parameters()
        if name in routed(optimizer)["adamw"]
    }
    assert decay == {
        "norm.weight": 0.2,
        "norm.scale": 0.0,
        "gate": 0.0,
        "temperature": 0.0,
        "scaling_factor": 0.0,
    }


# -- head-wise ----------------------------------------------------------------------------


def test_head_wise_takes_head_dim_from_the_model_config() -> None:
    model = llama()
    assert model.config.head_dim == 8
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True})
    params = dict(model.named_parameters())
    qk = names(model, "q_proj", "k_proj")
    for name in names(model, *PROJECTIONS):
        expected = 8 if name in qk else None
        assert group_of(optimizer, "muon", params[name])["head_dim"] == expected, name
    # Qwen2's config has no head_dim: hidden_size // num_attention_heads
    qwen = qwen2()
    optimizer = get_hyper_optimizer(qwen, muon={"head_wise": True})
    weight = qwen.model.layers[0].self_attn.k_proj.weight
    assert group_of(optimizer, "muon", weight)["head_dim"] == 8


def test_head_dim_in_the_family_dict_wins_and_is_not_a_muon_option() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 16})
    q = model.model.layers[0].self_attn.q_proj.weight
    assert group_of(optimizer, "muon", q)["head_dim"] == 16
    assert optimizer["muon"].defaults["head_dim"] is None  # only the q/k groups have it


def test_head_wise_patterns_override_the_names() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        muon={
            "head_wise_patterns": {r"v_proj\.weight$": None, r"layers\.0\.self_attn\.q_proj": 16}
        },
    )
    params = dict(model.named_parameters())
    head_dims = {
        n: group_of(optimizer, "muon", params[n])["head_dim"] for n in names(model, *PROJECTIONS)
    }
    assert {n for n, d in head_dims.items() if d == 8} == names(model, "v_proj")
    assert {n for n, d in head_dims.items() if d == 16} == {
        "model.layers.0.self_attn.q_proj.weight"
    }
    assert head_dims["model.layers.1.self_attn.k_proj.weight"] is None


def test_head_wise_without_a_head_dim_is_an_error() -> None:
    model = nn.ModuleDict({"q_proj": nn.Linear(8, 8, bias=False), "up": nn.Linear(8, 8)})
    with pytest.raises(
        HyperParallelValueError, match="muon is head-wise but has no head_dim: give"
    ):
        get_hyper_optimizer(model, muon={"head_wise": True})
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 4})
    assert group_of(optimizer, "muon", model["q_proj"].weight)["head_dim"] == 4


def test_head_wise_with_no_q_or_k_projection_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(
        HyperParallelValueError, match=r"found no q/k projection weight.*head_wise_patterns"
    ):
        get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 4})


# -- param groups -------------------------------------------------------------------------


def test_param_groups_give_some_tables_a_5x_lr() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        sinkhorn={"lr": 1e-3, "param_groups": [{"param_patterns": ["embed_tokens"], "lr": 5e-3}]},
        muon={"lr": 0.02, "param_groups": [{"param_patterns": [r"\.mlp\."], "lr": 0.1}]},
    )
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert (
        group_of(optimizer, "sinkhorn", embed)["lr"]
        == 5 * group_of(optimizer, "sinkhorn", head)["lr"]
    )
    up = model.model.layers[1].mlp.up_proj.weight
    o = model.model.layers[1].self_attn.o_proj.weight
    assert (
        group_of(optimizer, "muon", up)["lr"] == 0.1
        and group_of(optimizer, "muon", o)["lr"] == 0.02
    )


def test_param_groups_key_typo_is_caught_by_the_optimizer() -> None:
    with pytest.raises(ValueError, match=r"Unknown key 'lrr' in a param group of optimizer 'muon'"):
        get_hyper_optimizer(
            llama(), muon={"param_groups": [{"param_patterns": ["mlp"], "lrr": 1.0}]}
        )


def test_param_groups_entry_needs_patterns() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"muon\['param_groups'\]\[0\] must select its params with 'param_patterns'",
    ):
        get_hyper_optimizer(llama(), muon={"param_groups": [{"params": [], "lr": 1.0}]})


# -- errors -------------------------------------------------------------------------------


def test_trainable_param_in_no_family_lists_the_params() -> None:
    model = llama()
    with pytest.raises(HyperParallelValueError) as info:
        get_hyper_optimizer(model, adamw=None)
    message = str(info.value)
    assert "5 trainable param(s) belong to no optimizer family" in message
    assert "model.layers.0.input_layernorm.weight" in message and "model.norm.weight" in message
    assert "turn it on (adamw={})" in message


def test_param_matched_by_two_families_names_both() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"Param 'model.layers.0.mlp.up_proj.weight' matches the param patterns of both "
        r"families 'sinkhorn' and 'adamw'",
    ):
        get_hyper_optimizer(
            llama(), sinkhorn={"param_patterns": ["up_proj"]}, adamw={"param_patterns": ["mlp"]}
        )


def test_pattern_that_matches_nothing() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"adamw\['param_patterns'\] entry 'embed_token\$' matches no param of the model",
    ):
        get_hyper_optimizer(llama(), adamw={"param_patterns": ["embed_token$"]})
    with pytest.raises(
        HyperParallelValueError, match=r"head_wise_patterns'\] entry 'wqkv' matches no"
    ):
        get_hyper_optimizer(llama(), muon={"head_wise_patterns": {"wqkv": 8}})


@pytest.mark.parametrize(
    "other",
    [
        {"muon_params": []},
        {"adamw_params": []},
        {"muon_kwargs": {"lr": 0.02}},
        {"optimizers": {"sgd": {}}},
        {"partitioner": "by_shape"},
        {"partitioner_kwargs": {}},
    ],
    ids=lambda d: next(iter(d)),
)
def test_family_keywords_do_not_mix_with_the_other_forms(other: dict[str, Any]) -> None:
    name = next(iter(other))
    with pytest.raises(
        HyperParallelTypeError,
        match=rf"got family keywords \(muon=\) and {name}=; use one or the other",
    ):
        get_hyper_optimizer(llama(), muon={}, **other)


def test_a_family_is_a_dict_or_none() -> None:
    with pytest.raises(
        HyperParallelTypeError, match=r"muon= must be a dict of muon's options.*got float"
    ):
        get_hyper_optimizer(llama(), muon=0.02)
    with pytest.raises(
        HyperParallelTypeError, match=r"param_patterns'\] must be a list.*\['q_proj'\]"
    ):
        get_hyper_optimizer(llama(), muon={"param_patterns": "q_proj"})
    with pytest.raises(
        HyperParallelTypeError, match=r"muon= takes no 'params'; select .*param_patterns"
    ):
        get_hyper_optimizer(llama(), muon={"params": []})
    with pytest.raises(HyperParallelValueError, match=r"Family 'sgd' selects no params"):
        get_hyper_optimizer(llama(), sgd={"lr": 0.1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'muom'.*Did you mean 'muon'"):
        get_hyper_optimizer(llama(), muom={})


# -- the partitioner ----------------------------------------------------------------------


def test_family_routing_keys_are_the_partitioners() -> None:
    from hyper_parallel_builtins.families import FAMILY_KEYS

    assert set(FAMILY_KEYS) == FAMILY_ROUTING_KEYS


def test_by_family_passes_the_partitioner_check() -> None:
    assignment = check_partitioner("by_family")
    assert set(assignment) == {"muon", "sinkhorn", "adamw"}
    model = llama()
    check_partitioner("by_family", model, families={"muon": {"head_wise": True}, "adamw": {}})


@pytest.mark.usefixtures("fresh_registry")
def test_family_mode_calls_by_family_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third party takes the name over: the built-in disabled, its own registered."""
    calls: list[dict[str, Any]] = []

    def by_family(model: nn.Module, *, families: Any = None) -> dict[str, list[Any]]:
        calls.append(dict(families))
        return {"adamw": list(model.parameters()), "muon": [], "sinkhorn": []}

    @hookimpl
    def hyper_parallel_register_partitioners(register: Any) -> None:
        register("by_family", by_family)

    monkeypatch.setenv("HYPER_PARALLEL_DISABLE_PLUGINS", "families")
    plugin = types.ModuleType("everything_to_adamw")
    plugin.hyper_parallel_register_partitioners = hyper_parallel_register_partitioners  # type: ignore[attr-defined]
    with plugin_registered(plugin):
        model = nn.Linear(4, 4)
        optimizer = get_hyper_optimizer(model, muon={"lr": 0.02, "head_wise": True})
    assert list(optimizer.optimizers) == ["adamw"]
    assert calls == [{"muon": {"head_wise": True}, "sinkhorn": {}, "adamw": {}}]


# -- training -----------------------------------------------------------------------------


def test_training_a_tiny_llama_lowers_the_loss() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        muon={"lr": 0.02, "head_wise": True},
        sinkhorn={"lr": 3e-3},
        adamw={"lr": 3e-3, "weight_decay": 0.1},
    )
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
