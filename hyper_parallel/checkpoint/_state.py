"""How a model, its optimizers and fp32 main params become a checkpoint's tensors and plain values.

Only tensors go to DCP; every other value (param-group ``lr``, ``betas``, the
scheduler's state, ``step``) goes to the JSON manifest, so a load never
unpickles arbitrary objects. DCP's own ``.metadata`` is read with a restricted
unpickler that accepts only DCP's metadata classes.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.optim import Optimizer

from hyper_parallel.checkpoint._errors import CheckpointError
from hyper_parallel.core.compat import checkpoint_fqn
from hyper_parallel.core.optimizer import MainParams

__all__ = [
    "GROUP_TENSOR_PREFIX",
    "OptimizerView",
    "SafeReader",
    "json_value",
    "like",
    "named_optimizers",
    "quiet_single_process",
    "split_optimizer",
]

GROUP_TENSOR_PREFIX = "groups"


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" load warning; no process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def named_optimizers(optimizer: Optimizer) -> dict[str, Optimizer]:
    """A ChainedOptimizer's sub-optimizers by name, or ``{"optimizer": optimizer}``."""
    subs = getattr(optimizer, "optimizers", None)
    if isinstance(subs, Mapping):
        return {str(k): v for k, v in subs.items()}
    return {"optimizer": optimizer}


class OptimizerView:
    """What DCP's optimizer state dict calls sees as ``model``: the params the optimizer holds.

    Without fp32 main params that is the model itself. With them, the
    optimizers hold the main copies, so a stand-in module holds each main
    copy (and every other param) under the model param's name: the optimizer
    state keeps the model's names, and the main copies are saved by name too.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        mains = getattr(optimizer, "main_params", None)
        self.model = model
        self.module = model
        self.mains: dict[str, torch.Tensor] = {}
        self.main_params: MainParams = mains if mains is not None else MainParams()
        if mains is None or not len(mains):
            return
        self.module = nn.Module()
        for name, param in model.named_parameters():
            fqn = checkpoint_fqn(model, name)
            held = mains.main_of(param)
            *path, leaf = fqn.split(".")
            owner = self.module
            for part in path:
                if part not in dict(owner.named_children()):
                    owner.add_module(part, nn.Module())
                owner = owner.get_submodule(part)
            owner.register_parameter(leaf, held)  # type: ignore[arg-type]
            if held is not param:
                self.mains[fqn] = held.detach()


def json_value(value: Any, where: str) -> Any:
    """``value`` as JSON (tuples become lists); ``CheckpointError`` if it is not plain."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{where} is {type(value).__name__} {value!r}, which is neither a tensor nor "
            f"JSON-serialisable; a checkpoint stores only tensors and plain values."
        ) from exc
    return json.loads(json.dumps(value))


def like(saved: Any, current: Any) -> Any:
    """A JSON-loaded value back in the type of the value it replaces (lists -> tuples)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(like(s, c) for s, c in zip(saved, current, strict=False))
    return saved


def split_optimizer(osd: Mapping[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DCP optimizer state dict as (tensors for DCP, plain values for JSON)."""
    tensors: dict[str, Any] = {"state": {}, GROUP_TENSOR_PREFIX: {}}
    plain: dict[str, Any] = {"state": {}, "param_groups": []}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors["state"].setdefault(fqn, {})[key] = value
            else:
                where = f"optimizer {name!r} state {fqn}.{key}"
                plain["state"].setdefault(fqn, {})[key] = json_value(value, where)
    for index, group in enumerate(osd["param_groups"]):
        values: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                values[key] = list(value)
            elif isinstance(value, torch.Tensor):
                tensors[GROUP_TENSOR_PREFIX].setdefault(str(index), {})[key] = value
            else:
                where = f"optimizer {name!r} param group {index} {key!r}"
                values[key] = json_value(value, where)
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


class SafeReader(FileSystemReader):
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
