"""The plugin module: what the ``hyper_parallel`` entry point of this distribution names.

hyper_parallel imports this module on its first registry lookup and calls
each function marked ``@hookimpl`` once, with a ``register`` callback. The
function names must be hook names from
:mod:`hyper_parallel.core.plugin.hookspecs`; implement only the hooks you need.
"""

from __future__ import annotations

from hyper_parallel import hookimpl
from hyper_parallel.core.plugin import RegisterFn

from .lion import Lion
from .schedules import step_decay

__all__ = ["hyper_parallel_register_lr_schedulers", "hyper_parallel_register_optimizers"]


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``lion``."""
    register("lion", Lion, description="Lion: sign of an interpolated momentum (Chen et al. 2023)")


@hookimpl
def hyper_parallel_register_lr_schedulers(register: RegisterFn) -> None:
    """Register ``step_decay`` (alias ``staircase``)."""
    register(
        "step_decay",
        step_decay,
        description="linear warmup, then the lr times gamma every `every` steps",
        aliases=("staircase",),
    )
