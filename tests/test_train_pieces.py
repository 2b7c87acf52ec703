"""The mesh-agnostic pieces of lesson 09's training run as a specification: data, schedule, MFU,
activation recompute, sharded checkpoints that load on another mesh, the NaN guard, sampling.

Tolerances: none. Data, checkpoints and sampling are copies and integer work: exact. Recompute
runs the same kernels on the same inputs a second time, so loss and every gradient (parameters
after two ZeRO-3 steps) are bitwise equal to no recompute on the CPU (measured: equal in every
example); a tolerance would only hide a recompute that reads the wrong input. A resumed run repeats
the same operations on the restored state: bitwise equal losses. Saved bytes = formula (integers).
"""
from __future__ import annotations

import importlib
import math
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import ROOT

ddp = importlib.import_module("01_ddp")
tpm = importlib.import_module("03_tensor_parallel")
zm = importlib.import_module("02_zero")
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
    with pytest.raises(ValueError, match="dp_rank=2 is not in \\[0, 2\\)"):
        tp.ShardedLoader(torch.arange(100), 4, 6, 2, 2)
    with pytest.raises(ValueError, match="seq_len=0 and global_batch=2 must be >= 1"):
        tp.ShardedLoader(torch.arange(100), 0, 2)
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
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA A100 80GB PCIe", 312e12), ("Tesla T4", None)])
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


# --- activation recompute -----------------------------------------------------------------------

def loss_and_grads(model, tokens, targets, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens, targets, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_training(runs: dict) -> None:
    """Bitwise: recompute reruns the same kernels on the same inputs (module docstring)."""
    loss, grads = runs["none"]
    for mode in ("selective", "full"):
        assert torch.equal(runs[mode][0], loss), mode
        assert all(torch.equal(runs[mode][1][n], g) for n, g in grads.items()), mode


def layer_bytes(layer, cfg, batch: int, seq_len: int, shards: int = 1) -> int:
    """Bytes one block saves for backward, on its input (b, s / shards, h) (lesson 03's setup)."""
    x = torch.randn(batch, seq_len // shards, cfg.dim, requires_grad=True)
    cos, sin = ddp.rope_angles(torch.arange(seq_len), cfg.head_dim, cfg.rope_theta)
    out, saved = tp.activation_bytes(lambda: layer(x, cos, sin), layer.parameters(), x.device)
    out.sum().backward()
    return saved


@given(n_heads=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2]), layers=st.integers(1, 2),
       batch=st.integers(1, 3), seq_len=st.integers(1, 9), seed=st.integers(0, 99))
def test_recompute_equals_no_recompute_and_saves_what_the_formula_says(n_heads, groups, layers, batch,
                                                                         seq_len, seed):
    cfg = ddp.ModelConfig(vocab_size=40, dim=4 * n_heads, n_layers=layers, n_heads=n_heads,
                          n_kv_heads=max(1, n_heads // groups), ffn_dim=12, seed=seed)
    batch_data = ddp.synthetic_batch(cfg, batch, seq_len, step=0)
    runs, saved = {}, {}
    for mode in tp.RECOMPUTE_MODES:
        model = tp.apply_recompute(ddp.GPT(cfg), mode)
        names = [n for n, _ in model.named_parameters()]
        assert names == [n for n, _ in ddp.GPT(cfg).named_parameters()], "names are kept"
        runs[mode] = loss_and_grads(model, *batch_data)
        saved[mode] = layer_bytes(model.layers["0"], cfg, batch, seq_len)
        assert saved[mode] == tp.layer_activation_formula(cfg, batch, seq_len, 1, False, mode), mode
    assert_same_training(runs)
    assert saved["full"] < saved["selective"] < saved["none"]


def test_recompute_refuses_bad_modes_and_a_second_application():
    with pytest.raises(ValueError, match="mode 'some' must be one of \\('none', 'selective', 'full'\\)"):
        tp.apply_recompute(ddp.GPT(ddp.ModelConfig()), "some")
    model = tp.apply_recompute(ddp.GPT(ddp.ModelConfig()), "full")
    with pytest.raises(ValueError, match="already recomputes \\(full\\)"):
        tp.apply_recompute(model, "selective")


def recompute_tensor_parallel(cfg, batch: int, seq_len: int, sequence_parallel: bool) -> tuple:
    """On each rank: loss and local gradients under each mode, and layer 0's saved bytes."""
    runs, saved = {}, {}
    for mode in tp.RECOMPUTE_MODES:
        model = tpm.apply_tensor_parallel(ddp.GPT(cfg), None, sequence_parallel)
        tp.apply_recompute(model, mode)
        runs[mode] = loss_and_grads(model, *ddp.synthetic_batch(cfg, batch, seq_len, step=0))
        shards = dist.get_world_size() if sequence_parallel else 1
        saved[mode] = layer_bytes(model.layers["0"], cfg, batch, seq_len, shards)
    return runs, saved


def recompute_context_parallel(cfg, batch: int, seq_len: int) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = cpm.validate_context_parallel(seq_len, cfg.n_heads, cp, "ring", True)
    tokens, targets = (layout.shard(t, rank, dim=1) for t in ddp.synthetic_batch(cfg, batch, seq_len, 0))
    runs = {}
    for mode in tp.RECOMPUTE_MODES:
        model = ddp.GPT(cfg, attn_fn=cpm.ContextParallelAttention(None, "ring", True))
        runs[mode] = loss_and_grads(tp.apply_recompute(model, mode), tokens, targets,
                                    positions=layout.positions(rank))
    return runs


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_after_tensor_parallelism(rank_pool, sequence_parallel):
    cfg = ddp.ModelConfig(vocab_size=33, dim=16, n_heads=4, n_kv_heads=2, ffn_dim=24, n_layers=2)
    for runs, saved in rank_pool.run(2, recompute_tensor_parallel, cfg, 2, 6, sequence_parallel):
        assert_same_training(runs)
        for mode, got in saved.items():
            assert got == tp.layer_activation_formula(cfg, 2, 6, 2, sequence_parallel, mode), mode


def test_recompute_with_ring_attention(rank_pool):
    cfg = ddp.ModelConfig(vocab_size=33, dim=16, n_heads=2, ffn_dim=24, n_layers=2)
    for runs in rank_pool.run(2, recompute_context_parallel, cfg, 2, 8):
        assert_same_training(runs)


def recompute_zero3(cfg, batch: int, seq_len: int) -> dict:
    """ZeRO-3 gathers a block's parameters in hooks around Block.__call__ and, in backward, when
    the block's output gradient arrives: before the recompute reads them."""
    runs = {}
    for mode in tp.RECOMPUTE_MODES:
        model = tp.apply_recompute(ddp.GPT(cfg), mode)
        zero, losses = zm.ZeRO(model, stage=3), []
        for step in range(2):
            x, y = ddp.synthetic_batch(cfg, batch, seq_len, step, dist.get_rank(), 2)
            loss = model(x, y)
            loss.backward()
            losses.append(loss.detach())
            zero.step()
            zero.zero_grad()
        runs[mode] = (torch.stack(losses), zero.gather_full([u.master for u in zero.units]))
    return runs


def test_recompute_under_zero3(rank_pool):
    cfg = ddp.ModelConfig(vocab_size=33, dim=16, n_heads=2, ffn_dim=24, n_layers=2)
    for runs in rank_pool.run(2, recompute_zero3, cfg, 4, 6):
        assert_same_training(runs)


# --- checkpoints --------------------------------------------------------------------------------

CONFIG = tp.checkpoint_config(ddp.ModelConfig())
KINDS = ("param", "exp_avg", "exp_avg_sq")


@given(shape=st.lists(st.integers(0, 4), max_size=3), data=st.data())
def test_a_piece_indexes_the_elements_it_takes(shape, data):
    slices = tuple(tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2))))
                   for n in shape)
    box = math.prod(b - a for a, b in slices)
    lo = data.draw(st.integers(0, box))
    piece = tp.Piece("w", tuple(shape), slices, data.draw(st.sampled_from([None, (lo, box)])))
    full = torch.arange(math.prod(shape)).view(shape)
    assert torch.equal(piece.take(full).flatten(), piece.global_index())
    assert piece.take(full).shape == piece.local_shape


def test_bad_pieces_are_refused():
    with pytest.raises(ValueError, match="slices \\(\\(0, 5\\),\\) do not fit the shape \\(4,\\)"):
        tp.Piece("w", (4,), ((0, 5),))
    with pytest.raises(ValueError, match="flat range \\(2, 7\\) outside the 6 elements"):
        tp.Piece("w", (2, 4), ((0, 2), (1, 4)), (2, 7))


@given(shapes=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), min_size=1, max_size=4),
       dp=st.integers(1, 5))
def test_a_zero_shard_of_a_flat_unit_is_cut_into_pieces(shapes, dp):
    # a rank's tensor-parallel boxes (here the first rows of each tensor) flattened together, then
    # split into dp shards: the pieces of a shard take exactly its elements from the full tensors
    boxes = [tp.Piece(f"w{i}", (rows + 1, cols), ((0, rows), (0, cols)))
             for i, (rows, cols) in enumerate(shapes)]
    full = {b.name: torch.randn(b.shape) for b in boxes}
    flat = torch.cat([b.take(full[b.name]).flatten() for b in boxes])
    for lo, hi in bounds(len(flat), dp):
        shard = torch.zeros(hi - lo)
        for piece, offset in tp.flat_shard_pieces(boxes, lo, hi):
            shard[offset:offset + piece.local_shape[0]] = piece.take(full[piece.name])
        assert torch.equal(shard, flat[lo:hi])


def bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """n split into parts ranges, uneven and possibly empty as with padded shards."""
    size = math.ceil(n / parts)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def layout(shapes: dict[str, tuple[int, ...]], tp_size: int, dp_size: int, dim: dict[str, int | None]
           ) -> list[list[tp.Piece]]:
    """Rank (d, t) of a dp x tp mesh: tensor parallelism slices `dim` of each tensor (None:
    replicated), ZeRO splits each rank's box flattened into dp ranges."""
    ranks = []
    for d in range(dp_size):
        for t in range(tp_size):
            pieces = []
            for name, shape in shapes.items():
                slices = [(0, n) for n in shape]
                if dim[name] is not None:
                    slices[dim[name]] = bounds(shape[dim[name]], tp_size)[t]
                box = math.prod(b - a for a, b in slices)
                pieces.append(tp.Piece(name, shape, tuple(slices), bounds(box, dp_size)[d]))
            ranks.append(pieces)
    return ranks


def save_threaded(folder, step: int, ranks: list[list[tp.Piece]], tensors: dict, meta=None,
                  config=CONFIG, fail_rank: int | None = None) -> list[BaseException | None]:
    """Every rank's save_checkpoint in its own thread, a threading.Barrier as the barrier. A rank
    that raises aborts the barrier, so the others stop as a real job's would."""
    barrier, errors = threading.Barrier(len(ranks), timeout=30), [None] * len(ranks)

    def rank(r: int) -> None:
        try:
            if r == fail_rank:
                raise RuntimeError(f"rank {r} killed")
            pieces = [(p, {k: p.take(tensors[p.name][k]) for k in KINDS}) for p in ranks[r]]
            tp.save_checkpoint(folder, step, pieces, meta or {}, config, r, len(ranks), barrier.wait)
        except BaseException as error:  # noqa: BLE001 - the test inspects every rank's outcome
            errors[r] = error
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def random_tensors(shapes: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: {k: torch.randn(shape, generator=gen) for k in KINDS}
            for name, shape in shapes.items()}


def assert_loads(folder, ranks: list[list[tp.Piece]], tensors: dict) -> None:
    for r, pieces in enumerate(ranks):
        loaded, _ = tp.load_checkpoint(folder, pieces, CONFIG, r)
        for piece, got in zip(pieces, loaded):
            for k in KINDS:
                assert torch.equal(got[k], piece.take(tensors[piece.name][k])), (piece, k)


MESHES = st.tuples(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3]))


@given(saved_mesh=MESHES, loaded_mesh=MESHES, rows=st.integers(1, 7), cols=st.integers(1, 6),
       seed=st.integers(0, 99))
def test_a_checkpoint_loads_exactly_on_another_mesh(tmp_path_factory, saved_mesh, loaded_mesh, rows,
                                                     cols, seed):
    folder = tmp_path_factory.mktemp("ckpt")
    shapes = {"embed": (rows, cols), "wo": (cols, rows), "norm": (cols,), "scale": ()}
    dims = {"embed": 0, "wo": 1, "norm": None, "scale": None}  # column, row parallel, replicated
    tensors = random_tensors(shapes, seed)
    errors = save_threaded(folder, 5, layout(shapes, *saved_mesh, dims), tensors)
    assert errors == [None] * math.prod(saved_mesh)
    assert_loads(folder, layout(shapes, *loaded_mesh, dims), tensors)
    assert_loads(folder, layout(shapes, *loaded_mesh, {n: 0 if s else None for n, s in shapes.items()}),
                 tensors)  # another sharded dimension, too


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    shapes, dims = {"w": (6, 4), "b": (4,)}, {"w": 0, "b": None}
    ranks = layout(shapes, 2, 2, dims)
    old, new = random_tensors(shapes, 0), random_tensors(shapes, 1)
    assert save_threaded(tmp_path, 1, ranks, old, {"loader": {"epoch": 0, "position": 1}}) == [None] * 4
    # rank 2 dies before writing: the others wait at the barrier, which breaks; LATEST stays
    errors = save_threaded(tmp_path, 2, ranks, new, fail_rank=2)
    assert all(errors), errors
    # a kill in the middle of writing a file: a partial .tmp, never renamed
    real_save = torch.save

    def killed_midway(obj, f):
        if Path(f.name).name.startswith("rank00001"):
            f.write(b"PK\x03\x04 partial")
            raise KeyboardInterrupt("killed")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", killed_midway)
    assert all(save_threaded(tmp_path, 3, ranks, new))
    monkeypatch.undo()
    assert (tmp_path / "step_00000003" / "rank00001.pt.tmp").exists()
    assert tp.latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert_loads(tmp_path, layout(shapes, 4, 1, dims), old)
    _, meta = tp.load_checkpoint(tmp_path, [], CONFIG)
    assert meta["step"] == 1 and meta["loader"] == {"epoch": 0, "position": 1} and meta["world"] == 4
    # the next complete save takes over and removes the old and the partial folders
    assert save_threaded(tmp_path, 4, ranks, new) == [None] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_00000004"]
    assert_loads(tmp_path, layout(shapes, 1, 3, dims), new)


KILLED_SAVE = """
import os, signal, sys, torch
import train_pieces as tp
folder, where = sys.argv[1:]
kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
piece = tp.Piece.whole("w", (1000,))
save = lambda step, barrier: tp.save_checkpoint(
    folder, step, [(piece, {"param": torch.full((1000,), float(step))})], {}, {}, 0, 1, barrier)
save(1, lambda: None)
if where == "writing":
    real_save = torch.save
    torch.save = lambda obj, f: (real_save(obj, f), f.flush(), f.truncate(500), kill())
save(2, kill)  # "barrier": every file is written, LATEST not moved yet
"""


@pytest.mark.parametrize("where", ["writing", "barrier"])
def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, where):
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), where], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = tmp_path / "step_00000002" / ("rank00000.pt.tmp" if where == "writing" else "meta.pt")
    assert partial.exists(), "the process died inside the second save"
    (loaded,), meta = tp.load_checkpoint(tmp_path, [tp.Piece.whole("w", (1000,))], {})
    assert meta["step"] == 1 and torch.equal(loaded["param"], torch.ones(1000))


def test_saving_the_step_already_saved_keeps_it(tmp_path):
    shapes, dims = {"w": (3, 2)}, {"w": 0}
    tensors = random_tensors(shapes, 0)
    save_threaded(tmp_path, 7, layout(shapes, 2, 1, dims), tensors)
    before = (tmp_path / "step_00000007" / "rank00000.pt").stat().st_mtime_ns
    again = save_threaded(tmp_path, 7, layout(shapes, 2, 1, dims), random_tensors(shapes, 1))
    assert again == [None] * 2
    assert (tmp_path / "step_00000007" / "rank00000.pt").stat().st_mtime_ns == before
    assert_loads(tmp_path, layout(shapes, 1, 1, dims), tensors)


def test_another_model_configuration_is_refused(tmp_path):
    tensors = random_tensors({"w": (2,)}, 0)
    save_threaded(tmp_path, 1, layout({"w": (2,)}, 1, 1, {"w": None}), tensors)
    other = tp.checkpoint_config(ddp.ModelConfig(dim=32, n_layers=3))
    with pytest.raises(ValueError, match="another model configuration: dim=64 \\(this model: 32\\), "
                                         "n_layers=2 \\(this model: 3\\); refusing"):
        tp.load_checkpoint(tmp_path, [tp.Piece.whole("w", (2,))], other)
    assert tp.checkpoint_config(ddp.ModelConfig(seed=5)) == CONFIG, "the seed does not matter"


def test_elements_no_saved_piece_holds_are_a_clear_error(tmp_path):
    shapes = {"w": (4, 3)}
    ranks = layout(shapes, 2, 1, {"w": 0})
    save_threaded(tmp_path, 1, [ranks[0], []], random_tensors(shapes, 0))  # rank 1 saved nothing
    with pytest.raises(ValueError, match="w: 6 of the 12 elements of .* are in no saved piece"):
        tp.load_checkpoint(tmp_path, [tp.Piece.whole("w", (4, 3))], CONFIG)
    with pytest.raises(ValueError, match="w: saved with global shape \\(4, 3\\), wanted \\(3, 4\\)"):
        tp.load_checkpoint(tmp_path, [tp.Piece.whole("w", (3, 4))], CONFIG)
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        tp.load_checkpoint(tmp_path / "nothing", [], CONFIG)
    with pytest.raises(ValueError, match="w: tensors of \\[\\(2, 2\\)\\] for a piece of shape \\(6,\\)"):
        tp.save_checkpoint(tmp_path, 2, [(ranks[0][0], {"param": torch.zeros(2, 2)})], {}, CONFIG,
                           0, 1, lambda: None)


def test_a_whole_model_loads_for_sampling_with_rng_state(tmp_path):
    cfg = ddp.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32)
    trained = ddp.GPT(cfg)
    pieces = [(tp.Piece.whole(n, p.shape), {"param": p}) for n, p in trained.named_parameters()]
    torch.manual_seed(3)
    tp.save_checkpoint(tmp_path, 9, pieces, {}, tp.checkpoint_config(cfg), 0, 1, lambda: None)
    after_save = torch.rand(4)
    fresh = ddp.GPT(ddp.ModelConfig(**{**vars(cfg), "seed": 1}))
    meta = tp.load_model(fresh, tmp_path, tp.checkpoint_config(cfg))
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters(), strict=True))
    tp.set_rng_state(meta["rng"])
    assert torch.equal(torch.rand(4), after_save), "the RNG continues where the saved run was"


def train_steps(model, optimizer, loader, steps: range, losses: list) -> None:
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = tp.learning_rate(step, 3e-3, 2, 6, 3e-4)
        loss = model(*next(loader))
        loss.backward()
        tp.check_finite_loss(loss.item(), step)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_resuming_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path):
    # The pieces together on one device: bytes of text, the loader, the schedule, AdamW, and a
    # checkpoint of parameters, moments and loader position halfway. Bitwise equal losses.
    cfg = ddp.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32)
    train, _ = tp.split_tokens(tp.read_tokens(None, max_bytes=4000), 16, 4)

    def fresh() -> tuple:
        model = ddp.GPT(cfg)
        return model, ddp.make_optimizer(model, 3e-3), tp.ShardedLoader(train, 16, 4, seed=1)

    model, optimizer, loader = fresh()
    uninterrupted = []
    train_steps(model, optimizer, loader, range(6), uninterrupted)
    model, optimizer, loader = fresh()
    first = []
    train_steps(model, optimizer, loader, range(3), first)
    pieces = [(tp.Piece.whole(n, p.shape), {"param": p, **{k: optimizer.state[p][k] for k in KINDS[1:]}})
              for n, p in model.named_parameters()]  # AdamW's step count is the training step
    config = tp.checkpoint_config(cfg)
    tp.save_checkpoint(tmp_path, 3, pieces, {"loader": loader.state_dict()}, config, 0, 1, lambda: None)
    model, optimizer, loader = fresh()
    params = list(model.parameters())
    loaded, meta = tp.load_checkpoint(tmp_path, [piece for piece, _ in pieces], config)
    with torch.no_grad():
        for p, data in zip(params, loaded, strict=True):
            p.copy_(data["param"])
            optimizer.state[p] = {"step": torch.tensor(float(meta["step"])),
                                  **{k: data[k].clone() for k in KINDS[1:]}}
    loader.load_state_dict(meta["loader"])
    train_steps(model, optimizer, loader, range(meta["step"], 6), first)
    assert first == uninterrupted
