"""HyperParallel's optimizer API as its scripts call it: prefixed ``*_kwargs`` keys,
``swap_optimizer`` and ``detect_dtensor_backend``, the container's ``RuntimeError``,
and param groups copied back into ``get_hyper_optimizer``.

The facts come from HyperParallel's ``hyper_parallel/core/optimizer/__init__.py``
(``_filter_optimizer_config`` and the ``get_hyper_optimizer`` docstring example),
``components/optim`` (its Trainer builders), ``tests/torch/optimizer/_test_muon_e2e.py``
(``_make_optimizer``), ``swap_optimizer.py``, ``dtensor_compat.py`` and ``lr_scheduler.py``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel
from hyper_parallel import HyperParallelError, UnknownPluginError
from hyper_parallel.core import optimizer as optimizer_api
from hyper_parallel.core.errors import HyperParallelStateDictError
from hyper_parallel.core.optimizer import (
    ChainedOptimizer,
    LRSchedulersContainer,
    SwapOptimizer,
    SwapOptimizerConfig,
    detect_dtensor_backend,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    swap_optimizer,
)

# The constants of HyperParallel's Muon end-to-end test (_test_muon_e2e.py).
E2E_MUON_KWARGS = {
    "muon_lr": 0.01,
    "muon_weight_decay": 0.1,
    "muon_matched_adamw_rms": 0.2,
    "muon_momentum": 0.9,
    "muon_ns_steps": 5,
}
E2E_ADAMW_KWARGS = {"adamw_lr": 1e-3, "adamw_weight_decay": 0.01}


class E2EModel(nn.Module):
    """The parameter kinds of HyperParallel's end-to-end model, small: matrices, 3-D experts, norms."""

    def __init__(self, dim: int = 16, ffn: int = 32, vocab: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.qkv = nn.Parameter(torch.randn(dim, 3 * dim) * 0.02)
        self.router = nn.Parameter(torch.randn(dim, experts) * 0.02)
        self.expert_up = nn.Parameter(torch.randn(experts, dim, ffn) * 0.02)
        self.norm = nn.LayerNorm(dim)


def e2e_model() -> E2EModel:
    torch.manual_seed(7)
    return E2EModel()


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """HyperParallel's _split_params: matrices (and N-D) to Muon, vectors to AdamW."""
    params = list(model.parameters())
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def trained(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3
) -> list[torch.Tensor]:
    """The params after ``steps`` steps on the same seeded gradients."""
    for step in range(steps):
        generator = torch.Generator().manual_seed(2026 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 0.05
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def prefixed_e2e_optimizer(model: nn.Module, **overrides: Any) -> ChainedOptimizer:
    """HyperParallel's _make_optimizer: every option with its optimizer's prefix."""
    muon, adamw = split(model)
    return get_hyper_optimizer(
        model=model,
        muon_params=[{"params": muon}],
        adamw_params=[{"params": adamw}],
        muon_kwargs={**E2E_MUON_KWARGS, **overrides},
        adamw_kwargs=E2E_ADAMW_KWARGS,
    )


# -- 1. prefixed keys in *_kwargs --------------------------------------------------------


def test_prefixed_kwargs_train_exactly_as_the_plain_ones() -> None:
    model = e2e_model()
    optimizer = prefixed_e2e_optimizer(model)
    muon = optimizer["muon"].defaults
    assert (muon["lr"], muon["weight_decay"], muon["matched_adamw_rms"]) == (0.01, 0.1, 0.2)
    assert (muon["momentum"], muon["ns_steps"]) == (0.9, 5)
    assert (optimizer["adamw"].defaults["lr"], optimizer["adamw"].defaults["weight_decay"]) == (
        1e-3,
        0.01,
    )
    after_prefixed = trained(model, optimizer)

    plain_model = e2e_model()
    muon_params, adamw_params = split(plain_model)
    plain = get_hyper_optimizer(
        plain_model,
        [{"params": muon_params}],
        [{"params": adamw_params}],
        {key.removeprefix("muon_"): value for key, value in E2E_MUON_KWARGS.items()},
        {"lr": 1e-3, "weight_decay": 0.01},
    )
    after_plain = trained(plain_model, plain)
    default_model = e2e_model()
    after_defaults = trained(
        default_model, get_hyper_optimizer(default_model, *split(default_model))
    )

    assert all(torch.equal(a, b) for a, b in zip(after_prefixed, after_plain, strict=True))
    assert not torch.allclose(after_prefixed[1], after_defaults[1])  # the options took effect


def test_the_docstring_example_of_hyperparallel_runs() -> None:
    """Its get_hyper_optimizer docstring: prefixed keys, and an unprefixed 'fused'."""
    model = e2e_model()
    muon, adamw = split(model)
    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=[{"params": muon}],
        adamw_params=[{"params": adamw}],
        adamw_kwargs={
            "adamw_lr": 1e-3,
            "adamw_weight_decay": 1e-2,
            "adamw_betas": (0.9, 0.95),
            "adamw_eps": 1e-8,
            "fused": True,
        },
        muon_kwargs={
            "muon_lr": 2e-2,
            "muon_weight_decay": 0.1,
            "muon_momentum": 0.95,
            "muon_ns_steps": 5,
            "muon_ns_variant": "asym5",
            "muon_nesterov": True,
        },
    )
    adamw_group = optimizer["adamw"].param_groups[0]
    assert adamw_group["betas"] == (0.9, 0.95) and adamw_group["fused"] is True
    assert optimizer["muon"].param_groups[0]["ns_variant"] == "asym5"
    before = [p.detach().clone() for p in model.parameters()]
    after = trained(model, optimizer, steps=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_sinkhorn_kwargs_take_the_sinkhorn_prefix() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8, bias=False))
    optimizer = get_hyper_optimizer(
        model,
        muon_params=[model[1].weight],
        sinkhorn_params=[model[0].weight],
        sinkhorn_kwargs={"sinkhorn_lr": 5e-3, "sinkhorn_steps": 7, "tau": 0.0},
    )
    sinkhorn = optimizer["sinkhorn"].param_groups[0]
    assert (sinkhorn["lr"], sinkhorn["steps"], sinkhorn["tau"]) == (5e-3, 7, 0.0)


def test_an_option_given_with_and_without_its_prefix_is_an_error() -> None:
    model = e2e_model()
    muon, adamw = split(model)
    with pytest.raises(ValueError, match=r"muon_kwargs sets option 'lr' twice.*'muon_lr'"):
        get_hyper_optimizer(model, muon, adamw, muon_kwargs={"lr": 0.02, "muon_lr": 0.01})


@pytest.mark.parametrize(
    ("muon_kwargs", "message"),
    [
        ({"adamw_lr": 1e-3}, r"Unknown keyword argument 'adamw_lr' for optimizer 'muon'"),
        (
            {"muon_lrr": 0.02},
            r"Unknown keyword argument 'lrr' for optimizer 'muon'. Did you mean 'lr'",
        ),
    ],
)
def test_unknown_keys_stay_an_error_with_the_prefix(
    muon_kwargs: dict[str, Any], message: str
) -> None:
    """HyperParallel drops (and logs) these; here they are the TypeError they always were."""
    model = e2e_model()
    with pytest.raises(TypeError, match=message):
        get_hyper_optimizer(model, *split(model), muon_kwargs=muon_kwargs)


def test_family_dicts_take_no_prefix_as_in_hyperparallel() -> None:
    """HyperParallel passes family dicts to the constructor as they are: a prefixed key is a TypeError."""
    with pytest.raises(TypeError, match=r"'muon_lr' for optimizer 'muon'"):
        get_hyper_optimizer(e2e_model(), muon={"muon_lr": 0.02}, adamw={})


# -- 2. swap_optimizer and detect_dtensor_backend ------------------------------------------


def test_both_names_are_exported_where_hyperparallel_exports_them() -> None:
    for module in (hyper_parallel, optimizer_api):
        assert {"swap_optimizer", "detect_dtensor_backend"} <= set(module.__all__)
    assert hyper_parallel.swap_optimizer is swap_optimizer
    assert list(inspect.signature(swap_optimizer).parameters) == ["optimizer", "config"]
    assert inspect.signature(swap_optimizer).parameters["config"].default is None
    assert list(inspect.signature(detect_dtensor_backend).parameters) == [
        "adamw_params",
        "muon_params",
    ]


@pytest.mark.parametrize("as_dict", [False, True])
def test_swap_optimizer_wraps_and_steps_as_the_unswapped_optimizer(
    tmp_path: Path, as_dict: bool
) -> None:
    options: dict[str, Any] = {
        "swap_times": 2,
        "tier": "disk",
        "disk_path": tmp_path,
        "min_numel": 0,
    }
    reference_model, swapped_model = e2e_model(), e2e_model()
    reference = trained(reference_model, torch.optim.Adam(reference_model.parameters(), lr=1e-2))
    wrapped = swap_optimizer(
        torch.optim.Adam(swapped_model.parameters(), lr=1e-2),
        options if as_dict else SwapOptimizerConfig(**options),
    )
    assert isinstance(wrapped, SwapOptimizer) and wrapped.config.swap_times == 2
    after = trained(swapped_model, wrapped)
    assert all(torch.equal(a, b) for a, b in zip(reference, after, strict=True))


def test_swap_optimizer_refuses_what_swap_optimizer_refuses() -> None:
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        swap_optimizer(object())  # type: ignore[arg-type]


def test_plain_params_are_the_local_backend() -> None:
    model = e2e_model()
    muon, adamw = split(model)
    assert detect_dtensor_backend(adamw, muon) == "local"
    assert detect_dtensor_backend([{"params": adamw}], []) == "local"
    assert detect_dtensor_backend([], []) == "local"  # HyperParallel: its default


@pytest.fixture
def one_rank_mesh(tmp_path: Path) -> Iterator[Any]:
    """A gloo process group of one rank and a 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_params_are_fully_shards_backend(one_rank_mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = nn.Parameter(distribute_tensor(torch.randn(4, 3), one_rank_mesh, [Shard(0)]))
    plain = nn.Parameter(torch.randn(3))
    assert detect_dtensor_backend([plain], [sharded]) == "fsdp"
    assert detect_dtensor_backend([{"params": [sharded]}], []) == "fsdp"
    # As in HyperParallel, Muon's first param decides when there is one.
    assert detect_dtensor_backend([sharded], [plain]) == "local"


def test_the_environment_names_the_backend_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = [nn.Parameter(torch.randn(3, 3))]
    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "local")
    assert detect_dtensor_backend([], plain) == "local"
    assert detect_dtensor_backend([], []) == "local"
    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "fsdp")
    with pytest.raises(ValueError, match=r"Sharding backend 'fsdp' \(HYPER_PARALLEL_SHARDING="):
        detect_dtensor_backend([], plain)
    monkeypatch.setenv("HYPER_PARALLEL_SHARDING", "fdsp")
    with pytest.raises(UnknownPluginError, match="fdsp"):
        detect_dtensor_backend([], [])


# -- 5. the container's RuntimeError -------------------------------------------------------


@pytest.mark.parametrize(
    "saved_names", [["muon"], ["adamw", "muon", "sinkhorn"], ["adamw", "lion"]]
)
def test_a_state_of_other_schedulers_is_a_runtime_error(saved_names: list[str]) -> None:
    model = e2e_model()
    container = LRSchedulersContainer(
        get_hyper_optimizer(model, *split(model)),
        lambda optimizer: get_hyper_lr_scheduler(optimizer, total_steps=10),
    )
    saved = container.state_dict()
    state = {name: saved.get(name, saved["muon"]) for name in saved_names}
    before = container.state_dict()
    with pytest.raises(
        RuntimeError, match=r"saved schedulers are .*this container has \['adamw', 'muon'\]"
    ) as caught:
        container.load_state_dict(state)
    assert isinstance(caught.value, HyperParallelStateDictError)
    assert isinstance(caught.value, HyperParallelError) and isinstance(caught.value, ValueError)
    assert container.state_dict() == before  # nothing was loaded


# -- 7. param groups copied from our optimizers --------------------------------------------


def copied(optimizer: ChainedOptimizer) -> dict[str, dict[str, Any]]:
    return {
        name: {"params": [dict(g) for g in sub.param_groups]}
        for name, sub in optimizer.optimizers.items()
    }


def options(optimizer: ChainedOptimizer) -> dict[str, list[dict[str, Any]]]:
    return {
        name: [{k: v for k, v in g.items() if k != "params"} for g in sub.param_groups]
        for name, sub in optimizer.optimizers.items()
    }


@pytest.mark.parametrize("with_scheduler", [False, True])
def test_groups_copied_from_every_optimizer_build_the_same_optimizer(with_scheduler: bool) -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        original = get_hyper_optimizer(
            model,
            muon={"lr": 0.03},
            sinkhorn={"lr": 2e-3},
            adamw={"lr": 1e-3, "weight_decay": 0.05},
        )
    if with_scheduler:
        get_hyper_lr_scheduler(original, total_steps=10, warmup_steps=2)  # adds initial_lr
    assert "decoupled_weight_decay" in original["adamw"].param_groups[0]  # torch 2.13's
    rebuilt = get_hyper_optimizer(model, optimizers=copied(original))
    assert list(rebuilt.optimizers) == list(original.optimizers) == ["adamw", "muon", "sinkhorn"]
    assert options(rebuilt) == options(original)


def test_adamw_groups_still_refuse_typos_and_another_decay() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    groups = [
        dict(g) for g in get_hyper_optimizer(model, adamw={}).optimizers["adamw"].param_groups
    ]
    typo = [{**groups[0], "decoupled_weight_decy": True}, *groups[1:]]
    with pytest.raises(
        ValueError, match=r"'decoupled_weight_decy'.*Did you mean 'decoupled_weight_decay'"
    ):
        get_hyper_optimizer(model, optimizers={"adamw": {"params": typo}})
    adam_like = [{**g, "decoupled_weight_decay": False} for g in groups]
    with pytest.raises(
        ValueError, match=r"decoupled_weight_decay=False; AdamW's is always True.*'adam'"
    ):
        get_hyper_optimizer(model, optimizers={"adamw": {"params": adam_like}})
    # The plugin's own class checks the same, built directly.
    adamw = type(get_hyper_optimizer(model, adamw={}).optimizers["adamw"])
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        adamw(adam_like)
    # A key that only AdamW groups hold is no key of another optimizer's groups.
    muon_groups = [{"params": [model[0].weight], "decoupled_weight_decay": True}]
    with pytest.raises(
        ValueError,
        match=r"Unknown key 'decoupled_weight_decay' in a param group of optimizer 'muon'",
    ):
        get_hyper_optimizer(
            model,
            optimizers={
                "muon": {"params": muon_groups},
                "adamw": {"params": [model[0].bias, *model[1].parameters()]},
            },
        )
