"""Training quality on real text: Muon + AdamW against an lr-tuned AdamW, by loss and by budget.

Run from the repository root::

    python -m benchmarks --cases quality            # 240 steps (minutes on 2 cores)
    python -m benchmarks --cases quality --quick    # 120 steps, fewer budgets, smaller eval
    python -m benchmarks --cases quality --seeds 3  # each run on 3 seeds: means and spread
    python -m benchmarks --cases quality --init torch  # PyTorch's default init instead
    python -m benchmarks --cases quality --muon-lrs 1e-3,6e-3  # Muon's lr swept too

The built-in decoder shaped like a small Llama
(:class:`~hyper_parallel.train.model.TinyGPT`: d=128, 4 blocks, 4 heads,
RMSNorm, SwiGLU, rotary positions; GPT-2's init, N(0, 0.02) with smaller
residual projections) trains
on :func:`~hyper_parallel.train.corpus.python_stdlib_corpus` (the running
Python's standard library, split by file, a 2,048-token byte-level BPE),
sequence 256, batch 8, the gradient's norm clipped to 1, with a cosine
schedule and 5% warmup from :func:`~hyper_parallel.get_hyper_lr_scheduler`.
Every run of a seed starts from the same init and sees the same batches.
``--init torch`` leaves PyTorch's module defaults instead (:data:`INITS`),
a control: at this width they are larger, and AdamW takes a larger lr.
The configurations:

- AdamW over an lr sweep (:attr:`QualitySize.adamw_lrs`); the one with the
  lowest final validation loss is "the lr-tuned AdamW", its lr "the tuned lr";
- Muon + AdamW at HyperParallel's defaults:
  ``get_hyper_optimizer(model, muon={}, adamw={})``;
- Muon at its default lr with the AdamW half at the tuned lr:
  ``muon={}, adamw={"lr": best}``;
- both halves at the tuned lr: ``muon={"lr": best}, adamw={"lr": best}``.
  Muon's step RMS is matched to AdamW's (``0.2 * lr``), so AdamW's tuned lr
  is Muon's first guess too; this is the configuration :data:`TARGET` is
  asked of;
- ``torch.optim.Muon`` at its defaults on the same matrices, AdamW at 1e-3
  on the rest;
- Muon at the tuned lr with the AdamW half at each lr of the sweep above it
  (:func:`adamw_half_sweep`): whether the AdamW half takes more than AdamW
  alone does;
- with ``--muon-lrs``, Muon at each of those lrs with the AdamW half at the
  tuned lr (:func:`muon_lr_sweep`).

Rows: each configuration's final validation loss and tokens/s against the
lr-tuned AdamW's; then, for the Muon configurations of
:attr:`QualitySize.budgeted`, separate runs each with its own full cosine
over a fraction of the steps (:attr:`QualitySize.budgets`, largest first,
stopping at the first that does not reach the lr-tuned AdamW's final
validation loss), and the smallest fraction that reached it ("never" if the
largest did not). By default those are both halves at the tuned lr, the
lowest Muon + AdamW run and HyperParallel's defaults. The loss curves of the
full runs go to a PNG (``--loss-plot``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import ROOT, Row, Settings, case_command
from hyper_parallel import (
    AdamW,
    Muon,
    clip_grad_norm_,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
)
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import ChainedOptimizer
from hyper_parallel.train.corpus import python_stdlib_corpus
from hyper_parallel.train.data import TokenizedText, batches
from hyper_parallel.train.model import GPTConfig, TinyGPT
from hyper_parallel.train.plot import smooth_by_step
from hyper_parallel.train.run import RunResult, evaluate

__all__ = [
    "DEFAULT",
    "INITS",
    "QUICK",
    "TORCH_INIT",
    "Configuration",
    "QualitySize",
    "case_quality",
    "quality_rows",
]

#: Keys of the Muon configurations (:attr:`Configuration.key`).
MUON_DEFAULTS = "muon_defaults"
#: Muon at its default lr, the AdamW half at the tuned AdamW lr.
MUON_DEFAULT_LR_KEY = "muon_default_lr"
#: Both halves at the tuned AdamW lr: the configuration :data:`TARGET` is asked of.
MUON_BOTH_TUNED = "muon_both_tuned"
TORCH_MUON = "torch_muon"
#: In :attr:`QualitySize.budgeted`: whichever Muon + AdamW run (any lrs) ended lowest.
MUON_LOWEST = "muon_lowest"
#: What :attr:`QualitySize.budgeted` may name.
BUDGETABLE = (MUON_BOTH_TUNED, MUON_LOWEST, MUON_DEFAULT_LR_KEY, MUON_DEFAULTS, TORCH_MUON)

#: The lr of the AdamW half next to torch.optim.Muon (HyperParallel's AdamW default).
TORCH_MUON_ADAMW_LR = 1e-3

#: The steps-to-target fraction the case aims at with both halves at the tuned AdamW lr.
TARGET = "<= 0.8"

#: Where the loss curves go without ``--loss-plot`` (``runs/`` is ignored by git).
DEFAULT_LOSS_PLOT = ROOT / "runs" / "benchmarks" / "quality_losses.png"


@dataclass(frozen=True)
class QualitySize:
    """What the case trains: the model, the data's shape, the sweep, the budgets, the seeds."""

    steps: int = 240
    batch_size: int = 8
    seq_len: int = 256
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_hidden: int = 352  # SwiGLU width: 8/3 of dim, rounded up to a multiple of 32
    vocab_size: int = 2048
    positions: str = "rotary"  # a Positions name
    init_std: float | None = 0.02  # None: PyTorch's default init (--init torch)
    max_grad_norm: float | None = 1.0  # None: not clipped
    warmup_fraction: float = 0.05
    eval_every: int = 40  # in the full runs; a budget run validates at its end only
    eval_batches: int = 16
    adamw_lrs: tuple[float, ...] = (1e-3, 2e-3, 3e-3, 5e-3)
    muon_lrs: tuple[float, ...] = ()  # --muon-lrs: Muon's lr swept, the AdamW half at the tuned lr
    budgets: tuple[float, ...] = (0.4, 0.6, 0.8, 1.0)
    budgeted: tuple[str, ...] = (MUON_BOTH_TUNED, MUON_LOWEST, MUON_DEFAULTS)
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        unknown = set(self.budgeted) - set(BUDGETABLE)
        if unknown:
            raise HyperParallelValueError(
                f"QualitySize.budgeted: unknown configuration(s) {sorted(unknown)}; choose from "
                f"{', '.join(map(repr, BUDGETABLE))}"
            )
        if not self.seeds or not self.adamw_lrs or not self.budgets:
            raise HyperParallelValueError(
                "QualitySize: seeds, adamw_lrs and budgets each need at least one value"
            )
        lrs = (*self.adamw_lrs, *self.muon_lrs)
        if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
            raise HyperParallelValueError(
                f"QualitySize: every lr must be a positive number, got adamw_lrs={self.adamw_lrs}, "
                f"muon_lrs={self.muon_lrs}"
            )
        if max(self.budgets) != 1.0 or not all(0 < f <= 1 for f in self.budgets):
            raise HyperParallelValueError(
                f"QualitySize.budgets {self.budgets}: give fractions of the steps in (0, 1], "
                "1.0 among them (the full run, which the budgets count down from)"
            )

    def model(self, vocab_size: int) -> GPTConfig:
        """The decoder's shape at this size, for a corpus of ``vocab_size`` tokens."""
        return GPTConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            dim=self.dim,
            layers=self.layers,
            heads=self.heads,
            mlp_hidden=self.mlp_hidden,
            positions=self.positions,
            init_std=self.init_std,
        )

    def budget_steps(self, fraction: float) -> int:
        """The steps of a run given ``fraction`` of :attr:`steps` (at least 1)."""
        return max(1, round(fraction * self.steps))


#: The default size: 240 steps, four AdamW lrs, budgets 0.4 to 1.0 for three Muon configurations
#: (about 15 minutes on 2 AVX2-only cores, 3.5 of them torch.optim.Muon's bf16 Newton-Schulz).
DEFAULT = QualitySize()
#: ``--quick``: 120 steps, budgets 0.6, 0.8 and 1.0 (for both halves at the tuned AdamW lr and
#: the lowest Muon + AdamW), a smaller eval.
QUICK = QualitySize(steps=120, eval_every=20, eval_batches=4, budgets=(0.6, 0.8, 1.0),
                    budgeted=(MUON_BOTH_TUNED, MUON_LOWEST))  # fmt: skip

#: ``--init``'s choices: each a change to the size. ``gpt2`` (the default): GPT-2's N(0, 0.02),
#: the residual projections smaller; ``torch``: PyTorch's module defaults (embeddings N(0, 1),
#: matrices uniform within 1/sqrt(fan_in)).
INITS: dict[str, dict[str, float | None]] = {
    "gpt2": {"init_std": 0.02},
    "torch": {"init_std": None},
}
TORCH_INIT = "torch"


@dataclass(frozen=True)
class Configuration:
    """One optimizer configuration: its key, how rows name it, and how it is built for a model.

    ``same_as``: what it builds, resolved (``("muon", 0.02, 0.001)``: Muon at
    lr 2e-2, the AdamW half at 1e-3); two configurations that build the same
    optimizer share their runs. Empty: its own.
    """

    key: str
    label: str
    build: Callable[[TinyGPT], torch.optim.Optimizer]
    same_as: tuple[object, ...] = ()


def _lr_text(lr: float) -> str:
    """``3e-3`` for 0.003, ``1.5e-3`` for 0.0015 (three significant digits at most)."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def adamw(lr: float) -> Configuration:
    """AdamW on every param at ``lr``: ``get_hyper_optimizer(model, adamw={"lr": lr})``."""
    return Configuration(
        f"adamw_{lr:g}",
        f"AdamW lr {_lr_text(lr)}",
        lambda model: get_hyper_optimizer(model, adamw={"lr": lr}),
    )


#: HyperParallel's AdamW lr where none is given (the AdamW half of its defaults).
ADAMW_DEFAULT_LR: float = inspect.signature(AdamW).parameters["lr"].default
#: HyperParallel's Muon lr where none is given, as a Muon built without one resolves it.
MUON_DEFAULT_LR: float = Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults["lr"]


#: How labels name a half at the tuned AdamW lr.
TUNED_HALF = "the AdamW half at the tuned AdamW lr"
TUNED_MUON = "Muon at the tuned AdamW lr"


def _kwargs_text(lr: float | None) -> str:
    """``{}`` for ``None``, ``{'lr': 2e-3}`` for 0.002: how a row names what it passes."""
    return "{}" if lr is None else f"{{'lr': {_lr_text(lr)}}}"


def muon_adamw(key: str, what: str, muon_lr: float | None, adamw_lr: float | None) -> Configuration:
    """Muon + AdamW: ``get_hyper_optimizer(model, muon={"lr": muon_lr}, adamw={"lr": adamw_lr})``.

    ``None`` leaves that half's lr at its default. The label says ``what`` and
    the call; :attr:`Configuration.same_as` holds the two resolved lrs.
    """
    muon = {} if muon_lr is None else {"lr": muon_lr}
    adamw = {} if adamw_lr is None else {"lr": adamw_lr}
    return Configuration(
        key,
        f"Muon + AdamW, {what} (muon={_kwargs_text(muon_lr)}, adamw={_kwargs_text(adamw_lr)})",
        lambda model: get_hyper_optimizer(model, muon=muon, adamw=adamw),
        same_as=(
            "muon",
            MUON_DEFAULT_LR if muon_lr is None else muon_lr,
            ADAMW_DEFAULT_LR if adamw_lr is None else adamw_lr,
        ),
    )


def muon_configurations(best_adamw_lr: float) -> list[Configuration]:
    """HyperParallel's defaults; Muon at its default with the AdamW half at ``best_adamw_lr``;
    both halves at ``best_adamw_lr``; torch.optim.Muon.

    Configurations that build the same optimizer (:attr:`Configuration.same_as`)
    share their runs.
    """
    best = best_adamw_lr
    return [
        muon_adamw(MUON_DEFAULTS, "HyperParallel's defaults", None, None),
        muon_adamw(MUON_DEFAULT_LR_KEY, f"Muon at its default lr, {TUNED_HALF}", None, best),
        muon_adamw(MUON_BOTH_TUNED, "both at the tuned AdamW lr", best, best),
        Configuration(
            TORCH_MUON,
            f"torch.optim.Muon defaults + AdamW lr {_lr_text(TORCH_MUON_ADAMW_LR)}",
            _torch_muon,
        ),
    ]


def adamw_half_sweep(lrs: Sequence[float], best_adamw_lr: float) -> list[Configuration]:
    """Muon at ``best_adamw_lr`` with the AdamW half at each lr of ``lrs`` above it: whether the
    AdamW half takes more than AdamW alone does."""
    return [
        muon_adamw(
            f"muon_adamw_{lr:g}",
            f"{TUNED_MUON}, the AdamW half at {_lr_text(lr)}",
            best_adamw_lr,
            lr,
        )
        for lr in lrs
        if lr > best_adamw_lr
    ]


def muon_lr_sweep(lrs: Sequence[float], best_adamw_lr: float) -> list[Configuration]:
    """Muon at each lr of ``lrs`` with the AdamW half at ``best_adamw_lr`` (``--muon-lrs``):
    whether Muon wants the lr AdamW does. :func:`muon_configurations` already trains Muon at
    ``best_adamw_lr`` and at its default."""
    return [
        muon_adamw(f"muon_{lr:g}_adamw", f"Muon at {_lr_text(lr)}, {TUNED_HALF}", lr, best_adamw_lr)
        for lr in lrs
        if lr not in (best_adamw_lr, MUON_DEFAULT_LR)  # muon_configurations trains those
    ]


def _torch_muon(model: TinyGPT) -> torch.optim.Optimizer:
    """torch.optim.Muon at its defaults on the matrices HyperParallel's Muon would take.

    The rest (embeddings, head, norms) go to AdamW at :data:`TORCH_MUON_ADAMW_LR`.
    """
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ImportError(f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9 has)")
    routed = get_hyper_optimizer(model, muon={}, adamw={"lr": TORCH_MUON_ADAMW_LR})
    matrices = [p for group in routed.optimizers["muon"].param_groups for p in group["params"]]
    return ChainedOptimizer(
        {"adamw": routed.optimizers["adamw"], "muon": muon(matrices)},
        param_names=model.named_parameters(),
    )


# ---------------------------------------------------------------- training


def train(
    configuration: Configuration,
    data: TokenizedText,
    size: QualitySize,
    seed: int,
    steps: int,
    *,
    curve: bool = True,
) -> RunResult:
    """Train a fresh model ``steps`` steps, a full cosine of its own, and validate it.

    ``curve``: validate every :attr:`QualitySize.eval_every` steps on the way
    (for the plot) as well as at the end; otherwise at the end only.
    The init and the batches depend on ``seed`` only: every configuration of a
    seed starts alike and sees the same batches (the first ``steps`` of them).
    A non-finite loss stops the run; its final validation loss is then ``inf``.
    """
    torch.manual_seed(seed)
    model = TinyGPT(size.model(data.vocab_size))
    optimizer = configuration.build(model)
    warmup = max(1, round(size.warmup_fraction * steps))
    scheduler = get_hyper_lr_scheduler(optimizer, "cosine", total_steps=steps, warmup_steps=warmup)
    shape = {"batch_size": size.batch_size, "seq_len": size.seq_len}
    train_batches = batches(data.train, **shape, generator=torch.Generator().manual_seed(seed))
    val_iter = batches(data.val, **shape, generator=torch.Generator().manual_seed(seed + 1))
    val_batches = [next(val_iter) for _ in range(size.eval_batches)]
    result = RunResult(name=configuration.label, steps_done=0)
    timed = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        loss = model.loss(next(train_batches))
        loss.backward()
        if size.max_grad_norm is not None:
            clip_grad_norm_(model.parameters(), size.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        timed += time.perf_counter() - start if step > 1 else 0.0  # the first step warms up
        value = float(loss.detach())
        result.train_losses.append((step, value))
        result.steps_done = step
        if not math.isfinite(value):
            result.val_losses.append((step, math.inf))
            break
        if step == steps or (curve and step % size.eval_every == 0):
            result.val_losses.append((step, evaluate(model, val_batches)))
    result.logged_train_losses = list(result.train_losses)
    result.seconds = timed
    tokens = (result.steps_done - 1) * size.batch_size * size.seq_len
    result.tokens_per_s = tokens / timed if timed > 0 else 0.0
    return result


@dataclass
class Runs:
    """One configuration's runs at one number of steps, one per seed."""

    configuration: Configuration
    steps: int
    results: list[RunResult]

    @property
    def losses(self) -> list[float]:
        """Each seed's final validation loss; ``inf`` where there is none or it is not finite."""
        finals = (r.final_val_loss for r in self.results)
        return [loss if loss is not None and math.isfinite(loss) else math.inf for loss in finals]

    @property
    def loss(self) -> float:
        """The final validation loss, the mean over the seeds."""
        return statistics.fmean(self.losses)

    @property
    def tokens_per_s(self) -> float:
        return statistics.fmean(r.tokens_per_s for r in self.results)

    def against(self, best: Runs) -> str:
        """The note of a loss row: ``"4.294 vs 4.713"``, and the seeds' spread when several."""
        return f"{self.loss:.3f} vs {best.loss:.3f}{self.spread()}"

    def spread(self) -> str:
        """``"; 3 seeds: 4.701-4.733"`` with several seeds, else ``""``."""
        if len(self.losses) < 2:
            return ""
        return f"; {len(self.losses)} seeds: {min(self.losses):.3f}-{max(self.losses):.3f}"


def _run(configuration: Configuration, data: TokenizedText, size: QualitySize, steps: int) -> Runs:
    """``configuration`` trained ``steps`` steps on each seed, each run said on stderr.

    Only runs of all :attr:`QualitySize.steps` validate on the way: the budget
    runs are judged by their final loss alone."""
    results = []
    for seed in size.seeds:
        result = train(configuration, data, size, seed, steps, curve=steps == size.steps)
        print(f"quality: {configuration.label}, seed {seed}, {steps} steps: final validation "
              f"loss {result.final_val_loss:.3f} ({result.seconds:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        results.append(result)
    return Runs(configuration, steps, results)


class _Trainer:
    """Each configuration's runs at a number of steps, trained once: configurations that build
    the same optimizer (:attr:`Configuration.same_as`) share them."""

    def __init__(self, data: TokenizedText, size: QualitySize) -> None:
        self.data, self.size = data, size
        self._done: dict[tuple[tuple[object, ...], int], Runs] = {}

    def __call__(self, configuration: Configuration, steps: int) -> Runs:
        key = (configuration.same_as or (configuration.key,), steps)
        held = self._done.get(key)
        if held is None:
            held = self._done[key] = _run(configuration, self.data, self.size, steps)
        elif held.configuration != configuration:
            print(f"quality: {configuration.label}, {steps} steps: the same optimizer as "
                  f"{held.configuration.label}; its runs reused", file=sys.stderr, flush=True)  # fmt: skip
        return dataclasses.replace(held, configuration=configuration)


# ---------------------------------------------------------------- rows


def case_quality(settings: Settings) -> Iterator[Row]:
    """The quality case at :data:`DEFAULT` (``--quick``: :data:`QUICK`), ``--seeds`` seeds,
    ``--init``'s init (:data:`INITS`), ``--muon-lrs``' Muon lrs."""
    size = QUICK if settings.quick_flag else DEFAULT
    seeds = int(settings.extra.get("seeds", "1"))
    init = INITS[settings.extra.get("init", "gpt2")]
    muon_lrs = parse_lrs(settings.extra["muon_lrs"]) if "muon_lrs" in settings.extra else ()
    size = dataclasses.replace(size, seeds=tuple(range(seeds)), muon_lrs=muon_lrs, **init)
    yield from quality_rows(size, settings)


def parse_lrs(text: str) -> tuple[float, ...]:
    """``--muon-lrs``' text: ``"1e-3,6e-3"`` as ``(0.001, 0.006)``, each lr once, in order.

    Anything that is not a list of one or more positive numbers raises,
    naming the text."""
    fix = "give comma-separated positive numbers, for example 1e-3,6e-3"
    parts = [part for part in text.split(",") if part.strip()]
    try:
        lrs = tuple(dict.fromkeys(float(part) for part in parts))
    except ValueError:
        raise HyperParallelValueError(f"--muon-lrs {text!r}: {fix}") from None
    if not lrs or not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise HyperParallelValueError(f"--muon-lrs {text!r}: {fix}")
    return lrs


def quality_rows(size: QualitySize, settings: Settings) -> Iterator[Row]:
    """Train every configuration at ``size`` and yield the rows the module docstring lists."""
    data = python_stdlib_corpus(vocab_size=size.vocab_size)
    print(f"quality: training on {data.source}", file=sys.stderr, flush=True)
    extra = [f"--seeds {len(size.seeds)}"] if len(size.seeds) > 1 else []
    if size.init_std is None:
        extra.append(f"--init {TORCH_INIT}")
    if size.muon_lrs:
        extra.append(f"--muon-lrs {','.join(map(_lr_text, size.muon_lrs))}")
    command = case_command("quality", settings, *extra)
    trained = _Trainer(data, size)
    sweep = [trained(adamw(lr), size.steps) for lr in size.adamw_lrs]
    best = min(sweep, key=lambda runs: runs.loss)
    best_lr = size.adamw_lrs[sweep.index(best)]
    configurations = [
        *muon_configurations(best_lr),
        *adamw_half_sweep(size.adamw_lrs, best_lr),
        *muon_lr_sweep(size.muon_lrs, best_lr),
    ]
    full = [*sweep, *(trained(c, size.steps) for c in configurations)]
    where = f"{size.steps} steps of {size.batch_size} x {size.seq_len} tokens, python-stdlib"
    if size.init_std is None:
        where += ", PyTorch's default init"
    reference = f"{best.configuration.label} (the sweep's best)"
    for runs in full:
        yield Row(f"Training quality: final validation loss, {where}", runs.configuration.label,
                  runs.loss, reference, best.loss, "nats", note=runs.against(best),
                  command=command)  # fmt: skip
    for runs in full:
        yield Row(f"Training quality: training throughput, {where}", runs.configuration.label,
                  runs.tokens_per_s, reference, best.tokens_per_s, "tokens/s",
                  command=command)  # fmt: skip
    _plot_and_say(full, Path(settings.extra.get("loss_plot", DEFAULT_LOSS_PLOT)))
    for runs in _budgeted(full, size.budgeted):
        yield from _budget_rows(runs, best, trained, command)


def _budgeted(full: Sequence[Runs], keys: Sequence[str]) -> list[Runs]:
    """The full runs :attr:`QualitySize.budgeted` names, in its order, each optimizer once.

    :data:`MUON_LOWEST` is the Muon + AdamW run (any lrs) with the lowest
    final loss; where that optimizer is already named, it is not
    budgeted again.
    """
    by_key = {runs.configuration.key: runs for runs in full}
    muon_adamw_runs = [runs for runs in full if runs.configuration.same_as[:1] == ("muon",)]
    chosen: dict[tuple[object, ...], Runs] = {}
    for key in keys:
        runs = min(muon_adamw_runs, key=lambda r: r.loss) if key == MUON_LOWEST else by_key[key]
        chosen.setdefault(runs.configuration.same_as or (runs.configuration.key,), runs)
    return list(chosen.values())


def _budget_rows(full: Runs, best: Runs, trained: _Trainer, command: str) -> Iterator[Row]:
    """``full``'s configuration by budget, largest first, while each reaches ``best``'s final loss.

    One row per budget run, then the steps-to-target row: the steps of the
    smallest budget that reached it with every larger budget reaching it too,
    against the full run's steps ("never" when the largest did not). The run
    at budget 1.0 is the full run itself.
    """
    label = full.configuration.label
    reached: Runs | None = None
    size = trained.size
    for fraction in sorted(size.budgets, reverse=True):
        steps = size.budget_steps(fraction)
        runs = trained(full.configuration, steps)
        yield Row(f"Training quality: final validation loss by budget, {label}",
                  f"{fraction:.2f} of the steps ({steps}), its own cosine", runs.loss,
                  f"{best.configuration.label}, {best.steps} steps", best.loss, "nats",
                  note=runs.against(best), command=command)  # fmt: skip
        if runs.loss > best.loss:
            break
        reached = runs
    if reached is None:
        note = f"never: the largest budget ({max(size.budgets):.2f}) did not reach {best.loss:.3f}"
    else:
        note = f"{reached.steps / best.steps:.2f} of the steps ({best.steps / reached.steps:.2f}x)"
    target = TARGET if full.configuration.key == MUON_BOTH_TUNED else ""
    yield Row(f"Training quality: steps to the lr-tuned AdamW's final validation loss "
              f"(by budget), {label}", label, reached.steps if reached else None,
              best.configuration.label, best.steps, "steps", target, note, command)  # fmt: skip


# ---------------------------------------------------------------- plot


def plot_losses(full: Sequence[Runs], path: Path) -> None:
    """A PNG of the first seed's full runs: validation loss (markers), smoothed train loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120)
    colors = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]
    for index, runs in enumerate(full):
        color = colors[index % len(colors)]
        result = runs.results[0]
        steps = [s for s, _ in result.train_losses]
        ax.plot(steps, smooth_by_step(result.train_losses), color=color, alpha=0.4, linewidth=1)
        val_steps, val = zip(*result.val_losses, strict=True)
        ax.plot(val_steps, val, color=color, marker="o", markersize=3, linewidth=1.6,
                label=f"{runs.configuration.label}: {runs.losses[0]:.3f}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("validation loss (markers; final loss in the legend) and smoothed train loss "
                 "(thin), first seed", fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _plot_and_say(full: Sequence[Runs], path: Path) -> None:
    """:func:`plot_losses` to ``path``, and say where on stderr."""
    plot_losses(full, path)
    print(f"quality: loss curves written to {path}", file=sys.stderr, flush=True)
