"""``hyper-parallel train``: a small GPT on built-in synthetic data, Muon + AdamW against peers."""

from hyper_parallel.train.config import MUON_ADAMW, TrainConfig, TrainError
from hyper_parallel.train.data import DataError, TokenizedText, load_text_file, synthetic_corpus
from hyper_parallel.train.loop import steps_to_reach, train
from hyper_parallel.train.model import GPTConfig, TinyGPT
from hyper_parallel.train.run import RunResult

__all__ = [
    "MUON_ADAMW",
    "DataError",
    "GPTConfig",
    "RunResult",
    "TinyGPT",
    "TokenizedText",
    "TrainConfig",
    "TrainError",
    "load_text_file",
    "steps_to_reach",
    "synthetic_corpus",
    "train",
]
