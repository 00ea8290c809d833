"""User code that imports everything from ``hyper_parallel`` type-checks under ``mypy --strict``.

* against the source tree, with the project's settings;
* against an editable install made as the README's quick start makes it, from a
  directory outside the clone, as a user's own project sees it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from installing import copy_project, fresh_venv

import hyper_parallel

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """
import torch

from hyper_parallel import *  # noqa: F403
from hyper_parallel import (
    AdamW, ChainedOptimizer, MainParams, Muon, Sinkhorn, get_hyper_lr_scheduler,
    get_hyper_optimizer, step_if_finite,
)

model = torch.nn.Linear(8, 8)
muon: Muon = Muon([model.weight], lr=0.02, ns_variant="asym5", momentum=(0.9, 0.95))
adamw: AdamW = AdamW([model.bias], lr=3e-4)
sinkhorn: Sinkhorn = Sinkhorn([torch.nn.Parameter(torch.randn(4, 4))], lr=1e-3)
chained = ChainedOptimizer({"muon": muon, "adamw": adamw})
optimizer: ChainedOptimizer = get_hyper_optimizer(model, partitioner="by_shape")
scheduler = get_hyper_lr_scheduler(optimizer, scheduler_type="cosine", total_steps=10, warmup_steps=1)
stepped: bool = step_if_finite(chained)
mains: MainParams | None = get_hyper_optimizer(model, fp32_main_params=True).main_params
"""


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(source, encoding="utf-8")
    # The project's own mypy settings (strict = true); its cache makes this quick after CI's run.
    env = {**os.environ, "MYPYPATH": str(ROOT / "plugins")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-warn-unused-ignores", str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_a_user_script_type_checks_strictly_and_a_wrong_type_is_caught(tmp_path: Path) -> None:
    assert sorted(hyper_parallel.__all__)  # the star import above has names to import
    result = _mypy(tmp_path, USER_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    wrong = _mypy(tmp_path, USER_SCRIPT + "\nnot_a_number: int = Muon\n")
    assert wrong.returncode == 1 and 'expression has type "type[Muon]"' in wrong.stdout, (
        wrong.stdout
    )


#: A user's script: both packages, typed; its last line is a type error mypy must report.
EDITABLE_USER_SCRIPT = """
import torch

from hyper_parallel import ChainedOptimizer, get_hyper_optimizer
from hyper_parallel_builtins.schedules import cosine

model = torch.nn.Linear(8, 8)
optimizer: ChainedOptimizer = get_hyper_optimizer(model, partitioner="by_shape")
factor: float = cosine(5, total_steps=10, warmup_steps=1)
wrong: int = optimizer
"""
WRONG_LINE = EDITABLE_USER_SCRIPT.rstrip("\n").count("\n") + 1  # the last line


def _readme_editable_install() -> list[str]:
    """The arguments of the README quick start's first ``pip install``, less the torch pin."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in section.splitlines() if x.startswith("pip install") and " -e " in x)
    words = shlex.split(line.split("&&", 1)[0])
    assert words[:2] == ["pip", "install"], line
    return [w for w in words[2:] if not w.startswith("torch==")]


def _without_editable_mode(args: list[str]) -> list[str]:
    """``args`` as a plain ``pip install -e``: no ``--config-settings editable_mode=...``."""
    out: list[str] = []
    for word in args:
        if word.startswith("editable_mode=") and out and out[-1] == "--config-settings":
            out.pop()
        elif not word.startswith("--config-settings=editable_mode="):
            out.append(word)
    return out


def test_without_editable_mode_drops_only_the_mode() -> None:
    args = ["-e", ".[train]", "--config-settings", "editable_mode=strict", "--quiet"]
    assert _without_editable_mode(args) == ["-e", ".[train]", "--quiet"]
    assert _without_editable_mode(["-e", ".", "--config-settings=editable_mode=strict"]) == [
        "-e",
        ".",
    ]


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_the_readme_editable_install_is_what_mypy_reads(tmp_path: Path) -> None:
    """A user's script outside the clone type-checks against the README's editable install.

    The install is made into a fresh venv (the core dependencies linked in) from a
    copy of the project; the user's mypy runs with that venv's interpreter. A
    plain ``pip install -e`` reaches the two package folders through an import
    hook mypy cannot follow: the packages are missing to it.
    """
    clone = copy_project(ROOT, tmp_path / "clone")
    venv = fresh_venv(tmp_path / "venv", ["torch", "pluggy", "xxhash", "setuptools"])
    user = tmp_path / "user"
    user.mkdir()
    script = user / "train.py"
    script.write_text(EDITABLE_USER_SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}

    def install_and_check(args: list[str]) -> subprocess.CompletedProcess[str]:
        done = venv.pip("install", "--no-deps", "--no-build-isolation", *args, cwd=clone)
        assert done.returncode == 0, done.stdout + done.stderr
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(venv.python),
             "--cache-dir", str(tmp_path / "mypy-cache"), script.name],
            cwd=user, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip

    readme_way = _readme_editable_install()
    plain = install_and_check(_without_editable_mode(readme_way))
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert 'Cannot find implementation or library stub for module named "hyper_parallel"' in (
        plain.stdout
    ), plain.stdout

    checked = install_and_check(readme_way)
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert errors == [
        f"{script.name}:{WRONG_LINE}: error: Incompatible types in assignment "
        '(expression has type "ChainedOptimizer", variable has type "int")  [assignment]'
    ], checked.stdout + checked.stderr
