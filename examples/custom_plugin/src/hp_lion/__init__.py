"""hp_lion: a third-party hyper_parallel plugin, and the template for writing one.

It adds the optimizer ``lion`` (:class:`Lion`) and the LR schedule
``step_decay`` (:func:`step_decay`, alias ``staircase``). Installing the
distribution is all it takes: hyper_parallel finds :mod:`hp_lion.plugin`
through the ``hyper_parallel`` entry-point group, so users select them by name::

    get_hyper_optimizer(model, optimizers={"lion": {"params": params, "lr": 1e-4}})
    get_hyper_lr_scheduler(optimizer, "step_decay", total_steps=1000, gamma=0.5, every=100)
"""

from .lion import Lion
from .schedules import step_decay

__version__ = "0.1.0"

__all__ = ["Lion", "__version__", "step_decay"]
