"""The built-in decoder's positions: a learned table, rotary (Llama's RoPE), or none."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.train import TrainConfig, train
from hyper_parallel.train.model import GPTConfig, Positions, Rotary, TinyGPT


def _reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex numbers: dims ``j`` and ``j + d/2`` of a head form ``z_j``, which turns
    by ``e^(i t theta^(-2j/d))`` at position ``t`` (float64)."""
    _, _, seq, dim = x.shape
    half = dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    freqs = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / dim)
    turn = torch.polar(torch.ones(seq, half, dtype=torch.float64),
                       torch.arange(seq, dtype=torch.float64)[:, None] * freqs)  # fmt: skip
    z = z * turn
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rotary_turns_each_pair_of_a_head_by_its_position_s_angle(theta: float) -> None:
    x = torch.randn(2, 3, 17, 8, generator=torch.Generator().manual_seed(0))
    turned = Rotary.of(17, 8, theta, torch.device("cpu"))(x)
    torch.testing.assert_close(turned.double(), _reference_rope(x, theta), rtol=1e-5, atol=1e-5)


def test_rotary_scores_a_query_and_a_key_by_their_distance_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(16, generator=gen).expand(1, 1, 40, 16)
    k = torch.randn(16, generator=gen).expand(1, 1, 40, 16)
    rotary = Rotary.of(40, 16, 10000.0, torch.device("cpu"))
    scores = (rotary(q) @ rotary(k).mT)[0, 0]
    assert scores[5, 2] == pytest.approx(float(scores[29, 26]), abs=1e-4)
    assert scores[30, 0] == pytest.approx(float(scores[39, 9]), abs=1e-4)
    assert abs(float(scores[5, 2] - scores[5, 3])) > 1e-3  # another distance, another score


def _model(positions: str, seq_len: int = 8, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=64, seq_len=seq_len, dim=32, layers=layers, heads=4,
                             positions=positions))  # fmt: skip


def test_a_rotary_model_has_no_position_table_and_reads_past_seq_len() -> None:
    rotary, learned = _model("rotary"), _model("learned")
    assert rotary.config.positions is Positions.ROTARY
    assert "embed_positions.weight" not in dict(rotary.named_parameters())
    assert "embed_positions.weight" in dict(learned.named_parameters())
    ids = torch.randint(0, 64, (2, 20))
    assert rotary(ids).shape == (2, 20, 64)
    with pytest.raises(HyperParallelValueError, match="longer than seq_len=8"):
        learned(ids)


def test_rotary_tells_the_order_of_a_prefix_apart_and_no_positions_does_not() -> None:
    """One block with no positions sees the last token's prefix as a set; rotary sees its order."""
    ids = torch.tensor([[3, 11, 42, 5, 9]])
    swapped = torch.tensor([[42, 3, 5, 11, 9]])
    none = _model("none", layers=1)
    torch.testing.assert_close(none(ids)[0, -1], none(swapped)[0, -1])
    rotary = _model("rotary", layers=1)
    assert not torch.allclose(rotary(ids)[0, -1], rotary(swapped)[0, -1], atol=1e-4)


def test_a_rotary_model_trains() -> None:
    model = _model("rotary", seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.arange(17).remainder(5).repeat(4, 1)  # a period-5 pattern
    first = float(model.loss(batch).detach())
    for _ in range(30):
        model.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(model.loss(batch).detach()) < first / 4 < math.log(64)


def test_an_unknown_positions_name_and_an_odd_rotary_head_are_refused() -> None:
    with pytest.raises(HyperParallelValueError, match="positions='sinusoidal' is not one of "
                       "'learned', 'rotary', 'none'"):  # fmt: skip
        GPTConfig(vocab_size=8, positions="sinusoidal")
    with pytest.raises(HyperParallelValueError, match="even head size.*= 3; change dim or heads"):
        GPTConfig(vocab_size=8, dim=6, heads=2, positions="rotary")


def test_hyper_parallel_train_builds_the_model_with_the_positions_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[TinyGPT] = []
    real_init = TinyGPT.__init__

    def keep(self: TinyGPT, config: GPTConfig) -> None:
        real_init(self, config)
        built.append(self)

    monkeypatch.setattr(TinyGPT, "__init__", keep)
    config = TrainConfig(dim=32, layers=1, heads=2, seq_len=32, batch_size=8, progress=False,
                         steps=10, eval_every=5, threads=1, positions="rotary", out=tmp_path)  # fmt: skip
    summary = train(config, echo=lambda line: None)
    assert summary["config"]["positions"] == "rotary"
    assert summary["runs"]["muon+adamw"]["steps"] == 10
    assert [m.config.positions for m in built] == [Positions.ROTARY]
    assert not hasattr(built[0], "embed_positions")
