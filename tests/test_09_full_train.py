"""Lesson 09 as a specification: every composition of the mesh trains exactly like one device.

Tolerances (fp32 on CPU), measured then widened with margin: over 134 configurations (two runs of
the dev profile's 60 drawn meshes, the pinned examples and the 16-rank run) the largest differences
were 6.0e-7 on losses, 1.8e-7 on step-0 gradients and 4.1e-7 on parameters after 3 steps.
- loss per step: atol 2e-5 (33x). The parallel loss is a mean of means (microbatches, dp x cp
  ranks, vocabulary shards), the same sums in another order.
- step-0 gradients, every element of every parameter reassembled from the ranks' pieces: atol 2e-6
  (11x) + rtol 1e-4. A real bug (a reduction done twice or missed, a microbatch loss not divided by
  m, a norm or expert gradient not summed over tp, an expert gradient not divided by ep) is off by
  the gradient itself, >= 25% relative.
- parameters after 3 AdamW steps at lr 1e-3, with eps 1e-6 (lesson 01's reason) and clipping at
  0.5, below the gradients' norm: atol 2e-5 (48x). Any sync bug moves parameters by ~lr = 1e-3.
- the clipping norm per step: the same on every rank, and rtol 2e-6 from clip_grad_norm_'s (largest
  of 21 configurations 1.9e-7 relative). Parameters cannot show a clipping bug: AdamW's update is
  almost blind to a common factor on the gradient. A norm that counts a tp-replicated parameter
  once per tp rank, or misses the experts of the other ep ranks (~1e-4 of the squares here), is off
  by more than 1e-5 relative.
MoE models are dropless without balancing (09 refuses the rest); the reference is 01's
train_single_device (AdamW + clip_grad_norm_) on the same model converted by lesson 06.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import functools
import gc
import importlib
import itertools
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import unittest.mock
import weakref
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import ROOT, SCRIPT_TIMEOUT_S, run_script
from test_02_zero import snapshot
from test_08_fp8 import ElementwiseBytes, reassembled, record_fp8_operands

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
pipeline = importlib.import_module("04_pipeline")
fp8 = importlib.import_module("08_fp8")
full_train = importlib.import_module("09_full_train")

LOSS_ATOL, GRAD_ATOL, GRAD_RTOL, PARAM_ATOL, ADAM_EPS, LR, STEPS = 2e-5, 2e-6, 1e-4, 2e-5, 1e-6, 1e-3, 3
NORM_RTOL = 2e-6

def train_on_mesh(cfg, sizes, train, steps: int):
    """On every rank: train `steps` steps on lesson 01's synthetic batches; return the losses, the
    step-0 gradient shards, the final parameter shards, the summary (with step 0's activations: the
    most bytes the layers held for backward at once) and the clipping norm per step."""
    full_train.validate(cfg, sizes, train, torch.distributed.get_world_size())  # before any collective
    mesh = full_train.build_mesh(sizes)
    trainer = full_train.Trainer(cfg, mesh, train, torch.device("cpu"))
    models = trainer.stages.values()
    layers = [block for model in models for block in model.layers.values()]
    params = [p for model in models for p in model.parameters()]
    losses, grads, norms = [], None, []
    for step in range(steps):
        rows = full_train.dp_rows(cfg, train, step, mesh)
        if step == 0:
            loss, activations = full_train.tensor_parallel.activation_bytes(
                lambda: trainer.forward_backward(rows), params, torch.device("cpu"), inside=layers)
            grads = full_train.shard_values(trainer, "grads")
        else:
            loss = trainer.forward_backward(rows)
        losses.append(loss)
        norms.append(trainer.update())
    summary = {**full_train.summary(trainer), "activations": activations}
    return losses, grads, full_train.shard_values(trainer), summary, norms


def check_against_reference(results, cfg, train, steps: int = STEPS, reference=None) -> dict[str, float]:
    ref = reference or foundation.train_single_device(
        cfg, steps, train.global_batch, train.seq_len, lr=train.lr, adam_eps=train.adam_eps,
        max_grad_norm=train.max_grad_norm, transform=full_train.reference_transform(train))
    diffs = {}
    for losses, *_ in results:
        assert losses == pytest.approx(ref.losses, abs=LOSS_ATOL), (losses, ref.losses)
    diffs["loss"] = max(abs(a - b) for r in results for a, b in zip(r[0], ref.losses))
    for *_, norms in results:  # one clipping factor for the whole mesh, the one device's
        assert norms == results[0][-1], "the ranks clipped by different norms"
        assert norms == pytest.approx(ref.grad_norms, rel=NORM_RTOL), (norms, ref.grad_norms)
    diffs["norm"] = max(abs(a / b - 1) for a, b in zip(results[0][-1], ref.grad_norms))
    for index, key, expected in ((1, "grads", ref.first_grads), (2, "params", ref.params)):
        got = full_train.assemble([piece for r in results for piece in r[index]])
        assert sorted(got) == sorted(expected), "some parameter is held by no rank"
        for name, tensor in got.items():
            assert not tensor.isnan().any(), f"{name}: some element is held by no rank"
            tol = dict(atol=GRAD_ATOL, rtol=GRAD_RTOL) if key == "grads" else dict(atol=PARAM_ATOL, rtol=0)
            torch.testing.assert_close(tensor, expected[name], **tol, msg=lambda m: f"{key} {name}: {m}")
        diffs[key] = foundation.max_abs_diff(got, expected)
    return diffs


MOE = full_train.expert_parallel.MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=8, aux_loss_coef=0.0)


def small_model(n_layers: int = 2, seed: int = 0) -> "foundation.ModelConfig":
    return foundation.ModelConfig(vocab_size=30, dim=16, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                  ffn_dim=24, seed=seed)


def global_indices(shape, local, tp_dim, tp_start, tp_length, ep_start, flat_start, flat_stop):
    """For each element [flat_start, flat_stop) of a rank's tensor of shape local: its index in the
    flattened global parameter (shape), -1 for padding (element by element: what held_piece's runs are
    checked against)."""
    index = torch.arange(math.prod(shape)).view(shape)
    if ep_start is not None:
        index = index.narrow(0, ep_start, local[0])
    if tp_dim is not None:
        index = index.narrow(tp_dim, tp_start, tp_length)
        pad = list(local)
        pad[tp_dim] -= tp_length
        index = torch.cat([index, index.new_full(pad, -1)], tp_dim)
    return index.flatten()[flat_start:flat_stop]


def held_elements(trainer) -> int:
    """The real (not padding) elements of a trainer's ZeRO shards, element by element from each
    parameter's TP attributes (03) and this rank's experts (06)."""
    tp_rank, count = trainer.mesh.coords["tp"], 0
    ep_rank = full_train.dist.get_rank(trainer.mesh.groups["ep"])
    for part in trainer.zeros:
        ep = trainer.mesh.sizes.ep if part.kind == "ep_dp" else 1
        for unit in part.zero.units:
            for i, start, stop in zero.shard_parts(unit):
                p, local = unit.params[i], tuple(unit.shapes[i])
                shape, dim, tp_start, length = list(local), getattr(p, "tp_shard_dim", None), 0, 0
                if dim is not None:
                    shape[dim], tp_start = p.tp_full_size, tp_rank * local[dim]
                    length = max(0, min(local[dim], p.tp_full_size - tp_start))
                shape[0] *= ep
                index = global_indices(tuple(shape), local, dim, tp_start, length,
                                       ep_rank * local[0] if ep > 1 else None, start, stop)
                count += int((index >= 0).sum())
    return count


def check_copies_agree(results) -> None:
    """Every element of every parameter is held somewhere, and its copies (tp-replicated norms,
    ZeRO-0-2's dp x cp replicas) hold the same value."""
    seen: dict[str, dict[int, float]] = {}
    for _, _, params, *_ in results:
        for piece, values in params:
            copies = seen.setdefault(piece.name, {})
            for first, offset, length in piece.runs.tolist():
                for i, v in enumerate(values[offset:offset + length].tolist(), first):
                    assert abs(copies.setdefault(i, v) - v) <= 1e-6, f"{piece.name}[{i}]: copies differ"
    for name, copies in seen.items():
        assert len(copies) == math.prod(_shape(results, name)), f"{name}: some element is held by no rank"


def _shape(results, name: str) -> tuple[int, ...]:
    return next(piece.shape for r in results for piece, _ in r[2] if piece.name == name)


# Meshes with each dimension in {1, 2, 4} and at most 8 ranks, in order of size (shrinks to small).
MESHES = sorted((full_train.MeshSizes(*sizes) for sizes in itertools.product((1, 2, 4), repeat=4)
                 if math.prod(sizes) <= 8), key=lambda m: (m.world, m.dp, m.pp, m.cp))


@st.composite
def configurations(draw):
    sizes = draw(st.sampled_from(MESHES), label="mesh")
    moe = draw(st.booleans(), label="moe")
    if moe:  # expert parallelism borrows from dp x cp
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if (sizes.dp * sizes.cp) % e == 0]), label="ep")
        sizes = full_train.MeshSizes(sizes.dp, sizes.pp, sizes.cp, sizes.tp, ep)
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved"] if sizes.pp > 1 else ["1f1b"]))
    virtual = 2 if schedule == "interleaved" else 1
    microbatches = draw(st.sampled_from([1, 2, 4]))
    if schedule == "interleaved":
        microbatches = sizes.pp * draw(st.integers(1, 2))
    sequence_parallel = sizes.tp > 1 and draw(st.booleans(), label="sequence_parallel")
    bf16 = not moe and draw(st.booleans(), label="bf16")  # MoE's routing may flip on bf16 rounding
    bf16_optimizer = bf16 and draw(st.booleans(), label="bf16_optimizer")
    seq_len = 2 * sizes.cp * sizes.tp * draw(st.integers(1, 2))
    n_kv_heads = draw(st.sampled_from([h for h in (2, 4) if h % sizes.tp == 0] or [4]))
    cfg = foundation.ModelConfig(vocab_size=draw(st.sampled_from([30, 32])), dim=16, n_heads=4,
                                 n_kv_heads=n_kv_heads, ffn_dim=24,
                                 n_layers=sizes.pp * virtual + draw(st.integers(0, 1)),
                                 seed=draw(st.integers(0, 9)))
    rows, zero_stage = draw(st.integers(1, 2)), draw(st.integers(0, 3))
    fp32_grads = bf16 and zero_stage <= 1 and draw(st.booleans(), label="fp32_grads")
    places = cfg.n_layers + 2 >= 2 * sizes.pp * virtual  # for the embedding and the head beside a layer
    ends_as_layers = places and draw(st.booleans(), label="ends_as_layers")
    refused = {"op": max(sizes.tp, sizes.cp) > 1 or schedule == "zb-h1",  # 09: 03's collectives, 05's ring,
               "elementwise": moe}  # zb-h1's weight pass; elementwise is priced for dense layers
    recompute = draw(st.sampled_from([m for m in full_train.tensor_parallel.RECOMPUTE_MODES if not refused.get(m)]),
                     label="recompute")
    train = full_train.TrainConfig(global_batch=sizes.dp * microbatches * rows, seq_len=seq_len,
                                   zero_stage=zero_stage, schedule=schedule, microbatches=microbatches,
                                   virtual=virtual, sequence_parallel=sequence_parallel, lr=LR,
                                   adam_eps=ADAM_EPS, max_grad_norm=0.5, moe=MOE if moe else None,
                                   mixed_precision=bf16, bf16_optimizer=bf16_optimizer, fp32_grads=fp32_grads,
                                   recompute=recompute,
                                   reduce_in_backward=draw(st.booleans(), label="reduce_in_backward"),
                                   ends_as_layers=ends_as_layers)
    return cfg, sizes, train


def pinned(dims, zero_stage, schedule, microbatches, sp, ep=None, n_layers=2, recompute="none", lean_saves=True,
           loss_chunks=1, reduce_in_backward=True, ends_as_layers=False):
    """A configuration the 15 drawn examples may miss, run on every CI pass."""
    sizes = full_train.MeshSizes(*dims, **({"ep": ep} if ep else {}))
    cfg = small_model(n_layers)
    train = full_train.TrainConfig(global_batch=sizes.dp * microbatches, seq_len=4 * sizes.cp * sizes.tp,
                                   zero_stage=zero_stage, schedule=schedule, microbatches=microbatches,
                                   virtual=2 if schedule == "interleaved" else 1, sequence_parallel=sp, lr=LR,
                                   adam_eps=ADAM_EPS, max_grad_norm=0.5, moe=MOE if ep else None,
                                   recompute=recompute, lean_saves=lean_saves, loss_chunks=loss_chunks,
                                   reduce_in_backward=reduce_in_backward, ends_as_layers=ends_as_layers)
    return (cfg, sizes, train)


@given(configuration=configurations())
@example(configuration=pinned((1, 2, 1, 2), 3, "interleaved", 2, True, n_layers=4))
@example(configuration=pinned((2, 1, 2, 2), 1, "1f1b", 1, False, ep=4))
@example(configuration=pinned((2, 2, 1, 2), 2, "zb-h1", 2, True, ep=2))
@example(configuration=pinned((1, 4, 1, 2), 0, "1f1b", 4, False, n_layers=4))
@example(configuration=pinned((2, 1, 2, 1), 3, "1f1b", 2, False, ep=2))
@example(configuration=pinned((2, 1, 2, 2), 3, "1f1b", 2, True, recompute="full"))
@example(configuration=pinned((1, 2, 1, 2), 1, "1f1b", 2, True, lean_saves=False))  # --autograd-saves
@example(configuration=pinned((1, 2, 2, 2), 1, "1f1b", 2, True, recompute="elementwise"))
@example(configuration=pinned((1, 2, 2, 1), 1, "gpipe", 2, False, recompute="selective"))
@example(configuration=pinned((1, 2, 1, 1), 0, "zb-h1", 4, False))  # W frees the last stage's B path
@example(configuration=pinned((2, 1, 1, 2), 1, "1f1b", 2, True, loss_chunks=3))  # 03's loss in 3 slices
@example(configuration=pinned((1, 2, 1, 1), 0, "gpipe", 3, False, loss_chunks=64))  # 64 slices of 4 tokens
@example(configuration=pinned((2, 2, 1, 1), 1, "interleaved", 2, False, n_layers=4, reduce_in_backward=False))
@example(configuration=pinned((1, 4, 1, 1), 0, "1f1b", 4, False, n_layers=6, ends_as_layers=True))  # 1 2 2 1, not 2 2 1 1
@example(configuration=(foundation.ModelConfig(vocab_size=30, dim=16, n_layers=1, n_heads=4, ffn_dim=24),
                        full_train.MeshSizes(cp=2, tp=4), full_train.TrainConfig(  # one head a rank: the
                            global_batch=1, seq_len=16, zero_stage=0, lr=LR,  # ring's output is out_proj's
                            adam_eps=ADAM_EPS, max_grad_norm=0.5)))  # input (the plan counted it twice)
@example(configuration=(foundation.ModelConfig(vocab_size=30, dim=16, n_layers=1, n_heads=4, ffn_dim=24),
                        full_train.MeshSizes(cp=2, tp=4), full_train.TrainConfig(  # the same in bf16: the ring
                            global_batch=1, seq_len=16, zero_stage=1, lr=LR, adam_eps=ADAM_EPS,  # keeps its bf16
                            max_grad_norm=0.5, mixed_precision=True, bf16_optimizer=True)))  # output; BF16 AdamW
@example(configuration=(small_model(2), full_train.MeshSizes(dp=2, pp=2), full_train.TrainConfig(  # 02's fp32
    global_batch=4, seq_len=8, zero_stage=1, microbatches=2, lr=LR, adam_eps=ADAM_EPS,  # gradients summed
    max_grad_norm=0.5, mixed_precision=True, fp32_grads=True)))  # over a pipeline's microbatches
def test_any_mesh_equals_one_device(rank_pool, configuration):
    """And the plan (09's formulas, which `plan` applies at scale) is what each rank measures: its
    parameters, bytes held, activations held at once, microbatches in flight, bytes sent per group."""
    cfg, sizes, train = configuration
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS)
    if train.mixed_precision:  # bf16 against its one-device twin (test_bf16_... below says why 5e-4)
        ref = foundation.train_single_device(cfg, STEPS, train.global_batch, train.seq_len, lr=LR,
                                             adam_eps=ADAM_EPS, max_grad_norm=0.5, mixed_precision=True,
                                             bf16_optimizer=train.bf16_optimizer)
        assert results[0][0] == pytest.approx(ref.losses, abs=5e-4)
    else:
        check_against_reference(results, cfg, train)
    check_copies_agree(results)
    plans = full_train.plan(cfg, sizes, train)  # in this process: no group, nothing built
    for rank, (_, _, _, summary, _) in enumerate(results):
        mine = plans[sizes.coords(rank)["pp"]]
        assert summary["plan"] == mine and summary["params"] == mine.params
        assert summary["held"] == summary["memory_formula"]
        assert summary["in_flight"] == mine.in_flight
        if train.moe is None and train.recompute == "elementwise":  # the peak is inside a region, before its
            # end empties its norm's output and SwiGLU's product: at most a layer's rebuilt bytes above the plan
            held = summary["activations"] - mine.memory["activations"]
            assert 0 <= held <= mine.rebuilt == rebuilt_bytes(cfg, sizes, train), (summary["activations"], mine)
        elif train.moe is None and train.recompute != "op":  # MoE: what the experts keep depends on the routing
            # (no formula); op: its policy's kept outputs are out of activation_bytes' sight (test_03 counts them)
            assert summary["activations"] == mine.memory["activations"], (summary["activations"], mine)
        if train.schedule != "zb-h1" or train.zero_stage < 3:  # zb-h1's W may re-gather a unit
            assert all(summary["traffic"][k] == f for k, f in summary["traffic_formula"].items()
                       if f is not None), (summary["traffic"], summary["traffic_formula"])  # None: routing
        assert summary["traffic"].keys() == summary["traffic_formula"].keys()


def rebuilt_bytes(cfg, sizes, train) -> int:
    """A layer's saves that "elementwise" rebuilds, for one microbatch on a rank (03's formula)."""
    args = (cfg, train.global_batch // sizes.dp // train.microbatches, train.seq_len // sizes.cp, sizes.tp,
            train.sequence_parallel)
    kept = {mode: full_train.tensor_parallel.layer_activation_formula(
        *args, mode, 2 if train.mixed_precision else 4, lean=True) for mode in ("none", "elementwise")}
    return kept["none"] - kept["elementwise"]


def test_sixteen_ranks_every_dimension_two(rank_pool):
    cfg, sizes = small_model(), full_train.MeshSizes(dp=2, pp=2, cp=2, tp=2, ep=2)
    train = full_train.TrainConfig(global_batch=8, seq_len=16, zero_stage=2, microbatches=2,
                                   sequence_parallel=True, lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5,
                                   moe=MOE)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS)
    check_against_reference(results, cfg, train)
    check_copies_agree(results)
    for *_, s, _ in results:
        assert all(s["traffic"][k] == f for k, f in s["traffic_formula"].items() if f is not None), s


def normwise_differences(results, expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """||step-0 gradient - expected|| / ||expected|| per parameter, reassembled from the shards."""
    got = full_train.assemble([piece for r in results for piece in r[1]])
    assert sorted(got) == sorted(expected)
    return {name: ((g - expected[name].float()).norm() / expected[name].float().norm()).item()
            for name, g in got.items()}


@st.composite
def fp8_tensor_parallel_configurations(draw):
    """tp 2 or 4, with dp 2 or not, SP or not: meshes whose FP8 GEMMs one device runs in the same
    order (no pipeline, no recompute, no ring: each microbatch's forward then its backward)."""
    sizes = full_train.MeshSizes(*draw(st.sampled_from([(1, 1, 1, 2), (2, 1, 1, 2), (1, 1, 1, 4)])))
    microbatches, rows = draw(st.sampled_from([1, 2])), draw(st.integers(1, 2))
    cfg = foundation.ModelConfig(vocab_size=draw(st.sampled_from([30, 32])), dim=16, n_heads=4,
                                 n_kv_heads=draw(st.sampled_from([h for h in (2, 4) if h % sizes.tp == 0])),
                                 ffn_dim=24, seed=draw(st.integers(0, 9)))
    train = full_train.TrainConfig(global_batch=sizes.dp * microbatches * rows, seq_len=2 * sizes.tp * draw(
        st.integers(1, 2)), zero_stage=draw(st.integers(0, 3)), microbatches=microbatches,
        sequence_parallel=draw(st.booleans()), fp8=True, lr=LR, adam_eps=ADAM_EPS)
    return cfg, sizes, train


def first_fp8_difference(mesh, reference, sizes, microbatches: int) -> tuple[int, int] | None:
    """Walk one device's FP8 GEMM operands in their order beside the mesh's (the tp ranks' pieces put
    together; a dp rank's microbatches where one device has them): the first operand some of whose
    FP8 numbers differ from one device's by more than 2^-10 of the largest, and how many; or None.
    The FP8 numbers, not the values they stand for: a gradient on dp ranks is dp times one device's
    (each rank's loss is its own rows' mean), which its scale absorbs exactly."""
    by_dp: dict[int, list] = {}
    for rank, (_, operands) in enumerate(mesh):
        by_dp.setdefault(sizes.coords(rank)["dp"], []).append(operands)
    pieces = sizes.dp * microbatches  # one device's microbatches per step
    block = len(reference) // (STEPS * pieces)  # operands per microbatch
    assert all(len(ops) == STEPS * microbatches * block for ops in by_dp[0]), "the mesh ran other GEMMs"
    for i, (bits, dtype, _) in enumerate(reference):
        piece, offset = divmod(i, block)
        step, dp_rank, microbatch = piece // pieces, piece % pieces // microbatches, piece % microbatches
        ranks = [ops[(step * microbatches + microbatch) * block + offset] for ops in by_dp[dp_rank]]
        assert all(torch.equal(r[2], ranks[0][2]) for r in ranks), f"operand {i}: the tp ranks' scales differ"
        ours = reassembled([r[0] for r in ranks], bits.shape).view(dtype).float()
        theirs = bits.view(dtype).float()
        differ = int(((ours - theirs).abs() > 2 ** -10 * theirs.abs().max()).sum())
        if differ:
            return i, differ
    return None


@settings(max_examples=max(2, settings.default.max_examples // 5))
@given(configuration=fp8_tensor_parallel_configurations())
@example(configuration=(small_model(), full_train.MeshSizes(tp=2), full_train.TrainConfig(
    global_batch=2, seq_len=8, fp8=True, lr=LR, adam_eps=ADAM_EPS)))
@example(configuration=(small_model(), full_train.MeshSizes(tp=2), full_train.TrainConfig(
    global_batch=4, seq_len=8, microbatches=2, sequence_parallel=True, fp8=True, lr=LR, adam_eps=ADAM_EPS)))
@example(configuration=(small_model(), full_train.MeshSizes(dp=2, tp=2), full_train.TrainConfig(
    global_batch=4, seq_len=8, zero_stage=3, microbatches=2, fp8=True, lr=LR, adam_eps=ADAM_EPS)))
def test_fp8_under_tensor_parallelism_is_one_devices_fp8(rank_pool, configuration):
    """--fp8 on tp ranks (SP or not, dp or not, each ZeRO stage: Float8ZeRO's amaxes go over tp too)
    against one device's FP8 on the same microbatches (08's unsharded run, each weight cast once per
    step): every scale is the whole tensor's, so every FP8 number of every GEMM is one device's,
    compared directly. Before (each rank scaling its own pieces) the first split operand moved by 4-6
    times its amax and the losses by 1e-4 - 3e-4 over 3 steps. What may still differ is fp32
    summation order (row-parallel partial sums, the vocabulary-parallel loss): FP8 numbers of
    fp32 noise around zero, under 2^-10 of the amax (measured <= 2.5e-5 of it per operand in all),
    which cannot move a result beyond fp32 rounding: the fp32 tolerances of the top of this file.
    Unless a value lies within that fp32 difference of an FP8 rounding boundary and rounds the other
    way, a flip of one grid step: sum |difference| / grid spacing over the cast values >= 2^-10 of
    their amax expects 0.01 - 0.04 per example here (none in 60 measured). A flip then moves
    everything after it like a different rounding: such an example asserts the flip (at most 2
    numbers of the first differing operand; per-shard scales move hundreds) and compares loosely, as
    FP8 runs on different roundings (FP8_LOSS_ATOL, FP8_GRAD_RTOL, justified below)."""
    cfg, sizes, train = configuration
    mesh = rank_pool.run(sizes.world, record_fp8_operands, train_on_mesh, cfg, sizes, train, STEPS)
    (reference, _), operands = rank_pool.run(1, record_fp8_operands, fp8.train_float8_zero, cfg, STEPS,
                                             train.global_batch, train.seq_len, mode="unsharded",
                                             microbatches=sizes.dp * train.microbatches, lr=train.lr,
                                             adam_eps=train.adam_eps)[0]
    flip = first_fp8_difference(mesh, operands, sizes, train.microbatches)
    (losses, *_), _ = mesh[0]
    grads, params = (full_train.assemble([piece for (r, _) in mesh for piece in r[i]]) for i in (1, 2))
    if flip is None:
        assert losses == pytest.approx(reference.losses, abs=LOSS_ATOL), (losses, reference.losses)
        for got, expected, tol in ((grads, reference.first_grads, dict(atol=GRAD_ATOL, rtol=GRAD_RTOL)),
                                   (params, reference.params, dict(atol=PARAM_ATOL, rtol=0))):
            assert got.keys() == expected.keys()
            for name, tensor in got.items():
                torch.testing.assert_close(tensor, expected[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    else:
        index, count = flip
        assert count <= 2, f"operand {index} of one device's: {count} FP8 numbers differ (per-shard scales?)"
        assert losses == pytest.approx(reference.losses, abs=FP8_LOSS_ATOL), (losses, reference.losses)
        for name, grad in grads.items():
            expected = reference.first_grads[name]
            assert (grad - expected).norm() <= FP8_GRAD_RTOL * expected.norm(), name
    for (*_, summary, _), _ in mesh:  # FP8 GEMMs change no byte held; 08's amaxes are in tp's formula
        assert summary["held"] == summary["memory_formula"]
        assert summary["traffic"] == summary["traffic_formula"]


FP8_LOSS_ATOL, FP8_GRAD_RTOL = 5e-3, 0.35


class Fp32GatherUnit(fp8.Float8GatherUnit):
    """Float8ZeRO's unit (same layout, same per-step casts) gathering and binding like 02's: fp32
    weights, which each forward casts."""
    gather_input, bind, release = (zero.FlatUnit.gather_input, zero.FlatUnit.bind,
                                   zero.FlatUnit.release)


def train_fp8_on_mesh(cfg, sizes, train, steps: int, fp8_gathers: bool = True):
    """train_on_mesh with the Float8Linear weights' ZeRO-3 all-gathers in FP8 (Float8ZeRO) or in
    fp32 (Fp32GatherUnit). Also returns the e4m3 elements cast that no Float8Linear received as
    input: the weights' casts."""
    elements = {"cast": 0, "inputs": 0}
    real_cast, real_unit, real_keep = fp8.cast_to_fp8, fp8.Float8ZeRO.unit_type, fp8.Float8Math.keep

    def counting_cast(x, scale, dtype):
        elements["cast"] += x.numel() if dtype == fp8.E4M3 else 0
        return real_cast(x, scale, dtype)

    def counting_keep(math, x):  # one cast of an input for all the linears that read it
        elements["inputs"] += x.numel()
        return real_keep(math, x)

    fp8.cast_to_fp8 = counting_cast
    fp8.Float8Math.keep = counting_keep
    fp8.Float8ZeRO.unit_type = real_unit if fp8_gathers else Fp32GatherUnit
    try:
        return *train_on_mesh(cfg, sizes, train, steps), elements["cast"] - elements["inputs"]
    finally:
        fp8.cast_to_fp8, fp8.Float8ZeRO.unit_type, fp8.Float8Math.keep = real_cast, real_unit, real_keep


@settings(max_examples=max(2, settings.default.max_examples // 5))  # two meshes trained per example
@given(configuration=configurations().filter(lambda c: c[2].moe is None  # routing would flip under FP8
                                             and c[2].recompute != "elementwise"))  # refused with FP8
@example(configuration=pinned((1, 1, 1, 1), 0, "1f1b", 1, False))  # one rank: the twin's very casts
@example(configuration=pinned((2, 1, 2, 1), 0, "1f1b", 2, False, recompute="full"))
def test_fp8_zero3_gathers_a_byte_per_weight_element_and_follows_its_fp8_twin(rank_pool, configuration):
    """--fp8 --zero 3: the Float8Linear weights all-gathered in FP8 change no bit of training (the
    same mesh with fp32 gathers), move and hold what the formulas say, and each weight element is
    cast once per step on one rank (+ once when built), not once per microbatch. Against the one-
    device FP8 twin on the whole batch: the mesh casts with other scales (each microbatch's, each
    dp or cp rank's activations and gradients; tp changes none, see above), so e4m3 / e5m2 round
    differently: the losses of 10 meshes were within 5.0e-4 of the twin's (allowed 5e-3: e4m3's 2^-4
    relative rounding moves the loss by ~5e-4 from fp32's in 3 steps) and each parameter's step-0
    gradient within 13% (relative norm; allowed 35%: a reduction missed or doubled is off by >= 50%).
    One rank with one microbatch casts exactly as the twin does: fp32 rounding only."""
    cfg, sizes, train = configuration
    train = dataclasses.replace(train, fp8=True, zero_stage=3)
    runs = [rank_pool.run(sizes.world, train_fp8_on_mesh, cfg, sizes, train, STEPS, fp8_gathers)
            for fp8_gathers in (True, False)]
    for (losses, grads, params, summary, norms, _), fp32_gathers in zip(*runs, strict=True):
        assert losses == fp32_gathers[0] and norms == fp32_gathers[4]
        for ours, theirs in ((grads, fp32_gathers[1]), (params, fp32_gathers[2])):
            assert all(a[0].name == b[0].name and torch.equal(a[0].runs, b[0].runs) and torch.equal(a[1], b[1])
                       for a, b in zip(ours, theirs, strict=True))
        assert summary["held"] == summary["memory_formula"]
        if train.schedule != "zb-h1":  # zb-h1's W may re-gather a unit; None: no formula
            assert all(summary["traffic"][k] == f for k, f in summary["traffic_formula"].items()
                       if f is not None), (summary["traffic"], summary["traffic_formula"])
    model = fp8.convert_to_float8(foundation.GPT(cfg))
    weights = set(fp8.float8_weights(model))
    names = {name for name, p in model.named_parameters() if p in weights}
    held = sum(values.numel() for r in runs[0] for piece, values in r[2] if piece.name in names)
    assert sum(r[5] for r in runs[0]) == (STEPS + 1) * held, "each weight element: one cast per step"

    reference = foundation.train_single_device(cfg, STEPS, train.global_batch, train.seq_len, lr=train.lr,
                                               adam_eps=train.adam_eps, max_grad_norm=train.max_grad_norm,
                                               transform=fp8.convert_to_float8)
    losses, grads = runs[0][0][0], full_train.assemble([piece for r in runs[0] for piece in r[1]])
    if sizes.world == 1 and train.microbatches == 1:
        check_against_reference([r[:5] for r in runs[0]], cfg, train, reference=reference)
    assert losses == pytest.approx(reference.losses, abs=FP8_LOSS_ATOL), (losses, reference.losses)
    for name, grad in grads.items():
        expected = reference.first_grads[name]
        assert (grad - expected).norm() <= FP8_GRAD_RTOL * expected.norm(), name


def test_bf16_mixed_precision_follows_its_one_device_twin(rank_pool):
    """ZeRO's bf16 compute with fp32 masters through pipeline boundaries (bf16 activations), the
    ring and SP, against 02's one-device bf16 twin: bf16 keeps 8 bits, so sums in another order
    differ by ~1e-3 relative; the losses were within 3.6e-5 here (allowed: 5e-4). A missed
    reduction would be off by the loss's own scale. Gradients, per parameter, in norm: the two round
    to bf16 at different points (tp and cp partial sums, microbatches, stage boundaries), each
    rounding off by at most u = 2^-8; a layer-0 weight's gradient passes the roundings of the
    layers above, forward and backward: 8u = 2^-5 allowed, the largest measured 0.0107 (2.7u). A
    reduction missed or done twice is off by >= 25%."""
    cfg, sizes = small_model(), full_train.MeshSizes(pp=2, cp=2, tp=2)
    train = full_train.TrainConfig(global_batch=4, seq_len=8, microbatches=2, zero_stage=3,
                                   sequence_parallel=True, lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5,
                                   mixed_precision=True)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS)
    ref = foundation.train_single_device(cfg, STEPS, 4, 8, lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5,
                                         mixed_precision=True)
    assert results[0][0] == pytest.approx(ref.losses, abs=5e-4)
    gradients = normwise_differences(results, ref.first_grads)
    assert max(gradients.values()) < 8 * torch.finfo(torch.bfloat16).eps / 2, gradients


def trainer_left_alive(cfg, sizes, train) -> list[str]:
    """Which of a Trainer and its stage models outlive two steps, the last reference to them and a
    garbage collection."""
    trainer = full_train.check_steps(cfg, full_train.build_mesh(sizes), train, 2, torch.device("cpu"))[-1]
    references = {"trainer": weakref.ref(trainer),
                  **{f"stage {stage}": weakref.ref(model) for stage, model in trainer.stages.items()}}
    del trainer
    gc.collect()
    return sorted(name for name, reference in references.items() if reference() is not None)


FP8_ZERO3 = pinned((2, 1, 1, 2), 3, "1f1b", 2, True)


@pytest.mark.parametrize("configuration", [
    pinned((2, 1, 2, 1), 3, "1f1b", 2, False, ep=2),  # 06's MoE keeps its aux loss, and so that loss's graph
    pinned((1, 2, 1, 2), 3, "interleaved", 2, True, n_layers=4),
    (*FP8_ZERO3[:2], dataclasses.replace(FP8_ZERO3[2], fp8=True, mixed_precision=True)),  # 08's Float8ZeRO
])
def test_a_dropped_trainer_frees_its_models(rank_pool, configuration):
    """As lesson 01's wrapper (test_01's test_a_dropped_wrapper_frees_its_model says why).
    Here ZeRO-3's hooks on its modules' outputs matter too: a graph kept after backward (06's aux loss,
    held by its layer) keeps their hooks, and with hooks that held the ZeRO, a Trainer with MoE stayed
    alive (measured), its 4 groups' threads with it."""
    assert rank_pool.run(4, trainer_left_alive, *configuration) == [[]] * 4


def test_mesh_coordinates_and_groups():
    sizes = full_train.MeshSizes(dp=2, pp=2, cp=2, tp=2)
    assert [sizes.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1], "tp must vary fastest"
    assert sizes.coords(13) == dict(dp=1, pp=1, cp=0, tp=1)
    assert all(sizes.rank(**sizes.coords(r)) == r for r in range(sizes.world))
    for dims, n_groups in ((("tp",), 8), (("dp", "cp"), 4), (("pp",), 8)):
        groups = sizes.groups(dims)
        assert len(groups) == n_groups and sorted(r for g in groups for r in g) == list(range(16))
    assert sizes.groups(("tp",))[0] == [0, 1] and sizes.groups(("dp", "cp"))[0] == [0, 2, 8, 10]
    for mesh in (sizes, full_train.MeshSizes(dp=3, pp=1, cp=2, tp=2), full_train.MeshSizes(dp=1, pp=3, cp=1, tp=2)):
        grid = torch.arange(mesh.world).view(*(getattr(mesh, d) for d in full_train.DIMS))
        for n in range(1, 5):  # every set of dims: the groups are the grid's lines along them, in mesh order
            for dims in itertools.combinations(full_train.DIMS, n):
                moving = [full_train.DIMS.index(d) for d in dims]
                fixed = [i for i in range(4) if i not in moving]
                lines = grid.permute(*fixed, *moving).reshape(-1, math.prod(grid.shape[i] for i in moving))
                assert mesh.groups(dims) == lines.tolist(), (mesh, dims)
    assert "rank 13: dp=1 pp=1 cp=0 tp=1\n" in full_train.rank_map(sizes)
    with_ep = full_train.MeshSizes(dp=2, pp=2, cp=2, tp=2, ep=4)
    assert with_ep.expert_groups(False)[0] == [0, 2, 8, 10] and with_ep.expert_groups(True)[0] == [0]
    assert "rank 10: dp=1 pp=0 cp=1 tp=0 ep=3" in full_train.rank_map(with_ep)
    ep2 = full_train.MeshSizes(dp=2, cp=2, ep=2)  # ep groups: cp pairs; expert-data groups: the dp pairs
    assert ep2.expert_groups(False) == [[0, 1], [2, 3]] and ep2.expert_groups(True) == [[0, 2], [1, 3]]


def test_an_odd_sequence_is_refused_only_where_the_zigzag_cuts_it():
    """Zigzag cuts a sequence in 2 x cp chunks; at cp = 1 there is no cut (before: seq_len=31 refused at
    cp = 1 with "not divisible by 2 x cp = 2")."""
    cfg = small_model()
    odd = full_train.TrainConfig(global_batch=2, seq_len=31)
    full_train.validate(cfg, full_train.MeshSizes(), odd, 1)
    with pytest.raises(ValueError, match=r"seq_len=31 is not divisible by 2 x cp = 4"):
        full_train.validate(cfg, full_train.MeshSizes(cp=2), odd, 2)


def test_invalid_configurations_list_every_violation(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_layers=1, n_heads=3, ffn_dim=20)
    train = full_train.TrainConfig(global_batch=3, seq_len=6, zero_stage=4, microbatches=2,
                                   sequence_parallel=True)
    rank_pool.expect_invalid(4, train_on_mesh, cfg, full_train.MeshSizes(dp=2, pp=2, tp=2), train, 1,
                             match=r"(?s)zero_stage=4 must be <= 3.*2 x 2 x 1 x 2 = 8 is not the world size 4"
                                   r".*n_heads=3 is not divisible by tp=2.*global_batch=3 is not divisible by dp=2")
    good = full_train.TrainConfig(global_batch=4, seq_len=6, microbatches=2)
    rank_pool.expect_invalid(4, train_on_mesh, small_model(1), full_train.MeshSizes(pp=2, cp=2), good, 1,
                             match=r"(?s)seq_len=6 is not divisible by 2 x cp = 4.*n_layers=1 cannot fill")
    moe_train = full_train.TrainConfig(global_batch=4, seq_len=8,
                                       moe=full_train.expert_parallel.MoEConfig(n_experts=3))
    rank_pool.expect_invalid(4, train_on_mesh, small_model(), full_train.MeshSizes(dp=2, tp=2, ep=4),
                             moe_train, 1, match=r"(?s)ep=4 must divide dp x cp = 2.*")
    rank_pool.expect_invalid(4, train_on_mesh, small_model(), full_train.MeshSizes(dp=4, ep=2), moe_train, 1,
                             match=r"(?s)n_experts=3 is not divisible by ep=2.*dropless and unbalanced")
    with pytest.raises(ValueError, match="ep=2 needs an MoE model"):
        full_train.validate(small_model(), full_train.MeshSizes(dp=2, ep=2), good, 2)
    with pytest.raises(ValueError, match="global_batch=0 must be >= 1"):
        full_train.validate(small_model(), full_train.MeshSizes(), full_train.TrainConfig(global_batch=0), 1)
    with pytest.raises(ValueError, match="dp=0 must be >= 1"):
        full_train.validate(small_model(), full_train.MeshSizes(dp=0), good, 1)
    sequence_parallel = full_train.TrainConfig(global_batch=1, seq_len=12, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"seq_len / cp = 12 / 2 tokens over tp=4: not divisible"):
        full_train.validate(small_model(), full_train.MeshSizes(cp=2, tp=4), sequence_parallel, 8)
    whole = dataclasses.replace(good, recompute="whole", fp8=True, moe=moe_train.moe)  # plan's, unpriced
    with pytest.raises(ValueError, match="its rerun's FP8 amaxes and MoE all-to-alls have no formula"):
        full_train.validate(small_model(), full_train.MeshSizes(), whole, 1)


def nan_step(cfg, sizes, train):
    """One NaN weight on the first stage: the loss, the norm and every parameter element on every
    rank, both stages, come out NaN (clipping by a NaN norm must not hide it)."""
    trainer = full_train.Trainer(cfg, full_train.build_mesh(sizes), train, torch.device("cpu"))
    if 0 in trainer.stages:
        with torch.no_grad():
            trainer.stages[0].layers["0"].attn_norm.weight[0] = float("nan")
    loss = trainer.forward_backward(full_train.dp_rows(cfg, train, 0, trainer.mesh))
    norm = trainer.update()
    return loss, norm, all(values.isnan().all() for _, values in full_train.shard_values(trainer))


def test_a_nan_propagates_to_every_rank(rank_pool):
    sizes = full_train.MeshSizes(dp=2, pp=2)
    train = full_train.TrainConfig(global_batch=4, seq_len=8, microbatches=2, zero_stage=0, max_grad_norm=1.0)
    for loss, norm, every_param_nan in rank_pool.run(sizes.world, nan_step, small_model(), sizes, train):
        assert math.isnan(loss) and math.isnan(norm) and every_param_nan


def wrong_rows(cfg, sizes, train):
    trainer = full_train.Trainer(cfg, full_train.build_mesh(sizes), train, torch.device("cpu"))
    trainer.forward_backward(torch.zeros(train.global_batch, train.seq_len, dtype=torch.long))


def test_rows_of_the_wrong_shape_are_refused(rank_pool):
    train = full_train.TrainConfig(global_batch=4, seq_len=8)
    rank_pool.expect_invalid(2, wrong_rows, small_model(), full_train.MeshSizes(dp=2), train,
                             match=r"rows of shape \(4, 8\): this dp rank expects .* = \(2, 9\)")


def test_the_profile_attributes_kernels_by_their_launch_from_any_thread():
    """A trace in the profiler's format: forward on the main thread launches kernel A; backward's
    range is on the main thread, but autograd's own thread launches kernel B inside it; kernel C is
    launched outside every part. Each part gets the kernels launched in its range; the GPU's idle
    time is the span from the first kernel's start to the last one's end, less their union."""
    ms = 1000  # the trace's times are in microseconds
    def kernel(name, ts, dur, correlation):
        return {"cat": "kernel", "name": name, "ts": ts * ms, "dur": dur * ms,
                "args": {"correlation": correlation}}

    def launch(cat, ts, correlation, tid):
        return {"cat": cat, "name": "launch", "ts": ts * ms, "args": {"correlation": correlation}, "tid": tid}
    events = [{"cat": "user_annotation", "name": "forward", "ts": 0, "dur": 100 * ms, "tid": 1},
              {"cat": "user_annotation", "name": "backward", "ts": 100 * ms, "dur": 200 * ms, "tid": 1},
              launch("cuda_runtime", 50, 1, 1), launch("cuda_driver", 150, 2, 2),
              launch("cuda_runtime", 310, 3, 1),
              kernel("A", 60, 80, 1), kernel("B", 200, 50, 2), kernel("C", 320, 30, 3)]
    text = full_train.step_profile({"traceEvents": events}, steps=1, step_s=0.4)
    spent = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()[1:3]}
    assert spent == {"forward": 80.0, "backward": 50.0}, text
    busy, span = 80 + 50 + 30, 350 - 60
    assert f"ran kernels {busy:.1f} ms and sat idle {span - busy:.1f} ms" in text, text


def out_of_vocabulary_rows(cfg, sizes, train, bad_id):
    trainer = full_train.Trainer(cfg, full_train.build_mesh(sizes), train, torch.device("cpu"))
    rows = torch.zeros(train.global_batch // sizes.dp, train.seq_len + 1, dtype=torch.long)
    rows[0, -1] = bad_id  # a target only: the vocab-parallel loss would skip it
    trainer.forward_backward(rows)


@pytest.mark.parametrize("bad_id", [30, -1])
def test_ids_outside_the_vocabulary_are_refused_on_the_cpu(rank_pool, bad_id):
    """09 checks its rows before they move to the device (03's check on device tensors would make
    the CPU wait for the GPU every step); a tp shard would otherwise skip an id no rank holds."""
    train = full_train.TrainConfig(global_batch=4, seq_len=8)
    rank_pool.expect_invalid(2, out_of_vocabulary_rows, small_model(), full_train.MeshSizes(tp=2), train,
                             bad_id,
                             match=r"token and target ids must lie in \[0, 30\)")


def test_main_runs_and_prints_the_check():
    out = run_script("09_full_train.py", *"check --dp 2 --tp 2 --moe --ep 2 --steps 2 --seq-len 16".split())
    assert "max |difference| from one device" in out and "rank  3: dp=1 pp=0 cp=0 tp=1" in out
    assert "MoE 4 experts top-2 over ep=2" in out and ", recompute none, " in out  # the header names the mode


def test_train_bounds_elementwise_recomputes_activations_by_a_layers_refill():
    """At pp 2, rank 0 (no head) held 31,008 B above its plan with elementwise recompute, 288 B with none
    (helper-55): a layer's emptied storages are full inside its regions and again once backward refills
    them. The line says so, and what it measures is within it: plan <= measured <= plan + that layer's."""
    out = run_script("09_full_train.py", *("train --steps 2 --seq-len 16 --global-batch 4 --eval-every 2 --no-save "
                                           "--dp 1 --tp 1 --pp 2 --microbatches 4 --recompute elementwise").split())
    line = re.search(r"the most autograd held per rank: ([\d,]+), .*in flight: ([\d,]+) \(.*recompute elementwise, "
                     r"lean saves\), and up to a layer's ([\d,]+) B it empties at its regions' ends and refills in "
                     r"their backward\n", out)
    assert line, out
    measured, planned, rebuilt = (int(x.replace(",", "")) for x in line.groups())
    assert planned <= measured <= planned + rebuilt and rebuilt > 0, line.group(0)


def test_check_of_a_diverged_run_fails_instead_of_printing_differences():
    """--lr 1e6 turns the loss NaN at step 2 on the mesh and on one device alike: the check printed
    "max |difference| ... loss 4.8e-07" (max() skips NaN) and exited 0 (helper-48). Now its losses, then
    one line naming the step, exit 1."""
    proc = subprocess.run([sys.executable, "09_full_train.py", "check", "--dp", "1", "--tp", "1", "--steps", "3",
                           "--lr", "1e6"], cwd=ROOT, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 1 and "max |difference|" not in proc.stdout, (proc.stdout, proc.stderr)
    step = re.search(r"error: the mesh's loss at step (\d) is nan: its training diverged \(a smaller --lr\), "
                     r"and non-finite numbers prove no equality\n$", proc.stderr)
    assert step and re.search(rf"\n{step[1]} +nan ", proc.stdout), (proc.stdout, proc.stderr)


def test_check_fp8_prints_its_differences_from_one_devices_fp8_run():
    """check --fp8 beside one device's FP8 run on the same microbatches (dp x m of them, each cast
    with its own scales, as the mesh casts them): the same FP8 numbers, so a step within this file's
    fp32 tolerances (after it, fp32's rounding flips a few FP8 roundings: the printout says so).
    Beside the fp32 reference it printed FP8's rounding as the mesh's figure (loss 5.9e-4, step-0
    gradients 1.7e-3 at dp 2 x tp 2)."""
    out = run_script("09_full_train.py", *"check --fp8 --steps 1 --seq-len 16".split())
    loss, grads, params = map(float, re.search(
        r"max \|difference\| from one device's FP8 run on the same 4 microbatches \(AdamW, clipping at 1.0\): "
        r"loss (\S+), step-0 gradients (\S+), parameters after 1 step (\S+) ", out).groups())
    assert loss <= LOSS_ATOL and grads <= GRAD_ATOL and params <= PARAM_ATOL, (loss, grads, params)
    assert "(FP8: the same scales, so the same FP8 numbers" in out


# --- --compile: one graph per block -------------------------------------------------------------

# Compiled against eager on the same rank, batch and shards. The tests compile with aot_eager, not
# Inductor: Inductor spends ~45 s on two cores generating a block's C++, while aot_eager captures
# the same graphs (AOTAutograd's backward included, traced through the operators' fake
# implementations) and runs them with PyTorch's kernels: everything but the code generation, which
# test_07 checks on the kernel's operators. Measured: the same bits at tp = 1 and 2 (the same
# kernels in the same order); 1e-7 (3 ulps on gradients of up to 0.33) leaves room for an op that
# AOTAutograd decomposes. A wrong fake shape or stride, a lost gradient, a collective run twice or
# not at all is off by 1e-3 or more, or raises.
COMPILED_ATOL = dict(loss=1e-6, grad=1e-7)


def compiled_against_eager(tp: int, sequence_parallel: bool, fp8: bool = False) -> tuple:
    """On every rank of a tp mesh, 07's attention (4 query heads reading 2 K/V heads): the graph
    breaks torch._dynamo.explain finds in a whole stage model under a comm meter (the Trainer's
    step runs under one); then the stage model eager and with --compile's blocks, a forward and
    backward each: loss, this rank's gradients, the collectives it sent. One layer: --compile
    compiles each block on its own, and a second cost 35 s of tracing in all (81 s for the three, 46 s)."""
    torch._dynamo.reset()
    cfg = foundation.ModelConfig(vocab_size=30, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=32)
    train = full_train.TrainConfig(global_batch=2, seq_len=8, attention="flash",
                                   sequence_parallel=sequence_parallel, fp8=fp8)
    sizes = full_train.MeshSizes(tp=tp)
    mesh = full_train.build_mesh(sizes)
    batch = foundation.synthetic_batch(cfg, 2, 8, step=0)
    with foundation.comm_meter():
        stage = full_train.build_stage_model(cfg, mesh, train, 0, 1, torch.device("cpu"))
        explained = torch._dynamo.explain(stage)(*batch)
    runs, aot_eager = [], functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
    for compile in (False, True):
        with unittest.mock.patch.object(torch.nn.Module, "compile", aot_eager):
            stage = full_train.build_stage_model(cfg, mesh, dataclasses.replace(
                train, compile=compile), stage=0, n_stages=1, device=torch.device("cpu"))
        assert all(hasattr(block.forward, "_torchdynamo_orig_callable") == compile for block in stage.layers.values())
        with foundation.comm_meter() as meter:
            loss = stage(*batch)
            loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in stage.named_parameters()},
                     {key: (s.calls, s.payload_bytes) for key, s in meter.stats.items()}))
    return explained.graph_break_count, [r.reason for r in explained.break_reasons], runs


@pytest.mark.parametrize("tp, sequence_parallel, fp8", [(1, False, False), (2, True, False), (2, True, True)])
def test_compiled_blocks_are_one_graph_and_equal_eager(rank_pool, tp, sequence_parallel, fp8):
    """07's kernel and 03's collectives are operators, and at tp = 1 03 inserts nothing: a stage model
    traces as one graph, without a break (before, with two layers: 14 at tp = 1, 22 at tp = 2 with SP,
    at every attention call and around every f and g, whose comm-meter Python the tracer cannot follow). So
    --compile takes every block whole (fullgraph=True), and the compiled step equals eager's on the
    loss, every gradient and every collective, at tp = 1 none. --fp8 too: 08's amax all-reduces over
    tp go through 03's collective operator."""
    for breaks, reasons, (eager, compiled) in rank_pool.run(tp, compiled_against_eager, tp, sequence_parallel,
                                                            fp8, timeout=600):
        assert breaks == 0, reasons
        assert abs(compiled[0] - eager[0]) <= COMPILED_ATOL["loss"]
        assert compiled[1].keys() == eager[1].keys()
        for name, grad in eager[1].items():
            torch.testing.assert_close(compiled[1][name], grad, atol=COMPILED_ATOL["grad"], rtol=0,
                                       msg=lambda m: f"{name}: {m}")
        assert compiled[2] == eager[2] and bool(eager[2]) == (tp > 1)


def zero3_compiled_against_eager(cfg, sizes, train) -> list[tuple]:
    """On every rank: two steps of ZeRO-3 (losses, final parameter shards), eager then compiled."""
    runs = []
    for compile in (False, True):
        losses, _, params, _ = full_train.check_steps(cfg, full_train.build_mesh(sizes),
                                                      dataclasses.replace(train, compile=compile), 2,
                                                      torch.device("cpu"))
        runs.append((losses, [values for _, values in params]))
    return runs


def test_zero3_gathers_around_compiled_blocks(rank_pool):
    """ZeRO-3's hooks on each block wait for its all-gather, which the tracer cannot follow: --compile
    takes each block's forward whole (fullgraph=True), and the hooks run eagerly around it. Before,
    --zero 3 --compile stopped at torch._dynamo's Unsupported (Work.wait) (measured on one rank and on
    dp 2 x tp 2); now two steps equal eager's within 1e-6, losses and parameters (COMPILED_ATOL's loss
    bound): a gather missed or bound late would leave a block's weights empty or stale, off by their
    own scale, ~0.02."""
    cfg, sizes, train = pinned((2, 1, 1, 1), 3, "1f1b", 2, False, n_layers=1)
    for eager, compiled in rank_pool.run(sizes.world, zero3_compiled_against_eager, cfg, sizes, train, timeout=600):
        assert compiled[0] == pytest.approx(eager[0], abs=COMPILED_ATOL["loss"])
        for ours, reference in zip(compiled[1], eager[1], strict=True):
            torch.testing.assert_close(ours, reference, atol=COMPILED_ATOL["loss"], rtol=0)


def test_fullgraph_blocker_names_what_keeps_a_block_in_pieces():
    train, moe = full_train.TrainConfig(), full_train.TrainConfig(moe=MOE)
    for sizes in (full_train.MeshSizes(), full_train.MeshSizes(dp=2, pp=2, tp=2)):
        assert full_train.fullgraph_blocker(sizes, train) is None
        assert "several graphs: --moe" in full_train.fullgraph_blocker(sizes, moe)
    assert "several graphs: cp > 1" in full_train.fullgraph_blocker(full_train.MeshSizes(cp=2), train)
    assert "left eager: ep > 1" in full_train.fullgraph_blocker(full_train.MeshSizes(dp=2, ep=2), moe)


def test_trains_header_counts_an_moes_experts_not_the_dense_model():
    """train --moe printed the dense model's "836,736 matmul params" (helper-48) and would price MFU by
    them: now the experts, and every parameter the model holds; the dense header is 6N's N."""
    dense = sum(p.numel() for name, p in foundation.GPT(BYTES).named_parameters() if name != "embed.weight")
    assert full_train.model_words(BYTES, None) == f"({dense:,} matmul params)"
    moe_model = full_train.reference_transform(full_train.TrainConfig(moe=MOE))(foundation.GPT(BYTES))
    held = sum(p.numel() for p in moe_model.parameters())
    assert full_train.model_words(BYTES, MOE) == f"with MoE layers of 4 experts, top 2 ({held:,} parameters)"


# === Part 2: the training run ===================================================================
# Tolerances: data, checkpoints and sampling are copies and integer work: exact. A run resumed on
# the same mesh repeats the same operations on the restored state: bitwise equal losses. Resumed on
# another mesh (dp=2 x tp=2 -> dp=4, -> pp=2 x tp=2 with ZeRO-0, ZeRO-1 -> ZeRO-3), the sums run
# in another order: losses within RESUME_ATOL = 2e-5 of the uninterrupted run (measured <= 4.8e-7
# on losses ~5.5; the part-1 loss tolerance). A state restored wrong (AdamW's moments or step
# lost, a slice misplaced) moves the loss by >= 1e-3 at lr 3e-3.

RESUME_ATOL = 2e-5


# --- data ---------------------------------------------------------------------------------------

def name_of(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def loss_of_the_last_stage(sizes: "full_train.MeshSizes", chunks: int) -> tuple:
    """What 09's Trainer made its last stage's loss_fn: (its name, its slices, the loss it slices)."""
    mesh = full_train.build_mesh(sizes)
    train = full_train.TrainConfig(loss_chunks=chunks)
    trainer = full_train.Trainer(small_model(), mesh, train, torch.device("cpu"))
    loss_fn = trainer.stages[max(trainer.stages)].loss_fn
    return name_of(loss_fn), getattr(loss_fn, "chunks", None), name_of(getattr(loss_fn, "loss_fn", None))


@pytest.mark.parametrize("tp, whole", [(1, "cross_entropy_loss"), (2, "VocabParallelLoss")])
def test_loss_chunks_slices_the_loss_tensor_parallelism_made(rank_pool, tp, whole):
    """--loss-chunks wraps the loss 03's apply_tensor_parallel installed (01's at tp = 1), after it: a
    wrapper set before would be replaced, and training would equal one device all the same."""
    sizes = full_train.MeshSizes(tp=tp)
    for made in rank_pool.run(tp, loss_of_the_last_stage, sizes, 3):
        assert made == ("ChunkedLoss", 3, whole)
    for made in rank_pool.run(tp, loss_of_the_last_stage, sizes, 1):
        assert made == (whole, None, "NoneType")  # 1: the loss unsliced


def reductions_in_flight_when_the_schedule_ends(sizes: "full_train.MeshSizes", train) -> list[bool]:
    """For each unit of each of this rank's ZeROs: whether its gradient's reduction was already launched
    when forward_backward reached finish_gradient_sync (launched during the last backward: in flight)."""
    mesh = full_train.build_mesh(sizes)
    cfg = small_model(n_layers=4)
    trainer = full_train.Trainer(cfg, mesh, train, torch.device("cpu"))
    launched = []
    for part in trainer.zeros:
        def finish(zero=part.zero, finish=part.zero.finish_gradient_sync):
            launched.extend(unit.reduction is not None for unit in zero.units)
            finish()
        part.zero.finish_gradient_sync = finish
    rows = torch.randint(cfg.vocab_size, (train.global_batch // sizes.dp, train.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    trainer.forward_backward(rows)
    return launched


@pytest.mark.parametrize("pp, schedule, zero_stage", [(1, "1f1b", 0), (2, "interleaved", 1), (2, "zb-h1", 3)])
def test_each_stage_reduces_its_gradients_during_its_last_backward(rank_pool, pp, schedule, zero_stage):
    """What plan prices: the gradients' reduction hidden behind the last microbatch's backward (its W
    under ZB-H1), every unit's launched from 02's hook before the schedule ends; --reduce-after-backward:
    none before."""
    sizes = full_train.MeshSizes(dp=2, pp=pp)
    for reduce_in_backward in (True, False):
        train = full_train.TrainConfig(global_batch=4, seq_len=8, zero_stage=zero_stage, schedule=schedule,
                                       microbatches=2, virtual=2 if schedule == "interleaved" else 1,
                                       reduce_in_backward=reduce_in_backward)
        for launched in rank_pool.run(sizes.world, reductions_in_flight_when_the_schedule_ends, sizes, train):
            assert len(launched) >= 2 and launched == [reduce_in_backward] * len(launched), launched


def test_default_corpus_is_the_standard_library_in_sorted_order():
    tokens = full_train.read_tokens(None, max_bytes=5000)
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    assert len(tokens) == 5000 and tokens.dtype == torch.uint8
    assert bytes(tokens[:min(len(first), 5000)].tolist()) == first[:5000]


def test_bad_data_files_give_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        full_train.read_tokens(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        full_train.read_tokens(tmp_path / "empty.txt")
    (tmp_path / "text.txt").write_bytes(b"hello")
    assert bytes(full_train.read_tokens(tmp_path / "text.txt").tolist()) == b"hello"


@given(length=st.integers(1, 200), seq_len=st.integers(1, 8), batch=st.integers(1, 4))
@example(length=20, seq_len=1, batch=1)  # 18 + 2 tokens: both parts hold exactly s + 1
@example(length=19, seq_len=1, batch=1)  # 18 + 1: validation is one token short
def test_split_refuses_exactly_the_texts_too_short_for_a_batch(length, seq_len, batch):
    tokens = torch.arange(length)
    n_val = int(length * 0.1)
    if min(n_val, length - n_val) >= batch * seq_len + 1:
        train, val = full_train.split_tokens(tokens, seq_len, batch)
        assert torch.equal(torch.cat([train, val]), tokens) and len(val) == n_val
        for part in (train, val):  # each part yields a batch
            assert next(full_train.ShardedLoader(part, seq_len, batch)).shape == (batch, seq_len + 1)
    else:
        with pytest.raises(ValueError, match=f"each part needs >= global_batch x seq_len \\+ 1 = "
                                             f"{batch} x {seq_len} \\+ 1"):
            full_train.split_tokens(tokens, seq_len, batch)


def loaders(length: int, seq_len: int, batch: int, dp: int, seed: int = 0) -> list:
    tokens = torch.arange(length)  # window i starts with token i * seq_len: its id is readable
    return [full_train.ShardedLoader(tokens, seq_len, batch, r, dp, seed) for r in range(dp)]


def global_batch(ranks: list) -> torch.Tensor:
    return torch.cat([next(loader) for loader in ranks])


@given(seq_len=st.integers(1, 6), per_rank=st.integers(1, 3), dp=st.sampled_from([1, 2, 4]),
       n_windows=st.integers(1, 30), seed=st.integers(0, 9))
def test_each_epoch_reads_every_window_once_across_ranks(seq_len, per_rank, dp, n_windows, seed):
    batch = per_rank * dp
    length = max(n_windows, batch) * seq_len + 1
    ranks = loaders(length, seq_len, batch, dp, seed)
    per_epoch = ranks[0].batches_per_epoch
    seen = []
    for _ in range(per_epoch):
        rows = global_batch(ranks)
        assert torch.equal(rows, rows[:, :1] + torch.arange(seq_len + 1)), "s + 1 consecutive tokens"
        seen += (rows[:, 0] // seq_len).tolist()
    assert len(set(seen)) == len(seen) == per_epoch * batch
    if (length - 1) // seq_len % batch == 0:
        assert sorted(seen) == list(range((length - 1) // seq_len))
    assert all((r.state_dict()["epoch"], r.state_dict()["position"]) == (1, 0) for r in ranks)


def test_loader_order_is_seeded():
    a, b, c = (global_batch(loaders(400, 4, 8, 2, seed)) for seed in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)


@given(before=st.integers(0, 9), after=st.integers(1, 9), dp_before=st.sampled_from([1, 2, 4]),
       dp_after=st.sampled_from([1, 2, 4]))
def test_loader_resumes_on_the_uninterrupted_batches_even_on_another_dp(before, after, dp_before, dp_after):
    uninterrupted = loaders(83, 3, 4, 1)  # 27 windows: 6 batches per epoch, so epochs roll over
    expected = [global_batch(uninterrupted) for _ in range(before + after)][before:]
    first = loaders(83, 3, 4, dp_before)
    for _ in range(before):
        global_batch(first)
    resumed = loaders(83, 3, 4, dp_after)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    assert all(torch.equal(global_batch(resumed), want) for want in expected)


def test_loader_errors():
    with pytest.raises(ValueError, match="divisible by dp=4 and dp_rank=0"):
        full_train.ShardedLoader(torch.arange(100), 4, 6, 0, 4)
    with pytest.raises(ValueError, match="dp_rank=2 in \\[0, 2\\)"):
        full_train.ShardedLoader(torch.arange(100), 4, 6, 2, 2)
    with pytest.raises(ValueError, match="seq_len=0 and global_batch=2 must be >= 1"):
        full_train.ShardedLoader(torch.arange(100), 0, 2)
    with pytest.raises(ValueError, match="fewer than global_batch=4 windows of seq_len \\+ 1 = 5"):
        full_train.ShardedLoader(torch.arange(16), 4, 4)
    saved = full_train.ShardedLoader(torch.arange(100), 4, 4, seed=1).state_dict()
    for other in (full_train.ShardedLoader(torch.arange(100), 4, 2, seed=1),  # a batch past the epoch's end,
                  full_train.ShardedLoader(torch.arange(60), 4, 4, seed=1),  # other data
                  full_train.ShardedLoader(torch.arange(100), 4, 4, seed=2)):
        with pytest.raises(ValueError, match="the checkpoint's data position counts other windows"):
            other.load_state_dict(saved)


# --- learning rate, MFU, sampling ---------------------------------------------------------------

def test_learning_rate_corners():
    lr = lambda step, warmup=10: full_train.learning_rate(step, 1.0, warmup, 110, 0.1)  # noqa: E731
    assert lr(0) == pytest.approx(0.1) and lr(9) == 1.0 and lr(10) == 1.0  # warmup, then the top
    assert lr(60) == pytest.approx(0.55)  # half way down the cosine: the middle of max and min
    assert lr(110) == pytest.approx(0.1) and lr(500) == 0.1  # the floor, and after
    assert lr(0, warmup=0) == 1.0
    decay = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:])), "the cosine never rises"


@given(n_heads=st.sampled_from([2, 4]), groups=st.sampled_from([1, 2]), layers=st.integers(1, 3))
def test_flops_per_token_count_the_model_but_its_embedding(n_heads, groups, layers):
    cfg = foundation.ModelConfig(vocab_size=50, dim=8 * n_heads, n_layers=layers, n_heads=n_heads,
                          n_kv_heads=n_heads // groups, ffn_dim=24)
    counted = sum(p.numel() for n, p in foundation.GPT(cfg).named_parameters() if not n.startswith("embed"))
    assert full_train.flops_per_token(cfg, 7) == 6 * counted + 12 * layers * cfg.dim * 7
    # by hand: dim 8, 2 heads of 4, ffn 16, 1 layer, vocab 10, T = 4: N = 256 (q k v o) + 384 (MLP)
    # + 16 + 8 (norms) + 80 (LM head) = 744; 6N + 12 L H Q T = 4464 + 384
    by_hand = foundation.ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, ffn_dim=16)
    assert full_train.flops_per_token(by_hand, 4) == 4848


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)])
def test_peak_flops_table(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert full_train.peak_bf16_flops(torch.device("cuda", 0)) == peak
    assert full_train.peak_bf16_flops(torch.device("cpu")) is None


def test_the_sample_is_seeded_draws_from_the_top_k_and_top_k_1_is_greedy():
    """sample draws each byte from the top_k likeliest with softmax(logits / T), by a generator seeded
    with `seed`: the same seed, the same bytes; another seed, others (a random model at T = 1 is near
    uniform over 256 bytes). Teacher-forced, one forward over the whole text ranks every byte drawn
    among its position's top_k; with top_k = 1, first: greedy decoding."""
    model = foundation.GPT(foundation.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32, seed=1))
    drawn = full_train.sample(model, b"def ", 40, temperature=1.0, top_k=256, seed=3)
    assert len(drawn) == 40 and model.training, "the model's mode is restored"
    assert full_train.sample(model, b"def ", 40, temperature=1.0, top_k=256, seed=3) == drawn
    assert full_train.sample(model, b"def ", 40, temperature=1.0, top_k=256, seed=4) != drawn
    for top_k in (1, 5):
        new = full_train.sample(model, b"def ", 30, temperature=1.0, top_k=top_k, seed=0)
        with torch.no_grad():
            logits = model(torch.tensor(list(b"def " + new))[None])[0, 3:-1]
        chosen = logits.gather(-1, torch.tensor(list(new))[:, None])
        assert (logits > chosen).sum(-1).max() < top_k, top_k  # how many bytes were likelier
    assert full_train.sample(model, b"x", 0) == b""
    bad = {"prompt": dict(prompt=b""), "not bytes": dict(model=foundation.GPT(foundation.ModelConfig())),
           "temperature 0": dict(temperature=0.0), "temperature nan": dict(temperature=math.nan),
           "top_k 0": dict(top_k=0), "n_new -1": dict(n_new=-1)}
    for case, change in bad.items():
        arguments = dict(model=model, prompt=b"a", n_new=3) | change
        with pytest.raises(ValueError, match="sample needs a non-empty prompt, a byte-level model"):
            full_train.sample(**arguments)


def test_the_sample_draws_from_the_softmax_of_the_logits_over_the_temperature():
    """At T = 0.5 with top_k 5, each draw is handed softmax(top-5 logits / 0.5), derived here from one
    teacher-forced forward over the text drawn (T = 1 was the only temperature tested: a sample that
    ignored T passed)."""
    model = foundation.GPT(foundation.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32, seed=1))
    handed, multinomial = [], torch.multinomial

    def recording(probabilities, n, generator=None):
        handed.append(probabilities.clone())
        return multinomial(probabilities, n, generator=generator)

    with unittest.mock.patch.object(torch, "multinomial", recording):
        new = full_train.sample(model, b"def ", 12, temperature=0.5, top_k=5, seed=0)
    with torch.no_grad():
        logits = model(torch.tensor(list(b"def " + new))[None])[0, 3:-1]
    expected = (logits.topk(5).values / 0.5).softmax(-1)
    torch.testing.assert_close(torch.cat(handed), expected, atol=1e-5, rtol=1e-5)


def test_the_prompt_is_whole_lines_of_the_text_from_its_second_line():
    text = b"a partial line\n    def f(x):\n        return x\n# the rest"
    tokens = torch.tensor(list(text), dtype=torch.uint8)
    first, second = b"    def f(x):\n", b"        return x\n"
    assert full_train.text_prompt(tokens, max_bytes=len(first + second)) == first + second
    assert full_train.text_prompt(tokens, max_bytes=len(first + second) - 1) == first
    assert full_train.text_prompt(tokens, max_bytes=5) == first[:5], "a line longer than max_bytes: cut"


# --- the real Trainer: checkpoints, resume, the NaN guard -----------------------------------------

BYTES = foundation.ModelConfig(vocab_size=256, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24)
TEXT = full_train.read_tokens(None, max_bytes=6000)
PER_ELEMENT = 4 * len(zero.CHECKPOINT_KINDS)  # fp32 parameter + AdamW's two moments


class Interrupted(Exception):
    pass


def train_run(sizes, train, run, stop_at=None, poison_at=None, poison="params"):
    """On every rank: the real train_loop on a fresh Trainer over TEXT. stop_at: raise after that
    step's update (a kill between checkpoints); poison_at: after that step's update, set a weight
    to NaN (every rank) or, poison="moments", rank 1's AdamW second moments to inf; or in that
    step's forward_backward, poison="inf loss": its loss is inf (every rank), "inf gradient": one
    element of rank 1's gradient shard is inf (an overflow). Returns the losses, the validation
    losses, the bytes read on resume and the bytes of this rank's slices (its ZeRO shards' real
    elements, by global_indices), or the error's text."""
    mesh = full_train.build_mesh(sizes)
    trainer = full_train.Trainer(BYTES, mesh, train, torch.device("cpu"))
    train_tokens, val_tokens = full_train.split_tokens(TEXT, train.seq_len, train.global_batch)
    loader = full_train.ShardedLoader(train_tokens, train.seq_len, train.global_batch,
                                      trainer.mesh.coords["dp"], sizes.dp, run.seed)

    forward_backward = trainer.forward_backward

    def poisoned_forward_backward(rows):
        loss = forward_backward(rows)
        if trainer.steps == poison_at and poison == "inf gradient" and trainer.mesh.rank == 1:
            trainer.zeros[0].zero.units[0].grad_shard[0] = math.inf
        return math.inf if trainer.steps == poison_at and poison == "inf loss" else loss

    trainer.forward_backward = poisoned_forward_backward

    def progress(step, loss, seconds, val):
        if step == poison_at and poison == "params":
            next(iter(trainer.stages.values())).layers["0"].mlp_norm.weight.data.fill_(math.nan)
        elif step == poison_at and poison == "moments" and trainer.mesh.rank == 1:
            zero_opt = trainer.zeros[0].zero
            zero_opt.optimizer.state[zero_opt.units[0].master]["exp_avg_sq"].fill_(math.inf)
        if step == stop_at:
            raise Interrupted

    try:
        out = full_train.train_loop(trainer, loader, val_tokens, run, progress)
    except (Interrupted, FloatingPointError, zero.CheckpointError) as error:
        return str(error)
    return dict(losses=out["losses"], val=out["val"], read=out["read"],
                slices=PER_ELEMENT * held_elements(trainer))


def one_device_validation(folder, train, run) -> float:
    """The validation loss of the checkpoint's model on one device: the mean over the first
    run.eval_batches global batches of the validation windows, as train_loop reads them."""
    model = foundation.GPT(BYTES)
    zero.load_model(model, folder)
    _, val_tokens = full_train.split_tokens(TEXT, train.seq_len, train.global_batch)
    windows = full_train.ShardedLoader(val_tokens, train.seq_len, train.global_batch, seed=run.seed)
    with torch.no_grad():
        losses = [model(rows[:, :-1], rows[:, 1:]).item()
                  for rows in (next(windows) for _ in range(run.eval_batches))]
    return sum(losses) / len(losses)


def test_resume_reads_only_its_slices_and_equals_the_uninterrupted_run_on_any_mesh(rank_pool, tmp_path):
    tp_dp = full_train.MeshSizes(dp=2, tp=2)
    train = full_train.TrainConfig(global_batch=8, seq_len=8, lr=3e-3, max_grad_norm=1.0)
    run = full_train.RunConfig(steps=6, warmup=2, eval_every=3, save_every=3, folder=str(tmp_path / "a"))
    full = rank_pool.run(4, train_run, tp_dp, train, run, timeout=600)[0]
    assert full["losses"][5] < full["losses"][0] - 0.05, "it learns"
    # The validation loss the run prints is one device's mean over the same windows (fp32 sums in
    # another order: RESUME_ATOL); a sum over the eval batches, or one dp rank's rows alone, is not.
    assert full["val"][6] == pytest.approx(one_device_validation(run.folder, train, run), abs=RESUME_ATOL)
    interrupted = dataclasses.replace(run, folder=str(tmp_path / "b"))
    stopped = rank_pool.run(4, train_run, tp_dp, train, interrupted, stop_at=4, timeout=600)
    assert stopped == [""] * 4  # after step 3's checkpoint
    assert zero.latest_checkpoint(interrupted.folder).name == "step_00000003"
    # other meshes (and ZeRO stages)
    others = ((full_train.MeshSizes(dp=4), 1), (full_train.MeshSizes(pp=2, tp=2), 0), (tp_dp, 3))
    for sizes, stage in others:
        shutil.copytree(interrupted.folder, tmp_path / f"{sizes.dp}{sizes.pp}{stage}")
    resumed = dataclasses.replace(interrupted, resume="latest")
    for result in rank_pool.run(4, train_run, tp_dp, train, resumed, timeout=600):
        assert result["losses"] == {s: full["losses"][s] for s in (3, 4, 5)}, "bitwise"
        assert result["val"] == {6: full["val"][6]}, "bitwise"
        assert result["read"] == result["slices"], "a rank reads exactly the elements it holds"
    for sizes, stage in others:
        other = dataclasses.replace(resumed, folder=str(tmp_path / f"{sizes.dp}{sizes.pp}{stage}"))
        for result in rank_pool.run(4, train_run, sizes, dataclasses.replace(train, zero_stage=stage), other,
                                    timeout=600):
            losses = result["losses"]
            assert sorted(losses) == [3, 4, 5] and result["read"] == result["slices"]
            assert [losses[s] for s in (3, 4, 5)] == pytest.approx([full["losses"][s] for s in (3, 4, 5)],
                                                                   abs=RESUME_ATOL)
            assert result["val"][6] == pytest.approx(full["val"][6], abs=RESUME_ATOL)


def test_fp8_zero3_resumes_bitwise(rank_pool, tmp_path):
    """Under --fp8 --zero 3 each rank keeps the e4m3 casts of its weight shards (lesson 08's
    Float8ZeRO): a resume must cast them anew from the loaded masters, then go on bit for bit."""
    sizes = full_train.MeshSizes(dp=2, tp=2)
    train = full_train.TrainConfig(global_batch=8, seq_len=8, lr=3e-3, max_grad_norm=1.0, fp8=True,
                                   zero_stage=3)
    run = full_train.RunConfig(steps=4, warmup=2, eval_every=100, save_every=2, folder=str(tmp_path / "a"))
    full = rank_pool.run(4, train_run, sizes, train, run, timeout=600)[0]
    interrupted = dataclasses.replace(run, folder=str(tmp_path / "b"))
    stopped = rank_pool.run(4, train_run, sizes, train, interrupted, stop_at=3, timeout=600)
    assert stopped == [""] * 4  # after step 2's checkpoint
    for result in rank_pool.run(4, train_run, sizes, train, dataclasses.replace(interrupted, resume="latest"),
                                timeout=600):
        assert result["losses"] == {s: full["losses"][s] for s in (2, 3)}, "bitwise"


# Replicated pieces: at ZeRO-0 both dp ranks hold every element, both tp ranks the norms (and the experts).
@pytest.mark.parametrize("sizes, train", [
    (full_train.MeshSizes(dp=2, tp=2), full_train.TrainConfig(global_batch=4, seq_len=8, zero_stage=0)),
    (full_train.MeshSizes(dp=2, tp=2, ep=2), full_train.TrainConfig(global_batch=4, seq_len=8, moe=MOE)),
], ids=["zero0-dp2-tp2", "moe-ep2-tp2"])
def test_each_element_is_written_once(rank_pool, tmp_path, sizes, train):
    run = full_train.RunConfig(steps=1, warmup=1, eval_every=1, folder=str(tmp_path))
    rank_pool.run(sizes.world, train_run, sizes, train, run, timeout=600)
    model = (full_train.reference_transform(train) or (lambda m: m))(foundation.GPT(BYTES))
    n = sum(p.numel() for p in model.parameters())
    target = zero.latest_checkpoint(tmp_path)
    pieces = read_pieces(target)
    payload = sum(t.untyped_storage().nbytes() for _, data in pieces for t in data.values())
    assert payload == PER_ELEMENT * n, (payload, PER_ELEMENT * n)
    # The rest is metadata: meta.json; per rank file its RNG (5,056 B) and the zip's directory (< 1 KB);
    # per piece its name, shape, runs and three zip records (< 1 KB). Pieces held twice would double
    # the payload.
    metadata = sum(f.stat().st_size for f in target.iterdir()) - payload
    assert metadata < (target / "meta.json").stat().st_size + 6_000 * sizes.world + 1_000 * len(pieces)
    zero.load_model(model, tmp_path)  # the reader refuses an element held by no piece, or by two


DAMAGES = {  # what is done to step_00000003, what the message says
    "truncated": (lambda d: os.truncate(d / "rank00001.pt", 1000), "rank00001.pt has 1,000 bytes where"),
    "altered": (lambda d: flip_bytes(d / "rank00001.pt"), "rank00001.pt does not match the sha256"),
    "missing": (lambda d: (d / "rank00000.pt").unlink(), "rank00000.pt is missing"),
    "garbled metadata": (lambda d: (d / "meta.json").write_bytes(b"\x00{x"), "meta.json cannot be read"),
    "LATEST to a missing step": (shutil.rmtree, "its folder is missing"),
}


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(255 - b for b in data[len(data) // 2:len(data) // 2 + 8])
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_one_line_on_every_rank_naming_the_file_and_the_last_good(rank_pool,
                                                                                          tmp_path):
    """Three checkpoints kept, the newest damaged: the advice names the one before it (step 2) and
    its --resume 2, not the oldest kept (step 1)."""
    sizes, train = full_train.MeshSizes(dp=2), full_train.TrainConfig(global_batch=4, seq_len=8)
    run = full_train.RunConfig(steps=3, warmup=1, eval_every=3, save_every=1, keep=3,
                               folder=str(tmp_path / "run"))
    full = rank_pool.run(2, train_run, sizes, train, run, timeout=600)[0]
    assert sorted(p.name for p in Path(run.folder).glob("step_*")) == [f"step_0000000{s}" for s in (1, 2, 3)]
    for case, (damage, what) in DAMAGES.items():
        folder = tmp_path / case
        shutil.copytree(run.folder, folder)
        damage(folder / "step_00000003")
        resumed = dataclasses.replace(run, folder=str(folder), resume="latest")
        # rank 1 hashes file 1
        for message in rank_pool.run(2, train_run, sizes, train, resumed, timeout=600):
            step_3, step_2 = folder / "step_00000003", folder / "step_00000002"
            assert "\n" not in message, message
            assert message.startswith(f"checkpoint step 3 ({step_3}) cannot be used: {what}"), (case, message)
            assert message.endswith(f"the previous complete checkpoint is step 2 ({step_2}); resume from it: "
                                    f"python 09_full_train.py --resume 2"), (case, message)
    from_previous = dataclasses.replace(resumed, resume="2")
    for result in rank_pool.run(2, train_run, sizes, train, from_previous, timeout=600):
        assert result["losses"] == {2: full["losses"][2]} and result["val"] == full["val"], "bitwise"


def test_a_run_keeps_only_its_last_keep_checkpoints(rank_pool, tmp_path):
    """--keep 2 over three saves: each save past the second removes the oldest the run wrote."""
    sizes, train = full_train.MeshSizes(dp=2), full_train.TrainConfig(global_batch=4, seq_len=8)
    run = full_train.RunConfig(steps=3, warmup=1, eval_every=3, save_every=1, keep=2,
                               folder=str(tmp_path / "run"))
    rank_pool.run(2, train_run, sizes, train, run, timeout=600)
    assert sorted(p.name for p in Path(run.folder).glob("step_*")) == ["step_00000002", "step_00000003"]


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(rank_pool, tmp_path):
    sizes, train = full_train.MeshSizes(dp=2), full_train.TrainConfig(global_batch=4, seq_len=8, zero_stage=2)
    run = full_train.RunConfig(steps=6, warmup=1, eval_every=6, save_every=2, folder=str(tmp_path))
    for message in rank_pool.run(2, train_run, sizes, train, run, poison_at=2, timeout=600):
        assert message == (f"step 3: the loss is nan; stopping without saving, the last good checkpoint is "
                           f"{tmp_path / 'step_00000002'}")
    assert zero.latest_checkpoint(tmp_path).name == "step_00000002"
    model = foundation.GPT(BYTES)
    assert zero.load_model(model, tmp_path)["step"] == 2
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("poison, stop", [
    ("inf loss", "the loss is inf; stopping without saving"),
    ("inf gradient", "the gradient norm is inf, so its update left weights that are not finite; stopping "
                     "without saving"),
])
def test_an_inf_loss_or_gradient_stops_the_run_like_a_nan(rank_pool, tmp_path, poison, stop):
    """Before: the tests injected NaN only, so a guard written as isnan would pass them. An inf loss
    stops before the update; an inf gradient element on one rank makes the global norm inf (and the
    clipped update NaN): every rank stops before the next save, naming the step. LATEST stays step 2."""
    sizes, train = full_train.MeshSizes(dp=2), full_train.TrainConfig(global_batch=4, seq_len=8, zero_stage=2)
    run = full_train.RunConfig(steps=6, warmup=1, eval_every=6, save_every=2, folder=str(tmp_path))
    for message in rank_pool.run(2, train_run, sizes, train, run, poison_at=2, poison=poison, timeout=600):
        assert message == f"step 2: {stop}, the last good checkpoint is {tmp_path / 'step_00000002'}"
    assert zero.latest_checkpoint(tmp_path).name == "step_00000002"
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_00000002"]


@pytest.mark.parametrize("poison", ["params", "moments"])
def test_no_checkpoint_holds_a_non_finite_number(rank_pool, tmp_path, poison):
    """Step 1's update leaves a NaN weight (every rank) or an inf second moment (rank 1's shard
    only, so every rank must learn it from rank 1): step 2's checkpoint is not written."""
    sizes, train = full_train.MeshSizes(dp=2), full_train.TrainConfig(global_batch=4, seq_len=8, zero_stage=2)
    run = full_train.RunConfig(steps=4, warmup=1, eval_every=4, save_every=1, folder=str(tmp_path))
    for message in rank_pool.run(2, train_run, sizes, train, run, poison_at=1, poison=poison, timeout=600):
        assert message == (f"step 1's update left parameters or AdamW moments that are not finite: "
                           f"step_00000002 is not written, the last good checkpoint is "
                           f"{tmp_path / 'step_00000001'}")
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_00000001"]
    target, meta = zero.open_checkpoint(tmp_path, BYTES)
    reader = zero.CheckpointReader(target, meta)
    for name, p in foundation.GPT(BYTES).named_parameters():
        assert all(t.isfinite().all() for t in reader.read(zero.Piece.whole(name, p.shape)).values()), name


@given(data=st.data())
def test_held_pieces_are_the_global_indices_in_runs(data):
    """held_piece plans reads in rows: the same elements, in the same order, as global_indices."""
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), label="shape"))
    dim = data.draw(st.sampled_from([None, *range(len(shape))]), label="tp_dim")
    ep = data.draw(st.booleans(), label="expert") and (dim is None or dim > 0)
    local, start, length, ep_start = list(shape), 0, 0, None
    if ep:
        local[0] = data.draw(st.integers(1, shape[0]))
        ep_start = data.draw(st.integers(0, shape[0] - local[0]))
    if dim is not None:  # a tp shard of size local[dim] (padded) starting at start, real length `length`
        local[dim] = data.draw(st.integers(1, shape[dim] + 1))
        start = data.draw(st.integers(0, shape[dim]))
        length = min(local[dim], shape[dim] - start)
    flat_start = data.draw(st.integers(0, math.prod(local)))
    flat_stop = data.draw(st.integers(flat_start, math.prod(local)))
    index = global_indices(shape, tuple(local), dim, start, length, ep_start, flat_start, flat_stop)
    expected = [(int(i), p) for p, i in enumerate(index.tolist()) if i >= 0]
    piece = full_train.held_piece("w", shape, tuple(local), dim, start, length, ep_start)
    got = [(g + k, o + k) for g, o, n in piece.narrow(flat_start, flat_stop).runs.tolist() for k in range(n)]
    assert got == expected


def read_pieces(folder: Path) -> list:
    """((name, shape, runs), {kind: values}) of every piece in folder's rank files."""
    return [((name, shape, runs), data) for f in sorted(folder.glob("rank*.pt"))
            for name, shape, runs, data in torch.load(f, weights_only=True)["pieces"]]


def test_the_training_run_on_one_process_end_to_end(tmp_path):
    """World 1 (the single-GPU path, here on the CPU): lesson 07's kernel, selective recompute,
    checkpoints, the sample, the loss curve. --resume 2 in a copy of the folder first evaluates the
    loaded weights (the validation loss recorded at the save, bit for bit), then repeats step 2:
    the same loss and validation as printed, and bitwise the same step-3 checkpoint; --resume of
    the finished run says so and trains nothing, after removing what a save killed midway left. Then
    altered bytes, a truncated file, LATEST deleted, a folder under a file, a folder holding a user's file:
    one line (from the rank, and before launch), exit code 2; a save that fails mid-run (files limited to
    1 MiB, as a full disk would stop them): one line, exit code 2."""
    # One layer: 07's kernel runs in Triton's interpreter, 2.5 s a step with the tiny preset's 4 layers
    common = ("--layers 1 --dp 1 --tp 1 --seq-len 16 --global-batch 2 --warmup 1 --steps 3 --save-every 2 "
              "--eval-every 2 --sample-bytes 4 --attention flash --recompute selective").split()
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_script("09_full_train.py", *common, "--checkpoint-dir", str(a), timeout=900)
    assert "attention flash" in out and "recompute selective" in out and "final: 2 timed steps" in out
    assert "Sample from the checkpoint" in out and "The losses ('.' training, 'o' validation):" in out
    assert "the most autograd held per rank: " in out and "'s 1 layer, 1 microbatch in flight: " in out
    assert zero.latest_checkpoint(a).name == "step_00000003"
    meta = json.loads((a / "step_00000003" / "meta.json").read_text())
    assert meta["schedule"] == {"--lr": 3e-3, "--warmup": 1, "--steps": 3}  # a resume compares its own
    n = sum(p.numel() for p in foundation.GPT(full_train.configure(parse_options("train", *common)).cfg).parameters())
    assert f"B on disk = (params + 2 AdamW moments) x 4 B x {n:,} parameters, each element once " in out
    shutil.copytree(a, b)
    resumed = run_script("09_full_train.py", "train", *common, "--checkpoint-dir", str(b), "--resume", "2",
                         timeout=900)
    assert f"resumed from {b / 'step_00000002'}: steps 2 to 3" in resumed
    assert (f"note: going back to step 2, this run's saves replace the later checkpoints step_00000003 (to keep "
            f"them, stop now and resume in a copy of {b})") in resumed  # before: silently (helper-48)
    last_loss = re.search(r"-> (\S+ at step 2)", out).group(1)
    assert f"train loss {last_loss} -> {last_loss}" in resumed
    saved_val, final_val = re.search(r"validation: (\S+) after 2, (\S+) after 3", out).groups()
    assert f"validation: {final_val} after 3" in resumed
    again = re.search(r"validation loss of the loaded weights (\S+), when saved (\S+): difference 0.0e\+00 "
                      r"\(the same mesh", resumed)
    assert again and again.group(1) == again.group(2) and f"{float(again.group(2)):.3f}" == saved_val
    (a / "step_00000009").mkdir()  # a kill -9 inside saves at steps 9 and (again) 3
    for unfinished in (a / "step_00000009" / "rank00000.pt.tmp", a / "step_00000003" / "rank00001.pt.tmp"):
        unfinished.write_bytes(b"half a file")
    finished = run_script("09_full_train.py", *common, "--checkpoint-dir", str(a), "--resume", timeout=900)
    assert "already at step 3 of --steps 3: nothing to train" in finished and "train loss" not in finished
    assert (f"removed what an interrupted save left in {a}: step_00000003/rank00001.pt.tmp, step_00000009\n"
            in finished), finished
    assert sorted(p.name for p in a.iterdir()) == ["LATEST", "LOCK", "step_00000002", "step_00000003"]
    pieces = zip(read_pieces(a / "step_00000003"), read_pieces(b / "step_00000003"), strict=True)
    for (spec_a, data_a), (spec_b, data_b) in pieces:
        assert spec_a == spec_b and all(torch.equal(data_a[k], data_b[k]) for k in data_a), spec_a
    c, d, e, under_a_file = tmp_path / "c", tmp_path / "d", tmp_path / "e", tmp_path / "a file" / "run"
    shutil.copytree(a, c)
    (c / "LATEST").unlink()
    under_a_file.parent.write_text("a file, not a folder")
    d.mkdir()
    (d / "step_00000002").write_text("the user's file, named as a step")
    flip_bytes(b / "step_00000003" / "rank00000.pt")
    os.truncate(a / "step_00000003" / "rank00000.pt", 100)
    for folder, extra, message in (
            (c, ["--resume"], f"{c} has no LATEST file .*; the complete checkpoints there are steps 2, 3: "
                              f"resume from the last: python 09_full_train.py .* --resume 3$"),
            (under_a_file, [], f"checkpoint folder {re.escape(str(under_a_file))} cannot be written "
                               f"\\(NotADirectoryError: "),
            (d, ["--save-every", "1"], f"checkpoint folder {d} holds what no run of this course wrote "
                                       f"\\(step_00000002\\): left as it is"),
            (e, ["--save-every", "1"], f"checkpoint step 1 could not be saved in {e / 'step_00000001'} "
                                       f"\\(rank 0: OSError: \\[Errno 27\\] File too large\\); the last "
                                       f"complete checkpoint: none$"),
            (b, ["--resume"], f"checkpoint step 3 \\({b / 'step_00000003'}\\) cannot be used: rank00000.pt "
                              f"does not match the sha256 .*; the previous complete checkpoint is step 2 .*; "
                              f"resume from it: python 09_full_train.py .* --resume 2$"),
            (a, ["--resume"], "rank00000.pt has 100 bytes where meta.json records"),
            (a, ["--resume", "2", "--seq-len", "8"], "counts other windows: .*--seq-len 16 \\(now 8\\)")):
        limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))) if folder == e else None
        proc = subprocess.run([sys.executable, "09_full_train.py", *common, "--checkpoint-dir", str(folder),
                               *extra], cwd=ROOT, capture_output=True, text=True, timeout=900, preexec_fn=limit)
        errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("09:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert re.search(message, errors[0]) and "Traceback" not in proc.stderr, proc.stderr


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, list, str]:
    """09's main() in this process, up to the launch, which is recorded, not run: (exit code,
    stderr, [the number of processes launched], stdout)."""
    launched = []
    monkeypatch.setattr(full_train.foundation, "launch", lambda fn, args, nproc: launched.append(nproc))
    monkeypatch.setattr(sys, "argv", ["09_full_train.py", *argv])
    try:
        full_train.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, err, launched, out


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt must not be empty"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be > 0"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--dp", "0"], "--dp must be >= 1"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--top-k", "0"], "--top-k must be >= 1"),
    (["--warmup", "0"], None),  # no warmup is a valid choice
    (["--profile", "3", "--trace", "{tmp}/no such folder/t.json"], "--trace {tmp}/no such folder/t.json: its "
                                                                   "folder does not exist"),
    (["--profile", "3", "--trace", "{tmp}"], "--trace {tmp} is a folder: name a file in it"),
    (["--profile", "3", "--trace", "{tmp}/mine.json"], "--trace {tmp}/mine.json exists: name a new file"),
])
def test_options_are_checked_before_launch_even_where_used_late(monkeypatch, capsys, tmp_path, argv, message):
    """Rank 0 writes --trace after the profiled steps: a path it could not write would fail there,
    leaving the other ranks waiting; every option is checked before any rank starts."""
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "mine.json").write_text("a user's trace")  # before: overwritten at the end of the run
    argv, message = [a.format(tmp=tmp_path) for a in argv], message and message.format(tmp=tmp_path)
    code, err, launched, _ = run_main(monkeypatch, capsys, *argv, "--checkpoint-dir", str(tmp_path / "run"))
    if message is None:
        assert code == 0 and launched == [4] and not err, err
    else:
        assert code == 2 and not launched and err.startswith(f"09_full_train.py train: error: {message}"), err
        assert err.count("\n") == 1, err
    assert (tmp_path / "mine.json").read_text() == "a user's trace"


@pytest.mark.parametrize("argv", [["--no-save", "--checkpoint-dir", "{run}"],
                                  ["--checkpoint-dir", "{run}", "--no-save"],
                                  ["--no-save", "--resume", "--checkpoint-dir", "{run}"]])
def test_an_option_and_its_off_flag_are_refused_together_in_either_order(monkeypatch, capsys, tmp_path, argv):
    """Both set one field: before, the last won, so --no-save --resume --checkpoint-dir DIR saved in DIR
    and removed an older checkpoint there. Now argparse refuses the pair, before anything is made."""
    run = tmp_path / "run"
    code, err, launched, _ = run_main(monkeypatch, capsys, "train", *[a.format(run=run) for a in argv])
    assert code == 2 and not launched and not run.exists(), err
    assert re.search(r"error: argument (--no-save: not allowed with argument --checkpoint-dir|"
                     r"--checkpoint-dir: not allowed with argument --no-save)$", err.rstrip("\n")), err


def test_resuming_from_a_folder_that_is_not_there_is_refused_and_makes_none(monkeypatch, capsys, tmp_path):
    """Before: the refusal ("holds no complete checkpoint") left the folder made, with a LOCK in it."""
    missing = tmp_path / "no run yet"
    code, err, launched, _ = run_main(monkeypatch, capsys, "train", "--resume", "--checkpoint-dir", str(missing))
    assert code == 2 and not launched and not missing.exists(), err
    assert err == f"09_full_train.py train: error: --resume: checkpoint folder {missing} does not exist (a new run: " \
                  f"drop --resume)\n"


def test_an_empty_checkpoint_dir_is_refused_not_taken_as_the_current_folder(monkeypatch, capsys):
    """--checkpoint-dir "" once said "no checkpoints" and then saved into the current folder."""
    monkeypatch.delenv("RANK", raising=False)
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", "")
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert err.startswith("09_full_train.py train: error: --checkpoint-dir must name a folder"), err


def test_under_torchrun_rank_0_alone_prints_an_invalid_option(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun sets it; a shell's stray RANK lacks it
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        for argv in (["--max-grad-norm", "0"], ["--dp", "x"]):  # ours, and argparse's own
            code, err, launched, _ = run_main(monkeypatch, capsys, *argv, "--checkpoint-dir", str(tmp_path))
            assert code == 2 and not launched and bool(err) == (rank == "0"), (rank, err)


def test_a_checkpoint_dir_in_use_or_that_is_a_file_is_refused_before_launch(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    held = zero.lock_checkpoints(tmp_path / "run")  # this process is "the running run"
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(tmp_path / "run"))
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert f"checkpoint folder {tmp_path / 'run'} is in use by a running run (pid {os.getpid()} on " in err
    held.close()
    assert run_main(monkeypatch, capsys, "--checkpoint-dir", str(tmp_path / "run"))[::2] == (0, [4]), "free"
    (tmp_path / "file").write_text("not a folder")
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(tmp_path / "file"))
    assert code == 2 and not launched, err
    assert err.endswith(f"checkpoint folder {tmp_path / 'file'} is a file, not a folder\n"), err


@pytest.mark.parametrize("mine", ["step_by_step/notes.md", "step_plots/a.txt", "draft.tmp", "step_00000100",
                                  "LATEST", "LOCK", "step_00000001/notes.md", "step_00000001/draft.tmp"])
@pytest.mark.parametrize("earlier_run", [False, True], ids=["a user's folder", "an earlier run's folder"])
def test_a_checkpoint_dir_holding_a_users_files_is_refused_before_launch_untouched(monkeypatch, capsys, tmp_path,
                                                                                    mine, earlier_run):
    """Before: "removed what an interrupted save left in DIR: draft.tmp, step_by_step, step_plots", and they
    were gone. A folder holding what no run of the course wrote is refused before any rank starts, in one
    line naming it, and not a byte of it changes (an earlier run's unfinished save stays too)."""
    monkeypatch.delenv("RANK", raising=False)
    folder = tmp_path / "run"
    if earlier_run:
        if mine in ("LATEST", "LOCK"):
            pytest.skip("the course's own name in its own folder is the course's")
        zero.lock_checkpoints(folder).close()
        (folder / "step_00000003").mkdir()
        (folder / "step_00000003" / "rank00000.pt.tmp").write_bytes(b"half a file")
    (folder / mine).parent.mkdir(parents=True, exist_ok=True)
    (folder / mine).write_text("the user's")
    before = snapshot(folder)
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(folder))
    named = mine if earlier_run and mine.startswith("step_00000001/") else mine.split("/")[0]
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert f"checkpoint folder {folder} holds what no run of this course wrote ({named}): left as it is" in err
    assert snapshot(folder) == before


def test_a_new_run_into_an_earlier_runs_checkpoints_is_refused_before_launch_untouched(monkeypatch, capsys, tmp_path):
    """Before: a new run into checkpoints/09 after the main job printed "note: ... step_00000600 is from an
    earlier run; this run replaces it at its first save", and that save removed step_00000500 and
    step_00000600, though the README said a run removes only what it wrote. Now a new run into a folder
    holding an earlier run's complete checkpoints is refused in one line before any rank starts, and not a
    byte changes; --resume continues that run (test_resume_reads_only_its_slices_*)."""
    monkeypatch.delenv("RANK", raising=False)
    folder = tmp_path / "run"
    zero.lock_checkpoints(folder).close()
    for step, keep in ((500, ()), (600, (500,))):  # the main job's last two, as --keep 2 leaves them
        zero.save_checkpoint(folder, step, [(zero.Piece.whole("w", (6,)), {"params": torch.zeros(6)})], keep=keep)
    before = snapshot(folder)
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(folder))
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert err.endswith(f"checkpoint folder {folder} holds an earlier run's checkpoints (step_00000500, "
                        f"step_00000600): --resume continues that run; a new run needs a new or empty folder "
                        f"(it removes no save it did not write)\n"), err
    assert snapshot(folder) == before
    (folder / "step_00000600" / "meta.json").unlink()  # damaged since: LATEST still names it
    (folder / "step_00000500" / "meta.json").unlink()  # and one no file names
    before = snapshot(folder)
    code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(folder))
    assert code == 2 and not launched and "holds an earlier run's checkpoints (step_00000600)" in err, err
    assert snapshot(folder) == before


def test_too_many_ranks_for_this_machine_are_named_by_count_not_by_an_option_09_lacks(monkeypatch, capsys):
    """09's mesh sets its ranks (it has no --nproc); launch_lesson's memory rule said "--nproc 128 would
    need at least ...". Now it counts the local processes."""
    monkeypatch.delenv("RANK", raising=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    too_many = memory // foundation.LOCAL_PROCESS_BYTES + 1
    code, err, launched, _ = run_main(monkeypatch, capsys, "--dp", str(too_many), "--tp", "1",
                                       "--global-batch", str(too_many))
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert f"{too_many} local processes would need at least" in err and "--nproc" not in err, err


def test_the_command_line_refuses_a_users_folder_with_exit_2(tmp_path):
    """The review's folder, through `python 09_full_train.py --checkpoint-dir DIR`: one line, exit 2."""
    for mine in ("step_by_step/notes.md", "step_plots/a.txt", "draft.tmp"):
        (tmp_path / mine).parent.mkdir(exist_ok=True)
        (tmp_path / mine).write_text("the user's")
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "09_full_train.py", "--checkpoint-dir", str(tmp_path), "--steps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 2 and not proc.stdout and proc.stderr == (
        f"09_full_train.py train: error: checkpoint folder {tmp_path} holds what no run of this course wrote "
        f"(draft.tmp, step_by_step, step_plots): left as it is; choose a new or empty folder (a run writes only "
        f"LOCK, LATEST and step_NNNNNNNN/ in it)\n"), proc.stderr
    assert snapshot(tmp_path) == before


def test_a_resume_whose_folder_became_read_only_is_refused_before_launch(monkeypatch, capsys, tmp_path):
    """Before: the run trained, then crashed at its first save (two tracebacks, the steps since the
    last save lost). Now the folder is tried before any rank starts. As root, chmod stops no write:
    the OS's refusal is played by tempfile.mkstemp raising what it raises in a read-only folder; a
    user other than root also meets the real one."""
    monkeypatch.delenv("RANK", raising=False)
    folder = tmp_path / "run"
    zero.lock_checkpoints(folder).close()  # an earlier run's folder, with its LOCK file

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(folder / "tmpx.tmp"))

    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "mkstemp", read_only)
        code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(folder), "--resume")
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert err.endswith(f"checkpoint folder {folder} cannot be written (PermissionError: [Errno 13] "
                        f"Permission denied: '{folder / 'tmpx.tmp'}')\n"), err
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            code, err, launched, _ = run_main(monkeypatch, capsys, "--checkpoint-dir", str(folder),
                                              "--resume")
        finally:
            folder.chmod(0o755)
        assert code == 2 and not launched and f"checkpoint folder {folder} cannot be written (Perm" in err


MODEL_OPTIONS = {"--dp", "--pp", "--cp", "--tp", "--ep", "--moe", "--experts", "--zero", "--schedule",
                 "--microbatches", "--virtual", "--sequence-parallel", "--fp8", "--recompute", "--kv-heads",
                 "--global-batch", "--seq-len", "--model", "--dim", "--layers", "--heads", "--ffn-dim", "--vocab",
                 "--attention", "--compile", "--eager", "--lean-saves", "--autograd-saves", "--loss-chunks",
                 "--reduce-in-backward", "--reduce-after-backward", "--ends-as-layers", "--bf16-optimizer",
                 "--fp32-grads", "--attention-dropout"}
STEP_OPTIONS = {"--steps", "--lr", "--max-grad-norm", "--bf16"}
OWN_OPTIONS = {  # what each sub-command offers, and nothing else
    "check": MODEL_OPTIONS | STEP_OPTIONS,
    "train": MODEL_OPTIONS | STEP_OPTIONS | {"--data", "--seed", "--warmup", "--eval-every",
                                             "--checkpoint-dir", "--save-every", "--keep", "--no-save",
                                             "--resume", "--prompt", "--sample-bytes", "--no-sample",
                                             "--temperature", "--top-k", "--profile", "--trace"},
}


def parse_options(*argv: str) -> argparse.Namespace:
    """09's options as main() parses them (01's parse_options of 09's fields and sub-commands)."""
    return foundation.parse_options(full_train.__doc__, full_train.OPTIONS, full_train.COMMANDS,
                                    argv=list(argv))[1]


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_reduce_after_backward_reaches_the_configuration(command):
    """The option 09's plan prices Megatron-LM 2021 and DeepSpeed with, read from the command line."""
    assert full_train.configure(parse_options(command)).train.reduce_in_backward
    after = full_train.configure(parse_options(command, "--reduce-after-backward"))
    assert not after.train.reduce_in_backward


def help_of(monkeypatch, capsys, *argv: str) -> dict[str, str]:
    """--help's text of each option, by option name."""
    monkeypatch.setenv("COLUMNS", "200")
    code, _, _, text = run_main(monkeypatch, capsys, *argv, "--help")
    assert code == 0 and "(default: None)" not in text
    return {option.split()[0].rstrip(","): option for option in re.split(r"\n  (?=-)", text)[1:]}


@pytest.mark.parametrize("command", OWN_OPTIONS)
def test_each_sub_command_shows_its_own_options_with_one_default_each(monkeypatch, capsys, command):
    options = help_of(monkeypatch, capsys, command)
    assert options.keys() == OWN_OPTIONS[command] | {"-h"}
    for option in options.values():
        assert option.count("default") <= 1, option


def test_no_sub_command_is_train_and_check_defaults_differ_as_its_help_says(monkeypatch, capsys):
    assert "{train,check,plan}" in run_main(monkeypatch, capsys, "--help")[3]
    parse = lambda *argv: vars(parse_options(*argv))  # noqa: E731
    train = parse("train")
    assert parse() == train and parse("--resume") == {**train, "resume": "latest"}
    # check's preset: 2 K/V heads; its run, 8 x 32 tokens, whatever --model (a proof on synthetic data)
    differ = {"check": dict(steps=3, microbatches=2, model="check", lr=1e-3, global_batch=8, seq_len=32)}
    for command, defaults in differ.items():
        args = parse(command)
        changed = {k: v for k, v in args.items() if k in train and v != train[k]}
        assert changed == dict(command=command, **defaults)
        options = help_of(monkeypatch, capsys, command)
        for name, value in defaults.items():
            assert f"(default: {value})" in options["--" + name.replace("_", "-")]
    options = help_of(monkeypatch, capsys, "train")
    assert all("(default: the --model's)" in options[name] for name in ("--global-batch", "--lr", "--dim"))
    assert "(default: 1, or 2 with pp > 1)" in options["--microbatches"]
    resolved = full_train.configure(parse_options("--pp", "2")).train
    _, seq_len, global_batch, lr = full_train.MODELS["tiny"]
    assert (resolved.seq_len, resolved.global_batch, resolved.lr) == (seq_len, global_batch, lr)
    assert resolved.microbatches == 2


@pytest.mark.parametrize("argv", [["--nproc", "3"], ["check", "--nproc", "4"]])
def test_the_mesh_sets_the_ranks_and_nproc_is_refused(monkeypatch, capsys, argv):
    monkeypatch.delenv("RANK", raising=False)
    code, err, launched, _ = run_main(monkeypatch, capsys, *argv)
    assert code == 2 and not launched and f"unrecognized arguments: --nproc {argv[-1]}" in err, err
    assert run_main(monkeypatch, capsys, "check", "--dp", "1", "--tp", "1", "--pp", "3")[::2] == (0, [3])


def rank_processes(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("signum, times", [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2)],
                         ids=["SIGINT", "SIGTERM", "SIGINT twice"])
def test_a_signal_to_the_launcher_alone_stops_its_ranks_before_it_says_so(signum, times):
    """`kill -INT <launcher pid>` (a scheduler; Ctrl-C signals the whole group), or plain `kill` (SIGTERM,
    which before ended the launcher alone: its ranks trained on to the last step, saving and holding the
    folder's LOCK): the launcher stops its ranks, then prints its one line, last, and exits 128 + the
    signal's number, as a shell reports it; no rank is left; no resource-tracker warning. A second
    signal while the ranks stop (Ctrl-C pressed again; `timeout` passing one on) changes nothing: it
    printed two KeyboardInterrupt tracebacks."""
    args = "--dp 2 --tp 1 --seq-len 16 --global-batch 2 --steps 100000 --eval-every 100000 --no-save".split()
    # A shell's `pytest &` starts pytest with SIGINT ignored, and an ignored signal stays ignored
    # across exec: the launcher would never see our SIGINT (three suite runs hung so). A handled one
    # is reset to the default at exec, so the launcher starts as it would from a terminal.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "09_full_train.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stderr=subprocess.PIPE,
                                start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    err = bytearray()
    chunks = iter(lambda: os.read(proc.stderr.fileno(), 4096), b"")
    reader = threading.Thread(target=lambda: [err.extend(chunk) for chunk in chunks])
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not re.search(rb" [1-9]\d*/100000", err) and time.monotonic() < deadline:
            time.sleep(0.2)  # until rank 0's bar shows a finished step
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 2, err.decode()
        for _ in range(times):
            os.kill(proc.pid, signum)
            time.sleep(0.05)
        proc.wait(timeout=120)  # a hang guard: it stops in seconds
        reader.join(timeout=10)
        text = err.decode(errors="replace")
        assert proc.returncode == 128 + signum, text
        assert text.rstrip().endswith("interrupted: the 2 local ranks stopped"), text
        for rank in ranks:
            with pytest.raises(ProcessLookupError):
                os.kill(rank, 0)
        assert "resource_tracker" not in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)


@pytest.mark.parametrize("text, message", [(None, "no such file"), (b"", "the file is empty"),
                                           (b"x" * 100, "the text is too short: 90 training and 10")])
def test_bad_data_is_one_clear_error_before_any_process_starts(tmp_path, text, message):
    data = tmp_path / "text.txt"
    if text is not None:
        data.write_bytes(text)
    proc = subprocess.run([sys.executable, "09_full_train.py", "--data", str(data)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_data_too_large_to_read_on_every_rank_is_refused_before_any_rank(monkeypatch, capsys, tmp_path):
    """Every rank (and the launcher's check) reads --data whole, its bytes and a copy: a file larger than
    this machine holds so was read until the kernel killed a rank (helper-48, by reading the code). A
    sparse file of that size: one line, before any rank starts."""
    monkeypatch.delenv("RANK", raising=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    data = tmp_path / "corpus.txt"
    with open(data, "wb") as sparse:
        sparse.truncate(memory // (2 * 5) + 1)  # 4 ranks (dp 2 x tp 2) and the launcher
    code, err, launched, _ = run_main(monkeypatch, capsys, "--data", str(data), "--no-save")
    assert code == 2 and not launched and err.count("\n") == 1, err
    assert f"--data {data} would need at least " in err and "(its bytes and their copy in each rank and here)" in err


def test_a_mesh_that_cannot_split_the_batch_is_refused_in_its_options_words(monkeypatch, capsys):
    """validate names TrainConfig's and MeshSizes' fields (global_batch=8); the reader typed --dp 3:
    the refusal says the options (the model's sizes too: the next test)."""
    code, err, launched, out = run_main(monkeypatch, capsys, "check", "--dp", "3", "--tp", "2")
    assert (code, launched, out) == (2, [], ""), err
    assert err.endswith(" check: error: invalid configuration: --global-batch 8 is not divisible by --dp 3\n"), err


def test_a_plan_read_through_a_pipe_that_closes_early_ends_quietly():
    """`plan ... | head -1`: the reader closes the pipe before plan writes its report. Before, a
    BrokenPipeError's traceback and exit 1; now nothing on stderr and exit 0, as a shell's own tools do."""
    read, write = os.pipe()
    os.close(read)
    try:
        buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
        proc = subprocess.run([sys.executable, "09_full_train.py", "plan", "--model", "llama3-8b", "--gpus", "8"],
                              cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=SCRIPT_TIMEOUT_S,
                              env=buffered)  # stdout buffered, as in a terminal's pipe: the error comes at flush
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_the_plans_memory_table_keeps_its_columns_apart_past_a_thousand_gib(monkeypatch, capsys):
    """Llama 3 405B on 8 GPUs does not fit: its totals pass 1,000 GiB, where the columns ran together
    ("1.41,313.0"). Each row of the table is its stage, 8 numbers, and what the stage holds."""
    code, err, launched, out = run_main(monkeypatch, capsys, "plan", "--model", "llama3-405b", "--dp", "1", "--pp",
                                        "4", "--cp", "1", "--tp", "2")
    assert code == 1 and not err, err  # exit 1: it does not fit
    header = next(line for line in out.splitlines() if line.startswith("GiB per GPU"))
    rows = [line for line in out.splitlines() if line.startswith("  pp ")]
    assert header.split()[3:] == ["params", "grads", "optim", "activ", "temps", "frag", "cuda+", "total"]
    assert len(rows) == 4 and any(float(row.split()[9].replace(",", "")) >= 1000 for row in rows), out
    for row in rows:
        numbers = row.split()[2:10]
        assert all(re.fullmatch(r"\d{1,3}(,\d{3})*\.\d|[\d.e-]+", n) for n in numbers), row
        assert row[:len(header)].rstrip().endswith(numbers[-1]) and len(row[:len(header)]) == len(header), row


def test_kv_heads_option_is_checked_before_any_process_starts():
    proc = subprocess.run([sys.executable, "09_full_train.py", "check", "--kv-heads", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--heads 4 is not divisible by --kv-heads 3" in proc.stderr


def test_the_loss_curve_is_drawn_where_the_losses_are():
    """Rows from the highest loss (top, labelled) to the lowest (bottom, labelled); a column per
    1/width of the steps, '.' at its mean training loss, 'o' at each validation loss."""
    train = {step: 5.0 - step / 100 for step in range(400)}  # falls a row every ~0.4 of 4 / 11
    curve = full_train.loss_curve(train, {200: 4.5}, width=40, height=12).splitlines()
    assert curve[0].startswith("  5.000 |.") and curve[11].startswith("  1.010 |")
    assert curve[11].endswith(".") and len(curve[11]) == 9 + 40, "the last column is the last steps"
    rows = [next(r for r, line in enumerate(curve[:12]) if len(line) > 9 + c and line[9 + c] == ".")
            for c in range(40)]
    assert rows == sorted(rows), "a falling loss is drawn falling"
    assert curve[1][9 + 19] == "o", "the validation after 200 steps: at step 199's column, 4.5's row"
    assert curve[12] == "        +" + "-" * 40 and "step 0" in curve[13] and curve[13].endswith("step 399")


def test_a_resume_with_another_schedule_says_so():
    """--resume --steps 1200 of a run saved with --steps 600 decays its learning rate over 1,200 steps
    from there: no longer the uninterrupted run (helper-48: silently). A note names what changed; the same
    schedule, or a checkpoint of before the field, says nothing."""
    train, run = full_train.TrainConfig(lr=3e-4), full_train.RunConfig(steps=1200, warmup=20)
    meta = {"schedule": {"--lr": 3e-4, "--warmup": 20, "--steps": 600}}
    assert full_train.changed_schedule(meta, train, run) == (
        "note: the learning rate's schedule is not the saved run's (--steps 600 -> 1200): from here the steps "
        "differ from the uninterrupted run's")
    assert full_train.changed_schedule({"schedule": full_train.schedule_of(train, run)}, train, run) is None
    assert full_train.changed_schedule({}, train, run) is None


def test_a_resume_says_how_close_its_validation_is_and_why_on_another_mesh():
    meta = {"mesh": dataclasses.asdict(full_train.MeshSizes(dp=2, tp=2)), "val": 1.5}
    same = full_train.resumed_validation(meta, 1.5, full_train.MeshSizes(dp=2, tp=2))
    assert "difference 0.0e+00 (the same mesh: the same sums, so with the same options a resumed run" in same
    other = full_train.resumed_validation(meta, 1.5 + 2 ** -20, full_train.MeshSizes(dp=4))
    assert "difference 9.5e-07 (saved on dp=2 pp=1 cp=1 tp=2, resumed on dp=4 pp=1 cp=1 tp=1" in other
    assert "then drift" in other


# === Part 3: the plan at scale (`plan`) ==========================================================
# The planner builds nothing, searches only meshes validate accepts, and its step time adds up,
# moves the right way and predicts published runs within 15%. What is exact and what is a tolerance:
# the plans are plan() (proved equal to what a running mesh measures in part 1); the step's parts add
# up to it within float rounding (rel 1e-12); the predictions of published runs are held to 15% (the
# README's table states each error), the model's stated accuracy: a change that moves a prediction
# further is a change to the model, to be argued.

def plan_main(monkeypatch, capsys, *options: str) -> tuple[int, str, str]:
    """09's plan in this process: it builds nothing and starts no rank. (exit code, stdout, stderr)"""
    monkeypatch.setattr(sys, "argv", ["09_full_train.py", "plan", *options])
    try:
        full_train.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    assert not torch.distributed.is_initialized()
    out, err = capsys.readouterr()
    return code, out, err


def preset(name: str) -> "foundation.ModelConfig":
    return foundation.ModelConfig(**{"vocab_size": 256, **full_train.PRESETS[name][0]})


def test_plan_of_llama3_70b_on_256_gpus_prints_the_fastest_meshes_that_fit(monkeypatch, capsys):
    _, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-70b", "--gpus", "256")
    assert "llama3-70b: 70.6B parameters" in out and "batch 1,024 x 8,192 tokens" in out
    meshes = re.findall(r"\n(\d)\. dp=(\d+) pp=(\d+) cp=(\d+) tp=(\d+)", out)
    assert [int(m[0]) for m in meshes] == list(range(1, full_train.TOP_MESHES + 1))
    assert all(math.prod(map(int, m[1:])) == 256 and int(m[4]) <= 8 for m in meshes)
    fullest = [float(x) for x in re.findall(r"fullest GPU ([\d.]+) GiB", out)]
    assert len(fullest) == full_train.TOP_MESHES and max(fullest) <= 80
    steps = [float(x) for x in re.findall(r"\n   step ([\d.]+) s predicted", out)]
    assert len(steps) == full_train.TOP_MESHES and steps == sorted(steps), "fastest first"
    bubbles = re.findall(r" \+ bubble ([\d.]+) s \((\d+)% of the step", out)  # once 04's fraction alone
    assert len(bubbles) == full_train.TOP_MESHES
    assert all(abs(100 * float(b) / step - int(share)) <= 1 for (b, share), step in zip(bubbles, steps)), bubbles


PLAN_RECOMPUTE = {f.name: f for f in dataclasses.fields(full_train.TrainConfig)}["recompute"].metadata["argparse"][
    "choices"]  # 03's modes and plan's whole


@given(gpus=st.sampled_from([8, 16, 64]), memory_gb=st.floats(8, 160), more=st.floats(1, 4),
       model=st.sampled_from(["1b", "llama3-8b"]), zero_stage=st.integers(0, 3),
       recompute=st.sampled_from(PLAN_RECOMPUTE), sequence_parallel=st.booleans())
def test_the_search_returns_valid_meshes_that_fit_and_more_memory_never_slows_it(
        gpus, memory_gb, more, model, zero_stage, recompute, sequence_parallel):
    cfg, (_, seq_len, batch, _) = preset(model), full_train.PRESETS[model]
    train = full_train.TrainConfig(global_batch=batch, seq_len=seq_len, zero_stage=zero_stage,
                                   mixed_precision=True, recompute=recompute,
                                   sequence_parallel=sequence_parallel)
    search = lambda gb: full_train.search_meshes(  # noqa: E731
        cfg, dataclasses.replace(train, microbatches=None), gpus, dict.fromkeys(full_train.DIMS), 1,
        full_train.Cluster(gpu_memory=gb))
    valid, fitting, _ = search(memory_gb)
    for sizes, run, plans, _ in valid:
        full_train.validate(cfg, sizes, run, gpus)  # raises if it does not accept the mesh
        assert sizes.tp <= 8 and plans == full_train.plan(cfg, sizes, run)
    fits = [v for v in valid if max(p.total for p in v[2]) <= memory_gb * 2 ** 30]
    assert sorted(map(id, fitting)) == sorted(map(id, fits)), "every mesh that fits, and only those"
    _, with_more, _ = search(memory_gb * more)
    if fitting:
        assert with_more[0][3]["step"] <= fitting[0][3]["step"]


def test_a_model_that_cannot_fit_is_one_line_saying_by_how_much(monkeypatch, capsys):
    """The one line, and exit 1 (a script's `if plan ...` reads the answer; 2 is a refused option). --json
    carries the same line as why_not_fitting (null where a mesh fits)."""
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-405b", "--gpus", "8")
    assert code == 1 and not err, err
    needs, ratio = re.fullmatch(r"llama3-405b does not fit on 8 GPUs of 80 GiB: the leanest of \d+ valid "
                                r"meshes \(dp=\d+ pp=\d+ cp=1 tp=\d+, .*\) needs ([\d,.]+) GiB on its fullest "
                                r"GPU, ([\d.]+)x the memory; its largest part: optimizer, [\d,.]+ GiB; no more "
                                r"recompute, ZeRO, microbatches, loss slices or SP make it fit\n", out).groups()
    assert float(needs.replace(",", "")) / 80 == pytest.approx(float(ratio), abs=0.05)
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-405b", "--gpus", "8", "--json")
    plan = json.loads(out)
    assert code == 1 and plan["fits"] is False and plan["fitting"] == 0 and len(plan["meshes"]) == 1
    assert plan["why_not_fitting"].startswith("its largest part: optimizer, ") and plan["why_not_fitting"].endswith(
        "no more recompute, ZeRO, microbatches, loss slices or SP make it fit")
    code, out, _ = plan_main(monkeypatch, capsys, *"--model llama3-70b --dp 4 --pp 1 --cp 1 --tp 8 --zero 2".split())
    assert code == 1
    assert re.search(r"\ndoes not fit: the fullest GPU needs [\d,.]+ GiB, [\d,.]+ GiB \(\d+%\) more than its "
                     r"80 GiB; its largest part: activations, [\d,.]+ GiB \(1 microbatch in flight\); it fits with "
                     r"--sequence-parallel: [\d,.]+ GiB, step [\d,.]+ s\n$", out), out  # faster than recompute
    deep = "--model llama3-70b --dp 1 --pp 4 --cp 1 --tp 8 --gpus 32 --microbatches 8"
    _, out, _ = plan_main(monkeypatch, capsys, *deep.split())  # 1F1B's first rank holds min(m, pp)
    held = pipeline.in_flight_bound("1f1b", 0, pp=4, m=8)
    assert "its largest part: activations, " in out and f" ({held} microbatches in flight); " in out, out
    lean = "--model llama3-8b --dp 8 --pp 1 --cp 1 --tp 1 --zero 3 --recompute full --global-batch 8 --gpu-memory 34"
    _, out, _ = plan_main(monkeypatch, capsys, *lean.split())  # the loss at once: 11.7 GiB of fp32 temporaries
    assert re.search(r"; its largest part: temporaries, [\d,.]+ GiB; it fits with --loss-chunks 8: [\d,.]+ GiB, step "
                     r"[\d,.]+ s\n$", out), out
    _, out, _ = plan_main(monkeypatch, capsys, *lean.split(), "--loss-chunks", "8")
    assert out.splitlines()[-1].startswith("fits: "), out


@pytest.mark.parametrize("options, message", [
    ("--gpu-memory 0", "--gpu-memory must be >= 1, not 0.0"),
    ("--gpu-memory -5", "--gpu-memory must be >= 1, not -5.0"),
    ("--hbm-tbps 0", "--hbm-tbps must be >= 0.01, not 0.0"),
    ("--hbm-tbps -3", "--hbm-tbps must be >= 0.01, not -3.0"),
    ("--peak-tflops 0", "--peak-tflops must be >= 1, not 0.0"),
    ("--nvlink-gbps 0", "--nvlink-gbps must be >= 1, not 0.0"),
    ("--network-gbps 0", "--network-gbps must be >= 0.1, not 0.0"),
    ("--gpus-per-node 0", "--gpus-per-node must be >= 1, not 0"),
    ("--dp 0", "--dp must be >= 1, not 0"),
    ("--peak-tflops inf --hbm-tbps inf", "--peak-tflops must be <= 1e6, not inf"),
    ("--peak-tflops 1e308 --hbm-tbps 1e308", "--peak-tflops must be <= 1e6, not 1e+308"),
    ("--hbm-tbps inf", "--hbm-tbps must be <= 1e3, not inf"),
    ("--network-gbps 1e-300", "--network-gbps must be >= 0.1, not 1e-300"),
    ("--nvlink-gbps nan", "--nvlink-gbps must be >= 1, not nan"),
    ("--gpu-memory inf", "--gpu-memory must be <= 1e5, not inf"),
    ("--gpus 10000000", "--gpus must be <= 1e6, not 10000000"),
    ("--zero 4", "--zero must be <= 3, not 4"),
    ("--layers 1000000", "--layers must be <= 10000, not 1000000"),  # 01's MAX_LAYERS
    ("--layers 1" + "0" * 400, "--layers must be <= 10000, not 1" + "0" * 400),
    ("--vocab 1" + "0" * 30, "--vocab must be <= 1000000, not 1" + "0" * 30),  # 01's MAX_WIDTH
    ("--dim 1" + "0" * 30, "--dim must be <= 1000000, not 1" + "0" * 30),
    ("--ffn-dim 1000001", "--ffn-dim must be <= 1000000, not 1000001"),
    ("--heads 1000001", "--heads must be <= 1000000, not 1000001"),
    ("--experts 1000001", "--experts must be <= 1000000, not 1000001"),
    ("--seq-len 1" + "0" * 30, "--seq-len must be <= 1e8, not 1" + "0" * 30),
    ("--global-batch 1" + "0" * 30, "--global-batch must be <= 1e7, not 1" + "0" * 30),
])
def test_plan_refuses_an_impossible_input_in_one_line_before_any_work(monkeypatch, capsys, options, message):
    """Zeros divided the step time (a ZeroDivisionError), a negative memory or bandwidth were
    planned, --dp 0 was "no sizes multiply to it"; inf and 1e308 rates priced a step at 0 s (a
    ZeroDivisionError), --peak-tflops inf alone "3,751 TFLOP/s per GPU, MFU 0%", --network-gbps 1e-300
    a step of 300 digits, --zero 4 reached validate; 10^6 layers ran past a minute, a vocabulary or width of
    10^30 printed "393390655517578089201664.00x the memory": each is one line naming the option and its range
    (Cluster, 01's MAX_LAYERS and TrainConfig state why), exit 2."""
    monkeypatch.setattr(full_train, "search_meshes", lambda *args: pytest.fail("planned"))
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8", *options.split())
    assert (code, out, err) == (2, "", f"09_full_train.py plan: error: {message}\n")


@pytest.mark.parametrize("corner", ["--peak-tflops 1 --hbm-tbps 0.01 --nvlink-gbps 1 --network-gbps 0.1",
                                    "--peak-tflops 1e6 --hbm-tbps 1e3 --nvlink-gbps 1e5 --network-gbps 1e5"])
def test_plan_prices_a_step_at_each_end_of_the_rates_ranges(monkeypatch, capsys, corner):
    """The ranges are what plan can price: at their ends a step of a few digits, its parts each a
    number, MFU at most 100%."""
    code, out, err = plan_main(monkeypatch, capsys, *"--model llama3-8b --dp 8 --pp 1 --cp 1 --tp 8".split(),
                               *corner.split())
    step, mfu = re.search(r"\nstep ([\d,.]+) s predicted: [\d,]+ TFLOP/s per GPU, MFU (\d+)%", out).groups()
    assert code == 0 and not err and len(step) < 12 and int(mfu) <= 100, out
    parts = re.findall(r" (?:GEMMs|attention|elementwise|TP|DP|PP|CP|bubble) ([\d,.e+-]+)", out)
    assert len(parts) == 8 and all(math.isfinite(float(x.replace(",", ""))) for x in parts), out


@pytest.mark.parametrize("options", ["--gpus 8 --microbatches 7", "--gpus 16 --tp 16",
                                     "--gpus 8 --moe --ep 3"])
def test_no_mesh_that_passes_validate_is_refused_like_any_other_input(monkeypatch, capsys, options):
    """Microbatches that divide no mesh's batch, tp 16 on nodes of 8, an ep that divides no dp x cp:
    one line, as before, but exit 2 (it was 0, on stdout)."""
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", *options.split())
    assert (code, out) == (2, "") and err.count("\n") == 1, (code, out, err)
    gpus = options.split()[1]
    assert err.startswith(f"09_full_train.py plan: error: no mesh of {gpus} GPUs passes validate: "), err


def test_a_gpu_just_too_small_never_reads_as_fitting(monkeypatch, capsys):
    """A model 0.4% over the memory printed "1.0x the memory" (83.5 GB of 80 read as fitting), and a
    mesh given "(0%) more": the ratio is rounded up, 1.01x and 1%."""
    cfg = preset("llama3-70b")
    train = full_train.TrainConfig(global_batch=1024, seq_len=8192, mixed_precision=True)
    valid, _, _ = full_train.search_meshes(cfg, dataclasses.replace(train, microbatches=None), 8,
                                           dict.fromkeys(full_train.DIMS), 1, full_train.Cluster())
    for mesh, need in ((None, min(max(p.total for p in v[2]) for v in valid)),
                       ((4, 1, 1, 2), max(p.total for p in timed("llama3-70b", (4, 1, 1, 2))[2]))):
        given = ["--gpus", "8"] if mesh is None else [f"--{d}={n}" for d, n in zip(full_train.DIMS, mesh)]
        memory = float(need) / 2 ** 30 / 1.004
        _, out, _ = plan_main(monkeypatch, capsys, "--model=llama3-70b", *given, f"--gpu-memory={memory!r}")
        if mesh is None:
            assert re.search(r"needs [\d,.]+ GiB on its fullest GPU, 1\.01x the memory; its largest part", out), out
        else:
            assert re.search(r"\ndoes not fit: the fullest GPU needs [\d,.]+ GiB, [\d,.]+ GiB \(1%\) more", out)


@pytest.mark.parametrize("options, given", [
    ("", "neither"),
    ("--gpus 8 --dp 2 --pp 1 --cp 1 --tp 2", "--gpus 8 --dp 2 --pp 1 --cp 1 --tp 2 (the sizes multiply to 4)"),
    ("--dp 2 --pp 1 --cp 1", "--dp 2 --pp 1 --cp 1"),  # no --tp, no --gpus
])
def test_plan_without_a_gpu_count_says_what_it_needs_and_was_given(monkeypatch, capsys, options, given):
    """The first command a student types (no options) printed a Python dict of Nones."""
    monkeypatch.setattr(full_train, "search_meshes", lambda *args: pytest.fail("planned"))
    code, out, err = plan_main(monkeypatch, capsys, *options.split())
    needs = ("09_full_train.py plan: error: plan needs --gpus N or every mesh size (--dp --pp --cp --tp), "
             "sizes that multiply")
    assert (code, out) == (2, "") and err == f"{needs} to N; given: {given}\n", err


@pytest.mark.parametrize("rank, torchrun, prints", [
    ("0", True, True), ("1", True, False), ("1", False, True)],
    ids=["torchrun rank 0", "torchrun rank 1", "a shell's stray RANK=1"])
def test_under_torchrun_the_plan_and_an_error_are_printed_once(monkeypatch, capsys, rank, torchrun, prints):
    """torchrun --nproc_per_node=2 printed the plan twice; a RANK left in a shell silenced the errors."""
    for name, value in dict(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, MASTER_ADDR="localhost",
                            MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none").items():
        monkeypatch.setenv(name, value)
    if not torchrun:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8")
    assert code == 0 and not err and out.startswith("llama3-8b: 8.03B parameters") == prints, (out, err)
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "0")
    assert code == 2 and not out and err.startswith("09_full_train.py plan: error: --gpus") == prints, err


def test_llama3_405b_on_metas_mesh_is_planned_without_building_it():
    """tp 8, pp 16, dp 64 on 8,192 GPUs (Meta's): nothing is built; the pipeline ranks' TP-local
    parameters x 8 add up to the model's (vocabulary 128,256, heads and ffn all divide by 8: no
    padding) and 7 more copies of the norms, which every tp rank holds whole."""
    cfg, sizes = preset("llama3-405b"), full_train.MeshSizes(dp=64, pp=16, tp=8)
    train = full_train.TrainConfig(global_batch=2048, seq_len=8192, microbatches=32, mixed_precision=True,
                             sequence_parallel=True, recompute="full")
    full_train.validate(cfg, sizes, train, 8192)
    plans = full_train.plan(cfg, sizes, train)
    assert [p.layers for p in plans] == [8] * 14 + [7] * 2
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    model = sum(map(math.prod, foundation.parameter_shapes(cfg).values()))
    assert sum(p.params for p in plans) * 8 - 7 * norms == model
    assert [p.in_flight for p in plans] == list(range(16, 0, -1))


# --- the step time, predicted from the operations ---------------------------------------------------

def timed(model: str, mesh: tuple[int, int, int, int], microbatches: int | None = None, **train) -> tuple:
    """planned() of a preset on mesh (dp, pp, cp, tp), bf16 with fp32 masters, H100 nodes:
    (sizes, the run, plans, step time)."""
    cfg, (_, seq_len, batch, _) = preset(model), full_train.PRESETS[model]
    run = full_train.TrainConfig(**dict(dict(global_batch=batch, seq_len=seq_len, mixed_precision=True), **train))
    return full_train.planned(cfg, full_train.MeshSizes(*mesh), dataclasses.replace(run, microbatches=microbatches),
                              full_train.Cluster())


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_leaves_no_elementwise_work_replicated(tp):
    """With SP every elementwise byte of a stage with the final norm is split t ways (norms and
    residual adds by tokens, RoPE and SwiGLU by heads and ffn), and the loss's logits by vocabulary
    (03's vocab-parallel loss moving its LOSS_BYTES a logit, 01's its own): t ranks move what one
    device moves, but for the input gradients of the linears that read one input (q, k, v; gate, up),
    which each rank sums on every token before 03's reduce-scatter (9h a token and layer, an add at a time
    in 03's SP backward operator; plain TP's compiled sums 7h; one device's norms read them, 3h). Plain TP repeats the norms and adds (10h forward, 12h backward per token and
    layer) on every rank. The embedding's lookup is every rank's."""
    cfg = foundation.ModelConfig(vocab_size=512, dim=64, n_layers=3, n_heads=8, n_kv_heads=4, ffn_dim=176)
    tokens, at = 96, dict(layers=3, embed=False, head=True, elem_bytes=2)
    one = full_train.elementwise_bytes(cfg, tokens, 1, False, **at)
    sp = full_train.elementwise_bytes(cfg, tokens, tp, True, **at)
    plain = full_train.elementwise_bytes(cfg, tokens, tp, False, **at)
    losses = [[per_logit * 512 * tokens for per_logit in full_train.LOSS_BYTES[split, False][2]] for split in (0, 1)]
    losses[1][0] += full_train.VOCAB_SLICE_BYTES * 512
    sums = {per_token: [0, per_token * cfg.dim * tokens * 2 * 3] for per_token in (3, 7, 9)}  # 3 layers, 2 B
    sp, plain = ([x - loss / tp - summed for x, loss, summed in zip(bytes_, losses[1], sums[per_token])]
                 for bytes_, per_token in ((sp, 9), (plain, 7)))
    one = [x - loss - summed for x, loss, summed in zip(one, losses[0], sums[3])]
    assert [tp * x for x in sp] == one
    extra = [(tp - 1) * (per_layer * 3 + norm) * cfg.dim * tokens * 2 for per_layer, norm in ((10, 2), (12, 3))]
    assert [tp * x - y for x, y in zip(plain, one)] == extra
    embed = full_train.elementwise_bytes(cfg, tokens, tp, True, layers=0, embed=True, head=False)
    assert list(embed) == [2 * cfg.dim * tokens * 2, 3 * cfg.dim * tokens * 2]


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_the_step_is_its_parts_and_the_pipeline_spans_the_slowest_rank_over_one_minus_the_bubble(
        schedule, virtual):
    """Issue 34: compute stretched by 1 + bubble instead of / (1 - bubble) passed, as the tests
    checked only the order of meshes. On pp 8 with 8 microbatches 04's bubble is 7/15 (1F1B), so
    the two differ by 1.9x: the span must be the slowest rank's busy time / (1 - bubble) plus the
    fill and drain's sends, each rank's idle time in it at least busy x bubble / (1 - bubble), and
    the parts add up to the step."""
    _, run, plans, timing = timed("llama3-8b", (2, 8, 1, 4), 8, schedule=schedule, virtual=virtual,
                                  sequence_parallel=True)
    bubble, busy, parts = full_train.pipeline.bubble_formula(schedule, 8, 8, virtual), timing["busy"], timing["parts"]
    assert timing["bubble"] == bubble > 0.2 and len(busy) == len(plans) == 8
    assert timing["span"] == pytest.approx(max(busy) / (1 - bubble) + parts["PP"], rel=1e-12)
    assert parts["bubble"] >= max(busy) * bubble / (1 - bubble) * (1 - 1e-12)
    assert sum(parts.values()) == pytest.approx(timing["step"], rel=1e-12)
    assert timing["overlap"] <= timing["step"] <= timing["no_overlap"]


def test_the_prediction_moves_the_right_way_when_one_input_changes():
    """More tp: more exposed TP time (each rank sends (t-1)/t of the same activations); more
    microbatches: a smaller bubble; a slower network: a slower step, the GEMMs unchanged."""
    tp_seconds = [timed("llama3-70b", (4, 4, 1, tp), recompute="full", sequence_parallel=True)[3]["parts"]["TP"]
                  for tp in (2, 4, 8)]
    assert 0 < tp_seconds[0] < tp_seconds[1] < tp_seconds[2]
    bubbles = [timed("llama3-70b", (4, 8, 1, 8), m, recompute="full")[3] for m in (8, 32, 128)]
    assert [t["parts"]["bubble"] for t in bubbles] == sorted((t["parts"]["bubble"] for t in bubbles), reverse=True)
    assert bubbles[0]["parts"]["bubble"] > 3 * bubbles[2]["parts"]["bubble"] > 0
    cfg, (sizes, run, plans, fast) = preset("llama3-70b"), timed("llama3-70b", (16, 4, 1, 4), recompute="full")
    slow = full_train.step_time(cfg, sizes, run, plans, full_train.Cluster(network_gbps=12.5))
    assert slow["parts"]["GEMMs"] == fast["parts"]["GEMMs"] and slow["step"] > fast["step"]
    assert slow["parts"]["DP"] > fast["parts"]["DP"] and slow["parts"]["PP"] > fast["parts"]["PP"]



@pytest.mark.parametrize("moe", [False, True])
def test_sequence_parallels_tp_time_hides_a_regions_regather_and_reduce_scatter_behind_its_backward_gemms(moe):
    """03's SP backward priced (Megatron's overlap), llama3-8b's layers at tp 4 with 2 microbatches a step:
    hide=False hides nothing: the TP part is every message of tp_messages at NVLink's rate plus a latency a
    call. Hidden, on a link fast enough that each message is shorter than the GEMMs it runs beside: each
    region's all-gather of its kept shard and its input gradient's reduce-scatter (the ring's bytes of
    b x s x h), a layer and microbatch; two regions a dense layer, the attention's alone where 06's experts
    keep their own MLP. Without lean saves (no regather, autograd keeps the gathered input) none."""
    cfg = dataclasses.replace(preset("llama3-8b"), n_layers=2)
    sizes = full_train.MeshSizes(1, 1, 1, 4, 1)
    run = full_train.TrainConfig(global_batch=4, seq_len=4096, microbatches=2, sequence_parallel=True,
                                 mixed_precision=True, compile=True, moe=MOE if moe else None)
    cluster = full_train.Cluster(nvlink_gbps=1e5)
    plans = full_train.plan(cfg, sizes, run)

    def tp_seconds(train, hide: bool) -> float:
        return full_train.step_time(cfg, sizes, train, plans, cluster, hide=hide)["parts"]["TP"]

    messages = full_train.tp_messages(cfg, sizes, run, cfg.n_layers, True, True)
    plain = sum(float(sent) / (1e9 * cluster.nvlink_gbps) + calls * cluster.latency for calls, sent in messages)
    assert tp_seconds(run, hide=False) == pytest.approx(plain, rel=1e-12)
    tokens = run.global_batch // run.microbatches * run.seq_len
    bsh = tokens * cfg.dim * 2  # bf16
    each_way = sum(float(foundation.ring_traffic(op, bsh, sizes.tp)) / (1e9 * cluster.nvlink_gbps)
                   for op in ("all_gather", "reduce_scatter")) + 2 * cluster.latency
    regions = 1 if moe else 2
    hidden = run.microbatches * cfg.n_layers * regions * each_way
    assert tp_seconds(run, hide=False) - tp_seconds(run, hide=True) == pytest.approx(hidden, rel=1e-9)
    autograd_saves = dataclasses.replace(run, lean_saves=False)
    assert tp_seconds(autograd_saves, hide=True) == tp_seconds(autograd_saves, hide=False)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_ring_hop_hides_behind_one_blocks_attention_not_the_whole_call(recompute):
    """05's ring sends cp - 1 hops of K/V, each while the rank computes one block and merges it, 1/cp of
    its attention and merges: exposed, microbatches x layers x (cp - 1) x (hop - block), forward and
    backward, where a hop outlasts a block. On dp 4 x cp 8 x tp 8 (Llama 3 8B), tp fills each node, so
    cp's hops cross the network and outlast a block: 1.12 s exposed (hidden behind the whole call, it was
    0; 1.44 s before the merges were priced, 0.93 s while they were not in place). Full
    recompute reruns the forward's ring: its hops twice (a review's mutant that sent them once passed)."""
    sizes, run, plans, timing = timed("llama3-8b", (4, 1, 8, 8), recompute=recompute)
    cfg, cluster, cp, tp = preset("llama3-8b"), full_train.Cluster(), 8, 8
    rows, s = run.global_batch // sizes.dp // run.microbatches, run.seq_len // cp
    sent = full_train.context_parallel.attention_bytes("ring", rows * s * cfg.dim // tp,
                                                       rows * s * cfg.n_kv_heads * cfg.head_dim // tp, cp, 2)
    attention = full_train.flash.attention_seconds(rows, cfg.n_heads // tp, s, cfg.head_dim, "flash", cp)
    merges = full_train.ring_merge_bytes(rows * s, cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim, cp)
    assert not full_train.inside_node(sizes, "cp", cluster.gpus_per_node)
    hop = [float(sent[d]) / (cp - 1) / (cluster.network_gbps * 1e9) + cluster.latency
           for d in ("forward", "backward")]
    block = [(seconds + nbytes / (cluster.hbm_tbps * 1e12)) / cp for seconds, nbytes in zip(attention, merges)]
    assert all(h > b for h, b in zip(hop, block)), (hop, block)
    forwards = 1 + (recompute == "full")
    exposed = run.microbatches * plans[0].layers * (cp - 1) * (forwards * (hop[0] - block[0]) + hop[1] - block[1])
    assert timing["parts"]["CP"] == pytest.approx(exposed, rel=1e-9)
    assert recompute == "full" or round(exposed, 2) == 1.12


def test_a_thin_fp8_gemm_is_priced_at_its_bytes_a_bf16_output_at_two():
    """08's roofline as plan prices a Float8Linear on few tokens (16): every GEMM bandwidth-bound, its
    e4m3 operands 1 byte an element, its bf16 output 2 (the backward's dW = dy^T x outputs the whole
    weight: at 1 byte it took half the time); and the casts' bytes (08's float8_cast_bytes)."""
    t, k, n, hbm = 16, 8192, 8192, 3.35e12
    moved = lambda rows, inner, cols: rows * inner + inner * cols + 2 * rows * cols  # noqa: E731
    casts = full_train.fp8.float8_cast_bytes(t, k, n)
    forward, backward = full_train.fp8.linear_seconds(t, k, n, hbm, float8=True)
    assert forward == pytest.approx((moved(t, k, n) + casts[0]) / hbm, rel=1e-12)
    assert backward == pytest.approx((moved(t, n, k) + moved(n, t, k) + casts[1]) / hbm, rel=1e-12)


def test_plan_casts_an_input_to_fp8_once_for_the_linears_that_read_it(monkeypatch):
    """03's Projections makes one FP8 cast of x for q, k, v and one for gate, up (08's Float8Math.keep,
    counted on two FP8 layers' forward): the plan prices as many input casts, CAST_BY_A_SIBLING's linears
    reading their first sibling's. Pricing a cast for each linear (before) added 3 casts of tokens x dim
    a layer's forward: NeMo's Llama 2 7B FP8 run, 16 microbatches of 4,096 tokens, 32 layers."""
    keep = fp8.Float8Math.keep
    inputs = []
    monkeypatch.setattr(fp8.Float8Math, "keep", lambda math, x: inputs.append(x.shape) or keep(math, x))
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24)
    fp8.convert_to_float8(foundation.GPT(cfg))(torch.zeros(1, 8, dtype=torch.long))
    linears = [name.split(".")[-2] for name, shape in full_train.local_shapes(cfg, 1, None, 1).items()
               if name.startswith("layers.") and len(shape) == 2]
    assert set(full_train.CAST_BY_A_SIBLING) < set(linears) and len(linears) == 7
    assert len(inputs) == cfg.n_layers * (len(linears) - len(full_train.CAST_BY_A_SIBLING)) == 2 * 4
    cfg, sizes, run, cluster = published_run("NeMo Llama 2 7B, FP8")
    run = dataclasses.replace(run, microbatches=16)
    once = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"]
    monkeypatch.setattr(full_train, "CAST_BY_A_SIBLING", ())
    each = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"]
    tokens = 4096
    extra = 16 * 32 * 3 * fp8.CAST_BYTES * tokens * cfg.dim / (cluster.hbm_tbps * 1e12)
    assert (sizes.dp, run.global_batch, run.seq_len, cfg.n_layers, run.recompute) == (8, 128, 4096, 32, "none")
    assert each - once == pytest.approx(extra, rel=1e-9)


def test_plan_casts_each_fp8_weight_once_a_step_at_the_eager_casts_bytes(monkeypatch):
    """08's weights_cast_once, or with --zero 3 Float8ZeRO's cast of each rank's shard, once a step and
    eager (08's WEIGHT_CAST_BYTES, SHARD_CAST_BYTES): NeMo's Llama 2 7B FP8 run (dp 8, 32 layers of 7
    FP8 weights) spends that many bytes a rank at the HBM's bandwidth, in its GEMMs part."""
    cfg, sizes, run, cluster = published_run("NeMo Llama 2 7B, FP8")
    run = dataclasses.replace(run, microbatches=16)
    weights = 32 * sum(math.prod(shape) for name, shape in full_train.local_shapes(cfg, 1, None, 1).items()
                       if name.startswith("layers.") and len(shape) == 2)
    hbm = cluster.hbm_tbps * 1e12
    for zero_stage, rate, shards in ((1, fp8.WEIGHT_CAST_BYTES, 1), (3, fp8.SHARD_CAST_BYTES, 8)):
        run = dataclasses.replace(run, zero_stage=zero_stage)
        cast = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"]
        monkeypatch.setitem(rate, 2, 0)
        free = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"]
        monkeypatch.undo()
        assert weights == 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) and cast - free == pytest.approx(rate[2] * weights / shards / hbm)


def test_plan_gathers_fp8_weights_under_zero_3_at_a_byte_an_element():
    """Float8ZeRO (08) all-gathers its weights' e4m3 bytes: with --zero 3 an FP8 run's gathers move 1 B an
    element of the layers' FP8 weights where its bf16 twin's move 2 (the plan's traffic counted 1 B, its
    step 2 B: a review found it). NeMo's Llama 2 7B on dp 8, nothing hidden: the DP parts differ by the
    bytes saved (two gathers, each (n - 1) / n of them, on NVLink) as 02 prices ZeRO-3's: a unit's share,
    the first unit's gathered once, the others' before each microbatch's forward and its backward."""
    cfg, sizes, run, cluster = published_run("NeMo Llama 2 7B, FP8")
    run = dataclasses.replace(run, microbatches=16, zero_stage=3)
    dp = {}
    for float8 in (True, False):
        twin = dataclasses.replace(run, fp8=float8)
        twin_sizes, twin, plans, _ = full_train.planned(cfg, sizes, twin, cluster)
        dp[float8] = full_train.step_time(cfg, twin_sizes, twin, plans, cluster, hide=False)["parts"]["DP"]
    weights = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008)
    units = 32 + 3  # the layers, the embedding, the norm, the head
    saved = 2 * 7 / 8 * weights / (cluster.nvlink_gbps * 1e9)
    assert sizes.dp == 8 and dp[False] - dp[True] == pytest.approx(saved * (1 + 2 * 16 * (units - 1)) / (2 * units),
                                                                   rel=1e-6)


class CopyBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes the copies (clone, copy_) a dispatch mode sees read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.bytes += 2 * out.numel() * out.element_size()
        return out


def collective_copies(rows: int) -> dict:
    """On one rank: the bytes 03's gather and scatter copy around their collective, of a (rows, 32, 64)
    bf16 x; whether the all-reduce (its copy inside the operator) leaves x and returns a new tensor."""
    group = torch.distributed.group.WORLD
    x = torch.randn(rows, 32, 64, dtype=torch.bfloat16)
    copies = {}
    for kind, collective in (("gather", full_train.tensor_parallel._gathered),
                             ("scatter", full_train.tensor_parallel._reduce_scattered)):
        with CopyBytes() as counted:
            collective(x, group)
        copies[kind] = counted.bytes
    before = x.clone()
    out = full_train.tensor_parallel._all_reduced(x, group)
    copies["all_reduce"] = out.data_ptr() != x.data_ptr() and torch.equal(x, before)
    return copies


def test_plan_prices_the_copies_03s_collectives_make(rank_pool, monkeypatch):
    """tp_copy_bytes: 03's all-reduce copies its input into a new tensor (2 B moved a byte); SP's gathers
    and scatters copy their input and output (one rank: 2 x 2 x x's bytes) where a microbatch holds more
    than one sequence, none for one. The plan adds that much a step at the HBM's bandwidth: DGX Cloud's
    Nemotron-4 15B (tp 2, SP) with 2 sequences a microbatch, and with one."""
    for rows in (1, 2):
        copies = rank_pool.run(1, collective_copies, rows)[0]
        moved = 4 * (rows > 1) * rows * 32 * 64 * 2
        assert copies == {"gather": moved, "scatter": moved, "all_reduce": True}
    cfg, sizes, run, cluster = published_run("DGX Cloud Nemotron-4 15B, 16 GPUs")
    for microbatches, sequences in ((4, 2), (8, 1)):
        run = dataclasses.replace(run, microbatches=microbatches)
        assert (sizes.tp, sizes.pp, run.global_batch // sizes.dp // microbatches) == (2, 1, sequences)
        ops = full_train.tp_collectives(cfg, sizes, run, 32, True, True)  # one stage: 32 layers and the ends
        moved = ops["all_gather"][1] + ops["reduce_scatter"][1]
        expected = 2 * ops["all_reduce"][1] + (sequences > 1) * 2 * (1 + Fraction(1, 2)) * moved
        assert full_train.tp_copy_bytes(cfg, sizes, run, 32, True, True) == expected and run.sequence_parallel
        copied = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["elementwise"]
        monkeypatch.setattr(full_train, "tp_copy_bytes", lambda *args: 0)
        free = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["elementwise"]
        monkeypatch.undo()
        assert copied - free == pytest.approx(float(expected) / (cluster.hbm_tbps * 1e12), rel=1e-9)


class RecomputeCount(torch.utils._python_dispatch.TorchDispatchMode):
    """In a backward: its matmuls, the linears whose forward runs again (x @ W^T: by the weight W read,
    named in `weights`) and the amaxes (FP8 casts)."""

    def __init__(self, weights: dict) -> None:
        super().__init__()
        self.weights = weights
        self.linears = []
        self.mm = 0
        self.amax = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.mm += 1
            if args[1].data_ptr() in self.weights and args[1].stride(0) == 1:  # W^T: the forward's form
                self.linears.append(self.weights[args[1].data_ptr()])
        self.amax += func is torch.ops.aten.amax.default
        return func(*args, **(kwargs or {}))


def recompute_counts(recompute: str, float8: bool) -> RecomputeCount:
    """One layer of 01's GPT with 03's lean saves and recompute (and 08's FP8 linears): its backward counted.
    "whole": the layer in a reentrant checkpoint, as Megatron's CheckpointFunction wraps it (plan's price)."""
    cfg = foundation.ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96)
    model = full_train.tensor_parallel.apply_lean_saves(foundation.GPT(cfg))
    model = fp8.convert_to_float8(model) if float8 else model
    block = model.layers["0"]
    if recompute == "whole":
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True)
    else:
        full_train.tensor_parallel.apply_recompute(model, recompute)
    weights = {module.weight.data_ptr(): name.split(".")[-1] for name, module in block.named_modules()
               if isinstance(module, torch.nn.Linear)}
    cos, sin = foundation.rope_angles(torch.arange(16), cfg.head_dim, cfg.rope_theta)
    with fp8.weights_cast_once(model):
        y = block(torch.randn(2, 16, cfg.dim, requires_grad=True), cos, sin)
        with RecomputeCount(weights) as counted:
            y.sum().backward()
    return counted


def test_elementwise_recomputes_rebuild_costs_the_bytes_a_dispatch_mode_counts():
    """NORM_REBUILD_BYTES and SWIGLU_REBUILD_BYTES, eager bf16: 03's lean norm and SwiGLU's product as its
    refill runs them (no grad), counted, and the refill's storage copy, a read and a write (2 x 2 B)."""
    cfg = foundation.ModelConfig(vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512)
    block = full_train.tensor_parallel.apply_lean_saves(foundation.GPT(cfg)).to(torch.bfloat16).layers["0"]
    x = torch.randn(2, 64, cfg.dim, dtype=torch.bfloat16)
    gate, up = torch.randn(2, 2, 64, cfg.ffn_dim, dtype=torch.bfloat16)
    with torch.no_grad(), ElementwiseBytes() as norm:
        full_train.tensor_parallel.lean_rms_norm(block.attn_norm, x)
    with torch.no_grad(), ElementwiseBytes() as product:
        foundation.swiglu(gate, up)
    assert norm.bytes + 2 * 2 * x.numel() == full_train.NORM_REBUILD_BYTES * x.numel()
    assert product.bytes + 2 * 2 * gate.numel() == full_train.SWIGLU_REBUILD_BYTES * gate.numel()


def test_the_plan_prices_elementwise_recompute_by_what_it_rebuilds():
    """Against no recompute (both eager; SP at tp 2, cp 2; Llama 3 8B's layer, 2 of them, a small
    vocabulary so that a layer's backward, not the loss, holds the most temporaries): the elementwise work
    grows by each layer's and microbatch's rebuild (2 norms, SwiGLU's product, each copied back); the
    GEMMs, attention, TP and the ring run no more; the layers keep 03's formula's difference less
    (activations), and one layer's backward holds it again (temporaries)."""
    cfg = foundation.ModelConfig(vocab_size=512, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    sizes = full_train.MeshSizes(dp=1, pp=1, cp=2, tp=2)
    runs = {}
    for mode in ("none", "elementwise"):
        train = full_train.TrainConfig(global_batch=2, seq_len=8192, microbatches=2, mixed_precision=True,
                                       sequence_parallel=True, recompute=mode, compile=False)
        runs[mode] = full_train.planned(cfg, sizes, train, full_train.Cluster())
    _, run, plans, timing = runs["elementwise"]
    _, _, none_plans, none_timing = runs["none"]
    tokens = run.seq_len // sizes.cp  # a microbatch's (one sequence), on a rank
    rebuild = (2 * full_train.NORM_REBUILD_BYTES * cfg.dim * tokens // sizes.tp
               + full_train.SWIGLU_REBUILD_BYTES * cfg.ffn_dim // sizes.tp * tokens)
    hbm = full_train.Cluster().hbm_tbps * 1e12
    grown = timing["parts"]["elementwise"] - none_timing["parts"]["elementwise"]
    assert grown == pytest.approx(cfg.n_layers * run.microbatches * rebuild / hbm, rel=1e-9)
    for part in ("GEMMs", "attention", "CP", "TP"):
        assert timing["parts"][part] == none_timing["parts"][part], part
    kept = {mode: full_train.tensor_parallel.layer_activation_formula(cfg, 1, tokens, sizes.tp, True, mode, 2,
                                                                      lean=True) for mode in runs}
    layer_less = kept["none"] - kept["elementwise"]
    mine, before = plans[0].memory, none_plans[0].memory
    assert before["activations"] - mine["activations"] == cfg.n_layers * plans[0].in_flight * layer_less
    assert mine["temporaries"] - before["temporaries"] == layer_less


def test_elementwise_recompute_is_refused_where_it_cannot_run_or_be_priced(monkeypatch, capsys):
    """Without lean saves (nothing to rebuild from), compiled (its hooks), with MoE (unpriced) or FP8 (its
    linears keep casts: nothing rebuilt): one line each, before any mesh; plan's default compiles."""
    base = "--model llama3-8b --dp 8 --pp 1 --cp 1 --tp 1 --recompute elementwise".split()
    for extra, refusal in ((["--eager", "--autograd-saves"], "lean saves keep: not with --autograd-saves"),
                           ([], "torch.compile does not trace: use --eager"),
                           (["--eager", "--moe"], "priced for dense layers"),
                           (["--eager", "--fp8"], "would save nothing with --fp8")):
        code, _, err = plan_main(monkeypatch, capsys, *base, *extra)
        assert code == 2 and refusal in err, (extra, err)
    code, out, _ = plan_main(monkeypatch, capsys, *base, "--eager")  # priced (8k tokens: 1 = does not fit)
    assert code in (0, 1) and ", recompute elementwise, " in out, out


@pytest.mark.parametrize("recompute", ["op", "full", "whole"])
def test_the_plans_recompute_runs_again_the_gemms_and_casts_03_runs_again(recompute):
    """03's recompute counted over one layer's backward, beyond backward's own (14 matmuls, 7 casts of
    output gradients): in fp32 the linears whose forward runs again, by the weight their matmul reads; in
    FP8 how many matmuls and input casts. "full" stops at down_proj's input, which its backward keeps (an
    FP8 down_proj runs its GEMM before Projections keeps its input's cast); "op" runs k, out and up again,
    and the four input casts. The plan's GEMMs on NeMo's Llama 2 7B run (16 microbatches, 32 layers) grow
    by just those linears' forward GEMMs (no weight cast: once a step) and input casts; "full"'s elementwise
    work by the forward's less the residual add after down_proj. "whole" (plan only, a reentrant
    checkpoint, refused with FP8): all 7 linears, and the whole forward's elementwise work."""
    own = recompute_counts("none", True)
    assert (own.mm, own.amax, own.linears) == (14, 7, [])
    course = recompute_counts(recompute, False)
    names = {"op": ["k_proj", "out_proj", "up_proj"],
             "full": ["q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj"],
             "whole": ["q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj"]}[recompute]
    assert course.linears == names and course.mm == 14 + len(names) and course.amax == 0
    runs = [(names, False)]
    if recompute != "whole":
        float8 = recompute_counts(recompute, True)
        names8 = names + ["down_proj"] * (recompute == "full")
        assert (float8.mm, float8.amax) == (14 + len(names8), 7 + 4)
        runs.append((names8, True))
    cfg, sizes, run, cluster = published_run("NeMo Llama 2 7B, FP8")
    hbm = cluster.hbm_tbps * 1e12
    layer = {name.split(".")[-2]: shape for name, shape in full_train.local_shapes(cfg, 1, None, 1).items()
             if name.startswith("layers.") and len(shape) == 2}
    for rerun, fp8_run in runs:
        run = dataclasses.replace(run, microbatches=16, recompute="none", fp8=fp8_run)
        base = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"]
        run = dataclasses.replace(run, recompute=recompute)
        grown = full_train.planned(cfg, sizes, run, cluster)[3]["parts"]["GEMMs"] - base
        speed = cluster.speed[fp8_run]
        gemms = sum(fp8.linear_seconds(4096, layer[name][1], layer[name][0], hbm, fp8_run, speed, False)[0]
                    for name in rerun)
        inputs = [n_in for name, (_, n_in) in layer.items() if name not in full_train.CAST_BY_A_SIBLING]
        casts = fp8_run * sum(fp8.float8_cast_bytes(4096, n_in, 0)[0] for n_in in inputs) / hbm
        assert len(inputs) == 4 and grown == pytest.approx(16 * 32 * (gemms + casts), rel=1e-9), fp8_run
    if recompute == "whole":  # what full keeps, and its rebuilt layer among backward's temporaries
        cfg_bloom, sizes_bloom, run_bloom, _ = published_run("BLOOM 176B")
        holds = [[r.memory for r in full_train.plan(cfg_bloom, sizes_bloom, dataclasses.replace(run_bloom,
                                                                                                recompute=mode))]
                 for mode in ("full", "whole")]
        assert holds[0] == holds[1]
    if recompute != "op":  # and the elementwise work before down_proj: not the second residual add after it
        forward = full_train.elementwise_bytes(cfg, 4096, 1, False, layers=1, embed=False, head=False)[0]
        parts = [full_train.planned(cfg, sizes, dataclasses.replace(run, recompute=mode), cluster)[3]["parts"]
                 for mode in ("none", recompute)]
        grown = parts[1]["elementwise"] - parts[0]["elementwise"]
        last_add = 3 * 2 * cfg.dim * 4096 * (recompute == "full")  # whole: its rerun reaches the add too
        assert grown == pytest.approx(16 * 32 * (forward - last_add) / hbm, rel=1e-9)


def test_attention_between_measured_lengths_takes_the_rate_nearest_by_ratio():
    """07 measured its rates at 1,024 to 16,384 tokens, doubling; between two, the nearer on a log
    scale: 3,000 tokens is 1.37x below 4,096 and 1.46x above 2,048, so 4,096's rate (by difference it
    took 2,048's, 952 tokens off against 1,096). 2,896 is their geometric mean. Forward FLOPs 4 s^2 d
    a head, halved by the causal mask; backward 2.5x."""
    rates = full_train.flash.ATTENTION_TFLOPS_H100[128, True]["flash"]
    for seq, measured in ((3000, 4096), (6000, 8192), (2900, 4096), (2890, 2048), (1400, 1024)):
        forward, backward = full_train.flash.attention_seconds(1, 1, seq, 128, "flash")
        expected = 2 * seq ** 2 * 128 / (rates[full_train.flash.BENCH_SEQS.index(measured)] * 1e12)
        assert forward == pytest.approx(expected, rel=1e-12), (seq, measured)
        assert backward == pytest.approx(2.5 * expected, rel=1e-12)


def test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node():
    """Every mesh of sizes 1-3 and every kind of group, on nodes of every size up to twice the world
    (before: only sizes a group's block divides were inside; 6 GPUs of one 8-GPU node priced their
    all-reduce on the network): inside_node is true iff each group, derived here from the grid of ranks
    (tp fastest: rank = ((d pp + p) cp + c) tp + t), has its ranks on one node. A block that merely
    fits in a node (not aligned to it), or one of the group's own sizes only, fails here. A kind that
    is no mesh dimension (the experts' "ep", "ep_dp") lies in the dp x cp groups it borrows from."""
    kinds = {**full_train.GROUP_DIMS, "ep": ("dp", "cp"), "ep_dp": ("dp", "cp")}
    for shape in itertools.product((1, 2, 3), repeat=len(full_train.DIMS)):
        world, grid = math.prod(shape), torch.arange(math.prod(shape)).reshape(shape)
        for kind, dims in kinds.items():
            moving = [full_train.DIMS.index(d) for d in dims]
            held = [axis for axis in range(len(shape)) if axis not in moving]
            groups = grid.permute(*held, *moving).reshape(-1, math.prod(shape[axis] for axis in moving))
            for per_node in range(1, 2 * world + 1):
                expected = bool((groups // per_node == groups[:, :1] // per_node).all())
                assert full_train.inside_node(full_train.MeshSizes(*shape), kind, per_node) == expected, (
                    f"dp, pp, cp, tp = {shape}, nodes of {per_node}: {kind} groups inside a node: {expected}")


@given(busy=st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=8), bubble=st.floats(0.0, 0.9),
       boundary=st.floats(1e-6, 1e-2), pp=st.integers(1, 8), microbatches=st.integers(1, 16),
       virtual=st.integers(1, 3), hide=st.booleans())
@example(busy=[1.0], bubble=0.0, boundary=1e-3, pp=1, microbatches=2, virtual=2, hide=False)
def test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain(
        busy, bubble, boundary, pp, microbatches, virtual, hide):
    """Outside the fill and drain's sends, the slowest rank is busy max(busy) and idle the bubble's
    fraction of the span (04's bubble is that idle fraction; stretched by 1 + bubble, it would idle
    bubble / (1 + bubble)). The sends: with overlap, those the first forward and the last backward
    make (pp - 1 each); without, every microbatch's, both ways, at each of the pp x virtual - 1
    boundaries between consecutive stages; pp = 1 sends nothing (one rank holds its stages: the
    example). Tolerance: span - fill rounds off about 1e-16 x the fill (under 10 s), which the idle
    fraction divides by >= 1e-3 s."""
    span, fill = full_train.pipeline_span(busy, bubble, boundary, pp, microbatches, virtual, hide)
    crossings = 0 if pp == 1 else 2 * (pp - 1) if hide else 2 * microbatches * (pp * virtual - 1)
    assert fill == pytest.approx(crossings * boundary, rel=1e-12), f"fill: not {crossings} boundary sends"
    pipeline_seconds = span - fill
    idle = (pipeline_seconds - max(busy)) / pipeline_seconds
    assert idle == pytest.approx(bubble, rel=1e-9, abs=1e-9), f"idles {idle:.6g} of the span, not {bubble}"

# The README's table: label -> (model: a preset or its sizes, mesh (dp, pp, cp, tp), the run (plan's options and
# --gpu), the published figure: ms or s a step, tokens/s per GPU, or TFLOP/s per GPU as 09's flops_per_token counts
# them: PaLM's (Meta's MFU), for these models also Megatron's formula). Knobs not published, chosen a priori: one
# sequence per microbatch, Megatron's 1F1B, Llama 3's interleaving with v = 2 (torchtitan's default), SP with
# tp > 1, no recompute unless published; Meta's FSDP that keeps the parameters after forward as ZeRO-2,
# Megatron's and NeMo's distributed optimizer ZeRO-1, FSDP (MPT's FULL_SHARD, torchtitan's) ZeRO-3; the
# attention kernel each framework runs (Transformer Engine's fused attention: cudnn); eager where the run was.
# Sources: /work/research/published_runs.md's rows (DG-, NE-, TT-, AO-) with their commits and quotes.
# The paper's pipeline: "we reduce one Transformer layer each from the first and the last stages" (ends_as_layers)
LLAMA3_405B = dict(schedule="interleaved", virtual=2, zero_stage=2, sequence_parallel=True, ends_as_layers=True)
MEGATRON = lambda d, n: dict(dim=d, n_layers=n, n_heads=d // 128, ffn_dim=round(d / 3) * 8, vocab_size=131_072)  # noqa
# llm-foundry's modeling_mpt.py (2023-10): "MPTForCausalLM only supports tied word embeddings"
MPT = lambda d, n: dict(dim=d, n_layers=n, n_heads=d // 128, ffn_dim=round(d / 3) * 8, vocab_size=50_368,  # noqa: E731
                        tie_embeddings=True)
NVIDIA = dict(attention="cudnn", zero_stage=1)  # Transformer Engine (NVTE_FUSED_ATTN=1), distributed optimizer
# NVIDIA's fused cross-entropy (dgxc-benchmarking's llama3.1 and nemotron4-15b yamls: cross_entropy_loss_fusion: true;
# Megatron-Bridge's Llama recipes: cross_entropy_loss_fusion = True) keeps one fp32 copy of the logits, about
# what 03's loss in 8 slices keeps (the logits and their gradient in bf16, one slice's fp32 temporaries)
FUSED_LOSS = dict(loss_chunks=8)
TITAN = dict(gpu="h100-96gb", zero_stage=3, microbatches=1, recompute="op", compile=False)  # Grand Teton, FSDP2
PUBLISHED = {
    # 09's own, README "On one H100" (2026-11-25) and its H200 row (2026-11-27), compiled, ZeRO-1 on one rank
    "09 `1b`": ("1b", (1, 1, 1, 1), dict(microbatches=1, attention="flash"), (199.2, "ms")),
    "09 `1b`, SDPA": ("1b", (1, 1, 1, 1), dict(microbatches=1), (181.0, "ms")),
    "09 `1b`, FP8": ("1b", (1, 1, 1, 1), dict(microbatches=1, attention="flash", fp8=True), (226.5, "ms")),
    "09 `1b`, H200": ("1b", (1, 1, 1, 1), dict(microbatches=1, attention="flash", gpu="h200"), (181.4, "ms")),
    "09 `2b`": ("2b", (1, 1, 1, 1), dict(microbatches=1, attention="flash"), (345.8, "ms")),
    "09 `2b`, FP8": ("2b", (1, 1, 1, 1), dict(microbatches=1, attention="flash", fp8=True), (305.4, "ms")),
    # Meta's Llama 3 paper, Table 4
    "Llama 3 405B": ("llama3-405b", (64, 16, 1, 8), LLAMA3_405B, (430, "TFLOP/s")),
    "Llama 3 405B, 16,384 GPUs": ("llama3-405b", (128, 16, 1, 8), LLAMA3_405B, (400, "TFLOP/s")),
    "Llama 3 405B, 131k tokens": ("llama3-405b", (8, 16, 16, 8), dict(LLAMA3_405B, seq_len=131_072, global_batch=128),
                                  (380, "TFLOP/s")),
    # Megatron-LM's README (H100, 2024-07): 4,096 tokens, heads of 128, GELU MLP priced as our SwiGLU of its size
    **{f"Megatron {size}": (MEGATRON(d, n), (48, pp, 1, tp), dict(zero_stage=1, sequence_parallel=tp > 1,
                                                               global_batch=b, seq_len=4096), (tflops, "TFLOP/s"))
       for size, d, n, b, pp, tp, tflops in (
           ("1.7B", 2048, 24, 192, 1, 1, 408.8), ("7.1B", 4096, 30, 192, 1, 2, 465.9), ("16B", 6144, 32, 192, 1, 4, 489.1),
           ("32B", 7168, 48, 192, 1, 8, 459.6), ("70B", 8192, 84, 384, 2, 8, 419.7), ("119B", 10240, 92, 768, 4, 8, 420.5),
           ("177B", 12288, 96, 1152, 6, 8, 432.8), ("314B", 16384, 96, 1536, 8, 8, 474.4),
           ("462B", 18432, 112, 3072, 16, 8, 459.9))},
    # llm-foundry's H100 tables (scripts/train/benchmarking/README.md): eager FSDP FULL_SHARD, 2,048 tokens
    "MPT-1B": (MPT(2048, 24), (8, 1, 1, 1), dict(microbatches=1, zero_stage=3, global_batch=112, seq_len=2048,
                                               compile=False), (45_455, "tokens/s")),
    "MPT-7B": (MPT(4096, 32), (8, 1, 1, 1), dict(microbatches=1, zero_stage=3, global_batch=48, seq_len=2048,
                                               compile=False), (10_643, "tokens/s")),
    "MPT-70B": (MPT(8192, 80), (512, 1, 1, 1), dict(microbatches=1, zero_stage=3, recompute="full", global_batch=4096,
                                                  seq_len=2048, compile=False), (1_007, "tokens/s")),
    # NVIDIA dgxc-benchmarking v24.11.1 (DGX H100, NeMo 24.09, no recompute, fused loss): DG-1a, DG-1b, DG-2b;
    # seconds a step
    "DGX Cloud 8B": ("llama3-8b", (4, 1, 2, 1), dict(NVIDIA, global_batch=128, microbatches=32, **FUSED_LOSS),
                     (12.91, "s")),
    "DGX Cloud 8B, FP8": ("llama3-8b", (4, 1, 2, 1), dict(NVIDIA, global_batch=128, microbatches=32, fp8=True,
                                                        **FUSED_LOSS),
                          (9.67, "s")),
    "DGX Cloud 70B, FP8": ("llama3-70b", (2, 4, 2, 4), dict(NVIDIA, global_batch=128, microbatches=64, fp8=True,
                                                          **FUSED_LOSS,
                                                          schedule="interleaved", virtual=5, sequence_parallel=True),
                           (11.01, "s")),
    # NVIDIA NeMo 24.07 performance summary (DGX H100, FP8): NE-1
    "NeMo Llama 2 7B, FP8": ("llama2-7b", (8, 1, 1, 1), dict(NVIDIA, global_batch=128, seq_len=4096, microbatches=16,
                                                           fp8=True), (16_934, "tokens/s")),
    # torchtitan benchmarks/llama3_h100_202412 (Grand Teton H100s at 500 W): TT-1a, TT-1c, TT-2a; torchao's
    # float8 e2e benchmark (the same H100s): AO-1b; torchtitan's H200 (Trainy/WhiteFiber) and A100 runs: TT-9a, TT-10c
    "torchtitan 8B, eager": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=16), (5_762, "tokens/s")),
    "torchtitan 8B, FP8": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=16, compile=True, fp8=True),
                           (8_532, "tokens/s")),
    "torchtitan 8B, 32k, FP8": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=8, seq_len=32_768, compile=True,
                                                              fp8=True, recompute="full"), (3_890, "tokens/s")),
    "torchao 8B, FP8": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=8, compile=True, fp8=True),
                        (7_689.5, "tokens/s")),
    "torchtitan 8B, H200, FP8": ("llama3-8b", (32, 1, 1, 1), dict(TITAN, gpu="h200", global_batch=64, compile=True,
                                                                fp8=True), (10_938, "tokens/s")),
    "torchtitan 70B, A100": ("llama3-70b", (64, 1, 1, 1), dict(TITAN, gpu="a100-80gb", global_batch=64,
                                                             recompute="full"), (331, "tokens/s")),
}
# beyond 20%, the README says why: measured before one graph per block. Megatron 32B (tp 8) came within 20%
# (+23% to +13%) once 03's backward ran SP's regather and input-gradient reduce-scatter beside its GEMMs
# DGX Cloud 8B FP8 (cp 2): 05's ring merges its blocks eager in fp32 (1.4 s of 11.9), as its bf16 twin's (+6%)
MISSES = {"09 `1b`, FP8"}


def published_row(label: str) -> tuple:
    """A run of either set: (model, mesh, options, published figure)."""
    return PUBLISHED[label] if label in PUBLISHED else HELD_OUT[label]


def published_run(label: str) -> tuple:
    """The published run's (ModelConfig, mesh, TrainConfig, Cluster): plan's options over the model's run,
    bf16 with fp32 masters, compiled unless the row says not; --gpu and --power-limit set the Cluster."""
    model, mesh, options, _ = published_row(label)
    options = {"compile": True, **options}
    cfg = preset(model) if isinstance(model, str) else foundation.ModelConfig(**model)
    _, seq_len, batch, _ = full_train.PRESETS[model] if isinstance(model, str) else (None, None, None, None)
    gpu = dict(zip(full_train.GPU_FIELDS, full_train.GPUS[options.pop("gpu", "h100-sxm")]))
    for field in full_train.GPU_FIELDS:  # the run's cluster where it differs from the preset's
        gpu[field] = options.pop(field, gpu[field])
    run = full_train.TrainConfig(**{**dict(global_batch=batch, seq_len=seq_len, mixed_precision=True), **options})
    return cfg, full_train.MeshSizes(*mesh), run, full_train.Cluster(**gpu)


def published_and_predicted(label: str) -> tuple[float, dict]:
    """The published run's step in seconds (from its figure) and plan's step time for its mesh."""
    cfg, sizes, run, cluster = published_run(label)
    microbatches = published_row(label)[2].get("microbatches")  # None: one sequence each
    sizes, run, _, timing = full_train.planned(cfg, sizes, dataclasses.replace(run, microbatches=microbatches),
                                               cluster)
    figure, unit = published_row(label)[3]
    tokens_per_gpu = run.global_batch * run.seq_len / sizes.world
    per_second = {"ms": 1e3 / figure, "s": 1 / figure, "tokens/s": figure / tokens_per_gpu,
                  "TFLOP/s": figure * 1e12 / (tokens_per_gpu * full_train.flops_per_token(cfg, run.seq_len))}
    return 1 / per_second[unit], timing


def test_the_1b_run_measured_on_one_h100_is_predicted_within_15_percent():
    """README, "On a GPU": the 1b preset on one H100, 8 x 2,048 tokens in one microbatch, ZeRO-1
    over one rank, compiled. With SDPA: 181.0 ms a step. With 07's kernel 196-199 ms, of which the
    profile found the GPU busy 190.5 ms (forward 50.8, backward 120.3, sync 2.2, optimizer 17.2) and
    idle 24.3 while the CPU launched the graph-broken blocks, which the model does not price: it is
    held to the GPU's 190.5 ms (the step is 17-18% above it). cuBLAS's GEMMs took 104.6 ms a step."""
    for label, measured in (("09 `1b`, SDPA", 0.181), ("09 `1b`", 0.1905)):
        timing = published_and_predicted(label)[1]
        assert abs(timing["step"] / measured - 1) <= 0.15, (label, timing["step"])
        assert abs(timing["parts"]["GEMMs"] / 0.1046 - 1) <= 0.15


def test_llama3_405b_on_8192_gpus_is_predicted_within_15_percent():
    """Meta's Llama 3 paper, Table 4, row 1: tp 8, pp 16, dp 64 on 8,192 H100s, 2,048 sequences of
    8,192 tokens; 430 TFLOP/s per GPU as PaLM counts them (43% MFU). The knobs the paper leaves out
    are PUBLISHED's a priori choices (interleaved with v = 2, one sequence per microbatch)."""
    published, timing = published_and_predicted("Llama 3 405B")
    assert abs(timing["step"] / published - 1) <= 0.15, (timing["step"], published)


def test_every_published_run_is_predicted_within_20_percent_but_the_readmes_stated_miss():
    """Issue 49's target, for runs of four more sources (NVIDIA's DGX Cloud and NeMo pages, torchtitan's
    and torchao's benchmarks; FP8, 8 GPUs, an H200, an A100) and the old rows, which the models of an
    eager step (MPT: -20 to -28% before), FP8's casts by their bytes and a power limit brought in."""
    errors = {label: published_and_predicted(label)[1]["step"] / published_and_predicted(label)[0] - 1
              for label in PUBLISHED}
    assert {label for label, error in errors.items() if abs(error) > 0.20} == MISSES, errors
    sources = {label.split()[0] for label in PUBLISHED} - {"09", "Llama", "Megatron", "MPT-1B", "MPT-7B", "MPT-70B"}
    assert sources == {"DGX", "NeMo", "torchtitan", "torchao"}
    assert sum(run.fp8 for run in (published_run(label)[2] for label in PUBLISHED if label.split()[0] in sources)) >= 4


# Held out: published runs the model was never calibrated on (test_the_held_out_runs_... states the rule). Rows of
# /work/research/published_runs.md (its ids in the comments), each planned by PUBLISHED's a priori rules; besides:
# a GeLU or squared-ReLU MLP priced as 01's SwiGLU of its size (swiglu_of_its_size), Megatron's tied embedding,
# Megatron before FlashAttention (2021-2022, A100s) with --attention unfused, and Megatron's fused kernels
# (LayerNorm, softmax, bias-GeLU, bias-dropout-add) as compiled.
def swiglu_of_its_size(ffn: int) -> int:
    """A two-matrix MLP of width ffn as 01's three-matrix SwiGLU of its parameters: 2/3 ffn, rounded to a
    multiple of 128 (any tp up to 8 divides it)."""
    return round(ffn * 2 / 3 / 128) * 128


def gpt(dim: int, layers: int, heads: int, vocab: int, ffn: int | None = None, kv_heads: int | None = None,
        tied: bool = True) -> dict:
    """A GPT-style model (a GeLU MLP 4 x dim wide unless ffn says) in 01's sizes."""
    return dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=vocab,
                ffn_dim=swiglu_of_its_size(ffn or 4 * dim), tie_embeddings=tied)


# Megatron-LM 2021's --DDP-impl local (train_step all-reduces the gradients after forward_backward_func
# returns) and DeepSpeed's pipeline engine (ReduceGrads after the schedule's last backward) reduce once the
# schedule ends: --reduce-after-backward; --DDP-impl torch is PyTorch's DDP, reducing in backward as 01's. Neither
# run_table_1.sh nor BLOOM's slurm sets --attention-dropout: Megatron's default, 0.1 (tr11-176B-ml's README: "The
# default Megatron-LM dropout settings are inherited"). Their --checkpoint-activations (sc21/CONFIG.sh at de7dc40;
# BLOOM's slurm, with --deepspeed-activation-checkpointing) wrap each layer in a reentrant CheckpointFunction
# (mpu/random.py; DeepSpeed's), whose backward runs the layer's forward again to its end: --recompute whole
A100_MEGATRON = dict(gpu="a100-80gb", attention="unfused", attention_dropout=0.1, recompute="whole", seq_len=2048,
                     reduce_in_backward=False)
# Megatron-DeepSpeed, ZeRO-1, 2 sequences a microbatch, on Jean Zay's A100 nodes: "8 GPUs per node Using NVLink 4
# inter-gpu connects, 4 OmniPath links" of 100 Gb/s (tr11-176B-ml's README, Hardware): 6.25 GB/s a GPU each way
# between nodes, where the preset's DGX A100 has a 200 Gb/s NIC a GPU (25 GB/s)
BLOOM = dict(A100_MEGATRON, zero_stage=1, global_batch=2048, network_gbps=4 * 100 / 8 / 8)
# From 02-28 on (chronicles-prequel.md, "Rebalancing layers", and tr11-176B-ml.slurm): "BF16 optimizer that was just
# written to accumulate gradients in fp32 ... 4bytes x params and it's not sharded" (02's --fp32-grads), and
# --pp-partition-method 'type:transformer|embedding', "each embedding layer its own slot" (--ends-as-layers)
BLOOM_0228 = dict(BLOOM, fp32_grads=True, ends_as_layers=True)
NARAYANAN = dict(A100_MEGATRON, zero_stage=0)  # Megatron-LM 2021: plain data parallelism
NEMO_2403 = dict(NVIDIA, fp8=True, sequence_parallel=True)  # NeMo 24.03.01 (TE's fused attention, its CP ring)
BRIDGE = dict(NVIDIA, fp8=True, seq_len=8192, sequence_parallel=True, **FUSED_LOSS)  # FP8 current scaling
NEMOTRON = dict(dim=6144, n_layers=32, n_heads=48, n_kv_heads=8, ffn_dim=swiglu_of_its_size(24_576), vocab_size=256_000)
NEMOTRON_340B = dict(dim=18_432, n_layers=96, n_heads=96, n_kv_heads=8, ffn_dim=swiglu_of_its_size(73_728),
                     vocab_size=256_000)
DGXC = dict(NVIDIA, seq_len=4096, sequence_parallel=True, **FUSED_LOSS)  # dgxc-benchmarking v25.01 / v25.04
FOUNDRY = dict(zero_stage=3, recompute="full", compile=False)  # llm-foundry: eager FSDP FULL_SHARD, as MPT above
HELD_OUT = {
    # bigscience tr11-176B-ml @ 9e64ede: chronicles.md l.45, README.md l.245, chronicles-prequel.md l.427, 818, 929-950
    "BLOOM 176B": (gpt(14_336, 70, 112, 250_880), (8, 12, 1, 4), dict(BLOOM_0228, microbatches=128), (105.22, "s")),
    "BLOOM 176B, batch 16": (gpt(14_336, 70, 112, 250_880), (8, 12, 1, 4),
                             dict(BLOOM_0228, global_batch=16, microbatches=1), (15.23, "s")),
    "BLOOM 176B, 02-28": (gpt(14_336, 70, 112, 250_880), (8, 12, 1, 4), dict(BLOOM_0228, microbatches=128),
                          (104.5, "s")),
    "BLOOM 176B, 64 heads": (gpt(14_336, 70, 64, 250_880), (8, 12, 1, 4), dict(BLOOM_0228, microbatches=128),
                             (102.03, "s")),
    "BLOOM 176B, 64 heads, 4 a microbatch": (gpt(14_336, 70, 64, 250_880), (8, 12, 1, 4),
                                             dict(BLOOM_0228, microbatches=64), (102.27, "s")),
    "BLOOM 176B, 64 heads, tp 8": (gpt(14_336, 70, 64, 250_880), (4, 12, 1, 8), dict(BLOOM_0228, microbatches=256),
                                   (121.63, "s")),
    "BLOOM 178B": (gpt(13_312, 82, 64, 250_880), (8, 12, 1, 4), dict(BLOOM_0228, microbatches=128), (104.45, "s")),
    "BLOOM 177B, pp 48": (gpt(12_288, 96, 64, 250_880), (8, 48, 1, 1), dict(BLOOM, microbatches=256), (142.17, "s")),
    "BLOOM 20B, one node": (gpt(14_400, 8, 32, 250_880), (1, 1, 1, 8), dict(BLOOM, recompute="none", microbatches=2048),
                            (777.09, "s")),
    # Narayanan et al. 2021 Table 1 (Megatron-LM's cases_april2021.png), meshes and --DDP-impl from its
    # sc21/run_table_1.sh (de7dc40); steps from the published TFLOP/s by the paper's Eq. 3
    **{f"Narayanan {size}": (gpt(dim, layers, heads, 51_200), mesh,
                             dict(NARAYANAN, global_batch=batch, microbatches=batch // mesh[0] // mbs,
                                  schedule="interleaved" if virtual > 1 else "1f1b", virtual=virtual,
                                  reduce_in_backward=ddp == "torch"), (step, "s"))
       for size, dim, layers, heads, mesh, mbs, batch, virtual, ddp, step in (
           ("1.7B", 2304, 24, 24, (32, 1, 1, 1), 16, 512, 1, "torch", 3.53),
           ("3.6B", 3072, 30, 32, (32, 1, 1, 2), 16, 512, 1, "torch", 3.7),
           ("7.5B", 4096, 36, 32, (32, 1, 1, 4), 16, 512, 1, "torch", 3.7),
           ("18.4B", 6144, 40, 48, (32, 1, 1, 8), 8, 1024, 1, "torch", 9.4),
           ("39.1B", 8192, 48, 64, (32, 2, 1, 8), 4, 1536, 1, "local", 14.45),
           ("76.1B", 10_240, 60, 80, (32, 4, 1, 8), 2, 1792, 3, "local", 16.06),
           ("145.6B", 12_288, 80, 96, (24, 8, 1, 8), 2, 2304, 2, "local", 24.82),
           ("310.1B", 16_384, 96, 128, (15, 16, 1, 8), 1, 2160, 2, "local", 37.61),
           ("529.6B", 20_480, 105, 128, (9, 35, 1, 8), 1, 2520, 3, "local", 54.08),
           ("1T", 25_600, 128, 160, (6, 64, 1, 8), 1, 3072, 1, "local", 102.63))},
    # NeMo docs performance_long_sequence.md @ 19fadb6, Llama 2 7B FP8 on DGX H100s with CP; steps from the published
    # TFLOP/s by NeMo's llama2 FLOP formula; a sequence per microbatch
    **{f"NeMo 24.03 Llama 2 7B, {seq // 1024}k": ("llama2-7b", mesh, dict(NEMO_2403, seq_len=seq, global_batch=batch),
                                                 (step, "s"))
       for seq, mesh, batch, step in ((8192, (4, 2, 1, 1), 512, 37.73), (32_768, (8, 1, 2, 2), 128, 19.59),
                                      (131_072, (8, 1, 4, 4), 32, 14.51), (262_144, (8, 1, 8, 4), 16, 13.49),
                                      (524_288, (4, 1, 16, 8), 8, 12.9), (1_048_576, (4, 1, 32, 8), 4, 12.91))},
    # Megatron-Bridge docs/performance-summary-archive.md @ 4ab94df (25.11, 26.02): tokens/s per GPU
    **{f"Megatron-Bridge {label}": (model, mesh, dict(BRIDGE, global_batch=batch, virtual=virtual, **more,
                                                      schedule="interleaved" if virtual > 1 else "1f1b"),
                                    (tokens, "tokens/s"))
       for label, model, mesh, batch, virtual, tokens, more in (
           ("8B", "llama3-8b", (8, 1, 1, 1), 128, 1, 14_451, dict(zero_stage=3)),  # Megatron-FSDP
           ("70B", "llama3-70b", (2, 8, 1, 4), 128, 5, 1602, {}),
           ("405B", "llama3-405b", (8, 8, 2, 8), 512, 8, 292, dict(ends_as_layers=True)),  # account_for_*
           ("70B, 26.02", "llama3-70b", (2, 8, 1, 4), 256, 5, 1621, {}),
           ("405B, 26.02", "llama3-405b", (8, 8, 2, 8), 1536, 8, 311, dict(ends_as_layers=True)),
           ("8B, B200", "llama3-8b", (8, 1, 1, 1), 128, 1, 30_624, dict(gpu="b200", microbatches=8)),
           ("405B, B200", "llama3-405b", (2, 8, 2, 4), 64, 8, 661, dict(gpu="b200", ends_as_layers=True)))},
    # Megatron-Bridge examples/model_verification_cards/qwen3-8b/card.yaml (QK-norm aside, a Llama): 64 microbatches
    "Megatron-Bridge Qwen3 8B": (dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12_288,
                                      vocab_size=151_936), (16, 1, 1, 1), dict(NVIDIA, global_batch=1024, seq_len=4096),
                                 (25.07, "s")),
    # NVIDIA dgxc-benchmarking v25.04 @ 741c886 (nemotron/, llama3.1/) and v25.01 @ 143b90d (README_15b, README_340b):
    # seconds a step
    **{f"DGX Cloud Nemotron-4 15B, {label}": (NEMOTRON, mesh, dict(DGXC, global_batch=batch, microbatches=4, fp8=fp8),
                                              (step, "s"))
       for label, mesh, batch, fp8, step in (("16 GPUs", (8, 1, 1, 2), 64, False, 2.66),
                                             ("16 GPUs, FP8", (8, 1, 1, 2), 64, True, 1.98),
                                             ("2,048 GPUs", (1024, 1, 1, 2), 8192, False, 2.78),
                                             ("tp 4", (4, 1, 1, 4), 64, False, 2.83))},
    # nemotron4-340b-synth.yaml's optim.dtype bf16: NeMo's megatron_base_model.py then sets store_params False (the
    # optimizer's dtype is the model's), BF16 AdamW. FP8 (+model.fp8_params) stores a bf16 copy beside 1 B FP8
    # weights: 1 + 6 / dp B a parameter, at dp 2 the course's 2 + 4 / dp. The yaml also sets
    # activations_checkpoint_granularity: selective and no cross_entropy_loss_fusion, and configure.sh's 340b branch
    # NVTE_FUSED_ATTN=0: Transformer Engine's flash-attn backend, FlashAttention-2 as SDPA's
    **{f"DGX Cloud Nemotron-4 340B{', FP8' * fp8}": (NEMOTRON_340B, (2, 8, 1, 8),
                                                    dict(DGXC, global_batch=32, schedule="interleaved", virtual=12,
                                                         fp8=fp8, bf16_optimizer=True, recompute="selective",
                                                         loss_chunks=1, attention="sdpa"), (step, "s"))
       for fp8, step in ((False, 4.61), (True, 3.16))},
    # NeMo's llama31_405b recipe (since 2025-03-08, d3f25b1): account_for_embedding/loss_in_pipeline_split
    **{f"DGX Cloud 405B{', FP8' * fp8}": ("llama3-405b", (4, 8, 2, 8), dict(DGXC, seq_len=8192, global_batch=256,
                                                                         ends_as_layers=True,
                                                                         schedule="interleaved", virtual=8, fp8=fp8),
                                         (step, "s"))
       for fp8, step in ((False, 19.78), (True, 12.37))},
    "DGX Cloud 70B, FP8, pp 8": ("llama3-70b", (2, 8, 1, 4), dict(DGXC, seq_len=8192, global_batch=128, fp8=True,
                                                                schedule="interleaved", virtual=5), (9.86, "s")),
    # llm-foundry's benchmark tables (2023, scripts/train/benchmarking/README.md): tokens/s over the GPUs
    **{f"MPT-{size}{', FP8' * fp8}": (gpt(dim, layers, heads, 50_368), (dp, 1, 1, 1),
                                      dict(FOUNDRY, gpu=gpu, global_batch=batch, seq_len=seq,
                                           microbatches=batch // dp // mbs, fp8=fp8,
                                           recompute="full" if checkpoint else "none"), (tokens, "tokens/s"))
       for size, dim, layers, heads, dp, mbs, batch, seq, fp8, checkpoint, gpu, tokens in (
           ("30B", 7168, 48, 56, 32, 14, 1344, 2048, False, True, "h100-sxm", 73_860 / 32),
           ("13B, 32k", 5120, 40, 40, 8, 1, 24, 32_768, False, True, "h100-sxm", 15_812 / 8),
           ("7B, 65k", 4096, 32, 32, 8, 1, 16, 65_536, False, True, "h100-sxm", 15_654 / 8),
           ("3B", 2560, 32, 20, 8, 10, 480, 2048, True, False, "h100-sxm", 244_692 / 8),
           ("70B, A100", 8192, 80, 64, 64, 8, 2048, 2048, False, True, "a100-80gb", 26_274 / 64))},
}


# The held-out runs beyond 20%: (the bound their error is pinned to, the sign and why). Measured, not tuned: the
# A100 rows' and the long-context rows' shortfalls are each the same across their runs (below).
TP_OVERLAP = "which its tp_comm_overlap hides (userbuffers: each all-gather and reduce-scatter split over a GEMM)"
QKV_SUMS = "the sums of q, k and v's (gate and up's) input gradients, which its fused linears do not make:"
RING_MERGES = ("05's ring merging its blocks' outputs eager, in place, in fp32 (ring_merge_bytes; Transformer Engine's "
               "merges not read):")
HELD_OUT_MISSES = {
    "BLOOM 176B, batch 16": (0.55, "-: a ramp-up step (one microbatch a replica): twice 12 stages' compute and ZeRO's "
                                   "sync"),
    "BLOOM 176B, 64 heads, tp 8": (0.35, "-: tp 8 ran 19% slower than tp 4 (chronicles-prequel.md); in the plan tp 8's "
                                         "all-reduces at NVLink's 300 GB/s cost 3 s more, its bubble 3 s less"),
    "BLOOM 20B, one node": (0.55, "-: a first test (02-17): recompute not stated (priced without), 2,048 "
                                  "microbatches of one sequence on one node"),
    "DGX Cloud Nemotron-4 15B, 16 GPUs, FP8": (0.35, "+: FP8 takes 0.3 s off its GEMMs (08's casts: 10 B an input "
                                                     "element, 77 a weight's, eager once a step), 0.7 s off the "
                                                     "published step (Transformer Engine fuses its casts into the "
                                                     "norms); the bf16 twin is +10%"),
    "DGX Cloud 405B, FP8": (0.30, f"+: tp 8's messages, 1.7 s exposed (0.8 s less with 03's backward running SP's "
                                  f"regather and reduce-scatter beside its GEMMs), {TP_OVERLAP}; {QKV_SUMS} 0.4 s; "
                                  f"its cp 2 ring at 07's rate, 0.5 s more than cuDNN's, and {RING_MERGES} 0.3 s; "
                                  f"the bf16 twin is -2%: FP8 halves the GEMMs, not the messages"),
    **dict.fromkeys(("MPT-13B, 32k", "MPT-7B, 65k"), (0.35, "-: attention-bound without CP: llm-foundry's flash "
                                                            "attention of 2023 at 62% of 07's SDPA rate in both")),
}
HELD_OUT_SOURCES = ("BLOOM", "Narayanan", "NeMo", "Megatron-Bridge")  # used for no constant of the model


def test_the_held_out_runs_are_predicted_within_their_pinned_errors():
    """Issue 55: runs the model was not tuned on. The split: PUBLISHED is what the model's constants
    and a priori knobs were chosen against; HELD_OUT is every other row of /work/research/
    published_runs.md that plan can price as published (a dense model, its mesh, batch and length, a
    --gpu preset, a step; MoE, GB200 and OOM rows out), less the rows that file lists as doubtful or
    partial (MT-NLG, BLOOM's 181B and 200B, Nemotron-4's reports, Megatron 2020, the B200 long-context
    and DGX Cloud v25.04 340B rows, Megatron-Bridge's SFT, torchtitan's tables 4-5 and async TP) and
    those MEMORY calibrates on (torchtitan's, torchao's). No constant comes from them, and from four
    of their sources (HELD_OUT_SOURCES) nothing at all. Each run's error is pinned: within 20%, or
    beyond it within HELD_OUT_MISSES' bound, with its sign and why. The target, 20% for 85% of them,
    is met: 40 of 47 (85%). 29 once the plan priced --reduce-after-backward for Megatron-LM 2021 and
    DeepSpeed (their gradients reduced once the schedule ends; --attention unfused moved none), 35 once it
    priced an input's FP8 cast once for the linears reading it, as 03's Projections makes it; 27 once it
    priced what 03 runs and it had not (a review against the code, each counted by a dispatch mode): the
    recompute stopping before down_proj (six A100 runs of Megatron and DeepSpeed, which rerun the whole
    layer, went beyond 20%), 08's eager weight casts, 03's collectives' copies, the loss's eager bytes; 29
    once it priced the sums of q, k and v's (gate and up's) input gradients, which each rank makes on every
    token before 03's collective (Narayanan's 39.1B and 310.1B back within 20%; NVIDIA's FP8 rows, whose
    fused QKV makes no sum, further out); 34 once it priced a ring's attention (cp > 1) at 07's rate, the
    kernel 09 runs in 05's ring whatever --attention says, where it had priced cuDNN's, which the course
    has no ring of (NeMo 24.03's five long-context runs within 20%); 33 once it priced the ring's eager
    merges (NeMo's runs -5% to +5%; Megatron-Bridge's 405B of 26.02 past 20%); 36 once BLOOM's runs were
    priced on their cluster's published network (Jean Zay's four 100 Gb/s Omni-Path links a node of eight
    A100s: 6.25 GB/s a GPU, the preset's DGX A100 25), the same 33 once Narayanan's 1.7B to 18.4B ran
    PyTorch's DDP as run_table_1.sh says (reducing in backward; priced as Megatron's local DDP before:
    3.6B, 7.5B and 18.4B went past 20%); 32 once a review of the sources set what they state: BLOOM's runs
    from 02-28 with fp32 gradients and the embedding and head as layers, the 340B's selective recompute and
    flash-attn (NVTE_FUSED_ATTN=0), NVIDIA's fused loss where the yaml sets it, MPT's tied embeddings (the
    340B in FP8 went past 20%); 36 once it priced Megatron's dropout of the attention probabilities (its
    default 0.1, which neither Narayanan's scripts nor BLOOM's set) with --attention unfused (Narayanan's
    1.7B to 18.4B, -27% to -22%, within 20%: -19% to -18%); 37 once it priced their reentrant checkpoints
    (--recompute whole: each layer rerun to its end, down_proj and its all-reduce too; Narayanan's 76.1B
    -22% to -17%, his others -16% to -2%, BLOOM's 176B runs -12% to -5%); 38 once 05's ring merged and
    accumulated in place (merge_into, add_: 20 B a query element a ring step, 40 before; Megatron-Bridge's 405B of
    26.02 +21% to +20%, NeMo's long-context runs -10% to +0%); 40 once 03's backward ran SP's regather and
    input-gradient reduce-scatter beside its GEMMs, as Megatron's does (NVIDIA's 340B and 70B in FP8, +22%
    and +23%, to +17% and +19%). The misses are families: BLOOM's tests, llm-foundry's long context (2023,
    cp 1), NVIDIA's FP8 runs of the 15B and the 405B."""
    assert len(HELD_OUT) >= 12 and not set(HELD_OUT) & set(PUBLISHED) and set(HELD_OUT_MISSES) <= set(HELD_OUT)
    assert all(sum(label.startswith(source) for label in HELD_OUT) >= 3 for source in HELD_OUT_SOURCES)
    for label in HELD_OUT:
        published, timing = published_and_predicted(label)
        error = timing["step"] / published - 1
        bound, why = HELD_OUT_MISSES.get(label, (0.20, ""))
        assert abs(error) <= bound, (label, error, why)
        assert (abs(error) > 0.20) == bool(why) and why[:1] in ("", "+" if error > 0 else "-"), (label, error, why)


def test_a_rings_attention_is_priced_at_the_kernel_09_runs_in_it():
    """With cp > 1, 09 runs 05's ring of 07's kernel whatever --attention says (a ring block returns its
    rows' log-sum-exp, which SDPA does not): plan prices 07's rate and memory there. NeMo's 128k run at cp 4
    has one step and one peak under cudnn, sdpa and flash (plan once priced a cuDNN ring, which the
    course does not have); at cp 1 (its 8k run) --attention picks the kernel: cuDNN's, 07's, SDPA's."""
    steps = {}
    peaks = {}
    for label in ("NeMo 24.03 Llama 2 7B, 128k", "NeMo 24.03 Llama 2 7B, 8k"):
        cfg, sizes, run, cluster = published_run(label)
        for kernel in ("cudnn", "sdpa", "flash"):
            _, _, plans, timing = full_train.planned(cfg, sizes, dataclasses.replace(run, attention=kernel), cluster)
            steps[label, kernel] = timing["step"]
            peaks[label, kernel] = max(p.total for p in plans)
    ring = "NeMo 24.03 Llama 2 7B, 128k"
    assert published_run(ring)[1].cp == 4 and published_run(ring)[2].attention == "cudnn"
    assert steps[ring, "cudnn"] == steps[ring, "sdpa"] == steps[ring, "flash"]
    assert peaks[ring, "cudnn"] == peaks[ring, "sdpa"] == peaks[ring, "flash"]
    one = "NeMo 24.03 Llama 2 7B, 8k"
    assert published_run(one)[1].cp == 1 and steps[one, "cudnn"] < steps[one, "flash"] < steps[one, "sdpa"]


def test_reduce_after_backward_exposes_the_whole_gradient_reduction():
    """--reduce-after-backward (Megatron-LM 2021's local DDP, DeepSpeed's pipeline): Narayanan's 1.7B on
    dp 32 (four nodes: the ring crosses the NICs; it ran PyTorch's DDP) all-reduces every bf16 gradient
    after the schedule: the DP part is 2 (N - 1) / N x the gradients' bytes at 25 GB/s plus a call's
    latency a unit, the step that much longer; reduced in backward, only what the last microbatch's
    backward does not hide."""
    cfg, sizes, run, cluster = published_run("Narayanan 1.7B")
    assert run.reduce_in_backward and sizes.dp == 32 and run.microbatches == 1
    run = dataclasses.replace(run, reduce_in_backward=False)
    after = full_train.planned(cfg, sizes, run, cluster)
    during = full_train.planned(cfg, sizes, dataclasses.replace(run, reduce_in_backward=True), cluster)
    [rank] = after[2]
    units = cfg.n_layers + 3  # the embedding, each layer, the norm, the head
    nbytes = 2 * 31 / 32 * 2 * rank.params  # each unit padded to a multiple of 32: within rel 1e-6
    assert after[3]["parts"]["DP"] == pytest.approx(nbytes / 25e9 + units * cluster.latency, rel=1e-3)
    assert during[3]["parts"]["DP"] < 0.05 * after[3]["parts"]["DP"]
    assert after[3]["step"] - during[3]["step"] == pytest.approx(after[3]["parts"]["DP"] - during[3]["parts"]["DP"])


def test_fp32_gradients_double_the_gradients_bytes_held_and_reduced():
    """--fp32-grads (02's, Megatron's main_grad): the same run holds its gradients and reduces them after
    the schedule in fp32, 4 B an element: twice the gradients' bytes and the DP part's, less its calls'
    latency (the same calls)."""
    cfg, sizes, run, cluster = published_run("Narayanan 1.7B")
    run = dataclasses.replace(run, reduce_in_backward=False)
    bf16 = full_train.planned(cfg, sizes, run, cluster)
    fp32 = full_train.planned(cfg, sizes, dataclasses.replace(run, fp32_grads=True), cluster)
    assert fp32[2][0].memory["grads"] == 2 * bf16[2][0].memory["grads"]
    latency = (cfg.n_layers + 3) * cluster.latency
    assert fp32[3]["parts"]["DP"] - latency == pytest.approx(2 * (bf16[3]["parts"]["DP"] - latency), rel=1e-9)


def test_fp32_gradients_price_zero_1s_step_and_reduction_at_4_bytes():
    """At ZeRO-1 with 4 microbatches (Nemotron-4 15B on 16 GPUs, tp 2: dp crosses the nodes), nothing
    hidden: the fp32 gradients add zero_step_bytes' own difference to the elementwise part, and to DP the
    reduce-scatter's 2 more bytes an element at the network's rate; the all-gather still sends bf16."""
    cfg, sizes, run, cluster = published_run("DGX Cloud Nemotron-4 15B, 16 GPUs")
    sizes, run, plans, _ = full_train.planned(cfg, sizes, dataclasses.replace(run, microbatches=4), cluster)
    assert run.zero_stage == 1 and run.microbatches == 4 and not full_train.inside_node(sizes, "dp_cp", 8)
    fp32_run = dataclasses.replace(run, fp32_grads=True)
    bf16 = full_train.step_time(cfg, sizes, run, plans, cluster, hide=False)["parts"]
    fp32_plans = full_train.plan(cfg, sizes, fp32_run)
    fp32 = full_train.step_time(cfg, sizes, fp32_run, fp32_plans, cluster, hide=False)["parts"]
    [rank] = plans
    n = sizes.dp * sizes.cp
    step_bytes = [zero.zero_step_bytes(rank.params, n, 1, 4, True, False, fp32_grads) for fp32_grads in (False, True)]
    hbm = cluster.hbm_tbps * 1e12
    assert fp32["elementwise"] - bf16["elementwise"] == pytest.approx((step_bytes[1] - step_bytes[0]) / hbm)
    more = foundation.ring_traffic("reduce_scatter", 2 * rank.params, n)
    assert fp32["DP"] - bf16["DP"] == pytest.approx(float(more) / (cluster.network_gbps * 1e9))


@pytest.mark.parametrize("options, fits", [
    ("--model llama3-8b --dp 8 --pp 8 --cp 1 --tp 1 --microbatches 4", "it fits with --microbatches 64: "),
    ("--model llama3-70b --dp 2 --pp 1 --cp 1 --tp 8 --zero 3 --recompute full",
     "no more recompute, ZeRO, microbatches, loss slices or SP make it fit; with AdamW's state in bf16 (other "
     "numbers), it fits with --bf16-optimizer --sequence-parallel: "),
    ("--model llama3-8b --gpus 8 --seq-len 131072 --global-batch 8", "it fits with --recompute full on "),
    ("--model llama3-70b --gpus 32 --pp 1 --cp 1 --zero 2", "it fits with --sequence-parallel on "),
    ("--model llama3-8b --dp 8 --pp 1 --cp 1 --tp 1 --seq-len 32768 --global-batch 64",
     "it fits with --recompute full --zero 3 --loss-chunks 8: "),
    ("--model llama3-8b --gpus 8 --seq-len 131072 --global-batch 8 --gpu a100-40gb",
     "it fits with --recompute full --loss-chunks 8 --sequence-parallel on "),
], ids=["microbatches", "bf16-optimizer", "search", "sequence parallel", "three together", "three, searched"])
def test_a_mesh_that_does_not_fit_names_what_would_fit_it(monkeypatch, capsys, options, fits):
    """A new user's dead ends (issue 55's reviews): 4 microbatches of 16 sequences on pp 8 (one sequence
    each fits); a 70B whose AdamW state alone overflows (only --bf16-optimizer, which computes other
    numbers, fits: named last); a search where no mesh fits as asked (it said by how much, not what fits;
    then it named the fastest fitting mesh's numbers as the leanest's: now it names that mesh); a 70B at
    tp 8 whose activations SP fits, faster than a full recompute (SP was not offered); an 8B at 32k tokens
    that no one option fits (it said none fits: now the fewest together). Each suggestion fits when taken,
    on the mesh it names, with the GiB and step said; of several, none can be left out."""
    code, out, _ = plan_main(monkeypatch, capsys, *options.split())
    said = re.search(re.escape(fits) + r"(dp=\d+ pp=\d+ cp=\d+ tp=\d+: )?([\d,.]+) GiB, step ([\d,.]+) s$",
                     out.splitlines()[-1])
    assert code == 1 and said, out
    taken = fits.rpartition("it fits with ")[2].removesuffix(": ").removesuffix(" on ").split()
    mesh = [f"--{size.replace('=', ' ')}" for size in (said[1] or "").removesuffix(": ").split()]
    code, out, _ = plan_main(monkeypatch, capsys, *options.split(), *taken, *" ".join(mesh).split())
    assert code == 0 and not out.splitlines()[-1].startswith("does not fit") and "does not fit on" not in out, out
    if mesh:  # that mesh alone: its fullest GPU and step as said
        assert f"fits: {said[2]} of " in out and f"step {said[3]} s predicted" in out, out
    starts = [i for i, word in enumerate(taken) if word.startswith("--")] + [len(taken)]
    if len(starts) > 2 and "--bf16-optimizer" not in taken:  # the fewest: without any one, nothing fits
        # (--bf16-optimizer's suggestion is its fastest pairing, not the fewest options)
        for left_out in zip(starts, starts[1:]):
            others = [word for i, word in enumerate(taken) if not left_out[0] <= i < left_out[1]]
            code, out, _ = plan_main(monkeypatch, capsys, *options.split(), *others)
            assert code == 1 and "does not fit" in out, (others, out)


def test_fp32_gradients_rule_out_zero_2_and_3_in_what_would_fit(monkeypatch, capsys):
    """A mesh that fits only at ZeRO-3: the plan offers --zero 3, and with --fp32-grads (whose buffer
    stages 2-3 free) says why it offers nothing (it tried ZeRO 2-3 with the flag on, which validate
    refused, and said no option fits)."""
    options = ("--model llama3-8b --dp 8 --pp 1 --cp 1 --tp 1 --global-batch 8 --seq-len 8192 --recompute full "
               "--loss-chunks 8 --gpu a100-40gb").split()
    _, out, _ = plan_main(monkeypatch, capsys, *options)
    assert re.search(r"; it fits with --zero 3: [\d.]+ GiB, step [\d.]+ s$", out.splitlines()[-1]), out
    _, out, _ = plan_main(monkeypatch, capsys, *options, "--fp32-grads")
    assert out.splitlines()[-1].endswith("no more recompute, ZeRO, microbatches, loss slices or SP make it fit "
                                         "(--fp32-grads keeps ZeRO at 0-1)"), out


def test_unfused_attention_is_priced_kernel_by_kernel_as_pytorchs_eager_attention_runs():
    """--attention unfused prices the kernels PyTorch's eager attention (SDPA's math backend, counted
    here by a dispatch mode, fp32) launches: forward two batched GEMMs around the softmax, backward
    four around the softmax's backward; each GEMM by 08's roofline at its own per-head shape, each
    softmax by its bytes (2 and 3 passes of the seq x seq scores) at the HBM's bandwidth. The causal
    mask is not counted: Megatron's softmax applies it inside, as the formula says (eager PyTorch adds
    a pass). cp > 1: each of the ring's cp blocks whole. Megatron's dropout of the probabilities: the
    kernels CUDA's dropout launches (aten.native_dropout, a bool mask beside its output, and its
    backward; on a CPU F.dropout decomposes, so they are called here as CUDA calls them)."""
    batch, heads, seq, head_dim, hbm, speed = 2, 3, 64, 16, 1e12, 0.5
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    counted = []

    class Kernels(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten._safe_softmax.default,
                        torch.ops.aten._softmax.default, torch.ops.aten._softmax_backward_data.default):
                counted.append((func, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)], out.shape))
            return out

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), Kernels():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        backward_from = len(counted)
        out.backward(torch.ones_like(out))

    def seconds(kernels) -> float:
        total = 0.0
        for func, shapes, out_shape in kernels:
            if func == torch.ops.aten.bmm.default:
                (count, m, inner), (_, _, n) = shapes
                total += count * full_train.fp8.gemm_seconds(m, inner, n, hbm, speed=speed)
            else:
                total += 4 * (sum(math.prod(shape) for shape in shapes) + math.prod(out_shape)) / hbm
        return total

    gemms = [func == torch.ops.aten.bmm.default for func, _, _ in counted]
    assert (sum(gemms[:backward_from]), sum(gemms[backward_from:]), len(counted)) == (2, 4, 8)
    formula = full_train.unfused_attention_seconds(batch, heads, seq, head_dim, 1, hbm, 4, speed)
    assert formula == pytest.approx((seconds(counted[:backward_from]), seconds(counted[backward_from:])), rel=1e-12)
    ring = full_train.unfused_attention_seconds(batch, heads, seq, head_dim, 4, hbm, 4, speed)
    assert ring == pytest.approx(tuple(4 * x for x in formula), rel=1e-12)

    probabilities = torch.rand(batch, heads, seq, seq, requires_grad=True)
    moved = []

    class Bytes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.native_dropout.default, torch.ops.aten.native_dropout_backward.default):
                tensors = [t for t in (*args, *(out if isinstance(out, tuple) else (out,))) if torch.is_tensor(t)]
                moved.append(sum(t.numel() * t.element_size() for t in tensors))
            return out

    with Bytes():
        dropped, _ = torch.native_dropout(probabilities, 0.1, True)
        dropped.backward(torch.ones_like(dropped))
    assert len(moved) == 2
    with_dropout = full_train.unfused_attention_seconds(batch, heads, seq, head_dim, 1, hbm, 4, speed, dropout=True)
    assert [a - b for a, b in zip(with_dropout, formula)] == pytest.approx([n / hbm for n in moved], rel=1e-12)
    ring = full_train.unfused_attention_seconds(batch, heads, seq, head_dim, 4, hbm, 4, speed, dropout=True)
    assert ring == pytest.approx(tuple(4 * x for x in with_dropout), rel=1e-12)


def test_the_plan_says_and_prices_the_attention_dropout(monkeypatch, capsys):
    """--attention-dropout P with --attention unfused: the header names it; at any P > 0 (0.05, 0.1, 1: the
    kernels' bytes do not depend on P) the step grows by the dropout kernels' seconds and the fullest GPU
    by the dropped probabilities and mask a layer keeps (one layer's under full recompute, rebuilt in its
    backward), and at 0 by nothing: their formulas' own tests count them."""
    options = ("--model llama3-8b --vocab 32000 --dp 8 --pp 1 --cp 1 --tp 1 --gpu a100-80gb --attention unfused "
               "--seq-len 4096 --global-batch 8 --recompute full").split()  # a layer's backward above the loss
    plans = []
    for dropout in ("0", "0.05", "0.1", "1"):
        code, out, _ = plan_main(monkeypatch, capsys, *options, "--attention-dropout", dropout, "--json")
        assert code == 0
        mesh = json.loads(out)["meshes"][0]
        plans.append(dict(step_s=mesh["step_s"], **mesh["memory_gib"][mesh["fullest"]]))
    _, without, _ = plan_main(monkeypatch, capsys, *options, "--json")  # no --attention-dropout: 0
    assert json.loads(without)["meshes"][0]["step_s"] == plans[0]["step_s"]
    assert plans[1] == plans[2] == plans[3]
    _, text, _ = plan_main(monkeypatch, capsys, *options, "--attention-dropout", "0.1")
    assert "Priced: GEMMs and attention (unfused, dropout 0.1; cp > 1" in text, text
    layers = heads = 32
    scores = heads * 4096 ** 2  # a layer's, one sequence a microbatch
    hbm = full_train.GPUS["a100-80gb"][3] * 1e12
    dropout_kernels = 3 * scores * (2 * 2 + 1) / hbm  # in bf16: forward, its recompute, backward
    assert plans[1]["step_s"] - plans[0]["step_s"] == pytest.approx(layers * dropout_kernels, rel=1e-6)
    grew = (plans[1]["activations"] + plans[1]["temporaries"] - plans[0]["activations"]
            - plans[0]["temporaries"]) * 2 ** 30
    assert grew == pytest.approx(scores * (1 + 2), rel=1e-3)  # the mask and the dropped P


def megatron_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: bool) -> torch.Tensor:
    """Megatron's attention before FlashAttention (2021, one K/V head a query head): baddbmm's scaled
    scores, the softmax (Megatron's fused kernel applies the causal mask inside: none here), CUDA's
    dropout kernel (aten.native_dropout), the batched P V."""
    batch, heads, seq, head_dim = q.shape
    flat = [t.reshape(batch * heads, seq, head_dim) for t in (q, k, v)]
    empty = torch.empty(batch * heads, seq, seq, dtype=q.dtype)
    scores = torch.baddbmm(empty, flat[0], flat[1].transpose(1, 2), beta=0, alpha=head_dim ** -0.5)
    probabilities = torch.softmax(scores, dim=-1)
    if dropout:
        probabilities, _ = torch.native_dropout(probabilities, 0.1, True)
    return torch.bmm(probabilities, flat[2]).view(batch, heads, seq, head_dim)


@pytest.mark.parametrize("batch, heads, seq, head_dim", [(2, 4, 32, 16), (1, 2, 64, 16), (1, 1, 128, 8)])
def test_unfused_attention_holds_what_plan_says(batch, heads, seq, head_dim):
    """--attention unfused's memory: what Megatron's eager attention keeps beyond q, k and v (autograd's
    saved tensors, counted) is unfused_attention_saves, exactly; the most its backward makes alive at
    once (test_03's LiveStorages) is within unfused_attention_backward_bytes, a bound that counts dq, dk
    and dv beside two seq x seq gradients: autograd's order frees one or two of the three before the
    peak (seq >= 2 head_dim here, where the seq x seq terms lead), so the bound is above it by at most
    their bytes."""
    from test_03_tensor_parallel import LiveStorages
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        for dropout in (False, True):
            q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
            saved = {}

            def keep(t: torch.Tensor) -> torch.Tensor:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = megatron_attention(q, k, v, dropout)
            inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
            beyond = sum(nbytes for pointer, nbytes in saved.items() if pointer not in inputs)
            assert beyond == full_train.unfused_attention_saves(batch, heads, seq, size, dropout)
            with LiveStorages() as made:
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            bound = full_train.unfused_attention_backward_bytes(batch, heads, heads, seq, head_dim, size)
            gradients = 3 * batch * heads * seq * head_dim * size
            assert made.peak <= bound <= made.peak + gradients, (made.peak, bound)


# Held-out runs that publish memory: BLOOM's benchmarks, nvidia-smi on the first node (CUDA's context and the
# allocator's cache in it, as in plan's total). Recorded for issue 55's memory targets, not yet asserted beyond
# "fits" (every one of these ran): published GiB, and plan's fullest GPU on that node at this commit (03's lean
# saves: 0-1.1 GiB below autograd's; from 02-28, BF16_Optimizer's fp32 gradients; unfused attention's seq x seq
# saves, 0-2.2 GiB), which is 1-29% below (DeepSpeed's buffers?).
HELD_OUT_MEMORY = {  # label: (published GiB, planned GiB)
    "BLOOM 176B, 02-28": (59, 44.7), "BLOOM 176B, 64 heads": (59, 43.8),
    "BLOOM 176B, 64 heads, 4 a microbatch": (73, 53.2), "BLOOM 176B, 64 heads, tp 8": (40, 30.7),
    "BLOOM 178B": (63, 44.8), "BLOOM 177B, pp 48": (58, 49.4), "BLOOM 20B, one node": (68, 67.4),
}


def test_every_held_out_mesh_that_published_its_memory_fits_in_the_plan():
    """Every mesh of HELD_OUT_MEMORY ran, so plan must say it fits (its fullest GPU within the 80 GiB);
    the GiB recorded beside each are plan's for the first node's GPUs, where the published reading was
    taken (to 0.1 GiB: a change to the layer's formula re-records them)."""
    for label, (published, recorded) in HELD_OUT_MEMORY.items():
        cfg, sizes, run, cluster = published_run(label)
        run = dataclasses.replace(run, microbatches=published_row(label)[2].get("microbatches"))
        sizes, run, plans, _ = full_train.planned(cfg, sizes, run, cluster)
        first_node = {rank // (sizes.cp * sizes.tp) % sizes.pp for rank in range(cluster.gpus_per_node)}
        planned = float(max(plans[p].total for p in first_node)) / 2 ** 30
        assert max(p.total for p in plans) <= cluster.gpu_memory * 2 ** 30, (label, published)
        assert round(planned, 1) == recorded, (label, planned, published)


# Published meshes (every one ran) that plan says do not fit as published, 30 of PUBLISHED's and HELD_OUT's 78
# before 03's lean layer, 8 after it, 6 with NVIDIA's fused loss as 03's loss in slices (FUSED_LOSS), 4 with the
# 340B's BF16 AdamW as its yaml sets it (02's bf16_optimizer; at 12 B a parameter over dp 2 its optimizer alone
# was 32.2 GiB), 3 with 05's ring keeping its bf16 output and an fp32 lse and DGX Cloud's 405B cut with the
# embedding and head as layers (ends_as_layers; 83.8 GiB before both, 78.6 after): each names its largest term
# and the option that fits it, the fastest of those that keep less
# (test_every_published_mesh_fits_or_names_the_term_and_an_option_that_fits_it).
DOES_NOT_FIT_AS_PUBLISHED = {  # label: (the largest term, the option that fits)
    # interleaved 1F1B's 47 microbatch-stages of 4 layers; eager, as 03's elementwise recompute runs
    "Llama 3 405B": ("activations", "--recompute elementwise --eager"),
    "Llama 3 405B, 16,384 GPUs": ("activations", "--recompute elementwise --eager"),  # was --zero 3, slower
    "Llama 3 405B, 131k tokens": ("activations", "--recompute elementwise --eager"),
}


def test_every_published_mesh_fits_or_names_the_term_and_an_option_that_fits_it():
    """Issue 55: a published mesh ran, so plan's verdict on it is "fits", or (DOES_NOT_FIT_AS_PUBLISHED) names
    its fullest GPU's largest term and an option with which the plan says it fits, the fastest of them."""
    for label in {**PUBLISHED, **HELD_OUT}:
        cfg, sizes, run, cluster = published_run(label)
        run = dataclasses.replace(run, microbatches=published_row(label)[2].get("microbatches"))
        mesh = {d: getattr(sizes, d) for d in full_train.DIMS}
        job = full_train.Job("plan", label, cfg, mesh, sizes.ep, run, full_train.RunConfig(), cluster, sizes.world)
        report, fits = full_train.plan_report(job)
        verdict = report.splitlines()[-1]
        if label not in DOES_NOT_FIT_AS_PUBLISHED:
            assert fits and verdict.startswith("fits: "), (label, verdict)
            continue
        term, option = DOES_NOT_FIT_AS_PUBLISHED[label]
        assert re.fullmatch(rf"does not fit: .*; its largest part: {term}, [\d,.]+ GiB( \(.*\))?; it fits with {option}: "
                            rf"[\d,.]+ GiB, step [\d,.]+ s", verdict), (label, verdict)
        change = {}
        for given in option.removeprefix("--").split(" --"):  # "recompute elementwise", "eager"
            name, *value = given.split()
            if name == "eager":
                change["compile"] = False
            elif name == "recompute":
                change["recompute"] = value[0]
            else:
                change[{"zero": "zero_stage", "loss-chunks": "loss_chunks"}[name]] = int(value[0])
        job = dataclasses.replace(job, train=dataclasses.replace(run, **change))
        assert not fits and full_train.plan_report(job)[0].splitlines()[-1].startswith("fits: "), (label, option)


# Published peak memory per GPU (GiB; torchtitan and torchao log torch's peak *reserved* bytes, which leave out
# the CUDA context and NCCL's buffers: compared with plan's total less its cuda_nccl). Row ids are
# /work/research/published_runs.md's, each run's source there: TT-1..6 torchtitan benchmarks/
# llama3_h100_202412_torchtitan.md (commit 9dec370, Grand Teton H100 96 GB at 500 W); TT-9 torchtitan's
# benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md; AO-1, AO-2 pytorch/ao docs/source/workflows/training.md
# (8 H100s, 8 power-limited B200s); AO-3 torchao's prototype/moe_training README; DG-6 dgxc-benchmarking v25.04's
# example log; MB-S Megatron-Bridge's nemo-mbridge-perf-memory-tuning skill (GB, 70B SFT). Tolerance 10% where the
# plan models the run; else the miss as it stands and why (a change that moves it is a change to the model).
# torchtitan compiles its loss with --compile since 2025-04 (pytorch/torchtitan#1033): it keeps about the logits'
# gradient, as 03's loss in slices does (FUSED_LOSS); TT-1..4 (2024-12) ran it eager, AO-1's date is not stated
COMPILED_LOSS = FUSED_LOSS
# torchtitan under PP (9dec370's parallelize_llama.py): FSDP2 with reshard_after_forward=False and its default
# mixed_precision_reduce float32; torch's pipeline stage turns gradient sync off but for the last microbatch, so
# FSDP2 adds each microbatch's bf16 gradients into whole fp32 ones: 02's ZeRO-1 with fp32 gradients
TITAN_PP = dict(TITAN, zero_stage=1, microbatches=8, recompute="full", sequence_parallel=True, fp8=True, compile=True,
                fp32_grads=True)
# Megatron-Bridge's skill reports peaks of *allocated* bytes (its baseline's 58.8 GB ran out of 80 GB GPUs to
# fragmentation; report_memory divides torch's memory_stats() by 1e9): compared, as 09's check prints
# max_memory_allocated, with plan's total less its fragmentation and cuda_nccl
ALLOCATED_PEAKS = ("MB-S1", "MB-S2", "MB-S3")
# and of the *last* pipeline stage's GPU: Bridge's TensorBoard and W&B writers live on the last rank (where the
# loss is), which logged its own memory until Megatron-Bridge#3645 (2026-05-08, "peak GPU memory typically lives
# on the first PP stage": issue #3167) reduced it over the pipeline; the skill's table is from 2026-04-16 (its
# commit e43a7468f). Compared with plan's last pipeline rank, which holds the fewest microbatches in flight
LAST_STAGE_PEAKS = ("MB-S1", "MB-S2", "MB-S3")
MEMORY = {  # id: (model, mesh, options, published GiB, tolerance, why it misses)
    "TT-1a": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=16), 82.4, 0.10, ""),
    "TT-1b": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=16, compile=True), 77.0, 0.10, ""),
    "TT-1c": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=16, compile=True, fp8=True), 76.8, 0.10, ""),
    **{f"TT-2{x}": ("llama3-8b", (8 // cp, 1, cp, 1), dict(TITAN, global_batch=8 // cp, seq_len=32_768 * cp,
                                                           recompute="full", compile=True, fp8=True), gib, 0.10, "")
       for x, cp, gib in (("a", 1, 83.9), ("b", 2, 84.2), ("c", 4, 84.0), ("d", 8, 84.5))},
    **{f"TT-3{x}": ("llama3-8b", (128, 1, 1, 1), dict(TITAN, global_batch=256, **kw), gib, 0.10, "")
       for x, kw, gib in (("a", {}, 67.0), ("b", dict(compile=True), 62.0), ("c", dict(compile=True, fp8=True), 61.8))},
    **{f"TT-4{x}": ("llama3-70b", (32, 1, 1, 8), dict(TITAN, global_batch=512, recompute="full", sequence_parallel=True,
                                                      compile=True, fp8=True), gib, tol,
                    "-: DTensor's loss parallel and async TP's buffers are not 03's") for x, gib, tol in
       (("a", 71.9, 0.20), ("b", 67.6, 0.15))},
    **{f"TT-{x}": ("llama3-405b", (8 // cp, 8, cp, 8), dict(TITAN_PP, global_batch=(32 if seq == 8192 else 8) * 8 // cp,
                                                            seq_len=seq,
                                                            schedule=schedule, virtual=2 if schedule != "1f1b" else 1),
                   gib, 0.10, "")
       for x, cp, seq, schedule, gib in (("5a", 1, 8192, "1f1b", 82.5), ("5b", 1, 8192, "interleaved", 72.7),
                                         ("6a", 1, 32768, "1f1b", 75.3), ("6b", 2, 65536, "1f1b", 75.9),
                                         ("6c", 4, 131072, "1f1b", 77.1), ("6d", 8, 262144, "1f1b", 84.9))},
    **{f"TT-9{x}": ("llama3-8b", (dp, 1, 1, 1), dict(TITAN, gpu="h200", global_batch=2 * dp, compile=True, fp8=True,
                                                    **COMPILED_LOSS),
                    gib, 0.15, "+: its loss compiled, priced as 03's sliced loss (45% above with the loss at once); "
                               "the rest not found (float8's forced weight recompute?)") for x, dp, gib in
       (("a", 32, 47.96), ("b", 64, 46.97))},
    **{f"AO-1{x}": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, global_batch=8, compile=True, fp8=x != "a"), gib, 0.10, "")
       for x, gib in (("a", 47.65), ("b", 47.77), ("c", 47.79))},
    **{f"AO-2{x}": ("llama3-8b", (8, 1, 1, 1), dict(TITAN, gpu="b200", global_batch=8, compile=True, fp8=x != "a",
                                                    **COMPILED_LOSS), gib,
                    0.35, "+: its loss compiled, priced as 03's sliced loss (55% above at once); AO-1 holds 14 GiB "
                          "more at the same shapes on H100s: not found why")
       for x, gib in (("a", 33.71), ("b", 33.38), ("c", 33.88), ("d", 33.88), ("e", 33.72))},
    **{f"AO-3{x}": (None, None, None, gib, None, "n/a: MoE activations depend on the routing: no formula")
       for x, gib in (("a", 145.55), ("b", 146.62), ("c", 144.71), ("d", 145.32))},
    "DG-6": ("llama3-8b", (4, 1, 2, 1), dict(NVIDIA, global_batch=128, microbatches=32, fp8=True), 65.97, 0.25,
             "+: its configuration and the metric's meaning are not stated (published_runs.md: low confidence)"),
    **{f"MB-S{x}": ("llama3-70b", mesh, dict(NVIDIA, global_batch=32, seq_len=4096, microbatches=32 // mesh[0],
                                             schedule="interleaved", virtual=5, sequence_parallel=True, fp8=True),
                    gb * 1e9 / 2 ** 30, tolerance, why)
       for x, mesh, gb, tolerance, why in (("1", (2, 4, 1, 4), 58.8, 0.15,
                                            "+: at dp 2 (dp 1, MB-S2: +9%), 02's ZeRO-1 holds its reduce-scatter "
                                            "output in backward (Megatron reduces in place into its gradient "
                                            "buffer); the rest is not found"),
                                           ("2", (1, 8, 1, 4), 53.2, 0.10, ""),
                                           ("3", (1, 4, 1, 8), 50.2, 0.10, ""))},
}


def test_the_planned_memory_is_within_10_percent_of_published_peaks_where_it_models_the_run():
    """36 published peaks; the plan's reserved bytes (its tensors, temporaries and the allocator's
    segments; allocated where the source reports them; the GPU the source read) within each row's tolerance:
    10% on the 21 runs it models (torchtitan's and torchao's 8B on 8 and 128 GPUs, with and without FP8,
    context parallelism to 256k tokens; torchtitan's 405B on 512 GPUs, pipelined with 02's fp32 gradients;
    Megatron-Bridge's 70B at tp 8, and at tp 4 over 8 stages), each miss bounded and said why; README's
    counts."""
    assert len(MEMORY) == 36 and sum(row[4] == 0.10 for row in MEMORY.values()) == 21
    errors = []
    for label, (model, mesh, options, published, tolerance, why) in MEMORY.items():
        if model is None:
            continue
        PUBLISHED[label] = (model, mesh, options, (1, "s"))
        try:
            cfg, sizes, run, cluster = published_run(label)
            run = dataclasses.replace(run, microbatches=options.get("microbatches"))
            sizes, run, plans, _ = full_train.planned(cfg, sizes, run, cluster)
        finally:
            del PUBLISHED[label]
        read = plans[-1] if label in LAST_STAGE_PEAKS else max(plans, key=lambda p: p.total)  # the GPU it read
        left_out = ("cuda_nccl", "fragmentation") if label in ALLOCATED_PEAKS else ("cuda_nccl",)
        planned = float(read.total - sum(read.memory[part] for part in left_out)) / 2 ** 30
        assert abs(planned / published - 1) <= tolerance, (label, planned, published, why)
        assert (tolerance == 0.10) == (not why) and why[:1] in ("", "+" if planned > published else "-")
        errors.append(abs(planned / published - 1))
    within = [sum(error <= bound for error in errors) for bound in (0.10, 0.15)]
    assert (f"Memory against 36 published peaks (torchtitan, torchao, DGX Cloud, Megatron-Bridge): {within[0]} "
            f"within 10%, {within[1]} within 15%") in " ".join(readme_planning_table().split()), within


def readme_planning_table() -> str:
    return (ROOT / "README.md").read_text()


def readme_errors(heading: str) -> list[int]:
    """The signed errors (%) of the README's table after heading, row by row, each row's in its order."""
    text = readme_planning_table()
    table = text[text.index(heading):].split("\n\n")[1]
    return [int(x) for row in table.splitlines()[2:] for x in row.rstrip(" |").rpartition("|")[2].split()]


def test_the_readmes_tables_of_published_runs_are_what_plan_predicts():
    """README's planning tables: the calibration set's error and the held-out set's, each run's in
    PUBLISHED's and HELD_OUT's order, rounded to a percent."""
    for heading, runs in (("Calibrated on", PUBLISHED), ("Held out", HELD_OUT)):
        errors = []
        for label in runs:
            published, timing = published_and_predicted(label)
            errors.append(round(100 * (timing["step"] / published - 1)))
        assert readme_errors(heading) == errors, heading


PLAN_OPTIONS = {"--dp", "--pp", "--cp", "--tp", "--ep", "--moe", "--experts", "--zero", "--schedule",
                "--microbatches", "--virtual", "--sequence-parallel", "--fp8", "--recompute", "--kv-heads",
                "--global-batch", "--seq-len", "--model", "--gpus", "--gpus-per-node", "--gpu-memory",
                "--peak-tflops", "--hbm-tbps", "--nvlink-gbps", "--network-gbps", "--attention", "--gpu",
                "--fp8-tflops", "--power-limit", "--json", "--dim", "--layers", "--heads", "--ffn-dim", "--vocab",
                "--compile", "--eager", "--lean-saves", "--autograd-saves", "--loss-chunks",
                "--reduce-in-backward", "--reduce-after-backward", "--ends-as-layers", "--bf16-optimizer",
                "--fp32-grads", "--attention-dropout"}


def test_the_planner_offers_the_meshs_and_clusters_options_and_says_what_decides_the_rest(
        monkeypatch, capsys):
    """09's fields that name plan, and Cluster's, each once with one default; the mesh sizes left
    out are searched, the microbatches one sequence each, the rates the --gpu preset's: --help says so."""
    monkeypatch.setenv("COLUMNS", "200")
    code, text, _ = plan_main(monkeypatch, capsys, "--help")
    options = {option.split()[0].rstrip(","): option for option in re.split(r"\n  (?=-)", text)[1:]}
    assert code == 0 and options.keys() == PLAN_OPTIONS | {"-h"} and "(default: None)" not in text
    assert all(option.count("default") <= 1 and len(option.split()) > 2 for option in options.values())
    assert all("(default: searched)" in options[f"--{d}"] for d in full_train.DIMS)
    assert "(default: global_batch / dp: one sequence each)" in options["--microbatches"]
    assert all("(default: the --gpu preset's)" in options[o] for o in ("--gpu-memory", "--hbm-tbps", "--power-limit"))
    assert "(default: h100-sxm)" in options["--gpu"] and "(default: True)" in options["--compile"]


def test_every_preset_and_a_config_file_are_one_option_of_every_command(monkeypatch, capsys, tmp_path):
    """--model is defined once (it was twice: train's 09 presets, plan's published ones): a preset or a
    Hugging Face config.json for train, check and plan alike; 09's byte-level presets set no vocabulary."""
    assert full_train.MODELS.items() <= full_train.PRESETS.items()
    assert all("vocab_size" not in full_train.PRESETS[name][0] for name in ("tiny", "1b", "2b"))
    model_fields = [f for f in dataclasses.fields(full_train.ModelOptions) if f.name == "model"]
    assert len(model_fields) == 1 and model_fields[0].metadata["commands"] is None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    for command in ("train", "check", "plan"):
        assert full_train.configure(parse_options(command, "--model", str(path))).cfg == preset("llama3-8b")


def test_check_proves_any_model_on_its_own_small_run_and_a_run_beyond_this_machine_is_refused(
        monkeypatch, capsys, tmp_path):
    """check of a config.json is that shape on check's 8 x 32 tokens (the file's run, Llama 3 8B's 512 x
    8,192, had a dim-64 model's ranks killed by the OOM killer mid-launch); on a CPU, a mesh whose plan
    (09's own bytes, a GPU's allowances aside) exceeds this machine is one line before any rank starts."""
    small = dict(LLAMA3_8B_CONFIG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, num_hidden_layers=2)
    (tmp_path / "small.json").write_text(json.dumps(small))
    run = full_train.configure(parse_options("check", "--model", str(tmp_path / "small.json"))).train
    assert (run.global_batch, run.seq_len) == (8, 32)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the guard of CPU ranks, on any machine
    for argv in (["check", "--model", "llama3-8b"], ["--model", "1b", "--dp", "1", "--tp", "1", "--no-save"]):
        code, err, launched, _ = run_main(monkeypatch, capsys, *argv)
        assert code == 2 and not launched and f"this machine has {memory:,}" in err, err
        assert f"--model {argv[argv.index('--model') + 1]} with --global-batch" in err
        assert "09's plan of the tensors" in err
    code, err, launched, _ = run_main(monkeypatch, capsys, "check", "--moe", "--experts", "100000")
    assert code == 2 and not launched and "--model check --moe --experts 100000 with --global-batch 8" in err, err


LLAMA3_8B_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                        rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5,
                        rope_scaling=dict(factor=8.0, rope_type="llama3"))


def test_a_config_json_plans_as_its_preset_and_sizes_override_a_preset_or_a_file(monkeypatch, capsys, tmp_path):
    """Meta's Llama 3.1 8B config.json plans exactly as the llama3-8b preset (a file's run: that preset's
    8,192 x 512); --layers 16 halves the layers of either; --gpu h200 with --hbm-tbps 5: 140 GiB at 5 TB/s."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    mesh = "--dp 8 --pp 1 --cp 1 --tp 8".split()
    file, name = (plan_main(monkeypatch, capsys, "--model", m, *mesh)[1] for m in (str(path), "llama3-8b"))
    assert file.split("\n", 1)[1] == name.split("\n", 1)[1] and "batch 512 x 8,192 tokens" in file
    for model in (str(path), "llama3-8b"):
        code, out, _ = plan_main(monkeypatch, capsys, "--model", model, "--layers", "16", *mesh)
        assert code == 0 and "(dim 4096, 16 layers, 32 heads / 8 K/V, ffn 14336," in out
    llama2 = {k: v for k, v in dict(LLAMA3_8B_CONFIG, vocab_size=32000, intermediate_size=11008,
                                    rope_theta=1e4).items() if k != "num_key_value_heads"}  # its K/V heads: 32
    path.write_text(json.dumps(llama2))
    run = ["--seq-len", "4096", "--global-batch", "1024", *mesh]
    file, name = (plan_main(monkeypatch, capsys, "--model", m, *run)[1] for m in (str(path), "llama2-7b"))
    assert file.split("\n", 1)[1] == name.split("\n", 1)[1] and "32 heads / 32 K/V" in file
    path.write_text(json.dumps(dict(llama2, model_type="mistral", num_key_value_heads=8, sliding_window=4096)))
    assert plan_main(monkeypatch, capsys, "--model", str(path), *run)[0] == 0  # Mistral 7B v0.1's window: all
    code, _, err = plan_main(monkeypatch, capsys, "--model", str(path), *run[2:], "--seq-len", "4097")
    assert code == 2 and "sliding_window=4096: attention within a window shorter than the run's seq_len 4,097" in err
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpu", "h200", "--hbm-tbps", "5", *mesh)
    assert code == 0 and "64 GPUs of 140 GiB (h200)" in out and "the rest at 5 TB/s" in out
    cluster = full_train.configure(parse_options("plan", "--gpu", "h200", "--hbm-tbps", "5")).cluster
    assert cluster == full_train.Cluster(gpu="h200", **{**dict(zip(full_train.GPU_FIELDS, full_train.GPUS["h200"])),
                                                        "hbm_tbps": 5})


def test_a_mixtral_config_plans_its_experts_and_a_tied_one_counts_the_embedding_once(monkeypatch, capsys, tmp_path):
    """Mixtral 8x7B-shaped: 8 experts, top 2, each of intermediate_size; Llama 3.2 1B ties its head: the
    planned parameters, the untied model's less one vocabulary x dim table, on one pipeline stage."""
    mixtral = dict(LLAMA3_8B_CONFIG, model_type="mixtral", vocab_size=32000, num_local_experts=8,
                   num_experts_per_tok=2, sliding_window=None)
    (tmp_path / "mixtral.json").write_text(json.dumps(mixtral))
    train = full_train.configure(parse_options("plan", "--model", str(tmp_path / "mixtral.json"))).train
    assert (train.moe.n_experts, train.moe.top_k, train.moe.expert_ffn_dim) == (8, 2, 14336)
    code, out, _ = plan_main(monkeypatch, capsys, "--model", str(tmp_path / "mixtral.json"), "--gpus", "64", "--ep", "8")
    assert code == 0 and "MFU n/a" in out
    tied = dict(LLAMA3_8B_CONFIG, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True)
    sizes = []
    for tie in (True, False):
        (tmp_path / "tied.json").write_text(json.dumps(dict(tied, tie_word_embeddings=tie)))
        args = parse_options("plan", "--model", str(tmp_path / "tied.json"))
        cfg = full_train.configure(args).cfg
        train = dataclasses.replace(full_train.configure(args).train, microbatches=1)  # plan's: per mesh
        sizes.append(full_train.plan(cfg, full_train.MeshSizes(dp=8), train)[0].params)
    assert sizes[1] - sizes[0] == 128256 * 2048


def test_an_moe_plan_never_says_fits_of_memory_it_does_not_count(monkeypatch, capsys, tmp_path):
    """MoE activations have no formula (None): a plan that fits without them says so, and --json's fits is
    null, not true (a review found "fits: 15.5 of 80 GiB" where the dense twin needed 82.3). The header
    counts every expert (Mixtral 8x7B: 46.7B, not the dense 7.2B) and names them; --moe's experts are
    as wide as the preset's MLP (Mixtral's rule; a review found Llama 3 8B's made 64 wide), or --ffn-dim."""
    mixtral = dict(LLAMA3_8B_CONFIG, model_type="mixtral", vocab_size=32000, num_local_experts=8,
                   num_experts_per_tok=2)
    (tmp_path / "mixtral.json").write_text(json.dumps(mixtral))
    code, out, _ = plan_main(monkeypatch, capsys, "--model", str(tmp_path / "mixtral.json"), "--gpus", "64")
    assert code == 0 and "46.7B parameters" in out and "8 experts of 14336, top 2" in out
    assert "fit without their activations; the fastest:" in out and "'fit' is a lower bound" in out
    mesh = ["--model", "llama3-8b", "--moe", "--dp", "2", "--pp", "4", "--cp", "1", "--tp", "2"]
    code, out, _ = plan_main(monkeypatch, capsys, *mesh)
    assert code == 0 and out.splitlines()[-1].startswith("fits without its activations: ")
    assert "4 experts of 14336, top 2" in out
    # 22B of experts on 8 GPUs do not fit: the verdict names a counted part (it once crashed on the None)
    code, out, _ = plan_main(monkeypatch, capsys, *mesh[:3], "--dp", "4", "--pp", "1", "--cp", "1", "--tp", "2")
    assert code == 1 and re.search(r"^does not fit: .*; its largest part: optimizer, .* it fits without its "
                                   r"activations with --bf16-optimizer --zero 3: ", out.splitlines()[-1]), out
    code, out, _ = plan_main(monkeypatch, capsys, *mesh[:3], "--dp", "4", "--pp", "1", "--cp", "1", "--tp", "2",
                             "--json")
    plan = json.loads(out)  # null: fits but for the activations; not fitting even without them: false
    assert code == 1 and plan["fits"] is False and "--bf16-optimizer --zero 3" in plan["why_not_fitting"]
    code, out, _ = plan_main(monkeypatch, capsys, *mesh, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] is None and plan["cluster"]["gpus"] == plan["gpus"] == 16
    assert full_train.configure(parse_options("plan", *mesh, "--ffn-dim", "1024")).train.moe.expert_ffn_dim == 1024


@pytest.mark.parametrize("command", ["plan", "train", "check"])
@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen2"), "model_type='qwen2' is not llama, mistral or mixtral"),
    (dict(hidden_act="gelu"), "hidden_act='gelu': a feature 01's GPT (a plain Llama) lacks"),
    (dict(sliding_window=16), "sliding_window=16: attention within a window shorter than the run's seq_len"),
    (dict(num_hidden_layers=-2), "num_hidden_layers=-2: must be a positive integer"),
    (dict(num_hidden_layers=10 ** 400), "num_hidden_layers=~10^400 is past the bound of 10,000"),
    (dict(num_hidden_layers=10 ** 9), "num_hidden_layers=1,000,000,000 is past the bound of 10,000"),
    (dict(vocab_size=10 ** 30), "vocab_size=~10^30 is past the bound of 1,000,000"),
    (dict(vocab_size=None), "vocab_size=None: missing"),
    (dict(num_attention_heads=7), "--dim 4096 is not divisible by --heads 7"),
    ("not json", "Expecting value: line 1 column 1"),
])
def test_a_config_that_is_not_llama_shaped_or_broken_is_one_line_before_any_rank(monkeypatch, capsys, tmp_path,
                                                                                   command, change, message):
    path = tmp_path / "model.json"
    path.write_text(change if isinstance(change, str) else json.dumps(
        {k: v for k, v in {**LLAMA3_8B_CONFIG, **change}.items() if v is not None}))
    code, err, launched, out = run_main(monkeypatch, capsys, command, "--model", str(path),
                                        *(["--gpus", "8"] if command == "plan" else []))
    assert not launched and not out and code == 2 and err.count("\n") == 1 and f"error: --model {path}: {message}" in err, err


def test_a_size_at_its_bound_is_planned_in_closed_form(monkeypatch, capsys):
    """10,000 layers (MAX_LAYERS): 20,000 took 34 s, flops_per_token listing every layer's parameters; now a
    layer's parameters x layers (test_flops_per_token_count_the_model_but_its_embedding: the same count)."""
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8", "--layers", "10000")
    assert code == 1 and out.startswith("llama3-8b does not fit on 8 GPUs of 80 GiB: the leanest of "), out


def test_a_model_or_mesh_of_one_is_said_in_the_singular(monkeypatch, capsys):
    """ "1 GPUs", "1 meshes pass validate" once."""
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "tiny", "--gpus", "1")
    assert code == 0 and "; 1 GPU of 80 GiB (h100-sxm)" in out and "\n1 mesh passes validate, 1 fits; the" in out
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "tiny", "--gpus", "1", "--moe")
    assert code == 0 and "\n1 mesh passes validate, 1 fits without its activations; the fastest:" in out
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-405b", "--gpus", "1")
    assert code == 1 and out.startswith("llama3-405b does not fit on 1 GPU of 80 GiB: the leanest of 1 valid mesh (")
    code, _, err = plan_main(monkeypatch, capsys, "--model", "tiny", "--gpus", "1", "--microbatches", "7")
    assert code == 2 and err.startswith("09_full_train.py plan: error: no mesh of 1 GPU passes validate: "), err


@pytest.mark.parametrize("argv, heads", [
    (["--model", "tiny", "--heads", "8"], (8, 8)),  # tiny has no grouping (4 / 4): none is made up (8 / 4)
    (["--model", "llama3-8b", "--heads", "64"], (64, 8)),  # its grouping's K/V heads stay
    (["--model", "tiny", "--heads", "8", "--kv-heads", "2"], (8, 2)),
])
def test_heads_alone_keep_a_presets_grouping_or_its_absence(argv, heads):
    cfg = full_train.configure(parse_options("plan", *argv)).cfg
    assert (cfg.n_heads, cfg.n_kv_heads) == heads


@pytest.mark.parametrize("mesh, communicators", [
    (dict(), 1),  # the world's
    (dict(dp=2), 2),  # + dp x cp's
    (dict(cp=2), 3),  # + cp's and dp x cp's: build_mesh makes both, the same two ranks
    (dict(pp=2, tp=2), 3),  # + pp's and tp's
    (dict(dp=2, cp=2, ep=2), 5),  # + cp's, dp x cp's, and the experts' two (their all-to-all's, their dp)
])
def test_nccls_buffers_are_one_allowance_a_communicator(mesh, communicators):
    """plan's cuda_nccl: CUDA's context and cuBLAS (0.5 GiB) and 0.3 GiB of NCCL's buffers for each
    communicator a rank uses (a group of more than one rank that carries traffic), counted by hand."""
    options = [f"--{d}={n}" for d, n in mesh.items()] + ["--moe"] * ("ep" in mesh)
    args = parse_options("plan", "--model", "check", *options)
    job = full_train.configure(args)
    cfg = job.cfg
    train = dataclasses.replace(job.train, microbatches=1)  # plan's: per mesh
    sizes = full_train.MeshSizes(**mesh)
    full_train.validate(cfg, sizes, train, sizes.world)
    for rank in full_train.plan(cfg, sizes, train):
        assert rank.memory["cuda_nccl"] == 2 ** 30 * (Fraction(1, 2) + Fraction(3, 10) * communicators)


def test_the_loss_reads_a_padded_vocabulary_shard():
    """The vocab-parallel loss's bytes over a rank's logits, forward and backward (bf16: 50 and 22 a logit,
    and 34 an id of the rank's slice in forward): vocab_shard pads the vocabulary to a multiple of tp, so
    1,001 ids over tp = 2 are 501 a rank, as 1,002 are (rounded down: 500). By hand: 1,002 ids cost 500
    ids a rank more than 2 ids (1 a rank): forward (50 x 10 tokens + 34) x 500, backward 22 x 10 x 500."""
    cfg = foundation.ModelConfig(vocab_size=2, dim=8, n_heads=2, ffn_dim=16)
    one, uneven, even = (full_train.elementwise_bytes(dataclasses.replace(cfg, vocab_size=v), 10, 2, False,
                                                      layers=0, embed=False, head=True) for v in (2, 1001, 1002))
    assert uneven == even and [b - a for a, b in zip(one, even)] == [(50 * 10 + 34) * 500, 22 * 10 * 500]


class OutsideBlocks(ElementwiseBytes):
    """ElementwiseBytes, paused while a ring block computes (07's kernel on a GPU: priced as attention)."""
    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclasses.dataclass
class PausingWork(full_train.context_parallel.BlockWork):
    """05's BlockWork that pauses a counter around each block."""
    counter: OutsideBlocks | None = None

    def timed(self, fn, q, k, *args):
        self.counter.paused = True
        try:
            return fn(q, k, *args)
        finally:
            self.counter.paused = False


def ring_merges_counted(shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """On each rank of a cp group: the bytes 05's zigzag ring moves outside its blocks, forward and
    backward, for each (batch, heads, kv_heads, seq_len, head_dim), bf16."""
    counts = []
    for batch, heads, kv_heads, seq_len, head_dim in shapes:
        s = seq_len // torch.distributed.get_world_size()
        q, k, v = (torch.randn(batch, n, s, head_dim, dtype=torch.bfloat16, requires_grad=True)
                   for n in (heads, kv_heads, kv_heads))
        passes = [OutsideBlocks(), OutsideBlocks()]
        work = PausingWork(counter=passes[0])
        with passes[0]:
            out, _ = full_train.context_parallel.ring_attention(q, k, v, work=work)
        work.counter = passes[1]  # the ring's backward times its blocks with the forward's BlockWork
        with passes[1]:
            out.backward(torch.randn_like(out))
        counts.append([p.bytes for p in passes])
    return counts


def loss_bytes_counted(vocab_parallel: bool, chunks: int, dtype: torch.dtype) -> list[float]:
    """On one rank: what the loss's eager operations move, by a dispatch mode, a logit of (tokens, 4,096)
    logits (forward, backward: the difference between 128 and 64 tokens over 64 x 4,096), then the rest
    an id of the vocabulary (forward, backward)."""
    vocab = 4096
    loss_fn = foundation.cross_entropy_loss
    if vocab_parallel:
        loss_fn = full_train.tensor_parallel.VocabParallelLoss(0, vocab, torch.distributed.group.WORLD)
    if chunks > 1:
        loss_fn = full_train.tensor_parallel.ChunkedLoss(loss_fn, chunks)
    counts = []
    for tokens in (64, 128):
        logits = torch.randn(1, tokens, vocab, dtype=dtype, requires_grad=True)
        passes = [ElementwiseBytes(), ElementwiseBytes()]
        with passes[0]:
            loss = loss_fn(logits, torch.randint(0, vocab, (1, tokens)))
        with passes[1]:
            loss.backward()
        counts.append([p.bytes for p in passes])
    per_logit = [(counts[1][i] - counts[0][i]) / (64 * vocab) for i in (0, 1)]
    return per_logit + [(counts[0][i] - per_logit[i] * 64 * vocab) / vocab for i in (0, 1)]


@pytest.mark.parametrize("cp", [2, 3])
def test_the_rings_merges_move_the_bytes_a_dispatch_mode_counts(rank_pool, cp):
    """ring_merge_bytes: what 05's ring does outside its blocks, eager (merging fp32 partial outputs and
    float64 log-sum-exps, stacking and passing K/V, accumulating dQ and dK/dV in fp32), on each rank, at 2
    and 3 ranks, for grouped and plain heads and two head sizes."""
    seq_len = 256 * cp  # chunks of 128 tokens: each tensor counted holds over 1,000 elements
    shapes = [(1, 8, 2, seq_len, 64), (1, 8, 8, seq_len, 32), (2, 16, 4, seq_len, 64)]
    for rank_counts in rank_pool.run(cp, ring_merges_counted, shapes):
        for (batch, heads, kv_heads, seq_len, head_dim), counted in zip(shapes, rank_counts):
            formula = full_train.ring_merge_bytes(batch * seq_len // cp, heads, kv_heads, head_dim, cp)
            assert counted == list(formula), (cp, heads, kv_heads, head_dim)


def test_the_losses_eager_bytes_are_what_a_dispatch_mode_counts(rank_pool):
    """elementwise_bytes' loss: LOSS_BYTES a logit, for 01's cross-entropy and 03's vocab-parallel one, whole
    or in 4 slices, on bf16 and fp32 logits; VOCAB_SLICE_BYTES an id a call of the vocab-parallel one (its
    ids and masks), in forward. Per-token numbers (the max, the sum, the target's logit) are not counted."""
    for (vocab_parallel, chunked), by_bytes in full_train.LOSS_BYTES.items():
        for elem_bytes, (forward, backward) in by_bytes.items():
            dtype = {2: torch.bfloat16, 4: torch.float32}[elem_bytes]
            counted = rank_pool.run(1, loss_bytes_counted, vocab_parallel, 4 if chunked else 1, dtype)[0]
            slices = 4 if chunked else 1
            assert counted == [forward, backward, vocab_parallel * full_train.VOCAB_SLICE_BYTES * slices, 0]


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "llama-9b", "--gpus", "8"], "--model 'llama-9b' is neither a preset ("),
    (["plan", "--model", "nothing.json", "--gpus", "8"], "--model nothing.json: [Errno 2] No such file"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--fp8"], "--fp8: the a100-80gb has no FP8"),
    (["plan", "--model", "llama3-8b", "--dp", "4", "--pp", "1", "--cp", "1", "--tp", "2", "--recompute", "op"],
     "recompute op reruns a block but its matmuls' and attention's outputs: at --tp 2, --cp 1"),
    (["check", "--pp", "2", "--tp", "1", "--schedule", "zb-h1", "--recompute", "op"],  # torch raised at backward
     "recompute op keeps its matmuls' outputs for one backward (torch's selective checkpoint), and zb-h1's"),
    (["check", "--attention", "cudnn"], "--attention cudnn is plan's price of SDPA's cuDNN backend"),
    (["train", "--attention", "unfused"], "--attention unfused is plan's price of PyTorch's eager attention"),
    (["check", "--attention-dropout", "0.1"], "--attention-dropout is plan's price of Megatron's dropout of the "
                                              "attention probabilities: 01's model has no dropout"),
    (["plan", "--model", "llama3-8b", "--dp", "8", "--pp", "1", "--cp", "1", "--tp", "1", "--attention-dropout",
      "0.1"], "--attention-dropout 0.1 is priced for --attention unfused, whose kernels write the probabilities: "
              "--attention sdpa draws its mask inside"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--attention", "flash", "--attention-dropout", "0.1"],
     "error: --attention-dropout 0.1 is priced for --attention unfused"),  # before the search: no mesh named
    (["plan", "--model", "llama3-8b", "--dp", "4", "--pp", "1", "--cp", "2", "--tp", "1", "--attention", "unfused",
      "--seq-len", "8192", "--attention-dropout", "0.1"], "is priced for unfused attention at --cp 1: at --cp 2 09 "
                                                         "runs 07's kernel in 05's ring"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--attention", "unfused", "--attention-dropout", "1.5"],
     "--attention-dropout must be <= 1, not 1.5"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--attention", "unfused", "--attention-dropout", "nan"],
     "--attention-dropout must be >= 0, not nan"),  # NaN breaks every rule
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--attention", "unfused", "--attention-dropout", "-0.1"],
     "--attention-dropout must be >= 0, not -0.1"),
    (["train", "--recompute", "whole"], "--recompute whole is plan's price of a reentrant checkpoint (Megatron's): "
                                        "train and check run full, which keeps the same tensors"),
    (["check", "--recompute", "whole"], "--recompute whole is plan's price of a reentrant checkpoint"),
    (["train", "--no-sample", "--prompt", "hi", "--temperature", "3"],  # accepted, then no sample (helper-48)
     "--no-sample leaves --prompt, --temperature unread: drop them or --no-sample"),
    (["train", "--no-save", "--keep", "5", "--sample-bytes", "50"], "--no-save leaves --keep, --sample-bytes unread"),
    (["train", "--no-save", "--top-k", "1", "--no-sample"], "--no-save leaves --top-k unread: drop it or --no-save"),
    (["train", "--seed", "100000000000000000000000"], "--seed must be <= 4294967295, not 1000000"),  # a rank's
    (["train", "--seed", "-1"], "--seed must be >= 0, not -1"),
    (["train", "--data", "/dev/null"], "--data /dev/null: not a regular file"),  # it said "no such file"
    (["train", "--profile", "5", "--steps", "4"], "--profile 5 needs --steps >= 7 (the first two compile and "
                                                  "measure), not 4"),  # it profiled 2, saying nothing  # traceback ("Overflow when unpacking long long")
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--recompute", "whole", "--fp8"],
     "error: --recompute whole is priced for dense layers without FP8: its rerun's FP8 amaxes have no formula"),
    (["plan", "--model", "llama3-8b", "--dp", "8", "--pp", "1", "--cp", "1", "--tp", "1", "--recompute", "whole",
      "--moe"], "error: --recompute whole is priced for dense layers without FP8: its rerun's MoE all-to-alls"),
    (["train", "--model", "llama3-8b", "--no-save", "--vocab", "200"], "train reads bytes: a vocabulary of 200"),
    (["train", "--model", "llama3-8b"], "the sample decodes bytes: a vocabulary of 128256 is not 256"),
    (["train", "--model", "tiny", "--heads", "3"], "--dim 128 is not divisible by --heads 3"),
    (["train", "--resume", "--no-save"], "--resume reads the checkpoint folder that --no-save turns off: drop --no-save"),
    (["check", "--ep", "2"], "--ep 2 is an option of an MoE model: add --moe"),  # it once made the model an MoE
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--pp", "8", "--virtual", "4", "--schedule", "interleaved",
      "--ends-as-layers"], "ends_as_layers: the embedding and the head take a layer's place, and n_layers + 2 = 34 "
                           "places cannot give the first and last of 32 stages a layer"),
    (["check", "--bf16-optimizer"], "--bf16-optimizer keeps AdamW's state in the bf16 of mixed precision: add "
                                    "--bf16"),  # check runs fp32 unless told
    (["check", "--fp32-grads"], "--fp32-grads adds mixed precision's bf16 gradients into fp32: add --bf16"),
    (["plan", "--model", "llama3-8b", "--dp", "8", "--pp", "1", "--cp", "1", "--tp", "1", "--zero", "3",
      "--fp32-grads"], "--fp32-grads keeps ZeRO's whole gradient buffer in fp32, which --zero 3 does not keep: "
                       "use --zero 0 or 1"),
    (["plan", "--model", "llama3-8b", "--experts", "8"], "--experts 8 is an option of an MoE model: add --moe"),
    (["plan", "--model", "llama3-8b", "--gpus", "32", "--pp", "64"], "the sizes given multiply to 64, which does not "
                                                                     "divide --gpus 32"),
    (["plan", "--model", "llama3-8b", "--gpus", "64", "--dp", "3"], "the sizes given multiply to 3, which does not "
                                                                    "divide --gpus 64"),  # said: "no mesh of them"
    (["plan", "--model", "llama3-8b", "--gpus", "64", "--gpus-per-node", "3"],  # it planned 21 1/3 nodes
     "64 GPUs are not whole nodes of --gpus-per-node 3 (21 nodes and 1 GPU)"),
    (["plan", "--model", "llama3-8b", "--dp", "3", "--pp", "1", "--cp", "1", "--tp", "4"],
     "12 GPUs are not whole nodes of --gpus-per-node 8 (1 node and 4 GPUs)"),
    (["check", "--moe", "--experts", "3", "--ep", "2"], "invalid configuration: --experts 3 is not divisible by --ep 2"),
    (["plan", "--model", "llama3-8b", "--gpus", "16", "--tp", "16"],
     "--tp 16 does not divide --gpus-per-node 8: a tp group stays in one node"),
    (["plan", "--model", "llama3-8b", "--gpus", "16", "--dp", "1", "--pp", "1", "--cp", "1"],  # tp left: 16
     "--tp 16 does not divide --gpus-per-node 8: a tp group stays in one node"),
    (["plan", "--model", "llama3-8b", "--gpus", "128", "--pp", "64", "--tp", "2", "--seq-len", "4095",
      "--sequence-parallel"],  # validate's list, one line
     "--dp 1 --pp 64 --cp 1 --tp 2: invalid configuration: --layers 32 cannot fill pp x virtual = 64 x 1 = 64 stages: "
     "every stage needs at least one layer; "),
])
def test_model_and_gpu_refusals_are_one_line_exit_2(monkeypatch, capsys, argv, message):
    code, err, launched, out = run_main(monkeypatch, capsys, *argv)
    assert (code, launched, out) == (2, [], "") and err.count("\n") == 1 and message in err, err


def test_a_tied_config_plans_and_train_refuses_it_in_one_line(monkeypatch, capsys, tmp_path):
    path = tmp_path / "tied.json"
    path.write_text(json.dumps(dict(LLAMA3_8B_CONFIG, tie_word_embeddings=True)))
    assert plan_main(monkeypatch, capsys, "--model", str(path), "--gpus", "8")[0] == 0
    for command in ("train", "check"):
        code, err, launched, _ = run_main(monkeypatch, capsys, command, "--model", str(path))
        assert code == 2 and not launched and "ties its LM head to the embedding: 09 trains them apart" in err


def test_the_headers_name_what_adamw_updates(monkeypatch, capsys):
    """check's, train's and plan's headers share precision_name: fp32 (check and train on a CPU), bf16 with
    fp32 masters, or with --bf16-optimizer 02's BF16 AdamW."""
    assert full_train.precision_name(full_train.TrainConfig()) == "fp32"
    for extra, name in (((), "bf16 + fp32 masters"), (("--bf16-optimizer",), "bf16 + BF16 AdamW"),
                        (("--fp32-grads",), "bf16 + fp32 masters + fp32 gradients")):
        code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8", *extra)
        assert code == 0 and f"), {name}; batch 512 x 8,192 tokens" in out.splitlines()[0], out


def test_json_is_one_object_with_the_text_reports_numbers(monkeypatch, capsys):
    """--json: the run's settings that plan prices, the mesh, each part of the step, memory per part and
    pipeline rank, bytes per group, as the text report prints them (rounded there); the search: the
    fastest meshes that fit, in order."""
    options = "--model llama3-70b --dp 4 --pp 4 --cp 1 --tp 8 --sequence-parallel --recompute full".split()
    _, text, _ = plan_main(monkeypatch, capsys, *options)
    code, out, err = plan_main(monkeypatch, capsys, *options, "--json")
    plan = json.loads(out)
    assert code == 0 and not err and out.count("\n") == 1 and len(plan["meshes"]) == 1
    mesh = plan["meshes"][0]
    assert plan.keys() >= {"model", "config", "train", "gpus", "cluster", "valid", "fitting", "fits", "meshes"}
    assert (plan["train"]["seq_len"], plan["train"]["recompute"], plan["train"]["fp8"]) == (8192, "full", False)
    assert "lr" not in plan["train"] and "Infinity" not in out and "NaN" not in out  # strict JSON
    assert mesh["mesh"] == dict(dp=4, pp=4, cp=1, tp=8, ep=1) and set(mesh["parts_s"]) == set(full_train.PARTS)
    assert list(mesh["memory_gib"][0]) == ["params", "grads", "optimizer", "activations", "temporaries",
                                           "fragmentation", "cuda_nccl", "total"]
    assert f"step {mesh['step_s']:.3g} s predicted" in text and f"MFU {mesh['mfu']:.0%}" in text
    for part, seconds in mesh["parts_s"].items():
        assert f"{part} {seconds:.3g}" in text, part
    for rank, memory in enumerate(mesh["memory_gib"]):
        row = re.search(rf"\n  pp {rank} (.*)", text)[1].split()[:len(memory)]
        assert row == [f"{x:,.1f}" if x >= 1 else f"{x:.2g}" for x in memory.values()], (rank, row)
    for group, sent in mesh["sent_gb"].items():
        assert f"{group} {full_train.number_text(sent['gb'])} GB ({sent['link']})" in text
    assert plan["fits"] == ("\nfits: " in text) and (plan["why_not_fitting"] is None) == plan["fits"]
    searched = json.loads(plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "64", "--json")[1])
    steps = [m["step_s"] for m in searched["meshes"]]
    assert len(steps) == full_train.TOP_MESHES and steps == sorted(steps) and searched["fits"]


def test_the_gpu_presets_are_the_clusters_and_h100_sxm_is_its_default():
    """Every preset prices a plan; Cluster()'s defaults are h100-sxm's; an A100 has no FP8; a power limit
    under the TDP slows compute-bound kernels in proportion (the Grand Teton H100 at 500 of 700 W)."""
    assert full_train.Cluster() == full_train.Cluster(**dict(zip(full_train.GPU_FIELDS, full_train.GPUS["h100-sxm"])))
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200"} <= full_train.GPUS.keys()
    for name, numbers in full_train.GPUS.items():
        cluster = full_train.Cluster(**dict(zip(full_train.GPU_FIELDS, numbers)))
        speed, speed8 = cluster.speed
        assert speed == pytest.approx(cluster.peak_tflops / 989 * min(1, cluster.power_limit / cluster.tdp))
        assert (math.isnan(speed8)) == name.startswith("a100")
    assert full_train.Cluster(**dict(zip(full_train.GPU_FIELDS, full_train.GPUS["h100-96gb"]))).speed[0] == 500 / 700
    assert full_train.Cluster(power_limit=1000).speed == (1.0, 1.0)  # above its TDP a GPU runs no faster


def test_a_gpu_without_fp8_says_so_in_the_plans_header(monkeypatch, capsys):
    """An A100's plan names no FP8 rate (its speed[1] is NaN, which the header once printed), and says
    its GEMM and attention rates are the H100's scaled, not measured on it; the H100 SXM's are measured."""
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb")
    assert code == 0 and "(no FP8; the a100-80gb's datasheet peaks" in out.splitlines()[1] and "nan" not in out
    assert "not measured on it" in out.splitlines()[1]
    code, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8")
    assert code == 0 and "H100 rates x 1 (FP8 x 1), the rest" in out.splitlines()[1]


@pytest.mark.parametrize("lean_saves", [True, False])
@pytest.mark.parametrize("dims", [(256, 4, 2, 512), (512, 8, 8, 768), (384, 6, 3, 256), (512, 4, 1, 512)])
def test_an_eager_layers_elementwise_bytes_are_what_a_dispatch_mode_counts(dims, lean_saves):
    """elementwise_bytes(fused=False): 01's layer in bf16, each operator a kernel (norms and RoPE in fp32),
    its weights trained (the norms' gradients), as 09 builds it: with 03's lean saves (a review found the
    count taken without them and with frozen weights: 16h a token less in backward, and lean's 4f more)."""
    dim, heads, kv_heads, ffn = dims
    cfg = foundation.ModelConfig(vocab_size=64, dim=dim, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, n_layers=1)
    model = foundation.GPT(cfg)
    if lean_saves:
        full_train.tensor_parallel.apply_lean_saves(model)
    block, tokens = model.layers["0"].to(torch.bfloat16), 64
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True) * 1
    cos, sin = foundation.rope_angles(torch.arange(tokens), cfg.head_dim, cfg.rope_theta)
    counted = [ElementwiseBytes(), ElementwiseBytes()]
    with counted[0]:
        y = block(x, cos, sin)
    with counted[1]:
        y.backward(torch.randn_like(y))
    formula = full_train.elementwise_bytes(cfg, tokens, 1, False, layers=1, embed=False, head=False, fused=False,
                                           lean_saves=lean_saves)
    assert [c.bytes for c in counted] == list(formula)


def test_an_eager_plan_prices_the_layer_its_saves_make():
    """--eager prices the bytes its layer moves (the test above): with 03's lean saves (the default) or
    --autograd-saves. torchtitan's eager 8B (one microbatch of 2 x 8,192 tokens a rank, 32 layers): its
    backward's elementwise bytes differ by 16h - 4f a token and layer (the norms' weight gradients, less
    SwiGLU's silu recomputed), at the HBM's bandwidth; nothing else in the part moves."""
    cfg, sizes, run, cluster = published_run("torchtitan 8B, eager")
    elementwise = {}
    for lean_saves in (True, False):
        saves = dataclasses.replace(run, lean_saves=lean_saves, microbatches=1)
        elementwise[lean_saves] = full_train.planned(cfg, sizes, saves, cluster)[3]["parts"]["elementwise"]
    tokens = 16 // 8 * 8192
    per_token = 16 * 4096 - 4 * 14336
    assert not run.compile and elementwise[False] - elementwise[True] == pytest.approx(
        32 * tokens * per_token / (cluster.hbm_tbps * 1e12), rel=1e-9)


def test_the_mlps_backward_holds_what_mlp_backward_bytes_says():
    from test_03_tensor_parallel import LiveStorages
    for dim, ffn in ((64, 96), (64, 200), (64, 64)):
        mlp = foundation.SwiGLU(foundation.ModelConfig(dim=dim, ffn_dim=ffn)).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(2, 32, dim, dtype=torch.bfloat16, requires_grad=True)
        y = mlp(x * 1)
        with LiveStorages() as made:
            torch.autograd.grad(y, x, torch.randn_like(y))
        assert made.peak == full_train.mlp_backward_bytes(64, dim, ffn, 2)
