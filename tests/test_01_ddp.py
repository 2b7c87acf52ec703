"""Lesson 01 as a specification: the reference model, the comm meter, and data parallelism that
computes exactly what one device computes.

Tolerances (fp32 on CPU), measured then widened with margin:
- loss per step: atol 1e-5. The data-parallel loss is the mean of N rank means, the reference the
  mean of one batch: the same sum in another order, error ~1e-7 on losses of ~5; later steps also
  carry the parameter differences below.
- gradients of the first step: atol 1e-6 + rtol 1e-4. Each element is a sum over the global batch
  in a different order; we measured <= 1.2e-7 absolute over 30 random configurations. A real bug
  (a missed bucket, a missing / N) is off by the gradient itself, >= 25% relative.
- parameters after 3 AdamW steps at lr 1e-3, with Adam's eps raised to 1e-6: atol 1e-5. Adam's
  update g / (sqrt(v) + eps) magnifies a gradient's rounding error by up to 1/eps: with the default
  eps = 1e-8 a gradient of ~1e-9 turned rounding into a 1.1e-4 parameter difference (hypothesis
  found it). With eps = 1e-6 we measured <= 2.4e-7 over 30 configurations; any sync bug moves
  parameters by ~lr = 1e-3. Adam is blind to a uniform gradient scale, which is why gradients are
  compared directly.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, SCRIPT_TIMEOUT_S, RankFailure, run_script

foundation = importlib.import_module("01_ddp")

LOSS_ATOL, GRAD_ATOL, GRAD_RTOL, PARAM_ATOL, ADAM_EPS = 1e-5, 1e-6, 1e-4, 1e-5, 1e-6


@st.composite
def model_configs(draw) -> "foundation.ModelConfig":
    n_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    return foundation.ModelConfig(vocab_size=draw(st.sampled_from([16, 50, 64])), dim=n_heads * head_dim,
                                  n_layers=draw(st.integers(1, 2)), n_heads=n_heads,
                                  ffn_dim=draw(st.sampled_from([16, 24])), seed=draw(st.integers(0, 99)))


# --- the reference model ----------------------------------------------------------------------

@given(cfg=model_configs(), seq_len=st.integers(2, 12), data=st.data())
def test_logits_are_causal(cfg, seq_len, data):
    t = data.draw(st.integers(0, seq_len - 2), label="position")
    model = foundation.GPT(cfg)
    tokens, _ = foundation.synthetic_batch(cfg, 2, seq_len, step=0)
    changed = tokens.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :t + 1], after[:, :t + 1]), "a logit saw a future token"
    assert not torch.allclose(before[:, t + 1:], after[:, t + 1:]), "changed tokens had no effect"


@given(cfg=model_configs())
def test_initial_loss_is_near_ln_vocab(cfg):
    # logits = lm_head(rmsnorm(h)) with lm_head ~ N(0, init_std^2) and |rmsnorm(h)|^2 = dim, so the
    # logits have std s = init_std sqrt(dim), E[loss] ~ ln V + s^2 / 2, and each token's loss
    # deviates from that by ~s. Tokens repeat within a batch, so the n token losses are not
    # independent: we measured at most 5.4 s / sqrt(n) over 540 configurations; allow 10.
    tokens, targets = foundation.synthetic_batch(cfg, 8, 16, step=0)
    loss = foundation.GPT(cfg)(tokens, targets).item()
    s = cfg.init_std * math.sqrt(cfg.dim)
    assert abs(loss - (math.log(cfg.vocab_size) + s ** 2 / 2)) < 10 * s / math.sqrt(tokens.numel())


def test_init_is_deterministic_and_seeded():
    cfg = foundation.ModelConfig(seed=3)
    a, b, c = foundation.GPT(cfg), foundation.GPT(cfg), foundation.GPT(foundation.ModelConfig(seed=4))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


@given(world=st.integers(1, 4), per_rank=st.integers(1, 3), step=st.integers(0, 5))
def test_rank_slices_tile_the_global_batch(world, per_rank, step):
    cfg = foundation.ModelConfig()
    whole = foundation.synthetic_batch(cfg, world * per_rank, 8, step)
    slices = [foundation.synthetic_batch(cfg, world * per_rank, 8, step, r, world) for r in range(world)]
    for i in range(2):
        assert torch.equal(torch.cat([s[i] for s in slices]), whole[i])
    assert torch.equal(whole[0][:, 1:], whole[1][:, :-1]), "targets are the next tokens"


@pytest.mark.parametrize("global_batch, seq_len", [(0, 4), (2, 0)])
def test_an_empty_training_batch_is_refused(global_batch, seq_len):
    # Every lesson draws its batches here: without the check an empty batch trains on a NaN loss.
    with pytest.raises(ValueError, match=f"global_batch={global_batch} and seq_len={seq_len} must"):
        foundation.synthetic_batch(foundation.ModelConfig(), global_batch, seq_len, step=0)


def test_bad_model_config_names_the_constraint():
    with pytest.raises(ValueError, match="dim=30 is not divisible by n_heads=4"):
        foundation.ModelConfig(dim=30, n_heads=4)


@given(n_heads=st.sampled_from([2, 4]), kv_divisor=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_grouped_query_attention_equals_attention_with_repeated_kv_heads(n_heads, kv_divisor, seed):
    # GQA with n_kv_heads = H / g is, by definition, multi-head attention in which query head i uses
    # key/value head i // g: build that multi-head model from the GQA weights and compare logits.
    n_kv = max(1, n_heads // kv_divisor)
    cfg = foundation.ModelConfig(vocab_size=32, dim=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv,
                                 ffn_dim=16, seed=seed)
    gqa, mha = foundation.GPT(cfg), foundation.GPT(foundation.ModelConfig(**{**vars(cfg), "n_kv_heads": n_heads}))
    state = gqa.state_dict()
    for name, w in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = w.view(n_kv, cfg.head_dim, cfg.dim).repeat_interleave(n_heads // n_kv, 0)
            state[name] = state[name].reshape(cfg.dim, cfg.dim)
    mha.load_state_dict(state)
    tokens, _ = foundation.synthetic_batch(cfg, 2, 9, step=0)
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=0, atol=1e-6)
    assert gqa.layers["0"].attn.k_proj.weight.shape == (n_kv * cfg.head_dim, cfg.dim)


def test_attention_gets_kv_heads_unrepeated_and_nothing_saves_them_repeated():
    """The attention function receives k and v with n_kv_heads heads, and no tensor autograd keeps
    has K/V repeated to the query heads: of the saved (batch, heads, seq, head_dim) tensors, only q
    and the output have n_heads heads."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=16)
    received = []

    def recording_attention(q, k, v):
        received.append((q.shape[1], k.shape[1], v.shape[1]))
        return foundation.causal_attention(q, k, v)

    model, saved = foundation.GPT(cfg, attn_fn=recording_attention), []
    tokens, targets = foundation.synthetic_batch(cfg, 2, 5, step=0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        model(tokens, targets)
    assert received == [(8, 2, 2)]
    per_head = [shape for shape in saved if len(shape) == 4 and shape[2:] == (5, cfg.head_dim)]
    assert sorted(shape[1] for shape in per_head) == [2, 2, 8, 8]  # k, v; q, out (SDPA's CPU kernel)


def test_the_projection_and_activation_hooks_are_the_plain_calls_by_default():
    """01's hooks for lessons 03 and 08: a block makes the projections of one input in one call
    (Attention.project, SwiGLU.project; by default each linear of x) and SwiGLU's activation is an
    attribute (gated; by default silu(gate) x up). Replaced by the same math written out, they receive
    q, k, v's and gate, up's linears, and the model's logits do not change."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=24)
    model = foundation.GPT(cfg)
    block = model.layers["0"]
    assert block.attn.project is block.mlp.project is foundation.linears_of
    assert block.mlp.gated is foundation.swiglu
    tokens, _ = foundation.synthetic_batch(cfg, 2, 5, step=0)
    calls = []

    def written_out_project(x, *linears):
        calls.append(linears)
        return tuple(x @ linear.weight.t() for linear in linears)

    def written_out_gated(gate, up):
        calls.append((gate.shape, up.shape))
        return gate * torch.sigmoid(gate) * up

    with torch.no_grad():
        before = model(tokens)
        block.attn.project = block.mlp.project = written_out_project
        block.mlp.gated = written_out_gated
        after = model(tokens)
    attn, mlp = block.attn, block.mlp
    assert calls == [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj), ((2, 5, 24),) * 2]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_empty_batch_gives_empty_logits_and_hidden_states():
    # As nn.Linear does for (0, in): later lessons shard batches, and a rank may get no rows.
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=4, n_kv_heads=2, ffn_dim=16)
    model = foundation.GPT(cfg)
    assert model(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5, 32)
    model.lm_head = None
    assert model(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5, 16)


def test_default_kv_heads_and_bad_kv_heads():
    assert foundation.ModelConfig(n_heads=4).n_kv_heads == 4
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        foundation.ModelConfig(n_heads=4, n_kv_heads=3)


def test_default_loss_is_mean_cross_entropy_and_is_pluggable():
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=16)
    model = foundation.GPT(cfg)
    tokens, targets = foundation.synthetic_batch(cfg, 2, 7, step=0)
    with torch.no_grad():
        logits = model(tokens)
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
        assert torch.equal(model(tokens, targets), expected)
        model.loss_fn = lambda lg, tg: (lg.sum(), tg.shape)
        assert model(tokens, targets) == (logits.sum(), targets.shape)


def test_stages_without_embed_or_head_compose_to_the_whole_model():
    # A pipeline stage is the model with the modules it does not own set to None: the first stage
    # (embed, layer 0) returns hidden states, the last (layer 1, norm, head) starts from them.
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=16, n_layers=2)
    whole = foundation.GPT(cfg)
    first, last = foundation.GPT(cfg), foundation.GPT(cfg)
    first.lm_head = first.norm = None
    del first.layers["1"]
    last.embed = None
    del last.layers["0"]
    tokens, targets = foundation.synthetic_batch(cfg, 2, 7, step=0)
    hidden = first(tokens)
    assert hidden.shape == (2, 7, cfg.dim)
    assert torch.equal(last(hidden, targets), whole(tokens, targets))
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()} == \
        {n for n, _ in whole.named_parameters()}


# --- the reference pinned down on its own: RoPE, initialisation, a float64 model, AdamW ----------

@st.composite
def gqa_model_configs(draw) -> "foundation.ModelConfig":
    cfg = draw(model_configs())
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if cfg.n_heads % k == 0]))
    return dataclasses.replace(cfg, n_kv_heads=kv_heads)


def rope_complex_float64(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE by its definition: the pair (x_j, x_{j+d/2}) is the complex number x_j + i x_{j+d/2},
    multiplied by e^(i p theta^(-2j/d)) at position p. x: (batch, seq, heads, d), in float64."""
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angle = positions.double()[:, None] * freq
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)[:, None]
    return torch.cat([z.real, z.imag], dim=-1)


@given(head_dim=st.sampled_from([2, 4, 8, 16]), seq=st.integers(1, 12), offset=st.integers(0, 1000),
       theta=st.sampled_from([10000.0, 500000.0]), seed=st.integers(0, 99))
def test_rope_is_the_complex_rotation(head_dim, seq, offset, theta, seed):
    x = torch.randn(2, seq, 3, head_dim, generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq) + offset
    got = foundation.apply_rope(x, *foundation.rope_angles(positions, head_dim, theta)).double()
    # fp32 angles p x freq are off by ~p_max 2^-24 radians, which moves a value by that much times
    # its pair's norm: measured <= 0.6 p_max 2^-24 max|x| over 300 draws; allow 4 x that, + 1e-6.
    # A wrong frequency or pairing is off by O(|x|).
    bound = 4 * (offset + seq) * 2.0 ** -24 * x.abs().max().item() + 1e-6
    torch.testing.assert_close(got, rope_complex_float64(x.double(), positions, theta), atol=bound, rtol=0)


def attention_scores(model, tokens, positions) -> list[torch.Tensor]:
    """q k^T in every layer, as the attention function receives q and k (after RoPE; query head i
    against K/V head i // g)."""
    scores = []

    def recording_attention(q, k, v):
        k_of_query = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores.append(q.double() @ k_of_query.transpose(-1, -2))
        return foundation.causal_attention(q, k, v)

    for layer in model.layers.values():
        layer.attn.attn_fn = recording_attention
    with torch.no_grad():
        model(tokens, positions=positions)
    return scores


@given(cfg=gqa_model_configs(), seq_len=st.integers(2, 10), shift=st.integers(1, 1000))
def test_attention_scores_depend_on_relative_positions_only(cfg, seq_len, shift):
    """RoPE's point: q_m . k_n depends on m - n only. Shifting every position keeps every score, up to
    fp32 angle rounding: measured <= 1.1 p_max 2^-24 x max|score| over 100 draws, allow 16 x. Doubling
    the positions (new offsets) changes them: measured >= 0.18 x max|score|, required 1e-3 x."""
    model, tokens = foundation.GPT(cfg), foundation.synthetic_batch(cfg, 2, seq_len, step=0)[0]
    positions = torch.arange(seq_len)
    base, shifted, doubled = (attention_scores(model, tokens, p) for p in
                              (positions, positions + shift, 2 * positions))
    for layer, (b, s, d) in enumerate(zip(base, shifted, doubled, strict=True)):
        scale = b.abs().max().item()
        assert (s - b).abs().max().item() <= 16 * (seq_len + shift) * 2.0 ** -24 * scale + 1e-9, layer
        off_diagonal = ~torch.eye(seq_len, dtype=torch.bool)
        assert (d - b)[..., off_diagonal].abs().max().item() > 1e-3 * scale, layer


@given(n_heads=st.sampled_from([2, 4]), groups=st.sampled_from([1, 2]), layers=st.integers(0, 3), tie=st.booleans())
def test_parameter_shapes_are_the_models(n_heads, groups, layers, tie):
    cfg = foundation.ModelConfig(vocab_size=37, dim=8 * n_heads, n_layers=layers, n_heads=n_heads,
                                 n_kv_heads=n_heads // groups, ffn_dim=20, tie_embeddings=tie)
    built = [(name, tuple(p.shape)) for name, p in foundation.GPT(cfg).named_parameters()]
    assert list(foundation.parameter_shapes(cfg).items()) == built


def test_a_tied_lm_head_is_the_embedding_and_the_default_is_untied():
    """The hook for Llama 3.2-style ties: one parameter under two modules, its gradient the sum of both
    uses; the default model (every lesson's) keeps two."""
    untied, tied = (foundation.GPT(foundation.ModelConfig(tie_embeddings=t)) for t in (False, True))
    assert untied.lm_head.weight is not untied.embed.weight and "lm_head.weight" in dict(untied.named_parameters())
    assert tied.lm_head.weight is tied.embed.weight
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.embed.weight)
        for (_, a), (_, b) in zip(untied.named_parameters(), tied.named_parameters()):  # lm_head last, untied
            a.copy_(b)
    tokens, targets = foundation.synthetic_batch(tied.cfg, 2, 8, 0)
    for model in (tied, untied):
        model(tokens, targets).backward()
    torch.testing.assert_close(tied.embed.weight.grad, untied.embed.weight.grad + untied.lm_head.weight.grad)


LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5,
                 attention_bias=False, mlp_bias=False, head_dim=128, max_position_embeddings=131072,
                 rope_scaling=dict(factor=8.0, rope_type="llama3"), torch_dtype="bfloat16")


def test_a_hugging_face_llama_or_mixtral_config_is_the_model_config():
    """Meta's Llama 3.1 8B config.json (rope_scaling stretches positions: no shape, unread) and a
    Mixtral 8x7B-shaped one (per-expert intermediate_size; 8 experts, top 2); Llama 3.2 1B ties."""
    cfg, moe = foundation.ModelConfig.from_hf(LLAMA3_8B, 8192)
    assert moe is None and cfg == foundation.ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                                                         n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0)
    mixtral = dict(LLAMA3_8B, model_type="mixtral", vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                   sliding_window=None, rope_theta=1e6)
    del mixtral["head_dim"], mixtral["attention_bias"], mixtral["mlp_bias"]
    cfg, moe = foundation.ModelConfig.from_hf(mixtral, 8192)
    assert moe == (8, 2) and cfg.vocab_size == 32000 and cfg.ffn_dim == 14336 and cfg.rope_theta == 1e6
    llama32 = dict(LLAMA3_8B, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, head_dim=64,
                   tie_word_embeddings=True)
    assert foundation.ModelConfig.from_hf(llama32, 8192)[0].tie_embeddings


LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, intermediate_size=11008, vocab_size=32000, hidden_act="silu",
                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096)  # no K/V heads
MISTRAL_7B_V01 = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      vocab_size=32000, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                      sliding_window=4096, tie_word_embeddings=False)


@pytest.mark.parametrize("config, seq_len, read", [
    (LLAMA2_7B, 4096, dict(n_kv_heads=32, rope_theta=1e4)),  # missing: LlamaConfig's defaults
    (dict(LLAMA2_7B, num_key_value_heads=None), 4096, dict(n_kv_heads=32)),  # null: the heads
    (dict(LLAMA2_7B, rms_norm_eps=None), 4096, "rms_norm_eps=None: missing"),  # null, no default in HF
    (dict(LLAMA2_7B, tie_word_embeddings=None), 4096, dict(tie_embeddings=False)),
    ({k: v for k, v in LLAMA2_7B.items() if k != "rms_norm_eps"}, 4096, dict(norm_eps=1e-6)),
    (dict(LLAMA2_7B, hidden_act="swish"), 4096, dict(n_kv_heads=32)),  # ACT2FN: silu's other name
    (MISTRAL_7B_V01, 4096, dict(n_kv_heads=8)),  # a window that covers every token: full attention
    (MISTRAL_7B_V01, 4097, "sliding_window=4096: attention within a window shorter than the run's seq_len 4,097"),
    (dict(MISTRAL_7B_V01, sliding_window=None), 32768, dict(n_kv_heads=8)),  # Mistral 7B v0.2: none
    ({k: v for k, v in MISTRAL_7B_V01.items() if k not in ("sliding_window", "num_key_value_heads")}, 4096,
     dict(n_kv_heads=8)),  # missing: MistralConfig's 4096 and 8
    ({k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}, 8192,
     "sliding_window=4096 (its default): attention within a window shorter than the run's seq_len 8,192"),
    (dict(MISTRAL_7B_V01, num_key_value_heads=None), 4096, dict(n_kv_heads=32)),
    (dict(MISTRAL_7B_V01, model_type="mixtral"), 4096, dict(rope_theta=1e4)),  # + MixtralConfig's 8, top 2
])
def test_a_config_json_is_read_as_hugging_face_reads_it(config, seq_len, read):
    """A key missing is its transformers config class's default (LlamaConfig: the heads for K/V heads, never
    one; MistralConfig: 8 and a window of 4096); null K/V heads are the heads, a null tie or window none."""
    if isinstance(read, str):
        with pytest.raises(ValueError) as error:
            foundation.ModelConfig.from_hf(config, seq_len)
        assert str(error.value).startswith(read) and "\n" not in str(error.value), error.value
        return
    cfg, moe = foundation.ModelConfig.from_hf(config, seq_len)
    assert all(getattr(cfg, k) == v for k, v in read.items()), cfg
    assert moe == ((8, 2) if config["model_type"] == "mixtral" else None)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen2"), "model_type='qwen2' is not llama, mistral or mixtral"),
    (dict(model_type=None), "model_type=None is not llama, mistral or mixtral"),
    (dict(hidden_act="gelu"), "hidden_act='gelu': a feature 01's GPT (a plain Llama) lacks"),
    (dict(attention_bias=True), "attention_bias=True: a feature"),
    (dict(mlp_bias=True), "mlp_bias=True: a feature"),
    (dict(sliding_window=4096), "sliding_window=4096: attention within a window shorter than the run's seq_len"),
    (dict(head_dim=256), "head_dim=256: a feature"),  # heads of other than hidden_size / heads (Qwen3, Gemma)
    (dict(hidden_size=None), "hidden_size=None: missing"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0: must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size=-1: must be a positive integer"),
    (dict(intermediate_size=14336.5), "intermediate_size=14336.5: must be a positive integer"),
    (dict(num_attention_heads=True), "num_attention_heads=True: must be a positive integer"),
    (dict(num_key_value_heads="8"), "num_key_value_heads='8': must be a positive integer"),
    (dict(rope_theta=float("nan")), "rope_theta=nan: must be a positive number"),
    (dict(rope_theta=math.inf), "rope_theta=inf: must be a positive number"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false': must be true or false"),
    (dict(model_type="mixtral", num_local_experts=0), "num_local_experts=0: must be a positive integer"),
    (dict(num_key_value_heads=7), "n_heads=32 is not divisible by n_kv_heads=7"),
    (dict(num_hidden_layers=10 ** 400), "num_hidden_layers=~10^400 is past the bound of 10,000"),
    (dict(num_hidden_layers=10 ** 6), "num_hidden_layers=1,000,000 is past the bound of 10,000"),
    (dict(vocab_size=10 ** 30), "vocab_size=~10^30 is past the bound of 1,000,000"),
    (dict(hidden_size=10 ** 30), "hidden_size=~10^30 is past the bound of 1,000,000"),
    (dict(intermediate_size=1_000_001), "intermediate_size=1,000,001 is past the bound of 1,000,000"),
    # a misspelled key: transformers ignores it, and its size would be a default (here, 32 K/V heads)
    (dict(num_key_value_heads=None, num_key_value_head=8), "num_key_value_head: transformers reads no such key; is "
                                                           "it num_key_value_heads, which the file lacks?"),
    (dict(intermediate_size=None, intermediate_sizes=14336), "intermediate_sizes: transformers reads no such key; is "
                                                             "it intermediate_size, which the file lacks?"),
    (dict(rms_norm_eps=None, rms_norm_epsilon=1e-5), "rms_norm_epsilon: transformers reads no such key; is it "
                                                     "rms_norm_eps, which the file lacks?"),
])
def test_a_config_that_is_not_llama_shaped_or_nonsensical_is_one_line_naming_the_field(change, message):
    """Each size within a stated bound (01's MAX_LAYERS, MAX_WIDTH: far past any published model), so that a
    typo of 10^400 layers is a line, not a traceback (an OverflowError, a MemoryError) or an hour of planning."""
    config = {k: v for k, v in {**LLAMA3_8B, **change}.items() if v is not None or k == "model_type"}
    with pytest.raises(ValueError) as error:
        foundation.ModelConfig.from_hf(config, 8192)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value


RESIDUAL_OUTPUTS = ("attn.out_proj.weight", "mlp.down_proj.weight")
UNSCALED = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight")


@pytest.mark.parametrize("n_layers", [1, 3])
def test_init_std_of_each_parameter_group(n_layers):
    """GPT.reset_parameters' rule: norms 1; residual-branch outputs N(0, (init_std / sqrt(2 n_layers))^2);
    every other weight N(0, init_std^2), each drawn independently. The sample std of n normal values
    has relative standard error 1/sqrt(2(n-1)) and the mean std / sqrt(n): allow 5 of each (the
    smallest weight has 4096 values: 5.5% on the std); an unscaled residual is off by sqrt(2)."""
    cfg = foundation.ModelConfig(n_layers=n_layers, n_kv_heads=2, seed=1)
    model = foundation.GPT(cfg)
    params = dict(model.named_parameters())
    rule = {"embed.weight": cfg.init_std, "lm_head.weight": cfg.init_std, "norm.weight": None}
    for i in range(n_layers):
        rule.update({f"layers.{i}.{n}": cfg.init_std / math.sqrt(2 * n_layers) for n in RESIDUAL_OUTPUTS})
        rule.update({f"layers.{i}.{n}": cfg.init_std for n in UNSCALED})
        rule.update({f"layers.{i}.{n}_norm.weight": None for n in ("attn", "mlp")})
    assert params.keys() == rule.keys()
    for name, std in rule.items():
        p, n = params[name].detach().double(), params[name].numel()
        if std is None:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        assert abs(p.std().item() / std - 1) < 5 / math.sqrt(2 * (n - 1)), (name, p.std().item(), std)
        assert abs(p.mean().item()) < 5 * std / math.sqrt(n), name
    weights = [p.flatten()[:1024] for p in params.values() if p.dim() == 2]
    assert len({tuple(w.tolist()) for w in weights}) == len(weights), "weights must be drawn independently"


def reference_forward_float64(model, tokens: torch.Tensor, positions: torch.Tensor):
    """The GPT written out from its docstrings with plain tensor ops, in float64, from model's weights.
    Returns (hidden states after the last layer, logits)."""
    cfg, w = model.cfg, {name: p.detach().double() for name, p in model.named_parameters()}
    batch, seq = tokens.shape
    heads, kv_heads, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rmsnorm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    def project(x, name, n_heads):
        return (x @ w[name].T).view(batch, seq, n_heads, d)

    kv_of_head = torch.arange(heads) // (heads // kv_heads)  # query head j reads key/value head j // g
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    h = w["embed.weight"][tokens]
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        x = rmsnorm(h, w[pre + "attn_norm.weight"])
        q = rope_complex_float64(project(x, pre + "attn.q_proj.weight", heads), positions, cfg.rope_theta)
        k = rope_complex_float64(project(x, pre + "attn.k_proj.weight", kv_heads), positions, cfg.rope_theta)
        v = project(x, pre + "attn.v_proj.weight", kv_heads)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_of_head]) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
        attn = torch.einsum("bhqk,bkhd->bqhd", probs, v[:, :, kv_of_head]).reshape(batch, seq, heads * d)
        h = h + attn @ w[pre + "attn.out_proj.weight"].T
        x = rmsnorm(h, w[pre + "mlp_norm.weight"])
        gate = x @ w[pre + "mlp.gate_proj.weight"].T
        swiglu = gate * torch.sigmoid(gate) * (x @ w[pre + "mlp.up_proj.weight"].T)  # silu(gate) x up
        h = h + swiglu @ w[pre + "mlp.down_proj.weight"].T
    return h, rmsnorm(h, w["norm.weight"]) @ w["lm_head.weight"].T


@given(cfg=gqa_model_configs(), seq_len=st.integers(1, 10), offset=st.integers(0, 50))
def test_logits_equal_a_float64_implementation_of_the_same_weights(cfg, seq_len, offset):
    """Weights are redrawn at std 1/sqrt(fan_in) and norm weights around 1, so attention is sharp and
    every part of the forward moves the logits by O(1): at the init std attention is near uniform
    and a wrong score would hide. fp32 against float64 over 200 configurations: measured <= 5.0e-6
    on logits (up to 16 in size) and 7.9e-6 on hidden states; allow 1e-4 (+ rtol 1e-5)."""
    model = foundation.GPT(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[1] if p.dim() == 2 and name != "embed.weight" else 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in) + (1.0 if p.dim() == 1 else 0.0))
    tokens, targets = foundation.synthetic_batch(cfg, 2, seq_len, step=0)
    positions = torch.arange(seq_len) + offset
    hidden, logits = reference_forward_float64(model, tokens, positions)
    tolerance = dict(atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions=positions).double(), logits, **tolerance)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        torch.testing.assert_close(model(tokens, targets, positions).double(), loss, **tolerance)
        model.loss_fn = lambda lg, tg: (lg, tg)  # the hook receives the logits and the targets as they are
        hooked_logits, hooked_targets = model(tokens, targets, positions)
        torch.testing.assert_close(hooked_logits.double(), logits, **tolerance)
        assert torch.equal(hooked_targets, targets)
        model.lm_head = None  # a stage without the head returns the last hidden states
        torch.testing.assert_close(model(tokens, positions=positions).double(), hidden, **tolerance)


def test_make_optimizer_is_adamw_with_the_documented_hyperparameters():
    model = foundation.GPT(foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32))
    optimizer = foundation.make_optimizer(model, lr=3e-4, eps=1e-6)
    assert type(optimizer) is torch.optim.AdamW and len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    hyperparameters = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    assert hyperparameters == (3e-4, 1e-6, 0.1, (0.9, 0.999))


def test_at_seq_len_1_queries_and_keys_get_rounding_noise_which_the_demos_say():
    """A softmax over one score is 1 whatever the score: at seq_len 1 q_proj's and k_proj's gradients are
    rounding noise (measured ~1e-10 against v_proj's ~0.1), which AdamW scales to lr-sized steps; at seq_len
    2 they are real (~1e-3). The demos print lone_token_note, which says so, at seq_len 1 only."""
    cfg = foundation.ModelConfig()
    model = foundation.GPT(cfg)
    for seq_len, bound in ((1, lambda q, v: q < 1e-6 * v), (2, lambda q, v: q > 1e-3 * v)):
        model.zero_grad()
        model(*foundation.synthetic_batch(cfg, 16, seq_len, 0, 0, 1)).backward()
        for layer in model.layers.values():
            v = layer.attn.v_proj.weight.grad.abs().max()
            for noise in (layer.attn.q_proj.weight.grad, layer.attn.k_proj.weight.grad):
                assert bound(noise.abs().max(), v), (seq_len, noise.abs().max(), v)
    assert "q_proj and\nk_proj get gradients of rounding noise" in foundation.lone_token_note(1)
    assert foundation.lone_token_note(2) == ""


def test_training_steps_are_adamw_steps_with_the_given_lr_and_eps(rank_pool):
    """AdamW's first step, written out: bias-corrected m = g and v = g^2, so
    p <- p (1 - lr wd) - lr g / (|g| + eps). With eps = 1e-3, comparable to the gradients, an eps
    that does not reach AdamW (1e-8 instead) moves a parameter by lr eps / (|g| + eps): measured
    >= 4e-3 per tensor over 10 seeds, against fp32 rounding <= 7.2e-8; allow 5e-7."""
    cfg, lr, eps, wd = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32), 1e-2, 1e-3, 0.1
    initial = foundation.cpu_copy(foundation.GPT(cfg).named_parameters())
    runs = {"single device": foundation.train_single_device(cfg, 1, 4, 6, lr=lr, adam_eps=eps)}
    for mode in foundation.DP_MODES:
        runs[mode] = rank_pool.run(2, foundation.train_data_parallel, cfg, 1, 4, 6, mode=mode, lr=lr,
                                   adam_eps=eps)[0][0]
    for run, result in runs.items():
        for name, g in result.first_grads.items():
            g, p = g.double(), initial[name].double()
            expected = p * (1 - lr * wd) - lr * g / (g.abs() + eps)
            torch.testing.assert_close(result.params[name].double(), expected, atol=5e-7, rtol=0,
                                       msg=lambda m, name=name, run=run: f"{run}, {name}: {m}")


def test_the_reference_clips_by_the_global_norm_and_at_inf_is_the_plain_adamw_loop():
    """clip_grad_norm_ at max_grad_norm = inf scales by exactly 1: the same bits as the loop without
    it (written out here). The norm it records is the step-0 gradients' global norm; clipped to a
    tenth of it, AdamW's first step is that of g / 10 (the first-step formula of the test above:
    with eps = 1e-3, comparable to the gradients, an unclipped g moves parameters >= 1e-4 away)."""
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    model = foundation.GPT(cfg)
    optimizer, losses = foundation.make_optimizer(model, 1e-3, ADAM_EPS), []
    for step in range(3):
        loss = model(*foundation.synthetic_batch(cfg, 4, 6, step))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    reference = foundation.train_single_device(cfg, 3, 4, 6, adam_eps=ADAM_EPS)
    assert reference.losses == losses
    assert all(torch.equal(reference.params[name], p) for name, p in model.named_parameters())
    norm = math.sqrt(sum(g.double().square().sum().item() for g in reference.first_grads.values()))
    assert reference.grad_norms[0] == pytest.approx(norm, rel=1e-6)
    lr, eps, wd = 1e-2, 1e-3, 0.1
    clipped = foundation.train_single_device(cfg, 1, 4, 6, lr=lr, adam_eps=eps, max_grad_norm=norm / 10)
    scale = (norm / 10) / (norm + 1e-6)  # clip_grad_norm_'s factor (its 1e-6 guards a zero norm)
    for name, p in foundation.GPT(cfg).named_parameters():
        g = clipped.first_grads[name].double() * scale
        expected = p.detach().double() * (1 - lr * wd) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(clipped.params[name].double(), expected, atol=5e-7, rtol=0)


# --- the comm meter ---------------------------------------------------------------------------

def exercise_collectives() -> dict:
    """Every wrapper, on the world group and on the subgroup of the last two ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pair = (n - 2, n - 1)
    sub = dist.new_group(list(pair))
    out = {}
    with foundation.comm_meter() as meter:
        t = torch.full((4,), float(rank + 1))
        foundation.all_reduce(t, async_op=True).wait()
        out["all_reduce"] = t
        gathered = torch.empty(2 * n)
        foundation.all_gather(gathered, torch.tensor([rank, 10.0 * rank]))
        out["all_gather"] = gathered
        shard = torch.empty(2)
        foundation.reduce_scatter(shard, torch.arange(2.0 * n) * (rank + 1))
        out["reduce_scatter"] = shard
        # uneven all-to-all: rank r sends j + 1 rows to rank j, each row filled with 100 r + j
        inp = torch.cat([torch.full((j + 1, 2), 100.0 * rank + j) for j in range(n)])
        received = torch.empty(n * (rank + 1), 2)
        foundation.all_to_all(received, inp, [rank + 1] * n, [j + 1 for j in range(n)])
        out["all_to_all"] = received
        even = torch.empty(n)  # even splits: one element to each rank
        foundation.all_to_all(even, torch.arange(n) + 10.0 * rank)
        out["all_to_all_even"] = even
        # a ring shift with batched p2p: send to the right, receive from the left
        from_left = torch.empty(2)
        for work in foundation.batch_p2p([("send", torch.full((2,), float(rank)), (rank + 1) % n),
                                          ("recv", from_left, (rank - 1) % n)]):
            work.wait()
        out["ring"] = from_left
        if rank in pair:
            b = torch.full((3,), float(rank))
            foundation.broadcast(b, src=1, group=sub)  # group rank 1 = global rank n - 1
            out["broadcast"] = b
            msg = torch.full((5,), 7.0) if rank == pair[0] else torch.empty(5)
            op = ("send", msg, 1) if rank == pair[0] else ("recv", msg, 0)  # peers: group ranks
            for work in foundation.batch_p2p([op], group=sub):
                work.wait()
            out["send_recv"] = msg
    out["meter"] = meter
    return out


class CoalescedWork:
    """What torch's batch_isend_irecv returns on CUDA: one work for the whole batch (NCCL's), which may be
    waited for again (a gloo work may not: a second wait of a receive waits for another message)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        while self.works:
            self.works.pop().wait()
        return True


def coalesced_p2p_works() -> tuple[list[bool], list[float]]:
    """On 2 ranks, batch_p2p of a send to the other rank and a receive from it, torch's batch_isend_irecv
    answering as on CUDA: whether each op got the batch's work, and what arrived."""
    peer = 1 - dist.get_rank()
    received = torch.empty(2)
    ops = [("send", torch.full((2,), float(dist.get_rank())), peer), ("recv", received, peer)]
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda p2p_ops: [CoalescedWork(batch(p2p_ops))]
    try:
        works = foundation.batch_p2p(ops)
    finally:
        dist.batch_isend_irecv = batch
    for work in works:
        work.wait()
    return [work is works[0] for work in works], received.tolist()


def test_a_coalesced_batch_gives_each_op_its_work(rank_pool):
    """On CUDA, torch's batch_isend_irecv returns one work for a whole batch (NCCL coalesces it), where
    gloo returns one an op: 04's executor zips the works with the ops (strict), which raised for any batch
    of two on a GPU (a review's find; no test had two GPUs). batch_p2p now gives each op a work."""
    assert rank_pool.run(2, coalesced_p2p_works) == [([True, True], [1.0, 1.0]), ([True, True], [0.0, 0.0])]


@pytest.mark.parametrize("n", [3, 4])
def test_collective_wrappers_compute_and_count(rank_pool, n):
    world, pair, f = tuple(range(n)), (n - 2, n - 1), 4  # f: bytes per fp32 element
    for rank, out in enumerate(rank_pool.run(n, exercise_collectives)):
        assert torch.equal(out["all_reduce"], torch.full((4,), n * (n + 1) / 2))  # sum of rank + 1
        assert torch.equal(out["all_gather"], torch.tensor([[r, 10.0 * r] for r in world]).flatten())
        rank_sum = n * (n + 1) / 2  # sum over ranks of (rank + 1)
        assert torch.equal(out["reduce_scatter"], torch.tensor([2.0 * rank, 2.0 * rank + 1]) * rank_sum)
        expected = torch.cat([torch.full((rank + 1, 2), 100.0 * src + rank) for src in world])
        assert torch.equal(out["all_to_all"], expected)
        assert torch.equal(out["all_to_all_even"], torch.tensor([10.0 * src + rank for src in world]))
        assert torch.equal(out["ring"], torch.full((2,), float((rank - 1) % n)))
        if rank in pair:
            assert torch.equal(out["broadcast"], torch.full((3,), float(pair[1])))
            assert torch.equal(out["send_recv"], torch.full((5,), 7.0))
        m = out["meter"]
        assert (m.calls("all_reduce"), m.payload("all_reduce")) == (1, 4 * f)
        assert m.traffic("all_reduce") == Fraction(2 * (n - 1), n) * 4 * f
        assert m.payload("all_gather") == 2 * n * f
        assert m.traffic("all_gather") == Fraction(n - 1, n) * 2 * n * f
        assert m.traffic("reduce_scatter") == Fraction(n - 1, n) * 2 * n * f
        uneven_rows, kept_rows = n * (n + 1) // 2, rank + 1
        assert m.payload("all_to_all") == (2 * uneven_rows + n) * f
        assert m.traffic("all_to_all") == (2 * (uneven_rows - kept_rows) + (n - 1)) * f
        on_pair = rank in pair
        assert (m.payload("broadcast"), m.traffic("broadcast")) == ((3 * f, 3 * f) if on_pair else (0, 0))
        assert m.traffic("send") == 2 * f + (5 * f if rank == pair[0] else 0)
        assert m.payload("recv") == 2 * f + (5 * f if rank == pair[1] else 0)
        assert m.traffic("recv") == 0, "traffic counts what a rank sends"
        assert m.calls(group=world) == 7, "all_reduce, all_gather, reduce_scatter, 2 all_to_all, send, recv"
        assert m.calls(group=pair) == (2 if on_pair else 0)
        assert {ranks for _, ranks in m.stats} == ({world, pair} if on_pair else {world})


def test_meters_add_up_per_operation_and_group():
    """meter += other: a run's meter from its steps' meters (lessons 02, 08, 09)."""
    run, step = foundation.CommMeter(), foundation.CommMeter()
    run.stats["all_reduce", (0, 1)] = foundation.OpStats(1, 8, Fraction(8))
    step.stats["all_reduce", (0, 1)] = foundation.OpStats(2, 16, Fraction(16))
    step.stats["send", (0, 1)] = foundation.OpStats(1, 4, Fraction(4))
    total = run
    total += step
    assert total is run and (run.calls("all_reduce"), run.payload(), run.traffic("send", (0, 1))) == (3, 28, 4)
    assert step.calls() == 3 and step.payload() == 20, "the added meter is left as it was"


# --- data parallelism equals one device --------------------------------------------------------

def assert_matches_reference(result, reference) -> None:
    assert result.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
    assert result.first_grads.keys() == reference.first_grads.keys()
    for name, grad in reference.first_grads.items():
        torch.testing.assert_close(result.first_grads[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    for name, param in reference.params.items():
        torch.testing.assert_close(result.params[name], param, atol=PARAM_ATOL, rtol=0,
                                   msg=lambda m, name=name: f"parameter {name} after training: {m}")


@given(cfg=model_configs(), world=st.integers(1, 4), mode=st.sampled_from(foundation.DP_MODES),
       accum=st.integers(1, 3), per_micro=st.integers(1, 2), seq_len=st.integers(1, 10),
       bucket_bytes=st.sampled_from([64, 1000, 4096, 1 << 20]))
def test_data_parallel_equals_single_device(rank_pool, cfg, world, mode, accum, per_micro, seq_len,
                                            bucket_bytes):
    steps, global_batch = 3, world * accum * per_micro
    runs = rank_pool.run(world, foundation.train_data_parallel, cfg, steps, global_batch, seq_len, mode=mode,
                         accum_steps=accum, bucket_bytes=bucket_bytes, adam_eps=ADAM_EPS)
    reference = foundation.train_single_device(cfg, steps, global_batch, seq_len, adam_eps=ADAM_EPS)
    assert_matches_reference(runs[0][0], reference)
    for rank, (result, _) in enumerate(runs[1:], start=1):
        for name, param in runs[0][0].params.items():
            assert torch.equal(result.params[name], param), f"rank {rank} drifted on {name}"

    # The meter: each gradient element is all-reduced exactly once per optimizer step, whatever the
    # accumulation, and the ring traffic is 2(N-1)/N of that.
    grad_bytes = sum(p.numel() * p.element_size() for p in reference.params.values())
    tensors = len(reference.params)
    for result, meter in runs:
        assert meter.payload("all_reduce") == steps * grad_bytes
        assert meter.traffic("all_reduce") == Fraction(2 * (world - 1), world) * steps * grad_bytes
        assert meter.calls() == meter.calls("all_reduce"), "only all-reduces during training"
        if mode == "naive":
            assert meter.calls("all_reduce") == steps * tensors
        else:
            buckets = result.stats["buckets"]
            largest = max(p.numel() * p.element_size() for p in reference.params.values())
            assert math.ceil(grad_bytes / max(bucket_bytes, largest)) <= buckets <= tensors
            assert meter.calls("all_reduce") == steps * buckets


def bucket_layout_after_one_backward(cfg, bucket_bytes):
    model = foundation.GPT(cfg)
    wrapper = foundation.BucketedDataParallel(model, bucket_bytes=bucket_bytes)
    tokens, targets = foundation.synthetic_batch(cfg, 2, 8, 0, dist.get_rank(), dist.get_world_size())
    model(tokens, targets).backward()
    launched_by_hooks = [bucket.work is not None for bucket in wrapper.buckets]
    wrapper.finish_gradient_sync()
    names = {p: n for n, p in model.named_parameters()}
    return launched_by_hooks, [[names[p] for p in bucket.params] for bucket in wrapper.buckets]


@given(bucket_bytes=st.sampled_from([1, 3000, 20_000, 1 << 30]))
def test_buckets_fill_in_reverse_order_and_launch_during_backward(rank_pool, bucket_bytes):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=64)
    launched, buckets = rank_pool.run(2, bucket_layout_after_one_backward, cfg, bucket_bytes)[0]
    assert all(launched), "every all-reduce must start inside backward, before anyone waits"
    reference = foundation.GPT(cfg)
    sizes = {n: p.numel() * 4 for n, p in reference.named_parameters()}
    assert [n for bucket in buckets for n in bucket] == list(reversed(sizes))
    for bucket in buckets:
        assert len(bucket) == 1 or sum(sizes[n] for n in bucket) <= bucket_bytes
    for this, following in zip(buckets, buckets[1:], strict=False):  # greedy: the next tensor did not fit
        assert sum(sizes[n] for n in this) + sizes[following[0]] > bucket_bytes


def broadcast_after_perturbing(cfg):
    """Every rank's weights differ; then the group {1, 2} (of 3 ranks) syncs from its rank 0."""
    model = foundation.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())
    group = dist.new_group([1, 2])
    if dist.get_rank() in (1, 2):
        foundation.BucketedDataParallel(model, group, bucket_bytes=4096)
    return foundation.cpu_copy(model.named_parameters())


def test_wrapping_broadcasts_from_the_groups_first_rank(rank_pool):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    params = rank_pool.run(3, broadcast_after_perturbing, cfg)
    initial = foundation.cpu_copy(foundation.GPT(cfg).named_parameters())
    for name, value in initial.items():
        assert torch.equal(params[0][name], value), "rank 0 is outside the group: untouched"
        assert torch.equal(params[1][name], value + 1), "rank 1 is the group's rank 0: the source"
        assert torch.equal(params[2][name], value + 1), f"rank 2 did not receive {name}"


def launches_when_gradients_arrive_out_of_order(cfg):
    """Feed gradients to the hooks by hand, the second bucket's first: nothing may launch until the
    first bucket is full (ranks must issue collectives in the same order), then both launch."""
    model = foundation.GPT(cfg)
    wrapper = foundation.BucketedDataParallel(model, bucket_bytes=1)  # one parameter per bucket
    first, second = wrapper.buckets[0].params[0], wrapper.buckets[1].params[0]
    launched = []
    for param in (second, first):
        param.grad = torch.ones_like(param)
        wrapper._on_grad_ready(param)
        launched.append(wrapper.next_to_launch)
    for param in model.parameters():  # the rest, so that finish_gradient_sync can wait on all
        if param.grad is None:
            param.grad = torch.ones_like(param)
            wrapper._on_grad_ready(param)
    wrapper.finish_gradient_sync()
    return launched, first.grad.unique().tolist()


def test_buckets_launch_in_order_even_if_a_later_one_fills_first(rank_pool):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    for launched, averaged in rank_pool.run(2, launches_when_gradients_arrive_out_of_order, cfg):
        assert launched == [0, 2], "bucket 1 launched before bucket 0, or bucket 0 did not release it"
        assert averaged == [1.0], "ones on both ranks average to ones"


class LandingWork:
    """An async all-reduce's work whose sum lands in its buffer when waited for (an async one may
    land any time before that), or at once if done."""

    def __init__(self, buffer: torch.Tensor, summed: torch.Tensor, done: bool = False) -> None:
        self.buffer, self.summed, self.done = buffer, summed, False
        if done:
            self.wait()

    def wait(self) -> bool:
        self.buffer.copy_(self.summed)
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def test_unpack_waits_then_averages_each_view_into_its_gradient_and_empties_the_bucket():
    """unpack waits for the all-reduce before it reads the buffer, divides by the world size, copies
    each view into its own parameter's .grad, and leaves no slot ready and no work for the next step."""
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    bucket = foundation.GradBucket(params)
    for p in params:
        p.grad = torch.full_like(p, 7.0)  # this rank's own gradient
        bucket.add(p)
    summed = torch.arange(7.0)  # the group's sum, not yet landed
    bucket.work = LandingWork(bucket.buffer, summed)
    bucket.unpack(4)
    assert torch.equal(params[0].grad, summed[:4].view(2, 2) / 4)
    assert torch.equal(params[1].grad, summed[4:] / 4)
    assert bucket.ready == set() and bucket.work is None


def most_in_flight_in_one_backward(done: bool) -> tuple[int, int]:
    """One backward under BucketedDataParallel, a bucket a parameter, its all-reduces' works landing
    only when waited for (done=False) or at once: (max_in_flight, the number of buckets)."""
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    model = foundation.GPT(cfg)
    wrapper = foundation.BucketedDataParallel(model, bucket_bytes=1)

    def launch(tensor, group=None, async_op=False):
        return LandingWork(tensor, tensor.clone(), done)  # one rank: the sum is its own gradient

    real = foundation.all_reduce
    foundation.all_reduce = launch
    try:
        model(*foundation.synthetic_batch(cfg, 2, 4, 0)).backward()
    finally:
        foundation.all_reduce = real
    wrapper.finish_gradient_sync()
    return wrapper.max_in_flight, len(wrapper.buckets)


def test_max_in_flight_counts_the_launched_all_reduces_not_yet_finished(rank_pool):
    [(pending, buckets)] = rank_pool.run(1, most_in_flight_in_one_backward, False)
    assert pending == buckets, "none finishes before the wait: every bucket is in flight at the end"
    [(finished, _)] = rank_pool.run(1, most_in_flight_in_one_backward, True)
    assert finished == 0, "each finished as it launched: never one in flight"


def naive_average_in_groups_of_two_and_one() -> float:
    """3 ranks in groups {0, 1} and {2}; rank r's only gradient is r + 1, frozen one aside."""
    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # every rank creates every group
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight.grad = torch.full((1, 1), dist.get_rank() + 1.0)
    frozen = torch.nn.Linear(1, 1, bias=False).requires_grad_(False)
    model.add_module("frozen", frozen)
    foundation.all_reduce_gradients(model, groups[dist.get_rank() // 2])
    return model.weight.grad.item()


def test_naive_averaging_stays_within_its_group(rank_pool):
    """The mean over the rank's own group: (1 + 2) / 2 on ranks 0 and 1, 3 alone on rank 2. Over the
    world (or divided by the world's size) every rank would get 2.0 (or 1.0, 1.0, 1.0)."""
    assert rank_pool.run(3, naive_average_in_groups_of_two_and_one) == [1.5, 1.5, 3.0]


def train_on_strided_subgroups(cfg, steps, global_batch, seq_len):
    """4 ranks, two data-parallel groups {0, 2} and {1, 3}: nothing may assume the world group."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[dist.get_rank() % 2]
    return foundation.train_data_parallel(cfg, steps, global_batch, seq_len, mode="bucketed", accum_steps=2,
                                          bucket_bytes=2048, adam_eps=ADAM_EPS, group=group)


def test_data_parallel_on_a_subgroup(rank_pool):
    cfg, steps, global_batch, seq_len = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, seed=5), 3, 4, 6
    runs = rank_pool.run(4, train_on_strided_subgroups, cfg, steps, global_batch, seq_len)
    reference = foundation.train_single_device(cfg, steps, global_batch, seq_len, adam_eps=ADAM_EPS)
    for rank, (result, meter) in enumerate(runs):
        assert_matches_reference(result, reference)
        group = (0, 2) if rank % 2 == 0 else (1, 3)
        assert {ranks for _, ranks in meter.stats} == {group}


def bucketed_step(model, group, batch):
    ddp = foundation.BucketedDataParallel(model, group, bucket_bytes=2048)
    loss = model(*batch)
    loss.backward()
    ddp.finish_gradient_sync()
    return ddp, loss


def left_alive_after_a_step(cfg, wrap_and_step) -> list[str]:
    """Which of a wrapper and its model, after a step on a group of their own, outlive the last
    reference to them and a garbage collection. The model keeps the step's loss, its graph with it,
    as 06's MoE layer keeps its aux loss."""
    group = dist.new_group(list(range(dist.get_world_size())))
    model = foundation.GPT(cfg)
    batch = foundation.synthetic_batch(cfg, 4, 6, 0, dist.get_rank(), dist.get_world_size())
    wrapper, model.last_loss = wrap_and_step(model, group, batch)
    references = {"wrapper": weakref.ref(wrapper), "model": weakref.ref(model)}
    del wrapper, model
    gc.collect()
    return sorted(name for name, reference in references.items() if reference() is not None)


def test_a_dropped_wrapper_frees_its_model(rank_pool):
    """A notebook's second model, a job that evaluates many checkpoints, a worker that trains again:
    each needs the first wrapper freed, with its model and, once destroyed, its process group (an idle
    gloo group keeps a thread that wakes every millisecond). torch keeps post-accumulate-grad hooks
    where the garbage collector cannot look (weak_hook): with hooks that held the wrapper, the
    wrapper and the model stayed alive (measured), and the group's threads with them."""
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32)
    assert rank_pool.run(2, left_alive_after_a_step, cfg, bucketed_step) == [[], []]


@pytest.mark.parametrize("kwargs, message", [
    (dict(global_batch=10, accum_steps=2), r"global_batch=10 is not divisible by 2 ranks x "
                                           r"accum_steps=2 = 4"),
    (dict(global_batch=4, accum_steps=0), r"accum_steps=0 must be >= 1"),
    (dict(global_batch=4, mode="ring"), r"mode='ring' must be one of"),
    (dict(global_batch=4, bucket_bytes=0), r"bucket_bytes=0 must be positive"),
])
def test_bad_configuration_fails_on_every_rank_without_hanging(rank_pool, kwargs, message):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32)
    kwargs = dict(kwargs)  # parametrize shares the dict between reruns
    global_batch = kwargs.pop("global_batch")
    rank_pool.expect_invalid(2, foundation.train_data_parallel, cfg, 1, global_batch, 4, match=message,
                             **kwargs)


def grads_with_a_frozen_embedding(cfg, mode, unused_trainable=False):
    """One synced step with embed.weight frozen (and, if asked, a trainable parameter that gets no
    gradient): the gradients, or the error message."""
    model = foundation.GPT(cfg)
    model.embed.weight.requires_grad_(False)
    if unused_trainable:
        model.unused = torch.nn.Parameter(torch.zeros(3))
    wrapper = foundation.BucketedDataParallel(model, bucket_bytes=2048) if mode == "bucketed" else None
    tokens, targets = foundation.synthetic_batch(cfg, 4, 6, 0, dist.get_rank(), dist.get_world_size())
    model(tokens, targets).backward()
    try:  # every rank fails at the same parameter, after the same collectives: the group stays usable
        wrapper.finish_gradient_sync() if wrapper else foundation.all_reduce_gradients(model)
    except RuntimeError as error:
        return str(error)
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", foundation.DP_MODES)
def test_frozen_parameters_are_skipped_and_unused_trainable_ones_refused(rank_pool, mode):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    model = foundation.GPT(cfg)
    model.embed.weight.requires_grad_(False)
    tokens, targets = foundation.synthetic_batch(cfg, 4, 6, 0)
    model(tokens, targets).backward()
    for grads in rank_pool.run(2, grads_with_a_frozen_embedding, cfg, mode):
        assert grads["embed.weight"] is None
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads[name], p.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for message in rank_pool.run(2, grads_with_a_frozen_embedding, cfg, mode, unused_trainable=True):
        assert "got no gradient" in message and "unused" in message


def wrap_twice(cfg):
    model = foundation.GPT(cfg)
    foundation.BucketedDataParallel(model)
    foundation.BucketedDataParallel(model)  # a re-run notebook cell


def test_wrapping_a_model_twice_fails_when_built(rank_pool):
    with pytest.raises(RankFailure) as failure:
        rank_pool.run(2, wrap_twice, foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32))
    for tb in failure.value.errors.values():
        assert "ValueError: cannot wrap with BucketedDataParallel: this model's gradients are already " \
               "synchronised by BucketedDataParallel" in tb


def test_wrapping_a_model_without_trainable_parameters_fails_and_claims_nothing():
    model = foundation.GPT(foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32)).requires_grad_(False)
    with pytest.raises(ValueError, match=r"^the model has no trainable parameter \(requires_grad=True\)"):
        foundation.BucketedDataParallel(model)  # before any collective: no process group is needed
    assert not hasattr(model, "gradient_sync_owner"), "a failed build must not claim the model"


def accumulate_with_a_frozen_embedding_then_misuse(cfg):
    """Two micro-steps, the first under no_sync(), with embed.weight frozen: the averaged gradients.
    Then the pattern's two slips, each an error on every rank: a step whose backward passes all ran
    under no_sync(), and a second backward before finish_gradient_sync()."""
    model = foundation.GPT(cfg)
    model.embed.weight.requires_grad_(False)
    wrapper = foundation.BucketedDataParallel(model, bucket_bytes=2048)
    tokens, targets = foundation.synthetic_batch(cfg, 4, 6, 0, dist.get_rank(), dist.get_world_size())
    with wrapper.no_sync():
        (model(tokens[:1], targets[:1]) / 2).backward()
    (model(tokens[1:], targets[1:]) / 2).backward()
    wrapper.finish_gradient_sync()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    errors = []
    for outside_no_sync in (0, 2):
        model.zero_grad(set_to_none=True)
        with wrapper.no_sync():
            model(tokens, targets).backward()
        try:
            for _ in range(outside_no_sync):
                model(tokens, targets).backward()
            wrapper.finish_gradient_sync()
        except RuntimeError as error:
            errors.append(str(error))
    for bucket in wrapper.buckets:  # the first backward's all-reduces, launched on every rank alike
        bucket.work.wait()
    return grads, errors


def test_accumulation_skips_frozen_parameters_and_refuses_a_backward_out_of_place(rank_pool):
    cfg = foundation.ModelConfig(dim=16, n_heads=2, ffn_dim=32, vocab_size=32)
    model = foundation.GPT(cfg)
    model.embed.weight.requires_grad_(False)
    model(*foundation.synthetic_batch(cfg, 4, 6, 0)).backward()
    for grads, errors in rank_pool.run(2, accumulate_with_a_frozen_embedding_then_misuse, cfg):
        assert grads["embed.weight"] is None
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads[name], p.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL)
        assert len(errors) == 2 and "no gradient reached the buckets" in errors[0], errors
        assert "a second backward outside no_sync() before finish_gradient_sync()" in errors[1], errors


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
TORCHRUN_8_RANKS_4_PER_NODE = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
TOO_MANY = MEMORY // foundation.LOCAL_PROCESS_BYTES + 1  # local processes: one more than this machine holds


@pytest.mark.parametrize("env, nproc, gpus, message", [
    ({"WORLD_SIZE": "1"}, 3, 0, "--global-batch 16 is not divisible by 3 ranks x --accum 2 = 6"),
    ({"RANK": "0"}, 2, 0, "RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not: a partial torchrun "
                          "environment (run under torchrun, or unset RANK to launch 2 local processes)"),
    ({}, 2, 1, "2 ranks on this node need a GPU each, but 1 is visible: run at most 1 per node, or "
               "CUDA_VISIBLE_DEVICES= to run on the CPU"),
    (TORCHRUN_8_RANKS_4_PER_NODE, 1, 2, "4 ranks on this node need a GPU each, but 2 are visible: run at "
                                        "most 2 per node, or CUDA_VISIBLE_DEVICES= to run on the CPU"),
    ({"RANK": "0", "WORLD_SIZE": "16", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 1, 8,
     "--global-batch 16 is not divisible by 16 ranks x --accum 2 = 32"),
    ({}, TOO_MANY, 0, f"--nproc {TOO_MANY} would need at least {TOO_MANY * foundation.LOCAL_PROCESS_BYTES:,} "
                      f"bytes ({TOO_MANY} local processes of Python and torch, 220 MiB each); this machine has "
                      f"{MEMORY:,}"),
    ({"RANK": "0", "WORLD_SIZE": str(TOO_MANY), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 1, 0,
     f"--global-batch 16 is not divisible by {TOO_MANY} ranks x --accum 2 = {2 * TOO_MANY}"),
], ids=["stray WORLD_SIZE", "partial torchrun environment", "more local ranks than GPUs",
        "torchrun: more ranks per node than GPUs", "ranks per node unknown: no GPU check",
        "more local processes than this machine holds", "torchrun's ranks, on many nodes: no local bound"])
def test_launcher_checks_the_world_that_will_run_in_one_line(monkeypatch, capsys, env, nproc, gpus, message):
    """The defaults (global batch 16, accum 2) are checked against the ranks that would really start,
    before any starts: a stray WORLD_SIZE is not what local processes get; RANK alone is no torchrun;
    with CUDA (faked: `gpus`) each rank of a node needs its own GPU (a lent H200 found 09's default
    dp 2 x tp 2 mesh failing inside the ranks on its one GPU, with a traceback from each)."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(sys, "argv", ["01_ddp.py", "--nproc", str(nproc)])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    with pytest.raises(SystemExit) as exit_:
        foundation.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"01_ddp.py: error: {message}\n"


@pytest.mark.parametrize("ctrl_c", [signal.default_int_handler, signal.SIG_IGN], ids=["Ctrl-C", "`cmd &`"])
def test_launch_handles_its_signals_while_the_ranks_run_and_gives_the_handlers_back(monkeypatch, ctrl_c):
    """While the ranks run, launch's StopOnce takes SIGTERM, and SIGINT unless it was ignored (a shell's
    `cmd &`: Ctrl-C at the terminal is not for it); on a normal return both handlers are as before.
    The ranks here are a stand-in whose join reports the handlers it meets."""
    met = []

    class Ranks:
        processes = []

        def join(self, grace_period):
            met.append({signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)})
            return True

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(foundation.mp, "start_processes", lambda *args, **kwargs: Ranks())
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, ctrl_c)
    try:
        foundation.launch(print, nproc=2)
        after = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])
    [during] = met
    assert isinstance(during[signal.SIGTERM], foundation.StopOnce)
    assert during[signal.SIGINT] is signal.SIG_IGN if ctrl_c is signal.SIG_IGN else isinstance(
        during[signal.SIGINT], foundation.StopOnce)
    assert after == {signal.SIGINT: ctrl_c, signal.SIGTERM: before[signal.SIGTERM]}


def test_a_rank_killed_by_a_signal_is_one_line_not_a_traceback(monkeypatch, capsys):
    """03 --batch 100000 passed the memory rule (it counts no activations) and the kernel killed a rank:
    torch's ProcessExitedException ended the launcher in a traceback (helper-48). Now one line naming the
    rank and the signal (SIGKILL: out of memory, most likely), exit 128 + its number, as a shell says."""
    class Ranks:
        processes = []

        def join(self, grace_period):
            raise foundation.mp.ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1,
                                                       error_pid=99, exit_code=-signal.SIGKILL)

    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(foundation.mp, "start_processes", lambda *args, **kwargs: Ranks())
    monkeypatch.setattr(sys, "argv", ["03_tensor_parallel.py"])
    with pytest.raises(SystemExit) as exit_:
        foundation.launch(print, nproc=2)
    assert exit_.value.code == 128 + signal.SIGKILL
    assert capsys.readouterr().err == ("03_tensor_parallel.py: error: rank 1 was killed by SIGKILL (the system out "
                                       "of memory, most likely: smaller sizes, or fewer ranks)\n")


def test_ctrl_c_while_the_ranks_start_is_one_line_not_their_tracebacks():
    """Ctrl-C (SIGINT to the whole process group) while the spawned ranks still import torch: each printed
    a KeyboardInterrupt traceback of ~60 lines (helper-48), spawn's bootstrap catching none. launch starts
    them with SIGINT ignored; they listen once running (_launched_rank). The launcher stops them and says
    so in its one line, exit 130. It is sent once the launcher listens again (its SigIgn in /proc): sent in
    the instant it forks, it is ignored there too, and the run goes on (1 suite run of the last 4 failed so)."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (test_09's)
    try:
        proc = subprocess.Popen([sys.executable, "01_ddp.py", "--nproc", "2", "--steps", "3"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(spawned(proc.pid)) < 2 or ignores_sigint(proc.pid)):
            time.sleep(0.02)
        assert len(spawned(proc.pid)) == 2 and not ignores_sigint(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
        assert proc.returncode == 130 and "Traceback" not in err, err
        assert err.rstrip().endswith("interrupted: the 2 local ranks stopped"), err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def ignores_sigint(pid: int) -> bool:
    """Whether the process ignores SIGINT now (its SigIgn mask in /proc)."""
    ignored = re.search(r"^SigIgn:\s*([0-9a-f]+)$", open(f"/proc/{pid}/status").read(), re.M).group(1)
    return bool(int(ignored, 16) >> (signal.SIGINT - 1) & 1)


def spawned(pid: int) -> list[str]:
    """The ranks a launcher spawned (multiprocessing's spawn_main), by pid."""
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def test_launch_world_size(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert foundation.launch_world_size(3) == 3, "local processes get their own WORLD_SIZE"
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="RANK is set but MASTER_ADDR, MASTER_PORT not"):
        foundation.launch(print, "a rank ran", nproc=3)  # before fn runs, in one process or in many
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert foundation.launch_world_size(3) == 1, "under torchrun, torchrun's world size"
    # An edge hunt's environments typed by hand: a rank with no peer to come waited 120 s in silence, then
    # a C++ stack; WORLD_SIZE=0 divided by zero; RANK=x was int()'s traceback. Now each is one line.
    for name, value, message in (("RANK", "5", "RANK=5 must be below WORLD_SIZE=1"),
                                 ("WORLD_SIZE", "0", "RANK=0 must be below WORLD_SIZE=0"),
                                 ("RANK", "x", "RANK='x' is not a number"),
                                 ("MASTER_PORT", "notaport", "MASTER_PORT='notaport' is not a number")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(ValueError, match=re.escape(message)):
                foundation.launch_world_size(3)


def test_ctrl_c_in_a_lesson_of_one_process_is_one_line_and_exit_130(monkeypatch, capsys):
    """07 and 08's single run a demo in this process: a Ctrl-C printed 40 lines of the Triton interpreter's
    traceback (an edge hunt); launch's local ranks already said one line."""
    def interrupted(args):
        raise KeyboardInterrupt

    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    parser = foundation.LessonParser()
    with pytest.raises(SystemExit) as exit_:
        foundation.launch_lesson(parser, argparse.Namespace(), interrupted)
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def _join_and_leave() -> None:
    foundation.init_distributed()
    foundation.exit_distributed()


def test_launch_rendezvous_survives_a_port_taken_by_another_process(monkeypatch):
    """A port chosen, released, then bound by rank 0's store can be taken in between (a parallel test
    did, once: EADDRINUSE). Here it is taken before any rank starts: launch must not depend on it."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two ranks on the CPU, also on a one-GPU machine
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(foundation, "free_port", lambda: taken.getsockname()[1], raising=False)
        foundation.launch(_join_and_leave, nproc=2)


def test_counted_is_singular_at_one_only():
    """The noun every lesson prints beside a count (test_course reads that they all use counted)."""
    assert foundation.counted(1, "rank") == "1 rank" and foundation.counted(0, "rank") == "0 ranks"
    assert foundation.counted(2, "microbatch", "microbatches") == "2 microbatches"
    assert foundation.counted(1, "microbatch", "microbatches") == "1 microbatch"
    assert foundation.counted(1024, "step") == "1,024 steps"


def test_median_of_counts_the_timed_steps_not_the_warm_up_round():
    timed = argparse.Namespace(bench_steps=5, bench_rounds=3)
    assert foundation.median_of(timed) == "median of 10 steps"
    assert foundation.median_of(argparse.Namespace(bench_steps=1, bench_rounds=2), "call") == "median of 1 call"


def _rank_0_works_past_the_timeout() -> None:
    foundation.init_distributed(timeout_s=2)
    if dist.get_rank() == 0:
        time.sleep(6)  # as a long one-device reference on rank 0 alone
        print("rank 0 finished", flush=True)
    foundation.exit_distributed()


def test_a_rank_busier_than_the_groups_timeout_still_finishes(monkeypatch, capfd):
    """Every demo's rank 0 alone runs the one-device reference while the others have finished. They
    waited in a barrier at their exit, which failed after the group's timeout (01's demo at --seq-len
    4096 x 20 steps: the 120 s of init_distributed); now they exit with 0, and the launcher waits for
    rank 0. Here rank 0 works 3x a 2 s timeout."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    foundation.launch(_rank_0_works_past_the_timeout, nproc=2)
    assert "rank 0 finished" in capfd.readouterr().out


# --- the script itself ------------------------------------------------------------------------

def test_script_runs_as_plain_python():
    """The launcher end to end, on the CPU even on a GPU machine; its printed figures are checked."""
    stdout = run_script("01_ddp.py", "--nproc", "2", "--steps", "2", "--global-batch", "4",
                        "--seq-len", "8")
    formula = re.search(r"= ([\d,]+) B\n", stdout)
    rows = re.findall(r"^  (?:naive|bucketed)[^\n]*?([\d.]+e[-+]\d+)\s+([\d.]+e[-+]\d+)\s+\d+\s+([\d,]+) B$",
                      stdout, re.M)
    assert formula and len(rows) == 3, stdout
    for grad_diff, param_diff, traffic in rows:  # the demo keeps Adam's default eps: 10x more room
        assert float(grad_diff) <= GRAD_ATOL and float(param_diff) <= 10 * PARAM_ATOL, stdout
        assert traffic == formula.group(1), stdout


def test_a_shortened_option_is_an_error_not_a_guess():
    """argparse would take --bench-step for --bench-steps (and 09's --microbatch for --microbatches)."""
    classes = (foundation.Options, foundation.BenchRounds)
    with pytest.raises(SystemExit):
        foundation.parse_options(foundation.__doc__, classes, argv=["--bench-step", "3"])
    argv = ["--bench", "--bench-steps", "3"]
    assert foundation.parse_options(foundation.__doc__, classes, argv=argv)[1].bench_steps == 3


@dataclasses.dataclass
class RuledOptions:
    """Every kind of rule the lessons' fields carry, for the machinery's test."""
    count: int = foundation.option(1, "a count", ">= 1")
    rate: float = foundation.option(0.5, "a rate", ("> 0", "<= 1"))
    sizes: tuple = foundation.option((16,), "head sizes", (">= 16", "<= 128"), nargs="+")
    kind: str = foundation.option("a", "a kind", choices=("a", "b"))
    only_b: int = foundation.option(0, "an option of sub-command b", ">= 0", commands=("b",))
    internal: int = 3  # no help: not an option


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "--count must be >= 1, not 0"),
    (["--rate", "nan"], "--rate must be > 0, not nan"),
    (["--rate", "1.5"], "--rate must be <= 1, not 1.5"),
    (["--sizes", "16", "256"], "--sizes must be <= 128, not 256"),
    (["--kind", "c"], "argument --kind: invalid choice: 'c'"),
    (["--internal", "4"], "unrecognized arguments: --internal 4"),
    (["b", "--only-b", "-1"], "--only-b must be >= 0, not -1"),
    (["a", "--only-b", "1"], "unrecognized arguments: --only-b 1 (--only-b is an option of b)"),
    (["a", "--only-b=1"], "unrecognized arguments: --only-b=1 (--only-b is an option of b)"),  # the name
    (["bb", "--count", "2"], "unrecognized arguments: bb (the sub-commands: a, b)"),  # said a's, and no more
    (["--count", "2", "--sizes", "32", "64"], None),
])
def test_an_option_is_a_field_with_its_rule_beside_it(capsys, argv, message):
    """option(): the field's rule (several, a list's every element, NaN refused by each) is checked as
    the command line is parsed, in one line naming the option and the value, exit 2; a field without a
    help is no option; a sub-command's own fields are options of it only (given to another, the error
    names whose it is); none given: the first (a mistyped one is taken for its argument: the error lists
    the sub-commands)."""
    commands = {"a": foundation.Command("the first"), "b": foundation.Command("the second")}
    if message is None:
        _, args = foundation.parse_options("doc", (RuledOptions,), commands, argv=argv)
        assert (args.command, args.count, args.sizes, args.rate) == ("a", 2, [32, 64], 0.5)
        return
    with pytest.raises(SystemExit) as exit_:
        foundation.parse_options("doc", (RuledOptions,), commands, argv=argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err


def test_a_refused_rule_names_the_options_the_reader_typed(capsys):
    """LessonParser.refuse: a rule raised in Python's words (count=3, kind='b') exits 2 in the command
    line's (--count 3, --kind b), for the chosen command's options only: a name that merely ends like
    one (account=2, recount=1), a field that is no option (internal=3) and another command's option
    (only_b=1, of b) are left as they are."""
    commands = {"a": foundation.Command("the first"), "b": foundation.Command("the second")}
    parser, _ = foundation.parse_options("doc", (RuledOptions,), commands, argv=["a"])
    with pytest.raises(SystemExit) as exit_:
        parser.refuse(ValueError("count=3 is odd, kind='b': account=2 recount=1 internal=3 only_b=1"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.endswith(" a: error: --count 3 is odd, --kind b: account=2 recount=1 internal=3 only_b=1\n"), err
    with pytest.raises(SystemExit):  # a value with a space (a path): whole, quoted as the shell needs it
        parser.refuse(ValueError("kind='my runs, old' is not a kind; kind='' is empty"))
    err = capsys.readouterr().err
    assert err.endswith(" a: error: --kind 'my runs, old' is not a kind; --kind '' is empty\n"), err


def test_a_config_names_the_field_that_breaks_its_rule():
    """broken_rules on a config (09's validate): the field's name and value, not an option."""
    assert foundation.broken_rules(RuledOptions(count=0, rate=2.0), dataclasses.fields(RuledOptions)) == [
        "count=0 must be >= 1", "rate=2.0 must be <= 1"]
