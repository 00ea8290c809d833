"""The divergence rule of ``hyper-parallel train``: one warning when the loss does not fall.

A run is said to diverge, once, when either holds (docs/faults.md):

- **not falling**: at the end of its first stretch, ``max(warmup, 10)``
  steps (or the first step after it with 5 losses to average), the mean
  train loss of the last 5 steps is not at least 2% below the loss of the
  first step (the model as initialised);
- **risen**: at any later step, the mean of the last 5 steps is above that
  first loss, so everything learned is lost.

A healthy run is far from both: the quick start's loss is 25% below its
start by step 10.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["DivergenceWatch"]

WINDOW = 5  # steps averaged, so one noisy batch says nothing
MIN_FALL = 0.02  # the fall by the end of the stretch, relative to the first loss
MIN_STRETCH = 10  # the first stretch, when warmup is shorter


@dataclass
class DivergenceWatch:
    """Watches one run's train losses; :meth:`observe` returns the warning the first time a rule holds.

    Args:
        stretch: The step that ends the first stretch (``max(warmup, 10)``).
    """

    stretch: int
    start: tuple[int, float] | None = None  # the first step's loss
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    said: str | None = None
    fall_checked: bool = (
        False  # "not falling" looks once, at the first full window from the stretch
    )

    @classmethod
    def for_warmup(cls, warmup: int) -> DivergenceWatch:
        return cls(stretch=max(warmup, MIN_STRETCH))

    def observe(self, step: int, loss: float) -> str | None:
        """Take ``step``'s train loss; the warning (once) if the run is not learning or diverging."""
        if self.start is None:
            self.start = (step, loss)
        self.recent.append((step, loss))
        if self.said is not None or len(self.recent) < WINDOW:
            return None
        first_step, first = self.start
        mean = sum(v for _, v in self.recent) / len(self.recent)
        span = f"steps {self.recent[0][0]}-{step}, {first:.4f} at step {first_step}"
        if not self.fall_checked and step >= self.stretch:
            self.fall_checked = True
            if mean >= first * (1 - MIN_FALL):
                self.said = (
                    f"the loss has not fallen by step {step} (mean {mean:.4f} over {span}): the "
                    "run is not learning; check the learning rate (--lr, --muon-lr)"
                )
        elif step > self.stretch and mean > first:
            self.said = (
                f"the loss has risen above its start by step {step} (mean {mean:.4f} over "
                f"{span}): the run is diverging; lower the learning rate (--lr, --muon-lr)"
            )
        return self.said
