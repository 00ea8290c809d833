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

Exported: the iteration on a matrix, a list or a stack (``newton_schulz``,
``newton_schulz_batched``, ``newton_schulz_stack_`` with ``new_stack``,
``stack_into`` and ``normalize_``), a team of ranks' iteration, the
coefficient sets, the FLOP count and Gram choice, the :class:`Workspace`
that keeps buffers (and each stack's path) across steps, and the tuning
that measures the paths on this machine (:func:`tune`, :class:`PathCache`,
:data:`TUNING_ENV`): what an optimizer built on the iteration calls. The path tables and tuning constants
stay in the private modules.
"""

from __future__ import annotations

from hyper_parallel.core.options import CACHE_DIR_ENV, default_cache_dir
from hyper_parallel_builtins.newton_schulz._coefficients import (
    COEFFICIENT_SETS,
    KELLER_COEFFICIENTS,
    Coefficients,
    CoefficientSpec,
    resolve_coefficients,
)
from hyper_parallel_builtins.newton_schulz._iterate import (
    new_stack,
    newton_schulz,
    newton_schulz_batched,
    newton_schulz_flops,
    newton_schulz_stack_,
    normalize_,
    stack_into,
)
from hyper_parallel_builtins.newton_schulz._path_cache import (
    Candidate,
    PathCache,
    ShapeSet,
    Stack,
)
from hyper_parallel_builtins.newton_schulz._paths import resolve_ns_method
from hyper_parallel_builtins.newton_schulz._team import (
    newton_schulz_team,
    newton_schulz_team_collectives,
)
from hyper_parallel_builtins.newton_schulz._tuning import (
    TUNING_ENV,
    ShapeReport,
    Tuning,
    TuningReport,
    candidates,
    parse_tuning,
    stacks_of,
    tune,
    tuning_from_env,
)
from hyper_parallel_builtins.newton_schulz._workspace import Workspace

__all__ = [
    "CACHE_DIR_ENV",
    "COEFFICIENT_SETS",
    "KELLER_COEFFICIENTS",
    "TUNING_ENV",
    "Candidate",
    "CoefficientSpec",
    "Coefficients",
    "PathCache",
    "ShapeReport",
    "ShapeSet",
    "Stack",
    "Tuning",
    "TuningReport",
    "Workspace",
    "candidates",
    "default_cache_dir",
    "new_stack",
    "newton_schulz",
    "newton_schulz_batched",
    "newton_schulz_flops",
    "newton_schulz_stack_",
    "newton_schulz_team",
    "newton_schulz_team_collectives",
    "normalize_",
    "parse_tuning",
    "resolve_coefficients",
    "resolve_ns_method",
    "stack_into",
    "stacks_of",
    "tune",
    "tuning_from_env",
]
