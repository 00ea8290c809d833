"""Loading: :func:`load` and :func:`load_latest`, which change nothing unless they succeed.

A load reads into a staging copy of the tensors it loads (this rank's shards
of the model, optimizer state and fp32 main params) and checks them, and
only then copies them into the objects given. A file that fails its checksum,
a tensor that cannot be read, a shape that does not fit or NaN/Inf in the
checkpoint each raise before anything given has changed. The cost is that
staging copy: a rank holds its share of the checkpoint twice until the load
commits.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
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
    NonFiniteStateError,
    interrupt_in,
    is_dist,
    reason,
)
from hyper_parallel.checkpoint._integrity import verified_manifest
from hyper_parallel.checkpoint._layout import candidates
from hyper_parallel.checkpoint._saving import saver
from hyper_parallel.checkpoint._shared import agreed, agreed_value, check_shared, first_problem
from hyper_parallel.checkpoint._state import (
    GROUP_TENSOR_PREFIX,
    OptimizerView,
    SafeReader,
    like,
    named_optimizers,
    quiet_single_process,
    split_optimizer,
)
from hyper_parallel.checkpoint._tensors import (
    REMOVED_WHILE_READ,
    first_unreadable,
    flat_tensors,
    read_metadata,
)
from hyper_parallel.core.compat import checkpoint_fqn
from hyper_parallel.core.optimizer._main_params import (
    warn_main_params_dropped,
    warn_main_params_rebuilt,
)
from hyper_parallel.core.optimizer._nonfinite import non_finite

__all__ = ["load", "load_latest"]


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
    first, and the tensors are read into a staging copy and checked before
    any of them is copied in: on any error the model, optimizer, scheduler
    and main params are left exactly as they were.

    Args:
        path: A checkpoint directory.
        model: The model to load into.
        optimizer: The optimizer to load into; its sub-optimizer names must be
            those saved.
        scheduler: The scheduler to load into, if one was saved.

    Returns:
        The ``step`` given to :func:`save`.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or changed, the
            manifest is unreadable, or a tensor cannot be read back (the
            message names the file, the tensor and why); on every rank alike.
        NonFiniteStateError: a tensor in the checkpoint holds NaN or Inf.
        CheckpointError: ``path`` is missing or not a checkpoint, the
            sub-optimizer names, param groups or tensor shapes differ
            ("does not fit"), the checkpoint was removed while it was read,
            or a scheduler is given but none was saved.
    """
    saver.wait()  # never read a checkpoint this process is still writing
    ckpt = Path(path)
    check_shared(ckpt.parent)
    return _load_verified(ckpt, verified_manifest(ckpt), model, optimizer, scheduler)


@dataclass
class _Loading:
    """One load in progress: the live state dicts, and the staged tensors read for them."""

    model_sd: dict[str, Any]
    optim_sds: dict[str, dict[str, Any]]  # each sub-optimizer's DCP state dict (live tensors)
    staged: dict[str, Any]  # "model", "optim" (by name), "main": fresh tensors DCP reads into
    mains: dict[str, torch.Tensor]  # the live fp32 main copies the staged "main" goes into

    @classmethod
    def start(
        cls, view: OptimizerView, named: Mapping[str, Optimizer], saved_mains: bool
    ) -> _Loading:
        """The state to load into (an optimizer that never stepped gets its lazy state)."""
        model_sd = get_model_state_dict(view.model)
        optim_sds = {
            name: get_optimizer_state_dict(view.module, opt) for name, opt in named.items()
        }
        mains = view.mains if saved_mains else {}
        staged: dict[str, Any] = {
            "model": _empty_like(model_sd),
            "optim": {n: _empty_like(split_optimizer(sd, n)[0]) for n, sd in optim_sds.items()},
        }
        if mains:
            staged["main"] = _empty_like(mains)
        return cls(model_sd, optim_sds, staged, mains)


def _empty_like(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with every tensor replaced by an uninitialised one like it (DTensors stay sharded)."""
    return {
        key: _empty_like(value) if isinstance(value, Mapping) else torch.empty_like(value)
        for key, value in tree.items()
        if isinstance(value, (Mapping, torch.Tensor))
    }


def _load_verified(
    ckpt: Path, meta: Mapping[str, Any], model: nn.Module, optimizer: Optimizer, scheduler: Any
) -> int:
    """:func:`load` once every file of ``ckpt`` has been checked against ``meta``."""
    named = named_optimizers(optimizer)
    view = OptimizerView(model, optimizer)
    _check_fits(ckpt, meta, named, view, scheduler)
    never_stepped = [opt for opt in named.values() if not opt.state]
    scheduler_before = None if scheduler is None else scheduler.state_dict()
    try:
        loading = _Loading.start(view, named, bool(meta.get("main_params")))
        _read_staged(ckpt, loading.staged)
        if scheduler is not None:
            _load_scheduler(ckpt, scheduler, meta["scheduler"])
    except BaseException:
        for opt in never_stepped:  # its lazy state was made for this load only
            opt.state.clear()
        if scheduler_before is not None:
            scheduler.load_state_dict(scheduler_before)
        raise
    _commit(ckpt, meta, loading, view, named)
    return int(meta["step"])


def _load_scheduler(ckpt: Path, scheduler: Any, saved: Mapping[str, Any]) -> None:
    """Load the scheduler's plain state; one it refuses (another schedule) does not fit."""
    try:
        scheduler.load_state_dict(saved)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{ckpt} does not fit the scheduler given: {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_staged(ckpt: Path, staged: dict[str, Any]) -> None:
    """Read ``ckpt``'s tensors into ``staged`` and check them: they fit, read back, and are finite."""
    wanted = dict(flat_tensors(staged))
    try:
        metadata, problem = read_metadata(ckpt), None
    except (OSError, EOFError, CheckpointError) as exc:
        metadata, problem = None, f"its DCP metadata cannot be read ({reason(exc)})"
    if (problem := first_problem(problem)) is not None or metadata is None:  # every rank alike
        raise _unreadable(ckpt, list(wanted), problem or "another rank could not read it")
    _check_shapes(ckpt, metadata.state_dict_metadata, wanted)
    with quiet_single_process():
        try:
            _dcp_load(staged, storage_reader=SafeReader(ckpt), no_dist=not is_dist())
        except (CheckpointException, OSError, RuntimeError) as exc:  # on every rank alike
            if (interrupt := interrupt_in(exc)) is not None:
                raise interrupt from None
            raise _unreadable(ckpt, list(wanted), reason(exc)) from None
    bad = non_finite(wanted)
    if bad:
        raise NonFiniteStateError(
            f"{ckpt} holds NaN or Inf in {bad.summary}; nothing was loaded. Load an earlier "
            "checkpoint."
        )


def _check_shapes(ckpt: Path, saved: Mapping[str, Any], wanted: Mapping[str, torch.Tensor]) -> None:
    """Refuse, as not fitting, a tensor to load that the checkpoint lacks or holds at another shape."""
    for key, tensor in wanted.items():
        held = saved.get(key)
        if not isinstance(held, TensorStorageMetadata):
            raise CheckpointError(f"{ckpt} does not fit the objects given: it holds no {key}.")
        if tuple(held.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{ckpt} does not fit the objects given: {key} is {list(held.size)} there and "
                f"{list(tensor.shape)} here."
            )


def _unreadable(ckpt: Path, keys: list[str], said: str) -> CheckpointError:
    """The error for a read that failed: the file, the tensor and why, in one line.

    Rank 0's diagnosis is every rank's, so all raise the same class (a
    ``load_latest`` that skips on one rank skips on all). Only a tensor that
    reads back wrong makes the checkpoint corrupt; a failure that no single
    tensor reproduces (memory, a collective) is a plain error, never skipped.
    """
    why, removed = agreed_value((first_unreadable(ckpt, keys), not ckpt.is_dir()))
    if removed:
        return CheckpointError(
            f"Cannot load {ckpt}: {REMOVED_WHILE_READ}; nothing was loaded. Load again."
        )
    if why is None:
        return CheckpointError(
            f"Cannot load {ckpt}: {said.strip().splitlines()[0]}; nothing was loaded."
        )
    return CorruptCheckpointError(
        f"Cannot load {ckpt}: {why}. Nothing was loaded; load an earlier checkpoint."
    )


def _commit(
    ckpt: Path,
    meta: Mapping[str, Any],
    loading: _Loading,
    view: OptimizerView,
    named: Mapping[str, Optimizer],
) -> None:
    """Copy what was read and checked into the objects given; nothing here reads the checkpoint."""
    staged = loading.staged
    set_model_state_dict(view.model, _with_tensors(loading.model_sd, staged["model"]))
    for fqn, main in loading.mains.items():
        main.copy_(staged["main"][fqn])
    if view.mains and not loading.mains:
        view.main_params.params_to_mains()
        warn_main_params_rebuilt(str(ckpt))
    elif meta.get("main_params") and not view.mains:
        warn_main_params_dropped(str(ckpt))
    for name, opt in named.items():
        osd = loading.optim_sds[name]
        _restore_plain(osd, meta["optimizer_plain"][name], staged["optim"][name])
        set_optimizer_state_dict(view.module, opt, osd)


def _with_tensors(tree: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with the tensors of ``tensors`` (same keys) in place of its own."""
    return {
        key: _with_tensors(value, tensors[key])
        if isinstance(value, dict)
        else tensors.get(key, value)
        for key, value in tree.items()
    }


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
    says: it may lag after a full disk or a crash). One that is corrupt,
    holds NaN or Inf, or is no checkpoint at all is passed over with a
    :class:`UserWarning` naming it and why; nothing is loaded from it.

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
        skipped: CheckpointError
        try:
            meta = verified_manifest(ckpt)
        except CheckpointError as exc:  # corrupt, or no checkpoint: nothing was read from it
            skipped = exc
        else:
            try:
                return _load_verified(ckpt, meta, model, optimizer, scheduler)
            except (CorruptCheckpointError, NonFiniteStateError) as exc:  # not "does not fit"
                skipped = exc
        warnings.warn(f"Skipping {ckpt.name}: {skipped}", UserWarning, stacklevel=2)
        tried.append(f"{ckpt.name}: {skipped}")
    if not tried:
        return None
    raise CorruptCheckpointError(
        f"No intact checkpoint under {root}; tried {len(tried)}: " + " | ".join(tried)
    )
