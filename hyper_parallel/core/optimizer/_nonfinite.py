"""NaN and Inf: a step skipped for a non-finite gradient, and state that went non-finite.

A training loop already reads its loss every step. These checks cost nothing
more on a healthy step: the gradients are checked before the step (one
collective), and params and optimizer state only when the loss itself is not
finite, or before a checkpoint keeps them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from hyper_parallel.core._grads import grad_of, grad_tensors
from hyper_parallel.core.distributed._dtensor import local_tensor

__all__ = [
    "NonFiniteTensors",
    "grads_are_finite",
    "named_training_state",
    "non_finite",
    "non_finite_state",
    "step_if_finite",
]


class NonFiniteTensors(list[str]):
    """The names of the tensors that hold NaN or Inf, in order; empty when all are finite."""

    @property
    def summary(self) -> str:
        """The first name, and how many more: ``"lm_head.weight (and 3 more)"``."""
        if not self:
            return "no tensor"
        return self[0] + (f" (and {len(self) - 1} more)" if len(self) > 1 else "")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def grads_are_finite(optimizer: Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s params is finite, on every rank.

    With fp32 main params, the gradients checked are the model params' (see
    :func:`~hyper_parallel.core.optimizer._main_params.grad_tensors`).

    Sharded gradients (DTensors) are checked on their local shards and the
    verdict is combined over the default process group, so all ranks agree
    (and must all call this).
    """
    grads = [g for p in grad_tensors(optimizer) if (g := grad_of(p)) is not None]
    # the same pass as any state check: one read of the verdicts, not one per gradient
    return not non_finite((str(i), g) for i, g in enumerate(grads))


def step_if_finite(optimizer: Optimizer) -> bool:
    """Step ``optimizer`` unless a gradient is NaN/Inf; returns whether it stepped.

    A skipped step leaves params and optimizer state untouched (the
    gradients are kept for the caller to inspect and then zero).

    Examples:
        >>> loss.backward()
        >>> if not step_if_finite(optimizer):
        ...     print("skipped a step: non-finite gradient")
        >>> optimizer.zero_grad()
    """
    if not grads_are_finite(optimizer):
        return False
    optimizer.step()
    return True


def _local_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names, in order, of this process's tensors (local shards) holding NaN or Inf.

    One pass over each tensor for its smallest and largest value (NaN
    propagates to both, an Inf is one of them, and nothing can overflow),
    then one read of the verdicts per device and dtype. ``aminmax`` runs at about five
    times the speed of an ``inf``-norm on CPU (docs/benchmarks.md).
    """
    names: list[str] = []
    # per device and dtype: a float64 extreme cast down could overflow into a false Inf
    extremes: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    owners: dict[tuple[torch.device, torch.dtype], list[str]] = defaultdict(list)
    for name, tensor in named:
        local = local_tensor(tensor).detach()
        if local.is_complex():
            local = torch.view_as_real(local)
        if local.is_floating_point() and local.numel():
            names.append(name)
            extremes[(local.device, local.dtype)].append(torch.stack(torch.aminmax(local)))
            owners[(local.device, local.dtype)].append(name)
    bad: set[str] = set()
    for kind, pairs in extremes.items():
        finite = torch.isfinite(torch.stack(pairs)).all(dim=1).tolist()
        bad.update(name for name, ok in zip(owners[kind], finite, strict=True) if not ok)
    return [name for name in dict.fromkeys(names) if name in bad]


def non_finite(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    local: bool = False,
) -> NonFiniteTensors:
    """The names of the tensors in ``named`` that hold NaN or Inf, on any rank.

    Sharded tensors (DTensors) are checked on their local shards; under a
    process group every rank of ``group`` must call it and all get the same
    list (each rank's finds, in rank order, without repeats). A healthy
    check costs one small all-reduce.

    Args:
        named: ``name -> tensor``, or ``(name, tensor)`` pairs. Tensors that
            are not floating point are skipped.
        group: The process group to agree over (the default one).
        local: Check this process's tensors alone, without a collective.
    """
    pairs = named.items() if isinstance(named, Mapping) else named
    mine = NonFiniteTensors(_local_non_finite(pairs))
    if local or not _distributed() or dist.get_world_size(group) == 1:
        return mine
    count = torch.tensor([len(mine)], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if not int(count.item()):
        return NonFiniteTensors()
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return NonFiniteTensors(dict.fromkeys(name for names in everyone for name in names or ()))


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's small tensor lives: the CPU under gloo, else the accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return accelerator if accelerator is not None else torch.device("cpu")


def named_training_state(
    model: nn.Module, optimizer: Optimizer
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a step changes, by a name a person can find it under.

    The model's params by their names; fp32 main copies as ``<name> (fp32
    main copy)``; each sub-optimizer's state as ``<optimizer> state
    <name>.<key>`` (a plain optimizer is ``optimizer``).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    yield from model.named_parameters()
    mains = getattr(optimizer, "main_params", None)
    for param, main in mains if mains is not None else ():
        if main is not param:
            names[id(main)] = names.get(id(param), "?")
            yield f"{names[id(param)]} (fp32 main copy)", main
    subs = getattr(optimizer, "optimizers", None)
    named_subs = subs.items() if isinstance(subs, Mapping) else [("optimizer", optimizer)]
    for opt_name, opt in named_subs:
        for param, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield f"{opt_name} state {names.get(id(param), '?')}.{key}", value


def non_finite_state(model: nn.Module, optimizer: Optimizer) -> NonFiniteTensors:
    """The params, main params and optimizer state of a training run that hold NaN or Inf.

    Collective under a process group (see :func:`non_finite`). Call it when
    the loss is not finite, to tell a bad batch (nothing listed: skip it)
    from a run whose state is lost (stop), or before keeping the state.

    Examples:
        >>> loss = model(batch).mean()
        >>> if not torch.isfinite(loss) and (bad := non_finite_state(model, optimizer)):
        ...     raise SystemExit(f"the run diverged: {bad[0]} is not finite")
    """
    return non_finite(named_training_state(model, optimizer))
