"""Saving: :func:`save`, :func:`wait`, and the job a save hands to the saver."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from hyper_parallel.checkpoint._errors import NonFiniteStateError, world_size
from hyper_parallel.checkpoint._integrity import (
    FORMAT_VERSION,
)
from hyper_parallel.checkpoint._saving import SaveJob, saver
from hyper_parallel.checkpoint._shared import check_shared
from hyper_parallel.checkpoint._state import (
    OptimizerView,
    json_value,
    named_optimizers,
    split_optimizer,
)
from hyper_parallel.checkpoint._tensors import flat_tensors
from hyper_parallel.core.optimizer._nonfinite import non_finite

# -- save ------------------------------------------------------------------------


__all__ = ["make_job", "save", "wait"]


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
        NonFiniteStateError: a tensor to save holds NaN or Inf (named in the
            message); nothing is written, on every rank alike.
        CheckpointError: a value is neither a tensor nor JSON-serialisable, or
            the previous asynchronous save failed.
    """
    saver.submit(
        make_job(Path(path), model, optimizer, scheduler, step, extra), background=async_save
    )
    return Path(path)


def wait() -> None:
    """Wait until the asynchronous save in flight, if any, is committed.

    Raises:
        CheckpointError: that save (or an earlier asynchronous one) failed.
    """
    saver.wait()


def make_job(
    target: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None,
    step: int,
    extra: Mapping[str, Any] | None,
) -> SaveJob:
    """Everything a save of ``target`` writes, checked: plain values as JSON, tensors finite.

    Collective under a process group (the finiteness check agrees over it).
    """
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
    _refuse_non_finite(target, tensors)
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


def _refuse_non_finite(target: Path, tensors: dict[str, Any]) -> None:
    """Raise :class:`NonFiniteStateError` if any tensor to save holds NaN or Inf (every rank alike).

    One ``aminmax`` pass over what is saved and one small all-reduce: a small
    share of a synchronous save, a larger one of an asynchronous save's
    training stall (measured: docs/benchmarks.md, "Checkpoints: the NaN/Inf
    check and a load's staging copy").
    """
    bad = non_finite(flat_tensors(tensors))
    if bad:
        raise NonFiniteStateError(
            f"Refusing to save {target}: {bad.summary} holds NaN or Inf; a checkpoint never "
            "keeps non-finite state. The previous checkpoint is intact."
        )
