"""Non-finite state under FSDP2 on 2 ranks: NaN in one rank's shard stops every rank's save,
and ``load_latest`` passes over a checkpoint holding it, loading the one before exactly."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

from hyper_parallel.checkpoint import CheckpointManager, NonFiniteStateError, _save
from hyper_parallel.core.optimizer._nonfinite import non_finite_state
from hyper_parallel_builtins.muon._options import NS_DTYPE_ENV

#: The Muon momentum buffer that goes NaN, in rank 1's local shard only.
_BAD_PARAM = "layers.1.o_proj.weight"


def _full_state(built: tuple[Any, Any, Any]) -> dict[str, torch.Tensor]:
    """Params and optimizer state as whole tensors (collective: ``full_tensor`` gathers)."""
    model, opt, _ = built
    names = {id(p): n for n, p in model.named_parameters()}
    full = {f"param {n}": p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    for opt_name, sub in opt.optimizers.items():
        for param in (p for group in sub.param_groups for p in group["params"]):
            for key, value in sorted(sub.state[param].items()):
                if isinstance(value, torch.Tensor):
                    whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                    full[f"{opt_name} {names[id(param)]}.{key}"] = whole.detach().clone()
    return full


def _local_state(built: tuple[Any, Any, Any]) -> dict[str, torch.Tensor]:
    """This rank's shards of the params and optimizer state (no collective)."""
    model, opt, _ = built
    names = {id(p): n for n, p in model.named_parameters()}

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    shards = {f"param {n}": local(p) for n, p in model.named_parameters()}
    for opt_name, sub in opt.optimizers.items():
        for param, state in sub.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    shards[f"{opt_name} {names[id(param)]}.{key}"] = local(value)
    return shards


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"keys differ: {sorted(set(got) ^ set(want))}"]
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def _nan_on_rank_1(rank: int, world_size: int, root: str) -> None:
    from test_checkpoint import _batch, _fsdp_build, _train
    from torch.distributed.device_mesh import init_device_mesh

    assert os.environ[NS_DTYPE_ENV] == "float32"  # pinned below, before the spawn
    mesh = init_device_mesh("cpu", (world_size,))
    ckpts = Path(root) / "ckpts"
    result: dict[str, Any] = {"rank": rank}

    # 1. a step, then a healthy checkpoint at step 1
    built = _fsdp_build(mesh)
    _train(*built, _batch()[2 * rank : 2 * rank + 2], 1)
    manager = CheckpointManager(ckpts, keep_last=3)
    manager.save(1, model=built[0], optimizer=built[1], scheduler=built[2])
    full_at_1, local_at_1 = _full_state(built), _local_state(built)
    result["finite_before"] = non_finite_state(built[0], built[1])

    # 2. NaN in rank 1's shard of one Muon momentum buffer: every rank refuses the save
    model, opt, _ = built
    muon = opt.optimizers["muon"]
    param = dict(model.named_parameters())[_BAD_PARAM]
    shard = muon.state[param]["momentum_buffer"].to_local()
    assert shard.numel() > 0
    if rank == 1:
        shard.view(-1)[3] = float("nan")
    result["non_finite_state"] = non_finite_state(model, opt)
    try:
        manager.save(2, model=model, optimizer=opt, scheduler=built[2])
    except NonFiniteStateError as exc:
        result["save_refused"] = str(exc)
    else:
        result["save_refused"] = None
    torch.distributed.barrier()  # every rank has finished (or refused) before anyone looks
    result["after_refused_save"] = sorted(p.name for p in ckpts.iterdir())
    torch.distributed.barrier()  # and every rank has looked before rank 0 saves again

    # 3. a step-2 checkpoint holding the NaN, written past the check as an older version
    # would: load_latest passes over it, on every rank, and loads step 1 exactly
    real_refuse = _save._refuse_non_finite
    _save._refuse_non_finite = lambda *_: None  # type: ignore[assignment]
    try:
        manager.save(2, model=model, optimizer=opt, scheduler=built[2])
    finally:
        _save._refuse_non_finite = real_refuse  # type: ignore[assignment]
    result["after_unchecked_save"] = sorted(p.name for p in ckpts.iterdir())
    fresh = _fsdp_build(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["loaded_step"] = manager.load_latest(
            model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]
        )
    result["skipped"] = [str(w.message) for w in caught if "Skipping" in str(w.message)]
    result["local_differences"] = _differences(_local_state(fresh), local_at_1)
    result["full_differences"] = _differences(_full_state(fresh), full_at_1)
    result["scheduler_epoch"] = fresh[2].last_epoch
    result["compared"] = len(full_at_1)
    Path(root, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def test_nan_in_one_ranks_shard_refuses_every_ranks_save_and_is_passed_over_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NS_DTYPE_ENV, "float32")  # the spawned ranks inherit it
    run_distributed(_nan_on_rank_1, world_size=2, args=(str(tmp_path),))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    bad_name = f"muon state {_BAD_PARAM}.momentum_buffer"
    for r in (r0, r1):
        assert r["finite_before"] == [], r
        # every rank names the tensor, though only rank 1's shard holds the NaN
        assert r["non_finite_state"] == [bad_name], r
        refused = r["save_refused"]
        assert refused is not None, f"rank {r['rank']} saved NaN state"
        assert f"{_BAD_PARAM}.momentum_buffer holds NaN or Inf" in refused, refused
        assert "previous checkpoint is intact" in refused, refused
        # nothing of the refused save is left: no step 2, no staging directory
        assert "step_00000002" not in r["after_refused_save"], r["after_refused_save"]
        assert not [n for n in r["after_refused_save"] if n.startswith(".tmp-")], r
        assert "step_00000001" in r["after_refused_save"], r
        assert "step_00000002" in r["after_unchecked_save"], r
        # load_latest passes over the NaN checkpoint and loads step 1, bit for bit
        assert r["loaded_step"] == 1, r
        assert len(r["skipped"]) == 1 and r["skipped"][0].startswith("Skipping step_00000002"), r
        assert "NaN or Inf" in r["skipped"][0] and _BAD_PARAM in r["skipped"][0], r["skipped"]
        assert r["local_differences"] == [] and r["full_differences"] == [], r
        assert r["compared"] > 0 and r["scheduler_epoch"] == 1, r
    assert r0["save_refused"] == r1["save_refused"]
    assert r0["skipped"] == r1["skipped"]
