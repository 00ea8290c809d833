"""User code that imports everything from ``hyper_parallel`` type-checks under ``mypy --strict``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
