"""``SwapOptimizer``: optimizer state kept in host memory or on disk between steps.

Between steps every state tensor of at least ``min_numel`` elements lives in
the *tier*: pinned host memory (``tier="host"``) or file-backed tensors in
``disk_path`` (``tier="disk"``). With ``include_master_params=True`` the fp32
main copies of a chain built with ``fp32_main_params=True`` live there too.
A step brings them back in ``swap_times`` batches of params, balanced by
bytes: while one batch updates, the next one's state is read in by a
background thread, and each batch goes back out as soon as it is done, so at
most two batches are resident at once (``peak_resident_bytes`` says how much).

The host tier keeps what is on an accelerator; state that is on the CPU
already is in host memory, and stays where it is (as in HyperParallel).

The batches are the wrapped optimizer's own update, run on a part of its
params at a time: group options are restored before each part, so the result
equals one unswapped step bitwise. On a sharded model each rank swaps its own
shards; the batches follow the params' global sizes, so every rank runs the
same collectives.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.optim import Optimizer

from hyper_parallel.core.compat import init_optimizer_hooks
from hyper_parallel.core.errors import HyperParallelTypeError, HyperParallelValueError
from hyper_parallel.core.optimizer._main_params import MainParams
from hyper_parallel.core.optimizer._matrix import MatrixOptimizer, check_steps
from hyper_parallel.core.optimizer._swap_tier import Slot, Tier, bind, local_bytes, local_of

__all__ = [
    "MASTER_PARAM_KEYS",
    "TIERS",
    "SwapOptimizer",
    "SwapOptimizerConfig",
    "is_swap_optimizer",
]

#: Where state lives between steps.
TIERS = ("host", "disk")
#: The names of the fp32 main copies in ``state_keys``: HyperParallel's, then this project's.
MASTER_PARAM_KEYS = ("master_param", "main_param")

_Key = tuple[int, int, str]  # (sub-optimizer index, id(param), state key)
_ALIGN = 64  # bytes: where each working copy starts in a staging buffer
_MAIN = MASTER_PARAM_KEYS[0]  # the slot key of a main copy's own values
#: Set in ``__init__``; never looked up in the wrapped optimizer (a copy has none yet).
_OWN_ATTRIBUTES = frozenset(
    {"optimizer", "config", "_subs", "_slots", "_bytes", "_staging", "_tier", "_mains"}
)


@dataclass(frozen=True)
class SwapOptimizerConfig:
    """How :class:`SwapOptimizer` keeps state; HyperParallel's options, plus the tier.

    Args:
        swap_times: Batches a step is cut into (balanced by bytes).
        tier: ``"host"`` (pinned host memory; state already on the CPU stays
            where it is) or ``"disk"`` (files in ``disk_path``).
        disk_path: The directory of the disk tier; ``None``: a temporary one,
            removed when the optimizer is.
        state_keys: Which state entries to swap (``None``: every tensor),
            kept as a tuple. ``"master_param"`` (or ``"main_param"``) names
            the fp32 main copies, which ``include_master_params`` swaps.
        min_numel: Tensors with fewer elements (step counters) stay put.
        include_master_params: Swap the fp32 main copies too (an optimizer
            built with ``fp32_main_params=True``): each batch brings its
            copies in, steps them, rounds them into the model's params and
            writes them back.
        packed_swap: Read each batch into one of two staging buffers per
            device, reused every step (HyperParallel's A/B buffers); ``False``
            gives each working copy a tensor of its own; ``None``: the
            default, ``True``.
    """

    swap_times: int = 16
    tier: str = "host"
    disk_path: str | os.PathLike[str] | None = None
    state_keys: Sequence[str] | None = None
    min_numel: int = 1024
    include_master_params: bool = False
    packed_swap: bool | None = True

    def __post_init__(self) -> None:
        if isinstance(self.swap_times, bool) or not isinstance(self.swap_times, int):
            raise HyperParallelTypeError(f"swap_times must be an int, got {self.swap_times!r}.")
        if self.swap_times < 1:
            raise HyperParallelValueError(
                f"swap_times must be positive (>= 1), got {self.swap_times}."
            )
        if self.tier not in TIERS:
            raise HyperParallelValueError(
                f"tier must be 'host' or 'disk', got {self.tier!r}; 'disk' keeps the state in "
                "files of disk_path, 'host' in pinned host memory (for an accelerator)."
            )
        if self.min_numel < 0:
            raise HyperParallelValueError(
                f"min_numel must be non-negative (>= 0), got {self.min_numel}."
            )
        self._normalize()

    def _normalize(self) -> None:
        """HyperParallel's normalizations: ``packed_swap=None`` is ``True``, ``state_keys`` a tuple."""
        for flag in ("include_master_params", "packed_swap"):
            value = getattr(self, flag)
            if not isinstance(value, bool) and not (flag == "packed_swap" and value is None):
                raise HyperParallelTypeError(f"{flag} must be True or False, got {value!r}.")
        if self.packed_swap is None:  # the backend's default, which is True on torch
            object.__setattr__(self, "packed_swap", True)
        object.__setattr__(self, "state_keys", _state_keys(self.state_keys))
        named = [k for k in self.state_keys or () if k in MASTER_PARAM_KEYS]
        if named and not self.include_master_params:
            raise HyperParallelValueError(
                f"state_keys names {named[0]!r}, the fp32 main copies; they are swapped with "
                "include_master_params=True. Pass it, or leave the name out."
            )


def _state_keys(keys: Sequence[str] | None) -> tuple[str, ...] | None:
    """``keys`` as a tuple (HyperParallel's normalization), checked to be state names."""
    if keys is None:
        return None
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise HyperParallelTypeError(
            f"state_keys must be a sequence of state names or None, got {keys!r}."
        )
    return tuple(keys)


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
    With the host tier, params on the CPU keep their state where it is
    (host memory already): such an optimizer steps as it would unwrapped.

    Raises:
        ValueError: a bad option, or ``include_master_params=True`` for an
            optimizer that keeps no fp32 main params.

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
        self._mains = _swapped_mains(optimizer, self.config)
        self._tier = Tier(self.config)
        self._slots: dict[_Key, Slot] = {}
        self._bytes: dict[tuple[int, int], int] = {}  # the state's global bytes, per param
        self._staging: dict[tuple[torch.device, int], torch.Tensor] = {}  # two buffers a device
        self.peak_resident_bytes = 0
        init_optimizer_hooks(self)
        self._store_all()

    # -- the Optimizer surface ----------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def __getattr__(self, name: str) -> Any:
        # the wrapped optimizer's own API (a chain's ``optimizers``, ``main_params``, ...)
        if name in _OWN_ATTRIBUTES:
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # a wrapped chain's container protocol: ``for sub in swapped``, ``swapped["muon"]``, ...
    # (a TypeError from the wrapped optimizer where it is no container)
    def __iter__(self) -> Iterator[Any]:
        wrapped: Any = self.optimizer
        return iter(wrapped)

    def __len__(self) -> int:
        wrapped: Any = self.optimizer
        return len(wrapped)

    def __bool__(self) -> bool:  # an optimizer is true, whatever __len__ says of what it wraps
        return True

    def __getitem__(self, key: Any) -> Any:
        wrapped: Any = self.optimizer
        return wrapped[key]

    def __contains__(self, item: object) -> bool:
        wrapped: Any = self.optimizer
        return item in wrapped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any], **options: Any) -> None:
        """The wrapped optimizer's ``add_param_group`` (a chain's takes ``optimizer=``)."""
        self.optimizer.add_param_group(param_group, **options)

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
        whole = mains if self._mains is None else None  # else each batch moves its own
        if whole is not None:
            whole.grads_to_mains()
        try:
            self._step_in_batches()
        finally:
            if whole is not None:
                whole.mains_to_params()
        return loss

    def _step_in_batches(self) -> None:
        self._store_all()  # state made or loaded since the last step joins the tier
        self.peak_resident_bytes = 0
        batches = self._batches()
        before = [[_options(g) for g in opt.param_groups] for opt in self._subs]
        matrix = [opt for opt in self._subs if isinstance(opt, MatrixOptimizer)]
        check_steps(matrix)  # the whole step's checks, on the whole groups
        with contextlib.ExitStack() as in_parts:
            for opt in matrix:
                in_parts.enter_context(opt.stepping_in_parts())
            self._batch_by_batch(batches, before)
        for opt in matrix:  # what follows the whole step (Muon's QK-clip), on the whole groups
            opt.finish_step()

    def _batch_by_batch(
        self, batches: list[list[tuple[int, torch.Tensor]]], before: list[list[dict[str, Any]]]
    ) -> None:
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
                    if self._mains is not None:  # the batch's main copies into its params
                        self._mains.mains_to_params([p for _, p in batch])
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
            self._put(index, held[(index, pid)], key, tensor)
        if self._mains is not None:  # the batch's gradients into its main copies, now resident
            self._mains.grads_to_mains([p for _, p in batch])
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
        """``p``'s tensors that live in the tier: chosen state entries, and its own values if a main copy."""
        keys = self.config.state_keys
        for key, value in self._subs[index].state.get(p, {}).items():
            chosen = isinstance(value, torch.Tensor) and (keys is None or key in keys)
            if chosen and self._movable(index, p, key, value):
                yield key, value
        if self._mains is not None and self._mains.param_of(p) is not p:
            value = p.detach()
            if self._movable(index, p, _MAIN, value):
                yield _MAIN, value

    def _movable(self, index: int, p: torch.Tensor, key: str, value: torch.Tensor) -> bool:
        """Big enough, and not on the CPU already under the host tier (where it stays)."""
        if value.numel() < self.config.min_numel:
            return False
        if (index, id(p), key) in self._slots:
            return True
        return self.config.tier != "host" or self._home(index, p).type != "cpu"

    def _home(self, index: int, p: torch.Tensor) -> torch.device:
        """Where ``p`` steps: its device, or for a main copy in the tier, where it came from."""
        slot = self._slots.get((index, id(p), _MAIN))
        return slot.home if slot is not None else local_of(p).device

    def _put(self, index: int, p: torch.Tensor, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` becomes ``p``'s state entry ``key``, or (a main copy's) ``p``'s values."""
        if key == _MAIN:
            bind(p, local_of(tensor))
        else:
            self._subs[index].state[p][key] = tensor

    def _store(self, batch: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Write the batch's tensors into the tier; the tier's copies take their place."""
        for index, p in batch:
            held = 0
            for key, value in list(self._swapped(index, p)):
                slot = self._slots.get((index, id(p), key))
                if slot is None or not slot.fits(value):
                    home = self._home(index, p)
                    slot = self._slots[(index, id(p), key)] = self._tier.slot(value, home)
                if not slot.holds(value):
                    slot.write(value)
                    slot.release()
                self._put(index, p, key, slot.stored)
                held += slot.global_bytes
            self._bytes[(index, id(p))] = held

    def _store_all(self) -> None:
        self._store(list(self._params()))

    def _read(
        self, batch: Sequence[tuple[int, torch.Tensor]], buffer: int
    ) -> dict[_Key, torch.Tensor]:
        """Working copies of the batch's swapped tensors, on the devices their params step on.

        With ``packed_swap`` (the default) they are views of one of two staging
        buffers per device, reused every step, so a step allocates nothing
        for them; otherwise each is a tensor of its own.
        """
        found = [
            ((index, id(p), key), slot, slot.home)
            for index, p in batch
            for key, value in self._swapped(index, p)
            if (slot := self._slots.get((index, id(p), key))) is not None and slot.holds(value)
        ]
        staged = self._staged(found, buffer) if self.config.packed_swap else {}
        out = {}
        for key, slot, device in found:
            out[key] = slot.read(device, into=staged.get(key))
            slot.release()  # the pages just read are the working copy's now
        return out

    def _staged(
        self, found: Sequence[tuple[_Key, Slot, torch.device]], buffer: int
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
        now = sum(local_bytes(t) for t in resident.values())
        if coming is not None:  # the next batch, being read in
            nxt = batches[index + 1]
            now += sum(
                self._slots[(i, id(p), k)].local_bytes
                for i, p in nxt
                for k, _ in self._swapped(i, p)
                if (i, id(p), k) in self._slots
            )
        self.peak_resident_bytes = max(self.peak_resident_bytes, now)

    def __getstate__(self) -> dict[str, Any]:
        raise HyperParallelTypeError(
            "A SwapOptimizer cannot be copied or pickled: its state lives in its tier. Save it "
            "with state_dict() or hyper_parallel.checkpoint."
        )


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


def _swapped_mains(optimizer: Optimizer, config: SwapOptimizerConfig) -> MainParams | None:
    """The main copies that ``include_master_params`` keeps in the tier, or ``None``."""
    if not config.include_master_params:
        return None
    mains = getattr(optimizer, "main_params", None)
    if not isinstance(mains, MainParams):
        raise HyperParallelValueError(
            "include_master_params=True keeps the fp32 main copies in the tier, and this "
            f"{type(optimizer).__name__} keeps none: build it with "
            "get_hyper_optimizer(..., fp32_main_params=True) (or ChainedOptimizer(..., "
            "main_params=MainParams(...))), or leave include_master_params False."
        )
    return mains


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
