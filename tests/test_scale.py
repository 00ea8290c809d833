"""The cost model of a distributed step (``python -m benchmarks.scale``): bytes and predictions.

Its time predictions are held to measurements by the benchmark itself
(``--validate``), never here: tests do not assert on wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale import MODELS, Params, plan_exchange, predictions, validate
from hyper_parallel.core.distributed.cost import DeviceProfile, LinkCost

ROOT = Path(__file__).resolve().parent.parent
PROFILE = DeviceProfile(
    name="test",
    all_to_all=LinkCost(1e-5, 1e-10),
    all_gather=LinkCost(1e-5, 1e-10),
    matmul_flops={"float32": [[64.0, 1e10]], "bfloat16": [[64.0, 1e10]]},
)


def test_predicted_bytes_are_the_bytes_each_transport_moves_at_two_ranks() -> None:
    rows = validate(PROFILE, [(64, 1)])
    assert [r["transport"] for r in rows] == ["all_to_all", "all_gather"]
    for row in rows:
        assert row["predicted_bytes"] == row["measured_bytes"] > 0, row
        assert row["predicted_s"] > 0 and row["measured_s"] > 0


def test_plan_gives_every_matrix_one_owner_and_balances_the_flops() -> None:
    params = Params("two sizes", (((512, 512), 6), ((1024, 512), 3)), 0)
    plan = plan_exchange(params, 4, 4, "float32", device="cpu")  # type: ignore[arg-type]
    assert (plan.flops > 0).all() and plan.flops.max() <= 1.5 * plan.flops.mean()
    # every rank sends its shard of each matrix it does not own, and gets its piece back
    sent = sum(int(to.sent.sum()) for to, _ in plan.trips)
    assert sent == 3 * (6 * 512 * 512 + 3 * 1024 * 512) // 4


def test_llama_70b_predictions_and_the_command_line(tmp_path: Path) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--model", "llama-70b",
         "--ranks", "8,64,1024,16384", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["predictions"]
    assert {(r["ranks"], r["transport"]) for r in rows} == {
        (n, t) for n in (8, 64, 1024, 16384) for t in ("all_to_all", "all_gather")
    }
    assert set(rows[0]) == {"ranks", "transport", "step_s", "bytes_per_rank",
                            "ns_flops_per_rank", "state_bytes_per_rank"}  # fmt: skip
    flops = [r["ns_flops_per_rank"] for r in rows if r["transport"] == "all_to_all"]
    assert flops == sorted(flops, reverse=True) and flops[0] > 10 * flops[-1]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "llama-70b at 16384 ranks" in result.stdout and "picks all_to_all" in result.stdout


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
