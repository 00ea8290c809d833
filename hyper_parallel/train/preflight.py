"""What ``hyper-parallel train`` checks before its first step: paths, a resume, memory.

Each failure is a :class:`~hyper_parallel.train.config.TrainError` naming the
flag, the value and the fix, raised before any model is built, any step runs
or anything is written (the command line prints it as one line, exit 2).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyper_parallel.train.config import TrainConfig, TrainError, config_fields

if TYPE_CHECKING:
    from hyper_parallel.checkpoint import Verified
    from hyper_parallel.train.data import TokenizedText

__all__ = [
    "RUN_OUTPUTS",
    "available_memory_bytes",
    "check_dependencies",
    "check_memory",
    "check_paths",
    "check_resume",
    "estimate_peak_bytes",
    "launched_world_size",
    "resume_record",
    "run_folder",
    "run_folders_locked",
    "run_names",
]

#: The files a run writes into ``--out``.
RUN_OUTPUTS = ("metrics.jsonl", "loss_curves.png", "summary.json")


# -- paths --------------------------------------------------------------------------


def check_dependencies(config: TrainConfig) -> None:
    """The packages of the ``train`` extra that this run imports: the plot's, and the bar's.

    Checked before anything is written, so that a run refused for one leaves
    nothing behind that blocks its retry.
    """
    needed = {"matplotlib": "the loss plot"}
    if config.progress:
        needed["tqdm"] = "the progress bar (--no-progress goes without it)"
    missing = {name: why for name, why in needed.items() if not _importable(name)}
    if missing:
        what = "; ".join(f"{name}, for {why}" for name, why in missing.items())
        raise TrainError(
            f"hyper-parallel train needs packages that are not installed ({what}); "
            'install them with: pip install "hyper-parallel[train]"'
        )


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one
        return False


def check_paths(config: TrainConfig) -> None:
    """``--out``, ``--checkpoint-dir`` and each run's folder in it are (or can become) writable directories.

    A ``--out`` that already holds a run is refused unless ``--overwrite``
    (which replaces that run's files) or ``--resume`` (which continues it).
    """
    _check_writable_dir("--out", config.out)
    if config.checkpoint_dir is not None:
        _check_writable_dir("--checkpoint-dir", config.checkpoint_dir)
        for name in run_names(config):  # each run saves into a folder of its own there
            _check_writable_dir("--checkpoint-dir", config.checkpoint_dir / run_folder(name))
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


@contextlib.contextmanager
def run_folders_locked(config: TrainConfig) -> Iterator[None]:
    """Hold the writer lock of each run's folder under ``--checkpoint-dir`` (rank 0) while inside.

    A second run on the same folders stops here, before anything is written;
    a run whose holder died takes the folder (the kernel dropped its lock).
    """
    from hyper_parallel.checkpoint import CheckpointError
    from hyper_parallel.checkpoint._lock import hold, release

    held: list[Path] = []
    try:
        if config.checkpoint_dir is not None and os.environ.get("RANK", "0") == "0":
            for name in run_names(config):
                folder = config.checkpoint_dir / run_folder(name)
                try:
                    hold(folder)
                except CheckpointError as exc:
                    raise TrainError(f"--checkpoint-dir {config.checkpoint_dir}: {exc}") from None
                held.append(folder)
        yield
    finally:
        for folder in held:
            release(folder)


# -- resume -------------------------------------------------------------------------

#: The record keys that say whether two runs see the same data (``--data`` may move).
_SAME_DATA = ("data_digest", "vocab_size")


def resume_record(
    config: TrainConfig, name: str, data: TokenizedText, world_size: int
) -> dict[str, Any]:
    """What a checkpoint of run ``name`` records about how it was made (its ``extra``).

    Every option that changes the numbers (:attr:`Option.recorded`), the
    warmup in effect, a digest of the data, the number of processes (each
    draws its own batches) and torch's threads (which a resume keeps).
    """
    import torch

    record: dict[str, Any] = {}
    for f in config_fields():
        if f.option.recorded:
            value = getattr(config, f.name)
            record[f.name] = str(value) if isinstance(value, Path) else value
    record.update(
        warmup_steps=config.warmup,
        optimizer=name,
        vocab_size=data.vocab_size,
        data_digest=data.digest(),
        world_size=world_size,
        threads=torch.get_num_threads(),  # not refused when it differs: resumed_threads keeps it
    )
    return {"train": record}


def check_resume(config: TrainConfig, data: TokenizedText) -> dict[str, Verified | None]:
    """With ``--resume``, each run's newest intact checkpoint, checked to be made like this run.

    Returns:
        Each run's newest intact checkpoint (``None``: none yet); empty without ``--resume``.

    Raises:
        TrainError: a checkpoint was made with another value of an option that
            changes the numbers; the message names the flag and the value.
    """
    if not config.resume or config.checkpoint_dir is None:
        return {}
    from hyper_parallel.checkpoint import CheckpointManager

    found: dict[str, Verified | None] = {}
    for name in run_names(config):
        folder = config.checkpoint_dir / run_folder(name)
        newest = CheckpointManager(folder, lock=False).newest_intact()  # it only reads
        found[name] = newest
        made = newest.extra.get("train") if newest is not None else None
        if newest is not None and isinstance(made, dict):
            now = resume_record(config, name, data, launched_world_size())["train"]
            _refuse_changes(config, made, now, newest.path)
    return found


def run_names(config: TrainConfig) -> list[str]:
    """The runs of one ``train`` call, in order: ``--optimizer``'s, then ``--compare``'s."""
    return [config.optimizer, *([config.compare] if config.compare else [])]


def run_folder(name: str) -> str:
    """A run's folder under ``--checkpoint-dir`` (``muon+adamw``: ``muon_adamw``)."""
    return name.replace("+", "_")


def launched_world_size() -> int:
    """How many processes the launcher started (torchrun's ``WORLD_SIZE``; 1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


#: Recorded but never refused: --data is compared by its digest (the same text may have
#: moved), and a resumed run takes the saved thread count (``resumed_threads``).
_NOT_REFUSED = frozenset({"data", "threads"})


def _refuse_changes(
    config: TrainConfig, made: dict[str, Any], now: dict[str, Any], path: Path
) -> None:
    """Raise for the first recorded value that differs."""
    for key in now:  # in the order of the flags
        value = made.get(key, now[key])  # a key older checkpoints lack is not checked
        if key in _NOT_REFUSED or now[key] == value:
            continue
        if key in _SAME_DATA:
            before = made.get("data") or "the built-in data"
            raise TrainError(
                f"--data {config.data or '(built-in)'}: the checkpoint {path} was made with "
                f"other data ({before}, --tokenizer {made.get('tokenizer', 'char')}); resume "
                "with that --data and --tokenizer, or start without --resume"
            )
        if key == "world_size":
            raise TrainError(
                f"{now[key]} processes: the checkpoint {path} was made by {value}, and each "
                f"process draws its own batches; launch {value} (torchrun --nproc_per_node), "
                "or start without --resume"
            )
        flag = "--" + key.replace("_", "-")
        raise TrainError(
            f"{_shown(flag, now[key])}: the checkpoint {path} was made with "
            f"{_shown(flag, value)}; pass that, or start without --resume"
        )


def _shown(flag: str, value: Any) -> str:
    """``--lr 0.003``; a switch or an unset option as ``--tied-embeddings`` / ``no --sharding``."""
    if isinstance(value, bool) or value is None:
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


# -- memory -------------------------------------------------------------------------


def estimate_peak_bytes(config: TrainConfig, vocab_size: int) -> int:
    """A rough upper estimate of one process's peak memory for a training step, in bytes.

    The model (:func:`_model_bytes`) plus ``--batch-size`` sequences'
    activations (:func:`_sequence_bytes`).
    """
    return _model_bytes(config, vocab_size) + config.batch_size * _sequence_bytes(
        config, vocab_size
    )


def _model_bytes(config: TrainConfig, vocab_size: int) -> int:
    """Params with their gradients and optimizer state: 16 bytes each (fp32 param,
    gradient, and two moments at most)."""
    d, hidden = config.dim, -(-8 * config.dim // 3 // 32) * 32
    per_block = 4 * d * d + 3 * d * hidden + 2 * d
    params = config.layers * per_block + vocab_size * d * (1 if config.tied_embeddings else 2)
    return 16 * (params + config.seq_len * d)


def _sequence_bytes(config: TrainConfig, vocab_size: int) -> int:
    """The activations one sequence keeps for the backward pass, all fp32.

    Per token and block, the norms, q/k/v, attention output, the SwiGLU's four
    hidden-width tensors and the residuals (about ``12 d + 4 h``), the
    attention weights of every head over the sequence (``2 heads seq_len``);
    per token, the logits with their softmax and gradient (``3 vocab``).
    """
    d, hidden = config.dim, -(-8 * config.dim // 3 // 32) * 32
    per_token = config.layers * (12 * d + 4 * hidden + 2 * config.heads * config.seq_len)
    per_token += 3 * vocab_size + 4 * d
    return 4 * config.seq_len * per_token


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
        raise TrainError(_too_large(config, vocab_size, need, available))


def _too_large(config: TrainConfig, vocab_size: int, need: int, available: int) -> str:
    """The refusal of a run that does not fit: it names what is too large, and how far to lower it."""
    gib = 2**30
    free = f"but {available / gib:,.1f} GiB is free"
    model = _model_bytes(config, vocab_size)
    if model > available:
        return (
            f"--dim {config.dim} and --layers {config.layers}: the model's params, gradients "
            f"and optimizer state alone need about {model / gib:,.1f} GiB, {free}; lower --dim "
            "(the model grows with its square) or --layers"
        )
    per_sequence = _sequence_bytes(config, vocab_size)
    fits = (available - model) // per_sequence
    if fits < 1:
        return (
            f"--seq-len {config.seq_len}: one sequence's activations need about "
            f"{per_sequence / gib:,.1f} GiB besides the model's {model / gib:,.1f} GiB "
            f"(--dim {config.dim}, --layers {config.layers}), {free}; lower --seq-len or --dim"
        )
    return (
        f"--batch-size {config.batch_size}: a training step needs about {need / gib:,.1f} GiB "
        f"(estimated for --seq-len {config.seq_len}, --dim {config.dim}, --layers "
        f"{config.layers}), {free}; lower --batch-size to {fits} or less, or --seq-len"
    )
