"""Where :class:`SwapOptimizer` keeps a tensor between steps: pinned host memory or a file.

A :class:`Slot` holds one tensor's values in its tier; :class:`Tier` makes the
slots of one configuration. A DTensor is stored as its local shard, and
shown again as a DTensor of the same mesh and placements.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hyper_parallel.core.compat import set_local_data

if TYPE_CHECKING:
    from hyper_parallel.core.optimizer._swap import SwapOptimizerConfig

__all__ = ["Slot", "Tier", "bind", "like", "local_bytes", "local_of"]


class Slot:
    """Where one tensor lives between steps: ``stored`` (same type, shape and dtype).

    ``home`` is the device its working copies are read onto (its param's).
    """

    def __init__(
        self,
        stored: torch.Tensor,
        local: torch.Tensor,
        drop: Callable[[], None],
        home: torch.device,
    ) -> None:
        self.stored = stored  # the tier's copy, as the state dict shows it (a DTensor stays one)
        self.local = local  # its local data, in the tier
        self._drop = drop  # gives the memory of written pages back (disk tier)
        self.home = home
        self.local_bytes = local_bytes(local)
        self.global_bytes = stored.numel() * stored.element_size()

    def fits(self, value: torch.Tensor) -> bool:
        """Whether ``value`` can be written here: same type, shape, dtype and local shape."""
        return (
            type(value) is type(self.stored)
            and value.shape == self.stored.shape
            and value.dtype == self.stored.dtype
            and local_of(value).shape == self.local.shape
        )

    def holds(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is this slot's copy already (the object, or a view of its data)."""
        if value is self.stored:
            return True
        data = local_of(value)
        return data.numel() > 0 and data.data_ptr() == self.local.data_ptr()

    def write(self, value: torch.Tensor) -> None:
        """Copy ``value``'s local data into the tier (and into ``stored``, where that is a copy)."""
        self.local.copy_(local_of(value))
        shown = local_of(self.stored)
        if shown.data_ptr() != self.local.data_ptr():
            # DTensor.from_local moves host data to its mesh's device: that copy must not go stale
            shown.copy_(self.local)

    def read(self, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
        """A working copy on ``device``: in ``into`` (bytes of a staging buffer) where given."""
        if into is None:
            data = self.local.to(device, copy=True)
        else:
            data = into.view(self.local.dtype).view(self.local.shape)
            data.copy_(self.local)
        return like(self.stored, data)

    def release(self) -> None:
        """Give back the memory of the pages written or read (the disk tier); the data stays."""
        self._drop()


class Tier:
    """Makes the slots of one tier: pinned host memory, or files in ``disk_path``."""

    def __init__(self, config: SwapOptimizerConfig) -> None:
        self.config = config
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._count = itertools.count()

    def _path(self) -> Path:
        if self.config.disk_path is not None:
            root = Path(self.config.disk_path)
            root.mkdir(parents=True, exist_ok=True)
        else:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="hyper_parallel_swap_")
            root = Path(self._dir.name)
        return root / f"state_{os.getpid()}_{next(self._count)}.bin"

    def slot(self, value: torch.Tensor, home: torch.device) -> Slot:
        """A new slot holding a copy of ``value``, read back onto ``home``."""
        data = local_of(value)
        if self.config.tier == "host":
            held = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            held.copy_(data)
            return Slot(like(value, held), held, lambda: None, home)
        path = self._path()
        nbytes = max(data.numel() * data.element_size(), 1)
        with path.open("wb") as f:
            f.truncate(nbytes)
        flat = torch.from_file(str(path), shared=True, size=data.numel(), dtype=data.dtype)
        held = flat.view(data.shape)
        held.copy_(data)
        return Slot(like(value, held), held, lambda: _drop_pages(held), home)


def _drop_pages(t: torch.Tensor) -> None:
    """Unmap the resident pages of a file-backed tensor: its data stays in the file."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(-(-nbytes // page) * page), 4)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s local data."""
    data = local_of(t)
    return data.numel() * data.element_size()


def like(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as a tensor like ``template``: a DTensor of the same mesh and placements."""
    if not hasattr(template, "device_mesh"):
        return data
    from torch.distributed.tensor import DTensor

    dt: DTensor = template  # type: ignore[assignment]
    return DTensor.from_local(
        data, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )


def bind(param: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``data`` the values of ``param`` (its local shard, for a DTensor), keeping the object.

    The optimizers hold ``param`` and key their state by it, so it stays the
    same object; only where its values live changes (:func:`~hyper_parallel.core.compat.set_local_data`).
    """
    set_local_data(param, data)
