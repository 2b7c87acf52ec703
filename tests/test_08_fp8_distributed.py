"""Lesson 08's second file: FP8 in distributed training. ZeRO-3's all-gathers carry the weights' FP8
casts, bit for bit the whole weights' casts; under tensor parallelism every amax is the whole tensor's,
so a split layer casts one device's FP8 numbers; the bytes of both beside their formulas.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import re
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from conftest import run_script
from test_02_zero import ADAM_EPS, GRAD_ATOL, GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, assert_close_by_name
from test_08_fp8 import sample

foundation = importlib.import_module("01_ddp")
tensor_parallel = importlib.import_module("03_tensor_parallel")
fp8 = importlib.import_module("08_fp8")
fp8_distributed = importlib.import_module("08_fp8_distributed")
E4M3 = fp8.E4M3


# ----------------------------------------------------------------------------------------------
# FP8 communication: one weight cast per step; ZeRO-3 all-gathers the casts (Float8ZeRO)
# ----------------------------------------------------------------------------------------------
# Tolerances. The gathered casts must be the whole weights' casts bit for bit (bytes and scales
# compared as integers, NaN included): max is exact, the scale the same fp32 division and the cast
# elementwise with it. Training: Float8ZeRO against 02's ZeRO-3 with fp32 all-gathers (each forward
# casting the gathered weight) runs the same operations on the same bits: equal exactly. Against the
# unsharded run (02's ZeRO-0, whole weights, each cast once per step) the gradients are summed in
# another order (one all-reduce of the whole model, not a reduce-scatter per unit): 02's fp32
# tolerances, derived in test_02_zero.py; step 0's casts are the same bits, and over 12 drawn
# configurations the differences stayed at the rounding of those sums (losses 0, gradients <= 7.5e-9,
# parameters <= 1.9e-9; 1.2e-7 in the demo's larger model). (A weight an ulp from an e4m3 rounding
# midpoint could round the other way on the next step, an e4m3 step apart; none did.)

FEW_EXAMPLES = max(3, settings.default.max_examples // 3)  # each example trains 3 models on a rank pool
SPECIALS = ("none", "nan", "inf", "zero weight", "huge")


def tiny_fp8_gpt(cfg: foundation.ModelConfig, special: str = "none", seed: int = 0) -> nn.Module:
    """The GPT with Float8Linear layers, one weight given a special value (the same on every rank)."""
    model = fp8.convert_to_float8(foundation.GPT(cfg))
    weights = fp8_distributed.float8_weights(model)
    gen = torch.Generator().manual_seed(seed)
    weight = weights[int(torch.randint(len(weights), (), generator=gen))]
    element = int(torch.randint(weight.numel(), (), generator=gen))
    with torch.no_grad():
        if special == "zero weight":
            weight.zero_()
        elif special == "huge":
            weight.mul_(1e30)
        elif special != "none":
            weight.view(-1)[element] = float(special)
    return model


def gathered_casts(cfg: foundation.ModelConfig, special: str, seed: int):
    """On every rank: the (bytes, scale bits) each Float8Linear receives from Float8ZeRO's
    all-gather as the forward reaches it, and each unit's (offsets, shapes, owned range)."""
    model = tiny_fp8_gpt(cfg, special, seed)
    zero = fp8_distributed.Float8ZeRO(model)
    received = {}

    def record(module: nn.Module, args: tuple, name: str) -> None:
        q, scale = module.weight.float8_cast
        received[name] = q.view(torch.uint8).clone(), scale.view(torch.int32).clone()

    for name, module in model.named_modules():
        if isinstance(module, fp8.Float8Linear):
            module.register_forward_pre_hook(functools.partial(record, name=name))
    with torch.no_grad():
        model(torch.arange(6).view(1, 6) % cfg.vocab_size)
    return received, [(u.offsets, u.shapes, (u.owned.start, u.owned.stop)) for u in zero.units]


def row_split(layouts: list) -> bool:
    """Whether a shard boundary falls inside some weight's row."""
    for offsets, shapes, _ in layouts[0]:
        boundaries = {owned[0] for rank in layouts for o, _, owned in rank if o == offsets} - {0}
        if any(begin < b < end and (b - begin) % shape[1]
               for b in boundaries for begin, end, shape in zip(offsets, offsets[1:], shapes)):
            return True
    return False


@given(world=st.integers(1, 4), dim=st.sampled_from([10, 14]), ffn_dim=st.sampled_from([5, 7, 9, 11]),
       n_layers=st.integers(1, 2), special=st.sampled_from(SPECIALS), seed=st.integers(0, 1000))
def test_fp8_all_gather_is_the_whole_weights_cast_bit_for_bit(rank_pool, world, dim, ffn_dim, n_layers,
                                                              special, seed):
    """Shards that split rows, weights with NaN, inf, all zeros or near fp32's max: each rank casts
    its piece with the weight's global scale, and the gathered bytes are the whole weight's cast."""
    cfg = foundation.ModelConfig(vocab_size=11, dim=dim, n_layers=n_layers, n_heads=1, ffn_dim=ffn_dim, seed=seed)
    results = rank_pool.run(world, gathered_casts, cfg, special, seed)
    model = tiny_fp8_gpt(cfg, special, seed)
    for name, module in model.named_modules():
        if isinstance(module, fp8.Float8Linear):
            q, scale = fp8.quantize_tensorwise(module.weight.detach())
            for received, _ in results:
                assert torch.equal(received[name][0], q.view(torch.uint8)), name
                assert torch.equal(received[name][1], scale.view(torch.int32)), name
    assert world == 1 or row_split([layouts for _, layouts in results]), "no shard boundary inside a row"


def train_counting_casts(cfg, steps, global_batch, seq_len, mode, microbatches):
    """train_float8_zero on this rank, recording the numel of every e4m3 cast."""
    casts, real = [], fp8.cast_to_fp8

    def counting(x, scale, dtype):
        if dtype == E4M3:
            casts.append(x.numel())
        return real(x, scale, dtype)

    fp8.cast_to_fp8 = counting
    try:
        result, meter = fp8_distributed.train_float8_zero(cfg, steps, global_batch, seq_len, mode=mode,
                                              microbatches=microbatches, adam_eps=ADAM_EPS)
    finally:
        fp8.cast_to_fp8 = real
    return result, meter, casts


@settings(max_examples=FEW_EXAMPLES)
@given(world=st.integers(1, 4), microbatches=st.integers(1, 3), dim=st.sampled_from([10, 14]),
       ffn_dim=st.sampled_from([5, 7, 9]), seq_len=st.integers(2, 6), seed=st.integers(0, 1000))
def test_float8_zero3_trains_like_unsharded_fp8_with_a_byte_per_weight_element(
        rank_pool, world, microbatches, dim, ffn_dim, seq_len, seed):
    steps, global_batch = 3, world * microbatches
    cfg = foundation.ModelConfig(vocab_size=11, dim=dim, n_heads=1, ffn_dim=ffn_dim, seed=seed)
    runs = {mode: rank_pool.run(world, train_counting_casts, cfg, steps, global_batch, seq_len, mode,
                                microbatches) for mode in fp8_distributed.FLOAT8_ZERO_MODES}
    fp8_run, gathered, unsharded = (runs[mode][0][0] for mode in ("zero3-fp8", "zero3", "unsharded"))
    assert fp8_run.losses == gathered.losses
    for key in ("first_grads", "params"):
        ours, theirs = getattr(fp8_run, key), getattr(gathered, key)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), key
    assert fp8_run.losses == pytest.approx(unsharded.losses, abs=LOSS_ATOL)
    assert_close_by_name(fp8_run.first_grads, unsharded.first_grads, "step-0 gradient", atol=GRAD_ATOL,
                         rtol=GRAD_RTOL)
    assert_close_by_name(fp8_run.params, unsharded.params, "parameter", atol=PARAM_ATOL, rtol=0)

    # Bytes per step: all-gathers before each microbatch's forward and backward, 4 B per element of
    # the other parameters' units, 1 B per element of the weights' (padded: 02's layout); one
    # all-reduce per ZeRO for the clipping norm's square, one more for every weight's amax.
    model = fp8.convert_to_float8(foundation.GPT(cfg))
    weights, ring = fp8_distributed.float8_weights(model), Fraction(world - 1, world)
    (rest, padded_weights), n = fp8_run.stats["padded"], len(weights)
    for mode, weight_bytes, all_reduces in (("zero3", 4, 2), ("zero3-fp8", 1, 3)):
        for _, meter, _ in runs[mode]:
            assert meter.traffic("all_gather") == steps * microbatches * 2 * ring * (4 * rest + weight_bytes
                                                                                   * padded_weights)
            assert meter.traffic("reduce_scatter") == steps * ring * 4 * (rest + padded_weights)
            assert meter.calls("all_reduce") == steps * all_reduces
            assert meter.traffic("all_reduce") == steps * 2 * ring * 4 * (2 + (n if weight_bytes == 1 else 0))
    # 08's formula (what lesson 09's plan prices): its parts per step and microbatch, as measured
    # above; the amaxes' part is what the FP8 run all-reduces beyond the two ZeRO's clipping norms.
    formula, (_, meter, _) = fp8_distributed.float8_zero_traffic(padded_weights, n, world), runs["zero3-fp8"][0]
    assert formula["all_gather"] == 2 * ring * padded_weights
    assert formula["reduce_scatter"] == ring * 4 * padded_weights
    assert meter.traffic("all_reduce") - steps * 2 * ring * 4 * 2 == steps * formula["all_reduce"]
    assert formula["all_reduce"] == 2 * ring * 4 * n

    # Casts per step: each Float8Linear call casts its input (n per microbatch); the weights are
    # cast once per step whatever the microbatches: whole on every unsharded rank, in pieces under
    # Float8ZeRO (plus once when it is built), every element on exactly one rank.
    act_elements = steps * (global_batch // world) * seq_len * sum(w.shape[1] for w in weights)
    weight_elements = sum(w.numel() for w in weights)
    for _, _, casts in runs["zero3"]:
        assert len(casts) == steps * 2 * n * microbatches, "fp32 gathers: a weight cast per forward"
    for _, _, casts in runs["unsharded"]:
        assert len(casts) == steps * (n * microbatches + n)
        assert sum(casts) == act_elements + steps * weight_elements
    pieces = [(len(casts) - steps * n * microbatches) / (steps + 1) for _, _, casts in runs["zero3-fp8"]]
    assert all(p == int(p) and 1 <= p <= n for p in pieces) and sum(pieces) >= n, pieces
    cast_weight_elements = sum(sum(casts) - act_elements for _, _, casts in runs["zero3-fp8"])
    assert cast_weight_elements == (steps + 1) * weight_elements


def test_weights_cast_once_per_step_changes_no_bit(monkeypatch):
    """Three microbatches inside weights_cast_once: the weights are cast once, not three times, and
    the outputs and gradients are those of a cast per forward; the cast is dropped on exit, so a
    backward outside the step it was made for is refused rather than run on a stale cast."""
    calls, real = [], fp8.cast_to_fp8
    monkeypatch.setattr(fp8, "cast_to_fp8", lambda x, scale, dtype: calls.append(dtype) or real(x, scale, dtype))
    torch.manual_seed(0)
    model = fp8.convert_to_float8(nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 4)))
    microbatches = [torch.randn(5, 12) for _ in range(3)]
    runs = []
    for once in (False, True):
        model.zero_grad()
        calls.clear()
        with fp8_distributed.weights_cast_once(model) if once else contextlib.nullcontext():
            outs = [model(x) for x in microbatches]
            for out in outs:
                out.square().sum().backward()
        runs.append((outs, [p.grad.clone() for p in model.parameters()], calls.count(E4M3)))
    (outs, grads, per_forward), (outs_once, grads_once, once) = runs
    assert per_forward == 3 * (2 + 2) and once == 3 * 2 + 2, "x per forward; W per forward | once"
    assert all(torch.equal(a, b) for a, b in zip(outs + grads, outs_once + grads_once, strict=True))
    assert all(getattr(w, "float8_cast", None) is None for w in fp8_distributed.float8_weights(model))
    with fp8_distributed.weights_cast_once(model):
        out = model(microbatches[0])
    with pytest.raises(RuntimeError, match="step is gone: run backward inside 08_fp8_distributed.s weights_cast_once"):
        out.sum().backward()


def float8_zero_misuse(cfg: foundation.ModelConfig) -> list[str]:
    """On every rank: what Float8ZeRO refuses, each before any collective or wrong number."""
    messages = []
    model = fp8.convert_to_float8(foundation.GPT(cfg))
    zero = fp8_distributed.Float8ZeRO(model)
    tokens = torch.arange(4).view(1, 4)
    with pytest.raises(ValueError) as error, fp8_distributed.weights_cast_once(model):  # released between uses
        pass
    messages.append(str(error.value))
    zero.load_full_state_dict(zero.full_state_dict())  # recasts: the forward runs
    before = model(tokens).detach()
    with torch.no_grad():
        zero.units[0].master.mul_(2)  # a change Float8ZeRO did not make: its casts are stale
    with pytest.raises(RuntimeError) as error:
        model(tokens)
    messages.append(str(error.value))
    with torch.no_grad():
        zero.units[0].master.div_(2)
    zero.cast_shards()
    assert torch.equal(model(tokens).detach(), before)
    return messages


def test_float8_zero_refuses_stale_casts_and_unsharded_use(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=11, dim=10, n_heads=1, ffn_dim=7)
    for messages in rank_pool.run(2, float8_zero_misuse, cfg):
        assert "weights_cast_once needs whole weights" in messages[0]
        assert re.search(r"FP8 cast of layers\.0\..* older than its weights: Float8ZeRO\.cast_shards",
                         messages[1])
    rank_pool.expect_invalid(2, fp8_distributed.Float8ZeRO, foundation.GPT(cfg), match="this model has none: convert_to_float8")


# ----------------------------------------------------------------------------------------------
# FP8 under tensor parallelism: every scale the whole tensor's
# ----------------------------------------------------------------------------------------------
# A layer split over tp ranks casts its pieces with the whole tensors' scales (one MAX all-reduce of
# the amaxes), so the FP8 numbers are one device's bit for bit: bytes and scales compared exactly.
# Only the sums split over ranks (a row-parallel output, a column-parallel input gradient, a
# replicated weight's gradient over sequence shards) are added in another order: fp32 rounding of
# sums of K <= 32 products, rtol 1e-5. Per-shard scales (what tensor_parallel_scales prevents)
# change nearly every byte of a split operand whose pieces have different amaxes.

SPLITS = {"column": (None, 1), "row": (1, None), "sequence": (0, 0)}  # the dims x and grad_out are split along


def record_fp8_operands(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the operands of every FP8 GEMM (08's scaled_mm) recorded, in call
    order, as (bytes, FP8 format, scale): FP8 tensors do not pickle, bytes do."""
    operands, real = [], fp8.scaled_mm

    def recording(a_q, a_scale, b_q, b_scale, out_dtype):
        operands.extend((q.view(torch.uint8).clone(), q.dtype, scale.clone())
                        for q, scale in ((a_q, a_scale), (b_q, b_scale)))
        return real(a_q, a_scale, b_q, b_scale, out_dtype)

    fp8.scaled_mm = recording
    try:
        return fn(*args, **kwargs), operands
    finally:
        fp8.scaled_mm = real


def split_layer_step(kind: str, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor):
    """A Float8Linear holding `weight`: on every rank of the world split as lesson 03 splits a `kind`
    layer ("sequence": not split, on sequence shards under SP), forward on this rank's part of x,
    backward from its part of grad_out; one device (no process group): whole. Returns the output,
    input gradient and weight gradient."""
    layer = fp8.Float8Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    if dist.is_initialized():
        tp, rank = dist.get_world_size(), dist.get_rank()
        ctx = tensor_parallel.Context(None, tp, rank, sequence_parallel=kind == "sequence")
        if kind != "sequence":
            {"column": tensor_parallel.column_parallel, "row": tensor_parallel.row_parallel}[kind](layer, ctx)
        fp8_distributed.tensor_parallel_scales(layer, None, sequence_parallel=kind == "sequence")
        x, grad_out = (t if dim is None else t.chunk(tp, dim)[rank] for t, dim in zip((x, grad_out), SPLITS[kind]))
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_out)
    return out.detach(), x.grad, layer.weight.grad


def reassembled(pieces: list[torch.Tensor], whole_shape: torch.Size) -> torch.Tensor:
    """The ranks' pieces put together along the dimension they split, or their common value."""
    if all(p.shape == whole_shape for p in pieces):
        assert all(torch.equal(p, pieces[0]) for p in pieces), "a replicated operand differs between ranks"
        return pieces[0]
    dim = next(d for d, (a, b) in enumerate(zip(pieces[0].shape, whole_shape)) if a != b)
    return torch.cat(pieces, dim)


@given(tp=st.sampled_from([2, 4]), kind=st.sampled_from(list(SPLITS)), rows=st.integers(1, 3),
       cols=st.integers(1, 3), outs=st.integers(1, 3), outlier=st.floats(1.0, 100.0), seed=st.integers(0, 1000))
def test_a_split_layer_casts_one_devices_fp8_numbers(rank_pool, tp, kind, rows, cols, outs, outlier, seed):
    m, k, n = tp * rows, tp * 4 * cols, tp * 2 * outs
    x, grad_out = sample((m, k), seed, 0.0, 0.0), sample((m, n), seed + 1, -3.0, 0.0)
    weight = sample((n, k), seed + 2, -1.5, 0.0)
    x[0, -1] *= outlier  # the last rank's pieces hold the largest values: per-shard amaxes differ
    grad_out[-1, -1] *= outlier
    weight[-1, -1] *= outlier
    ranks = rank_pool.run(tp, record_fp8_operands, split_layer_step, kind, weight, x, grad_out)
    (out, grad_x, grad_w), operands = record_fp8_operands(split_layer_step, kind, weight, x, grad_out)
    assert len(operands) == 6, "three FP8 GEMMs: forward, input gradient, weight gradient"
    for i, (q, _, scale) in enumerate(operands):
        assert torch.equal(reassembled([r[1][i][0] for r in ranks], q.shape), q), (kind, i)
        assert all(torch.equal(r[1][i][2], scale) for r in ranks), (kind, i, "scale")
    x_dim, grad_dim = SPLITS[kind]
    for index, whole, dim in ((0, out, grad_dim), (1, grad_x, x_dim), (2, grad_w, 0 if kind == "column" else 1)):
        pieces = [r[0][index] for r in ranks]
        got = sum(pieces) if dim is None or (kind == "sequence" and index == 2) else torch.cat(pieces, dim)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())


@settings(max_examples=FEW_EXAMPLES)
@given(tp=st.sampled_from([2, 4]), sequence_parallel=st.booleans(), microbatches=st.integers(1, 2),
       n_layers=st.integers(1, 2), seed=st.integers(0, 1000))
def test_tensor_parallel_amax_all_reduces_move_what_the_formula_says(rank_pool, tp, sequence_parallel,
                                                                   microbatches, n_layers, seed):
    """Per step: one all-reduce of every weight's amax (weights cast once per step), and one of a
    single amax for each operand split where it is cast: per layer and microbatch the output
    gradients of q, k, v, gate, up (column-parallel) and the inputs of out and down (row-parallel):
    7 weights, 7 casts, 4 B each, on the ring. The rest of the all-reduces is lesson 03's formula."""
    cfg = foundation.ModelConfig(vocab_size=11, dim=4 * tp, n_layers=n_layers, n_heads=tp, ffn_dim=3 * tp, seed=seed)
    steps, batch, seq_len, ring = 2, 2 * microbatches, 2 * tp, Fraction(tp - 1, tp)
    megatron_calls, megatron_payload = tensor_parallel.comm_formula(
        cfg, batch, seq_len, sequence_parallel, microbatches=microbatches)["all_reduce"]
    for whole_tensor_scales in (True, False):
        runs = rank_pool.run(tp, fp8_distributed.train_float8_tensor_parallel, cfg, steps, batch, seq_len,
                             sequence_parallel=sequence_parallel, microbatches=microbatches,
                             whole_tensor_scales=whole_tensor_scales, adam_eps=ADAM_EPS)
        for _, meter in runs:
            calls = meter.calls("all_reduce") - steps * megatron_calls
            amax_bytes = meter.traffic("all_reduce") - steps * 2 * ring * megatron_payload
            if not whole_tensor_scales:
                assert calls == amax_bytes == 0
                continue
            assert calls == steps * (1 + microbatches * 7 * n_layers)
            assert amax_bytes == steps * 2 * ring * 4 * n_layers * (7 + microbatches * 7)
            assert amax_bytes == steps * fp8_distributed.tensor_parallel_amax_traffic(
                tp, n_layers, microbatches, sequence_parallel=sequence_parallel)


# --- the script itself ------------------------------------------------------------------------

def test_script_runs_as_plain_python():
    """Both demos on 2 local ranks: every measured byte count equals its formula (the script marks one
    that does not with "(!=)"), and the FP8-gather run equals the fp32-gather run exactly."""
    stdout = run_script("08_fp8_distributed.py", "--nproc", "2", "--batch", "4", "--seq-len", "8")
    gathers = re.findall(r"^  the weights in (?:fp32|FP8 ) \(b = \d B\):\s+([\d,]+) \| ([\d,]+)\s", stdout, re.M)
    amaxes = re.findall(r"^  (?:whole|each).*\s([\d,]+) B \| ([\d,]+) B$", stdout, re.M)  # 3 rows of scales
    assert len(gathers) == 2 and all(measured == formula for measured, formula in gathers), stdout
    assert len(amaxes) == 3 and all(measured == formula for measured, formula in amaxes), stdout
    assert "(!=)" not in stdout, stdout
    assert re.search(r"from the fp32-gather run: loss 0\.0e\+00, step-0 gradients 0\.0e\+00, parameters after "
                     r"3 steps 0\.0e\+00$", stdout, re.M), stdout
