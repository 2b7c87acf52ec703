"""Lesson 07: FlashAttention-2 in Triton, forward and backward, that runs on a laptop.

The parts, in order (the technique starts at _attend):
  Kernels: _tile (a head's rows, in any LAYOUT), _key_range (CAUSAL), _attend (THE RECURRENCE), the
    autotune tables FWD_GPU, DKDV_GPU, DQ_GPU (ON CHIP), _fwd_kernel; THE BACKWARD: _bwd_delta_kernel,
    _query_range, _bwd_dkdv_kernel, _bwd_dq_kernel
  Launchers, registered as operators (AN OPERATOR): flash_attention_forward, flash_attention_backward;
    flash_attention (GPT's attn_fn), FLASH_BLOCK (05's ring block); attention_backward_bytes
  A Hopper variant of the forward (HOPPER): _hopper_fwd_kernel, flash_attention_hopper (GPT's attn_fn)
  RUN IT: demo, bench; the command line (Options, main)
  Last, for lesson 09's plan only (an H100's measured rates, which no demo here reads):
    ATTENTION_TFLOPS_H100, attention_seconds

THE RECURRENCE (online softmax). out = softmax(scale Q K^T) V per (batch, head). Done naively, the
N x N scores and probabilities go to GPU memory (HBM) and back: O(N^2) memory and traffic (16 heads
at N = 16k in bf16: 8 GiB a sequence). Here a program keeps a block of query rows on chip and streams
the keys past it in blocks, with per row a running max m, sum l and fp32 accumulator; s: the scores
    m_new = max(m, rowmax(s))    alpha = exp(m - m_new)    p = exp(s - m_new)
    l = alpha l + rowsum(p)      acc = alpha acc + p V_block
then, once, out = acc / l and lse = m + log l, which is returned: lesson 05's ring merges partial
attentions with it. In base 2: scores are scaled once by scale x log2(e), then one exp2 each. S and P
only exist in registers: O(N) extra memory (the lse), and K, V are read N / BLOCK_M times.
CAUSAL: key blocks wholly in a query block's future are skipped (half the work), only blocks on the
diagonal are masked. Positions are absolute (key j is visible to query i iff q_offset + i >= k_offset
+ j), so a ring rank can attend to another's keys; a row that sees no key gets out = 0, lse = -inf.
GQA: g query heads share each K/V head; K and V come with their own heads, never repeated (program bh
reads K/V head bh // g): no copy, g x less K/V memory, and L2 serves a group's reads once.
LAYOUT: the kernels read (batch, heads, seq, head_dim) contiguous, or lesson 01's projections (batch,
seq, heads, head_dim) seen through .transpose(1, 2), in place: element d of row r of head (b, h) is at
(b stride_b + h stride_h + r ROW) x head_dim + d, strides in rows (ROW: 1, or the number of heads).
lse and delta are laid out like q without its head dim; out comes back in q's layout: no copies.

THE BACKWARD recomputes P from the lse instead of storing it:
    P = exp(scale Q K^T - lse)    dV = P^T dO    dP = dO V^T    dS = P * (dP - delta)
    dQ = scale dS K               dK = scale dS^T Q             delta_i = rowsum(O_i * dO_i) - dlse_i
(delta first, by a small kernel; dlse comes from a ring's merge.) One program per key block sums
its dK, dV over the query blocks and the g query heads of its K/V head, one per query block its dQ:
one writer per output, no atomics, a fixed order: bit-identical runs.
The price: Q K^T and dO V^T are computed twice (7 matmuls, not 5).

PRECISION. Dots accumulate in fp32 (fp32 inputs: exact dots, not TF32); P and dS are rounded to the
input dtype for their matmuls, as in FlashAttention-2. Without a GPU the kernels run in Triton's
interpreter (one program at a time, in numpy), which cannot do bf16 dots or exp: fp32 or fp16 there.
ON CHIP: tiles must fit an SM's registers (255 a thread; a spill goes off chip, inside the loop) and
shared memory (~ stages x BLOCK_N x d x 2 B a K or V tile; an H100 block: 227 KiB). The autotuner
times only configs that tests/test_gpu_compile.py compiles for sm_90 (no GPU needed) spill-free.
AN OPERATOR: registered by torch.library.custom_op (a fake gives the outputs' shapes and strides,
register_autograd joins the backward), the kernels are single nodes that torch.compile keeps in one
graph. HOPPER (sm_90): a forward whose TMA descriptors copy whole tiles, zero-filled past the ends (no
per-element addresses), 3 to 5 K/V tiles in flight, and persistent programs, one per SM, longest tiles
first; in the interpreter it equals the main forward bit for bit. The backward stays the main one's (TMA
frees few registers there); warp specialisation is Blackwell-only in Triton 3.6 and 3.7: not used.

RUN IT: python 07_flash_attention.py [--bench: GPU TFLOP/s beside SDPA's]. Look at the max differences
against float64 beside PyTorch's attention in the same dtype, the lse exact to fp32 even from fp16
inputs, and the memory never used.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

# First: without a GPU, lesson 01 switches on Triton's interpreter, before anything imports triton.
foundation = importlib.import_module("01_ddp")
context_parallel = importlib.import_module("05_context_parallel")

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

INTERPRETED = triton.knobs.runtime.interpret
if INTERPRETED and not isinstance(tl.zeros, InterpretedFunction):
    raise ImportError("triton was imported before TRITON_INTERPRET=1 was set, so its library is "
                      "compiled-only: without a GPU, import a lesson (01_ddp sets the flag) before triton")
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# Kernels. One program per (block of rows, batch x head). A head's rows lie ROW x head_dim elements
# apart from its first, which the batch and head strides find (LAYOUT above). head_dim is padded to a
# power of two, BLOCK_D, for tl.arange; the padding lanes load zeros and are never stored. ----------
@triton.jit
def _tile(rows, seq, ROW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of rows x BLOCK_D elements within one head (the banner above), and the mask of those that
    exist: the head-dim lanes are masked only when there are padding lanes (fewer live registers)."""
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < seq)[:, None]
    if HEAD_DIM != BLOCK_D:
        ok = ok & (offs_d < HEAD_DIM)[None, :]
    return rows[:, None] * (ROW * HEAD_DIM) + offs_d[None, :], ok


@triton.jit
def _load_keys(pointers, ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key or value tile; the key blocks below full_end all exist, so they load without a mask
    unless head_dim has padding lanes (which must not read past the tensor's end)."""
    if MASKED or HEAD_DIM != BLOCK_D:
        tile = tl.load(pointers, mask=ok, other=0.0)
    else:
        tile = tl.load(pointers)
    return tile


@triton.jit
def _visible(rows, cols, seq_k, shift, CAUSAL: tl.constexpr):
    """(rows, cols) mask: the key exists and, if causal, q_offset + row >= k_offset + col."""
    visible = cols[None, :] < seq_k
    if CAUSAL:
        visible = visible & (rows[:, None] + shift >= cols[None, :])
    return visible


@triton.jit
def _key_range(start_m, seq_k, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For the query block at start_m: keys [0, full_end) are visible to every row, no mask; keys
    [full_end, hi) cross the diagonal or the end of the sequence: masked; keys >= hi: skipped."""
    full_end, hi = seq_k // BLOCK_N * BLOCK_N, seq_k
    if CAUSAL:
        full_end = tl.minimum(seq_k, tl.maximum(0, start_m + shift + 1)) // BLOCK_N * BLOCK_N
        hi = tl.minimum(seq_k, tl.maximum(0, start_m + BLOCK_M + shift))
    return full_end, hi


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, rows, start, end, seq_k, shift, qk_scale, KV_ROW: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """THE RECURRENCE (module docstring) for a block of query rows over the key blocks [start, end),
    scores in log2 units; MASKED: blocks that cross the diagonal or the end of the sequence."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv, kv_ok = _tile(cols, seq_k, KV_ROW, HEAD_DIM, BLOCK_D)
        k = _load_keys(K + kv, kv_ok, MASKED, HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            s = tl.where(_visible(rows, cols, seq_k, shift, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASKED:
            # A row that has seen no key yet has m = -inf: subtract 0 instead of -inf so that
            # exp2 sees -inf - 0 (= 0), never -inf - (-inf) (= NaN).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_keys(V + kv, kv_ok, MASKED, HEAD_DIM, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per (head-dim tile width, dtype bytes), what the autotuner
# times: on sm_90 with Triton 3.7.1 the 16-bit ones are spill-free, and all fit an H100's and an A100's
# shared memory. fp32's exact dots run on CUDA cores (spilling on sm_90 at any tile): one small tile.
FWD_GPU = {(64, 2): [(64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
           (128, 2): [(64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2)],
           (64, 4): [(32, 32, 4, 2)], (128, 4): [(32, 32, 8, 2)]}
# dK/dV programs own BLOCK_N keys and step over queries BLOCK_M at a time; dQ programs the reverse.
# At head dim 128 the backward's accumulators (dK and dV: 2 x BLOCK_N x 128 fp32) need 8 warps;
# there 64 x 128 (255 registers) spills since the kernels read any layout (LAYOUT): not kept.
DKDV_GPU = {(64, 2): [(32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3)],
            (128, 2): [(32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 8, 3)],
            (64, 4): [(32, 32, 4, 2)], (128, 4): [(32, 32, 8, 2)]}
DQ_GPU = {(64, 2): [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
          (128, 2): [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)],
          (64, 4): [(32, 32, 4, 2)], (128, 4): [(32, 32, 8, 2)]}


def kept_configs(gpu: dict, head_dim: int, element_bytes: int) -> list[tuple[int, int, int, int]]:
    """A table's configs for this head dim (padded to 64 at least: smaller tiles only use fewer
    registers) and dtype size (2: bf16, fp16; 4: fp32)."""
    return gpu[max(64, triton.next_power_of_2(head_dim)), element_bytes]


def _prune(gpu: dict):
    """early_config_prune: of all the configs, time only the table's for this launch's head dim and dtype."""
    def prune(configs: list[triton.Config], named_args: dict, **meta) -> list[triton.Config]:
        kept = kept_configs(gpu, meta["HEAD_DIM"], named_args["Q"].element_size())
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in kept]
    return prune


def _autotuned(gpu: dict, cpu: tuple[int, int]):
    """Decorates a kernel: jit-compiled, and autotuned over every config of a table (in order, once
    each), pruned per launch; the interpreter runs one, (BLOCK_M, BLOCK_N) = cpu, with M != N too.
    Tuned per bucket of lengths (next power of two; the kernels ignore the bucket arguments), not per
    exact length, which varies (ring chunks, evaluation), since each new key compiles and times every
    config; the timings are kept on disk (cache_results), so a later run reuses them. Lengths,
    buckets, offsets are not specialised: no recompilation per length, offset, seq = 1."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in dict.fromkeys(c for kept in gpu.values() for c in kept)]
    if INTERPRETED:
        configs = [triton.Config({"BLOCK_M": cpu[0], "BLOCK_N": cpu[1]})]
    tune = triton.autotune(configs, key=["seq_q_bucket", "seq_k_bucket", "HEAD_DIM", "CAUSAL"],
                           prune_configs_by={"early_config_prune": _prune(gpu)}, cache_results=True)
    jit = triton.jit(do_not_specialize=["seq_q", "seq_k", "seq_q_bucket", "seq_k_bucket", "shift"])
    return lambda kernel: tune(jit(kernel))


@_autotuned(FWD_GPU, cpu=(32, 16))
def _fwd_kernel(Q, K, V, OUT, LSE, seq_q, seq_k, seq_q_bucket, seq_k_bucket, shift, sm_scale, group, heads,
                q_batch, q_head, kv_batch, kv_head, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                Q_ROW: tl.constexpr, KV_ROW: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Last query blocks first: with a causal mask they see the most keys, so the longest programs
    # start earliest instead of straggling at the end of the launch.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x heads x seq x dim can pass 2^31
    b, h = bh // heads, bh % heads
    rows = start_m + tl.arange(0, BLOCK_M)
    q_at = b * q_batch + h * q_head  # the head's first row (LAYOUT above)
    Q, OUT, LSE = Q + q_at * HEAD_DIM, OUT + q_at * HEAD_DIM, LSE + q_at
    kv_at = (b * kv_batch + h // group * kv_head) * HEAD_DIM  # GQA: the group's K/V head (GQA above)
    K, V = K + kv_at, V + kv_at
    qo, q_ok = _tile(rows, seq_q, Q_ROW, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + qo, mask=q_ok, other=0.0)
    qk_scale = sm_scale * LOG2E  # the softmax scale and log2(e) folded into one multiply
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end, hi = _key_range(start_m, seq_k, shift, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, rows, 0, full_end, seq_k, shift, qk_scale, KV_ROW,
                            HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, PRECISION, MASKED=False)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, rows, full_end, hi, seq_k, shift, qk_scale, KV_ROW,
                            HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, PRECISION, MASKED=True)
    # Rows that saw no key have acc = 0, l = 0, m = -inf: out = 0 / 1 = 0, lse = -inf + log2(1).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(OUT + qo, (acc / l_safe[:, None]).to(OUT.dtype.element_ty), mask=q_ok)
    tl.store(LSE + rows * Q_ROW, (m_i + tl.log2(l_safe)) * LN2, mask=rows < seq_q)


@triton.jit
def _bwd_delta_kernel(OUT, DO, DLSE, DELTA, seq_q, heads, q_batch, q_head, HAS_DLSE: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_ROW: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """delta (THE BACKWARD), one fp32 number per row, read by both backward kernels, not recomputed."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_at = bh // heads * q_batch + bh % heads * q_head
    offsets, ok = _tile(rows, seq_q, Q_ROW, HEAD_DIM, BLOCK_D)
    o = tl.load(OUT + q_at * HEAD_DIM + offsets, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + q_at * HEAD_DIM + offsets, mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + q_at + rows * Q_ROW, mask=rows < seq_q, other=0.0)
    tl.store(DELTA + q_at + rows * Q_ROW, delta, mask=rows < seq_q)


@triton.jit
def _load_row_stats(LSE, DELTA, rows, seq_q, ROW: tl.constexpr):
    """lse in log2 units and delta for these rows. Padding rows and rows that saw no key get
    lse = +inf, which makes their P = exp2(s - inf) exactly 0 without any mask."""
    lse = tl.load(LSE + rows * ROW, mask=rows < seq_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    return lse, tl.load(DELTA + rows * ROW, mask=rows < seq_q, other=0.0)


@triton.jit
def _query_range(start_n, seq_q, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For the key block at start_n: queries [0, lo) see none of its keys: skipped; [lo, full_start)
    cross the diagonal: masked; [full_start, q_end) see all: no mask. The sequences' ends need none:
    padding queries get P = 0 (lse = +inf), padding keys' dK, dV are never stored."""
    q_end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M
    lo, full_start = 0, 0
    if CAUSAL:
        lo = tl.minimum(q_end, tl.maximum(0, start_n - shift) // BLOCK_M * BLOCK_M)
        full_start = tl.cdiv(tl.maximum(0, start_n + BLOCK_N - 1 - shift), BLOCK_M) * BLOCK_M
        full_start = tl.minimum(q_end, full_start)
    return lo, full_start, q_end


@_autotuned(DKDV_GPU, cpu=(16, 32))
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, seq_q, seq_k, seq_q_bucket, seq_k_bucket, shift,
                     sm_scale, group, heads, q_batch, q_head, kv_batch, kv_head, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, Q_ROW: tl.constexpr, KV_ROW: tl.constexpr, CAUSAL: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    kv_bh = tl.program_id(1).to(tl.int64)  # one K/V head, read by `group` query heads
    b, first_head = kv_bh // (heads // group), kv_bh % (heads // group) * group
    cols = start_n + tl.arange(0, BLOCK_N)
    kv, kv_ok = _tile(cols, seq_k, KV_ROW, HEAD_DIM, BLOCK_D)
    kv_at = (b * kv_batch + first_head // group * kv_head) * HEAD_DIM  # 64-bit: on the scalar pointers,
    K, V, DK, DV = K + kv_at, V + kv_at, DK + kv_at, DV + kv_at  # so the tiles' offsets stay 32-bit
    group_at = b * q_batch + first_head * q_head  # the group's first query head's first row
    k = tl.load(K + kv, mask=kv_ok, other=0.0)
    v = tl.load(V + kv, mask=kv_ok, other=0.0)
    qk_scale = sm_scale * LOG2E
    dk, dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, full_start, q_end = _query_range(start_n, seq_q, shift, BLOCK_M, BLOCK_N, CAUSAL)
    # Every query head of the group adds its share to the same dK, dV, in a fixed order (THE BACKWARD):
    # one flat loop over (query head, query block) pairs that moves to the next head when a head's
    # blocks are done. A loop per head, or a division per step, costs registers: some configs spill.
    for unmasked in tl.static_range(2):  # [lo, full_start) masked (empty unless causal), then the rest
        first = full_start if unmasked else lo
        n_blocks = ((q_end if unmasked else full_start) - first) // BLOCK_M
        q_at, start_m = group_at, first  # the query head's first row; its block
        for _ in range(n_blocks * group):
            rows = start_m + tl.arange(0, BLOCK_M)
            qo, q_ok = _tile(rows, seq_q, Q_ROW, HEAD_DIM, BLOCK_D)
            q = tl.load(Q + q_at * HEAD_DIM + qo, mask=q_ok, other=0.0)
            do = tl.load(DO + q_at * HEAD_DIM + qo, mask=q_ok, other=0.0)
            lse, delta = _load_row_stats(LSE + q_at, DELTA + q_at, rows, seq_q, Q_ROW)
            # Transposed tiles (keys x queries), so dK and dV accumulate as plain matmuls.
            p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
            if not unmasked:
                p_t = tl.where(rows[None, :] + shift >= cols[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
            start_m += BLOCK_M
            if start_m == first + n_blocks * BLOCK_M:  # this head's blocks are done: the next head's
                q_at, start_m = q_at + q_head, first
    tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=kv_ok)


@_autotuned(DQ_GPU, cpu=(32, 16))
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, seq_q, seq_k, seq_q_bucket, seq_k_bucket, shift, sm_scale,
                   group, heads, q_batch, q_head, kv_batch, kv_head, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, Q_ROW: tl.constexpr, KV_ROW: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    rows = start_m + tl.arange(0, BLOCK_M)
    qo, q_ok = _tile(rows, seq_q, Q_ROW, HEAD_DIM, BLOCK_D)
    q_at = b * q_batch + h * q_head
    Q, DO, DQ = Q + q_at * HEAD_DIM, DO + q_at * HEAD_DIM, DQ + q_at * HEAD_DIM
    q = tl.load(Q + qo, mask=q_ok, other=0.0)
    do = tl.load(DO + qo, mask=q_ok, other=0.0)
    lse, delta = _load_row_stats(LSE + q_at, DELTA + q_at, rows, seq_q, Q_ROW)
    kv_at = (b * kv_batch + h // group * kv_head) * HEAD_DIM
    K, V = K + kv_at, V + kv_at
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end, hi = _key_range(start_m, seq_k, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for masked in tl.static_range(2):  # as in the forward: [0, full_end) unmasked, then [full_end, hi)
        for start_n in range(full_end if masked else 0, hi if masked else full_end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kv, kv_ok = _tile(cols, seq_k, KV_ROW, HEAD_DIM, BLOCK_D)
            k = _load_keys(K + kv, kv_ok, masked, HEAD_DIM, BLOCK_D)
            v = _load_keys(V + kv, kv_ok, masked, HEAD_DIM, BLOCK_D)
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
            if masked:
                p = tl.where(_visible(rows, cols, seq_k, shift, CAUSAL), p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + qo, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_ok)


# --- Launchers, registered as operators; lesson 05's ring calls them from its own autograd -----------------
def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or q.shape[1] % max(k.shape[1], 1) \
            or min(q.shape[1], q.shape[2], k.shape[2], k.shape[1]) < 1 or not 16 <= q.shape[3] <= 128:
        raise ValueError(f"expected q (batch, heads, seq_q, head_dim), k and v (batch, kv_heads, seq_k, "
                         f"head_dim) with kv_heads dividing heads, each size >= 1 but the batch, 16 <= "
                         f"head_dim <= 128; got {q.shape}, {k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError("bf16 needs a GPU: the Triton interpreter's bf16 dot is wrong; use fp32 or fp16")
    if not q.device == k.device == v.device or not (INTERPRETED or q.is_cuda):
        raise ValueError(f"q, k, v must be on one CUDA device; got {q.device}, {k.device}, {v.device}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t if the kernels can address it (LAYOUT: contiguous, or 01's projections transposed); else a copy."""
    return t if t.is_contiguous() or t.transpose(1, 2).is_contiguous() else t.contiguous()


def _row_stats(q: torch.Tensor) -> torch.Tensor:
    """An fp32 (batch, heads, seq) tensor laid out like q without its head dim (lse, delta)."""
    return torch.empty_strided(q.shape[:3], [stride // q.shape[3] for stride in q.stride()[:3]],
                               dtype=torch.float32, device=q.device)


def _as_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t in like's memory layout (copied only if it differs): the kernels address every tensor of
    q's shape with q's strides, v, dk, dv with k's, lse, dlse and delta with _row_stats(q)'s."""
    return t if t.stride() == like.stride() else torch.empty_like(like).copy_(t)


def _launch_args(q: torch.Tensor, k: torch.Tensor, q_offset: int, k_offset: int, causal: bool,
                 sm_scale: float | None) -> tuple[list, dict]:
    """An autotuned kernel's arguments after its tensors: lengths, buckets, shift, scale, the head
    counts and the batch and head strides of q and of k; constexprs, the row strides among them (a
    compile per layout: a multiply by a constant keeps the offsets' registers as they were)."""
    seq_q = q.shape[2]
    seq_k = k.shape[2]
    head_dim = q.shape[3]
    q_rows, k_rows = ([stride // head_dim for stride in t.stride()[:3]] for t in (q, k))  # LAYOUT above
    # "ieee": exact fp32 dots for fp32 (Triton's default is TF32); 16-bit products are exact anyway.
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), Q_ROW=q_rows[2],
                KV_ROW=k_rows[2], CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 else None)
    return [seq_q, seq_k, triton.next_power_of_2(seq_q), triton.next_power_of_2(seq_k), q_offset - k_offset,
            head_dim ** -0.5 if sm_scale is None else sm_scale, q.shape[1] // k.shape[1], q.shape[1],
            *q_rows[:2], *k_rows[:2]], meta


def _grid(seq: int, block: str, x: torch.Tensor):  # block: "BLOCK_M" or "BLOCK_N", the autotuner's pick
    return lambda meta: (triton.cdiv(seq, meta[block]), x.shape[0] * x.shape[1])  # x's (batch, heads)


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = _dense(q)
    return torch.empty_like(q), _row_stats(q)


# The kernels as PyTorch operators (AN OPERATOR above). Exact strides: the compiler hands each call the
# layout it was traced with, so the fake outputs' strides are the real ones.
@torch.library.custom_op("lesson07::flash_attention_forward", mutates_args=(),
                         tags=(torch.Tag.needs_exact_strides,))
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            sm_scale: float | None = None, q_offset: int = 0, k_offset: int = 0,
                            hopper: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (batch, heads, seq_q, head_dim), lse (batch, heads, seq_q) fp32, natural log, -inf
    where a row sees no key. out has q's memory layout; inputs in another layout than _dense's are
    copied first (O(N d)). hopper: by the Hopper variant's kernel (HOPPER), where TMA can copy."""
    _validate(q, k, v)
    q, k = _dense(q), _dense(k)
    v = _as_layout(v, k)
    out, lse = _outputs(q)
    args, meta = _launch_args(q, k, q_offset, k_offset, causal, sm_scale)
    if hopper and not (any(t.data_ptr() % 16 for t in (q, k, v)) or q.shape[3] * q.element_size() % 16):
        _hopper_launch(q, k, v, out, lse, args, meta)  # TMA's 16-byte rule: aligned starts and rows
    else:
        _fwd_kernel[_grid(q.shape[2], "BLOCK_M", q)](q, k, v, out, lse, *args, **meta)
    return out, lse


@flash_attention_forward.register_fake
def _forward_fake(q, k, v, causal=True, sm_scale=None, q_offset=0, k_offset=0, hopper=False):
    _validate(q, k, v)
    return _outputs(q)


def _check_backward(q, k, v, out, lse, dout, dlse) -> None:
    _validate(q, k, v)
    for name, t, shape in (("out", out, q.shape), ("dout", dout, q.shape), ("lse", lse, q.shape[:3]),
                           ("dlse", dlse, q.shape[:3])):
        if t is not None and (t.shape != shape or t.device != q.device or not t.is_floating_point()):
            raise ValueError(f"{name} must be a float tensor of shape {tuple(shape)} on {q.device}, to match "
                             f"q {tuple(q.shape)}; got {t.dtype} {tuple(t.shape)} on {t.device}")


@torch.library.custom_op("lesson07::flash_attention_backward", mutates_args=(),
                         tags=(torch.Tag.needs_exact_strides,))
def flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
                             causal: bool = True, sm_scale: float | None = None, q_offset: int = 0,
                             k_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv, given the forward's out and lse (or a ring's merged global out and lse).
    out and dout have q's shape, lse and dlse q.shape[:3]; dout is cast to q's dtype (the dots need
    it), out and dlse may be in any float dtype (they enter fp32 arithmetic)."""
    _check_backward(q, k, v, out, lse, dout, dlse)
    q, k = _dense(q), _dense(k)
    v = _as_layout(v, k)
    out = _as_layout(out, q)
    dout = _as_layout(dout.to(q.dtype), q)
    delta = _row_stats(q)
    lse = _as_layout(lse.float(), delta)
    dlse_or_lse = lse if dlse is None else _as_layout(dlse.float(), delta)  # unread when dlse is None
    args, meta = _launch_args(q, k, q_offset, k_offset, causal, sm_scale)
    _bwd_delta_kernel[(triton.cdiv(q.shape[2], 64), q.shape[0] * q.shape[1])](
        out, dout, dlse_or_lse, delta, q.shape[2], *args[7:10], HAS_DLSE=dlse is not None,
        HEAD_DIM=q.shape[3], BLOCK_D=meta["BLOCK_D"], Q_ROW=meta["Q_ROW"], BLOCK_M=64)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _bwd_dkdv_kernel[_grid(k.shape[2], "BLOCK_N", k)](q, k, v, dout, dk, dv, lse, delta, *args, **meta)
    _bwd_dq_kernel[_grid(q.shape[2], "BLOCK_M", q)](q, k, v, dout, dq, lse, delta, *args, **meta)
    return dq, dk, dv


@flash_attention_backward.register_fake
def _(q, k, v, out, lse, dout, dlse=None, causal=True, sm_scale=None, q_offset=0, k_offset=0):
    _check_backward(q, k, v, out, lse, dout, dlse)
    k = _dense(k)
    return torch.empty_like(_dense(q)), torch.empty_like(k), torch.empty_like(k)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, *ctx.args = inputs[:7]  # causal, sm_scale, q_offset, k_offset (not hopper: one backward)
    ctx.save_for_backward(q, k, v, *output)
    ctx.set_materialize_grads(False)  # an unused out or lse gets None, not a tensor of zeros


def _backward(ctx, dout, dlse):
    # Grad mode is on here only under create_graph=True: refuse, rather than return a dq without grad.
    if torch.is_grad_enabled():
        raise RuntimeError("flash_attention is once differentiable: create_graph=True (a second "
                           "derivative) is not supported; use lesson 05's naive_attention or SDPA for that")
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    return *flash_attention_backward(q, k, v, out, lse, dout, dlse, *ctx.args), None, None, None, None, None


flash_attention_forward.register_autograd(_backward, setup_context=_save_for_backward)


def flash_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                          k_offset: int, causal: bool, sm_scale: float | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query block against a key block at absolute positions (CAUSAL): for 05's ring."""
    q, k = _dense(q), _dense(k)  # here, so that autograd saves them as the kernels read them
    return flash_attention_forward(q, k, _as_layout(v, k), causal, sm_scale, q_offset, k_offset)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None) -> torch.Tensor:
    """A drop-in attention function for the reference model: GPT(cfg, attn_fn=flash_attention)."""
    return flash_block_attention(q, k, v, 0, 0, causal, sm_scale)[0]


def flash_block_backward(q, k, v, out, lse, dout, dlse, q_offset: int, k_offset: int, causal: bool):
    """dq, dk, dv of one block from the ring's global out and lse: the backward kernels as they are."""
    return flash_attention_backward(q, k, v, out, lse, dout, dlse, causal=causal, q_offset=q_offset,
                                    k_offset=k_offset)  # out as the ring keeps it (05: the returned one)


# Lesson 05's ring (and Ulysses) with these kernels as its block attention: lesson 09 uses it on a GPU.
FLASH_BLOCK = context_parallel.BlockAttention("triton (lesson 07)", flash_block_attention,
                                              flash_block_backward)


def attention_backward_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                             kernel: str) -> int:
    """The most attention's backward holds beyond what forward saved and the output's gradient: dq, dk, dv
    (test_07 measures this kernel's, SDPA's on a CPU); SDPA's FlashAttention-2 and cuDNN backends on a GPU
    also accumulate dq in fp32 (not measured here: 4 B a query element)."""
    return tokens * head_dim * (elem_bytes * (heads + 2 * kv_heads) + 4 * heads * (kernel != "flash"))


# --- A Hopper variant of the forward (HOPPER above) --------------------------------------------------------
# Its table, as FWD_GPU's: bigger tiles, deeper stages.
HOPPER_FWD_GPU = {(64, 2): [(128, 64, 8, 3), (128, 64, 8, 5), (128, 128, 8, 3), (128, 128, 8, 4)],
                  (128, 2): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5), (128, 128, 8, 2)],
                  (64, 4): [(32, 32, 4, 2)], (128, 4): [(32, 32, 8, 2)]}


@triton.jit
def _descriptor(X, batch, heads, seq, x_batch, x_head, ROW: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """X in its LAYOUT as (batch, head, row, dim), BLOCK rows a TMA copy: past the ends, 0 in, nothing out."""
    return tl.make_tensor_descriptor(X, [batch, heads, seq, HEAD_DIM], [x_batch * HEAD_DIM, x_head * HEAD_DIM,
                                     ROW * HEAD_DIM, 1], [1, 1, BLOCK, BLOCK_D])


@_autotuned(HOPPER_FWD_GPU, cpu=(32, 16))
def _hopper_fwd_kernel(Q, K, V, OUT, LSE, seq_q, seq_k, seq_q_bucket, seq_k_bucket, shift, sm_scale, group,
                       heads, q_batch, q_head, kv_batch, kv_head, batch, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, Q_ROW: tl.constexpr, KV_ROW: tl.constexpr, CAUSAL: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kv_heads, n_heads, n_blocks = heads // group, batch * heads, tl.cdiv(seq_q, BLOCK_M)
    q_desc = _descriptor(Q, batch, heads, seq_q, q_batch, q_head, Q_ROW, HEAD_DIM, BLOCK_M, BLOCK_D)
    o_desc = _descriptor(OUT, batch, heads, seq_q, q_batch, q_head, Q_ROW, HEAD_DIM, BLOCK_M, BLOCK_D)
    k_desc = _descriptor(K, batch, kv_heads, seq_k, kv_batch, kv_head, KV_ROW, HEAD_DIM, BLOCK_N, BLOCK_D)
    v_desc = _descriptor(V, batch, kv_heads, seq_k, kv_batch, kv_head, KV_ROW, HEAD_DIM, BLOCK_N, BLOCK_D)
    qk_scale = sm_scale * LOG2E
    # Tile t: query block n_blocks - 1 - t // n_heads of head t % n_heads. Every head's last blocks (causal:
    # the longest) first, dealt round-robin to the programs: the launch ends on the shortest.
    for tile in range(tl.program_id(0), n_blocks * n_heads, tl.num_programs(0)):
        start_m, b, h = (n_blocks - 1 - tile // n_heads) * BLOCK_M, tile % n_heads // heads, tile % heads
        rows = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_end, hi = _key_range(start_m, seq_k, shift, BLOCK_M, BLOCK_N, CAUSAL)
        # _attend's steps (so its bits), unmasked then masked, on K/V tiles TMA copies num_stages ahead.
        for masked in tl.static_range(2):
            for start_n in tl.range(full_end if masked else 0, hi if masked else full_end, BLOCK_N):
                cols = start_n + tl.arange(0, BLOCK_N)
                k = k_desc.load([b, h // group, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                s = tl.where(_visible(rows, cols, seq_k, shift, CAUSAL), s, float("-inf")) if masked else s
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if masked else m_new
                alpha = tl.exp2(m_i - m_sub)
                p = tl.exp2(s - m_sub[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = v_desc.load([b, h // group, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o_desc.store([b, h, start_m, 0], (acc / l_safe[:, None]).to(OUT.dtype.element_ty)[None, None])
        lse = (m_i + tl.log2(l_safe)) * LN2
        tl.store(LSE + b * q_batch + h * q_head + rows * Q_ROW, lse, mask=rows < seq_q)


def _hopper_launch(q, k, v, out, lse, args: list, meta: dict) -> None:
    """flash_attention_forward(hopper=True)'s launch: the main one's arguments, one program per SM."""
    # Scratch memory for the descriptors, set per call: per thread, and autograd has threads of its own.
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    programs = 3 if INTERPRETED else torch.cuda.get_device_properties(q.device).multi_processor_count

    def grid(meta: dict) -> tuple[int]:
        return (min(programs, triton.cdiv(q.shape[2], meta["BLOCK_M"]) * q.shape[0] * q.shape[1]),)

    _hopper_fwd_kernel[grid](q, k, v, out, lse, *args, q.shape[0], **meta)


def flash_attention_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                           sm_scale: float | None = None) -> torch.Tensor:
    """GPT(cfg, attn_fn=flash_attention_hopper): flash_attention with the Hopper forward."""
    return flash_attention_forward(q, k, v, causal, sm_scale, hopper=True)[0]


# --- RUN IT: the demo, the benchmark, the command line -----------------------------------------------------
def _sdpa(q, k, v, causal: bool) -> tuple[torch.Tensor, None]:
    grouped = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped), None


def demo(args: argparse.Namespace) -> None:
    device = torch.device("cpu" if INTERPRETED else "cuda")
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    gen = torch.Generator().manual_seed(0)

    def compare(label: str, attn, exact, *inputs: torch.Tensor) -> list[torch.Tensor | None]:
        """Prints max |attn's results - exact's from float64 inputs| ('-': SDPA gives no lse)."""
        got = context_parallel.outputs_and_grads(attn, *inputs)
        ref = context_parallel.outputs_and_grads(exact, *(t.double() for t in inputs))
        print(f"{label:<24}" + "".join(f"{'-' if a is None else f'{context_parallel.max_diff(a, b):.1e}':>9}"
                                       for a, b in zip(got, ref, strict=True)))
        return got

    print(f"FlashAttention-2 in Triton ({'interpreter on CPU' if INTERPRETED else 'GPU'}), (batch, heads, "
          f"seq, head_dim) = {shape}.\nmax |difference| against float64 attention on the same inputs:\n"
          + " " * 24 + "".join(f"{name:>9}" for name in ("out", "lse", "dq", "dk", "dv")))
    flash = partial(flash_block_attention, q_offset=0, k_offset=0)
    exact = context_parallel.naive_attention
    # 16-bit: fp16 in the interpreter (PRECISION), bf16 on a GPU (each dtype and mask tunes once: _autotuned).
    for dtype in (torch.float32, torch.float16 if INTERPRETED else torch.bfloat16):
        q, k, v, dout = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
        for causal, (name, attn) in itertools.product((False, True), (("ours", flash), ("torch", _sdpa))):
            compare(f"{str(dtype)[6:]} {'causal' if causal else 'full'} {name}", partial(attn, causal=causal),
                    partial(exact, causal=causal), q, k, v, dout)
    print(f"grouped-query attention, {foundation.counted(args.heads, 'query head')} on one K/V head (its dK, "
          f"dV summed over them):")
    q, dout = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    k, v = (torch.randn(shape[0], 1, *shape[2:], generator=gen).to(device) for _ in range(2))
    for name, attn in (("ours", flash), ("torch", _sdpa)):
        compare(f"float32 causal {name}", partial(attn, causal=True), partial(exact, causal=True),
                q, k, v, dout)
    # One ring step: in each (batch, head) the first 32 query rows see no key (64 + 31 < 96).
    q, k, v, dout = (torch.randn(shape, generator=gen).to(device) for _ in range(4))
    dlse = torch.randn(shape[:3], generator=gen).to(device)
    where = dict(q_offset=64, k_offset=96, causal=True)
    print("\nblock entry, queries at 64.., keys at 96.., causal, gradients into out and lse, fp32:")
    ours = compare("", partial(flash_block_attention, **where), partial(exact, **where),
                   q, k, v, dout, dlse)
    no_key = ours[1].isinf()
    heads = args.batch * args.heads
    rows = foundation.counted(int(no_key[0, 0].sum()), "row")
    print(f"{rows} of each (batch, head) see no key ({int(no_key.sum())} over the "
          f"{heads}): out 0 and lse -inf there, no NaN anywhere: "
          f"{bool((ours[0][no_key] == 0).all()) and not any(t.isnan().any() for t in ours)}")
    scores = heads * args.seq ** 2 * 4
    stats = heads * args.seq * 8
    print(f"\nmemory: naive attention's fp32 scores, batch x heads x seq^2 x 4 B = {scores:,} B here, are "
          f"never built;\nthe kernels keep lse and delta, batch x heads x seq x 8 B = {stats:,} B. At 16 "
          f"heads, seq 16384, bf16: 8 GiB of scores against 2 MiB.\nNotice: fp32 agrees to rounding; in "
          f"16 bits our errors are PyTorch's own (P and dS rounded to 16 bits); the lse is exact to fp32.")


# The sequence lengths --bench sweeps (09's plan reads its measured rates at them: the last part).
BENCH_SEQS = (1024, 2048, 4096, 8192, 16384)


def bench(args: argparse.Namespace) -> None:
    """TFLOP/s of forward, backward and both, bf16, 16k tokens a batch at width 2048 (FlashAttention-2's
    setting): ours, its Hopper variant, SDPA's flash and cuDNN backends; --bench-group g: g query heads per
    K/V head. FLOPs as the papers count them: forward 4 N^2 d per (batch, head) (two N x N x d matmuls),
    half if causal; backward 2.5 x forward (five matmuls; recomputation not counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    group = args.bench_group

    def tflops(attn, q, k, v, dout, causal: bool, fwd_flops: float) -> list[float | None]:
        try:
            out = attn(q, k, v, causal)
            ms = [do_bench(lambda: attn(q, k, v, causal), return_mode="median"),
                  do_bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=(q, k, v),
                           return_mode="median"),
                  do_bench(lambda: attn(q, k, v, causal).backward(dout), grad_to_none=(q, k, v),
                           return_mode="median")]
        except RuntimeError:  # an SDPA backend missing from this torch build, or not for this shape
            if attn in (flash_attention, flash_attention_hopper):
                raise
            return [None] * 3
        return [f * fwd_flops / (t * 1e-3) / 1e12 for f, t in zip((1, 2.5, 3.5), ms, strict=True)]

    def sdpa(backend):
        def attn(q, k, v, causal):
            with sdpa_kernel(backend):
                return _sdpa(q, k, v, causal)[0]
        return attn

    kernels = {"ours": flash_attention, "Hopper": flash_attention_hopper,
               "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}
    ratios = (("ours", "SDPA flash"), ("ours", "cuDNN"), ("Hopper", "cuDNN"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"TFLOP/s, median of do_bench; {foundation.counted(group, 'query head')} per K/V head")
    print(f"{'head_dim':>8}{'seq':>7}{'causal':>7}{'pass':>8}" + "".join(f"{name:>12}" for name in kernels)
          + "".join(f"{f'{a} / {b}':>18}" for a, b in ratios))
    for head_dim, seq, causal in itertools.product(args.bench_head_dims, args.bench_seqs, (False, True)):
        batch = max(1, 16384 // seq)
        heads = 2048 // head_dim
        shapes = [(batch, heads // (group if i in (1, 2) else 1), seq, head_dim) for i in range(4)]
        q, k, v, dout = (torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_(i < 3)
                         for i, s in enumerate(shapes))
        fwd_flops = 4 * batch * heads * seq ** 2 * head_dim / (2 if causal else 1)
        rates = {name: tflops(attn, q, k, v, dout, causal, fwd_flops) for name, attn in kernels.items()}
        for i, phase in enumerate(("fwd", "bwd", "fwd+bwd")):
            r = {name: rate[i] for name, rate in rates.items()}
            print(f"{head_dim:>8}{seq:>7}{causal!s:>7}{phase:>8}"
                  + "".join(f"{'n/a' if x is None else f'{x:.1f}':>12}" for x in r.values())
                  + "".join(f"{'n/a' if None in (r[a], r[b]) else f'{r[a] / r[b]:.2f}':>18}"
                            for a, b in ratios), flush=True)


@dataclass
class Options:
    batch: int = foundation.option(2, "the demo's sequences", ">= 1")
    heads: int = foundation.option(2, "the demo's query heads", ">= 1")
    seq: int = foundation.option(100, "the demo's tokens per sequence (100: a multiple of no block size)",
                                 ">= 1")
    head_dim: int = foundation.option(32, "the demo's size of each head, 16 to 128", (">= 16", "<= 128"))
    bench: bool = foundation.option(False, "GPU, bf16 TFLOP/s: ours, the Hopper variant, SDPA's flash, cuDNN")
    bench_head_dims: tuple[int, ...] = foundation.option((64, 128), "head dims --bench sweeps",
                                                         (">= 16", "<= 128"), nargs="+")
    bench_seqs: tuple[int, ...] = foundation.option(BENCH_SEQS, "sequence lengths --bench sweeps (16k tokens "
                                                    "a batch)", ">= 1", nargs="+")
    bench_group: int = foundation.option(1, "--bench: query heads per K/V head (grouped-query attention)",
                                         choices=(1, 2, 4, 8))


def validate_bench(world: int) -> None:
    """--bench's rule for launch_lesson, whatever the world: the kernels compiled, on a GPU."""
    if INTERPRETED:
        raise ValueError("--bench needs a CUDA GPU (on CPU the kernels run in Triton's interpreter)")


def demo_memory(args: argparse.Namespace, world: int) -> None:
    """The demo's largest tensors (the float64 reference's, on the CPU) against this machine's memory."""
    scores = {"the float64 reference's scores and probabilities":
              2 * 8 * args.batch * args.heads * args.seq ** 2}
    foundation.check_memory(None, args.batch, args.seq, world, scores,
                            what=f"--batch {args.batch} x --heads {args.heads} x --seq {args.seq}")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options,))
    if args.bench:
        foundation.launch_lesson(parser, args, bench, rules=[validate_bench])
        return
    rules = [partial(demo_memory, args)] if INTERPRETED else []  # a GPU: CUDA's out-of-memory error
    foundation.launch_lesson(parser, args, demo, rules=rules)


# --- For lesson 09's plan: what attention costs on an H100 (no demo here reads it) -------------------------
# `--bench` on one H100 SXM (README, "On one H100"), forward + backward TFLOP/s by (head_dim, causal) at
# each of BENCH_SEQS: this kernel ("flash"), SDPA's FlashAttention-2 backend ("sdpa") and its cuDNN
# backend ("cudnn"). 09's planner prices attention with them.
ATTENTION_TFLOPS_H100 = {
    (64, False): dict(flash=(294.6, 309.0, 317.9, 319.8, 329.3), sdpa=(228.1, 257.1, 279.7, 290.5, 289.0),
                      cudnn=(360.4, 399.7, 434.1, 447.3, 453.7)),
    (64, True): dict(flash=(217.8, 259.6, 278.7, 292.3, 305.8), sdpa=(163.0, 211.4, 245.2, 266.7, 283.2),
                     cudnn=(255.7, 328.7, 374.9, 415.8, 434.6)),
    (128, False): dict(flash=(319.7, 337.2, 353.9, 363.9, 374.3), sdpa=(243.6, 285.6, 307.6, 310.7, 315.7),
                       cudnn=(433.4, 493.9, 538.9, 555.7, 567.9)),
    (128, True): dict(flash=(243.9, 293.4, 320.8, 343.0, 366.5), sdpa=(178.2, 230.9, 265.9, 291.1, 304.9),
                      cudnn=(320.7, 397.9, 456.0, 500.6, 539.3)),
}


def attention_seconds(batch: int, heads: int, seq: int, head_dim: int, kernel: str, cp: int = 1,
                      speed: float = 1.0) -> tuple[float, float]:
    """(forward, backward) of causal attention of `batch` sequences of `seq` tokens over `heads` query heads,
    at the measured rate of `kernel` nearest in head dim and length (x speed: another GPU's peak over the
    H100's), FLOPs counted as bench's. cp > 1: seq is a rank's share of 05's zigzag ring, which computes
    1/cp of the causal attention over cp x seq tokens: cp / 2 unmasked blocks of seq x seq."""
    forward = 4 * batch * heads * seq ** 2 * head_dim * cp / 2
    rates = ATTENTION_TFLOPS_H100[min((64, 128), key=lambda d: abs(d - head_dim)), cp == 1][kernel]
    rate = rates[min(range(len(BENCH_SEQS)), key=lambda i: max(BENCH_SEQS[i] / seq, seq / BENCH_SEQS[i]))]
    both = 3.5 * forward / (rate * 1e12 * speed)
    return both / 3.5, both * 2.5 / 3.5


if __name__ == "__main__":
    main()
