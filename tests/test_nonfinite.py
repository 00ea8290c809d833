"""A NaN/Inf gradient skips the step: params and optimizer state stay as without that batch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN_ARGS as TINY
from conftest import TinyLM, lm_loss
from hyper_parallel.cli import main
from hyper_parallel.core.optimizer import get_hyper_optimizer, grads_are_finite, step_if_finite
from hyper_parallel.train import TinyGPT


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 32, (4, 9), generator=gen) for _ in range(3)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_is_skipped(bad: float) -> None:
    torch.manual_seed(0)
    a = TinyLM()
    b = copy.deepcopy(a)
    opt_a = get_hyper_optimizer(a, partitioner="by_shape", muon_lr=0.02, adamw_lr=3e-3)
    opt_b = get_hyper_optimizer(b, partitioner="by_shape", muon_lr=0.02, adamw_lr=3e-3)
    first, poisoned, last = _batches()
    for i, batch in enumerate((first, poisoned, last)):
        lm_loss(a, batch).backward()
        if i == 1:
            a.layers[0].q_proj.weight.grad[0, 0] = bad
            assert not grads_are_finite(opt_a)
            assert step_if_finite(opt_a) is False  # reported as skipped
        else:
            assert step_if_finite(opt_a) is True
        opt_a.zero_grad()
    for batch in (first, last):  # the same run without the poisoned batch's update
        lm_loss(b, batch).backward()
        opt_b.step()
        opt_b.zero_grad()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        for field, value in state.items():
            other = sb["state"][key][field]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_train_skips_and_reports_a_nan_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_loss = TinyGPT.loss
    calls = {"n": 0}

    def poisoned(self: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
        loss = real_loss(self, batch)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(TinyGPT, "loss", poisoned)
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--eval-every", "3", "--out", str(out), *TINY]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"run": "muon+adamw", "step": 3, "skipped": "non-finite gradient"} in records
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["muon+adamw"]["skipped_steps"] == [3]
    assert all(r["val_loss"] == r["val_loss"] for r in records if "val_loss" in r)  # no NaN leaked


def test_train_resume_continues_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["--steps", "12", "--eval-every", "4", *TINY]
    straight = tmp_path / "straight"
    assert (
        main(["train", *common, "--out", str(straight), "--checkpoint-dir", str(straight / "ckpt")])
        == 0
    )

    resumed = tmp_path / "resumed"
    real_loss = TinyGPT.loss
    calls = {"n": 0}

    def interrupted(self: TinyGPT, batch: torch.Tensor) -> torch.Tensor:
        if self.training:
            calls["n"] += 1
            if calls["n"] == 10:  # Ctrl-C during step 10, after the step-8 checkpoint
                raise KeyboardInterrupt
        return real_loss(self, batch)

    args = [
        "train",
        *common,
        "--out",
        str(resumed),
        "--checkpoint-dir",
        str(resumed / "ckpt"),
        "--checkpoint-every",
        "4",
    ]
    monkeypatch.setattr(TinyGPT, "loss", interrupted)
    assert main(args) == 130
    monkeypatch.setattr(TinyGPT, "loss", real_loss)
    assert main([*args, "--resume"]) == 0

    def final(out: Path) -> dict:
        return json.loads((out / "summary.json").read_text())["runs"]["muon+adamw"]

    assert final(resumed)["final_val_loss"] == final(straight)["final_val_loss"]
    assert final(resumed)["final_train_loss"] == final(straight)["final_train_loss"]
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    # resumed at 8; the resume point's validation is logged once
    assert [r["step"] for r in records if "val_loss" in r] == [0, 4, 8, 12]


def test_resume_needs_a_checkpoint_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--no-progress"])
    assert info.value.code == 2
    assert (
        "--resume, --checkpoint-every and --checkpoint-async need --checkpoint-dir DIR"
        in capsys.readouterr().err
    )
