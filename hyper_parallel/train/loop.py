"""The training run behind ``hyper-parallel train``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from hyper_parallel.core.optimizer import (
    ChainedOptimizer,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    step_if_finite,
)
from hyper_parallel.core.plugin import PluginKind, get_registry
from hyper_parallel.train.config import MUON_ADAMW, TrainConfig, TrainError
from hyper_parallel.train.data import TokenizedText, batches, load_text_file, synthetic_corpus
from hyper_parallel.train.model import GPTConfig, TinyGPT

__all__ = ["MUON_ADAMW", "RunResult", "TrainConfig", "TrainError", "steps_to_reach", "train"]

#: A run stops when this many steps in a row have non-finite gradients.
_MAX_SKIPS_IN_A_ROW = 10


@dataclass
class RunResult:
    """What one optimizer's run produced."""

    name: str
    steps_done: int
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    interrupted: bool = False
    skipped: list[int] = field(default_factory=list)  # steps skipped for non-finite gradients

    @property
    def final_val_loss(self) -> float | None:
        return self.val_losses[-1][1] if self.val_losses else None


def load_data(config: TrainConfig) -> TokenizedText:
    """The built-in corpus, or ``--data``'s file."""
    if config.data is None:
        return synthetic_corpus(seed=config.seed)
    return load_text_file(config.data, tokenizer=config.tokenizer)


def build_optimizer(config: TrainConfig, name: str, model: torch.nn.Module) -> ChainedOptimizer:
    """``muon+adamw`` through a partitioner, or one named optimizer on every param.

    A single optimizer gets two groups: params with two or more dims, with
    weight decay, and the rest (norms, biases) without.
    """
    if name == MUON_ADAMW:
        return get_hyper_optimizer(
            model,
            partitioner=config.partitioner,
            muon_kwargs={"lr": config.muon_lr, "weight_decay": config.weight_decay},
            adamw_kwargs={"lr": config.lr, "weight_decay": config.weight_decay},
        )
    entry = get_registry().get(PluginKind.OPTIMIZER, name)
    lr = config.muon_lr if entry.name == "muon" else config.lr
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": matrices, "weight_decay": config.weight_decay}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0})
    try:
        return get_hyper_optimizer(model, optimizers={entry.name: {"params": groups, "lr": lr}})
    except (TypeError, ValueError) as exc:
        raise TrainError(f"--optimizer {name}: {exc}") from None


def steps_to_reach(val_losses: list[tuple[int, float]], target: float) -> float | None:
    """First (linearly interpolated) step at which a validation curve reaches ``target``."""
    previous: tuple[int, float] | None = None
    for step, loss in val_losses:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


class _Metrics:
    """Appends one JSON object per line and flushes, so an interrupted run keeps its log.

    With no path (ranks other than 0 of a sharded run) it writes nothing.
    """

    def __init__(self, path: Path | None, *, append: bool = False) -> None:
        self._file: TextIO | None = None
        if path is not None:
            self._file = (
                path.open("a", encoding="utf-8") if append else path.open("w", encoding="utf-8")
            )

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _evaluate(model: TinyGPT, val_batches: list[torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(float(model.loss(b)) for b in val_batches) / len(val_batches)
    model.train()
    return loss


def _lrs(optimizer: ChainedOptimizer) -> dict[str, float]:
    return {name: float(opt.param_groups[0]["lr"]) for name, opt in optimizer.optimizers.items()}


@dataclass(frozen=True)
class _Placement:
    """Where this process trains: one process, or one rank of a sharded run."""

    mesh: Any = None  # a DeviceMesh when sharded
    backend: Any = None  # the ShardingBackend that shards the model
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: float) -> float:
        """The average of ``value`` over ranks (a no-op on one process)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size


def _placement(config: TrainConfig) -> _Placement:
    """Set up the mesh for ``--sharding`` (the process group comes from torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config.sharding is None or config.sharding == "local":
        if world > 1:
            raise TrainError(
                f"{world} processes were launched but --sharding is "
                f"{config.sharding or 'not set'}: pass --sharding fsdp or hsdp, or run one process"
            )
        return _Placement()
    import torch.distributed as dist

    from hyper_parallel.core.distributed import init_device_mesh

    backend = get_registry().get(PluginKind.SHARDING_BACKEND, config.sharding).obj()
    if backend.name not in ("fsdp", "hsdp"):
        raise TrainError(
            f"--sharding {config.sharding}: train shards its model with fsdp or hsdp; "
            f"{backend.name!r} is not supported here"
        )
    if backend.name == "hsdp":
        shard = 2 if world % 2 == 0 and world >= 4 else world
        shape: tuple[int, ...] = (world // shard, shard)
        names: tuple[str, ...] = ("replicate", "shard")
    else:
        shape, names = (world,), ("shard",)
    try:
        mesh = init_device_mesh("auto", shape, mesh_dim_names=names)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise TrainError(f"--sharding {config.sharding}: {exc}") from None
    device = (
        torch.device(mesh.device_type, torch.accelerator.current_device_index())
        if mesh.device_type != "cpu"
        else torch.device("cpu")
    )
    return _Placement(
        mesh=mesh, backend=backend, rank=dist.get_rank(), world_size=world, device=device
    )


def run_one(
    config: TrainConfig,
    name: str,
    data: TokenizedText,
    metrics: _Metrics,
    progress_factory: Callable[..., Any] | None,
    placement: _Placement | None = None,
) -> RunResult:
    """Train a fresh model with optimizer ``name``; every run sees the same init and batches.

    Sharded, each rank draws its own batches (the global batch is
    ``batch_size x world_size``) and only rank 0 writes metrics.
    """
    placement = placement or _Placement()
    torch.manual_seed(config.seed)
    model = TinyGPT(
        GPTConfig(
            vocab_size=data.vocab_size,
            seq_len=config.seq_len,
            dim=config.dim,
            layers=config.layers,
            heads=config.heads,
            mlp_hidden=_mlp_hidden(config.dim),
            tied_embeddings=config.tied_embeddings,
        )
    )
    if placement.backend is not None:
        placement.backend.shard_model(model, mesh=placement.mesh)
    optimizer = build_optimizer(config, name, model)
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, config.steps // 20)
    try:
        scheduler = get_hyper_lr_scheduler(
            optimizer, config.scheduler, total_steps=config.steps, warmup_steps=warmup
        )
    except (TypeError, ValueError) as exc:
        raise TrainError(f"--scheduler {config.scheduler}: {exc}") from None
    train_iter = batches(
        data.train, batch_size=config.batch_size, seq_len=config.seq_len,
        generator=torch.Generator().manual_seed(config.seed + 7919 * placement.rank),
    )  # fmt: skip
    val_iter = batches(
        data.val, batch_size=config.batch_size, seq_len=config.seq_len,
        generator=torch.Generator().manual_seed(config.seed + 1),
    )  # fmt: skip
    val_batches = [next(val_iter).to(placement.device) for _ in range(config.eval_batches)]
    manager = None
    first = 1
    if config.checkpoint_dir is not None:
        from hyper_parallel.checkpoint import CheckpointManager

        manager = CheckpointManager(config.checkpoint_dir / name.replace("+", "_"), keep_last=2)
        if config.resume:
            resumed = manager.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
            if resumed is not None:
                for _ in range(resumed):  # the same batches as an uninterrupted run
                    next(train_iter)
                first = resumed + 1
    result = RunResult(name=name, steps_done=first - 1)
    tokens_per_step = config.batch_size * config.seq_len * placement.world_size
    bar = progress_factory(total=config.steps, desc=name) if progress_factory else None
    start = time.perf_counter()
    window_start, window_steps = start, 0
    try:
        result.val_losses.append((first - 1, _evaluate(model, val_batches)))
        metrics.write({"run": name, "step": first - 1, "val_loss": result.val_losses[-1][1]})
        skipped_in_a_row = 0
        for step in range(first, config.steps + 1):
            lrs = _lrs(optimizer)
            loss = model.loss(next(train_iter).to(placement.device))
            loss.backward()
            stepped = step_if_finite(optimizer)
            optimizer.zero_grad(set_to_none=True)
            value = placement.mean(float(loss.detach()))
            if not stepped:
                # params, optimizer state and schedule stay as they were: as if without this batch
                skipped_in_a_row += 1
                result.skipped.append(step)
                metrics.write({"run": name, "step": step, "skipped": "non-finite gradient"})
                if skipped_in_a_row >= _MAX_SKIPS_IN_A_ROW:
                    raise TrainError(
                        f"{name}: {skipped_in_a_row} steps in a row had non-finite gradients "
                        f"(loss {value}) up to step {step}; lower the learning rate"
                    )
                if bar is not None:
                    bar.update(1)
                continue
            skipped_in_a_row = 0
            scheduler.step()
            result.train_losses.append((step, value))
            result.steps_done = step
            window_steps += 1
            if step % config.log_every == 0 or step == config.steps:
                now = time.perf_counter()
                tps = tokens_per_step * window_steps / max(now - window_start, 1e-9)
                window_start, window_steps = now, 0
                metrics.write(
                    {
                        "run": name,
                        "step": step,
                        "train_loss": value,
                        "lr": lrs,
                        "tokens_per_s": round(tps),
                    }
                )
                if bar is not None:
                    bar.set_postfix(
                        {
                            "loss": f"{value:.3f}",
                            **{f"lr_{k}": f"{v:.2e}" for k, v in lrs.items()},
                            "tok/s": f"{tps:,.0f}",
                        },
                        refresh=False,
                    )
            if step % config.eval_every == 0 or step == config.steps:
                result.val_losses.append((step, _evaluate(model, val_batches)))
                metrics.write({"run": name, "step": step, "val_loss": result.val_losses[-1][1]})
            if manager is not None and (
                step == config.steps
                or (config.checkpoint_every and step % config.checkpoint_every == 0)
            ):
                manager.save(step, model=model, optimizer=optimizer, scheduler=scheduler)
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        if bar is not None:
            bar.close()
    result.seconds = time.perf_counter() - start
    result.tokens_per_s = tokens_per_step * result.steps_done / max(result.seconds, 1e-9)
    return result


def _mlp_hidden(dim: int) -> int:
    """SwiGLU width: 8/3 of dim, rounded up to a multiple of 32."""
    return -(-8 * dim // 3 // 32) * 32


def _summary(config: TrainConfig, data: TokenizedText, results: list[RunResult]) -> dict[str, Any]:
    runs = {
        r.name: {
            "steps": r.steps_done,
            "final_train_loss": r.train_losses[-1][1] if r.train_losses else None,
            "final_val_loss": r.final_val_loss,
            "best_val_loss": min((v for _, v in r.val_losses), default=None),
            "seconds": round(r.seconds, 2),
            "tokens_per_s": round(r.tokens_per_s),
            "interrupted": r.interrupted,
            "skipped_steps": r.skipped,
        }
        for r in results
    }
    summary: dict[str, Any] = {
        "data": data.source,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "runs": runs,
    }
    if len(results) == 2 and not any(r.interrupted for r in results):
        ours, baseline = results
        target = baseline.final_val_loss
        if target is not None:
            reached = steps_to_reach(ours.val_losses, target)
            summary["comparison"] = {
                "target_val_loss": target,
                "baseline": baseline.name,
                "baseline_steps": baseline.steps_done,
                "steps_to_reach": reached,
                "step_ratio": None if reached is None else reached / baseline.steps_done,
            }
    return summary


def _print_summary(summary: dict[str, Any], out: Path, echo: Callable[[str], None]) -> None:
    echo(f"data: {summary['data']}")
    for name, run in summary["runs"].items():
        flag = "  (interrupted)" if run["interrupted"] else ""
        val = run["final_val_loss"]
        echo(
            f"{name:>14}: {run['steps']} steps in {run['seconds']:.0f} s, {run['tokens_per_s']:,} tok/s, "
            f"train loss {run['final_train_loss']:.4f}, val loss {val:.4f}{flag}"
            if run["final_train_loss"] is not None and val is not None
            else f"{name:>14}: {run['steps']} steps{flag}"
        )
    cmp = summary.get("comparison")
    if cmp:
        if cmp["steps_to_reach"] is None:
            echo(
                f"{next(iter(summary['runs']))} did not reach {cmp['baseline']}'s final val loss {cmp['target_val_loss']:.4f}"
            )
        else:
            echo(
                f"{next(iter(summary['runs']))} reached {cmp['baseline']}'s final val loss "
                f"{cmp['target_val_loss']:.4f} at step {cmp['steps_to_reach']:.0f} of {cmp['baseline_steps']} "
                f"(step ratio {cmp['step_ratio']:.2f})"
            )
    echo(f"wrote {out / 'metrics.jsonl'}, {out / 'loss_curves.png'}, {out / 'summary.json'}")


def train(config: TrainConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``config`` (and its ``--compare`` run); write metrics, plot and summary to ``config.out``.

    Returns:
        The summary (also written to ``summary.json``).

    Raises:
        TrainError, DataError: an unusable option or input.
        KeyboardInterrupt: never; Ctrl-C ends the current run early, and what
            was written so far is kept (``summary["runs"][...]["interrupted"]``).
    """
    config.validate()
    data = load_data(config)
    group_before = _process_group_initialized()
    try:
        return _train_placed(config, data, _placement(config), echo)
    finally:
        # A process group this call brought up is torn down here, not left to the
        # interpreter's exit, where gloo's threads can abort a run that has finished.
        if not group_before and _process_group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _train_placed(
    config: TrainConfig, data: TokenizedText, placement: _Placement, echo: Callable[[str], None]
) -> dict[str, Any]:
    """:func:`train` once the data is loaded and this process's place is set up."""
    from hyper_parallel.train.plot import plot_losses

    main = placement.is_main
    if main:
        config.out.mkdir(parents=True, exist_ok=True)
    progress = _progress_factory() if config.progress and main else None
    metrics = _Metrics(config.out / "metrics.jsonl" if main else None, append=config.resume)
    results: list[RunResult] = []
    try:
        for name in [config.optimizer, *([config.compare] if config.compare else [])]:
            results.append(run_one(config, name, data, metrics, progress, placement))
            if results[-1].interrupted:
                break
    finally:
        metrics.close()
    summary = _summary(config, data, results)
    if main:
        plot_losses(results, config.out / "loss_curves.png", title=f"{data.source}")
        summary_path = config.out / "summary.json"
        summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        _print_summary(summary, config.out, echo)
    return summary


def _progress_factory() -> Callable[..., Any]:
    from tqdm.auto import tqdm

    def factory(*, total: int, desc: str) -> Any:
        return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True, mininterval=0.5)

    return factory
