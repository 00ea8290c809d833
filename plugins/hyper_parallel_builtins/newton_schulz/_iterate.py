"""The iteration itself: batched or per matrix, standard or Gram, with the layouts chosen per product."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from hyper_parallel.core.compat import cpu_kind
from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean
from hyper_parallel_builtins.newton_schulz._coefficients import Coefficients
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

#: From this Gram size on, on CPU, each matrix is iterated with 2-D matmuls
#: rather than one batched matmul, which lets the symmetric products below
#: skip part of the work. Measured on CPU, Newton-Schulz alone: at Gram
#: size 512 the per-matrix path took 1.04x the batched time on the d=512
#: benchmark set in bf16 (up to 1.3x on 8 square matrices in fp32); at 640,
#: 768 and 1024 mostly 0.72-0.92x of it (bf16 and fp32, 4-6 matrices).
PER_MATRIX_FROM = 640

#: Rows per block when a symmetric product is built from its lower block
#: triangle (see :func:`_symmetric_product`). On CPU in bf16, one matrix's
#: Newton-Schulz with blocks of 256 took 0.85x (size 1024) and 0.78x (2048)
#: the time of one GEMM per product; 128 and 512 did worse.
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


@dataclass(frozen=True)
class CpuPath:
    """How the standard iteration runs on one CPU kind in one dtype.

    Attributes:
        per_matrix: Stacks of :data:`PER_MATRIX_FROM` rows or more iterate one
            matrix at a time with symmetric products (fewer FLOPs, smaller
            GEMMs); else one batched GEMM per product.
        poly_transposed: ``a X + P X`` reads ``P`` through its transposed
            view (``P^T @ X``), else as stored (``P @ X``). ``P`` is
            symmetric, so the two agree up to rounding, but CPU BLAS picks
            different kernels for the two layouts.
        measured: The figure the choice rests on (``docs/benchmarks.md``
            gives the command), or how it was chosen where none was measured.
    """

    per_matrix: bool
    poly_transposed: bool
    measured: str


#: The path of each (CPU kind, dtype) that was measured: Newton-Schulz alone on
#: the benchmark's transformer sets, 2 threads (``python -m benchmarks --cases
#: paths``; the table in docs/benchmarks.md), against one batched GEMM per product
#: reading ``P`` transposed. AVX512-BF16 was measured on an AMX CPU with oneDNN
#: capped below AMX; the AVX2 figures are older, from a 2-core AVX2 CPU.
CPU_PATHS: Mapping[tuple[str, torch.dtype], CpuPath] = MappingProxyType(
    {
        ("amx", torch.bfloat16): CpuPath(
            False, False, "batched P @ X 0.85x (d=1024 set), 0.99x (d=512); per matrix 0.97-1.05x"
        ),
        ("avx512_bf16", torch.bfloat16): CpuPath(
            True, False, "d=1024 set: per matrix P @ X 0.79x, P^T @ X 0.80x; batched P @ X 0.99x"
        ),
        **dict.fromkeys(
            [("amx", torch.float32), ("avx512_bf16", torch.float32)],
            CpuPath(True, True, "d=1024 set: per matrix 0.83-0.86x; batched P @ X 0.99-1.03x"),
        ),
        **dict.fromkeys(
            [("avx2", torch.float32), ("avx2", torch.bfloat16)],
            CpuPath(True, True, "per matrix 0.72-0.92x at 640-1024 rows; P^T @ X layouts "
                    "116-120 GFLOP/s against 86 (float32), 11-15 against 1.3 (bf16)"),
        ),
    }
)  # fmt: skip

#: A (CPU kind, dtype) no one has measured: the FLOP count decides. Symmetric
#: products do fewer FLOPs, and the two layouts do the same FLOPs.
UNMEASURED_CPU_PATH = CpuPath(
    per_matrix=True, poly_transposed=True, measured="not measured: the FLOP count"
)

#: Accelerators (not measured): one batched GEMM per product, a few large
#: kernels rather than the many small ones of the symmetric products.
ACCELERATOR_PATH = CpuPath(
    per_matrix=False, poly_transposed=True, measured="not measured: one batched GEMM per product"
)


def cpu_path(dtype: torch.dtype, device: torch.device, kind: str | None = None) -> CpuPath:
    """The path the standard iteration takes in ``dtype`` on ``device`` (:data:`CPU_PATHS`).

    ``kind`` is the CPU's (:func:`~hyper_parallel.core.compat.cpu_kind`),
    read from the machine where not given.
    """
    if device.type != "cpu":
        return ACCELERATOR_PATH
    return CPU_PATHS.get((kind or cpu_kind(), dtype), UNMEASURED_CPU_PATH)


def _per_matrix(x: Tensor, path: CpuPath) -> bool:
    """Whether the stack ``x`` iterates matrix by matrix (:data:`PER_MATRIX_FROM`)."""
    return path.per_matrix and x.shape[-2] >= PER_MATRIX_FROM


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
    eps: float,
    eps_added: bool,
    ws: Workspace | None = None,
) -> Tensor:
    """Run the iteration on ``x`` of shape (batch, rows, cols), ``rows <= cols``.

    ``x`` must be a tensor the caller owns: it is normalised in place and
    used as one of the two buffers the iterates alternate between, so the
    result is ``x`` itself or one other stack of its shape. The other stack
    and the Gram and polynomial buffers come from ``ws`` (else they are
    allocated once per call, not per iteration): fresh large tensors cost
    page faults on CPU (5-10% of the iteration at d=512).

    Every product is written ``A @ B.mT`` or ``A.mT @ B``, using that the Gram
    matrix and the polynomial are symmetric: CPU BLAS picks faster kernels for
    these layouts than for ``A @ B``. On a 2-core AVX2 CPU, 8 matrices of
    256 x 256: bf16 (emulated there) 11-15 GFLOP/s against 1.3, fp32 116-120
    against 86; the whole iteration in bf16 took 0.69 s against 6.4 s for
    8 matrices of 256 x 1024.
    """
    # The Gram matrix is rows x rows, so rows <= cols keeps it the small one.
    x.div_(norm_divisor(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), eps, eps_added))
    batch, rows, _ = x.shape
    spare = buffer_like(ws, "spare", x)
    path = cpu_path(x.dtype, x.device)
    if _per_matrix(x, path):
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
    """
    product = torch.addmm if current.dim() == 2 else torch.baddbmm
    if _transposed(out):
        product(current.mT, current.mT, poly.mT if poly_transposed else poly, beta=a, out=out.mT)
    else:
        product(current, poly.mT if poly_transposed else poly, current, beta=a, out=out)


#: The ways to run the iteration (``method`` of :func:`newton_schulz_batched`).
NS_METHODS = ("standard", "gram")

#: ``ns_method="auto"`` picks Gram Newton-Schulz for a matrix whose long side
#: is at least this many times its short side, by device type. Measured on a
#: 2-core AVX2 CPU, 5 Keller steps, Gram time over standard time, fp32:
#: 0.89 at aspect 2.7 (6 x 256 x 690), 0.83 (8 x 512 x 1376), 0.75 at 3.5
#: (8 x 384 x 1344), 0.77 at 4 (8 x 256 x 1024), 0.59 at 8 (4 x 256 x 2048);
#: bf16: 0.91 at 2.7, 0.80 at 4. Elsewhere (not measured) the FLOP count
#: decides: Gram does fewer FLOPs from aspect 2 on; the margin is the CPU's.
GRAM_MIN_ASPECT: Mapping[str, float] = MappingProxyType({"cpu": 2.5})

#: :data:`GRAM_MIN_ASPECT` for device types it does not list.
GRAM_MIN_ASPECT_DEFAULT = 2.5

#: On a CPU, from :data:`PER_MATRIX_FROM` rows on the standard iteration
#: multiplies only half of each symmetric product, so Gram pays off later:
#: fp32, 1.09x the standard time at aspect 2.7 (3 x 1024 x 2752), 0.79x at 4
#: (2 x 768 x 3072), 0.49x at 4 (2 x 1024 x 4096).
GRAM_MIN_ASPECT_CPU_LARGE = 3.5


def resolve_ns_method(method: str, rows: int, cols: int, device: torch.device) -> str:
    """``"standard"`` or ``"gram"`` for a ``rows x cols`` matrix on ``device``.

    ``method`` is one of :data:`NS_METHODS` (returned as is) or ``"auto"``:
    Gram from :data:`GRAM_MIN_ASPECT` of the device type on (on a CPU,
    :data:`GRAM_MIN_ASPECT_CPU_LARGE` for matrices of
    :data:`PER_MATRIX_FROM` rows or more).

    Raises:
        ValueError: an unknown ``method``.
    """
    if method in NS_METHODS:
        return method
    if method != "auto":
        choices = ("auto", *NS_METHODS)
        raise HyperParallelValueError(
            f"Unknown ns_method {method!r}. Use one of {', '.join(map(repr, choices))}."
            f"{did_you_mean(str(method), choices)}"
        )
    small = min(rows, cols)
    threshold = GRAM_MIN_ASPECT.get(device.type, GRAM_MIN_ASPECT_DEFAULT)
    if device.type == "cpu" and small >= PER_MATRIX_FROM:
        threshold = GRAM_MIN_ASPECT_CPU_LARGE
    return "gram" if max(rows, cols) >= threshold * small else "standard"


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
    eps: float,
    eps_added: bool,
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

    ``x`` (batch, rows, cols), ``rows <= cols``, is any stack the caller owns,
    a transposed view included: it is normalised in place and read only in
    products. The result is another stack laid out as ``x`` (or ``x`` itself
    after no steps); with ``ws``, every buffer is the workspace's.
    """
    x.div_(norm_divisor(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), eps, eps_added))
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
    tall = rows > cols
    gram = resolve_ns_method(method, rows, cols, first.device) == "gram"
    stacks = [m.reshape(-1, rows, cols) for m in matrices]
    counts = [s.shape[0] for s in stacks]
    # One copy does the stacking and the cast. A tall stack iterates through its
    # transposed view, and every product takes the view as it is and writes the
    # stack's own layout: on a CPU a transposing cast into bf16 took a quarter of a
    # 1376 x 512 matrix's Gram iteration, and a transposed result as much again to
    # cast back and apply.
    shape = (sum(counts), rows, cols)
    x = (
        torch.empty(shape, dtype=dtype, device=first.device)
        if workspace is None
        else workspace.take("stack", shape, dtype, first.device)
    )
    start = 0
    for stack, count in zip(stacks, counts, strict=True):
        x[start : start + count].copy_(stack)
        start += count
    work = x.mT if tall else x
    result = (_iterate_gram_ if gram else _iterate_)(work, coefficients, eps, eps_added, workspace)
    if tall:
        result = result.mT
    out: list[Tensor] = []
    start = 0
    for matrix, count in zip(matrices, counts, strict=True):
        out.append(result[start : start + count].reshape(matrix.shape))
        start += count
    return out


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
