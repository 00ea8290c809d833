"""Device meshes: pick the device, bring up the process group, build torch's ``DeviceMesh``.

``init_device_mesh`` is torch's function of the same name plus the two things a
training script otherwise writes by hand: choosing the communication backend
for the device (HCCL for Ascend NPUs, NCCL for CUDA, gloo for CPU) and
initializing the default process group from torchrun's environment.
"""

from __future__ import annotations

import atexit
import importlib
import math
import os
import time
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from hyper_parallel.core.compat import PrefixStore, Store, TCPStore
from hyper_parallel.core.errors import (
    HyperParallelImportError,
    HyperParallelRuntimeError,
    HyperParallelTypeError,
    HyperParallelValueError,
)

__all__ = [
    "BACKEND_FOR_DEVICE",
    "hsdp_mesh",
    "hsdp_mesh_shape",
    "init_device_mesh",
    "ranks_per_node",
    "resolve_device_type",
]

#: The collective backend each supported device type communicates with.
BACKEND_FOR_DEVICE: dict[str, str] = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}

_DEVICE_TYPES = ("auto", *BACKEND_FOR_DEVICE)
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_NPU_INSTALL_HINT = 'pip install "hyper-parallel[npu]"'


def _import_torch_npu() -> None:
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise HyperParallelImportError(
            "device_type 'npu' needs the Ascend adapter torch_npu, which is not importable "
            f"({exc}). Install it with `{_NPU_INSTALL_HINT}` (and the CANN toolkit), "
            "or use device_type 'cuda', 'cpu' or 'auto'."
        ) from exc


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_device_type(device_type: str) -> str:
    """Turn a requested device type into a concrete one and check it can be used.

    Args:
        device_type: ``"npu"``, ``"cuda"``, ``"cpu"``, or ``"auto"`` (the first
            present of npu, cuda, cpu).

    Returns:
        ``"npu"``, ``"cuda"`` or ``"cpu"``.

    Raises:
        ValueError: ``device_type`` is not one of the names above.
        ImportError: ``"npu"`` was asked for and ``torch_npu`` is not installed.
        RuntimeError: ``"cuda"`` was asked for and no CUDA device is present.
    """
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise HyperParallelValueError(
            f"Unknown device_type {device_type!r}. Available: {', '.join(_DEVICE_TYPES)}."
        )
    device_type = device_type.lower()
    if device_type == "auto":
        if _npu_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "npu":
        _import_torch_npu()
    elif device_type == "cuda" and not torch.cuda.is_available():
        raise HyperParallelRuntimeError(
            "device_type 'cuda' was asked for but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Use 'cpu' or 'auto'."
        )
    return device_type


def _normalize_shape(mesh_shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (mesh_shape,) if isinstance(mesh_shape, int) else mesh_shape
    if isinstance(dims, str) or not isinstance(dims, Sequence) or len(dims) == 0:
        raise HyperParallelTypeError(
            f"mesh_shape must be a positive int or a non-empty tuple of them, got {mesh_shape!r}."
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise HyperParallelValueError(
            f"mesh_shape entries must be positive ints, got {mesh_shape!r}."
        )
    return tuple(dims)


def _normalize_names(
    mesh_dim_names: Sequence[str] | None, shape: tuple[int, ...]
) -> tuple[str, ...] | None:
    if mesh_dim_names is None:
        return None
    if isinstance(mesh_dim_names, str):
        mesh_dim_names = (mesh_dim_names,)
    names = tuple(mesh_dim_names)
    if not all(isinstance(n, str) and n for n in names):
        raise HyperParallelTypeError(
            f"mesh_dim_names must be non-empty strings, got {mesh_dim_names!r}."
        )
    if len(names) != len(shape):
        raise HyperParallelValueError(
            f"mesh_dim_names {names} has {len(names)} names but mesh_shape {shape} has "
            f"{len(shape)} dims; give one name per dim."
        )
    if len(set(names)) != len(names):
        raise HyperParallelValueError(f"mesh_dim_names must be unique, got {names}.")
    return names


def _init_process_group_from_env(device_type: str) -> None:
    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise HyperParallelRuntimeError(
            "torch.distributed is not initialized and the launcher environment is missing "
            f"{', '.join(missing)}. Launch with `torchrun --nproc_per_node N script.py`, or "
            "call torch.distributed.init_process_group() before init_device_mesh()."
        )
    if device_type != "cpu":
        # NCCL/HCCL communicators bind to the current device: select it before init.
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        getattr(torch, device_type).set_device(local_rank)
    store = _attempt_scoped_agent_store()
    if store is None:
        dist.init_process_group(backend=BACKEND_FOR_DEVICE[device_type])
    else:
        dist.init_process_group(
            backend=BACKEND_FOR_DEVICE[device_type],
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    # The group is ours, so is its teardown: left to interpreter shutdown, gloo's worker
    # threads can be destroyed while still joinable, and the process aborts after its work.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _attempt_scoped_agent_store() -> Store | None:
    """torchrun's shared store, with keys scoped to this attempt of the job; ``None`` where unshared.

    torchrun's agents host one TCPStore for the whole job and hand it to every
    restart of the workers (``TORCHELASTIC_USE_AGENT_STORE=True``). The
    process group's rendezvous keys from a failed attempt are still in it, so
    after ``--max-restarts`` brings the workers back, gloo would read the dead
    ranks' addresses. Every attempt therefore gets a namespace of its own,
    named by a token its ranks agree on (:func:`agree_on_attempt_token`).
    The agents' restart counts cannot name it: an agent whose workers were
    healthy restarts them without counting, so across nodes they differ.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=dist.default_pg_timeout,
    )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    token = agree_on_attempt_token(agent_store, rank, world_size)
    return PrefixStore(f"{_HANDSHAKE}/{token}", agent_store)


#: Key prefix of the attempt handshake in torchrun's shared store.
_HANDSHAKE = "hyper_parallel/attempt"


def agree_on_attempt_token(
    store: TCPStore, rank: int, world_size: int, *, poll_seconds: float = 0.005
) -> str:
    """A token new to this attempt, the same on every rank, agreed through a store earlier attempts used.

    Rank 0 draws it. Every other rank asks for it under a nonce it has just
    drawn and waits for the answer under a key named by that nonce: no
    earlier attempt can have written that key, so no rank reads a dead
    rank's answer. Rank 0 answers every question in the store (stale ones
    too, harmlessly) until every rank has confirmed under the new token.
    Each step is a key no earlier attempt wrote, so the handshake holds
    whatever state a killed attempt left behind.
    """
    asks, ready = f"{_HANDSHAKE}/asks", f"{_HANDSHAKE}/ready/"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.append(asks, f"{nonce},")  # type: ignore[attr-defined]  # missing from torch's stubs
        token = store.get(f"{_HANDSHAKE}/answer/{nonce}").decode()
        store.add(ready + token, 1)
        return token
    token = uuid.uuid4().hex
    read = 0  # characters of the asks already answered
    while store.add(ready + token, 0) < world_size - 1:
        pending = store.get(asks).decode()[read:] if store.check([asks]) else ""
        for nonce in filter(None, pending.split(",")):
            store.set(f"{_HANDSHAKE}/answer/{nonce}", token)
        read += len(pending)
        time.sleep(poll_seconds)
    return token


def init_device_mesh(
    device_type: str,
    mesh_shape: int | Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Build a ``DeviceMesh``, initializing the default process group if needed.

    Example (under ``torchrun --nproc_per_node 4``)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    Args:
        device_type: ``"npu"`` (imports ``torch_npu``, HCCL), ``"cuda"`` (NCCL),
            ``"cpu"`` (gloo) or ``"auto"`` (the first present of npu, cuda, cpu).
        mesh_shape: Ranks per mesh dim, an int for a 1-D mesh or a tuple. Its
            product must equal the world size.
        mesh_dim_names: One unique name per mesh dim, e.g. ``("dp",)``.

    Returns:
        torch's ``DeviceMesh`` over all ranks.

    Raises:
        ValueError: unknown device type, a shape whose size is not the world
            size, or names that do not match the shape.
        TypeError: ``mesh_shape`` or ``mesh_dim_names`` of the wrong type.
        ImportError: ``"npu"`` without ``torch_npu`` (the message gives the
            install command).
        RuntimeError: the process group is not initialized and torchrun's
            environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``) is missing, or ``"cuda"`` without a CUDA device.
    """
    device = resolve_device_type(device_type)
    shape = _normalize_shape(mesh_shape)
    names = _normalize_names(mesh_dim_names, shape)

    initialized = dist.is_available() and dist.is_initialized()
    env_world = os.environ.get("WORLD_SIZE")
    world_size = dist.get_world_size() if initialized else int(env_world) if env_world else None
    # Checked before initializing so a wrong shape fails without touching the network.
    if world_size is not None and math.prod(shape) != world_size:
        raise HyperParallelValueError(
            f"mesh_shape {shape} covers {math.prod(shape)} ranks but the world size is "
            f"{world_size}; the product of mesh_shape must equal the world size."
        )
    if not initialized:
        _init_process_group_from_env(device)
    return _torch_init_device_mesh(device, shape, mesh_dim_names=names)


def hsdp_mesh_shape() -> tuple[int, int]:
    """HSDP's default ``(replicate, shard)`` shape: ``(nodes, processes per node)``.

    Read from torchrun's environment (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``),
    or from the initialized process group on one node: parameters are
    sharded within a node, over its fast links, and replicated across nodes.

    Raises:
        RuntimeError: neither torchrun's environment nor a process group.
        ValueError: a world size that is not a whole number of nodes.
    """
    initialized = dist.is_available() and dist.is_initialized()
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None and not initialized:
        raise HyperParallelRuntimeError(
            "hsdp_mesh needs torchrun's environment (WORLD_SIZE, LOCAL_WORLD_SIZE) or an "
            "initialized process group; launch with `torchrun --nnodes N --nproc_per_node P`."
        )
    world = dist.get_world_size() if initialized else int(env_world or 1)
    per_node = ranks_per_node(world)
    if per_node < 1 or world % per_node:
        raise HyperParallelValueError(
            f"the world size {world} is not a whole number of nodes of LOCAL_WORLD_SIZE="
            f"{per_node} processes; launch the same --nproc_per_node on every node, or pass "
            "a mesh of your own."
        )
    return world // per_node, per_node


def ranks_per_node(world: int) -> int:
    """The processes on each node: torchrun's ``LOCAL_WORLD_SIZE``, else all ``world`` (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world)


def hsdp_mesh(device_type: str = "auto") -> DeviceMesh:
    """The default HSDP mesh: ``(nodes, processes per node)``, named ``("replicate", "shard")``.

    Example (under ``torchrun --nnodes 2 --nproc_per_node 4``: a 2 x 4 mesh)::

        model = fully_shard(model, mesh=hsdp_mesh())

    ``fully_shard(model, mesh="hsdp")`` and ``hyper-parallel train --sharding
    hsdp`` use it. The shape comes from :func:`hsdp_mesh_shape`.
    """
    return init_device_mesh(device_type, hsdp_mesh_shape(), mesh_dim_names=("replicate", "shard"))
