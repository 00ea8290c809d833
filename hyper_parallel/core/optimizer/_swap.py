"""``SwapOptimizer``: optimizer state kept in host memory or on disk between steps.

Between steps every state tensor of at least ``min_numel`` elements lives in
the *tier*: pinned host memory (``tier="host"``, for an accelerator) or
file-backed tensors in ``disk_path`` (``tier="disk"``, anywhere). A step
brings the state back in ``swap_times`` batches of params, balanced by bytes:
while one batch updates, the next one's state is read in by a background
thread, and each batch goes back out as soon as it is done, so at most two
batches are resident at once (``peak_resident_bytes`` says how much).

The batches are the wrapped optimizer's own update, run on a part of its
params at a time: group options are restored before each part, so the result
equals one unswapped step bitwise. On a sharded model each rank swaps its own
shards; the batches follow the params' global sizes, so every rank runs the
same collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from hyper_parallel.core.compat import init_optimizer_hooks
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError

__all__ = ["TIERS", "SwapOptimizer", "SwapOptimizerConfig", "is_swap_optimizer"]

#: Where state lives between steps.
TIERS = ("host", "disk")

_Key = tuple[int, int, str]  # (sub-optimizer index, id(param), state key)
_ALIGN = 64  # bytes: where each working copy starts in a staging buffer


@dataclass(frozen=True)
class SwapOptimizerConfig:
    """How :class:`SwapOptimizer` keeps state; HyperParallel's options, plus the tier.

    Args:
        swap_times: Batches a step is cut into (balanced by bytes).
        tier: ``"host"`` (pinned host memory; an accelerator's params only)
            or ``"disk"`` (files in ``disk_path``).
        disk_path: The directory of the disk tier; ``None``: a temporary one,
            removed when the optimizer is.
        state_keys: Which state entries to swap (``None``: every tensor).
        min_numel: Tensors with fewer elements (step counters) stay put.
        include_master_params: Swap fp32 main copies too: not supported (an error).
        packed_swap: Read each batch into one of two staging buffers per
            device, reused every step (HyperParallel's A/B buffers); ``False``
            gives each working copy a tensor of its own.
    """

    swap_times: int = 16
    tier: str = "host"
    disk_path: str | os.PathLike[str] | None = None
    state_keys: Sequence[str] | None = None
    min_numel: int = 1024
    include_master_params: bool = False
    packed_swap: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.swap_times, bool) or not isinstance(self.swap_times, int):
            raise HyperParallelTypeError(f"swap_times must be an int, got {self.swap_times!r}.")
        if self.swap_times < 1:
            raise HyperParallelValueError(f"swap_times must be >= 1, got {self.swap_times}.")
        if self.tier not in TIERS:
            raise HyperParallelValueError(
                f"tier must be 'host' or 'disk', got {self.tier!r}; 'disk' keeps the state in "
                "files of disk_path, 'host' in pinned host memory (for an accelerator)."
            )
        if self.min_numel < 0:
            raise HyperParallelValueError(f"min_numel must be >= 0, got {self.min_numel}.")
        if self.include_master_params:
            raise HyperParallelValueError(
                "include_master_params=True is not supported: fp32 main params stay on the "
                "device, only optimizer state is swapped; leave it False."
            )
        if self.state_keys is not None and (
            isinstance(self.state_keys, str) or not all(isinstance(k, str) for k in self.state_keys)
        ):
            raise HyperParallelTypeError(
                f"state_keys must be a sequence of state names or None, got {self.state_keys!r}."
            )


def is_swap_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a :class:`SwapOptimizer`."""
    return isinstance(optimizer, SwapOptimizer)


class SwapOptimizer(Optimizer):
    """Wrap ``optimizer`` so that its state lives in host memory or on disk between steps.

    Args:
        optimizer: Any optimizer of this library (a ``ChainedOptimizer`` with
            fp32 main params included) or any torch optimizer whose state is
            tensors.
        config: A :class:`SwapOptimizerConfig` or a dict of its fields
            (HyperParallel's ``SwapOptimizer(optimizer, config)`` form).
        **options: The config's fields as keywords (``swap_times=4,
            tier="disk", disk_path="/scratch/opt"``); they override ``config``.

    It is a ``torch.optim.Optimizer``: ``param_groups``, ``state``,
    ``state_dict()`` and ``load_state_dict()`` are the wrapped optimizer's
    (the state's tensors being the tier's copies between steps), so LR
    schedulers, ``GradScaler`` and ``hyper_parallel.checkpoint`` work on it.

    Raises:
        ValueError: a bad option, or ``tier="host"`` for params on a CPU
            (host memory is where they already are: use ``tier="disk"``).

    Examples:
        >>> opt = SwapOptimizer(get_hyper_optimizer(model), swap_times=4, tier="disk")
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: SwapOptimizerConfig | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise HyperParallelTypeError(
                f"SwapOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        self.config = _config(config, options)
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._subs: list[Optimizer] = list(getattr(optimizer, "optimizers", {}).values()) or [
            optimizer
        ]
        self._tier = _Tier.make(self.config, self._devices())
        self._slots: dict[_Key, _Slot] = {}
        self._bytes: dict[tuple[int, int], int] = {}  # the state's global bytes, per param
        self._staging: dict[tuple[torch.device, int], torch.Tensor] = {}  # two buffers a device
        self.peak_resident_bytes = 0
        init_optimizer_hooks(self)
        self._store_all()

    # -- the Optimizer surface ----------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def __getattr__(self, name: str) -> Any:
        # the wrapped optimizer's own API (a chain's ``optimizers``, ``main_params``, ...)
        if name in ("optimizer", "_subs", "_slots", "_bytes", "_staging", "_tier", "config"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; its tensors are the tier's copies."""
        self._store_all()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer, then move the loaded state into the tier."""
        self.optimizer.load_state_dict(state_dict)  # type: ignore[arg-type]
        self._store_all()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of the wrapped optimizer, batch by batch; every batch goes back to the tier.

        If it raises part-way, every batch's state is written back to the
        tier as it stands: the batches before the failing one stepped, the
        failing one as far as the wrapped optimizer got (as it would be
        unswapped), those after it untouched. None stays resident, and
        ``state_dict()`` and the next ``step()`` work from that state.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mains = getattr(self.optimizer, "main_params", None)
        if mains is not None:
            mains.grads_to_mains()
        try:
            self._step_in_batches()
        finally:
            if mains is not None:
                mains.mains_to_params()
        return loss

    def _step_in_batches(self) -> None:
        self._store_all()  # state made or loaded since the last step joins the tier
        self.peak_resident_bytes = 0
        batches = self._batches()
        before = [[_options(g) for g in opt.param_groups] for opt in self._subs]
        with ThreadPoolExecutor(max_workers=1) as reader:
            coming: Future[dict[_Key, torch.Tensor]] | None = None
            if batches:
                coming = reader.submit(self._read, batches[0], 0)
            for index, batch in enumerate(batches):
                assert coming is not None
                resident = coming.result()
                coming = None
                if index + 1 < len(batches):  # the next batch comes in while this one updates
                    coming = reader.submit(self._read, batches[index + 1], (index + 1) % 2)
                self._note_resident(resident, coming, batches, index)
                try:
                    self._update(batch, resident, before)
                finally:
                    self._store(batch)
                    del resident

    # -- batches ------------------------------------------------------------------------

    def _params(self) -> Iterator[tuple[int, torch.Tensor]]:
        for index, opt in enumerate(self._subs):
            for group in opt.param_groups:
                for p in group["params"]:
                    yield index, p

    def _batches(self) -> list[list[tuple[int, torch.Tensor]]]:
        """``swap_times`` runs of consecutive params, balanced by their state's global bytes."""
        params = list(self._params())
        sizes = [self._state_bytes(i, p) or p.numel() * p.element_size() for i, p in params]
        total = sum(sizes) or 1
        batches: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(self.config.swap_times)]
        for (index, p), before in zip(params, itertools.accumulate([0, *sizes]), strict=False):
            batches[
                min(before * self.config.swap_times // total, self.config.swap_times - 1)
            ].append((index, p))
        return [b for b in batches if b]

    def _state_bytes(self, index: int, p: torch.Tensor) -> int:
        return self._bytes.get((index, id(p)), 0)

    def _update(
        self,
        batch: list[tuple[int, torch.Tensor]],
        resident: Mapping[_Key, torch.Tensor],
        before: list[list[dict[str, Any]]],
    ) -> None:
        """Step each sub-optimizer on the batch's params only, from the groups' options before the step."""
        held = {(index, id(p)): p for index, p in batch}
        for (index, pid, key), tensor in resident.items():
            self._subs[index].state[held[(index, pid)]][key] = tensor
        for index, opt in enumerate(self._subs):
            ids = {id(p) for i, p in batch if i == index}
            if not ids:
                continue
            for group, options in zip(opt.param_groups, before[index], strict=True):
                _reset(group, options)  # a group's own counters advance once per step
            with _restricted(opt, ids):
                opt.step()

    # -- moving state -------------------------------------------------------------------

    def _swapped(self, index: int, p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        keys = self.config.state_keys
        for key, value in self._subs[index].state.get(p, {}).items():
            big = isinstance(value, torch.Tensor) and value.numel() >= self.config.min_numel
            if big and (keys is None or key in keys):
                yield key, value

    def _store(self, batch: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Write the batch's state into the tier; the state entries become the tier's copies."""
        for index, p in batch:
            held = 0
            for key, value in list(self._swapped(index, p)):
                slot = self._slots.get((index, id(p), key))
                if slot is None or not slot.fits(value):
                    slot = self._slots[(index, id(p), key)] = self._tier.slot(value)
                if value is not slot.stored:
                    slot.write(value)
                    slot.release()
                self._subs[index].state[p][key] = slot.stored
                held += slot.global_bytes
            self._bytes[(index, id(p))] = held

    def _store_all(self) -> None:
        self._store(list(self._params()))

    def _read(
        self, batch: Sequence[tuple[int, torch.Tensor]], buffer: int
    ) -> dict[_Key, torch.Tensor]:
        """Working copies of the batch's swapped state, on the params' devices.

        With ``packed_swap`` (the default) they are views of one of two staging
        buffers per device, reused every step, so a step allocates nothing
        for them; otherwise each is a tensor of its own.
        """
        found = [
            ((index, id(p), key), slot, p.device)
            for index, p in batch
            for key, value in self._swapped(index, p)
            if (slot := self._slots.get((index, id(p), key))) is not None and value is slot.stored
        ]
        staged = self._staged(found, buffer) if self.config.packed_swap else {}
        out = {}
        for key, slot, device in found:
            out[key] = slot.read(device, into=staged.get(key))
            slot.release()  # the pages just read are the working copy's now
        return out

    def _staged(
        self, found: Sequence[tuple[_Key, _Slot, torch.device]], buffer: int
    ) -> dict[_Key, torch.Tensor]:
        """Byte ranges of staging buffer ``buffer`` (0 or 1) of each device, one per slot."""
        offsets: dict[_Key, tuple[torch.device, int]] = {}
        ends: dict[torch.device, int] = {}
        for key, slot, device in found:
            start = -(-ends.get(device, 0) // _ALIGN) * _ALIGN
            offsets[key] = (device, start)
            ends[device] = start + slot.local_bytes
        for device, end in ends.items():
            held = self._staging.get((device, buffer))
            if held is None or held.numel() < end:
                self._staging[(device, buffer)] = torch.empty(end, dtype=torch.uint8, device=device)
        return {
            key: self._staging[(device, buffer)][start : start + slot.local_bytes]
            for (key, slot, _), (device, start) in zip(found, offsets.values(), strict=True)
        }

    def _note_resident(
        self,
        resident: Mapping[_Key, torch.Tensor],
        coming: Future[Any] | None,
        batches: Sequence[Sequence[tuple[int, torch.Tensor]]],
        index: int,
    ) -> None:
        now = sum(_local_bytes(t) for t in resident.values())
        if coming is not None:  # the next batch, being read in
            nxt = batches[index + 1]
            now += sum(
                self._slots[(i, id(p), k)].local_bytes
                for i, p in nxt
                for k, _ in self._swapped(i, p)
                if (i, id(p), k) in self._slots
            )
        self.peak_resident_bytes = max(self.peak_resident_bytes, now)

    def _devices(self) -> set[torch.device]:
        return {_local(p).device for _, p in self._params()}

    def __getstate__(self) -> dict[str, Any]:
        raise HyperParallelTypeError(
            "A SwapOptimizer cannot be copied or pickled: its state lives in its tier. Save it "
            "with state_dict() or hyper_parallel.checkpoint."
        )


# -- the tiers -------------------------------------------------------------------------


class _Slot:
    """Where one state tensor lives between steps: ``stored`` (same type, shape and dtype)."""

    def __init__(self, stored: torch.Tensor, local: torch.Tensor, drop: Callable[[], None]) -> None:
        self.stored = stored  # the tier's copy, as the state dict shows it (a DTensor stays one)
        self._local = local  # its local data, in the tier
        self._drop = drop  # gives the memory of written pages back (disk tier)
        self.local_bytes = _local_bytes(local)
        self.global_bytes = stored.numel() * stored.element_size()

    def fits(self, value: torch.Tensor) -> bool:
        return (
            type(value) is type(self.stored)
            and value.shape == self.stored.shape
            and value.dtype == self.stored.dtype
            and _local(value).shape == self._local.shape
        )

    def write(self, value: torch.Tensor) -> None:
        self._local.copy_(_local(value))

    def read(self, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
        """A working copy on ``device``: in ``into`` (bytes of a staging buffer) where given."""
        if into is None:
            local = self._local.to(device, copy=True)
        else:
            local = into.view(self._local.dtype).view(self._local.shape)
            local.copy_(self._local)
        return _like(self.stored, local)

    def release(self) -> None:
        self._drop()


class _Tier:
    """Makes the slots of one tier."""

    def __init__(self, config: SwapOptimizerConfig) -> None:
        self.config = config
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._count = itertools.count()

    @classmethod
    def make(cls, config: SwapOptimizerConfig, devices: set[torch.device]) -> _Tier:
        if config.tier == "host" and all(d.type == "cpu" for d in devices):
            raise HyperParallelValueError(
                "tier='host' keeps optimizer state in host memory, and these params are on the "
                "CPU, where it already is; use tier='disk' (with disk_path=...) to move it out of "
                "memory."
            )
        return cls(config)

    def _path(self) -> Path:
        if self.config.disk_path is not None:
            root = Path(self.config.disk_path)
            root.mkdir(parents=True, exist_ok=True)
        else:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="hyper_parallel_swap_")
            root = Path(self._dir.name)
        return root / f"state_{os.getpid()}_{next(self._count)}.bin"

    def slot(self, value: torch.Tensor) -> _Slot:
        local = _local(value)
        if self.config.tier == "host":
            held = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            held.copy_(local)
            return _Slot(_like(value, held), held, lambda: None)
        path = self._path()
        nbytes = max(local.numel() * local.element_size(), 1)
        with path.open("wb") as f:
            f.truncate(nbytes)
        flat = torch.from_file(str(path), shared=True, size=local.numel(), dtype=local.dtype)
        held = flat.view(local.shape)
        held.copy_(local)
        return _Slot(_like(value, held), held, lambda: _drop_pages(held))


def _drop_pages(t: torch.Tensor) -> None:
    """Unmap the resident pages of a file-backed tensor: its data stays in the file."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(-(-nbytes // page) * page), 4)


# -- helpers ---------------------------------------------------------------------------


def _config(
    config: SwapOptimizerConfig | Mapping[str, Any] | None, options: Mapping[str, Any]
) -> SwapOptimizerConfig:
    known = {f.name for f in fields(SwapOptimizerConfig)}
    for given in (options, config if isinstance(config, Mapping) else {}):
        unknown = sorted(set(given) - known)
        if unknown:
            raise HyperParallelTypeError(
                f"SwapOptimizer got unknown option(s) {unknown}; it takes {sorted(known)}."
            )
    if config is None:
        base = SwapOptimizerConfig()
    elif isinstance(config, SwapOptimizerConfig):
        base = config
    elif isinstance(config, Mapping):
        base = SwapOptimizerConfig(**config)
    else:
        raise HyperParallelTypeError(
            f"config must be a SwapOptimizerConfig, a dict or None, got {type(config).__name__}."
        )
    return replace(base, **options) if options else base


@contextlib.contextmanager
def _restricted(opt: Optimizer, ids: set[int]) -> Iterator[None]:
    """``opt``'s groups hold only the params in ``ids``, from their options before the step."""
    kept = [(group, group["params"]) for group in opt.param_groups]
    for group, params in kept:
        group["params"] = [p for p in params if id(p) in ids]
    try:
        yield
    finally:
        for group, params in kept:
            group["params"] = params


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _reset(group: dict[str, Any], options: Mapping[str, Any]) -> None:
    """``group``'s options back to ``options`` exactly: keys added since are removed."""
    for key in [k for k in group if k != "params" and k not in options]:
        del group[key]
    group.update(options)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _local_bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor like ``template``: a DTensor of the same mesh and placements."""
    if not hasattr(template, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    dt: DTensor = template  # type: ignore[assignment]
    return DTensor.from_local(
        local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
