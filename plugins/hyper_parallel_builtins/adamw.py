"""Built-in plugin: ``adamw``, torch's own AdamW with its fastest kernel on.

No AdamW math lives here: this is :class:`torch.optim.AdamW`, with ``fused``
turned on where torch has a fused kernel for the params' device and dtype,
and ``foreach`` otherwise. Explicit ``fused=``/``foreach=`` win.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from hyper_parallel import hookimpl
from hyper_parallel.core.compat import fused_kernel_devices
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import check_group_keys
from hyper_parallel.core.plugin import RegisterFn

__all__ = ["AdamW"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_supported(params: list[torch.Tensor]) -> bool:
    devices = fused_kernel_devices()
    return bool(params) and all(
        p.device.type in devices and p.dtype in _FUSED_DTYPES and not torch.is_complex(p)
        for p in params
    )


class AdamW(torch.optim.AdamW):
    """:class:`torch.optim.AdamW` that defaults to the fused kernel, else foreach.

    Takes exactly the arguments of :class:`torch.optim.AdamW`. When neither
    ``fused`` nor ``foreach`` is given, ``fused=True`` is used if every param
    is on a device and dtype torch's fused AdamW supports (CPU and CUDA
    included), otherwise ``foreach=True``. ``differentiable=True`` or a
    ``capturable`` setup keeps torch's own default.

    A group copied from an AdamW's ``param_groups`` may be given back as it
    is: its ``decoupled_weight_decay`` (which torch puts in every group) is
    accepted with AdamW's value, ``True``.
    """

    #: Keys torch puts in every group that no argument sets, with the only value each may have.
    fixed_group_keys: ClassVar[Mapping[str, Any]] = {"decoupled_weight_decay": True}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        params = list(params)
        if fused is None and foreach is None and not differentiable:
            tensors = [
                p
                for item in params
                for p in (item["params"] if isinstance(item, dict) else [item])
                if isinstance(p, torch.Tensor)
            ]
            if _fused_supported(tensors):
                fused = True
            else:
                foreach = True
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; an unknown key (a typo such as ``lrr``) is a ``ValueError``.

        So is ``decoupled_weight_decay=False``: that group would be Adam with
        L2 regularization (use the ``adam`` optimizer for it), not AdamW.
        """
        check_group_keys(
            param_group, {*self.defaults, *self.fixed_group_keys}, where="optimizer AdamW"
        )
        for key, value in self.fixed_group_keys.items():
            if key in param_group and param_group[key] != value:
                raise HyperParallelValueError(
                    f"A param group of optimizer AdamW sets {key}={param_group[key]!r}; AdamW's "
                    f"is always {value!r}. Drop the key, or use the 'adam' optimizer "
                    "(torch.optim.Adam) for weight decay added to the gradient."
                )
        super().add_param_group(param_group)


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``adamw``."""
    register("adamw", AdamW, description="torch's AdamW, fused where the device supports it")
