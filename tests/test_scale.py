"""The cost model of a distributed step (``python -m benchmarks.scale``): bytes and predictions.

Its time predictions are held to measurements by the benchmark itself
(``--validate``), never here: tests do not assert on wall time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.scale import (
    MODELS,
    PREDICTION_KEYS,
    Params,
    fit_team_link,
    memory_per_rank,
    muon_group,
    plan_exchange,
    predictions,
    shard_size,
    validate,
)
from hyper_parallel_builtins.fsdp_backend.cost import DeviceProfile, LinkCost, team_seconds
from hyper_parallel_builtins.muon import MuonTeam

ROOT = Path(__file__).resolve().parent.parent
PROFILE = DeviceProfile(
    name="test",
    all_to_all=LinkCost(1e-5, 1e-10),
    all_gather=LinkCost(1e-5, 1e-10),
    matmul_flops={"float32": [[64.0, 1e10]], "bfloat16": [[64.0, 1e10]]},
)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_predicted_bytes_are_the_bytes_each_transport_moves_at_two_ranks(
    ns_dtype: torch.dtype,
) -> None:
    # in bfloat16 a team's Gram matrices travel in 2 bytes, its norms in 4 (float32 sums)
    rows = validate(PROFILE, [(64, 1, 1, 1), (64, 1, 2, 1)], ns_dtype)
    assert [(r["transport"], r["team_size"]) for r in rows] == [
        ("all_to_all", 1),
        ("all_gather", 1),
        ("all_to_all", 2),
        ("all_gather", 2),
    ]
    for row in rows:
        assert row["predicted_bytes"] == row["measured_bytes"] > 0, row
        assert row["predicted_s"] > 0 and row["measured_s"] > 0


@pytest.mark.parametrize("two_nodes", [False, True], ids=["hsdp 2x2", "2 nodes x 2"])
def test_predicted_bytes_are_exact_where_replicas_share_the_work(two_nodes: bool) -> None:
    # the trips within each replica row, and the spread over the column of replicas
    rows = validate(PROFILE, [(64, 2, 1, 2)], torch.float32, ranks=4, two_nodes=two_nodes)
    assert [(r["ranks"], r["replicas"]) for r in rows] == [(4, 2), (4, 2)]
    for row in rows:
        assert row["predicted_bytes"] == row["measured_bytes"] > 0, row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calibration_reads_the_team_link_off_what_teams_take_beyond_their_flops(
    dtype: torch.dtype,
) -> None:
    link, team = LinkCost(latency_s=2e-4, seconds_per_byte=3e-9), MuonTeam(muon_group(), dtype)
    measured = []
    for side in (128, 256, 512):
        shape = torch.Size((side, side))
        collectives = team.collectives(shape, 2)
        measured.append((side, team_seconds(team.cost(shape, 2), collectives, 2,
                                            dtype.itemsize, 1e10, link)))  # fmt: skip
    fitted = fit_team_link(measured, PROFILE, dtype)  # PROFILE: 1e10 FLOP/s in both dtypes
    assert fitted.latency_s == pytest.approx(link.latency_s)
    assert fitted.seconds_per_byte == pytest.approx(link.seconds_per_byte)


def test_plan_gives_every_matrix_one_owner_and_balances_the_flops() -> None:
    params = Params("two sizes", (((512, 512), 6), ((1024, 512), 3)), 0)
    plan = plan_exchange(params, 4, 4, torch.float32, PROFILE, device="cpu", team_size=1)
    assert (plan.flops > 0).all() and plan.flops.max() <= 1.5 * plan.flops.mean()
    # every rank sends its shard of each matrix it does not own, and gets its piece back
    sent = sum(int(to.sent.sum()) for to, _ in plan.trips)
    assert sent == 3 * (6 * 512 * 512 + 3 * 1024 * 512) // 4


def test_teams_share_each_matrix_and_its_flops() -> None:
    params = Params("one big", (((2048, 512), 1), ((512, 512), 1)), 0)
    whole = plan_exchange(params, 4, 4, torch.float32, PROFILE, device="cpu", team_size=1)
    teams = plan_exchange(params, 4, 4, torch.float32, PROFILE, device="cpu", team_size=2)
    assert teams.team_size == 2 and (teams.flops > 0).all()
    # the big matrix alone set the busiest rank; shared by two it sets half that, and more
    # ranks work (standard iteration: 4 s^2 l + 2 s^3 per step, split two ways)
    big = 5 * (4 * 512 * 512 * 2048 + 2 * 512**3)
    assert float(teams.flops.max()) == big / 2 < float(whole.flops.max())
    # each member gets what of its band it does not hold. The tall matrix (team of ranks 0
    # and 1) is cut by rows: rank 0's band is shards 0 and 1, rank 1's shards 2 and 3, so
    # three 512-row shards travel. The square one (ranks 2 and 3) is cut by columns: each
    # member gets half the columns of the three 128-row shards it does not hold.
    sent = sum(int(to.sent.sum()) for to, _ in teams.trips)
    assert sent == 3 * 512 * 512 + 2 * 3 * 128 * 256
    assert (teams.team_bytes > 0).all() and int(whole.team_bytes.sum()) == 0


def _predict(tmp_path: Path, model: str, ranks: str) -> tuple[list[dict[str, Any]], str]:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--model", model, "--ranks", ranks,
         "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert png.read_bytes().startswith(b"\x89PNG")
    return json.loads(out.read_text())["predictions"], result.stdout


def _auto(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per rank count, the row the backend's ``auto`` transport takes (the faster)."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["ranks"] not in best or (r["step_s"] or 0) < (best[r["ranks"]]["step_s"] or 0):
            best[r["ranks"]] = r
    return best


def test_llama_70b_gets_no_slower_from_1024_to_16384_ranks(tmp_path: Path) -> None:
    rows, stdout = _predict(tmp_path, "llama-70b", "8,64,1024,4096,16384")
    assert {(r["ranks"], r["transport"]) for r in rows} == {
        (n, t) for n in (8, 64, 1024, 4096, 16384) for t in ("all_to_all", "all_gather")
    }
    assert set(rows[0]) == set(PREDICTION_KEYS)
    auto = _auto(rows)
    # 8 H100s of 80 GB cannot hold its params, gradients and state: the row says so
    assert not auto[8]["fits"] and auto[8]["step_s"] is None
    assert "at 8 ranks (h100-infiniband): HSDP 1 x 8" in stdout and "does not fit" in stdout
    for n in (64, 1024, 4096, 16384):
        assert auto[n]["fits"] and auto[n]["memory_bytes_per_rank"] <= 80e9, auto[n]
    steps = [auto[n]["step_s"] for n in (1024, 4096, 16384)]
    assert all(b <= 1.05 * a for a, b in itertools.pairwise(steps)), steps
    assert auto[16384]["bytes_per_rank"] <= auto[1024]["bytes_per_rank"]
    assert auto[16384]["bytes_over_bound"] <= 1.5, auto[16384]
    assert auto[16384]["replica_group"] < 16384 // auto[16384]["shard_size"]  # groups of replicas
    # FLOPs fall until the groups of replicas stop growing, then stay
    flops = [auto[n]["ns_flops_per_rank"] for n in (64, 1024, 16384)]
    assert flops[0] > flops[1] >= flops[2], flops


def test_deepseek_v3_is_predicted_only_where_it_fits(tmp_path: Path) -> None:
    rows, stdout = _predict(tmp_path, "deepseek-v3-moe", "64,128,1024")
    auto = _auto(rows)
    assert not auto[64]["fits"] and "at 64 ranks" in stdout and "does not fit" in stdout
    assert all(auto[n]["memory_bytes_per_rank"] <= 80e9 for n in (128, 1024))
    assert auto[1024]["step_s"] < auto[128]["step_s"]


def test_the_shard_size_is_the_smallest_that_fits_from_shapes_alone() -> None:
    # 1e9 Muon elements and 1e8 AdamW: fp32 params and grads (8 B) and the state (4 B, 8 B)
    params = Params("1.1B", (((1000, 1000), 1000),), 100_000_000)
    per_rank = 1000 * 1000 * 1000 * 12 + 100_000_000 * 16
    assert memory_per_rank(params, 8) == per_rank // 8
    assert memory_per_rank(params, 8, param_bytes=2) == (per_rank - 1_100_000_000 * 4) // 8
    small = dataclasses.replace(PROFILE, device_memory_bytes=per_rank / 30)
    assert shard_size(params, 64, small) == 32  # the smallest multiple of a node that fits
    assert shard_size(params, 8, small) == 8  # none fits: all ranks, and the row says so
    (row, _) = predictions(params, [8], small)[:2]
    assert not row.fits and row.step_s is None
    with pytest.raises(SystemExit, match="--shard-size 3 does not divide 8 ranks"):
        predictions(params, [8], small, shards=3)


def test_a_hugging_face_config_is_read_like_the_built_in_shape(tmp_path: Path) -> None:
    config = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    from benchmarks.scale import params_from_config

    assert params_from_config(path).matrices == MODELS["llama-70b"]().matrices
    ours = predictions(params_from_config(path), [8], PROFILE)
    assert [r.step_s for r in ours] == [
        r.step_s for r in predictions(MODELS["llama-70b"](), [8], PROFILE)
    ]
    path.write_text("{}")
    with pytest.raises(SystemExit, match=r"not a usable config.json \(KeyError"):
        params_from_config(path)
