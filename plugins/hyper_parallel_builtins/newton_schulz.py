"""Newton-Schulz orthogonalization and its coefficient sets.

An odd matrix polynomial ``X -> a X + b (X X^T) X + c (X X^T)^2 X`` acts on
each singular value ``s`` of ``X`` as ``s -> a s + b s^3 + c s^5`` and leaves
the singular vectors alone. Starting from ``G / ||G||_F`` (every singular
value in ``[0, 1]``) and applying it a few times pushes every singular value
towards 1, so the result approaches the polar factor ``U V^T`` of
``G = U S V^T`` without an SVD: matmuls only, which is why Muon uses it.

A *coefficient set* is the sequence of ``(a, b, c)`` used at each iteration.
:data:`COEFFICIENT_SETS` holds the named ones; :func:`resolve_coefficients`
turns any accepted spelling into exactly ``ns_steps`` triples.

Each matrix is first divided by its Frobenius norm and an ``eps``, by one of
two rules: ``max(||X||, eps)`` (``torch.optim.Muon``) or ``||X|| + eps``
(HyperParallel's ``ns_epsilon``); ``eps_added`` picks the second.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

from hyper_parallel.core.compat import cpu_has_native_bf16
from hyper_parallel.core.errors import HyperParallelRuntimeError, HyperParallelValueError
from hyper_parallel.core.options import did_you_mean

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ASYM5_COEFFICIENTS",
    "COEFFICIENT_SETS",
    "FIXED_LENGTH_SETS",
    "GRAM_FIRST_RESTART",
    "GRAM_MIN_ASPECT",
    "GRAM_MIN_ASPECT_CPU_LARGE",
    "GRAM_MIN_ASPECT_DEFAULT",
    "GRAM_RESTART_EVERY",
    "KELLER_COEFFICIENTS",
    "MAX_NS_STEPS",
    "NS_METHODS",
    "PER_MATRIX_FROM",
    "SYMMETRIC_BLOCK_ROWS",
    "CoefficientSpec",
    "Coefficients",
    "custom_coefficients",
    "is_triple",
    "newton_schulz",
    "newton_schulz_batched",
    "newton_schulz_flops",
    "newton_schulz_team",
    "newton_schulz_team_collectives",
    "resolve_coefficients",
    "resolve_ns_method",
]

Coefficients: TypeAlias = tuple[float, float, float]
"""One iteration's ``(a, b, c)``."""

CoefficientSpec: TypeAlias = str | Sequence[float] | Sequence[Sequence[float]]
"""A set name, one triple (used every iteration), or one triple per iteration."""

MAX_NS_STEPS = 99
"""The most iterations accepted (the same bound as ``torch.optim.Muon``)."""

KELLER_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: the steepest slope at zero that still keeps every
singular value within roughly ``[0.7, 1.2]`` after five steps. The default of
``torch.optim.Muon``."""

ASYM5_COEFFICIENTS: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""A different triple for each of five iterations (the set Dion published): HyperParallel's
default (``ns_variant="asym5"``). It defines exactly five iterations."""

# Amsel, Persson, Musco & Gower, "The Polar Express" (arXiv 2505.16932): the
# degree-5 polynomial optimal for each iteration in turn.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def _with_safety_factor(
    triples: tuple[Coefficients, ...], factor: float
) -> tuple[Coefficients, ...]:
    # Dividing a, b, c by f, f^3, f^5 turns p(x) into p(x / f), so round-off
    # that lifts a singular value slightly above 1 stays inside the interval
    # the polynomial was optimised for. The last step is left exact so the
    # iteration still ends at 1.
    scaled = tuple((a / factor, b / factor**3, c / factor**5) for a, b, c in triples[:-1])
    return (*scaled, triples[-1])


COEFFICIENT_SETS: Mapping[str, tuple[Coefficients, ...]] = MappingProxyType(
    {
        "asym5": ASYM5_COEFFICIENTS,
        "keller": (KELLER_COEFFICIENTS,),
        "legacy": (KELLER_COEFFICIENTS,),  # HyperParallel's name for Keller's triple
        "polar_express": _with_safety_factor(_POLAR_EXPRESS_RAW, 1.01),
        # Classic cubic Newton-Schulz: slower, but converges to U V^T itself.
        "cubic": ((1.5, -0.5, 0.0),),
    }
)
"""Named coefficient sets. A set shorter than ``ns_steps`` repeats its last triple,
except those in :data:`FIXED_LENGTH_SETS`."""

FIXED_LENGTH_SETS: frozenset[str] = frozenset({"asym5"})
"""Sets tuned as a whole for their own number of iterations: ``ns_steps`` may not exceed it."""


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_triple(value: object, where: str) -> Coefficients:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
        raise HyperParallelValueError(
            f"{where} must contain exactly three values (a, b, c), got {value!r}."
        )
    if not all(_is_real(v) for v in value):
        raise HyperParallelValueError(
            f"{where} must contain exactly three values (a, b, c) that are floats, got {value!r}."
        )
    a, b, c = (float(v) for v in value)
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise HyperParallelValueError(f"{where} must contain only finite values, got {value!r}.")
    return (a, b, c)


def is_triple(spec: object) -> bool:
    """Whether ``spec`` is one ``(a, b, c)`` (three numbers), as ``torch.optim.Muon`` takes it."""
    return (
        not isinstance(spec, str)
        and isinstance(spec, Sequence)
        and len(spec) == 3
        and all(_is_real(v) for v in spec)
    )


def _check_ns_steps(ns_steps: object) -> int:
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool):
        raise HyperParallelValueError(f"ns_steps must be an int, got {ns_steps!r}.")
    if not 1 <= ns_steps <= MAX_NS_STEPS:
        raise HyperParallelValueError(f"ns_steps must be in 1..{MAX_NS_STEPS}, got {ns_steps}.")
    return ns_steps


def custom_coefficients(spec: object, ns_steps: int) -> tuple[Coefficients, ...]:
    """One triple per iteration, given by the caller: the first ``ns_steps`` of ``spec``.

    HyperParallel's ``ns_variant="custom"``: ``spec`` is a non-empty
    sequence of at least ``ns_steps`` triples of finite floats.

    Raises:
        ValueError: an empty or short sequence, or a malformed or non-finite
            triple (named by its index).
    """
    _check_ns_steps(ns_steps)
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise HyperParallelValueError(
            "ns_coefficients must be provided as a non-empty sequence of (a, b, c) triples, one "
            f"per iteration, got {spec!r}."
        )
    if ns_steps > len(spec):
        raise HyperParallelValueError(
            f"ns_steps={ns_steps} exceeds the {len(spec)} provided coefficient groups; give one "
            f"(a, b, c) per iteration, or lower ns_steps to {len(spec)}."
        )
    triples = tuple(_as_triple(t, f"ns_coefficients[{i}]") for i, t in enumerate(spec))
    return triples[:ns_steps]


def resolve_coefficients(spec: CoefficientSpec, ns_steps: int) -> tuple[Coefficients, ...]:
    """Return the ``(a, b, c)`` for each of ``ns_steps`` iterations.

    Args:
        spec: A name in :data:`COEFFICIENT_SETS` (case-insensitive, ``-`` read
            as ``_``), whose last triple repeats when it is shorter than
            ``ns_steps`` (a set in :data:`FIXED_LENGTH_SETS` does not: more
            steps than it has are an error); one triple, used at every
            iteration (``torch.optim.Muon``'s form); or a sequence of at
            least ``ns_steps`` triples, of which the first ``ns_steps`` are
            used (:func:`custom_coefficients`).
        ns_steps: Number of iterations, ``1 <= ns_steps <= 99``.

    Raises:
        ValueError: an unknown set name (the message lists the sets), a
            malformed, non-finite or short sequence, or ``ns_steps`` out of
            range.
    """
    _check_ns_steps(ns_steps)
    if is_triple(spec):
        return (_as_triple(spec, "ns_coefficients"),) * ns_steps
    if not isinstance(spec, str):
        return custom_coefficients(spec, ns_steps)
    key = spec.strip().lower().replace("-", "_")
    if key not in COEFFICIENT_SETS:
        raise HyperParallelValueError(
            f"Unknown Newton-Schulz coefficient set {spec!r}. Available: "
            f"{', '.join(sorted(COEFFICIENT_SETS))}.{did_you_mean(key, COEFFICIENT_SETS)}"
        )
    triples = COEFFICIENT_SETS[key]
    if key in FIXED_LENGTH_SETS and ns_steps > len(triples):
        raise HyperParallelValueError(
            f"The {key!r} coefficients define {len(triples)} iterations, but ns_steps={ns_steps}; "
            f"lower ns_steps to {len(triples)} or fewer, or choose a set that repeats its last "
            "triple ('legacy', 'polar_express')."
        )
    if len(triples) >= ns_steps:
        return triples[:ns_steps]
    return triples + (triples[-1],) * (ns_steps - len(triples))


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


def _norm_divisor(norms: Tensor, eps: float, eps_added: bool) -> Tensor:
    """What each matrix is divided by first: ``norm + eps`` or ``max(norm, eps)``, in place."""
    return norms.add_(eps) if eps_added else norms.clamp_min_(eps)


def _per_matrix(x: Tensor) -> bool:
    """Whether the stack ``x`` iterates matrix by matrix (:data:`PER_MATRIX_FROM`).

    Measured on CPUs only: accelerators keep one batched GEMM per product, a
    few large kernels rather than many smaller ones, and so do CPUs that
    multiply bf16 natively when ``x`` is bf16: on an AMX CPU, 8 matrices of
    1024 x 1024 took 140 ms batched against 169 ms one by one (768: 68
    against 85 ms), while float32 there still took 0.78x batched time one
    by one.
    """
    if x.device.type != "cpu" or x.shape[-2] < PER_MATRIX_FROM:
        return False
    return not (x.dtype == torch.bfloat16 and cpu_has_native_bf16())


def _iterate_(
    x: Tensor, coefficients: Sequence[Coefficients], eps: float, eps_added: bool
) -> Tensor:
    """Run the iteration on ``x`` of shape (batch, rows, cols), ``rows <= cols``.

    ``x`` must be a tensor the caller owns: it is normalised in place and
    used as one of the two buffers the iterates alternate between, so the
    result is ``x`` itself or one other stack of its shape. The Gram and
    polynomial buffers are allocated once, not per iteration: fresh large
    tensors cost page faults on CPU (5-10% of the iteration at d=512).

    Every product is written ``A @ B.mT`` or ``A.mT @ B``, using that the Gram
    matrix and the polynomial are symmetric: CPU BLAS picks faster kernels for
    these layouts than for ``A @ B``. On a 2-core AVX2 CPU, 8 matrices of
    256 x 256: bf16 (emulated there) 11-15 GFLOP/s against 1.3, fp32 116-120
    against 86; the whole iteration in bf16 took 0.69 s against 6.4 s for
    8 matrices of 256 x 1024.
    """
    # The Gram matrix is rows x rows, so rows <= cols keeps it the small one.
    x.div_(_norm_divisor(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), eps, eps_added))
    batch, rows, _ = x.shape
    spare = torch.empty_like(x)
    if _per_matrix(x):
        gram = x.new_empty(rows, rows)
        poly = torch.empty_like(gram)
        for i in range(batch):
            _iterate_one(x[i], spare[i], gram, poly, coefficients)
    else:
        gram = x.new_empty(batch, rows, rows)
        poly = torch.empty_like(gram)
        current, nxt = x, spare
        for a, b, c in coefficients:
            torch.bmm(current, current.mT, out=gram)
            # A cubic step (c == 0) skips the (X X^T)^2 matmul.
            if c == 0.0:
                torch.mul(gram, b, out=poly)
            else:
                torch.baddbmm(gram, gram, gram.mT, beta=b, alpha=c, out=poly)
            _update(current, poly, a, nxt)
            current, nxt = nxt, current
    # Every matrix took the same number of steps, so all results are in one stack.
    return spare if len(coefficients) % 2 else x


def _iterate_one(
    x: Tensor,
    spare: Tensor,
    gram: Tensor,
    poly: Tensor,
    coefficients: Sequence[Coefficients],
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
        _update(current, poly, a, nxt)
        current, nxt = nxt, current


def _transposed(t: Tensor) -> bool:
    """Whether ``t`` is the transposed view of a contiguous stack (a tall matrix's)."""
    return t.mT.is_contiguous() and not t.is_contiguous()


def _update(current: Tensor, poly: Tensor, a: float, out: Tensor) -> None:
    """``out = a X + P X`` (``P`` symmetric), written in ``out``'s own layout.

    For a transposed view the product is formed transposed, ``a X^T + X^T P``,
    straight into the contiguous memory behind it: no transposing copy.
    """
    product = torch.addmm if current.dim() == 2 else torch.baddbmm
    if _transposed(out):
        product(current.mT, current.mT, poly.mT, beta=a, out=out.mT)
    else:
        product(current, poly.mT, current, beta=a, out=out)


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
    x: Tensor, coefficients: Sequence[Coefficients], eps: float, eps_added: bool
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
    products. The result is a new stack laid out as ``x`` (or ``x`` itself
    after no steps).
    """
    x.div_(_norm_divisor(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), eps, eps_added))
    gram = torch.bmm(x, x.mT)
    poly, q_t, spare = torch.empty_like(gram), torch.empty_like(gram), torch.empty_like(gram)
    identity = True  # Q is the identity (not stored): no step need multiply by it
    last = len(coefficients) - 1
    # Q is kept transposed (q_t), and every product is written A @ B.mT or A.mT @ B
    # (R and P are symmetric): see _iterate_ for why.
    for step, (a, b, c) in enumerate(coefficients):
        restart = (
            step >= GRAM_FIRST_RESTART and (step - GRAM_FIRST_RESTART) % GRAM_RESTART_EVERY == 0
        )
        if restart and not identity:
            x = _q_times(q_t, x)
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
    return x if identity else _q_times(q_t, x)


def _q_times(q_t: Tensor, x: Tensor) -> Tensor:
    """``Q X``, laid out in memory as ``x`` is (see :func:`_update`)."""
    if _transposed(x):
        return torch.bmm(x.mT, q_t).mT  # (X^T Q^T)^T
    return torch.bmm(q_t.mT, x)


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

    Returns:
        One tensor per input, same shape, in ``dtype``. They are views into
        one result stack.

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
    x = torch.empty((sum(counts), rows, cols), dtype=dtype, device=first.device)
    start = 0
    for stack, count in zip(stacks, counts, strict=True):
        x[start : start + count].copy_(stack)
        start += count
    work = x.mT if tall else x
    result = (_iterate_gram_ if gram else _iterate_)(work, coefficients, eps, eps_added)
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


def _band(size: int, parts: int, part: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` balanced bands of ``range(size)``."""
    return part * size // parts, (part + 1) * size // parts


def newton_schulz_team(
    slices: Sequence[Tensor],
    coefficients: Sequence[Coefficients],
    group: ProcessGroup,
    *,
    eps: float = 1e-7,
    eps_added: bool = False,
    dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """The standard iteration on column slices, shared by the ranks of ``group``.

    Each rank passes its slice ``X_j`` of shape ``(batch, m, n_j)`` of every
    matrix (``m`` no more than the whole width ``n``), the same matrices in
    the same order. Per step the ranks all-reduce the Gram matrices
    ``A = sum_j X_j X_j^T``, each forms its band of rows of
    ``P = b A + c A A``, one all-gather completes ``P``, and each updates
    its own slice: ``X_j = a X_j + P X_j``. A rank does ``1/ranks`` of the
    FLOPs of the whole matrix (:func:`newton_schulz_flops`, standard); the
    sums run in a different order from one rank's, so the result equals
    :func:`newton_schulz_batched`'s up to rounding.

    Returns:
        This rank's slices of the results, in ``dtype`` (default: the first
        slice's).
    """
    if not slices:
        return []
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    dtype = slices[0].dtype if dtype is None else dtype
    xs = [s.to(dtype, copy=True) for s in slices]
    wide = torch.promote_types(dtype, torch.float32)
    squares = torch.cat([x.to(wide).square().sum((-2, -1)) for x in xs])
    dist.all_reduce(squares, group=group)
    norms = _norm_divisor(squares.sqrt_(), eps, eps_added).split([x.shape[0] for x in xs])
    for x, norm in zip(xs, norms, strict=True):
        x.div_(norm.to(dtype).view(-1, 1, 1))
    for a, b, c in coefficients:
        grams = [torch.bmm(x, x.mT) for x in xs]
        _all_reduce_each(grams, group)
        if c == 0.0:
            polys = [g.mul_(b) for g in grams]
        else:
            polys = _team_polynomial(grams, b, c, ranks, me, group)
        xs = [torch.baddbmm(x, p.mT, x, beta=a) for x, p in zip(xs, polys, strict=True)]
    return xs


def _all_reduce_each(tensors: list[Tensor], group: ProcessGroup) -> None:
    """Sum each tensor over ``group`` in place, all in one collective."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def _team_polynomial(
    grams: list[Tensor], b: float, c: float, ranks: int, me: int, group: ProcessGroup
) -> list[Tensor]:
    """``b A + c A A`` of each Gram matrix: this rank's band of rows, then one all-gather."""
    bands, heights = [], []
    for gram in grams:
        rows = gram.shape[-1]
        start, stop = _band(rows, ranks, me)
        height = -(-rows // ranks)
        band = gram.new_zeros(gram.shape[0], height, rows)
        mine = gram[:, start:stop]
        band[:, : stop - start] = torch.baddbmm(mine, mine, gram.mT, beta=b, alpha=c)
        bands.append(band.reshape(-1))
        heights.append(height)
    flat = torch.cat(bands)
    gathered = flat.new_empty(ranks * flat.numel())
    dist.all_gather_single(gathered, flat, group=group)
    per_rank = gathered.view(ranks, -1)
    polys, offset = [], 0
    for gram, height in zip(grams, heights, strict=True):
        batch, rows = gram.shape[0], gram.shape[-1]
        size = batch * height * rows
        padded = per_rank[:, offset : offset + size].view(ranks, batch, height, rows)
        heights_of = [stop - start for start, stop in (_band(rows, ranks, r) for r in range(ranks))]
        polys.append(torch.cat([padded[r, :, :h] for r, h in enumerate(heights_of)], dim=1))
        offset += size
    return polys


def newton_schulz_team_collectives(
    batch: int,
    short: int,
    coefficients: Sequence[Coefficients],
    ranks: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[str, int]]:
    """The collectives one rank makes in :func:`newton_schulz_team` for one matrix.

    ``(kind, elements)``, in elements of the iteration's ``dtype``: the
    norm's all-reduce (summed in at least float32), then per step the Gram
    all-reduce and (unless the step is cubic) the polynomial's all-gather.
    """
    wide = torch.promote_types(dtype, torch.float32)
    made = [("all_reduce", batch * wide.itemsize // dtype.itemsize)]
    for _, _, c in coefficients:
        made.append(("all_reduce", batch * short * short))
        if c != 0.0:
            made.append(("all_gather", ranks * batch * -(-short // ranks) * short))
    return made
