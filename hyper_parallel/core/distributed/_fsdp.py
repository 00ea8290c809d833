"""``fully_shard``: torch FSDP2 on every repeated block and the root, plus a gradient scaling factor.

The gradient scaling factor multiplies each reduced gradient shard (after
FSDP's reduce-scatter, HSDP's all-reduce and FSDP's usual averaging) before it
lands in ``.grad``. It is installed through FSDP2's public per-unit
all-reduce hook (``FSDPModule.set_all_reduce_hook``), which FSDP calls on the
reduce-scatter output (1-D mesh) or the all-reduce output (HSDP) and before
the gradient is written into the sharded parameter. FSDP's own
``set_gradient_divide_factor`` is not used: for fp32/bf16 it reduces with
``ReduceOp.PREMUL_SUM``, which gloo rejects, and its ``SUM``-only variant
(``set_force_sum_reduction_for_comms``) divides twice when a unit's shard
group has one rank.

``MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)`` (HyperParallel's
flag) rides on the same hook: it keeps a reference to the reduced gradients
in the reduce dtype, before FSDP casts them to the param's dtype, and a
post-accumulate-grad hook on each sharded param then adds its slice, in
fp32, into the param's ``main_grad`` and releases the low-precision
``.grad`` FSDP wrote.
"""

from __future__ import annotations

import math
import os
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hyper_parallel.core._grads import MAIN_GRAD_ATTR
from hyper_parallel.core.compat import (
    ReducedGradSlot,
    fsdp_all_reduce_hooks,
    fsdp_reduced_grad_slots,
)
from hyper_parallel.core.distributed._mesh import hsdp_mesh, init_device_mesh
from hyper_parallel.core.distributed._presharding import remember_params_before_sharding
from hyper_parallel.core.errors import (
    HyperParallelRuntimeError,
    HyperParallelTypeError,
    HyperParallelValueError,
)

__all__ = [
    "BlockPredicate",
    "GradientScaling",
    "MixedPrecisionPolicy",
    "fully_shard",
    "set_gradient_scaling_factor",
]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: ``(qualified_name, module) -> bool``: whether a submodule is its own FSDP unit.
BlockPredicate = Callable[[str, nn.Module], bool]

_SCALING_ATTR = "_hyper_parallel_gradient_scaling"
_WATCHED_ATTR = "_hyper_parallel_main_grad_hook"


@dataclass(frozen=True)
class MixedPrecisionPolicy(TorchMixedPrecisionPolicy):
    """torch's FSDP2 ``MixedPrecisionPolicy``, plus HyperParallel's ``apply_grad_on_fp32_main_grad``.

    The fields before it are torch's, in HyperParallel's order too, so
    ``MixedPrecisionPolicy(torch.bfloat16, torch.float32)`` means the same
    in both. It is a torch policy: :func:`fully_shard` (and torch's own)
    takes it.

    Attributes:
        apply_grad_on_fp32_main_grad: Under :func:`fully_shard`, each reduced
            gradient shard lands in the sharded param's ``main_grad``, an
            fp32 DTensor sharded like the param, added to what it holds
            (micro-batches accumulate in fp32), and the param's ``.grad``
            stays ``None``. The value is FSDP's reduced gradient (in
            ``reduce_dtype``) upcast, before FSDP would round it to the
            param's dtype: give ``reduce_dtype=torch.float32`` for an fp32
            reduction too. ``get_hyper_optimizer(..., fp32_main_params=True)``
            steps with ``main_grad`` and clears it in ``zero_grad``; an
            optimizer that steps ``.grad`` (torch's, or ours without main
            params) is stopped with an error at its step.
    """

    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.apply_grad_on_fp32_main_grad, bool):
            raise HyperParallelTypeError(
                "MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=...) takes True or False, got "
                f"{self.apply_grad_on_fp32_main_grad!r}."
            )


class GradientScaling:
    """The factor one sharded model multiplies its reduced gradients by.

    One instance is shared by the all-reduce hooks of every FSDP unit of the
    model, so setting the factor reaches them all at once.
    """

    def __init__(self) -> None:
        self.factor: float | None = None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """FSDP all-reduce hook: scale the unit's reduced gradient shard in place."""
        if self.factor is not None:
            reduce_output.mul_(self.factor)


def _find_blocks(module: nn.Module) -> list[nn.Module]:
    for container in module.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            children = list(container.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                return children
    return []


def _select_blocks(
    module: nn.Module, blocks: Sequence[nn.Module] | BlockPredicate | None
) -> list[nn.Module]:
    if blocks is None:
        return _find_blocks(module)
    named = [(name, sub) for name, sub in module.named_modules() if sub is not module]
    if callable(blocks) and not isinstance(blocks, nn.Module):
        return [sub for name, sub in named if blocks(name, sub)]
    if isinstance(blocks, (nn.Module, str)) or not isinstance(blocks, Sequence):
        raise HyperParallelTypeError(
            "blocks must be None (find the repeated blocks), a list of submodules, or a "
            f"predicate (name, module) -> bool; got {type(blocks).__name__}."
        )
    index = {id(sub): i for i, (_, sub) in enumerate(named)}
    chosen: dict[int, nn.Module] = {}
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise HyperParallelTypeError(
                f"blocks must hold nn.Module instances, got {type(block).__name__}."
            )
        if block is module:
            raise HyperParallelValueError(
                "blocks must not contain the root module; it is sharded last anyway."
            )
        if id(block) not in index:
            raise HyperParallelValueError(
                f"block {type(block).__name__} is not a submodule of the model being sharded."
            )
        chosen[id(block)] = block
    # In module order; fully_shard applies them in reverse, so children precede parents.
    return sorted(chosen.values(), key=lambda b: index[id(b)])


def _check_devices(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, param in module.named_parameters():
        kind = param.device.type
        # FSDP moves CPU params to the mesh's device and keeps meta params for deferred
        # init; params already on another accelerator would be moved silently.
        if kind not in ("cpu", "meta", mesh.device_type):
            raise HyperParallelValueError(
                f"parameter {name!r} is on {param.device} but the mesh is on "
                f"{mesh.device_type!r}; move the model to CPU (or {mesh.device_type}) or build "
                f"the mesh with init_device_mesh({kind!r}, ...)."
            )


def _check_factor(factor: float | int | torch.Tensor) -> float:
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise HyperParallelValueError(
                f"gradient scaling factor tensor must have one element, got shape "
                f"{tuple(factor.shape)}."
            )
        value = float(factor.detach().item())
    elif isinstance(factor, (int, float)) and not isinstance(factor, bool):
        value = float(factor)
    else:
        raise HyperParallelTypeError(
            f"gradient scaling factor must be a float, an int or a 1-element tensor, got "
            f"{type(factor).__name__}."
        )
    if not math.isfinite(value) or value <= 0:
        raise HyperParallelValueError(
            f"gradient scaling factor must be finite and > 0, got {value}; pass None to "
            "turn scaling off."
        )
    return value


def set_gradient_scaling_factor(
    module: nn.Module,
    factor: float | int | torch.Tensor | None = None,
    *,
    scale_factor: float | int | torch.Tensor | None = None,
) -> None:
    """Multiply the model's reduced gradients by ``factor`` before they land in ``.grad``.

    Applies to every FSDP unit of a model sharded by :func:`fully_shard`, from
    the next backward on. The factor multiplies the gradient FSDP would
    otherwise store (already averaged over the data-parallel ranks), so
    ``grad == factor * unscaled_grad``. Also available as the method
    ``model.set_gradient_scaling_factor(...)``.

    Args:
        module: The root returned by :func:`fully_shard`.
        factor: A finite number > 0 (float, int or 1-element tensor, read once
            now), or ``None`` to turn scaling off.
        scale_factor: The same, by keyword (the guide's spelling); give one of
            ``factor`` and ``scale_factor``, not both.

    Raises:
        TypeError: both arguments given, or a factor of the wrong type.
        ValueError: a non-finite or non-positive factor, a tensor with more
            than one element, a module not sharded by :func:`fully_shard`, or
            an FSDP unit that already has a user all-reduce hook.

    Note:
        The factor rides on FSDP's per-unit all-reduce hook; a later
        ``set_all_reduce_hook`` on a unit replaces it for that unit.
    """
    if factor is not None and scale_factor is not None:
        raise HyperParallelTypeError(
            "set_gradient_scaling_factor() takes factor or scale_factor, not both "
            f"(got factor={factor!r}, scale_factor={scale_factor!r})."
        )
    requested = factor if factor is not None else scale_factor
    scaling = getattr(module, _SCALING_ATTR, None)
    if not isinstance(scaling, GradientScaling):
        raise HyperParallelValueError(
            f"{type(module).__name__} was not sharded by hyper_parallel.fully_shard; "
            "call fully_shard(model, mesh=...) first."
        )
    value = None if requested is None else _check_factor(requested)
    if value is not None:
        _install_hooks(module, scaling, main_grad=False)
    scaling.factor = value


class _UnitHook:
    """One FSDP unit's all-reduce hook: the model's scaling factor, then the main_grad capture."""

    def __init__(self, unit: FSDPModule, scaling: GradientScaling, main_grad: bool) -> None:
        self.unit = unit
        self.scaling = scaling
        self.main_grad = main_grad

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """Scale the unit's reduced gradients in place; keep them for ``main_grad``."""
        self.scaling(reduce_output)
        if self.main_grad:
            _capture(self.unit, reduce_output)


def _install_hooks(module: nn.Module, scaling: GradientScaling, *, main_grad: bool) -> None:
    """Give every FSDP unit of ``module`` its :class:`_UnitHook` (once)."""
    # Installed on first use only, so a model that neither scales nor keeps main_grad keeps
    # FSDP's hook slot (and its stream waits) free; turning scaling off leaves a no-op.
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        current = fsdp_all_reduce_hooks(unit)
        ours = [isinstance(h, _UnitHook) and h.scaling is scaling for h in current]
        if any(hook is not None and not mine for hook, mine in zip(current, ours, strict=True)):
            raise HyperParallelValueError(
                f"FSDP unit {type(unit).__name__} already has an all-reduce hook "
                "(set_all_reduce_hook); the gradient scaling factor and main_grad need that slot."
            )
        if current and not all(ours):
            unit.set_all_reduce_hook(_UnitHook(unit, scaling, main_grad))


# -- main_grad ----------------------------------------------------------------------


class _Landing(threading.local):
    """The reduced gradients FSDP is writing now (in this thread), and how far they are taken."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.slots: dict[int, ReducedGradSlot] = {}


_LANDING = _Landing()


def _capture(unit: FSDPModule, reduce_output: torch.Tensor) -> None:
    """Keep ``unit``'s flat reduced gradients for its params' post-accumulate-grad hooks."""
    slots = fsdp_reduced_grad_slots(unit)
    for slot in slots:
        # A param FSDP replaced since the last reduce (``model.to``, a load with assign=True)
        # gets the hook now, before FSDP writes its gradient.
        if slot.param.requires_grad and not getattr(slot.param, _WATCHED_ATTR, False):
            slot.param.register_post_accumulate_grad_hook(_land_main_grad)
            setattr(slot.param, _WATCHED_ATTR, True)
    _LANDING.buffer, _LANDING.offset = reduce_output, 0
    _LANDING.slots = {id(slot.param): slot for slot in slots}


def _next_reduced_shard(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s shard of the captured reduced gradients; FSDP writes them in slot order."""
    buffer, slot = _LANDING.buffer, _LANDING.slots.get(id(param))
    if buffer is None or slot is None:
        grad = param.grad  # a gradient that did not come through FSDP's reduction
        return grad.to_local() if isinstance(grad, DTensor) else grad
    start, end = _LANDING.offset, _LANDING.offset + slot.span
    if end > buffer.numel():
        raise HyperParallelRuntimeError(
            f"FSDP reduced {buffer.numel()} gradient elements, fewer than its params' shards "
            f"take ({end}): this torch lays them out differently, and "
            "apply_grad_on_fp32_main_grad cannot place them; turn it off."
        )
    _LANDING.offset = end
    if end == buffer.numel():  # all taken: do not keep the buffer alive
        _LANDING.buffer, _LANDING.slots = None, {}
    return torch.as_strided(buffer, slot.size, slot.stride, start)


@torch.no_grad()
def _land_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: add ``param``'s reduced shard to its fp32 ``main_grad``."""
    shard = _next_reduced_shard(param)
    if shard is None:
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    shard = shard.to(device=local.device, dtype=torch.float32)
    main_grad = getattr(param, MAIN_GRAD_ATTR, None)
    if main_grad is None:
        if isinstance(param, DTensor):
            main_grad = DTensor.from_local(
                shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        else:
            main_grad = shard
        setattr(param, MAIN_GRAD_ATTR, main_grad)
    else:
        (main_grad.to_local() if isinstance(main_grad, DTensor) else main_grad).add_(shard)
    param.grad = None


_STEP_GUARD: list[Any] = []


def _guard_steps_that_read_grad() -> None:
    """Stop an optimizer that steps ``.grad`` while the gradients are in ``main_grad`` (once)."""
    if not _STEP_GUARD:
        hook = register_optimizer_step_pre_hook(_refuse_grads_in_main_grad)
        _STEP_GUARD.append(hook)


def _refuse_grads_in_main_grad(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: torch's optimizers and ours read ``.grad``, never ``main_grad``."""
    del args, kwargs  # the step's own arguments: not needed
    if getattr(optimizer, "main_params", None) is not None:
        return  # a ChainedOptimizer with fp32 main params moves main_grad in itself
    if not type(optimizer).__module__.startswith(("torch.optim", "hyper_parallel")):
        return  # another optimizer may read main_grad itself, as Megatron's do
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None and getattr(param, MAIN_GRAD_ATTR, None) is not None:
                name = getattr(param, "model_name", None) or f"a {tuple(param.shape)} param"
                raise HyperParallelRuntimeError(
                    f"{type(optimizer).__name__}.step(): {name}'s gradient is in its main_grad "
                    "(fully_shard with MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)) "
                    "and its .grad is None, so this optimizer would not update it. Build the "
                    "optimizer with get_hyper_optimizer(..., fp32_main_params=True), which steps "
                    "with main_grad, or turn apply_grad_on_fp32_main_grad off."
                )


def _default_mesh(*, hsdp: bool) -> DeviceMesh:
    """A 1-D mesh over the world, or HSDP's ``(nodes, processes per node)``."""
    # A gloo-only group cannot drive an accelerator mesh even where one is present.
    device = "cpu" if dist.is_initialized() and dist.get_backend() == "gloo" else "auto"
    if hsdp:
        return hsdp_mesh(device)
    world = dist.get_world_size() if dist.is_initialized() else None
    # init_device_mesh initializes the process group from torchrun's environment
    # (or says which variables are missing).
    return init_device_mesh(device, (world or int(os.environ.get("WORLD_SIZE") or 1),))


def fully_shard(
    module: ModuleT,
    *,
    mesh: DeviceMesh | Literal["hsdp"] | None = None,
    blocks: Sequence[nn.Module] | BlockPredicate | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: TorchMixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> ModuleT:
    """Shard ``module`` with torch FSDP2: each repeated block, then the root.

    A 1-D mesh shards parameters over all its ranks (``Shard(0)``); a 2-D mesh
    ``(replicate, shard)`` is HSDP (``(Replicate(), Shard(0))``). The model is
    changed in place and returned; it is then an ``FSDPModule`` with the extra
    method ``set_gradient_scaling_factor(factor=None, *, scale_factor=None)``
    (see :func:`set_gradient_scaling_factor`).

    Example::

        mesh = init_device_mesh("cpu", (dp_size,), mesh_dim_names=("dp",))
        model = fully_shard(model, mesh=mesh)
        model.set_gradient_scaling_factor(scale_factor=0.5)

    Args:
        module: The model. Its parameters may be on CPU, on meta, or on the
            mesh's device.
        mesh: A 1-D or 2-D ``DeviceMesh``; ``None`` builds a 1-D mesh over the
            world on the default device (``init_device_mesh("auto", world)``);
            ``"hsdp"`` builds HSDP's default mesh, ``(nodes, processes per
            node)`` (:func:`hsdp_mesh`).
        blocks: The submodules that become their own FSDP units. ``None``
            finds them: the children of the first ``nn.ModuleList`` /
            ``nn.Sequential`` holding two or more modules of one class (e.g.
            ``model.layers``). Or a list of submodules, or a predicate
            ``(name, module) -> bool`` over ``module.named_modules()``.
        reshard_after_forward: Passed to FSDP for the blocks. When ``True``
            the root keeps FSDP's root default (no reshard after forward, as
            backward needs its parameters at once).
        mp_policy: FSDP's ``MixedPrecisionPolicy``, or ours
            (:class:`MixedPrecisionPolicy`), which adds HyperParallel's
            ``apply_grad_on_fp32_main_grad``; ``None`` keeps dtypes.
        offload_policy: FSDP's ``OffloadPolicy``; ``None`` offloads nothing.

    Returns:
        ``module`` itself, now an ``FSDPModule``.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a module already sharded by FSDP, a mesh that is not 1-D
            or 2-D, parameters on an accelerator other than the mesh's, or
            blocks that are not submodules of ``module``.
    """
    if not isinstance(module, nn.Module):
        raise HyperParallelTypeError(
            f"fully_shard expects an nn.Module, got {type(module).__name__}."
        )
    already = [
        name or "<root>" for name, sub in module.named_modules() if isinstance(sub, FSDPModule)
    ]
    if already:
        raise HyperParallelValueError(
            f"{type(module).__name__} is already sharded by FSDP (FSDP units: "
            f"{', '.join(already[:5])}); call fully_shard once, on the unsharded model."
        )
    if isinstance(mesh, str) and mesh != "hsdp":
        raise HyperParallelValueError(
            f"mesh={mesh!r}: the one mesh named by a string is 'hsdp'; pass a DeviceMesh "
            "(init_device_mesh) or None for a 1-D mesh over the world."
        )
    if mesh is not None and not isinstance(mesh, (DeviceMesh, str)):
        raise HyperParallelTypeError(
            f"mesh must be a torch DeviceMesh, 'hsdp' or None, got {type(mesh).__name__}."
        )
    if not isinstance(reshard_after_forward, int):
        raise HyperParallelTypeError(
            f"reshard_after_forward must be a bool or int, got {type(reshard_after_forward).__name__}."
        )
    if mp_policy is not None and not isinstance(mp_policy, TorchMixedPrecisionPolicy):
        raise HyperParallelTypeError(
            f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}."
        )
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise HyperParallelTypeError(
            f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}."
        )
    units = _select_blocks(module, blocks)
    if mesh is None or mesh == "hsdp":
        mesh = _default_mesh(hsdp=mesh == "hsdp")
    if mesh.ndim not in (1, 2):
        raise HyperParallelValueError(
            f"fully_shard needs a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP); "
            f"got a {mesh.ndim}-D mesh {tuple(mesh.shape)} with names {mesh.mesh_dim_names}."
        )
    _check_devices(module, mesh)

    mp = mp_policy or TorchMixedPrecisionPolicy()
    offload = offload_policy or OffloadPolicy()
    # FSDP2 replaces every param with a sharded one; remember which old param became which
    # name, so param lists built before sharding (as the user guide does) still resolve.
    remember_params_before_sharding(module)
    for block in reversed(units):
        _torch_fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
            offload_policy=offload,
        )  # fmt: skip
    root_reshard = None if reshard_after_forward is True else reshard_after_forward
    _torch_fully_shard(
        module, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=mp, offload_policy=offload
    )

    scaling = GradientScaling()
    setattr(module, _SCALING_ATTR, scaling)
    bound = types.MethodType(set_gradient_scaling_factor, module)
    setattr(module, "set_gradient_scaling_factor", bound)  # noqa: B010
    if isinstance(mp, MixedPrecisionPolicy) and mp.apply_grad_on_fp32_main_grad:
        _install_hooks(module, scaling, main_grad=True)
        _guard_steps_that_read_grad()
    return module
