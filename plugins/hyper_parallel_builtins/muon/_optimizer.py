"""The :class:`Muon` optimizer and its registration."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from hyper_parallel import hookimpl
from hyper_parallel.core.distributed import Need, RowBlocks, WholeMatrices
from hyper_parallel.core.distributed.toolkit import local_tensor
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import MatrixOptimizer
from hyper_parallel.core.plugin import RegisterFn
from hyper_parallel.qk_clip import ClipGroup, ClipPlan, QKClipStats, plan_clip, tracking
from hyper_parallel_builtins.muon._extensions import (
    MomentumUpdateFn,
    MuonPostUpdateContext,
    NSTransformFn,
    PostUpdateFn,
    ReshapeFn,
    ZeropowerFn,
    check_head_wise,
    check_head_wise_selects,
    head_wise_dims,
    param_names,
)
from hyper_parallel_builtins.muon._matrices import matrix_shape, need
from hyper_parallel_builtins.muon._options import (
    HYPER_PARALLEL_LR,
    TORCH_LR,
    check_options,
    check_replica_count,
    follows_torch,
    ns_dtype_from_env,
    resolve_settings,
)
from hyper_parallel_builtins.muon._team import MuonTeam
from hyper_parallel_builtins.muon._update import (
    BlockTransform,
    DecidedGroup,
    MomentumSource,
    MuonSettings,
    StepOptions,
    apply_updates_,
)
from hyper_parallel_builtins.newton_schulz import (
    CoefficientSpec,
    PathCache,
    Tuning,
    TuningReport,
    Workspace,
    parse_tuning,
    stacks_of,
    tune,
    tuning_from_env,
)

__all__ = ["Muon", "hyper_parallel_register_optimizers"]

# Group keys beyond torch.optim.Muon's, with the values a group loaded from an older or
# another library's state_dict (torch.optim.Muon's, HyperParallel's) gets.
_EXTRA_DEFAULTS: Mapping[str, Any] = {
    "matched_adamw_rms": None,
    "ns_variant": None,
    "ns_epsilon": 1e-10,
    "zero_rms_scale_mode": "zero",
    "apply_lr_in_update": False,
    "ns_coefficients": None,
    "eps": None,
    "adjust_lr_fn": None,
    "ns_dtype": None,
    "ns_method": "auto",
    "matrix_view": "auto",
    "sharding": None,
    "head_dim": None,
    "split_rows": None,
    "qk_clip_threshold": None,
    "qk_clip_alpha": 0.5,
}

#: The group keys whose values decide a group's :class:`DecidedGroup`; a group whose values
#: change (add_param_group, load_state_dict, a user's edit) gets it worked out again. (lr,
#: weight_decay, momentum and nesterov are read at each step.)
_DECIDING_KEYS = (
    "adjust_lr_fn",
    "eps",
    "ns_coefficients",
    "ns_variant",
    "ns_steps",
    "ns_epsilon",
    "matched_adamw_rms",
    "zero_rms_scale_mode",
    "apply_lr_in_update",
    "ns_dtype",
    "ns_method",
    "matrix_view",
    "sharding",
    "head_dim",
    "split_rows",
    "qk_clip_threshold",
    "qk_clip_alpha",
)

# What Muon keeps beyond torch's Optimizer state: carried by copies and pickles.
_INSTANCE_ATTRIBUTES = (
    "head_wise",
    "head_dim",
    "head_wise_patterns",
    "hsdp_replica_count",
    "zeropower_fn",
    "momentum_update_fn",
    "reshape_fn",
    "ns_transform_fn",
    "env_ns_dtype",
    "post_update_fn",
    "_head_dims",
    "workspace",
    "ns_tuning",
)


class Muon(MatrixOptimizer):
    r"""Momentum orthogonalized by Newton-Schulz, for hidden-layer matrices: HyperParallel's Muon.

    For each matrix param :math:`W` of shape :math:`(A, B)` with gradient
    :math:`G` and momentum buffer :math:`M` (zero at first), by default:

    .. math::

        U &\leftarrow G + m_1 M, \qquad M \leftarrow m_2 M + G, \qquad
            U \leftarrow G + m_1 U \ \text{(nesterov)} \\
        O &\leftarrow \mathrm{NS}_k\!\left(U / (\lVert U \rVert_F + \epsilon)\right) \\
        W &\leftarrow (1 - \eta\lambda)\, W - \eta\, r \sqrt{\max(A, B)}\; O

    where :math:`\mathrm{NS}_k` is ``ns_steps`` iterations of
    :math:`X \leftarrow aX + (bA + cA^2)X` with :math:`A = XX^\top` (on
    :math:`X^\top` when :math:`A > B`), one ``(a, b, c)`` per iteration from
    ``ns_variant``, and :math:`r` is ``matched_adamw_rms``: the update's RMS
    is about :math:`\eta r`, an AdamW update's, so AdamW's lr and weight
    decay carry over. These are HyperParallel's defaults, names and rule, so
    a HyperParallel script trains the same here.

    ``torch.optim.Muon``'s keywords keep torch's meaning: a call with
    ``adjust_lr_fn``, ``eps`` or ``ns_coefficients`` as one ``(a, b, c)``
    triple makes torch's update (lr 1e-3 by default, momentum
    :math:`M \leftarrow \mu M + (1-\mu) G`, the norm floored at ``eps``, the
    scale :math:`\sqrt{\max(1, A/B)}` or ``"match_rms_adamw"``'s). Each
    param group follows the convention its own keys say.

    Params with fewer than 2 dims are refused: give them to AdamW
    (``get_hyper_optimizer`` does so). Params of more dims are read as
    matrices as ``matrix_view`` says. Matrices of one shape, device and NS
    dtype in a param group are orthogonalized in one batched call. Sharded
    (DTensor) params of any layout get the same numbers as one process.

    Args:
        params: Params, ``(name, param)`` pairs, or param-group dicts; a group
            may override any option below but ``head_wise``,
            ``head_wise_patterns``, ``hsdp_replica_count`` and the callables.
        lr: Learning rate :math:`\eta` (a float or a 1-element tensor).
            ``None``: 2e-2, or 1e-3 with torch's keywords.
        weight_decay: Decoupled weight decay :math:`\lambda`.
        matched_adamw_rms: RMS target :math:`r`. ``0``/``None``: see
            ``zero_rms_scale_mode``.
        momentum: :math:`m_1 = m_2`, or HyperParallel's pair ``(m1, m2)``.
        nesterov: Orthogonalize the Nesterov look-ahead.
        ns_steps: Newton-Schulz iterations :math:`k`, 1 to 99.
        ns_variant: Coefficient set: ``"asym5"`` (a triple per iteration,
            at most 5; the default, ``None``, except with torch's keywords,
            whose default is ``"legacy"``), ``"legacy"`` (Keller Jordan's
            ``(3.4445, -4.7750, 2.0315)`` at every step), ``"custom"`` (the
            triple of each iteration from ``ns_coefficients``), or another set of
            :data:`~hyper_parallel_builtins.newton_schulz.COEFFICIENT_SETS`
            (``"polar_express"``, ``"cubic"``).
        hsdp_replica_count: HSDP replicas that share one copy of the
            optimizer's work (a divisor of the replicate dim; ``None``: all
            of them). Replicas in different groups compute the same results
            themselves, so the sharing collectives stay within a group.
        head_wise: Split the q/k projection weights that
            ``head_wise_patterns`` selects (default: names ending in
            ``q_proj``, ``k_proj``, ``q_b_proj``, ``wq`` or ``wk`` +
            ``.weight``) into heads: a ``(heads * head_dim, in)`` weight is
            ``heads`` independent ``(head_dim, in)`` matrices for
            Newton-Schulz and the scale. Params need names.
        head_dim: The head size of the default selection.
        head_wise_patterns: ``{regex: head_dim}`` replacing the default selection.
        ns_coefficients: With ``ns_variant="custom"``, at least ``ns_steps``
            finite ``(a, b, c)`` (the first ``ns_steps`` used), or a schedule
            of ``((a, b, c), repeat)`` pairs whose repeats add up to
            ``ns_steps``, e.g. ``[(keller, 8), ((2, -1.5, 0.5), 2)]`` with
            ``ns_steps=10``; or one triple, torch's form (torch's convention).
        ns_epsilon: Added to each matrix's norm before Newton-Schulz.
        zeropower_fn: ``fn(x, steps=ns_steps)`` in place of Newton-Schulz,
            on a ``(m, n)`` matrix or ``(B, m, n)`` stack of whole matrices.
        momentum_update_fn: ``fn(grads, buffers, m1, m2, nesterov)`` in place of
            the momentum rule: steps the buffers in place and returns the updates.
        reshape_fn: ``fn(name, update)``: views of a param's whole update to
            orthogonalize (and scale) one by one.
        ns_transform_fn: ``fn(name, update)``: an
            :class:`~hyper_parallel_builtins.muon.NSInputTransform` (pieces
            and how to restore them), or ``None`` to leave the param alone.
        post_update_fn: ``fn(param, local_tensor, context)`` after each
            updated param's step, with a
            :class:`~hyper_parallel_builtins.muon.MuonPostUpdateContext`.
        zero_rms_scale_mode: With no ``matched_adamw_rms``: ``"zero"`` makes
            no update (weight decay only), ``"use_lr"`` scales by 1.
        apply_lr_in_update: Fold :math:`-\eta` into the update's scale and
            add it (the same step, rounded in another order).
        eps: torch's floor on the norm (torch's convention; default 1e-7).
        adjust_lr_fn: torch's ``"original"`` (:math:`\sqrt{\max(1, A/B)}`) or
            ``"match_rms_adamw"`` (:math:`0.2\sqrt{\max(A, B)}`) (torch's convention).
        ns_dtype: dtype Newton-Schulz runs in. ``None``: the fastest on the
            device (:func:`~hyper_parallel_builtins.muon.default_ns_dtype`):
            bfloat16 on an accelerator and on a CPU with native bf16 matmul,
            float32 on other CPUs, float64 for float64 params;
            ``$HYPER_PARALLEL_NS_DTYPE`` where set. Params and buffers keep
            their own dtype.
        ns_method: ``"standard"``, ``"gram"`` (iterate on the Gram matrix:
            fewer FLOPs for long thin matrices, the same result up to
            rounding) or ``"auto"`` (Gram from the aspect ratio measured to
            pay off on the device).
        matrix_view: How params of more than 2 dims become matrices:
            ``"auto"`` (3-D ``(E, m, n)`` is ``E`` expert matrices, 4-D and more
            is flattened to ``(out, -1)``), ``"flatten"`` or ``"batch"`` (all
            leading dims are batch dims).
        sharding: The sharding backend of sharded params (``"fsdp"``,
            ``"hsdp"``, ...). ``None``: ``$HYPER_PARALLEL_SHARDING`` as it is
            when the optimizer is built, else detected from the placements.
        split_rows: Group key: row counts that split a fused weight (QKV)
            into independent blocks; a group's ``head_dim`` then applies
            inside each. (A group's ``head_dim`` alone splits its params
            into heads.)
        qk_clip_threshold: QK-clip (MuonClip): after each step, every
            attention head whose largest pre-softmax logit ``S`` over the
            step passed this ``tau`` has its ``W_q`` rows scaled by
            ``(tau / S) ** qk_clip_alpha`` and its ``W_k`` rows by
            ``(tau / S) ** (1 - qk_clip_alpha)``, on each rank's shards.
            The logits come from the layers
            :func:`hyper_parallel.qk_clip.track` tracks; the step's figures
            are :attr:`qk_clip_stats`. ``None``: off.
        qk_clip_alpha: The share of the clip ``W_q`` takes, in [0, 1].
        ns_tuning: ``"on"``: a group's Newton-Schulz paths (and float32 where
            it beats a lower-precision default) are measured here at its first
            step, or read from the per-user cache; ``"off"``: the table decides;
            ``"retune"``: measured again. ``None``: ``$HYPER_PARALLEL_NS_TUNING``,
            else ``"on"``. Rank 0's choice is every rank's; see :attr:`ns_tuning_report`.

    Raises:
        ValueError: a param with fewer than 2 dims or complex, an
            out-of-range or unknown option, or a head-wise param that cannot
            be split.
        TypeError: an ``hsdp_replica_count`` that is not an int.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> matrices = [p for p in model.parameters() if p.ndim >= 2]
        >>> opt = Muon(matrices, lr=0.02, momentum=0.95)
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step()
    """

    extra_group_defaults: ClassVar[Mapping[str, Any]] = _EXTRA_DEFAULTS

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor | None = None,
        weight_decay: float = 0.1,
        matched_adamw_rms: float | None = 0.2,
        momentum: float | Sequence[float] = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_variant: str | None = None,
        hsdp_replica_count: int | None = None,
        head_wise: bool = False,
        head_dim: int | None = None,
        head_wise_patterns: Mapping[str, int] | None = None,
        *,
        ns_coefficients: CoefficientSpec | None = None,
        ns_epsilon: float = 1e-10,
        zeropower_fn: ZeropowerFn | None = None,
        momentum_update_fn: MomentumUpdateFn | None = None,
        reshape_fn: ReshapeFn | None = None,
        ns_transform_fn: NSTransformFn | None = None,
        post_update_fn: PostUpdateFn | None = None,
        zero_rms_scale_mode: str = "zero",
        apply_lr_in_update: bool = False,
        eps: float | None = None,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | None = None,
        ns_method: str = "auto",
        matrix_view: str = "auto",
        sharding: str | None = None,
        split_rows: Sequence[int] | None = None,
        qk_clip_threshold: float | None = None,
        qk_clip_alpha: float = 0.5,
        ns_tuning: str | None = None,
    ) -> None:
        check_head_wise(head_wise, head_dim, head_wise_patterns, (reshape_fn, ns_transform_fn))
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "matched_adamw_rms": matched_adamw_rms,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_variant": ns_variant,
            "ns_coefficients": ns_coefficients,
            "ns_epsilon": ns_epsilon,
            "zero_rms_scale_mode": zero_rms_scale_mode,
            "apply_lr_in_update": apply_lr_in_update,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "ns_method": ns_method,
            "matrix_view": matrix_view,
            "sharding": sharding,
            "head_dim": None,
            "split_rows": split_rows,
            "qk_clip_threshold": qk_clip_threshold,
            "qk_clip_alpha": qk_clip_alpha,
        }
        if lr is None:
            defaults["lr"] = TORCH_LR if follows_torch(defaults) else HYPER_PARALLEL_LR
        self.head_wise, self.head_dim = head_wise, head_dim
        self.head_wise_patterns = head_wise_patterns
        self.hsdp_replica_count = check_replica_count(hsdp_replica_count)
        self.zeropower_fn, self.momentum_update_fn = zeropower_fn, momentum_update_fn
        self.reshape_fn, self.ns_transform_fn = reshape_fn, ns_transform_fn
        self.post_update_fn = post_update_fn
        self._head_dims: dict[Tensor, int] = {}
        #: Newton-Schulz work buffers, kept from step to step (a copy starts with none);
        #: ``None`` allocates them afresh at every step
        self.workspace: Workspace | None = Workspace()
        # $HYPER_PARALLEL_NS_DTYPE, read when a group that follows it is added; never at a step
        self.env_ns_dtype: torch.dtype | None = None
        #: each group's decided record (by id), with what it was worked out from
        self._decided: dict[int, tuple[tuple[Any, ...], DecidedGroup]] = {}
        #: What the last step's QK-clip saw and did (``None`` before one, or with it off)
        self.qk_clip_stats: QKClipStats | None = None
        self._qk_plan: tuple[tuple[Any, ...], ClipPlan | None] | None = None
        #: Tuning of the Newton-Schulz paths (``$HYPER_PARALLEL_NS_TUNING`` read here, once)
        self.ns_tuning = tuning_from_env() if ns_tuning is None else parse_tuning(ns_tuning)
        self._tuning_reports: dict[int, TuningReport] = {}  # by group id
        self._path_cache: PathCache | None = None  # made at the first tuning
        super().__init__(params, defaults, replica_group_size=self.hsdp_replica_count)
        if head_wise:
            check_head_wise_selects(self.param_groups, head_wise_patterns)

    _check_options = staticmethod(check_options)

    def _check_param(self, param: Tensor, group: dict[str, Any]) -> None:
        """Refuse vectors, complex params, and head or row splits that do not fit."""
        if param.ndim < 2:
            raise HyperParallelValueError(
                f"Muon only updates matrices, but got a param of shape {tuple(param.shape)} "
                f"({param.ndim}-D). Optimize params with fewer than 2 dims (biases, norm weights) "
                "with AdamW: e.g. get_hyper_optimizer(model, partitioner='by_shape'), or put them "
                "in adamw_params."
            )
        if param.is_complex():
            raise HyperParallelValueError(
                f"Muon does not support complex params (got {param.dtype}, shape "
                f"{tuple(param.shape)}); optimize them with AdamW or view them as real."
            )

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["ns_dtype"] is None:
            self.env_ns_dtype = ns_dtype_from_env()
        self._decided.pop(id(group), None)  # worked out again at its next step
        dims = (
            head_wise_dims([group], self.head_dim, self.head_wise_patterns)
            if self.head_wise
            else {}
        )
        for p in group["params"]:
            split = dims.get(p)
            if split is not None and group["head_dim"] not in (None, split):
                raise HyperParallelValueError(
                    f"A param of shape {tuple(p.shape)} is split into heads of {split} rows by "
                    f"head_wise and of {group['head_dim']} by its group's head_dim; give one."
                )
            need(p.shape, group, split or group["head_dim"])  # the split fits
        self._head_dims.update(dims)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in _INSTANCE_ATTRIBUTES})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._decided = {}  # by group id, which a copy does not keep
        self.qk_clip_stats, self._qk_plan = None, None
        self._tuning_reports, self._path_cache = {}, None

    @property
    def ns_tuning_report(self) -> TuningReport | None:
        """What tuning chose for each group's stacks and what it cost (``None`` before any)."""
        reports = list(self._tuning_reports.values())
        return sum(reports[1:], reports[0]) if reports else None

    def settings(self, group: Mapping[str, Any]) -> MuonSettings:
        """What ``group``'s options decide, worked out when they last changed (never per step)."""
        return self.decided(group).settings

    def decided(self, group: Mapping[str, Any]) -> DecidedGroup:
        """What ``group``'s options and params decide (:class:`DecidedGroup`), kept until they change."""
        deciding = (
            tuple(group[key] for key in _DECIDING_KEYS),
            tuple(id(p) for p in group["params"]),
            self.workspace,
            self.zeropower_fn,
            self.momentum_update_fn,
            self.reshape_fn,
            self.ns_transform_fn,
            self.ns_tuning,
        )
        kept = self._decided.get(id(group))
        if kept is None or kept[0] != deciding:
            kept = self._decided[id(group)] = (deciding, self._decide(group))
        return kept[1]

    def _decide(self, group: Mapping[str, Any]) -> DecidedGroup:
        settings = resolve_settings(group, self.env_ns_dtype)
        params: list[Tensor] = group["params"]
        keyed = self.reshape_fn is not None or self.ns_transform_fn is not None
        needs = {
            id(p): need(
                p.shape, group, self._head_dims.get(p, group["head_dim"]), i if keyed else None
            )
            for i, p in enumerate(params)
        }
        names = param_names(group)
        plain = self.zeropower_fn is None and not keyed
        if plain:
            settings = self._tuned(group, settings, params, needs)
        transform = BlockTransform(
            group,
            settings,
            names,
            zeropower_fn=self.zeropower_fn,
            reshape_fn=self.reshape_fn,
            ns_transform_fn=self.ns_transform_fn,
            workspace=self.workspace,
            device=params[0].device if params else None,
        )
        backend = self.sharding_backend(group)
        return DecidedGroup(
            settings=settings,
            backend=backend,
            needs=needs,
            names={id(p): name for p, name in zip(params, names, strict=True)},
            transform=transform,
            team=(
                MuonTeam(group, settings.dtype_for(params[0]), self.workspace, settings)
                if plain and params
                else None
            ),
            streams=(
                backend.holds_whole
                and plain
                and self.momentum_update_fn is None
                and all(isinstance(n, WholeMatrices) for n in needs.values())
            ),
        )

    def _tuned(
        self,
        group: Mapping[str, Any],
        settings: MuonSettings,
        params: Sequence[Tensor],
        needs: Mapping[int, Need],
    ) -> MuonSettings:
        """``settings`` with the dtypes tuning chose; the paths go to the workspace.

        With ``ns_tuning`` off, or no workspace to keep the paths, nothing is measured.
        """
        mode = parse_tuning(self.ns_tuning)  # a user may have set the attribute to a name
        if mode is Tuning.OFF or self.workspace is None or not params:
            return settings
        matrices = []
        for p in params:  # a param's row blocks (heads, fused parts) are matrices of their own
            batch, rows, cols = matrix_shape(p.shape, group["matrix_view"])
            needed = needs[id(p)]
            heights = needed.heights if isinstance(needed, RowBlocks) else (rows,)
            matrices += [(batch, h, cols, settings.dtype_for(p), p.device) for h in heights]
        free = settings.group_ns_dtype is None and settings.env_ns_dtype is None
        if self._path_cache is None:
            self._path_cache = PathCache()
        report = tune(stacks_of(matrices, group["ns_method"], free), mode, self._path_cache)
        self._tuning_reports[id(group)] = report
        return dataclasses.replace(settings, tuned_dtypes=report.keep_in(self.workspace))

    def _step_group(self, group: dict[str, Any]) -> None:
        group["step"] = (group.get("step") or 0) + 1
        params, grads, buffers = self._params_with_grads(group)
        if not params:
            return
        decided = self.decided(group)
        options = StepOptions.of(group, decided.settings)
        if decided.streams:  # plain params held whole: each made, orthogonalized, applied in turn
            decided.transform.stream_(params, grads, buffers, options)
            local_params = params
        else:  # the backend brings whole blocks to the transform, wherever they live
            local_params = [local_tensor(p) for p in params]
            updates = decided.backend.map_prepared_blocks(
                decided.transform,
                MomentumSource(decided.settings, options, buffers, grads, self.momentum_update_fn),
                buffers,
                [decided.needs[id(p)] for p in params],
                cost=decided.transform.cost,
                team=decided.team,
            )
            apply_updates_(local_params, updates, options)
        if self.post_update_fn is not None:
            self._post_update(params, local_params, group, decided, options.lr)

    def _check_step(self, group: dict[str, Any]) -> None:
        """Decide ``group`` now if an option was edited since its last step: a bad value fails
        before any group steps."""
        self.decided(group)

    def _ready_step(self) -> None:
        """Plan QK-clip (where a group sets ``qk_clip_threshold``) when the groups or the tracked
        layers changed; a layer it cannot clip, or one that recorded no logits, fails before
        any group steps."""
        decided = tuple(self.decided(group) for group in self.param_groups)
        deciding = (tracking.generation, *map(id, decided))  # the records stay alive in the key
        if self._qk_plan is None or self._qk_plan[0][: len(deciding)] != deciding:
            self._qk_plan = ((*deciding, *decided), self._plan_qk_clip(decided))
        if self._qk_plan[1] is not None:
            self._qk_plan[1].check_ready()

    def _finish_step(self) -> None:
        """QK-clip, once every group has stepped, with the plan :meth:`_ready_step` made."""
        assert self._qk_plan is not None
        if self._qk_plan[1] is not None:
            self.qk_clip_stats = self._qk_plan[1].clip_()

    def _plan_qk_clip(self, decided: Sequence[DecidedGroup]) -> ClipPlan | None:
        if all(d.settings.qk_clip_threshold is None for d in decided):
            return None
        return plan_clip(
            [
                ClipGroup(
                    group["params"],
                    param_names(group),
                    d.settings.qk_clip_threshold,
                    d.settings.qk_clip_alpha,
                )
                for group, d in zip(self.param_groups, decided, strict=True)
            ]
        )

    def _post_update(
        self,
        params: list[Tensor],
        local: list[Tensor],
        group: dict[str, Any],
        decided: DecidedGroup,
        lr: float,
    ) -> None:
        assert self.post_update_fn is not None
        for param, local_param in zip(params, local, strict=True):
            context = MuonPostUpdateContext(
                param_fqn=decided.names[id(param)],
                logical_shape=tuple(param.shape),
                lr=lr,
                weight_decay=float(group["weight_decay"]),
                step=int(group["step"]),
            )
            self.post_update_fn(param, local_param, context)


@hookimpl
def hyper_parallel_register_optimizers(register: RegisterFn) -> None:
    """Register ``muon``."""
    register(
        "muon",
        Muon,
        description="HyperParallel's Muon: momentum orthogonalized by Newton\u2013Schulz, for "
        "hidden-layer matrices",
        requires=("matrices_only",),
    )
