"""Lesson 09 as a specification: every composition of the mesh trains exactly like one device.

Tolerances (fp32 on CPU), measured then widened with margin (see the README's lesson-09 figures):
- loss per step: atol 2e-5. The parallel loss is a mean of means (microbatches, dp x cp ranks,
  vocabulary shards), the same sums in another order; later steps carry the parameter differences.
- step-0 gradients, every element of every parameter reassembled from the shards: atol 2e-6 +
  rtol 1e-4. Sums over tokens, tensor shards and ring blocks in another order. A real bug (a
  reduction done twice or missed, a microbatch loss not divided by m, a norm gradient not summed
  over tp) is off by the gradient itself, >= 25% relative.
- parameters after 3 AdamW steps at lr 1e-3 with eps 1e-6 (lesson 01's reason) and clipping at a
  norm below the gradients' (so the global norm is exercised): atol 2e-5. Any sync or clipping bug
  moves parameters by ~lr = 1e-3.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given
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
    if sizes not in _meshes:
        _meshes[sizes] = nine.build_mesh(sizes)
    mesh = _meshes[sizes]
    trainer = nine.Trainer(cfg, mesh, train, torch.device("cpu"))
    per_dp = train.global_batch // sizes.dp
    losses, grads = [], None
    for step in range(steps):
        tokens, targets = ddp.synthetic_batch(cfg, train.global_batch, train.seq_len, step)
        rows = torch.cat([tokens, targets[:, -1:]], dim=1)[mesh.coords["dp"] * per_dp:][:per_dp]
        losses.append(trainer.forward_backward(rows))
        if step == 0:
            grads = trainer.shards("grads")
        trainer.update()
    return losses, grads, trainer.shards("params"), trainer.summary()


def validate_on_rank(cfg, sizes, train):
    nine.validate(cfg, sizes, train, torch.distributed.get_world_size())


def check_against_reference(results, cfg, train, steps: int = STEPS) -> dict[str, float]:
    ref = zero_lesson.train_reference(cfg, steps, train.global_batch, train.seq_len, lr=train.lr,
                                      adam_eps=train.adam_eps, max_grad_norm=train.max_grad_norm)
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


def small_model(n_layers: int = 2, seed: int = 0) -> "ddp.ModelConfig":
    return ddp.ModelConfig(vocab_size=30, dim=16, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=24,
                           seed=seed)


def test_fixed_dense_mesh(rank_pool):
    cfg, sizes = small_model(), nine.MeshSizes(dp=2, pp=2, tp=2)
    train = nine.TrainConfig(global_batch=8, seq_len=8, zero_stage=1, microbatches=2,
                             lr=LR, adam_eps=ADAM_EPS, max_grad_norm=0.5)
    results = rank_pool.run(sizes.world, train_on_mesh, cfg, sizes, train, STEPS, timeout=300)
    print(check_against_reference(results, cfg, train))
