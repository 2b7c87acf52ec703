"""Lesson 08: FP8 training - the two formats, how to scale into them, a Float8Linear; then FP8 in
distributed training: ZeRO-3's all-gathers in FP8, and one scale per tensor under tensor parallelism.

Two sub-commands: `single` (the default) runs in one process, `distributed` on ranks. The parts:
  The scale rule, the saturating cast, the recipes: amax_to_scale, cast_to_fp8, quantize_tiles        single
  One fused pass in Triton; delayed scaling: _amax_cast_kernel, fused_amax_cast, DelayedScaling       single
  FP8 GEMM and Float8Linear: scaled_mm, Float8Math, Float8Linear                                        both
  FP8 communication: weights_cast_once; Float8GatherUnit, Float8ZeRO; train_float8_zero          distributed
  FP8 under tensor parallelism: tensor_parallel_scales, train_float8_tensor_parallel             distributed
  RUN IT: sqnr_table, spike_demo, demo, bench; distributed_demo; Options, the size rules, main          both
  Last, for lesson 09's plan only (an H100's measured GEMM rates, which no demo here reads):
    GEMM_TFLOPS_H100, CAST_BYTES, WEIGHT_CAST_BYTES, SHARD_CAST_BYTES, gemm_seconds, float8_cast_bytes,
    weight_casts_bytes, linear_seconds

THE FORMATS (8 bits: sign, exponent, mantissa)
  e4m3fn  4 exponent + 3 mantissa bits: max 448, smallest normal 2^-6, smallest subnormal 2^-9;
          rounding errs by <= 2^-4 = 6.25% (~30 dB SQNR on Gaussian data). "fn": no inf, so the
          top binade holds numbers up to 448 (only S.1111.111 is NaN).
  e5m2    5 exponent + 2 mantissa bits, IEEE-like: max 57344, smallest subnormal 2^-16; errs by
          <= 12.5% (~25 dB) for ~2^15 x more range.
Weights and activations have a stable range and want precision: e4m3. Gradients span many more
orders of magnitude and want range: e5m2. That split is the "hybrid" recipe.
SATURATION: x.to(fp8) may overflow to inf (e5m2; torch 2.13's CPU e4m3fn cast saturates to 448,
older ones give NaN), so every cast here clamps finite values to +-fp8_max first, as the hardware's
.satfinite conversion does. NON-FINITE INPUT never becomes a finite FP8 number (torch and Triton
alike): NaN stays NaN, +-inf stays +-inf in e5m2 and is NaN in e4m3fn; a tile holding one has amax
NaN or inf (scale NaN or 0: inf x 0 = NaN) and reads back as NaN.

THE SCALE RULE: q = cast(x * s) with s = fp8_max / amax puts the largest |x| on fp8_max; x ~ q / s.
torch._scaled_mm takes *dequantisation* scales, 1/s. Error: SQNR in dB (6 dB ~ 1 bit).

SCALING RECIPES (the granularity of s, and when it is known)
- tensorwise current ("dynamic"): one s from this tensor's amax. Never overflows; but the amax
  reduction must finish before the cast starts (an extra memory pass), and one outlier pushes
  every other value towards the subnormals.
- delayed (Transformer Engine): s from the max of the last H amaxes, over 2^margin, is known before
  x is read: one fused pass casts with it and records x's amax. But a spike above the whole history
  saturates until the history catches up; a margin buys headroom with precision.
- rowwise: one s per row (token of x, output channel of W): an outlier hurts only its row; the GEMM's
  epilogue applies the scales. The backward's transposed operands are re-quantised along the other dim.
- blockwise (DeepSeek-V3): 1 x 128 activation tiles, 128 x 128 weight blocks. Best SQNR under
  outliers, but scales vary along K: a dedicated GEMM rescales each 128-wide K chunk's partial sum.

FLOAT8LINEAR (tensorwise, hybrid): y = x W^T with x, W in e4m3; grad_x = g W and grad_W = g^T x
with the output gradient g in e5m2: all three GEMMs on FP8 tensor cores. An H100's FP8 peak is 2x
bf16 (1979 vs 989 dense TFLOP/s); an amax and a cast per operand (memory-bound passes) amortise
only on large GEMMs fused by torch.compile: published end-to-end gains are 1.2-1.5x (`--bench`).
ACTIVATION MEMORY: for grad_W it keeps x's e4m3 cast (1 B an element) and scale, not x; the linears of
one input (q, k, v; gate, up) share one cast of it (lesson 03's Projections; under SP a rank keeps its
sequence shard, re-gathered in FP8). A lean layer (03) then keeps, a token in bf16, 6h + 5ad + 4kd +
4a + 5f + 8 bytes, not 8h + 4ad + 4kd + 4a + 6f + 8: the regions' inputs and down_proj's at 1 B, and
out_proj's cast beside the attention's own output (Transformer Engine's, delayed scaling).

FP8 IN DISTRIBUTED TRAINING: Float8Linear's two hooks, a weight's `float8_cast` (made once per step)
and `amax_groups` (the groups an operand's amax is the MAX over).
- FP8 COMMUNICATION (ZeRO-3, lesson 02; torchao's "float8 all-gather"). A weight does not change
  inside an optimizer step: cast it once per step (weights_cast_once), and, sharded, before the
  all-gather, which then moves a quarter of fp32's bytes. One all-reduce (MAX) of the amaxes of each
  rank's pieces gives every weight's global amax, so the gathered bytes are bit for bit the whole
  weight's cast, wherever the shard boundaries fall. Per step, for Psi_8 Float8Linear weight elements,
  N ranks, m microbatches: all-gathers of 2m (N-1)/N x 1 B x Psi_8 instead of 2 B (bf16) or 4 B
  (fp32), plus 2 (N-1)/N x 4 B per weight for the amaxes; each rank keeps its cast shard (Psi_8 / N B).
  Gradients reduce-scatter in full precision.
- FP8 UNDER TENSOR PARALLELISM (lesson 03; torchao's float8 on DTensor). A rank scaling by its own
  piece of a split tensor casts with another scale than one device, so every amax of a split tensor
  is the MAX over the tp group (tensor_parallel_scales): the weights' (once per step) and, per call,
  the operand split where it is cast. Per step, L layers, m microbatches: 2 (t-1)/t x 4 B x L (7 + 7m),
  the amaxes of 7 weights and 7 split operands a layer. The casts are then one device's; the split
  sums still add in another order, so the runs stay close to one device's, not bit for bit.

RUN IT
    python 08_fp8.py              # CPU: SQNR tables, the spike demo, 60 steps of the tiny GPT in fp32
                                  # and in FP8 (--steps 300: the long run); one process
    python 08_fp8.py --bench      # GPU: FP8 vs bf16 GEMM TFLOP/s, Float8Linear MLP speed-up
    python 08_fp8.py distributed  # CPU: 4 local ranks (--nproc): ZeRO-3 of the FP8 GPT with fp32 vs
                                  # FP8 all-gathers, then FP8 under TP (torchrun works too)
Look at: cast SQNR ~30 dB (e4m3) / ~25 dB (e5m2); delayed scaling collapsing on the spike, current
scaling not; the fp32 and FP8 losses within a few thousandths. distributed: every measured byte count
beside its formula, the weights' all-gather bytes at a quarter, no bit changed; under TP, the distance
from one device's FP8 run with whole-tensor scales and without them, and one layer's activations.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# First: without a GPU, lesson 01 switches on Triton's interpreter, before anything imports triton.
foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
tensor_parallel = importlib.import_module("03_tensor_parallel")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = triton.knobs.runtime.interpret  # else the kernel is compiled and needs CUDA tensors
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E4M3, E5M2 = FORMATS.values()
AMAX_EPS = 1e-12  # the smallest amax a scale divides by
AMAX_BYTES = 4  # the bytes of an fp32 amax
# Bits the kernel writes: NaN is S.1111.111 (e4m3fn) or S.11111.11 (e5m2); e5m2's inf is S.11111.00.
NAN_BITS = 0x7F
INF_BITS = {E4M3: 0x7F, E5M2: 0x7C}
Quantized = tuple[torch.Tensor, torch.Tensor]  # (FP8 values, their scales)


# --- The scale rule, the saturating cast and the scaling recipes -------------------------------------------
def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s = fp8_max / amax in fp32, finite for every finite amax (zero: an all-zero x casts to zeros)."""
    amax = amax.float().clamp(min=AMAX_EPS)
    return torch.full_like(amax, fp8_max(dtype)) / amax  # torch's `number / tensor` is an ulp off


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """The MAX of amax (fp32, contiguous) over the group, through 03's collective operator (a compiled
    block keeps one graph), on its bits read as int32 as the Triton kernel below does (see there)."""
    return tensor_parallel._all_reduced(amax.view(torch.int32), group, "max").view(amax.dtype)


def check_format(dtype: torch.dtype) -> None:
    if dtype not in INF_BITS:  # torch's other 8-bit floats (e4m3fnuz: another NaN, no -0) are not taught
        raise ValueError(f"dtype={dtype} is not one of the FP8 formats here: {tuple(FORMATS.values())}")


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of x * scale that keeps non-finite values (torch's e4m3fn cast saturates inf)."""
    check_format(dtype)
    y = x.float() * scale
    is_inf = x.isinf() & y.isinf()  # an inf input; a finite one whose product overflows saturates
    inf = y if INF_BITS[dtype] != NAN_BITS else torch.full_like(y, torch.nan)  # e4m3fn: no inf
    return torch.where(is_inf, inf, y.clamp(-fp8_max(dtype), fp8_max(dtype))).to(dtype)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """20 log10(||reference|| / ||reference - approx||) in dB; +inf when they are equal."""
    ref = reference.detach().double()
    return (20 * torch.log10(ref.norm() / (ref - approx.detach().double()).norm())).item()


def check_matrix(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 2-D (rows, cols) tensor, got shape {tuple(x.shape)}")


def quantize_tiles(x: torch.Tensor, tile: tuple[int | None, int | None], dtype: torch.dtype = E4M3,
                   group=None) -> Quantized:
    """Current scaling with one scale per (tile_rows x tile_cols) tile of a 2-D x (None: the whole
    dimension). Returns (fp8 tensor, scales of shape (rows / tile_rows, cols / tile_cols)). group: x
    is this rank's piece of a tensor split over the group, each tile's amax the MAX over it."""
    check_matrix(x)
    rows, cols = x.shape
    tile_rows, tile_cols = (whole if size is None else size for size, whole in zip(tile, x.shape))
    if tile_rows < 1 or tile_cols < 1:
        raise ValueError(f"tile sizes must be >= 1, got {tuple(tile)}")
    if rows % tile_rows or cols % tile_cols:
        raise ValueError(f"shape {tuple(x.shape)} is not divisible by the tile {tuple(tile)}")
    tiles = x.float().reshape(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    if group is not None:
        amax = all_reduce_amax(amax, group)
    scale = amax_to_scale(amax, dtype)
    return cast_to_fp8(tiles, scale[:, None, :, None], dtype).reshape(rows, cols), scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    row_tiles, col_tiles = scale.shape
    tiles = q.float().reshape(row_tiles, rows // row_tiles, col_tiles, cols // col_tiles)
    return (tiles / scale[:, None, :, None]).reshape(rows, cols)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3, group=None) -> Quantized:
    return quantize_tiles(x, (None, None), dtype, group)  # scale shape (1, 1)


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> Quantized:
    return quantize_tiles(x, (1, None), dtype)  # scale shape (rows, 1)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = E4M3) -> Quantized:
    return quantize_tiles(x, block, dtype)  # DeepSeek-V3: (1, 128) for activations, (128, 128) for weights


# --- One fused pass in Triton (per-tile amax -> scale -> saturating cast, plus the amax); delayed scaling ---
@triton.jit
def _max_keeping_nan(values, axis):
    """The max of values >= 0 along axis, NaN if any is NaN as in torch (tl.max skips NaN)."""
    has_nan = tl.max((values != values).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(values, axis=axis))


@triton.jit
def _amax_cast_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, n_rows, n_cols, tile_cols,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_EXP: tl.constexpr,
                      MANTISSA_BITS: tl.constexpr, EPS: tl.constexpr, GIVEN_SCALE: tl.constexpr,
                      NAN_BITS: tl.constexpr, INF_BITS: tl.constexpr):
    tile = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: rows x cols may pass 2^31
    in_tile = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (in_tile[None, :] < tile_cols)
    offsets = rows[:, None] * n_cols + (tile * tile_cols + in_tile)[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    row_amax = _max_keeping_nan(tl.abs(x), 1)
    if GIVEN_SCALE:  # delayed scaling: cast with the one scale at scale_ptr, only record the amax
        scale = tl.load(scale_ptr) + tl.zeros_like(row_amax)
    else:  # div_rn: IEEE division, bit-equal to torch's (Triton's plain fp32 '/' is approximate on GPUs)
        scale = tl.math.div_rn(FP8_MAX, tl.maximum(row_amax, EPS, propagate_nan=tl.PropagateNan.ALL))
    y = x * scale[:, None]
    is_nan = y != y
    is_inf = (tl.abs(x) == float("inf")) & (y == y)  # an inf input; a finite one that overflows saturates
    y = tl.clamp(y, -FP8_MAX, FP8_MAX)
    # Round to the FP8 grid in fp32 (nearest-even): adding then subtracting 2^23 x the FP8 spacing at
    # y's exponent makes fp32 rounding do it, so the cast below is exact - the interpreter's own fp8
    # conversion truncates subnormals and rounds ties away from zero.
    exponent = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    big = ((exponent - MANTISSA_BITS + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + big) - big
    y = tl.where(y < 0, -rounded, rounded)
    # Non-finite values are written as bits: the GPU's conversion (.satfinite) saturates inf to
    # fp8_max, and the interpreter's garbles NaN.
    bits = y.to(q_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
    bits = tl.where(is_inf, INF_BITS | tl.where(x < 0, 0x80, 0), tl.where(is_nan, NAN_BITS, bits))
    tl.store(q_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + offsets, bits.to(tl.uint8), mask=mask)
    if not GIVEN_SCALE:
        tl.store(scale_ptr + rows * (n_cols // tile_cols) + tile, scale, mask=rows < n_rows)
    # Non-negative floats order like their bits read as int32, with NaN above inf: an integer atomic
    # max on the bits keeps a NaN by construction (a float max by IEEE's maxNum would drop it).
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32), bitcast=True),
                  _max_keeping_nan(row_amax, 0).to(tl.int32, bitcast=True))


def fused_amax_cast(x: torch.Tensor, tile_cols: int | None = None, dtype: torch.dtype = E4M3,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton twin of quantize_tiles(x, (1, tile_cols)) (tile_cols=None: rowwise), reading x
    once; given a one-element fp32 scale (delayed scaling), the twin of cast_to_fp8(x, scale, dtype).
    Returns (fp8 tensor, scales (rows, cols / tile_cols) or the given one, the whole tensor's amax)."""
    check_matrix(x)
    check_format(dtype)
    rows, cols = x.shape
    tile_cols = cols if tile_cols is None else tile_cols
    if tile_cols < 1:
        raise ValueError(f"tile_cols={tile_cols} must be >= 1")
    if cols % tile_cols:
        raise ValueError(f"cols={cols} is not divisible by tile_cols={tile_cols}")
    if not INTERPRETED and not x.is_cuda:
        raise ValueError("the compiled Triton kernel needs CUDA tensors (it is interpreted without a GPU)")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device):
        raise ValueError(f"a given scale must be one fp32 number on {x.device}, got {scale.shape} {scale}")
    x = x.contiguous()
    finfo = torch.finfo(dtype)
    given = scale is not None
    q = torch.empty_like(x, dtype=dtype)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = scale if given else torch.empty(rows, cols // tile_cols, dtype=torch.float32, device=x.device)
    rows_per_program, block, num_warps = cast_launch_shape(tile_cols)
    grid = (triton.cdiv(rows, rows_per_program), cols // tile_cols)  # (wider rows: a column-chunk loop)
    _amax_cast_kernel[grid](x, q, scale, amax, rows, cols, tile_cols, ROWS=rows_per_program,
                            BLOCK=block, FP8_MAX=finfo.max, MIN_EXP=int(math.log2(finfo.smallest_normal)),
                            MANTISSA_BITS=int(-math.log2(finfo.eps)), EPS=AMAX_EPS, GIVEN_SCALE=given,
                            NAN_BITS=NAN_BITS, INF_BITS=INF_BITS[dtype], num_warps=num_warps)
    return q, scale, amax


def cast_launch_shape(tile_cols: int) -> tuple[int, int, int]:
    """(rows a program casts, the power-of-2 block of columns, warps): 4-16 warps, at most 32 values
    a thread up to 16384 columns. 64 rows of 128 used all 255 registers and spilled on sm_90."""
    block = triton.next_power_of_2(tile_cols)
    rows = max(1, min(32, 8192 // block))
    return rows, block, min(16, max(4, rows * block // 1024))


class DelayedScaling:
    """The docstring's delayed recipe; amax_history: newest first, on x's device (the host never waits
    on a device-to-host copy). Guard (Transformer Engine's): while the history's max is 0 or not finite
    (an inf or NaN amax in the window), s = 1; a non-finite x still casts to non-finite values."""

    def __init__(self, dtype: torch.dtype = E4M3, history_len: int = 16, margin: int = 0) -> None:
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be >= 1")
        self.dtype = dtype
        self.margin = margin
        self.amax_history = torch.zeros(history_len)
        self.calls = 0

    def scale(self, first_amax: torch.Tensor | None = None) -> torch.Tensor | None:
        """The (1, 1) scale the next quantize uses (no history yet: from first_amax, or None)."""
        amax = self.amax_history.max() if self.calls else first_amax
        if amax is None:
            return None
        scale = amax_to_scale(amax, self.dtype) / 2.0 ** self.margin
        return scale.where((amax > 0) & amax.isfinite(), 1.0).view(1, 1)  # the guard

    def quantize(self, x: torch.Tensor) -> Quantized:
        if x.dim() == 0 or x.numel() == 0:
            raise ValueError(f"x must be non-empty with >= 1 dimension (rows of its last), got shape "
                             f"{tuple(x.shape)}")
        self.amax_history = self.amax_history.to(x.device)  # a no-op after the first call
        scale = self.scale(None if self.calls else x.detach().abs().amax())  # first call: reduce, then cast
        q, _, amax = fused_amax_cast(x.detach().reshape(-1, x.shape[-1]), dtype=self.dtype, scale=scale)
        self.amax_history, self.calls = torch.cat([amax.view(1), self.amax_history[:-1]]), self.calls + 1
        return q.view(x.shape), scale  # any shape: the kernel sees rows of x's last dimension


# --- FP8 GEMM and Float8Linear -----------------------------------------------------------------------------
def scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T for row-major FP8 a and b, with tensorwise ((1, 1)) or rowwise
    ((M, 1), (N, 1)) quantisation scales. torch._scaled_mm wants its second operand column-major
    (b.t() of a row-major b is one, without a copy) and dequantisation scales, 1/s."""
    if a_q.is_cuda:
        m, k = a_q.shape
        n = b_q.shape[0]
        if m % 16 or k % 16 or n % 16:
            raise ValueError(f"FP8 GEMMs on CUDA need M, K, N divisible by 16, got M={m}, K={k}, N={n}")
        if a_q.dtype == b_q.dtype == E5M2:
            raise ValueError("cuBLAS has no e5m2 x e5m2 GEMM: make one operand e4m3")
        if a_scale.numel() > 1 and out_dtype != torch.bfloat16:
            raise ValueError(f"rowwise-scaled FP8 GEMMs on CUDA need out_dtype=bfloat16, got {out_dtype}")
    else:  # torch's CPU _scaled_mm is a scalar loop (1024x128 @ 128x384: 0.9 s, fp32's GEMM 1 ms):
        # the same sum in fp32, where FP8 values and their products are exact; then the scales
        product = a_q.float() @ b_q.float().t()
        return (product / a_scale.reshape(-1, 1) / b_scale.reshape(1, -1)).to(out_dtype)
    return torch._scaled_mm(a_q, b_q.t(), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal().reshape(1, -1), out_dtype=out_dtype)


@dataclass(frozen=True)
class Float8Math:
    """Float8Linear's three GEMMs (the docstring's FLOAT8LINEAR), for lesson 03's Projections; x's cast
    is kept as bytes (gloo all-gathers no FP8 type). Each *_group: the group holding the other pieces
    of that operand, or None."""
    dtype: torch.dtype  # of x, of the output and of x's gradient
    x_group: object = None
    weight_group: object = None
    grad_group: object = None

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_q, x_scale = quantize_tensorwise(x.reshape(-1, x.shape[-1]), E4M3, self.x_group)
        return x_q.view(torch.uint8).view(x.shape), x_scale

    def operands(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if getattr(weight, "float8_cast", None) is not None:  # read again by backward: ZeRO-3 (Float8ZeRO,
            return ()  # below) frees it after forward, gathers it again
        return quantize_tensorwise(weight, E4M3, self.weight_group)

    @staticmethod
    def weight_operand(weight: torch.Tensor, operands: tuple[torch.Tensor, ...]) -> Quantized:
        if not operands and weight.float8_cast is None:
            raise RuntimeError("the weight's FP8 cast of this step is gone: run backward inside "
                               "weights_cast_once() (Float8ZeRO gathers it again)")
        return operands or weight.float8_cast

    def forward(self, kept: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor,
                operands: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x_bytes, x_scale = kept
        x_q = x_bytes.view(E4M3).reshape(-1, x_bytes.shape[-1])
        out = scaled_mm(x_q, x_scale, *self.weight_operand(weight, operands), self.dtype)
        return out.view(*x_bytes.shape[:-1], -1)

    def grad_operand(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_tensorwise(grad.reshape(-1, grad.shape[-1]), E5M2, self.grad_group)

    @staticmethod
    def grad_input(grad: tuple, weight: tuple, dtype: torch.dtype) -> torch.Tensor:
        # Tensorwise scales survive transposition: the casts are reused, only re-laid out.
        g_q, g_scale = grad
        w_q, w_scale = weight
        return scaled_mm(g_q, g_scale, w_q.t().contiguous(), w_scale, dtype)

    @staticmethod
    def grad_weight(grad: tuple, kept: tuple, dtype: torch.dtype) -> torch.Tensor:
        g_q, g_scale = grad
        x_bytes, x_scale = kept
        x_q = x_bytes.view(E4M3).reshape(-1, x_bytes.shape[-1])
        return scaled_mm(g_q.t().contiguous(), g_scale, x_q.t().contiguous(), x_scale, dtype)


tensor_parallel.MATHS["Float8Math"] = Float8Math  # for 03's SP backward operator

# What a Float8Linear keeps of its input for backward (03's kept_input): 1 B an element, an fp32 scale.
KEPT_INPUT = (1, AMAX_BYTES)


class Float8Linear(nn.Linear):
    """Drop-in for nn.Linear (same parameters, same state_dict) whose GEMMs run in FP8; the bias,
    if any, is added in high precision. Like nn.Linear, an empty batch gives an empty output (and a
    zero weight gradient): with no amax to scale by, it skips FP8."""

    DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # FP8 GEMMs output these
    amax_groups = (None, None, None)  # Float8Math's x_group, weight_group, grad_group

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Float8Linear":
        with torch.device("meta"):  # no throw-away initialisation: the parameters are shared
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.dtype not in self.DTYPES:
            raise ValueError(f"Float8Linear computes in float32, bfloat16 or float16 (input and weight "
                             f"alike), got input {x.dtype} and weight {self.weight.dtype}")
        if x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        return tensor_parallel.project(x, self)[0]

    def math(self, x: torch.Tensor) -> Float8Math:
        return Float8Math(x.dtype, *self.amax_groups)


def convert_to_float8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Swap, in place, every nn.Linear of model not named in skip for a Float8Linear. lm_head stays
    high precision, as in FP8 recipes: a 6% error on a logit is that error in log-probability times
    the logit, and its gradient (softmax - one-hot) starts all of backprop."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and f"{parent_name}.{name}".lstrip(".") not in skip:
                setattr(parent, name, Float8Linear.from_linear(child))
        if getattr(parent, "project", None) is foundation.linears_of:
            parent.project = tensor_parallel.project  # one cast of a shared input (ACTIVATION MEMORY)
    return model


# --- FP8 communication: each weight cast once per step; ZeRO-3 all-gathers the casts -----------------------
def float8_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of model's Float8Linear layers, each once."""
    return list(dict.fromkeys(m.weight for m in model.modules() if isinstance(m, Float8Linear)))


@contextlib.contextmanager
def weights_cast_once(model: nn.Module) -> Iterator[None]:
    """Around one optimizer step's forward and backward passes: each Float8Linear weight is cast on
    entry (under TP with the whole weight's scale), dropped on exit."""
    weights = float8_weights(model)
    group = tensor_parallel_group(model)
    if any(w.numel() == 0 for w in weights):
        raise ValueError("weights_cast_once needs whole weights, not ZeRO-3's released ones: "
                         "Float8ZeRO casts their shards once per step")
    try:
        if weights:
            amaxes = torch.stack([w.detach().float().abs().amax() for w in weights])
            if group is not None:
                amaxes = all_reduce_amax(amaxes, group)
            for w, scale in zip(weights, amax_to_scale(amaxes, E4M3).view(-1, 1, 1), strict=True):
                w.float8_cast = cast_to_fp8(w.detach(), scale, E4M3), scale
        yield
    finally:
        for w in weights:
            w.float8_cast = None


class Float8GatherUnit(zero.FlatUnit):
    """A ZeRO-3 unit of Float8Linear weights whose all-gather carries their e4m3 casts (made by
    Float8ZeRO.cast_shards). Weights only: every rank's shard must be the same number of bytes."""

    cast_shard: torch.Tensor | None = None  # this rank's shard cast to e4m3, as bytes (padding: 0)
    scales: tuple[torch.Tensor, ...] = ()   # each weight's global scale
    cast_version: int | None = None         # the master's version counter when it was cast

    def pieces(self) -> list[slice]:
        """Where each weight's elements lie in this rank's shard (an empty slice: none of them)."""
        start, stop = self.owned.start, self.owned.stop
        return [slice(min(max(begin, start), stop) - start, min(max(end, start), stop) - start)
                for begin, end in zip(self.offsets, self.offsets[1:])]

    def gather_input(self) -> torch.Tensor:
        if self.cast_version != self.master._version:  # in-place updates bump the counter
            raise RuntimeError(f"the FP8 cast of {self.names[0]}'s unit is older than its weights: "
                               f"Float8ZeRO.cast_shards() after every change of them")
        return self.cast_shard  # uint8: gloo has no FP8 type, and an all-gather only moves bytes

    def bind(self, flat: torch.Tensor) -> None:
        """Each weight's cast is a view of the gathered bytes; the parameter, a stride-0 view of one
        zero, gives autograd the shape it checks the gradient against, for 4 bytes."""
        for p, shape, cast, scale in zip(self.params, self.shapes, self.views(flat.view(E4M3)),
                                         self.scales, strict=True):
            p.data = self.released.new_zeros(()).expand(shape)
            p.float8_cast = (cast, scale.view(1, 1))

    def release(self) -> None:
        for p in self.params:
            p.float8_cast = None
        super().release()


class Float8ZeRO(zero.ZeRO):
    """ZeRO-3 of model's Float8Linear weights, all-gathered in FP8; the rest is lesson 02's. The other
    parameters need a ZeRO of their own, both clipped by one norm: train_float8_zero shows the pair."""

    unit_type = Float8GatherUnit

    def __init__(self, model: nn.Module, group=None, **kwargs) -> None:
        weights = set(float8_weights(model))
        if not weights:
            raise ValueError("Float8ZeRO shards Float8Linear weights, and this model has none: "
                             "convert_to_float8 it first")
        super().__init__(model, 3, group, owns=lambda p: p in weights, **kwargs)
        self.weight_casts = 0  # pieces cast so far: one per weight and step on each rank holding some
        self.tensor_parallel_group = tensor_parallel_group(model)  # the weights' other TP shards
        self.cast_shards()

    def clip_and_update(self, squares: torch.Tensor | None = None) -> torch.Tensor:
        norm = super().clip_and_update(squares)
        self.cast_shards()
        return norm

    def load_shards(self, shards: list[dict[str, torch.Tensor]], step: int) -> None:
        super().load_shards(shards, step)
        self.cast_shards()

    @torch.no_grad()
    def cast_shards(self) -> None:
        """Each piece of a weight here cast with the whole weight's scale (under TP: over tp too)."""
        pieces = [unit.shard[piece].float() for unit in self.units for piece in unit.pieces()]
        nothing = torch.zeros((), device=pieces[0].device)  # the amax of a weight with no piece here
        amaxes = torch.stack([piece.abs().amax() if piece.numel() else nothing for piece in pieces])
        amaxes = all_reduce_amax(amaxes, self.group)
        if self.tensor_parallel_group is not None:
            amaxes = all_reduce_amax(amaxes, self.tensor_parallel_group)
        scales = iter(amax_to_scale(amaxes, E4M3))
        for unit in self.units:
            unit.cast_shard = torch.zeros_like(unit.shard, dtype=torch.uint8)
            unit.scales = tuple(next(scales) for _ in unit.params)
            for piece, scale in zip(unit.pieces(), unit.scales):
                if piece.start < piece.stop:
                    cast = cast_to_fp8(unit.shard[piece], scale, E4M3)
                    unit.cast_shard[piece] = cast.view(torch.uint8)
                    self.weight_casts += 1
            unit.cast_version = unit.master._version

    def held_bytes(self) -> dict[str, int]:
        held = super().held_bytes()  # + the cast shards and the scales, and gathered casts still bound
        casts = [t for u in self.units for t in (u.cast_shard, *u.scales)]
        bound = [p.float8_cast[0] for u in self.units for p in u.params if getattr(p, "float8_cast", None)]
        held["params"] += zero.storage_bytes(casts + bound, set())
        return held

    def memory_formula(self) -> dict[str, Fraction]:
        formula = super().memory_formula()  # + 1 B per element of the shard, 4 B per weight's scale
        padded = sum(u.padded for u in self.units)
        n_weights = sum(len(u.params) for u in self.units)
        formula["params"] += Fraction(padded, self.world) + AMAX_BYTES * n_weights
        return formula


def float8_zero_traffic(padded: int, n_weights: int, n: int, grad_bytes: int = 4) -> dict[str, Fraction]:
    """Ring bytes one rank sends per step (one microbatch) for Float8ZeRO's padded weights: 02's
    ZeRO-3 traffic with 1 B parameters, and the amaxes' all-reduce (the clipping norm's aside)."""
    traffic = zero.zero_traffic_per_step(padded, n, 3, param_bytes=1, grad_bytes=grad_bytes)
    return {**traffic, "all_reduce": foundation.ring_traffic("all_reduce", AMAX_BYTES * n_weights, n)}


FLOAT8_ZERO_MODES = ("unsharded", "zero3", "zero3-fp8")


def validate_float8_zero(global_batch: int, world: int, microbatches: int) -> None:
    """train_float8_zero's sizes, on every rank before any collective (and by main before the launch)."""
    if microbatches < 1 or global_batch % (world * microbatches):
        raise ValueError(f"global_batch={global_batch} is not divisible by the group size x microbatches "
                         f"= {world} x {microbatches}")


def train_float8_zero(cfg: foundation.ModelConfig, steps: int, global_batch: int, seq_len: int, *, mode: str,
                      microbatches: int = 1, lr: float = 1e-3, adam_eps: float = 1e-8, group=None,
                      device: torch.device | str = "cpu") -> tuple[zero.ZeroResult, foundation.CommMeter]:
    """02's train_zero for the FP8 GPT, in microbatches. mode "unsharded": data parallel (ZeRO-0),
    each weight cast once per step; "zero3": 02's ZeRO-3, fp32 all-gathers, a cast in each forward;
    "zero3-fp8": the weights under Float8ZeRO. stats: padded elements and casts."""
    world = foundation.group_size(group)
    rank = dist.get_rank(group)
    if mode not in FLOAT8_ZERO_MODES:
        raise ValueError(f"mode={mode!r} must be one of {FLOAT8_ZERO_MODES}")
    validate_float8_zero(global_batch, world, microbatches)
    model = convert_to_float8(foundation.GPT(cfg)).to(device)
    weights = set(float8_weights(model))
    settings = dict(lr=lr, adam_eps=adam_eps)
    if mode == "unsharded":
        zeros = [zero.ZeRO(model, 0, group, **settings)]
    else:
        rest = zero.ZeRO(model, 3, group, owns=lambda p: p not in weights, **settings)
        zeros = [rest, Float8ZeRO(model, group, **settings) if mode == "zero3-fp8"
                 else zero.ZeRO(model, 3, group, owns=lambda p: p in weights, **settings)]
    initial_casts = getattr(zeros[-1], "weight_casts", 0)
    result = zero.ZeroResult([], {}, {})
    steps_meter = foundation.CommMeter()
    local_losses = []
    for step in range(steps):
        tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step, rank, world)
        with foundation.comm_meter() as meter:
            with contextlib.ExitStack() as accumulate:
                for zero_opt in zeros:
                    accumulate.enter_context(zero_opt.no_sync())
                if mode == "unsharded":
                    accumulate.enter_context(weights_cast_once(model))
                loss = foundation.accumulate_microbatches(model, tokens, targets, microbatches, device)
            for zero_opt in zeros:
                zero_opt.finish_gradient_sync()
        if step == 0:
            for zero_opt in zeros:
                result.first_grads.update(zero_opt.unshard([u.grad_shard for u in zero_opt.units]))
        with foundation.comm_meter() as update_meter:
            squares = sum(zero_opt.grad_squares() for zero_opt in zeros)
            for zero_opt in zeros:
                zero_opt.clip_and_update(squares)
                zero_opt.zero_grad()
        steps_meter += meter
        steps_meter += update_meter
        local_losses.append(loss)
    result.losses = foundation.mean_over_ranks(local_losses, group)
    result.params = {k: v for z in zeros for k, v in z.full_state_dict()["params"].items()}
    result.stats = dict(padded=[sum(u.padded for u in z.units) for z in zeros], n_weights=len(weights),
                        weight_casts=getattr(zeros[-1], "weight_casts", 0) - initial_casts)
    result.held = zeros[-1].held_bytes()  # the weights' ZeRO, after the last step
    result.formula = zeros[-1].memory_formula()
    return result, steps_meter


# --- FP8 under tensor parallelism: every scale the whole tensor's ------------------------------------------
def tensor_parallel_scales(model: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """After lesson 03 split model over group: each Float8Linear takes the scales one device would
    (the docstring's FP8 UNDER TENSOR PARALLELISM; a layer whole on SP's sequence shards: 06's router)."""
    if foundation.group_size(group) == 1:
        return model
    group = dist.group.WORLD if group is None else group  # None: torch's default group, the world
    column, row = (tensor_parallel.SPLIT_DIM[style] for style in (tensor_parallel.column_parallel,
                                                                  tensor_parallel.row_parallel))
    for layer in model.modules():
        if isinstance(layer, Float8Linear):
            dim = getattr(layer.weight, "tp_shard_dim", None)
            on_shards = dim is None and sequence_parallel  # whole, outside the regions
            split = (dim == row or on_shards, True, dim == column or on_shards)  # x, weight, grad
            layer.amax_groups = tuple(group if is_split else None for is_split in split)
    return model


@contextlib.contextmanager
def float8_split(model: nn.Module, sequence_parallel: bool = False) -> Iterator[nn.Module]:
    """03's split GPT with FP8 linears, every scale the whole tensor's, each weight cast once as in 09's
    steps (weights_cast_once: not a per-token cost): 03's measure_layer context."""
    model = tensor_parallel_scales(convert_to_float8(model), sequence_parallel=sequence_parallel)
    with weights_cast_once(model):
        yield model


def tensor_parallel_group(model: nn.Module):
    """The group model's Float8Linear layers reduce their amaxes over (tensor_parallel_scales), or None."""
    groups = {layer.amax_groups[1] for layer in model.modules() if isinstance(layer, Float8Linear)}
    if len(groups) > 1:
        raise ValueError(f"the Float8Linear layers of one model reduce amaxes over {len(groups)} different "
                         f"groups: tensor_parallel_scales once, after apply_tensor_parallel")
    return next(iter(groups), None)


def tensor_parallel_amax_traffic(tp: int, layers: int, microbatches: int = 1, *, mlp: bool = True,
                                 sequence_parallel: bool = False, recompute: str = "none") -> Fraction:
    """The docstring's amax bytes per step over tp ranks: per layer 7 weights, and per microbatch the
    split operands: the output gradients of q, k, v, gate, up and the inputs of out, down. mlp=False
    (06's MoE layers): attention's 4, with SP the router's input and output gradient. recompute="full"
    casts each layer's row-parallel inputs (SP: the router's) again in backward."""
    weights = 7 if mlp else 5  # q, k, v, out + gate, up, down | the router
    split = 7 if mlp else 4 + 2 * sequence_parallel
    again = (2 if mlp else 1 + sequence_parallel) if recompute == "full" else 0
    amaxes = layers * (weights + microbatches * (split + again))
    return foundation.ring_traffic("all_reduce", AMAX_BYTES * amaxes, tp)


def train_float8_tensor_parallel(cfg: foundation.ModelConfig, steps: int, global_batch: int, seq_len: int, *,
                                 sequence_parallel: bool = False, whole_tensor_scales: bool = True,
                                 group=None, **kwargs):
    """03's train_tensor_parallel (kwargs: microbatches, lr, adam_eps, device) for the FP8 GPT, each weight
    cast once per step. whole_tensor_scales=False: each rank scales by its own pieces instead."""
    scales = functools.partial(tensor_parallel_scales, group=group, sequence_parallel=sequence_parallel)
    return tensor_parallel.train_tensor_parallel(
        cfg, steps, global_batch, seq_len, sequence_parallel=sequence_parallel, group=group,
        transform=convert_to_float8, after=scales if whole_tensor_scales else None,
        around_step=weights_cast_once, **kwargs)


# --- RUN IT: measurements, the one-process demo and --bench; the distributed demo; the command line --------
def realistic_activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose channels have log-normal scales plus a few 20x outlier channels, the
    shape of LLM activations (LLM.int8() found such outlier features in every large model)."""
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(0.5 * torch.randn(cols, generator=gen))
    channel_scale[torch.randperm(cols, generator=gen)[:max(1, cols // 64)]] *= 20
    return torch.randn(rows, cols, generator=gen) * channel_scale


def sqnr_table(x: torch.Tensor, w: torch.Tensor) -> dict[str, dict[str, float]]:
    """SQNR (dB) of every recipe on activations x and a weight w: x's casts in both formats, x @ w^T
    in e4m3, and Float8Linear holding w. Blockwise has no CPU kernel: its GEMM dequantises and
    multiplies in fp32, the same sum a blockwise kernel computes chunk by chunk."""
    tiles = {"tensorwise": ((None, None),) * 2, "rowwise": ((1, None),) * 2,  # (x's tile, w's tile)
             "blockwise": ((1, 128), (128, 128))}
    table = {f"cast {name}": {recipe: sqnr(x, dequantize_tiles(*quantize_tiles(x, x_tile, dtype)))
                              for recipe, (x_tile, _) in tiles.items()} for name, dtype in FORMATS.items()}
    exact = x @ w.t()
    gemm = {}
    for recipe, (x_tile, w_tile) in tiles.items():
        x_q, x_scale = quantize_tiles(x, x_tile)
        w_q, w_scale = quantize_tiles(w, w_tile)
        if recipe == "blockwise":
            approx = dequantize_tiles(x_q, x_scale) @ dequantize_tiles(w_q, w_scale).t()
        else:
            approx = scaled_mm(x_q, x_scale, w_q, w_scale, torch.float32)
        gemm[recipe] = sqnr(exact, approx)
    return {**table, "GEMM e4m3": gemm, "Float8Linear": float8_linear_sqnrs(x, w)}


def float8_linear_sqnrs(x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    """Float8Linear against nn.Linear holding the same weight: output, input and weight gradients."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.to(x))
    grad_out = torch.randn(x.shape[0], weight.shape[0], generator=torch.Generator().manual_seed(0)).to(x)
    runs = []
    for module in (linear, Float8Linear.from_linear(copy.deepcopy(linear))):
        inp = x.clone().requires_grad_()
        (out := module(inp)).backward(grad_out)
        runs.append((out, inp.grad, module.weight.grad))
    return {name: sqnr(ref, approx) for name, ref, approx
            in zip(("output", "grad_input", "grad_weight"), *runs, strict=True)}


def spike_demo(history_len: int = 16, spike: float = 100.0, seed: int = 0) -> dict[str, float]:
    """history_len calm steps, then a step where 1 token in 16 is `spike` x larger (a loss spike's
    activations): delayed scaling casts it with the calm history's scale and clips."""
    delayed = DelayedScaling(E4M3, history_len)
    for step in range(history_len):
        delayed.quantize(realistic_activations(256, 256, seed + step).to(DEVICE))
    x = realistic_activations(256, 256, seed + history_len).to(DEVICE)
    x[::16] *= spike
    q, stale_scale = delayed.quantize(x)  # the calm history's scale
    return {"delayed SQNR": sqnr(x, q.float() / stale_scale),
            "clipped": ((x * stale_scale).abs() > fp8_max(E4M3)).float().mean().item(),
            "current SQNR": sqnr(x, dequantize_tiles(*quantize_tensorwise(x)))}


def training_device() -> torch.device:
    """The lesson's device where its GEMMs take FP8 operands: the CPU, or a GPU of compute capability
    8.9 or more (Ada, Hopper: an A100 has no FP8 tensor cores, so it trains on the CPU)."""
    fp8_tensor_cores = DEVICE.type == "cpu" or torch.cuda.get_device_capability(DEVICE) >= (8, 9)
    return DEVICE if fp8_tensor_cores else torch.device("cpu")


def demo(args: argparse.Namespace) -> None:
    x = realistic_activations(1024, 512, seed=1)
    w = torch.randn(768, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    print("SQNR on activations with outlier channels (x: 1024 x 512, W: 768 x 512):")
    for label, values in sqnr_table(x, w).items():
        print(f"  {label:<16}" + "   ".join(f"{k}: {v:5.1f} dB" for k, v in values.items()))
    x64 = x[:64].to(DEVICE)  # interpreted on the CPU, compiled (CUDA tensors only) on a GPU
    q, scale, amax = fused_amax_cast(x64, 128)
    ref_q, ref_scale = quantize_blockwise(x64, (1, 128))
    print(f"\nTriton fused amax+cast (1x128 tiles, 64 x 512) vs torch: fp8 values equal "
          f"{torch.equal(q.float(), ref_q.float())}, scales equal {torch.equal(scale, ref_scale)}, "
          f"amax equal {amax.item() == x64.abs().max().item()}")
    spike = spike_demo()
    print(f"\nActivation spike (1 token in 16 x100) after 16 calm steps: delayed scaling clips "
          f"{spike['clipped']:.1%} of values, SQNR {spike['delayed SQNR']:.1f} dB; current scaling "
          f"SQNR {spike['current SQNR']:.1f} dB.")
    print(f"\nTraining the tiny GPT for {foundation.counted(args.steps, 'AdamW step')} "
          f"(batch {args.batch} x {args.seq_len}), "
          f"fp32 then FP8 (Float8Linear), on the {training_device().type}, the losses side by side:")
    fp32, float8 = (foundation.train_single_device(foundation.ModelConfig(), args.steps, args.batch,
                                                   args.seq_len, lr=3e-3, device=training_device(),
                                                   transform=transform, progress=f"training, {label}").losses
                    for label, transform in (("fp32", None), ("FP8", convert_to_float8)))
    print(f"  {'step':>6}{'fp32':>9}{'FP8':>9}{'FP8 - fp32':>12}")
    for step in sorted({*range(0, args.steps, max(1, args.steps // 6)), args.steps - 1}):
        print(f"  {step:>6}{fp32[step]:>9.4f}{float8[step]:>9.4f}{float8[step] - fp32[step]:>+12.4f}")
    last = min(10, args.steps)
    final = [sum(losses[-last:]) / last for losses in (fp32, float8)]
    print(f"  mean of the last {last}: fp32 {final[0]:.4f}, FP8 {final[1]:.4f}, difference "
          f"{final[1] - final[0]:+.4f}")
    print("Notice: e4m3 casts keep ~30 dB, e5m2 ~25 dB; finer tiles help under outliers; a spike "
          "breaks delayed scaling but not current scaling; FP8 training tracks fp32 closely.")


def bench(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    compile_fn = functools.partial(torch.compile, disable=args.eager)
    median_ms = functools.partial(triton.testing.do_bench, return_mode="median")
    print(f"{torch.cuda.get_device_name()}, TFLOP/s (median of triton.testing.do_bench runs); "
          f"scaling {'eager' if args.eager else 'under torch.compile'}")
    print(f"{'M=N=K':>7}{'bf16':>7}" + "".join(f"{r + ' ' + c:>17}" for r in ("tensorwise", "rowwise")
                                             for c in ("GEMM", "+ scaling", "speed-up", "with scaling")))
    quantizers = [(eager, compile_fn(eager)) for eager in (quantize_tensorwise, quantize_rowwise)]
    for n in (4096, 8192, 16384):
        a, b = (torch.randn(n, n, device=dev, dtype=bf16) for _ in range(2))
        bf16_ms = median_ms(lambda: a @ b.t())  # noqa: B023 - do_bench runs it at once
        row = ""
        for eager_quantize, quantize in quantizers:
            a_q, a_s = eager_quantize(a)
            b_q, b_s = eager_quantize(b)
            ms = [median_ms(fn) for fn in (lambda: scaled_mm(a_q, a_s, b_q, b_s, bf16),  # noqa: B023
                                           lambda: scaled_mm(*quantize(a), *quantize(b), bf16))]  # noqa: B023
            row += "".join(f"{2 * n ** 3 / t / 1e9:>17.0f}" for t in ms)
            row += "".join(f"{bf16_ms / t:>16.2f}x" for t in ms)
        print(f"{n:>7}{2 * n ** 3 / bf16_ms / 1e9:>7.0f}{row}", flush=True)
    x = torch.randn(8192, 8192, device=dev, dtype=bf16)
    tensorwise = compile_fn(quantize_tensorwise)
    print("\nCasting 8192 x 8192 bf16 to e4m3, GB/s of the bytes a cast must move (read 2 B, write 1 B a "
          "value) beside a bf16 copy's (2 + 2 B: the practical peak):")
    casts = (("bf16 copy", x.clone, 4), ("fused rowwise, one pass", lambda: fused_amax_cast(x), 3),
             ("fused 1 x 128 tiles", lambda: fused_amax_cast(x, 128), 3),
             ("tensorwise (amax, then cast)", lambda: tensorwise(x), 3))
    gbps = {name: moved * x.numel() / median_ms(cast) / 1e6 for name, cast, moved in casts}
    for name, rate in gbps.items():
        print(f"  {name:<30}{rate:>7.0f} GB/s{rate / gbps['bf16 copy']:>7.0%} of the copy's")
    print(f"\nSwiGLU MLP forward+backward, {args.bench_tokens} tokens (ms):")
    print(f"{'dim -> ffn':>14}{'bf16':>9}{'Float8Linear':>14}{'speed-up':>10}")
    for dim, ffn_dim in ((4096, 14336), (8192, 28672)):  # Llama-3 8B and 70B MLPs
        x = torch.randn(args.bench_tokens, dim, device=dev, dtype=bf16, requires_grad=True)
        mlp_cfg = foundation.ModelConfig(dim=dim, ffn_dim=ffn_dim, n_heads=dim // 128)
        mlp = foundation.SwiGLU(mlp_cfg).to(dev, bf16)
        grad_out = torch.randn_like(x)
        ms = []
        for module in (mlp, convert_to_float8(copy.deepcopy(mlp))):
            step = compile_fn(module)
            params = [x, *module.parameters()]  # do_bench runs it at once:
            ms.append(median_ms(lambda: torch.autograd.grad(step(x), params, grad_out)))  # noqa: B023
        print(f"{f'{dim} -> {ffn_dim}':>14}{ms[0]:>9.2f}{ms[1]:>14.2f}{ms[0] / ms[1]:>9.2f}x")
    print("Notice: the GEMM alone nears 2x at large sizes; scaling passes eat into it, less so the larger.")


# The demo's GPT: FFN 192 (not 176) so that its TP splits (96, 48) keep CUDA's FP8 GEMMs at multiples of 16.
DEMO_MODEL = foundation.ModelConfig(ffn_dim=192)
DEMO_MICROBATCHES = 2  # ZeRO-3's, in the distributed demo


def distributed_demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    steps = 3
    world = dist.get_world_size()
    m = DEMO_MICROBATCHES
    cfg = DEMO_MODEL
    eps = 1e-6  # not AdamW's 1e-8, which turns fp32 rounding on gradients near 0 into lr-sized moves (01)
    runs = {mode: train_float8_zero(cfg, steps, args.batch, args.seq_len, mode=mode, microbatches=m,
                                    device=device) for mode in FLOAT8_ZERO_MODES}
    casts = foundation.all_ranks(runs["zero3-fp8"][0].stats["weight_casts"] // steps, dst=0)
    tp_runs = {(sp, whole): train_float8_tensor_parallel(cfg, steps, args.batch, args.seq_len, adam_eps=eps,
                                                         sequence_parallel=sp, whole_tensor_scales=whole,
                                                         device=device)
               for sp, whole in ((False, True), (True, True), (False, False))}
    before = tensor_parallel.measure_layer(cfg, args.batch, args.seq_len, True, device, regather=False)[0]
    fp8_layer = functools.partial(float8_split, sequence_parallel=True)
    after = tensor_parallel.measure_layer(cfg, args.batch, args.seq_len, True, device, lean=True,
                                          context=fp8_layer)[0]
    if casts is not None:  # rank 0
        rest, weights = runs["zero3"][0].stats["padded"]
        n = runs["zero3"][0].stats["n_weights"]
        # Each microbatch gathers every unit twice (forward, backward); the weights' part at b B an element:
        gathered = {b: m * 2 * foundation.ring_traffic("all_gather", b * weights, world) for b in (4, 2, 1)}
        print(f"\nZeRO-3 of the FP8 GPT on {foundation.counted(world, 'rank')} ({dist.get_backend()}, "
              f"{device.type}), {foundation.counted(m, 'microbatch', 'microbatches')}, "
              f"{foundation.counted(steps, 'step')}. Its {n} Float8Linear weights\n({weights:,} elements, "
              f"padded per block) in a ZeRO of their own, the other parameters ({rest:,}) in lesson 02's.\n"
              f"All-gather bytes per rank per step, measured | formula 2m (N-1)/N x (4 B x {rest:,} + "
              f"b x {weights:,}):")
        for mode, b in (("zero3", 4), ("zero3-fp8", 1)):
            measured = runs[mode][1].traffic("all_gather") / steps
            formula = gathered[b] + m * 2 * foundation.ring_traffic("all_gather", 4 * rest, world)
            print(f"  the weights in {'fp32' if b == 4 else 'FP8 '} (b = {b} B): {float(measured):>11,.0f} | "
                  f"{float(formula):<11,.0f}{'' if measured == formula else ' (!=)'} of which the weights "
                  f"{float(gathered[b]):>11,.0f}")
        print(f"  (in bf16, b = 2 B, the weights' part would be {float(gathered[2]):,.0f}.) The gradients "
              f"reduce-scatter in fp32 either way.")
        calls = {mode: runs[mode][1].calls("all_reduce") // steps for mode in ("zero3", "zero3-fp8")}
        amax = (runs["zero3-fp8"][1].traffic("all_reduce") - runs["zero3"][1].traffic("all_reduce")) / steps
        amax_formula = float8_zero_traffic(weights, n, world)["all_reduce"]
        print(f"All-reduces per step: {calls['zero3']} with fp32 gathers (each ZeRO's clipping norm), "
              f"{calls['zero3-fp8']} with FP8 ones: + every weight's\n  amax, {float(amax):.0f} B | "
              f"2 (N-1)/N x {AMAX_BYTES} B x {n} = {float(amax_formula):.0f} B, whatever the microbatches.")
        print(f"Weight pieces cast per step, rank by rank: {casts} = the {n} weights + {sum(casts) - n} "
              f"where a shard boundary cuts one:\n  each element once per step (fp32 gathers: each weight "
              f"in each of the {m} forwards, {m * n} casts per rank).")
        for mode, label in (("zero3", "the fp32-gather run"),
                            ("unsharded", "the unsharded run (ZeRO-0, each weight cast once per step)")):
            loss, grads, params = runs["zero3-fp8"][0].max_differences(runs[mode][0])
            print(f"max |difference| of the FP8-gather run from {label}: loss {loss:.1e}, step-0 gradients "
                  f"{grads:.1e}, parameters after {foundation.counted(steps, 'step')} {params:.1e}")
        print("Notice: a byte per gathered weight element, one small all-reduce per step, and the same bits "
              "as casting whole weights\n(the unsharded run sums its gradients in another order).")
        reference = foundation.train_single_device(cfg, steps, args.batch, args.seq_len, adam_eps=eps,
                                                   device=device, transform=convert_to_float8)
        print(f"\nThe FP8 GPT under tensor parallelism over {foundation.counted(world, 'rank')} (lesson 03), "
              f"{foundation.counted(steps, 'step')} of "
              f"batch {args.batch} x {args.seq_len}, against one device's FP8:\n  {'scales from':<30}max "
              f"|difference|: {'loss':>7}{'step-0 gradients':>17}{'parameters':>11}   amax all-reduces per "
              f"step, measured | formula 2(t-1)/t x 4 B x L (7 + 7m), m = 1")
        for (sp, whole), (result, meter) in tp_runs.items():
            megatron = tensor_parallel.comm_formula(cfg, args.batch, args.seq_len, sp)["all_reduce"][1]
            megatron_bytes = foundation.ring_traffic("all_reduce", megatron, world)
            measured = (meter.traffic("all_reduce") - steps * megatron_bytes) / steps
            formula = tensor_parallel_amax_traffic(world, cfg.n_layers, sequence_parallel=sp) if whole else 0
            label = ("whole tensors'" if whole else "each rank's own pieces'") + (", SP" if sp else "")
            loss, grads, params = result.max_differences(reference)
            print(f"  {label:<48}{loss:>7.1e}{grads:>17.1e}{params:>11.1e}   {float(measured):,.0f} B | "
                  f"{float(formula):,.0f} B{'' if measured == formula else ' (!=)'}")
        print(foundation.lone_token_note(args.seq_len), end="")
        print("Notice: with the whole tensors' scales a split layer casts one device's FP8 numbers (the "
              "tests compare them byte for byte), but its split\nsums add in another order: where that tips "
              "a value across an e4m3 rounding (rare), AdamW makes it an lr-sized move, close to one\n"
              "device, not bit for bit. With each rank's own scales the FP8 roundings differ everywhere, for "
              "a few bytes of amaxes less.")
        print("\nOne layer's activations per rank, TP + SP (fp32), measured | 03's formula (KEPT_INPUT):")
        layer_formula = functools.partial(tensor_parallel.layer_activation_formula, cfg, args.batch,
                                          args.seq_len, world, True)
        rows = {"autograd's, regions' inputs gathered, fp32": (before, layer_formula(regather=False)),
                "lean, re-gathered, FP8 casts": (after, layer_formula(lean=True, kept_input=KEPT_INPUT))}
        for label, (saved, formula) in rows.items():
            differs = "" if saved == formula else " (!=)"
            print(f"  {label:<48}{saved:>11,} B | {formula:,} B{differs}")
    foundation.exit_distributed()


@dataclass
class Options:
    steps: int = foundation.option(60, "AdamW steps of the fp32 and the FP8 training (the loss levels off "
                                   "by ~40)", ">= 1", commands=("single",))
    batch: int = foundation.option(16, "sequences per step (distributed: ZeRO-3's in 2 microbatches)", ">= 1")
    seq_len: int = foundation.option(64, "tokens per sequence", ">= 1")
    bench: bool = foundation.option(False, "GPU: FP8 vs bf16 GEMMs and MLP", commands=("single",))
    bench_tokens: int = foundation.option(16384, "--bench: GEMM rows of the MLP", ">= 1",
                                          commands=("single",))
    eager: bool = foundation.option(False, "--bench: without torch.compile", commands=("single",))


def validate_bench(world: int) -> None:
    """--bench's rule for launch_lesson, whatever the world: FP8 tensor cores."""
    if training_device().type != "cuda":
        raise ValueError("--bench needs a GPU with FP8 tensor cores (compute capability >= 8.9)")


def validate_fp8_rows(batch: int, seq_len: int, distributed: bool, world: int) -> None:
    """On a GPU, the FP8 GEMMs' rows in multiples of 16 (scaled_mm): a step's, or each rank's below."""
    if training_device().type != "cuda":
        return
    rows = {"a step's": batch * seq_len}
    if distributed:
        rows = {"a rank's ZeRO-3 microbatch": batch // (DEMO_MICROBATCHES * world) * seq_len,
                "a rank's sequence shard under SP": batch * seq_len // world}
    odd = [f"{what} {n}" for what, n in rows.items() if n % 16]
    if odd:
        raise ValueError(f"FP8 GEMMs on CUDA need rows in multiples of 16, not {', '.join(odd)} (--batch "
                         f"x --seq-len)")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options,), {
        "single": foundation.Command("one process: FP8 formats and scaling, the fused cast, FP8 training "
                                     "(--bench: on a GPU)"),
        "distributed": foundation.Command("on --nproc ranks: ZeRO-3 with FP8 all-gathers, FP8 under tensor "
                                          "parallelism", classes=(foundation.Ranks,))},
        aliases={"global_batch": "batch"}, bench_only=("eager",))
    if getattr(args, "bench", False):
        foundation.launch_lesson(parser, args, bench, rules=[validate_bench])
        return
    distributed = args.command == "distributed"
    rows = functools.partial(validate_fp8_rows, args.batch, args.seq_len, distributed)
    memory = functools.partial(foundation.check_memory, DEMO_MODEL, args.batch, args.seq_len,
                               what=f"--batch {args.batch} x --seq-len {args.seq_len}")
    if not distributed:
        foundation.launch_lesson(parser, args, demo, rules=[rows, memory])
        return
    microbatches = functools.partial(validate_float8_zero, args.batch, microbatches=DEMO_MICROBATCHES)
    heads = functools.partial(tensor_parallel.validate_tensor_parallel, DEMO_MODEL)
    foundation.launch_lesson(parser, args, distributed_demo, divisible={"--seq-len": args.seq_len},
                             rules=[microbatches, heads, rows, memory])


# --- For lesson 09's plan: what a linear layer costs on an H100 (no demo here reads it) --------------------
# This lesson's `--bench` on one H100 SXM (README, "On one H100"): TFLOP/s of a @ b.t() at M = N = K in bf16,
# tensorwise FP8, and FP8 with both operands' amax and cast; the GEMMs priced at the first two, the casts by
# their bytes (float8_cast_bytes) at CAST_BYTES an element: the third column's extra time at 3.35 TB/s.
GEMM_TFLOPS_H100 = {4096: (770, 1210, 713), 8192: (709, 1230, 808), 16384: (746, 1286, 1028)}
CAST_BYTES = sum(n * (1 / cast - 1 / f8) * 3.35 for n, (_, f8, cast) in GEMM_TFLOPS_H100.items()) / 3  # ~10
# The weights' casts run eager (outside the compiled blocks, each operation a kernel): bytes an element, by
# the weight's bytes (bf16 or fp32), as a dispatch mode counts them (test_08); weight_casts_bytes reads them
WEIGHT_CAST_BYTES = {2: 77, 4: 67}
SHARD_CAST_BYTES = {2: 83, 4: 75}


def gemm_seconds(m: int, k: int, n: int, hbm_bytes_per_s: float, float8: bool = False,
                 speed: float = 1.0) -> float:
    """A roofline for (m x k) @ (k x n): the longer of its FLOPs at the measured rate of the GEMM
    nearest in FLOPs (x speed: another GPU's peak over the H100's) and its bytes (inputs in bf16 or
    FP8, a bf16 output) at the memory's bandwidth. A thin GEMM (few tokens) is bandwidth-bound."""
    flops = 2 * m * k * n
    size = min(GEMM_TFLOPS_H100, key=lambda x: max(2 * x ** 3 / max(flops, 1), flops / (2 * x ** 3)))
    moved = (m * k + k * n) * (1 if float8 else 2) + 2 * m * n
    return max(flops / (GEMM_TFLOPS_H100[size][float8] * 1e12 * speed), moved / hbm_bytes_per_s)


def float8_cast_bytes(tokens: int, in_features: int, out_features: int, input_cast: bool = True) -> tuple:
    """Memory traffic (forward, backward) of Float8Linear's casts from bf16 in a compiled block: x's, then
    backward's output gradient's, at CAST_BYTES an element (measured; the amax's read, the cast's read and
    write: 5 B at least), and the column-major copies _scaled_mm wants of the gradient, x and W (1 B read,
    1 written). input_cast False: another linear made x's cast. The weight's cast: weight_casts_bytes."""
    x = tokens * in_features
    w = in_features * out_features
    g = tokens * out_features
    return CAST_BYTES * input_cast * x, CAST_BYTES * g + 2 * (g + x + w)


def weight_casts_bytes(elements: int, elem_bytes: int, shards: int = 0) -> float:
    """Memory traffic of a step's casts of `elements` FP8 weights of elem_bytes: weights_cast_once's, or
    with shards > 0 Float8ZeRO's, each rank casting its 1/shards of them."""
    if shards:
        return SHARD_CAST_BYTES[elem_bytes] * elements / shards
    return WEIGHT_CAST_BYTES[elem_bytes] * elements


def linear_seconds(tokens: int, in_features: int, out_features: int, hbm_bytes_per_s: float,
                   float8: bool = False, speed: float = 1.0, input_cast: bool = True) -> tuple[float, float]:
    """A linear layer's (forward, backward): its three GEMMs (the docstring's FLOAT8LINEAR), and casts."""
    gemm = functools.partial(gemm_seconds, hbm_bytes_per_s=hbm_bytes_per_s, float8=float8, speed=speed)
    casts = (0, 0)
    if float8:
        casts = float8_cast_bytes(tokens, in_features, out_features, input_cast)
    forward = gemm(tokens, in_features, out_features) + casts[0] / hbm_bytes_per_s
    backward = gemm(tokens, out_features, in_features) + gemm(out_features, tokens, in_features)
    return forward, backward + casts[1] / hbm_bytes_per_s


if __name__ == "__main__":
    main()
