"""Atomic, reshardable checkpoints of a model, a ChainedOptimizer and its scheduler.

Built on :mod:`torch.distributed.checkpoint` (DCP): the model and every
sub-optimizer go through ``get_model_state_dict`` / ``get_optimizer_state_dict``
and back through ``set_model_state_dict`` / ``set_optimizer_state_dict``, so one
checkpoint loads on one process (no process group), on FSDP/HSDP, and at
another world size (DCP reshards).

Layout of ``root`` as written by :class:`CheckpointManager`::

    root/
        step_00000010/          # one checkpoint
            .metadata, *.distcp # DCP: tensors only (model, optimizer state, fp32 main params)
            hyper_parallel.json # step, extra, scheduler, group hyperparams
        latest                  # name of the newest complete checkpoint

Only tensors go to DCP; every other value (param-group ``lr``, ``betas``,
the scheduler's state, ``step``, ``extra``) is stored as JSON, so loading never
unpickles arbitrary objects. DCP's own ``.metadata`` file is read with a
restricted unpickler that accepts only DCP's metadata classes.

Saving is atomic: everything is written into ``root/.tmp-<name>``; after a
barrier rank 0 renames it to ``root/<name>`` and then replaces ``latest``
(``os.replace``). A crash at any point leaves the previous checkpoint and
pointer intact.

Examples:
    >>> manager = CheckpointManager("ckpt", keep_last=3)
    >>> manager.save(step, model=model, optimizer=optimizer, scheduler=scheduler)
    >>> start = manager.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
from torch.optim import Optimizer

from hyper_parallel.core._torch_private import checkpoint_fqn
from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "load",
    "load_latest",
    "save",
]

FORMAT_VERSION = 1
META_FILE = "hyper_parallel.json"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_GROUP_TENSOR_PREFIX = "groups"


class CheckpointError(HyperParallelRuntimeError):
    """A checkpoint is missing, malformed, or does not fit the objects given."""


# -- helpers ---------------------------------------------------------------------


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning; no process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def _named_optimizers(optimizer: Optimizer) -> dict[str, Optimizer]:
    """A ChainedOptimizer's sub-optimizers by name, or ``{"optimizer": optimizer}``."""
    subs = getattr(optimizer, "optimizers", None)
    if isinstance(subs, Mapping):
        return {str(k): v for k, v in subs.items()}
    return {"optimizer": optimizer}


class _OptimizerView:
    """What DCP's optimizer state dict calls sees as ``model``: the params the optimizer holds.

    Without fp32 main params that is the model itself. With them, the
    optimizers hold the main copies, so a stand-in module holds each main
    copy (and every other param) under the model param's name: the optimizer
    state keeps the model's names, and the main copies are saved by name too.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        mains = getattr(optimizer, "main_params", None)
        self.module = model
        self.mains: dict[str, torch.Tensor] = {}
        if mains is None or not len(mains):
            return
        self.module = nn.Module()
        for name, param in model.named_parameters():
            fqn = checkpoint_fqn(model, name)
            held = mains.main_of(param)
            *path, leaf = fqn.split(".")
            owner = self.module
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]  # type: ignore[assignment]
            owner.register_parameter(leaf, held)  # type: ignore[arg-type]
            if held is not param:
                self.mains[fqn] = held.detach()


def _json_value(value: Any, where: str) -> Any:
    """``value`` as JSON (tuples become lists); ``CheckpointError`` if it is not plain."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{where} is {type(value).__name__} {value!r}, which is neither a tensor nor "
            f"JSON-serialisable; a checkpoint stores only tensors and plain values."
        ) from exc
    return json.loads(json.dumps(value))


def _like(saved: Any, current: Any) -> Any:
    """A JSON-loaded value back in the type of the value it replaces (lists -> tuples)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(_like(s, c) for s, c in zip(saved, current, strict=False))
    return saved


def _split_optimizer(osd: Mapping[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DCP optimizer state dict as (tensors for DCP, plain values for JSON)."""
    tensors: dict[str, Any] = {"state": {}, _GROUP_TENSOR_PREFIX: {}}
    plain: dict[str, Any] = {"state": {}, "param_groups": []}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors["state"].setdefault(fqn, {})[key] = value
            else:
                where = f"optimizer {name!r} state {fqn}.{key}"
                plain["state"].setdefault(fqn, {})[key] = _json_value(value, where)
    for index, group in enumerate(osd["param_groups"]):
        values: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                values[key] = list(value)
            elif isinstance(value, torch.Tensor):
                tensors[_GROUP_TENSOR_PREFIX].setdefault(str(index), {})[key] = value
            else:
                where = f"optimizer {name!r} param group {index} {key!r}"
                values[key] = _json_value(value, where)
        plain["param_groups"].append(values)
    return tensors, plain


def _safe_metadata_class(module: str, name: str) -> bool:
    if module.startswith("torch.distributed.checkpoint"):
        return True
    if module == "torch" and (
        name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    ):
        return True
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return False
    return (module, name) in {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("torch.serialization", "_get_layout"),
        ("torch", "strided"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if _safe_metadata_class(module, name) else None
        # From DCP's own modules only classes (data records), never functions.
        if found is None or (
            module.startswith("torch.distributed.checkpoint") and not isinstance(found, type)
        ):
            raise CheckpointError(
                f"Refusing to load {module}.{name} from a checkpoint's DCP metadata; only "
                f"torch.distributed.checkpoint metadata classes are allowed."
            )
        return found


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata.")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the path does not exist.")
    meta_path = path / META_FILE
    if not path.is_dir() or not meta_path.is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a hyper_parallel checkpoint (expected a directory with "
            f"{META_FILE} and DCP's .metadata)."
        )
    meta = json.loads(meta_path.read_text())
    if not isinstance(meta, dict) or meta.get("format") != "hyper_parallel.checkpoint":
        raise CheckpointError(f"{meta_path} is not hyper_parallel checkpoint metadata.")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {meta.get('version')!r}; this hyper_parallel "
            f"reads version {FORMAT_VERSION}."
        )
    return meta


# -- save / load -----------------------------------------------------------------


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save a checkpoint into the directory ``path``, atomically.

    Call it on every rank. The tensors are written with DCP into
    ``<parent>/.tmp-<name>``; after a barrier rank 0 renames that to ``path``
    (replacing an older checkpoint there). It does not touch any ``latest``
    pointer; :class:`CheckpointManager` does.

    Args:
        path: The checkpoint directory to create.
        model: The model (plain, FSDP or HSDP).
        optimizer: A :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`
            (each sub-optimizer is saved under its name) or a plain optimizer.
        scheduler: An LR scheduler whose ``state_dict()`` holds plain values
            (e.g. :class:`~hyper_parallel.core.optimizer.HyperLRScheduler`).
        step: The training step, returned by :func:`load`.
        extra: Anything JSON-serialisable to keep with the checkpoint.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CheckpointError: a value is neither a tensor nor JSON-serialisable.
    """
    target = Path(path)
    tmp = target.parent / f".tmp-{target.name}"
    named = _named_optimizers(optimizer)
    view = _OptimizerView(model, optimizer)
    tensors: dict[str, Any] = {"model": get_model_state_dict(model), "optim": {}}
    if view.mains:
        tensors["main"] = view.mains
    plain: dict[str, Any] = {}
    for name, opt in named.items():
        tensors["optim"][name], plain[name] = _split_optimizer(
            get_optimizer_state_dict(view.module, opt), name
        )
    meta = {
        "format": "hyper_parallel.checkpoint",
        "version": FORMAT_VERSION,
        "step": int(step),
        "extra": _json_value(dict(extra or {}), "extra"),
        "optimizers": list(named),
        "main_params": sorted(view.mains),
        "optimizer_plain": plain,
        "scheduler": None
        if scheduler is None
        else _json_value(scheduler.state_dict(), "scheduler state"),
        "world_size": dist.get_world_size() if _is_dist() else 1,
    }
    if _rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crashed save
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    with _quiet_single_process():
        _dcp_save(tensors, storage_writer=FileSystemWriter(tmp), no_dist=not _is_dist())
    if _rank() == 0:
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    _barrier()
    if _rank() == 0:
        _commit(tmp, target)
    _barrier()
    return target


def _commit(tmp: Path, target: Path) -> None:
    """Move a completed ``tmp`` checkpoint into place (rank 0)."""
    old = target.parent / f".old-{target.name}"
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(tmp, target)
    if old.exists():
        shutil.rmtree(old)


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
    was written; DCP reshards.

    Args:
        path: A checkpoint directory.
        model: The model to load into.
        optimizer: The optimizer to load into; its sub-optimizer names must be
            those saved.
        scheduler: The scheduler to load into, if one was saved.

    Returns:
        The ``step`` given to :func:`save`.

    Raises:
        CheckpointError: ``path`` is missing or not a checkpoint, the
            sub-optimizer names or param groups differ, or a scheduler is
            given but none was saved.
    """
    ckpt = Path(path)
    meta = _read_meta(ckpt)
    named = _named_optimizers(optimizer)
    if list(named) != meta["optimizers"]:
        raise CheckpointError(
            f"{ckpt} holds optimizers {meta['optimizers']}, but the optimizer given has "
            f"{list(named)}; build the optimizer the checkpoint was saved with."
        )
    if scheduler is not None and meta["scheduler"] is None:
        raise CheckpointError(f"{ckpt} holds no scheduler state, but a scheduler was given.")
    view = _OptimizerView(model, optimizer)
    _check_main_params(ckpt, meta, view)
    model_sd = get_model_state_dict(model)
    current: dict[str, Any] = {}
    tensors: dict[str, Any] = {"model": model_sd, "optim": {}}
    if view.mains:
        tensors["main"] = view.mains  # DCP loads into the main copies in place
    for name, opt in named.items():
        osd = get_optimizer_state_dict(view.module, opt)  # creates lazy state if needed
        saved_groups = meta["optimizer_plain"][name]["param_groups"]
        if len(saved_groups) != len(osd["param_groups"]):
            raise CheckpointError(
                f"Optimizer {name!r} has {len(osd['param_groups'])} param groups; {ckpt} "
                f"holds {len(saved_groups)}."
            )
        current[name] = osd
        tensors["optim"][name], _ = _split_optimizer(osd, name)
    with _quiet_single_process():
        reader = _SafeReader(ckpt)
        reader.read_metadata()  # refuse unsafe metadata here, with our error, before DCP reads it
        _dcp_load(tensors, storage_reader=reader, no_dist=not _is_dist())
    set_model_state_dict(model, model_sd)
    for name, opt in named.items():
        osd = current[name]
        plain = meta["optimizer_plain"][name]
        loaded = tensors["optim"][name]
        for fqn, state in osd["state"].items():
            state.update(loaded["state"].get(fqn, {}))
            state.update(plain["state"].get(fqn, {}))
        for index, group in enumerate(osd["param_groups"]):
            saved = plain["param_groups"][index]
            if sorted(saved["params"]) != sorted(group["params"]):
                raise CheckpointError(
                    f"Optimizer {name!r} param group {index} holds different params than in {ckpt}."
                )
            for key, value in saved.items():
                if key != "params":
                    group[key] = _like(value, group.get(key))
            group.update(loaded[_GROUP_TENSOR_PREFIX].get(str(index), {}))
        set_optimizer_state_dict(view.module, opt, osd)
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def _check_main_params(ckpt: Path, meta: Mapping[str, Any], view: _OptimizerView) -> None:
    saved, have = meta.get("main_params", []), sorted(view.mains)
    if saved == have:
        return
    if not saved or not have:
        held, given = ("holds", "has none") if saved else ("holds none", "has them")
        raise CheckpointError(
            f"{ckpt} {held} fp32 main params, but the optimizer given {given}; build the "
            f"optimizer as it was saved (get_hyper_optimizer(..., fp32_main_params={bool(saved)}))."
        )
    raise CheckpointError(
        f"{ckpt} holds fp32 main params for {len(saved)} params, the optimizer given has them "
        f"for {len(have)}; they differ at "
        f"{', '.join(sorted(set(saved) ^ set(have))[:5])}."
    )


def _read_latest(root: Path) -> Path | None:
    pointer = root / LATEST_FILE
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META_FILE).is_file():
            return candidate
    steps = _step_dirs(root)
    return steps[-1][1] if steps else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any | None = None,
) -> int | None:
    """Load the newest complete checkpoint under ``root``.

    Follows the ``latest`` pointer; without one (or if it names a missing
    checkpoint) the highest complete ``step_*`` directory.

    Returns:
        The step loaded, or ``None`` when ``root`` holds no checkpoint.
    """
    found = _read_latest(Path(root))
    if found is None:
        return None
    return load(found, model=model, optimizer=optimizer, scheduler=scheduler)


class CheckpointManager:
    """Numbered checkpoints under one directory, with a ``latest`` pointer and retention.

    Args:
        root: The directory holding ``step_<N>`` checkpoints.
        keep_last: How many checkpoints to keep (the newest); ``None`` keeps all.

    Examples:
        >>> manager = CheckpointManager("ckpt", keep_last=2)
        >>> manager.save(100, model=model, optimizer=opt, scheduler=sched)
        >>> manager.load_latest(model=model, optimizer=opt, scheduler=sched)
        100
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise HyperParallelValueError(
                f"keep_last must be an int >= 1 or None, got {keep_last!r}."
            )
        self.root = Path(root)
        self.keep_last = keep_last

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
        """Save at ``step`` (see :func:`save`), then move ``latest`` and prune old ones.

        Returns:
            The new checkpoint's directory.
        """
        target = save(
            self.path_for(step),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=step,
            extra=extra,
        )
        if _rank() == 0:
            pointer_tmp = self.root / f".{LATEST_FILE}.tmp"
            pointer_tmp.write_text(target.name + "\n")
            os.replace(pointer_tmp, self.root / LATEST_FILE)
            if self.keep_last is not None:
                for _, old in _step_dirs(self.root)[: -self.keep_last]:
                    if old != target:
                        shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return target

    def latest(self) -> Path | None:
        """The newest complete checkpoint's directory, or ``None``."""
        return _read_latest(self.root)

    def load_latest(
        self, *, model: nn.Module, optimizer: Optimizer, scheduler: Any | None = None
    ) -> int | None:
        """Load the newest checkpoint (see :func:`load_latest`); ``None`` if there is none."""
        return load_latest(self.root, model=model, optimizer=optimizer, scheduler=scheduler)
