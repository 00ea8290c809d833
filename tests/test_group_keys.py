"""A misspelt param-group key is an error with a suggestion, never a group at the default lr."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.core.errors import HyperParallelError
from hyper_parallel.core.optimizer import AdamW, Muon, Sinkhorn, get_hyper_optimizer


@pytest.mark.parametrize("optimizer", [Muon, Sinkhorn, AdamW], ids=lambda o: o.__name__)
def test_a_typo_in_a_group_is_refused_with_a_suggestion(optimizer: Any) -> None:
    good = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(
        ValueError,
        match=r"Unknown key 'lrr' in a param group of optimizer \w+\. Did you mean 'lr'\?",
    ):
        optimizer([{"params": [good], "lrr": 0.1}])
    opt = optimizer([good], lr=0.01)
    with pytest.raises(HyperParallelError, match="Unknown key 'momentun'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "momentun": 0.9})
    assert len(opt.param_groups) == 1


def test_get_hyper_optimizer_checks_group_keys_of_any_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    weights = [model[0].weight, model[1].weight]
    biases = [model[0].bias, model[1].bias]
    with pytest.raises(ValueError, match=r"Unknown key 'lrr' in a param group of optimizer 'muon'"):
        get_hyper_optimizer(
            model, muon_params=[{"params": weights, "lrr": 0.1}], adamw_params=biases
        )
    with pytest.raises(ValueError, match=r"of optimizer 'sgd'\. Did you mean 'momentum'\?"):
        get_hyper_optimizer(
            model, optimizers={"sgd": {"params": [{"params": weights + biases, "momentun": 0.9}]}}
        )


def test_keys_torch_schedulers_add_still_load() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    opt = Muon([p], lr=0.02)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # adds initial_lr to each group
    opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "initial_lr": 0.02})
    assert len(opt.param_groups) == 2
