"""What ``hyper-parallel train`` checks before its first step: paths, a resume, memory.

Each failure is a :class:`~hyper_parallel.train.config.TrainError` naming the
flag, the value and the fix, raised before any model is built, any step runs
or anything is written (the command line prints it as one line, exit 2).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hyper_parallel.train.config import TrainConfig, TrainError

__all__ = [
    "RUN_OUTPUTS",
    "available_memory_bytes",
    "check_memory",
    "check_paths",
    "check_resume",
    "estimate_peak_bytes",
    "resume_record",
    "run_folder",
]

#: The files a run writes into ``--out``.
RUN_OUTPUTS = ("metrics.jsonl", "loss_curves.png", "summary.json")

#: The options a checkpoint of ``train`` records, and a resume must repeat.
_RESUMED = ("steps", "dim", "layers", "heads", "seq_len", "tied_embeddings", "partitioner")


# -- paths --------------------------------------------------------------------------


def check_paths(config: TrainConfig) -> None:
    """``--out`` and ``--checkpoint-dir`` are (or can become) writable directories.

    A ``--out`` that already holds a run is refused unless ``--overwrite``
    (which replaces that run's files) or ``--resume`` (which continues it).
    """
    _check_writable_dir("--out", config.out)
    if config.checkpoint_dir is not None:
        _check_writable_dir("--checkpoint-dir", config.checkpoint_dir)
    if config.out.is_dir() and not (config.overwrite or config.resume):
        held = sorted(p.name for p in config.out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise TrainError(
                f"--out {config.out}: the directory is not empty ({shown}); pass --overwrite "
                "to replace its run, or choose another --out"
            )


def _check_writable_dir(flag: str, path: Path) -> None:
    """``path`` is a writable directory, or the directory it would be made in is writable."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise TrainError(f"{flag} {path}: {where}; give a directory")
    try:  # ask the file system, not the mode bits: root, ACLs and read-only mounts differ
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        what = "the directory" if existing == path else f"{existing}, where it would be made,"
        raise TrainError(
            f"{flag} {path}: {what} is not writable ({exc.strerror}); choose another directory"
        ) from None


# -- resume -------------------------------------------------------------------------


def resume_record(config: TrainConfig, name: str, vocab_size: int) -> dict[str, Any]:
    """What a checkpoint of run ``name`` records about how it was made (its ``extra``)."""
    record = {key: getattr(config, key) for key in _RESUMED}
    record.update(optimizer=name, vocab_size=vocab_size)
    return {"train": record}


def check_resume(config: TrainConfig, vocab_size: int) -> None:
    """With ``--resume``, the newest intact checkpoint of each run was made like this one."""
    if not config.resume or config.checkpoint_dir is None:
        return
    from hyper_parallel.checkpoint import CheckpointManager

    for name in [config.optimizer, *([config.compare] if config.compare else [])]:
        manager = CheckpointManager(config.checkpoint_dir / run_folder(name))
        found = manager.newest_intact()
        if found is None:
            continue
        made = found.extra.get("train")
        if isinstance(made, dict):
            _compare(config, vocab_size, name, made, found.path)


def run_folder(name: str) -> str:
    """A run's folder under ``--checkpoint-dir`` (``muon+adamw``: ``muon_adamw``)."""
    return name.replace("+", "_")


def _compare(
    config: TrainConfig, vocab_size: int, name: str, made: dict[str, Any], path: Path
) -> None:
    now = resume_record(config, name, vocab_size)["train"]
    for key in (*_RESUMED, "vocab_size"):
        if key not in made or made[key] == now[key]:
            continue
        if key == "vocab_size":
            raise TrainError(
                f"--data {config.data or '(built-in)'}: the checkpoint {path} was made with data "
                f"of {made[key]} distinct tokens, this data has {now[key]}; resume with the "
                "same --data and --tokenizer, or start without --resume"
            )
        flag = "--" + key.replace("_", "-")
        value = made[key]
        shown = (flag if value else "no " + flag) if isinstance(value, bool) else f"{flag} {value}"
        raise TrainError(
            f"{flag} {now[key]}: the checkpoint {path} was made with {shown}; pass that, or "
            "start without --resume"
        )


# -- memory -------------------------------------------------------------------------


def estimate_peak_bytes(config: TrainConfig, vocab_size: int) -> int:
    """A rough upper estimate of one process's peak memory for a training step, in bytes.

    Params with their gradients and optimizer state (16 bytes each: fp32
    param, gradient, and two moments at most), plus the activations kept for
    the backward pass: per token and block, the norms, q/k/v, attention
    output, the SwiGLU's four hidden-width tensors and the residuals (about
    ``12 d + 4 h``), the attention weights of every head over the sequence
    (``2 heads seq_len``), and the logits with their softmax and gradient
    (``3 vocab``), all fp32.
    """
    d, layers, hidden = config.dim, config.layers, -(-8 * config.dim // 3 // 32) * 32
    per_block = 4 * d * d + 3 * d * hidden + 2 * d
    params = layers * per_block + vocab_size * d * (1 if config.tied_embeddings else 2)
    params += config.seq_len * d
    per_token = layers * (12 * d + 4 * hidden + 2 * config.heads * config.seq_len)
    per_token += 3 * vocab_size + 4 * d
    tokens = config.batch_size * config.seq_len
    return 16 * params + 4 * tokens * per_token


def available_memory_bytes() -> int | None:
    """Memory this process can still use on the host: the smaller of free RAM and a cgroup limit.

    ``None`` where the platform does not say (the check is then skipped).
    """
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory(config: TrainConfig, vocab_size: int) -> None:
    """Refuse a run whose estimated peak (every process on this host) exceeds the free memory."""
    if config.sharding is not None and config.sharding != "local":
        return  # sharded runs may train on accelerators; their memory is theirs to size
    available = available_memory_bytes()
    if available is None:
        return
    need = estimate_peak_bytes(config, vocab_size)
    if need > available:
        gib = 2**30
        raise TrainError(
            f"--batch-size {config.batch_size}: a training step needs about {need / gib:,.1f} GiB "
            f"(estimated for --seq-len {config.seq_len}, --dim {config.dim}, --layers "
            f"{config.layers}), but {available / gib:,.1f} GiB is free; lower --batch-size or "
            "--seq-len"
        )
