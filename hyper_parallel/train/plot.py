"""Loss-curve plot of one or more training runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyper_parallel.train.run import RunResult

__all__ = ["plot_losses"]

_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


def _smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    out: list[float] = []
    for v in values:
        out.append(v if not out else (1 - alpha) * out[-1] + alpha * v)
    return out


def plot_losses(results: Sequence[RunResult], path: Path, *, title: str = "") -> None:
    """Write a PNG: smoothed train loss (thin) and validation loss (markers) per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for color, result in zip(_COLORS, results, strict=False):
        if result.train_losses:
            steps, losses = zip(*result.train_losses, strict=True)
            ax.plot(
                steps,
                _smooth(list(losses)),
                color=color,
                alpha=0.45,
                linewidth=1.0,
                label=f"{result.label} train",
            )
        if result.val_losses:
            steps, losses = zip(*result.val_losses, strict=True)
            ax.plot(
                steps,
                losses,
                color=color,
                marker="o",
                markersize=3,
                linewidth=1.8,
                label=f"{result.label} validation",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
