"""Lesson 09 as a specification: every composition of the mesh trains exactly like one device.

Tolerances (fp32 on CPU), measured then widened with margin: over 134 configurations (two runs of
the dev profile's 60 drawn meshes, the pinned examples and the 16-rank run) the largest differences
were 6.0e-7 on losses, 1.8e-7 on step-0 gradients and 4.1e-7 on parameters after 3 steps.
- loss per step: atol 2e-5 (33x). The parallel loss is a mean of means (microbatches, dp x cp
  ranks, vocabulary shards), the same sums in another order.
- step-0 gradients, every element of every parameter reassembled from the ShardSpecs: atol 2e-6
  (11x) + rtol 1e-4. A real bug (a reduction done twice or missed, a microbatch loss not divided by
  m, a norm or expert gradient not summed over tp, an expert gradient not divided by ep) is off by
  the gradient itself, >= 25% relative.
- parameters after 3 AdamW steps at lr 1e-3, with eps 1e-6 (lesson 01's reason) and clipping at
  0.5, below the gradients' norm, so the norm over the whole mesh decides the step: atol 2e-5
  (48x). Any sync or clipping bug moves parameters by ~lr = 1e-3.
MoE models are dropless without balancing (09 refuses the rest); the reference is 02's
train_reference (AdamW + clip_grad_norm_) on the same model converted by lesson 06.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import run_script

ddp = importlib.import_module("01_ddp")
zero_lesson = importlib.import_module("02_zero")
nine = importlib.import_module("09_full_train")

LOSS_ATOL, GRAD_ATOL, GRAD_RTOL, PARAM_ATOL, ADAM_EPS, LR, STEPS = 2e-5, 2e-6, 1e-4, 2e-5, 1e-6, 1e-3, 3

_meshes: dict = {}  # per worker process: new_group is slow, so each mesh's groups are built once


def train_on_mesh(cfg, sizes, train, steps: int):
    """On every rank: train `steps` steps on lesson 01's synthetic batches; return the losses, the
    step-0 gradient shards, the final parameter shards and the summary."""
    nine.validate(cfg, sizes, train, torch.distributed.get_world_size())  # before any collective
    if sizes not in _meshes:
        _meshes[sizes] = nine.build_mesh(sizes)
    mesh = _meshes[sizes]
    trainer = nine.Trainer(cfg, mesh, train, torch.device("cpu"))
    losses, grads = [], None
    for step in range(steps):
        losses.append(trainer.forward_backward(nine.dp_rows(cfg, train, step, mesh)))
        if step == 0:
            grads = trainer.shards("grads")
        trainer.update()
    return losses, grads, trainer.shards("params"), trainer.summary()


def check_against_reference(results, cfg, train, steps: int = STEPS) -> dict[str, float]:
    ref = zero_lesson.train_reference(cfg, steps, train.global_batch, train.seq_len, lr=train.lr,
                                      adam_eps=train.adam_eps, max_grad_norm=train.max_grad_norm,
                                      transform=nine.reference_transform(train))
    diffs = {}
    for losses, *_ in results:
        assert losses == pytest.approx(ref.losses, abs=LOSS_ATOL), (losses, ref.losses)
    diffs["loss"] = max(abs(a - b) for r in results for a, b in zip(r[0], ref.losses))
    for index, key, expected in ((1, "grads", ref.first_grads), (2, "params", ref.params)):
        got = nine.assemble([piece for r in results for piece in r[index]])
        assert sorted(got) == sorted(expected), "some parameter is held by no rank"
        for name, tensor in got.items():
            assert not tensor.isnan().any(), f"{name}: some element is held by no rank"
            tol = dict(atol=GRAD_ATOL, rtol=GRAD_RTOL) if key == "grads" else dict(atol=PARAM_ATOL, rtol=0)
            torch.testing.assert_close(tensor, expected[name], **tol, msg=lambda m: f"{key} {name}: {m}")
        diffs[key] = ddp.max_abs_diff(got, expected)
    return diffs


MOE = nine.moe_lesson.MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=8, aux_loss_coef=0.0)


def small_model(n_layers: int = 2, seed: int = 0) -> "ddp.ModelConfig":
    return ddp.ModelConfig(vocab_size=30, dim=16, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=24,
                           seed=seed)


def check_copies_agree(results) -> None:
    """Every element of every parameter is held somewhere, and its copies (tp-replicated norms,
    ZeRO-0-2's dp x cp replicas) hold the same value."""
    seen: dict[str, dict[int, float]] = {}
    for _, _, params, _ in results:
        for spec, values in params:
            index = spec.global_indices()
            copies = seen.setdefault(spec.name, {})
            for i, v in zip(index[index >= 0].tolist(), values[index >= 0].tolist()):
                assert abs(copies.setdefault(i, v) - v) <= 1e-6, f"{spec.name}[{i}]: copies differ"
    for name, copies in seen.items():
        assert len(copies) == math.prod(_shape(results, name)), f"{name}: some element is held by no rank"


def _shape(results, name: str) -> tuple[int, ...]:
    return next(spec.full_shape for r in results for spec, _ in r[2] if spec.name == name)


# Meshes with each dimension in {1, 2, 4} and at most 8 ranks, in order of size (shrinks to small).
MESHES = sorted((nine.MeshSizes(dp, pp, cp, tp) for dp in (1, 2, 4) for pp in (1, 2, 4) for cp in (1, 2, 4)
                 for tp in (1, 2, 4) if dp * pp * cp * tp <= 8), key=lambda m: (m.world, m.dp, m.pp, m.cp))


@st.composite
def configurations(draw):
    sizes = draw(st.sampled_from(MESHES), label="mesh")
    moe = draw(st.booleans(), label="moe")
    if moe:  # expert parallelism borrows from dp x cp
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if (sizes.dp * sizes.cp) % e == 0]), label="ep")
        sizes = nine.MeshSizes(sizes.dp, sizes.pp, sizes.cp, sizes.tp, ep)
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved"] if sizes.pp > 1 else ["1f1b"]))
    virtual = 2 if schedule == "interleaved" else 1
    microbatches = draw(st.sampled_from([1, 2, 4]))
    if schedule == "interleaved":
        microbatches = sizes.pp * draw(st.integers(1, 2))
    sequence_parallel = sizes.tp > 1 and draw(st.booleans(), label="sequence_parallel")
    seq_len = 2 * sizes.cp * sizes.tp * draw(st.integers(1, 2))
    n_kv_heads = draw(st.sampled_from([h for h in (2, 4) if h % sizes.tp == 0] or [4]))
    cfg = ddp.ModelConfig(vocab_size=draw(st.sampled_from([30, 32])), dim=16, n_heads=4, n_kv_heads=n_kv_heads,
                          ffn_dim=24, n_layers=sizes.pp * virtual + draw(st.integers(0, 1)),
                          seed=draw(st.integers(0, 9)))
    train = nine.TrainConfig(global_batch=sizes.dp * microbatches * draw(st.integers(1, 2)), seq_len=seq_len,
                             zero_stage=draw(st.integers(0, 3)), schedule=schedule, microbatches=microbatches,
                             virtual=virtual, sequence_parallel=sequence_parallel, lr=LR, adam_eps=ADAM_EPS,
                             max_grad_norm=0.5, moe=MOE if moe else None)
    return cfg, sizes, train


def pinned(dims, zero_stage, schedule, microbatches, sp, ep=None, n_layers=2):
    """A configuration the 15 drawn examples may miss, run on every CI pass."""
    sizes = nine.MeshSizes(*dims, **({"ep": ep} if ep else {}))
    cfg = small_model(n_layers)
    train = nine.TrainConfig(global_batch=sizes.dp * microbatches, seq_len=4 * sizes.cp * sizes.tp,
                             zero_stage=zero_stage, schedule=schedule, microbatches=microbatches,
                             virtual=2 if schedule == "interleaved" else 1, sequence_parallel=sp, lr=LR,
                             adam_eps=ADAM_EPS, max_grad_norm=0.5, moe=MOE if ep else None)
    return (cfg, sizes, train)


@given(configuration=configurations())
@example(configuration=pinned((1, 2, 1, 2), 3, "interleaved", 2, True, n_layers=4))
@example(configuration=pinned((2, 1, 2, 2), 1, "1f1b", 1, False, ep=4))
@example(configuration=pinned((2, 2, 1, 2), 2, "zb-h1", 2, True, ep=2))
@example(configuration=pinned((1, 4, 1, 2), 0, "1f1b", 4, False, n_layers=4))
@example(configuration=pinned((2, 1, 2, 1), 3, "1f1b", 2, False, ep=2))
def test_any_mesh_equals_one_device(rank_pool, configuration):
    cfg, sizes, train = configuration
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS, timeout=300)
    check_against_reference(results, cfg, train)
    check_copies_agree(results)
    for _, _, _, summary in results:
        assert summary["held"] == summary["memory_formula"]
        if train.schedule != "zb-h1" or train.zero_stage < 3:  # zb-h1's W may re-gather a unit
            assert all(summary["traffic"][k] == f for k, f in summary["traffic_formula"].items()
                       if f is not None), (summary["traffic"], summary["traffic_formula"])  # None: routing
        assert summary["traffic"].keys() == summary["traffic_formula"].keys()


def test_sixteen_ranks_every_dimension_two(rank_pool):
    cfg, sizes = small_model(), nine.MeshSizes(dp=2, pp=2, cp=2, tp=2, ep=2)
    train = nine.TrainConfig(global_batch=8, seq_len=16, zero_stage=2, microbatches=2, sequence_parallel=True,
                             lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5, moe=MOE)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS, timeout=400)
    check_against_reference(results, cfg, train)
    check_copies_agree(results)
    for *_, s in results:
        assert all(s["traffic"][k] == f for k, f in s["traffic_formula"].items() if f is not None), s


def test_fp8_flag_trains_close_to_fp32(rank_pool):
    """Float8Linear (lesson 08) runs on the CPU through torch._scaled_mm. Its tensorwise scales are
    per TP shard and per microbatch, so it is compared with the fp32 reference loosely: e4m3's 2^-4
    relative rounding on the GEMMs moved the loss by 5e-4 at most over 3 steps here; a missed
    reduction moves it by far more. And it must differ: FP8 really ran."""
    cfg, sizes = small_model(), nine.MeshSizes(dp=2, tp=2)
    train = nine.TrainConfig(global_batch=4, seq_len=8, microbatches=1, fp8=True, lr=LR, adam_eps=ADAM_EPS)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS, timeout=300)
    ref = zero_lesson.train_reference(cfg, STEPS, train.global_batch, train.seq_len, lr=LR, adam_eps=ADAM_EPS)
    differences = [abs(a - b) for a, b in zip(results[0][0], ref.losses)]
    assert 1e-7 < max(differences) < 5e-3, differences


def test_bf16_mixed_precision_follows_its_one_device_twin(rank_pool):
    """ZeRO's bf16 compute with fp32 masters through pipeline boundaries (bf16 activations), the
    ring and SP, against 02's one-device bf16 twin: bf16 keeps 8 bits, so sums in another order
    differ by ~1e-3 relative; the losses were within 3.6e-5 here (allowed: 5e-4). A missed
    reduction would be off by the loss's own scale."""
    cfg, sizes = small_model(), nine.MeshSizes(pp=2, cp=2, tp=2)
    train = nine.TrainConfig(global_batch=4, seq_len=8, microbatches=2, zero_stage=3, sequence_parallel=True,
                             lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5, mixed_precision=True)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS, timeout=300)
    ref = zero_lesson.train_reference(cfg, STEPS, 4, 8, lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5,
                                      mixed_precision=True)
    assert results[0][0] == pytest.approx(ref.losses, abs=5e-4)


def test_mesh_coordinates_and_groups():
    sizes = nine.MeshSizes(dp=2, pp=2, cp=2, tp=2)
    assert [sizes.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1], "tp must vary fastest"
    assert sizes.coords(13) == dict(dp=1, pp=1, cp=0, tp=1)
    assert all(sizes.rank(**sizes.coords(r)) == r for r in range(sizes.world))
    for dims, n_groups in ((("tp",), 8), (("dp", "cp"), 4), (("pp",), 8)):
        groups = sizes.groups(dims)
        assert len(groups) == n_groups and sorted(r for g in groups for r in g) == list(range(16))
    assert sizes.groups(("tp",))[0] == [0, 1] and sizes.groups(("dp", "cp"))[0] == [0, 2, 8, 10]
    assert "rank 13: dp=1 pp=1 cp=0 tp=1\n" in nine.rank_map(sizes)
    with_ep = nine.MeshSizes(dp=2, pp=2, cp=2, tp=2, ep=4)
    assert with_ep.expert_groups(False)[0] == [0, 2, 8, 10] and with_ep.expert_groups(True)[0] == [0]
    assert "rank 10: dp=1 pp=0 cp=1 tp=0 ep=3" in nine.rank_map(with_ep)
    ep2 = nine.MeshSizes(dp=2, cp=2, ep=2)  # ep groups: cp pairs; expert-data groups: the dp pairs
    assert ep2.expert_groups(False) == [[0, 1], [2, 3]] and ep2.expert_groups(True) == [[0, 2], [1, 3]]


def test_invalid_configurations_list_every_violation(rank_pool):
    cfg = ddp.ModelConfig(vocab_size=30, dim=12, n_layers=1, n_heads=3, ffn_dim=20)
    train = nine.TrainConfig(global_batch=3, seq_len=6, zero_stage=4, microbatches=2, sequence_parallel=True)
    rank_pool.expect_invalid(4, train_on_mesh, cfg, nine.MeshSizes(dp=2, pp=2, tp=2), train, 1,
                             match=r"(?s)2 x 2 x 1 x 2 = 8 is not the world size 4.*n_heads=3 is not "
                                   r"divisible by tp=2.*stage=4.*global_batch=3 is not divisible by dp=2")
    good = nine.TrainConfig(global_batch=4, seq_len=6, microbatches=2)
    rank_pool.expect_invalid(4, train_on_mesh, small_model(1), nine.MeshSizes(pp=2, cp=2), good, 1,
                             match=r"(?s)seq_len=6 is not divisible by 2 x cp = 4.*n_layers=1 cannot fill")
    moe_train = nine.TrainConfig(global_batch=4, seq_len=8, moe=nine.moe_lesson.MoEConfig(n_experts=3))
    rank_pool.expect_invalid(4, train_on_mesh, small_model(), nine.MeshSizes(dp=2, tp=2, ep=4), moe_train, 1,
                             match=r"(?s)ep=4 must divide dp x cp = 2.*")
    rank_pool.expect_invalid(4, train_on_mesh, small_model(), nine.MeshSizes(dp=4, ep=2), moe_train, 1,
                             match=r"(?s)n_experts=3 is not divisible by ep=2.*dropless and unbalanced")
    with pytest.raises(ValueError, match="ep=2 needs an MoE model"):
        nine.validate(small_model(), nine.MeshSizes(dp=2, ep=2), good, 2)
    with pytest.raises(ValueError, match="global_batch=0 must be >= 1"):
        nine.validate(small_model(), nine.MeshSizes(), nine.TrainConfig(global_batch=0), 1)
    with pytest.raises(ValueError, match="every mesh size must be >= 1"):
        nine.validate(small_model(), nine.MeshSizes(dp=0), good, 1)


def nan_step(cfg, sizes, train):
    """One NaN weight on the first stage: the loss, the norm and every parameter must not come out
    finite (clipping by a NaN norm must not hide it)."""
    trainer = nine.Trainer(cfg, nine.build_mesh(sizes), train, torch.device("cpu"))
    if 0 in trainer.stages:
        with torch.no_grad():
            trainer.stages[0].layers["0"].attn_norm.weight[0] = float("nan")
    loss = trainer.forward_backward(nine.dp_rows(cfg, train, 0, trainer.mesh))
    norm = trainer.update()
    return loss, norm, all(not values.isfinite().all() for spec, values in trainer.shards("params")
                           if spec.stage == 0)


def test_a_nan_propagates_to_every_rank(rank_pool):
    sizes = nine.MeshSizes(dp=2, pp=2)
    train = nine.TrainConfig(global_batch=4, seq_len=8, microbatches=2, zero_stage=0, max_grad_norm=1.0)
    for loss, norm, stage0_all_nan in rank_pool.run(sizes.world, nan_step, small_model(), sizes, train):
        assert math.isnan(loss) and math.isnan(norm) and stage0_all_nan


def wrong_rows(cfg, sizes, train):
    trainer = nine.Trainer(cfg, nine.build_mesh(sizes), train, torch.device("cpu"))
    trainer.forward_backward(torch.zeros(train.global_batch, train.seq_len, dtype=torch.long))


def test_rows_of_the_wrong_shape_are_refused(rank_pool):
    train = nine.TrainConfig(global_batch=4, seq_len=8)
    rank_pool.expect_invalid(2, wrong_rows, small_model(), nine.MeshSizes(dp=2), train,
                             match=r"rows of shape \(4, 8\): this dp rank expects .* = \(2, 9\)")


def test_main_runs_and_prints_the_check():
    out = run_script("09_full_train.py", *"--dp 2 --tp 2 --ep 2 --steps 2 --seq-len 16".split())
    assert "max |difference| from one device" in out and "rank  3: dp=1 pp=0 cp=0 tp=1" in out
    assert "MoE 4 experts top-2 over ep=2" in out
