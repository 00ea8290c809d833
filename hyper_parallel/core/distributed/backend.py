"""The ``ShardingBackend`` contract that sharding plugins implement, and backend selection."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from hyper_parallel.core.distributed._dtensor import is_dtensor
from hyper_parallel.core.plugin import PluginKind, get_registry

__all__ = ["SHARDING_ENV", "FullTensorsFn", "ShardingBackend", "resolve_backend"]

#: Maps a list of full (plain) tensors to results of the same shapes.
FullTensorsFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]

#: Environment variable naming the sharding backend when none is given.
SHARDING_ENV = "HYPER_PARALLEL_SHARDING"


class ShardingBackend(abc.ABC):
    """How params are sharded, and how to compute on the full matrix behind a shard.

    A backend is registered by class through
    ``hyper_parallel_register_sharding_backends`` and instantiated without
    arguments. Subclasses implement all three methods and set ``name`` (the
    name they are registered under, used in messages).
    """

    name: ClassVar[str] = ""
    #: Whether :func:`resolve_backend` may pick this backend when none is named.
    auto_detect: ClassVar[bool] = True

    @abc.abstractmethod
    def accepts(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these params' layout (plain tensors, DTensor placements) is this backend's."""

    @abc.abstractmethod
    def shard_model(self, module: nn.Module, **options: Any) -> nn.Module:
        """Shard ``module`` in place and return it."""

    @abc.abstractmethod
    def full_matrix_map(
        self,
        fn: FullTensorsFn,
        tensors: Sequence[torch.Tensor],
        *,
        batch_dims: Sequence[int] | None = None,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> list[torch.Tensor]:
        """Apply ``fn`` to the full tensor behind each input; return results laid out like the inputs.

        Args:
            fn: Takes a list of full plain tensors, returns results of the same
                shapes; it is called with as many tensors at once as possible
                so it can batch same-shape work.
            tensors: Local tensors or shards; every rank passes the same list.
            batch_dims: Per tensor, leading dims ``fn`` treats independently;
                a tensor sharded only on those needs no communication.
            cost: Work of a tensor from its full shape, to balance ranks.

        Returns:
            One result per input with the input's own (local) shape,
            placements and dtype.
        """


def resolve_backend(name: str | None, params: Sequence[torch.Tensor]) -> ShardingBackend:
    """The backend named ``name`` (or ``$HYPER_PARALLEL_SHARDING``), else the one that fits ``params``.

    Detection tries every registered backend but ``local`` in name order and
    takes the first that accepts the params, then ``local``; backends with
    ``auto_detect = False`` (``ddp``) are used only when named.

    Raises:
        UnknownPluginError: no backend of that name.
        ValueError: the named backend does not match the params' layout, or
            no backend accepts them.
    """
    registry = get_registry()
    chosen = name or os.environ.get(SHARDING_ENV) or None
    if chosen is not None:
        entry = registry.get(PluginKind.SHARDING_BACKEND, chosen)
        backend: ShardingBackend = entry.obj()
        if not backend.accepts(params):
            source = "sharding=" if name else f"{SHARDING_ENV}="
            raise ValueError(
                f"Sharding backend {entry.name!r} ({source}{chosen!r}) does not match the params: "
                f"{_describe(params)}. Shard the model with that backend first, or pick the backend "
                "that matches (leave sharding unset to detect it)."
            )
        return backend
    entries = registry.entries(PluginKind.SHARDING_BACKEND)
    ordered = [e for e in entries if e.name != "local"] + [e for e in entries if e.name == "local"]
    for entry in ordered:
        backend = entry.obj()
        if backend.auto_detect and backend.accepts(params):
            return backend
    raise ValueError(
        f"No sharding backend accepts these params ({_describe(params)}); installed: "
        f"{', '.join(e.name for e in entries) or '(none)'}."
    )


def _describe(params: Sequence[torch.Tensor]) -> str:
    layouts = sorted(
        {
            f"DTensor{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh"  # type: ignore[attr-defined]
            if is_dtensor(p)
            else "plain tensors"
            for p in params
        }
    )
    return ", ".join(layouts)
