"""The iteration itself: batched or per matrix, standard or Gram, with the layouts chosen per product."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError
from hyper_parallel_builtins.newton_schulz._coefficients import Coefficients
from hyper_parallel_builtins.newton_schulz._paths import (
    StackPath,
)
from hyper_parallel_builtins.newton_schulz._workspace import Workspace, path_of

#: Rows per block when a symmetric product is built from its lower block
#: triangle (see :func:`_symmetric_product`). On CPU in bf16, blocks of 256
#: rows made one matrix's Newton-Schulz faster than one GEMM per product, and
#: faster than blocks of 128 or 512 rows (measured: docs/benchmarks.md, "What
#: the iteration's constants rest on").
SYMMETRIC_BLOCK_ROWS = 256


def _symmetric_product(
    out: Tensor,
    x: Tensor,
    *,
    add_to: Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
) -> Tensor:
    """``out = beta * add_to + alpha * x @ x.T`` for a 2-D ``x``, ``add_to`` symmetric.

    The result is symmetric, so only its lower block triangle is multiplied
    out: row stripe ``i`` is ``x[rows_i] @ x[:end_i].T`` written straight
    into ``out``, and each block above the diagonal is the transpose of one
    below it. With blocks of :data:`SYMMETRIC_BLOCK_ROWS` rows that is
    ``(k + 1) / 2k`` of the full product's FLOPs for ``k`` blocks. The
    entries agree with the full product's up to rounding (the BLAS may
    block a smaller GEMM differently); on the bf16 shapes of the benchmark
    they were bitwise equal.
    """
    rows = x.shape[0]
    if rows <= SYMMETRIC_BLOCK_ROWS:
        if add_to is None:
            return torch.mm(x, x.mT, out=out)
        return torch.addmm(add_to, x, x.mT, beta=beta, alpha=alpha, out=out)
    edges = [*range(0, rows, SYMMETRIC_BLOCK_ROWS), rows]
    for start, stop in itertools.pairwise(edges):
        stripe = out[start:stop, :stop]
        if add_to is None:
            torch.mm(x[start:stop], x[:stop].mT, out=stripe)
        else:
            torch.addmm(add_to[start:stop, :stop], x[start:stop], x[:stop].mT,
                        beta=beta, alpha=alpha, out=stripe)  # fmt: skip
    for start, stop in itertools.pairwise(edges[1:]):
        out[:start, start:stop].copy_(out[start:stop, :start].mT)
    return out


def norm_divisor(norms: Tensor, eps: float, eps_added: bool) -> Tensor:
    """What each matrix is divided by first: ``norm + eps`` or ``max(norm, eps)``, in place."""
    return norms.add_(eps) if eps_added else norms.clamp_min_(eps)


def normalize_(x: Tensor, eps: float = 1e-7, eps_added: bool = False) -> Tensor:
    """Divide each matrix of ``x`` (``..., rows, cols``) by its Frobenius norm, in place.

    The iteration's first act (the divisor is :func:`norm_divisor`'s). A
    caller that fills a stack part by part can do it to each part as it is
    written, while the part is still in cache, and then pass
    ``normalized=True`` to :func:`newton_schulz_stack_`: the same numbers, bit
    for bit, for one pass less over memory (11-15 ms of a 300-320 ms Muon
    step at d=512 x 4 blocks on one CPU thread).
    """
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return x.div_(norm_divisor(norms, eps, eps_added))


def buffer_like(
    ws: Workspace | None, role: str, x: Tensor, dtype: torch.dtype | None = None
) -> Tensor:
    """A buffer shaped and laid out like ``x`` (in ``dtype``): the workspace's, else a new one."""
    if ws is None:
        return torch.empty_like(x, dtype=dtype)
    return ws.take_like(role, x, dtype)


def new_buffer(ws: Workspace | None, role: str, shape: Sequence[int], like: Tensor) -> Tensor:
    """A contiguous ``shape`` buffer of ``like``'s dtype and device: the workspace's, else new."""
    if ws is None:
        return like.new_empty(tuple(shape))
    return ws.take(role, shape, like.dtype, like.device)


def _iterate_(
    x: Tensor,
    coefficients: Sequence[Coefficients],
    ws: Workspace | None = None,
    path: StackPath | None = None,
) -> Tensor:
    """Run the iteration on ``x`` of shape (batch, rows, cols), ``rows <= cols``, normalized.

    ``path`` is the stack's (:func:`~hyper_parallel_builtins.newton_schulz._workspace.path_of`),
    else decided here.

    ``x`` must be a tensor the caller owns, each matrix already divided by
    its norm (:func:`normalize_`): it is one of the two buffers the iterates
    alternate between, so the result is ``x`` itself or one other stack of
    its shape. The other stack
    and the Gram and polynomial buffers come from ``ws`` (else they are
    allocated once per call, not per iteration): fresh large tensors cost
    page faults on CPU (measured: docs/benchmarks.md, "What the iteration's
    constants rest on").

    Every product is written ``A @ B.mT`` or ``A.mT @ B``, using that the Gram
    matrix and the polynomial are symmetric: CPU BLAS picks faster kernels for
    these layouts than for ``A @ B``, most of all in bf16 where the CPU
    emulates it (measured: docs/benchmarks.md, "Why Newton-Schulz is fast on
    a CPU").
    """
    # The Gram matrix is rows x rows, so rows <= cols keeps it the small one.
    batch, rows, _ = x.shape
    spare = buffer_like(ws, "spare", x)
    if path is None:
        path = path_of(ws, "standard", rows, x.shape[-1], x.dtype, x.device)
    if path.per_matrix:
        gram = new_buffer(ws, "gram", (rows, rows), x)
        poly = new_buffer(ws, "poly", (rows, rows), x)
        for i in range(batch):
            _iterate_one(x[i], spare[i], gram, poly, coefficients, path.poly_transposed)
    else:
        gram = new_buffer(ws, "gram", (batch, rows, rows), x)
        poly = new_buffer(ws, "poly", (batch, rows, rows), x)
        current, nxt = x, spare
        for a, b, c in coefficients:
            torch.bmm(current, current.mT, out=gram)
            # A cubic step (c == 0) skips the (X X^T)^2 matmul.
            if c == 0.0:
                torch.mul(gram, b, out=poly)
            else:
                torch.baddbmm(gram, gram, gram.mT, beta=b, alpha=c, out=poly)
            _update(current, poly, a, nxt, path.poly_transposed)
            current, nxt = nxt, current
    # Every matrix took the same number of steps, so all results are in one stack.
    return spare if len(coefficients) % 2 else x


def _iterate_one(
    x: Tensor,
    spare: Tensor,
    gram: Tensor,
    poly: Tensor,
    coefficients: Sequence[Coefficients],
    poly_transposed: bool,
) -> None:
    """:func:`_iterate_` on one normalised ``rows x cols`` matrix, with 2-D matmuls
    and symmetric products (:func:`_symmetric_product`).

    The iterates alternate between ``x`` and ``spare``: the result is in
    ``spare`` after an odd number of steps, in ``x`` after an even one.
    ``gram`` and ``poly`` are ``rows x rows`` work buffers.
    """
    current, nxt = x, spare
    for a, b, c in coefficients:
        _symmetric_product(gram, current)
        if c == 0.0:
            torch.mul(gram, b, out=poly)
        else:
            # gram is symmetric, so gram @ gram == gram @ gram.T
            _symmetric_product(poly, gram, add_to=gram, beta=b, alpha=c)
        _update(current, poly, a, nxt, poly_transposed)
        current, nxt = nxt, current


def _transposed(t: Tensor) -> bool:
    """Whether ``t`` is the transposed view of a contiguous stack (a tall matrix's)."""
    return t.mT.is_contiguous() and not t.is_contiguous()


def _update(current: Tensor, poly: Tensor, a: float, out: Tensor, poly_transposed: bool) -> None:
    """``out = a X + P X`` (``P`` symmetric), written in ``out``'s own layout.

    ``P`` is read through its transposed view with ``poly_transposed``, else
    as stored (whichever layout :data:`CPU_PATHS` measured faster). For a
    transposed view the product is formed transposed, ``a X^T + X^T P``,
    straight into the contiguous memory behind it: no transposing copy.
    (Folding ``a`` into ``P``'s diagonal would save ``baddbmm``'s copy of
    ``X``, but rounds ``a + P_ii`` in ``P``'s dtype: in bf16 it raised the
    error against float64 from 0.015-0.022 to 0.025 on 256-1024 rows.)
    """
    product = torch.addmm if current.dim() == 2 else torch.baddbmm
    if _transposed(out):
        product(current.mT, current.mT, poly.mT if poly_transposed else poly, beta=a, out=out.mT)
    else:
        product(current, poly.mT if poly_transposed else poly, current, beta=a, out=out)


#: Gram iterations restart (rebuild ``X`` and its Gram matrix from the long
#: side) before iteration ``GRAM_FIRST_RESTART`` and then every
#: ``GRAM_RESTART_EVERY`` iterations: the early steps grow the small singular
#: values fastest, and with them the round-off that ``R = P R P`` carries.
#: With ``R`` made symmetric after each update this kept fp32, bf16 and fp16
#: within 2-4x the standard iteration's error against fp64 (Keller and Polar
#: Express, 5 to 12 steps); with one restart and no symmetrizing, Keller's
#: 12 steps diverged even in fp32.
GRAM_FIRST_RESTART = 2
GRAM_RESTART_EVERY = 3


def _iterate_gram_(
    x: Tensor,
    coefficients: Sequence[Coefficients],
    ws: Workspace | None = None,
) -> Tensor:
    """:func:`_iterate_` on the Gram matrix: the long side is touched only at restarts.

    Every step multiplies ``X`` on the left by ``P = a I + b R + c R^2`` with
    ``R = X X^T``, so after ``k`` steps ``X_k = Q X_0`` for a ``rows x rows``
    matrix ``Q``, and ``R_{k+1} = P R_k P``. This iterates ``Q`` and ``R``
    and forms ``Q X_0`` only at the restarts (:data:`GRAM_FIRST_RESTART`) and
    at the end. A standard step costs ``4 rows^2 cols + 2 rows^3`` FLOPs; a Gram
    step ``8 rows^3`` (less on the first step after a restart, where ``Q`` is
    the identity, and on the last, which needs no new ``R``), and a restart
    ``4 rows^2 cols``. The polynomial applied is the same, so the result
    equals :func:`_iterate_`'s up to rounding.

    ``x`` (batch, rows, cols), ``rows <= cols``, normalized
    (:func:`normalize_`), is any stack the caller owns, a transposed view
    included: it is read only in products. The result is another stack laid
    out as ``x`` (or ``x`` itself after no steps); with ``ws``, every buffer
    is the workspace's.
    """
    square = (x.shape[0], x.shape[1], x.shape[1])
    gram = torch.bmm(x, x.mT, out=new_buffer(ws, "gram", square, x))
    poly, q_t, spare = (new_buffer(ws, role, square, x) for role in ("poly", "q", "gram_spare"))
    products = 0  # Q X_0 products so far: they alternate between two buffers
    identity = True  # Q is the identity (not stored): no step need multiply by it
    last = len(coefficients) - 1
    # Q is kept transposed (q_t), and every product is written A @ B.mT or A.mT @ B
    # (R and P are symmetric): see _iterate_ for why.
    for step, (a, b, c) in enumerate(coefficients):
        restart = (
            step >= GRAM_FIRST_RESTART and (step - GRAM_FIRST_RESTART) % GRAM_RESTART_EVERY == 0
        )
        if restart and not identity:
            x = _q_times(q_t, x, buffer_like(ws, f"qx{products % 2}", x))
            products += 1
            torch.bmm(x, x.mT, out=gram)
            identity = True
        if c:
            torch.baddbmm(gram, gram, gram.mT, beta=b, alpha=c, out=poly)
        else:
            torch.mul(gram, b, out=poly)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        if identity:
            q_t.copy_(poly)
            identity = False
        else:
            torch.bmm(q_t, poly.mT, out=spare)  # (P Q)^T = Q^T P
            q_t, spare = spare, q_t
        if step < last:
            torch.bmm(gram, poly.mT, out=spare)  # R P
            torch.bmm(spare.mT, poly, out=gram)  # (R P)^T P = P R P
            torch.add(gram, gram.mT, out=spare).mul_(0.5)  # symmetric, as P R P is
            gram, spare = spare, gram
    return x if identity else _q_times(q_t, x, buffer_like(ws, f"qx{products % 2}", x))


def _q_times(q_t: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """``Q X`` written in ``out``, laid out in memory as ``x`` is (see :func:`_update`)."""
    if _transposed(x):
        torch.bmm(x.mT, q_t, out=out.mT)  # (X^T Q^T)^T
    else:
        torch.bmm(q_t.mT, x, out=out)
    return out


def newton_schulz_flops(rows: int, cols: int, steps: int, method: str) -> float:
    """FLOPs of ``steps`` iterations on one ``rows x cols`` matrix by ``method``.

    ``"standard"``: ``4 s^2 l + 2 s^3`` per step (short side ``s``, long side
    ``l``). ``"gram"``: ``8 s^3`` per step, plus ``4 s^2 l`` for the first Gram
    matrix and the final product and ``4 s^2 l`` per restart. Used to balance
    Newton-Schulz work across ranks, not to time it.
    """
    small, large = min(rows, cols), max(rows, cols)
    if method != "gram":
        return float(steps * (4 * small * small * large + 2 * small**3))
    restarts = len(range(GRAM_FIRST_RESTART, steps, GRAM_RESTART_EVERY))
    return float(steps * 8 * small**3 + (4 + 4 * restarts) * small * small * large)


def newton_schulz_batched(
    matrices: Sequence[Tensor],
    coefficients: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    eps_added: bool = False,
    dtype: torch.dtype | None = None,
    method: str = "standard",
    workspace: Workspace | None = None,
) -> list[Tensor]:
    """Orthogonalize same-shape matrices in one batched iteration.

    Every tensor has shape ``(..., m, n)`` with the same ``(m, n)`` and
    device; leading dims are batches of independent matrices. They are
    copied (and cast) once into a single ``(B, m, n)`` stack, each matrix is
    divided by its own Frobenius norm (clamped at ``eps``, or plus ``eps``
    with ``eps_added``), and each
    ``(a, b, c)`` of ``coefficients`` is one step ``A = X X^T;
    X = a X + (b A + c A A) X`` on the whole stack (on ``X^T`` when
    ``m > n``, so ``A`` is the smaller Gram matrix).

    Args:
        matrices: The matrices; not modified.
        coefficients: One ``(a, b, c)`` per iteration (see
            :func:`resolve_coefficients`).
        eps: Lower bound on the norm divided by, so a zero matrix stays zero.
        eps_added: Divide by ``norm + eps`` instead (HyperParallel's rule).
        dtype: The dtype to iterate and return in; default the first
            matrix's.
        method: ``"standard"``, ``"gram"`` (iterate on the Gram matrix,
            fewer FLOPs for matrices several times longer than wide; see
            :func:`_iterate_gram_`), or ``"auto"`` (:func:`resolve_ns_method`).
        workspace: Where the stack and every work buffer come from, kept
            from call to call (:class:`Workspace`); ``None``: allocated for
            this call.

    Returns:
        One tensor per input, same shape, in ``dtype``. They are views into
        one result stack: with a ``workspace``, one of its buffers, valid
        until its next call on this shape.

    Raises:
        ValueError: matrices of different shapes or devices, fewer than 2
            dims, or an unknown ``method``.
        RuntimeError: a matrix requires grad while grad mode is on: the
            iteration works in place on its buffers and is not
            differentiable.
    """
    if not matrices:
        return []
    first = matrices[0]
    if first.ndim < 2:
        raise HyperParallelValueError(
            f"Newton-Schulz needs matrices, got a tensor of shape {tuple(first.shape)}."
        )
    rows, cols = first.shape[-2], first.shape[-1]
    for m in matrices:
        if m.shape[-2:] != first.shape[-2:] or m.device != first.device:
            raise HyperParallelValueError(
                "newton_schulz_batched needs matrices of one shape on one device; got "
                f"{tuple(first.shape[-2:])} on {first.device} and {tuple(m.shape[-2:])} on {m.device}."
            )
    if torch.is_grad_enabled() and any(m.requires_grad for m in matrices):
        raise HyperParallelRuntimeError(
            "Newton-Schulz is not differentiable (it iterates in place on work buffers), but a "
            "matrix requires grad. Call it under torch.no_grad() or pass matrix.detach()."
        )
    dtype = first.dtype if dtype is None else dtype
    stacks = [m.reshape(-1, rows, cols) for m in matrices]
    counts = [s.shape[0] for s in stacks]
    # One copy does the stacking and the cast.
    x = new_stack((sum(counts), rows, cols), dtype, first.device, workspace, method)
    for part, stack in zip(x.split(counts), stacks, strict=True):
        stack_into(part, stack, workspace)
    result = newton_schulz_stack_(
        x, coefficients, eps=eps, eps_added=eps_added, method=method, workspace=workspace
    )
    out: list[Tensor] = []
    start = 0
    for matrix, count in zip(matrices, counts, strict=True):
        out.append(result[start : start + count].reshape(matrix.shape))
        start += count
    return out


def new_stack(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    workspace: Workspace | None,
    method: str = "standard",
) -> Tensor:
    """An uninitialised ``(batch, rows, cols)`` stack to fill and hand to :func:`newton_schulz_stack_`.

    Fill it with :func:`stack_into`. Tall matrices that the standard
    iteration (``method`` as in :func:`newton_schulz_batched`) will run are
    laid out transposed where :attr:`CpuPath.tall_transposed` says so. With a
    ``workspace``, its ``"stack"`` buffer (the same one call after call);
    else a new tensor.
    """
    batch, rows, cols = shape
    device = torch.device(device)
    transposed = path_of(workspace, method, rows, cols, dtype, device).tall_transposed
    layout = (batch, cols, rows) if transposed else (batch, rows, cols)
    made = (
        torch.empty(layout, dtype=dtype, device=device)
        if workspace is None
        else workspace.take("stack", layout, dtype, device)
    )
    return made.mT if transposed else made


def stack_into(part: Tensor, matrices: Tensor, workspace: Workspace | None = None) -> None:
    """Copy (and cast) ``matrices`` into ``part`` of a stack from :func:`new_stack`.

    Into a transposed layout it casts first (into the workspace's ``"cast"``
    buffer), then copies matrix by matrix into the contiguous memory behind
    ``part``: torch transposes fast only 2-D tensors of one dtype, so this
    beats one transposing cast or a copy of the 3-D slice (measured on an AMX
    CPU: docs/benchmarks.md, "What the iteration's constants rest on").
    """
    if not _transposed(part):
        part.copy_(matrices)
        return
    if matrices.dtype != part.dtype:
        matrices = buffer_like(workspace, "cast", matrices, part.dtype).copy_(matrices)
    for target, source in zip(part.mT, matrices.mT, strict=True):
        target.copy_(source)


def newton_schulz_stack_(
    x: Tensor,
    coefficients: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    eps_added: bool = False,
    method: str = "standard",
    workspace: Workspace | None = None,
    normalized: bool = False,
) -> Tensor:
    """Orthogonalize each matrix of the stack ``x`` (batch, rows, cols), overwriting ``x``.

    The work of :func:`newton_schulz_batched` once its matrices are stacked:
    a caller that makes its matrices one by one (Muon's momentum, param by
    param) writes each into a stack from :func:`new_stack` and frees it,
    rather than holding them all. A tall stack iterates through its
    transposed view: every product takes the view as it is and writes the
    stack's own layout, as a transposing cast into bf16 would cost a large
    share of the iteration (measured: docs/benchmarks.md, "What the
    iteration's constants rest on").

    ``normalized``: the caller has already divided each matrix by its norm
    (:func:`normalize_` with this ``eps`` and ``eps_added``), as it filled
    the stack.

    Returns:
        The results, laid out as ``x``: ``x`` itself or another stack
        (with a ``workspace``, one of its buffers, valid until its next call
        on this shape).
    """
    rows, cols = x.shape[-2:]
    tall = rows > cols
    path = path_of(workspace, method, rows, cols, x.dtype, x.device)
    work = x.mT if tall else x
    if not normalized:
        normalize_(work, eps, eps_added)
    if path.gram:
        result = _iterate_gram_(work, coefficients, workspace)
    else:
        result = _iterate_(work, coefficients, workspace, path)
    return result.mT if tall else result


def newton_schulz(
    matrix: Tensor,
    coefficients: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    eps_added: bool = False,
    dtype: torch.dtype | None = None,
    method: str = "standard",
) -> Tensor:
    """Orthogonalize ``matrix`` (shape ``(..., m, n)``); see :func:`newton_schulz_batched`.

    Examples:
        >>> g = torch.randn(64, 32)
        >>> o = newton_schulz(g, resolve_coefficients("cubic", 40))
        >>> torch.allclose(o.mT @ o, torch.eye(32), atol=1e-4)
        True
    """
    return newton_schulz_batched(
        [matrix], coefficients, eps=eps, eps_added=eps_added, dtype=dtype, method=method
    )[0]
