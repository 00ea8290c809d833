"""The examples work: the quickstart trains, and the example plugin installs and is found.

Neither test needs the example plugin installed in this environment: it is
pip-installed into a temporary directory that is on ``sys.path`` only while a
test uses it, and the registry is reloaded before and after.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch
from installing import pip_install_into

from conftest import lm_loss
from hyper_parallel import get_registry
from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer
from hyper_parallel.testing import check_lr_schedule, check_optimizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICKSTART = EXAMPLES / "quickstart.py"
PLUGIN_SOURCE = EXAMPLES / "custom_plugin"
PLUGIN_DISTRIBUTION = "hyper-parallel-lion"
PLUGIN_PACKAGE = "hp_lion"

_STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss (\d+\.\d+)\s+lr adamw (\S+)\s+muon (\S+)$", re.M)


# -- quickstart ----------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart() -> Iterator[ModuleType]:
    """examples/quickstart.py imported as a module (it is a script, not in a package)."""
    spec = importlib.util.spec_from_file_location("quickstart_example", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        # Its dataclasses look their module up in sys.modules while it executes.
        patch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        yield module


def test_quickstart_runs_and_the_loss_falls(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), "--steps", "16", "--log-every", "3"],
        cwd=tmp_path,  # anything the script writes by a relative path stays out of the checkout
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _STEP_LINE.findall(result.stdout)
    assert [int(step) for step, *_ in lines] == [0, 3, 6, 9, 12, 15], result.stdout
    losses = [float(loss) for _, loss, _, _ in lines]
    assert losses[-1] < losses[0] - 0.5, result.stdout
    # Each sub-optimizer's lr is shown: warmup, then cosine decay to HyperParallel's floor,
    # a thousandth of the peak, at the last step.
    muon_lrs = [float(lr) for *_, lr in lines]
    assert max(muon_lrs) == pytest.approx(0.02, rel=0.05) and muon_lrs[-1] == 2e-5
    assert "identical weights = True" in result.stdout
    assert "UserWarning" not in result.stderr


def test_quickstart_split_gives_matrices_to_muon_and_everything_else_to_adamw(
    quickstart: ModuleType,
) -> None:
    model = quickstart.TinyDecoder(quickstart.ModelConfig())
    muon_params, adamw_params = quickstart.split_params(model)
    names = {id(p): name for name, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon_params}
    assert muon_names == {
        f"layers.{i}.{proj}.weight" for i in range(2) for proj in quickstart.MUON_KEYS
    }
    adamw_names = {names[id(p)] for p in adamw_params}
    assert "layers.0.q_proj.bias" in adamw_names and "lm_head.weight" in adamw_names
    assert len(muon_params) + len(adamw_params) == len(list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no param needs moving: the split is exact
        quickstart.build_training(quickstart.ModelConfig(), total_steps=4, warmup_steps=1)


@pytest.mark.parametrize("steps", ["0", "-3", "two"])
def test_quickstart_rejects_a_bad_step_count(
    quickstart: ModuleType, steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        quickstart.parse_args(["--steps", steps])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err


# -- the example plugin ------------------------------------------------------------


@pytest.fixture(scope="module")
def installed_example_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip-install examples/custom_plugin (built from a copy: no build files land in the repo)."""
    target = tmp_path_factory.mktemp("site")
    pip_install_into(PLUGIN_SOURCE, target, cwd=tmp_path_factory.mktemp("build"))
    return target


def _plugin_modules() -> list[str]:
    return [name for name in sys.modules if name.partition(".")[0] == PLUGIN_PACKAGE]


@contextmanager
def _on_path(target: Path) -> Iterator[None]:
    """Put ``target`` first on ``sys.path`` with a fresh registry; restore both after.

    Works whether or not the example is also installed in this environment: any
    ``hp_lion`` modules already imported are set aside, so the copy in ``target``
    is the one imported, and put back afterwards.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in _plugin_modules():
            patch.delitem(sys.modules, name)
        patch.syspath_prepend(str(target))
        importlib.invalidate_caches()
        get_registry().reset()
        try:
            yield
        finally:
            get_registry().reset()
            for name in _plugin_modules():
                del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def example_plugin(installed_example_plugin: Path) -> Iterator[Path]:
    with _on_path(installed_example_plugin):
        yield installed_example_plugin


def _distribution_label(target: Path) -> str:
    (dist,) = [
        d
        for d in importlib.metadata.distributions(path=[str(target)])
        if d.metadata["Name"] == PLUGIN_DISTRIBUTION
    ]
    return f"{PLUGIN_DISTRIBUTION} {dist.version}"


def test_example_plugin_is_found_through_its_entry_point(example_plugin: Path) -> None:
    label = _distribution_label(example_plugin)
    lion = get_registry().get("optimizer", "lion")
    step_decay = get_registry().get("lr_scheduler", "step_decay")
    for entry in (lion, step_decay):
        assert entry.distribution == label
        assert entry.plugin == PLUGIN_PACKAGE
        assert Path(sys.modules[entry.obj.__module__].__file__ or "").is_relative_to(example_plugin)
    assert type(lion.obj).__name__ == "type" and lion.obj.__name__ == "Lion"
    assert get_registry().get("lr_scheduler", "staircase") is step_decay
    assert "lion" in get_registry().names("optimizer")


def test_example_plugin_passes_the_plugin_checks(example_plugin: Path) -> None:
    check_optimizer("lion", lr=1e-2, weight_decay=0.1)
    check_lr_schedule("step_decay", total_steps=40, warmup_steps=4, gamma=0.5, every=5)


def test_example_plugin_is_selected_by_name(
    example_plugin: Path, model: torch.nn.Module, batch: torch.Tensor
) -> None:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = get_hyper_optimizer(
        model,
        optimizers={
            "lion": {"params": matrices, "lr": 3e-3, "weight_decay": 0.1},
            "adamw": {"params": others, "lr": 1e-2},
        },
    )
    assert type(optimizer.optimizers["lion"]).__name__ == "Lion"
    scheduler = get_hyper_lr_scheduler(
        optimizer, "step_decay", total_steps=20, warmup_steps=2, gamma=0.5, every=3
    )
    before = float(lm_loss(model, batch).detach())
    for _ in range(8):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert float(lm_loss(model, batch).detach()) < before
    # Step 8 = 2 warmup steps + two decays of 3 steps: a quarter of each group's own peak.
    assert optimizer.optimizers["lion"].param_groups[0]["lr"] == pytest.approx(3e-3 / 4)
    assert optimizer.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    with pytest.raises(TypeError, match=r"Unknown keyword argument 'gama'.*Did you mean 'gamma'"):
        get_hyper_lr_scheduler(optimizer, "step_decay", total_steps=20, gama=0.5)


def test_registry_is_as_before_once_the_example_is_off_the_path(
    installed_example_plugin: Path,
) -> None:
    before = {kind: get_registry().names(kind) for kind in ("optimizer", "lr_scheduler")}
    with _on_path(installed_example_plugin):
        assert "lion" in get_registry().names("optimizer")
    after = {kind: get_registry().names(kind) for kind in ("optimizer", "lr_scheduler")}
    assert after == before


def test_example_plugin_trains_from_the_command_line(example_plugin: Path, tmp_path: Path) -> None:
    """``hyper-parallel train --optimizer lion`` with its schedule, both from the example."""
    from hyper_parallel.cli import main

    out = tmp_path / "lion"
    tiny = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "8"]
    args = [
        "train",
        "--optimizer",
        "lion",
        "--lr",
        "3e-3",
        "--scheduler",
        "step_decay",
        "--steps",
        "10",
    ]
    assert main([*args, "--eval-every", "5", "--out", str(out), "--no-progress", *tiny]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {k for r in records if "lr" in r for k in r["lr"]} == {"lion"}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[-1] < val[0]
