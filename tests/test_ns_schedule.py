"""Muon's Newton-Schulz coefficient schedule: ``((a, b, c), repeat)`` pairs over ``ns_steps``.

A schedule is the same as writing its triples out one per iteration, bit for
bit, on every path (batched, per matrix, Gram, FSDP and teams of ranks), as
an option and as a group key; every malformed schedule is a clear error.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.core.optimizer import Muon, get_hyper_optimizer

KELLER = (3.4445, -4.7750, 2.0315)
SETTLE = (2.0, -1.5, 0.5)
#: DeepSeek-V4's hybrid Newton-Schulz: eight of Keller's steps, then two that settle at 1.
SCHEDULE = [(KELLER, 8), (SETTLE, 2)]
WRITTEN_OUT = [KELLER] * 8 + [SETTLE] * 2
STEPS = 3


def _custom(coefficients: Any) -> dict[str, Any]:
    return {"ns_variant": "custom", "ns_coefficients": coefficients, "ns_steps": 10}


def _matrices(shapes: list[tuple[int, int]], seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _train(options: dict[str, Any], shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The params after STEPS steps of Muon with ``options`` on fixed gradients."""
    params = _matrices(shapes)
    opt = Muon(params, lr=0.02, ns_dtype=torch.float32, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@contextmanager
def counting(name: str) -> Iterator[list[tuple[int, ...]]]:
    """Record the shape of the first argument of each call to the iteration function ``name``."""
    from hyper_parallel_builtins.newton_schulz import _iterate

    calls: list[tuple[int, ...]] = []
    real: Callable[..., Any] = getattr(_iterate, name)

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    setattr(_iterate, name, counted)
    try:
        yield calls
    finally:
        setattr(_iterate, name, real)


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# -- the schedule is its triples written out, on every path --------------------------


def test_the_schedule_resolves_to_one_triple_per_iteration() -> None:
    opt = Muon(_matrices([(4, 6)]), **_custom(SCHEDULE))
    assert opt.settings(opt.param_groups[0]).coefficients == tuple(WRITTEN_OUT)


def test_batched_path_equals_the_triples_written_out() -> None:
    shapes = [(12, 20)] * 3
    with counting("_iterate_") as stacks, counting("_iterate_one") as singles:
        scheduled = _train({**_custom(SCHEDULE), "ns_method": "standard"}, shapes)
    assert (3, 12, 20) in stacks and not singles  # one batched stack of the three matrices
    written = _train({**_custom(WRITTEN_OUT), "ns_method": "standard"}, shapes)
    _assert_bitwise(scheduled, written)
    # the last two triples matter: Keller's ten times gives other numbers
    keller = _train({**_custom([KELLER] * 10), "ns_method": "standard"}, shapes)
    assert not torch.equal(scheduled[0], keller[0])


def test_per_matrix_path_equals_the_triples_written_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel_builtins.newton_schulz import _paths

    monkeypatch.setattr(_paths, "PER_MATRIX_FROM", 6)  # float32 goes one by one on any CPU
    shapes = [(8, 14), (8, 14), (14, 8)]
    with counting("_iterate_one") as singles:
        scheduled = _train({**_custom(SCHEDULE), "ns_method": "standard"}, shapes)
    assert len(singles) == 3 * STEPS
    _assert_bitwise(scheduled, _train({**_custom(WRITTEN_OUT), "ns_method": "standard"}, shapes))


def test_gram_path_equals_the_triples_written_out() -> None:
    # 10 iterations: the Gram path restarts before iterations 2, 5 and 8, inside both runs
    shapes = [(6, 40), (40, 6)]
    with counting("_iterate_gram_") as grams:
        scheduled = _train({**_custom(SCHEDULE), "ns_method": "gram"}, shapes)
    assert len(grams) == 2 * STEPS
    _assert_bitwise(scheduled, _train({**_custom(WRITTEN_OUT), "ns_method": "gram"}, shapes))


def test_a_group_key_schedule_beside_a_group_of_the_default_set() -> None:
    a, b = _matrices([(5, 7), (5, 7)])
    opt = Muon([{"params": [a], **_custom(SCHEDULE)}, {"params": [b]}])
    first, second = (opt.settings(g).coefficients for g in opt.param_groups)
    assert first == tuple(WRITTEN_OUT)
    assert len(second) == 5 and second[0] == (4.0848, -6.8946, 2.9270)  # asym5
    opt.add_param_group({"params": _matrices([(3, 3)], seed=2), **_custom(SCHEDULE)})
    assert opt.settings(opt.param_groups[2]).coefficients == tuple(WRITTEN_OUT)


def test_a_schedule_survives_a_state_dict_round_trip() -> None:
    params = _matrices([(6, 9)])
    opt = Muon(params, lr=0.02, **_custom(SCHEDULE))
    params[0].grad = torch.ones(6, 9)
    opt.step()
    twin = [nn.Parameter(p.detach().clone()) for p in params]
    restored = Muon(twin)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert restored.settings(restored.param_groups[0]).coefficients == tuple(WRITTEN_OUT)
    for p in (*params, *twin):
        p.grad = torch.full((6, 9), 0.5)
    opt.step()
    restored.step()
    assert torch.equal(params[0].detach(), twin[0].detach())


def test_yaml_lists_are_a_schedule_too() -> None:
    as_lists = [[list(KELLER), 8], [list(SETTLE), 2]]
    opt = Muon(_matrices([(4, 6)]), **_custom(as_lists))
    assert opt.settings(opt.param_groups[0]).coefficients == tuple(WRITTEN_OUT)


# -- a sharded model: FSDP over 2 ranks, then teams of 2 -------------------------------


def _fsdp_schedule(rank: int, world_size: int) -> None:
    from test_distributed_muon import assert_bitwise_equal, exchange_options
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hyper_parallel_builtins.muon._team as muon_team
    from conftest import TinyLM, lm_loss

    torch.manual_seed(0)
    initial = TinyLM(qkv_bias=False)
    mesh = init_device_mesh("cpu", (world_size,))
    batch = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))

    def trained(coefficients: Any) -> nn.Module:
        model = copy.deepcopy(initial)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = get_hyper_optimizer(
            model, muon_kwargs={"lr": 0.02, **_custom(coefficients)}, adamw_kwargs={"lr": 3e-3}
        )
        for _ in range(STEPS):
            lm_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        return model

    for team in ("1", "2"):
        real, calls = muon_team.newton_schulz_team, []

        def counted(slices: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(slices))
            return real(slices, *args, **kwargs)

        with exchange_options(overlap=True, team_size=team):
            muon_team.newton_schulz_team = counted  # type: ignore[assignment]
            try:
                scheduled = trained(SCHEDULE)
            finally:
                muon_team.newton_schulz_team = real
            written = trained(WRITTEN_OUT)
        assert bool(calls) == (team == "2"), (team, calls)  # teams of 2 share each matrix
        assert_bitwise_equal(scheduled, written, f"team_size={team}")


def test_fsdp_and_team_paths_equal_the_triples_written_out() -> None:
    from distributed import run_distributed

    run_distributed(_fsdp_schedule, world_size=2)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("coefficients", "match"),
    [
        (
            [(KELLER, 8), (SETTLE, 1)],
            r"schedule runs 8 \+ 1 = 9 iterations, but ns_steps=10; "
            r"make the repeats add up to ns_steps, or set ns_steps=9",
        ),
        ([(KELLER, 8), (SETTLE, 3)], r"runs 8 \+ 3 = 11 iterations, but ns_steps=10"),
        ([(KELLER, 8), SETTLE], r"ns_coefficients\[1\] must be a \(\(a, b, c\), repeat\) pair"),
        ([(KELLER, 8), (SETTLE, 1, 1)], r"ns_coefficients\[1\] must be a \(\(a, b, c\), repeat\)"),
        ([((2.0, -1.5), 2), (KELLER, 8)], r"ns_coefficients\[0\]\[0\] must contain exactly three"),
        (
            [(KELLER, 8), ((2.0, float("nan"), 0.5), 2)],
            r"ns_coefficients\[1\]\[0\] must contain only finite values",
        ),
        ([(KELLER, 8), ((2.0, -1.5, float("inf")), 2)], r"only finite values"),
        ([(KELLER, 8), (("2", -1.5, 0.5), 2)], r"\[1\]\[0\] must contain .* that are floats"),
        (
            [(KELLER, 0), (SETTLE, 10)],
            r"ns_coefficients\[0\]\[1\], the number of iterations "
            r"of \(3.4445, -4.775, 2.0315\), must be an int >= 1, got 0",
        ),
        ([(KELLER, -2), (SETTLE, 12)], r"\[0\]\[1\].*must be an int >= 1, got -2"),
        ([(KELLER, 8.0), (SETTLE, 2)], r"\[0\]\[1\].*must be an int >= 1, got 8.0"),
        ([(KELLER, True), (SETTLE, 9)], r"\[0\]\[1\].*must be an int >= 1, got True"),
        ((KELLER, 10), r"is one \(\(a, b, c\), repeat\) pair; a schedule is a list of them"),
        (
            [(3.4445, 8)],
            r"ns_coefficients\[0\] must contain exactly three values.*"
            r"Or write a schedule: \(\(a, b, c\), repeat\) pairs",
        ),
    ],
)
def test_a_bad_schedule_is_refused(coefficients: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Muon(_matrices([(4, 6)]), **_custom(coefficients))
    opt = Muon(_matrices([(4, 6)]))
    with pytest.raises(ValueError, match=match):  # the same check for a group key
        opt.add_param_group({"params": _matrices([(3, 5)], seed=3), **_custom(coefficients)})
    assert len(opt.param_groups) == 1


def test_a_schedule_needs_ns_variant_custom() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "can only be provided when ns_variant='custom' (or as one (a, b, c) triple, "
        "torch.optim.Muon's form); got a schedule of ((a, b, c), repeat) pairs with "
        "ns_variant='asym5'. Add ns_variant='custom'."
    )):  # fmt: skip
        Muon(_matrices([(4, 6)]), ns_variant="asym5", ns_coefficients=SCHEDULE, ns_steps=10)


def test_more_than_99_iterations_are_refused() -> None:
    with pytest.raises(ValueError, match=r"ns_steps must be in 1..99, got 100"):
        Muon(_matrices([(4, 6)]), ns_variant="custom", ns_coefficients=[(KELLER, 100)],
             ns_steps=100)  # fmt: skip
