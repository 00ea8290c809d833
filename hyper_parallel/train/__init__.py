"""``hyper-parallel train``: a small GPT on built-in synthetic data, Muon + AdamW against peers.

From Python: :func:`train` runs a :class:`TrainConfig` and returns its summary;
:class:`TinyGPT` (with :class:`GPTConfig`) is the model.
"""

from hyper_parallel.train.config import TrainConfig, TrainError
from hyper_parallel.train.data import DataError
from hyper_parallel.train.loop import train
from hyper_parallel.train.model import GPTConfig, TinyGPT

__all__ = [
    "DataError",
    "GPTConfig",
    "TinyGPT",
    "TrainConfig",
    "TrainError",
    "train",
]
