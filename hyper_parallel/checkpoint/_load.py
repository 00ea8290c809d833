"""Loading: :func:`load` and :func:`load_latest`, verified before anything changes."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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
)
from hyper_parallel.checkpoint._integrity import (
    verified_manifest,
)
from hyper_parallel.checkpoint._layout import candidates
from hyper_parallel.checkpoint._saving import saver
from hyper_parallel.checkpoint._shared import agreed, check_shared
from hyper_parallel.checkpoint._state import (
    GROUP_TENSOR_PREFIX,
    OptimizerView,
    SafeReader,
    like,
    named_optimizers,
    split_optimizer,
)
from hyper_parallel.core.compat import checkpoint_fqn
from hyper_parallel.core.optimizer._main_params import (
    warn_main_params_dropped,
    warn_main_params_rebuilt,
)

__all__ = ["load", "load_latest"]


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" load warning; no process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


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


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
) -> int | None:
    """Load the newest intact checkpoint under ``root``.

    Tries every ``step_*`` directory, newest first (whatever ``latest``
    says: it may lag after a full disk or a crash). One that fails verification (corrupt, or no checkpoint at
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
    for ckpt in [Path(root) / name for name in agreed([c.name for c in candidates(Path(root))])]:
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
