"""A library that installs and interoperates like one: what other tools and a bare install meet."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_TRAIN_ARGS
from hyper_parallel import HyperParallelError, get_hyper_optimizer
from hyper_parallel.cli import main
from hyper_parallel.train.data import synthetic_corpus


def test_a_chain_of_two_has_no_single_optimizer_attribute_as_hasattr_sees_it() -> None:
    """accelerate's wrapper asks ``hasattr(optimizer, "optimizer")`` under HF Trainer."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    chain = get_hyper_optimizer(model)
    assert not hasattr(chain, "optimizer") and getattr(chain, "optimizer", None) is None
    with pytest.raises(AttributeError, match=r"more than one optimizer \(.*\); pick one") as raised:
        _ = chain.optimizer
    assert isinstance(raised.value, HyperParallelError)
    single = get_hyper_optimizer(model, optimizers={"adamw": {"params": list(model.parameters())}})
    assert single.optimizer is single.optimizers["adamw"]


@pytest.mark.parametrize(
    ("flags", "missing", "named"),
    [
        ([], ("tqdm", "matplotlib"), "tqdm, for the progress bar"),
        (["--no-progress"], ("matplotlib",), "matplotlib, for the loss plot"),
    ],
)
def test_train_without_its_extra_names_the_install_and_leaves_nothing_behind(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    missing: tuple[str, ...],
    named: str,
) -> None:
    for name in missing:  # what a bare ``pip install hyper-parallel`` has: neither
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "out"
    args = ["train", *TINY_TRAIN_ARGS, "--steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit) as refused:
        main([*(a for a in args if a != "--no-progress"), *flags])
    assert refused.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert named in line and line.endswith('pip install "hyper-parallel[train]"'), line
    assert not out.exists() or not any(out.iterdir())  # the retry is not refused
    monkeypatch.undo()
    assert main([*args]) == 0  # and once installed, the same command trains


def test_the_data_digest_needs_no_numpy_and_is_what_it_was() -> None:
    """Checkpoints record the data's digest; reading the ids' bytes without numpy keeps it."""
    data = synthetic_corpus(seed=0)
    h = hashlib.sha256((data.alphabet or "").encode("utf-8"))
    for ids in (data.train, data.val):
        h.update(np.ascontiguousarray(ids.to(torch.int64).numpy()).tobytes())
    assert data.digest() == h.hexdigest()


def test_names_loaded_on_first_use_are_in_dir_for_tab_completion() -> None:
    import hyper_parallel
    import hyper_parallel.core.distributed as distributed

    for name in ("Muon", "AdamW", "Sinkhorn", "fully_shard", "init_device_mesh", "clip_grad_norm_"):
        assert name in dir(hyper_parallel), name
    assert "ranks_per_node" in dir(distributed)  # loaded on first use
    assert "fully_shard" not in distributed.__all__  # users import it from hyper_parallel
    assert set(hyper_parallel.__all__) <= set(dir(hyper_parallel))
    assert set(distributed.__all__) <= set(dir(distributed))


def test_a_number_where_the_schedule_name_goes_says_where_it_belongs() -> None:
    from hyper_parallel import get_hyper_lr_scheduler

    model = torch.nn.Linear(4, 4)
    optimizer = get_hyper_optimizer(model)
    lrs = [g["lr"] for g in optimizer.param_groups]
    with pytest.raises(TypeError, match=r'got int 1000; .*"cosine", total_steps=1000\)'):
        get_hyper_lr_scheduler(optimizer, 1000)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs total_steps=N"):
        get_hyper_lr_scheduler(optimizer, "cosine")
    assert [g["lr"] for g in optimizer.param_groups] == lrs
