"""Lesson 07's proof: the Triton FlashAttention kernels compute attention, forward and backward.

Every kernel test compares all five results, out, lse, dq, dk and dv, against naive attention computed in
float64 on the same (already rounded) inputs, so the reference's own error is negligible and the
whole difference is the kernel's. Inputs are standard normal, so out, lse and the gradients are of
order 1 to 10 and absolute tolerances are meaningful.

On CPU the kernels run in Triton's interpreter (fp32 and fp16, tiny hypothesis-drawn shapes, odd
lengths, causal or not, arbitrary position offsets). On a GPU they are compiled and autotuned, and
every new shape costs compilations, so the GPU tests use a few fixed shapes: bf16 and fp16 must be
at most twice as far from float64 as PyTorch's own attention in the same dtype, plus a small
floor; fp32 must match to the CPU tolerance; two runs must be bit-identical. The block-skipping
test runs the kernels' own range helpers on either.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import SCRIPT_TIMEOUT_S
from test_05_context_parallel import NAN_AT, nan_inputs

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
foundation = importlib.import_module("01_ddp")  # first: without a GPU it turns the interpreter on
context_parallel = importlib.import_module("05_context_parallel")
flash = importlib.import_module("07_flash_attention")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cpu" if flash.INTERPRETED else "cuda")
NAMES = ("out", "lse", "dq", "dk", "dv")
# Absolute tolerances per result. fp32: the kernel sums at most 40 products of order-1 numbers per
# element; rounding measured at ~1e-6 (fp32 eps 1.2e-7), so 2e-5 leaves 10x headroom while a wrong
# mask, scale or offset is off by 1e-2 or more. fp16: P and dS are rounded to fp16 (relative
# 2^-11 = 4.9e-4) before their matmuls and the outputs are stored in fp16, on values up to ~4:
# measured up to 1.7e-3, tolerance 1e-2. The lse is accumulated in fp32 from exact products of fp16
# numbers and stored in fp32, so it keeps the fp32 tolerance even for fp16 inputs.
TOLERANCE = {torch.float32: dict(out=2e-5, lse=2e-5, grad=2e-5),
             torch.float16: dict(out=1e-2, lse=2e-5, grad=1e-2)}

cpu_only = pytest.mark.skipif(not flash.INTERPRETED, reason="interpreter tests: tiny drawn shapes would "
                              "make a GPU compile and autotune for every example; the GPU tests below apply")
gpu_only = pytest.mark.skipif(flash.INTERPRETED, reason="needs CUDA (compiled Triton, bf16)")


def random_inputs(batch, heads, seq_q, seq_k, head_dim, dtype, seed, lse_grad=False, kv_heads=None):
    """q, k, v, dout, dlse; k and v have kv_heads heads (grouped-query attention; None: heads)."""
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, heads, seq_q, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads or heads, seq_k, head_dim, generator=gen) for _ in range(2))
    dlse = torch.randn(batch, heads, seq_q, generator=gen).to(DEVICE) if lse_grad else None
    return [t.to(DEVICE, dtype) for t in (q, k, v, dout)] + [dlse]


def float64_reference(q, k, v, dout, dlse, causal, q_offset=0, k_offset=0):
    q, k, v, dout, dlse = (None if t is None else t.double() for t in (q, k, v, dout, dlse))
    return context_parallel.outputs_and_grads(partial(context_parallel.naive_attention, causal=causal, q_offset=q_offset,
                                           k_offset=k_offset), q, k, v, dout, dlse)


def assert_close_to_reference(results, reference, dtype, tol: dict | None = None) -> None:
    tol = tol or TOLERANCE[dtype]
    for name, got, want in zip(NAMES, results, reference, strict=True):
        assert got.shape == want.shape and got.dtype == (torch.float32 if name == "lse" else dtype)
        assert not got.isnan().any(), f"{name} has NaNs"
        error = context_parallel.max_diff(got, want)
        assert error <= tol.get(name, tol["grad"]), f"{name}: max |error| {error:.2e} > {tol}"


# The drawn tests take the hypothesis profile's count of examples, as every lesson's: one costs 0.5-0.8 s
# in the interpreter (50 s for 64 measured), and their explicit examples hold the edges.
@cpu_only
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3, 4]),
       seq=st.integers(1, 40), head_dim=st.sampled_from([16, 24, 32]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2 ** 16))
@example(batch=2, kv_heads=2, group=1, seq=32, head_dim=32, causal=True, dtype=torch.float32, seed=0)  # whole blocks
@example(batch=1, kv_heads=1, group=1, seq=1, head_dim=16, causal=True, dtype=torch.float16, seed=1)
@example(batch=1, kv_heads=2, group=1, seq=37, head_dim=24, causal=False, dtype=torch.float16, seed=2)
@example(batch=2, kv_heads=2, group=3, seq=23, head_dim=16, causal=True, dtype=torch.float32, seed=3)
def test_attention_matches_float64(batch, kv_heads, group, seq, head_dim, causal, dtype, seed):
    """group: query heads per K/V head (grouped-query attention; 1: multi-head)."""
    q, k, v, dout, _ = random_inputs(batch, kv_heads * group, seq, seq, head_dim, dtype, seed, kv_heads=kv_heads)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 0, causal), q, k, v, dout)
    assert_close_to_reference(ours, float64_reference(q, k, v, dout, None, causal), dtype)
    # The GPT-facing function is the same kernel: bit-identical output.
    assert torch.equal(flash.flash_attention(q, k, v, causal=causal), ours[0])


@cpu_only
@given(seq_q=st.integers(1, 40), seq_k=st.integers(1, 40), q_offset=st.integers(0, 64),
       k_offset=st.integers(0, 64), causal=st.sampled_from([True, True, False]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2 ** 16))
# No row sees a key; some rows see none; all keys lie in the past.
@example(seq_q=8, seq_k=20, q_offset=0, k_offset=40, causal=True, dtype=torch.float32, seed=0)
@example(seq_q=40, seq_k=33, q_offset=3, k_offset=20, causal=True, dtype=torch.float32, seed=1)
@example(seq_q=17, seq_k=40, q_offset=64, k_offset=0, causal=True, dtype=torch.float16, seed=2)
def test_block_entry_with_offsets_and_lse_gradient(seq_q, seq_k, q_offset, k_offset, causal, dtype, seed):
    """The ring's entry: absolute positions, gradients into out and lse, rows with no visible key;
    4 query heads reading 2 K/V heads (the ring circulates K/V heads only). One sequence: the offsets
    apply to every sequence alike, and batches are drawn above (the interpreter's time is per program,
    so a second sequence doubled this test's)."""
    q, k, v, dout, dlse = random_inputs(1, 4, seq_q, seq_k, 16, dtype, seed, lse_grad=True, kv_heads=2)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, q_offset, k_offset, causal),
                                   q, k, v, dout, dlse)
    reference = float64_reference(q, k, v, dout, dlse, causal, q_offset, k_offset)
    assert_close_to_reference(ours, reference, dtype)
    no_key = reference[1] == float("-inf")
    assert torch.equal(ours[1] == float("-inf"), no_key)
    assert (ours[0][no_key] == 0).all()


@cpu_only
def test_causal_diagonal_at_every_block_alignment():
    """Shifts q_offset - k_offset from -48 to 48 put the diagonal at every position relative to the
    interpreter's blocks (32 x 16 for the forward and dQ, 16 x 32 for dK/dV), both ends of every
    masked range included; negative shifts leave the first rows with no key at all."""
    q, k, v, dout, dlse = random_inputs(1, 1, 40, 40, 16, torch.float32, seed=4, lse_grad=True)
    for shift in range(-48, 49):
        ours = context_parallel.outputs_and_grads(partial(flash.flash_block_attention, q_offset=48 + shift, k_offset=48,
                                               causal=True), q, k, v, dout, dlse)
        assert_close_to_reference(ours, float64_reference(q, k, v, dout, dlse, True, 48 + shift, 48),
                                  torch.float32)


@cpu_only
@pytest.mark.parametrize("seq_q", [29, 130])  # 130: three blocks of rows in every kernel, delta's too
def test_raw_launchers_with_merged_lse_gradient(seq_q):
    """Lesson 05 calls the launchers from its own autograd.Function: forward -> (out, lse), and
    backward(q, k, v, out, lse, dout, dlse, causal, sm_scale, q_offset, k_offset). A ring's merged out
    and lse arrive contiguous whatever q's layout: with q, k, v in lesson 01's, the same gradients."""
    q, k, v, dout, dlse = random_inputs(1, 2, seq_q, 35, 32, torch.float32, seed=3, lse_grad=True)
    out, lse = flash.flash_attention_forward(q, k, v, True, 0.3, 10, 5)
    grads = flash.flash_attention_backward(q, k, v, out, lse, dout, dlse, True, 0.3, 10, 5)
    reference = context_parallel.outputs_and_grads(lambda *x: context_parallel.naive_attention(*x, True, 0.3, 10, 5),
                                        q.double(), k.double(), v.double(), dout.double(), dlse.double())
    assert_close_to_reference([out, lse, *grads], reference, torch.float32)
    q01, k01, v01, dout01 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    grads01 = flash.flash_attention_backward(q01, k01, v01, out, lse, dout01, dlse, True, 0.3, 10, 5)
    for ours, contiguous in zip(grads01, grads, strict=True):
        assert torch.equal(ours, contiguous)


@cpu_only
def test_the_drop_in_attention_passes_its_scale_on():
    """flash_attention with a scale of its own (not 1/sqrt(head_dim)): the kernels use that one."""
    q, k, v, _, _ = random_inputs(1, 2, 20, 20, 16, torch.float32, seed=4)
    exact = context_parallel.naive_attention(q.double(), k.double(), v.double(), True, 0.3)[0]
    assert context_parallel.max_diff(flash.flash_attention(q, k, v, True, 0.3), exact) <= TOLERANCE[torch.float32]["out"]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradient_into_lse_only(dtype):
    """A loss on the lse alone: out gets no gradient, so autograd hands FlashAttention.backward
    dout = None (the branch that substitutes zeros). Keys start at position 10: rows 0..9 see none."""
    q, k, v, _, dlse = random_inputs(2, 2, 29, 35, 16, dtype, seed=6, lse_grad=True)
    ours = context_parallel.outputs_and_grads(partial(flash.flash_block_attention, q_offset=0, k_offset=10, causal=True),
                                   q, k, v, None, dlse)
    assert_close_to_reference(ours, float64_reference(q, k, v, None, dlse, True, 0, 10), dtype)


@cpu_only
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2]), seq=st.integers(1, 24),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2 ** 16))
def test_reads_lesson_01_layout_without_copies(batch, kv_heads, group, seq, dtype, seed):
    """Lesson 01 passes q, k, v as (batch, seq, heads, head_dim) projections seen through
    .transpose(1, 2). The kernels read that layout in place: the same bits as from contiguous copies,
    out comes back in q's layout (01's transpose back is then a view), and autograd saves the inputs
    themselves, not copies. A v in another layout than k is copied to k's, with the same result."""
    heads = kv_heads * group
    q, k, v, dout, _ = random_inputs(batch, heads, seq, seq, 16, dtype, seed, kv_heads=kv_heads)
    as_01 = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]
    attention = partial(flash.flash_block_attention, q_offset=0, k_offset=0, causal=True)
    saved = []

    def keep_pointer(t):
        saved.append(t.data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep_pointer, lambda t: t):
        ours = context_parallel.outputs_and_grads(attention, *as_01)
    assert set(saved) >= {t.data_ptr() for t in as_01[:3]}
    assert ours[0].stride() == as_01[0].stride()
    contiguous = context_parallel.outputs_and_grads(attention, q, k, v, dout)
    mixed = context_parallel.outputs_and_grads(attention, as_01[0], as_01[1], v, as_01[3])
    for name, a, b, c in zip(NAMES, ours, contiguous, mixed, strict=True):
        assert torch.equal(a, b) and torch.equal(c, b), name


@cpu_only
@pytest.mark.parametrize("kernel", ["flash", "sdpa"])
@pytest.mark.parametrize("batch, heads, kv_heads, seq, head_dim", [(1, 4, 2, 64, 16), (2, 2, 1, 32, 32), (1, 4, 4, 48, 16)])
def test_attention_backward_holds_what_attention_backward_bytes_says(kernel, batch, heads, kv_heads, seq, head_dim):
    """The most attention's backward makes alive at once (test_03's LiveStorages), on 01's layout:
    dq, dk, dv (this kernel reads q and k in place, no copies); SDPA on a CPU has no fp32 accumulator."""
    from test_03_tensor_parallel import LiveStorages
    attention = flash.flash_attention if kernel == "flash" else foundation.causal_attention
    for dtype, size in ((torch.float32, 4), (torch.float16, 2)):
        q, k, v = (torch.randn(batch, seq, h, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        out = attention(q, k, v)
        dout = torch.randn_like(out)
        with LiveStorages() as made:
            torch.autograd.grad(out, (q, k, v), dout)
        assert made.peak == flash.attention_backward_bytes(batch * seq, heads, kv_heads, head_dim, size, "flash")


def test_sdpas_gpu_backends_hold_an_fp32_dq_beside_the_gradients():
    """SDPA's FlashAttention-2 and cuDNN backends accumulate dq in fp32 beside the bf16 dq, dk and dv; 07's
    kernel does not (measured above: a CPU has no such backend). By hand, 128 tokens, 8 heads of 64, 2 K/V
    heads: dq 128 x 8 x 64 x 2 B, dk and dv 128 x 2 x 64 x 2 B each; SDPA's also 128 x 8 x 64 x 4 B."""
    gradients = 128 * 8 * 64 * 2 + 2 * 128 * 2 * 64 * 2
    assert flash.attention_backward_bytes(128, 8, 2, 64, 2, "flash") == gradients
    for kernel in ("sdpa", "cudnn"):
        assert flash.attention_backward_bytes(128, 8, 2, 64, 2, kernel) == gradients + 128 * 8 * 64 * 4


@cpu_only
@pytest.mark.parametrize("group", [2, 4])
def test_grouped_kv_gradients_are_the_groups_sums(group):
    """A K/V head read by g query heads gets the sum of their g gradients (the chain rule for one
    tensor used g times): the grouped kernel's dK, dV equal the sum over each group of what the
    kernel computes for K and V repeated to every query head (those sums in another order: fp32
    rounding, 2e-5 as above), and its out, lse and dQ are the same bits (the same per-head work)."""
    q, k, v, dout, dlse = random_inputs(2, 2 * group, 24, 40, 16, torch.float32, seed=9, lse_grad=True,
                                        kv_heads=2)
    attn = partial(flash.flash_block_attention, q_offset=16, k_offset=0, causal=True)
    grouped = context_parallel.outputs_and_grads(attn, q, k, v, dout, dlse)
    repeated = context_parallel.outputs_and_grads(attn, q, *(t.repeat_interleave(group, 1) for t in (k, v)), dout, dlse)
    for name, a, b in zip(NAMES[:3], grouped, repeated, strict=False):
        assert torch.equal(a, b), name
    for name, a, b in zip(NAMES[3:], grouped[3:], repeated[3:], strict=True):
        assert a.shape == k.shape, name
        assert context_parallel.max_diff(a, b.unflatten(1, (2, group)).sum(2)) <= 2e-5, name


def test_second_derivative_raises_instead_of_dropping_terms():
    """create_graph=True through flash_attention: the kernels have no derivative of their own, so a
    second derivative must raise (before the fix it returned a dq that did not require grad, and a
    gradient penalty silently lost its attention terms). The first derivative is unchanged."""
    q, k, v, dout, _ = random_inputs(1, 2, 12, 12, 16, torch.float32, seed=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with pytest.raises(RuntimeError, match="once differentiable: create_graph=True"):
        torch.autograd.grad((flash.flash_attention(q, k, v) * dout).sum(), q, create_graph=True)
    first, = torch.autograd.grad((flash.flash_attention(q, k, v) * dout).sum(), q)
    expected, = torch.autograd.grad((context_parallel.naive_attention(q, k, v)[0] * dout).sum(), q)
    assert context_parallel.max_diff(first, expected) <= TOLERANCE[torch.float32]["grad"]


def test_backward_checks_its_inputs_and_casts_dout():
    """flash_attention_backward, which lesson 05 calls directly: a wrongly shaped or placed out,
    dout, lse or dlse is refused before any kernel reads out of bounds; an fp32 dout for fp16
    attention (a loss computed in fp32) is cast to fp16, as autograd would, not refused by Triton."""
    q, k, v, dout, dlse = random_inputs(1, 2, 20, 24, 16, torch.float16, seed=7, lse_grad=True)
    good = dict(out=torch.randn_like(q), lse=torch.randn_like(dlse), dout=dout, dlse=dlse)
    for name, bad in [("out", good["out"][:, :, :-1]), ("dout", dout[..., :8]), ("lse", good["lse"][0]),
                      ("dlse", dlse[..., None]), ("lse", good["lse"].long()), ("dlse", dlse.to("meta"))]:
        with pytest.raises(ValueError, match=f"{name} must be a float tensor of shape"):
            flash.flash_attention_backward(q, k, v, **(good | {name: bad}))
    if flash.INTERPRETED:  # on a GPU, this tiny shape would autotune every config: the checks suffice
        out, lse = flash.flash_attention_forward(q, k, v)
        grads = flash.flash_attention_backward(q, k, v, out, lse, dout.float(), dlse)
        for got, want in zip(grads, flash.flash_attention_backward(q, k, v, out, lse, dout, dlse), strict=True):
            assert got.dtype == torch.float16 and torch.equal(got, want)


@triton.jit
def _ranges_kernel(BLOCK_INDEX, SEQ_Q, SEQ_K, SHIFT, OUT, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """The kernels' own range helpers on n cases at once: block b's (full_end, hi) as a forward or
    dQ program (query block b) and (lo, full_start, q_end) as a dK/dV program (key block b)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    b, shift = tl.load(BLOCK_INDEX + i, mask=ok), tl.load(SHIFT + i, mask=ok)
    full_end, hi = flash._key_range(b * BLOCK_M, tl.load(SEQ_K + i, mask=ok), shift, BLOCK_M, BLOCK_N, CAUSAL)
    lo, full_start, q_end = flash._query_range(b * BLOCK_N, tl.load(SEQ_Q + i, mask=ok), shift, BLOCK_M,
                                               BLOCK_N, CAUSAL)
    zero = b * 0  # makes the values that are plain integers (non-causal) into vectors
    tl.store(OUT + i, full_end + zero, mask=ok)
    tl.store(OUT + n + i, hi + zero, mask=ok)
    tl.store(OUT + 2 * n + i, lo + zero, mask=ok)
    tl.store(OUT + 3 * n + i, full_start + zero, mask=ok)
    tl.store(OUT + 4 * n + i, q_end + zero, mask=ok)


def tile_visibility(n_row_tiles, block_m, n_col_tiles, block_n, shifts, seq_k, causal):
    """Brute force, element by element: (shift, row tile, column tile) -> any / all of the tile's
    (query, key) pairs visible. Tiles count every position, padding rows past seq_q included."""
    rows = torch.arange(n_row_tiles * block_m)[None, :, None]
    cols = torch.arange(n_col_tiles * block_n)[None, None, :]
    visible = (cols < seq_k) & ((rows + shifts[:, None, None] >= cols) if causal else True)
    visible = visible.expand(len(shifts), rows.shape[1], cols.shape[2])
    tiles = visible.reshape(len(shifts), n_row_tiles, block_m, n_col_tiles, block_n)
    return tiles.any(4).any(2), tiles.all(4).all(2)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (32, 128), (128, 32), (64, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_skipping_matches_brute_force_visibility(block_m, block_n, causal):
    """The work saving, checked directly: for every block (forward and dQ programs over key blocks,
    dK/dV programs over query blocks), lengths 1, 40, 130 and every shift from -150 to 150, a tile
    is visited iff some (query, key) pair in it is visible, and runs unmasked iff all are. The
    forward's tiles must mask keys past seq_k (a zero-loaded key scores 0, not -inf); the dK/dV
    tiles need not (padding queries have P = 0, padding keys' dK, dV are never stored), so there
    only positions count."""
    seqs, shifts = (1, 40, 130), torch.arange(-150, 151)
    cases = [(seq_q, seq_k) for seq_q in seqs for seq_k in seqs]
    blocks = [max(triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n)) for seq_q, seq_k in cases]
    table = []  # rows (block index, seq_q, seq_k, shift): per case, every shift x every block
    for (seq_q, seq_k), n in zip(cases, blocks, strict=True):
        shift, block = torch.cartesian_prod(shifts, torch.arange(n)).T
        table.append(torch.stack([block, block * 0 + seq_q, block * 0 + seq_k, shift]))
    table = torch.cat(table, dim=1).to(DEVICE, torch.int32)
    out = torch.empty(5, table.shape[1], dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(triton.cdiv(table.shape[1], 1024),)](*table, out, table.shape[1], BLOCK_M=block_m,
                                                         BLOCK_N=block_n, CAUSAL=causal, BLOCK=1024)
    ranges = out.cpu().split([len(shifts) * n for n in blocks], dim=1)
    for (seq_q, seq_k), n, got in zip(cases, blocks, ranges, strict=True):
        full_end, hi, lo, full_start, q_end = got.reshape(5, len(shifts), n, 1)
        n_q, n_k = triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n)
        key_starts, query_starts = torch.arange(n_k) * block_n, torch.arange(n_q) * block_m
        fwd_any, fwd_all = tile_visibility(n_q, block_m, n_k, block_n, shifts, seq_k, causal)
        assert torch.equal(key_starts < hi[:, :n_q], fwd_any)  # visited: some pair visible
        assert torch.equal(key_starts < full_end[:, :n_q], fwd_all)  # unmasked: all pairs visible
        bwd_any, bwd_all = tile_visibility(n_q, block_m, n_k, block_n, shifts, float("inf"), causal)
        visited = (query_starts >= lo[:, :n_k]) & (query_starts < q_end[:, :n_k])
        unmasked = (query_starts >= full_start[:, :n_k]) & (query_starts < q_end[:, :n_k])
        assert torch.equal(visited, bwd_any.transpose(1, 2))
        assert torch.equal(unmasked, bwd_all.transpose(1, 2))


@pytest.mark.parametrize("seq_len, kv_heads", [(24, 4), (33, 2), (33, 1)])
def test_gpt_with_flash_attention_equals_reference(seq_len, kv_heads):
    """GPT(cfg, attn_fn=flash_attention) = the reference GPT (SDPA, grouped by enable_gqa when
    kv_heads < 4 heads): loss and every parameter's gradient. One layer: the kernel's out, dq, dk and dv
    still reach every gradient below the head (a second layer doubled the interpreter's time).
    Tolerances: measured <= 5e-7 (loss) and 2e-8 (gradients of size <= 0.1); a non-causal kernel is
    off by >= 1.6e-3 and 3e-2."""
    cfg = foundation.ModelConfig(n_kv_heads=kv_heads, n_layers=1)
    tokens, targets = (t.to(DEVICE) for t in foundation.synthetic_batch(cfg, 2, seq_len, step=0))
    losses, grads = [], []
    for attn_fn in (foundation.causal_attention, flash.flash_attention):
        model = foundation.GPT(cfg, attn_fn=attn_fn).to(DEVICE)
        losses.append(model(tokens, targets))
        grads.append(dict(zip(dict(model.named_parameters()),
                              torch.autograd.grad(losses[-1], list(model.parameters())), strict=True)))
    assert abs(losses[0].item() - losses[1].item()) <= 1e-5
    assert foundation.max_abs_diff(grads[0], grads[1]) <= 1e-6


def test_operators_pass_opcheck():
    """torch.library.opcheck on both operators, fp32 (one config each: no autotuning on a GPU either),
    grouped-query, offsets that leave rows with no key: the schema (nothing mutated or aliased), the
    fake implementations against the real outputs (shapes, dtypes, strides, in lesson 01's layout
    too), the registered autograd, and all of it traced by AOTAutograd with dynamic shapes."""
    q, k, v, dout, dlse = random_inputs(1, 4, 20, 24, 16, torch.float32, seed=10, lse_grad=True,
                                        kv_heads=2)
    as_01 = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out, lse = flash.flash_attention_forward(q, k, v, True, None, 0, 8)
    cases = [(torch.ops.lesson07.flash_attention_forward, (*as_01, True, None, 0, 8)),
             (torch.ops.lesson07.flash_attention_backward, (q, k, v, out, lse, dout, dlse, True, 0.3, 0, 8))]
    for op, args in cases:
        results = torch.library.opcheck(op.default, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_a_gpt_with_the_kernel_traces_as_one_graph():
    """The reason for the operators: torch.compile's tracer records each attention call as one node,
    so the whole model is one graph (with @torch.compiler.disable on flash_attention: a break at
    every layer)."""
    cfg = foundation.ModelConfig(dim=32, n_heads=2, n_kv_heads=1)
    model = foundation.GPT(cfg, attn_fn=flash.flash_attention).to(DEVICE)
    batch = (t.to(DEVICE) for t in foundation.synthetic_batch(cfg, 2, 12, 0))
    explained = torch._dynamo.explain(model)(*batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_rejects_bad_input():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    for head_dim in (8, 136):  # the kernels' configurations cover 16-128 (136: one past the top, x8)
        wide = torch.randn(1, 2, 8, head_dim, device=DEVICE)
        with pytest.raises(ValueError, match="16 <= head_dim <= 128"):
            flash.flash_attention(wide, wide, wide)
    with pytest.raises(ValueError, match="expected q"):
        flash.flash_attention(q, q[:, :, :, :8], q[:, :, :, :8])
    with pytest.raises(ValueError, match="with kv_heads dividing heads"):  # 3 query heads, 2 K/V heads
        flash.flash_attention(torch.randn(1, 3, 8, 16, device=DEVICE), q, q)
    for empty in (q[:, :, :0], q[:, :0]):  # no query, no head: the message named neither (an edge hunt)
        with pytest.raises(ValueError, match="each size >= 1 but the batch"):
            flash.flash_attention(empty, q, q)
    with pytest.raises(ValueError, match="must share one"):
        flash.flash_attention(q, q.half(), q)
    if flash.INTERPRETED:
        with pytest.raises(ValueError, match="bf16 needs a GPU"):
            flash.flash_attention(*[q.bfloat16()] * 3)


@cpu_only
@pytest.mark.parametrize("triton_first", [False, True])
def test_interpreter_switch_in_a_fresh_process(triton_first):
    """Without a GPU, importing a lesson (01's device set-up) turns the interpreter on where the
    environment does not choose (TRITON_INTERPRET=0 keeps the compiler: test_gpu_compile's worker); if
    triton was imported earlier (too late to switch), the kernel's import fails and says why, instead of
    failing later inside a kernel."""
    code = ("import importlib, torch\n" + ("import triton\n" if triton_first else "") +
            "flash = importlib.import_module('07_flash_attention')\n"
            "q = torch.randn(1, 1, 20, 16)\n"
            "exact = flash.context_parallel.naive_attention(q, q, q)[0]\n"
            "print((flash.flash_attention(q, q, q) - exact).abs().max().item())\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                         timeout=SCRIPT_TIMEOUT_S)
    if triton_first:
        assert run.returncode != 0 and "import a lesson (01_ddp sets the flag) before triton" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert float(run.stdout) < 1e-5


def kernel_block() -> "context_parallel.BlockAttention":
    """Lesson 07's kernel as the ring's block. The pool's gloo ranks hold CPU tensors, which only the
    interpreter takes: on a GPU machine each call moves its inputs to CUDA and its results back."""
    if flash.INTERPRETED:
        return flash.FLASH_BLOCK

    def on_cuda(fn):
        def call(*args):
            results = fn(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
            return tuple(t.cpu() for t in results)
        return call
    return context_parallel.BlockAttention(flash.FLASH_BLOCK.name, on_cuda(flash.FLASH_BLOCK.forward),
                                           on_cuda(flash.FLASH_BLOCK.backward))


def with_both_blocks(method: str, causal: bool):
    results = {}
    for block in (context_parallel.TORCH_BLOCK, kernel_block()):
        results[block.name], _, _ = context_parallel.sharded_attention(
            1, 4, 8, 16, method=method, zigzag=True, causal=causal, block=block, seed=3, kv_heads=2)
    return results


@pytest.mark.parametrize("method", context_parallel.METHODS)
@pytest.mark.parametrize("causal", [True, False])
def test_the_triton_kernel_as_ring_block_equals_the_torch_block(rank_pool, method, causal):
    """Lesson 05's ring and Ulysses with this lesson's kernel as their block (FLASH_BLOCK): the same
    out, lse, dq, dk, dv as with 05's torch block, both fp32: atol 1e-5 (measured <= 9.5e-7, each
    is ~1e-6 from float64); 4 query heads reading 2 K/V heads."""
    for results in rank_pool.run(2, with_both_blocks, method, causal):
        torch_results, flash_results = results.values()
        for a, b in zip(flash_results, torch_results, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

@pytest.mark.parametrize("where", ["k", "v"])
def test_a_nan_reaches_every_row_that_attends_to_it(where):
    """Lesson 05's NaN contract on the kernel: a NaN key or value at position j makes NaN every row
    i >= j of the query heads that read it, in out and dq (and the lse, for a key); a NaN value
    leaves the lse finite; the other heads stay finite."""
    q, k, v, dout = (t.to(DEVICE) for t in nan_inputs(where))
    out, lse, dq = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 0, True),
                                                      q, k, v, dout)[:3]
    attends = slice(2, 4), slice(NAN_AT, None)  # query heads 2, 3 read K/V head 1
    assert out[0][attends].isnan().all() and dq[0][attends].isnan().all()
    assert not out[0, :2].isnan().any()
    assert lse[0][attends].isnan().all() if where == "k" else lse.isfinite().all()


# ----------------------------------------------------------------------------------------------
# GPU: compiled and autotuned kernels, bf16 included
# ----------------------------------------------------------------------------------------------

GPU_SHAPE = (2, 4, 777)  # batch, heads, seq: 777 is not a multiple of any block size


@gpu_only
@pytest.mark.parametrize("dtype, causal, head_dim", [(torch.bfloat16, True, 128), (torch.bfloat16, False, 64),
                                                     (torch.float16, True, 64), (torch.float16, False, 128)])
def test_gpu_16bit_error_at_most_twice_pytorch(dtype, causal, head_dim):
    """|ours - float64| <= 2 |torch SDPA in the same dtype - float64| + 1e-4, on out and every
    gradient (FlashAttention's own test rule); the lse, accumulated in fp32 from exact products of
    16-bit inputs, within 1e-4 of float64 (values ~10, fp32 rounding ~1e-6)."""
    q, k, v, dout, _ = random_inputs(*GPU_SHAPE, GPU_SHAPE[2], head_dim, dtype, seed=0)
    reference = float64_reference(q, k, v, dout, None, causal)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 0, causal), q, k, v, dout)
    torch_sdpa = context_parallel.outputs_and_grads(lambda *x: (torch.nn.functional.scaled_dot_product_attention(
        *x, is_causal=causal), None), q, k, v, dout)
    assert context_parallel.max_diff(ours[1], reference[1]) <= 1e-4
    for name, got, theirs, want in zip(NAMES, ours, torch_sdpa, reference, strict=True):
        if name != "lse":
            ours_error, torch_error = context_parallel.max_diff(got, want), context_parallel.max_diff(theirs, want)
            assert ours_error <= 2 * torch_error + 1e-4, \
                f"{name}: {ours_error:.2e} vs torch {torch_error:.2e}"


@gpu_only
def test_gpu_fp32_block_entry_with_offsets():
    """fp32 on the GPU uses exact fp32 dots (not TF32). Rows 0..199 see no key (keys start at
    position 200). Sums run over up to 500 terms here, not 40: tolerance 1e-4 (TF32 would be ~1e-2)."""
    q, k, v, dout, dlse = random_inputs(2, 3, 300, 500, 64, torch.float32, seed=1, lse_grad=True)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 200, True), q, k, v, dout, dlse)
    assert_close_to_reference(ours, float64_reference(q, k, v, dout, dlse, True, 0, 200), torch.float32,
                              tol=dict(out=1e-4, lse=1e-4, grad=1e-4))


@gpu_only
def test_gpu_causal_diagonal_at_block_boundaries():
    """The GPU's blocks (32 to 128 rows or keys, per kernel and autotuned pick) differ from the
    interpreter's: shifts q_offset - k_offset at and beside 0, +-32, +-64, +-128 put the diagonal on,
    just inside and just outside every block edge, negative shifts leave rows with no key. One fp32
    shape, so one compile: the shift is neither specialised nor in the tuning key."""
    q, k, v, dout, dlse = random_inputs(1, 2, 300, 300, 64, torch.float32, seed=5, lse_grad=True)
    for shift in sorted({edge + d for edge in (-128, -64, -32, 0, 32, 64, 128) for d in (-1, 0, 1)}):
        attn = partial(flash.flash_block_attention, q_offset=200 + shift, k_offset=200, causal=True)
        ours = context_parallel.outputs_and_grads(attn, q, k, v, dout, dlse)
        assert_close_to_reference(ours, float64_reference(q, k, v, dout, dlse, True, 200 + shift, 200),
                                  torch.float32, tol=dict(out=1e-4, lse=1e-4, grad=1e-4))


@gpu_only
def test_gpu_grouped_query_attention_error_at_most_twice_pytorch():
    """4 query heads reading 1 K/V head, bf16, against float64, with SDPA's enable_gqa as the bound
    (as in test_gpu_16bit_error_at_most_twice_pytorch)."""
    q, k, v, dout, _ = random_inputs(*GPU_SHAPE, GPU_SHAPE[2], 128, torch.bfloat16, seed=3, kv_heads=1)
    reference = float64_reference(q, k, v, dout, None, True)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 0, True), q, k, v, dout)
    torch_sdpa = context_parallel.outputs_and_grads(lambda *x: (torch.nn.functional.scaled_dot_product_attention(
        *x, is_causal=True, enable_gqa=True), None), q, k, v, dout)
    for name, got, theirs, want in zip(NAMES, ours, torch_sdpa, reference, strict=True):
        if name != "lse":
            assert context_parallel.max_diff(got, want) <= 2 * context_parallel.max_diff(theirs, want) + 1e-4, name


@gpu_only
def test_gpu_deterministic():
    """No atomics: two forward + backward passes in one process (so with the same autotuned block
    sizes) are bit-identical, grouped-query dK/dV sums included."""
    q, k, v, dout, _ = random_inputs(*GPU_SHAPE, GPU_SHAPE[2], 128, torch.bfloat16, seed=2, kv_heads=2)
    runs = [context_parallel.outputs_and_grads(lambda *x: flash.flash_block_attention(*x, 0, 0, True), q, k, v, dout)
            for _ in range(2)]
    for name, first, second in zip(NAMES, *runs, strict=True):
        assert torch.equal(first, second), name


# --- the Hopper variant of the forward: TMA descriptors, persistent programs, longest tiles first -----

@cpu_only
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       seq_q=st.integers(1, 80), seq_k=st.integers(1, 80), q_offset=st.integers(0, 40), k_offset=st.integers(0, 40),
       causal=st.booleans(), head_dim=st.sampled_from([16, 20, 24, 32]), layout_01=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2 ** 16))
# 3 query blocks x 12 heads = 36 tiles over the interpreter's 3 programs; rows with no key; padding lanes.
@example(batch=2, kv_heads=2, group=3, seq_q=70, seq_k=80, q_offset=0, k_offset=0, causal=True, head_dim=24,
         layout_01=True, dtype=torch.float32, seed=0)
@example(batch=1, kv_heads=1, group=2, seq_q=40, seq_k=33, q_offset=0, k_offset=30, causal=True, head_dim=16,
         layout_01=False, dtype=torch.float16, seed=1)
@example(batch=1, kv_heads=2, group=1, seq_q=1, seq_k=70, q_offset=0, k_offset=0, causal=False, head_dim=32,
         layout_01=False, dtype=torch.float16, seed=2)
def test_hopper_forward_is_the_main_forward_bit_for_bit(batch, kv_heads, group, seq_q, seq_k, q_offset,
                                                        k_offset, causal, head_dim, layout_01, dtype, seed):
    """In the interpreter, which runs tensor descriptors (their zero fill past a head's rows and head dim
    too) and the persistent loop (3 programs, each taking every third tile, longest first), the Hopper
    kernel's out and lse are the main kernel's bits: the same block sizes, the same operations. What the
    interpreter cannot show (the TMA unit, pipelining, one program per SM) tests/test_gpu_compile.py
    compiles for sm_90. fp16 at head dim 20 (40-byte rows, which TMA cannot copy) takes the main kernel."""
    q, k, v, _, _ = random_inputs(batch, kv_heads * group, seq_q, seq_k, head_dim, dtype, seed, kv_heads=kv_heads)
    if layout_01:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    main = flash.flash_attention_forward(q, k, v, causal, None, q_offset, k_offset)
    hopper = flash.flash_attention_forward(q, k, v, causal, None, q_offset, k_offset, hopper=True)
    for name, a, b in zip(("out", "lse"), main, hopper, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride(), name


def test_gpt_with_the_hopper_forward_is_the_same_model_in_one_graph():
    """GPT(cfg, attn_fn=flash_attention_hopper): the loss and every gradient of GPT with flash_attention
    (bit for bit in the interpreter; on a GPU the autotuners may pick other blocks: within 1e-5), and
    an operator, so torch.compile's tracer keeps the model in one graph."""
    cfg = foundation.ModelConfig(n_kv_heads=2, n_layers=1)
    tokens, targets = (t.to(DEVICE) for t in foundation.synthetic_batch(cfg, 2, 33, step=0))
    results = []
    for attn_fn in (flash.flash_attention, flash.flash_attention_hopper):
        model = foundation.GPT(cfg, attn_fn=attn_fn).to(DEVICE)
        loss = model(tokens, targets)
        results.append([loss, *torch.autograd.grad(loss, list(model.parameters()))])
    for a, b in zip(*results, strict=True):
        assert (torch.equal(a, b) if flash.INTERPRETED else context_parallel.max_diff(a, b) <= 1e-5)
    explained = torch._dynamo.explain(model)(tokens, targets)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_hopper_operator_passes_opcheck():
    """torch.library.opcheck on the forward operator with hopper=True, as on the main ones: lesson 01's
    layout, grouped-query, rows with no key; its fake and autograd are the main forward's."""
    q, k, v, _, _ = random_inputs(1, 4, 20, 24, 16, torch.float32, seed=11, kv_heads=2)
    as_01 = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    results = torch.library.opcheck(torch.ops.lesson07.flash_attention_forward.default,
                                    (*as_01, True, None, 0, 8, True))
    assert set(results.values()) == {"SUCCESS"}, results


@gpu_only
@pytest.mark.parametrize("dtype, causal, head_dim, kv_heads", [(torch.bfloat16, True, 128, 1),
                                                               (torch.bfloat16, False, 64, 4),
                                                               (torch.float16, True, 64, 2)])
def test_gpu_hopper_forward_error_at_most_twice_pytorch(dtype, causal, head_dim, kv_heads):
    """The compiled Hopper kernel (TMA, pipelined, persistent), lesson 01's layout, 777 tokens (no block
    size divides them): out and every gradient within twice SDPA's error against float64, + 1e-4."""
    q, k, v, dout, _ = random_inputs(*GPU_SHAPE, GPU_SHAPE[2], head_dim, dtype, seed=4, kv_heads=kv_heads)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    reference = float64_reference(q, k, v, dout, None, causal)
    ours = context_parallel.outputs_and_grads(lambda *x: flash.flash_attention_forward(*x, causal, hopper=True),
                                              q, k, v, dout)
    torch_sdpa = context_parallel.outputs_and_grads(lambda *x: (torch.nn.functional.scaled_dot_product_attention(
        *x, is_causal=causal, enable_gqa=True), None), q, k, v, dout)
    assert context_parallel.max_diff(ours[1], reference[1]) <= 1e-4
    for name, got, theirs, want in zip(NAMES, ours, torch_sdpa, reference, strict=True):
        if name != "lse":
            assert context_parallel.max_diff(got, want) <= 2 * context_parallel.max_diff(theirs, want) + 1e-4, name


# --- what attention costs: the measured rates 09's planner prices it with ---------------------------

def test_the_planners_attention_rates_are_the_readmes_measurements():
    """ATTENTION_TFLOPS_H100 is README's `--bench` table (forward + backward: ours, SDPA's flash,
    cuDNN), every one of its 20 rows: a re-measured README cannot leave the planner behind."""
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"\n\| (64|128) \| (\d+) \| (no|yes) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \|", text)
    assert len(rows) == 2 * len(flash.BENCH_SEQS) * 2
    for head_dim, seq, causal, *rates in rows:
        measured = flash.ATTENTION_TFLOPS_H100[int(head_dim), causal == "yes"]
        at = flash.BENCH_SEQS.index(int(seq))
        assert [measured[k][at] for k in ("flash", "sdpa", "cudnn")] == [float(r) for r in rates]


@pytest.mark.parametrize("kernel", ["flash", "sdpa", "cudnn"])
def test_attention_is_priced_by_the_papers_flops_at_the_nearest_measured_rate(kernel):
    """Forward 4 N^2 d a head, halved by the causal mask, backward 2.5x, at the measured rate of the
    nearest head dim and length; a rank of a zigzag ring over cp ranks does 1/cp of the causal work
    over cp x seq tokens, at the rate of unmasked blocks of its length."""
    rate = lambda d, causal, seq: flash.ATTENTION_TFLOPS_H100[d, causal][kernel][  # noqa: E731
        flash.BENCH_SEQS.index(seq)] * 1e12
    forward, backward = flash.attention_seconds(2, 16, 2048, 128, kernel)
    assert forward == pytest.approx(4 * 2 * 16 * 2048 ** 2 * 128 / 2 / rate(128, True, 2048), rel=1e-12)
    assert backward == pytest.approx(2.5 * forward, rel=1e-12)
    assert flash.attention_seconds(2, 16, 2000, 120, kernel)[0] * rate(128, True, 2048) == pytest.approx(
        4 * 2 * 16 * 2000 ** 2 * 120 / 2, rel=1e-12)  # nearest: head dim 128, length 2048
    ring = flash.attention_seconds(1, 8, 4096, 64, kernel, cp=4, speed=2.0)[0]
    assert ring * 4 * rate(64, False, 4096) * 2.0 == pytest.approx(4 * 8 * (4 * 4096) ** 2 * 64 / 2, rel=1e-12)
