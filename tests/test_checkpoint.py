"""Checkpoints: bitwise resume on one process, bf16, atomic saves, FSDP resharding."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

from conftest import TinyLM, lm_loss
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import CheckpointError, CheckpointManager, _load, _saving
from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 9), generator=gen)


def _build(dtype: torch.dtype = torch.float32, **model_kwargs: Any) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = TinyLM(**model_kwargs).to(dtype)
    opt = get_hyper_optimizer(model, partitioner="by_shape", muon_lr=0.02, adamw_lr=3e-3)
    sched = get_hyper_lr_scheduler(opt, "cosine", total_steps=10, warmup_steps=2)
    return model, opt, sched


def _train(model: Any, opt: Any, sched: Any, batch: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _assert_same(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> None:
    (ma, oa, _), (mb, ob, _) = a, b
    for (name, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert list(oa.optimizers) == list(ob.optimizers)
    for name in oa.optimizers:
        sa, sb = oa.optimizers[name], ob.optimizers[name]
        for ga, gb in zip(sa.param_groups, sb.param_groups, strict=True):
            assert ga["lr"] == gb["lr"] and ga["initial_lr"] == gb["initial_lr"], name
            for pa, pb in zip(ga["params"], gb["params"], strict=True):
                st_a, st_b = sa.state[pa], sb.state[pb]
                assert st_a.keys() == st_b.keys()
                for key in st_a:
                    va, vb = st_a[key], st_b[key]
                    if isinstance(va, torch.Tensor):
                        assert va.dtype == vb.dtype and torch.equal(va, vb), (name, key)
                    else:
                        assert va == vb, (name, key)


def test_resume_is_bitwise_equal(tmp_path: Path) -> None:
    batch = _batch()
    straight = _build()
    _train(*straight, batch, 10)

    first = _build()
    _train(*first, batch, 5)
    manager = CheckpointManager(tmp_path)
    manager.save(5, model=first[0], optimizer=first[1], scheduler=first[2], extra={"tok": 123})

    resumed = _build()
    assert not resumed[1].optimizers["muon"].state  # fresh, never stepped
    step = manager.load_latest(model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    assert step == 5
    _assert_same(first, resumed)
    assert checkpoint.verify(manager.path_for(5)).extra == {"tok": 123}
    _train(*resumed, batch, 5)
    _assert_same(straight, resumed)


def test_bf16_state_comes_back_bf16(tmp_path: Path) -> None:
    batch = _batch()
    first = _build(torch.bfloat16)
    _train(*first, batch, 2)
    checkpoint.save(tmp_path / "c", model=first[0], optimizer=first[1], step=2)
    resumed = _build(torch.bfloat16)
    assert checkpoint.load(tmp_path / "c", model=resumed[0], optimizer=resumed[1]) == 2
    for p in resumed[0].parameters():
        assert p.dtype == torch.bfloat16
    muon = resumed[1].optimizers["muon"]
    bufs = [t for s in muon.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert any(t.dtype == torch.bfloat16 and t.ndim == 2 for t in bufs)
    _assert_same(first, resumed)
    _train(resumed[0], resumed[1], None, batch, 1)
    _train(first[0], first[1], None, batch, 1)
    _assert_same(first, resumed)


def test_crash_mid_save_keeps_previous_and_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _batch()
    model, opt, sched = _build()
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _train(model, opt, sched, batch, 1)
        manager.save(step, model=model, optimizer=opt, scheduler=sched)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]

    def crash(tmp: Path, target: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(_saving, "_replace", crash)
    _train(model, opt, sched, batch, 1)
    with pytest.raises(CheckpointError) as failed:
        manager.save(4, model=model, optimizer=opt, scheduler=sched)
    monkeypatch.undo()
    assert str(failed.value) == (
        f"The save of {manager.path_for(4)} failed: OSError: disk gone. The previous "
        "checkpoint is intact."
    )
    assert not (tmp_path / ".tmp-step_00000004").exists()  # a failed save cleans up after itself
    (tmp_path / ".tmp-step_00000004").mkdir()  # what a killed one leaves
    assert manager.latest() == manager.path_for(3)
    fresh = _build()
    assert manager.load_latest(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]) == 3
    # a stale pointer (crash between rename and pointer) falls back to the newest step dir
    (tmp_path / "latest").write_text("step_00000099\n")
    assert manager.latest() == manager.path_for(3)
    # the next save cleans the crashed temp dir
    manager.save(4, model=model, optimizer=opt, scheduler=sched)
    assert not (tmp_path / ".tmp-step_00000004").exists()
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_clear_errors(tmp_path: Path) -> None:
    model, opt, _ = _build()
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "nope", model=model, optimizer=opt)
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match="not a hyper_parallel checkpoint"):
        checkpoint.load(tmp_path / "junk", model=model, optimizer=opt)
    assert checkpoint.load_latest(tmp_path / "empty", model=model, optimizer=opt) is None
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, step=0)
    torch.manual_seed(0)
    other = TinyLM()
    adamw_only = get_hyper_optimizer(other, optimizers={"adamw": {"params": other.parameters()}})
    with pytest.raises(CheckpointError, match="holds optimizers"):
        checkpoint.load(tmp_path / "c", model=other, optimizer=adamw_only)
    with pytest.raises(CheckpointError, match="JSON"):
        checkpoint.save(tmp_path / "d", model=model, optimizer=opt, step=0, extra={"x": object()})


def test_load_in_a_new_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    batch = _batch()
    first = _build()
    _train(*first, batch, 3)
    checkpoint.save(tmp_path / "c", model=first[0], optimizer=first[1], scheduler=first[2], step=3)
    _train(*first, batch, 2)
    torch.save({n: p.detach() for n, p in first[0].named_parameters()}, tmp_path / "want.pt")
    tests = Path(__file__).parent
    code = f"""
import sys; sys.path.insert(0, {str(tests)!r})
import torch
from test_checkpoint import _build, _train, _batch
from hyper_parallel import checkpoint
m, o, s = _build()
assert checkpoint.load({str(tmp_path / "c")!r}, model=m, optimizer=o, scheduler=s) == 3
_train(m, o, s, _batch(), 2)
want = torch.load({str(tmp_path / "want.pt")!r}, weights_only=True)
for n, p in m.named_parameters():
    assert torch.equal(p, want[n]), n
print("ok")
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# -- FSDP ---------------------------------------------------------------------------


def _fsdp_build(mesh: Any) -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import fully_shard

    model, _, _ = _build(qkv_bias=False)
    model = copy.deepcopy(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = get_hyper_optimizer(model, partitioner="by_shape", muon_lr=0.02, adamw_lr=3e-3)
    sched = get_hyper_lr_scheduler(opt, "cosine", total_steps=10, warmup_steps=2)
    return model, opt, sched


def _fsdp_save_and_resume(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    per = 4 // world_size
    batch = _batch()[rank * per : (rank + 1) * per]
    run = _fsdp_build(mesh)
    _train(*run, batch, 3)
    manager = CheckpointManager(root)
    manager.save(3, model=run[0], optimizer=run[1], scheduler=run[2])
    _train(*run, batch, 3)
    resumed = _fsdp_build(mesh)
    assert manager.load_latest(model=resumed[0], optimizer=resumed[1], scheduler=resumed[2]) == 3
    _train(*resumed, batch, 3)
    want = {n: p.full_tensor() for n, p in run[0].named_parameters()}
    for n, p in resumed[0].named_parameters():
        torch.testing.assert_close(p.full_tensor(), want[n], rtol=1e-6, atol=1e-6, msg=n)
    if rank == 0:
        torch.save(want, Path(root) / "want.pt")


def test_fsdp_two_ranks_resume_and_reshard_to_one_and_four(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_distributed(_fsdp_save_and_resume, world_size=2, args=(str(root),))
    # one process, no process group, plain model: DCP reshards the FSDP checkpoint
    model, opt, sched = _build(qkv_bias=False)
    assert CheckpointManager(root).load_latest(model=model, optimizer=opt, scheduler=sched) == 3
    _train(model, opt, sched, _batch(), 3)
    want = torch.load(root / "want.pt", weights_only=True)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-6, atol=1e-6, msg=n)
    # four ranks: DCP reshards the two-rank FSDP checkpoint again
    run_distributed(_fsdp_load_at_four, world_size=4, args=(str(root),))


def _fsdp_load_at_four(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    batch = _batch()[rank : rank + 1]
    resumed = _fsdp_build(mesh)
    assert (
        CheckpointManager(root).load_latest(
            model=resumed[0], optimizer=resumed[1], scheduler=resumed[2]
        )
        == 3
    )
    _train(*resumed, batch, 3)
    want = torch.load(Path(root) / "want.pt", weights_only=True)
    for n, p in resumed[0].named_parameters():
        torch.testing.assert_close(p.full_tensor(), want[n], rtol=1e-6, atol=1e-6, msg=n)


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """DCP's ``.metadata`` is a pickle: only its own record classes may come out of it."""
    import pickle

    model, opt, sched = _build()
    path = checkpoint.save(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched, step=0)
    (path / ".metadata").write_bytes(pickle.dumps(os.system))
    _reseal(path)  # whoever plants it can also fix the checksums: they guard against accidents
    with pytest.raises(CheckpointError, match=r"Refusing to load posix\.system"):
        checkpoint.load(path, model=model, optimizer=opt, scheduler=sched)


def _reseal(path: Path) -> None:
    """Record the checkpoint's files as they are now, as a deliberate edit would."""
    from hyper_parallel.checkpoint._integrity import MANIFEST, digest_file, write_manifest

    meta = json.loads((path / MANIFEST).read_text())
    files = {name: digest_file(path / name) for name in meta.pop("files")}
    write_manifest(path, {k: v for k, v in meta.items() if not k.endswith("xxh3_64")}, files)


def _ranks_agree_on_checkpoints(rank: int, world_size: int, root: str) -> None:
    # a directory local to each rank (as on a node's own disk): every rank stops, naming it
    local = Path(root) / f"local{rank}"
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(local)
    assert str(info.value).startswith(
        f"Checkpoint directory {local}: rank 0 does not see the files rank(s) 1 wrote there."
    )
    assert "must be one directory on storage all ranks share" in str(info.value)
    assert not list(local.iterdir())  # nothing written, the markers gone
    # a shared one: rank 0 chooses what to load, even when another rank's listing is stale
    shared = Path(root) / "shared"
    model, opt, sched = _build()
    manager = CheckpointManager(shared)
    for step in (1, 2):
        _train(model, opt, sched, _batch(), 1)
        manager.save(step, model=model, optimizer=opt, scheduler=sched)
    if rank == 1:
        stale = _load.candidates
        _load.candidates = lambda r: list(reversed(stale(r)))  # type: ignore[assignment]
    fresh = _build()
    assert manager.load_latest(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]) == 2
    assert not list(shared.glob(".shared-check-*"))


def test_ranks_prove_they_share_the_directory_and_load_one_choice(tmp_path: Path) -> None:
    run_distributed(_ranks_agree_on_checkpoints, world_size=2, args=(str(tmp_path),))


def test_one_writer_per_folder_and_a_reader_may_look_on(tmp_path: Path) -> None:
    model, opt, sched = _build()
    writer = CheckpointManager(tmp_path)
    writer.save(1, model=model, optimizer=opt, scheduler=sched)
    reader = CheckpointManager(tmp_path, lock=False)  # loads while the writer lives
    assert reader.load_latest(model=model, optimizer=opt, scheduler=sched) == 1
    with pytest.raises(CheckpointError, match="made with lock=False, to load only"):
        reader.save(2, model=model, optimizer=opt, scheduler=sched)
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on host ")
    writer.close()
    assert not (tmp_path / ".lock").exists()  # given back, and its file with it
