"""One optimizer's run of ``hyper-parallel train``: a fresh model trained step by step."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from hyper_parallel.core.errors import HyperParallelRuntimeError
from hyper_parallel.core.optimizer import (
    ChainedOptimizer,
    HyperLRScheduler,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    step_if_finite,
)
from hyper_parallel.core.optimizer._nonfinite import non_finite_state
from hyper_parallel.core.plugin import OptimizerEntry, PluginKind, get_registry
from hyper_parallel.train.config import MUON_ADAMW, TrainConfig, TrainError
from hyper_parallel.train.data import TokenizedText, batches
from hyper_parallel.train.divergence import DivergenceWatch
from hyper_parallel.train.model import TinyGPT
from hyper_parallel.train.placement import Placement
from hyper_parallel.train.preflight import resume_record, run_folder
from hyper_parallel.train.qk_log import QKClipFigures, track_for_clip

if TYPE_CHECKING:
    from hyper_parallel.checkpoint import CheckpointManager, Preemption

__all__ = ["Metrics", "NonFiniteRun", "RunResult", "build_optimizer", "evaluate", "run_one"]

#: A run stops when this many steps in a row have non-finite gradients.
_MAX_SKIPS_IN_A_ROW = 10

_LOWER_LR = "lower the learning rate (--lr, --muon-lr)"


class NonFiniteRun(HyperParallelRuntimeError):
    """The run's params, optimizer state or gradients went NaN/Inf: it stops, keeping nothing of it."""


@dataclass
class RunResult:
    """What one optimizer's run produced."""

    name: str
    steps_done: int
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    #: The train losses the log holds (step 1, every ``log_every``, the last): what the plot draws.
    logged_train_losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    interrupted: bool = False  # Ctrl-C
    preempted: bool = False  # SIGTERM: stopped after a step, saved there with --checkpoint-dir
    save_error: str | None = None  # a checkpoint could not be written: the run stopped
    non_finite: str | None = None  # state or every gradient went NaN/Inf: the run stopped
    diverged: str | None = None  # the divergence rule's warning (divergence.py), said once
    skipped: list[int] = field(default_factory=list)  # steps skipped for non-finite gradients
    resumed_from: int = 0  # the checkpoint's step; seconds and tokens_per_s count from there
    optimizers: list[str] = field(default_factory=list)  # the sub-optimizers, in step order
    qk_clip: QKClipFigures | None = None  # with --qk-clip-threshold, where Muon clips

    @property
    def label(self) -> str:
        """The run as plots and summaries show it: ``muon+adamw``'s split names what it used."""
        if self.name != MUON_ADAMW or set(self.optimizers) <= {"muon", "adamw"}:
            return self.name
        rank = {"muon": 0, "adamw": 2}
        return "+".join(sorted(self.optimizers, key=lambda n: rank.get(n, 1)))

    @property
    def stopped_early(self) -> bool:
        """Stopped before its last step: Ctrl-C, SIGTERM, a failed save, or NaN/Inf."""
        return bool(self.interrupted or self.preempted or self.save_error or self.non_finite)

    @property
    def final_val_loss(self) -> float | None:
        return self.val_losses[-1][1] if self.val_losses else None

    @classmethod
    def resumed(cls, name: str, step: int, rows: list[dict[str, Any]]) -> RunResult:
        """A run continued after ``step``, with what its log already holds up to there."""
        result = cls(name=name, steps_done=step, resumed_from=step)
        for row in rows:
            if "train_loss" in row:
                result.train_losses.append((row["step"], row["train_loss"]))
                result.logged_train_losses.append((row["step"], row["train_loss"]))
            if "val_loss" in row:
                result.val_losses.append((row["step"], row["val_loss"]))
            if "skipped" in row:
                result.skipped.append(row["step"])
            result.diverged = row.get("diverged", result.diverged)
        return result


def build_optimizer(config: TrainConfig, name: str, model: torch.nn.Module) -> ChainedOptimizer:
    """``muon+adamw`` through a partitioner, or one named optimizer on every param.

    A single optimizer gets two groups: params with two or more dims, with
    weight decay, and the rest (norms, biases) without; a matrix-only one
    (Muon, Sinkhorn) leaves the rest to AdamW at ``--lr``.
    """
    clip = config.muon_qk_clip(name)  # Muon's QK-clip options, where this run clips
    if name == MUON_ADAMW:
        return get_hyper_optimizer(
            model,
            partitioner=config.partitioner,
            muon_kwargs={"lr": config.muon_lr, "weight_decay": config.weight_decay, **clip},
            adamw_kwargs={"lr": config.lr, "weight_decay": config.weight_decay},
        )
    entry = get_registry().get(PluginKind.OPTIMIZER, name)
    lr = config.muon_lr if entry.name == "muon" else config.lr
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    decayed = {"params": matrices, "weight_decay": config.weight_decay}
    undecayed = {"params": vectors, "weight_decay": 0.0}
    optimizers: dict[str, dict[str, Any]] = {entry.name: {"params": [decayed], "lr": lr, **clip}}
    if vectors and isinstance(entry, OptimizerEntry) and entry.matrix_only:
        # Norms and biases go to AdamW, said here rather than warned about by the factory.
        optimizers["adamw"] = {"params": [undecayed], "lr": config.lr}
    elif vectors:
        optimizers[entry.name]["params"].append(undecayed)
    try:
        return get_hyper_optimizer(model, optimizers=optimizers)
    except (TypeError, ValueError) as exc:
        raise TrainError(f"--optimizer {name}: {exc}") from None


class Metrics:
    """Appends one JSON object per line and flushes, so an interrupted run keeps its log.

    With no path (ranks other than 0 of a sharded run) it writes nothing.
    Appending (a resumed run), the log keeps its complete rows; :meth:`resume`
    drops a run's rows past its checkpoint, which are measured again.
    """

    def __init__(self, path: Path | None, *, append: bool = False) -> None:
        self._path = path
        self._file: TextIO | None = None
        self._rows: list[dict[str, Any]] = []
        if path is not None and append and path.is_file():
            self._rows = _complete_rows(path)
        self._rewrite()

    def _rewrite(self) -> None:
        """The log replaced whole by the rows kept, then opened for appending."""
        if self._path is None:
            return
        if self._file is not None:
            self._file.close()
        text = "".join(json.dumps(r) + "\n" for r in self._rows)
        replace_atomically(self._path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        self._file = self._path.open("a", encoding="utf-8")

    def resume(self, run: str, step: int) -> list[dict[str, Any]]:
        """Continue ``run`` after ``step``: its later rows go (they run again); its rows kept."""
        self._rows = [r for r in self._rows if r.get("run") != run or r.get("step", 0) <= step]
        self._rewrite()
        return [r for r in self._rows if r.get("run") == run]

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._rows.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a sibling temporary file, then rename it over ``path``: Ctrl-C leaves either."""
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _complete_rows(path: Path) -> list[dict[str, Any]]:
    """The log's rows; a line cut short by a killed process is dropped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def evaluate(model: TinyGPT, val_batches: Sequence[torch.Tensor]) -> float:
    """Mean next-token loss over the validation batches (in eval mode, then back to train)."""
    model.eval()
    with torch.no_grad():
        loss = sum(float(model.loss(b)) for b in val_batches) / len(val_batches)
    model.train()
    return loss


def _lrs(optimizer: ChainedOptimizer) -> dict[str, float]:
    return {name: float(opt.param_groups[0]["lr"]) for name, opt in optimizer.optimizers.items()}


class _Throughput:
    """Tokens per second: over the steps since the last log line, and over the whole run."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.start = self._window_start = time.perf_counter()
        self._window_steps = 0

    def count_step(self) -> None:
        self._window_steps += 1

    def window(self) -> float:
        """Over the steps counted since the last call (or the start); starts a new window."""
        now = time.perf_counter()
        tps = self.tokens_per_step * self._window_steps / max(now - self._window_start, 1e-9)
        self._window_start, self._window_steps = now, 0
        return tps

    def seconds(self) -> float:
        return time.perf_counter() - self.start


@dataclass
class _Run:
    """One optimizer's run in progress: what trains, on which batches, and what it produced.

    Built by :meth:`start`; :meth:`step` does one optimizer step and the logging,
    validation and checkpoint that fall on it.
    """

    config: TrainConfig
    model: TinyGPT
    optimizer: ChainedOptimizer
    scheduler: HyperLRScheduler
    train_batches: Iterator[torch.Tensor]
    val_batches: list[torch.Tensor]
    placement: Placement
    metrics: Metrics
    checkpoints: CheckpointManager | None
    record: dict[str, Any]  # how the run is made, kept in each checkpoint (``resume_record``)
    result: RunResult  # steps_done: the steps already done, more than 0 when resumed
    bar: Any  # a progress bar (tqdm's interface), or None
    throughput: _Throughput
    divergence: DivergenceWatch
    skipped_in_a_row: int = 0
    saved_at: int | None = None  # the step of this run's newest save

    @classmethod
    def start(
        cls,
        config: TrainConfig,
        name: str,
        data: TokenizedText,
        metrics: Metrics,
        progress_factory: Callable[..., Any] | None,
        placement: Placement,
    ) -> _Run:
        """A fresh model, its optimizer and schedule, resumed from a checkpoint if asked."""
        torch.manual_seed(config.seed)
        model = TinyGPT(config.model(data.vocab_size))
        if placement.backend is not None:
            placement.backend.shard_model(model, mesh=placement.mesh)
        track_for_clip(model, config.muon_qk_clip(name))
        optimizer = build_optimizer(config, name, model)
        scheduler = _build_scheduler(config, optimizer)
        train_batches, val_batches = _batches(config, data, placement)
        checkpoints = _checkpoints(config, name)
        done = 0
        if checkpoints is not None and config.resume:
            done = _resume(
                checkpoints, model, optimizer, scheduler, train_batches, placement.rank == 0
            )
        rows = metrics.resume(name, done) if config.resume else []
        result = RunResult.resumed(name, done, rows)
        result.optimizers = list(optimizer.optimizers)
        result.qk_clip = QKClipFigures.of(config.muon_qk_clip(name), rows)
        bar = (
            progress_factory(total=config.steps, initial=done, desc=result.label)
            if progress_factory
            else None
        )
        tokens_per_step = config.batch_size * config.seq_len * placement.world_size
        return cls(
            config=config,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            train_batches=train_batches,
            val_batches=val_batches,
            placement=placement,
            metrics=metrics,
            checkpoints=checkpoints,
            record=resume_record(config, name, data, placement.world_size),
            result=result,
            bar=bar,
            throughput=_Throughput(tokens_per_step),
            divergence=_watch(config, result),
        )

    @property
    def name(self) -> str:
        return self.result.name

    def evaluate(self, step: int) -> None:
        self.result.val_losses.append((step, evaluate(self.model, self.val_batches)))
        self.metrics.write(
            {"run": self.name, "step": step, "val_loss": self.result.val_losses[-1][1]}
        )

    def step(self, step: int) -> None:
        """One optimizer step, or a skipped one when a gradient is not finite."""
        lrs = _lrs(self.optimizer)
        loss = self.model.loss(next(self.train_batches).to(self.placement.device))
        loss.backward()
        stepped = step_if_finite(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        value = self.placement.mean(float(loss.detach()))
        if stepped:
            self._after_step(step, value, lrs)
        else:
            self._skip(step, value)
        if self.bar is not None:
            self.bar.update(1)

    def _skip(self, step: int, loss: float) -> None:
        """Params, optimizer state and schedule stay as they were: as if without this batch.

        Raises:
            NonFiniteRun: the loss is not finite because the params or the
                optimizer state are not (checked only then), or too many
                steps in a row were skipped.
        """
        self.skipped_in_a_row += 1
        self.result.skipped.append(step)
        self.metrics.write({"run": self.name, "step": step, "skipped": "non-finite gradient"})
        if not math.isfinite(loss) and (bad := non_finite_state(self.model, self.optimizer)):
            raise NonFiniteRun(
                f"{self.name}: stopped at step {step}: the loss is {loss} and {bad.summary} "
                f"holds NaN or Inf{self._kept()}; {_LOWER_LR}"
            )
        if self.skipped_in_a_row >= _MAX_SKIPS_IN_A_ROW:
            raise NonFiniteRun(
                f"{self.name}: stopped at step {step}: {self.skipped_in_a_row} steps in a row had "
                f"non-finite gradients (loss {loss}); {_LOWER_LR}"
            )

    def _kept(self) -> str:
        """What the checkpoints hold, for a run stopped by NaN/Inf: only finite state."""
        return "; no checkpoint keeps it" if self.checkpoints is not None else ""

    def _watch(self, step: int, loss: float) -> None:
        """Say once, on rank 0, and record, when the divergence rule holds."""
        said = self.divergence.observe(step, loss)
        if said is None:
            return
        self.result.diverged = f"{self.result.label}: {said}"
        self.metrics.write({"run": self.name, "step": step, "diverged": self.result.diverged})
        if self.placement.is_main:
            line = f"hyper-parallel train: warning: {self.result.diverged}"
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr)

    def _after_step(self, step: int, loss: float, lrs: dict[str, float]) -> None:
        """Advance the schedule; log, validate and save where ``step`` falls on their interval."""
        config = self.config
        self.skipped_in_a_row = 0
        self.scheduler.step()
        self.result.train_losses.append((step, loss))
        self.result.steps_done = step
        self.throughput.count_step()
        self._watch(step, loss)
        clipped = self.result.qk_clip.count(self.optimizer) if self.result.qk_clip else {}
        last = step == config.steps
        if step % config.log_every == 0 or last or step == 1:  # step 1: the loss it starts from
            self._log(step, loss, lrs, clipped)
        if step % config.eval_every == 0 or last:
            self.evaluate(step)
        every = config.checkpoint_every
        if last or (every and step % every == 0):
            self.save(step)

    def save(self, step: int) -> None:
        """Save a checkpoint of ``step`` (with ``--checkpoint-dir``), unless one was just saved there."""
        from hyper_parallel.checkpoint import NonFiniteStateError

        if self.checkpoints is None or self.saved_at == step:
            return
        try:
            self.checkpoints.save(
                step,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                extra=self.record,
            )
        except NonFiniteStateError as exc:
            said = str(exc).rstrip(".")
            raise NonFiniteRun(
                f"{self.name}: stopped at step {step}: {said}; {_LOWER_LR}"
            ) from None
        self.saved_at = step

    def _log(
        self, step: int, loss: float, lrs: dict[str, float], clipped: dict[str, float | int]
    ) -> None:
        tps = self.throughput.window()
        self.result.logged_train_losses.append((step, loss))
        self.metrics.write(
            {
                "run": self.name,
                "step": step,
                "train_loss": loss,
                "lr": lrs,
                "tokens_per_s": round(tps),
                **clipped,
            }
        )
        if self.bar is not None:
            lr_text = {f"lr_{k}": f"{v:.2e}" for k, v in lrs.items()}
            self.bar.set_postfix(
                {"loss": f"{loss:.3f}", **lr_text, "tok/s": f"{tps:,.0f}"}, refresh=False
            )

    def finish(self) -> RunResult:
        """The result, with this process's time and tokens per second (since the resume point)."""
        result = self.result
        result.seconds = self.throughput.seconds()
        tokens = self.throughput.tokens_per_step * (result.steps_done - result.resumed_from)
        result.tokens_per_s = tokens / max(result.seconds, 1e-9)
        return result


def _watch(config: TrainConfig, result: RunResult) -> DivergenceWatch:
    """The divergence rule for this run; a resumed one starts from the first step's logged loss."""
    watch = DivergenceWatch.for_warmup(config.warmup)
    if result.train_losses and result.train_losses[0][0] == 1:
        watch.start = result.train_losses[0]
    watch.said = result.diverged
    return watch


def _build_scheduler(config: TrainConfig, optimizer: ChainedOptimizer) -> HyperLRScheduler:
    try:
        return get_hyper_lr_scheduler(
            optimizer, config.scheduler, total_steps=config.steps, warmup_steps=config.warmup
        )
    except (TypeError, ValueError) as exc:
        raise TrainError(f"--scheduler {config.scheduler}: {exc}") from None


def _batches(
    config: TrainConfig, data: TokenizedText, placement: Placement
) -> tuple[Iterator[torch.Tensor], list[torch.Tensor]]:
    """Training batches (each rank its own) and the fixed validation batches (every rank's)."""
    train_batches = batches(
        data.train, batch_size=config.batch_size, seq_len=config.seq_len,
        generator=torch.Generator().manual_seed(config.seed + 7919 * placement.rank),
    )  # fmt: skip
    val_iter = batches(
        data.val, batch_size=config.batch_size, seq_len=config.seq_len,
        generator=torch.Generator().manual_seed(config.seed + 1),
    )  # fmt: skip
    return train_batches, [next(val_iter).to(placement.device) for _ in range(config.eval_batches)]


def _checkpoints(config: TrainConfig, name: str) -> CheckpointManager | None:
    """With ``--checkpoint-dir``, a manager of the run's own folder (``muon+adamw``: ``muon_adamw``)."""
    if config.checkpoint_dir is None:
        return None
    from hyper_parallel.checkpoint import CheckpointManager

    return CheckpointManager(
        config.checkpoint_dir / run_folder(name),
        keep_last=2,
        async_save=config.checkpoint_async,
    )


def _resume(
    checkpoints: CheckpointManager,
    model: TinyGPT,
    optimizer: ChainedOptimizer,
    scheduler: HyperLRScheduler,
    train_batches: Iterator[torch.Tensor],
    report: bool,
) -> int:
    """Load the newest intact checkpoint, if any, and skip the batches it trained on; its step.

    When ``report``, says on stderr where it resumed, and which corrupt
    checkpoints it skipped on the way.
    """
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", UserWarning)
        done = checkpoints.load_latest(model=model, optimizer=optimizer, scheduler=scheduler) or 0
    for warning in skipped if report else []:
        print(f"hyper-parallel train: --resume: {warning.message}", file=sys.stderr)
    if done and report:
        where = checkpoints.path_for(done)
        print(f"hyper-parallel train: resuming from step {done} ({where})", file=sys.stderr)
    elif report:
        print(
            f"hyper-parallel train: --resume: no checkpoint in {checkpoints.root} yet; "
            "starting at step 0",
            file=sys.stderr,
        )
    for _ in range(done):  # the same batches as an uninterrupted run
        next(train_batches)
    return done


def run_one(
    config: TrainConfig,
    name: str,
    data: TokenizedText,
    metrics: Metrics,
    progress_factory: Callable[..., Any] | None,
    placement: Placement | None = None,
    preemption: Preemption | None = None,
) -> RunResult:
    """Train a fresh model with optimizer ``name``; every run sees the same init and batches.

    Sharded, each rank draws its own batches (the global batch is
    ``batch_size x world_size``) and only rank 0 writes metrics. The run
    stops early, with what it did so far in its result, on Ctrl-C
    (``interrupted``), on a signal ``preemption`` caught (``preempted``: after
    the step, saved there) or on a checkpoint that cannot be written
    (``save_error``; a failed background save is heard of at the next step).
    """
    from hyper_parallel.checkpoint import CheckpointError

    run = _Run.start(config, name, data, metrics, progress_factory, placement or Placement())
    first = run.result.steps_done + 1
    try:
        if first == 1:  # resumed: the run that saved validated there if its interval said so
            run.evaluate(0)
        for step in range(first, config.steps + 1):
            run.step(step)
            if run.checkpoints is not None:
                run.checkpoints.check()
            asked = preemption is not None and preemption.requested(run.placement.device)
            if asked and step < config.steps:  # at the last step the run has simply finished
                run.save(step)
                run.result.preempted = True
                break
    except KeyboardInterrupt:
        run.result.interrupted = True
    except CheckpointError as exc:
        run.result.save_error = str(exc)
    except NonFiniteRun as exc:
        run.result.non_finite = str(exc)
        run.metrics.write({"run": name, "step": run.result.steps_done, "stopped": str(exc)})
    finally:
        if run.bar is not None:
            run.bar.close()
        if run.checkpoints is not None:
            try:
                run.checkpoints.wait()  # a background save in flight is committed before we go on
            except CheckpointError as exc:
                run.result.save_error = run.result.save_error or str(exc)
            finally:
                run.checkpoints.close()  # the folder's lock, for the next run of this process
    return run.finish()
