"""Lesson 02 as a specification: every ZeRO stage computes what one device computes with AdamW and
torch's clip_grad_norm_, holds the bytes the memory model says, and moves the bytes the paper says.

Tolerances, fp32 on CPU, Adam's eps raised to 1e-6 (lesson 01's docstring: eps bounds how much Adam
magnifies gradient rounding). Measured over 24 random configurations (world 1-4, every stage,
clipping at 0.05 / 1 / off), then widened with margin:
- loss per step: measured <= 4.8e-7, atol 1e-5;
- gradients of step 0, reassembled from the shards: <= 3.6e-7, atol 1e-6 + rtol 1e-4 (the
  reduce-scatter sums the same numbers as lesson 01's all-reduce, in another order);
- parameters after 3 AdamW steps: <= 1.4e-6, atol 1e-5; a sharding bug moves them by ~lr = 1e-3;
- exp_avg (a sum of gradients): <= 7.8e-8, atol 1e-6 + rtol 1e-4, like the gradients; exp_avg_sq
  (a sum of squared gradients, values down to ~1e-12): <= 1.9e-4 relative, rtol 1e-3 + atol 1e-10;
  a shard written to the wrong place or a missing / N is off by 100% or more;
- the global gradient norm (what clipping uses): <= 1.5e-7 relative, rtol 1e-5; the classic bug, a
  shard's own norm, is off by a factor of about sqrt(N).
Mixed precision (bf16 compute and communication, fp32 master and moments) against its one-device
twin: on 1 rank both compute the same bf16 gradients, so fp32's tolerances hold; on N > 1 ranks bf16
gradients are rounded after differently ordered sums; see test_mixed_precision_equals_its_one_device_twin.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import re
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import run_script
from test_01_ddp import model_configs

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
checkpoints = importlib.import_module("02_zero_checkpoints")

LOSS_ATOL, GRAD_ATOL, GRAD_RTOL, PARAM_ATOL, ADAM_EPS = 1e-5, 1e-6, 1e-4, 1e-5, 1e-6
SQ_ATOL, SQ_RTOL, NORM_RTOL = 1e-10, 1e-3, 1e-5


def assert_close_by_name(ours: dict, reference: dict, what: str, **tolerances) -> None:
    assert ours.keys() == reference.keys(), what
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, **tolerances,
                                   msg=lambda m, name=name: f"{what} of {name}: {m}")


def assert_matches_reference(result, reference) -> None:
    assert result.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
    assert result.grad_norms == pytest.approx(reference.grad_norms, rel=NORM_RTOL)
    assert_close_by_name(result.first_grads, reference.first_grads, "step-0 gradient",
                         atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert_close_by_name(result.params, reference.params, "parameter", atol=PARAM_ATOL, rtol=0)
    assert_close_by_name(result.state["exp_avg"], reference.state["exp_avg"], "exp_avg",
                         atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert_close_by_name(result.state["exp_avg_sq"], reference.state["exp_avg_sq"], "exp_avg_sq",
                         atol=SQ_ATOL, rtol=SQ_RTOL)
    assert result.state["step"] == reference.state["step"]


# --- every stage equals one device -------------------------------------------------------------

@given(cfg=model_configs(), world=st.integers(1, 4), stage=st.sampled_from(zero.STAGES),
       per_rank=st.integers(1, 2), seq_len=st.integers(1, 8),
       max_grad_norm=st.sampled_from([0.05, 1.0, math.inf]), prefetch=st.booleans(),
       resume_after=st.sampled_from([None, 1, 2]))
@example(cfg=foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20), world=3, stage=3, per_rank=1,
         seq_len=4, max_grad_norm=1.0, prefetch=False, resume_after=None)  # ZeRO-3 without prefetch
def test_zero_equals_single_device(rank_pool, cfg, world, stage, per_rank, seq_len, max_grad_norm,
                                   prefetch, resume_after):
    steps, global_batch = 3, world * per_rank
    kwargs = dict(adam_eps=ADAM_EPS, max_grad_norm=max_grad_norm)
    runs = rank_pool.run(world, zero.train_zero, cfg, steps, global_batch, seq_len, stage=stage,
                         prefetch=prefetch, resume_after=resume_after, **kwargs)
    reference = foundation.train_single_device(cfg, steps, global_batch, seq_len, **kwargs)
    assert_matches_reference(runs[0][0], reference)
    for rank, (result, _) in enumerate(runs[1:], start=1):
        for name, param in runs[0][0].params.items():
            assert torch.equal(result.params[name], param), f"rank {rank} drifted on {name}"

    # Memory: the bytes held equal the formula on the padded count, exactly.
    psi = sum(t.numel() for t in reference.params.values())
    padded = runs[0][0].stats["padded_params"]
    assert psi <= padded < psi + world * runs[0][0].stats["units"]
    for result, _ in runs:
        expected = zero.zero_memory_per_rank(padded, world, stage, 4, 4, zero.ADAM_MOMENT_BYTES)
        expected["optimizer"] += zero.STEP_COUNTER_BYTES * result.stats["units"]
        assert result.held == expected

    # Communication: per step, the paper's formula on the padded count, plus (stages 1-3) one fp32
    # scalar all-reduce for the global gradient norm.
    formula = zero.zero_traffic_per_step(padded, world, stage, 4, 4)
    norm = Fraction(2 * (world - 1), world) * 4 if stage else 0
    for _, meter in runs:
        for op, bytes_per_step in formula.items():
            assert meter.traffic(op) - (norm * steps if op == "all_reduce" else 0) == steps * bytes_per_step
        if stage:
            assert meter.traffic("all_reduce") == norm * steps
        assert set(op for op, _ in meter.stats) <= {"all_reduce", "reduce_scatter", "all_gather"}


@pytest.mark.parametrize("mixed_precision", [False, True])
@pytest.mark.parametrize("stage", zero.STAGES)
def test_memory_formula_counts_adamw_step_counter_of_every_unit(rank_pool, stage, mixed_precision):
    """The bytes held equal 02's own formula (memory_formula, which the demo and lesson 09's plan
    print), and that formula is the paper's on the padded count plus torch AdamW's `step`, one fp32
    scalar tensor per flat unit: without the counters it would be 4 B x units short."""
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20, n_layers=3)
    world = 2
    result = rank_pool.run(world, zero.train_zero, cfg, 1, world, 4, stage=stage,
                           mixed_precision=mixed_precision)[0][0]
    padded, units = result.stats["padded_params"], result.stats["units"]
    size, master = (2, 4) if mixed_precision else (4, 0)  # bf16 compute keeps fp32 masters
    paper = zero.zero_memory_per_rank(padded, world, stage, size, size, master + zero.ADAM_MOMENT_BYTES)
    assert units == cfg.n_layers + 3, "embed, each layer, norm, lm_head: one unit each"
    assert result.formula == {**paper, "optimizer": paper["optimizer"] + 4 * units}
    assert result.held == result.formula


def test_uneven_sizes_clipping_and_traffic_ratios(rank_pool):
    """3 ranks, every module's size odd: padding in every unit; clipping active at every step;
    traffic 1x DDP for stages 1-2 and 1.5x DDP for stage 3 on the padded count."""
    cfg = foundation.ModelConfig(vocab_size=37, dim=10, n_heads=1, ffn_dim=13, seed=7)
    reference = foundation.train_single_device(cfg, 3, 6, 5, adam_eps=ADAM_EPS, max_grad_norm=0.01)
    assert min(reference.grad_norms) > 0.01, "clipping must be active for this test to mean anything"
    psi = sum(t.numel() for t in reference.params.values())
    for stage in zero.STAGES:
        runs = rank_pool.run(3, zero.train_zero, cfg, 3, 6, 5, stage=stage, adam_eps=ADAM_EPS,
                             max_grad_norm=0.01)
        result, meter = runs[0]
        assert_matches_reference(result, reference)
        padded = result.stats["padded_params"]
        assert padded > psi and padded % 3 == 0
        traffic = sum(meter.traffic(op) for op in ("reduce_scatter", "all_gather"))
        ddp_traffic = 3 * Fraction(2 * 2, 3) * 4 * padded  # 3 steps of DDP on the padded count
        expected = {0: 0, 1: 1, 2: 1, 3: Fraction(3, 2)}[stage]
        assert traffic == expected * ddp_traffic


def load_then_gather(cfg, stage, state):
    model = foundation.GPT(cfg)
    optimizer = zero.ZeRO(model, stage)
    optimizer.load_full_state_dict(state)
    with torch.no_grad():
        tokens, _ = foundation.synthetic_batch(cfg, 1, 5, 0)
        logits = model(tokens)  # the compute parameters were refreshed too (stage 3: gathered)
    return optimizer.full_state_dict(), logits


def test_a_checkpoint_moves_between_stages_and_group_sizes(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=37, dim=10, n_heads=1, ffn_dim=13, seed=3)
    saved = rank_pool.run(2, zero.train_zero, cfg, 2, 4, 5, stage=3)[0][0].state
    reference = foundation.GPT(cfg)
    reference.load_state_dict(saved["params"])
    with torch.no_grad():
        expected_logits = reference(foundation.synthetic_batch(cfg, 1, 5, 0)[0])
    for world, stage in ((3, 1), (1, 0), (3, 3)):
        for state, logits in rank_pool.run(world, load_then_gather, cfg, stage, saved):
            assert state["step"] == saved["step"] == 2
            for key in ("params", "exp_avg", "exp_avg_sq"):
                assert state[key].keys() == saved[key].keys()
                assert all(torch.equal(state[key][n], saved[key][n]) for n in saved[key]), (key, world)
            torch.testing.assert_close(logits, expected_logits, atol=1e-6, rtol=0)


# --- models that are not the reference GPT: what FSDP2 supports, ZeRO supports -----------------

def tie_embedding(model):
    """GPT-2's and Llama 3.2's tie: the LM head is the embedding (one parameter, two modules)."""
    model.lm_head.weight = model.embed.weight
    return model


def add_logit_scale(model):
    """A parameter registered on the model itself, outside every unit module, used in forward."""
    model.logit_scale = torch.nn.Parameter(torch.full((), 1.5))
    loss_fn = model.loss_fn
    model.loss_fn = lambda logits, targets: loss_fn(logits * model.logit_scale, targets)
    return model


FROZEN = ("norm.weight", "layers.0.mlp.up_proj.weight")


def freeze_some(model):
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


@pytest.mark.parametrize("stage", zero.STAGES)
@pytest.mark.parametrize("transform", [tie_embedding, add_logit_scale, freeze_some])
def test_tied_root_and_frozen_parameters_train_as_on_one_device(rank_pool, transform, stage):
    """Before: a tied weight was flattened twice (a stale checkpoint entry at stages 0-1, a crash at
    2-3), a parameter on the model itself was never updated nor saved, a frozen one was refused.
    Now each trainable parameter has one flat slot, one gradient and one checkpoint entry (resumed
    from after step 1), frozen ones are neither updated nor synchronised; memory counts each once."""
    cfg = foundation.ModelConfig(vocab_size=37, dim=12, n_heads=2, ffn_dim=14, seed=5)
    world, steps, kwargs = 3, 3, dict(adam_eps=ADAM_EPS, max_grad_norm=1.0, transform=transform)
    runs = rank_pool.run(world, zero.train_zero, cfg, steps, world, 4, stage=stage, resume_after=1,
                         **kwargs)
    reference = foundation.train_single_device(cfg, steps, world, 4, **kwargs)
    result = runs[0][0]
    assert_matches_reference(result, reference)
    model = transform(foundation.GPT(cfg))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert reference.params.keys() == model.state_dict().keys()  # a tied weight under both names
    assert len(reference.first_grads) == len(dict(model.named_parameters())) - len(frozen)
    for name in FROZEN if transform is freeze_some else ():
        assert torch.equal(result.params[name], model.get_parameter(name)), f"{name} was updated"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    padded = result.stats["padded_params"]
    assert trainable <= padded < trainable + world * result.stats["units"], "each parameter once"
    for other, _ in runs:
        expected = zero.zero_memory_per_rank(padded, world, stage, 4, 4, zero.ADAM_MOMENT_BYTES)
        expected["optimizer"] += zero.STEP_COUNTER_BYTES * result.stats["units"]
        expected["params"] += sum(p.nbytes for p in frozen)
        assert other.held == expected


def load_misshapen(cfg, stage, name, misshape):
    """Load a full state whose entry `name` was replaced; return the error and whether this rank's
    state is still the one before."""
    model = foundation.GPT(cfg)
    optimizer = zero.ZeRO(model, stage)
    model(*foundation.synthetic_batch(cfg, dist.get_world_size(), 4, 0, dist.get_rank(),
                                      dist.get_world_size())).backward()
    optimizer.step()
    before = optimizer.full_state_dict()
    state = {**before, "params": {**before["params"], name: misshape(before["params"][name])}}
    try:
        optimizer.load_full_state_dict(state)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    after = optimizer.full_state_dict()
    return error, all(torch.equal(after[k][n], before[k][n]) for k in ("params", *zero.ADAM_KEYS)
                      for n in before[k])


def a_scalar(t):
    return torch.tensor(0.5)


def transposed(t):
    return t.t().contiguous()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("misshape", [a_scalar, transposed])
def test_load_full_state_dict_refuses_another_shape_before_changing_anything(rank_pool, misshape, stage):
    """Before: a scalar was broadcast over the whole weight, a transposed copy reshaped into it."""
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    name = "layers.0.mlp.up_proj.weight"  # (20, 12): its transpose has another shape
    for error, unchanged in rank_pool.run(2, load_misshapen, cfg, stage, name, misshape):
        assert f"params['{name}'] has shape" in error and "the parameter has shape (20, 12)" in error, error
        assert unchanged


def tied_state_into_torch(cfg, stage):
    """The full state of a ZeRO over a tied model, loaded strictly into a tied torch model."""
    model = tie_embedding(foundation.GPT(cfg))
    optimizer = zero.ZeRO(model, stage)
    model(*foundation.synthetic_batch(cfg, dist.get_world_size(), 4, 0, dist.get_rank(),
                                      dist.get_world_size())).backward()
    optimizer.step()
    state = optimizer.full_state_dict()
    torch_model = tie_embedding(foundation.GPT(cfg))
    torch_model.load_state_dict(state["params"], strict=True)
    optimizer.load_full_state_dict(state)  # and back: the second name is the same values
    return state, torch_model.state_dict(), optimizer.full_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_tied_models_full_state_dict_is_torchs(rank_pool, stage):
    """Before: one entry, embed.weight, so a strict load_state_dict into a tied torch model reported
    lm_head.weight missing. Now both names, the same values, as torch's own state_dict()."""
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    for state, loaded, again in rank_pool.run(2, tied_state_into_torch, cfg, stage, timeout=600):
        assert state["params"].keys() == loaded.keys() and "lm_head.weight" in loaded
        assert all(torch.equal(state["params"][name], value) for name, value in loaded.items())
        assert torch.equal(state["params"]["lm_head.weight"], state["params"]["embed.weight"])
        assert all(torch.equal(again[k][n], state[k][n]) for k in zero.CHECKPOINT_KINDS for n in state[k])


# --- mixed precision ---------------------------------------------------------------------------

def relative_error(ours: dict, reference: dict) -> float:
    diff = sum(((ours[n] - reference[n]) ** 2).sum() for n in reference)
    return math.sqrt(diff / sum((reference[n] ** 2).sum() for n in reference))


@pytest.mark.parametrize("world, stage", [(1, 3), (1, 1), (2, 2), (3, 3), (4, 1)])
def test_mixed_precision_equals_its_one_device_twin(rank_pool, world, stage):
    cfg = foundation.ModelConfig(vocab_size=50, dim=24, n_heads=3, ffn_dim=20, seed=world)
    steps, global_batch, seq_len = 3, 2 * world, 8
    kwargs = dict(adam_eps=ADAM_EPS, max_grad_norm=1.0, mixed_precision=True)
    result = rank_pool.run(world, zero.train_zero, cfg, steps, global_batch, seq_len, stage=stage,
                           **kwargs)[0][0]
    twin = foundation.train_single_device(cfg, steps, global_batch, seq_len, **kwargs)
    initial = foundation.cpu_copy(foundation.GPT(cfg).named_parameters())
    if world == 1:  # the same bf16 gradients: only the fp32 norm's summation order differs
        assert_matches_reference(result, twin)
    else:
        # Measured over 18 random configurations (world 2-4, every stage): losses <= 1.5e-4,
        # gradients <= 6.0e-3 relative (bf16 keeps 8 bits: 2^-8 = 3.9e-3 per rounding), norms
        # <= 1.2e-3 relative, the parameters' movement from their initial values <= 2.9e-2
        # relative (Adam turns the rounding of gradients near 0 into lr-sized moves). A missing / N
        # is 100% off on gradients; a shard updated in the wrong place, 100% of the movement.
        # Per parameter as well (a whole wrong parameter is a small share of the total): measured
        # <= 8.3e-3 on gradients and <= 5.3e-2 on movement over these cases; a zeroed gradient
        # shard is >= 50% off on its parameter.
        assert result.losses == pytest.approx(twin.losses, abs=1e-3)
        assert relative_error(result.first_grads, twin.first_grads) < 2e-2
        moved = {n: result.params[n] - initial[n] for n in initial}
        twin_moved = {n: twin.params[n] - initial[n] for n in initial}
        assert relative_error(moved, twin_moved) < 0.1
        for n in initial:
            assert relative_error({n: result.first_grads[n]}, {n: twin.first_grads[n]}) < 3e-2, n
            assert relative_error({n: moved[n]}, {n: twin_moved[n]}) < 0.2, n
        assert result.grad_norms == pytest.approx(twin.grad_norms, rel=1e-2)


def bf16_parameters_after_a_step(cfg, stage):
    model = foundation.GPT(cfg)
    optimizer = zero.ZeRO(model, stage, mixed_precision=True)
    tokens, targets = foundation.synthetic_batch(cfg, 2 * dist.get_world_size(), 6, 0, dist.get_rank(),
                                                 dist.get_world_size())
    model(tokens, targets).backward()
    optimizer.step()
    masters = optimizer.full_state_dict()["params"]
    return {n: (p.dtype, torch.equal(p.detach(), masters[n].to(torch.bfloat16)))
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mixed_precision_params_are_the_rounded_fp32_masters(rank_pool, stage):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    for rank_result in rank_pool.run(2, bf16_parameters_after_a_step, cfg, stage):
        assert rank_result == {n: (torch.bfloat16, True) for n in rank_result}


# --- ZeRO-3: gather just in time, prefetch, free --------------------------------------------------

def materialised_units_during_forward(cfg, prefetch):
    model = foundation.GPT(cfg)
    optimizer = zero.ZeRO(model, 3, prefetch=prefetch)
    seen = []
    for _, module in zero.zero_units(model):  # registered after ZeRO's: runs after the gather
        module.register_forward_pre_hook(lambda m, args: seen.append(
            sum(any(p.numel() for p in u.params) for u in optimizer.units)))
    tokens, targets = foundation.synthetic_batch(cfg, 2, 6, 0, dist.get_rank(), 2)
    model(tokens, targets).backward()
    optimizer.step()
    after = sum(p.numel() for p in model.parameters())
    return seen, after, optimizer.prefetched_gathers, optimizer.max_gathers_in_flight


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_gathers_one_module_at_a_time_and_prefetches(rank_pool, prefetch):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20, n_layers=3)
    units = 3 + 3  # embed, 3 blocks, norm, lm_head
    runs = rank_pool.run(2, materialised_units_during_forward, cfg, prefetch)
    for seen, after, prefetched, in_flight in runs:
        assert seen == [1] * units, "only the computing module has full parameters"
        assert after == 0, "every full parameter is freed after backward"
        assert prefetched == (2 * (units - 1) if prefetch else 0), "forward and backward prefetch"
        assert in_flight <= (2 if prefetch else 1)


# --- misuse and non-finite values ---------------------------------------------------------------

def misuse(cfg, case):
    model = foundation.GPT(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = foundation.synthetic_batch(cfg, 2 * world, 6, 0, rank, world)
    optimizer = zero.ZeRO(model, 1 if case == "nan" else 2)
    if case == "nan":  # one rank's gradient goes bad: every rank must see it, none may hide it
        model(tokens, targets).backward()
        if rank == 1:
            model.layers["0"].mlp.up_proj.weight.grad[0, 0] = float("nan")
        norm = optimizer.step()
        return norm.item(), all(not p.isfinite().all() for p in model.parameters())
    if case == "unused":  # backward reaches the embedding only
        model.embed(tokens).sum().backward()
    else:  # "twice": gradient accumulation is not what these stages do
        model(tokens, targets).backward()
        try:
            model(tokens, targets).backward()
        except RuntimeError as error:
            optimizer.finish_gradient_sync()  # the first backward's reduce-scatters are in flight
            return str(error)
    try:
        optimizer.finish_gradient_sync()
    except RuntimeError as error:
        return str(error)
    return "no error"


def accumulated_gradients(cfg, stage: int, global_batch: int, seq_len: int, micro: int,
                          all_under_no_sync: bool):
    """micro microbatches of this rank's rows, each loss / micro, accumulated under no_sync() (the
    last one outside it, or all inside and then finish_gradient_sync): the full gradients."""
    model = foundation.GPT(cfg)
    optimizer = zero.ZeRO(model, stage)
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, 0, rank, world)
    for i, (x, y) in enumerate(zip(tokens.chunk(micro), targets.chunk(micro))):
        last = i == micro - 1 and not all_under_no_sync
        with optimizer.no_sync() if not last else contextlib.nullcontext():
            (model(x, y) / micro).backward()
    optimizer.finish_gradient_sync()
    return optimizer.gather_full([u.grad_shard for u in optimizer.units])


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_accumulates_microbatches(rank_pool, stage):
    # The gradient of the mean over microbatches of their mean losses is the batch's: one device.
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    reference = foundation.train_single_device(cfg, 1, 8, 6)
    for all_inside in (False, True):
        for grads in rank_pool.run(2, accumulated_gradients, cfg, stage, 8, 6, 2, all_inside):
            assert_close_by_name(grads, reference.first_grads, "accumulated gradient",
                                 atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_misuse_is_refused_and_nan_propagates(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    for message in rank_pool.run(2, misuse, cfg, "twice"):
        assert "a second backward before step()" in message
    for message in rank_pool.run(2, misuse, cfg, "unused"):
        assert "parameters got no gradient this step" in message and "layers.0.attn_norm.weight" in message
    for norm, all_non_finite in rank_pool.run(2, misuse, cfg, "nan"):
        assert math.isnan(norm) and all_non_finite, "a NaN gradient must not come out finite"


# --- bad input: one clear error on every rank, before any collective ----------------------------

def build_zero(cfg, stage, wrap_first, freeze):
    model = foundation.GPT(cfg)
    if freeze:
        model.requires_grad_(False)
    if wrap_first == "ddp":
        foundation.BucketedDataParallel(model, bucket_bytes=4096)
    elif wrap_first == "zero":
        zero.ZeRO(model, 1)
    zero.ZeRO(model, stage)


@pytest.mark.parametrize("stage, wrap_first, freeze, message", [
    (4, None, False, r"stage=4 must be one of \(0, 1, 2, 3\)"),
    (-1, None, False, r"stage=-1 must be one of"),
    (2, "ddp", False, r"already synchronised by BucketedDataParallel"),
    (3, "zero", False, r"already synchronised by ZeRO-1"),
    (1, None, True, r"no trainable parameter"),
])
def test_bad_input_fails_on_every_rank_without_hanging(rank_pool, stage, wrap_first, freeze, message):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    rank_pool.expect_invalid(2, build_zero, cfg, stage, wrap_first, freeze, match=message)


def test_batch_not_divisible_by_the_group_fails_on_every_rank(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=30, dim=12, n_heads=2, ffn_dim=20)
    rank_pool.expect_invalid(2, zero.train_zero, cfg, 1, 3, 4, stage=2,
                             match="global_batch=3 is not divisible by the group size 2")


# --- the memory model --------------------------------------------------------------------------

def test_memory_model_reproduces_the_papers_table():
    """ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12, fp16 parameters and gradients."""
    totals = [float(sum(zero.zero_memory_per_rank(7_500_000_000, 64, s).values())) / 1e9 for s in zero.STAGES]
    printed = [round(totals[0]), round(totals[1], 1), round(totals[2], 1), round(totals[3], 2)]
    assert printed == [120, 31.4, 16.6, 1.88]


@given(psi=st.integers(1, 10**6), n=st.integers(1, 64))
def test_memory_model_shards_exactly_what_each_stage_shards(psi, n):
    full = zero.zero_memory_per_rank(psi, n, 0)
    for stage in zero.STAGES:
        mem = zero.zero_memory_per_rank(psi, n, stage)
        for i, key in enumerate(("optimizer", "grads", "params")):
            assert mem[key] == (full[key] / n if stage > i else full[key])


# --- the time model (lesson 10's planner) ---------------------------------------------------------

@pytest.mark.parametrize("stage", zero.STAGES)
def test_zero_hides_its_traffic_behind_compute_where_it_can(stage):
    """send at 1 B/s, no latency: seconds are bytes. Behind a long backward the reduction shows only
    its last unit's share; with no compute to hide behind, all of it. Stages 1-2's gather after the
    step never hides. Stage 3 gathers each unit before its forward and its backward in each
    microbatch: all but the first hide behind the previous unit, or show entirely. hide=False: all."""
    psi, n, units, m, send = 1200, 4, 10, 3, lambda nbytes, calls: float(nbytes)
    ops = zero.zero_traffic_per_step(psi, n, stage, 2, 2)
    reduce, gather = ops.get("reduce_scatter", 0) + ops.get("all_reduce", 0), ops.get("all_gather", 0)
    one = gather / 2 / units  # a unit's gather (stage 3)
    exposed = lambda last_backward, unit, **hide: zero.zero_exposed_seconds(  # noqa: E731
        psi, n, stage, units, m, 2, send, last_backward, (unit, unit), **hide)
    gathers = (one, one + 2 * m * (units - 1) * one) if stage == 3 else (gather, gather)
    assert exposed(1e9, 1e9) == pytest.approx(float(reduce / units + gathers[0]))
    assert exposed(0.0, 0.0) == pytest.approx(float(reduce + gathers[1]))
    assert exposed(1e9, 1e9, hide=False) == exposed(0.0, 0.0)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_the_steps_memory_traffic_counts_each_pass_of_this_zero(mixed_precision):
    """Bytes per element of ZeRO's passes outside its collectives, as step() runs them: on the full
    gradients the microbatches' accumulation (3 G each; stages 2-3 keep the first) and the zeroing
    (0-1: G) or flattening (2-3: 2 G); on the shard / n, the norm (G), fp32 copy and clip (mixed:
    G + 12; fp32: 8), fused AdamW (28), the bf16 copy (mixed: 6), stages 1-2's send copy (2 G)."""
    g, psi, n, m = (2 if mixed_precision else 4), 1000, 4, 3
    per_shard = 3 * g + (g + 12 if mixed_precision else 8) + 28 + 6 * mixed_precision
    full = {0: 3 * g * m + g, 1: 3 * g * m + g, 2: 3 * g * (m - 1) + 2 * g, 3: 3 * g * (m - 1) + 2 * g}
    for stage in zero.STAGES:
        shard = psi if stage == 0 else psi // n
        send_copy = 2 * g * (stage in (1, 2))
        assert zero.zero_step_bytes(psi, n, stage, m, mixed_precision) == (
            full[stage] * psi + (per_shard + send_copy) * shard)
    assert zero.zero_step_bytes(psi, 1, 1, m, mixed_precision) == (full[1] + per_shard) * psi  # no send copy


# --- the script itself -------------------------------------------------------------------------

def test_script_runs_as_plain_python():
    stdout = run_script("02_zero.py", "--nproc", "2", "--steps", "2", "--global-batch", "4",
                        "--seq-len", "8", timeout=900)
    assert len(re.findall(r"ZeRO-\d .* equal$", stdout, re.M)) == 8 and "DIFFERENT" not in stdout, stdout
    assert stdout.count("= formula") == 4 and "1.500 x DDP" in stdout, stdout
    assert "120.00 GB" in stdout and "1.88 GB" in stdout, stdout
    assert stdout.splitlines()[-1].startswith("Notice: every stage takes the one-device step"), stdout
