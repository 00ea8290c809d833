"""The plugin contract: the four hooks a ``hyper_parallel`` plugin may implement.

A plugin is a module (or any object) with functions marked by
``from hyper_parallel import hookimpl``. It is found through the entry-point
group ``hyper_parallel``::

    # pyproject.toml of a third-party distribution
    [project.entry-points.hyper_parallel]
    my_plugin = "my_package.hp_plugin"

Each hook is called once per registry load with a ``register`` callback::

    register(name, obj, *, description="", aliases=())

``name`` and every alias are matched case-insensitively, with ``-`` and ``_``
treated alike, and must be unique within their kind across all plugins: a
second registration of a name is an error that names both plugins. What
``obj`` must be depends on the hook, as documented below. Registration only
records ``obj``; nothing is built until a user selects it by name.
"""

from __future__ import annotations

from hyper_parallel.core.plugin._markers import hookspec
from hyper_parallel.core.plugin._types import RegisterFn

__all__ = [
    "hyper_parallel_register_lr_schedulers",
    "hyper_parallel_register_optimizers",
    "hyper_parallel_register_partitioners",
    "hyper_parallel_register_sharding_backends",
]


@hookspec
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register optimizers.

    ``obj`` is a callable ``(params, **kwargs) -> torch.optim.Optimizer``; an
    optimizer class is the usual choice. ``params`` is a list of param-group
    dicts. Its keyword arguments are checked against its signature before it
    is called, so a misspelt keyword is reported with a suggestion instead of
    being dropped. ``requires=`` names what it needs of the loop that steps
    it (``"closure"``, ``"sparse_grads"``, ``"matrices_only"``), and
    ``hyper-parallel plugins`` shows them. ``"matrices_only"`` tells
    :func:`~hyper_parallel.core.optimizer.get_hyper_optimizer` (and
    ``hyper-parallel train``) that params with fewer than two dims belong to
    AdamW (``OptimizerEntry.matrix_only``); ``hyper-parallel train`` refuses
    an optimizer with either of the others.
    """


@hookspec
def hyper_parallel_register_lr_schedulers(register: RegisterFn) -> None:
    """Register learning-rate schedules.

    ``obj`` is ``fn(step, *, total_steps, warmup_steps, **options) -> float``:
    the factor (usually in ``[0, 1]``) applied to every param group's own peak
    lr at ``step`` (0-based; ``step == 0`` is the lr before the first
    optimizer step). Keyword-only parameters of ``fn`` beyond ``total_steps``
    and ``warmup_steps`` are the schedule's options; their defaults are the
    defaults users get. Options named ``min_lr_ratio``, ``start_ratio``,
    ``decay_ratio``, ``decay_steps`` or ``decay_shape`` also make the
    schedule take HyperParallel's ``lr_min`` / ``lr_start`` (over ``lr``),
    ``lr_decay_ratio``, ``wsd_decay_steps`` or ``lr_wsd_decay_style`` when a
    user sets them.
    """


@hookspec
def hyper_parallel_register_partitioners(register: RegisterFn) -> None:
    """Register param-group partitioners.

    ``obj`` is ``fn(model, **options) -> dict[str, list]``: it maps optimizer
    names (as registered, e.g. ``"muon"``) to the params, or param-group
    dicts, that optimizer gets. Frozen params may be left out; every
    trainable param must be assigned exactly once.
    """


@hookspec
def hyper_parallel_register_sharding_backends(register: RegisterFn) -> None:
    """Register sharding backends.

    ``obj`` is a class implementing
    :class:`hyper_parallel.core.distributed.ShardingBackend`: it shards a
    model and brings a matrix optimizer's transform the data it needs: whole
    matrices or row blocks (``map_blocks``), or completed row and column sums
    (``map_reductions``). An instance is made per param group when an
    optimizer is built.
    """
