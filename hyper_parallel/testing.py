"""Helpers for testing hyper_parallel plugins, ours and third parties'.

Example, in a plugin distribution's own test suite::

    from hyper_parallel.testing import check_lr_schedule, check_optimizer

    def test_my_optimizer_conforms():
        check_optimizer("my_optimizer", lr=1e-2)

    def test_my_schedule_conforms():
        check_lr_schedule("my_schedule", total_steps=50, warmup_steps=5)

    def test_my_partitioner_and_backend_conform():
        check_partitioner("my_partitioner")
        check_sharding_backend("my_backend")

To try a plugin object without installing it, register it for one block::

    with plugin_registered(my_plugin_module):
        check_optimizer("my_optimizer")

To run a check on several CPU processes (gloo)::

    def _check(rank: int, world_size: int) -> None:
        ...  # every process; torch.distributed is initialized

    run_distributed(_check, world_size=2)
"""

from __future__ import annotations

import copy
import faulthandler
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn
from torch.optim import Optimizer

from hyper_parallel.core.plugin import PluginKind, get_registry
from hyper_parallel.core.plugin._registry import register_plugin, unregister_plugin

__all__ = [
    "check_lr_schedule",
    "check_optimizer",
    "check_partitioner",
    "check_sharding_backend",
    "free_port",
    "plugin_registered",
    "run_distributed",
]


@contextmanager
def plugin_registered(plugin: object, name: str | None = None) -> Iterator[str]:
    """Register ``plugin`` in-process for the duration of a ``with`` block.

    Yields the name it was registered under; it is unregistered on exit,
    even when the block raises.
    """
    registered = register_plugin(plugin, name)
    try:
        yield registered
    finally:
        unregister_plugin(registered)


class _ToyProblem:
    """A small deterministic least-squares problem on one matrix (or a sparse embedding)."""

    def __init__(self, *, sparse: bool, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.sparse = sparse
        if sparse:
            self.ids = torch.randint(0, 16, (32,), generator=gen)
            self.target = torch.randn(32, 4, generator=gen, dtype=dtype)
            self.weight = torch.nn.Parameter(torch.randn(16, 4, generator=gen, dtype=dtype))
        else:
            self.inputs = torch.randn(64, 6, generator=gen, dtype=dtype)
            true_weight = torch.randn(6, 4, generator=gen, dtype=dtype)
            self.target = self.inputs @ true_weight
            self.weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=dtype) * 0.5)

    def loss(self, weight: torch.Tensor) -> torch.Tensor:
        if self.sparse:
            rows = torch.nn.functional.embedding(self.ids, weight, sparse=True)
            return torch.nn.functional.mse_loss(rows, self.target)
        return torch.nn.functional.mse_loss(self.inputs @ weight, self.target)

    def closure(self, optimizer: Optimizer, weight: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            optimizer.zero_grad()
            loss = self.loss(weight)
            loss.backward()
            return float(loss.detach())

        return run


def _build(
    name_or_factory: str | Callable[..., Optimizer], params: list[Any], kwargs: dict[str, Any]
) -> Optimizer:
    factory = (
        get_registry().get(PluginKind.OPTIMIZER, name_or_factory).obj
        if isinstance(name_or_factory, str)
        else name_or_factory
    )
    optimizer = factory(params, **kwargs)
    if not isinstance(optimizer, Optimizer):
        raise AssertionError(
            f"{name_or_factory!r} built a {type(optimizer).__name__}, not a torch Optimizer"
        )
    return optimizer


def check_optimizer(
    name_or_factory: str | Callable[..., Optimizer],
    *,
    steps: int = 5,
    sparse: bool = False,
    **kwargs: Any,
) -> None:
    """Check that an optimizer builds, reduces a toy loss, and round-trips its state.

    Runs ``steps`` steps (with a closure, so closure-only optimizers such as
    LBFGS work) on a least-squares problem, asserts the loss fell, then
    checks that a fresh optimizer loading ``state_dict()`` makes exactly the
    same next step.

    Args:
        name_or_factory: A registered optimizer name, or the factory itself.
        steps: Steps before the round trip.
        sparse: Use a problem with sparse gradients (for ``sparseadam``).
        **kwargs: Passed to the optimizer.

    Raises:
        AssertionError: with what went wrong.
    """
    problem = _ToyProblem(sparse=sparse)
    weight = problem.weight
    optimizer = _build(name_or_factory, [{"params": [weight]}], dict(kwargs))
    with torch.no_grad():
        start = float(problem.loss(weight))
    for _ in range(steps):
        optimizer.step(problem.closure(optimizer, weight))
    with torch.no_grad():
        end = float(problem.loss(weight))
    if not math.isfinite(end) or end >= start:
        raise AssertionError(
            f"{name_or_factory!r}: loss did not fall in {steps} steps ({start:.6g} -> {end:.6g})"
        )

    twin = torch.nn.Parameter(weight.detach().clone())
    restored = _build(name_or_factory, [{"params": [twin]}], dict(kwargs))
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.step(problem.closure(optimizer, weight))
    restored.step(problem.closure(restored, twin))
    if not torch.equal(weight.detach(), twin.detach()):
        diff = (weight.detach() - twin.detach()).abs().max().item()
        raise AssertionError(
            f"{name_or_factory!r}: the step after a state_dict round trip differs (max abs diff {diff:.3g})"
        )


def check_lr_schedule(
    name: str, *, total_steps: int = 40, warmup_steps: int = 4, **options: Any
) -> None:
    """Check that a registered LR schedule drives every group from its own peak.

    Builds the schedule with :func:`~hyper_parallel.core.optimizer.get_hyper_lr_scheduler`
    over two param groups with different peak lrs, steps past ``total_steps``,
    and asserts: lrs are finite and non-negative; both groups follow the same
    factor; a fresh scheduler loading ``state_dict()`` mid-way continues
    with identical lrs.

    Raises:
        AssertionError: with what went wrong.
    """
    from hyper_parallel.core.optimizer import get_hyper_lr_scheduler

    peaks = (0.1, 0.003)

    def fresh() -> Optimizer:
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in peaks]
        return torch.optim.SGD(
            [{"params": [p], "lr": lr} for p, lr in zip(params, peaks, strict=True)]
        )

    def lrs(opt: Optimizer) -> list[float]:
        return [float(g["lr"]) for g in opt.param_groups]

    optimizer = fresh()
    scheduler = get_hyper_lr_scheduler(
        optimizer, name, total_steps=total_steps, warmup_steps=warmup_steps, **options
    )
    half = total_steps // 2
    history: list[list[float]] = []
    saved: dict[str, Any] | None = None
    for step in range(total_steps + 3):
        current = lrs(optimizer)
        history.append(current)
        if not all(math.isfinite(x) and x >= 0 for x in current):
            raise AssertionError(
                f"schedule {name!r}: lr {current} at step {step} is negative or not finite"
            )
        factors = [x / p for x, p in zip(current, peaks, strict=True)]
        if not math.isclose(factors[0], factors[1], rel_tol=1e-9, abs_tol=1e-12):
            raise AssertionError(
                f"schedule {name!r}: groups moved differently at step {step}: {factors}"
            )
        if step == half:
            saved = copy.deepcopy(scheduler.state_dict())
        optimizer.step()
        scheduler.step()
    assert saved is not None

    other = fresh()
    resumed = get_hyper_lr_scheduler(
        other, name, total_steps=total_steps, warmup_steps=warmup_steps, **options
    )
    resumed.load_state_dict(saved)
    for step in range(half + 1, total_steps + 3):
        other.step()
        resumed.step()
        if lrs(other) != history[step]:
            raise AssertionError(
                f"schedule {name!r}: after a state_dict round trip the lr at step {step} is "
                f"{lrs(other)}, expected {history[step]}"
            )


def _toy_decoder() -> torch.nn.Module:
    """The library's decoder, tiny: embeddings, projections (q/k/v with biases), norms, a head."""
    from hyper_parallel.train.model import GPTConfig, TinyGPT

    config = GPTConfig(
        vocab_size=16, seq_len=8, dim=8, layers=1, heads=2, mlp_hidden=12, qkv_bias=True
    )
    return TinyGPT(config)


def check_partitioner(
    name: str, model: torch.nn.Module | None = None, **options: Any
) -> dict[str, list[Any]]:
    """Check that a registered partitioner assigns every trainable param once, and trains.

    Args:
        name: The partitioner's registered name.
        model: The model to split (default: a small decoder with
            embeddings, projections, norms, biases and a head, which the check
            then also trains for a few steps).
        **options: The partitioner's options.

    Returns:
        The partitioner's assignment (optimizer name -> params or groups).

    Raises:
        AssertionError: the result is not a dict of registered optimizer
            names, a trainable param is assigned twice or not at all, or a
            step through ``get_hyper_optimizer`` does not lower the loss.
    """
    from hyper_parallel.core.optimizer import get_hyper_optimizer

    own_model = model is None
    model = model if model is not None else _toy_decoder()
    registry = get_registry()
    assignment = registry.get(PluginKind.PARTITIONER, name).obj(model, **options)
    if not isinstance(assignment, dict):
        raise AssertionError(
            f"partitioner {name!r} returned {type(assignment).__name__}, not a dict"
        )
    seen: dict[int, str] = {}
    for opt_name, items in assignment.items():
        registry.get(PluginKind.OPTIMIZER, opt_name)  # a registered optimizer
        for item in items:
            params = item["params"] if isinstance(item, dict) else [item]
            for p in params:
                if id(p) in seen:
                    raise AssertionError(
                        f"partitioner {name!r} gives a param of shape {tuple(p.shape)} to both "
                        f"{seen[id(p)]!r} and {opt_name!r}"
                    )
                seen[id(p)] = opt_name
    missed = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missed:
        raise AssertionError(f"partitioner {name!r} leaves out trainable params: {missed}")
    if own_model:
        optimizer = get_hyper_optimizer(model, partitioner=name, partitioner_kwargs=options or None)
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(5):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        if not losses[-1] < losses[0]:
            raise AssertionError(f"partitioner {name!r}: the loss did not fall: {losses}")
    return assignment


def _sharded_like_fsdp_or_hsdp(backend: Any, fulls: list[torch.Tensor]) -> list[torch.Tensor]:
    """``fulls`` as row shards over the world (FSDP), else on a ``(1, world)`` mesh (HSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    for shape, placements in (((world,), [Shard(0)]), ((1, world), [Replicate(), Shard(0)])):
        mesh = init_device_mesh("cpu", shape)
        tensors: list[torch.Tensor] = [distribute_tensor(f, mesh, placements) for f in fulls]
        if backend.accepts(tensors):
            return tensors
    raise AssertionError(
        f"sharding backend {backend.name!r} accepts neither plain tensors nor FSDP/HSDP row shards"
    )


def check_sharding_backend(name: str) -> None:
    """Check that a registered sharding backend maps blocks and reductions like one process.

    The backend is tried on what it accepts: plain tensors, or row-sharded
    DTensors on a 1-D or ``(1, world)`` mesh (a one-process gloo group is set up
    for the check when none is running). Whole matrices and row blocks must
    reach the transform whole, and results must come back laid out like
    the inputs.

    Raises:
        AssertionError: a result differs from the transform applied to the
            whole tensors, or comes back in another layout.
    """
    import torch.distributed as dist

    from hyper_parallel.core.distributed import RowBlocks, WholeMatrices

    backend = get_registry().get(PluginKind.SHARDING_BACKEND, name).obj()
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(4, 3, generator=gen), torch.randn(6, 5, generator=gen)]
    needs = [WholeMatrices(), RowBlocks((2, 4))]
    expected_blocks = [
        fulls[0] / fulls[0].norm(),
        torch.cat([b / b.norm() for b in fulls[1].split([2, 4])]),
    ]
    expected_rows = [f / f.norm(dim=1, keepdim=True) for f in fulls]

    def normalize(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        return [b / b.norm() for b in blocks]

    def unit_rows(local: list[torch.Tensor], reducer: Any) -> list[torch.Tensor]:
        norms = reducer.row_sums([x.square() for x in local])
        return [x / n.sqrt()[:, None] for x, n in zip(local, norms, strict=True)]

    own_group = False
    if not backend.accepts(fulls) and not dist.is_initialized():
        rendezvous = Path(tempfile.mkdtemp()) / "rendezvous"
        dist.init_process_group("gloo", init_method=rendezvous.as_uri(), rank=0, world_size=1)
        own_group = True
    try:
        tensors: list[torch.Tensor] = list(fulls)
        if not backend.accepts(fulls):
            tensors = _sharded_like_fsdp_or_hsdp(backend, fulls)
        for label, results, expected in (
            ("map_blocks", backend.map_blocks(normalize, tensors, needs), expected_blocks),
            ("map_reductions", backend.map_reductions(unit_rows, tensors), expected_rows),
        ):
            for t, r, e in zip(tensors, results, expected, strict=True):
                if type(r) is not type(t) or r.shape != t.shape:
                    raise AssertionError(
                        f"{name!r}.{label} changed the layout of a {tuple(t.shape)} tensor"
                    )
                whole = r.full_tensor() if hasattr(r, "full_tensor") else r
                if not torch.allclose(whole, e, atol=1e-6):
                    raise AssertionError(f"{name!r}.{label} differs from the whole-tensor result")
    finally:
        if own_group:
            dist.destroy_process_group()


# -- several processes ----------------------------------------------------------------

# How long rank 0 waits for the other ranks to finish before it exits anyway.
_EXIT_WAIT_S = 60.0
#: How long a rank waits in one collective before it fails (gloo's default is 30 minutes):
#: ranks that disagree on their collectives fail the test instead of hanging it.
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    # A crash in native code (an abort, a segfault) writes no traceback; this file gets
    # the Python stack of every thread at that moment instead. It stays open for the
    # process's whole life, so no context manager.
    fault_log = Path(errors, f"rank{rank}.fault").open("w")  # noqa: SIM115
    faulthandler.enable(file=fault_log, all_threads=True)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT
        )
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean finish. Rank 0 hosts the TCP store every rank's process group was built
    # on, so it leaves last. Then each rank ends without interpreter finalization: gloo's
    # native threads can abort a process there (SIGABRT, "terminate called without an
    # active exception") after its test has passed, which would fail the test with no
    # Python traceback to show for it.
    Path(errors, f"rank{rank}.done").touch()
    if rank == 0:
        deadline = time.monotonic() + _EXIT_WAIT_S
        while (
            time.monotonic() < deadline and len(list(Path(errors).glob("rank*.done"))) < world_size
        ):
            time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], *, world_size: int, args: tuple[Any, ...] = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes (gloo) and wait.

    Each process has torch's environment variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ...), one thread, and an initialized process group,
    which is torn down after ``fn``. ``fn`` must be importable (defined at
    module level). A process that finishes cleanly ends without interpreter
    finalization, where gloo's native threads can abort a finished process.

    Raises:
        AssertionError: a rank failed; the message holds every failing
            rank's traceback (or, for a crash in native code, the Python
            stack of its threads).
    """
    with tempfile.TemporaryDirectory() as errors:
        try:
            spawn(  # type: ignore[no-untyped-call]
                _worker,
                args=(world_size, free_port(), fn, args, errors),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:
            reports = [p for p in sorted(Path(errors).glob("rank*.*")) if p.read_text().strip()]
            detail = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in reports)
            detail = f"{exc}\n{detail}" if detail else str(exc)
            raise AssertionError(f"distributed run failed:\n{detail}") from None
