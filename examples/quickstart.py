"""Quickstart: Muon for the projections, AdamW for the rest, one warmup + cosine schedule.

The user guide's flow, end to end, in a few seconds on a CPU:

1. a tiny decoder-only language model (the one ``hyper-parallel train``
   trains) named like Llama/Qwen layers (``q_proj`` ... ``down_proj``,
   RMSNorm, token embedding, ``lm_head``; q/k/v carry a bias as in Qwen);
2. the guide's name-based split: the projection matrices go to Muon,
   everything else (embedding, norms, biases, ``lm_head``) to AdamW;
3. ``get_hyper_optimizer``, which builds both and chains them into one
   ``ChainedOptimizer``, and ``get_hyper_lr_scheduler`` with a cosine
   schedule that drives each param group from its own peak lr (down to a
   thousandth of it, HyperParallel's default floor);
4. a training loop on a synthetic next-token task (every token has one fixed
   successor, so the loss can fall from ``ln(vocab)`` towards 0), printing the
   loss and each sub-optimizer's lr;
5. a checkpoint halfway through (model, optimizer and scheduler
   ``state_dict``s, plus the data order), loaded into fresh objects that
   replay the second half: they end with exactly the same weights.

Run it::

    python examples/quickstart.py            # 200 steps
    python examples/quickstart.py --steps 30 # shorter
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from hyper_parallel.core.optimizer import (
    ChainedOptimizer,
    HyperLRScheduler,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
)
from hyper_parallel.train import GPTConfig, TinyGPT

# The guide's rule: the large projections use Muon.
MUON_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- the model ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of :class:`TinyDecoder`."""

    vocab_size: int = 64
    dim: int = 64
    hidden_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4


class TinyDecoder(TinyGPT):
    """The decoder ``hyper-parallel train`` trains, at :class:`ModelConfig`'s sizes.

    Per block: ``input_layernorm`` (RMSNorm), ``q_proj/k_proj/v_proj`` (with a
    bias, as in Qwen) and ``o_proj`` around causal attention,
    ``post_attention_layernorm``, then ``gate_proj/up_proj/down_proj`` (SwiGLU).
    Around the blocks: ``embed_tokens``, a final ``norm`` and an untied
    ``lm_head``; no position table, and torch's default init.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(
            GPTConfig(
                vocab_size=config.vocab_size,
                dim=config.dim,
                mlp_hidden=config.hidden_dim,
                layers=config.num_layers,
                heads=config.num_heads,
                qkv_bias=True,
                positions="none",
                init_std=None,
            )
        )


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting ``ids[:, 1:]`` from ``ids[:, :-1]``."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# -- the data ----------------------------------------------------------------


class SuccessorTask:
    """Sequences in which every token is followed by its fixed, randomly chosen successor.

    Deterministic: the successor table and every batch come from ``seed``.
    """

    def __init__(self, vocab_size: int, *, seq_len: int = 32, batch_size: int = 16, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab_size, generator=self.generator)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size

    def batch(self) -> torch.Tensor:
        tokens = [torch.randint(0, self.vocab_size, (self.batch_size,), generator=self.generator)]
        for _ in range(self.seq_len - 1):
            tokens.append(self.successor[tokens[-1]])
        return torch.stack(tokens, dim=1)


# -- optimizer and schedule ------------------------------------------------------


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The guide's split: projection matrices for Muon, everything else for AdamW.

    Muon orthogonalizes matrices, so the q/k/v *biases* (whose names also
    contain ``q_proj`` ...) go to AdamW here. Left in Muon's list, the library
    would move them to AdamW itself and warn, naming each one.
    """
    muon_params: list[nn.Parameter] = []
    adamw_params: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and any(key in name for key in MUON_KEYS):
            muon_params.append(param)
        else:
            adamw_params.append(param)
    return muon_params, adamw_params


def build_training(
    config: ModelConfig, *, total_steps: int, warmup_steps: int
) -> tuple[TinyDecoder, ChainedOptimizer, HyperLRScheduler]:
    """A freshly initialized model with its chained optimizer and LR scheduler."""
    torch.manual_seed(0)
    model = TinyDecoder(config)
    muon_params, adamw_params = split_params(model)
    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=muon_params,
        adamw_params=adamw_params,
        muon_kwargs={"lr": 0.02, "momentum": 0.95},
        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
    )
    scheduler = get_hyper_lr_scheduler(
        optimizer=optimizer,
        scheduler_type="cosine",
        total_steps=total_steps,
        warmup_steps=warmup_steps,
    )
    return model, optimizer, scheduler


def train_step(
    model: nn.Module, optimizer: ChainedOptimizer, scheduler: HyperLRScheduler, ids: torch.Tensor
) -> float:
    """One step of the guide's loop; returns the loss before the update."""
    loss = next_token_loss(model, ids)
    loss.backward()
    optimizer.step()  # steps AdamW, then Muon
    optimizer.zero_grad()
    scheduler.step()
    return float(loss.detach())


def lrs(optimizer: ChainedOptimizer) -> str:
    """Each sub-optimizer's current lr (of its first param group), e.g. ``muon 2.00e-02``."""
    return "  ".join(
        f"{name} {opt.param_groups[0]['lr']:.2e}" for name, opt in optimizer.optimizers.items()
    )


# -- main ----------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=_positive_int, default=200, help="training steps")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warmup steps (default: a tenth of --steps)",
    )
    parser.add_argument(
        "--log-every", type=_positive_int, default=20, help="print every N steps (and the last)"
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="CPU threads for torch (default 1: a model this small is fastest on one)",
    )
    return parser.parse_args(argv)


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: ChainedOptimizer,
    scheduler: HyperLRScheduler,
    task: SuccessorTask,
    step: int,
) -> None:
    """Everything a resumed run needs; each state_dict holds only tensors and plain values."""
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),  # keyed by sub-optimizer: "muon", "adamw"
            "scheduler": scheduler.state_dict(),
            "data": task.generator.get_state(),
        },
        path,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    total_steps: int = args.steps
    warmup_steps: int = total_steps // 10 if args.warmup_steps is None else args.warmup_steps
    checkpoint_step = total_steps // 2
    config = ModelConfig()
    task = SuccessorTask(config.vocab_size)
    model, optimizer, scheduler = build_training(
        config, total_steps=total_steps, warmup_steps=warmup_steps
    )
    sizes = ", ".join(
        f"{name} ({sum(len(g['params']) for g in opt.param_groups)} tensors)"
        for name, opt in optimizer.optimizers.items()
    )
    print(f"optimizers: {sizes}; schedule: cosine, {total_steps} steps, {warmup_steps} warmup")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        first_loss = last_loss = math.nan
        for step in range(total_steps):
            if step == checkpoint_step:
                save_checkpoint(path, model, optimizer, scheduler, task, step)
            loss = train_step(model, optimizer, scheduler, task.batch())
            if step == 0:
                first_loss = loss
            last_loss = loss
            if step % args.log_every == 0 or step == total_steps - 1:
                # The lr shown is the one the *next* step will use.
                print(f"step {step:4d}  loss {loss:.4f}  lr {lrs(optimizer)}")
        print(
            f"loss {first_loss:.4f} -> {last_loss:.4f} "
            f"(a model that knows nothing: ln(vocab) = {math.log(config.vocab_size):.4f})"
        )
        checkpoint = torch.load(path, weights_only=True)

    # Resume in fresh objects from the checkpoint and replay the rest of the run.
    resumed_model, resumed_optimizer, resumed_scheduler = build_training(
        config, total_steps=total_steps, warmup_steps=warmup_steps
    )
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed_scheduler.load_state_dict(checkpoint["scheduler"])
    resumed_task = SuccessorTask(config.vocab_size)
    resumed_task.generator.set_state(checkpoint["data"])
    for _ in range(checkpoint["step"], total_steps):
        train_step(resumed_model, resumed_optimizer, resumed_scheduler, resumed_task.batch())
    identical = all(
        torch.equal(a, b)
        for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True)
    )
    print(
        f"resumed from the step-{checkpoint['step']} checkpoint and replayed to step "
        f"{total_steps}: identical weights = {identical}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
