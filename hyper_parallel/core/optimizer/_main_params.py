"""fp32 main copies of a low-precision model's params.

A bf16 param cannot take an update smaller than half its ulp: AdamW's
``lr * m / sqrt(v)`` at ``lr=1e-5`` on a weight near 1 rounds away, step after
step. :class:`MainParams` keeps an fp32 copy (the *main* param) of each
low-precision param. The optimizers hold and step the main copies, so their
state is fp32 too; around each step the chain moves the gradients in and the
rounded values out:

1. ``main.grad = param.grad`` upcast to fp32;
2. the optimizers step the main copies;
3. ``param`` becomes ``main`` rounded to its dtype (round to nearest even).

A main copy is made from the param itself (``param.detach().float()``), so a
sharded param (a DTensor under ``fully_shard``) gets a main copy sharded the
same way, and the optimizers see the same layout they would see without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["MAIN_DTYPE", "MainParams", "grad_tensors", "needs_main_copy"]

#: The dtype of every main copy.
MAIN_DTYPE = torch.float32


def needs_main_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` is floating point with less precision than fp32 (bf16, fp16, ...)."""
    return param.is_floating_point() and param.element_size() < MAIN_DTYPE.itemsize


def grad_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """The tensors that hold ``optimizer``'s gradients between ``backward`` and ``step``.

    Its params; for a :class:`~hyper_parallel.core.optimizer.ChainedOptimizer`
    with main copies, the model params those stand for
    (:meth:`~hyper_parallel.core.optimizer.ChainedOptimizer.grad_params`).
    """
    own = getattr(optimizer, "grad_params", None)
    if callable(own):
        return list(own())
    return [p for group in optimizer.param_groups for p in group["params"]]


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
        for param in params:
            self.add(param)

    def add(self, param: torch.Tensor) -> torch.Tensor:
        """Make ``param``'s main copy if it needs one and has none; return :meth:`main_of`."""
        if needs_main_copy(param) and id(param) not in self._main and id(param) not in self._param:
            main = nn.Parameter(param.detach().to(MAIN_DTYPE), requires_grad=param.requires_grad)
            self._pair(param, main)
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

    @torch.no_grad()
    def grads_to_mains(self) -> None:
        """Give each main copy its param's gradient, upcast (``None`` stays ``None``)."""
        for param, main in self._pairs:
            grad = param.grad
            main.grad = None if grad is None else grad.to(MAIN_DTYPE)

    @torch.no_grad()
    def mains_to_params(self) -> None:
        """Round each main copy into its param, and drop the main copies' gradients."""
        for param, main in self._pairs:
            param.copy_(main)
            main.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the params (where backward writes them) and of the main copies."""
        for param, main in self._pairs:
            for tensor in (param, main):
                if tensor.grad is None:
                    continue
                if set_to_none:
                    tensor.grad = None
                else:
                    tensor.grad.detach_().zero_()

    def __getstate__(self) -> dict[str, Any]:
        # The lookups are by id(), which a copy (deepcopy, pickle) does not keep.
        return {"pairs": self._pairs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        for param, main in state["pairs"]:
            self._pair(param, main)
