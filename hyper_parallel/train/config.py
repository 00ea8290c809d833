"""The options of ``hyper-parallel train``: one dataclass, and each field's command-line flag.

Every :class:`TrainConfig` field is a flag of ``hyper-parallel train``: ``--`` and
the field's name with dashes, parsed as the field's type. A field's
``metadata["option"]`` (an :class:`Option`) holds its help text and what the
flag and :meth:`TrainConfig.validate` check; a new field gets its flag with no
other edit.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyper_parallel.core.errors import HyperParallelError, HyperParallelValueError
from hyper_parallel.core.plugin import OptimizerEntry, PluginKind, get_registry
from hyper_parallel.train.model import GPTConfig, Positions

__all__ = [
    "MUON_ADAMW",
    "ConfigField",
    "Option",
    "TrainConfig",
    "TrainError",
    "config_fields",
    "optimizers_train_cannot_use",
    "uses_muon",
]

#: The default optimizer: Muon for hidden matrices, AdamW for the rest.
MUON_ADAMW = "muon+adamw"


class TrainError(HyperParallelValueError):
    """A training option or input that cannot be used; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class Option:
    """How a :class:`TrainConfig` field reads on the command line, and what is checked.

    A ``bool`` field is a switch: ``--name`` when it defaults to False,
    ``--no-name`` when it defaults to True.
    """

    help: str = "(default: %(default)s)"  # argparse's help text, ``%(default)s`` included
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # the only values allowed
    positive: bool = False  # an int that must be >= 1
    on_command_line: bool = True
    #: It changes the numbers: a checkpoint records it, and ``--resume`` must repeat it.
    recorded: bool = False


def _option(
    help: str = Option.help,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    positive: bool = False,
    on_command_line: bool = True,
    recorded: bool = False,
) -> dict[str, Option]:
    """A field's ``metadata``: its :class:`Option`."""
    option = Option(
        help=help,
        metavar=metavar,
        choices=choices,
        positive=positive,
        on_command_line=on_command_line,
        recorded=recorded,
    )
    return {"option": option}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one ``hyper-parallel train`` invocation needs."""

    optimizer: str = field(
        default=MUON_ADAMW,
        metadata=_option(f"'{MUON_ADAMW}' (default), or any registered optimizer name"),
    )
    compare: str | None = field(
        default=None,
        metadata=_option(
            "also train with optimizer NAME, one of --optimizer's choices, and plot both "
            "(e.g. adamw)",
            metavar="NAME",
        ),
    )
    partitioner: str = field(
        default="by_shape",
        metadata=_option(f"how {MUON_ADAMW} splits params (default: %(default)s)", recorded=True),
    )
    scheduler: str = field(
        default="cosine", metadata=_option("LR schedule name (default: %(default)s)", recorded=True)
    )
    steps: int = field(
        default=400,
        metadata=_option("optimizer steps (default: %(default)s)", positive=True, recorded=True),
    )
    warmup_steps: int | None = field(
        default=None, metadata=_option("warmup steps (default: 5%% of --steps)", recorded=True)
    )
    lr: float = field(
        default=3e-3,
        metadata=_option(
            "AdamW's peak lr, or the single optimizer's (default: %(default)s)", recorded=True
        ),
    )
    muon_lr: float = field(
        default=6e-3,
        metadata=_option(
            "Muon's peak lr; its step RMS is 0.2 * lr, on AdamW's scale (default: %(default)s)",
            recorded=True,
        ),
    )
    weight_decay: float = field(
        default=0.0,
        metadata=_option("each optimizer's weight decay (default: %(default)s)", recorded=True),
    )
    qk_clip_threshold: float | None = field(
        default=None,
        metadata=_option(
            "QK-clip (MuonClip): after each Muon step, every attention head whose largest "
            "logit exceeded T has its query and key rows scaled down to bring it to T; "
            "metrics.jsonl and the summary show the largest logit before and after and the "
            "heads clipped. --optimizer must have Muon; a --compare baseline without it does "
            "not clip (default: off)",
            metavar="T",
            recorded=True,
        ),
    )
    qk_clip_alpha: float = field(
        default=0.5,
        metadata=_option(
            "the share of --qk-clip-threshold's scaling the query rows take, in [0, 1]; the "
            "key rows take the rest (default: %(default)s)",
            metavar="A",
            recorded=True,
        ),
    )
    batch_size: int = field(
        default=32,
        metadata=_option(
            "sequences per step, per process (default: %(default)s)", positive=True, recorded=True
        ),
    )
    seq_len: int = field(
        default=128,
        metadata=_option(
            "tokens per sequence, the model's context (default: %(default)s)",
            positive=True,
            recorded=True,
        ),
    )
    dim: int = field(
        default=128,
        metadata=_option("model width (default: %(default)s)", positive=True, recorded=True),
    )
    layers: int = field(
        default=4,
        metadata=_option("decoder blocks (default: %(default)s)", positive=True, recorded=True),
    )
    heads: int = field(
        default=4,
        metadata=_option("attention heads (default: %(default)s)", positive=True, recorded=True),
    )
    tied_embeddings: bool = field(
        default=False, metadata=_option("share the embedding and lm_head weights", recorded=True)
    )
    positions: str = field(
        default=Positions.LEARNED.value,
        metadata=_option(
            "how the model tells positions apart: 'learned' (a position table, the default), "
            "'rotary' (RoPE, as in Llama) or 'none'",
            choices=tuple(p.value for p in Positions),
            recorded=True,
        ),
    )
    eval_every: int = field(
        default=25,
        metadata=_option("validation interval in steps (default: %(default)s)", positive=True),
    )
    eval_batches: int = field(
        default=8,
        metadata=_option("batches per validation", positive=True, on_command_line=False),
    )
    log_every: int = field(
        default=5,
        metadata=_option("train loss interval in steps", positive=True, on_command_line=False),
    )
    seed: int = field(
        default=0,
        metadata=_option(
            "seeds the init, the batches and the built-in data (default: %(default)s)",
            recorded=True,
        ),
    )
    data: Path | None = field(
        default=None,
        metadata=_option(
            "train on this UTF-8 text file instead of the synthetic data; or a built-in corpus "
            "by name: 'python-stdlib', this Python's standard library sources, split by file "
            "with a 2,048-token byte-level BPE, built offline and cached (a file of that name: "
            "give its full path)",
            metavar="FILE|NAME",
            recorded=True,
        ),
    )
    tokenizer: str = field(
        default="char",
        metadata=_option(
            "a --data file's tokens: one per character, or per byte (default: %(default)s)",
            choices=("char", "byte"),
            recorded=True,
        ),
    )
    out: Path = field(
        default=Path("runs/train"), metadata=_option("output directory (default: %(default)s)")
    )
    overwrite: bool = field(
        default=False, metadata=_option("replace the run already in --out (default: refuse)")
    )
    progress: bool = field(default=True, metadata=_option("no progress bar"))
    threads: int | None = field(
        default=None,
        metadata=_option(
            "torch's CPU threads (default: OMP_NUM_THREADS if set, else this process's share "
            "of the CPUs less those busy as it starts)",
            metavar="N",
            positive=True,
        ),
    )
    sharding: str | None = field(
        default=None,
        metadata=_option(
            "shard the model with this backend (fsdp, hsdp); run under torchrun, e.g. "
            "torchrun --nproc_per_node 2 -m hyper_parallel train --sharding fsdp",
            recorded=True,
        ),
    )
    checkpoint_dir: Path | None = field(
        default=None,
        metadata=_option(
            "save checkpoints here: one folder per run, the last two of each kept; under "
            "torchrun, on storage every rank shares"
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=_option("also save every N steps (default: only at the end)", metavar="N"),
    )
    checkpoint_async: bool = field(
        default=False,
        metadata=_option("write checkpoints in the background while training goes on"),
    )
    resume: bool = field(
        default=False,
        metadata=_option(
            "continue from the newest intact checkpoint in --checkpoint-dir (a corrupt one is "
            "skipped, with a message)"
        ),
    )

    def muon_qk_clip(self, name: str) -> dict[str, float]:
        """Muon's QK-clip options for run ``name``: empty where that run does not clip.

        Only a run whose optimizer has Muon (:func:`uses_muon`) clips; a
        ``--compare`` baseline without Muon trains as it would without the flag.
        """
        if self.qk_clip_threshold is None or not uses_muon(name):
            return {}
        return {"qk_clip_threshold": self.qk_clip_threshold, "qk_clip_alpha": self.qk_clip_alpha}

    @property
    def warmup(self) -> int:
        """The warmup steps in effect: ``--warmup-steps``, else 5% of ``--steps`` (at least 1)."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    def model(self, vocab_size: int) -> GPTConfig:
        """The decoder these options train on a corpus of ``vocab_size`` tokens (its SwiGLU
        width 8/3 of ``dim``, rounded up to a multiple of 32)."""
        return GPTConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            dim=self.dim,
            layers=self.layers,
            heads=self.heads,
            mlp_hidden=-(-8 * self.dim // 3 // 32) * 32,
            tied_embeddings=self.tied_embeddings,
            positions=self.positions,
        )

    def validate(self) -> None:
        """Raise :class:`TrainError` for the first unusable option."""
        fields = config_fields()
        for f in fields:
            value = getattr(self, f.name)
            if f.option.positive and value is not None and value < 1:
                raise TrainError(f"{f.flag} must be >= 1, got {value}")
        self._check_ranges()
        for f in fields:
            value = getattr(self, f.name)
            if f.option.choices is not None and value not in f.option.choices:
                allowed = " or ".join(repr(c) for c in f.option.choices)
                raise TrainError(f"{f.flag} must be {allowed}, got {value!r}")
        self._check_plugin_names()

    def _check_ranges(self) -> None:
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise TrainError(
                f"--warmup-steps must be between 0 and --steps ({self.steps}), got {self.warmup_steps}"
            )
        for name in ("lr", "muon_lr"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise TrainError(f"{_flag(name)} must be a positive number, got {value}")
        if self.checkpoint_every < 0:
            raise TrainError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every or self.checkpoint_async) and (
            self.checkpoint_dir is None
        ):
            raise TrainError(
                "--resume, --checkpoint-every and --checkpoint-async need --checkpoint-dir DIR"
            )
        self._check_data()
        if self.weight_decay < 0:
            raise TrainError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.dim % self.heads:
            raise TrainError(f"--dim ({self.dim}) must be divisible by --heads ({self.heads})")
        self._check_qk_clip()

    def _check_data(self) -> None:
        from hyper_parallel.train.corpus import BUILT_IN_CORPORA

        if (
            self.data is not None
            and str(self.data) in BUILT_IN_CORPORA
            and self.tokenizer != "char"
        ):
            raise TrainError(
                f"--tokenizer {self.tokenizer}: --data {self.data} is a built-in corpus with its "
                "own tokenizer; drop --tokenizer, or give a file's full path"
            )

    def _check_qk_clip(self) -> None:
        threshold, alpha = self.qk_clip_threshold, self.qk_clip_alpha
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise TrainError(
                f"--qk-clip-threshold must be a positive number (the largest attention logit "
                f"allowed), got {threshold}"
            )
        if not 0.0 <= alpha <= 1.0:  # NaN fails too
            raise TrainError(f"--qk-clip-alpha must be between 0 and 1, got {alpha}")
        if threshold is None and alpha != 0.5:
            raise TrainError(
                f"--qk-clip-alpha {alpha} does nothing without --qk-clip-threshold T; give both"
            )

    def _check_plugin_names(self) -> None:
        registry = get_registry()
        if self.sharding is not None:
            try:
                registry.get(PluginKind.SHARDING_BACKEND, self.sharding)
            except HyperParallelError as exc:
                raise TrainError(f"--sharding: {exc}") from None
        for flag, choice in (("--optimizer", self.optimizer), ("--compare", self.compare)):
            if choice is not None and choice != MUON_ADAMW:
                try:
                    entry = registry.get(PluginKind.OPTIMIZER, choice)
                except HyperParallelError as exc:
                    raise TrainError(f"{flag}: {exc}") from None
                if reason := _unusable(entry):
                    raise TrainError(
                        f"{flag} {choice}: train cannot use it: {reason}, and train steps "
                        "without a closure on dense gradients of every param; choose another "
                        "(hyper-parallel plugins marks which train can use)"
                    )
        if self.qk_clip_threshold is not None and not uses_muon(self.optimizer):
            raise TrainError(
                f"--qk-clip-threshold: --optimizer {self.optimizer} has no Muon, and QK-clip "
                f"runs after Muon's step; use --optimizer {MUON_ADAMW} (the default) or muon, "
                "or drop --qk-clip-threshold"
            )
        for flag, kind, name in (
            ("--partitioner", PluginKind.PARTITIONER, self.partitioner),
            ("--scheduler", PluginKind.LR_SCHEDULER, self.scheduler),
        ):
            try:
                registry.get(kind, name)
            except HyperParallelError as exc:
                raise TrainError(f"{flag}: {exc}") from None


def uses_muon(name: str) -> bool:
    """Whether run ``name`` (``muon+adamw``, or a registered optimizer's name) steps with Muon."""
    if name == MUON_ADAMW:
        return True
    return get_registry().get(PluginKind.OPTIMIZER, name).name == "muon"


def _unusable(entry: Any) -> str | None:
    """Why ``train``'s loop cannot step a registered optimizer, or ``None``."""
    return entry.unusable_in_plain_loop() if isinstance(entry, OptimizerEntry) else None


def optimizers_train_cannot_use() -> dict[str, str]:
    """Every registered optimizer ``train`` refuses, with the reason."""
    return {
        e.name: reason
        for e in get_registry().entries()
        if e.kind is PluginKind.OPTIMIZER and (reason := _unusable(e))
    }


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ConfigField:
    """One :class:`TrainConfig` field as the command line sees it."""

    name: str
    type: type  # what a value is parsed as: int, float, str, bool or Path (never None)
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        """``--name-with-dashes``; a switch that turns a True default off is ``--no-...``."""
        off_switch = self.type is bool and self.default is True
        return _flag(f"no_{self.name}" if off_switch else self.name)


def config_fields() -> list[ConfigField]:
    """Every :class:`TrainConfig` field, in order, with its type and :class:`Option`."""
    hints = typing.get_type_hints(TrainConfig)
    return [
        ConfigField(
            f.name, _value_type(hints[f.name]), f.default, f.metadata.get("option", Option())
        )
        for f in dataclasses.fields(TrainConfig)
    ]


def _value_type(hint: Any) -> type:
    """``int`` for ``int`` and for ``int | None``."""
    kinds: list[type] = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return kinds[0]
