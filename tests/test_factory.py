"""get_hyper_optimizer: every way of naming params, and every bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from conftest import TinyLM, lm_loss
from hyper_parallel import UnknownPluginError
from hyper_parallel.core.optimizer import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def guide_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if any(k in name for k in PROJ) else adamw).append(p)
    return muon, adamw


def ids(params: list[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


def opt_params(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def test_guide_form_builds_muon_and_adamw() -> None:
    model = TinyLM(qkv_bias=False)
    muon, adamw = guide_split(model)
    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=muon,
        adamw_params=adamw,
        muon_kwargs={"lr": 0.02, "momentum": 0.95},
        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
    )
    assert isinstance(optimizer, ChainedOptimizer)
    assert list(optimizer.optimizers) == ["adamw", "muon"]  # HyperParallel's order
    assert isinstance(optimizer.optimizers["muon"], Muon)
    assert isinstance(optimizer.optimizers["adamw"], AdamW)
    assert opt_params(optimizer.optimizers["muon"]) == ids(muon)
    assert opt_params(optimizer.optimizers["adamw"]) == ids(adamw)
    assert optimizer.optimizers["muon"].param_groups[0]["momentum"] == 0.95
    assert optimizer.optimizers["adamw"].param_groups[0]["weight_decay"] == 0.1


def test_one_dim_params_listed_for_muon_go_to_adamw_with_one_warning(model: nn.Module) -> None:
    muon, adamw = guide_split(model)  # q/k/v biases are 1-D and match the guide's names
    with pytest.warns(UserWarning) as record:
        optimizer = get_hyper_optimizer(model, muon, adamw, {"lr": 0.02}, {"lr": 3e-4})
    messages = [str(w.message) for w in record if "fewer than 2 dims" in str(w.message)]
    assert len(messages) == 1
    assert (
        "6 param(s)" in messages[0]
        and "layers.0.q_proj.bias" in messages[0]
        and "'adamw'" in messages[0]
    )
    biases = [p for n, p in model.named_parameters() if n.endswith("proj.bias")]
    assert ids(biases) <= opt_params(optimizer.optimizers["adamw"])
    assert not ids(biases) & opt_params(optimizer.optimizers["muon"])


def test_one_dim_params_create_adamw_when_only_muon_is_given() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="'0.bias', '1.bias'|0.bias, 1.bias"):
        optimizer = get_hyper_optimizer(model, muon_params=list(model.parameters()))
    assert set(optimizer.optimizers) == {"muon", "adamw"}
    assert opt_params(optimizer.optimizers["adamw"]) == {id(model[0].bias), id(model[1].bias)}


def test_any_registered_optimizers_by_name(model: nn.Module) -> None:
    muon, adamw = guide_split(model)
    matrices = [p for p in muon if p.ndim == 2]
    vectors = [p for p in muon if p.ndim < 2]
    optimizer = get_hyper_optimizer(
        model,
        optimizers={
            "muon": {"params": matrices, "lr": 0.05},
            "sgd": {"params": adamw, "lr": 0.1, "momentum": 0.9},
            "adam": {"params": vectors, "lr": 1e-3},
        },
    )
    assert list(optimizer.optimizers) == ["muon", "sgd", "adam"]
    assert isinstance(optimizer.optimizers["sgd"], torch.optim.SGD)
    assert optimizer.optimizers["sgd"].param_groups[0]["momentum"] == 0.9


def test_partitioner_when_params_are_not_given(model: nn.Module) -> None:
    optimizer = get_hyper_optimizer(model, partitioner="by_shape", muon_kwargs={"lr": 0.03})
    assert optimizer.optimizers["muon"].param_groups[0]["lr"] == 0.03
    muon_names = {
        n for n, p in model.named_parameters() if id(p) in opt_params(optimizer.optimizers["muon"])
    }
    assert muon_names == {n for n, p in model.named_parameters() if "proj.weight" in n}
    # no params and no partitioner: by_shape is the default
    default = get_hyper_optimizer(model)
    assert opt_params(default.optimizers["muon"]) == opt_params(optimizer.optimizers["muon"])


def test_prefixed_kwargs(model: nn.Module) -> None:
    optimizer = get_hyper_optimizer(model, muon_lr=0.07, muon_ns_steps=4, adamw_weight_decay=0.0)
    assert optimizer.optimizers["muon"].param_groups[0]["lr"] == 0.07
    assert optimizer.optimizers["muon"].param_groups[0]["ns_steps"] == 4
    assert all(g["weight_decay"] == 0.0 for g in optimizer.optimizers["adamw"].param_groups)


def test_frozen_params_are_skipped_and_tied_params_counted_once() -> None:
    model = TinyLM(tied=True, qkv_bias=False)
    model.layers[0].q_proj.weight.requires_grad_(False)
    everything = [p for _, p in model.named_parameters(remove_duplicate=False)]
    muon = [p for n, p in model.named_parameters() if "proj" in n]
    rest = [p for p in everything if id(p) not in ids(muon)]  # holds the tied weight twice
    optimizer = get_hyper_optimizer(model, muon, rest)
    assert id(model.layers[0].q_proj.weight) not in opt_params(optimizer)
    adamw_params = [p for g in optimizer.optimizers["adamw"].param_groups for p in g["params"]]
    assert sum(p is model.embed_tokens.weight for p in adamw_params) == 1


def test_empty_list_means_that_optimizer_is_not_created() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    optimizer = get_hyper_optimizer(model, muon_params=list(model.parameters()), adamw_params=[])
    assert list(optimizer.optimizers) == ["muon"]


def test_training_with_the_factory_reduces_loss(model: nn.Module, batch: torch.Tensor) -> None:
    optimizer = get_hyper_optimizer(model, partitioner="by_shape", muon_lr=0.02, adamw_lr=3e-3)
    start = float(lm_loss(model, batch).detach())
    for _ in range(10):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(lm_loss(model, batch).detach()) < 0.9 * start


# -- bad input -------------------------------------------------------------------------


def test_the_explicit_form_takes_sinkhorn_params_and_kwargs_as_hyper_parallel_does() -> None:
    from hyper_parallel.core.optimizer import Sinkhorn

    model = TinyLM(qkv_bias=False)
    table, head = model.embed_tokens.weight, model.lm_head.weight
    muon, adamw = guide_split(model)
    adamw = [p for p in adamw if p is not table and p is not head]
    optimizer = get_hyper_optimizer(
        model,
        muon_params=muon,
        adamw_params=adamw,
        sinkhorn_params=[{"params": [head]}, {"params": [table], "lr": 5e-3}],
        sinkhorn_kwargs={"lr": 1e-3},
        muon_kwargs={"lr": 0.02},
    )
    assert list(optimizer.optimizers) == ["adamw", "muon", "sinkhorn"]
    sinkhorn = optimizer.optimizers["sinkhorn"]
    assert isinstance(sinkhorn, Sinkhorn)
    assert [g["lr"] for g in sinkhorn.param_groups] == [1e-3, 5e-3]
    assert optimizer.param_names_by_optimizer["sinkhorn"] == [
        "embed_tokens.weight",
        "lm_head.weight",
    ]
    # a vector goes to AdamW instead, as it does when listed for Muon
    small = nn.ModuleDict({"embed": nn.Embedding(8, 4), "norm": nn.LayerNorm(4)})
    with pytest.warns(UserWarning, match="listed for sinkhorn.*norm.weight"):
        moved = get_hyper_optimizer(
            small, sinkhorn_params=[small["embed"].weight, small["norm"].weight],
            adamw_params=[small["norm"].bias],
        )  # fmt: skip
    assert moved.param_names_by_optimizer["adamw"] == ["norm.weight", "norm.bias"]


def test_param_in_two_groups(model: nn.Module) -> None:
    muon, adamw = guide_split(model)
    with pytest.raises(
        ValueError,
        match="Param 'layers.0.q_proj.weight' is in the groups of both 'adamw' and 'muon'",
    ):
        get_hyper_optimizer(model, muon, [*adamw, model.layers[0].q_proj.weight])


def test_trainable_param_in_no_group_lists_names(model: nn.Module) -> None:
    muon, _ = guide_split(model)
    with pytest.raises(ValueError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_hyper_optimizer(model, [p for p in muon if p.ndim == 2], [])
    message = str(info.value)
    assert "13 trainable param(s) are in no optimizer group and would never train" in message
    assert "embed_tokens.weight, layers.0.input_norm.weight" in message and "and 8 more" in message
    assert "partitioner='by_shape'" in message


def test_unknown_kwarg_has_a_hint(model: nn.Module) -> None:
    with pytest.raises(
        TypeError,
        match="Unknown keyword argument 'momentun' for optimizer 'muon'. Did you mean 'momentum'",
    ):
        get_hyper_optimizer(model, muon_kwargs={"momentun": 0.9})
    with pytest.raises(
        TypeError,
        match="unexpected keyword argument 'muon_params_x'|Unknown keyword argument 'params_x'",
    ):
        get_hyper_optimizer(model, muon_params_x=1)
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'partitionr'.*Did you mean 'partitioner'"
    ):
        get_hyper_optimizer(model, partitionr="by_shape")


def test_unknown_partitioner_option(model: nn.Module) -> None:
    with pytest.raises(
        TypeError,
        match="Unknown keyword argument 'head_name' for partitioner 'by_shape'. Did you mean 'head_names'",
    ):
        get_hyper_optimizer(
            model, partitioner="by_shape", partitioner_kwargs={"head_name": ["lm_head"]}
        )


def test_all_groups_empty() -> None:
    model = nn.Linear(2, 2)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="got no params to optimize"):
        get_hyper_optimizer(model, muon_params=[], adamw_params=list(model.parameters()))


def test_unknown_names(model: nn.Module) -> None:
    with pytest.raises(UnknownPluginError, match="Unknown optimizer 'lion'.*Available:"):
        get_hyper_optimizer(model, optimizers={"lion": {"params": list(model.parameters())}})
    with pytest.raises(
        UnknownPluginError, match="Unknown partitioner 'by_shap'.*Did you mean 'by_shape'"
    ):
        get_hyper_optimizer(model, partitioner="by_shap")


def test_params_and_partitioner_together(model: nn.Module) -> None:
    muon, adamw = guide_split(model)
    with pytest.raises(ValueError, match="both explicit params and partitioner='by_name'"):
        get_hyper_optimizer(model, muon, adamw, partitioner="by_name")


def test_param_not_in_model(model: nn.Module) -> None:
    stranger = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(
        ValueError, match=r"shape \(3, 3\) given to optimizer 'muon' is not a parameter of model"
    ):
        get_hyper_optimizer(model, muon_params=[stranger], adamw_params=list(model.parameters()))


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="needs model=<nn.Module>, got list"):
        get_hyper_optimizer([nn.Parameter(torch.zeros(2, 2))])  # type: ignore[arg-type]


def test_same_optimizer_configured_twice(model: nn.Module) -> None:
    with pytest.raises(ValueError, match="Optimizer 'muon' is configured twice"):
        get_hyper_optimizer(model, muon_kwargs={"lr": 0.1}, optimizers={"Muon": {"lr": 0.2}})
    with pytest.raises(ValueError, match="Option 'lr' of optimizer 'muon' is given twice"):
        get_hyper_optimizer(model, muon_kwargs={"lr": 0.1}, muon_lr=0.2)


def test_sharding_backend_must_match_the_params(
    model: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        ValueError,
        match=r"Sharding backend 'hsdp' \(sharding='hsdp'\) does not match the params: "
        r"layers.0.q_proj.weight \(shape \(16, 16\), a plain tensor\)",
    ):
        get_hyper_optimizer(model, sharding="hsdp")
    with pytest.raises(
        UnknownPluginError, match="Unknown sharding backend 'fdsp'.*Did you mean 'fsdp'"
    ):
        get_hyper_optimizer(model, sharding="fdsp")
    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "fsdp")
    with pytest.raises(
        ValueError, match=r"'fsdp' \(HYPER_PARALLEL_SHARDING='fsdp'\) does not match"
    ):
        get_hyper_optimizer(model)
    optimizer = get_hyper_optimizer(model, sharding="local")
    assert optimizer.optimizers["muon"].param_groups[0]["sharding"] == "local"


@pytest.mark.parametrize("name", ["muon", "torch_muon"])
def test_a_matrix_only_optimizer_gives_its_vectors_to_adamw(name: str) -> None:
    # both say it one way, requires=("matrices_only",)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.warns(UserWarning, match=r"fewer than 2 dims were listed for"):
        opt = get_hyper_optimizer(model, optimizers={name: {"params": list(model.parameters())}})
    held = {n: [p for g in o.param_groups for p in g["params"]] for n, o in opt.optimizers.items()}
    assert [p.ndim for p in held[name]] == [2]
    assert sorted(p.ndim for p in held["adamw"]) == [1, 1, 1]
