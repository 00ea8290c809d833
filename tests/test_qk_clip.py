"""QK-clip (MuonClip) on one process: the rule against a twin optimizer without the clip.

Tiny Hugging Face models built from configs (nothing downloaded) and a fused-QKV attention
of our own. Each head's largest logit is recomputed here from the attention layer's inputs
(a forward pre-hook: the layer's own projections, the model's own rotary, its scaling, the
causal mask, the whole logits in float64), not with :func:`hyper_parallel.qk_clip.max_logits`.
"""

from __future__ import annotations

import copy
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyper_parallel import get_hyper_optimizer
from hyper_parallel.core.errors import HyperParallelValueError
from hyper_parallel.core.optimizer import Muon
from hyper_parallel.qk_clip import (
    QKClipStats,
    QKLayout,
    layer_of,
    max_logits,
    track,
    track_layer,
    tracked_layers,
    untrack,
)
from hyper_parallel.train.model import DecoderBlock, GPTConfig, TinyGPT

transformers = pytest.importorskip("transformers")

HEAD_DIM = 8
RTOL = 2e-5  # the clip's factors are float32, the reference's float64


@pytest.fixture(autouse=True)
def _nothing_tracked_after() -> Iterator[None]:
    """Each test leaves no tracked layer behind (the registry is the process's)."""
    yield
    for layer in tracked_layers():
        untrack(layer.module)


# -- models -----------------------------------------------------------------------------------

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # QK-norm
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),  # fused qkv_proj
}


def tiny(family: str = "llama", *, kv_heads: int = 4, boost: tuple[float, ...] = ()) -> Any:
    """A 2-layer ``family`` model with 4 query heads of 8; query head ``h``'s rows times ``boost[h]``."""
    torch.manual_seed(0)
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_class(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = model_class(config)
    with torch.no_grad():
        for _, attention in attention_layers(model):
            proj = attention.q_proj if hasattr(attention, "q_proj") else attention.qkv_proj
            for head, factor in enumerate(boost):  # query rows come first in qkv_proj
                proj.weight[head * HEAD_DIM : (head + 1) * HEAD_DIM].mul_(factor)
    return model


def attention_layers(model: nn.Module) -> list[tuple[str, Any]]:
    return [(name, m) for name, m in model.named_modules() if name.endswith("self_attn")]


def batch(seed: int = 1) -> Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_step(model: nn.Module, optimizer: Any, *batches: Tensor) -> None:
    for ids in batches:
        model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def muon_of(optimizer: Any) -> Muon:
    """The Muon of a chain (or the Muon itself)."""
    if isinstance(optimizer, Muon):
        return optimizer
    (muon,) = [opt for opt in optimizer if isinstance(opt, Muon)]
    return muon


# -- the reference maxima ---------------------------------------------------------------------


def reference_maxima(query: Tensor, key: Tensor, scaling: float) -> Tensor:
    """Each query head's largest causal ``scaling * q . k``, in float64, from the whole logits."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = (query.double() @ key.double().transpose(-1, -2)) * scaling
    causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


class Probe:
    """Each forward's per-head maxima of every attention layer of a transformers model."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, list[Tensor]] = defaultdict(list)
        for name, attention in attention_layers(model):
            attention.register_forward_pre_hook(partial(self._record, name), with_kwargs=True)

    @torch.no_grad()
    def _record(
        self, name: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        (b, s, _), heads = hidden.shape, module.config.num_attention_heads
        kv = module.config.num_key_value_heads
        if hasattr(module, "q_proj"):
            query, key = module.q_proj(hidden), module.k_proj(hidden)
        else:  # fused [queries | keys | values]
            query, key, _ = module.qkv_proj(hidden).split(
                [heads * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM], -1
            )
        query = query.view(b, s, heads, HEAD_DIM).transpose(1, 2)
        key = key.view(b, s, kv, HEAD_DIM).transpose(1, 2)
        rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
        query, key = rotary(query, key, *kwargs["position_embeddings"])
        self.seen[name].append(reference_maxima(query, key, module.scaling))

    def take(self) -> dict[str, Tensor]:
        """Per layer, the max over the recorded forwards; then forget them."""
        taken = {name: torch.stack(each).amax(0) for name, each in self.seen.items()}
        self.seen.clear()
        return taken


def expected_maxima(model: nn.Module, *batches: Tensor) -> dict[str, Tensor]:
    """The maxima a training forward of the batches sees (on a copy, so nothing records)."""
    probed = copy.deepcopy(model)
    probe = Probe(probed)
    with torch.no_grad():
        for ids in batches:
            probed(ids)
    return probe.take()


def threshold_between(maxima: dict[str, Tensor], over: set[int]) -> float:
    """A ``tau`` that the query heads ``over`` of every layer exceed and the others do not."""
    small = max(float(s[h]) for s in maxima.values() for h in range(len(s)) if h not in over)
    large = min(float(s[h]) for s in maxima.values() for h in over)
    assert small < large / 1.5, (small, large)  # the boosts separate them
    return math.sqrt(small * large)


# -- the rule -----------------------------------------------------------------------------------


@dataclass
class Rows:
    """One layer's query rows, key rows, and rows the clip must leave alone."""

    query: Tensor
    key: Tensor
    others: tuple[Tensor, ...] = ()


def rows_of(attention: Any) -> Rows:
    """A transformers attention's rows; a bias is one more column of its projection's rows."""
    heads, kv = attention.config.num_attention_heads, attention.config.num_key_value_heads
    if hasattr(attention, "qkv_proj"):
        q, k, v = attention.qkv_proj.weight.split([heads * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM])
        return Rows(q, k, (v,))
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    if q.bias is None:
        return Rows(q.weight, k.weight, (v.weight,))
    return Rows(
        torch.cat([q.weight, q.bias[:, None]], 1),
        torch.cat([k.weight, k.bias[:, None]], 1),
        (v.weight, v.bias),
    )


def assert_rule(
    clipped: Rows, twin: Rows, maxima: Tensor, tau: float, alpha: float, label: str
) -> None:
    """Query head h's rows = the twin's * gamma_h ** alpha; a key head's = the twin's * (the
    smallest gamma of its query heads) ** (1 - alpha); a factor of 1 and other rows bitwise."""
    gamma = torch.where(maxima > tau, tau / maxima, torch.ones_like(maxima))
    shared = gamma.view(clipped.key.shape[0] // HEAD_DIM, -1).amin(dim=1)
    for role, factors, new, old in (
        ("query", gamma**alpha, clipped.query, twin.query),
        ("key", shared ** (1 - alpha), clipped.key, twin.key),
    ):
        for head, factor in enumerate(factors.tolist()):
            part = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
            where = f"{label}: {role} head {head} (factor {factor:.4f})"
            if factor == 1.0:
                assert torch.equal(new[part], old[part]), where
            else:
                expected = (old[part].double() * factor).float()
                torch.testing.assert_close(new[part], expected, rtol=RTOL, atol=0, msg=where)
    for new, old in zip(clipped.others, twin.others, strict=True):
        assert torch.equal(new, old), f"{label}: rows that are neither query nor key changed"


def assert_model_rule(
    model: nn.Module, twin: nn.Module, maxima: dict[str, Tensor], tau: float, alpha: float = 0.5
) -> None:
    with torch.no_grad():
        for (name, mine), (_, theirs) in zip(
            attention_layers(model), attention_layers(twin), strict=True
        ):
            assert_rule(rows_of(mine), rows_of(theirs), maxima[name], tau, alpha, name)


def assert_stats(stats: QKClipStats | None, maxima: dict[str, Tensor], tau: float) -> None:
    assert stats is not None
    every = torch.cat(list(maxima.values()))
    assert stats.max_logit == pytest.approx(float(every.max()), rel=RTOL)
    assert stats.heads_clipped == int((every > tau).sum()) > 0
    assert stats.heads == every.numel()
    assert stats.max_logit_after <= tau * (1 + RTOL)
    assert stats.as_dict()["qk_heads_clipped"] == stats.heads_clipped


def clipped_and_twin(
    family: str,
    muon: dict[str, Any],
    *,
    boost: tuple[float, ...],
    over: set[int],
    kv_heads: int = 4,
) -> tuple[nn.Module, nn.Module, dict[str, Tensor], float, QKClipStats | None]:
    """One step of a tracked model clipped at a tau that only the query heads ``over`` exceed,
    and of its untracked twin with the same options but no threshold."""
    model = tiny(family, kv_heads=kv_heads, boost=boost)
    ids = batch()
    tau = threshold_between(expected_maxima(model, ids), over)
    twin = copy.deepcopy(model)
    probe = Probe(model)
    assert [layer.name for layer in track(model)] == [name for name, _ in attention_layers(model)]
    optimizer = get_hyper_optimizer(model, muon={**muon, "qk_clip_threshold": tau}, adamw={})
    train_step(model, optimizer, ids)
    train_step(twin, get_hyper_optimizer(twin, muon=muon, adamw={}), ids)
    return model, twin, probe.take(), tau, muon_of(optimizer).qk_clip_stats


# -- the rule on each layout ---------------------------------------------------------------------


def test_multi_head_llama_heads_over_tau_are_scaled_by_the_rule_and_the_others_untouched() -> None:
    model, twin, maxima, tau, stats = clipped_and_twin(
        "llama", {}, boost=(1.0, 6.0, 1.0, 9.0), over={1, 3}
    )
    assert_model_rule(model, twin, maxima, tau)
    assert_stats(stats, maxima, tau)
    assert stats is not None and (stats.heads_clipped, stats.heads) == (4, 8)
    assert stats.max_logit_after == pytest.approx(tau, rel=RTOL)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grouped_query_key_head_takes_the_smallest_gamma_of_its_query_heads(family: str) -> None:
    # key head 0: query heads 0 (over tau) and 1 (under); key head 1: heads 2 and 3, both over
    model, twin, maxima, tau, stats = clipped_and_twin(
        family, {"qk_clip_alpha": 0.25}, kv_heads=2, boost=(8.0, 1.0, 5.0, 12.0), over={0, 2, 3}
    )
    assert_model_rule(model, twin, maxima, tau, alpha=0.25)
    assert_stats(stats, maxima, tau)
    head_1 = slice(HEAD_DIM, 2 * HEAD_DIM)
    for (_, mine), (_, theirs) in zip(attention_layers(model), attention_layers(twin), strict=True):
        assert torch.equal(mine.q_proj.weight[head_1], theirs.q_proj.weight[head_1])
        assert not torch.equal(mine.k_proj.weight[:HEAD_DIM], theirs.k_proj.weight[:HEAD_DIM])


def test_fused_qkv_of_phi3_is_tracked_and_clipped_on_its_query_and_key_rows() -> None:
    model, twin, maxima, tau, stats = clipped_and_twin(
        "phi3", {}, kv_heads=2, boost=(7.0, 1.0, 1.0, 10.0), over={0, 3}
    )
    assert_model_rule(model, twin, maxima, tau)  # and its value rows bitwise
    assert_stats(stats, maxima, tau)


def test_head_wise_muon_is_clipped_by_the_same_rule() -> None:
    model, twin, maxima, tau, stats = clipped_and_twin(
        "llama", {"head_wise": True}, boost=(6.0, 1.0, 9.0, 1.0), over={0, 2}
    )
    assert_model_rule(model, twin, maxima, tau)
    assert_stats(stats, maxima, tau)


def test_accumulation_takes_the_max_of_both_forwards_and_an_eval_forward_counts_not() -> None:
    model = tiny(boost=(1.0, 4.0, 2.0, 8.0))
    candidates = [batch(seed) for seed in range(6)]
    seen = [expected_maxima(model, ids) for ids in candidates]
    loudest = max(range(6), key=lambda i: max(float(m.max()) for m in seen[i].values()))
    first, second = [i for i in range(6) if i != loudest][:2]
    both = {name: torch.maximum(seen[first][name], seen[second][name]) for name in seen[first]}
    assert any(bool((seen[loudest][n] > both[n]).any()) for n in both)  # eval would change it
    assert all(not torch.equal(both[n], seen[first][n]) for n in both)  # and so would forward 2
    tau = 0.5 * min(float(m.min()) for m in both.values())  # every head clipped
    twin = copy.deepcopy(model)
    track(model)
    optimizer = get_hyper_optimizer(model, muon={"qk_clip_threshold": tau}, adamw={})
    model(candidates[first], labels=candidates[first]).loss.backward()
    model.eval()
    model(candidates[loudest])
    model.train()
    train_step(model, optimizer, candidates[second])
    plain = get_hyper_optimizer(twin, muon={}, adamw={})
    train_step(twin, plain, candidates[first], candidates[second])
    assert_model_rule(model, twin, both, tau)
    assert_stats(muon_of(optimizer).qk_clip_stats, both, tau)


# -- attention of one's own: track_layer, report, split_rows -------------------------------------


class FusedAttention(nn.Module):
    """Causal attention with one fused ``qkv`` Linear: [4 query | 2 key | 2 value] heads of 8."""

    ROWS = (4 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM)

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, sum(self.ROWS), bias=False)
        self.out = nn.Linear(self.ROWS[0], dim, bias=False)

    def split(self, x: Tensor) -> list[Tensor]:
        b, s, _ = x.shape
        return [
            p.view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in self.qkv(x).split(self.ROWS, -1)
        ]

    def forward(self, x: Tensor) -> Tensor:
        query, key, value = self.split(x)
        layer = layer_of(self)
        if layer is not None and self.training:
            layer.report(max_logits(query, key, scaling=HEAD_DIM**-0.5, causal=True))
        key, value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        out: Tensor = self.out(attended.transpose(1, 2).flatten(2))
        return out


def test_fused_qkv_of_ones_own_split_by_split_rows_is_clipped_and_its_values_untouched() -> None:
    torch.manual_seed(0)
    model = FusedAttention()
    with torch.no_grad():
        model.qkv.weight[:HEAD_DIM].mul_(20.0)  # query head 0 over tau; key head 0 shared with 1
        model.qkv.weight[3 * HEAD_DIM : 4 * HEAD_DIM].mul_(30.0)  # and head 3
        x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(2))
        query, key, _ = model.split(x)
        maxima = reference_maxima(query, key, HEAD_DIM**-0.5)
    tau = threshold_between({"": maxima}, over={0, 3})
    twin = copy.deepcopy(model)
    layout = QKLayout(
        query="qkv.weight", key="qkv.weight", head_dim=HEAD_DIM, num_heads=4, num_kv_heads=2,
        key_row=4 * HEAD_DIM,
    )  # fmt: skip
    track_layer(model, layout, "attention")

    def muon(module: FusedAttention, **clip: float) -> Muon:
        fused: dict[str, Any] = {"params": [module.qkv.weight], "split_rows": FusedAttention.ROWS}
        return Muon([{**fused, **clip}, {"params": [module.out.weight]}])

    clipped = muon(model, qk_clip_threshold=tau)
    for module, optimizer in ((model, clipped), (twin, muon(twin))):
        module(x).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        (q, k, v), (q0, k0, v0) = (m.qkv.weight.split(FusedAttention.ROWS) for m in (model, twin))
        assert_rule(Rows(q, k, (v,)), Rows(q0, k0, (v0,)), maxima, tau, 0.5, "qkv")
    assert_stats(clipped.qk_clip_stats, {"": maxima}, tau)


# -- the options in every form -------------------------------------------------------------------


def split_params(model: nn.Module) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Layer 0's W_q and W_k, the other hidden matrices, and the rest (for AdamW)."""
    qk: list[Tensor] = []
    matrices: list[Tensor] = []
    rest: list[Tensor] = []
    for name, param in model.named_parameters():
        if "embed" in name or "lm_head" in name or param.ndim < 2:
            rest.append(param)
        elif name.endswith(
            ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight")
        ):
            qk.append(param)
        else:
            matrices.append(param)
    return qk, matrices, rest


def prefixed(options: dict[str, Any]) -> dict[str, Any]:
    return {f"muon_{key}": value for key, value in options.items()}


def by_kwargs(model: nn.Module, options: dict[str, Any]) -> Any:
    qk, matrices, rest = split_params(model)
    return get_hyper_optimizer(
        model, muon_params=qk + matrices, adamw_params=rest, muon_kwargs=options
    )


def by_groups(model: nn.Module, options: dict[str, Any]) -> Any:
    qk, matrices, rest = split_params(model)
    muon = {"params": [{"params": qk, **options}, {"params": matrices}]}
    return get_hyper_optimizer(model, optimizers={"muon": muon, "adamw": {"params": rest}})


FORMS: dict[str, Callable[[nn.Module, dict[str, Any]], Any]] = {
    "muon={...}": lambda model, o: get_hyper_optimizer(model, muon=o, adamw={}),
    "muon_<option>=": lambda model, o: get_hyper_optimizer(model, muon={}, adamw={}, **prefixed(o)),
    "muon_kwargs": by_kwargs,
    "muon_kwargs, prefixed": lambda model, o: by_kwargs(model, prefixed(o)),
    "explicit groups": by_groups,
    "param_groups": lambda model, o: get_hyper_optimizer(
        model,
        muon={"param_groups": [{"param_patterns": [r"layers\.0\.self_attn\.[qk]_proj"], **o}]},
        adamw={},
    ),
    "Muon(...)": lambda model, o: Muon(split_params(model)[0] + split_params(model)[1], **o),
}
#: The query heads each form clips: every layer's, or (a group of layer 0's W_q, W_k) layer 0's.
CLIPPED_HEADS = {"explicit groups": 4, "param_groups": 4}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_of_the_options_clips(form: str) -> None:
    model = tiny()
    track(model)
    optimizer = FORMS[form](model, {"qk_clip_threshold": 1e-3, "qk_clip_alpha": 0.25})
    muon = muon_of(optimizer)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    (group,) = [g for g in muon.param_groups if any(p is q_proj for p in g["params"])]
    assert (group["qk_clip_threshold"], group["qk_clip_alpha"]) == (1e-3, 0.25)
    train_step(model, optimizer, batch())
    heads = CLIPPED_HEADS.get(form, 8)
    stats = muon.qk_clip_stats
    assert stats is not None and (stats.heads, stats.heads_clipped) == (heads, heads)


BAD = [("qk_clip_threshold", 0), ("qk_clip_threshold", -1.0), ("qk_clip_threshold", math.nan),
       ("qk_clip_threshold", "100"), ("qk_clip_alpha", 1.5)]  # fmt: skip


@pytest.mark.parametrize(("option", "value"), BAD, ids=[f"{o}={v!r}" for o, v in BAD])
@pytest.mark.parametrize("form", FORMS)
def test_a_bad_option_in_each_form_is_a_value_error_naming_it(
    form: str, option: str, value: Any
) -> None:
    model = tiny()
    track(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"^{option} should be"):
        FORMS[form](model, {option: value})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(tracked_layers()) == 2
    assert model.config._attn_implementation == "hyper_parallel_qk_clip_sdpa"


def test_a_bad_option_in_an_added_group_changes_nothing() -> None:
    model = tiny()
    track(model)
    qk, matrices, _ = split_params(model)
    muon = Muon(qk, qk_clip_threshold=1.0)
    with pytest.raises(ValueError, match=r"^qk_clip_alpha should be"):
        muon.add_param_group({"params": matrices, "qk_clip_alpha": -0.5})
    assert len(muon.param_groups) == 1 and muon.param_groups[0]["qk_clip_alpha"] == 0.5


def test_a_bad_option_edited_into_a_group_fails_the_step_before_any_change() -> None:
    model = tiny()
    track(model)
    qk = split_params(model)[0]
    muon = Muon(qk, qk_clip_threshold=1.0)
    muon.param_groups[0]["qk_clip_threshold"] = -1.0
    model(batch(), labels=batch()).loss.backward()
    weights = [p.detach().clone() for p in qk]
    with pytest.raises(ValueError, match=r"^qk_clip_threshold should be"):
        muon.step()
    assert all(torch.equal(p, w) for p, w in zip(qk, weights, strict=True))


# -- errors -------------------------------------------------------------------------------------


def test_a_model_with_no_attention_is_refused() -> None:
    with pytest.raises(
        HyperParallelValueError, match=r"found no attention layer to track in Linear"
    ):
        track(nn.Linear(4, 4))


def test_qk_norm_is_refused_naming_the_norm_and_nothing_is_tracked() -> None:
    model = tiny("qwen3", kv_heads=2)
    with pytest.raises(
        HyperParallelValueError, match=r"clip 'model\.layers\.0\.self_attn'.*q_norm"
    ):
        track(model)
    assert tracked_layers() == [] and model.config._attn_implementation == "sdpa"


def _weights(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[Tensor]) -> bool:
    return all(torch.equal(p, w) for p, w in zip(model.parameters(), before, strict=True))


def test_a_threshold_with_nothing_tracked_fails_at_the_step_naming_track_before_any_change() -> (
    None
):
    model = tiny()
    optimizer = get_hyper_optimizer(model, muon={"qk_clip_threshold": 1.0}, adamw={})
    before = _weights(model)
    with pytest.raises(HyperParallelValueError, match=r"no tracked attention .*qk_clip\.track\("):
        train_step(model, optimizer, batch())
    assert _unchanged(model, before)


def test_a_step_with_no_training_forward_recorded_names_the_layer_before_any_change() -> None:
    model = tiny()
    track(model)
    optimizer = get_hyper_optimizer(model, muon={"qk_clip_threshold": 1.0}, adamw={})
    model.eval()  # eval-mode forwards do not record
    before = _weights(model)
    with pytest.raises(HyperParallelValueError, match=r"'model\.layers\.0\.self_attn' recorded no"):
        train_step(model, optimizer, batch())
    assert _unchanged(model, before)


def test_a_tracked_twin_with_the_same_layer_names_is_not_clipped_by_this_optimizer() -> None:
    model = tiny(boost=(8.0,))
    twin = copy.deepcopy(model)
    track(model)
    track(twin)  # same names, its own params: no forward of it before model's step
    optimizer = get_hyper_optimizer(model, muon={"qk_clip_threshold": 1.0}, adamw={})
    twin_before = _weights(twin)
    train_step(model, optimizer, batch())
    stats = muon_of(optimizer).qk_clip_stats
    assert stats is not None and stats.heads == 4 * len(attention_layers(model))
    assert _unchanged(twin, twin_before)


# -- tracking off costs nothing -----------------------------------------------------------------


@pytest.fixture
def recordings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of the recording's max_logits, wherever tracking calls it."""
    from hyper_parallel.qk_clip import _hf, _track

    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        return max_logits(*args, **kwargs)

    for module in (_hf, _track):
        monkeypatch.setattr(module, "max_logits", counted)
    return calls


def test_an_untracked_model_runs_what_it_ran_before_and_untrack_restores_it(
    recordings: list[int],
) -> None:
    model = tiny()
    twin = copy.deepcopy(model)
    track(model)
    ids = batch()
    plain = twin(ids, labels=ids).loss
    assert recordings == [] and twin.config._attn_implementation == "sdpa"
    train_step(twin, get_hyper_optimizer(twin, muon={}, adamw={}), ids)
    assert recordings == []
    tracked = model(ids, labels=ids).loss
    assert len(recordings) == 2 and torch.equal(tracked, plain)  # the recording changes no bit
    untrack(model)
    assert model.config._attn_implementation == "sdpa" and tracked_layers() == []
    assert torch.equal(model(ids, labels=ids).loss, plain) and len(recordings) == 2


def test_the_built_in_model_gets_its_own_attention_back(recordings: list[int]) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, layers=2, dim=32, heads=4))
    twin = copy.deepcopy(model)
    assert [layer.name for layer in track(model)] == ["layers.0", "layers.1"]
    assert all("attention" in vars(block) for block in model.layers)
    ids = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.loss(ids), twin.loss(ids)) and len(recordings) == 2
    untrack(model)
    assert not any("attention" in vars(block) for block in model.layers)
    assert all(block.attention is DecoderBlock.attention for block in model.layers)
    model.loss(ids)
    assert len(recordings) == 2 and tracked_layers() == []


def test_a_swapped_optimizer_clips_once_per_step_as_the_unswapped_one() -> None:
    """SwapOptimizer steps Muon batch by batch; the clip still runs once, on the whole step."""
    from hyper_parallel import swap_optimizer

    model = tiny(boost=(8.0, 1.0, 6.0))
    twin = copy.deepcopy(model)
    track(model)
    track(twin)
    plain = get_hyper_optimizer(model, muon={"qk_clip_threshold": 1.0}, adamw={})
    swapped = swap_optimizer(
        get_hyper_optimizer(twin, muon={"qk_clip_threshold": 1.0}, adamw={}),
        {"swap_times": 3, "min_numel": 1},
    )
    for seed in (1, 2):
        train_step(model, plain, batch(seed))
        train_step(twin, swapped, batch(seed))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert muon_of(swapped.optimizer).qk_clip_stats == muon_of(plain).qk_clip_stats
