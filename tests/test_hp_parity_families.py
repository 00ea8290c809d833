"""Family selectors written as globs beside regular expressions.

HyperParallel's ``param_patterns`` are regular expressions, searched in a param's names; its
users also write MindFormers-style globs (``adamw_include: ["*word_embeddings*", ...]``). Here a
pattern that starts with ``*`` or ``?``, or is written ``glob:<pattern>``, is a glob matched
against a whole name; everything else stays a regular expression. Tiny Hugging Face Llama models,
built in-process from a config.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from test_families import llama, routed
from torch import nn

from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.optimizer import ChainedOptimizer, get_hyper_optimizer

MLP = ("gate_proj", "up_proj", "down_proj")


def mlp_weights(model: nn.Module, layer: int | None = None) -> set[str]:
    prefix = "model.layers." + ("" if layer is None else f"{layer}.")
    return {
        n
        for n, _ in model.named_parameters()
        if n.startswith(prefix) and any(f".mlp.{p}.weight" in n for p in MLP)
    }


def lr_of(optimizer: ChainedOptimizer, family: str, param: torch.Tensor) -> float:
    (group,) = [g for g in optimizer[family].param_groups if any(p is param for p in g["params"])]
    return float(group["lr"])


def test_a_glob_routes_what_the_regex_hyper_parallel_users_write_routes() -> None:
    model = llama()
    by_glob = get_hyper_optimizer(
        model, muon={}, sinkhorn={}, adamw={"param_patterns": ["*.mlp.*"]}
    )
    by_regex = get_hyper_optimizer(
        model, muon={}, sinkhorn={}, adamw={"param_patterns": [r"\.mlp\."]}
    )
    assert routed(by_glob) == routed(by_regex)
    assert mlp_weights(model) <= routed(by_glob)["adamw"]
    assert not mlp_weights(model) & routed(by_glob)["muon"]


def test_globs_and_regexes_mix_in_one_list_and_one_string_is_a_list_of_one() -> None:
    model = llama()
    mixed = get_hyper_optimizer(
        model, muon={}, sinkhorn={}, adamw={"param_patterns": ["*gate_proj*", r"up_proj\.weight$"]}
    )
    moved = {n for n in mlp_weights(model) if "down_proj" not in n}
    assert moved <= routed(mixed)["adamw"] and not moved & routed(mixed)["muon"]
    single = get_hyper_optimizer(model, muon={}, sinkhorn={}, adamw={"param_patterns": "*.mlp.*"})
    assert mlp_weights(model) <= routed(single)["adamw"]


def test_a_glob_matches_the_whole_name_a_regex_is_searched_in_it() -> None:
    model = llama()
    searched = get_hyper_optimizer(
        model, muon={}, sinkhorn={}, adamw={"param_patterns": ["q_proj"]}
    )
    assert {n for n in routed(searched)["adamw"] if "q_proj" in n}
    with pytest.raises(
        HyperParallelValueError,
        match=r"adamw\['param_patterns'\] entry '\*q_proj' matches no param of the model; "
        r"fix the glob \(a glob is matched against whole param names",
    ):  # the names end in '.weight'
        get_hyper_optimizer(model, muon={}, sinkhorn={}, adamw={"param_patterns": ["*q_proj"]})


def test_the_glob_prefix_reads_a_pattern_that_would_be_a_regex_as_a_glob() -> None:
    model = llama()
    # As a regular expression this needs a character between "layers" and "mlp" that the
    # names do not have, so it selects nothing; as a glob, '?' is the layer's digit.
    with pytest.raises(
        HyperParallelValueError,
        match=r"entry 'model\.layers\.\?\.mlp\.\*' matches no param of the model; fix the "
        r"regular expression .* a pattern is a glob when it starts with '\*' or '\?' or is "
        r"written 'glob:\.\.\.'",
    ):
        get_hyper_optimizer(
            model, muon={}, sinkhorn={}, adamw={"param_patterns": ["model.layers.?.mlp.*"]}
        )
    as_glob = get_hyper_optimizer(
        model, muon={}, sinkhorn={}, adamw={"param_patterns": ["glob:model.layers.1.mlp.*"]}
    )
    assert mlp_weights(model, 1) <= routed(as_glob)["adamw"]
    assert mlp_weights(model, 0) <= routed(as_glob)["muon"]


@pytest.mark.parametrize("start", ["*", "?"])
def test_no_regular_expression_starts_like_a_glob(start: str) -> None:
    """Why the rule is unambiguous: a pattern read as a glob was never a valid regex."""
    with pytest.raises(re.error, match="nothing to repeat"):
        re.compile(start + "norm")


def test_param_groups_take_globs_within_their_family() -> None:
    model = llama()
    optimizer = get_hyper_optimizer(
        model,
        muon={"lr": 0.02, "param_groups": [{"param_patterns": ["*.mlp.*"], "lr": 0.1}]},
        sinkhorn={"lr": 1e-3, "param_groups": [{"param_patterns": ["*embed_tokens*"], "lr": 5e-3}]},
        adamw={},
    )
    layer = model.model.layers[1]
    assert lr_of(optimizer, "muon", layer.mlp.up_proj.weight) == 0.1
    assert lr_of(optimizer, "muon", layer.self_attn.o_proj.weight) == 0.02
    assert lr_of(optimizer, "sinkhorn", model.model.embed_tokens.weight) == 5e-3
    assert lr_of(optimizer, "sinkhorn", model.lm_head.weight) == 1e-3


def test_a_glob_selects_a_tied_weight_through_either_name() -> None:
    """HyperParallel's tied-alias test, its regex written as a glob."""
    model = llama(tied=True)
    optimizer = get_hyper_optimizer(
        model,
        muon={},
        sinkhorn={"lr": 1e-3, "param_groups": [{"param_patterns": "*lm_head.weight", "lr": 5e-3}]},
        adamw={},
    )
    shared = model.model.embed_tokens.weight
    assert model.lm_head.weight is shared
    assert lr_of(optimizer, "sinkhorn", shared) == 5e-3


@pytest.mark.parametrize(
    ("patterns", "shown"),
    [
        (["*.mlp_proj.*"], r"'\*\.mlp_proj\.\*'"),
        (["*MLP*"], r"'\*MLP\*'"),  # case-sensitive, as names are
        (["glob:lm_head"], r"'glob:lm_head'"),
    ],
)
def test_a_glob_that_matches_nothing_stays_an_error(patterns: list[str], shown: str) -> None:
    with pytest.raises(HyperParallelValueError, match=shown + " matches no param of the model"):
        get_hyper_optimizer(llama(), muon={}, sinkhorn={}, adamw={"param_patterns": patterns})


def test_a_param_groups_glob_that_selects_none_of_its_family_is_an_error() -> None:
    with pytest.raises(
        HyperParallelValueError,
        match=r"muon\['param_groups'\]\[0\]\['param_patterns'\] selects none of muon's params; "
        r"fix its patterns \(a glob is matched against whole param names",
    ):
        get_hyper_optimizer(
            llama(), muon={"param_groups": [{"param_patterns": ["*.nothing.*"]}]}, adamw={}
        )


@pytest.mark.parametrize(
    ("pattern", "error", "message"),
    [
        ("glob:", HyperParallelTypeError, r"entry 'glob:' is an empty glob"),
        (
            "(q_proj",
            HyperParallelValueError,
            r"entry '\(q_proj' is not a valid regular expression: .*; for a glob, "
            r"write glob:\(q_proj",
        ),
    ],
)
def test_an_empty_glob_and_a_broken_regex_are_named(
    pattern: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        get_hyper_optimizer(llama(), muon={}, sinkhorn={}, adamw={"param_patterns": [pattern]})


def test_a_glob_config_trains_like_its_regex_twin() -> None:
    def run(patterns: Any) -> list[torch.Tensor]:
        model = llama()
        optimizer = get_hyper_optimizer(
            model, muon={"lr": 0.02}, sinkhorn={"lr": 1e-3}, adamw={"param_patterns": patterns}
        )
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(["*.mlp.*"]), run([r"\.mlp\."]), strict=True):
        assert torch.equal(a, b)
