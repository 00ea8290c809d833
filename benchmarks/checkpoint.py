"""Checkpoint benchmark: checksum speed by algorithm, a save's training stall, the checksums' share.

Run from the repository root::

    python -m benchmarks --cases checkpoint           # a 100M-param model
    python -m benchmarks --cases checkpoint --quick   # a 5M-param model

Rows:

- the checksum of one checkpoint's files (in the page cache, as right after a
  save) with XXH3-64, the algorithm checkpoints use, against CRC32C
  (``google-crc32c``, when installed) and SHA-256 (``hashlib``);
- how long ``save`` holds the training loop: asynchronous (until the state is
  copied to CPU memory) against synchronous (until the checkpoint is committed);
- the checksums' share of a synchronous save (the rank's fsync'd checksum pass
  against the whole save).
"""

from __future__ import annotations

import hashlib
import mmap
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["case_checkpoint", "checkpoint_model"]

_CHUNK = 8 << 20


def checkpoint_model(params: int) -> tuple[Any, Any]:
    """A GPT-style model of about ``params`` params and its Muon + AdamW optimizer, stepped once."""
    from hyper_parallel.core.optimizer import get_hyper_optimizer
    from hyper_parallel.train.model import GPTConfig, TinyGPT

    dim, vocab = (768, 8192) if params >= 50_000_000 else (256, 4096)
    per_layer = 4 * dim * dim + 3 * dim * (8 * dim // 3)
    layers = max(1, round((params - vocab * dim) / per_layer))
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=vocab, seq_len=128, dim=dim, layers=layers,
                              heads=dim // 64, mlp_hidden=8 * dim // 3))  # fmt: skip
    optimizer = get_hyper_optimizer(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the optimizer state exists, as in training
    return model, optimizer


def _mapped(digest: Callable[[Any], Any]) -> Callable[[Path], Any]:
    def run(path: Path) -> Any:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return digest(m)

    return run


def _crc32c_by_chunks(path: Path) -> int:
    import google_crc32c  # its binding takes bytes only, so it reads copies

    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return crc


def _checksummers() -> dict[str, Callable[[Path], Any] | str]:
    """Each algorithm's checksum of one file, by name, or why it cannot be measured."""
    from benchmarks.peers import use_peer_dir
    from hyper_parallel.checkpoint._integrity import digest_file

    use_peer_dir()
    found: dict[str, Callable[[Path], Any] | str] = {
        "xxh3_64": digest_file,  # what checkpoints run
        "sha256": _mapped(lambda m: hashlib.sha256(m).hexdigest()),
    }
    try:
        import google_crc32c  # noqa: F401

        found["crc32c"] = _crc32c_by_chunks
    except ImportError:
        found["crc32c"] = "google-crc32c is not installed (python -m benchmarks --install-peers)"
    return found


def case_checkpoint(settings: Any) -> Iterator[Any]:
    """Checksum algorithms, the training stall of a sync and an async save, the checksums' share."""
    from benchmarks.suite import Row, _command
    from hyper_parallel import checkpoint
    from hyper_parallel.checkpoint._integrity import checksum_share

    params = settings.checkpoint_params
    model, optimizer = checkpoint_model(params)
    count = sum(p.numel() for p in model.parameters())
    command = _command("checkpoint", settings)
    with tempfile.TemporaryDirectory(prefix="hp-bench-ckpt-") as scratch:
        root = Path(scratch)
        managers = {mode: checkpoint.CheckpointManager(root / mode, keep_last=1,
                                                       async_save=mode == "async")
                    for mode in ("sync", "async")}  # fmt: skip
        times: dict[str, list[float]] = {"sync": [], "async": [], "checksums": []}
        for step in range(settings.repeats):  # as a training loop saves: one manager each
            for mode in ("sync", "async") if step % 2 == 0 else ("async", "sync"):
                begin = time.perf_counter()
                managers[mode].save(step, model=model, optimizer=optimizer)
                times[mode].append(time.perf_counter() - begin)
                managers[mode].wait()
            begin = time.perf_counter()
            checksum_share(managers["sync"].path_for(step))
            times["checksums"].append(time.perf_counter() - begin)
        saved = managers["sync"].path_for(settings.repeats - 1)
        files = sorted(p for p in saved.iterdir() if p.is_file())
        size = sum(p.stat().st_size for p in files)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        what = f"Checkpoint of a {count / 1e6:.0f}M-param model with Muon + AdamW state ({size / 2**20:,.0f} MiB)"
        yield Row(f"{what}: training stall of a save", "async save", medians["async"],
                  "synchronous save", medians["sync"], "s", "", "", command)  # fmt: skip
        yield Row(f"{what}: checksums' share of a save", "fsync + checksum of every file",
                  medians["checksums"], "synchronous save", medians["sync"], "s", "<= 0.05",
                  "", command)  # fmt: skip
        yield from _algorithm_rows(files, size, settings.repeats, command)
        shutil.rmtree(root, ignore_errors=True)


def _algorithm_rows(files: list[Path], size: int, repeats: int, command: str) -> Iterator[Any]:
    from benchmarks.suite import Row

    algorithms = _checksummers()
    runs = {name: a for name, a in algorithms.items() if not isinstance(a, str)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(max(repeats, 3)):
        for name in runs if repeat % 2 == 0 else reversed(list(runs)):
            begin = time.perf_counter()
            for path in files:
                runs[name](path)
            times[name].append(time.perf_counter() - begin)
    ours = statistics.median(times["xxh3_64"])
    for peer in ("crc32c", "sha256"):
        value = statistics.median(times[peer]) if peer in times else None
        note = algorithms[peer] if isinstance(algorithms[peer], str) else ""
        yield Row(f"Checksum of one checkpoint's files ({size / 2**20:,.0f} MiB, page cache)",
                  "xxh3_64 (checkpoints)", ours, peer, value, "s", "<= 1.0", str(note),
                  command)  # fmt: skip
