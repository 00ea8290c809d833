"""Atomic, verified, reshardable checkpoints of a model, a ChainedOptimizer and its scheduler.

Built on :mod:`torch.distributed.checkpoint` (DCP): the model and every
sub-optimizer go through ``get_model_state_dict`` / ``get_optimizer_state_dict``
and back through ``set_model_state_dict`` / ``set_optimizer_state_dict``, so one
checkpoint loads on one process (no process group), on FSDP/HSDP, and at
another world size (DCP reshards).

Layout of ``root`` as written by :class:`CheckpointManager`::

    root/
        step_00000010/          # one checkpoint
            .metadata, *.distcp # DCP: tensors only (model, optimizer state, fp32 main params)
            hyper_parallel.json # manifest: step, extra, scheduler, group hyperparams,
                                # and the size and checksum of every other file
        latest                  # name of the newest complete checkpoint (for people:
                                # loads take the newest step_* directory)

**Saving is atomic.** Everything is written into ``root/.tmp-<name>``; every
file is fsync'd and checksummed, the manifest is written, and only then does
rank 0 rename the directory into place and replace ``latest``. A crash at any
point leaves the previous checkpoint and pointer intact. With
``async_save=True`` the state is copied to CPU memory and the rest happens
behind training (at most one save in flight; :func:`wait` joins it).

**Nothing wrong is kept.** A save refuses state holding NaN or Inf
(:class:`NonFiniteStateError`, naming the tensor; nothing is written).
Before any value reaches the model, optimizer or scheduler, a load checks
every file against the manifest (the ranks share the work and agree), then
reads the tensors into a staging copy and checks their shapes, that each
reads back, and that none holds NaN or Inf; only then is anything copied in.
A flipped bit, a truncated copy, a missing file or a tensor that cannot be
read is a :class:`CorruptCheckpointError` naming the checkpoint, the file
and the tensor, and the objects passed in are left exactly as they were.
:func:`load_latest` then falls back to the newest good checkpoint, with a
warning.

**Ranks agree.** Under a process group, every rank first proves that it sees
the same directory as the others (a disk local to each node is a
:class:`CheckpointError` naming it, on every rank), and ``load_latest``
loads the checkpoint rank 0 chose, on every rank.

Examples:
    >>> manager = CheckpointManager("ckpt", keep_last=3)
    >>> manager.save(step, model=model, optimizer=optimizer, scheduler=scheduler)
    >>> start = manager.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
"""

from __future__ import annotations

from hyper_parallel.checkpoint._errors import (
    CheckpointError,
    CorruptCheckpointError,
    NonFiniteStateError,
)
from hyper_parallel.checkpoint._load import load, load_latest
from hyper_parallel.checkpoint._lock import break_lock
from hyper_parallel.checkpoint._manager import CheckpointManager
from hyper_parallel.checkpoint._preemption import Preemption
from hyper_parallel.checkpoint._save import save, wait
from hyper_parallel.checkpoint._verify import Verified, verify

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "NonFiniteStateError",
    "Preemption",
    "Verified",
    "break_lock",
    "load",
    "load_latest",
    "save",
    "verify",
    "wait",
]
