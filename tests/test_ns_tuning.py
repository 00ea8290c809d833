"""Newton-Schulz paths measured on this machine: the switches, the cache, the numbers, the ranks.

The suite runs with tuning off (conftest); these tests turn it on with a cache directory of
their own. A forced candidate is one a cache file names: Muon reads it and measures nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from distributed import run_distributed
from test_muon import reference_muon, relative_error

import hyper_parallel_builtins.muon._options as options_module
import hyper_parallel_builtins.muon._update as update_module
from hyper_parallel_builtins.muon import Muon
from hyper_parallel_builtins.muon._options import NS_DTYPE_ENV
from hyper_parallel_builtins.newton_schulz import (
    CACHE_DIR_ENV,
    TUNING_ENV,
    Candidate,
    PathCache,
    ShapeSet,
    Stack,
    Tuning,
    Workspace,
    _tuning,
    candidates,
    default_cache_dir,
    stacks_of,
    tune,
    tuning_from_env,
)
from hyper_parallel_builtins.newton_schulz._path_cache import CACHE_FORMAT, device_name
from hyper_parallel_builtins.newton_schulz._paths import StackPath, resolve_ns_method, stack_path
from hyper_parallel_builtins.newton_schulz._tuning import SWITCH_BELOW

CPU = torch.device("cpu")
STEPS = 3
TORCH: dict[str, Any] = {
    "adjust_lr_fn": "original",
    "lr": 0.02,
}  # the convention of the float64 reference

#: (rows, cols) of a tall, a wide and a square param, and a long one that ns_method="auto" runs
#: by Gram; past one symmetric block of 256 rows, so every candidate (per matrix too) is one
SHAPES = {"tall": (384, 320), "wide": (320, 384), "square": (320, 320), "long": (800, 288)}
COUNT = 2  # params of each shape


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tuning on (by its variable), the cache in a directory of this test's own."""
    monkeypatch.setenv(TUNING_ENV, "on")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The candidates timed (by name), with the real timer."""
    calls: list[str] = []
    real = _tuning.seconds_of

    def counting(candidate: Candidate, *args: Any) -> float:
        calls.append(candidate.name)
        return real(candidate, *args)

    monkeypatch.setattr(_tuning, "seconds_of", counting)
    return calls


@pytest.fixture
def bf16_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Muon's default Newton-Schulz dtype is bfloat16 here (as on a CPU with native bf16)."""
    monkeypatch.delenv(NS_DTYPE_ENV)
    monkeypatch.setattr(options_module, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def ns_stacks() -> Iterator[mock.MagicMock]:
    """A spy on Muon's Newton-Schulz: each call's first argument is the stack it ran."""
    real = update_module.newton_schulz_stack_
    with mock.patch.object(update_module, "newton_schulz_stack_", wraps=real) as spy:
        yield spy


def _dtypes(spy: mock.MagicMock) -> set[torch.dtype]:
    return {call.args[0].dtype for call in spy.call_args_list}


def _start(shapes: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _grads(shapes: list[tuple[int, int]]) -> list[list[torch.Tensor]]:
    return [_start(shapes, seed=1 + step) for step in range(STEPS)]


def _train(
    starts: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    workspace: Workspace | None = None,
    **options: Any,
) -> tuple[list[torch.Tensor], Muon]:
    """Copies of ``starts`` after a Muon step per entry of ``grads`` (in ``workspace`` if given)."""
    params = [p.clone().requires_grad_() for p in starts]
    muon = Muon(params, **options)
    if workspace is not None:
        muon.workspace = workspace
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        muon.step()
    return [p.detach() for p in params], muon


class _TablePaths(Workspace):
    """Today's workspace: every stack takes :func:`stack_path`'s path, never a tuned one."""

    def path(
        self, method: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> StackPath:
        return stack_path(method, rows, cols, dtype, device)


# -- the switches ------------------------------------------------------------------------


def test_the_variable_and_the_option_name_the_mode_and_refuse_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TUNING_ENV)
    assert tuning_from_env() is Tuning.ON  # the default
    for name in ("on", "off", "retune"):
        monkeypatch.setenv(TUNING_ENV, name)
        assert tuning_from_env() is Tuning(name)
        assert Muon([torch.zeros(4, 4)]).ns_tuning is Tuning(name)  # read when it is built
    assert Muon([torch.zeros(4, 4)], ns_tuning="off").ns_tuning is Tuning.OFF  # the option wins
    monkeypatch.setenv(TUNING_ENV, "retuen")
    with pytest.raises(ValueError, match=r"HYPER_PARALLEL_NS_TUNING='retuen' is not a tuning "
                       r"mode; use one of 'on', 'off', 'retune'\. Did you mean 'retune'"):  # fmt: skip
        Muon([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match=r"ns_tuning='fast' is not a tuning mode"):
        Muon([torch.zeros(4, 4)], ns_tuning="fast")


def test_the_cache_directory_follows_the_variable_then_the_platform(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hyper_parallel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "hyper_parallel"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert default_cache_dir() == Path.home() / "Library" / "Caches" / "hyper_parallel"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert default_cache_dir() == tmp_path / "local" / "hyper_parallel" / "Cache"


@pytest.mark.parametrize("how", ["option", "variable"])
def test_tuning_off_runs_todays_paths_bitwise_and_measures_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, timed: list[str], how: str
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(TUNING_ENV, "off" if how == "variable" else "on")
    # batched and per matrix (from 640 rows), tall, wide and square, and a Gram stack
    shapes = [s for s in SHAPES.values() for _ in range(COUNT)] + [(640, 700), (96, 24)]
    starts, grads = _start(shapes), _grads(shapes)
    today, _ = _train(starts, grads, workspace=_TablePaths(), ns_tuning="off", **TORCH)
    switch: dict[str, Any] = {"ns_tuning": "off"} if how == "option" else {}
    ours, muon = _train(starts, grads, **switch, **TORCH)
    for a, b in zip(ours, today, strict=True):
        assert torch.equal(a, b)
    assert timed == [] and not (tmp_path / "cache").exists()
    assert muon.ns_tuning_report is None


# -- every candidate within the parity tolerance -----------------------------------------


def _stack(shape: tuple[int, int]) -> Stack:
    gram = resolve_ns_method("auto", *shape, CPU) == "gram"
    return Stack(*shape, COUNT, torch.bfloat16, CPU, dtype_free=True, gram=gram)


def test_a_stack_the_rule_runs_by_gram_times_the_standard_iteration_against_it() -> None:
    long, tall = _stack(SHAPES["long"]), _stack(SHAPES["tall"])
    assert long.gram and not tall.gram
    made = candidates(long)
    assert made[0].path.gram and made[0].name == "bfloat16, Gram"  # the rule's path first
    standard = [c for c in made[1:] if not c.path.gram]
    assert len(standard) == len(made) - 1 == len(candidates(tall))
    assert not any(c.path.gram for c in candidates(tall))  # never Gram where the rule is standard
    matrices = [(2, 800, 288, torch.bfloat16, CPU), (1, 384, 320, torch.bfloat16, CPU)]
    assert [s.gram for s in stacks_of(matrices, "auto", True)] == [True, False]
    assert [s.gram for s in stacks_of(matrices, "standard", True)] == [False, False]
    assert stacks_of(matrices, "gram", True) == []  # named Gram: nothing to choose
    keys = {ShapeSet.of(s).key for s in (long, dataclasses.replace(long, gram=False))}
    assert len(keys) == 2


def _forced(shape_name: str) -> list[tuple[str, str, Candidate]]:
    return [(shape_name, c.name, c) for c in candidates(_stack(SHAPES[shape_name]))]


@functools.cache
def _expected(rows: int, cols: int) -> list[torch.Tensor]:
    """The float64 reference's params after the steps (the same for every candidate)."""
    shapes = [(rows, cols)] * COUNT
    starts, grads = _start(shapes), _grads(shapes)
    return [
        reference_muon(start, [g[i] for g in grads], (1, rows, cols))
        for i, start in enumerate(starts)
    ]


FORCED = [case for name in SHAPES for case in _forced(name)]


@pytest.mark.parametrize(("shape_name", "name", "candidate"), FORCED, ids=[
    f"{s}-{n}" for s, n, _ in FORCED])  # fmt: skip
def test_each_candidate_a_cache_names_keeps_muon_within_the_parity_tolerance(
    cache_dir: Path,
    timed: list[str],
    bf16_default: None,
    ns_stacks: mock.MagicMock,
    shape_name: str,
    name: str,
    candidate: Candidate,
) -> None:
    rows, cols = SHAPES[shape_name]
    cache = PathCache(cache_dir)
    cache.put(ShapeSet.of(_stack((rows, cols))).key, candidate, {name: 1.0})
    cache.save()
    starts, grads = _start([(rows, cols)] * COUNT), _grads([(rows, cols)] * COUNT)
    params, muon = _train(starts, grads, **TORCH)
    assert timed == []  # read from the cache: nothing measured
    report = muon.ns_tuning_report
    assert report is not None and report.cached and report.shapes[0].chosen == candidate
    assert muon.workspace is not None
    assert muon.workspace.path("auto", rows, cols, candidate.dtype, CPU) == candidate.path
    assert _dtypes(ns_stacks) == {candidate.dtype}
    # the parity tolerances of test_muon: 5e-5 for a float32 iteration, 1e-2 for bfloat16
    tolerance = 5e-5 if candidate.dtype == torch.float32 else 1e-2
    for param, expected, start in zip(params, _expected(rows, cols), starts, strict=True):
        assert relative_error(param, expected, start) < tolerance, (shape_name, name)


# -- measure once, then remember ---------------------------------------------------------

SMALL = [(64, 48), (64, 48), (48, 64), (32, 32)]


def test_a_first_run_measures_and_writes_the_cache_and_a_second_optimizer_reads_it(
    cache_dir: Path, timed: list[str], bf16_default: None
) -> None:
    starts, grads = _start(SMALL), _grads(SMALL)
    _, first = _train(starts, grads, **TORCH)
    report = first.ns_tuning_report
    assert report is not None and not report.cached and report.cost_s > 0
    assert [(s.stack.rows, s.stack.cols, s.stack.count) for s in report.shapes] == [
        (64, 48, 2), (48, 64, 1), (32, 32, 1)]  # fmt: skip
    assert timed  # measured
    for shape in report.shapes:  # the default dtype's candidates all timed, the fastest chosen
        names = {c.name: c.dtype for c in candidates(shape.stack)}
        assert {n for n, dtype in names.items() if dtype == torch.bfloat16} <= set(shape.seconds)
        assert set(shape.seconds) <= set(names)
        assert any(names[n] == torch.float32 for n in shape.seconds)  # float32's table path
        table, fastest = next(iter(shape.seconds)), min(shape.seconds, key=shape.seconds.get)
        leads = shape.seconds[fastest] < SWITCH_BELOW * shape.seconds[table]
        assert shape.chosen.name == (fastest if leads else table)  # the table's, unless beaten
    written = json.loads((cache_dir / "ns_paths.json").read_text())
    assert written["torch"] == torch.__version__ and len(written["entries"]) == 3

    timed.clear()
    _, second = _train(starts, grads, **TORCH)
    assert timed == []  # a new optimizer reads the cache and measures nothing
    again = second.ns_tuning_report
    assert again is not None and again.cached
    assert [s.chosen for s in again.shapes] == [s.chosen for s in report.shapes]

    _train(starts, grads, ns_tuning="retune", **TORCH)
    assert timed  # measured again
    _, off = _train(starts, grads, ns_tuning="off", **TORCH)
    assert off.ns_tuning_report is None


@pytest.mark.parametrize(("lead", "wins"), [(0.97, False), (0.90, True)])
def test_another_path_replaces_the_tables_only_where_it_is_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lead: float, wins: bool
) -> None:
    stack = Stack(64, 48, 2, torch.float32, CPU)
    table, other = [c.name for c in candidates(stack)][:2]
    times = {table: 1.0, other: lead}
    monkeypatch.setattr(_tuning, "seconds_of", lambda c, run, device: times.get(c.name, 2.0))
    (shape,) = tune([stack], Tuning.ON, PathCache(tmp_path)).shapes
    assert shape.seconds[other] == lead  # measured and reported either way
    assert shape.chosen.name == (other if wins else table)


@pytest.mark.parametrize(
    ("gram_s", "standard_s", "chosen"),
    [(1.0, 0.98, "standard"), (1.0, 1.03, "standard"), (0.90, 1.0, "Gram")],
    ids=["standard-faster", "tie-within-5%", "gram-clearly-faster"],
)
def test_where_the_rule_runs_gram_a_tie_goes_to_the_standard_iteration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gram_s: float, standard_s: float, chosen: str
) -> None:
    """Gram approximates the standard iteration: it is kept only where clearly faster."""
    stack = _stack(SHAPES["long"])
    gram, *standard = [c.name for c in candidates(stack)]
    assert stack.gram and "Gram" in gram
    fastest_standard = standard[1]  # not the table's standard path: the fastest one is the bar
    times = {gram: gram_s, fastest_standard: standard_s}
    monkeypatch.setattr(_tuning, "seconds_of", lambda c, run, device: times.get(c.name, 1.5))
    (shape,) = tune([stack], Tuning.ON, PathCache(tmp_path)).shapes
    expected = gram if chosen == "Gram" else fastest_standard
    assert shape.chosen.name == expected, shape.seconds


def _tuned_once(cache_dir: Path) -> None:
    _train(_start(SMALL), _grads(SMALL), **TORCH)
    assert (cache_dir / "ns_paths.json").exists()


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda text: text[: len(text) // 2], "cannot be read"),
        (lambda text: "[1, 2]", "not a path cache"),
        (lambda text: text.replace(f'"format": {CACHE_FORMAT}', '"format": 0'), "format 0"),
        (lambda text: text.replace(torch.__version__, "1.0.0"), "torch '1.0.0'"),
        (lambda text: text.replace('"per_matrix": false', '"per_matrix": 3'), "malformed"),
    ],
    ids=["corrupt", "not-a-cache", "other-format", "other-torch", "bad-entry"],
)
def test_a_corrupt_or_stale_cache_is_ignored_with_one_warning_line_and_rewritten(
    cache_dir: Path, timed: list[str], spoil: Any, says: str
) -> None:
    _tuned_once(cache_dir)
    file = cache_dir / "ns_paths.json"
    file.write_text(spoil(file.read_text()))
    timed.clear()
    with pytest.warns(UserWarning) as caught:
        _train(_start(SMALL), _grads(SMALL), **TORCH)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert says in messages[0] and str(file) in messages[0]
    assert timed  # measured again
    rewritten = json.loads(file.read_text())
    assert rewritten["format"] == CACHE_FORMAT and rewritten["torch"] == torch.__version__
    assert len(rewritten["entries"]) == 3


def test_the_key_holds_the_device_torch_threads_shape_and_dtype(
    cache_dir: Path, timed: list[str]
) -> None:
    key = ShapeSet.of(Stack(64, 48, 2, torch.bfloat16, CPU, dtype_free=True)).key
    for part in (device_name(CPU), torch.__version__,
                 f"{torch.get_num_threads()} threads", "64x48 x2", "bfloat16"):  # fmt: skip
        assert part in key, (part, key)
    others = [Stack(48, 64, 2, torch.bfloat16, CPU, True), Stack(64, 48, 3, torch.bfloat16, CPU, True),
              Stack(64, 48, 2, torch.float32, CPU, True), Stack(64, 48, 2, torch.bfloat16, CPU)]  # fmt: skip
    assert len({key, *(ShapeSet.of(s).key for s in others)}) == 5

    _tuned_once(cache_dir)
    timed.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _train(_start(SMALL), _grads(SMALL), **TORCH)  # another thread count: a cache miss
    finally:
        torch.set_num_threads(threads)
    assert timed
    assert len(json.loads((cache_dir / "ns_paths.json").read_text())["entries"]) == 6


def test_a_group_that_names_its_dtype_or_zeropower_fn_is_tuned_as_it_says(
    cache_dir: Path, bf16_default: None, ns_stacks: mock.MagicMock
) -> None:
    starts, grads = _start([(64, 48)]), _grads([(64, 48)])
    _, named = _train(starts, grads, ns_dtype=torch.bfloat16, **TORCH)
    report = named.ns_tuning_report
    assert report is not None and not report.shapes[0].stack.dtype_free
    assert {c.split(",")[0] for c in report.shapes[0].seconds} == {"bfloat16"}  # no float32
    assert _dtypes(ns_stacks) == {torch.bfloat16}
    _, custom = _train(starts, grads, zeropower_fn=lambda x, steps: x, **TORCH)
    assert custom.ns_tuning_report is None  # the user's iteration: nothing to tune


def test_tuning_runs_once_per_group_when_it_is_decided_never_at_a_later_step(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyper_parallel_builtins.muon import _optimizer

    calls: list[int] = []
    real = _optimizer.tune
    monkeypatch.setattr(_optimizer, "tune", lambda stacks, *a: calls.append(1) or real(stacks, *a))
    starts = _start(SMALL)
    params = [p.clone().requires_grad_() for p in starts]
    muon = Muon([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], **TORCH)
    for step in _grads(SMALL):
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        muon.step()
    assert len(calls) == 2  # one per group, at its first step
    muon.param_groups[1]["ns_steps"] = 3  # an edited group is decided again: its choice read back
    muon.step()
    report = muon.ns_tuning_report
    assert len(calls) == 3 and report is not None and len(report.shapes) == 3


def test_a_kept_path_replaces_the_tables_where_the_method_allows_it() -> None:
    ws = Workspace()
    table = ws.path("auto", 96, 64, torch.float32, CPU)  # decided, then kept
    tuned = StackPath(gram=False, per_matrix=False, poly_transposed=not table.poly_transposed,
                      tall_transposed=True)  # fmt: skip
    ws.keep_path(96, 64, torch.float32, CPU, tuned)
    assert ws.path("auto", 96, 64, torch.float32, CPU) == tuned
    assert ws.path("standard", 96, 64, torch.float32, CPU) == tuned
    assert ws.path("auto", 96, 64, torch.bfloat16, CPU) == stack_path(
        "auto", 96, 64, torch.bfloat16, CPU
    )
    ws.keep_path(96, 24, torch.float32, CPU, tuned)  # the standard iteration over the rule's Gram
    assert ws.path("auto", 96, 24, torch.float32, CPU) == tuned
    assert ws.path("gram", 96, 24, torch.float32, CPU).gram  # a named Gram stays Gram
    ws.clear()  # buffers go, kept paths stay
    assert ws.path("auto", 96, 64, torch.float32, CPU) == tuned


# -- the tuning cost ---------------------------------------------------------------------


def test_the_cost_of_tuning_a_transformer_is_measured_and_reported(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformer_shapes(256, 2) of the benchmarks: the cost is reported, not held to a time."""
    from benchmarks.common import transformer_shapes

    shapes = Counter(transformer_shapes(256, 2))
    matrices = [(n, r, c, torch.bfloat16, CPU) for (r, c), n in shapes.items()]
    stacks = stacks_of(matrices, "auto", dtype_free=True)  # the MLP's by Gram's rule, timed too
    report = tune(stacks, Tuning.ON, PathCache(cache_dir))
    assert report.cost_s > 0 and not report.cached
    assert sum(s.cost_s for s in report.shapes) <= report.cost_s
    with capsys.disabled():
        print(f"\n{report}")


# -- ranks -------------------------------------------------------------------------------


def _check_ranks_run_rank_0s_choice(rank: int, world_size: int, tmp: str) -> None:
    import os

    import torch.distributed as dist

    os.environ[TUNING_ENV] = "on"
    os.environ[CACHE_DIR_ENV] = str(Path(tmp) / f"rank{rank}")
    timed: list[str] = []

    def favouring(candidate: Candidate, *args: Any) -> float:
        """Rank 0 finds P @ X fastest, rank 1 P^T @ X."""
        timed.append(candidate.name)
        return 1.0 if candidate.path.poly_transposed == (rank == 1) else 2.0

    _tuning.seconds_of = favouring  # type: ignore[assignment]  # a process of this test's own
    params, muon = _train(_start(SMALL), _grads(SMALL), **TORCH)
    report = muon.ns_tuning_report
    assert report is not None
    assert all(not s.chosen.path.poly_transposed for s in report.shapes)  # rank 0's choice
    assert muon.workspace is not None
    for s in report.shapes:
        path = muon.workspace.path("auto", s.stack.rows, s.stack.cols, s.chosen.dtype, CPU)
        assert not path.poly_transposed
    assert bool(timed) == (rank == 0)  # rank 1 measured nothing
    assert (Path(tmp) / f"rank{rank}" / "ns_paths.json").exists() == (rank == 0)
    for p in params:
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.contiguous())
        assert torch.equal(gathered[0], gathered[1])


def test_every_rank_runs_rank_0s_choice(tmp_path: Path) -> None:
    run_distributed(_check_ranks_run_rank_0s_choice, world_size=2, args=(str(tmp_path),))
