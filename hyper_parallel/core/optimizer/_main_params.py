"""fp32 main copies of a low-precision model's params.

A bf16 param cannot take an update smaller than half its ulp: AdamW's
``lr * m / sqrt(v)`` at ``lr=1e-5`` on a weight near 1 rounds away, step after
step. :class:`MainParams` keeps an fp32 copy (the *main* param) of each
low-precision param. The optimizers hold and step the main copies, so their
state is fp32 too; around each step the chain moves the gradients in and the
rounded values out:

1. ``main.grad`` = the param's gradient upcast to fp32: its ``main_grad``
   where it has one (a gradient accumulated in fp32, as Megatron-style
   training keeps it), else its ``.grad``, which is then released;
2. the optimizers step the main copies;
3. ``param`` becomes ``main`` rounded to its dtype (round to nearest even).

An fp32 param needs no copy and steps itself; where it has a ``main_grad``,
that becomes its ``.grad``.

A main copy is made from the param itself (``param.detach().float()``), so a
sharded param (a DTensor under ``fully_shard``) gets a main copy sharded the
same way, and the optimizers see the same layout they would see without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hyper_parallel.core._grads import MAIN_GRAD_ATTR, grad_of

__all__ = [
    "MAIN_DTYPE",
    "MAIN_GRAD_ATTR",
    "MainParams",
    "needs_main_copy",
    "warn_main_params_dropped",
    "warn_main_params_rebuilt",
]

#: The dtype of every main copy.
MAIN_DTYPE = torch.float32


def warn_main_params_rebuilt(source: str) -> None:
    """Warn that main copies were remade from the params, as a checkpoint had none."""
    warnings.warn(
        f"{source} has no fp32 main params; initialized the fp32 main parameters from the "
        "loaded model parameters. Values not representable in the model precision cannot be "
        "recovered.",
        UserWarning,
        stacklevel=3,
    )


def warn_main_params_dropped(source: str) -> None:
    """Warn that a checkpoint's main copies were not loaded, as the optimizer keeps none."""
    warnings.warn(
        f"{source} holds fp32 main params, but this optimizer keeps none "
        "(fp32_main_params=False): they were dropped, and training continues from the model's "
        "own params. Build the optimizer with fp32_main_params=True to keep them.",
        UserWarning,
        stacklevel=3,
    )


def needs_main_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` is floating point with less precision than fp32 (bf16, fp16, ...)."""
    return param.is_floating_point() and param.element_size() < MAIN_DTYPE.itemsize


class MainParams:
    """The fp32 main copies of low-precision params, paired with their params.

    Args:
        params: Params to give main copies; those with fp32 or more precision
            are left alone (the optimizers step them directly).

    Examples:
        >>> mains = MainParams(model.parameters())
        >>> muon = Muon([mains.main_of(p) for p in matrices], lr=0.02)
        >>> optimizer = ChainedOptimizer({"muon": muon, ...}, main_params=mains)
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._main: dict[int, nn.Parameter] = {}
        self._param: dict[int, torch.Tensor] = {}
        self._own: dict[int, torch.Tensor] = {}  # params precise enough to step themselves
        for param in params:
            self.add(param)

    def add(self, param: torch.Tensor) -> torch.Tensor:
        """Make ``param``'s main copy if it needs one and has none; return :meth:`main_of`."""
        if id(param) in self._main or id(param) in self._param:
            return self.main_of(param)
        if needs_main_copy(param):
            main = nn.Parameter(param.detach().to(MAIN_DTYPE), requires_grad=param.requires_grad)
            self._pair(param, main)
        else:
            self._own[id(param)] = param
        return self.main_of(param)

    def main_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizers step for ``param``: its main copy, or ``param`` itself."""
        return self._main.get(id(param), param)

    def param_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model param a main copy stands for, or ``tensor`` itself if it is not one."""
        return self._param.get(id(tensor), tensor)

    def _pair(self, param: torch.Tensor, main: nn.Parameter) -> None:
        self._pairs.append((param, main))
        self._main[id(param)] = main
        self._param[id(main)] = param

    def __iter__(self) -> Iterator[tuple[torch.Tensor, nn.Parameter]]:
        """``(param, main)`` pairs, in the order the main copies were made."""
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} main copies)"

    def _chosen(
        self, only: Collection[torch.Tensor] | None
    ) -> tuple[list[tuple[torch.Tensor, nn.Parameter]], list[torch.Tensor]]:
        """The pairs whose main copy, and the fp32 params that, are in ``only`` (``None``: all)."""
        if only is None:
            return self._pairs, list(self._own.values())
        ids = {id(t) for t in only}
        pairs = [(param, main) for param, main in self._pairs if id(main) in ids]
        return pairs, [param for param in self._own.values() if id(param) in ids]

    @torch.no_grad()
    def grads_to_mains(self, only: Collection[torch.Tensor] | None = None) -> None:
        """Give each main copy its param's gradient, upcast (``None`` stays ``None``).

        The gradient is the param's ``main_grad`` where it has one, else its
        ``.grad``; both are released (the main copy now holds it), so the
        next backward starts a new one whoever clears gradients (a trainer's
        ``model.zero_grad()`` does not know ``main_grad``). An fp32 param with
        a ``main_grad`` gets it as its ``.grad``.

        Args:
            only: The tensors the optimizers step (main copies, fp32 params)
                whose gradients move now; ``None``: all of them.
                ``SwapOptimizer`` moves each batch's as the batch comes in.
        """
        pairs, own = self._chosen(only)
        for param, main in pairs:
            grad = grad_of(param)
            main.grad = None if grad is None else grad.to(MAIN_DTYPE)
            param.grad = None
            _release_main_grad(param)
        for param in own:
            main_grad = getattr(param, MAIN_GRAD_ATTR, None)
            if main_grad is not None:
                param.grad = main_grad.to(param.dtype)
                _release_main_grad(param)

    @torch.no_grad()
    def mains_to_params(self, only: Collection[torch.Tensor] | None = None) -> None:
        """Round each main copy into its param, and drop the main copies' gradients.

        Args:
            only: The main copies to round (others are left alone); ``None``: all.
        """
        for param, main in self._chosen(only)[0]:
            param.copy_(main)
            main.grad = None

    @torch.no_grad()
    def params_to_mains(self) -> None:
        """Make each main copy its param again (after the params were loaded without them).

        What the params' precision could not hold (the low bits of the fp32
        values) is lost: the copies restart from the rounded values.
        """
        for param, main in self._pairs:
            main.copy_(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the params (``.grad`` and ``main_grad``) and of the main copies."""
        tensors = [t for pair in self._pairs for t in pair] + list(self._own.values())
        for tensor in tensors:
            main_grad = getattr(tensor, MAIN_GRAD_ATTR, None)
            if main_grad is not None:
                if set_to_none:
                    setattr(tensor, MAIN_GRAD_ATTR, None)
                else:
                    main_grad.detach_().zero_()
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.detach_().zero_()

    def __getstate__(self) -> dict[str, Any]:
        # The lookups are by id(), which a copy (deepcopy, pickle) does not keep.
        return {"pairs": self._pairs, "own": list(self._own.values())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        for param, main in state["pairs"]:
            self._pair(param, main)
        for param in state.get("own", ()):
            self._own[id(param)] = param


def _release_main_grad(param: torch.Tensor) -> None:
    """Drop ``param``'s ``main_grad`` once its main copy (or ``.grad``) holds it."""
    if getattr(param, MAIN_GRAD_ATTR, None) is not None:
        setattr(param, MAIN_GRAD_ATTR, None)
