"""Built-in plugin: the ``fsdp`` and ``hsdp`` sharding backends (DTensor params, any layout).

``fsdp`` takes DTensor params of any layout made of ``Shard``, FSDP+TP's
strided shards and ``Replicate``, on a mesh that spans the world or on a 1-D
sub-mesh: FSDP, HSDP, tensor parallel, FSDP+TP, expert stacks split on the
expert dim. ``hsdp`` is the same backend limited to 2-D
``(replicate, shard)`` meshes, for ``shard_model``.

Who computes what, for each param a matrix optimizer hands over:

* **In place.** A rank that holds whole blocks of a param (row shards that
  hold whole heads, expert stacks split on the expert dim, any param split
  only along dims its transform treats independently) computes them where
  they are. Nothing moves.
* **Owner exchange.** Every other param gets one owner rank, chosen
  greedily by cost so the work is balanced over every rank of the mesh
  (replicas included). The owned params are taken in buckets, each giving
  every owner a share of its work: per bucket, one collective brings each
  distinct piece of a param to its owner (one holder sends each piece, the
  owner itself where it holds one); the owner assembles the whole tensors,
  runs the transform on all it owns in the bucket in one call, and a second
  collective returns to every rank its own piece of the result.
* **Teams.** Where one owner per param would leave ranks idle (fewer
  params than ranks, one far larger than the rest), each param goes to a
  team of consecutive ranks instead, if the optimizer offers its transform
  as a :class:`~hyper_parallel.core.distributed.TeamTransform`: each member
  receives a band of the param (its *region*) the same way an owner
  receives the whole, the team runs the transform together, and each
  member returns its band. An owner is the team of one whose region is the
  whole param. ``team_size="auto"`` (the default) sizes teams by the cost
  model.

**Transport:** both trips of a bucket travel by ``all_to_all_single`` (each
rank sends each owner what it needs) or ``all_gather_single`` (every rank
gets everything, padded, and keeps its part: more bytes, fewer costly
messages). ``transport="auto"`` (the default) picks per bucket by the cost
model of :mod:`hyper_parallel_builtins.fsdp_backend.cost` and the device's
profile; every rank predicts the same, so they agree without talking.

**Overlap** (the default): the collectives are asynchronous. The first
bucket is sent before the in-place blocks are made (``map_prepared_blocks``:
a matrix optimizer's momentum) and transformed, and the next
bucket travels while the current one computes, while the results of the
one before travel back. Without overlap (``FSDPBackend(overlap=False)`` or
``HYPER_PARALLEL_EXCHANGE_OVERLAP=0``) every exchange is waited for as soon
as it is started. Both run the same plan and call the transform on the same
tensors, so their results are bitwise equal.

The plan (every rank's layout, who owns and who sends what, the buckets)
depends only on the params' shapes and placements; it is made once, with
one collective, and reused every step.
"""

from __future__ import annotations

from hyper_parallel_builtins.fsdp_backend._backend import (
    FSDPBackend,
    HSDPBackend,
    hyper_parallel_register_sharding_backends,
)
from hyper_parallel_builtins.fsdp_backend._plan_types import ExchangePlan

__all__ = [
    "ExchangePlan",
    "FSDPBackend",
    "HSDPBackend",
    "hyper_parallel_register_sharding_backends",
]
