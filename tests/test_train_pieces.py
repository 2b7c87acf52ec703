"""The mesh-agnostic pieces of lesson 09's training run as a specification: data, schedule, MFU,
activation recompute, sharded checkpoints that load on another mesh, the NaN guard, sampling.

Tolerances: data, checkpoints and sampling are exact (copies and integer work). Recompute runs the
same kernels on the same inputs a second time, so loss and every gradient must be bitwise equal
to no recompute on the CPU (measured: equal in every example); any tolerance would only hide a
recompute that reads the wrong input. Saved bytes equal the formula exactly (integer accounting).
"""
from __future__ import annotations

import importlib
import math
import sysconfig
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

ddp = importlib.import_module("01_ddp")
tpm = importlib.import_module("03_tensor_parallel")
cpm = importlib.import_module("05_context_parallel")
tp = importlib.import_module("train_pieces")


# --- data ---------------------------------------------------------------------------------------

def test_default_corpus_is_the_standard_library_in_sorted_order():
    tokens = tp.read_tokens(None, max_bytes=5000)
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    assert len(tokens) == 5000 and tokens.dtype == torch.uint8
    assert bytes(tokens[:min(len(first), 5000)].tolist()) == first[:5000]
    assert torch.equal(tokens, tp.read_tokens(None, max_bytes=5000))


def test_bad_data_files_give_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        tp.read_tokens(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        tp.read_tokens(tmp_path / "empty.txt")
    (tmp_path / "text.txt").write_bytes(b"hello")
    assert bytes(tp.read_tokens(tmp_path / "text.txt").tolist()) == b"hello"


@given(length=st.integers(1, 200), seq_len=st.integers(1, 8), batch=st.integers(1, 4))
@example(length=20, seq_len=1, batch=1)  # 18 + 2 tokens: both parts hold exactly s + 1
@example(length=19, seq_len=1, batch=1)  # 18 + 1: validation is one token short
def test_split_refuses_exactly_the_texts_too_short_for_a_batch(length, seq_len, batch):
    tokens = torch.arange(length)
    n_val = int(length * 0.1)
    if min(n_val, length - n_val) >= batch * seq_len + 1:
        train, val = tp.split_tokens(tokens, seq_len, batch)
        assert torch.equal(torch.cat([train, val]), tokens) and len(val) == n_val
        for part in (train, val):  # each part yields a batch
            assert next(tp.ShardedLoader(part, seq_len, batch))[0].shape == (batch, seq_len)
    else:
        with pytest.raises(ValueError, match=f"each part needs >= global_batch x seq_len \\+ 1 = "
                                             f"{batch} x {seq_len} \\+ 1"):
            tp.split_tokens(tokens, seq_len, batch)


def loaders(length: int, seq_len: int, batch: int, dp: int, seed: int = 0) -> list:
    tokens = torch.arange(length)  # window i starts with token i * seq_len: its id is readable
    return [tp.ShardedLoader(tokens, seq_len, batch, r, dp, seed) for r in range(dp)]


def global_batch(ranks: list) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [next(loader) for loader in ranks]
    return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])


@given(seq_len=st.integers(1, 6), per_rank=st.integers(1, 3), dp=st.sampled_from([1, 2, 4]),
       n_windows=st.integers(1, 30), seed=st.integers(0, 9))
def test_each_epoch_reads_every_window_once_across_ranks(seq_len, per_rank, dp, n_windows, seed):
    batch = per_rank * dp
    length = max(n_windows, batch) * seq_len + 1
    ranks = loaders(length, seq_len, batch, dp, seed)
    per_epoch = ranks[0].batches_per_epoch
    seen = []
    for _ in range(per_epoch):
        x, y = global_batch(ranks)
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
        assert torch.equal(x, x[:, :1] + torch.arange(seq_len)), "a window is s consecutive tokens"
        seen += (x[:, 0] // seq_len).tolist()
    assert len(set(seen)) == len(seen) == per_epoch * batch
    if (length - 1) // seq_len % batch == 0:
        assert sorted(seen) == list(range((length - 1) // seq_len))
    assert all(r.state_dict() == {"epoch": 1, "position": 0} for r in ranks)


def test_loader_order_is_seeded():
    a, b, c = (global_batch(loaders(400, 4, 8, 2, seed)) for seed in (0, 0, 1))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


@given(before=st.integers(0, 9), after=st.integers(1, 9), dp_before=st.sampled_from([1, 2, 4]),
       dp_after=st.sampled_from([1, 2, 4]))
def test_resume_sees_the_uninterrupted_batches_even_on_another_dp(before, after, dp_before, dp_after):
    uninterrupted = loaders(83, 3, 4, 1)  # 27 windows: 6 batches per epoch, so epochs roll over
    expected = [global_batch(uninterrupted) for _ in range(before + after)][before:]
    first = loaders(83, 3, 4, dp_before)
    for _ in range(before):
        global_batch(first)
    resumed = loaders(83, 3, 4, dp_after)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    for want in expected:
        got = global_batch(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_loader_errors():
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by dp=4"):
        tp.ShardedLoader(torch.arange(100), 4, 6, 0, 4)
    with pytest.raises(ValueError, match="fewer than global_batch=4 windows of seq_len \\+ 1 = 5"):
        tp.ShardedLoader(torch.arange(16), 4, 4)


# --- learning rate, MFU, NaN guard --------------------------------------------------------------

def test_learning_rate_corners():
    lr = lambda step, warmup=10: tp.learning_rate(step, 1.0, warmup, 110, 0.1)  # noqa: E731
    assert lr(0) == pytest.approx(0.1) and lr(9) == 1.0 and lr(10) == 1.0  # warmup, then the top
    assert lr(60) == pytest.approx(0.55)  # half way down the cosine: the middle of max and min
    assert lr(110) == pytest.approx(0.1) and lr(500) == 0.1  # the floor, and after
    assert lr(0, warmup=0) == 1.0
    decay = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:])), "the cosine never rises"


def test_flops_per_token_by_hand():
    # dim 8, 2 heads of 4, ffn 16, 1 layer, vocab 10, T = 4. N: q k v o 4 x 8 x 8 = 256, MLP
    # 3 x 8 x 16 = 384, two norms 16, final norm 8, LM head 8 x 10 = 80: 744 (the embedding's 80
    # do not count). 6N = 4464; 12 L H Q T = 12 x 1 x 2 x 4 x 4 = 384. Total 4848.
    cfg = ddp.ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, ffn_dim=16)
    assert tp.matmul_params(cfg) == 744 and tp.flops_per_token(cfg, 4) == 4848
    assert tp.mfu(1000.0, cfg, 4, 4848e3) == pytest.approx(1.0)


@given(n_heads=st.sampled_from([2, 4]), groups=st.sampled_from([1, 2]), layers=st.integers(1, 3))
def test_matmul_params_count_the_model_but_its_embedding(n_heads, groups, layers):
    cfg = ddp.ModelConfig(vocab_size=50, dim=8 * n_heads, n_layers=layers, n_heads=n_heads,
                          n_kv_heads=n_heads // groups, ffn_dim=24)
    model = ddp.GPT(cfg)
    counted = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed"))
    assert tp.matmul_params(cfg) == counted


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("Tesla T4", None)])
def test_peak_flops_table(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert tp.peak_bf16_flops(torch.device("cuda", 0)) == peak
    assert tp.peak_bf16_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_nan_guard_names_the_step(loss):
    with pytest.raises(FloatingPointError, match=f"step 7: the loss is {loss}"):
        tp.check_finite_loss(loss, 7)
    tp.check_finite_loss(3.5, 7)


# --- greedy sampling ----------------------------------------------------------------------------

def test_greedy_sample_continues_with_the_most_likely_byte():
    model = ddp.GPT(ddp.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32, seed=1))
    new = tp.greedy_sample(model, b"def ", 12)
    assert len(new) == 12 and model.training, "the model's mode is restored"
    text = torch.tensor(list(b"def " + new))[None]
    with torch.no_grad():  # teacher-forced: one forward over the whole text predicts the same bytes
        assert model(text)[0, 3:-1].argmax(-1).tolist() == list(new)
    assert tp.greedy_sample(model, b"x", 0) == b""
    with pytest.raises(ValueError, match="at least one byte"):
        tp.greedy_sample(model, b"", 3)
    with pytest.raises(ValueError, match="vocab_size 256, not 128"):
        tp.greedy_sample(ddp.GPT(ddp.ModelConfig()), b"a", 1)
