"""Family configuration: ``get_hyper_optimizer(model, muon=..., sinkhorn=..., adamw=...)``.

HyperParallel's routing, decay, head-wise and ``param_groups`` rules, and each error, on tiny
Hugging Face Llama and Qwen2 models built in-process from a config (nothing downloaded), and
HyperParallel's own composition tests (``tests/ut/core/optimizer``) ported to this API.
"""

from __future__ import annotations

import copy
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel import hookimpl
from hyper_parallel.core.errors import (
    HyperParallelConfigError,
    HyperParallelTypeError,
    HyperParallelValueError,
)
from hyper_parallel.core.optimizer import ChainedOptimizer, Muon, Sinkhorn, get_hyper_optimizer
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

ALL = {"muon": {}, "sinkhorn": {}, "adamw": {}}


def test_llama_embedding_and_head_to_sinkhorn_norms_to_adamw_projections_to_muon() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={"lr": 0.02}, sinkhorn={"lr": 3e-3}, adamw={})
    assert list(optimizer.optimizers) == ["adamw", "muon", "sinkhorn"]  # HyperParallel's order
    assert isinstance(optimizer["sinkhorn"], Sinkhorn)
    assert routed(optimizer) == {
        "muon": names(model, *PROJECTIONS, end=".weight"),
        "sinkhorn": {"model.embed_tokens.weight", "lm_head.weight"},
        "adamw": names(model, "norm"),
    }
    assert len(routed(optimizer)["adamw"]) == 5  # two norms a layer, and the final one
    assert optimizer["muon"].param_groups[0]["lr"] == 0.02
    assert optimizer["sinkhorn"].param_groups[0]["lr"] == 3e-3


def test_a_family_left_out_is_off() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={}, adamw={})
    assert list(optimizer.optimizers) == ["adamw", "muon"]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= routed(optimizer)["adamw"]
    assert routed(optimizer)["muon"] == names(model, *PROJECTIONS)
    assert routed(get_hyper_optimizer(model, muon={}, sinkhorn=None, adamw={})) == routed(optimizer)


def test_without_muon_hidden_matrices_go_to_adamw() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, sinkhorn={}, adamw={})
    assert list(optimizer.optimizers) == ["adamw", "sinkhorn"]
    assert names(model, *PROJECTIONS) <= routed(optimizer)["adamw"]
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight", "lm_head.weight"}


class KimiRMSNormGated(nn.Module):
    """A gated RMSNorm as Kimi's attention has: a norm by its class name only."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


def test_norm_classes_by_type_and_by_name() -> None:
    class ScaleNorm(nn.Module):  # a norm by its class name only
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    class Normalize(nn.Module):  # not a norm: the name does not end in Norm
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
            "gated": KimiRMSNormGated(4),
            "proj": nn.Linear(4, 4, bias=False),
            "normalize": Normalize(),
        }
    )
    optimizer = get_hyper_optimizer(model, muon={}, adamw={})
    assert routed(optimizer)["muon"] == {"proj.weight", "normalize.weight"}
    assert routed(optimizer)["adamw"] == {n for n, _ in model.named_parameters()} - {
        "proj.weight",
        "normalize.weight",
    }


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
    optimizer = get_hyper_optimizer(model, muon={}, sinkhorn={})
    assert routed(optimizer) == {
        "muon": {"hidden.weight"},
        "sinkhorn": {"unembed.weight", "output_layer.weight"},
    }


def test_tied_model_optimizes_the_shared_weight_once() -> None:
    model = llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = get_hyper_optimizer(model, **ALL)
    sinkhorn_params = [p for g in optimizer["sinkhorn"].param_groups for p in g["params"]]
    assert len(sinkhorn_params) == 1 and sinkhorn_params[0] is model.lm_head.weight
    assert optimizer.param_names_by_optimizer["sinkhorn"] == ["model.embed_tokens.weight"]
    every = [
        p for opt in optimizer.optimizers.values() for g in opt.param_groups for p in g["params"]
    ]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    # a pattern naming the head by its other name selects the same (one) param
    by_head_name = get_hyper_optimizer(model, muon={}, adamw={"param_patterns": [r"^lm_head\."]})
    assert "model.embed_tokens.weight" in routed(by_head_name)["adamw"]


def test_frozen_params_are_left_out() -> None:
    model = llama()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = get_hyper_optimizer(model, muon={}, adamw={"param_patterns": ["embed_tokens"]})
    everything = set().union(*routed(optimizer).values())
    assert "model.layers.0.self_attn.q_proj.weight" not in everything
    assert "model.embed_tokens.weight" not in everything  # matched, but frozen: no error either


def test_param_patterns_override_the_default_routing_and_may_be_one_string() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        muon={},
        adamw={"param_patterns": [r"layers\.1\.mlp\."]},
        sinkhorn={"param_patterns": "o_proj"},  # one regular expression, as HyperParallel takes it
    )
    assert names(model, "layers.1.mlp.") <= routed(optimizer)["adamw"]
    assert routed(optimizer)["sinkhorn"] == {"model.embed_tokens.weight", "lm_head.weight"} | names(
        model, "o_proj"
    )
    assert not (names(model, "layers.1.mlp.", "o_proj") & routed(optimizer)["muon"])


def test_a_vector_selected_for_a_matrix_only_family_is_an_error() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"muon requires matrix parameters, got model.layers.0.self_attn.q_proj.bias",
    ):
        get_hyper_optimizer(
            qwen2(), muon={"param_patterns": [r"self_attn\.q_proj\."]}, sinkhorn={}, adamw={}
        )


def test_any_registered_optimizer_is_a_family() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, **ALL, sgd={"param_patterns": ["down_proj"], "lr": 0.1})
    assert list(optimizer.optimizers) == ["adamw", "muon", "sinkhorn", "sgd"]
    assert isinstance(optimizer["sgd"], torch.optim.SGD)
    assert routed(optimizer)["sgd"] == names(model, "down_proj")
    assert optimizer["sgd"].defaults["lr"] == 0.1


def test_prefixed_keywords_configure_an_enabled_family() -> None:
    optimizer = get_hyper_optimizer(llama(), muon={"momentum": 0.9}, adamw={}, muon_lr=0.05)
    assert (
        optimizer["muon"].defaults["lr"] == 0.05 and optimizer["muon"].defaults["momentum"] == 0.9
    )


def test_param_names_are_in_the_models_order() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True}, adamw={})
    order = [n for n, _ in model.named_parameters()]
    for listed in optimizer.param_names_by_optimizer.values():
        assert listed == sorted(listed, key=order.index)
    assert all(p.model_name == n for n, p in model.named_parameters())  # bound, as HyperParallel


# -- weight decay -------------------------------------------------------------------------


def test_qwen2_biases_have_no_decay_and_norm_weights_keep_it() -> None:
    model = qwen2()
    optimizer = get_hyper_optimizer(model, **{**ALL, "adamw": {"weight_decay": 0.1}})
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


def test_by_shape_and_by_family_agree_on_norms_and_their_decay() -> None:
    model = nn.ModuleDict({"norm": KimiRMSNormGated(4), "proj": nn.Linear(4, 4)})
    for optimizer in (
        get_hyper_optimizer(model, partitioner="by_shape", adamw_weight_decay=0.1),
        get_hyper_optimizer(model, muon={}, adamw={"weight_decay": 0.1}),
    ):
        assert routed(optimizer)["adamw"] == {"norm.weight", "proj.bias"}
        assert group_of(optimizer, "adamw", model["norm"].weight)["weight_decay"] == 0.1
        assert group_of(optimizer, "adamw", model["proj"].bias)["weight_decay"] == 0.0


# -- head-wise (Muon's keywords, with the head size from the model) --------------------------


def test_head_wise_takes_head_dim_from_the_model_config() -> None:
    model = llama()
    assert model.config.head_dim == 8
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True}, adamw={})
    qk = names(model, "q_proj", "k_proj")
    params = dict(model.named_parameters())
    assert optimizer["muon"]._head_dims == {params[n]: 8 for n in qk}
    assert optimizer["muon"].head_dim == 8
    # Qwen2's config has no head_dim: hidden_size // num_attention_heads
    qwen = qwen2()
    optimizer = get_hyper_optimizer(qwen, muon={"head_wise": True}, adamw={})
    assert optimizer["muon"]._head_dims[qwen.model.layers[0].self_attn.k_proj.weight] == 8


def test_head_dim_in_the_family_dict_wins() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 16}, adamw={})
    q = model.model.layers[0].self_attn.q_proj.weight
    assert optimizer["muon"]._head_dims[q] == 16
    assert optimizer["muon"].defaults["head_dim"] is None  # a Muon keyword, not a group key


def test_head_wise_patterns_replace_the_names() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        muon={
            "head_wise": True,
            "head_wise_patterns": {r"v_proj\.weight$": 8, r"layers\.0\.self_attn\.q_proj": 16},
        },
        adamw={},
    )
    params = dict(model.named_parameters())
    dims = {n: optimizer["muon"]._head_dims.get(params[n]) for n in names(model, *PROJECTIONS)}
    assert {n for n, d in dims.items() if d == 8} == names(model, "v_proj")
    assert {n for n, d in dims.items() if d == 16} == {"model.layers.0.self_attn.q_proj.weight"}
    assert dims["model.layers.1.self_attn.k_proj.weight"] is None


def test_head_wise_without_a_head_dim_is_an_error() -> None:
    model = nn.ModuleDict({"q_proj": nn.Linear(8, 8, bias=False), "up": nn.Linear(8, 8)})
    with pytest.raises(
        HyperParallelValueError, match="A positive integer head_dim is required for q_proj.weight"
    ):
        get_hyper_optimizer(model, muon={"head_wise": True}, adamw={})
    optimizer = get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 4}, adamw={})
    assert optimizer["muon"]._head_dims == {model["q_proj"].weight: 4}


def test_a_head_wise_pattern_that_selects_nothing_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(HyperParallelValueError, match=r"head_wise=True selects no Muon param"):
        get_hyper_optimizer(model, muon={"head_wise": True, "head_dim": 4}, adamw={})
    with pytest.raises(HyperParallelValueError, match=r"entry 'wqkv' selects no"):
        get_hyper_optimizer(
            llama(), muon={"head_wise": True, "head_wise_patterns": {"wqkv": 8}}, adamw={}
        )


# -- param groups -------------------------------------------------------------------------


def test_param_groups_give_some_tables_a_5x_lr() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        sinkhorn={"lr": 1e-3, "param_groups": [{"param_patterns": ["embed_tokens"], "lr": 5e-3}]},
        muon={"lr": 0.02, "param_groups": [{"param_patterns": [r"\.mlp\."], "lr": 0.1}]},
        adamw={},
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


def test_param_groups_select_within_their_own_family() -> None:
    """HyperParallel's builder test: one selector per family, matching params of all three."""
    model = nn.ModuleList(
        nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 3), nn.LayerNorm(3)) for _ in range(2)
    )
    config = {"lr": 0.001, "param_groups": [{"param_patterns": [r"^1\."], "lr": 0.003}]}
    optimizer = get_hyper_optimizer(model, muon=config, sinkhorn=config, adamw=config)
    for name, param in model.named_parameters():
        (family,) = [f for f, listed in routed(optimizer).items() if name in listed]
        expected = 0.003 if name.startswith("1.") else 0.001
        assert group_of(optimizer, family, param)["lr"] == expected, name
    # adamw's undecayed params keep weight_decay 0 in their own selected group
    assert group_of(optimizer, "adamw", model[1][1].bias) == {
        **group_of(optimizer, "adamw", model[1][1].bias),
        "lr": 0.003,
        "weight_decay": 0.0,
    }


def test_a_param_groups_entry_for_another_familys_params_is_an_error() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"param_groups match no parameters in their optimizer family: "
        r"sinkhorn\['param_groups'\]\[0\]\['param_patterns'\] selects none of sinkhorn's params; "
        r"it selects params of muon",
    ):
        get_hyper_optimizer(
            llama(),
            muon={},
            sinkhorn={"param_groups": [{"param_patterns": ["q_proj"], "lr": 1e-3}]},
            adamw={},
        )


def test_overlapping_param_groups_are_an_error() -> None:
    groups = [{"param_patterns": ["embed"]}, {"param_patterns": ["embed_tokens"]}]
    with pytest.raises(HyperParallelValueError, match=r"Overlapping param_groups for"):
        get_hyper_optimizer(llama(), muon={}, sinkhorn={"param_groups": groups}, adamw={})


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({"param_patterns": ["embed"]}, "must be a list of mappings"),
        ([0.001], "must be a mapping"),
        ([{"lr": 0.001}], "require param_patterns and cannot contain runtime params"),
        ([{"param_patterns": ["embed"], "params": []}], "cannot contain runtime params"),
    ],
)
def test_malformed_param_groups_are_both_type_and_value_errors(groups: Any, message: str) -> None:
    with pytest.raises(HyperParallelConfigError, match=message) as info:
        get_hyper_optimizer(llama(), muon={}, sinkhorn={"param_groups": groups}, adamw={})
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_param_groups_key_typo_is_caught_by_the_optimizer() -> None:
    with pytest.raises(ValueError, match=r"Unknown key 'lrr' in a param group of optimizer 'muon'"):
        get_hyper_optimizer(
            llama(), muon={"param_groups": [{"param_patterns": ["mlp"], "lrr": 1.0}]}, adamw={}
        )


# -- errors -------------------------------------------------------------------------------


def test_a_trainable_param_whose_family_is_off_is_named() -> None:
    model = llama()
    with pytest.raises(HyperParallelValueError) as info:
        get_hyper_optimizer(model, muon={}, sinkhorn={})
    message = str(info.value)
    assert message.startswith(
        "No enabled optimizer owns trainable parameter model.layers.0.input_layernorm.weight"
    )
    assert "model.norm.weight" in message and "turn it on (adamw={})" in message


def test_a_param_two_families_select_is_an_overlap() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"Overlapping optimizer selectors for \['model.layers.0.mlp.up_proj.weight'\]: "
        r"the param_patterns of adamw, sinkhorn all match it",
    ):
        get_hyper_optimizer(
            llama(),
            muon={},
            sinkhorn={"param_patterns": ["up_proj"]},
            adamw={"param_patterns": ["mlp"]},
        )


def test_pattern_that_matches_nothing() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"adamw\['param_patterns'\] entry 'embed_token\$' matches no param of the model",
    ):
        get_hyper_optimizer(llama(), muon={}, adamw={"param_patterns": ["embed_token$"]})


@pytest.mark.parametrize(
    "other",
    [
        {"muon_params": []},
        {"adamw_params": []},
        {"sinkhorn_params": []},
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
        HyperParallelConfigError,
        match=rf"cannot be mixed .* got family keywords \(muon=\) and {name}=; use one or the other",
    ) as info:
        get_hyper_optimizer(llama(), muon={}, **other)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_a_family_is_a_dict_or_none() -> None:
    with pytest.raises(
        HyperParallelTypeError, match=r"muon= must be a dict of muon's options.*got float"
    ):
        get_hyper_optimizer(llama(), muon=0.02)
    with pytest.raises(
        HyperParallelTypeError, match=r"muon= takes no 'params'; select .*param_patterns"
    ):
        get_hyper_optimizer(llama(), muon={"params": []})
    with pytest.raises(HyperParallelValueError, match=r"Family 'sgd' selects no params"):
        get_hyper_optimizer(llama(), **ALL, sgd={"lr": 0.1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'muom'.*Did you mean 'muon'"):
        get_hyper_optimizer(llama(), muom={})


# -- HyperParallel's composition tests, ported -------------------------------------------------


class TinyModel(nn.Module):
    """Independent Q/K, token table, prediction head, norm and bias parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=8, num_attention_heads=2)
        self.embed = nn.Embedding(9, 8)
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 4, bias=False)
        self.v_proj = nn.Linear(8, 4, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 9, bias=False)


def three_families(model: nn.Module, **extra: Any) -> ChainedOptimizer:
    return get_hyper_optimizer(model, muon={"head_wise": True}, sinkhorn={}, adamw={}, **extra)


def test_hp_routing_and_tied_parameters() -> None:
    model = TinyModel()
    model.lm_head.weight = model.embed.weight
    model.v_proj.weight.requires_grad_(False)
    optimizer = three_families(model)
    assert optimizer.param_names_by_optimizer["sinkhorn"] == ["embed.weight"]
    assert optimizer.param_names_by_optimizer["muon"] == ["q_proj.weight", "k_proj.weight"]
    decays = {
        id(p): group["weight_decay"]
        for group in optimizer.optimizers_dict["adamw"].param_groups
        for p in group["params"]
    }
    assert decays[id(model.q_proj.bias)] == 0
    assert decays[id(model.norm.weight)] == 0.01


def test_hp_matrix_norm_weights_stay_with_adamw() -> None:
    model = nn.Module()
    model.norm = nn.LayerNorm((2, 4))
    model.gate_scale = nn.Parameter(torch.ones(4))
    optimizer = get_hyper_optimizer(model, muon={}, adamw={"weight_decay": 0.1})
    assert set(optimizer.optimizers_dict) == {"adamw"}
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decays[id(model.norm.weight)] == 0.1
    assert decays[id(model.norm.bias)] == 0
    assert decays[id(model.gate_scale)] == 0


@pytest.mark.parametrize("options", [{}, {"param_patterns": [r"^norm\.weight$"]}])
def test_hp_gated_norm_weights_use_configured_decay(options: dict[str, Any]) -> None:
    model = nn.Module()
    model.norm = KimiRMSNormGated(4)
    model.gate_scale = nn.Parameter(torch.ones(4))
    optimizer = get_hyper_optimizer(
        model, muon={}, adamw={"lr": 0.1, "weight_decay": 0.1, **options}
    )
    assert set(optimizer.optimizers_dict) == {"adamw"}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    torch.testing.assert_close(model.norm.weight, torch.full((4,), 0.99))
    torch.testing.assert_close(model.gate_scale, torch.ones(4))


def test_hp_regex_selection_and_errors() -> None:
    model = TinyModel()
    optimizer = get_hyper_optimizer(
        model, muon={}, sinkhorn={"param_patterns": [r"v_proj.weight$"]}, adamw={}
    )
    assert "v_proj.weight" in optimizer.param_names_by_optimizer["sinkhorn"]
    with pytest.raises(ValueError, match="Overlapping"):
        get_hyper_optimizer(
            model,
            muon={"param_patterns": [r"embed.weight$"]},
            sinkhorn={"param_patterns": [r"embed.weight$"]},
            adamw={},
        )
    with pytest.raises(ValueError, match="No enabled optimizer"):
        get_hyper_optimizer(model, muon={}, sinkhorn={})
    with pytest.raises(ValueError, match="cannot be mixed"):
        get_hyper_optimizer(model, muon_params=[], muon={})
    leaf = torch.optim.SGD([model.q_proj.weight], lr=0.1)
    with pytest.raises(ValueError, match="more than one|in both"):
        ChainedOptimizer({"one": leaf, "two": leaf})


def test_hp_custom_head_patterns_and_validation() -> None:
    model = nn.Linear(6, 8, bias=False)
    optimizer = get_hyper_optimizer(
        model, muon={"head_wise": True, "head_wise_patterns": {r"^weight$": 2}}
    )
    assert optimizer.optimizer.head_wise_patterns == {r"^weight$": 2}
    with pytest.raises(ValueError, match="divisible"):
        get_hyper_optimizer(model, muon={"head_wise": True, "head_wise_patterns": {r"^weight$": 3}})
    with pytest.raises(ValueError, match="cannot be combined"):
        Muon([model.weight], head_wise=True, head_dim=4, reshape_fn=lambda name, tensor: [tensor])


def test_hp_three_way_checkpoint_resume() -> None:
    torch.manual_seed(5)
    model = TinyModel()
    optimizer = three_families(model)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    checkpoint = copy.deepcopy(optimizer.state_dict())
    restored_model = copy.deepcopy(model)
    restored = three_families(restored_model)
    restored.load_state_dict(checkpoint)
    for first, second in zip(model.parameters(), restored_model.parameters(), strict=True):
        first.grad = torch.randn_like(first)
        second.grad = first.grad.clone()
    optimizer.step()
    restored.step()
    for first, second in zip(model.parameters(), restored_model.parameters(), strict=True):
        torch.testing.assert_close(first, second)


def test_hp_main_parameters_keep_head_geometry_and_float32_sinkhorn_state() -> None:
    model = TinyModel().to(torch.bfloat16)
    chain = three_families(model, fp32_main_params=True)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    chain.step()
    for state in chain.optimizers_dict["sinkhorn"].state.values():
        assert state["momentum_buffer"].dtype == torch.float32
    assert chain.param_names_by_optimizer["muon"] == [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
    ]
    assert set(chain.optimizers_dict["muon"]._head_dims.values()) == {4}


# -- the partitioner ----------------------------------------------------------------------


def test_by_family_passes_the_partitioner_check() -> None:
    assignment = check_partitioner("by_family")
    assert list(assignment) == ["adamw", "muon", "sinkhorn"]
    check_partitioner("by_family", llama(), families={"muon": {}, "adamw": {}})


@pytest.mark.usefixtures("fresh_registry")
def test_family_mode_calls_by_family_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third party takes the name over: the built-in disabled, its own registered."""
    calls: list[dict[str, Any]] = []

    def by_family(model: nn.Module, *, families: Any = None) -> dict[str, list[Any]]:
        calls.append(dict(families))
        return {"adamw": list(model.parameters()), "muon": []}

    @hookimpl
    def hyper_parallel_register_partitioners(register: Any) -> None:
        register("by_family", by_family)

    monkeypatch.setenv("HYPER_PARALLEL_DISABLE_PLUGINS", "families")
    plugin = types.ModuleType("everything_to_adamw")
    plugin.hyper_parallel_register_partitioners = hyper_parallel_register_partitioners  # type: ignore[attr-defined]
    with plugin_registered(plugin):
        model = nn.Linear(4, 4)
        optimizer = get_hyper_optimizer(
            model, muon={"lr": 0.02, "param_patterns": ["weight"]}, adamw={}
        )
    assert list(optimizer.optimizers) == ["adamw"]
    assert calls == [{"muon": {"param_patterns": ["weight"]}, "adamw": {}}]


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
