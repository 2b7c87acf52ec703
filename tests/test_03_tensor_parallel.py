"""Lesson 03 as a specification: tensor parallelism (with vocab-parallel embedding and loss,
sequence parallelism and grouped-query attention) computes what one device computes, and moves
exactly the bytes of the Megatron formula.

Tolerances (fp32 on CPU), the same as lesson 01's, for the same reasons; measured over the 15 ci
examples of the main test:
- loss per step: atol 1e-5; measured <= 9.5e-7 (the same sums split over ranks, losses of ~4);
- step-0 gradients: atol 1e-6 + rtol 1e-4; measured <= 2.9e-7 absolute: the partial sums of the
  row-parallel linears, of the vocabulary in the loss and of the norms' gradients are added in
  another order. A real bug (a missing f, a norm gradient not summed over the sequence shards,
  padding leaking into the softmax) is off by a whole rank's share of a gradient, >= 25%;
- parameters after 3 AdamW steps (eps 1e-6, see test_01_ddp.py): atol 1e-5; measured <= 1.2e-6.
- operators and the vocab-parallel loss: fp64, atol 1e-12 (sums of a few numbers).
- lean saves (apply_lean_saves) against autograd's: the same tolerances. The norm's backward is its
  closed form, r (g - x r mean(g x r)), where autograd differentiates each operation: fp32 rounding,
  measured <= 3e-8 on gradients; the SwiGLU's runs autograd's own kernels, bitwise.
- activation recompute: none. It runs the same kernels on the same inputs a second time, so loss and
  every gradient (parameters after two ZeRO-3 steps) are bitwise equal to no recompute on the CPU;
  a tolerance would only hide a recompute that reads the wrong input. Saved bytes = formula exactly.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import importlib
import itertools
import os
import re
import unittest.mock
import weakref
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import run_script
from test_01_ddp import ADAM_EPS, GRAD_ATOL, PARAM_ATOL, assert_matches_reference

foundation = importlib.import_module("01_ddp")
tensor_parallel = importlib.import_module("03_tensor_parallel")
zero = importlib.import_module("02_zero")
context_parallel = importlib.import_module("05_context_parallel")
expert_parallel = importlib.import_module("06_expert_parallel")


# --- the whole model equals one device ----------------------------------------------------------

@st.composite
def tp_configs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    n_kv_heads = tp * draw(st.integers(1, 2))
    n_heads = n_kv_heads * draw(st.sampled_from([1, 2]))  # 2: grouped-query attention
    head_dim = draw(st.sampled_from([2, 4]))
    cfg = foundation.ModelConfig(vocab_size=draw(st.sampled_from([3, 16, 17, 50, 64])),  # 3 < tp = 4
                                 dim=n_heads * head_dim, n_layers=draw(st.integers(1, 2)), n_heads=n_heads,
                                 n_kv_heads=n_kv_heads, ffn_dim=tp * draw(st.integers(1, 6)),
                                 seed=draw(st.integers(0, 99)))
    sequence_parallel = draw(st.booleans())
    seq_len = tp * draw(st.integers(1, 3)) if sequence_parallel else draw(st.integers(1, 9))
    return tp, cfg, sequence_parallel, seq_len


def lean_or_autograd(model, lean: bool):
    return tensor_parallel.apply_lean_saves(model) if lean else model


def loss_in_slices(model, chunks: int):
    """Lesson 09's --loss-chunks on the split model: its loss (vocab-parallel or not) in `chunks` slices."""
    if chunks > 1:
        model.loss_fn = tensor_parallel.ChunkedLoss(model.loss_fn, chunks)
    return model


@given(setup=tp_configs(), batch=st.integers(1, 3), lean=st.booleans(), regather=st.booleans(),
       split_batch=st.booleans(), loss_chunks=st.sampled_from([1, 2, 64]))
@example(setup=(4, foundation.ModelConfig(vocab_size=3, dim=16, n_heads=4, ffn_dim=8), True, 4), batch=2,  # V < tp
         lean=True, regather=True, split_batch=False, loss_chunks=1)
@example(setup=(2, foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8), True, 2), batch=2,
         lean=False, regather=True, split_batch=True, loss_chunks=64)  # more slices than a microbatch's tokens
def test_tensor_parallel_equals_single_device(rank_pool, setup, batch, lean, regather, split_batch, loss_chunks):
    """Also with lean saves, under SP with each region's linears keeping their input's sequence shard
    (regather) or the gathered input, in microbatches (split_batch: one a sequence) and with the loss in
    slices (LossInChunks: at most one a token of a microbatch, each 3 all-reduces over tp)."""
    tp, cfg, sequence_parallel, seq_len = setup
    steps = 3
    microbatches = batch if split_batch else 1
    transform = functools.partial(lean_or_autograd, lean=lean)
    runs = rank_pool.run(tp, tensor_parallel.train_tensor_parallel, cfg, steps, batch, seq_len,
                         sequence_parallel=sequence_parallel, regather=regather, adam_eps=ADAM_EPS,
                         microbatches=microbatches, transform=transform,
                         after=functools.partial(loss_in_slices, chunks=loss_chunks))
    reference = foundation.train_single_device(cfg, steps, batch, seq_len, adam_eps=ADAM_EPS)
    result = runs[0][0]
    assert_matches_reference(result, reference)
    for rank, (other, _) in enumerate(runs[1:], start=1):
        assert other.losses == result.losses, f"rank {rank} computed another loss"
        for name, param in result.params.items():
            assert torch.equal(other.params[name], param), f"rank {rank} disagrees on {name}"

    # Communication in the training steps (forward + backward, every layer, the embedding, the LM
    # head's input and the loss), per rank: calls and payload per the formula, ring traffic. At
    # tp = 1 there is nothing to communicate: no collective at all.
    formula = {}
    if tp > 1:
        formula = tensor_parallel.comm_formula(cfg, batch, seq_len, sequence_parallel, regather=regather,
                                               microbatches=microbatches, loss_chunks=loss_chunks)
    share = {"all_reduce": Fraction(2 * (tp - 1), tp), "all_gather": Fraction(tp - 1, tp),
             "reduce_scatter": Fraction(tp - 1, tp)}
    for _, meter in runs:
        assert {op for op, _ in meter.stats} == set(formula), "no other collective"
        for op, (calls, payload) in formula.items():
            assert (meter.calls(op), meter.payload(op)) == (steps * calls, steps * payload), op
            assert meter.traffic(op) == share[op] * steps * payload


def freeze_some(model):
    """A frozen replicated weight (a norm) and frozen sharded ones: both of the MLP's projections of one
    input (with SP, 03's backward operator returns an empty gradient for each: two, which may not alias)."""
    model.layers["0"].attn_norm.weight.requires_grad_(False)
    model.layers["0"].mlp.gate_proj.weight.requires_grad_(False)
    model.layers["0"].mlp.up_proj.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_frozen_parameters_stay_frozen_and_the_rest_trains_as_on_one_device(rank_pool,
                                                                            sequence_parallel):
    cfg = foundation.ModelConfig(vocab_size=19, dim=16, n_heads=2, ffn_dim=16)
    runs = rank_pool.run(2, tensor_parallel.train_tensor_parallel, cfg, 2, 2, 4, adam_eps=ADAM_EPS,
                         sequence_parallel=sequence_parallel, transform=freeze_some)
    # foundation.train_single_device copies every .grad, so the reference loop is spelled out here.
    model = freeze_some(foundation.GPT(cfg))
    optimizer = foundation.make_optimizer(model, 1e-3, ADAM_EPS)
    reference = foundation.TrainResult([], {}, {})
    for step in range(2):
        loss = model(*foundation.synthetic_batch(cfg, 2, 4, step))
        loss.backward()
        reference.losses.append(loss.item())
        if step == 0:
            reference.first_grads = foundation.cpu_copy((n, p.grad) for n, p in model.named_parameters()
                                                        if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    reference.params = foundation.cpu_copy(model.named_parameters())
    assert len(reference.first_grads) == len(reference.params) - 3
    assert_matches_reference(runs[0][0], reference)
    initial = foundation.GPT(cfg)
    for name in ("layers.0.attn_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"):
        assert torch.equal(runs[0][0].params[name], initial.get_parameter(name)), name


class AnotherLinear(torch.nn.Linear):
    """A linear of another kind, the same maths (as a LoRA adapter, or one that 08's convert_to_float8
    skips, would be among FP8 ones)."""


def k_of_another_kind(model):
    """Every block's k_proj an AnotherLinear, then lean saves: the attention region's linears are of two
    kinds, which 03's project hands each to its own linear (SP's shard gathered first, by GatherSequence)."""
    for block in model.layers.values():
        block.attn.k_proj.__class__ = AnotherLinear
    return tensor_parallel.apply_lean_saves(model)


def train_counting_projections(*args, **kwargs) -> tuple:
    """train_tensor_parallel's result and meter, and how many regions went through Projections."""
    apply = unittest.mock.Mock(wraps=tensor_parallel.Projections.apply)
    with unittest.mock.patch.object(tensor_parallel.Projections, "apply", apply):
        result, meter = tensor_parallel.train_tensor_parallel(*args, **kwargs)
    return result, meter, apply.call_count


def test_a_region_of_two_linear_kinds_trains_as_on_one_device(rank_pool):
    """project's other path, under SP (where the linears gather their input): q, k, v of two kinds go
    each to its own linear, on the whole input (SP's shard gathered by GatherSequence, whose backward
    reduce-scatters its gradient), and only the MLP's region goes through Projections, once a layer and
    step."""
    cfg = foundation.ModelConfig(vocab_size=19, dim=16, n_heads=2, ffn_dim=16)
    steps = 2
    runs = rank_pool.run(2, train_counting_projections, cfg, steps, 2, 4, adam_eps=ADAM_EPS,
                         sequence_parallel=True, transform=k_of_another_kind)
    reference = foundation.train_single_device(cfg, steps, 2, 4, adam_eps=ADAM_EPS)
    for result, _, projections in runs:
        assert projections == steps * cfg.n_layers
        assert_matches_reference(result, reference)


def empty_batch_step(cfg, sequence_parallel: bool, split: bool) -> tuple:
    """A batch of no sequences through the lean GPT (split: over the group, SP or not): its logits' shape
    (split, the vocabulary's shard), whether its loss is NaN (a mean of nothing), and after backward the
    largest |gradient| of any parameter (None if one got no gradient)."""
    tokens, targets = foundation.synthetic_batch(cfg, 2, 4, step=0)
    model = tensor_parallel.apply_lean_saves(foundation.GPT(cfg))
    if split:
        model = tensor_parallel.apply_tensor_parallel(model, None, sequence_parallel)
    shape = tuple(model(tokens[:0]).shape)
    loss = model(tokens[:0], targets[:0])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    largest = None if any(g is None for g in grads) else max(g.abs().max().item() for g in grads)
    return shape, loss.isnan().item(), largest


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_batch_of_no_sequences_steps_as_on_one_device(rank_pool, sequence_parallel):
    """A batch of no sequences (under SP, project's other path: Projections' backward would view its rows
    as a matrix, which raised): one device's logits have no rows, its loss is NaN and every gradient is
    zero; so on every rank, with the rank's shard of the vocabulary (19 padded to 2 x 10)."""
    cfg = foundation.ModelConfig(vocab_size=19, dim=16, n_heads=2, ffn_dim=16)
    assert empty_batch_step(cfg, sequence_parallel, split=False) == ((0, 4, cfg.vocab_size), True, 0.0)
    for shape, nan, largest in rank_pool.run(2, empty_batch_step, cfg, sequence_parallel, True):
        assert (shape, nan, largest) == ((0, 4, 10), True, 0.0)


def tie_embedding(model):
    """GPT-2's and Llama 3.2's tie: the LM head is the embedding."""
    model.lm_head.weight = model.embed.weight
    return model


def tie_after_tensor_parallelism(cfg, sequence_parallel):
    model = tensor_parallel.apply_tensor_parallel(tie_embedding(foundation.GPT(cfg)), None, sequence_parallel)
    return model.lm_head.weight is model.embed.weight, len(list(model.parameters()))


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, True), (3, False), (3, True)])
def test_a_tied_embedding_stays_tied_and_trains_as_on_one_device(rank_pool, tp, sequence_parallel):
    """Before: after apply_tensor_parallel the head and the embedding were two parameters (21 for
    20), each trained on its own use: 6.3e-3 off tied PyTorch's loss after 3 steps at tp = 3.
    The vocabulary 17 is padded at tp = 2 and 3: the padded row is shared too."""
    cfg = foundation.ModelConfig(vocab_size=17, dim=12, n_heads=6, ffn_dim=12, seed=4)
    for tied, n_params in rank_pool.run(tp, tie_after_tensor_parallelism, cfg, sequence_parallel):
        assert tied and n_params == len(list(tie_embedding(foundation.GPT(cfg)).parameters()))
    runs = rank_pool.run(tp, tensor_parallel.train_tensor_parallel, cfg, 3, 2, 6, adam_eps=ADAM_EPS,
                         sequence_parallel=sequence_parallel, transform=tie_embedding)
    reference = foundation.train_single_device(cfg, 3, 2, 6, adam_eps=ADAM_EPS, transform=tie_embedding)
    assert runs[0][0].params.keys() == reference.params.keys()
    assert_matches_reference(runs[0][0], reference)


def split_a_tie_two_ways(cfg, head_styles):
    plan = {**tensor_parallel.TENSOR_PARALLEL_PLAN, "lm_head": [getattr(tensor_parallel, s) for s in head_styles]}
    with foundation.comm_meter() as meter:
        try:
            tensor_parallel.apply_tensor_parallel(tie_embedding(foundation.GPT(cfg)), None, plan=plan)
        except ValueError as error:
            return str(error), meter.calls()
    return "no error", meter.calls()


@pytest.mark.parametrize("head_styles, how", [(["enter_region", "row_parallel"], "along dim 1"),
                                              ([], "not at all")])
def test_a_tie_split_two_ways_is_refused_before_any_collective(rank_pool, head_styles, how):
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8)
    for error, calls in rank_pool.run(2, split_a_tie_two_ways, cfg, head_styles):
        assert ("embed.weight and lm_head.weight are one tied parameter" in error
                and f"embed.weight along dim 0, lm_head.weight {how}" in error), error
        assert calls == 0, "refused before any collective"


def loss_and_gradients_with_plan(cfg, plan, tokens, targets):
    model = tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, plan=plan)
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: tensor_parallel.unshard(p.grad, like=p) for n, p in model.named_parameters()}


def test_a_plan_that_leaves_the_head_whole_takes_the_loss_of_whole_logits(rank_pool):
    """Before: the vocab-parallel loss was installed whatever the plan, so a replicated head's whole
    logits were read as a vocabulary slice: 3.2804 for one device's 2.7952, and no error."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8, seed=5)
    plan = {k: v for k, v in tensor_parallel.TENSOR_PARALLEL_PLAN.items() if k != "lm_head"}
    tokens, targets = foundation.synthetic_batch(cfg, 2, 6, 0)
    model = foundation.GPT(cfg)
    loss = model(tokens, targets)
    loss.backward()
    for tp_loss, grads in rank_pool.run(2, loss_and_gradients_with_plan, cfg, plan, tokens, targets):
        assert tp_loss == pytest.approx(loss.item(), abs=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=GRAD_ATOL, rtol=1e-4)


def parameters_after_rank_dependent_init(cfg):
    """Each rank's weights drawn apart (rank r adds r): apply_tensor_parallel must start every rank
    from rank 0's, as its docstring says (broadcast over the group first)."""
    model = foundation.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())
    model = tensor_parallel.apply_tensor_parallel(model, None)
    return {n: tensor_parallel.unshard(p) for n, p in model.named_parameters()}


def test_every_rank_starts_from_rank_zeros_weights(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8)
    reference = dict(foundation.GPT(cfg).named_parameters())
    for params in rank_pool.run(2, parameters_after_rank_dependent_init, cfg):
        for name, p in params.items():
            assert torch.equal(p, reference[name].detach()), name


def apply_refused(cfg, **options):
    with foundation.comm_meter() as meter:
        try:
            tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, **options)
        except ValueError as error:
            return str(error), meter.calls()
    return "no error", meter.calls()


def test_sizes_tp_cannot_split_are_refused_before_any_collective(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=16, dim=12, n_heads=3, n_kv_heads=3, ffn_dim=8)
    for error, calls in rank_pool.run(2, apply_refused, cfg):
        assert error == "n_heads=3 is not divisible by tp=2" and calls == 0


def test_sequence_parallelism_with_a_whole_head_is_refused_before_any_collective(rank_pool):
    """Under SP the final norm's output is a sequence shard: a head the plan leaves whole would read
    only it (before: torch's "Expected input batch_size (4) to match target batch_size (8)" in forward)."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8)
    plan = {k: v for k, v in tensor_parallel.TENSOR_PARALLEL_PLAN.items() if k != "lm_head"}
    for error, calls in rank_pool.run(2, apply_refused, cfg, sequence_parallel=True, plan=plan):
        assert error.startswith("sequence parallelism needs a plan that splits lm_head's rows") and calls == 0
    assert {error for error, _ in rank_pool.run(2, apply_refused, cfg, plan=plan)} == {"no error"}


class IdChecks(TorchDispatchMode):
    """Counts the minima and maxima taken of integer tensors: the forward's check of the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.min.default, torch.ops.aten.max.default) and not args[0].is_floating_point():
            self.calls += 1
        return func(*args, **(kwargs or {}))


def id_checks_in_a_forward(cfg, check_ids: bool) -> int:
    model = tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, check_ids=check_ids)
    with IdChecks() as checks:
        model(*foundation.synthetic_batch(cfg, 2, 4, 0))
    return checks.calls


def test_check_ids_false_leaves_the_ids_to_the_caller(rank_pool):
    """check_ids=False (lesson 09 checks on the CPU): no min and max of the ids, which cost a GPU a sync
    a step; by default the tokens' and the targets' (2 x 2)."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=2, ffn_dim=8)
    assert rank_pool.run(2, id_checks_in_a_forward, cfg, True) == [4, 4]
    assert rank_pool.run(2, id_checks_in_a_forward, cfg, False) == [0, 0]


def train_on_strided_subgroups(cfg, sequence_parallel):
    """4 ranks, two tensor-parallel groups {0, 2} and {1, 3}: nothing may assume the world group."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    return tensor_parallel.train_tensor_parallel(cfg, 2, 2, 4, sequence_parallel=sequence_parallel,
                                                 adam_eps=ADAM_EPS, group=groups[dist.get_rank() % 2])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_on_a_subgroup(rank_pool, sequence_parallel):
    cfg = foundation.ModelConfig(vocab_size=21, dim=16, n_heads=2, ffn_dim=16, seed=3)
    runs = rank_pool.run(4, train_on_strided_subgroups, cfg, sequence_parallel)
    reference = foundation.train_single_device(cfg, 2, 2, 4, adam_eps=ADAM_EPS)
    for rank, (result, meter) in enumerate(runs):
        assert_matches_reference(result, reference)
        assert {ranks for _, ranks in meter.stats} == {(0, 2) if rank % 2 == 0 else (1, 3)}


def test_formula_is_megatrons_four_all_reduces_per_layer():
    # Without the loss and embedding terms, the formula is 4 b s h per layer; with SP the same
    # volume as all-gathers + reduce-scatters (all-reduce = reduce-scatter + all-gather), and with
    # regather 2 all-gathers more (each region's input again in backward), of 1 B an element in FP8.
    b, s = 2, 8
    for layers in (1, 3):
        cfg = foundation.ModelConfig(n_layers=layers)
        bsh = b * s * cfg.dim * 4
        plain = tensor_parallel.comm_formula(cfg, b, s, False)["all_reduce"]
        assert plain == ((4 * layers + 2) + 3, (4 * layers + 2) * bsh + 3 * b * s * 4)
        sp = tensor_parallel.comm_formula(cfg, b, s, True, regather=False)
        assert sp["all_gather"] == sp["reduce_scatter"] == (4 * layers + 2, (4 * layers + 2) * bsh)
        regathered = tensor_parallel.comm_formula(cfg, b, s, True)["all_gather"]
        assert regathered == (6 * layers + 2, (6 * layers + 2) * bsh)
        fp8 = tensor_parallel.comm_formula(cfg, b, s, True, kept_input=(1, 4))["all_gather"]
        assert fp8 == (6 * layers + 2, (4 * layers + 2) * bsh + 2 * layers * bsh // 4)


def train_with_sharded_logits(cfg, batch, seq_len, sequence_parallel):
    """model(tokens) returns this rank's vocabulary slice of the logits."""
    model = tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, sequence_parallel)
    tokens, _ = foundation.synthetic_batch(cfg, batch, seq_len, 0)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_logits_are_split_by_vocabulary(rank_pool, sequence_parallel):
    cfg = foundation.ModelConfig(vocab_size=17, dim=16, n_heads=4, n_kv_heads=2, ffn_dim=16)
    shards = rank_pool.run(2, train_with_sharded_logits, cfg, 2, 6, sequence_parallel)
    tokens, _ = foundation.synthetic_batch(cfg, 2, 6, 0)
    with torch.no_grad():
        expected = foundation.GPT(cfg)(tokens)
    assert [s.shape[-1] for s in shards] == [9, 9], "17 padded to 18"
    torch.testing.assert_close(torch.cat(shards, -1)[..., :17], expected, atol=1e-6, rtol=0)


# --- each operator against its definition --------------------------------------------------------

def rank_tensor(rank: int, shape, salt: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank),
                       dtype=torch.float64)


def run_operators(shape):
    """Each operator on a rank-dependent input, with a rank-dependent upstream gradient."""
    rank, out = dist.get_rank(), {}
    for name, fn in (("f", tensor_parallel.CopyToRegion), ("g", tensor_parallel.ReduceFromRegion),
                     ("gather", tensor_parallel.GatherSequence), ("scatter", tensor_parallel.ReduceScatterSequence)):
        x = rank_tensor(rank, shape, 1).requires_grad_()
        y = fn.apply(x, None)
        y.backward(rank_tensor(rank, y.shape, 2))
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_conjugate_operators_match_their_definitions(rank_pool, tp):
    shape = (2, 3 * tp, 5)  # (batch, seq, hidden)
    results = rank_pool.run(tp, run_operators, shape)
    xs = [rank_tensor(r, shape, 1) for r in range(tp)]
    sum_x = sum(xs)
    seq = shape[1] // tp
    for rank, out in enumerate(results):
        grads_f = [rank_tensor(r, shape, 2) for r in range(tp)]
        close = dict(atol=1e-12, rtol=0)
        torch.testing.assert_close(out["f"][0], xs[rank], **close)                # identity
        torch.testing.assert_close(out["f"][1], sum(grads_f), **close)            # all-reduce
        torch.testing.assert_close(out["g"][0], sum_x, **close)                   # all-reduce
        torch.testing.assert_close(out["g"][1], grads_f[rank], **close)           # identity
        gathered = (2, shape[1] * tp, 5)
        grads_gather = [rank_tensor(r, gathered, 2) for r in range(tp)]
        torch.testing.assert_close(out["gather"][0], torch.cat(xs, 1), **close)
        torch.testing.assert_close(out["gather"][1],
                                   sum(grads_gather)[:, rank * shape[1]:(rank + 1) * shape[1]], **close)
        grads_scatter = [rank_tensor(r, (2, seq, 5), 2) for r in range(tp)]
        torch.testing.assert_close(out["scatter"][0], sum_x[:, rank * seq:(rank + 1) * seq], **close)
        torch.testing.assert_close(out["scatter"][1], torch.cat(grads_scatter, 1), **close)


def run_vocab_parallel(logits, targets, vocab_size, tokens, table):
    """The rank's slices of the loss, the logits' gradient and the embedding, from full inputs."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    first, per_rank = tensor_parallel.vocab_shard(vocab_size, tp, rank)
    padded = F.pad(logits, (0, per_rank * tp - vocab_size), value=123.0)  # garbage: must be ignored
    local = padded[..., first:first + per_rank].clone().requires_grad_()
    loss = tensor_parallel.VocabParallelLoss(first, vocab_size, None)(local, targets)
    loss.backward()
    weight = F.pad(table, (0, 0, 0, per_rank * tp - vocab_size))[first:first + per_rank]
    embedding = tensor_parallel.VocabParallelEmbedding(torch.nn.Parameter(weight.clone()), first)
    rows = embedding(tokens)
    rows.backward(torch.ones_like(rows))
    return loss.detach(), local.grad, rows.detach(), embedding.weight.grad


def loss_peak(tokens: int, vocab_size: int, dtype: torch.dtype, chunks: int = 1, grad: bool = True) -> int:
    """The most bytes the loss holds at once (LiveStorages), forward and backward, on this rank's logits
    as the LM head makes them (inside, in dtype) and drops them when forward returns: 01's loss on one
    rank, the vocab-parallel one on several; in chunks (LossInChunks) or not; grad=False: forward alone,
    under torch.no_grad."""
    tp, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    first, per_rank = tensor_parallel.vocab_shard(vocab_size, tp, rank)
    weight = torch.randn(per_rank, 8, dtype=dtype, requires_grad=True)
    x, targets = torch.randn(1, tokens, 8, dtype=dtype), torch.randint(vocab_size, (1, tokens))
    loss_fn = foundation.cross_entropy_loss if tp == 1 else tensor_parallel.VocabParallelLoss(first, vocab_size, None)
    if chunks > 1:
        loss_fn = tensor_parallel.ChunkedLoss(loss_fn, chunks)
    with LiveStorages() as made, torch.set_grad_enabled(grad):
        loss = (lambda: loss_fn(x @ weight.t(), targets))()
        if grad:
            loss.backward()
    return made.peak


@pytest.mark.parametrize("tp", [1, 2])
def test_the_loss_holds_at_its_peak_what_loss_bytes_says(rank_pool, tp):
    """01's loss (tp = 1): the logits cast to fp32, the log-softmax it saves; backward, nll's gradient and
    the log-softmax's beside the saved one: 12 B a logit whatever the logits' dtype. Vocab-parallel: the
    logits, an fp32 copy, the exponentials and the softmax it saves: 12 B + the logits' bytes."""
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        peaks = [loss_peak(300, 1000, dtype)] if tp == 1 else rank_pool.run(tp, loss_peak, 300, 1000, dtype)
        for peak in peaks:
            exact = tensor_parallel.loss_bytes(300, 1000, tp, size)  # a logit a token and vocabulary id
            assert exact <= peak <= exact + 64 * 300 + 8 * 1000, (dtype, peak, exact)  # + per-token vectors, ids


@pytest.mark.parametrize("tp", [1, 2])
def test_the_loss_in_chunks_holds_at_its_peak_what_loss_bytes_says(rank_pool, tp):
    """LossInChunks: the logits and their gradient whole (2 x their bytes), a slice's temporaries as the
    loss at once holds them on its tokens (ceil(300 / 7) = 43; 1,000 slices of 300 tokens: one token
    each, the empty ones skipped); besides, 64 B a token of the slice and 8 an id (per-token vectors,
    scalars): less than one token's logits, so a slice a token too short fails. Under torch.no_grad,
    no gradient: at least a whole one less than with it."""
    vocab = tensor_parallel.vocab_shard(1000, tp, 0)[1]
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        for chunks in (7, 1000):
            arguments = (300, 1000, dtype, chunks)
            peaks = [loss_peak(*arguments)] if tp == 1 else rank_pool.run(tp, loss_peak, *arguments)
            exact = tensor_parallel.loss_bytes(300, 1000, tp, size, chunks)
            slack = 64 * -(-300 // chunks) + 8 * 1000
            for peak in peaks:
                assert exact <= peak <= exact + slack, (dtype, chunks, peak, exact)
            assert exact < tensor_parallel.loss_bytes(300, 1000, tp, size)  # bf16, 7 slices: 2.1x less (tp 1)
            if tp == 1:
                without = loss_peak(*arguments, grad=False)
            else:
                without = max(rank_pool.run(tp, loss_peak, *arguments, grad=False))
            # + 64: a scalar or two whose lifetime depends on the process's history (seen: 4 B on one
            # rank, in some runs only); a gradient made under no_grad would be 300 x vocab x size more
            assert without + 300 * vocab * size <= max(peaks) + 64, (dtype, chunks, without, peaks)


def test_the_loss_in_chunks_keeps_no_gradient_for_logits_that_need_none():
    """Grad mode on, logits that need no gradient (a frozen head, an evaluation outside no_grad): no
    gradient buffer of the logits' size, as under torch.no_grad."""
    logits, targets = torch.randn(1, 300, 1000), torch.randint(1000, (1, 300))
    loss_fn = tensor_parallel.ChunkedLoss(foundation.cross_entropy_loss, 7)
    peaks = {}
    for grad in (True, False):
        with LiveStorages() as made, torch.set_grad_enabled(grad):
            loss_fn(logits, targets)
        peaks[grad] = made.peak
    assert peaks[True] <= peaks[False] + 64, peaks  # + 64: a scalar or two (the flake above); a gradient: 1.2 MB


def losses_at_once_and_in_chunks(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunks: int,
                                 scale: float) -> list:
    """(loss, the logits' gradient, the comm meter) of this rank's loss at once and in chunks, backward from
    scale x loss."""
    tp, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    first, per_rank = tensor_parallel.vocab_shard(vocab_size, tp, rank)
    local = F.pad(logits, (0, per_rank * tp - vocab_size))[..., first:first + per_rank]
    whole = foundation.cross_entropy_loss if tp == 1 else tensor_parallel.VocabParallelLoss(first, vocab_size, None)
    out = []
    for loss_fn in (whole, tensor_parallel.ChunkedLoss(whole, chunks)):
        leaf = local.detach().clone().requires_grad_()
        with foundation.comm_meter() as meter:
            loss = loss_fn(leaf, targets)
            (loss * scale).backward()
        out.append((loss.detach(), leaf.grad, meter))
    return out


@given(batch=st.integers(1, 3), seq=st.integers(1, 9), vocab_size=st.integers(2, 40), chunks=st.integers(1, 40),
       scale=st.sampled_from([1.0, 0.25, -3.0, 1 / 3, 1 / 7]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99))
@example(batch=1, seq=1, vocab_size=2, chunks=40, scale=1.0, dtype=torch.float32, seed=0)  # 39 empty slices
def test_the_loss_in_chunks_equals_the_loss_at_once(batch, seq, vocab_size, chunks, scale, dtype, seed):
    """01's loss (fp32 inside) on one rank: the same mean and the same gradient of the logits, in their
    dtype, whatever the slices (more than the tokens: empty ones) and whatever the gradient backward
    starts from (scale: the microbatches' 1/m, a loss scale; backward multiplies the kept gradient by it
    in fp32 and rounds once: exactly, 1/3 unrounded to bf16). The loss: a sum of up to 40 slices' means,
    each weighted by its share and rounded once in fp32: within 40 x 2^-24 relative. The gradient: each
    element (softmax - onehot) / tokens rounded a few more times in fp32 (4 x 2^-24); bf16 logits: that
    value rounded to bf16 either way, at most one bf16 step apart (2^-7 relative)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab_size, generator=gen) * 5).to(dtype)
    targets = torch.randint(vocab_size, (batch, seq), generator=gen)
    (loss, grad, _), (chunked, chunked_grad, _) = losses_at_once_and_in_chunks(logits, targets, vocab_size,
                                                                               chunks, scale)
    assert chunked_grad.dtype == dtype
    _, (_, kept, _) = losses_at_once_and_in_chunks(logits, targets, vocab_size, chunks, 1.0)
    assert torch.equal(chunked_grad, (kept.float() * scale).to(dtype))
    torch.testing.assert_close(chunked, loss, atol=0, rtol=40 * 2 ** -24)
    rtol = 4 * 2 ** -24 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(chunked_grad, grad, atol=1e-30, rtol=rtol)
    with torch.no_grad():  # no backward to come: the loss alone, no gradient computed or kept
        alone = tensor_parallel.ChunkedLoss(foundation.cross_entropy_loss, chunks)(logits, targets)
    torch.testing.assert_close(alone, loss, atol=0, rtol=40 * 2 ** -24)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_loss_in_chunks_of_a_non_finite_logit_or_no_token_is_the_loss_at_once(bad):
    """A NaN or an infinite logit: NaN, or the finite loss at once gives, in its slice as at once (a -inf
    logit of a non-target is a zero probability); the gradient alike (NaN where the loss at once has
    one). No token at all: the loss at once, a mean of nothing (NaN), not an error."""
    logits = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    logits[1, 4, 2] = bad
    targets = torch.zeros(2, 6, dtype=torch.long)
    (loss, grad, _), (chunked, chunked_grad, _) = losses_at_once_and_in_chunks(logits, targets, 5, 4, 1.0)
    torch.testing.assert_close(chunked, loss, atol=0, rtol=4 * 2 ** -24, equal_nan=True)
    torch.testing.assert_close(chunked_grad, grad, atol=1e-30, rtol=4 * 2 ** -24, equal_nan=True)
    assert chunked.isnan() == (bad != -float("inf"))
    empty = tensor_parallel.ChunkedLoss(foundation.cross_entropy_loss, 4)(logits[:0], targets[:0])
    assert empty.isnan() and foundation.cross_entropy_loss(logits[:0], targets[:0]).isnan()


@pytest.mark.parametrize("tp, chunks", [(2, 3), (4, 5), (2, 64)])
def test_the_vocab_parallel_loss_in_chunks_equals_it_at_once(rank_pool, tp, chunks):
    """Every rank: the same loss and gradient of its vocabulary's logits (fp64, 1e-12), and the loss's
    collectives on each slice as comm_formula counts them (64 slices of 30 tokens: one each, the rest
    empty and skipped on every rank): the same bytes in more calls."""
    gen = torch.Generator().manual_seed(tp + chunks)
    logits = torch.randn(2, 15, 11, generator=gen, dtype=torch.float64) * 5
    targets = torch.randint(11, (2, 15), generator=gen)
    cfg = foundation.ModelConfig(vocab_size=11, dim=4, n_layers=1, n_heads=1, ffn_dim=4)
    head = dict(layers=0, embed=False, head=True)  # the head's f and the loss, in fp64
    at_once = tensor_parallel.comm_formula(cfg, 2, 15, False, elem_bytes=8, **head)["all_reduce"]
    sliced = tensor_parallel.comm_formula(cfg, 2, 15, False, elem_bytes=8, loss_chunks=chunks, **head)["all_reduce"]
    for (loss, grad, meter), (chunked, chunked_grad, chunked_meter) in rank_pool.run(
            tp, losses_at_once_and_in_chunks, logits, targets, 11, chunks, 0.5):
        torch.testing.assert_close(chunked, loss, atol=1e-12, rtol=0)
        torch.testing.assert_close(chunked_grad, grad, atol=1e-12, rtol=0)
        extra_calls = chunked_meter.calls("all_reduce") - meter.calls("all_reduce")
        assert (extra_calls, chunked_meter.payload("all_reduce")) == (sliced[0] - at_once[0], meter.payload("all_reduce"))
        assert sliced[1] == at_once[1]


def test_a_vocabulary_tp_does_not_divide_is_priced_as_its_padded_shard(rank_pool):
    """vocab_shard pads the vocabulary to a multiple of tp: 1,001 ids over tp = 2 are 501 a rank, as 1,002
    are. Measured, the loss holds the same at its peak for both; loss_bytes prices both alike (rounded
    down, 1,001 ids would be 500 a rank: less than the loss holds)."""
    uneven, even = (rank_pool.run(2, loss_peak, 300, vocab_size, torch.bfloat16) for vocab_size in (1001, 1002))
    assert uneven == even
    assert tensor_parallel.loss_bytes(300, 1001, 2, 2) == tensor_parallel.loss_bytes(300, 1002, 2, 2)


@pytest.mark.parametrize("tp, vocab_size", [(2, 16), (2, 7), (4, 3), (4, 10)])
def test_vocab_parallel_loss_and_embedding_match_their_definitions(rank_pool, tp, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(2, 5, vocab_size, generator=gen, dtype=torch.float64) * 30
    logits[0, 0, -1] = 1e4  # a max far above the rest: the shift by the max keeps exp finite
    targets = torch.randint(vocab_size, (2, 5), generator=gen)
    targets[0, :2] = torch.tensor([0, vocab_size - 1])  # the first and the last id
    tokens = torch.randint(vocab_size, (2, 5), generator=gen)
    table = torch.randn(vocab_size, 3, generator=gen, dtype=torch.float64)
    results = rank_pool.run(tp, run_vocab_parallel, logits, targets, vocab_size, tokens, table)
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    expected.backward()
    per_rank = tensor_parallel.vocab_shard(vocab_size, tp, 0)[1]
    grad = torch.cat([r[1] for r in results], -1)
    rows_grad = torch.cat([r[3] for r in results])
    close = dict(atol=1e-12, rtol=0)
    for loss, _, _, _ in results:
        torch.testing.assert_close(loss, expected.detach(), **close)
    # Each rank looks up only its ids (zeros elsewhere); the partial embeddings sum to the table's.
    torch.testing.assert_close(sum(r[2] for r in results), F.embedding(tokens, table), **close)
    for rank, (_, _, rows, _) in enumerate(results):
        first, _ = tensor_parallel.vocab_shard(vocab_size, tp, rank)
        outside = (tokens < first) | (tokens >= first + per_rank)
        assert torch.all(rows[outside] == 0), f"rank {rank} looked up an id it does not hold"
    torch.testing.assert_close(grad[..., :vocab_size], full.grad, **close)
    assert torch.all(grad[..., vocab_size:] == 0), "padded logits got a gradient"
    counts = torch.bincount(tokens.flatten(), minlength=per_rank * tp).double()
    torch.testing.assert_close(rows_grad, counts[:, None].expand(-1, 3), **close)


def vocab_parallel_loss(logits, targets, vocab_size):
    tp, rank = dist.get_world_size(), dist.get_rank()
    first, per_rank = tensor_parallel.vocab_shard(vocab_size, tp, rank)
    local = F.pad(logits, (0, per_rank * tp - vocab_size))[..., first:first + per_rank]
    return tensor_parallel.VocabParallelLoss(first, vocab_size, None)(local, targets)


def test_bf16_logits_are_summed_in_fp32(rank_pool):
    """An LM head's bf16 logits: the loss is the float64 loss of the same bf16 values within fp32
    rounding (sums of 500 terms a rank: measured 3e-8 relative; 1e-6 allowed). Summed in bf16 it
    is off by ~3e-3 (a bf16 ulp of the sum, and of the loss itself)."""
    gen = torch.Generator().manual_seed(0)
    vocab_size = 1000
    logits = (torch.randn(1, 8, vocab_size, generator=gen) * 3).bfloat16()
    targets = torch.randint(vocab_size, (1, 8), generator=gen)
    expected = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
    for loss in rank_pool.run(2, vocab_parallel_loss, logits, targets, vocab_size):
        assert loss.double().item() == pytest.approx(expected.item(), rel=1e-6)


# --- one layer: activation memory and communication -------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_one_layer_activation_memory_and_communication_equal_the_formulas(rank_pool, tp):
    """With SP or not, lean saves or autograd's, each region's linears keeping their input's sequence
    shard (regather) or the gathered input: the bytes saved and the collectives (calls, payloads) are
    the formulas'. Plain TP and SP without regather send Megatron's 4 all-reduces' volume; regather adds
    an all-gather of b s h a region."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=32, n_heads=8, n_kv_heads=4, ffn_dim=48)  # grouped-query
    megatron = 4 * Fraction(2 * (tp - 1), tp) * 3 * 8 * 32 * 4  # 4 ring all-reduces of b s h
    for sequence_parallel, lean, regather in itertools.product((False, True), repeat=3):
        formula = tensor_parallel.layer_activation_formula(cfg, 3, 8, tp, sequence_parallel, lean=lean,
                                                           regather=regather)
        comm = tensor_parallel.comm_formula(cfg, 3, 8, sequence_parallel, layers=1, embed=False, head=False,
                                            regather=regather) if tp > 1 else {}
        ops = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
        regathers = 2 * Fraction(tp - 1, tp) * 3 * 8 * 32 * 4 * (sequence_parallel and regather)
        for saved, meter in rank_pool.run(tp, tensor_parallel.measure_layer, cfg, 3, 8, sequence_parallel, "cpu",
                                          lean, regather):
            assert saved == formula, (sequence_parallel, lean, regather)
            assert {op: (meter.calls(op), meter.payload(op)) for op, _ in meter.stats} == comm
            assert sum(meter.traffic(op) for op in ops) == megatron + regathers


def sequence_parallel_backward_events(cfg, batch: int, seq_len: int) -> list[str]:
    """On this rank, a forward and backward of the SP GPT (lean saves, regather): in order, each collective
    left running (its start and its wait) and each backward GEMM of Projections (LinearMath's)."""
    events = []
    collectives = {name: getattr(foundation, name) for name in ("all_gather", "reduce_scatter")}
    gemms = {name: getattr(tensor_parallel.LinearMath, name) for name in ("grad_input", "grad_weight")}

    class LoggedWork:
        def __init__(self, work, name: str) -> None:
            self.work = work
            self.name = name

        def wait(self):
            events.append(f"wait {self.name}")
            return self.work.wait()

    def logged_collective(name: str):
        def collective(*args, async_op: bool = False, **kwargs):
            work = collectives[name](*args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            assert all(tensor.is_contiguous() for tensor in args[:2])  # NCCL's rule (gloo takes strides)
            events.append(f"start {name}")
            return LoggedWork(work, name)
        return collective

    def logged_gemm(name: str):
        def gemm(*args):
            events.append(name)
            return gemms[name](*args)
        return staticmethod(gemm)

    model = tensor_parallel.apply_tensor_parallel(tensor_parallel.apply_lean_saves(foundation.GPT(cfg)), None, True)
    tokens, targets = foundation.synthetic_batch(cfg, batch, seq_len, step=0)
    with unittest.mock.patch.multiple(foundation, **{name: logged_collective(name) for name in collectives}), \
            unittest.mock.patch.multiple(tensor_parallel.LinearMath, **{name: logged_gemm(name) for name in gemms}):
        model(tokens, targets).backward()
    return events


def test_sequence_parallels_backward_runs_its_collectives_beside_the_gemms_that_do_not_need_them(rank_pool):
    """Megatron's overlap (03's Projections, one operator): a region's backward starts the all-gather of
    its kept shard, makes the input's gradient (one GEMM a linear) while it travels, waits for it, starts
    the input gradient's reduce-scatter, makes the weights' gradients (one GEMM each) and only then waits.
    The MLP's region (gate, up) comes first in backward, then the attention's (q, k, v). A backward that
    waited at once, or that started a collective after the GEMMs, logs another order."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=48)

    def region(linears: int) -> list[str]:
        return (["start all_gather", *["grad_input"] * linears, "wait all_gather",
                 "start reduce_scatter", *["grad_weight"] * linears, "wait reduce_scatter"])

    for events in rank_pool.run(2, sequence_parallel_backward_events, cfg, 2, 8):  # the order is any tp's
        assert events == region(2) + region(3)


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def sequence_parallel_backward_opcheck(cfg, batch: int, seq_len: int, dtype: torch.dtype, transform=None,
                                       after=None, test_utils=OPCHECKS) -> int:
    """On this rank, a forward and backward of the SP GPT in dtype (transform: the GPT before its lean
    saves, as 09 orders them; after: the split model), each call of the SP backward operator recorded; then
    torch.library.opcheck's test_utils on each call's arguments (by default all: the schema, inputs not
    mutated nor aliased by outputs; the fake, what torch.compile traces, against the real output's shapes,
    dtypes and strides). Returns how many calls were checked."""
    calls = []
    operator = tensor_parallel._sequence_parallel_backward

    def recorded(*args):
        calls.append(torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, args))  # as in backward
        return operator(*args)

    model = tensor_parallel.apply_lean_saves((transform or (lambda model: model))(foundation.GPT(cfg))).to(dtype)
    model = tensor_parallel.apply_tensor_parallel(model, None, True)
    model = (after or (lambda model: model))(model)
    tokens, targets = foundation.synthetic_batch(cfg, batch, seq_len, step=0)
    with unittest.mock.patch.object(tensor_parallel, "_sequence_parallel_backward", recorded):
        model(tokens, targets).backward()
    for args in calls:  # every rank checks the same calls in the same order: their collectives pair up
        torch.library.opcheck(operator, args, test_utils=test_utils)
    return len(calls)


def test_sequence_parallels_backward_operator_traces_as_it_runs(rank_pool):
    """torch.compile traces the operator by its fake: a fake that said another shape or dtype than the
    real output would compile a wrong graph, which no eager test runs. opcheck compares them on a bf16
    GPT's real calls (the attention's region and the MLP's, a layer), with some weights frozen (an empty
    gradient where not needed) and not."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=48)
    assert rank_pool.run(2, sequence_parallel_backward_opcheck, cfg, 2, 8, torch.bfloat16) == [2, 2]
    assert rank_pool.run(2, sequence_parallel_backward_opcheck, cfg, 2, 8, torch.bfloat16, freeze_some) == [2, 2]


def tensor_parallel_layer_bytes(cfg, batch: int, seq_len: int, sequence_parallel: bool, mode: str) -> int:
    """layer_bytes of layer 0 of the lean tensor-parallel GPT under a recompute mode ("op": kept_bytes)."""
    model = tensor_parallel.apply_tensor_parallel(tensor_parallel.apply_lean_saves(foundation.GPT(cfg)), None,
                                                  sequence_parallel)
    model = tensor_parallel.apply_recompute(model, mode)
    shards = dist.get_world_size() if sequence_parallel else 1
    return layer_bytes(model.layers["0"], cfg, batch, seq_len, shards, mode=mode)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_recompute_mode_of_a_tensor_parallel_layer_saves_what_the_formula_says(rank_pool, tp):
    """The formula's tp > 1 branches of every recompute mode, with SP or not (lean saves, regather): a
    one-device test reaches none of them; lesson 09 prices selective and full at any tp."""
    cfg = foundation.ModelConfig(vocab_size=32, dim=32, n_heads=8, n_kv_heads=4, ffn_dim=48)
    for sequence_parallel, mode in itertools.product((False, True), tensor_parallel.RECOMPUTE_MODES):
        formula = tensor_parallel.layer_activation_formula(cfg, 3, 8, tp, sequence_parallel, mode, lean=True)
        for saved in rank_pool.run(tp, tensor_parallel_layer_bytes, cfg, 3, 8, sequence_parallel, mode):
            assert saved == formula, (sequence_parallel, mode)


def hooks_and_loss_at_tp_1(sequence_parallel: bool) -> tuple[int, bool]:
    """The hooks apply_tensor_parallel registered (besides the model's own input check), and whether
    the loss is the reference's cross-entropy."""
    model = tensor_parallel.apply_tensor_parallel(foundation.GPT(foundation.ModelConfig()), None, sequence_parallel)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules() if m is not model)
    hooks += sum(bool(p._backward_hooks) for p in model.parameters())
    return hooks, model.loss_fn is foundation.cross_entropy_loss


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_at_tp_1_nothing_is_inserted(rank_pool, sequence_parallel):
    """f and g would move nothing at tp = 1: no hook, no autograd function (which torch.compile's
    tracer could not follow, lesson 09), no SP gradient hook; the loss is plain cross-entropy."""
    assert rank_pool.run(1, hooks_and_loss_at_tp_1, sequence_parallel) == [(0, True)]


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_layer_saves_its_kv_heads_only(n_kv_heads):
    """A 32/8-head layer scaled down: 8 query heads reading n_kv_heads K/V heads. Autograd keeps k
    (after RoPE) and v with their own heads; K/V repeated to the 8 query heads would keep two more
    s x b x (8 - n_kv_heads) x head_dim fp32 tensors, which is what grouping saves."""
    cfg, batch, seq = foundation.ModelConfig(dim=32, n_heads=8, n_kv_heads=n_kv_heads, ffn_dim=48), 3, 8
    saved = layer_bytes(foundation.GPT(cfg).layers["0"], cfg, batch, seq)
    assert saved == tensor_parallel.layer_activation_formula(cfg, batch, seq, 1, False)
    repeated = tensor_parallel.layer_activation_formula(dataclasses.replace(cfg, n_kv_heads=8), batch, seq, 1,
                                                         False)
    assert repeated - saved == 4 * 2 * seq * batch * (8 - n_kv_heads) * cfg.head_dim


# Llama 3 8B's and 70B's layers (Meta's config.json), for the published per-token formulas below.
LLAMA3_LAYERS = {"8B": dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336),
                 "70B": dict(dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672)}


def bytes_a_token(cfg, tp: int, tokens: int, **keywords) -> Fraction:
    """One layer's saved bytes a token on a rank, in bf16 with SP (the RoPE tables, shared, left out)."""
    layers = [tensor_parallel.layer_activation_formula(cfg, 1, tokens, tp, True, "none", 2, layers=n, **keywords)
              for n in (1, 2)]
    return Fraction(layers[1] - layers[0], tokens)


@pytest.mark.parametrize("model", LLAMA3_LAYERS)
@pytest.mark.parametrize("tp", [1, 8])
def test_the_lean_layer_keeps_what_megatron_with_transformer_engine_keeps(model, tp):
    """Megatron-Core with Transformer Engine keeps, a token and layer in bf16 with SP (read in their code:
    two norm inputs and outputs, 2 fp32 rstd, q, k, v, the attention's output and fp32 log-sum-exp,
    the 2f-wide SwiGLU input and its output), (8h + 4ad + 4kd + 4a + 6f + 8) / t bytes. The lean layer
    whose regions keep their input's sequence shard keeps exactly that; autograd's, which kept each
    region's gathered input, 4h + (12h + 8 + 4ad + 4kd + 4a + 8f) / t."""
    cfg = foundation.ModelConfig(vocab_size=128, n_layers=1, **LLAMA3_LAYERS[model])
    h, a, k, d, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    tokens = 8 * tp
    assert bytes_a_token(cfg, tp, tokens, lean=True) == Fraction(8 * h + 4 * a * d + 4 * k * d + 4 * a + 6 * f + 8, tp)
    autograd = 4 * h + Fraction(12 * h + 8 + 4 * a * d + 4 * k * d + 4 * a + 8 * f, tp)
    assert bytes_a_token(cfg, tp, tokens, regather=False) == autograd


# --- bad input fails on every rank, before any collective ---------------------------------------

# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 3:
# the models evaluated, (attention heads a, hidden size h), all with s = 2048 and t = 8.
PAPER_MODELS = {"22B": (64, 6144), "175B (GPT-3)": (96, 12288), "530B (MT-NLG)": (128, 20480),
                "1T": (160, 25600)}


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_korthikanti_formulas_are_the_papers(model):
    """The per-layer activation bytes 03 prints (16-bit, per GPU) against the paper's equations
    (Table 2): no parallelism sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht)); tensor +
    sequence parallel sbh(34/t + 5as/(ht)). Before: a missing / t on the SP formula passed every test."""
    a, h = PAPER_MODELS[model]
    s, t, b = 2048, 8, 1
    cfg = foundation.ModelConfig(vocab_size=51200, dim=h, n_heads=a, ffn_dim=4 * h)
    sbh, scores = s * b * h, 5 * a * s / h
    assert tensor_parallel.korthikanti_bytes(cfg, b, s, 1, False) == pytest.approx(sbh * (34 + scores), rel=1e-12)
    assert tensor_parallel.korthikanti_bytes(cfg, b, s, t, False) == pytest.approx(sbh * (10 + 24 / t + scores / t),
                                                                                   rel=1e-12)
    assert tensor_parallel.korthikanti_bytes(cfg, b, s, t, True) == pytest.approx(sbh * (34 / t + scores / t),
                                                                                  rel=1e-12)
    for tp in (1, 2, t):  # t = 1: nothing to split, with or without SP
        assert tensor_parallel.korthikanti_bytes(cfg, b, s, tp, True) == pytest.approx(sbh * (34 + scores) / tp,
                                                                                       rel=1e-12)


@pytest.mark.parametrize("model, saving", [("175B (GPT-3)", 0.70), ("530B (MT-NLG)", 0.65)])
def test_korthikanti_numbers_in_the_papers_text(model, saving):
    """The paper's worked numbers (Section 5): 5as/h = 80 for GPT-3 (64 for MT-NLG) against 34, so
    recomputing only the attention scores (selective recompute: sbh 34/t left with TP + SP) saves 70%
    of the TP + SP memory for GPT-3, 65% for MT-NLG; and its abstract's 5x: plain TP against TP + SP
    + selective recompute."""
    (a, h), s, t = PAPER_MODELS[model], 2048, 8
    cfg = foundation.ModelConfig(dim=h, n_heads=a, ffn_dim=4 * h)
    selective = s * h * 34 / t
    assert round(1 - selective / tensor_parallel.korthikanti_bytes(cfg, 1, s, t, True), 2) == saving
    assert round(tensor_parallel.korthikanti_bytes(cfg, 1, s, t, False) / selective) == 5


def forward_once(cfg, batch, seq_len, sequence_parallel, bad_token, bad_target, twice):
    model = tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, sequence_parallel)
    if twice:
        tensor_parallel.apply_tensor_parallel(model, None, sequence_parallel)
    tokens, targets = foundation.synthetic_batch(cfg, batch, seq_len, 0)
    if bad_token is not None:
        tokens[0, 0] = bad_token
    if bad_target is not None:
        targets[-1, -1] = bad_target
    model(tokens, targets).backward()


@pytest.mark.parametrize("changes, message", [
    (dict(n_heads=6, dim=24, n_kv_heads=6), r"n_heads=6 is not divisible by tp=4"),
    (dict(n_kv_heads=2), r"n_kv_heads=2 is not divisible by tp=4"),
    (dict(ffn_dim=30), r"ffn_dim=30 is not divisible by tp=4"),
    (dict(seq_len=6, sequence_parallel=True), r"sequence length 6 is not divisible by tp=4"),
    (dict(bad_token=32), r"target ids must lie in \[0, 32\)"),
    (dict(bad_token=-1), r"target ids must lie in \[0, 32\)"),
    (dict(bad_target=32), r"target ids must lie in \[0, 32\)"),
    (dict(twice=True), r"already tensor-parallel"),
])
def test_bad_sizes_fail_on_every_rank_without_hanging(rank_pool, changes, message):
    changes = dict(changes)  # parametrize shares the dict between reruns
    run = dict(seq_len=8, sequence_parallel=False, bad_token=None, bad_target=None, twice=False)
    run.update({k: changes.pop(k) for k in list(changes) if k in run})
    cfg = foundation.ModelConfig(**{**dict(vocab_size=32, dim=16, n_heads=4, ffn_dim=16), **changes})
    rank_pool.expect_invalid(4, forward_once, cfg, 2, match=message, **run)


# --- the script itself ------------------------------------------------------------------------

def test_script_runs_as_plain_python():
    stdout = run_script("03_tensor_parallel.py", "--nproc", "2", "--steps", "2")
    diffs = re.findall(r"^  TP(?: \+ SP)?\s+([\d.]+e[-+]\d+)\s+([\d.]+e[-+]\d+)$", stdout, re.M)
    assert len(diffs) == 2, stdout
    for grad_diff, param_diff in diffs:
        assert float(grad_diff) <= GRAD_ATOL and float(param_diff) <= 10 * PARAM_ATOL, stdout
    assert len(re.findall(r"^  TP.* a step: .* B  = formula$", stdout, re.M)) == 4, stdout
    assert len(re.findall(r"^  TP.* a layer: .* B  = formula", stdout, re.M)) == 2, stdout
    memory = re.findall(r"^  TP[^:\n]*?\s([\d,]+) B\s+([\d,]+) B\s+[\d,]+ B$", stdout, re.M)  # before, after
    assert len(memory) == 4 and all(measured == formula for measured, formula in memory), stdout


@pytest.mark.parametrize("options, message", [
    (["--seq-len", "30"], "--seq-len 30 is not divisible by the 4 ranks"),  # the demo runs SP
    (["--bench", "--nproc", "3"], "n_heads=8 is not divisible by tp=3"),  # checked for --bench too
    (["--vocab", "0"], "--vocab must be >= 1, not 0"),
])
def test_options_the_demo_cannot_run_are_refused_before_any_rank_starts(monkeypatch, capsys, options, message):
    """What a reader may try: a sequence SP cannot split, --bench on ranks that cannot split its model,
    a vocabulary of nothing: one line and exit 2 before any rank starts, not a traceback on every rank."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["03_tensor_parallel.py", "--nproc", "4", *options])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    with pytest.raises(SystemExit) as exit_:
        tensor_parallel.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_batch_whose_activations_pass_the_machine_is_refused_before_any_rank_starts(monkeypatch, capsys):
    """--batch 100000 passed the memory rule (the batch, the embedding, the head and the logits), and the
    kernel killed a rank 101 s in (helper-48). The rule now adds the activations rank 0's one-device
    reference keeps, by layer_activation_formula: a batch whose activations alone pass this machine's
    memory is refused in one line, before any rank starts."""
    cfg = foundation.ModelConfig(vocab_size=127, **tensor_parallel.DEMO_MODEL)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_sequence = tensor_parallel.layer_activation_formula(cfg, 1, 32, 1, False, layers=cfg.n_layers)
    batch = memory // per_sequence + 1
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["03_tensor_parallel.py", "--nproc", "2", "--batch", str(batch)])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    with pytest.raises(SystemExit) as exit_:
        tensor_parallel.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "the reference's activations); this machine" in err


# --- activation recompute -----------------------------------------------------------------------

def loss_and_grads(model, tokens, targets, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens, targets, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class LiveStorages(TorchDispatchMode):
    """The storages the operators inside make (not views of storages made before), each while it lives
    (storage: bytes), and the most bytes alive at once: what a GPU's allocator would hold for them."""

    def __init__(self, ignore: tuple = ()) -> None:
        super().__init__()
        self.live, self.peak, self.before = {}, 0, set()
        self.ignore = ignore  # operators whose outputs are not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A storage by its StorageImpl (_cdata), not its data_ptr: 03's elementwise recompute empties storages
        # in place (resize_(0)), and a storage made at the address one of them freed went uncounted (1,024 or
        # 64 of 20,804 B, under 3 of 62 garbage-collector thresholds tried: a failure of one suite run)
        known = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        if func in self.ignore:
            return out
        for t in (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()):
            storage = t.untyped_storage()
            if storage._cdata not in known | self.live.keys():
                self.live[storage._cdata] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, storage._cdata, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def kept_bytes(forward, inputs) -> int:
    """What blocks under "op" recompute keep for backward: their inputs (the checkpoints') and the
    outputs the policy saved (outside autograd's saved-tensor hooks, so activation_bytes sees the
    inputs only): the storages forward() made that outlive it but its output, and the inputs. Not a
    collective's output, which the policy never keeps: gloo's thread sometimes still held the last
    all-reduce's output when forward returned (2 of 5 runs of this file, +b s h of fp32 at tp 2 and 4)."""
    with LiveStorages(ignore=(torch.ops.lesson03.collective.default,)) as made:
        out = forward()
    held = sum(made.live.values()) - out.untyped_storage().nbytes()
    out.float().sum().backward()
    return held + sum(t.untyped_storage().nbytes() for t in inputs)


RECOMPUTE_ON_AUTOGRAD_SAVES = [m for m in tensor_parallel.RECOMPUTE_MODES if m != "elementwise"]
LEAN_PAIR = [(True, "none"), (True, "elementwise")]  # elementwise, against no recompute on lean saves


def assert_same_training(runs: dict) -> None:
    """Bitwise: recompute reruns the same kernels on the same inputs (module docstring)."""
    loss, grads = runs["none"]
    for mode in set(runs) - {"none"}:
        assert torch.equal(runs[mode][0], loss), mode
        assert all(torch.equal(runs[mode][1][n], g) for n, g in grads.items()), mode


def layer_bytes(blocks, cfg, batch: int, seq_len: int, shards: int = 1, dtype=torch.float32, mode: str = "") -> int:
    """Bytes a stack of blocks (one block, or a list) saves for backward, on its input (b, s / shards,
    h) (lesson 03's setup), in dtype, when the forward returns; mode "op": kept_bytes."""
    blocks = [blocks] if isinstance(blocks, torch.nn.Module) else blocks
    x = torch.randn(batch, seq_len // shards, cfg.dim, dtype=dtype, requires_grad=True)
    cos, sin = foundation.rope_angles(torch.arange(seq_len), cfg.head_dim, cfg.rope_theta)

    def forward() -> torch.Tensor:
        h = x
        for block in blocks:  # one forward's RoPE tables, read by every block
            h = block(h, cos, sin)
        return h

    if mode == "op":
        return kept_bytes(forward, (x, cos, sin))
    params = [p for b in blocks for p in b.parameters()]
    out, saved = tensor_parallel.activation_bytes(forward, params, x.device, at_end=True)
    out.float().sum().backward()
    return saved


@given(n_heads=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2]), layers=st.integers(1, 2),
       batch=st.integers(1, 3), seq_len=st.integers(1, 9), seed=st.integers(0, 99), lean=st.booleans())
def test_recompute_equals_no_recompute_and_saves_what_the_formula_says(n_heads, groups, layers, batch,
                                                                         seq_len, seed, lean):
    """Lean saves or autograd's; lean saves against autograd's: the tolerances of the top of this file."""
    cfg = foundation.ModelConfig(vocab_size=40, dim=4 * n_heads, n_layers=layers, n_heads=n_heads,
                                 n_kv_heads=max(1, n_heads // groups), ffn_dim=12, seed=seed)
    batch_data = foundation.synthetic_batch(cfg, batch, seq_len, step=0)
    runs, saved = {}, {}
    for mode in [m for m in tensor_parallel.RECOMPUTE_MODES if lean or m != "elementwise"]:  # on lean saves
        model = tensor_parallel.apply_recompute(lean_or_autograd(foundation.GPT(cfg), lean), mode)
        names = [n for n, _ in model.named_parameters()]
        assert names == [n for n, _ in foundation.GPT(cfg).named_parameters()], "names are kept"
        runs[mode] = loss_and_grads(model, *batch_data)
        saved[mode] = layer_bytes(model.layers["0"], cfg, batch, seq_len, mode=mode)
        assert saved[mode] == tensor_parallel.layer_activation_formula(cfg, batch, seq_len, 1, False, mode,
                                                                       lean=lean), mode
        for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):  # every layer, bf16 too
            stack = layer_bytes(list(model.to(dtype).layers.values()), cfg, batch, seq_len, dtype=dtype, mode=mode)
            assert stack == tensor_parallel.layer_activation_formula(cfg, batch, seq_len, 1, False, mode, size,
                                                                     layers=layers, lean=lean), (mode, dtype)
    assert_same_training(runs)
    assert saved["full"] < saved["op"] < saved["none"] and saved["full"] < saved["selective"] < saved["none"]
    if lean:
        assert saved["elementwise"] < saved["none"]
        loss, grads = loss_and_grads(foundation.GPT(cfg), *batch_data)
        assert abs(runs["none"][0] - loss) <= 1e-5
        for name, grad in grads.items():
            torch.testing.assert_close(runs["none"][1][name], grad, atol=GRAD_ATOL, rtol=1e-4, msg=name)


class OperatorCount(TorchDispatchMode):
    """How many times each operator runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def test_op_recompute_keeps_odd_fp8_gemms_as_it_keeps_odd_matmuls():
    """Lesson 08's FP8 GEMMs on a GPU are torch._scaled_mm, not mm: "op" counts both (torchtitan's save
    list holds both), so an FP8 layer keeps the outputs a bf16 one keeps. Two FP8 GEMMs in a checkpoint
    (_scaled_mm runs on the CPU too), each output kept by a product for p's gradient: backward runs the
    second again, not the first (before: both, as any op the policy does not keep)."""
    one = torch.tensor(1.0)
    x = torch.randn(16, 16).to(torch.float8_e4m3fn)

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)

    def products(p: torch.Tensor) -> torch.Tensor:
        return (gemm() * p + gemm() * p).sum()

    p = torch.ones(16, 16, requires_grad=True)
    policy = tensor_parallel.odd_matmuls_and_attention
    out = torch.utils.checkpoint.checkpoint(products, p, use_reentrant=False, context_fn=policy)
    with OperatorCount() as counted:
        out.backward()
    assert counted.calls[torch.ops.aten._scaled_mm.default] == 1
    assert torch.equal(p.grad, 2 * gemm())


def test_recompute_and_lean_saves_refuse_bad_modes_and_a_second_application():
    refused = foundation.GPT(foundation.ModelConfig())
    with pytest.raises(ValueError, match="mode 'some' must be one of \\('none', 'selective', 'elementwise', 'op', "
                                         "'full'\\)"):
        tensor_parallel.apply_recompute(refused, "some")
    with pytest.raises(ValueError, match="recompute elementwise rebuilds .* from what lean saves keep: apply_lean_"):
        tensor_parallel.apply_recompute(refused, "elementwise")
    assert tensor_parallel.apply_recompute(refused, "full").recompute == "full", "a refused mode leaves no mark"
    model = tensor_parallel.apply_recompute(foundation.GPT(foundation.ModelConfig()), "full")
    with pytest.raises(ValueError, match="already recomputes \\(full\\)"):
        tensor_parallel.apply_recompute(model, "selective")
    model = tensor_parallel.apply_lean_saves(foundation.GPT(foundation.ModelConfig()))
    with pytest.raises(ValueError, match="already keeps lean saves: apply_lean_saves once"):
        tensor_parallel.apply_lean_saves(model)


def rerun_whole(model):
    """09's plan-only --recompute whole, as Megatron's CheckpointFunction runs it: each block in a
    reentrant checkpoint, whose backward runs the block's forward again to its end."""
    for block in model.layers.values():
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True)
    return model


def recompute_tensor_parallel(cfg, batch: int, seq_len: int, sequence_parallel: bool) -> tuple:
    """On each rank: loss and local gradients under each mode (and a reentrant "whole"), layer 0's saved
    bytes, the meter of the step (forward + backward), and the TP-local parameter shapes."""
    runs, saved, meters = {}, {}, {}
    # op reruns collectives (09 refuses it); elementwise needs lean saves (test_elementwise_recompute_...)
    for mode in [*set(tensor_parallel.RECOMPUTE_MODES) - {"op", "elementwise"}, "whole"]:
        model = tensor_parallel.apply_tensor_parallel(foundation.GPT(cfg), None, sequence_parallel)
        if mode == "whole":
            rerun_whole(model)
        else:
            tensor_parallel.apply_recompute(model, mode)
        with foundation.comm_meter() as meters[mode]:
            runs[mode] = loss_and_grads(model, *foundation.synthetic_batch(cfg, batch, seq_len, step=0))
        shards = dist.get_world_size() if sequence_parallel else 1
        saved[mode] = layer_bytes(model.layers["0"], cfg, batch, seq_len, shards)
    return runs, saved, meters, [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def recompute_context_parallel(cfg, batch: int, seq_len: int) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = context_parallel.validate_context_parallel(seq_len, cfg.n_heads, cp, "ring", True)
    tokens, targets = (layout.shard(t, rank, dim=1) for t in foundation.synthetic_batch(cfg, batch, seq_len, 0))
    runs = {}
    # op reruns the ring's sends (09 refuses it); elementwise recomputes from lean saves: against lean saves
    for lean, mode in [*((False, m) for m in RECOMPUTE_ON_AUTOGRAD_SAVES if m != "op"), *LEAN_PAIR]:
        model = foundation.GPT(cfg, attn_fn=context_parallel.ContextParallelAttention(None, "ring", True))
        model = tensor_parallel.apply_recompute(lean_or_autograd(model, lean), mode)
        runs.setdefault(lean, {})[mode] = loss_and_grads(model, tokens, targets, positions=layout.positions(rank))
    return runs


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_after_tensor_parallelism(rank_pool, sequence_parallel):
    """Also: full recompute re-runs each block's collectives up to down_proj's input (comm_formula), a
    reentrant checkpoint ("whole", 09's plan for Megatron's) to the block's end, the MLP's g too, keeping
    what full keeps; tp_local_shape gives every parameter's shape on a rank (vocabulary 33 padded to 34)."""
    cfg = foundation.ModelConfig(vocab_size=33, dim=16, n_heads=4, n_kv_heads=2, ffn_dim=24, n_layers=2)
    share = {"all_reduce": 1, "all_gather": Fraction(1, 2), "reduce_scatter": Fraction(1, 2)}  # ring, t = 2
    results = rank_pool.run(2, recompute_tensor_parallel, cfg, 2, 6, sequence_parallel)
    for runs, saved, meters, shapes in results:
        assert_same_training(runs)
        g = "reduce_scatter" if sequence_parallel else "all_reduce"
        assert meters["whole"].traffic(g) > meters["full"].traffic(g)  # the MLP's g, again
        for mode, got in saved.items():
            saving = "full" if mode == "whole" else mode
            assert got == tensor_parallel.layer_activation_formula(cfg, 2, 6, 2, sequence_parallel, saving), mode
            formula = tensor_parallel.comm_formula(cfg, 2, 6, sequence_parallel, recompute=mode)
            assert {op: meters[mode].traffic(op) for op, _ in meters[mode].stats} == \
                {op: share[op] * payload for op, (_, payload) in formula.items()}, mode
        assert shapes == [(name, tensor_parallel.tp_local_shape(name, shape, 2))
                          for name, shape in foundation.parameter_shapes(cfg).items()]


def test_elementwise_recompute_of_an_moe_block_rebuilds_only_its_norms_outputs():
    """06's MoE keeps its experts' own inputs (no SwiGLU product of 01's): "elementwise" rebuilds each
    norm's output only, 2 x b s h elements a layer less, bitwise the same training."""
    cfg = foundation.ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24)
    moe = expert_parallel.MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=8)
    batch_data = foundation.synthetic_batch(cfg, 2, 6, step=0)
    runs, saved = {}, {}
    for mode in ("none", "elementwise"):
        model = tensor_parallel.apply_lean_saves(expert_parallel.convert_to_moe(foundation.GPT(cfg), moe))
        tensor_parallel.apply_recompute(model, mode)
        runs[mode] = loss_and_grads(model, *batch_data)
        saved[mode] = layer_bytes(model.layers["0"], cfg, 2, 6)
    assert_same_training(runs)
    assert saved["none"] - saved["elementwise"] == 2 * 4 * 2 * 6 * cfg.dim  # two norms' fp32 outputs


def test_elementwise_recompute_holds_nothing_past_backward_and_leaves_other_forwards_alone():
    """The refill hook stays on the graph after backward: once it has run it must drop the storage and
    what it rebuilt from (x, gate, up), or they stay alive into the next step's forward. After a backward
    with the loss still referenced, the storages made in the step are those of no recompute; a forward
    under no_grad (validation), and one that is never backpropagated, run and change nothing."""
    cfg = foundation.ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24)
    batch_data = foundation.synthetic_batch(cfg, 2, 6, step=0)
    held, runs = {}, {}
    for mode in ("none", "elementwise"):
        model = tensor_parallel.apply_recompute(tensor_parallel.apply_lean_saves(foundation.GPT(cfg)), mode)
        with torch.no_grad():
            validation = model(*batch_data)
        model(*batch_data)  # never backpropagated
        with LiveStorages() as made:
            loss = model(*batch_data)
            loss.backward()
        held[mode] = sum(made.live.values())
        runs[mode] = (torch.stack([validation, loss.detach()]), {n: p.grad for n, p in model.named_parameters()})
    assert_same_training(runs)
    assert held["elementwise"] == held["none"]


def elementwise_recompute_on_ranks(cfg, batch: int, seq_len: int, sequence_parallel: bool) -> tuple:
    """On each rank, lean saves with no recompute and with "elementwise": loss and local gradients, and
    the step's collectives."""
    runs, meters = {}, {}
    for mode in ("none", "elementwise"):
        model = tensor_parallel.apply_lean_saves(foundation.GPT(cfg))
        model = tensor_parallel.apply_tensor_parallel(model, None, sequence_parallel)
        tensor_parallel.apply_recompute(model, mode)
        with foundation.comm_meter() as meters[mode]:
            runs[mode] = loss_and_grads(model, *foundation.synthetic_batch(cfg, batch, seq_len, step=0))
    traffic = {mode: {op: meter.traffic(op) for op, _ in meter.stats} for mode, meter in meters.items()}
    return runs, traffic


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_elementwise_recompute_after_tensor_parallelism(rank_pool, sequence_parallel):
    """The emptied storages are refilled before the regions' backward reads them: with SP, the shard
    that Projections keeps and re-gathers; without, the input the linears keep. Bitwise, as every mode
    (test_each_recompute_mode_... measures the bytes it drops); the rebuild sends nothing."""
    cfg = foundation.ModelConfig(vocab_size=33, dim=16, n_heads=4, n_kv_heads=2, ffn_dim=24, n_layers=2)
    for runs, traffic in rank_pool.run(2, elementwise_recompute_on_ranks, cfg, 2, 6, sequence_parallel):
        assert_same_training(runs)
        assert traffic["elementwise"] == traffic["none"]


def test_recompute_with_ring_attention(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=33, dim=16, n_heads=2, ffn_dim=24, n_layers=2)
    for runs in rank_pool.run(2, recompute_context_parallel, cfg, 2, 8):
        assert_same_training(runs[False])  # autograd's saves
        assert_same_training(runs[True])  # lean saves


def recompute_zero3(cfg, batch: int, seq_len: int) -> dict:
    """ZeRO-3 gathers a block's parameters in hooks around Block.__call__ and, in backward, when
    the block's output gradient arrives: before the recompute reads them."""
    runs = {}
    for lean, mode in [*((False, m) for m in RECOMPUTE_ON_AUTOGRAD_SAVES), *LEAN_PAIR]:
        model = tensor_parallel.apply_recompute(lean_or_autograd(foundation.GPT(cfg), lean), mode)
        zero_opt, losses = zero.ZeRO(model, stage=3), []
        for step in range(2):
            x, y = foundation.synthetic_batch(cfg, batch, seq_len, step, dist.get_rank(), 2)
            loss = model(x, y)
            loss.backward()
            losses.append(loss.detach())
            zero_opt.step()
            zero_opt.zero_grad()
        masters = zero_opt.unshard([u.master for u in zero_opt.units])
        runs.setdefault(lean, {})[mode] = (torch.stack(losses), masters)
    return runs


def test_recompute_under_zero3(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=33, dim=16, n_heads=2, ffn_dim=24, n_layers=2)
    for runs in rank_pool.run(2, recompute_zero3, cfg, 4, 6):
        assert_same_training(runs[False])  # autograd's saves
        assert_same_training(runs[True])  # lean saves



def outputs_and_gradients(function, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """function's output and the gradients of its sum by every input (fresh leaves, so each call is its own)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*leaves)
    out.sum().backward()
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def test_lean_norm_and_swiglu_equal_autograds_even_with_nan_and_inf():
    """The lean saves recompute what autograd keeps: output and every gradient equal 01's modules' on finite
    rows (fp32 rounding: the recomputed x / rms is the same expression; 1e-6), and a row holding NaN or inf
    is NaN in the same places (equal_nan), never a finite value that hides it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    norm = foundation.RMSNorm(8, eps=1e-5)
    weight = torch.randn(8, generator=gen)
    expected = outputs_and_gradients(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), x, weight)
    lean = outputs_and_gradients(lambda x, w: tensor_parallel.RMSNormKeepingInput.apply(x, w, norm.eps), x, weight)
    for got, want in zip(lean, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)
    gate = torch.randn(4, 8, generator=gen)
    gate[0, 0] = float("nan")
    gate[3, 1] = float("-inf")
    up = torch.randn(4, 8, generator=gen)
    expected = outputs_and_gradients(foundation.swiglu, gate, up)
    lean = outputs_and_gradients(tensor_parallel.SwiGLUKeepingInputs.apply, gate, up)
    for got, want in zip(lean, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)
