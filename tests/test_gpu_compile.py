"""The GPU kernels of lessons 07 and 08 compile for an H100 and an A100, fit, and do not spill: checked
on a machine with no GPU.

Everywhere else the kernels run in Triton's interpreter, which accepts programs the compiler may
reject and ignores what decides whether a kernel can launch and run fast. Here Triton compiles them
for sm_90 (H100) and sm_80 (A100) without a GPU (compile_for_gpu: this file run as a child process
with TRITON_INTERPRET=0, which lesson 01 leaves alone: the compiler, not the interpreter), and the
ptxas shipped with Triton (-v) reports each kernel's registers and spills. This proves:
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

`python tests/test_gpu_compile.py` prints every 07 kernel x config x 16-bit dtype x head dim (and fp32's
own configs) compiled for sm_90: shared memory, registers, spills, and whether the autotuner tries it:
the figures behind 07's tables FWD_GPU, DKDV_GPU, DQ_GPU and HOPPER_FWD_GPU. The Hopper kernel's tensor
descriptors compile to TMA copies on sm_90 (to plain loads on sm_80), which the interpreter cannot show.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# First: lesson 01 turns the interpreter on without a GPU, unless TRITON_INTERPRET is set (the worker's 0).
flash = importlib.import_module("07_flash_attention")
fp8 = importlib.import_module("08_fp8")
import triton  # noqa: E402

PINNED_TRITON = "3.7.1"  # the Triton the configs were pruned with (register use varies by version)
PINNED = triton.__version__ == PINNED_TRITON
SHARED_PER_BLOCK = {90: 227 * 1024, 80: 163 * 1024}  # bytes of shared memory a block may use: H100, A100
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"  # shipped with Triton
GPU_TABLES = {"_fwd_kernel": flash.FWD_GPU, "_bwd_dkdv_kernel": flash.DKDV_GPU,
              "_bwd_dq_kernel": flash.DQ_GPU,  # 07's autotune tables, by kernel, and its Hopper variant's
              "_hopper_fwd_kernel": flash.HOPPER_FWD_GPU}
HEAD_DIMS = (64, 128)


# --- compiling for a GPU that is not here ----------------------------------------------------

def attention_compile_job(kernel: str, dtype: str, head_dim: int, block_m: int, block_n: int,
                          num_warps: int, num_stages: int, capability: int = 90) -> dict:
    """What compile_for_gpu needs to compile one of 07's kernels as a causal launch with q of this
    dtype ("bf16", "fp16", "fp32") and head_dim would: pointers 16-byte aligned (as torch's are), in
    lesson 01's layout for 16 query and 4 K/V heads (rows 16 and 4 head dims apart)."""
    fn = getattr(flash, kernel).fn  # the JITFunction under the autotuner
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), Q_ROW=16,
                      KV_ROW=4, CAUSAL=True, PRECISION="ieee" if dtype == "fp32" else None,
                      BLOCK_M=block_m, BLOCK_N=block_n)
    signature = {name: "constexpr" if name in constexprs else "fp32" if name == "sm_scale" else
                 ("*fp32" if name in ("LSE", "DELTA") else f"*{dtype}") if name.isupper() else "i32"
                 for name in fn.arg_names}
    strides = [name for name in fn.arg_names if name.endswith(("_batch", "_head"))]
    return dict(module="07_flash_attention", kernel=kernel, signature=signature, constexprs=constexprs,
                capability=capability, num_warps=num_warps, num_stages=num_stages,
                divisible=strides)  # as Triton specialises them at a launch: multiples of 16


def compile_for_gpu(jobs: list[dict], processes: int = 2) -> list[dict]:
    """Compiles each job (a kernel, argument types, constexprs, target, warps, stages) for a GPU
    that need not be here -> per job: shared (bytes per block), registers (per thread), spill_stores,
    spill_loads (bytes, from ptxas -v), tf32 and tma (whether the PTX has a TF32 instruction, a TMA
    copy). Runs in child processes (this file, --compile-worker), where the interpreter is off; Triton
    caches the compiles across runs."""
    def worker(share: list[dict]) -> list[dict]:
        run = subprocess.run([sys.executable, __file__, "--compile-worker"], input=json.dumps(share),
                             capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"))
        if run.returncode:
            raise RuntimeError(f"the compile worker failed:\n{run.stderr}")
        return json.loads(run.stdout)
    with ThreadPoolExecutor(processes) as pool:
        results = list(pool.map(worker, [jobs[i::processes] for i in range(processes)]))
    return [results[i % processes][i // processes] for i in range(len(jobs))]


def compile_one(job: dict) -> dict:
    """In the worker: triton.compile for the job's target, then ptxas -v (as Triton runs it) on the PTX."""
    fn = getattr(importlib.import_module(job["module"]), job["kernel"])
    fn = fn.fn if isinstance(fn, triton.runtime.Autotuner) else fn  # the JITFunction under an autotuner
    if list(job["signature"]) != fn.arg_names:
        raise ValueError(f"the signature must name {job['kernel']}'s arguments {fn.arg_names} in order")
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(job["signature"].items())
               if t[0] == "*" or name in job.get("divisible", ())}
    compiled = triton.compile(triton.compiler.ASTSource(fn, job["signature"], job["constexprs"], aligned),
                              target=triton.backends.compiler.GPUTarget("cuda", job["capability"], 32),
                              options=dict(num_warps=job["num_warps"], num_stages=job["num_stages"]))
    ptx, arch = compiled.asm["ptx"], f"sm_{job['capability']}{'a' if job['capability'] >= 90 else ''}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        log = subprocess.run([str(PTXAS), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}",
                              file.name, "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(shared=compiled.metadata.shared, registers=int(re.search(r"Used (\d+) registers", log)[1]),
                spill_stores=int(spills[1]), spill_loads=int(spills[2]),
                tf32=bool(re.search(r"\.tf32\b", ptx)), tma=bool(re.search(r"cp\.async\.bulk\.tensor", ptx)))


# --- the jobs ----------------------------------------------------------------------------------


def largest(configs: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """The kept config with the biggest tile (then the most stages): the one nearest every limit."""
    return max(configs, key=lambda c: (c[0] * c[1], c[3], -c[2]))


def attention_jobs() -> list[tuple[str, tuple, str, int, int]]:
    """(kernel, config, dtype, head_dim, capability) at head dims 64 and 128: on sm_90 every kept bf16
    config, and in fp16 and on sm_80 the largest per kernel (bf16 and fp16 compile alike: same registers,
    same shared memory); fp32's one config per kernel at head dim 64 on sm_90: each fp32 compile takes
    15-40 s (CUDA-core dots unrolled); the printed table shows fp32 at 128 fits (<= 70 KiB)."""
    jobs = []
    for kernel, table in GPU_TABLES.items():
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
    job = attention_compile_job("_fwd_kernel", "fp32", 64, 64, 64, 4, 3)
    job["constexprs"]["PRECISION"] = None
    return job


@pytest.fixture(scope="module")
def compiled() -> dict:
    """All compiles in one batch, two processes at a time (the cores of a laptop or the CI runner)."""
    attention, fp8_jobs = attention_jobs(), fp8_cast_jobs()
    results = compile_for_gpu([attention_compile_job(kernel, dtype, head_dim, *config, capability=cap)
                               for kernel, config, dtype, head_dim, cap in attention]
                              + fp8_jobs + [tf32_default_job()])
    return dict(attention=dict(zip(attention, results, strict=False)),
                fp8=results[len(attention):-1], tf32_default=results[-1])


def test_every_compiled_kernel_fits_the_targets_shared_memory(compiled):
    for (kernel, config, dtype, head_dim, capability), got in compiled["attention"].items():
        assert got["shared"] <= SHARED_PER_BLOCK[capability], \
            f"{kernel} {config} {dtype} head_dim {head_dim} sm_{capability}: {got['shared']} B"
    for got in compiled["fp8"]:
        assert got["shared"] <= SHARED_PER_BLOCK[90]


@pytest.mark.skipif(not PINNED, reason=f"register use changes between Triton versions: the configs were "
                    f"pruned with Triton {PINNED_TRITON}, this is {triton.__version__}")
def test_kept_16bit_configs_do_not_spill_on_sm90(compiled):
    spilling = [(key, got["spill_stores"], got["spill_loads"]) for key, got in compiled["attention"].items()
                if key[2] != "fp32" and key[4] == 90 and got["spill_stores"] + got["spill_loads"]]
    assert not spilling, spilling
    assert len([key for key in compiled["attention"] if key[2] != "fp32" and key[4] == 90]) >= 3 * 2 * 2


def test_fp32_kernels_use_exact_fp32_dots_not_tf32(compiled):
    fp32 = {key: got for key, got in compiled["attention"].items() if key[2] == "fp32"}
    assert len(fp32) == len(GPU_TABLES)
    assert not [key for key, got in fp32.items() if got["tf32"]]
    # The check can fail: without input_precision="ieee" the finder sees TF32 tensor-core instructions.
    assert compiled["tf32_default"]["tf32"]


def test_the_hopper_kernel_copies_its_tiles_with_tma_on_sm90(compiled):
    """What the interpreter cannot show: on sm_90 the Hopper kernel's tensor descriptors become TMA copies
    (cp.async.bulk.tensor) in every config and dtype; the main kernels' pointer loads never do."""
    sm90 = {key: got["tma"] for key, got in compiled["attention"].items() if key[4] == 90}
    assert any(key[0] == "_hopper_fwd_kernel" for key in sm90)
    assert all(tma == (key[0] == "_hopper_fwd_kernel") for key, tma in sm90.items()), sm90


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
        compile_for_gpu([job], processes=1)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prune_times_only_the_listed_configs(head_dim, dtype):
    """The prune function the autotuners get on a GPU (the interpreter has one config and no prune)."""
    q = torch.empty(1, 1, 1, head_dim, dtype=dtype)
    for table in GPU_TABLES.values():
        everything = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                      for m, n, w, s in dict.fromkeys(c for kept in table.values() for c in kept)]
        pruned = flash._prune(table)(everything, {"Q": q}, HEAD_DIM=head_dim)
        got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in pruned]
        assert sorted(got) == sorted(flash.kept_configs(table, head_dim, q.element_size())) and got


# --- the table: `python tests/test_gpu_compile.py` ----------------------------------------------

def gpu_report() -> None:
    """Compiles every kernel x config x 16-bit dtype x head dim (64, 128) for sm_90, and fp32's own
    configs (its CUDA-core dots compile slowly), and prints what one block needs: shared memory,
    registers per thread, spill bytes; and whether the autotuner tries it. No GPU needed."""
    limit = SHARED_PER_BLOCK[90]
    rows = [(kernel, config, dtype, head_dim) for kernel, table in GPU_TABLES.items()
            for config in dict.fromkeys(c for (_, size), kept in table.items() if size == 2 for c in kept)
            for dtype in ("bf16", "fp16") for head_dim in HEAD_DIMS]
    rows += [(kernel, config, "fp32", head_dim) for kernel, table in GPU_TABLES.items()
             for head_dim in HEAD_DIMS for config in flash.kept_configs(table, head_dim, 4)]
    results = compile_for_gpu([attention_compile_job(kernel, dtype, head_dim, *config)
                               for kernel, config, dtype, head_dim in rows])
    print(f"sm_90, Triton {triton.__version__}, causal; shared memory limit {limit // 1024} KiB "
          f"a block, 255 registers a thread.\n{'kernel':<18}{'M x N':>9}{'warps':>6}{'stages':>7}"
          f"{'dtype':>6}{'head':>5}{'shared':>9}{'regs':>6}{'spill st/ld B':>15}  autotuner")
    for (kernel, (m, n, warps, stages), dtype, head_dim), got in zip(rows, results, strict=True):
        spills = got["spill_stores"] + got["spill_loads"] > 0
        why = [f"needs {got['shared'] / 1024:.0f} KiB > {limit // 1024}"] if got["shared"] > limit else []
        why += ["spills"] if spills else []
        kept = flash.kept_configs(GPU_TABLES[kernel], head_dim, 4 if dtype == "fp32" else 2)
        if (m, n, warps, stages) in kept:
            verdict = "tries it" + ("  <- SPILLS" if spills and dtype != "fp32" else "")
        else:
            verdict = "never: " + (", ".join(why) or "not listed for this head dim")
        print(f"{kernel:<18}{f'{m}x{n}':>9}{warps:>6}{stages:>7}{dtype:>6}{head_dim:>5}"
              f"{got['shared'] / 1024:>6.0f} KiB{got['registers']:>6}{got['spill_stores']:>8}/"
              f"{got['spill_loads']:<6}  {verdict}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile-worker"]:  # compile_for_gpu's child: jobs on stdin, results on stdout
        if flash.INTERPRETED:
            sys.exit("the compile worker needs Triton's compiler: run it with TRITON_INTERPRET=0")
        print(json.dumps([compile_one(job) for job in json.loads(sys.stdin.read())]))
    else:
        gpu_report()
