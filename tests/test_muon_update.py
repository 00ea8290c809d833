"""Muon's functional core and its per-group record (``hyper_parallel_builtins.muon._update``).

The step's arithmetic can be run without the optimizer class: a group's
settings, a :class:`BlockTransform` and the step's options give the same
params as ``Muon.step``, bit for bit. What a group decides (:class:`DecidedGroup`)
follows its options and params: streaming only where every param is whole
and plain, row blocks for head-wise params, no team for a custom
``zeropower_fn``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from hyper_parallel.core.distributed import RowBlocks, WholeMatrices
from hyper_parallel_builtins.muon import Muon
from hyper_parallel_builtins.muon._options import ns_dtype_from_env, resolve_settings
from hyper_parallel_builtins.muon._update import (
    BlockTransform,
    MomentumSource,
    StepOptions,
    apply_updates_,
)
from hyper_parallel_builtins.newton_schulz import Workspace


def _params_and_grads(seed: int = 0) -> tuple[list[nn.Parameter], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8, 8), (8, 24), (3, 6, 4)]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    return params, grads


def _with_muon(
    params: list[nn.Parameter], grads: list[list[torch.Tensor]], **options: object
) -> None:
    muon = Muon(params, **options)  # type: ignore[arg-type]
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        muon.step()


def _group(params: list[nn.Parameter], **options: object) -> dict[str, object]:
    """A Muon group's options as Muon fills them in (without the optimizer's state)."""
    return dict(Muon(params, **options).param_groups[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": (0.9, 0.95), "nesterov": False}, {"adjust_lr_fn": "original"}],
    ids=["hyper_parallel", "m1_m2", "torch_rule"],
)
def test_the_functional_core_alone_steps_like_muon_bitwise(options: dict[str, object]) -> None:
    params, grads = _params_and_grads()
    expected = copy.deepcopy(params)
    _with_muon(expected, grads, **options)

    group = _group(params, **options)
    settings = resolve_settings(group, ns_dtype_from_env())  # as Muon reads it (tests set it)
    transform = BlockTransform(group, settings, workspace=Workspace())
    buffers = [torch.zeros_like(p) for p in params]
    with torch.no_grad():
        for step in grads:
            transform.stream_(params, step, buffers, StepOptions.of(group, settings))
    for got, want in zip(params, expected, strict=True):
        assert torch.equal(got, want)


def test_the_backend_path_pieces_give_the_streamed_numbers_bitwise() -> None:
    """MomentumSource, the transform on whole blocks and apply_updates_: the stream's numbers."""
    params, grads = _params_and_grads(1)
    streamed = copy.deepcopy(params)
    _with_muon(streamed, grads)

    group = _group(params)
    settings = resolve_settings(group, ns_dtype_from_env())
    transform = BlockTransform(group, settings)
    buffers = [torch.zeros_like(p) for p in params]
    with torch.no_grad():
        for step in grads:
            options = StepOptions.of(group, settings)
            updates = MomentumSource(settings, options, buffers, step)(list(range(len(params))))
            apply_updates_(list(params), transform(updates), options)
    for got, want in zip(params, streamed, strict=True):
        assert torch.equal(got, want)


def test_step_options_read_what_schedulers_change_and_the_lr_rule() -> None:
    params, _ = _params_and_grads()
    group = _group(params, lr=0.5, weight_decay=0.2, momentum=(0.8, 0.9), nesterov=False)
    options = StepOptions.of(group, resolve_settings(group))
    assert (options.lr, options.m1, options.m2, options.nesterov) == (0.5, 0.8, 0.9, False)
    assert options.decay == pytest.approx(1 - 0.5 * 0.2)
    assert options.alpha == -0.5
    folded = _group(params, lr=torch.tensor(0.5), apply_lr_in_update=True)
    assert StepOptions.of(folded, resolve_settings(folded)).alpha == 1.0


def test_a_plain_group_streams_and_a_head_wise_or_custom_one_goes_through_its_backend() -> None:
    params, _ = _params_and_grads()
    plain = Muon(params)
    decided = plain.decided(plain.param_groups[0])
    assert decided.streams and decided.backend.name == "local"
    assert all(isinstance(n, WholeMatrices) for n in decided.needs.values())
    assert decided.team is not None

    heads = nn.Parameter(torch.randn(16, 8))
    head_wise = Muon([{"params": [heads], "head_dim": 4}])
    decided = head_wise.decided(head_wise.param_groups[0])
    assert not decided.streams
    assert decided.needs[id(heads)] == RowBlocks((4, 4, 4, 4), 0)

    custom = Muon(params, zeropower_fn=lambda x, steps: x)
    decided = custom.decided(custom.param_groups[0])
    assert not decided.streams and decided.team is None


def test_the_record_is_kept_until_an_option_or_the_params_change() -> None:
    params, _ = _params_and_grads()
    muon = Muon(params[:2])
    group = muon.param_groups[0]
    first = muon.decided(group)
    group["lr"] = 0.5  # read live: the record stays
    assert muon.decided(group) is first
    group["ns_method"] = "gram"
    second = muon.decided(group)
    assert second is not first
    group["params"].append(params[2])
    assert muon.decided(group) is not second
    assert id(params[2]) in muon.decided(group).needs


def test_a_copy_keeps_the_replica_grouping_of_its_backends() -> None:
    params, _ = _params_and_grads()
    muon = Muon(params[:2], hsdp_replica_count=2)
    for twin in (copy.deepcopy(muon), pickle.loads(pickle.dumps(muon))):
        assert twin.hsdp_replica_count == 2
        assert twin._backends.replica_group_size == 2
