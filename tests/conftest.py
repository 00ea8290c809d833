"""Shared fixtures: a small guide-style transformer, a clean plugin registry, torchrun's
environment for one process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import free_port
from torch import nn

from hyper_parallel import get_registry
from hyper_parallel.train.model import DecoderBlock, GPTConfig, TinyGPT
from hyper_parallel.train.model import RMSNorm as RMSNorm  # for test_layouts
from hyper_parallel_builtins.muon._options import NS_DTYPE_ENV
from hyper_parallel_builtins.newton_schulz import TUNING_ENV

# Muon iterates in float32 in every test, and in every process a test starts, unless the
# test names its ns_dtype: by default a CPU with native bf16 matmul would iterate in
# bfloat16, and the comparisons with float32 references would hold on some machines only.
os.environ.setdefault(NS_DTYPE_ENV, "float32")

# Newton-Schulz paths are the table's in every test, and in every process a test starts,
# unless the test turns tuning on with a cache directory of its own: nothing is measured
# or written to the user's cache, and every run makes the same numbers.
os.environ.setdefault(TUNING_ENV, "off")

#: ``hyper-parallel train`` arguments for a model small enough for a test.
TINY_TRAIN_ARGS = [
    "--dim",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--no-progress",
]


@pytest.fixture(autouse=True)
def _own_working_directory(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test runs in an empty directory of its own, as do the processes it starts.

    The README runs ``hyper-parallel train`` (which writes ``runs/train``) and then
    the tests, in one directory: no test may depend on what is there.
    """
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a ``train`` run starts: a refusal comes before any model or step."""
    from hyper_parallel.train import run as run_module

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a training run started before the refusal")

    monkeypatch.setattr(run_module._Run, "start", classmethod(refuse))


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a refused ``hyper-parallel train`` call (exit 2, no traceback)."""
    from hyper_parallel.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Reload plugins before and after the test (env changes, monkeypatched discovery)."""
    get_registry().reset()
    try:
        yield
    finally:
        get_registry().reset()


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchrun's environment for a world of one; the process group is torn down after."""
    assert not dist.is_initialized()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Block(DecoderBlock):
    """The library's decoder block, its norms named as in the user guide: input_norm, post_norm."""

    norm_names = ("input_norm", "post_norm")


class TinyLM(TinyGPT):
    """The library's decoder, small: one head, q/k/v biases, no position table, torch's init."""

    block_type = Block

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        hidden: int = 32,
        layers: int = 2,
        qkv_bias: bool = True,
        tied: bool = False,
    ) -> None:
        super().__init__(
            GPTConfig(
                vocab_size=vocab,
                dim=dim,
                mlp_hidden=hidden,
                layers=layers,
                heads=1,
                qkv_bias=qkv_bias,
                tied_embeddings=tied,
                positions="none",
                init_std=None,
            )
        )


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


@pytest.fixture
def batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 9), generator=gen)


@contextmanager
def counting_newton_schulz() -> Iterator[list[int]]:
    """Record how many matrices each Newton-Schulz call of Muon gets on this process."""
    import hyper_parallel_builtins.muon._update as muon_module

    counted: list[int] = []
    real = muon_module.newton_schulz_stack_

    def counting(stack: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counted.append(stack.shape[0])
        return real(stack, *args, **kwargs)

    muon_module.newton_schulz_stack_ = counting  # type: ignore[assignment]
    try:
        yield counted
    finally:
        muon_module.newton_schulz_stack_ = real  # type: ignore[assignment]


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group and none of torchrun's variables: a plain one-process run."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
