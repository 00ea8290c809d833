"""Atomic, verified, reshardable checkpoints of a model, a ChainedOptimizer and its scheduler.

Built on :mod:`torch.distributed.checkpoint` (DCP): the model and every
sub-optimizer go through ``get_model_state_dict`` / ``get_optimizer_state_dict``
and back through ``set_model_state_dict`` / ``set_optimizer_state_dict``, so one
checkpoint loads on one process (no process group), on FSDP/HSDP, and at
another world size (DCP reshards).

Layout of ``root`` as written by :class:`CheckpointManager`::

    root/
        step_00000010/          # one checkpoint
            .metadata, *.distcp # DCP: tensors only (model, optimizer state, fp32 main params)
            hyper_parallel.json # manifest: step, extra, scheduler, group hyperparams,
                                # and the size and checksum of every other file
        latest                  # name of the newest complete checkpoint

**Saving is atomic.** Everything is written into ``root/.tmp-<name>``; every
file is fsync'd and checksummed, the manifest is written, and only then does
rank 0 rename the directory into place and replace ``latest``. A crash at any
point leaves the previous checkpoint and pointer intact. With
``async_save=True`` the state is copied to CPU memory and the rest happens
behind training (at most one save in flight; :func:`wait` joins it).

**Loading is verified.** Before any value reaches the model, optimizer or
scheduler, every file is checked against the manifest (the ranks share the
work and agree), so a flipped bit, a truncated copy or a missing file is a
:class:`CorruptCheckpointError` naming the checkpoint and the file, and the
objects passed in are left as they were. :func:`load_latest` then falls back
to the newest intact checkpoint, with a warning.

**Ranks agree.** Under a process group, every rank first proves that it sees
the same directory as the others (a disk local to each node is a
:class:`CheckpointError` naming it, on every rank), and ``load_latest``
loads the checkpoint rank 0 chose, on every rank.

Examples:
    >>> manager = CheckpointManager("ckpt", keep_last=3)
    >>> manager.save(step, model=model, optimizer=optimizer, scheduler=scheduler)
    >>> start = manager.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.optim import Optimizer

from hyper_parallel.checkpoint._errors import (
    CheckpointError,
    CorruptCheckpointError,
    is_dist,
    reason,
    world_size,
)
from hyper_parallel.checkpoint._integrity import (
    FORMAT_VERSION,
    MANIFEST,
    verified_manifest,
)
from hyper_parallel.checkpoint._saving import SaveJob, new_stager, saver
from hyper_parallel.checkpoint._shared import agreed, check_shared
from hyper_parallel.checkpoint._state import (
    GROUP_TENSOR_PREFIX,
    OptimizerView,
    SafeReader,
    json_value,
    like,
    named_optimizers,
    split_optimizer,
)
from hyper_parallel.core.compat import checkpoint_fqn
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer._main_params import (
    warn_main_params_dropped,
    warn_main_params_rebuilt,
)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "Verified",
    "find_checkpoints",
    "load",
    "load_latest",
    "save",
    "verify",
    "wait",
]

LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" load warning; no process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


# -- save ------------------------------------------------------------------------


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
) -> Path:
    """Save a checkpoint into the directory ``path``, atomically.

    Call it on every rank. It does not touch any ``latest`` pointer;
    :class:`CheckpointManager` does.

    Args:
        path: The checkpoint directory to create (an older one there is replaced).
        model: The model (plain, FSDP or HSDP).
        optimizer: A :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`
            (each sub-optimizer is saved under its name) or a plain optimizer.
        scheduler: An LR scheduler whose ``state_dict()`` holds plain values
            (e.g. :class:`~hyper_parallel.core.optimizer.HyperLRScheduler`).
        step: The training step, returned by :func:`load`.
        extra: Anything JSON-serialisable to keep with the checkpoint.
        async_save: Return once the state is copied to CPU memory and write,
            checksum and commit it in the background. A save in flight is
            waited for first; :func:`wait` (or process exit) waits for this one.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CheckpointError: a value is neither a tensor nor JSON-serialisable, or
            the previous asynchronous save failed.
    """
    saver.submit(_job(Path(path), model, optimizer, scheduler, step, extra), background=async_save)
    return Path(path)


def wait() -> None:
    """Wait until the asynchronous save in flight, if any, is committed.

    Raises:
        CheckpointError: that save (or an earlier asynchronous one) failed.
    """
    saver.wait()


def _job(
    target: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None,
    step: int,
    extra: Mapping[str, Any] | None,
) -> SaveJob:
    check_shared(target.parent)
    named = named_optimizers(optimizer)
    view = OptimizerView(model, optimizer)
    tensors: dict[str, Any] = {"model": get_model_state_dict(model), "optim": {}}
    if view.mains:
        tensors["main"] = view.mains
    plain: dict[str, Any] = {}
    for name, opt in named.items():
        tensors["optim"][name], plain[name] = split_optimizer(
            get_optimizer_state_dict(view.module, opt), name
        )
    meta = {
        "format": "hyper_parallel.checkpoint",
        "version": FORMAT_VERSION,
        "step": int(step),
        "extra": json_value(dict(extra or {}), "extra"),
        "optimizers": list(named),
        "main_params": sorted(view.mains),
        "optimizer_plain": plain,
        "scheduler": None
        if scheduler is None
        else json_value(scheduler.state_dict(), "scheduler state"),
        "world_size": world_size(),
    }
    return SaveJob(tensors, meta, target)


# -- load ------------------------------------------------------------------------


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
) -> int:
    """Load a checkpoint written by :func:`save` into ``model``, ``optimizer``, ``scheduler``.

    Call it on every rank. The objects may be freshly built (the optimizer
    need not have stepped) and sharded differently from when the checkpoint
    was written; DCP reshards. Every file is verified against the manifest
    first; on any error the objects are left as they were.

    Args:
        path: A checkpoint directory.
        model: The model to load into.
        optimizer: The optimizer to load into; its sub-optimizer names must be
            those saved.
        scheduler: The scheduler to load into, if one was saved.

    Returns:
        The ``step`` given to :func:`save`.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or changed, or
            the manifest is unreadable (on every rank alike).
        CheckpointError: ``path`` is missing or not a checkpoint, the
            sub-optimizer names or param groups differ, or a scheduler is
            given but none was saved.
    """
    saver.wait()  # never read a checkpoint this process is still writing
    ckpt = Path(path)
    check_shared(ckpt.parent)
    return _load_verified(ckpt, verified_manifest(ckpt), model, optimizer, scheduler)


def _load_verified(
    ckpt: Path, meta: Mapping[str, Any], model: nn.Module, optimizer: Optimizer, scheduler: Any
) -> int:
    """:func:`load` once every file of ``ckpt`` has been checked against ``meta``."""
    named = named_optimizers(optimizer)
    view = OptimizerView(model, optimizer)
    _check_fits(ckpt, meta, named, view, scheduler)
    model_sd = get_model_state_dict(model)
    current: dict[str, Any] = {}
    tensors: dict[str, Any] = {"model": model_sd, "optim": {}}
    saved_mains = bool(meta.get("main_params"))
    if view.mains and saved_mains:
        tensors["main"] = view.mains  # DCP loads into the main copies in place
    for name, opt in named.items():
        current[name] = get_optimizer_state_dict(view.module, opt)  # creates lazy state
        tensors["optim"][name], _ = split_optimizer(current[name], name)
    with _quiet_single_process():
        reader = SafeReader(ckpt)
        reader.read_metadata()  # refuse unsafe metadata here, with our error, before DCP reads it
        try:
            _dcp_load(tensors, storage_reader=reader, no_dist=not is_dist())
        except CheckpointException as exc:
            raise CheckpointError(f"{ckpt} does not fit the objects given: {reason(exc)}") from exc
    set_model_state_dict(model, model_sd)
    if view.mains and not saved_mains:
        view.main_params.params_to_mains()
        warn_main_params_rebuilt(str(ckpt))
    elif saved_mains and not view.mains:
        warn_main_params_dropped(str(ckpt))
    for name, opt in named.items():
        _restore_plain(current[name], meta["optimizer_plain"][name], tensors["optim"][name])
        set_optimizer_state_dict(view.module, opt, current[name])
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def _restore_plain(
    osd: dict[str, Any], plain: Mapping[str, Any], loaded: Mapping[str, Any]
) -> None:
    """Put the JSON values and the loaded tensors back into an optimizer state dict."""
    for fqn, state in osd["state"].items():
        state.update(loaded["state"].get(fqn, {}))
        state.update(plain["state"].get(fqn, {}))
    for index, group in enumerate(osd["param_groups"]):
        for key, value in plain["param_groups"][index].items():
            if key != "params":
                group[key] = like(value, group.get(key))
        group.update(loaded[GROUP_TENSOR_PREFIX].get(str(index), {}))


def _check_fits(
    ckpt: Path,
    meta: Mapping[str, Any],
    named: Mapping[str, Optimizer],
    view: OptimizerView,
    scheduler: Any | None,
) -> None:
    """Refuse a checkpoint that does not fit the objects given, before anything changes."""
    if sorted(named) != sorted(meta["optimizers"]):  # by name: the chain's order may differ
        raise CheckpointError(
            f"{ckpt} holds optimizers {meta['optimizers']}, but the optimizer given has "
            f"{list(named)}; build the optimizer the checkpoint was saved with."
        )
    if scheduler is not None and meta["scheduler"] is None:
        raise CheckpointError(f"{ckpt} holds no scheduler state, but a scheduler was given.")
    _check_main_params(ckpt, meta, view)
    fqn = {id(p): checkpoint_fqn(view.module, n) for n, p in view.module.named_parameters()}
    for name, opt in named.items():
        saved = meta["optimizer_plain"][name]["param_groups"]
        if len(saved) != len(opt.param_groups):
            raise CheckpointError(
                f"Optimizer {name!r} has {len(opt.param_groups)} param groups; {ckpt} "
                f"holds {len(saved)}."
            )
        for index, (group, held) in enumerate(zip(opt.param_groups, saved, strict=True)):
            if sorted(fqn.get(id(p), "?") for p in group["params"]) != sorted(held["params"]):
                raise CheckpointError(
                    f"Optimizer {name!r} param group {index} holds different params than in {ckpt}."
                )


def _check_main_params(ckpt: Path, meta: Mapping[str, Any], view: OptimizerView) -> None:
    """Main copies saved and kept must be of the same params (one side without them is fine)."""
    saved, have = meta.get("main_params", []), sorted(view.mains)
    if saved == have or not saved or not have:
        return
    raise CheckpointError(
        f"{ckpt} holds fp32 main params for {len(saved)} params, the optimizer given has them "
        f"for {len(have)}; they differ at "
        f"{', '.join(sorted(set(saved) ^ set(have))[:5])}."
    )


# -- the newest intact checkpoint ------------------------------------------------


def _candidates(root: Path) -> list[Path]:
    """The checkpoints under ``root`` to try, best first: ``latest``'s, then newest step first."""
    steps = [path for _, path in sorted(_step_dirs(root), reverse=True)]
    pointer = root / LATEST_FILE
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in steps:
            steps.remove(named)
            steps.insert(0, named)
    return steps


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
) -> int | None:
    """Load the newest intact checkpoint under ``root``.

    Tries the checkpoint ``latest`` names, then every ``step_*`` directory,
    newest first. One that fails verification (corrupt, or no checkpoint at
    all) is skipped with a :class:`UserWarning` naming it and why; nothing is
    loaded from it.

    Returns:
        The step loaded, or ``None`` when ``root`` holds no checkpoint.

    Raises:
        CorruptCheckpointError: no checkpoint under ``root`` is intact (the
            message lists each and why).
        CheckpointError: the newest intact checkpoint does not fit the objects
            given (see :func:`load`).
    """
    saver.wait()
    check_shared(Path(root))
    tried = []
    # rank 0 chooses the order to try; every rank verifies each alike (collectively)
    for ckpt in [Path(root) / name for name in agreed([c.name for c in _candidates(Path(root))])]:
        try:
            meta = verified_manifest(ckpt)
        except CheckpointError as exc:
            warnings.warn(f"Skipping a corrupt checkpoint. {exc}", UserWarning, stacklevel=2)
            tried.append(f"{ckpt.name}: {exc}")
            continue
        return _load_verified(ckpt, meta, model, optimizer, scheduler)
    if not tried:
        return None
    raise CorruptCheckpointError(
        f"No intact checkpoint under {root}; tried {len(tried)}:\n  " + "\n  ".join(tried)
    )


# -- verify ----------------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    """One checkpoint checked by :func:`verify`: intact, or why not."""

    path: Path
    error: str | None = None
    step: int | None = None
    files: int = 0
    bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what ``save(extra=...)`` kept
    checksums: bool = True  # False: saved before checksums (format 1), nothing to check against

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        """One line for a terminal: ``ok`` or ``CORRUPT``, the path, and what was found."""
        if not self.ok:
            return f"CORRUPT  {self.path}  {self.error}"
        if not self.checksums:
            return f"ok?      {self.path}  (step {self.step}; saved without checksums, unverified)"
        return f"ok       {self.path}  (step {self.step}, {self.files} files, {self.bytes:,} bytes)"


def verify(path: str | os.PathLike[str]) -> Verified:
    """Check one checkpoint's files against its manifest, in this process alone.

    Returns:
        What was found; :attr:`Verified.ok` is ``False`` for a corrupt one (or
        a path that is no checkpoint), with the reason.
    """
    ckpt = Path(path)
    try:
        meta = verified_manifest(ckpt, collective=False)
    except CheckpointError as exc:
        return Verified(ckpt, error=str(exc))
    files = meta.get("files", {}).values()
    total = sum(f["bytes"] for f in files)
    return Verified(
        ckpt, None, int(meta["step"]), len(files), total, dict(meta["extra"]), "files" in meta
    )


def _looks_like_checkpoint(path: Path) -> bool:
    return bool(_STEP_DIR.match(path.name)) or any(
        (path / name).is_file() for name in (MANIFEST, ".metadata")
    )


def find_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """``root`` if it is a checkpoint, else every checkpoint below it, sorted.

    Unfinished saves (``.tmp-*``) are not checkpoints and are left out.
    """
    top = Path(root)
    if _looks_like_checkpoint(top):
        return [top]
    found = []
    for directory, subdirs, _ in os.walk(top):
        here = Path(directory)
        kept = []
        for name in sorted(subdirs):
            if name.startswith((".tmp-", ".old-")):
                continue
            if _looks_like_checkpoint(here / name):
                found.append(here / name)
            else:
                kept.append(name)
        subdirs[:] = kept
    return found


# -- manager ---------------------------------------------------------------------


class CheckpointManager:
    """Numbered checkpoints under one directory, with a ``latest`` pointer and retention.

    Args:
        root: The directory holding ``step_<N>`` checkpoints.
        keep_last: How many checkpoints to keep (the newest); ``None`` keeps all.
        async_save: Save in the background (see :func:`save`); the pointer
            moves and old checkpoints go only once the new one is committed.
            The manager keeps its CPU copy of the state between saves, so
            later saves copy into it instead of allocating anew.

    Under a process group, make it on every rank: it checks, collectively,
    that every rank sees the same ``root`` (each writes a marker file there
    and looks for the others'), before anything is saved or loaded.

    Raises:
        CheckpointError: some rank does not see the files the others wrote in
            ``root`` (a disk local to each node); the message names ``root``
            and that rank, on every rank alike.

    Examples:
        >>> manager = CheckpointManager("ckpt", keep_last=2)
        >>> manager.save(100, model=model, optimizer=opt, scheduler=sched)
        >>> manager.load_latest(model=model, optimizer=opt, scheduler=sched)
        100
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise HyperParallelValueError(
                f"keep_last must be an int >= 1 or None, got {keep_last!r}."
            )
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self._stager: DefaultStager | None = None  # one CPU copy of the state, reused
        check_shared(self.root)

    def path_for(self, step: int) -> Path:
        """The directory of the checkpoint at ``step``."""
        return self.root / f"step_{int(step):08d}"

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: Any | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save at ``step`` (see :func:`save`); once committed, move ``latest`` and prune.

        Returns:
            The new checkpoint's directory (still being written when asynchronous).
        """
        job = _job(self.path_for(step), model, optimizer, scheduler, step, extra)
        job.on_commit = self._committed
        if self.async_save and self._stager is None:
            self._stager = new_stager()
        saver.submit(job, background=self.async_save, stager=self._stager)
        return job.target

    def _committed(self, target: Path) -> None:
        """Point ``latest`` at ``target`` and prune (rank 0, after the rename)."""
        pointer_tmp = self.root / f".{LATEST_FILE}.tmp"
        pointer_tmp.write_text(target.name + "\n")
        os.replace(pointer_tmp, self.root / LATEST_FILE)
        if self.keep_last is not None:
            for _, old in _step_dirs(self.root)[: -self.keep_last]:
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the save in flight (see :func:`wait`)."""
        saver.wait()

    def newest_intact(self) -> Verified | None:
        """The checkpoint :meth:`load_latest` would load, checked in this process alone; or ``None``."""
        for ckpt in _candidates(self.root):
            found = verify(ckpt)
            if found.ok:
                return found
        return None

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names (else the newest ``step_*``), or ``None``; unverified."""
        candidates = _candidates(self.root)
        return candidates[0] if candidates else None

    def load_latest(
        self, *, model: nn.Module, optimizer: Optimizer, scheduler: Any | None = None
    ) -> int | None:
        """Load the newest intact checkpoint (see :func:`load_latest`); ``None`` if there is none."""
        return load_latest(self.root, model=model, optimizer=optimizer, scheduler=scheduler)
