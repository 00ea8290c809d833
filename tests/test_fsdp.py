"""``init_device_mesh`` and ``fully_shard``: FSDP/HSDP grads against one process, the scaling factor.

Distributed checks run in one spawn per world size (each spawn costs seconds):
2 processes for FSDP and the guide's two distributed blocks, 4 for HSDP.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel
from conftest import Block, TinyLM, lm_loss
from hyper_parallel.core.distributed import _fsdp as fsdp_module
from hyper_parallel.core.distributed._fsdp import fully_shard, set_gradient_scaling_factor
from hyper_parallel.core.distributed._mesh import init_device_mesh

GUIDE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "optimizer-guide.md"

# The guide's two distributed blocks, verbatim; run with "cpu" for "npu".
SHARDED_OPTIMIZER_BLOCK = """from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.optimizer import get_hyper_optimizer

mesh = init_device_mesh("npu", (dp_size,), mesh_dim_names=("dp",))
model = fully_shard(model, mesh=mesh)

# after FSDP sharding, the optimizer state is sharded too
optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_param_groups,
    adamw_params=adamw_param_groups,
    ...
)
"""
SCALING_BLOCK = """from hyper_parallel import fully_shard, init_device_mesh

mesh = init_device_mesh("npu", (dp_size,), mesh_dim_names=("dp",))
model = fully_shard(model, mesh=mesh)

# set the gradient scaling factor
model.set_gradient_scaling_factor(scale_factor=0.5)

# clip_grad enhancement: align the clip_grad_norm_ reduction with each grad's
# process group, so clip_grad works under mixed parallelism
"""
# The sharded-optimizer block elides the keyword arguments with ``...`` (not valid
# Python after keywords); the guide's section 1 gives them.
_ELIDED = "    ...\n"
_SECTION_1_KWARGS = (
    '    muon_kwargs={"lr": 0.02, "momentum": 0.95},\n'
    '    adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},\n'
)

BATCH = 4  # sequences in the global batch, split evenly over the data-parallel ranks
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _runnable(block: str) -> str:
    return block.replace('"npu"', '"cpu"').replace(_ELIDED, _SECTION_1_KWARGS)


def _global_batch() -> torch.Tensor:
    return torch.randint(0, 32, (BATCH, 9), generator=torch.Generator().manual_seed(1))


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _reference_grads() -> dict[str, torch.Tensor]:
    """One process, the whole batch: what every data-parallel run must reproduce."""
    model = _model()
    lm_loss(model, _global_batch()).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _local_backward(model: nn.Module, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """Backward on this rank's slice of the global batch; returns the local grad shards."""
    model.zero_grad(set_to_none=True)
    per_rank = BATCH // dp_size
    lm_loss(model, _global_batch()[dp_rank * per_rank : (dp_rank + 1) * per_rank]).backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _assert_scaled(
    scaled: dict[str, torch.Tensor], unscaled: dict[str, torch.Tensor], f: float
) -> None:
    assert scaled.keys() == unscaled.keys()
    for name, grad in scaled.items():
        # Exact: the factor multiplies the very tensor FSDP would store.
        assert torch.equal(grad, unscaled[name] * f), (name, f)


def _check_scaling(model: Any, dp_rank: int, dp_size: int) -> None:
    """The scaling factor in all its spellings, against the unscaled grads of the same model."""
    unscaled = _local_backward(model, dp_rank, dp_size)
    model.set_gradient_scaling_factor(0.5)
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 0.5)
    model.set_gradient_scaling_factor(0.3)  # not a power of two: still exact
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 0.3)
    model.set_gradient_scaling_factor(scale_factor=2)
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 2.0)
    model.set_gradient_scaling_factor(torch.tensor([0.25]))
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 0.25)
    model.set_gradient_scaling_factor(None)
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 1.0)
    set_gradient_scaling_factor(model, scale_factor=0.5)  # the function form
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 0.5)
    model.set_gradient_scaling_factor()
    _assert_scaled(_local_backward(model, dp_rank, dp_size), unscaled, 1.0)


def _check_matches_reference(
    model: nn.Module, placements: tuple[Any, ...], dp_rank: int, dp_size: int
) -> None:
    reference = _reference_grads()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == placements, name
    _local_backward(model, dp_rank, dp_size)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-6, msg=name)


def _check_fsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _model()
    layers = list(model.layers)
    assert fully_shard(model, mesh=mesh) is model
    assert isinstance(model, FSDPModule) and isinstance(model, TinyLM)
    assert all(isinstance(layer, FSDPModule) for layer in layers)
    assert [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)] == [
        "FSDPTinyLM", "FSDPBlock", "FSDPBlock",
    ]  # fmt: skip
    _check_matches_reference(model, (Shard(0),), rank, world_size)
    _check_scaling(model, rank, world_size)

    with pytest.raises(ValueError, match="already sharded by FSDP"):
        fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="already sharded by FSDP"):
        fully_shard(nn.Sequential(layers[0]), mesh=mesh)

    # blocks by predicate, by list, and the default mesh over the world.
    by_name = fully_shard(_model(), mesh=mesh, blocks=lambda name, m: name == "layers.1")
    assert [isinstance(layer, FSDPModule) for layer in by_name.layers] == [False, True]
    listed = _model()
    fully_shard(listed, mesh=mesh, blocks=[listed.layers[0], listed.norm])
    assert [isinstance(m, FSDPModule) for m in (*listed.layers, listed.norm)] == [True, False, True]
    default = fully_shard(_model())
    param = next(default.parameters())
    assert isinstance(param, DTensor) and param.device_mesh.device_type == "cpu"
    assert param.device_mesh.size() == world_size and param.placements == (Shard(0),)
    with pytest.raises(ValueError, match="1-D mesh .* or a 2-D"):
        fully_shard(_model(), mesh=init_device_mesh("cpu", (world_size, 1, 1)))

    _check_guide_blocks(rank, world_size)


def _export_for_guide() -> None:
    # The lead re-exports these from ``hyper_parallel``; until then the guide's
    # ``from hyper_parallel import ...`` is served in this process only.
    for name, fn in (("fully_shard", fully_shard), ("init_device_mesh", init_device_mesh)):
        if not hasattr(hyper_parallel, name):
            setattr(hyper_parallel, name, fn)


class _ParamsOf:
    """The guide's param groups, read from the model when the optimizer lists them.

    FSDP2 replaces each parameter with a sharded ``nn.Parameter``, so groups must
    be taken from the model after ``fully_shard``; the guide's block names groups
    defined before it, and this stands in for building them after.
    """

    def __init__(self, model: nn.Module, *, muon: bool) -> None:
        self.model, self.muon = model, muon

    def __iter__(self) -> Iterator[nn.Parameter]:
        for name, param in self.model.named_parameters():
            if (any(k in name for k in PROJ) and param.ndim == 2) == self.muon:
                yield param


def _check_guide_blocks(rank: int, world_size: int) -> None:
    _export_for_guide()
    model = _model()
    ns: dict[str, Any] = {
        "model": model,
        "dp_size": world_size,
        "muon_param_groups": _ParamsOf(model, muon=True),
        "adamw_param_groups": _ParamsOf(model, muon=False),
    }
    exec(_runnable(SHARDED_OPTIMIZER_BLOCK), ns)
    optimizer = ns["optimizer"]
    assert ns["model"] is model and isinstance(model, FSDPModule)
    sharded = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(sharded) == len(list(model.parameters()))
    assert all(isinstance(p, DTensor) for p in sharded)

    ns = {"model": _model(), "dp_size": world_size}
    exec(_runnable(SCALING_BLOCK), ns)
    scaled = _local_backward(ns["model"], rank, world_size)
    ns["model"].set_gradient_scaling_factor(None)
    _assert_scaled(scaled, _local_backward(ns["model"], rank, world_size), 0.5)


def _check_hsdp(rank: int, world_size: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets for 2 nodes of 2 processes
    model = fully_shard(_model(), mesh="hsdp")  # HSDP's default: (nodes, processes per node)
    mesh = next(model.parameters()).device_mesh
    assert mesh.shape == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    assert all(isinstance(layer, FSDPModule) for layer in model.layers)
    # Every rank is its own data-parallel replica of the batch (2 x 2 = 4 ways).
    _check_matches_reference(model, (Replicate(), Shard(0)), rank, world_size)
    _check_scaling(model, rank, world_size)
    _check_accumulation_without_all_reduce(model, rank, world_size)


def _accumulate_two(model: Any, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    per_rank = BATCH // dp_size
    ids = _global_batch()[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    model.zero_grad(set_to_none=True)
    model.set_requires_all_reduce(False)  # HSDP: reduce-scatter only, keep the partial sum
    lm_loss(model, ids).backward()
    model.set_requires_all_reduce(True)
    lm_loss(model, ids.flip(0)).backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _check_accumulation_without_all_reduce(model: Any, dp_rank: int, dp_size: int) -> None:
    """The factor is applied once, to the accumulated all-reduced grad."""
    model.set_gradient_scaling_factor(None)
    unscaled = _accumulate_two(model, dp_rank, dp_size)
    model.set_gradient_scaling_factor(0.5)
    _assert_scaled(_accumulate_two(model, dp_rank, dp_size), unscaled, 0.5)
    model.set_gradient_scaling_factor(None)


def test_fsdp_on_two_processes_matches_one_process_and_scales_grads() -> None:
    run_distributed(_check_fsdp, world_size=2)


def test_hsdp_on_a_2x2_mesh_matches_one_process_and_scales_grads() -> None:
    run_distributed(_check_hsdp, world_size=4)


def test_guide_blocks_are_the_guides_own() -> None:
    if not GUIDE.exists():
        pytest.skip(
            "the HyperParallel optimizer user guide these blocks quote is not available next to this checkout"
        )
    text = GUIDE.read_text(encoding="utf-8")
    assert "```python\n" + SHARDED_OPTIMIZER_BLOCK + "```" in text
    assert "```python\n" + SCALING_BLOCK + "```" in text


# --- one process ---------------------------------------------------------------------------


def test_one_process_initializes_from_env_and_scales_exactly(torchrun_env: None) -> None:
    # One rank per shard group is where FSDP's own SUM-only divide factor divides twice.
    mesh = init_device_mesh("cpu", 1, mesh_dim_names=("dp",))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names == ("dp",)
    model = fully_shard(_model(), mesh=mesh)
    _check_matches_reference(model, (Shard(0),), 0, 1)
    _check_scaling(model, 0, 1)


@pytest.mark.usefixtures("no_process_group")
def test_init_device_mesh_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        RuntimeError, match=r"missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"
    ):
        init_device_mesh("cpu", 2)
    with pytest.raises(
        ValueError, match=r"Unknown device_type 'tpu'. Available: auto, npu, cuda, cpu"
    ):
        init_device_mesh("tpu", 2)
    with pytest.raises(ValueError, match=r"2 names but mesh_shape \(4,\) has 1 dims"):
        init_device_mesh("cpu", 4, mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="must be unique"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="positive ints"):
        init_device_mesh("cpu", (2, 0))
    with pytest.raises(TypeError, match="mesh_shape must be"):
        init_device_mesh("cpu", "2")  # type: ignore[arg-type]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ValueError, match=r"mesh_shape \(2, 2\) covers 4 ranks but the world size is 2"
    ):
        init_device_mesh("cpu", (2, 2))
    assert not dist.is_initialized()


def test_npu_without_torch_npu_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(ImportError, match=r'torch_npu.*pip install "hyper-parallel\[npu\]"'):
        init_device_mesh("npu", 1)
    # "auto" skips the missing NPU instead of failing.
    assert fsdp_module.init_device_mesh is init_device_mesh
    from hyper_parallel.core.distributed._mesh import resolve_device_type

    assert resolve_device_type("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": "model"}, TypeError, "expects an nn.Module"),
        ({"mesh": "cpu"}, ValueError, r"mesh='cpu': the one mesh named by a string is 'hsdp'"),
        ({"mesh": 3}, TypeError, r"mesh must be a torch DeviceMesh, 'hsdp' or None, got int"),
        ({"blocks": "layers"}, TypeError, "blocks must be None .* or a predicate"),
        ({"blocks": [1]}, TypeError, "blocks must hold nn.Module"),
        ({"blocks": [nn.Linear(2, 2)]}, ValueError, "is not a submodule"),
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward must be"),
        ({"mp_policy": "bf16"}, TypeError, "mp_policy must be a MixedPrecisionPolicy"),
        ({"offload_policy": "cpu"}, TypeError, "offload_policy must be an OffloadPolicy"),
    ],
)
def test_fully_shard_argument_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    kwargs = {"module": _model(), **kwargs}
    with pytest.raises(error, match=match):
        fully_shard(**kwargs)


@pytest.mark.usefixtures("no_process_group")
def test_fully_shard_without_a_process_group_says_how_to_launch() -> None:
    with pytest.raises(RuntimeError, match="torchrun"):
        fully_shard(_model())


def test_root_in_blocks_is_rejected() -> None:
    model = _model()
    with pytest.raises(ValueError, match="must not contain the root"):
        fully_shard(model, blocks=[model])


def test_block_discovery() -> None:
    find: Callable[[nn.Module], list[nn.Module]] = fsdp_module._find_blocks
    model = _model()
    assert find(model) == list(model.layers)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert find(mixed) == []  # not all the same class
    assert find(nn.Sequential(Block(4, 8, True))) == []  # one block is no repetition
    nested = nn.Sequential(
        nn.Sequential(mixed, nn.ReLU()), nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)])
    )
    assert find(nested) == list(nested[1])  # the first qualifying container, depth-first


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0.5,), {"scale_factor": 0.5}, TypeError, "not both"),
        ((float("nan"),), {}, ValueError, "finite and > 0"),
        ((math.inf,), {}, ValueError, "finite and > 0"),
        ((0,), {}, ValueError, "finite and > 0"),
        ((), {"scale_factor": -1.0}, ValueError, "finite and > 0"),
        ((torch.tensor([0.5, 0.5]),), {}, ValueError, "one element, got shape \\(2,\\)"),
        (("0.5",), {}, TypeError, "float, an int or a 1-element tensor"),
        ((True,), {}, TypeError, "float, an int or a 1-element tensor"),
    ],
)
def test_bad_scaling_factors(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = _model()
    model._hyper_parallel_gradient_scaling = (
        fsdp_module.GradientScaling()
    )  # as fully_shard leaves it
    with pytest.raises(error, match=match):
        set_gradient_scaling_factor(model, *args, **kwargs)
    assert model._hyper_parallel_gradient_scaling.factor is None


def test_scaling_a_model_not_sharded_by_fully_shard() -> None:
    with pytest.raises(ValueError, match="not sharded by hyper_parallel.fully_shard"):
        set_gradient_scaling_factor(_model(), 0.5)
