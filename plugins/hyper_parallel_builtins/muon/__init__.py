"""Built-in plugin: ``muon``, HyperParallel's Muon (momentum orthogonalized by Newton-Schulz).

Its defaults, update rule and option names are HyperParallel's, and
``torch.optim.Muon``'s keywords keep torch's meaning (:mod:`._options` says
how a group's convention is decided). Beyond both: N-D params (conv
kernels, MoE expert stacks), a Newton-Schulz dtype chosen by device, the
Gram iteration, head-wise and fused-row blocks, and sharded params of any
layout through the sharding backends.

Modules: :mod:`._options` (conventions, defaults, checks, NS dtype),
:mod:`._matrices` (how params become matrices), :mod:`._extensions` (names,
head-wise selection, HyperParallel's callables), :mod:`._update` (momentum
and the block transform), :mod:`._optimizer` (the optimizer).
"""

from hyper_parallel_builtins.muon._extensions import MuonPostUpdateContext, NSInputTransform
from hyper_parallel_builtins.muon._matrices import matrix_shape
from hyper_parallel_builtins.muon._optimizer import Muon, hyper_parallel_register_optimizers
from hyper_parallel_builtins.muon._options import default_ns_dtype
from hyper_parallel_builtins.muon._team import MuonTeam

__all__ = [
    "Muon",
    "MuonPostUpdateContext",
    "MuonTeam",
    "NSInputTransform",
    "default_ns_dtype",
    "hyper_parallel_register_optimizers",
    "matrix_shape",
]
