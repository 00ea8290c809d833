"""Loss-curve plot of one or more training runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyper_parallel.train.run import RunResult

__all__ = ["Curve", "curves", "plot_losses"]

_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")

#: The smoothing's weight of one step's loss: about the last 10 steps count.
_ALPHA = 0.1


@dataclass(frozen=True)
class Curve:
    """What the plot draws of one run: its smoothed train loss and its validation loss."""

    label: str
    train: list[tuple[int, float]]  # (step, smoothed loss) at each step the log holds
    val: list[tuple[int, float]]


def smooth_by_step(points: Sequence[tuple[int, float]], alpha: float = _ALPHA) -> list[float]:
    """An exponential moving average over steps, not points: a gap of ``k`` steps weighs as ``k``.

    Points logged every 5 steps and points logged every step smooth alike, so
    a run resumed from a log of every 5th step draws the uninterrupted run's curve.
    """
    out: list[float] = []
    last_step = 0
    for step, value in points:
        if out:
            keep = (1 - alpha) ** max(step - last_step, 1)
            value = keep * out[-1] + (1 - keep) * value
        out.append(value)
        last_step = step
    return out


def curves(results: Sequence[RunResult]) -> list[Curve]:
    """The series :func:`plot_losses` draws: the logged train losses, smoothed by step."""
    found = []
    for result in results:
        points = result.logged_train_losses
        smoothed = smooth_by_step(points)
        train = [(step, value) for (step, _), value in zip(points, smoothed, strict=True)]
        found.append(Curve(result.label, train, list(result.val_losses)))
    return found


def plot_losses(results: Sequence[RunResult], path: Path, *, title: str = "") -> None:
    """Write a PNG: smoothed train loss (thin) and validation loss (markers) per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for color, curve in zip(_COLORS, curves(results), strict=False):
        if curve.train:
            steps, losses = zip(*curve.train, strict=True)
            ax.plot(steps, losses, color=color, alpha=0.45, linewidth=1.0,
                    label=f"{curve.label} train")  # fmt: skip
        if curve.val:
            steps, losses = zip(*curve.val, strict=True)
            ax.plot(steps, losses, color=color, marker="o", markersize=3, linewidth=1.8,
                    label=f"{curve.label} validation")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
