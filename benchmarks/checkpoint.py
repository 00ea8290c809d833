"""Checkpoint benchmark: checksums, a save's training stall, the non-finite check, a load's memory.

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
  against the whole save);
- the NaN/Inf check a save makes before it writes (``non_finite`` over the
  tensors it saves, timed inside each save) against the synchronous save and
  against the training stall of the asynchronous one (which runs it before
  its copy), and the same call timed alone against one optimizer step;
- the peak extra memory of ``checkpoint.load`` into a live model and
  optimizer (it stages a second copy of what it reads), measured as the
  resident set's high-water mark in a fresh process (Linux), against the
  checkpoint's size and against DCP reading in place into the live tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, Row, Settings, case_command
from benchmarks.peers import use_peer_dir

__all__ = ["case_checkpoint", "checkpoint_model", "load_peaks"]

_CHUNK = 8 << 20


def checkpoint_model(params: int, *, stepped: bool = True) -> tuple[Any, Any]:
    """A GPT-style model of about ``params`` params and its Muon + AdamW optimizer, stepped once.

    The gradients of that step stay set, so ``optimizer.step()`` can be timed
    again; ``stepped=False`` leaves the optimizer without state (and no
    gradients).
    """
    from hyper_parallel.core.optimizer import get_hyper_optimizer
    from hyper_parallel.train.model import GPTConfig, TinyGPT

    dim, vocab = (768, 8192) if params >= 50_000_000 else (256, 4096)
    per_layer = 4 * dim * dim + 3 * dim * (8 * dim // 3)
    layers = max(1, round((params - vocab * dim) / per_layer))
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=vocab, seq_len=128, dim=dim, layers=layers,
                              heads=dim // 64, mlp_hidden=8 * dim // 3))  # fmt: skip
    optimizer = get_hyper_optimizer(model)
    if stepped:
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


def case_checkpoint(settings: Settings) -> Iterator[Row]:
    """Checksum algorithms, the training stall of a sync and an async save, the checksums' share."""
    from hyper_parallel import checkpoint
    from hyper_parallel.checkpoint._integrity import checksum_share

    params = settings.checkpoint_params
    model, optimizer = checkpoint_model(params)
    count = sum(p.numel() for p in model.parameters())
    command = case_command("checkpoint", settings)
    with tempfile.TemporaryDirectory(prefix="hp-bench-ckpt-") as scratch:
        root = Path(scratch)
        managers = {mode: checkpoint.CheckpointManager(root / mode, keep_last=1,
                                                       async_save=mode == "async")
                    for mode in ("sync", "async")}  # fmt: skip
        times: dict[str, list[float]] = {"sync": [], "async": [], "checksums": []}
        times |= {"check in sync": [], "check in async": []}
        checks: list[float] = []
        saved_tensors: dict[str, Any] = {}
        for step in range(settings.repeats):  # as a training loop saves: one manager each
            for mode in ("sync", "async") if step % 2 == 0 else ("async", "sync"):
                with _check_timed(checks, saved_tensors):
                    begin = time.perf_counter()
                    managers[mode].save(step, model=model, optimizer=optimizer)
                    times[mode].append(time.perf_counter() - begin)
                times[f"check in {mode}"].append(checks[-1])
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
        yield Row(f"{what}: the non-finite check's share of a save",
                  "non-finite check (in the save)", medians["check in sync"], "synchronous save",
                  medians["sync"], "s", "", "timed inside the same saves", command)  # fmt: skip
        yield Row(f"{what}: the non-finite check's share of an async save's stall",
                  "non-finite check (in the save)", medians["check in async"], "async save",
                  medians["async"], "s", "", "timed inside the same saves", command)  # fmt: skip
        check_s, step_s = _check_against_step(saved_tensors, optimizer, settings.repeats)
        yield Row(f"{what}: the non-finite check against a training step",
                  "non_finite(flat_tensors(saved))", check_s, "optimizer step (Muon + AdamW)",
                  step_s, "s", "", "", command)  # fmt: skip
        yield from _load_memory_rows(what, saved, size, params, command)
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _check_timed(into: list[float], seen: dict[str, Any]) -> Iterator[None]:
    """Time the save's own NaN/Inf check (``_save._refuse_non_finite``) into ``into``.

    ``seen["tensors"]`` keeps the last state dict it checked: the tensors a
    save writes, to time the same call on its own.
    """
    from hyper_parallel.checkpoint import _save

    real = _save._refuse_non_finite

    def timed(target: Path, tensors: dict[str, Any]) -> None:
        begin = time.perf_counter()
        try:
            real(target, tensors)
        finally:
            into.append(time.perf_counter() - begin)
        seen["tensors"] = tensors

    _save._refuse_non_finite = timed  # type: ignore[assignment]
    try:
        yield
    finally:
        _save._refuse_non_finite = real  # type: ignore[assignment]


def _check_against_step(saved: dict[str, Any], optimizer: Any, repeats: int) -> tuple[float, float]:
    """Median seconds of the save's check alone and of one optimizer step, timed in turns.

    The optimizer stepped once already (the warm-up) and keeps its gradients;
    at most 3 steps are timed, as a step of the full-size model takes seconds.
    """
    from hyper_parallel.checkpoint._tensors import flat_tensors
    from hyper_parallel.core.optimizer._nonfinite import non_finite

    tensors = saved["tensors"]
    assert not non_finite(flat_tensors(tensors))  # warm, and the state is healthy
    runs: dict[str, Callable[[], object]] = {
        "check": lambda: non_finite(flat_tensors(tensors)),  # what a save runs
        "step": optimizer.step,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(min(repeats, 3)):
        for name in runs if repeat % 2 == 0 else reversed(list(runs)):
            begin = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - begin)
    return statistics.median(times["check"]), statistics.median(times["step"])


def _load_memory_rows(what: str, ckpt: Path, size: int, params: int, command: str) -> Iterator[Row]:
    """Peak extra memory of a load, from a fresh process: against the size, and in place."""
    case = f"{what}: peak extra memory of a load"
    code = (
        "import json, sys; from benchmarks.checkpoint import load_peaks; "
        "print(json.dumps(load_peaks(sys.argv[1], int(sys.argv[2]))))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(ckpt), str(params)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    peaks: dict[str, Any] = {}
    note = ""
    if found.returncode == 0:
        peaks = json.loads(found.stdout.strip().splitlines()[-1])
        note = peaks.pop("note", "")
    else:
        note = f"measuring failed: {(found.stderr.strip().splitlines() or ['?'])[-1][:120]}"
    ours, in_place = (
        None if peaks.get(key) is None else peaks[key] / 2**20 for key in ("staged", "in_place")
    )
    yield Row(case, "checkpoint.load (staged)", ours, "checkpoint size", size / 2**20, "MiB",
              "", note, command)  # fmt: skip
    yield Row(case, "checkpoint.load (staged)", ours, "DCP read in place (no staging)",
              in_place, "MiB", "", note, command)  # fmt: skip


def _memory_kib() -> dict[str, int]:
    """This process's resident set now and its high-water mark, in KiB (Linux)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


def _peak_extra(run: Callable[[], object]) -> int:
    """Bytes the resident set grew to at most while ``run`` ran, above where it started.

    Freed heap memory is returned to the system first and the high-water mark
    reset (``/proc/self/clear_refs``), so the peak is this call's alone.
    """
    import gc

    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc: freed heap back to the system
    if trim is not None:
        trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _memory_kib()["VmRSS"]
    run()
    return (_memory_kib()["VmHWM"] - before) * 1024


def load_peaks(path: str, params: int) -> dict[str, Any]:
    """Peak extra bytes of ``checkpoint.load`` and of DCP reading in place (run in a fresh process).

    The model and optimizer are built as the checkpoint's and loaded once
    first, so the optimizer state exists (as in a run that resumes into live
    objects) and neither figure counts it; then each read is measured alone.
    The load is measured once its files' checksums passed: that pass maps the
    files (page cache, nothing allocated), which the resident set would count.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from hyper_parallel import checkpoint
    from hyper_parallel.checkpoint import _load
    from hyper_parallel.checkpoint._state import (
        OptimizerView,
        SafeReader,
        named_optimizers,
        quiet_single_process,
        split_optimizer,
    )

    if not Path("/proc/self/clear_refs").exists():
        return {"note": "needs Linux's /proc/self/clear_refs"}
    ckpt = Path(path)
    model, optimizer = checkpoint_model(params, stepped=False)
    checkpoint.load(ckpt, model=model, optimizer=optimizer)  # makes the optimizer state

    def in_place() -> None:  # a load without staging: DCP reads into the live tensors
        view = OptimizerView(model, optimizer)
        tensors: dict[str, Any] = {"model": get_model_state_dict(model), "optim": {}}
        if view.mains:
            tensors["main"] = view.mains
        for name, opt in named_optimizers(optimizer).items():
            tensors["optim"][name] = split_optimizer(
                get_optimizer_state_dict(view.module, opt), name
            )[0]
        with quiet_single_process():
            dcp_load(tensors, storage_reader=SafeReader(ckpt), no_dist=True)

    staged: list[int] = []
    real = _load._load_verified

    def measured(*args: Any) -> int:  # the load once its files' checksums passed
        step: list[int] = []
        staged.append(_peak_extra(lambda: step.append(real(*args))))
        return step[0]

    _load._load_verified = measured  # type: ignore[assignment]
    try:
        checkpoint.load(ckpt, model=model, optimizer=optimizer)
    finally:
        _load._load_verified = real  # type: ignore[assignment]
    return {
        "staged": staged[0],
        "in_place": _peak_extra(in_place),
        "note": "resident set's high-water mark above its start, in a fresh process; "
        "the checksum pass before the read is not counted",
    }


def _algorithm_rows(files: list[Path], size: int, repeats: int, command: str) -> Iterator[Row]:
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
