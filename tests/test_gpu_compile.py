"""The GPU kernels of lessons 07 and 08 compile for an H100 and an A100, fit, and do not spill: checked
on a machine with no GPU.

Everywhere else the kernels run in Triton's interpreter, which accepts programs the compiler may
reject and ignores what decides whether a kernel can launch and run fast. Here Triton compiles them
for sm_90 (H100) and sm_80 (A100) without a GPU (07's compile_for_gpu: a child process with the
interpreter off), and ptxas -v reports each kernel's registers and spills. This proves:
  - every kernel compiles for the GPU at head dims 64 and 128, in bf16, fp16 and fp32 (07) and for each
    FP8 format (08, sm_90: FP8 needs sm_89+);
  - one block's shared memory fits the target's per-block limit (H100 227 KiB, A100 163 KiB), so no
    config the autotuner may try is unlaunchable;
  - with the pinned Triton, every config the autotuner may try in bf16 or fp16 at head dims 64 and 128 is
    spill-free on sm_90 (register use changes between Triton versions: skipped, saying so, on another);
  - fp32 inputs get exact fp32 dots: their PTX has no TF32 instruction (the interpreter cannot tell);
  - the autotuner's prune function keeps exactly the listed configs per head dim and dtype.
It cannot prove speed (that needs a GPU and --bench) or numerics (the interpreter tests and the GPU
tests of test_07/test_08 do). Compiles are slow (1-2 s each in 16-bit, 15-40 s in fp32, whose exact dots
are unrolled on CUDA cores), so fp16, fp32 and sm_80 compile a representative subset (attention_jobs).
"""
from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
flash = importlib.import_module("07_flash_attention")  # first: without a GPU it turns the interpreter on
fp8 = importlib.import_module("08_fp8")
import triton  # noqa: E402

PINNED = triton.__version__ == flash.PINNED_TRITON
HEAD_DIMS = (64, 128)


def largest(configs: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """The kept config with the biggest tile (then the most stages): the one nearest every limit."""
    return max(configs, key=lambda c: (c[0] * c[1], c[3], -c[2]))


def attention_jobs() -> list[tuple[str, tuple, str, int, int]]:
    """(kernel, config, dtype, head_dim, capability) at head dims 64 and 128: on sm_90 every kept bf16
    config, and in fp16 and on sm_80 the largest per kernel (bf16 and fp16 compile alike: same registers,
    same shared memory); fp32's one config per kernel at head dim 64 on sm_90: each fp32 compile takes
    15-40 s (CUDA-core dots unrolled); --gpu-report shows fp32 at 128 fits (<= 70 KiB)."""
    jobs = []
    for kernel, table in flash.GPU_TABLES.items():
        for head_dim in HEAD_DIMS:
            kept = flash.kept_configs(table, head_dim, 2)
            jobs += [(kernel, config, "bf16", head_dim, 90) for config in kept]
            jobs += [(kernel, largest(kept), "fp16", head_dim, 90),
                     (kernel, largest(kept), "bf16", head_dim, 80)]
        jobs += [(kernel, config, "fp32", 64, 90) for config in flash.kept_configs(table, 64, 4)]
    return jobs


def fp8_cast_jobs() -> list[dict]:
    """08's fused amax + cast, as fused_amax_cast launches it: rowwise on 4096 columns and 1 x 128
    tiles, from bf16 and fp32, into each format, with its own or a given (delayed) scale."""
    jobs = []
    for tile_cols, source, (name, dtype), given in [(4096, "bf16", ("fp8e4nv", fp8.E4M3), False),
                                                    (128, "fp32", ("fp8e4nv", fp8.E4M3), True),
                                                    (128, "bf16", ("fp8e5", fp8.E5M2), False),
                                                    (4096, "fp32", ("fp8e5", fp8.E5M2), True)]:
        finfo, (rows, block, num_warps) = torch.finfo(dtype), fp8.cast_launch_shape(tile_cols)
        constexprs = dict(ROWS=rows, BLOCK=block, FP8_MAX=finfo.max,
                          MIN_EXP=int(math.log2(finfo.smallest_normal)),
                          MANTISSA_BITS=int(-math.log2(finfo.eps)), EPS=fp8.AMAX_EPS, GIVEN_SCALE=given,
                          NAN_BITS=fp8.NAN_BITS, INF_BITS=fp8.INF_BITS[dtype])
        pointers = {"x_ptr": f"*{source}", "q_ptr": f"*{name}", "scale_ptr": "*fp32", "amax_ptr": "*fp32"}
        signature = {**pointers, "n_rows": "i32", "n_cols": "i32", "tile_cols": "i32",
                     **{key: "constexpr" for key in constexprs}}
        jobs.append(dict(module="08_fp8", kernel="_amax_cast_kernel", signature=signature,
                         constexprs=constexprs, capability=90,
                         num_warps=num_warps, num_stages=3))
    return jobs


def tf32_default_job() -> dict:
    """An fp32 forward without input_precision: Triton's default for fp32 dots is TF32."""
    job = flash.attention_compile_job("_fwd_kernel", "fp32", 64, 64, 64, 4, 3)
    job["constexprs"]["PRECISION"] = None
    return job


@pytest.fixture(scope="module")
def compiled() -> dict:
    """All compiles in one batch, two processes at a time (the cores of a laptop or the CI runner)."""
    attention, fp8_jobs = attention_jobs(), fp8_cast_jobs()
    results = flash.compile_for_gpu([flash.attention_compile_job(kernel, dtype, head_dim, *config, capability=cap)
                                     for kernel, config, dtype, head_dim, cap in attention]
                                    + fp8_jobs + [tf32_default_job()])
    return dict(attention=dict(zip(attention, results, strict=False)),
                fp8=results[len(attention):-1], tf32_default=results[-1])


def test_every_compiled_kernel_fits_the_targets_shared_memory(compiled):
    for (kernel, config, dtype, head_dim, capability), got in compiled["attention"].items():
        assert got["shared"] <= flash.SHARED_PER_BLOCK[capability], \
            f"{kernel} {config} {dtype} head_dim {head_dim} sm_{capability}: {got['shared']} B"
    for got in compiled["fp8"]:
        assert got["shared"] <= flash.SHARED_PER_BLOCK[90]


@pytest.mark.skipif(not PINNED, reason=f"register use changes between Triton versions: the configs were "
                    f"pruned with Triton {flash.PINNED_TRITON}, this is {triton.__version__}")
def test_kept_16bit_configs_do_not_spill_on_sm90(compiled):
    spilling = [(key, got["spill_stores"], got["spill_loads"]) for key, got in compiled["attention"].items()
                if key[2] != "fp32" and key[4] == 90 and got["spill_stores"] + got["spill_loads"]]
    assert not spilling, spilling
    assert len([key for key in compiled["attention"] if key[2] != "fp32" and key[4] == 90]) >= 3 * 2 * 2


def test_fp32_kernels_use_exact_fp32_dots_not_tf32(compiled):
    fp32 = {key: got for key, got in compiled["attention"].items() if key[2] == "fp32"}
    assert len(fp32) == len(flash.GPU_TABLES)
    assert not [key for key, got in fp32.items() if got["tf32"]]
    # The check can fail: without input_precision="ieee" the finder sees TF32 tensor-core instructions.
    assert compiled["tf32_default"]["tf32"]


def test_fp8_cast_kernel_compiles_for_sm90(compiled):
    assert len(compiled["fp8"]) == 4 and all(got["registers"] > 0 for got in compiled["fp8"])
    if PINNED:
        assert not [got for got in compiled["fp8"] if got["spill_stores"] + got["spill_loads"]]


def test_a_job_missing_a_kernel_argument_is_refused_by_name():
    """A kernel that gains an argument (08's cast kernel gained NAN_BITS and INF_BITS) fails a stale
    compile job with one line naming its arguments, not with an AttributeError deep inside Triton."""
    job = fp8_cast_jobs()[0]
    del job["signature"]["INF_BITS"], job["constexprs"]["INF_BITS"]
    with pytest.raises(RuntimeError, match=r"the signature must name _amax_cast_kernel's arguments \["):
        flash.compile_for_gpu([job], processes=1)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prune_times_only_the_listed_configs(head_dim, dtype):
    """The prune function the autotuners get on a GPU (the interpreter has one config and no prune)."""
    q = torch.empty(1, 1, 1, head_dim, dtype=dtype)
    for table in flash.GPU_TABLES.values():
        everything = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                      for m, n, w, s in dict.fromkeys(c for kept in table.values() for c in kept)]
        pruned = flash._prune(table)(everything, {"Q": q}, HEAD_DIM=head_dim)
        got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in pruned]
        assert sorted(got) == sorted(flash.kept_configs(table, head_dim, q.element_size())) and got
