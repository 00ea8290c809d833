"""clip_grad_norm_: torch's numbers on plain tensors; the one-process numbers on any mix of meshes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from hyper_parallel import clip_grad_norm_
from hyper_parallel.core.optimizer import ChainedOptimizer

INF = math.inf


def _plain_params(seed: int = 0, scale: float = 3.0) -> list[nn.Parameter]:
    """Params of several shapes with grads; one has no grad."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=gen)) for s in [(5, 4), (7,), (2, 3, 3), (6,)]]
    for p in params[:3]:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def _clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Copies with their grads (``copy.deepcopy`` drops a Parameter's ``.grad``)."""
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for copy_, p in zip(copies, params, strict=True):
        copy_.grad = None if p.grad is None else p.grad.clone()
    return copies


def _grads(params: list[nn.Parameter]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


# -- one process ---------------------------------------------------------------


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_norm", [1.0, 1e4], ids=["clips", "leaves"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF, 3.0, "inf"])
def test_matches_torch_on_plain_tensors(
    norm_type: float | str, max_norm: float, foreach: bool | None
) -> None:
    ours, theirs = _plain_params(), _plain_params()
    norm = clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, float(norm_type), foreach=foreach)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert norm.shape == () and norm.dtype == torch.float32
    for mine, ref in zip(_grads(ours), _grads(theirs), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
    if max_norm == 1.0:  # it really clipped
        assert expected > 1.0
        assert clip_grad_norm_(ours, INF, norm_type) == pytest.approx(1.0, rel=1e-5)


def test_takes_a_tensor_an_optimizer_a_generator_and_nothing() -> None:
    params = _plain_params()
    expected = torch.nn.utils.clip_grad_norm_(_clone(params), 1.0)
    torch.testing.assert_close(clip_grad_norm_(_clone(params), 1.0), expected)
    sgd = torch.optim.SGD(_clone(params), lr=0.1)
    torch.testing.assert_close(clip_grad_norm_(sgd, 1.0), expected)
    torch.testing.assert_close(clip_grad_norm_(iter(_clone(params)), 1.0), expected)
    ref = torch.nn.utils.clip_grad_norm_(_plain_params()[0], 1.0)
    torch.testing.assert_close(clip_grad_norm_(_plain_params()[0], 1.0), ref)
    assert clip_grad_norm_([], 1.0).item() == 0.0
    assert clip_grad_norm_([nn.Parameter(torch.ones(3))], 1.0).item() == 0.0  # no grads


def _chained() -> tuple[ChainedOptimizer, list[nn.Parameter], list[nn.Parameter]]:
    muon_params = _plain_params(seed=1, scale=0.1)[:3]  # small matrix grads
    adamw_params = _plain_params(seed=2, scale=50.0)  # large embedding-like grads
    chained = ChainedOptimizer(
        {
            "muon": torch.optim.SGD(muon_params, lr=0.1),
            "adamw": torch.optim.SGD(adamw_params, lr=0.1),
        }
    )
    return chained, muon_params, adamw_params


def test_per_optimizer_clips_each_sub_optimizer_to_max_norm() -> None:
    chained, muon_params, adamw_params = _chained()
    ref_muon, ref_adamw = _clone(muon_params), _clone(adamw_params)
    norms = clip_grad_norm_(chained, 1.0, per_optimizer=True)
    assert list(norms) == ["muon", "adamw"]
    torch.testing.assert_close(norms["muon"], torch.nn.utils.clip_grad_norm_(ref_muon, 1.0))
    torch.testing.assert_close(norms["adamw"], torch.nn.utils.clip_grad_norm_(ref_adamw, 1.0))
    for mine, ref in zip(
        _grads(muon_params + adamw_params), _grads(ref_muon + ref_adamw), strict=True
    ):
        torch.testing.assert_close(mine, ref)
    assert norms["muon"] < 1.0 < norms["adamw"]  # muon's grads were left alone

    # Clipped together, the large AdamW grads would have starved Muon's.
    chained, muon_params, _ = _chained()
    before = _grads(muon_params)
    total = clip_grad_norm_(chained, 1.0)
    assert total > 100.0
    assert all(
        g is not None and b is not None and g.norm() < b.norm() / 100
        for g, b in zip(_grads(muon_params), before, strict=True)
    )


def test_per_optimizer_takes_a_mapping_of_params() -> None:
    _, muon_params, adamw_params = _chained()
    ref = torch.nn.utils.clip_grad_norm_(_clone(adamw_params), 2.0, INF)
    norms = clip_grad_norm_({"a": muon_params, "b": adamw_params}, 2.0, INF, per_optimizer=True)
    torch.testing.assert_close(norms["b"], ref)
    # Without per_optimizer a mapping is just its params, clipped together.
    expected = torch.nn.utils.clip_grad_norm_(_clone(muon_params + adamw_params), 1.0)
    torch.testing.assert_close(
        clip_grad_norm_({"a": muon_params, "b": adamw_params}, 1.0), expected
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_norm": -1.0}, ValueError, r"max_norm must be a non-negative number, got -1.0"),
        ({"max_norm": math.nan}, ValueError, r"max_norm must be a non-negative number, got nan"),
        ({"max_norm": "big"}, TypeError, r"max_norm must be a number, got 'big'"),
        ({"norm_type": 0.0}, ValueError, r"norm_type must be a positive number or 'inf', got 0.0"),
        ({"norm_type": -2}, ValueError, r"norm_type must be a positive number or 'inf', got -2"),
        ({"norm_type": -INF}, ValueError, r"norm_type must be a positive.*got -inf"),
        ({"norm_type": math.nan}, ValueError, r"norm_type must be a positive.*got nan"),
        ({"norm_type": "l2"}, ValueError, r"norm_type must be a positive.*got 'l2'"),
    ],
)
def test_rejects_bad_numbers(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    args: dict[str, object] = {"max_norm": 1.0, **kwargs}
    params = _plain_params()
    before = _grads(params)
    with pytest.raises(error, match=message):
        clip_grad_norm_(params, **args)  # type: ignore[call-overload]
    for g, b in zip(_grads(params), before, strict=True):
        torch.testing.assert_close(g, b)  # nothing was scaled


def test_rejects_what_is_not_params_and_per_optimizer_misuse() -> None:
    params = _plain_params()
    with pytest.raises(TypeError, match=r"parameters must hold tensors, but item 1 is a str"):
        clip_grad_norm_([params[0], "w"], 1.0)  # type: ignore[list-item]
    sgd = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(TypeError, match=r"per_optimizer=True needs a ChainedOptimizer.*got a SGD"):
        clip_grad_norm_(sgd, 1.0, per_optimizer=True)
    with pytest.raises(TypeError, match=r"per_optimizer=True needs a ChainedOptimizer.*got list"):
        clip_grad_norm_(params, 1.0, per_optimizer=True)
    with pytest.raises(ValueError, match=r"per_optimizer=True got no optimizers"):
        clip_grad_norm_({}, 1.0, per_optimizer=True)
    with pytest.raises(
        TypeError, match=r"parameters\['b'\] must hold tensors, but item 0 is a int"
    ):
        clip_grad_norm_({"a": params, "b": [3]}, 1.0, per_optimizer=True)  # type: ignore[arg-type]


def test_foreach_true_needs_foreach_kernels() -> None:
    p = nn.Parameter(torch.ones(3, device="meta"))
    p.grad = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match=r"foreach=True was passed.*meta tensors"):
        clip_grad_norm_([p], 1.0, foreach=True)


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_error_if_nonfinite(norm_type: float, bad: float) -> None:
    params = _plain_params()
    assert params[1].grad is not None
    params[1].grad[3] = bad
    before = _grads(params)
    with pytest.raises(RuntimeError, match=rf"gradient norm of order {norm_type} .* non-finite"):
        clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
    for g, b in zip(_grads(params), before, strict=True):
        torch.testing.assert_close(g, b, equal_nan=True)  # nothing was scaled
    # Otherwise it clips anyway, exactly like torch.
    theirs = _clone(params)
    norm = clip_grad_norm_(params, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(norm, expected, equal_nan=True)
    for mine, ref in zip(_grads(params), _grads(theirs), strict=True):
        torch.testing.assert_close(mine, ref, equal_nan=True)


def test_per_optimizer_error_names_the_optimizer() -> None:
    chained, _, adamw_params = _chained()
    assert adamw_params[0].grad is not None
    adamw_params[0].grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match=r"params of optimizer 'adamw' is non-finite \(nan\)"):
        clip_grad_norm_(chained, 1.0, error_if_nonfinite=True, per_optimizer=True)


# -- four processes on a 2x2 mesh ------------------------------------------------

Layout = tuple[DeviceMesh, list[Placement]] | None


def _mixed_params(mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[Tensor]]:
    """Params with grads in every layout beside plain ones, and the full grads behind them."""
    gen = torch.Generator().manual_seed(0)  # the same numbers on every rank
    layouts: list[tuple[Layout, tuple[int, ...]]] = [
        ((mesh, [Shard(0), Replicate()]), (8, 6)),  # dense, FSDP on dp
        ((mesh, [Shard(0), Shard(1)]), (8, 4)),  # sharded on both dims
        ((mesh["dp"], [Shard(0)]), (4, 3, 3)),  # experts on the dp sub-mesh
        ((mesh["tp"], [Shard(1)]), (6, 8)),  # TP column-parallel
        ((mesh["tp"], [Shard(0)]), (1, 5)),  # uneven: tp rank 1 holds nothing
        (None, (7,)),  # plain, the same on every rank
        (None, (2, 2)),
    ]
    params, fulls = [], []
    for layout, shape in layouts:
        value, grad = torch.randn(shape, generator=gen), 3 * torch.randn(shape, generator=gen)
        if layout is None:
            param = nn.Parameter(value)
            param.grad = grad.clone()
        else:
            param = nn.Parameter(distribute_tensor(value, *layout))
            param.grad = distribute_tensor(grad, *layout)
        params.append(param)
        fulls.append(grad)
    # A Partial grad of a replicated param: each tp rank holds one addend of the grad.
    addends = [torch.randn(5, 3, generator=gen) for _ in range(2)]
    param = nn.Parameter(
        distribute_tensor(torch.randn(5, 3, generator=gen), mesh, [Replicate()] * 2)
    )
    param.grad = DTensor.from_local(
        addends[mesh.get_local_rank("tp")].clone(), mesh, [Replicate(), Partial()]
    )
    params.append(param)
    fulls.append(addends[0] + addends[1])
    return params, fulls


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_grads(params: list[nn.Parameter]) -> list[Tensor | None]:
    return [None if p.grad is None else _full(p.grad) for p in params]


def _reference(
    fulls: Sequence[Tensor], max_norm: float, p: float
) -> tuple[Tensor, list[Tensor | None]]:
    """torch's clip_grad_norm_ on the full grads, on one process: the norm and clipped grads."""
    params = [nn.Parameter(torch.zeros_like(g)) for g in fulls]
    for param, g in zip(params, fulls, strict=True):
        param.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, p)
    return norm, [param.grad for param in params]


def _assert_matches(
    norm: Tensor, clipped: list[Tensor | None], ref: tuple[Tensor, list[Tensor | None]]
) -> None:
    ref_norm, ref_grads = ref
    assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item(), (norm, ref_norm)
    torch.testing.assert_close(clipped, ref_grads, rtol=1e-6, atol=1e-6)


@contextlib.contextmanager
def _counting_all_reduces() -> Iterator[list[object]]:
    """The ``group`` of every ``dist.all_reduce`` call made inside."""
    calls: list[object] = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _check_mixed_meshes(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    max_norm = 1.0

    # torch's own clip_grad_norm_ cannot take this input.
    params, _ = _mixed_params(mesh)
    with pytest.raises(RuntimeError, match=r"got mixed torch.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    dtensor_params = [p for p in params if isinstance(p, DTensor)]
    with pytest.raises(RuntimeError, match=r"must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(dtensor_params, max_norm)

    for p in (2.0, INF, 1.0):
        params, fulls = _mixed_params(mesh)
        ref = _reference(list(fulls), max_norm, p)
        with _counting_all_reduces() as calls:
            norm = clip_grad_norm_(params, max_norm, p)
        assert len(calls) == 2, calls  # one per distinct group (dp, tp), not per param
        assert ref[0] > max_norm  # it clips
        _assert_matches(norm, _full_grads(params), ref)
        assert isinstance(params[-1].grad, DTensor) and params[-1].grad.placements[1].is_partial()

    # Experts with no grad on the dp=1 ranks: those rows count as zero there.
    params, fulls = _mixed_params(mesh)
    rows = fulls[2].clone()
    rows[2:] = 0
    if mesh.get_local_rank("dp") == 1:
        params[2].grad = None
    expected = list(fulls)
    expected[2] = rows
    ref = _reference(expected, max_norm, 2.0)
    norm = clip_grad_norm_(params, max_norm)
    if mesh.get_local_rank("dp") == 1:
        assert params[2].grad is None  # left as it was
        # Stand in the zeros, so every rank can join full_tensor() below.
        params[2].grad = DTensor.from_local(torch.zeros(2, 3, 3), mesh["dp"], [Shard(0)])
    _assert_matches(norm, _full_grads(params), ref)

    # Per optimizer: each group's norm over its own meshes, from the same collectives.
    params, fulls = _mixed_params(mesh)
    split = {"dense": [0, 1, 5, 6, 7], "experts": [2, 3, 4]}
    with _counting_all_reduces() as calls:
        norms = clip_grad_norm_(
            {name: [params[i] for i in idx] for name, idx in split.items()},
            max_norm,
            per_optimizer=True,
        )
    assert len(calls) == 2, calls
    for name, idx in split.items():
        ref = _reference([fulls[i] for i in idx], max_norm, 2.0)
        _assert_matches(norms[name], [_full_grads(params)[i] for i in idx], ref)

    # A nan on one rank's shard reaches every rank (a backend's MAX may drop nan).
    for p in (2.0, INF):
        params, _ = _mixed_params(mesh)
        grad = params[1].grad
        assert isinstance(grad, DTensor)
        if rank == 3:
            with torch.no_grad():
                grad.to_local()[0, 0] = math.nan
        with pytest.raises(RuntimeError, match=r"non-finite \(nan\)"):
            clip_grad_norm_(params, max_norm, p, error_if_nonfinite=True)
        assert math.isnan(clip_grad_norm_(params, max_norm, p).item())

    _check_pipeline_stages(rank)


def _check_pipeline_stages(rank: int) -> None:
    """pp=2 x dp=2: each stage holds different params; the norm spans both stages."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    gen = torch.Generator().manual_seed(1)
    shapes = {0: [(6, 4), (3,)], 1: [(4, 5), (2, 2), (2,)]}
    fulls = {s: [4 * torch.randn(shape, generator=gen) for shape in shapes[s]] for s in (0, 1)}

    def stage_params() -> list[nn.Parameter]:
        params = []
        for index, grad in enumerate(fulls[stage]):
            if index == 0:  # FSDP-sharded over the stage's dp ranks
                zeros = torch.zeros_like(grad)
                param = nn.Parameter(distribute_tensor(zeros, mesh["dp"], [Shard(0)]))
                param.grad = distribute_tensor(grad, mesh["dp"], [Shard(0)])
            else:
                param = nn.Parameter(torch.zeros_like(grad))
                param.grad = grad.clone()
            params.append(param)
        return params

    for p in (2.0, INF):
        ref_norm, ref_grads = _reference(fulls[0] + fulls[1], 1.0, p)
        # Without pp_group each stage sees only its own params (a smaller 2-norm).
        alone = clip_grad_norm_(stage_params(), INF, p)
        assert alone < ref_norm if p == 2.0 else alone <= ref_norm
        params = stage_params()
        norm = clip_grad_norm_(params, 1.0, p, pp_group=mesh.get_group("pp"))
        mine = ref_grads[: len(fulls[0])] if stage == 0 else ref_grads[len(fulls[0]) :]
        _assert_matches(norm, _full_grads(params), (ref_norm, mine))


def test_mixed_meshes_and_pipeline_stages_match_one_process() -> None:
    run_distributed(_check_mixed_meshes, world_size=4)
