"""``hyper-parallel train``: the runs, then their metrics, plot and summary."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.train.config import MUON_ADAMW, TrainConfig, TrainError
from hyper_parallel.train.corpus import built_in_corpus
from hyper_parallel.train.data import TokenizedText, load_text_file, synthetic_corpus
from hyper_parallel.train.outcome import exit_code
from hyper_parallel.train.placement import Placement, place
from hyper_parallel.train.preflight import (
    RUN_OUTPUTS,
    check_dependencies,
    check_memory,
    check_paths,
    check_resume,
    run_folders_locked,
    run_names,
)
from hyper_parallel.train.qk_log import summary_text
from hyper_parallel.train.run import Metrics, RunResult, replace_atomically, run_one
from hyper_parallel.train.threads import Threads, resumed_threads, torch_threads

if TYPE_CHECKING:
    from hyper_parallel.checkpoint import Preemption, Verified

__all__ = ["MUON_ADAMW", "RunResult", "TrainConfig", "TrainError", "steps_to_reach", "train"]


def load_data(config: TrainConfig) -> TokenizedText:
    """The synthetic corpus, the built-in corpus ``--data`` names, or ``--data``'s file."""
    if config.data is None:
        return synthetic_corpus(seed=config.seed)
    if (named := built_in_corpus(config.data)) is not None:
        return named
    return load_text_file(config.data, tokenizer=config.tokenizer, seq_len=config.seq_len)


def steps_to_reach(val_losses: list[tuple[int, float]], target: float) -> float | None:
    """First (linearly interpolated) step at which a validation curve reaches ``target``."""
    found = reached_between(val_losses, target)
    if found is None:
        return None
    (s0, l0), (s1, l1) = found
    if s0 == s1 or l0 == l1:
        return float(s1)
    return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)


def reached_between(
    val_losses: list[tuple[int, float]], target: float
) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """The validations either side of where the curve first reaches ``target``.

    The last one above it and the first one at or below it; both the first
    point when the curve starts there, ``None`` when it never gets there.
    """
    previous: tuple[int, float] | None = None
    for step, loss in val_losses:
        if loss <= target:
            return (previous or (step, loss)), (step, loss)
        previous = (step, loss)
    return None


def _summary(config: TrainConfig, data: TokenizedText, results: list[RunResult]) -> dict[str, Any]:
    runs = {
        r.name: {
            "steps": r.steps_done,
            "final_train_loss": r.train_losses[-1][1] if r.train_losses else None,
            "final_train_step": r.train_losses[-1][0] if r.train_losses else None,
            "final_val_loss": r.final_val_loss,
            "final_val_step": r.val_losses[-1][0] if r.val_losses else None,
            "best_val_loss": min((v for _, v in r.val_losses), default=None),
            "seconds": round(r.seconds, 2),
            "tokens_per_s": round(r.tokens_per_s),
            "interrupted": r.interrupted,
            "preempted": r.preempted,
            "save_error": r.save_error,
            "non_finite": r.non_finite,
            "diverged": r.diverged,
            "skipped_steps": r.skipped,
            "resumed_from_step": r.resumed_from,
            "label": r.label,
            "optimizers": r.optimizers,
            "qk_clip": r.qk_clip.summary() if r.qk_clip is not None else None,
        }
        for r in results
    }
    summary: dict[str, Any] = {
        "data": data.source,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "runs": runs,
        "exit_code": int(exit_code(list(runs.values()))),
    }
    if len(results) == 2 and not any(r.stopped_early for r in results):
        ours, baseline = results
        target = baseline.final_val_loss
        if target is not None:
            reached = steps_to_reach(ours.val_losses, target)
            between = reached_between(ours.val_losses, target)
            summary["comparison"] = {
                "target_val_loss": target,
                "baseline": baseline.name,
                "baseline_steps": baseline.steps_done,
                "steps_to_reach": reached,
                "validated_between": None if between is None else [s for s, _ in between],
                "step_ratio": None if reached is None else reached / baseline.steps_done,
            }
    return summary


def _run_line(label: str, run: dict[str, Any]) -> str:
    """One run of the summary: its steps, time, speed and final losses."""
    flag = "  (interrupted)" if run["interrupted"] else ""
    if run.get("preempted"):
        flag = "  (stopped by SIGTERM)"
    elif run.get("save_error"):
        flag = "  (stopped: a checkpoint could not be saved)"
    elif run.get("non_finite"):
        flag = "  (stopped: NaN/Inf)"
    elif run.get("diverged"):
        flag = "  (diverged)"
    val = run["final_val_loss"]
    if run["final_train_loss"] is None or val is None:
        return f"{label:>14}: {run['steps']} steps{flag}"
    # an interrupted run's last validation may be older than its last step: say so
    at = f" (at step {run['final_val_step']})" if run["final_val_step"] != run["steps"] else ""
    since = run.get("resumed_from_step", 0)
    ran = f" ({run['steps'] - since} since step {since})" if since else ""
    clip = f"; {summary_text(run['qk_clip'])}" if run.get("qk_clip") else ""
    return (
        f"{label:>14}: {run['steps']} steps{ran} in {run['seconds']:.0f} s, "
        f"{run['tokens_per_s']:,} tok/s, train loss {run['final_train_loss']:.4f}, "
        f"val loss {val:.4f}{at}{clip}{flag}"
    )


def _resume_hint(config: dict[str, Any]) -> str:
    """How a run stopped by Ctrl-C or SIGTERM goes on: --resume, with its checkpoints."""
    if config.get("checkpoint_dir"):
        return (
            "to go on from the last checkpoint, run the same command with --resume "
            f"(checkpoints in {config['checkpoint_dir']})"
        )
    return "it cannot be resumed: it saved no checkpoints (--checkpoint-dir DIR saves them)"


def _label_of_first(summary: dict[str, Any]) -> str:
    name, run = next(iter(summary["runs"].items()))
    return str(run.get("label", name))


def _print_summary(summary: dict[str, Any], out: Path, echo: Callable[[str], None]) -> None:
    echo(f"data: {summary['data']}")
    for name, run in summary["runs"].items():
        echo(_run_line(run.get("label", name), run))
    if any(run["interrupted"] or run.get("preempted") for run in summary["runs"].values()):
        echo(_resume_hint(summary["config"]))
    if summary.get("comparison"):
        echo(_comparison_line(_label_of_first(summary), summary["comparison"]))
    echo(f"wrote {', '.join(str(out / n) for n in RUN_OUTPUTS if (out / n).exists())}")


def _comparison_line(ours: str, cmp: dict[str, Any]) -> str:
    """Where ``ours`` reached the baseline's final val loss: between which validations."""
    target = f"{cmp['baseline']}'s final val loss {cmp['target_val_loss']:.4f}"
    if cmp["steps_to_reach"] is None:
        return f"{ours} did not reach {target}"
    first, last = cmp.get("validated_between") or [cmp["steps_to_reach"]] * 2
    of = f"of {cmp['baseline_steps']}; step ratio {cmp['step_ratio']:.2f}"
    if first == last:
        return f"{ours} reached {target} at its validation at step {last} ({of})"
    return (
        f"{ours} reached {target} between its validations at steps {first} and {last} "
        f"(interpolated: step {cmp['steps_to_reach']:.0f} {of})"
    )


def train(
    config: TrainConfig,
    *,
    echo: Callable[[str], None] = print,
    preemption: Preemption | None = None,
) -> dict[str, Any]:
    """Run ``config`` (and its ``--compare`` run); write metrics, plot and summary to ``config.out``.

    Returns:
        The summary (also written to ``summary.json``).

    Raises:
        TrainError, DataError: an unusable option or input.
        KeyboardInterrupt: never; Ctrl-C ends the current run early, and what
            was written so far is kept (``summary["runs"][...]["interrupted"]``).
            SIGTERM ends it after the current step, saved there with
            ``--checkpoint-dir`` (``"preempted"``; the summary only, no
            plot), and a checkpoint that cannot be written or state that
            went NaN/Inf ends it too (``"save_error"``, ``"non_finite"``:
            the message); the summary is written in every case, with the
            exit code (``"exit_code"``). ``preemption``
            is the caller's, installed already; by default ``train``
            catches SIGTERM itself while its runs train.
    """
    forget_stopped_summary(config.out)
    config.validate()
    check_dependencies(config)
    check_paths(config)
    with torch_threads(config.threads) as threads:
        data = load_data(config)
        with run_folders_locked(config):
            return _train_checked(config, data, echo, preemption, threads)


def _train_checked(
    config: TrainConfig,
    data: TokenizedText,
    echo: Callable[[str], None],
    preemption: Preemption | None,
    threads: Threads,
) -> dict[str, Any]:
    """:func:`train` once its paths are checked, its data loaded and its folders locked."""
    resumed = check_resume(config, data)
    saved: dict[str, Any] = next(
        (v.extra.get("train", {}) for v in resumed.values() if v is not None), {}
    )
    threads = resumed_threads(threads, saved.get("threads"))
    if _finished(config, resumed):
        return _left_as_it_was(config, resumed)
    check_memory(config, data.vocab_size)
    group_before = _process_group_initialized()
    try:
        return _train_placed(config, data, place(config), echo, preemption, threads)
    finally:
        # A process group this call brought up is torn down here, not left to the
        # interpreter's exit, where gloo's threads can abort a run that has finished.
        if not group_before and _process_group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()


def forget_stopped_summary(out: Path) -> None:
    """Remove ``out``'s summary of a run that stopped early (rank 0), before anything is checked.

    The summary says how the last attempt ended (``hyper-parallel outcome``):
    an earlier "preempted" must not answer for this attempt if it is refused
    or crashes before writing its own, or a job script would requeue it
    forever. A finished run's summary stays: ``--resume`` of it changes nothing.
    """
    path = out / "summary.json"
    if int(os.environ.get("RANK", "0")) != 0 or not path.is_file():
        return
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("exit_code", 0) != 0:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        return  # unreadable: check_paths and the run's own writes say what is wrong


def _finished(config: TrainConfig, resumed: dict[str, Verified | None]) -> bool:
    """``--resume`` of a run whose every run saved its last step and whose summary was written."""
    return (
        bool(resumed)
        and all(v is not None and v.step == config.steps for v in resumed.values())
        and (config.out / "summary.json").is_file()
    )


def _left_as_it_was(config: TrainConfig, resumed: dict[str, Verified | None]) -> dict[str, Any]:
    """Say that there is nothing to train; the summary already written."""
    if int(os.environ.get("RANK", "0")) == 0:
        where = ", ".join(f"{name} at step {v.step} ({v.path})" for name, v in resumed.items() if v)
        print(
            f"hyper-parallel train: --resume: the run already finished: {where}; {config.out} "
            "is left as it was. Start without --resume to train again",
            file=sys.stderr,
        )
    summary: dict[str, Any] = json.loads((config.out / "summary.json").read_text(encoding="utf-8"))
    return summary


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _train_placed(
    config: TrainConfig,
    data: TokenizedText,
    placement: Placement,
    echo: Callable[[str], None],
    preemption: Preemption | None,
    threads: Threads,
) -> dict[str, Any]:
    """:func:`train` once the data is loaded and this process's place is set up."""
    main = placement.is_main
    if main:
        config.out.mkdir(parents=True, exist_ok=True)
        if config.overwrite and not config.resume:  # the run being replaced leaves nothing behind
            for name in RUN_OUTPUTS:
                (config.out / name).unlink(missing_ok=True)
        (config.out / "summary.json").unlink(missing_ok=True)  # this run writes its own
        processes = f" on {placement.world_size} processes" if placement.world_size > 1 else ""
        echo(
            f"training {' then '.join(run_names(config))} for {config.steps} steps on "
            f"{data.source}{processes}, {threads}; writing {config.out}"
        )
    progress = _progress_factory() if config.progress and main else None
    metrics = Metrics(config.out / "metrics.jsonl" if main else None, append=config.resume)
    results: list[RunResult] = []
    own = main_thread_preemption() if preemption is None else None
    try:
        for name in run_names(config):
            result = run_one(config, name, data, metrics, progress, placement, preemption or own)
            results.append(result)
            if result.stopped_early:
                break
    finally:
        metrics.close()
        if own is not None:
            own.uninstall()
    summary = _summary(config, data, results)
    summary["threads"] = {"count": torch.get_num_threads(), "chosen_by": threads.why}
    if placement.mesh is not None:
        summary["mesh"] = {
            "shape": list(placement.mesh.shape),
            "dim_names": list(placement.mesh.mesh_dim_names or ()),
        }
    if main:
        _write_outputs(results, summary, config.out, data.source)
        _print_summary(summary, config.out, echo)
    if _process_group_initialized():
        import torch.distributed as dist

        # No rank leaves before rank 0 has written: torchrun's agent stops the others as
        # soon as one exits non-zero (after a preemption, every rank exits 143).
        dist.barrier()
    return summary


def main_thread_preemption() -> Preemption | None:
    """SIGTERM caught from now on (:class:`~hyper_parallel.checkpoint.Preemption`), from the main thread.

    Called from another thread (an embedding program's worker), Python can
    install no handler: ``None``, and SIGTERM does what the program set up.
    """
    from hyper_parallel.checkpoint import Preemption

    if threading.current_thread() is not threading.main_thread():
        return None
    return Preemption().install()


def _write_outputs(
    results: list[RunResult], summary: dict[str, Any], out: Path, title: str
) -> None:
    """The plot (when there is a point to draw) and the summary, each replaced whole or not at all.

    A preempted run writes its summary only: the grace period before SIGKILL
    is short, drawing the plot costs more than the rest of the way out, and
    the resumed run draws the whole curve.
    """
    from hyper_parallel.train.plot import plot_losses

    plot = out / "loss_curves.png"
    if any(r.preempted for r in results):
        pass  # the summary alone
    elif any(r.train_losses or r.val_losses for r in results):
        replace_atomically(plot, lambda tmp: plot_losses(results, tmp, title=title))
    else:  # interrupted before anything was measured: no plot, rather than an empty one
        plot.unlink(missing_ok=True)
    text = json.dumps(summary, indent=2) + "\n"
    replace_atomically(out / "summary.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _progress_factory() -> Callable[..., Any]:
    from tqdm.auto import tqdm

    def factory(*, total: int, initial: int, desc: str) -> Any:
        return tqdm(
            total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True, mininterval=0.5
        )

    return factory
