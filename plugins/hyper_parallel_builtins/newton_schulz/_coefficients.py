"""Coefficient sets: the ``(a, b, c)`` of each Newton-Schulz iteration, by name or given.

Given ones are one triple per iteration, or a schedule of
``((a, b, c), repeat)`` pairs whose repeats add up to ``ns_steps``
(:func:`expand_schedule`); either way every path iterates the same
per-iteration triples.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TypeAlias, TypeGuard

from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.options import did_you_mean

Coefficients: TypeAlias = tuple[float, float, float]
"""One iteration's ``(a, b, c)``."""

CoefficientSchedule: TypeAlias = Sequence[tuple[Sequence[float], int]]
"""``((a, b, c), repeat)`` pairs: each triple for ``repeat`` iterations in turn."""

CoefficientSpec: TypeAlias = str | Sequence[float] | Sequence[Sequence[float]] | CoefficientSchedule
"""A set name, one triple (used every iteration), one triple per iteration, or a schedule."""

_SCHEDULE_FORM = "((a, b, c), repeat)"

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


def _as_triple(value: object, where: str, hint: str = "") -> Coefficients:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
        raise HyperParallelValueError(
            f"{where} must contain exactly three values (a, b, c), got {value!r}.{hint}"
        )
    if not all(_is_real(v) for v in value):
        raise HyperParallelValueError(
            f"{where} must contain exactly three values (a, b, c) that are floats, got "
            f"{value!r}.{hint}"
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


def _is_sequence(value: object) -> TypeGuard[Sequence[object]]:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _is_pair(value: object) -> TypeGuard[Sequence[object]]:
    """Whether ``value`` is shaped as a schedule entry: a sequence, then one item that is not."""
    return (
        _is_sequence(value)
        and len(value) == 2
        and _is_sequence(value[0])
        and not _is_sequence(value[1])
    )


def is_schedule(spec: object) -> bool:
    """Whether ``spec`` is written as ``((a, b, c), repeat)`` pairs (any of its entries a pair)."""
    return _is_sequence(spec) and any(_is_pair(entry) for entry in spec)


def _repeat_of(entry: Sequence[object], index: int, triple: Coefficients) -> int:
    repeat = entry[1]
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise HyperParallelValueError(
            f"ns_coefficients[{index}][1], the number of iterations of {triple}, must be an int "
            f">= 1, got {repeat!r}."
        )
    return repeat


def expand_schedule(spec: Sequence[object], ns_steps: int) -> tuple[Coefficients, ...]:
    """The triple of each iteration of a schedule of ``((a, b, c), repeat)`` pairs.

    Each triple is used for ``repeat`` iterations in turn; the repeats must
    add up to ``ns_steps``. ``[((3.4445, -4.7750, 2.0315), 8), ((2, -1.5,
    0.5), 2)]`` with ``ns_steps=10`` is the first triple eight times, then
    the second twice: the same as writing the ten triples out.

    Raises:
        ValueError: an entry that is not such a pair, a malformed or
            non-finite triple, a repeat that is not an int >= 1 (each named
            by its index), or repeats that do not add up to ``ns_steps``.
    """
    _check_ns_steps(ns_steps)
    runs: list[tuple[Coefficients, int]] = []
    for index, entry in enumerate(spec):
        if not _is_pair(entry):
            raise HyperParallelValueError(
                f"ns_coefficients[{index}] must be a {_SCHEDULE_FORM} pair, as the schedule's "
                f"other entries are, got {entry!r}; a triple used once is ((a, b, c), 1)."
            )
        triple = _as_triple(entry[0], f"ns_coefficients[{index}][0]")
        runs.append((triple, _repeat_of(entry, index, triple)))
    total = sum(repeat for _, repeat in runs)
    if total != ns_steps:
        counts = " + ".join(str(repeat) for _, repeat in runs)
        raise HyperParallelValueError(
            f"The ns_coefficients schedule runs {counts} = {total} iterations, but "
            f"ns_steps={ns_steps}; make the repeats add up to ns_steps, or set ns_steps={total}."
        )
    return tuple(triple for triple, repeat in runs for _ in range(repeat))


def custom_coefficients(spec: object, ns_steps: int) -> tuple[Coefficients, ...]:
    """The triple of each iteration, given by the caller: one per iteration, or a schedule.

    HyperParallel's ``ns_variant="custom"``: ``spec`` is a non-empty
    sequence of at least ``ns_steps`` triples of finite floats, of which the
    first ``ns_steps`` are used; or a schedule of ``((a, b, c), repeat)``
    pairs whose repeats add up to ``ns_steps`` (:func:`expand_schedule`).

    Raises:
        ValueError: an empty or short sequence, a malformed or non-finite
            triple (named by its index), or a bad schedule.
    """
    _check_ns_steps(ns_steps)
    if _is_pair(spec):
        raise HyperParallelValueError(
            f"ns_coefficients={spec!r} is one {_SCHEDULE_FORM} pair; a schedule is a list of "
            f"them: write [{spec!r}]."
        )
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise HyperParallelValueError(
            "ns_coefficients must be provided as a non-empty sequence of (a, b, c) triples, one "
            f"per iteration, or of {_SCHEDULE_FORM} pairs, got {spec!r}."
        )
    if is_schedule(spec):
        return expand_schedule(spec, ns_steps)
    hint = f" (Or write a schedule: {_SCHEDULE_FORM} pairs.)"
    triples = tuple(_as_triple(t, f"ns_coefficients[{i}]", hint) for i, t in enumerate(spec))
    if ns_steps > len(triples):
        raise HyperParallelValueError(
            f"ns_steps={ns_steps} exceeds the {len(triples)} provided coefficient groups; give "
            f"one (a, b, c) per iteration, or lower ns_steps to {len(triples)}."
        )
    return triples[:ns_steps]


def resolve_coefficients(spec: CoefficientSpec, ns_steps: int) -> tuple[Coefficients, ...]:
    """Return the ``(a, b, c)`` for each of ``ns_steps`` iterations.

    Args:
        spec: A name in :data:`COEFFICIENT_SETS` (case-insensitive, ``-`` read
            as ``_``), whose last triple repeats when it is shorter than
            ``ns_steps`` (a set in :data:`FIXED_LENGTH_SETS` does not: more
            steps than it has are an error); one triple, used at every
            iteration (``torch.optim.Muon``'s form); a sequence of at
            least ``ns_steps`` triples, of which the first ``ns_steps`` are
            used; or a schedule of ``((a, b, c), repeat)`` pairs whose
            repeats add up to ``ns_steps`` (:func:`custom_coefficients`).
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
