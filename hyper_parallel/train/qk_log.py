"""QK-clip in a run of ``hyper-parallel train``: the tracked model, each step's figures, their sum.

With ``--qk-clip-threshold``, a run whose optimizer has Muon tracks its
model's attention (:func:`hyper_parallel.qk_clip.track`) and Muon clips after
each step (``qk_clip_threshold``, ``qk_clip_alpha``). Each logged row of
``metrics.jsonl`` holds that step's :class:`~hyper_parallel.qk_clip.QKClipStats`
(``qk_max_logit``, ``qk_max_logit_after``, ``qk_heads_clipped``, ``qk_heads``),
and the run's summary :meth:`QKClipFigures.summary`: over every step, the
largest logit before and after the clip and the heads clipped. Under
``--sharding`` the figures are every rank's: Muon reduces the maxima over
the ranks before it clips.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hyper_parallel.core.errors import HyperParallelRuntimeError
from hyper_parallel.core.optimizer import ChainedOptimizer
from hyper_parallel.qk_clip import QKClipStats, track

__all__ = ["QKClipFigures", "step_stats", "summary_text", "track_for_clip"]


def track_for_clip(model: nn.Module, options: dict[str, float]) -> None:
    """Track ``model``'s attention when Muon clips (``options``, from ``TrainConfig.muon_qk_clip``)."""
    if options:
        track(model)


def step_stats(optimizer: ChainedOptimizer) -> QKClipStats:
    """The last step's QK-clip figures, from the Muon of ``optimizer``.

    Raises:
        HyperParallelRuntimeError: no sub-optimizer has clipped yet (a run
            that clips reads them only after a step).
    """
    from hyper_parallel.core.optimizer import Muon

    for opt in optimizer:
        if isinstance(opt, Muon) and opt.qk_clip_stats is not None:
            return opt.qk_clip_stats
    raise HyperParallelRuntimeError(
        "QK-clip figures were asked of an optimizer whose Muon has not clipped a step"
    )


@dataclass
class QKClipFigures:
    """One run's QK-clip over its steps: the largest logits seen, and the heads clipped."""

    threshold: float
    alpha: float
    max_logit: float = -math.inf  # before the clip, over every step
    max_logit_after: float = -math.inf
    heads_clipped: int = 0  # summed over the steps: a head clipped at 3 steps counts 3 times
    steps_clipped: int = 0  # steps at which at least one head was clipped
    heads: int = 0  # query heads the clip watches

    def count(self, optimizer: ChainedOptimizer) -> dict[str, float | int]:
        """Count the step ``optimizer`` just took; its figures as a log row holds them."""
        stats = step_stats(optimizer)
        self.add(stats)
        return stats.as_dict()

    def add(self, stats: QKClipStats) -> None:
        """Count one step's figures."""
        self.max_logit = max(self.max_logit, stats.max_logit)
        self.max_logit_after = max(self.max_logit_after, stats.max_logit_after)
        self.heads_clipped += stats.heads_clipped
        self.steps_clipped += stats.heads_clipped > 0
        self.heads = stats.heads

    @classmethod
    def of(cls, options: dict[str, float], rows: Iterable[dict[str, Any]]) -> QKClipFigures | None:
        """A run's figures (``None`` where it does not clip), from the log rows it resumes with.

        A run resumed from a checkpoint counts the steps before it as far as
        its log shows them: the logged steps (step 1, every 5th, the last).
        """
        if not options:
            return None
        figures = cls(options["qk_clip_threshold"], options["qk_clip_alpha"])
        for row in rows:
            if "qk_max_logit" in row:
                figures.add(
                    QKClipStats(
                        row["qk_max_logit"],
                        row["qk_max_logit_after"],
                        row["qk_heads_clipped"],
                        row["qk_heads"],
                    )
                )
        return figures

    def summary(self) -> dict[str, Any]:
        """The figures as ``summary.json`` holds them (``None`` for a logit never seen)."""
        seen = math.isfinite(self.max_logit)
        return {
            "threshold": self.threshold,
            "alpha": self.alpha,
            "max_logit": self.max_logit if seen else None,
            "max_logit_after": self.max_logit_after if seen else None,
            "heads_clipped": self.heads_clipped,
            "steps_clipped": self.steps_clipped,
            "heads": self.heads,
        }


def summary_text(figures: dict[str, Any]) -> str:
    """The summary's figures in a few words, for the line printed at the end of a run."""
    said = f"QK-clip at {figures['threshold']:g}"
    if figures["max_logit"] is None:
        return f"{said}: no step taken"
    return (
        f"{said}: max logit {figures['max_logit']:.2f} ({figures['max_logit_after']:.2f} after "
        f"the clip), {figures['heads_clipped']} heads clipped at {figures['steps_clipped']} steps"
    )
