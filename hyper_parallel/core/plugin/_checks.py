"""What each kind of registry entry must be, checked once, when a plugin registers it.

A bad entry is then reported against the plugin that registered it, instead
of failing later for every user who selects something by name.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from hyper_parallel.core.errors import HyperParallelTypeError

if TYPE_CHECKING:
    from hyper_parallel.core.plugin._entries import PluginKind

__all__ = ["check_obj"]


_BACKEND_METHODS = ("accepts", "shard_model", "map_blocks", "map_reductions")


def check_obj(kind: PluginKind, name: str, obj: Any) -> None:
    """Raise ``TypeError`` if ``obj`` is not what the hookspec of ``kind`` asks for."""
    what = f"{kind.label} {name!r}"
    if kind.value == "sharding_backend":
        methods = [m for m in _BACKEND_METHODS if not callable(getattr(obj, m, None))]
        if not inspect.isclass(obj) or methods or inspect.isabstract(obj):
            missing = f" (missing {', '.join(methods)})" if methods else ""
            raise HyperParallelTypeError(
                f"{what} must be a concrete subclass of "
                f"hyper_parallel.core.distributed.ShardingBackend{missing}, got {obj!r}."
            )
        return
    if not callable(obj):
        raise HyperParallelTypeError(f"{what} must be callable, got {type(obj).__name__}.")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing more to check
    params = list(signature.parameters.values())
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = {"optimizer": "params", "lr_scheduler": "step", "partitioner": "model"}[kind.value]
    if not positional and not variadic:
        raise HyperParallelTypeError(
            f"{what} must take {first} as its first positional argument; its signature is "
            f"{signature}."
        )
    if kind.value == "lr_scheduler":
        names = {p.name for p in params}
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        lacking = [k for k in ("total_steps", "warmup_steps") if k not in names and not takes_any]
        if lacking:
            raise HyperParallelTypeError(
                f"{what} must be fn(step, *, total_steps, warmup_steps, **options); its "
                f"signature {signature} lacks {', '.join(lacking)}."
            )
