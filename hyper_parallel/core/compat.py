"""Every private torch API hyper_parallel uses, in one place, behind public helpers.

A torch release that renames one of these breaks this module alone, and the
tests that exercise each helper (FSDP x TP layouts, the gradient scaling
factor, clipping on devices without foreach kernels) say which. Plugins use
these helpers rather than torch's private names.
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The stores torchrun's agent uses; public classes, defined in a private module. Core's
# mesh code imports them from here (re-exported by name, not among the public names).
from torch._C._distributed_c10d import PrefixStore as PrefixStore
from torch._C._distributed_c10d import Store as Store
from torch._C._distributed_c10d import TCPStore as TCPStore

from hyper_parallel.core.errors import HyperParallelValueError

# The helpers plugins use. The rest of this module (DCP's FQNs, FSDP2's param groups,
# DTensor's strided shard, the optimizer hook dicts, torchrun's stores, gloo's worker
# threads) serves core's own modules, which import it from here.
__all__ = [
    "cpu_has_native_bf16",
    "cpu_kind",
    "device_has_foreach_support",
    "eager_when_compiled",
    "fused_kernel_devices",
]


def eager_when_compiled(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``, as eager code even inside ``torch.compile`` (``torch.compiler.disable``).

    Dynamo (and what it imports) loads only when something is compiled.
    """
    if torch.compiler.is_compiling():
        _disabled(fn)(*args)
    else:
        fn(*args)


@functools.cache
def _disabled(fn: Callable[..., None]) -> Callable[..., None]:
    disabled: Callable[..., None] = torch.compiler.disable(fn, reason="runs eagerly")
    return disabled


def strided_shard_type() -> Any:
    """DTensor's ``_StridedShard``: FSDP's outer split of a tensor-parallel dim."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def fsdp_param_groups(unit: Any) -> list[Any]:
    """The FSDP2 param groups of an ``FSDPModule`` (whose all-reduce hook slot we share)."""
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def fsdp_all_reduce_hooks(unit: Any) -> list[Any]:
    """The all-reduce hook each FSDP2 param group of ``unit`` holds now (``None`` where unset)."""
    return [getattr(group, "_all_reduce_hook", None) for group in fsdp_param_groups(unit)]


@dataclass(frozen=True)
class ReducedGradSlot:
    """Where FSDP2 writes one param's reduced gradient shard in its unit's flat reduce output.

    FSDP2 reduces the gradients of a unit's params (those that have one) in
    one flat buffer, in the order of the unit's params; each param's local
    shard starts where the previous param's padded shard ends.
    """

    #: The sharded param (a DTensor) on the module now.
    param: torch.Tensor
    #: The shape of this rank's shard of it.
    size: torch.Size
    #: Contiguous strides for ``size``.
    stride: tuple[int, ...]
    #: How many elements of the flat buffer the param takes: its padded shard.
    span: int


def fsdp_reduced_grad_slots(unit: Any) -> list[ReducedGradSlot]:
    """The :class:`ReducedGradSlot` of every param of an ``FSDPModule``, in FSDP's order."""
    return [
        ReducedGradSlot(
            param=fsdp_param.sharded_param,
            size=fsdp_param.sharded_size,
            stride=tuple(fsdp_param.contiguous_sharded_stride),
            span=fsdp_param.padded_sharded_param_size.numel(),
        )
        for group in fsdp_param_groups(unit)
        for fsdp_param in group.fsdp_params
    ]


def set_local_data(param: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``data`` the values of ``param`` in place: a plain tensor's ``.data``, or a
    DTensor's local shard (its ``_local_tensor``: DTensor has no public way to swap it)."""
    holder = getattr(param, "_local_tensor", param)
    holder.data = data


def device_has_foreach_support(device: torch.device) -> bool:
    """Whether torch has foreach kernels for tensors on ``device``."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(_device_has_foreach_support(device))


def fused_kernel_devices() -> set[str]:
    """Device types torch's fused optimizer kernels (fused AdamW) run on."""
    from torch.optim.optimizer import (  # type: ignore[attr-defined]
        _get_fused_kernels_supported_devices,
    )

    return set(_get_fused_kernels_supported_devices())


def checkpoint_fqn(model: torch.nn.Module, name: str) -> str:
    """The name DCP's ``get_optimizer_state_dict`` gives ``model``'s param ``name``.

    It drops wrapper prefixes (``torch.compile``'s ``_orig_mod``, DDP's
    ``module``), so a checkpoint's keys do not depend on how the model was wrapped.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise HyperParallelValueError(
            f"Param {name!r} stands for {len(fqns)} params ({', '.join(sorted(fqns))}), as a flat "
            "parameter of FSDP1 does; shard with fully_shard (FSDP2) instead."
        )
    return next(iter(fqns))


#: What a CPU multiplies matrices with, fastest first (:func:`cpu_kind`).
CPU_KINDS = ("amx", "avx512_bf16", "avx2", "other")

# oneDNN's ISA caps (``ONEDNN_MAX_CPU_ISA``) that keep bf16 in hardware without AMX;
# a cap naming AMX keeps AMX, and any other cap (AVX2, AVX512_CORE, ...) has no native bf16.
_BF16_WITHOUT_AMX_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2_512")


@functools.cache
def cpu_kind() -> str:
    """This CPU's kind for matrix products, one of :data:`CPU_KINDS`.

    ``"amx"``: AMX-BF16 tiles; ``"avx512_bf16"``: bf16 dot products in
    AVX-512 but no AMX; ``"avx2"``: no native bf16 (torch emulates bf16
    matmul, many times slower than fp32: docs/benchmarks.md); ``"other"``: none of these (or a
    torch without the probe). It is what torch's CPU capability reports,
    lowered by ``ONEDNN_MAX_CPU_ISA`` where that caps oneDNN, which runs
    torch's bf16 matmuls, below the hardware. Worked out once per process,
    as oneDNN reads its cap once: a step never reads the environment.
    """
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if probe is None:
        return "other"
    return cpu_kind_of(probe(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))


def cpu_kind_of(capability: Mapping[str, bool], onednn_cap: str) -> str:
    """:func:`cpu_kind` from torch's CPU capability and a value of ``ONEDNN_MAX_CPU_ISA``."""
    kind = (
        "amx"
        if capability.get("amx_bf16")
        else "avx512_bf16"
        if capability.get("avx512_bf16")
        else "avx2"
        if capability.get("avx2")
        else "other"
    )
    cap = onednn_cap.strip().upper()
    if not cap or cap in ("ALL", "DEFAULT") or kind not in ("amx", "avx512_bf16"):
        return kind
    if "AMX" in cap:
        return kind
    if cap in _BF16_WITHOUT_AMX_CAPS:
        return "avx512_bf16"
    return "avx2" if capability.get("avx2") else "other"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (:func:`cpu_kind` is AMX or AVX512-BF16).

    Without either, torch emulates bf16 matmul on the CPU, many times slower
    than fp32 (docs/benchmarks.md, "Why Newton-Schulz is fast on a CPU"). Unknown (a torch without the probe) reads as no.
    """
    return cpu_kind() in ("amx", "avx512_bf16")


#: The kinds of hook ``torch.optim.Optimizer``'s ``register_<kind>_hook`` methods keep,
#: each in a private dict of the optimizer.
OPTIMIZER_HOOKS = (
    "step_pre",
    "step_post",
    "state_dict_pre",
    "state_dict_post",
    "load_state_dict_pre",
    "load_state_dict_post",
)


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """What ``Optimizer.__init__`` sets up for hooks, for an optimizer that does not call it.

    The empty hook dicts the ``register_*_hook`` methods fill, and the patched
    ``step`` that runs the step hooks.
    """
    for kind in OPTIMIZER_HOOKS:
        setattr(optimizer, f"_optimizer_{kind}_hooks", OrderedDict())
    optimizer._patch_step_function()


def optimizer_hook_dict(optimizer: torch.optim.Optimizer, kind: str) -> dict[Any, Any]:
    """The live dict of hooks registered on ``optimizer`` with ``register_<kind>_hook``."""
    if kind not in OPTIMIZER_HOOKS:
        raise HyperParallelValueError(f"no optimizer hook kind {kind!r}; one of {OPTIMIZER_HOOKS}")
    hooks: dict[Any, Any] = getattr(optimizer, f"_optimizer_{kind}_hooks")
    return hooks


# -- process exit under gloo ---------------------------------------------------------

#: The name torch gives the threads that run a gloo process group's collectives.
_GLOO_WORKER_THREAD = "pt_gloo_runloop"

#: How long a process with gloo workers hands them the GIL before the interpreter stops.
GLOO_SETTLE_S = 0.05


def gloo_workers_alive() -> bool:
    """Whether this process has threads running gloo collectives.

    A gloo group's worker threads outlive ``destroy_process_group`` for as
    long as a ``DeviceMesh`` or an FSDP module refers to the group. Read from
    ``/proc`` where there is one; elsewhere, whether a group is still up.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return torch.distributed.is_available() and torch.distributed.is_initialized()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == _GLOO_WORKER_THREAD:
                    return True
        except OSError:  # the thread ended while we looked
            continue
    return False


def let_gloo_workers_finish() -> None:
    """Give gloo's worker threads the GIL before Python shuts down, so the process exits cleanly.

    A gloo worker frees each collective's tensors after the caller's ``wait``
    has returned. Where the caller has already dropped them, freeing takes the
    GIL; a worker that asks for it once the interpreter is finalizing is ended
    mid-destructor, and the process aborts with "terminate called without an
    active exception" after all its work is done. Sleeping here, while the
    interpreter is still whole, lets any such worker finish first.
    """
    if gloo_workers_alive():
        time.sleep(GLOO_SETTLE_S)


# At import, so that it runs after every exit handler registered later (the teardown of a
# process group init_device_mesh brought up among them); without gloo it is a no-op.
atexit.register(let_gloo_workers_finish)
