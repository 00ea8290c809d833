"""Newton-Schulz work buffers kept from one step to the next.

A step of Muon on a transformer stacks dozens of matrices of one shape and
iterates them together; the stack, its spare, and the Gram and polynomial
stacks run to tens of megabytes each. Allocated afresh per step, buffers that
large come from new pages of memory every time, and the page faults cost a
share of the step on a CPU (measured: docs/benchmarks.md, "Newton-Schulz
paths by CPU kind" and "What the iteration's constants rest on"). A
:class:`Workspace` keeps them instead, for as long as the optimizer that
owns it lives.

A workspace also keeps each stack's path: decided by the table the first time
a stack of its shape comes (:func:`stack_path`), or measured on this machine
and handed to :meth:`Workspace.keep_path` (``_tuning``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hyper_parallel_builtins.newton_schulz._paths import StackPath, stack_path

__all__ = ["Workspace", "path_of"]

_Key = tuple[str, tuple[int, ...], torch.dtype, torch.device]
_StackKey = tuple[int, int, torch.dtype, torch.device]


class Workspace:
    """Named work buffers, one per (role, shape, dtype, device), reused call after call.

    Matrices of one shape share their buffers; different shapes, dtypes or
    devices never do. A buffer handed out by :meth:`take` is valid until the
    next :meth:`take` of the same role and shape: the iteration's results are
    views of the workspace's buffers, so a caller copies what it keeps
    (Muon's update is a copy: it is cast and scaled out of them).

    Examples:
        >>> ws = Workspace()
        >>> a = ws.take("gram", (4, 64, 64), torch.float32, torch.device("cpu"))
        >>> a is ws.take("gram", (4, 64, 64), torch.float32, torch.device("cpu"))
        True
    """

    def __init__(self) -> None:
        self._buffers: dict[_Key, Tensor] = {}
        self._paths: dict[tuple[str, int, int, torch.dtype, torch.device], StackPath] = {}
        self._tuned: dict[_StackKey, StackPath] = {}

    def path(
        self, method: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> StackPath:
        """The path of ``(rows, cols)`` stacks, decided the first time one comes, then kept.

        The one :meth:`keep_path` was given for this shape, dtype and device
        where ``method`` allows it: ``"auto"`` takes any kept path (the
        standard iteration over its rule's Gram too), a named method only
        one of its own kind. Else :func:`stack_path`'s (the table's).
        """
        key = (method, rows, cols, dtype, device)
        held = self._paths.get(key)
        if held is None:
            held = stack_path(method, rows, cols, dtype, device)
            tuned = self._tuned.get((rows, cols, dtype, torch.device(device)))
            if tuned is not None and (method == "auto" or tuned.gram == held.gram):
                held = tuned
            self._paths[key] = held
        return held

    def keep_path(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device, path: StackPath
    ) -> None:
        """Run ``(rows, cols)`` stacks of ``dtype`` on ``device`` by ``path`` from now on
        (a tuned choice), where their method allows it (:meth:`path`)."""
        device = torch.device(device)
        self._tuned[(rows, cols, dtype, device)] = path
        for key in [k for k in self._paths if k[1:] == (rows, cols, dtype, device)]:
            del self._paths[key]

    def take(
        self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """The ``role`` buffer of this shape, dtype and device: made once, then the same one."""
        key = (role, tuple(shape), dtype, torch.device(device))
        held = self._buffers.get(key)
        if held is None:
            held = self._buffers[key] = torch.empty(key[1], dtype=dtype, device=device)
        return held

    def take_like(self, role: str, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A ``role`` buffer shaped and laid out like ``x`` (a transposed view stays one).

        Its dtype is ``dtype``, else ``x``'s.
        """
        dtype = x.dtype if dtype is None else dtype
        if x.dim() >= 2 and x.mT.is_contiguous() and not x.is_contiguous():
            return self.take(role, (*x.shape[:-2], x.shape[-1], x.shape[-2]), dtype, x.device).mT
        return self.take(role, x.shape, dtype, x.device)

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold."""
        return sum(math.prod(k[1]) * k[2].itemsize for k in self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Give every buffer back (they are made again when next needed); kept paths stay."""
        self._buffers.clear()
        self._paths.clear()

    def __repr__(self) -> str:
        return f"Workspace({len(self)} buffers, {self.nbytes / 2**20:.1f} MiB)"

    def __getstate__(self) -> dict[str, object]:
        return {}  # a copy starts empty: buffers are scratch, paths are this machine's

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]


def path_of(
    workspace: Workspace | None,
    method: str,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
) -> StackPath:
    """The workspace's kept :class:`StackPath`, else one decided now."""
    if workspace is None:
        return stack_path(method, rows, cols, dtype, device)
    return workspace.path(method, rows, cols, dtype, device)
