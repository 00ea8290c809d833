"""The optimizer and its schedulers under HF Trainer, accelerate and Lightning (docs/trainers.md).

Hugging Face ``Trainer`` (both ways it takes an optimizer), accelerate's own
loop and PyTorch Lightning each train a tiny Llama, save a checkpoint part
way, and resume from it: the resumed run ends with the uninterrupted run's
params and optimizer state bit for bit, having used its lrs step by step.
``torch.amp.GradScaler`` with fp16 autocast, and a ``torch.compile``'d
model, train with the optimizer unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel import (
    ChainedOptimizer,
    HyperLRScheduler,
    LRSchedulersContainer,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
)

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pl = pytest.importorskip("pytorch_lightning")

VOCAB = 64
#: Sequences of the synthetic data set, and the batch size: four steps an epoch.
SEQUENCES, BATCH = 32, 8
#: Steps of every run, and the step of the checkpoint a run resumes from.
STEPS, SAVE_AT = 6, 3
#: Optimizer settings of every run: Muon for the hidden matrices, AdamW for the rest.
OPTIMIZER = {"muon_lr": 0.02, "adamw_lr": 3e-3}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The models are tiny: a thread pool only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test's trainer sets up accelerate afresh (its state is shared by the process)."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_llama() -> nn.Module:
    """A two-layer Llama, hidden size 32, from a fixed seed."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def token_data() -> torch.Tensor:
    """The synthetic data set: random token sequences, the same in every run."""
    return torch.randint(0, VOCAB, (SEQUENCES, 16), generator=torch.Generator().manual_seed(0))


def hf_dataset() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": t, "labels": t} for t in token_data()]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return loss


def lrs_of(optimizer: Any) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Every tensor of ``got`` is bitwise the one of the same name in ``want``."""
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"differ after resuming: {different}"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state dict (momentum, moments, step counts), by its path."""
    found: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value.detach().clone()
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")

    walk(optimizer.state_dict(), "")
    assert found, "the optimizer holds no state"
    return found


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- Hugging Face Trainer -----------------------------------------------------------


class _RecordLrs(transformers.TrainerCallback):  # type: ignore[misc]
    """Every group's lr after each step (after the scheduler moved it), by global step."""

    def __init__(self) -> None:
        self.lrs: dict[int, list[float]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.lrs[state.global_step] = lrs_of(kwargs["optimizer"])


def hf_trainer(out: Path, route: str) -> tuple[Any, _RecordLrs]:
    """The recipe of docs/trainers.md for ``route``: our optimizer given built, or by factory."""
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        lr_scheduler_type="cosine",  # used by the factory route only
        warmup_steps=2,
    )
    record = _RecordLrs()
    if route == "optimizers":
        optimizer = get_hyper_optimizer(model, **OPTIMIZER)
        scheduler = get_hyper_lr_scheduler(optimizer, "cosine", total_steps=STEPS, warmup_steps=2)
        given: dict[str, Any] = {"optimizers": (optimizer, scheduler)}
    else:
        given = {"optimizer_cls_and_kwargs": (lambda: get_hyper_optimizer, dict(OPTIMIZER))}
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=hf_dataset(), callbacks=[record], **given
    )
    return trainer, record


@pytest.mark.parametrize("route", ["optimizers", "optimizer_cls_and_kwargs"])
def test_hf_trainer_resumes_bitwise(tmp_path: Path, route: str) -> None:
    full, full_lrs = hf_trainer(tmp_path / "full", route)
    full.train()
    chain = full.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(chain, ChainedOptimizer)
    assert "model.layers.0.self_attn.q_proj.weight" in chain.param_names_by_optimizer["muon"]
    assert "model.embed_tokens.weight" in chain.param_names_by_optimizer["adamw"]
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "scheduler.pt").is_file()

    resumed, resumed_lrs = hf_trainer(tmp_path / "resumed", route)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == STEPS
    assert sorted(resumed_lrs.lrs) == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed_lrs.lrs == {s: full_lrs.lrs[s] for s in resumed_lrs.lrs}
    assert len({tuple(lrs) for lrs in resumed_lrs.lrs.values()}) == STEPS - SAVE_AT  # moving
    assert resumed.lr_scheduler.get_last_lr() == full.lr_scheduler.get_last_lr()
    assert_same_tensors(params_of(resumed.model), params_of(full.model))
    assert_same_tensors(optimizer_tensors(resumed.optimizer.optimizer), optimizer_tensors(chain))
    from safetensors.torch import load_file

    at_checkpoint = load_file(checkpoint / "model.safetensors")
    assert all(not torch.equal(p, at_checkpoint[n]) for n, p in params_of(full.model).items())


def test_hf_trainer_route_gives_the_model_to_the_factory(tmp_path: Path) -> None:
    """``optimizer_cls_and_kwargs``: a non-Optimizer is called, then given the model."""
    trainer, _ = hf_trainer(tmp_path, "optimizer_cls_and_kwargs")
    trainer.create_optimizer()
    chain = trainer.optimizer
    assert isinstance(chain, ChainedOptimizer)
    assert chain.optimizers["muon"].param_groups[0]["lr"] == OPTIMIZER["muon_lr"]
    assert chain.optimizers["adamw"].param_groups[0]["lr"] == OPTIMIZER["adamw_lr"]
    built = get_hyper_optimizer(tiny_llama(), **OPTIMIZER)
    assert chain.param_names_by_optimizer == built.param_names_by_optimizer


# -- accelerate -----------------------------------------------------------------------


def accelerate_run(
    out: Path, scheduler_kind: str, *, save_at: int | None = None, resume_at: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[int, list[float]]]:
    """STEPS steps of accelerate's loop, saving at ``save_at`` or resuming at ``resume_at``."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    set_seed(0)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    model = tiny_llama()
    optimizer = get_hyper_optimizer(model, **OPTIMIZER)
    if scheduler_kind == "container":
        scheduler: Any = LRSchedulersContainer(
            optimizer,
            lambda optimizer: get_hyper_lr_scheduler(
                optimizer, "cosine", total_steps=STEPS, warmup_steps=2
            ),
        )
    else:
        scheduler = get_hyper_lr_scheduler(optimizer, "cosine", total_steps=STEPS, warmup_steps=2)
    loader = torch.utils.data.DataLoader(token_data(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = 0
    if resume_at is not None:
        accelerator.load_state(str(out))
        step = resume_at
    lrs: dict[int, list[float]] = {}
    while step < STEPS:
        epoch, done = divmod(step, len(loader))
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        for tokens in batches:
            accelerator.backward(lm_loss(model, tokens))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            lrs[step] = lrs_of(optimizer)
            if step == save_at:
                accelerator.save_state(str(out))
            if step == STEPS:
                break
    chain = optimizer.optimizer
    return params_of(accelerator.unwrap_model(model)), optimizer_tensors(chain), lrs


@pytest.mark.parametrize("scheduler_kind", ["get_hyper_lr_scheduler", "container"])
def test_accelerate_save_state_load_state_resumes_bitwise(
    tmp_path: Path, scheduler_kind: str
) -> None:
    params, state, lrs = accelerate_run(tmp_path, scheduler_kind, save_at=SAVE_AT)
    assert (tmp_path / "optimizer.bin").is_file() and (tmp_path / "scheduler.bin").is_file()
    resumed_params, resumed_state, resumed_lrs = accelerate_run(
        tmp_path, scheduler_kind, resume_at=SAVE_AT
    )
    assert sorted(resumed_lrs) == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed_lrs == {s: lrs[s] for s in resumed_lrs}
    assert len({tuple(v) for v in resumed_lrs.values()}) == STEPS - SAVE_AT
    assert_same_tensors(resumed_params, params)
    assert_same_tensors(resumed_state, state)


# -- PyTorch Lightning ----------------------------------------------------------------


class LitLlama(pl.LightningModule):  # type: ignore[misc]
    """The tiny Llama with our optimizer and scheduler from ``configure_optimizers``."""

    def __init__(self, scheduler_kind: str) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.scheduler_kind = scheduler_kind
        self.lrs: dict[int, list[float]] = {}

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.lrs[self.global_step + 1] = lrs_of(self.trainer.optimizers[0])  # the step's lr
        return lm_loss(self.model, tokens)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = get_hyper_optimizer(self.model, **OPTIMIZER)
        steps = self.trainer.max_steps
        if self.scheduler_kind == "container":
            scheduler: Any = LRSchedulersContainer(
                optimizer,
                lambda optimizer: get_hyper_lr_scheduler(
                    optimizer, "cosine", total_steps=steps, warmup_steps=2
                ),
            )
        else:
            scheduler = get_hyper_lr_scheduler(
                optimizer, "cosine", total_steps=steps, warmup_steps=2
            )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def lightning_fit(
    out: Path, scheduler_kind: str, ckpt_path: Path | None = None
) -> tuple[LitLlama, Any]:
    """Two epochs of four steps, a checkpoint after each epoch's last; resumed from ``ckpt_path``.

    Lightning restarts an epoch's data when it resumes from the middle of one (the
    loader is not resumable), so the checkpoints are taken every epoch's worth of steps.
    """
    pl.seed_everything(0, verbose=False)
    module = LitLlama(scheduler_kind)
    data = token_data()
    # A shuffle that follows the epoch (Lightning calls set_epoch), so a resumed run sees the
    # order the uninterrupted one saw.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    trainer = pl.Trainer(
        max_steps=2 * len(loader),
        accelerator="cpu",
        enable_checkpointing=True,
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=out, every_n_train_steps=len(loader), save_top_k=-1
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("scheduler_kind", ["get_hyper_lr_scheduler", "container"])
def test_lightning_resumes_from_its_ckpt_bitwise(tmp_path: Path, scheduler_kind: str) -> None:
    full, trainer = lightning_fit(tmp_path / "full", scheduler_kind)
    steps = trainer.max_steps
    (first_epoch,) = (tmp_path / "full").glob(f"epoch=0-step={steps // 2}.ckpt")
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(
        scheduler, LRSchedulersContainer if scheduler_kind == "container" else HyperLRScheduler
    )

    resumed, resumed_trainer = lightning_fit(tmp_path / "resumed", scheduler_kind, first_epoch)
    assert resumed_trainer.global_step == steps
    assert sorted(resumed.lrs) == list(range(steps // 2 + 1, steps + 1))
    assert resumed.lrs == {s: full.lrs[s] for s in resumed.lrs}
    assert len({tuple(v) for v in resumed.lrs.values()}) == steps // 2
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == (
        scheduler.get_last_lr()
    )
    assert_same_tensors(params_of(resumed), params_of(full))
    assert_same_tensors(
        optimizer_tensors(resumed_trainer.optimizers[0]), optimizer_tensors(trainer.optimizers[0])
    )


# -- GradScaler and torch.compile -------------------------------------------------


class TinyLM(nn.Module):
    """Embedding, two hidden matrices, a norm and a head: both optimizers have params."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.down(torch.relu(self.up(self.embed(tokens))))
        return self.head(self.norm(hidden))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()
    )


def test_grad_scaler_with_fp16_autocast_unscales_into_the_chain() -> None:
    """The unscaled gradients the chain steps with are the fp32 run's; so are its params."""
    torch.manual_seed(0)
    scaled_model = TinyLM()
    plain_model = copy.deepcopy(scaled_model)
    scaled, plain = get_hyper_optimizer(scaled_model), get_hyper_optimizer(plain_model)
    scaler = torch.amp.GradScaler("cpu")
    for tokens in token_data().split(BATCH)[:3]:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = scaled_model(tokens)
        assert logits.dtype == torch.float16
        scaler.scale(next_token_loss(logits, tokens)).backward()
        scaler.unscale_(scaled)
        scaled_norm = nn.utils.clip_grad_norm_(scaled_model.parameters(), 1.0)
        scaler.step(scaled)
        scaler.update()
        scaled.zero_grad()

        next_token_loss(plain_model(tokens), tokens).backward()
        plain_norm = nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain.step()
        plain.zero_grad()
        assert float(scaled_norm) == pytest.approx(float(plain_norm), rel=2e-2)
    assert scaler.get_scale() == 65536.0  # no step was skipped
    for name, param in plain_model.named_parameters():
        torch.testing.assert_close(
            scaled_model.get_parameter(name), param, rtol=0, atol=2e-3, msg=name
        )


def test_a_compiled_model_trains_as_the_eager_one() -> None:
    """``get_hyper_optimizer(torch.compile(model))`` routes and steps as for the model itself.

    The ``aot_eager`` backend traces what inductor would (dynamo, autograd) without
    building C++ kernels: the optimizer sees the same params either way.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_model = TinyLM()
    compiled_model = torch.compile(copy.deepcopy(eager_model), backend="aot_eager")
    eager, compiled = get_hyper_optimizer(eager_model), get_hyper_optimizer(compiled_model)
    assert {
        sub: [name.removeprefix("_orig_mod.") for name in names]
        for sub, names in compiled.param_names_by_optimizer.items()
    } == eager.param_names_by_optimizer
    for tokens in token_data().split(BATCH)[:3]:
        for model, optimizer in ((eager_model, eager), (compiled_model, compiled)):
            next_token_loss(model(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    for name, param in eager_model.named_parameters():
        torch.testing.assert_close(
            compiled_model.get_parameter(f"_orig_mod.{name}"), param, rtol=1e-5, atol=1e-6
        )
    torch._dynamo.reset()
