"""The user guide's distributed blocks, run under ``torchrun --nproc_per_node 2``.

The blocks are taken from the guide as written, with ``"cpu"`` for ``"npu"``
and the guide's ``...`` placeholder argument left out (it is not Python).
Writes ``ok <rank>`` lines to the file named by argv[1] when every check holds.
"""

import sys

import torch
import torch.distributed as dist
from test_guide import DISTRIBUTED_BLOCKS

from conftest import TinyLM, lm_loss
from hyper_parallel import clip_grad_norm_

out = sys.argv[1]
dp_size = 2
torch.manual_seed(0)
model = TinyLM(qkv_bias=False)
second = TinyLM(qkv_bias=False)
second.load_state_dict(model.state_dict())
# the groups are built before sharding, as a user would
muon_param_groups = [p for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
adamw_param_groups = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "proj" in n)]

namespace = dict(globals())
exec(DISTRIBUTED_BLOCKS[0], namespace)  # sharded optimizer
model, optimizer = namespace["model"], namespace["optimizer"]
assert type(model.layers[0].q_proj.weight).__name__ == "DTensor"
assert set(optimizer.optimizers) == {"muon", "adamw"}
muon_state_params = optimizer.optimizers["muon"].param_groups[0]["params"]
assert all(type(p).__name__ == "DTensor" for p in muon_state_params)

gen = torch.Generator().manual_seed(1)
batch = torch.randint(0, 32, (4, 9), generator=gen)
rank = dist.get_rank()
local = batch[rank * 2 : rank * 2 + 2]
lm_loss(model, local).backward()
unscaled = [p.grad.full_tensor().clone() for p in model.parameters()]
optimizer.zero_grad()

scaled_ns = {**namespace, "model": second}
exec(DISTRIBUTED_BLOCKS[1], scaled_ns)  # gradient scaling factor, on a fresh copy of the model
second = scaled_ns["model"]
lm_loss(second, local).backward()
for p, g in zip(second.parameters(), unscaled, strict=True):
    assert torch.equal(p.grad.full_tensor(), 0.5 * g)

# clip_grad: reduced over each grad's own process group; equals the one-process norm of these grads
expected = torch.linalg.vector_norm(
    torch.stack([torch.linalg.vector_norm(0.5 * g) for g in unscaled])
)
norm = clip_grad_norm_(second.parameters(), max_norm=1e9)
torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
lm_loss(model, local).backward()
optimizer.step()  # the sharded Muon + AdamW step
with open(out, "a") as f:
    f.write(f"ok {rank}\n")
