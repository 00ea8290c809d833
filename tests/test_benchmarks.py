"""The benchmark entry point runs and prints its table (figures are never asserted); the
benchmark modules import each other without a circle."""

from __future__ import annotations

import ast
import dataclasses
import gc
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import benchmarks.common as common
import benchmarks.quality as quality
import benchmarks.suite as suite
from benchmarks.checkpoint import case_checkpoint
from benchmarks.common import Row, Settings, transformer_shapes
from benchmarks.muon_small import case_muon_small
from benchmarks.qk_clip import Sizes, qk_clip_rows
from benchmarks.suite import case_distributed, format_table, not_measured_line, plot_label
from hyper_parallel import qk_clip
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.train.data import synthetic_corpus

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_entry_point_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = _bench("--cases", "muon,ns,adamw,chained", "--dims", "32", "--layers", "1",
                    "--repeats", "1", "--no-peers", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| case | ours | figure | peer | figure | ours / peer | target | note |" in result.stdout
    assert "python -m benchmarks --cases adamw" in result.stdout  # each row's command
    rows = json.loads(out.read_text())["rows"]
    cases = {r["case"].split(",")[0] for r in rows}
    assert cases == {
        "Muon step", "Newton-Schulz FLOP/s", "AdamW step", "ChainedOptimizer of 2 AdamWs (d=32 x 1 layers)"
    }  # fmt: skip
    measured = [r for r in rows if r["peer"] is not None]
    assert measured and all(r["ours"] > 0 and r["ratio"] > 0 for r in measured)
    # without peers, the Muon rows say so instead of showing a figure
    muon = [
        r for r in rows if r["case"].startswith("Muon step") and "matmul limit" not in r["case"]
    ]
    assert muon and all(r["peer"] is None and r["ratio"] is None for r in muon)
    # the share of the matmul limit needs no peer: one row per set
    limits = [r for r in rows if r["case"].endswith("share of the matmul limit")]
    assert len(limits) == 2 and all(r["ratio"] > 0 for r in limits)
    # the table is printed once: one header, one line per row shown, nothing else per row
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert sum(line.startswith("| case | ours |") for line in table) == 1
    assert len(table) == 1 + len(rows)  # without peers, each Muon figure's row stays, once
    assert not any(line.startswith("   ours") for line in result.stdout.splitlines())
    # a saved run prints the same table again without measuring
    again = _bench("--from-json", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert [line for line in again.stdout.splitlines() if line.startswith("| ")] == table


def test_distributed_case_runs_fsdp_and_fsdp_x_tp_rows() -> None:
    # Tiny sizes: this checks the benchmark runs (and that ours and the gather-all
    # baseline agree, which it asserts itself), never its timings.
    settings = Settings(repeats=1, peers=False, dist_dims=(32, 48), dist_layers=1,
                        dist_tp_dim=32, dist_tp_layers=1)  # fmt: skip
    rows = list(case_distributed(settings))
    assert all(r.ours is not None and r.peer is not None for r in rows), rows[0].note
    per_width = ["one process, 1 thread", "one process, 1 thread",
                 "every rank gathers every matrix", "one process"]  # fmt: skip
    assert [r.peer_label for r in rows] == [*per_width, *per_width,
        "every rank gathers every matrix", "every rank gathers every matrix"]  # fmt: skip
    assert ["d=32" in r.case for r in rows[:4]] == [True] * 4
    assert [r.ours_label for r in rows[-2:]] == ["ours (overlapped exchange)", "ours, no overlap"]
    assert rows[-1].case.startswith("Distributed Muon step on FSDP x TP, 4 ranks (dp=2, tp=2)")
    assert rows[-1].command == (
        "python -m benchmarks.distributed_muon --dim 32 48 --layers 1 --tp-dim 32 --tp-layers 1 "
        "--repeats 1 --skip-torch"
    )


def test_unknown_case_is_an_error_naming_the_cases() -> None:
    result = _bench("--cases", "muon,speed")
    assert result.returncode == 2
    assert "unknown case(s) speed; choose from muon, muon_small, ns, gram, adamw" in result.stderr


def test_rows_judge_their_targets() -> None:
    faster = Row("c", "ours", 0.5, "peer", 1.0, "s", "<= 1.0")
    slower = Row("c", "ours", 2.0, "peer", 1.0, "s", "<= 1.0")
    efficient = Row("c", "ours", 90.0, "mm", 100.0, "GFLOP/s", ">= 0.85")
    missing = Row("d", "ours", 1.0, "peer", None, "s", "<= 1.0", note="not installed")
    assert (faster.met, slower.met, efficient.met, missing.met) == (True, False, True, None)
    table = format_table([faster, slower, missing])
    assert "| 0.50x | <= 1.0 (met) |" in table
    assert "| 2.00x | <= 1.0 (not met) |" in table
    # the only row of its figure stays, so that ours is shown; the peer is named under it
    assert "| ours | 1.000 s | (no peer measured) | - | - | <= 1.0 (no figure) |  |" in table
    assert not_measured_line([missing]) == "Not measured: peer (not installed)"


def test_peers_without_a_figure_are_named_in_one_line_not_rows_of_dashes() -> None:
    case = "Muon step, 56 matrices, cpu, defaults"
    rows = [
        Row(case, "ours (fp32 NS)", 1.0, "torch.optim.Muon (bf16)", 2.0, "s", "<= 1.0"),
        Row(case, "ours (fp32 NS)", 1.0, "timm (bf16)", None, "s", "<= 1.0",
            note="timm is not installed"),
        Row(case, "ours (fp32 NS)", 1.0, "heavyball (bf16)", None, "s", "<= 1.0",
            note="ImportError: no module named heavyball"),
        Row("Muon step, equal NS dtype", "ours (bf16 NS)", 3.0, "timm (bf16)", None, "s",
            note="timm is not installed"),
        Row("Muon step, equal NS dtype", "ours (bf16 NS)", 3.0, "heavyball (bf16)", None, "s",
            note="ImportError: no module named heavyball"),
    ]  # fmt: skip
    table = format_table(rows)
    assert len(table.splitlines()) == 2 + 2  # header, the measured peer, ours at bf16 once
    assert "timm" not in table and "| torch.optim.Muon (bf16) | 2.000 s | 0.50x |" in table
    assert "| ours (bf16 NS) | 3.000 s | (no peer measured) | - |" in table
    assert not_measured_line(rows) == (
        "Not measured: timm (timm is not installed); "
        "heavyball (ImportError: no module named heavyball)"
    )
    assert not_measured_line(rows[:1]) is None


@pytest.mark.parametrize(("dim", "hidden"), [(512, 1376), (1024, 2752)])
def test_transformer_shapes_are_attention_and_swiglu(dim: int, hidden: int) -> None:
    shapes = transformer_shapes(dim, 2)
    assert shapes.count((dim, dim)) == 8
    assert shapes.count((hidden, dim)) == 4 and shapes.count((dim, hidden)) == 2


def test_plot_labels_tell_sizes_and_dtypes_apart() -> None:
    def label(case: str) -> str:
        return plot_label(Row(case, "ours (bf16 NS)", 1.0, "timm (bf16)", 1.0, "s"))

    at_512 = label("Muon step, 56 matrices (8 layers, d=512), cpu, equal NS dtype (bf16)")
    at_1024 = label("Muon step, 56 matrices (8 layers, d=1024), cpu, defaults")
    assert at_512 == "Muon step d=512 equal NS dtype bf16: ours (bf16 NS) vs timm (bf16)"
    assert at_1024 == "Muon step d=1024 defaults: ours (bf16 NS) vs timm (bf16)"
    assert label("New process: import and list every plugin").startswith(
        "New process: import and list every plugin: ours"
    )


def test_the_chart_leaves_out_rows_with_a_figure_of_0_and_names_them(tmp_path: Path) -> None:
    what = "Muon step, 56 matrices (8 layers, d=512), cpu"
    rows = [
        Row(what + ", defaults", "ours (bf16 NS)", 0.25, "timm (bf16)", 0.3, "s", "<= 1.0"),
        Row(what + ", minor page faults per step", "ours", 0.0, "timm", 6144.0, "faults"),
        Row(what + ", memory a step adds at its peak", "ours", 0.0, "timm", 0.0, "MiB"),
    ]
    chart = tmp_path / "chart.png"
    note = suite.plot(rows, chart)  # a ratio of 0 has no log2: this raised before
    assert chart.stat().st_size > 0
    assert note is not None and note.startswith("Not drawn, a figure of 0 has no log ratio")
    assert "page faults" not in note and "Muon step d=512: ours vs timm (0.0 faults vs" in note
    assert note.count("Muon step d=512: ours vs timm") == 2  # the memory row too
    assert suite.zero_rows_note(rows[:1]) is None


def test_plot_from_json_draws_a_run_with_zero_rows(tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    row = Row("Muon step, d=32, minor page faults per step", "ours", 0.0, "timm", 12.0, "faults")
    ok = Row("AdamW step, d=32", "ours (AdamW)", 1e-3, "torch AdamW fused", 1e-3, "s", "<= 1.05")
    saved.write_text(json.dumps({"machine": {"cpu": "test"},
                                 "rows": [vars(row), vars(ok)]}))  # fmt: skip
    chart = tmp_path / "chart.png"
    result = _bench("--from-json", str(saved), "--plot", str(chart))
    assert result.returncode == 0, result.stderr[-3000:]
    assert chart.exists()
    assert (
        "Not drawn, a figure of 0 has no log ratio: Muon step d=32: ours vs timm" in result.stderr
    )


def test_a_step_slower_than_the_figure_budget_is_timed_fewer_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(common, "FIGURE_BUDGET_S", 10.0)
    seconds = {"fast": 1.0, "mid": 4.0, "slow": 11.0}  # each call's duration, by a fake clock
    clock = [0.0]
    calls = dict.fromkeys(seconds, 0)

    def step(name: str) -> None:
        calls[name] += 1
        clock[0] += seconds[name]

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    steps = {name: (lambda n=name: step(n)) for name in seconds}
    medians, first = common.interleaved_medians(steps, 5, "cpu")
    # warm-up, then: 5 repeats; 10 s / 4 s = 2; the slow one's first call is its figure
    assert calls == {"fast": 6, "mid": 3, "slow": 1}
    assert medians == seconds and first == seconds


def test_a_peer_step_is_projected_from_one_step_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    steps_by_shape: dict[tuple[int, ...], int] = {}

    class Fake(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {})

        def step(self, closure: object = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    steps_by_shape[tuple(p.shape)] = steps_by_shape.get(tuple(p.shape), 0) + 1
                    clock[0] += p.numel() / 100  # seconds proportional to the matrix's size

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    shapes = [(4, 4)] * 5 + [(8, 4)] * 2
    projected = suite._projected_step_seconds(Fake, shapes, "cpu")
    # a warm-up and a timed step on one matrix of each shape, never the full set
    assert steps_by_shape == {(4, 4): 2, (8, 4): 2}
    assert projected == pytest.approx(5 * 0.16 + 2 * 0.32)


def test_checkpoint_case_times_saves_checksums_the_non_finite_check_and_a_loads_memory() -> None:
    rows = list(case_checkpoint(Settings(repeats=1, checkpoint_params=200_000)))
    assert [(r.ours_label, r.peer_label) for r in rows] == [
        ("async save", "synchronous save"),
        ("fsync + checksum of every file", "synchronous save"),
        ("xxh3_64 (checkpoints)", "crc32c"),
        ("xxh3_64 (checkpoints)", "sha256"),
        ("non-finite check (in the save)", "synchronous save"),
        ("non-finite check (in the save)", "async save"),
        ("non_finite(flat_tensors(saved))", "optimizer step (Muon + AdamW)"),
        ("checkpoint.load (staged)", "checkpoint size"),
        ("checkpoint.load (staged)", "DCP read in place (no staging)"),
    ]
    assert all(r.ours and r.ours > 0 for r in rows[:7]) and rows[0].peer and rows[3].peer
    assert rows[1].target == "<= 0.05" and rows[2].target == rows[3].target == "<= 1.0"
    assert all(r.peer and r.peer > 0 for r in rows[4:]), [r.note for r in rows[4:]]
    # a load's memory is measured in a fresh process: it ran (its size is never asserted)
    assert all(r.ours is not None and r.unit == "MiB" for r in rows[7:]), rows[7].note


def _benchmark_imports(folder: Path) -> dict[str, dict[str, tuple[int, bool]]]:
    """Per module of ``folder``, the modules of ``folder`` it imports: line, and whether at top.

    Every import counts, inside functions too: a circle closed there is a circle still.
    """
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        imported: dict[str, tuple[int, bool]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from .x import y
                    base = ".".join(filter(None, [folder.name, base]))
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == folder.name and len(parts) > 1 and parts[1] in modules:
                    imported.setdefault(parts[1], (node.lineno, id(node) in top))
        graph[path.stem] = imported
    return graph


def _cycle(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[str] | None:
    """One circle of imports in ``graph`` as the modules along it (first one repeated), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in graph.get(module, {}):
            if (found := visit(imported)) is not None:
                return found
        path.pop()
        done.add(module)
        return None

    for module in graph:
        if (found := visit(module)) is not None:
            return found
    return None


def test_benchmark_modules_import_each_other_without_a_cycle() -> None:
    graph = _benchmark_imports(ROOT / "benchmarks")
    assert "common" in graph["suite"] and "checkpoint" in graph["suite"]  # the graph is read
    circle = _cycle(graph)
    assert circle is None, "benchmarks import in a circle: " + " -> ".join(circle or [])


def test_a_circle_closed_inside_a_function_is_found(tmp_path: Path) -> None:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "suite.py").write_text("from benchmarks.case import run\n")
    (folder / "case.py").write_text("def run():\n    from benchmarks.suite import Row\n")
    (folder / "alone.py").write_text("from benchmarks import case\n")
    graph = _benchmark_imports(folder)
    assert graph == {"alone": {"case": (1, True)}, "case": {"suite": (2, False)},
                     "suite": {"case": (1, True)}}  # fmt: skip
    assert _cycle(graph) in (["case", "suite", "case"], ["suite", "case", "suite"])


def test_benchmark_modules_import_each_other_at_module_top() -> None:
    inside = [
        f"benchmarks/{module}.py:{line} imports {imported}"
        for module, imports in _benchmark_imports(ROOT / "benchmarks").items()
        for imported, (line, at_top) in imports.items()
        if not at_top
    ]
    assert not inside, inside


def test_the_paths_case_prints_what_tuning_chose_each_candidate_and_the_cost(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rows.json"
    result = _bench("--cases", "paths", "--dims", "32", "--layers", "1", "--repeats", "1",
                    "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "python -m benchmarks --cases paths --dims 32" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    # tuning measures even where the tests turn it off: the case gives it its own cache
    tuning = [
        r for r in rows if r["case"].startswith("Newton-Schulz tuning, d=32, stack 4 x 32 x 32")
    ]
    names = [r["ours_label"] for r in tuning]
    assert len(names) == len(set(names)) >= 2 and all(r["ours"] > 0 for r in tuning)
    assert sum("chosen" in r["note"].split("; ") for r in tuning) == 1
    assert sum("the table's" in r["note"].split("; ") for r in tuning) == 1
    assert {r["peer_label"] for r in tuning} == {"the table's: " + tuning[0]["ours_label"]}
    # the cost, against one step's Newton-Schulz: the ratio is the cost in steps
    (cost,) = [r for r in rows if r["case"].endswith("tuning cost")]
    every = [r for r in rows if r["case"].startswith("Newton-Schulz tuning, d=32")]
    stacks = {r["case"] for r in every}  # q, k, v, o; the MLP's two, which Gram's rule runs
    assert len(stacks) == 3 and any(r["ours_label"].endswith(", Gram") for r in every)
    assert cost["ours_label"] == f"tuning 3 stacks ({len(every)} candidates)"
    assert cost["ours"] > 0 and cost["ratio"] > 0
    whole_set = [r for r in rows if r["case"].startswith("Newton-Schulz on the d=32 x 1 layers")]
    (whole,) = [r for r in whole_set if r is not cost]
    assert (whole["ours_label"], whole["peer_label"]) == (
        "tuned paths and dtypes", "the table's (tuning off)"
    )  # fmt: skip
    assert whole["ratio"] > 0
    # the table's figures, as before: each path against batched P^T @ X
    table = [r for r in rows if r["case"].startswith("Newton-Schulz paths, d=32")]
    assert {"per matrix, P @ X", "per matrix, P^T @ X", "batched, P @ X"} <= {
        r["ours_label"] for r in table
    }


def test_against_needs_a_revision_and_says_so() -> None:
    result = _bench("--cases", "against")
    assert result.returncode == 2
    assert "--cases against needs --against REV" in result.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_against_times_this_checkout_and_another_commit_in_one_run() -> None:
    before = _worktrees()
    result = _bench("--cases", "against", "--against", "HEAD", "--dims", "32", "--layers", "1",
                    "--repeats", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "this checkout against HEAD" in line]
    assert len(rows) == 2 and "400 matrices 64x64" in rows[1]
    assert "python -m benchmarks --cases against --against HEAD" in result.stdout
    assert _worktrees() == before  # the other commit's checkout is gone


def _worktrees() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                            text=True, check=True)  # fmt: skip
    return listed.stdout.splitlines()


def test_qk_clip_case_times_tracked_forwards_and_the_clipped_step_of_each_model() -> None:
    tiny = Sizes(
        train={"dim": 32, "layers": 1, "heads": 2, "batch_size": 2},
        llama={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
        llama_batch=2,
        seq_lens=(8, 16),
    )  # fmt: skip
    gc.collect()
    tracked_before = len(qk_clip.tracked_layers())
    rows = list(qk_clip_rows(tiny, Settings(repeats=1)))
    gpt = "TinyGPT (d=32, 1 blocks, 2 heads, sdpa)"
    llama = "LlamaForCausalLM (d=32, 1 layers, 4 heads / 2 kv, {})"
    forward, step = (
        "QK-clip tracking, forward pass, {}, 2 x {} tokens",
        "QK-clip in optimizer.step(), Muon + AdamW, {}",
    )
    assert [r.case for r in rows] == [
        forward.format(gpt, 8), forward.format(gpt, 16), step.format(gpt),
        *(forward.format(llama.format(a), seq) for a in ("sdpa", "eager") for seq in (8, 16)),
        step.format(llama.format("sdpa")),
    ]  # fmt: skip
    tracked = ("tracked (qk_clip.track)", "untracked")
    assert [(r.ours_label, r.peer_label) for r in rows] == [
        tracked, tracked, ("qk_clip_threshold=100 (1 of 2 heads clipped)", "no qk_clip_threshold"),
        tracked, tracked, tracked, tracked,
        ("qk_clip_threshold=100 (2 of 4 heads clipped)", "no qk_clip_threshold"),
    ]  # fmt: skip
    assert all(r.unit == "s" and r.ratio is not None and r.ratio > 0 for r in rows)
    assert {r.command for r in rows} == {"python -m benchmarks --cases qk_clip"}
    gc.collect()
    assert len(qk_clip.tracked_layers()) == tracked_before  # the case leaves nothing tracked
    assert "qk_clip" in suite.CASES and "qk_clip" in suite.DEFAULT_CASES


def test_the_small_shapes_case_steps_ours_against_torch_muon_at_each_thread_count() -> None:
    threads = torch.get_num_threads()
    rows = list(case_muon_small(Settings(repeats=1), sets=((32, 2), (64, 1)), threads=(1, 2)))
    assert torch.get_num_threads() == threads  # put back
    assert [r.case for r in rows] == [
        f"Muon step, {n} matrices ({layers} layers, d={dim}), {count}, cpu, defaults"
        for count in ("1 thread", "2 threads") for dim, layers, n in ((32, 2, 14), (64, 1, 7))
    ]  # fmt: skip
    for r in rows:
        assert r.ours_label.startswith("ours (") and r.peer_label == "torch.optim.Muon (bf16)"
        assert r.ours > 0 and r.peer > 0 and r.met is not None and r.target == "<= 0.9"
        assert r.command == "python -m benchmarks --cases muon_small"
        assert r.note.startswith("ours' first step ")
    assert "muon_small" in suite.DEFAULT_CASES


def test_the_quality_case_trains_each_configuration_and_finds_the_steps_to_adamw_s_loss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    corpus = synthetic_corpus(train_chars=20_000, val_chars=4_000)
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: asked.append(kw) or corpus)
    tiny = quality.QualitySize(
        steps=8, batch_size=2, seq_len=16, dim=32, layers=1, heads=2, mlp_hidden=64,
        vocab_size=512, eval_every=4, eval_batches=1, adamw_lrs=(1e-3, 1e-2),
        budgets=(0.5, 1.0), seeds=(0, 1),
    )  # fmt: skip
    plot = tmp_path / "losses.png"
    rows = list(quality.quality_rows(tiny, Settings(extra={"loss_plot": str(plot)})))
    assert asked == [{"vocab_size": 512}]
    where = "8 steps of 2 x 16 tokens, python-stdlib"
    losses = [r for r in rows if r.case == f"Training quality: final validation loss, {where}"]
    best = min(losses[:2], key=lambda r: r.ours)  # the sweep's best AdamW is every row's reference
    best_lr = best.ours_label.removeprefix("AdamW lr ")
    tuned = f"{{'lr': {best_lr}}}"
    # the AdamW half, next to Muon at the tuned lr, is swept over the lrs above the tuned one
    half_sweep = [f"Muon + AdamW, Muon at the tuned AdamW lr, the AdamW half at 1e-2 "
                  f"(muon={tuned}, adamw={{'lr': 1e-2}})"]  # fmt: skip
    assert [r.ours_label for r in losses] == [
        "AdamW lr 1e-3", "AdamW lr 1e-2",
        "Muon + AdamW, HyperParallel's defaults (muon={}, adamw={})",
        f"Muon + AdamW, Muon at its default lr, the AdamW half at the tuned AdamW lr "
        f"(muon={{}}, adamw={tuned})",
        f"Muon + AdamW, both at the tuned AdamW lr (muon={tuned}, adamw={tuned})",
        "torch.optim.Muon defaults + AdamW lr 1e-3",
        *(half_sweep if best_lr == "1e-3" else []),
    ]  # fmt: skip
    for r in losses:
        assert r.peer_label == f"{best.ours_label} (the sweep's best)" and r.peer == best.ours
        assert 0 < r.ours < 10 and r.note.startswith(f"{r.ours:.3f} vs {best.ours:.3f}; 2 seeds: ")
    speed = [r for r in rows if r.case.startswith("Training quality: training throughput")]
    assert [r.ours_label for r in speed] == [r.ours_label for r in losses]
    assert all(r.unit == "tokens/s" and r.ours > 0 and r.peer > 0 for r in speed)
    # by budget: both halves at the tuned lr, the lowest Muon + AdamW, HyperParallel's defaults;
    # each optimizer (each pair of lrs) once
    b = float(best_lr)
    muon_default, adamw_default = quality.MUON_DEFAULT_LR, quality.ADAMW_DEFAULT_LR
    lrs = {losses[2].ours_label: (muon_default, adamw_default),
           losses[3].ours_label: (muon_default, b),
           losses[4].ours_label: (b, b), **{r.ours_label: (b, 1e-2) for r in losses[6:]}}  # fmt: skip
    lowest = min((r for r in losses if r.ours_label in lrs), key=lambda r: r.ours)
    budgeted: dict[tuple[float, float], Row] = {}
    for full in (losses[4], lowest, losses[2]):
        budgeted.setdefault(lrs[full.ours_label], full)
    reached = [r for r in rows if r.case.startswith("Training quality: steps to")]
    assert [r.ours_label for r in reached] == [full.ours_label for full in budgeted.values()]
    assert [r.target for r in reached] == ["<= 0.8"] + [""] * (len(budgeted) - 1)
    for r, full in zip(reached, budgeted.values(), strict=True):
        budgets = [x for x in rows if x.case.endswith(f"by budget, {full.ours_label}")]
        # largest first: budget 1.0 is the full run itself
        assert budgets[0].ours_label == "1.00 of the steps (8), its own cosine"
        assert budgets[0].ours == full.ours
        assert r.peer == 8 and r.unit == "steps" and r.peer_label == best.ours_label
        if r.ours is None:  # the full run did not reach AdamW's loss: no smaller budget is run
            assert r.note == f"never: the largest budget (1.00) did not reach {best.ours:.3f}"
            assert len(budgets) == 1 and full.ours > best.ours
            continue
        assert r.ours == 8 * float(r.note.split(" of the steps")[0])
        # every budget down to the one named reached it; the one run after it, if any, did not
        steps = [int(x.ours_label.split("(")[1].split(")")[0]) for x in budgets]
        assert steps == sorted(steps, reverse=True) and r.ours in steps
        assert [x.ours <= best.ours for x in budgets] == [n >= r.ours for n in steps]
    assert all(row.command == "python -m benchmarks --cases quality --seeds 2" for row in rows)
    table = format_table(rows)
    assert all(f"| {r.case} | {r.ours_label} |" in table for r in reached)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "quality" in suite.CASES and "quality" not in suite.DEFAULT_CASES


def test_quality_quick_is_the_smaller_size_and_prints_the_whole_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--cases quality --quick`` on a tiny model: QUICK's sweep, budgets and rows."""
    corpus = synthetic_corpus(train_chars=20_000, val_chars=4_000)
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: corpus)
    tiny = dataclasses.replace(quality.QUICK, steps=10, batch_size=2, seq_len=16, dim=32, layers=1,
                               heads=2, mlp_hidden=64, vocab_size=512, eval_every=5)  # fmt: skip
    monkeypatch.setattr(quality, "QUICK", tiny)
    settings = Settings(quick_flag="--quick", extra={"loss_plot": str(tmp_path / "l.png")})
    rows = list(quality.case_quality(settings))
    losses = [r for r in rows if r.case.startswith("Training quality: final validation loss, ")]
    best_lr = float(min(losses[: len(tiny.adamw_lrs)], key=lambda r: r.ours).ours_label[9:])
    # the sweep, three Muon + AdamW, torch.optim.Muon, the AdamW half at the sweep's higher lrs
    configurations = len(tiny.adamw_lrs) + 4 + sum(lr > best_lr for lr in tiny.adamw_lrs)
    kinds = Counter(r.case.split(",")[0] for r in rows)
    assert kinds["Training quality: final validation loss"] == configurations
    assert kinds["Training quality: training throughput"] == configurations
    # QUICK budgets both halves at the tuned lr and the lowest Muon + AdamW (once if the same)
    reached = [r for r in rows if r.case.startswith("Training quality: steps to")]
    assert 1 <= len(reached) <= 2 and reached[0].ours_label.startswith(
        "Muon + AdamW, both at the tuned AdamW lr")  # fmt: skip
    assert [r.target for r in reached] == ["<= 0.8", ""][: len(reached)]
    budgets = [r for r in rows if "by budget" in r.case and r.unit == "nats"]
    assert len(reached) <= len(budgets) <= len(reached) * len(tiny.budgets)
    assert all(r.peer == tiny.steps and r.unit == "steps" for r in reached)
    assert all(r.command == "python -m benchmarks --cases quality --quick" for r in rows)
    assert "| Training quality: steps to" in format_table(rows)


def test_quality_with_torch_s_init_says_so_in_every_row_and_its_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: synthetic_corpus(
        train_chars=20_000, val_chars=4_000))  # fmt: skip
    sizes: list[quality.QualitySize] = []
    monkeypatch.setattr(quality, "quality_rows", lambda size, settings: sizes.append(size) or [])
    list(quality.case_quality(Settings(extra={"init": "torch", "seeds": "2"})))
    list(quality.case_quality(Settings()))
    assert [(s.init_std, s.seeds) for s in sizes] == [(None, (0, 1)), (0.02, (0,))]
    monkeypatch.undo()
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: synthetic_corpus(
        train_chars=20_000, val_chars=4_000))  # fmt: skip
    tiny = quality.QualitySize(
        steps=2, batch_size=2, seq_len=16, dim=32, layers=1, heads=2, mlp_hidden=64,
        vocab_size=512, eval_every=2, eval_batches=1, adamw_lrs=(quality.ADAMW_DEFAULT_LR,),
        budgets=(1.0,), init_std=None,
    )  # fmt: skip
    rows = list(quality.quality_rows(tiny, Settings(extra={"loss_plot": str(tmp_path / "l.png")})))
    assert rows and all(r.command == "python -m benchmarks --cases quality --init torch"
                        for r in rows)  # fmt: skip
    losses = [r for r in rows if r.case.startswith("Training quality: final validation loss, ")]
    assert losses and all(r.case.endswith(", PyTorch's default init") for r in losses)


def test_quality_trains_one_optimizer_once_and_runs_budgets_largest_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At AdamW's default lr, Muon at its default lr with the AdamW half tuned *is* the defaults:
    one set of runs. Budgets run from the largest down while they reach AdamW's loss."""
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: synthetic_corpus(
        train_chars=20_000, val_chars=4_000))  # fmt: skip
    defaults = ("muon", quality.MUON_DEFAULT_LR, quality.ADAMW_DEFAULT_LR)
    both = ("muon", quality.ADAMW_DEFAULT_LR, quality.ADAMW_DEFAULT_LR)
    losses = {
        (("adamw_0.001",), 8): 5.0,
        (("torch_muon",), 8): 5.2,
        (defaults, 8): 4.5, (defaults, 6): 5.1, (defaults, 4): 4.9,  # 4 is past a miss: not run
        (both, 8): 4.0, (both, 6): 4.8, (both, 4): 4.9, (both, 2): float("nan"),  # a miss
    }  # fmt: skip
    trained: list[tuple[str, int, bool]] = []

    def fake_train(configuration: quality.Configuration, data: object, size: object, seed: int,
                   steps: int, *, curve: bool = True) -> quality.RunResult:  # fmt: skip
        trained.append((configuration.key, steps, curve))
        loss = losses[(configuration.same_as or (configuration.key,), steps)]
        return quality.RunResult(configuration.label, steps, train_losses=[(steps, loss)],
                                 val_losses=[(steps, loss)], tokens_per_s=1.0)  # fmt: skip

    monkeypatch.setattr(quality, "train", fake_train)
    budgeted = (quality.MUON_BOTH_TUNED, quality.MUON_LOWEST, quality.MUON_DEFAULT_LR_KEY,
                quality.MUON_DEFAULTS, quality.TORCH_MUON)  # fmt: skip
    tiny = quality.QualitySize(adamw_lrs=(quality.ADAMW_DEFAULT_LR,), steps=8,
                               budgets=(0.25, 0.5, 0.75, 1.0), budgeted=budgeted)  # fmt: skip
    rows = list(quality.quality_rows(tiny, Settings(extra={"loss_plot": str(tmp_path / "l.png")})))
    full = [("adamw_0.001", 8, True), (quality.MUON_DEFAULTS, 8, True),
            (quality.MUON_BOTH_TUNED, 8, True), (quality.TORCH_MUON, 8, True)]  # fmt: skip
    # both halves at the tuned lr: 8 (the full run), 6, 4 reach 5.0, 2 (NaN) does not; the lowest
    # Muon + AdamW is the same optimizer; Muon's default lr: 8 reaches, 6 does not, 4 is not run;
    # torch.optim.Muon's full run misses: never, and no budget run
    budgets = [(quality.MUON_BOTH_TUNED, 6, False), (quality.MUON_BOTH_TUNED, 4, False),
               (quality.MUON_BOTH_TUNED, 2, False), (quality.MUON_DEFAULT_LR_KEY, 6, False)]  # fmt: skip
    assert trained == full + budgets
    reached = [r for r in rows if r.case.startswith("Training quality: steps to")]
    assert [(r.ours, r.note, r.target) for r in reached] == [
        (4, "0.50 of the steps (2.00x)", "<= 0.8"), (8, "1.00 of the steps (1.00x)", ""),
        (None, "never: the largest budget (1.00) did not reach 5.000", ""),
    ]  # fmt: skip
    assert reached[1].ours_label.startswith("Muon + AdamW, Muon at its default lr, the AdamW half")
    assert "its runs reused" in capsys.readouterr().err


def test_quality_muon_lrs_sweeps_muon_with_the_adamw_half_at_the_tuned_lr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(quality, "python_stdlib_corpus", lambda **kw: synthetic_corpus(
        train_chars=20_000, val_chars=4_000))  # fmt: skip
    trained: list[tuple[object, ...]] = []

    def fake_train(configuration: quality.Configuration, data: object, size: object, seed: int,
                   steps: int, *, curve: bool = True) -> quality.RunResult:  # fmt: skip
        trained.append(configuration.same_as or (configuration.key,))
        loss = 4.0 if configuration.key == "adamw_0.002" else 5.0  # the sweep's best: 2e-3
        return quality.RunResult(configuration.label, steps, train_losses=[(steps, loss)],
                                 val_losses=[(steps, loss)], tokens_per_s=1.0)  # fmt: skip

    monkeypatch.setattr(quality, "train", fake_train)
    monkeypatch.setattr(quality, "DEFAULT", quality.QualitySize(adamw_lrs=(1e-3, 2e-3), steps=8))
    settings = Settings(
        extra={"muon_lrs": "1.5e-3,2e-3,0.02,0.0015", "loss_plot": str(tmp_path / "l.png")}
    )
    rows = list(quality.case_quality(settings))
    losses = [r for r in rows if r.case.startswith("Training quality: final validation loss, ")]
    labels = [r.ours_label for r in losses]
    # 2e-3 (the tuned lr) and 0.02 (Muon's default) are rows of their own already: trained once
    assert labels[-1] == ("Muon + AdamW, Muon at 1.5e-3, the AdamW half at the tuned AdamW lr "
                          "(muon={'lr': 1.5e-3}, adamw={'lr': 2e-3})")  # fmt: skip
    assert sum("Muon at 1.5e-3" in label for label in labels) == 1  # 0.0015 is the same lr
    assert ("muon", 1.5e-3, 2e-3) in trained and len(trained) == len(set(trained))
    assert {r.command for r in rows} == {
        "python -m benchmarks --cases quality --muon-lrs 1.5e-3,2e-3,2e-2"
    }
    for bad in ("6e-3,x", "0", "-1e-3", ",", ""):
        with pytest.raises(SystemExit) as exit_info:
            suite.main(["--cases", "quality", f"--muon-lrs={bad}"])
        says = f"--muon-lrs {bad!r}: give comma-separated positive numbers"
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
    for budgets in ((0.5, 0.8), (0.5, 1.0, 1.2), (0.0, 1.0)):
        with pytest.raises(HyperParallelValueError, match=r"budgets .*1\.0 among them"):
            quality.QualitySize(budgets=budgets)


def test_quality_runs_of_a_seed_start_from_the_same_init_and_batches() -> None:
    corpus = synthetic_corpus(train_chars=20_000, val_chars=4_000)
    tiny = quality.QualitySize(steps=4, batch_size=2, seq_len=16, dim=32, layers=1, heads=2,
                               mlp_hidden=64, eval_every=2, eval_batches=1)  # fmt: skip
    adamw = quality.train(quality.adamw(1e-3), corpus, tiny, seed=0, steps=4)
    muon = quality.train(quality.muon_configurations(1e-3)[1], corpus, tiny, seed=0, steps=2)
    again = quality.train(quality.adamw(1e-3), corpus, tiny, seed=0, steps=4)
    other_seed = quality.train(quality.adamw(1e-3), corpus, tiny, seed=1, steps=4)
    # step 1's loss is taken before any update: the same model on the same batch
    assert muon.train_losses[0] == adamw.train_losses[0] != other_seed.train_losses[0]
    assert again.val_losses == adamw.val_losses and [s for s, _ in adamw.val_losses] == [2, 4]
