"""Draw the figures of the docs from the code itself.

Run from the repository root after changing a schedule or a coefficient set::

    python docs/_scripts/make_figures.py

It writes ``docs/img/schedules.png`` (every built-in LR schedule, computed
with the registered functions) and ``docs/img/ns_coefficients.png`` (what
five Newton-Schulz steps of each coefficient set do to a singular value).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from hyper_parallel import get_registry
from hyper_parallel_builtins.newton_schulz import COEFFICIENT_SETS, resolve_coefficients

OUT = Path(__file__).resolve().parents[1] / "img"
TOTAL, WARMUP = 1000, 100


def schedules() -> None:
    entries = [
        e
        for e in get_registry().entries("lr_scheduler")
        if e.distribution and e.distribution.startswith("hyper-parallel ")
    ]
    fig, axes = plt.subplots(2, 4, figsize=(11, 4.6), dpi=110, sharex=True, sharey=True)
    steps = list(range(TOTAL + 1))
    for ax, entry in zip(axes.flat, entries, strict=False):
        factors = [entry.obj(s, total_steps=TOTAL, warmup_steps=WARMUP) for s in steps]
        ax.plot(steps, factors, linewidth=1.6)
        ax.set_title(entry.name, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(entries) :]:
        ax.axis("off")
    fig.suptitle(
        f"Built-in LR schedules, default options: factor on each group's peak lr "
        f"(total_steps={TOTAL}, warmup_steps={WARMUP})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(OUT / "schedules.png")
    plt.close(fig)


def coefficient_sets(ns_steps: int = 5) -> None:
    sigma = torch.logspace(-3, 0, 400, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    drawn: dict[tuple[tuple[float, float, float], ...], str] = {}
    for name in sorted(COEFFICIENT_SETS):  # a set under two names is drawn once
        triples = COEFFICIENT_SETS[name]
        drawn[triples] = f"{drawn[triples]} = {name}" if triples in drawn else name
    for label in drawn.values():
        x = sigma.clone()
        for a, b, c in resolve_coefficients(label.split(" = ")[0], ns_steps):
            x = a * x + b * x**3 + c * x**5
        ax.plot(sigma.numpy(), x.numpy(), label=label, linewidth=1.6)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("singular value of the normalized update")
    ax.set_ylabel(f"after {ns_steps} Newton-Schulz steps")
    ax.set_title("Newton-Schulz coefficient sets (ns_steps=5)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT / "ns_coefficients.png")
    plt.close(fig)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    schedules()
    coefficient_sets()
    print(f"wrote {OUT / 'schedules.png'} and {OUT / 'ns_coefficients.png'}")
