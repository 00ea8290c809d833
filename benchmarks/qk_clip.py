"""QK-clip's cost: a tracked model's forward pass against the untracked one's, and the clip's step.

Run from the repository root::

    python -m benchmarks --cases qk_clip           # seq 128 and 512
    python -m benchmarks --cases qk_clip --quick   # seq 128, fewer repeats

Two models, each as two copies with the same weights, one of them tracked
with :func:`hyper_parallel.qk_clip.track`, fed the same batch, on one thread
(see :func:`case_qk_clip`):

- the built-in model (:class:`~hyper_parallel.train.model.TinyGPT` at
  ``hyper-parallel train``'s default size: d=128, 4 blocks, 4 heads, SDPA,
  32 sequences);
- a Hugging Face ``LlamaForCausalLM`` built from a config (d=256, 4 layers,
  8 query heads sharing 2 key heads, 8 sequences), with ``sdpa`` and with
  ``eager`` attention.

Rows:

- the forward pass in training mode (autograd on, the graph dropped), tracked
  against untracked, at each sequence length: the median of interleaved
  repetitions;
- ``optimizer.step()`` of ``get_hyper_optimizer``'s Muon + AdamW with
  ``qk_clip_threshold`` against without, on each model (the same gradients;
  before each clipped step every layer reports maxima that put half its
  heads over the threshold, so the clip scales rows at every step).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common import Row, Settings, case_command, interleaved_medians

__all__ = ["DEFAULT", "QUICK", "Sizes", "case_qk_clip", "qk_clip_rows"]

#: The threshold of the clipped step (any value: the maxima reported are set against it).
THRESHOLD = 100.0


@dataclass(frozen=True)
class Sizes:
    """The models, batches and sequence lengths the case measures."""

    #: The built-in model's shape and batch, as ``hyper-parallel train`` options
    #: (dim, layers, heads, batch_size; its seq_len is set to the longest of ``seq_lens``).
    train: Mapping[str, Any]
    #: ``transformers.LlamaConfig`` keyword arguments of the Hugging Face model.
    llama: Mapping[str, Any]
    llama_batch: int
    seq_lens: tuple[int, ...]


#: ``hyper-parallel train``'s default model and batch; a small Llama with grouped-query attention.
DEFAULT = Sizes(
    train={},
    llama={"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2},
    llama_batch=8,
    seq_lens=(128, 512),
)  # fmt: skip
QUICK = dataclasses.replace(DEFAULT, seq_lens=(128,))


def _gpt(sizes: Sizes, device: str) -> tuple[nn.Module, str, int]:
    """The model ``hyper-parallel train`` builds at ``sizes.train``; its description and batch."""
    from hyper_parallel.train.config import TrainConfig
    from hyper_parallel.train.data import SYNTHETIC_ALPHABET
    from hyper_parallel.train.model import TinyGPT

    config = TrainConfig(**{**sizes.train, "seq_len": max(sizes.seq_lens)})
    torch.manual_seed(0)
    model = TinyGPT(config.model(len(SYNTHETIC_ALPHABET))).to(device)
    what = f"TinyGPT (d={config.dim}, {config.layers} blocks, {config.heads} heads, sdpa)"
    return model, what, config.batch_size


def _llama(sizes: Sizes, attention: str, device: str) -> tuple[nn.Module, str]:
    """A Hugging Face ``LlamaForCausalLM`` of ``sizes.llama`` with ``attention``; its description."""
    import transformers

    shape: dict[str, Any] = {**sizes.llama, "max_position_embeddings": max(sizes.seq_lens),
                             "attn_implementation": attention}  # fmt: skip
    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    model = nn.Module.to(transformers.LlamaForCausalLM(config), device)
    what = (f"LlamaForCausalLM (d={shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
            f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} kv, "
            f"{attention})")  # fmt: skip
    return model, what


def _threads() -> str:
    """``"1 thread"``, ``"2 threads"``: torch's threads now, for a row's note."""
    threads = torch.get_num_threads()
    return f"{threads} thread{'s' if threads > 1 else ''}"


def _twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``model`` (untracked) and a copy with the same weights, tracked; both in training mode."""
    from hyper_parallel.qk_clip import track

    tracked = copy.deepcopy(model)
    track(tracked)
    return model.train(), tracked.train()


def _forward(model: nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    """One training-mode forward of ``model`` on ``ids`` (the graph is dropped after it)."""
    if hasattr(model, "loss"):  # TinyGPT
        return lambda: model(ids)
    return lambda: model(input_ids=ids, use_cache=False).logits


def _forward_rows(
    model: nn.Module, what: str, batch: int, vocab: int, sizes: Sizes, repeats: int,
    settings: Settings,
) -> Iterator[Row]:  # fmt: skip
    """Tracked against untracked forward passes of ``model``, at each sequence length."""
    from hyper_parallel.qk_clip import untrack

    plain, tracked = _twins(model)
    for seq in sizes.seq_lens:
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seq))
        ids = ids.to(settings.device)
        steps = {"tracked": _forward(tracked, ids), "untracked": _forward(plain, ids)}
        medians, _ = interleaved_medians(steps, repeats, settings.device)
        yield Row(f"QK-clip tracking, forward pass, {what}, {batch} x {seq} tokens",
                  "tracked (qk_clip.track)", medians["tracked"], "untracked",
                  medians["untracked"], "s",
                  note=f"median of {repeats} training-mode forwards each, interleaved, {_threads()}",
                  command=case_command("qk_clip", settings))  # fmt: skip
    untrack(tracked)


def _report_half_over(layers: list[Any]) -> None:
    """Every tracked layer reports maxima with its even heads at twice the threshold."""
    for layer in layers:
        heads = layer.layout.num_heads
        device = layer.tensor(layer.layout.query).device
        maxima = torch.full((heads,), THRESHOLD / 2, device=device)
        maxima[::2] = 2 * THRESHOLD
        layer.report(maxima)


def _step_row(
    model: nn.Module, what: str, ids: torch.Tensor, repeats: int, settings: Settings
) -> Row:
    """``optimizer.step()`` with ``qk_clip_threshold`` against without, on the same gradients."""
    from hyper_parallel import get_hyper_optimizer
    from hyper_parallel.qk_clip import tracked_layers, untrack

    plain, clipped = _twins(copy.deepcopy(model))
    layers = [layer for layer in tracked_layers() if layer.module in set(clipped.modules())]
    for twin in (plain, clipped):
        logits = _forward(twin, ids)()
        assert isinstance(logits, torch.Tensor)
        logits.float().square().mean().backward()  # gradients: any loss will do
    clipping = get_hyper_optimizer(clipped, muon={"qk_clip_threshold": THRESHOLD}, adamw={})
    plain_step = get_hyper_optimizer(plain, muon={}, adamw={}).step

    def clipped_step() -> None:
        _report_half_over(layers)
        clipping.step()

    medians, _ = interleaved_medians(
        {"clipped": clipped_step, "plain": plain_step}, repeats, settings.device
    )
    heads = sum(layer.layout.num_heads for layer in layers)
    untrack(clipped)
    return Row(f"QK-clip in optimizer.step(), Muon + AdamW, {what}",
               f"qk_clip_threshold={THRESHOLD:g} ({-(-heads // 2)} of {heads} heads clipped)",
               medians["clipped"], "no qk_clip_threshold", medians["plain"], "s",
               note=f"median of {repeats} steps each, interleaved, {_threads()}; the clipped "
                    "step includes each layer's report of its maxima",
               command=case_command("qk_clip", settings))  # fmt: skip


def qk_clip_rows(sizes: Sizes, settings: Settings) -> Iterator[Row]:
    """The case's rows at ``sizes``: forward passes of each model, then each model's step."""
    device = settings.device
    forwards, steps = max(4 * settings.repeats, 4), max(10 * settings.repeats, 10)
    gpt, what, batch = _gpt(sizes, device)
    vocab = int(gpt.get_parameter("embed_tokens.weight").shape[0])
    yield from _forward_rows(gpt, what, batch, vocab, sizes, forwards, settings)
    gen = torch.Generator().manual_seed(0)
    first = sizes.seq_lens[0]
    yield _step_row(gpt, what, torch.randint(0, vocab, (batch, first), generator=gen).to(device),
                    steps, settings)  # fmt: skip
    try:
        import transformers  # noqa: F401
    except ImportError:
        yield Row("QK-clip tracking, LlamaForCausalLM", "tracked", None, "untracked", None, "s",
                  note="transformers is not installed: pip install transformers",
                  command=case_command("qk_clip", settings))  # fmt: skip
        return
    vocab = sizes.llama["vocab_size"]
    llamas = {attention: _llama(sizes, attention, device) for attention in ("sdpa", "eager")}
    for llama, what in llamas.values():
        yield from _forward_rows(llama, what, sizes.llama_batch, vocab, sizes, forwards, settings)
    ids = torch.randint(0, vocab, (sizes.llama_batch, first), generator=gen).to(device)
    yield _step_row(*llamas["sdpa"], ids, steps, settings)


def case_qk_clip(settings: Settings) -> Iterator[Row]:
    """QK-clip's forward-pass and step costs at :data:`DEFAULT` (``--quick``: :data:`QUICK`).

    On one thread: on a machine shared with other work, a thread pool's
    parallel regions wait for whichever thread was descheduled, and the
    small ops of a step slow down many times over.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from qk_clip_rows(QUICK if settings.quick_flag else DEFAULT, settings)
    finally:
        torch.set_num_threads(threads)
