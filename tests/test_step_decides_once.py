"""A step decides nothing that was decided when its groups were added: it reads no environment.

Environment variables (``ONEDNN_MAX_CPU_ISA``, ``HYPER_PARALLEL_NS_DTYPE``, the
sharding and cost-profile variables) are read when an optimizer or a group is
built. Setting one afterwards changes nothing a step does; these tests watch
``os.environ`` through a step after the first (which may still fill caches).
"""

from __future__ import annotations

import copy
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from distributed import run_distributed
from torch import nn

from conftest import TinyLM, lm_loss
from hyper_parallel import fully_shard, get_hyper_optimizer, init_device_mesh


class _Watched(dict[str, str]):
    """``os.environ`` as a dict that notes every name looked up."""

    def __init__(self, real: os._Environ[str]) -> None:
        super().__init__(real)
        self.read: list[str] = []

    def __getitem__(self, name: str) -> str:
        self.read.append(name)
        return super().__getitem__(name)

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        self.read.append(name)
        return super().get(name, default)

    def __contains__(self, name: object) -> bool:
        self.read.append(str(name))
        return super().__contains__(name)


@contextmanager
def _watched_environ() -> Iterator[list[str]]:
    real = os.environ
    watched = _Watched(real)
    os.environ = watched  # type: ignore[assignment]  # noqa: B003 (watched, not cleared)
    try:
        yield watched.read
    finally:
        os.environ = real  # noqa: B003


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, n: int) -> None:
    for _ in range(n):
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()


def _reads_during_a_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    _steps(model, optimizer, ids, 2)
    lm_loss(model, ids).backward()
    with _watched_environ() as read:
        optimizer.step()
    return read


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_a_local_muon_adamw_step_reads_no_environment(ns_method: str) -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=32, hidden=64)
    optimizer = get_hyper_optimizer(model, muon={"ns_method": ns_method}, adamw={})
    assert _reads_during_a_step(model, optimizer) == []


#: The modules that work out what options, coefficients, paths and the machine decide.
_DECIDING = {
    "hyper_parallel_builtins/muon/_options.py": "every function",
    "hyper_parallel_builtins/muon/_matrices.py": "every function",
    "hyper_parallel_builtins/newton_schulz/_coefficients.py": "every function",
    "hyper_parallel_builtins/newton_schulz/_paths.py": "every function",
    "hyper_parallel_builtins/newton_schulz/_tuning.py": "every function",
    "hyper_parallel_builtins/newton_schulz/_path_cache.py": "every function",
    "hyper_parallel/core/compat.py": "cpu_kind cpu_has_native_bf16 cpu_kind_of",
    "hyper_parallel/core/distributed/_backend.py": "resolve_backend __call__",
}


def _calls_during_a_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    """``module:function`` of every call into the project's code during a step after two."""
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    _steps(model, optimizer, ids, 2)
    lm_loss(model, ids).backward()
    called: set[str] = set()

    def watch(frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        where = frame.f_code.co_filename.replace(os.sep, "/")
        for package in ("/hyper_parallel/", "/hyper_parallel_builtins/"):
            if package in where:
                module = package.strip("/") + "/" + where.split(package, 1)[1]
                called.add(f"{module}:{frame.f_code.co_name}")

    sys.setprofile(watch)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    return called


def _modules(calls: set[str]) -> list[str]:
    return sorted({call.split(":")[0] for call in calls})


def _deciding(calls: set[str]) -> set[str]:
    found = set()
    for call in calls:
        module, function = call.split(":")
        functions = _DECIDING.get(module)
        if functions == "every function" or (functions and function in functions.split()):
            found.add(call)
    return found


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_a_local_muon_adamw_step_runs_in_six_modules_and_decides_nothing_again(
    ns_method: str,
) -> None:
    """After the first step, a step calls nothing that resolves options, paths or capabilities."""
    torch.manual_seed(0)
    model = TinyLM(dim=32, hidden=64)
    optimizer = get_hyper_optimizer(model, muon={"ns_method": ns_method}, adamw={})
    calls = _calls_during_a_step(model, optimizer)
    assert _deciding(calls) == set()
    assert len(_modules(calls)) <= 6, _modules(calls)
    assert "hyper_parallel_builtins/muon/_update.py:stream_" in calls  # the step was watched


def _check_fsdp(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = fully_shard(TinyLM(dim=32, hidden=64), mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = get_hyper_optimizer(model)
    assert _reads_during_a_step(model, optimizer) == []
    calls = _calls_during_a_step(model, optimizer)
    assert _deciding(calls) == set()
    assert len(_modules(calls)) <= 10, _modules(calls)
    assert "hyper_parallel_builtins/fsdp_backend/_exchange.py" in _modules(calls)


def test_an_fsdp_muon_adamw_step_at_2_ranks_runs_in_ten_modules_and_reads_no_environment() -> None:
    run_distributed(_check_fsdp, world_size=2)


def _muon_pair(**options: object) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    from hyper_parallel import Muon

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6, 6))]
    return params, Muon(params, lr=0.02, **options)  # type: ignore[arg-type]


def _step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


def test_muon_settings_are_worked_out_once_and_again_when_an_option_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyper_parallel_builtins.muon import _optimizer

    made: list[object] = []
    resolve = _optimizer.resolve_settings
    monkeypatch.setattr(_optimizer, "resolve_settings", lambda *a: made.append(a) or resolve(*a))
    params, muon = _muon_pair()
    for seed in range(3):
        _step(params, muon, seed)
    assert len(made) == 1  # the first step's; none after
    muon.param_groups[0]["ns_steps"] = 3  # a user's edit takes effect at the next step
    _step(params, muon, 3)
    assert len(made) == 2

    twin_params, twin = _muon_pair(ns_steps=3)
    with torch.no_grad():
        for p, q in zip(twin_params, params, strict=True):
            p.copy_(q)
    twin.load_state_dict(copy.deepcopy(muon.state_dict()))  # not the live buffers
    _step(params, muon, 4)
    _step(twin_params, twin, 4)
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
