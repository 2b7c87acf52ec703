"""Lesson 09: every technique at once. A (dp, pp, cp, tp) mesh, one model, proved equal to one device.

Three sub-commands, each with its own options: `train` (the default) trains on text, `check` proves the mesh
equal to one device, `plan` prices a run at scale on a cluster that is not here. The parts, as a run goes:
  The mesh: MeshSizes (tp fastest), build_mesh (every group), rank_map                           all
  The configuration: TrainConfig, RunConfig, Job (a command's options, made once); validate      all
  The composed model and its step: build_stage_model; Trainer (forward_backward, update)         check, train
  Data: read_tokens, ShardedLoader (bytes are tokens), learning_rate                             train
  Checkpoints: a Trainer's pieces (held_piece, piece_of) in lesson 02's protocol                 train, check
  The training run: train_loop, train_run (the program), print_run; MFU, sample                  train
  The equivalence check: check_steps, summary (measured beside the plan), check_run              check
  The plan's formulas: plan (bytes held and sent per rank, the lessons' formulas)               all
  Planning at scale: PRESETS, GPUS, Cluster, step_time (a step's seconds), search_meshes, plan_report plan
  The command line: the option fields (01's option()), COMMANDS, configure (options -> Job), main   all

THE MESH
world = dp x pp x cp x tp ranks (the mesh sets them: 09 has no --nproc), numbered with tp fastest:
rank = ((d pp + p) cp + c) tp + t. So a TP group's ranks are adjacent (one node, the fastest link: TP talks in
every layer), then cp, pp and dp, which talk less. Every rank creates every group in the same order
(dist.new_group is a collective over the world) and keeps its own. Expert parallelism needs no ranks of its
own: the dp x cp ranks of one (pp, tp) position hold different tokens, so an MoE layer may spread experts over
them (ep divides dp x cp); each expert is data-parallel over the other dp x cp / ep ranks.

ONE MODEL, TRANSFORMED IN ONE ORDER (each step an earlier lesson's own function)
  01 GPT(cfg) -> 06 convert_to_moe + apply_expert_parallel (--moe, --ep) -> 08 convert_to_float8 (--fp8) -> 03
  apply_lean_saves (unless --autograd-saves) -> 03 apply_tensor_parallel (+ SP; --loss-chunks: 03's
  ChunkedLoss) -> 05 ContextParallelAttention as attention (zigzag ring; 07's kernel on a GPU) -> 04 cut_stage
  (v stages a rank: interleaved 1F1B) -> 02 ZeRO 0-3 over dp x cp (experts: over the ranks holding the same
  ones; --fp8 --zero 3's Float8Linear weights: 08's Float8ZeRO, gathered in FP8).
TP rewrites modules and needs the whole model, CP only swaps a function, a stage cut deletes modules, ZeRO
flattens the final parameters. EP comes before TP: it slices the experts into new parameters, and SP's hook
goes on those. MoE layers are not split over tp: each tp rank runs them on its tokens (with SP, its shard).

GRADIENTS EQUAL ONE DEVICE'S, because each reduction happens exactly once:
- tp: Megatron's f/g inside the model; with SP every replicated parameter's partial gradient is summed over tp
  (03's hook). Nothing else reduces over tp.
- pp: each stage owns its parameters; microbatch losses are divided by m (04).
- dp x cp: each rank's loss is the mean over its tokens (equal counts) and the ring returns every dK/dV to its
  owner, so the dp x cp ranks' mean gradient is the batch's: ZeRO's reduce-scatter (or all-reduce) / (dp cp),
  once per step: no_sync around the schedule but for each stage's last backward, where 02's hooks reduce
  each unit as that backward completes it (--reduce-after-backward: once the schedule ends). An expert's
  gradient arrives summed over ep (06's backward all-to-all): / ep, then its own ZeRO / (dp cp / ep).
- clipping: ||g||^2 sums ZeRO's shards, then the ep (experts), tp and pp ranks; a parameter replicated over tp
  counts 1/tp on each. Every rank then scales alike.
MoE here is dropless without balancing, whose load would depend on which tokens share a forward (validate).

COST: plan() composes the lessons' formulas for what each rank holds and sends, building nothing: `check`
prints them beside each rank's measurements (tests prove them equal); `plan` sets them against GPU memory for
models and clusters not here, and prices a step. `train` adds 02's checkpoints, a NaN guard, MFU, a sample.

THE STEP TIME, from the operations (step_time): each one priced by the lesson that owns it, no MFU assumed.
GEMMs at their TP-local shapes by 08's roofline; attention at 07's measured rate (--attention unfused:
unfused_attention_seconds, with Megatron's dropout of the probabilities; cp > 1: 07's kernel in 05's ring,
whose eager merges move ring_merge_bytes, priced_kernel); elementwise work (elementwise_bytes, split as 03
splits the layer; the eager loss, FP8 weight casts and collectives' copies by the bytes a dispatch mode
counts) and the optimizer (02) at the HBM's bandwidth; what recompute runs again. On a GPU other than the
H100 SXM, 07's and 08's rates are the H100's scaled by its datasheet peak (Cluster): no course kernel ran
there. Messages go at their link's speed (NVLink inside a node, the NIC across: inside_node) plus a latency,
exposed where nothing hides them: TP's, but SP's regather and input-gradient reduce-scatter beyond the
GEMMs 03's backward runs beside them (sequence_parallel_hidden), the ring's hops beyond a block's attention
and merge, the gradient reduction beyond the last microbatch's backward (--reduce-after-backward: all of
it), ZeRO-1/2's gather after the step, ZeRO-3's beyond the previous layer, the pipeline's sends in its fill
and drain. The slowest pipeline rank's microbatches / (1 - 04's bubble) span the pipeline (pipeline_span).
Two bounds frame it: full overlap, none.

THE SEARCH (search_meshes): every dp x pp x cp x tp = N with tp inside a node that validate accepts; those
that fit in memory, fastest first; a given mesh that does not fit names its largest part and the fastest
option that keeps less with which it fits (why_not_fitting); where none fits, plan exits 1. The README's
planning table checks the predictions against published runs: those the model was calibrated on, and
runs it was only checked on (A100s, long context, B200s): PRESETS.

RUN IT
    python 09_full_train.py                      # train: dp=2 x tp=2, 4 CPU processes, a few minutes
    python 09_full_train.py --resume             # after a kill: on from the last checkpoint (or STEP)
    python 09_full_train.py --dp 1 --tp 1 --model 1b --attention flash --compile --profile 3  # one H100
    torchrun --nproc_per_node=8 09_full_train.py check --dp 2 --tp 2 --pp 2
    python 09_full_train.py check --dp 2 --cp 2 --tp 2 --sequence-parallel
    python 09_full_train.py check --dp 2 --tp 2 --pp 2 --moe --ep 2  # MoE, experts over 2 dp ranks
    python 09_full_train.py plan --model llama3-70b --gpus 256   # the fastest meshes that fit
    python 09_full_train.py plan --model llama3-405b --dp 64 --pp 16 --cp 1 --tp 8 --sequence-parallel \
        --zero 2 --schedule interleaved --virtual 2 --ends-as-layers  # Meta's mesh, per pipeline rank
Look at: the loss falling from ln 256 = 5.5 and the sample; tokens/s and MFU; with check, the rank map, the
max |difference| from one device (loss, every gradient reassembled from the shards, parameters after the
steps) and bytes per mesh dimension beside the formulas; with plan, the fullest GPU's bytes beside its memory,
which terms of the step are exposed communication and which the bubble, and how far apart the two bounds are.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import math
import os
import shlex
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
tensor_parallel = importlib.import_module("03_tensor_parallel")
pipeline = importlib.import_module("04_pipeline")
context_parallel = importlib.import_module("05_context_parallel")
expert_parallel = importlib.import_module("06_expert_parallel")
flash = importlib.import_module("07_flash_attention")
fp8 = importlib.import_module("08_fp8")

DIMS = ("dp", "pp", "cp", "tp")  # slowest to fastest varying
STEP_PARTS = ("forward", "backward", "gradient sync", "optimizer")  # record_function names (04, Trainer)

option = foundation.option  # 01's: a dataclass field that is also the option --field-name, its rule beside it
STEPPING = ("check", "train")  # the sub-commands that take optimizer steps (an option's default: all)
TRAIN = ("train",)
# what 02's ZeRO and 01's reference take
OPTIMIZER = ("lr", "adam_eps", "max_grad_norm", "mixed_precision", "bf16_optimizer")


# --- The mesh: sizes, coordinates and every group -------------------------------------------------
@dataclass(frozen=True)
class MeshSizes:
    dp: int = option(1, "data-parallel ranks (ZeRO shards over dp x cp)", ">= 1")
    pp: int = option(1, "pipeline-parallel ranks", ">= 1")
    cp: int = option(1, "context-parallel ranks (ring attention)", ">= 1")
    tp: int = option(1, "tensor-parallel ranks (adjacent: one node)", ">= 1")
    ep: int = option(1, "expert-parallel ranks, borrowed from dp x cp (not a dimension)", ">= 1")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """rank -> {dim: index}, tp fastest."""
        out = {}
        for dim in reversed(DIMS):
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return {dim: out[dim] for dim in DIMS}

    def rank(self, **coords: int) -> int:
        r = 0
        for dim in DIMS:
            r = r * getattr(self, dim) + coords[dim]
        return r

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group whose ranks differ only along dims, each in mesh order."""
        fixed = [d for d in DIMS if d not in dims]
        out = []
        for held in itertools.product(*(range(getattr(self, d)) for d in fixed)):
            moving = itertools.product(*(range(getattr(self, d)) for d in dims))
            out.append([self.rank(**dict(zip(fixed, held)), **dict(zip(dims, m))) for m in moving])
        return out

    def expert_groups(self, expert_data: bool) -> list[list[int]]:
        """ep groups: runs of ep consecutive ranks of each dp x cp group (cp first, then dp);
        expert-data groups (expert_data=True): the ranks holding the same experts."""
        out = []
        for ranks in self.groups(("dp", "cp")):
            runs = [ranks[i:i + self.ep] for i in range(0, len(ranks), self.ep)]
            out += [list(g) for g in zip(*runs)] if expert_data else runs
        return out


GROUP_DIMS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}
_ZERO_OPS = ("all_reduce", "reduce_scatter", "all_gather")
GROUP_OPS = {"tp": _ZERO_OPS, "cp": ("send",), "pp": ("send", "all_reduce"), "dp": (), "dp_cp": _ZERO_OPS,
             "ep": ("all_to_all", "all_gather"), "ep_dp": _ZERO_OPS}  # what each kind of group carries


class Mesh(NamedTuple):
    sizes: MeshSizes
    rank: int
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup]  # this rank's group of each kind in GROUP_DIMS


def build_mesh(sizes: MeshSizes) -> Mesh:
    rank = dist.get_rank()
    mine = {}
    every = {kind: sizes.groups(dims) for kind, dims in GROUP_DIMS.items()}
    every |= {"ep": sizes.expert_groups(False), "ep_dp": sizes.expert_groups(True)}
    for kind, groups in every.items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return Mesh(sizes, rank, sizes.coords(rank), mine)


def rank_map(sizes: MeshSizes) -> str:
    """One line per rank: its coordinates (and, with ep > 1, which experts' slice it holds)."""
    lines = []
    for rank in range(sizes.world):
        at = sizes.coords(rank)
        experts = f" ep={(at['dp'] * sizes.cp + at['cp']) % sizes.ep}" if sizes.ep > 1 else ""
        lines.append(f"  rank {rank:>2}: " + " ".join(f"{d}={i}" for d, i in at.items()) + experts)
    return "\n".join(lines)


def mesh_name(sizes: MeshSizes) -> str:
    return " ".join(f"{d}={getattr(sizes, d)}" for d in DIMS) + (f" ep={sizes.ep}" if sizes.ep > 1 else "")


def precision_name(train: "TrainConfig") -> str:
    if not train.mixed_precision:
        return "fp32"
    name = "bf16 + BF16 AdamW" if train.bf16_optimizer else "bf16 + fp32 masters"
    return name + " + fp32 gradients" * train.fp32_grads


# --- The configuration: the training, the run, and the Job a command makes of its options ---------
@dataclass(frozen=True)
class TrainConfig:
    # past the bounds, a typo: ~5,000x Llama 3 405B's 2,048 sequences, 10x the longest context (10M tokens)
    global_batch: int = option(8, "sequences per step", (">= 1", "<= 1e7"))
    seq_len: int = option(16, "tokens per sequence", (">= 1", "<= 1e8"))
    zero_stage: int = option(1, "ZeRO stage over dp x cp", (">= 0", "<= 3"), option="--zero", metavar="STAGE")
    reduce_in_backward: bool = option(True, "02's hooks reduce each unit's gradient while the last "
                                      "microbatch's backward runs", off=(
                                          "--reduce-after-backward", False, "every gradient reduced once the "
                                          "schedule ends (01's naive version; Megatron-LM before 2023)"))
    schedule: str = option("1f1b", "lesson 04's pipeline schedule", choices=pipeline.SCHEDULES)
    microbatches: int = option(1, "microbatches per step", ">= 1")
    virtual: int = option(1, "pipeline stages per rank (interleaved 1F1B)", ">= 1")
    ends_as_layers: bool = option(False, "04's cut counts the embedding and the head as a layer each: the "
                                  "first and last stages hold a layer less than the others (Megatron's "
                                  "account_for_embedding_in_pipeline_split and account_for_loss_in_"
                                  "pipeline_split)")
    sequence_parallel: bool = option(False, "lesson 03's SP in the tp groups")
    fp8: bool = option(False, "lesson 08's Float8Linear layers")
    lr: float = option(1e-3, "peak learning rate", "> 0", STEPPING)
    adam_eps: float = 1e-8
    max_grad_norm: float = option(math.inf, "clip the mesh's gradient norm (inf: none)", "> 0", STEPPING)
    moe: "expert_parallel.MoEConfig | None" = None  # every MLP an MoE layer (lesson 06)
    mixed_precision: bool = option(False, "bf16 compute, fp32 masters (but --bf16-optimizer)",
                                   commands=STEPPING, option="--bf16")
    bf16_optimizer: bool = option(False, "02's BF16 AdamW: the bf16 parameters are their own master, the "
                                  "moments bf16 (4 B a parameter, not 12; an update under 2^-8 of a weight "
                                  "is lost)")
    fp32_grads: bool = option(False, "02's fp32 gradients: each backward's bf16 gradient added into an fp32 "
                              "buffer, reduced in fp32 (Megatron's main_grad; FSDP2's reduce_dtype under a "
                              "pipeline); --zero 0 or 1")
    recompute: str = option("none", "activation recompute (03): selective = attention's inside, elementwise "
                            "= the norms' outputs and SwiGLU's product (lean saves, eager), full = each "
                            "block (torch's checkpoint: its rerun stops at down_proj's input, the last "
                            "tensor backward reads); plan only, whole = each block rerun to its end, "
                            "down_proj and its all-reduce too, as a reentrant checkpoint reruns it "
                            "(Megatron's, DeepSpeed's)", choices=(*tensor_parallel.RECOMPUTE_MODES, "whole"))
    lean_saves: bool = option(True, "03's lean saves: norms and SwiGLU keep their inputs, SP's linears their "
                              "input's sequence shard", off=(
                                  "--autograd-saves", False, "every tensor autograd saves; SP's linears keep "
                                  "the gathered input"))
    attention: str = option("sdpa", "flash: 07's kernel (cp > 1, any: 05's ring, of 07's kernel on a GPU, "
                            "of torch blocks on a CPU); plan only, kernels the course "
                            "does not run (priced where cp = 1): cudnn, SDPA's cuDNN backend (Transformer "
                            "Engine's fused attention); unfused, two GEMMs around a softmax that writes "
                            "the scores to memory (Megatron before FlashAttention; PyTorch's eager "
                            "attention)",
                            choices=("sdpa", "flash", "cudnn", "unfused"))
    attention_dropout: float = option(0.0, "plan only, with --attention unfused at cp 1: the probabilities' "
                                      "dropout (Megatron's --attention-dropout, which defaults to 0.1), a "
                                      "kernel that writes them dropped and a byte's mask, read again in "
                                      "backward; 01's model has none", (">= 0", "<= 1"), metavar="P")
    compile: bool = option(False, "torch.compile each block: one graph, its elementwise work fused", off=(
        "--eager", False, "eager blocks: each elementwise operation a kernel of its own"))
    loss_chunks: int = option(1, "03's LossInChunks: the loss and its gradient in forward, this many slices "
                              "of the tokens one after another (fp32 temporaries of one slice)",
                              (">= 1", "<= 1e6"))


MODELS = {  # (model, seq_len, global_batch, lr); vocabulary 256 (bytes are tokens) unless the model sets one
    "tiny": (dict(dim=128, n_layers=4, n_heads=4, ffn_dim=352), 128, 16, 3e-3),  # CPU: a few minutes
    "1b": (dict(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632), 2048, 8, 3e-4),  # 0.82B: one H100
    # Llama 3 8B's layer (dim 4096, GQA 32/8, ffn 14336), 8 of them: 1.7B, --fp8's GEMMs at full width
    "2b": (dict(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336), 2048, 8, 3e-4),
    "check": (dict(vocab_size=127, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176), 32, 8, 1e-3),
}  # check's default: its vocabulary of 127 is padded by tp. Published models: PRESETS, under plan


@dataclass
class RunConfig:
    steps: int = option(600, "optimizer steps", ">= 1", STEPPING)
    warmup: int = option(20, "steps of linear warmup, then cosine decay", ">= 0", TRAIN)
    min_lr_ratio: float = 0.1
    eval_every: int = option(100, "steps between validation losses", ">= 1", TRAIN)
    eval_batches: int = 2
    save_every: int = option(100, "steps between checkpoints; 0: only at the end", ">= 0", TRAIN)
    folder: str | None = option("checkpoints/09", "a folder per run (--resume reads it)", commands=TRAIN,
                                option="--checkpoint-dir", metavar="DIR",
                                off=("--no-save", None, "no checkpoints (and no sample)"))
    keep: int = option(2, "the last checkpoints kept (a damaged one names the one before)", ">= 1", TRAIN)
    resume: str | None = option(None, "continue from the last checkpoint, or from step STEP (one of those "
                                "kept)", commands=TRAIN, nargs="?", const="latest", metavar="STEP")
    # torch's seeds are 64-bit: the data order's seed x 1,000,003 + epoch stays inside one
    seed: int = option(0, "seeds the initial weights, the data order and the sample",
                       (">= 0", f"<= {2 ** 32 - 1}"), commands=TRAIN)
    profile: int = option(0, "profile STEPS steps after the second (torch.profiler): forward, backward, "
                          "gradient sync and optimizer, the top kernels, the GPU's idle time", ">= 0", TRAIN,
                          metavar="STEPS")
    trace: str | None = option(None, "with --profile: its Chrome trace (chrome://tracing)", commands=TRAIN)
    data: str | None = option(None, "a text file (default: the standard library's .py files)", commands=TRAIN)
    prompt: str | None = option(None, "the sample's start (default: lines of the validation text)",
                                commands=TRAIN)
    sample_bytes: int = option(200, "bytes the sample generates", ">= 0", TRAIN,
                               off=("--no-sample", 0, "no sample at the end"))
    temperature: float = option(0.8, "the sample's temperature: softmax(logits / T)", "> 0", TRAIN)
    top_k: int = option(20, "the sample draws from the top_k likeliest bytes (1: greedy)", ">= 1", TRAIN)

    @property
    def resume_step(self) -> int | None:
        """The step --resume names; None: the one LATEST names (or no resume)."""
        return None if self.resume in (None, "latest") else int(self.resume)


@dataclass(frozen=True)
class Job:
    """What configure makes of a command's options, read alike by the checks before launch and every rank."""
    command: str
    model: str  # --model as given: a preset's name or a config.json's path
    cfg: "foundation.ModelConfig"
    mesh: dict[str, int | None]  # dp, pp, cp, tp (plan: None where it searches)
    ep: int
    train: TrainConfig
    run: RunConfig
    cluster: "Cluster | None" = None  # plan's
    gpus: int | None = None  # plan's --gpus
    json: bool = False  # plan's --json

    @property
    def sizes(self) -> MeshSizes:
        """The mesh of train and check, every size given or defaulted."""
        return MeshSizes(**self.mesh, ep=self.ep)

    @property
    def nproc(self) -> int:
        """The local processes launch_lesson starts: the mesh sets them (09 has no --nproc)."""
        return self.sizes.world


def mesh_free_refusals(train: TrainConfig) -> list[str]:
    """Why these options cannot run or be priced on any mesh: validate's rules that no mesh size changes
    (plan says the first once, before its search)."""
    refusals = []
    if train.attention_dropout and train.attention != "unfused":
        refusals.append(f"attention_dropout={train.attention_dropout} is priced for attention=unfused, whose "
                        f"kernels write the probabilities: attention={train.attention} draws its mask "
                        f"inside, which plan does not price")
    if train.recompute == "whole" and (train.fp8 or train.moe):
        parts = [part for part, used in (("FP8 amaxes", train.fp8), ("MoE all-to-alls", train.moe)) if used]
        refusals.append(f"recompute='whole' is priced for dense layers without FP8: its rerun's "
                        f"{' and '.join(parts)} have no formula (full's have)")
    elementwise = train.recompute == "elementwise"
    if elementwise and not train.lean_saves:
        refusals.append("recompute='elementwise' rebuilds from what 03's lean saves keep: not with "
                        "--autograd-saves")
    if elementwise and train.compile:
        refusals.append("recompute='elementwise' empties and refills storages from autograd hooks, which "
                        "torch.compile does not trace: use --eager")
    if elementwise and train.moe is not None:
        refusals.append("recompute='elementwise' is priced for dense layers: 06's experts keep their own "
                        "inputs")
    if elementwise and train.fp8:
        refusals.append("recompute='elementwise' would save nothing with --fp8: 08's linears keep their "
                        "inputs' FP8 casts, not the bf16 tensors it rebuilds")
    return refusals


def validate(cfg, sizes: MeshSizes, train: TrainConfig, world: int) -> None:
    """Every violation, each lesson's rule in its own words, in one ValueError."""
    problems = [*foundation.broken_rules(sizes, dataclasses.fields(sizes)),
                *foundation.broken_rules(train, dataclasses.fields(train))]

    def check(rule, *args, rename: tuple[str, str] = ("", "")) -> None:
        try:
            rule(*args)
        except ValueError as error:
            problems.append(str(error).replace(*rename))

    if min(getattr(sizes, d) for d in DIMS) >= 1 and sizes.world != world:
        problems.append(f"dp x pp x cp x tp = {sizes.dp} x {sizes.pp} x {sizes.cp} x {sizes.tp} = "
                        f"{sizes.world} is not the world size {world}")
    tp = max(sizes.tp, 1)  # a size below 1 is reported above, by its rule
    cp = max(sizes.cp, 1)
    check(tensor_parallel.validate_tensor_parallel, cfg, tp)
    check(context_parallel.validate_context_parallel, train.seq_len, cfg.n_heads, cp, "ring", cp > 1,
          cfg.n_kv_heads)  # zigzag at cp > 1 (at 1: one chunk, any length)
    if train.global_batch % max(sizes.dp, 1):
        problems.append(f"global_batch={train.global_batch} is not divisible by dp={sizes.dp}")
    else:
        rows = train.global_batch // max(sizes.dp, 1)
        check(pipeline.validate_pipeline, cfg.n_layers, max(sizes.pp, 1), rows, train.microbatches,
              train.schedule, train.virtual, train.ends_as_layers,
              rename=(f"global_batch={rows}", f"global_batch / dp = {rows}"))
    if train.sequence_parallel and (train.seq_len // cp) % tp:
        problems.append(f"sequence parallelism splits each rank's seq_len / cp = {train.seq_len} / "
                        f"{cp} tokens over tp={tp}: not divisible")
    if train.fp32_grads and train.zero_stage >= 2:
        problems.append(f"--fp32-grads keeps ZeRO's whole gradient buffer in fp32, which --zero "
                        f"{train.zero_stage} does not keep: use --zero 0 or 1")
    if train.recompute == "op" and max(sizes.tp, sizes.cp) > 1:
        problems.append(f"recompute op reruns a block but its matmuls' and attention's outputs: at "
                        f"tp={sizes.tp}, cp={sizes.cp} that reruns 03's collectives or 05's ring, whose "
                        f"traffic has no formula")
    if train.recompute == "op" and train.schedule == "zb-h1" and sizes.pp > 1:
        problems.append("recompute op keeps its matmuls' outputs for one backward (torch's selective "
                        "checkpoint), and zb-h1's weight pass is a second one: use another schedule or "
                        "recompute mode")
    problems += mesh_free_refusals(train)
    if train.attention_dropout and train.attention == "unfused" and cp > 1:
        problems.append(f"attention_dropout={train.attention_dropout} is priced for unfused attention at "
                        f"cp=1: at cp={cp} 09 runs 07's kernel in 05's ring, which draws its mask inside")
    if sizes.ep > 1 and train.moe is None:
        problems.append(f"ep={sizes.ep} needs an MoE model (--moe)")
    if sizes.ep >= 1 and (sizes.dp * sizes.cp) % sizes.ep:
        problems.append(f"ep={sizes.ep} must divide dp x cp = {sizes.dp * sizes.cp}: expert "
                        f"parallelism borrows its ranks from them")
    elif sizes.ep >= 1 and train.moe is not None:
        if train.moe.n_experts % sizes.ep:
            problems.append(f"n_experts={train.moe.n_experts} is not divisible by ep={sizes.ep}")
        if train.moe.capacity_factor is not None or train.moe.aux_loss_coef or train.moe.bias_update_rate:
            problems.append("MoE here is dropless and unbalanced (capacity_factor=None, aux_loss_coef=0, "
                            "bias_update_rate=0): drops, the aux loss and the bias's load depend on which "
                            "tokens share a forward, which microbatches, sequence chunks and shards change")
    if len(problems) == 1:  # one line; several, a list
        raise ValueError(f"invalid configuration: {problems[0]}")
    if problems:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))


# --- The composed model and its step ---------------------------------------------------------------
def tensor_parallel_styles(moe) -> dict:
    styles = tensor_parallel.TENSOR_PARALLEL_PLAN
    return styles if moe is None else {name: style for name, style in styles.items() if ".mlp" not in name}


def fullgraph_blocker(sizes: MeshSizes, train: TrainConfig) -> str | None:
    """Why torch.compile cannot take a block as one graph on this mesh (None: it can; 07's kernel and
    03's collectives are operators it records as they are); with ep > 1 it cannot take it at all."""
    if sizes.ep > 1:
        return "blocks left eager: ep > 1, the tracer fails on 06's all-to-all, sized by the routing"
    if sizes.cp > 1:
        return "each block in several graphs: cp > 1, 05's ring sends K/V from its own autograd function"
    if train.moe is not None:
        return "each block in several graphs: --moe, 06's routing sizes each expert's tokens by the data"
    return None


def build_stage_model(cfg, mesh: Mesh, train: TrainConfig, stage: int, n_stages: int,
                      device: torch.device) -> nn.Module:
    """One pipeline stage of the model, transformed in the module docstring's order (ONE MODEL)."""
    model = foundation.GPT(cfg)
    if train.moe is not None:
        model = expert_parallel.convert_to_moe(model, train.moe)
        if mesh.sizes.ep > 1:
            expert_parallel.apply_expert_parallel(model, mesh.groups["ep"])
    if train.fp8:
        model = fp8.convert_to_float8(model)
    if train.lean_saves:
        model = tensor_parallel.apply_lean_saves(model)
    model = tensor_parallel.apply_tensor_parallel(model.to(device), mesh.groups["tp"],
                                                  train.sequence_parallel, tensor_parallel_styles(train.moe),
                                                  check_ids=False,  # forward_backward checks the rows
                                                  regather=train.lean_saves)
    if train.loss_chunks > 1:
        model.loss_fn = tensor_parallel.ChunkedLoss(model.loss_fn, train.loss_chunks)
    if train.fp8:  # 08: the scales of whole tensors, whatever tp splits
        fp8.tensor_parallel_scales(model, mesh.groups["tp"], train.sequence_parallel)
    attention = flash.flash_attention if train.attention == "flash" else None
    if mesh.sizes.cp > 1:
        attention = context_parallel.ContextParallelAttention(mesh.groups["cp"], "ring", zigzag=True, block=(
            flash.FLASH_BLOCK if device.type == "cuda" else context_parallel.TORCH_BLOCK))  # 07's on a GPU
    for block in model.layers.values() if attention else ():
        block.attn.attn_fn = attention
    model = pipeline.cut_stage(tensor_parallel.apply_recompute(model, train.recompute), stage, n_stages,
                               train.ends_as_layers)
    blocker = fullgraph_blocker(mesh.sizes, train) if train.compile else None
    if blocker and mesh.rank == 0 and stage == 0:
        print(f"--compile: {blocker}", flush=True)
    for block in model.layers.values() if train.compile and mesh.sizes.ep == 1 else ():
        # Its forward, in place (parameter names stay): the block's own hooks, 02's ZeRO-3 gathers that
        # wait for their all-gather, run eagerly around the graph (the tracer cannot follow Work.wait)
        block.forward = torch.compile(block.forward, fullgraph=blocker is None)
    return model


class StageZeRO(NamedTuple):  # a stage's ZeRO over dp x cp, or over the ranks holding the same experts
    kind: str  # the group kind it reduces over: "dp_cp" or "ep_dp"
    zero: "zero.ZeRO"  # 02's ZeRO, or 08's Float8ZeRO for FP8 weights under ZeRO-3


class Trainer:
    """One rank's part of the 4D-parallel training step: its pipeline stages, each TP- and CP-parallel, each
    with a ZeRO over dp x cp. Its slices: shard_values(trainer); its measurements beside the plan: summary.

        trainer = Trainer(cfg, mesh, train, device)
        loss = trainer.forward_backward(rows)  # this dp rank's rows, (global_batch / dp, seq_len + 1)
        trainer.update()
    """

    def __init__(self, cfg, mesh: Mesh, train: TrainConfig, device: torch.device) -> None:
        validate(cfg, mesh.sizes, train, mesh.sizes.world)  # its ranks: the caller checked them (build_mesh)
        self.cfg = cfg
        self.mesh = mesh
        self.train = train
        self.device = device
        sizes = mesh.sizes
        self.schedule = pipeline.make_schedule(train.schedule, sizes.pp, train.microbatches, train.virtual)
        self.layout = context_parallel.SequenceLayout(train.seq_len, sizes.cp, zigzag=sizes.cp > 1)
        positions = self.layout.positions(mesh.coords["cp"], device)
        self.stages = {}
        for stage in range(mesh.coords["pp"], self.schedule.n_stages, sizes.pp):
            model = build_stage_model(cfg, mesh, train, stage, self.schedule.n_stages, device)
            model.register_forward_pre_hook(  # global positions: RoPE on CP chunks and SP shards
                lambda _, args, kwargs: (args, {**kwargs, "positions": positions}), with_kwargs=True)
            self.stages[stage] = model
        settings = {k: getattr(train, k) for k in OPTIMIZER}
        self.zeros: list[StageZeRO] = []
        for stage, model in self.stages.items():
            experts = set()
            if sizes.ep > 1:
                layers = expert_parallel.moe_layers(model)
                experts = {p for layer in layers for p in layer.expert_parameters()}
            for p in experts:
                p.register_hook(lambda grad: grad / sizes.ep)  # arrives summed over ep (06's all-to-all)
            fp8_weights = set(fp8.float8_weights(model)) if train.fp8 and train.zero_stage == 3 else set()
            others = experts | fp8_weights  # each kind with a ZeRO of its own; the dense ZeRO owns the rest
            self.zeros.append(StageZeRO("dp_cp", zero.ZeRO(
                model, train.zero_stage, mesh.groups["dp_cp"], **settings, fp32_grads=train.fp32_grads,
                owns=(lambda p, others=others: p not in others) if others else None)))
            if experts:
                self.zeros.append(StageZeRO("ep_dp", zero.ZeRO(model, train.zero_stage, mesh.groups["ep_dp"],
                                                               **settings, fp32_grads=train.fp32_grads,
                                                               owns=experts.__contains__)))
            if fp8_weights:
                self.zeros.append(StageZeRO("dp_cp", fp8.Float8ZeRO(model, mesh.groups["dp_cp"], **settings)))
        rows = train.global_batch // sizes.dp // train.microbatches
        seq = train.seq_len // sizes.cp // (sizes.tp if train.sequence_parallel else 1)
        self.boundary_shape = (rows, seq, cfg.dim)  # a pipeline send's: a microbatch's activations
        self.meter = foundation.CommMeter()  # every step's communication, accumulated
        self.steps = self.in_flight = 0  # in_flight: the most microbatch-stage pairs held at once (04)

    def forward_backward(self, rows: torch.Tensor) -> float:
        """The schedule's forward and backward, gradients averaged over dp x cp; the batch's mean loss."""
        sizes = self.mesh.sizes
        if rows.shape != (expected := (self.train.global_batch // sizes.dp, self.train.seq_len + 1)):
            raise ValueError(f"rows of shape {tuple(rows.shape)}: this dp rank expects "
                             f"(global_batch / dp, seq_len + 1) = {expected}")
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.cfg.vocab_size):  # on the CPU: no GPU wait
            raise ValueError(f"token and target ids must lie in [0, {self.cfg.vocab_size})")
        tokens, targets = (self.layout.shard(t, self.mesh.coords["cp"], dim=1).to(self.device)
                           for t in (rows[:, :-1], rows[:, 1:]))
        with foundation.comm_meter() as meter:
            with contextlib.ExitStack() as accumulate:
                for part in self.zeros:
                    accumulate.enter_context(part.zero.no_sync())
                for model in self.stages.values() if self.train.fp8 and self.train.zero_stage < 3 else ():
                    accumulate.enter_context(fp8.weights_cast_once(model))  # 08: once per step
                log = pipeline.run_schedule(self.schedule, self.stages, tokens, targets,
                                            self.mesh.groups["pp"], boundary_shape=self.boundary_shape,
                                            before_last_backward=self.reduce_during if
                                            self.train.reduce_in_backward else None)
            with torch.profiler.record_function("gradient sync"):  # names in a profile (--profile)
                for part in self.zeros:
                    part.zero.finish_gradient_sync()
        self.meter += meter
        self.in_flight = max(self.in_flight, log.peak_in_flight)
        # Outside the meter: the last stage's local mean, averaged over dp x cp, sent to every stage.
        loss = (log.loss if log.loss is not None else torch.zeros((), device=self.device)).double()
        for kind in ("dp_cp", "pp"):
            foundation.all_reduce(loss, group=self.mesh.groups[kind])
        return loss.item() / (sizes.dp * sizes.cp)

    def reduce_during(self, stage: int) -> None:
        """Before a stage's last backward of the step its ZeROs leave no_sync (GRADIENTS: 02's hooks)."""
        for part in self.zeros:
            if part.zero.model is self.stages[stage]:
                part.zero.sync_gradients = True

    def update(self) -> torch.Tensor:
        """Clip by the norm over the whole mesh, AdamW on every shard; returns the norm on the device: its
        .item() would make the CPU wait for the GPU, which then idles while the CPU prepares the next step."""
        sizes = self.mesh.sizes

        def share(p: nn.Parameter) -> float:  # a parameter replicated over tp counts 1/tp on each copy
            return 1.0 if hasattr(p, "tp_shard_dim") else 1 / sizes.tp

        with foundation.comm_meter() as meter, torch.profiler.record_function("optimizer"):
            squares = {kind: sum(p.zero.grad_squares(share) for p in self.zeros if p.kind == kind)
                       for kind in ("dp_cp", "ep_dp")}
            if sizes.ep > 1:  # each ep rank holds other experts
                foundation.all_reduce(squares["ep_dp"], group=self.mesh.groups["ep"])
            squares = squares["dp_cp"] + squares["ep_dp"]
            for kind in ("tp", "pp"):
                if getattr(sizes, kind) > 1:
                    foundation.all_reduce(squares, group=self.mesh.groups[kind])
            for part in self.zeros:
                part.zero.clip_and_update(squares)
                part.zero.zero_grad()
        self.meter += meter
        self.steps += 1
        return squares.sqrt()


# --- Data: bytes are tokens, windows of seq_len + 1 in a seeded order per epoch; the learning rate --
def read_tokens(path: str | os.PathLike | None, max_bytes: int = 2 << 20) -> torch.Tensor:
    """The bytes of `path` as uint8 tokens; with no path, the standard library's top-level .py files in
    sorted order (in every Python install: no download), up to max_bytes (a fixed cap, enough for a CPU)."""
    if path is None:
        sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(source.read_bytes() for source in sources)[:max_bytes]
    elif not Path(path).is_file():
        kind = "no such file"
        if Path(path).exists():  # /dev/null, a pipe: read whole, by size, so a regular file
            kind = "a directory, not a file" if Path(path).is_dir() else "not a regular file"
        raise ValueError(f"--data {path}: {kind}")
    else:
        data = Path(path).read_bytes()
    if not data:
        raise ValueError(f"--data {path}: the file is empty" if path else
                         "found no .py file in the standard library")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_tokens(tokens: torch.Tensor, seq_len: int, global_batch: int,
                 val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the text's last val_fraction validates; each must hold one global batch."""
    need = global_batch * seq_len + 1
    n_val = int(len(tokens) * val_fraction)
    if min(n_val, len(tokens) - n_val) < need:
        raise ValueError(f"the text is too short: {len(tokens) - n_val:,} training and {n_val:,} "
                         f"validation tokens ({val_fraction:.0%}), and each part needs >= "
                         f"global_batch x seq_len + 1 = {global_batch} x {seq_len} + 1 = {need:,}")
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


class ShardedLoader:
    """Window i = tokens[i s : i s + s + 1]. Each epoch visits the windows in a permutation seeded by (seed,
    epoch), one global batch of B windows at a time; data-parallel rank r of d takes rows [r B/d, (r+1) B/d).
    Windows that do not fill a last batch wait for the next epoch's permutation. The state counts global
    batches, not rows, so a run can resume on another d. cp ranks share their dp rank's rows (Trainer)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0) -> None:
        if seq_len < 1 or global_batch < 1 or global_batch % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"seq_len={seq_len} and global_batch={global_batch} must be >= 1, global_batch "
                             f"divisible by dp={dp_size} and dp_rank={dp_rank} in [0, {dp_size})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.rows = slice(dp_rank * global_batch // dp_size, (dp_rank + 1) * global_batch // dp_size)
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        self.batches_per_epoch = self.n_windows // global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(tokens)} tokens hold fewer than global_batch={global_batch} "
                             f"windows of seq_len + 1 = {seq_len + 1} tokens")
        self.epoch = self.position = 0

    def __next__(self) -> torch.Tensor:
        """This rank's rows (B/d, s + 1), int64, of the next global batch."""
        order = torch.randperm(self.n_windows, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.epoch))
        batch = order[self.position * self.global_batch:][:self.global_batch]
        starts = batch[self.rows] * self.seq_len
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()

    def state_dict(self) -> dict[str, int]:
        """The position, and what it counts in: resuming on other windows would read other data."""
        return {"epoch": self.epoch, "position": self.position, "n_windows": self.n_windows,
                "seq_len": self.seq_len, "global_batch": self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        differ = [f"{k}={state[k]} (now {getattr(self, k)})" for k, v in self.state_dict().items()
                  if k not in ("epoch", "position") and state[k] != v]
        if differ:
            raise ValueError(f"the checkpoint's data position counts other windows: {', '.join(differ)}; "
                             f"resume with the same --data, --seq-len, --global-batch and --seed")
        self.epoch = state["epoch"]
        self.position = state["position"]


def learning_rate(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """Linear warmup (step 0: max_lr / warmup), then a half cosine to min_lr at total_steps; min_lr after."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


# --- Checkpoints: a Trainer's pieces in lesson 02's protocol (each element once, a resume reads its slices)
def held_piece(name: str, shape: tuple[int, ...], local: tuple[int, ...], tp_dim: int | None = None,
               tp_start: int = 0, tp_length: int = 0, ep_start: int | None = None) -> zero.Piece:
    """The elements of reference parameter `name` (global `shape`) that a rank's tensor of shape `local`
    holds, as 02's Piece: its TP slice (tp_length real elements from tp_start along tp_dim, padded to
    local's length) and, an expert tensor, the experts from ep_start (dim 0). A local row from the split
    dimension on is one run of consecutive global indices: planning a read costs rows, not elements."""
    dim = tp_dim if tp_dim is not None else (0 if ep_start is not None else None)
    if dim is None:  # held whole (replicated over tp, not an expert): one run
        return zero.Piece.whole(name, shape)
    inner = math.prod(shape[dim + 1:])
    start, real = (tp_start, tp_length) if tp_dim is not None else (0, local[0])
    rows = torch.arange(math.prod(shape[:dim])).view(shape[:dim])
    if ep_start is not None and dim > 0:  # this rank's experts: a narrower dim 0
        rows = rows.narrow(0, ep_start, local[0])
    elif ep_start is not None:
        start += ep_start
    first = rows.flatten() * shape[dim] * inner + start * inner
    runs = torch.stack([first, torch.arange(len(first)) * local[dim] * inner,
                        torch.full_like(first, real * inner)], 1)
    # a run that goes on where the one before ended (tp = 1: whole rows) joins it
    starts = torch.cat([torch.tensor([True]), (runs[1:, :2] != runs[:-1, :2] + runs[:-1, 2:]).any(1)])
    lengths = torch.zeros(int(starts.sum()), dtype=runs.dtype).index_add_(0, starts.cumsum(0) - 1, runs[:, 2])
    return zero.Piece(name, shape, torch.cat([runs[starts, :2], lengths[:, None]], 1), math.prod(local))


def piece_of(trainer: Trainer, kind: str) -> "zero.PieceOf":
    """02's piece_of for the trainer's ZeROs of this kind: held_piece of a unit's parameter on this rank."""
    tp_rank = trainer.mesh.coords["tp"]
    ep = trainer.mesh.sizes.ep if kind == "ep_dp" else 1
    ep_rank = dist.get_rank(trainer.mesh.groups["ep"])

    def held(unit: zero.FlatUnit, i: int) -> zero.Piece:
        p = unit.params[i]
        local = tuple(unit.shapes[i])
        full = list(local)
        dim = getattr(p, "tp_shard_dim", None)
        tp_start = 0
        length = 0
        if dim is not None:
            full[dim] = p.tp_full_size
            tp_start = tp_rank * local[dim]
            length = max(0, min(local[dim], p.tp_full_size - tp_start))
        full[0] *= ep  # the experts: dim 0 is ep x the experts this rank holds
        return held_piece(unit.names[i], tuple(full), local, dim, tp_start, length,
                          ep_rank * local[0] if ep > 1 else None)
    return held


def shard_values(trainer: Trainer, kind: str = "params") -> list[tuple[zero.Piece, torch.Tensor]]:
    """(piece, CPU values) of the shards' "params" (fp32), an AdamW moment, "grads" (averaged, unclipped)."""
    out = []
    for part in trainer.zeros:
        for unit in part.zero.units:
            source = unit.grad_shard if kind == "grads" else part.zero.shard_state(unit)[kind]
            out += [(piece, source[at].detach().float().cpu().clone())
                    for _, piece, at in zero.shard_pieces(unit, piece_of(trainer, part.kind))]
    return out


def checkpoint_pieces(trainer: Trainer) -> list[tuple[zero.Piece, dict[str, torch.Tensor]]]:
    """Pieces this rank writes (each element once in the mesh): 02's zero_pieces; tp copies by tp rank 0."""
    first_tp = trainer.mesh.coords["tp"] == 0
    return [pair for part in trainer.zeros for pair in zero.zero_pieces(
        part.zero, piece_of(trainer, part.kind), lambda p: hasattr(p, "tp_shard_dim") or first_tp)]


def resume_command(step: int) -> str:
    """This run's command line (a run of this script; else the bare script) with --resume STEP."""
    ours = Path(sys.argv[0]).name == Path(__file__).name
    script, words = (sys.argv[0], sys.argv[1:]) if ours else (Path(__file__).name, [])
    words = [w for i, w in enumerate(words)
             if not w.startswith("--resume") and not (w.isdigit() and words[i - 1:i] == ["--resume"])]
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)}"]
                if "TORCHELASTIC_RUN_ID" in os.environ else ["python"])
    return shlex.join([*launcher, script, *words, "--resume", str(step)])


def schedule_of(train: TrainConfig, run: RunConfig) -> dict:
    """What the learning rate of every step depends on (learning_rate's arguments)."""
    return {"--lr": train.lr, "--warmup": run.warmup, "--steps": run.steps}


def changed_schedule(meta: dict, train: TrainConfig, run: RunConfig) -> str | None:
    """A resume's note where its learning-rate schedule is not the saved run's (a run extended by a larger
    --steps decays over the new length), or None."""
    saved = meta.get("schedule")  # checkpoints of before this field: not known
    now = schedule_of(train, run)
    if saved is None or saved == now:
        return None
    changes = ", ".join(f"{option} {saved[option]:g} -> {now[option]:g}" for option in now
                        if saved[option] != now[option])
    return (f"note: the learning rate's schedule is not the saved run's ({changes}): from here the steps "
            f"differ from the uninterrupted run's")


def resumed_validation(meta: dict, again: float, sizes: MeshSizes) -> str:
    """The resumed weights' validation loss beside the one recorded at the save, and why they differ."""
    saved = MeshSizes(**meta["mesh"])
    line = (f"validation loss of the loaded weights {again:.6f}, when saved {meta['val']:.6f}: "
            f"difference {abs(again - meta['val']):.1e}")
    if saved == sizes:
        return line + (" (the same mesh: the same sums, so with the same options a resumed run repeats the "
                       "uninterrupted one)")  # a changed --lr, --steps or --warmup changes what follows
    return (line + f" (saved on {mesh_name(saved)}, resumed on {mesh_name(sizes)}: the same sums in another "
            f"order; training amplifies such rounding, so the losses follow the uninterrupted run's closely "
            f"at first, then drift: it ends near, not on, that run's loss)")


# --- The training run (train): the loop, the program, what it prints -----------------------------
def train_loop(trainer: Trainer, loader: ShardedLoader, val_tokens: torch.Tensor, run: RunConfig,
               progress) -> dict:
    """Steps from 0 or the checkpoint (run.resume) to run.steps: the learning rate, the NaN guard, validation,
    checkpoints (never a non-finite one), progress(step, loss, seconds, val). Returns its figures, `out`."""
    train = trainer.train
    rank = trainer.mesh.rank
    sizes = trainer.mesh.sizes
    out = dict(losses={}, times={}, val={}, activation_bytes=None, read=None, saved=None)
    start = 0
    kept = []  # this run's checkpoints, a resumed one included

    def validation() -> float:  # the mean loss over the first eval_batches global batches of windows
        windows = ShardedLoader(val_tokens, train.seq_len, train.global_batch, trainer.mesh.coords["dp"],
                                sizes.dp, run.seed)
        losses = []  # 04's schedules have no forward-only mode: the backward runs, its gradients dropped
        for _ in range(run.eval_batches):
            losses.append(trainer.forward_backward(next(windows)))
            for part in trainer.zeros:
                part.zero.zero_grad()
        return sum(losses) / run.eval_batches

    if run.resume:  # the parameters and AdamW (02's load_checkpoint: from any mesh or ZeRO stage, each
        target, meta, reader = zero.load_checkpoint(  # rank reading its slices), the data position, the RNG
            run.folder, trainer.cfg, [(part.zero, piece_of(trainer, part.kind)) for part in trainer.zeros],
            run.resume_step, resume_command)
        trainer.steps = start = meta["step"]
        loader.load_state_dict(meta["loader"])
        if rank < meta["world"]:  # no dropout here draws from the RNG: restored for a model that does
            torch.set_rng_state(reader.rng[rank]["cpu"])
            if trainer.device.type == "cuda" and "cuda" in reader.rng[rank]:
                torch.cuda.set_rng_state(reader.rng[rank]["cuda"], trainer.device)
        out["read"] = reader.bytes_read
        kept.append(start)
        elements = sum(piece.elements() for piece, _ in shard_values(trainer))
        report = foundation.all_ranks((out["read"], 4 * len(zero.CHECKPOINT_KINDS) * elements))
        again = validation() if meta.get("val") is not None and start < run.steps else None
        if rank == 0:
            print(f"resumed from {target}: steps {start} to {run.steps}. Bytes each rank read from it "
                  f"(memory-mapped) | its slices, (params + 2 AdamW moments) x 4 B x its shard's elements: "
                  + ", ".join(f"{a:,}|{b:,}" for a, b in report), flush=True)
            if again is not None:
                print(resumed_validation(meta, again, sizes), flush=True)
            if changed := changed_schedule(meta, train, run):
                print(changed, flush=True)
            if start >= run.steps:
                print(f"already at step {start} of --steps {run.steps}: nothing to train")
            later = sorted(p.name for p in Path(run.folder).glob("step_*") if (zero.step_of(p) or 0) > start)
            if later and start < run.steps:  # back from them: the run's saves rotate them out, as its own
                print(f"note: going back to step {start}, this run's saves replace the later checkpoints "
                      f"{', '.join(later)} (to keep them, stop now and resume in a copy of {run.folder})",
                      flush=True)

    def last_good() -> str:
        if not kept:
            return "no checkpoint of this run is kept"
        return f"the last good checkpoint is {Path(run.folder) / f'step_{kept[-1]:08d}'}"

    unchecked = None  # (step, its gradient norm on the device): read after a sync that makes it free

    def check_update() -> None:
        nonlocal unchecked
        if unchecked is not None and not math.isfinite(norm := unchecked[1].item()):
            raise FloatingPointError(f"step {unchecked[0]}: the gradient norm is {norm}, so its update left "
                                     f"weights that are not finite; stopping without saving, {last_good()}")
        unchecked = None

    out["measured"] = measured = min(start + 1, run.steps - 1)  # the second: the first compiles, autotunes
    profiled = range(measured + 1, min(measured + 1 + run.profile, run.steps))
    profiler = None
    for step in range(start, run.steps):
        if profiled and step == profiled.start:
            profiler = torch.profiler.profile()  # the CPU, and the GPU where there is one
            profiler.start()
        lr = learning_rate(step, train.lr, run.warmup, run.steps, train.lr * run.min_lr_ratio)
        for part in trainer.zeros:
            for group in part.zero.optimizer.param_groups:
                group["lr"] = lr
        rows = next(loader)
        t0 = time.perf_counter()
        if step == measured:  # the tensors autograd saves (CPU) or the peak memory (GPU)
            params = [p for model in trainer.stages.values() for p in model.parameters()]
            loss, out["activation_bytes"] = tensor_parallel.activation_bytes(
                lambda: trainer.forward_backward(rows), params, trainer.device)
        else:
            loss = trainer.forward_backward(rows)
        check_update()  # the step before's norm: ready, as this loss is
        if not math.isfinite(loss):  # the same global loss on every rank: every rank stops here
            raise FloatingPointError(f"step {step}: the loss is {loss}; stopping without saving, "
                                     f"{last_good()}")
        unchecked = (step, trainer.update())  # no wait: timed on the CPU, which the next loss keeps in step
        out["times"][step] = time.perf_counter() - t0
        out["losses"][step] = loss
        if profiler is not None and step == profiled[-1]:
            profiler.stop()
            step_s = sum(out["times"][s] for s in profiled) / len(profiled)
            with tempfile.TemporaryDirectory() as folder:  # not at --trace: a file made there since stays
                exported = Path(folder) / "trace.json"
                profiler.export_chrome_trace(str(exported))
                text = exported.read_text()
            out["profile"] = step_profile(json.loads(text), len(profiled), step_s)
            if run.trace is not None and rank == 0:
                pipeline.write_new("--trace", run.trace, text)
            out["profiled"] = list(profiled)
        progress(step, loss, out["times"][step], out["val"][max(out["val"])] if out["val"] else None)
        done = step + 1
        evaluate = done % run.eval_every == 0 or done == run.steps
        save = run.folder is not None and (done == run.steps or run.save_every and done % run.save_every == 0)
        if evaluate or save:
            check_update()
        if evaluate:
            out["val"][done] = validation()
        if save:
            pieces = checkpoint_pieces(trainer)
            finite = all(t.isfinite().all() for _, data in pieces for t in data.values())
            if not all(foundation.all_ranks(finite)):  # a checkpoint never holds a NaN or an inf
                raise FloatingPointError(f"step {step}'s update left parameters or AdamW moments that are "
                                         f"not finite: step_{done:08d} is not written, {last_good()}")
            meta = {"loader": loader.state_dict(), "mesh": dataclasses.asdict(sizes),
                    "val": out["val"].get(done),  # what a resume compares its validation with
                    "schedule": schedule_of(train, run)}  # and its learning rate's
            keep = kept[-(run.keep - 1):] if run.keep > 1 else ()
            out["saved"] = zero.save_checkpoint(run.folder, done, pieces, trainer.cfg, meta, keep)
            kept.append(done)
    return out


def train_run(job: Job) -> None:
    """The default job: train on text, print progress, checkpoints, the figures, a sample."""
    device = foundation.init_distributed()
    cfg = dataclasses.replace(job.cfg, seed=job.run.seed)
    sizes = job.sizes
    train = job.train
    run = job.run
    try:  # rank 0 holds the folder's lock until lock.close()
        lock = zero.claim_folder(run.folder) if run.folder is not None else None
    except zero.CheckpointError as error:
        foundation.exit_distributed(str(error))
    train_tokens, val_tokens = split_tokens(read_tokens(run.data), train.seq_len, train.global_batch)
    trainer = Trainer(cfg, build_mesh(sizes), train, device)  # the launcher validated every rank
    loader = ShardedLoader(train_tokens, train.seq_len, train.global_batch, trainer.mesh.coords["dp"],
                           sizes.dp, run.seed)
    rank0 = trainer.mesh.rank == 0
    peak = peak_bf16_flops(device)

    def mfu(tokens_per_s: float) -> float:  # per device: the useful FLOP/s over the peak
        return tokens_per_s * flops_per_token(cfg, train.seq_len) / (sizes.world * peak)

    if rank0:
        every = foundation.counted(run.save_every or run.steps, "step")
        saves = (f"checkpoints to {run.folder} every {every} and at the end, the last {run.keep} kept"
                 if run.folder else "no checkpoints")
        print(f"Training {foundation.counted(cfg.n_layers, 'layer')} x dim {cfg.dim} "
              f"{model_words(cfg, train.moe)} on {len(train_tokens):,} bytes of "
              f"{run.data or 'the standard library'}: {mesh_name(sizes)} on "
              f"{foundation.counted(sizes.world, 'rank')} ({device.type}, {precision_name(train)}), "
              f"ZeRO-{train.zero_stage}, attention {train.attention}, recompute {train.recompute}"
              f"{', compiled' if train.compile else ''}; batch {train.global_batch} x {train.seq_len} bytes, "
              f"AdamW lr {train.lr:g} warmup {run.warmup} + cosine; {saves}")
        if train.attention == "flash" and device.type == "cpu" and sizes.cp == 1:  # cp > 1: 05's ring
            print("note: --attention flash on a CPU runs 07's kernel in Triton's interpreter, minutes a "
                  "step: it is for a GPU (sdpa trains here)", flush=True)
    bars = []  # made at the first step: a resume that fails prints its line alone

    def progress(step: int, loss: float, seconds: float, val: float | None) -> None:
        if not bars:
            bars.append(tqdm(total=run.steps, initial=step, disable=not rank0, desc="09", dynamic_ncols=True))
        rate = train.global_batch * train.seq_len / seconds
        bars[0].update(step + 1 - bars[0].n)
        bars[0].set_postfix(loss=f"{loss:.3f}", **({"val": f"{val:.3f}"} if val is not None else {}),
                            tok_s=f"{rate:,.0f}", **({"mfu": f"{mfu(rate):.1%}"} if peak else {}))

    failed = None
    try:
        result = train_loop(trainer, loader, val_tokens, run, progress)
    except (zero.CheckpointError, FloatingPointError) as error:  # every rank finds it: one line each
        failed = error
    for bar in bars:
        bar.close()
    if failed is not None:
        foundation.exit_distributed(str(failed), code=1 if isinstance(failed, FloatingPointError) else 2)
    if not result["losses"]:  # a finished run resumed: said so, nothing more
        foundation.exit_distributed()
    activations = foundation.all_ranks(result["activation_bytes"])
    if rank0:
        print_run(trainer, result, activations, mfu if peak and not train.moe else None)  # MoE: as plan
        if result["saved"] is not None:
            on_disk = zero.disk_bytes(result["saved"], parameter_count(cfg, train.moe))
            print(f"checkpoint {result['saved']}: {on_disk}")
        if run.folder is not None and run.sample_bytes:
            transform = reference_transform(train)  # the run's MLPs were an MoE's (06)
            model = (transform(foundation.GPT(cfg)) if transform else foundation.GPT(cfg)).to(device)
            zero.load_model(model, run.folder)
            prompt = run.prompt.encode() if run.prompt is not None else text_prompt(val_tokens)
            new = sample(model, prompt, run.sample_bytes, run.temperature, run.top_k, run.seed)
            print(f"Sample from the checkpoint (a one-device lesson-01 GPT; temperature {run.temperature:g}, "
                  f"top-k {min(run.top_k, 256)}, seed {run.seed}), after {len(prompt)} bytes of prompt"
                  f"{'' if run.prompt is not None else ' from the validation text'}:\n"
                  + (prompt + new).decode(errors="replace"))
    if lock is not None:
        lock.close()
    foundation.exit_distributed()


def print_run(trainer: Trainer, result: dict, saved: list[int], mfu) -> None:
    """A run that trained a step: its losses and their curve, activations beside the formulas, speed."""
    cfg = trainer.cfg
    train = trainer.train
    losses = result["losses"]
    first = min(losses)
    last = max(losses)
    print(f"train loss {losses[first]:.3f} at step {first} -> {losses[last]:.3f} at step {last} "
          f"(ln {cfg.vocab_size} = {math.log(cfg.vocab_size):.3f}: a uniform guess); validation: "
          + ", ".join(f"{v:.3f} after {s}" for s, v in result["val"].items()))
    print(f"The losses ('.' training, 'o' validation):\n{loss_curve(losses, result['val'])}")
    rank0 = plan(cfg, trainer.mesh.sizes, train)[0]
    what = "peak memory above the step's start" if trainer.device.type == "cuda" else "the most autograd held"
    if trainer.device.type == "cpu" and train.recompute == "op":  # 03's policy keeps them outside autograd
        what += " (not the outputs op's policy keeps)"
    formula = ("no formula for MoE layers" if train.moe else
               f"the plan of rank 0's {foundation.counted(rank0.layers, 'layer')}, "
               f"{in_flight_text(rank0.in_flight, train.virtual)} in flight: {rank0.memory['activations']:,} "
               f"(03's formula of the layers alone, not the head's and the loss's; recompute "
               f"{train.recompute}, {'lean saves' if train.lean_saves else 'autograd saves'})")
    if train.recompute == "elementwise" and not train.moe:  # refilled storages are saved ones: counted
        formula += (f", and up to a layer's {rank0.rebuilt:,} B it empties at its regions' ends and "
                    f"refills in their backward")
    print(f"activations in step {result['measured']}, {what} per rank: "
          + ", ".join(f"{x:,}" for x in saved) + f"; {formula}")
    if trainer.device.type == "cuda":  # the run's peaks (rank 0) beside the plan's: a GPU checks the plan
        planned = [sum(v for k, v in rank0.memory.items() if v is not None and k not in parts) / GIB
                   for parts in (("fragmentation", "cuda_nccl"), ("cuda_nccl",))]
        measured = (torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB)
        print("GPU memory of rank 0, GiB, measured | planned: max_memory_allocated {:.2f} | {:.2f}, "
              "max_memory_reserved {:.2f} | {:.2f}".format(measured[0], planned[0], measured[1], planned[1]))
    times = [t for step, t in result["times"].items() if step not in result.get("profiled", ())]
    timed = times[max(1, len(times) // 4):] or times  # the first steps warm up (and compile)
    step_s = sum(timed) / len(timed)  # the first step trained is never profiled
    rate = train.global_batch * train.seq_len / step_s
    print(f"final: {foundation.counted(len(timed), 'timed step')}, {step_s * 1e3:,.1f} ms/step, "
          f"{rate:,.0f} tokens/s"
          + (f", MFU {mfu(rate):.1%} (PaLM {flops_per_token(cfg, train.seq_len):,} FLOP/token, bf16 peak "
             f"{peak_bf16_flops(trainer.device) / 1e12:.0f} TFLOP/s per device)" if mfu else ""))
    if "profile" in result:
        print(result["profile"])


def loss_curve(train: dict[int, float], val: dict[int, float], width: int = 64, height: int = 12) -> str:
    """The losses drawn in text, step across and loss up: '.' training (each column's mean over its
    steps), 'o' validation (recorded after `step` steps, so drawn at step - 1)."""
    first, last = min(train), max(train)
    values = [*train.values(), *val.values()]
    lo, hi = min(values), max(values)

    def column(step: int) -> int:
        return min(width - 1, (step - first) * width // (last - first + 1))

    def row(loss: float) -> int:
        return round((hi - loss) / ((hi - lo) or 1) * (height - 1))

    grid = [[" "] * width for _ in range(height)]
    columns = {}
    for step, loss in train.items():
        columns.setdefault(column(step), []).append(loss)
    for c, losses in columns.items():
        grid[row(sum(losses) / len(losses))][c] = "."
    for step, loss in val.items():
        grid[row(loss)][column(min(step - 1, last))] = "o"
    labels = {0: f"{hi:.3f}", height // 2: "loss", height - 1: f"{lo:.3f}"}
    lines = [f"{labels.get(r, ''):>7} |{''.join(cells)}".rstrip() for r, cells in enumerate(grid)]
    return "\n".join([*lines, f"{'':>7} +{'-' * width}",
                      f"{'':>8}{f'step {first}':<{width // 2}}{f'step {last}':>{width - width // 2}}"])


def step_profile(trace: dict, steps: int, step_s: float, top: int = 8) -> str:
    """Where a profiled step goes, from the profiler's Chrome trace: each part's time (GPU: the kernels
    launched inside its range from any thread, as autograd runs backward on its own; CPU: the range), the
    kernels (CPU: operators) that take most, and how long a GPU sat idle waiting for launches or a .item()."""
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    parts = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in STEP_PARTS]
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def ms(us: float) -> float:  # microseconds over the steps -> milliseconds per step
        return us / 1e3 / steps

    spent = dict.fromkeys(STEP_PARTS, 0.0)
    for part in parts if not kernels else ():
        spent[part["name"]] += part["dur"]
    for kernel in kernels:
        at = launched.get(kernel["args"].get("correlation"), -math.inf)
        part = next((p["name"] for p in parts if p["ts"] <= at <= p["ts"] + p["dur"]), None)
        if part is not None:
            spent[part] += kernel["dur"]
    lines = [f"profile of {foundation.counted(steps, 'step')}, {step_s * 1e3:,.1f} ms each (with the "
             f"profiler's overhead); {'GPU' if kernels else 'CPU'} time per step of each part:"]
    lines += [f"  {name:<14}{ms(us):10.1f} ms {ms(us) / (step_s * 1e3):6.1%}" for name, us in spent.items()]
    if kernels:  # the union of the kernels' intervals, against the span from the first to the last
        busy = 0.0
        reached = -math.inf  # the latest end so far
        for kernel in sorted(kernels, key=lambda e: e["ts"]):
            end = kernel["ts"] + kernel["dur"]
            busy += max(0.0, end - max(kernel["ts"], reached))
            reached = max(reached, end)
        idle = reached - min(e["ts"] for e in kernels) - busy
        lines.append(f"  the GPU ran kernels {ms(busy):.1f} ms and sat idle {ms(idle):.1f} ms of each step "
                     f"(waiting for the CPU's launches or a .item())")
    ops = kernels or [e for e in events if e.get("cat") == "cpu_op"]  # CPU operators: inclusive times
    took = collections.Counter()
    calls = collections.Counter(e["name"] for e in ops)
    for e in ops:
        took[e["name"]] += e["dur"]
    lines.append(f"  the {top} {'kernels' if kernels else 'operators'} that take most, ms per step (calls):")
    lines += [f"  {ms(us):10.2f} ({calls[name] // steps:>4})  {name[:80]}"
              for name, us in took.most_common(top)]
    return "\n".join(lines)


def model_words(cfg, moe) -> str:
    """train's header of the model: its matmul parameters; an MoE's experts and every parameter."""
    if moe is None:
        return f"({flops_per_token(cfg, 0) // 6:,} matmul params)"
    return (f"with MoE layers of {foundation.counted(moe.n_experts, 'expert')}, top {moe.top_k} "
            f"({parameter_count(cfg, moe):,} parameters)")


def flops_per_token(cfg, seq_len: int) -> int:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T for forward + backward: 6 per
    weight (2 forward, 4 backward), then the attention scores and weighted sum over context T.
    N: every parameter but the token embedding, whose lookup multiplies nothing (the untied LM head
    does). Recompute's extra forward is not counted: MFU (40-60% is good) counts useful work only."""
    n = parameter_count(cfg, None, skip=("embed.weight",))  # a tied head multiplies too
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


# get_device_name's words -> the --gpu preset (GPUS); the first match wins (an "H100 PCIe" is not an SXM H100)
DEVICE_GPUS = (("H100 PCIe", "h100-pcie"), ("H100 NVL", "h100-nvl"), ("H200 NVL", "h200-nvl"),
               ("H100", "h100-sxm"), ("H200", "h200"), ("A100", "a100-80gb"), ("B200", "b200"))


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, None on a CPU or an unknown GPU (no MFU shown)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    preset = next((gpu for words, gpu in DEVICE_GPUS if words in name), None)
    return None if preset is None else GPUS[preset][GPU_FIELDS.index("peak_tflops")] * 1e12


def text_prompt(tokens: torch.Tensor, max_bytes: int = 100) -> bytes:
    """Whole lines of the text from its second, at most max_bytes (or one longer line's start): like it."""
    text = bytes(tokens[:4 * max_bytes].tolist())
    start = text.find(b"\n") + 1
    end = text.rfind(b"\n", start, start + max_bytes) + 1
    return text[start:end] if end > start else text[start:start + max_bytes]


@torch.no_grad()
def sample(model: nn.Module, prompt: bytes, n_new: int, temperature: float = 0.8, top_k: int = 20,
           seed: int = 0) -> bytes:
    """n_new bytes continuing prompt (a byte-level 01 GPT, one device), each drawn from the top_k likeliest
    by softmax(logits / temperature), seeded (the same each run). Greedy decoding (top_k = 1) locks a small
    model into a loop ("self.______": a frequent byte, once emitted, makes itself likelier still); a less
    likely byte now and then breaks it, and T < 1 with the top-k cut keeps off the improbable tail."""
    if not prompt or model.cfg.vocab_size != 256 or not temperature > 0 or top_k < 1 or n_new < 0:
        raise ValueError(f"sample needs a non-empty prompt, a byte-level model (vocab_size 256, not "
                         f"{model.cfg.vocab_size}), temperature > 0 (not {temperature}), top_k >= 1 "
                         f"(not {top_k}) and n_new >= 0 (not {n_new})")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    tokens = torch.tensor(list(prompt), device=device)[None]
    was_training = model.training
    model.eval()
    for _ in range(n_new):  # each step re-reads the whole text (no cache)
        likely, index = (model(tokens)[:, -1].float() / temperature).topk(min(top_k, 256))
        drawn = torch.multinomial(likely.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, index.gather(-1, drawn)], dim=1)
    model.train(was_training)
    return bytes(tokens[0, len(prompt):].tolist())


# --- The equivalence check (check): the mesh against one device -----------------------------------
def reference_transform(train: TrainConfig):
    return None if train.moe is None else functools.partial(expert_parallel.convert_to_moe, cfg=train.moe)


def dp_rows(cfg, train: TrainConfig, step: int, mesh: Mesh) -> torch.Tensor:
    """This dp rank's rows of lesson 01's global batch, as (rows, seq_len + 1) token sequences."""
    tokens, targets = foundation.synthetic_batch(cfg, train.global_batch, train.seq_len, step,
                                                 mesh.coords["dp"], mesh.sizes.dp)
    return torch.cat([tokens, targets[:, -1:]], dim=1)


def check_steps(cfg, mesh: Mesh, train: TrainConfig, steps: int, device: torch.device) -> tuple:
    """check's run here: (losses, step-0 gradients and last parameters as (piece, values) pairs, Trainer)."""
    trainer = Trainer(cfg, mesh, train, device)
    losses = []
    for step in range(steps):
        losses.append(trainer.forward_backward(dp_rows(cfg, train, step, mesh)))
        if step == 0:
            grads = shard_values(trainer, "grads")
        trainer.update()
    return losses, grads, shard_values(trainer), trainer


def assemble(pieces: list[tuple["zero.Piece", torch.Tensor]]) -> dict:
    """Whole tensors (parameters, gradients, moments) by name from the ranks' (piece, values); unheld: NaN."""
    full = {}
    for piece, values in pieces:
        flat = full.setdefault(piece.name, torch.full(piece.shape, math.nan)).view(-1)
        for first, offset, length in piece.runs.tolist():
            flat[first:first + length] = values[offset:offset + length].float()
    return full


def metered_groups(mesh: Mesh) -> list[tuple[list[str], tuple[int, ...], set[str]]]:
    """(kinds, ranks, operations) of each group this rank talks in. Groups of different kinds may be the same
    ranks (cp and dp x cp when dp = 1): their operations tell them apart, else (ZeRO's and the router's
    all-gathers) they share an entry. dp alone carries nothing (ZeRO: dp x cp); at ep = 1 the ep groups are
    dp x cp's ranks again."""
    entries = []
    for kind, group in mesh.groups.items():
        if kind == "dp" or kind.startswith("ep") and mesh.sizes.ep == 1 or foundation.group_size(group) == 1:
            continue
        ranks = foundation.group_ranks(group)
        ops = set(GROUP_OPS[kind])
        shared = next((e for e in entries if e[1] == ranks and e[2] & ops), None)
        if shared is None:
            shared = ([], ranks, set())
            entries.append(shared)
        shared[0].append(kind)
        shared[2].update(ops)
    return entries


def summary(trainer: Trainer) -> dict:
    """The trainer's measurements (parameters and bytes held, bytes sent per group and step) and its plan."""
    mesh = trainer.mesh
    zeros = [part.zero for part in trainer.zeros]
    mine = plan(trainer.cfg, mesh.sizes, trainer.train)[mesh.coords["pp"]]
    held = {k: sum(z.held_bytes()[k] for z in zeros) for k in ("params", "grads", "optimizer")}
    traffic = {}
    traffic_formula = {}
    for kinds, ranks, ops in metered_groups(mesh):
        name = "+".join(kinds)
        traffic[name] = sum(trainer.meter.traffic(op, ranks) for op in ops) / max(trainer.steps, 1)
        parts = [mine.traffic.get(kind, 0) for kind in kinds]
        traffic_formula[name] = None if None in parts else sum(parts)
    units = [unit for z in zeros for unit in z.units]
    return dict(params=sum(unit.offsets[-1] for unit in units),
                shard=sum(stop - start for unit in units for _, start, stop in zero.shard_parts(unit)),
                held=held, memory_formula={k: mine.memory[k] for k in held}, traffic=traffic,
                traffic_formula=traffic_formula, in_flight=trainer.in_flight, plan=mine)


def check_run(job: Job) -> None:
    """check: the mesh's steps beside one device's, and each rank's bytes beside the plan (rank 0 prints)."""
    device = foundation.init_distributed()
    sizes = job.sizes
    cfg = job.cfg
    train = job.train
    steps = job.run.steps
    losses, grads, params, trainer = check_steps(cfg, build_mesh(sizes), train, steps, device)
    diverged = [step for step, loss in enumerate(losses) if not math.isfinite(loss)]  # every rank's losses
    one = build_mesh(MeshSizes()) if train.fp8 else None  # rank 0 alone (every rank makes its groups)
    ranks = foundation.all_ranks((grads, params, summary(trainer)), dst=0)  # on rank 0
    if trainer.mesh.rank == 0:
        if train.fp8:  # one device's FP8 on the same microbatches: the same scales, each microbatch's
            microbatches = sizes.dp * train.microbatches
            alone = dataclasses.replace(train, microbatches=microbatches, schedule="1f1b", virtual=1,
                                        sequence_parallel=False)
            ref_losses, ref_grads, ref_params, _ = check_steps(cfg, one, alone, steps, device)
            ref = foundation.TrainResult(ref_losses, assemble(ref_grads), assemble(ref_params))
        else:
            ref = foundation.train_single_device(cfg, steps, train.global_batch, train.seq_len, **{
                k: getattr(train, k) for k in OPTIMIZER}, transform=reference_transform(train))
        experts = train.moe and foundation.counted(train.moe.n_experts, "expert")
        moe = train.moe and f"MoE {experts} top-{train.moe.top_k} over ep={sizes.ep}; "
        print(f"4D parallelism: {mesh_name(sizes)} on {foundation.counted(sizes.world, 'rank')} "
              f"({dist.get_backend()}, {device.type}); ZeRO-{train.zero_stage}, {train.schedule} with "
              f"{foundation.counted(train.microbatches, 'microbatch', 'microbatches')}, "
              f"SP {'on' if train.sequence_parallel else 'off'}{', FP8' if train.fp8 else ''}, "
              f"recompute {train.recompute}, {precision_name(train)}; "
              f"{moe or ''}global batch {train.global_batch} x {train.seq_len}.\n"
              f"Rank map (tp fastest):\n{rank_map(sizes)}\n")
        print(f"{'step':<6}{'4D loss':>12}{'one device':>12}\n" + "\n".join(
            f"{step:<6}{a:>12.6f}{b:>12.6f}" for step, (a, b) in enumerate(zip(losses, ref.losses))))
    if diverged:  # NaN differs from nothing and max() skips it: a "max |difference|" would prove nothing
        foundation.exit_distributed(f"the mesh's loss at step {diverged[0]} is {losses[diverged[0]]}: its "
                                    f"training diverged (a smaller --lr), and non-finite numbers prove no "
                                    f"equality", code=1)
    if trainer.mesh.rank == 0:
        grads_full = assemble([pair for rank in ranks for pair in rank[0]])
        params_full = assemble([pair for rank in ranks for pair in rank[1]])
        one_device = "one device (AdamW + clip_grad_norm_"
        if train.fp8:
            same = foundation.counted(microbatches, "microbatch", "microbatches")
            one_device = f"one device's FP8 run on the same {same} (AdamW, clipping"
        print(f"max |difference| from {one_device} at {train.max_grad_norm}): loss "
              f"{max(abs(a - b) for a, b in zip(losses, ref.losses)):.1e}, step-0 gradients "
              f"{foundation.max_abs_diff(grads_full, ref.first_grads):.1e}, parameters after "
              f"{foundation.counted(steps, 'step')} {foundation.max_abs_diff(params_full, ref.params):.1e} "
              f"(every element reassembled from the ranks' pieces)")
        if train.fp8:  # 08's scales are whole tensors' whatever tp, pp and dp split; a cp rank's, its part's
            print("(FP8 with cp > 1: each rank scales its own part of a sequence, so these are FP8's "
                  "rounding, ~1e-3)" if sizes.cp > 1 else "(FP8: the same scales, so the same FP8 "
                  "numbers: step 0 differs by fp32's rounding. After the first update, that rounding puts\n"
                  "a few weights on the other side of an FP8 rounding boundary: flips, which the steps after "
                  "carry, as any rounding does)")
        print("\nPer rank (dp,pp,cp,tp): its stages' TP-local parameters and its ZeRO shard of them; bytes "
              f"held\n(live storages) | 02's formula; bytes sent per step in each group, measured | formula "
              f"({precision_name(train)}):")
        for rank, (_, _, measured) in enumerate(ranks):
            print(f"  rank {rank:>2} ({','.join(str(i) for i in sizes.coords(rank).values())}) "
                  f"{summary_line(measured)}")
        print("Notice: the bytes held shrink with tp and pp (and dp x cp for ZeRO-3); each dimension's "
              "traffic is its own lesson's formula.")
    foundation.exit_distributed()


def summary_line(measured: dict) -> str:
    memory = " ".join(f"{k} {measured['held'][k]:,}|{int(measured['memory_formula'][k]):,}"
                      for k in measured["held"])
    sent = []
    for kind, value in measured["traffic"].items():
        formula = measured["traffic_formula"][kind]
        beside = "n/a"
        if formula is not None:
            beside = f"{float(formula):,.0f}" + " (!=)" * (value != formula)
        sent.append(f"{kind} {float(value):,.0f}|{beside}")
    return (f"{measured['params']:>7,} params, ZeRO shard {measured['shard']:>7,} | {memory} | "
            + "  ".join(sent))


# --- The plan's formulas: what every rank holds and sends, by the lessons' formulas, any mesh and model
class UnitSizes(NamedTuple):
    """Elements one rank holds of a kind of ZeRO unit, by the ZeRO that holds them."""
    dense: int = 0    # in dp x cp's ZeRO
    experts: int = 0  # in the experts' ZeRO over ep_dp
    float8: int = 0   # in 08's Float8ZeRO (--fp8 --zero 3)
    float8_weights: int = 0  # the number of Float8Linear weights there


def local_shapes(cfg, tp: int, moe, ep: int) -> dict[str, tuple[int, ...]]:
    """A one-layer model's parameters as a rank holds them: 01's shapes, 06's experts, 03's tp slice."""
    shapes = foundation.parameter_shapes(dataclasses.replace(cfg, n_layers=1, tie_embeddings=False))
    if moe is not None:
        shapes = {name: shape for name, shape in shapes.items() if ".mlp." not in name}
        experts = expert_parallel.moe_parameter_shapes(cfg.dim, moe, ep)
        shapes |= {f"layers.0.mlp.{name}": shape for name, shape in experts.items()}
    return {name: tensor_parallel.tp_local_shape(name, shape, tp, tensor_parallel_styles(moe))
            for name, shape in shapes.items()}


def parameter_count(cfg, moe, skip: tuple[str, ...] = ()) -> int:
    """The model's parameters (every expert's) but those named in skip: local_shapes' layer x n_layers."""
    return sum(math.prod(shape) * (cfg.n_layers if name.startswith("layers.") else 1)
               for name, shape in local_shapes(cfg, 1, moe, 1).items() if name not in skip)


def unit_sizes(cfg, tp: int, moe, ep: int, fp8_gathers: bool = False) -> dict[str, UnitSizes]:
    """UnitSizes of each kind of ZeRO unit ("embed", "layers", "norm", "lm_head"). fp8_gathers (--fp8
    --zero 3): a layer's 2-D weights (08 converts every linear but the LM head) have a ZeRO of their own."""
    out: dict[str, UnitSizes] = {}
    for name, shape in local_shapes(cfg, tp, moe, ep).items():
        expert = ep > 1 and name.rpartition(".")[2] in expert_parallel.MoE.expert_names
        float8 = fp8_gathers and name.startswith("layers.") and len(shape) == 2
        numel = math.prod(shape)
        kind = name.split(".")[0]
        more = (numel * (not expert and not float8), numel * expert, numel * float8, float8)
        out[kind] = UnitSizes(*(held + added for held, added in zip(out.get(kind, UnitSizes()), more)))
    return out


@dataclass
class RankPlan:
    """What a rank at one pipeline coordinate holds and sends per step (its dp, cp, tp and ep peers alike)."""
    stages: list[int]
    layers: int
    params: int  # elements of its stages' TP-local parameters (before ZeRO)
    memory: dict[str, Fraction | int | None]  # bytes: params, grads, optimizer (02), activations (03 x 04)
    traffic: dict[str, Fraction | None]  # bytes it sends in its group of each kind; None: no formula
    in_flight: int  # microbatch-stage pairs whose activations it holds at once (04)
    rebuilt: int  # bytes of a layer's saves (one microbatch's) that its recompute rebuilds in backward (03)

    @property
    def total(self) -> Fraction:
        """Bytes held (MoE activations, which have no formula, count 0)."""
        return sum(v for v in self.memory.values() if v is not None)


def tp_collectives(cfg, sizes: MeshSizes, train: TrainConfig, layers: int, embed: bool, head: bool) -> dict:
    """03's collectives in a step of a pipeline rank's stages: {operation: (calls, their tensors' bytes)}."""
    return tensor_parallel.comm_formula(
        cfg, train.global_batch // sizes.dp, train.seq_len // sizes.cp, train.sequence_parallel,
        layers=layers, embed=embed, head=head, microbatches=train.microbatches, mlp=train.moe is None,
        elem_bytes=2 if train.mixed_precision else 4, recompute=train.recompute, regather=train.lean_saves,
        kept_input=fp8.KEPT_INPUT if train.fp8 else None, loss_chunks=train.loss_chunks)


def tp_messages(cfg, sizes: MeshSizes, train: TrainConfig, layers: int, embed: bool, head: bool) -> list:
    """tp_collectives as (calls, bytes a rank sends in the ring)."""
    ops = tp_collectives(cfg, sizes, train, layers, embed, head)
    return [(calls, foundation.ring_traffic(op, payload, sizes.tp)) for op, (calls, payload) in ops.items()]


def tp_copy_bytes(cfg, sizes: MeshSizes, train: TrainConfig, layers: int, embed: bool, head: bool
                  ) -> Fraction:
    """Memory traffic of the copies 03's collectives make in a step (test_09 counts them): an all-reduce
    reads its input and writes it into a new tensor (an operator never reduces a tensor it was given);
    SP's gathers and scatters move the sequence to the front and back, a copy of their input and of their
    output, when a microbatch has more than one sequence (of one, the moves are views)."""
    ops = tp_collectives(cfg, sizes, train, layers, embed, head)
    reduced = ops.get("all_reduce", (0, 0))[1]
    moved = sum(ops.get(op, (0, 0))[1] for op in ("all_gather", "reduce_scatter"))
    rows = train.global_batch // sizes.dp // train.microbatches
    return 2 * reduced + (rows > 1) * 2 * (1 + Fraction(1, sizes.tp)) * moved


def norm_traffic(n: int) -> Fraction:
    """What a rank sends all-reducing the clipping norm's fp32 square over a group of n ranks."""
    return foundation.ring_traffic("all_reduce", 4, n)


# What a GPU holds beyond the plan's tensors (the memory's "fragmentation" and "cuda_nccl"): the caching
# allocator reserves ~10% above what is allocated (reserved / allocated 1.08 and 1.11 in Megatron-Bridge's
# verification cards, expandable segments on); the CUDA context (PyTorch PR #86509: 274 MiB, lazily loaded)
# and cuBLAS's workspaces, 0.5 GiB; NCCL's buffers, 4 + 4.7 + 0.5 MiB a channel and peer for its three
# protocols (src/init.cc's defaults), 2 ring peers x 16 channels: 0.3 GiB a communicator. An estimate of
# published figures, not a measurement; torch's max_memory_reserved leaves out the context and NCCL's.
ALLOCATOR = Fraction(1, 10)
CUDA_GIB = Fraction(1, 2)
NCCL_GIB = Fraction(3, 10)
GIB = 2 ** 30


def priced_kernel(attention: str, cp: int) -> str:
    """The attention kernel plan prices: --attention's, but with cp > 1 the one 09 runs in 05's ring,
    07's, whatever --attention says (a ring block returns its rows' log-sum-exp, which SDPA does not)."""
    return "flash" if cp > 1 else attention


def mlp_backward_bytes(tokens: int, dim: int, ffn_dim: int, elem_bytes: int) -> int:
    """The most 01's SwiGLU's backward holds beyond its saved tensors (test_09 counts it): the gradients of
    down_proj's input, of silu(gate) and of up (3 f a token), and its input's (h)."""
    return tokens * elem_bytes * (3 * ffn_dim + dim)


def plan(cfg, sizes: MeshSizes, train: TrainConfig) -> list[RankPlan]:
    """Every pipeline rank's RankPlan by the earlier lessons' formulas (COST); call validate first."""
    e = 2 if train.mixed_precision else 4  # bytes of a compute parameter, gradient, activation
    tp = sizes.tp
    cp = sizes.cp
    pp = sizes.pp
    m = train.microbatches
    b = train.global_batch // sizes.dp  # a dp rank's sequences
    s = train.seq_len // cp  # a cp rank's tokens of each
    n_stages = pp * train.virtual
    units = unit_sizes(cfg, tp, train.moe, sizes.ep, fp8_gathers=train.fp8 and train.zero_stage == 3)
    if cfg.tie_embeddings and pp == 1:  # the head is the embedding
        units["lm_head"] = UnitSizes()
    spans = pipeline.stage_layers(cfg.n_layers, n_stages, train.ends_as_layers)
    zero_groups = {"dp_cp": sizes.dp * cp, "ep_dp": sizes.dp * cp // sizes.ep}
    split = train.schedule == "zb-h1"
    moe = 0  # an MoE layer's parameters
    if train.moe is not None:
        moe = sum(map(math.prod, expert_parallel.moe_parameter_shapes(cfg.dim, train.moe, sizes.ep).values()))
    tokens = b // m * s // tp  # a microbatch's tokens / tp: x a width, a rank's share (tp splits the heads)
    q = tokens * cfg.dim
    kv = tokens * cfg.n_kv_heads * cfg.head_dim
    attention = None  # what the attention function saves beyond q, k, v: None, SDPA's
    kernel = priced_kernel(train.attention, cp)
    if kernel == "unfused":
        attention = unfused_attention_saves(b // m, cfg.n_heads // tp, s, e, train.attention_dropout > 0)
    if cp > 1:
        attention = context_parallel.ring_saved_bytes(q, tokens * cfg.n_heads, e)
    if cp > 1 and cfg.n_heads == tp and not train.fp8:  # one head a rank: flattening it copies
        attention -= e * q  # nothing, so out_proj keeps the merged output the ring keeps: counted once

    saving = "full" if train.recompute == "whole" else train.recompute  # whole keeps what full keeps

    def stage_bytes(stage: int, mode: str = saving, layers: int | None = None) -> int:
        """03's activations of a stage's layers (or `layers` of them) for one microbatch; 08's casts kept."""
        return tensor_parallel.layer_activation_formula(
            cfg, b // m, s, tp, train.sequence_parallel, mode, e, attention, layers or len(spans[stage]),
            lean=train.lean_saves, regather=train.lean_saves,
            kept_input=fp8.KEPT_INPUT if train.fp8 else None)

    whole = stage_bytes(0, "none", 1)  # a layer's saves, which a recompute rebuilds in its backward
    rebuilt = {mode: whole - stage_bytes(0, mode, 1) for mode in ("op", "selective")}
    rebuilt |= dict.fromkeys(("full", "whole"), whole)
    rebuilt["elementwise"] = whole - stage_bytes(0, "elementwise", 1)  # also in forward, to its region's end
    mb = b // m * s  # a microbatch's tokens on a rank
    heads = cfg.n_heads // tp
    kv_heads = cfg.n_kv_heads // tp
    attention_backward = flash.attention_backward_bytes(mb, heads, kv_heads, cfg.head_dim, e, kernel)
    if kernel == "unfused":
        attention_backward = unfused_attention_backward_bytes(b // m, heads, kv_heads, s, cfg.head_dim, e)
    backward = rebuilt.get(train.recompute, 0) + max(attention_backward,
                                                     mlp_backward_bytes(mb, cfg.dim, cfg.ffn_dim // tp, e))
    out = []
    for rank in range(pp):
        stages = list(range(rank, n_stages, pp))
        layers = sum(len(spans[st]) for st in stages)
        memory = dict.fromkeys(("params", "grads", "optimizer"), Fraction(0))
        traffic = {}
        params = 0
        in_backward = 0  # the ZeROs' temporaries (02): one unit at a time in backward
        at_step = 0  # and every shard's at the step
        for st in stages:  # 02: a ZeRO per stage (and one for its experts) on its padded units
            held = [units["embed"]] * (st == 0) + [units["layers"]] * len(spans[st])
            held += [units["norm"], units["lm_head"]] * (st == n_stages - 1)
            for kind, part in (("dp_cp", "dense"), ("ep_dp", "experts"), ("dp_cp", "float8")):
                numels = [getattr(u, part) for u in held if getattr(u, part)]
                if not numels:
                    continue
                n = zero_groups[kind]
                padded = sum(zero.padded_size(x, n) for x in numels)
                params += sum(numels)
                precision = (train.mixed_precision, train.bf16_optimizer, train.fp32_grads)
                for key, value in zero.zero_memory_formula(padded, len(numels), n, train.zero_stage,
                                                           *precision).items():
                    memory[key] += value
                one, step = zero.zero_transient_bytes(padded, zero.padded_size(max(numels), n), n,
                                                      train.zero_stage, *precision)
                in_backward = max(in_backward, one)
                at_step += step
                ops = zero.zero_traffic_per_step(padded, n, train.zero_stage, e, 4 if train.fp32_grads else e)
                if part == "float8":  # + each rank's e4m3 shard and every weight's scale; 1 B gathers, amaxes
                    weights = sum(u.float8_weights for u in held)
                    memory["params"] += Fraction(padded, n) + fp8.AMAX_BYTES * weights
                    ops = fp8.float8_zero_traffic(padded, weights, n, e)
                gathers = m if train.zero_stage == 3 else 1  # ZeRO-3: around each microbatch's F and B
                sent = ops.get("all_gather", 0) * gathers
                sent += ops.get("reduce_scatter", 0) + ops.get("all_reduce", 0)
                if train.zero_stage:
                    sent += norm_traffic(n)
                traffic[kind] = traffic.get(kind, 0) + sent
        if tp > 1 and not split:  # 03 (ZB-H1's W re-runs part of the backward: no formula)
            messages = tp_messages(cfg, sizes, train, layers, 0 in stages, n_stages - 1 in stages)
            traffic["tp"] = norm_traffic(tp) + sum(sent for _, sent in messages)
            if train.sequence_parallel and moe:  # SP sums every replicated gradient over tp: the MoE's too
                traffic["tp"] += foundation.ring_traffic("all_reduce", m * layers * moe * e, tp)
            if train.fp8:  # 08: the amaxes of split weights, activations and gradients
                traffic["tp"] += fp8.tensor_parallel_amax_traffic(
                    tp, layers, m, mlp=train.moe is None, sequence_parallel=train.sequence_parallel,
                    recompute=train.recompute)
        elif tp > 1:
            traffic["tp"] = None
        forwards = 1 if train.recompute in ("none", "elementwise") else 2  # 2: a recompute reruns the ring
        if cp > 1:  # 05: every attention call of every microbatch; ZB-H1's W re-runs the backward
            ring = context_parallel.attention_bytes("ring", q, kv, cp, e)
            backwards = {st: 2 if split and st > 0 else 1 for st in stages}  # stage 0's B: no input gradient
            traffic["cp"] = None if split and forwards == 2 else sum(
                m * len(spans[st]) * (forwards * ring["forward"] + backwards[st] * ring["backward"])
                for st in stages)
        if pp > 1:  # 04: one activation forward and one gradient back per boundary and microbatch
            boundaries = sum((st < n_stages - 1) + (st > 0) for st in stages)
            seq = s // (tp if train.sequence_parallel else 1)
            traffic["pp"] = norm_traffic(pp) + pipeline.stage_trains_traffic(pp, train.virtual)  # 04's check
            traffic["pp"] += boundaries * b * seq * cfg.dim * e
        if sizes.ep > 1:
            traffic["ep"] = None  # 06's all-to-alls depend on the routing
        memory["activations"] = None
        memory["temporaries"] = None
        if train.moe is None:  # MoE activations have no formula
            memory["activations"] = pipeline.held_at_peak(train.schedule, rank, pp, m, train.virtual,
                                                          stage_bytes)
            loss = 0
            if n_stages - 1 in stages:
                loss = tensor_parallel.loss_bytes(mb, cfg.vocab_size, tp, e, train.loss_chunks)
            # at a backward's peak, or at the step's
            memory["temporaries"] = max(max(loss, backward) + in_backward, at_step - memory["activations"])
        allocated = sum(v for v in memory.values() if v is not None)
        memory["fragmentation"] = ALLOCATOR * allocated  # of the allocator's segments: reserved - allocated
        communicators = 1 + sum(getattr(sizes, d) > 1 for d in ("tp", "cp", "pp"))  # the world, each group
        communicators += (sizes.dp * cp > 1) + 2 * (sizes.ep > 1)
        memory["cuda_nccl"] = GIB * (CUDA_GIB + NCCL_GIB * communicators)
        out.append(RankPlan(stages, layers, params, memory, traffic,
                            pipeline.in_flight_bound(train.schedule, rank, pp, m, train.virtual),
                            rebuilt.get(train.recompute, 0)))
    return out


# ====== PLANNING AT SCALE (plan): a model and a cluster not here, priced by the lessons' formulas and rates =
# 09's presets and published models (Meta's Llama 3 and Llama 2 7B), as MODELS. Peak lr from the Llama 3
# paper; batches of 4M, 8M and 16M tokens (405B: Meta's last).
LLAMA3 = dict(vocab_size=128_256, n_kv_heads=8, rope_theta=500_000.0)
PRESETS = MODELS | {
    "llama2-7b": (dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32_000), 4096, 1024,
                  3e-4),
    "llama3-8b": (dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **LLAMA3), 8192, 512, 3e-4),
    "llama3-70b": (dict(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **LLAMA3), 8192, 1024, 1.5e-4),
    "llama3-405b": (dict(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, **LLAMA3), 8192, 2048, 8e-5),
}


# --- A cluster, and a step's time on it ------------------------------------------------------------
# --gpu: GiB (as the device reports it), dense bf16 and FP8 TFLOP/s (datasheets print 2x, "with sparsity"),
# HBM TB/s, GB/s each way on NVLink and on the NIC, the TDP and the power limit the GPU runs at (W).
GPUS = {  # A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): 40 (HBM2) or 80 GB, 312 TFLOP/s,
    # no FP8, 1,555 or 2,039 GB/s, NVLink 600 GB/s both ways, 400 W; DGX A100: a 200 Gb/s HDR NIC per GPU
    # (not re-read)
    "a100-40gb": (40, 312, None, 1.555, 300, 25, 400, 400),
    "a100-80gb": (80, 312, None, 2.039, 300, 25, 400, 400),
    # H100 SXM5 (nvidia.com/en-us/data-center/h100): 989 / 1,979 dense, 3.35 TB/s, NVLink 900 GB/s, 700 W; DGX
    # H100: eight 400 Gb/s ConnectX-7 (dgxc-benchmarking's README; NVIDIA's DGX BasePOD architecture)
    "h100-sxm": (80, 989, 1979, 3.35, 450, 50, 700, 700),
    # H100 PCIe (NVIDIA's datasheet as hpctech.co.jp prints it): 756 / 1,513 dense, 2,000 GB/s HBM2e, 350 W
    # (product brief PB-11133-001); NVLink bridges join pairs only: PCIe Gen5 x16, 128 GB/s both ways
    "h100-pcie": (80, 756, 1513, 2.0, 64, 50, 350, 350),
    # H200 (nvidia.com/en-us/data-center/h200): 141 GB HBM3e (140 GiB), 4.8 TB/s; the H100 SXM's die and
    # NVLink (MLPerf v4.1 system description: 18 links, 900 GB/s), 700 W; 400 Gb/s CX-7 per GPU (torchtitan's
    # H200 run)
    "h200": (140, 989, 1979, 4.8, 450, 50, 700, 700),
    # H100 NVL and H200 NVL (NVIDIA's datasheets): PCIe cards, 835 / 1,671 dense; 94 GB HBM3 at 3.9 TB/s,
    # 400 W, or the H200's 141 GB at 4.8 TB/s, 600 W; NVLink bridges, 600 and 900 GB/s both ways
    "h100-nvl": (93, 835, 1671, 3.9, 300, 50, 400, 400),
    "h200-nvl": (140, 835, 1671, 4.8, 450, 50, 600, 600),
    # B200 (DGX B200, nvidia.com/en-us/data-center/dgx-b200, / 8 GPUs: 1,440 GB, 72 PFLOPS FP8 sparse,
    # 64 TB/s, NVLink 5 14.4 TB/s; nvidia-smi: 179 GiB); bf16 2,250 (Blackwell datasheet); 1,000 W; 400 Gb/s
    # CX-7 each
    "b200": (179, 2250, 4500, 8.0, 900, 50, 1000, 1000),
    # Meta's Grand Teton H100 (torchtitan benchmarks/llama3_h100_202412: "96GB HBM2e with 2.4 TB/sec",
    # "400 Gb/s per GPU", "the default 500W power limit"): an SXM H100 (its peaks, NVLink; 95 GiB visible)
    # held to 500 W
    "h100-96gb": (95, 989, 1979, 2.4, 450, 50, 700, 500),
}
GPU_FIELDS = ("gpu_memory", "peak_tflops", "fp8_tflops", "hbm_tbps", "nvlink_gbps", "network_gbps", "tdp",
              "power_limit")
H100 = dict(zip(GPU_FIELDS, GPUS["h100-sxm"]))  # Cluster's defaults: the GPU of the course's measured rates
# 03's Projections casts an input to FP8 once for the linears that read it (q, k, v; gate, up): these
# take the cast their first sibling made
CAST_BY_A_SIBLING = ("k_proj", "v_proj", "up_proj")
PARTS = ("GEMMs", "attention", "elementwise", "TP", "DP", "PP", "CP", "bubble")  # step_time's, as printed


@dataclass(frozen=True)
class Cluster:
    """The machines: a --gpu preset (datasheet figures). Rates and sizes lie within ~1000x of an H100 node's
    (beyond any chip or cluster of today): a typo (0, 1e-300, inf, 1e308) priced a step at 0 s, then divided
    by it; NaN breaks every rule. --gpus at most a million: the search tries each divisor."""
    gpus: int | None = option(None, "GPUs (default: the mesh sizes' product)", (">= 1", "<= 1e6"), type=int)
    gpus_per_node: int = option(8, "GPUs per node (tp stays in one; more GPUs fill whole nodes)",
                                (">= 1", "<= 1e4"))
    gpu: str = option("h100-sxm", "the GPU: memory, peaks, bandwidths, power (each option below overrides)",
                      choices=GPUS)
    gpu_memory: float = option(H100["gpu_memory"], "GiB per GPU", (">= 1", "<= 1e5"), type=float)
    peak_tflops: float = option(H100["peak_tflops"], "dense bf16 TFLOP/s per GPU", (">= 1", "<= 1e6"),
                                type=float)
    fp8_tflops: float | None = option(H100["fp8_tflops"], "dense FP8 TFLOP/s per GPU (an A100 has none: "
                                      "--fp8 is refused)", (">= 1", "<= 1e6"), type=float)
    hbm_tbps: float = option(H100["hbm_tbps"], "TB/s of GPU memory (elementwise work, the optimizer, thin "
                             "GEMMs)", (">= 0.01", "<= 1e3"))
    nvlink_gbps: float = option(H100["nvlink_gbps"], "GB/s per GPU each way in a node", (">= 1", "<= 1e5"),
                                type=float)
    network_gbps: float = option(H100["network_gbps"], "GB/s per GPU each way between nodes (a 400 Gb/s "
                                 "NIC)", (">= 0.1", "<= 1e5"), type=float)
    power_limit: float = option(H100["power_limit"], "W a GPU may draw (below the TDP: lower clocks)",
                                (">= 50", "<= 1e4"), type=float)
    tdp: float = H100["tdp"]  # W: the preset's
    latency: float = 10e-6  # s a collective or send costs beyond its bytes: NCCL's tuning model
    # (src/graph/tuning.cc) puts a ring's base latency at 4-8 us, plus 0.5-3 us a hop on NVLink

    @property
    def speed(self) -> tuple[float, float]:
        """(bf16, FP8): this GPU's compute-bound rate over the H100 SXM's at 700 W (07's and 08's rates')."""
        clock = min(1.0, self.power_limit / self.tdp)
        bf16 = self.peak_tflops / H100["peak_tflops"] * clock
        float8 = (self.fp8_tflops or math.nan) / H100["fp8_tflops"] * clock
        return bf16, float8


def inside_node(sizes: MeshSizes, kind: str, gpus_per_node: int) -> bool:
    """Whether every group of this kind lies in one node: ranks are numbered tp fastest, so a group
    stays within aligned blocks of (its slowest dimension's size x the faster dimensions' sizes), and
    the job's blocks and nodes repeat their alignment every lcm of the two (6 GPUs of one 8-GPU node: a
    block of 6 lies in it, though 6 does not divide 8)."""
    moving = [d for d in DIMS if d in GROUP_DIMS.get(kind, ("dp", "cp")) and getattr(sizes, d) > 1]
    block = math.prod(getattr(sizes, d) for d in DIMS[DIMS.index(moving[0]):]) if moving else 1
    period = math.lcm(block, gpus_per_node)
    return all(start // gpus_per_node == (start + block - 1) // gpus_per_node
               for start in range(0, min(sizes.world, period), block))


def pipeline_span(busy: list[float], bubble: float, boundary: float, pp: int, microbatches: int,
                  virtual: int, hide: bool) -> tuple[float, float]:
    """(span, fill): the pipeline's seconds, and of them the fill and drain's sends (boundary seconds
    each: the first forward's pp - 1 hops before the last rank starts, the last backward's after it
    ends; hide=False: every microbatch's, both ways, over all pp x virtual - 1 boundaries; pp = 1:
    none, one rank holds every stage). Outside them the slowest rank is busy max(busy) and idle 04's
    bubble, its idle fraction."""
    fill = (pp > 1) * boundary * (2 * (pp - 1) if hide else 2 * microbatches * (pp * virtual - 1))
    return max(busy) / (1 - bubble) + fill, fill


# The loss runs eager (outside the compiled blocks): bytes its operations move a logit (forward, backward),
# by the logits' bytes, as a dispatch mode counts them (test_09): 01's cross-entropy (tp 1) or 03's vocab-
# parallel one (tp > 1, and VOCAB_SLICE_BYTES an id of the rank's slice a call), whole or in 03's LossInChunks
# (whose forward makes the gradient, its backward scales it)
LOSS_BYTES = {  # (vocab-parallel, in chunks): {bytes a logit: (forward, backward)}
    (False, False): {2: (18, 26), 4: (12, 20)},
    (True, False): {2: (50, 22), 4: (44, 16)},
    (False, True): {2: (54, 4), 4: (52, 8)},
    (True, True): {2: (82, 4), 4: (80, 8)},
}
VOCAB_SLICE_BYTES = 34
# 03's "elementwise" recompute in backward, eager bf16, bytes an element as a dispatch mode counts them
# (test_09): the lean norm again (36 a feature) or SwiGLU's product (10), and the refilling copy (4);
# bf16's, whatever the element size (fp32 runs at scale are not what the plan is for)
NORM_REBUILD_BYTES = 36 + 4
SWIGLU_REBUILD_BYTES = 10 + 4


def ring_merge_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, cp: int) -> tuple[int, int]:
    """Memory traffic (forward, backward) of 05's ring outside its blocks, eager, on a rank's `tokens`: the
    merges of each block's partial output into an fp32 sum and a float64 log-sum-exp, the K/V stacked and
    passed on, backward's fp32 dQ and dK/dV accumulated and passed on; bytes a query element, a key or
    value element and a query head's token, as a dispatch mode counts them in bf16 (test_09; an fp32 run
    priced the same). At 8k tokens and cp 2 they add half the time of 07's kernel."""
    q = tokens * heads * head_dim
    kv = tokens * kv_heads * head_dim
    lse = tokens * heads
    forward = (20 + 20 * cp) * q + (16 * cp - 8) * kv + (195 + 326 * cp) * lse
    backward = (20 + 12 * cp) * q + (112 * cp - 48) * kv
    return forward, backward


def elementwise_bytes(cfg, tokens: int, tp: int, sequence_parallel: bool, *, layers: int, embed: bool,
                      head: bool, mlp: bool = True, elem_bytes: int = 2, fused: bool = True,
                      loss_chunks: int = 1, lean_saves: bool = True) -> tuple[int, int]:
    """Memory traffic (forward, backward) of one rank's elementwise work on a microbatch of `tokens`
    tokens through a stage (03's comm_formula keywords). fused (torch.compile): each operation reads its
    inputs and writes its output once. Per layer, between the regions (/ t with SP): two RMSNorms (h in,
    h out), two residual adds (2h, h); on the rank's heads and ffn / t: RoPE on q and k, silu(gate) x up
    (2f, f). Plus the embedding's lookup, the final norm, and the loss on the V / t logits (LOSS_BYTES).
    Backward reads what forward read and the output's gradient, writes the inputs' gradients: a norm or an
    add 3h, SwiGLU 5f, the embedding 3h; and sums the input gradients of the linears that read one input
    (q, k, v; gate, up): at tp 1 the norm reads them (3h more), else a kernel sums them on every token
    before 03's collective (reads and a write, 7h; with SP and lean saves 03's backward operator adds
    them in place, an add at a time, 9h). Eager (bf16), each of 01's operations a kernel of its own,
    reading and writing fp32 inside a norm and RoPE: the bytes a dispatch mode counts (test_09; with 03's
    lean saves backward computes silu again)."""
    h = cfg.dim
    e = elem_bytes
    mid = tokens // (tp if sequence_parallel else 1)  # a rank's tokens between the regions
    qk = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // tp
    f = cfg.ffn_dim // tp * mlp
    vocab = -(-cfg.vocab_size // tp)
    calls = min(loss_chunks, tokens)  # LossInChunks' slices, none empty
    loss = [head * per_logit * vocab * tokens for per_logit in LOSS_BYTES[tp > 1, loss_chunks > 1][e]]
    loss[0] += head * (tp > 1) * VOCAB_SLICE_BYTES * vocab * calls
    ends = (2 * h * (embed * tokens + head * mid), 3 * h * (embed * tokens + head * mid))
    grad_sums = (0, 0)  # eager: counted in the layer's bytes
    if fused:  # elements x e: x h, q + kv, head_dim, f
        per_layer = [(10 * e, 2 * e, 0, 3 * e), (12 * e, 2 * e, 0, 5 * e)]
        summed = (2 + mlp) if tp == 1 else (4 + 3 * mlp)
        if tp > 1 and sequence_parallel and lean_saves:  # summed in 03's operator, an add at a time
            summed = 6 + 3 * mlp
        grad_sums = (0, summed * h * tokens * e)
    else:  # bytes a token and layer as counted: x h, q + kv, head_dim (RoPE's tables), f
        per_layer = [(84, 48, 16, 10), (230 - 16 * lean_saves, 52, 16, 18 + 4 * lean_saves)]
    per_token = [b * qk + c * cfg.head_dim + d * f for _, b, c, d in per_layer]  # a rank's heads and ffn
    return tuple(layers * (a * h * mid + rest * tokens + sums) + end * e + loss_part
                 for (a, *_), rest, sums, end, loss_part in zip(per_layer, per_token, grad_sums, ends, loss))


def unfused_attention_seconds(batch: int, heads: int, seq: int, head_dim: int, cp: int, hbm: float,
                              elem_bytes: int, speed: float, dropout: bool = False) -> tuple[float, float]:
    """(forward, backward) of attention without a fused kernel (--attention unfused), as Megatron ran it
    before FlashAttention: each head's seq x seq scores computed whole (the causal mask applied inside the
    softmax, after the product; cp > 1: each of the ring's cp blocks whole) by GEMMs at 08's roofline,
    around a softmax kernel that reads the scores and writes the probabilities (2 passes over the scores
    at the HBM's bandwidth). Backward: dP = dO V^T, then the softmax's backward reads P and dP and writes
    dS (3 passes), and dV = P^T dO, dQ = dS K, dK = dS^T Q, each with a seq x seq operand. dropout (as
    PyTorch's CUDA dropout runs it): a kernel reads P and writes the dropped P and a mask of a byte an
    element; its backward reads the gradient and the mask and writes dP (2 passes and a byte each way)."""
    count = batch * heads * cp
    passes = count * seq ** 2 * elem_bytes / hbm
    mask = count * seq ** 2 / hbm if dropout else 0.0  # a byte an element, written, then read
    dropped = 2 * passes + mask if dropout else 0.0
    scores = fp8.gemm_seconds(seq, head_dim, seq, hbm, speed=speed)  # Q K^T, and dO V^T
    reads = fp8.gemm_seconds(seq, seq, head_dim, hbm, speed=speed)  # P V, and the three that read P or dS
    return (count * (scores + reads) + 2 * passes + dropped,
            count * (scores + 3 * reads) + 3 * passes + dropped)


def unfused_attention_saves(batch: int, heads: int, seq: int, elem_bytes: int, dropout: bool) -> int:
    """What attention without a fused kernel keeps for backward beyond q, k and v, seq x seq a head
    (Korthikanti's 5 a s / h bytes a token in 16 bits with dropout, 2 a s / h without): the softmax's
    output P, which P V keeps too, and with dropout its mask (a byte an element) and the dropped P, which
    P V keeps instead (test_09 counts them)."""
    return batch * heads * seq ** 2 * (elem_bytes + dropout * (1 + elem_bytes))


def unfused_attention_backward_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                                     elem_bytes: int) -> int:
    """The most its backward holds beyond the saves, a bound: two seq x seq gradients (an eager kernel's
    input and output: dropout's, the softmax's) beside 07's dq, dk and dv (test_09 measures it)."""
    gradients = flash.attention_backward_bytes(batch * seq, heads, kv_heads, head_dim, elem_bytes, "flash")
    return 2 * batch * heads * seq ** 2 * elem_bytes + gradients


def step_time(cfg, sizes: MeshSizes, train: TrainConfig, plans: list[RankPlan], cluster: Cluster,
              hide: bool = True) -> dict:
    """Seconds per step (THE STEP TIME); parts: the slowest pipeline rank's (bubble: its idle time in the
    span). Bounds: hide=False, nothing hidden; the compute alone, or the busiest link's bytes."""
    tp = sizes.tp
    cp = sizes.cp
    pp = sizes.pp
    m = train.microbatches
    n = sizes.dp * sizes.cp  # ZeRO's group
    moe = train.moe
    e = 2 if train.mixed_precision else 4
    rows = train.global_batch // sizes.dp // m  # a microbatch's sequences
    s = train.seq_len // cp
    tokens = rows * s  # a microbatch's tokens on a rank
    hbm = cluster.hbm_tbps * 1e12
    speed, speed8 = cluster.speed
    shapes = local_shapes(cfg, tp, moe, sizes.ep)

    def link(kind: str) -> float:
        inside = inside_node(sizes, kind, cluster.gpus_per_node)
        return 1e9 * (cluster.nvlink_gbps if inside else cluster.network_gbps)

    def send(kind: str, nbytes: float, calls: int = 1) -> float:
        return float(nbytes) / link(kind) + calls * cluster.latency

    def linears(prefix: str, names=(), rerun: bool = False) -> list[float]:
        """(forward, backward) of the linears named (or all) under prefix; 06's experts on top_k x tokens.
        rerun: a recompute's, which casts no input (input_casts); the weights' casts: once a step."""
        out = [0.0, 0.0]
        for name, shape in shapes.items():
            if not name.startswith(prefix) or len(shape) < 2 or names and name.split(".")[-2] not in names:
                continue
            *experts, n_out, n_in = shape
            count = experts[0] if experts else 1
            float8 = train.fp8 and not experts and prefix == "layers."
            rows_in = tokens * (moe.top_k if experts else 1) // count
            input_cast = not rerun and name.split(".")[-2] not in CAST_BY_A_SIBLING
            rate = speed8 if float8 else speed
            f, b = fp8.linear_seconds(rows_in, n_in, n_out, hbm, float8, rate, input_cast)
            out = [out[0] + count * f, out[1] + count * b]
        return out

    def input_casts() -> float:
        """FP8: a layer's casts of its linears' inputs (4 of them), made again by a recompute."""
        if not train.fp8:
            return 0.0
        inputs = [shape[-1] for name, shape in shapes.items() if name.startswith("layers.")
                  and len(shape) == 2 and name.split(".")[-2] not in CAST_BY_A_SIBLING]
        return sum(fp8.float8_cast_bytes(tokens, n_in, 0)[0] for n_in in inputs) / hbm

    def sequence_parallel_hidden() -> float:
        """SP with its regather (03's Projections, Megatron's overlap): what a layer's backward hides of its
        regions' collectives, each input's all-gather behind the GEMMs of its gradient, the gradient's
        reduce-scatter behind the weights' gradients (seconds, both sides of a message)."""
        if not (train.sequence_parallel and train.lean_saves):
            return 0.0
        bsh = tokens * cfg.dim
        regather = send("tp", foundation.ring_traffic("all_gather", bsh * (1 if train.fp8 else e), tp))
        scatter = send("tp", foundation.ring_traffic("reduce_scatter", bsh * e, tp))
        hidden = 0.0
        mlp = ("gate_proj", "up_proj") if moe is None else ()  # 06's experts keep their own
        regions = {"attn": ("q_proj", "k_proj", "v_proj"), "mlp": mlp}
        rate = speed8 if train.fp8 else speed
        for region, names in regions.items():
            grad_input = 0.0
            grad_weight = 0.0
            for name in names:
                n_out, n_in = shapes[f"layers.0.{region}.{name}.weight"]
                grad_input += fp8.gemm_seconds(tokens, n_out, n_in, hbm, train.fp8, rate)
                grad_weight += fp8.gemm_seconds(n_out, tokens, n_in, hbm, train.fp8, rate)
            hidden += min(regather, grad_input) + min(scatter, grad_weight)
        return hidden

    def elementwise(**where) -> list[float]:  # (forward, backward) at the HBM's bandwidth
        nbytes = elementwise_bytes(cfg, tokens, tp, train.sequence_parallel, mlp=moe is None, elem_bytes=e,
                                   fused=train.compile, loss_chunks=train.loss_chunks,
                                   lean_saves=train.lean_saves, **where)
        return [x / hbm for x in nbytes]

    kernel = priced_kernel(train.attention, cp)
    if kernel == "unfused":
        attention = unfused_attention_seconds(rows, cfg.n_heads // tp, s, cfg.head_dim, cp, hbm, e, speed,
                                              dropout=train.attention_dropout > 0)
    else:
        attention = flash.attention_seconds(rows, cfg.n_heads // tp, s, cfg.head_dim, kernel, cp, speed)
    if cp > 1:  # 05's ring merges each block's partial output, eager
        merges = ring_merge_bytes(rows * s, cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim, cp)
        attention = [seconds + nbytes / hbm for seconds, nbytes in zip(attention, merges)]
    layer = {"GEMMs": linears("layers."), "attention": list(attention),
             "elementwise": elementwise(layers=1, embed=False, head=False)}
    # Recompute: what backward runs again before its own work (03's modes; test_09 counts GEMMs and casts)
    again = dict.fromkeys(layer, 0.0)
    if train.recompute == "selective":
        again["attention"] = layer["attention"][0]
    if train.recompute == "op":  # elementwise work, the 2nd, 4th and 6th matmul (its policy keeps the rest)
        again["elementwise"] = layer["elementwise"][0]
        again["GEMMs"] = linears("layers.", ("k_proj", "out_proj", "up_proj"), rerun=True)[0] + input_casts()
    if train.recompute == "elementwise":  # eager, bf16: each norm again, SwiGLU's product, each copied
        between_regions = tokens // (tp if train.sequence_parallel else 1)  # the norms' tokens on a rank
        rebuild = (2 * NORM_REBUILD_BYTES * cfg.dim * between_regions
                   + SWIGLU_REBUILD_BYTES * cfg.ffn_dim // tp * tokens)
        again["elementwise"] = rebuild / hbm
    if train.recompute in ("full", "whole"):  # full: the block up to down_proj's input, which its backward
        # keeps (FP8's down_proj runs its GEMM before Projections keeps its input's cast; 06's MoE: priced
        # whole); whole: to the block's end
        dense = moe is None and train.recompute == "full"
        names = [name.split(".")[-2] for name, shape in shapes.items() if name.startswith("layers.")
                 and len(shape) >= 2 and (train.fp8 or not dense or not name.endswith("down_proj.weight"))]
        last_add = 3 * e * cfg.dim * tokens // (tp if train.sequence_parallel else 1) * dense / hbm
        again["GEMMs"] = linears("layers.", names, rerun=True)[0] + input_casts()
        again["attention"] = layer["attention"][0]
        again["elementwise"] = layer["elementwise"][0] - last_add  # not the second residual add
    layer = {k: [f, b + again[k]] for k, (f, b) in layer.items()}
    ranks = []
    for p in plans:
        first = 0 in p.stages
        last = pp * train.virtual - 1 in p.stages
        ends = {"GEMMs": linears("lm_head") if last else [0, 0], "attention": [0, 0],
                "elementwise": elementwise(layers=0, embed=first, head=last)}
        work = {k: [p.layers * layer[k][i] + ends[k][i] for i in (0, 1)] for k in layer}
        parts = {k: m * sum(v) for k, v in work.items()} | dict.fromkeys(("TP", "CP", "DP"), 0.0)
        gather_bytes = e  # a gathered parameter's (ZeRO)
        if train.fp8:  # 08's casts of the stage's FP8 weights, once a step (ZeRO-3: each rank its shard's)
            weights = p.layers * sum(math.prod(shape) for name, shape in shapes.items()
                                     if name.startswith("layers.") and len(shape) == 2)
            parts["GEMMs"] += fp8.weight_casts_bytes(weights, e, n if train.zero_stage == 3 else 0) / hbm
            if train.zero_stage == 3:  # Float8ZeRO gathers their e4m3 bytes: 1 B an element
                gather_bytes = Fraction(e * p.params - (e - 1) * weights, p.params)
        if tp > 1:  # (ZB-H1's W re-runs part of the backward's: priced as 1F1B's)
            messages = tp_messages(cfg, sizes, train, p.layers, first, last)
            parts["TP"] = sum(send("tp", sent, calls) for calls, sent in messages)
            parts["TP"] -= m * p.layers * sequence_parallel_hidden() if hide else 0.0
            parts["elementwise"] += float(tp_copy_bytes(cfg, sizes, train, p.layers, first, last)) / hbm
        if cp > 1:  # each of the cp - 1 hops behind one block's attention; recompute: the forward's twice
            hops = context_parallel.attention_bytes("ring", tokens * cfg.dim // tp,
                                                    tokens * cfg.n_kv_heads * cfg.head_dim // tp, cp, e)
            forward = zero.exposed(send("cp", hops["forward"] / (cp - 1)), attention[0] / cp, hide)
            backward = zero.exposed(send("cp", hops["backward"] / (cp - 1)), attention[1] / cp, hide)
            forwards = 1 + (train.recompute not in ("none", "elementwise"))
            parts["CP"] = m * p.layers * (cp - 1) * (forward * forwards + backward)
        after = zero.zero_step_bytes(p.params, n, train.zero_stage, m, train.mixed_precision,
                                     train.bf16_optimizer, train.fp32_grads) / hbm
        if n > 1:  # 02's over dp x cp; units: each layer, the embedding, the norm and head
            unit = [sum(v[i] for v in layer.values()) for i in (0, 1)]
            units = p.layers + first + 2 * last
            last_backward = sum(v[1] for v in work.values())
            send_dp = functools.partial(send, "dp_cp")
            behind = last_backward if train.reduce_in_backward else 0.0
            parts["DP"] = zero.zero_exposed_seconds(p.params, n, train.zero_stage, units, m, gather_bytes,
                                                    send_dp, behind, unit, hide, 4 if train.fp32_grads else e)
        ranks.append((parts, after))
    bubble = pipeline.bubble_formula(train.schedule, pp, m, train.virtual)
    busy = [sum(parts.values()) - parts["DP"] for parts, _ in ranks]
    message = rows * s // (tp if train.sequence_parallel else 1) * cfg.dim * e  # a boundary's, each way
    span, fill = pipeline_span(busy, bubble, send("pp", message), pp, m, train.virtual, hide)
    totals = [span + parts["DP"] + after for parts, after in ranks]
    slowest = totals.index(max(totals))
    parts, after = ranks[slowest]
    parts = {**parts, "elementwise": parts["elementwise"] + after, "PP": fill,
             "bubble": span - fill - busy[slowest]}
    compute = max(sum(r[k] for k in layer) for r, _ in ranks) / (1 - bubble) + max(a for _, a in ranks)
    links = {"NVLink": 0.0, "network": 0.0}  # each link's busiest rank's seconds, had it no latency
    comm = {}
    for kind in dict.fromkeys(k for p in plans for k in p.traffic):
        sent = [p.traffic.get(kind, 0) for p in plans]
        where = "NVLink" if inside_node(sizes, kind, cluster.gpus_per_node) else "network"
        comm[kind] = None if None in sent else (float(max(sent)), where)
        links[where] += 0 if comm[kind] is None else comm[kind][0] / link(kind)
    flops = train.global_batch * train.seq_len * flops_per_token(cfg, train.seq_len)  # MFU's count
    return dict(step=max(totals), parts={k: parts[k] for k in PARTS}, bubble=bubble, busy=busy, span=span,
                flops=flops, mfu=flops / (max(totals) * sizes.world * cluster.peak_tflops * 1e12), comm=comm,
                overlap=max(compute, *links.values()),
                no_overlap=step_time(cfg, sizes, train, plans, cluster, hide=False)["step"] if hide else None)


def planned(cfg, sizes: MeshSizes, train: TrainConfig, cluster: Cluster) -> tuple:
    """(sizes, train as run (microbatches None: one sequence each), plans, step time), or a ValueError."""
    microbatches = train.microbatches or max(train.global_batch // sizes.dp, 1)
    train = dataclasses.replace(train, microbatches=microbatches)
    validate(cfg, sizes, train, sizes.world)
    plans = plan(cfg, sizes, train)
    return sizes, train, plans, step_time(cfg, sizes, train, plans, cluster)


def fullest(plans: list[RankPlan]) -> Fraction:
    return max(p.total for p in plans)


def search_meshes(cfg, train: TrainConfig, gpus: int, fixed: dict[str, int | None], ep: int,
                  cluster: Cluster) -> tuple[list, list, str]:
    """THE SEARCH: planned() of every mesh of gpus GPUs, the sizes given kept: (valid, fitting, a refusal)."""
    valid = []
    refusals = []
    across_nodes = set()  # the tp of each mesh of the sizes given whose tp groups would span two nodes
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        if gpus % (tp * cp * pp):
            continue
        sizes = MeshSizes(gpus // (tp * cp * pp), pp, cp, tp, ep)
        if any(fixed[d] not in (None, getattr(sizes, d)) for d in DIMS):
            continue
        if cluster.gpus_per_node % tp:
            across_nodes.add(tp)
            continue
        try:
            valid.append(planned(cfg, sizes, train, cluster))
        except ValueError as error:
            problems = str(error).replace(":\n  - ", ": ").replace("\n  - ", "; ")  # validate's list
            refusals.append(f"{mesh_name(sizes)}: {problems}")
    fitting = [v for v in valid if fullest(v[2]) <= cluster.gpu_memory * GIB]
    fitting.sort(key=lambda v: v[3]["step"])
    given = math.prod(size for size in fixed.values() if size)
    none = f"the sizes given multiply to {given}: no mesh of them has {gpus} GPUs"
    if gpus % given:
        none = f"the sizes given multiply to {given}, which does not divide --gpus {gpus}"
    if across_nodes:
        none = (f"tp={', '.join(map(str, sorted(across_nodes)))} does not divide --gpus-per-node "
                f"{cluster.gpus_per_node}: a tp group stays in one node")
    return valid, fitting, refusals[0] if refusals else none


# --- The plan's report: one mesh, or the fastest that fit; as text, or as JSON (--json) ----------
GROUP_NAMES = {"tp": "tp", "cp": "cp", "pp": "pp", "dp_cp": "dp x cp", "ep_dp": "experts' dp", "ep": "ep"}
TOP_MESHES = 3  # the search prints this many


def gib(nbytes: Fraction | int | None) -> float | None:
    return None if nbytes is None else float(nbytes) / GIB


def record(sizes: MeshSizes, train: TrainConfig, plans: list[RankPlan], timing: dict) -> dict:
    """One mesh's plan as data (GiB, GB, seconds): what describe prints and --json writes."""
    totals = [p.total for p in plans]
    return dict(mesh={d: getattr(sizes, d) for d in (*DIMS, "ep")}, zero=train.zero_stage,
                schedule=train.schedule, virtual=train.virtual, microbatches=train.microbatches,
                recompute=train.recompute, sequences=train.global_batch // sizes.dp // train.microbatches,
                sequence_parallel=train.sequence_parallel, attention=priced_kernel(train.attention, sizes.cp),
                step_s=timing["step"], parts_s=timing["parts"],
                bounds_s=[timing["overlap"], timing["no_overlap"]], bubble=float(timing["bubble"]),
                mfu=None if train.moe else timing["mfu"],
                tflops_per_gpu=None if train.moe else timing["flops"] / sizes.world / timing["step"] / 1e12,
                fullest=totals.index(max(totals)),
                memory_gib=[{**{k: gib(v) for k, v in p.memory.items()}, "total": gib(p.total)}
                            for p in plans],
                stages=[p.stages for p in plans], layers=[p.layers for p in plans],
                in_flight=[p.in_flight for p in plans],
                sent_gb={GROUP_NAMES[k]: v and dict(gb=v[0] / 1e9, link=v[1])
                         for k, v in timing["comm"].items()})


def gib_text(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}" if x >= 1 else f"{x:.2g}"


def number_text(x: float) -> str:  # 3 significant digits, or 1 decimal from 10 on: never 1e+03
    return f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def in_flight_text(held: int, virtual: int) -> str:
    """'3 microbatches' (interleaved, virtual > 1: '3 microbatch-stages') whose activations a rank holds."""
    if virtual > 1:
        return f"{held} microbatch-stage" + "s" * (held != 1)
    return f"{held} microbatch" + "es" * (held != 1)


def describe(r: dict, table: bool) -> str:
    """A record as text (table: GiB of the first two, the fullest and the last two pipeline ranks)."""
    lines = [mesh_name(MeshSizes(**r["mesh"])) + f", ZeRO-{r['zero']}, {r['schedule']} x "
             f"{foundation.counted(r['microbatches'], 'microbatch', 'microbatches')} of {r['sequences']}, "
             f"recompute {r['recompute']}, SP {'on' if r['sequence_parallel'] else 'off'}, attention "
             f"{r['attention']}"]
    memory = r["memory_gib"]
    if table:
        columns = ("params", "grads", "optim", "activ", "temps", "frag", "cuda+", "total")
        # a space before each column: a total of 1,313.0 GiB stays apart from its neighbour
        lines.append(f"{'GiB per GPU':<14}" + "".join(f" {column:>7}" for column in columns))
        last = len(memory) - 1
        shown = sorted({0, 1, r["fullest"], last - 1, last} if last > 5 else range(last + 1))
        for rank in shown:
            head = len(memory) * r["virtual"] - 1 in r["stages"][rank]
            what = ("embedding + " * (0 in r["stages"][rank]) + foundation.counted(r['layers'][rank], 'layer')
                    + " + head" * head + f", in flight: {in_flight_text(r['in_flight'][rank], r['virtual'])}")
            if rank > 0 and rank - 1 not in shown:
                lines.append("  ...")
            lines.append(f"  pp {rank:<9}" + "".join(f" {gib_text(v):>7}" for v in memory[rank].values())
                         + f"  {what}")
    else:
        most = memory[r["fullest"]]
        lines.append(f"fullest GPU {gib_text(most['total'])} GiB (pp {r['fullest']}: " + ", ".join(
            f"{k} {gib_text(v)}" for k, v in most.items() if k != "total") + ")")
    sent = [f"{k} n/a (no formula)" if v is None else f"{k} {number_text(v['gb'])} GB ({v['link']})"
            for k, v in r["sent_gb"].items()]
    lines.append("sent per GPU per step (its busiest pipeline rank): " + (", ".join(sent) or "nothing"))
    parts = r["parts_s"]
    useful = ("MFU n/a (flops_per_token counts dense MLPs)" if r["mfu"] is None else
              f"{r['tflops_per_gpu']:,.0f} TFLOP/s per GPU, MFU {r['mfu']:.0%}")
    compute = " + ".join(f"{k} {number_text(parts[k])}" for k in ("GEMMs", "attention", "elementwise"))
    exposed = ", ".join(f"{k} {number_text(parts[k])}" for k in ("TP", "DP", "PP", "CP"))
    best, worst = r["bounds_s"]
    lines += [f"step {number_text(r['step_s'])} s predicted: {useful}; bounds {number_text(best)} s "
              f"(perfect overlap) to {number_text(worst)} s (none)",
              f"  {compute} + exposed {exposed} + bubble {number_text(parts['bubble'])} s "
              f"({parts['bubble'] / r['step_s']:.0%} of the step: 04's idle fraction {r['bubble']:.0%}, "
              f"and the stages' imbalance)"]
    return "\n".join(lines)


LOSS_CHUNKS = 8  # the loss's slices why_not_fitting tries


def why_not_fitting(job: Job, gpus: int, r: dict) -> str:
    """A mesh that does not fit (r: the given one, or the search's leanest): its fullest GPU's largest
    term, and the fastest of the options below that keep less with which it fits (the sizes given kept;
    searched: on which mesh), else the fewest of them together, or that none does. Each computes the same
    numbers; --bf16-optimizer does not (AdamW's state in bf16), so it is named only where nothing else
    fits, and ZeRO 2-3 not where --fp32-grads would have to go: the user's calls."""
    most = r["memory_gib"][r["fullest"]]
    term = max((k for k in most if k != "total" and most[k] is not None), key=most.get)  # None: MoE's
    in_flight = in_flight_text(r["in_flight"][r["fullest"]], r["virtual"])
    held = f" ({in_flight} in flight)" if term == "activations" else ""
    modes = tensor_parallel.RECOMPUTE_MODES
    saving = "full" if job.train.recompute == "whole" else job.train.recompute  # whole saves what full does
    changes = {}
    for mode in ("selective", "elementwise", "full"):  # keeping less, in turn
        eager = mode == "elementwise" and job.train.compile  # 03's hooks, which torch.compile does not trace
        change = dict(recompute=mode, **({"compile": False} if eager else {}))
        if modes.index(mode) > modes.index(saving) and not (
                mode == "elementwise" and mesh_free_refusals(dataclasses.replace(job.train, **change))):
            changes[f"--recompute {mode}" + " --eager" * eager] = change
    if not job.train.fp32_grads:  # stages 2-3 free the fp32 gradient buffer it keeps
        changes |= {f"--zero {stage}": dict(zero_stage=stage) for stage in range(job.train.zero_stage + 1, 4)}
    if job.train.microbatches and job.mesh["dp"]:  # the sequences of a replica, one a microbatch
        sequences = job.train.global_batch // job.mesh["dp"]
        if job.train.microbatches < sequences:
            changes[f"--microbatches {sequences}"] = dict(microbatches=sequences)
    if job.train.loss_chunks < LOSS_CHUNKS:
        changes[f"--loss-chunks {LOSS_CHUNKS}"] = dict(loss_chunks=LOSS_CHUNKS)
    if not job.train.sequence_parallel and job.mesh["tp"] != 1:  # SP: what the regions share, split by tp
        changes["--sequence-parallel"] = dict(sequence_parallel=True)
    fits = fitting_options(job, gpus, changes) or fewest_together(job, gpus, changes)
    text = f"its largest part: {term}, {gib_text(most[term])} GiB{held}; "
    if not fits:
        kept = " (--fp32-grads keeps ZeRO at 0-1)" if job.train.fp32_grads else ""
        text += "no more recompute, ZeRO, microbatches, loss slices or SP make it fit" + kept
        if job.train.bf16_optimizer or not job.train.mixed_precision:
            return text
        leaner = {f"--bf16-optimizer{' ' * bool(option)}{option}": dict(change, bf16_optimizer=True)
                  for option, change in {"": {}, **changes}.items()}
        fits = fitting_options(job, gpus, leaner)
        if not fits:
            return text
        text += "; with AdamW's state in bf16 (other numbers), "
    option = min(fits, key=lambda change: fits[change][:2])
    step, held_gib, sizes = fits[option]
    uncounted = " without its activations" * (job.train.moe is not None)
    searched = "" if None not in job.mesh.values() else f" on {mesh_name(sizes)}"  # the fastest that fits
    said = f"{held_gib:,.1f} GiB, step {number_text(step)} s"
    return text + f"it fits{uncounted} with {option}{searched}: {said}"


def fewest_together(job: Job, gpus: int, changes: dict) -> dict:
    """Where no one option fits: the strongest of each kind at once (full recompute, ZeRO-3, ...), then each
    dropped that is not needed, in turn: {"--a --b": (step, GiB, sizes)}, or {} if all together do not fit."""
    strongest = {}  # a field -> its last (strongest) option: selective then full, ZeRO 1 then 3
    for option, change in changes.items():
        strongest[next(iter(change))] = option
    kept = list(strongest.values())

    def together(options: list[str]) -> dict:
        merged = {field: value for option in options for field, value in changes[option].items()}
        return fitting_options(job, gpus, {" ".join(options): merged})

    fits = together(kept)
    if len(kept) < 2 or not fits:
        return {}
    for option in list(kept):
        fewer = together([other for other in kept if other != option])
        if fewer:
            kept.remove(option)
            fits = fewer
    return fits


def fitting_options(job: Job, gpus: int, changes: dict) -> dict:
    """{option: (step, GiB, sizes) of the fastest mesh it fits on, the sizes given kept}: those that fit."""
    fits = {}
    for option, change in changes.items():
        train = dataclasses.replace(job.train, **change)
        fitting = search_meshes(job.cfg, train, gpus, job.mesh, job.ep, job.cluster)[1]
        if fitting:
            sizes, _, plans, timing = fitting[0]
            fits[option] = (timing["step"], gib(fullest(plans)), sizes)
    return fits


def plan_report(job: Job) -> tuple[str, bool]:
    """The given mesh's breakdown, or the fastest that fit (one line if none does); --json: one object.
    With whether a mesh fits (main's exit status: 1 where none does, for a script's `if`)."""
    cfg = job.cfg
    cluster = job.cluster
    train = job.train
    memory = cluster.gpu_memory
    fixed = job.mesh
    given = None not in fixed.values()  # every mesh size given: that mesh alone
    gpus = job.gpus or (math.prod(fixed.values()) if given else 0)
    if gpus < 1 or given and math.prod(fixed.values()) != gpus:
        options = [f"--{d} {v}" for d, v in {"gpus": job.gpus, **fixed}.items() if v is not None]
        product = f" (the sizes multiply to {math.prod(fixed.values())})" if given else ""
        raise ValueError(f"plan needs --gpus N or every mesh size (--dp --pp --cp --tp), sizes that multiply "
                         f"to N; given: {' '.join(options) or 'neither'}{product}")
    per_node = cluster.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise ValueError(f"{gpus:,} GPUs are not whole nodes of --gpus-per-node {per_node} "
                         f"({foundation.counted(gpus // per_node, 'node')} and "
                         f"{foundation.counted(gpus % per_node, 'GPU')})")
    if train.fp8 and cluster.fp8_tflops is None:
        raise ValueError(f"--fp8: the {cluster.gpu} has no FP8 tensor cores (--fp8-tflops prices one)")
    if refusals := mesh_free_refusals(train):  # every mesh's: said once, before the search
        raise ValueError(refusals[0])
    valid, fitting, refusal = search_meshes(cfg, train, gpus, fixed, job.ep, cluster)
    on = f"{gpus:,} GPU" + "s" * (gpus != 1)
    if not valid:  # a refusal, like any other: exit 2
        raise ValueError(f"no mesh of {on} passes validate: {refusal}")
    leanest = min(valid, key=lambda v: fullest(v[2]))
    shown = [record(*v) for v in (valid[:1] if given else fitting[:TOP_MESHES] or [leanest])]
    need = shown[0]["memory_gib"][shown[0]["fullest"]]["total"]
    moe = train.moe
    fits = need <= memory
    if job.json:
        # what plan prices: not the optimizer's lr, eps and clip (whose inf is no strict JSON)
        priced = {k: v for k, v in dataclasses.asdict(train).items() if k not in OPTIMIZER[:3]}
        why_not = None if fits else why_not_fitting(job, gpus, shown[0])
        report = json.dumps(dict(model=job.model, config=dataclasses.asdict(cfg), train=priced, gpus=gpus,
                                 cluster=dataclasses.asdict(cluster) | {"gpus": gpus}, valid=len(valid),
                                 fitting=len(fitting), fits=None if moe and fits else fits,
                                 why_not_fitting=why_not, meshes=shown))
        return report, fits
    n_params = parameter_count(cfg, moe, skip=("lm_head.weight",) if cfg.tie_embeddings else ())
    mlp = f"ffn {cfg.ffn_dim}"
    if moe:
        mlp = f"{foundation.counted(moe.n_experts, 'expert')} of {moe.expert_ffn_dim}, top {moe.top_k}"
    fp8_rate = f"FP8 x {cluster.speed[1]:.3g}" if cluster.fp8_tflops else "no FP8"
    scaled = "" if cluster.gpu == "h100-sxm" and cluster.speed[0] == 1 else (
        f"; the {cluster.gpu}'s datasheet peaks and power limit over the H100's: not measured on it")
    kernel = train.attention
    if train.attention_dropout:
        kernel += f", dropout {train.attention_dropout:g}"
    header = (f"{job.model}: {n_params / 1e9:,.3g}B parameters (dim {cfg.dim}, "
              f"{foundation.counted(cfg.n_layers, 'layer')}, {foundation.counted(cfg.n_heads, 'head')} / "
              f"{cfg.n_kv_heads} K/V, {mlp}, vocabulary {cfg.vocab_size:,}"
              f"{', tied' if cfg.tie_embeddings else ''}), {precision_name(train)}"
              f"{' + FP8 GEMMs' if train.fp8 else ''}; batch {train.global_batch:,} x {train.seq_len:,} "
              f"tokens; {on} of {memory:g} GiB ({cluster.gpu}), {cluster.gpus_per_node} per node.\n"
              f"Priced: GEMMs and attention ({kernel}; cp > 1: 07's in 05's ring) at the course's "
              f"H100 rates x "
              f"{cluster.speed[0]:.3g} ({fp8_rate}{scaled}), the rest at {cluster.hbm_tbps:g} TB/s"
              f"{'' if train.compile else ', eager'}; {cluster.nvlink_gbps:g} GB/s per GPU each way in a "
              f"node, {cluster.network_gbps:g} across nodes, {cluster.latency * 1e6:g} us a message.\n"
              f"Memory: the tensors, temporaries (the loss, a layer's backward, ZeRO's), the allocator's "
              f"segments (+{float(ALLOCATOR):.0%}), CUDA's context and NCCL's buffers"
              + ("; not an MoE's activations (the routing decides them: no formula): 'fit' is a lower "
                 "bound." if moe else "."))
    over = math.ceil(100 * need / memory)  # in % of the memory, rounded up
    if given:
        if need > memory:
            verdict = (f"does not fit: the fullest GPU needs {need:,.1f} GiB, {need - memory:,.1f} GiB "
                       f"({over - 100}%) more than its {memory:g} GiB; "
                       + why_not_fitting(job, gpus, shown[0]))
        else:
            verdict = (f"fits{' without its activations' * bool(moe)}: {need:,.1f} of {memory:g} GiB on the "
                       f"fullest GPU")
        return "\n".join([header, describe(shown[0], table=True), verdict]), fits
    if not fitting:
        return (f"{job.model} does not fit on {on} of {memory:g} GiB: the leanest of {len(valid)} "
                f"valid mesh{'es' * (len(valid) != 1)} ({describe(shown[0], False).splitlines()[0]}) needs "
                f"{need:,.1f} GiB on its fullest GPU, {over / 100:.2f}x the memory; "
                + why_not_fitting(job, gpus, shown[0])), fits
    one = len(fitting) == 1
    fit = f"{len(fitting)} fit{'s' * one}" + f" without {'its' if one else 'their'} activations" * bool(moe)
    passing = f"{len(valid)} mesh{'es pass' if len(valid) != 1 else ' passes'} validate"
    fastest = [f"{rank}. " + describe(r, table=False).replace("\n", "\n   ")
               for rank, r in enumerate(shown, 1)]
    return "\n".join([header, f"{passing}, {fit}; the fastest:", *fastest]), fits


# --- The command line: check | train | plan, made from the option fields -----------------------------
WIDTH = (">= 1", f"<= {foundation.MAX_WIDTH}")  # a size's rule: 01's bound on a config.json's


@dataclass(frozen=True)
class ModelOptions:  # the model: a preset or a config.json, each size overridable (model_spec), 01's bounds
    model: str = option("tiny", f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json",
                        metavar="NAME|FILE")
    dim: int | None = option(None, "model width", WIDTH, type=int)
    layers: int | None = option(None, "transformer blocks", (">= 1", f"<= {foundation.MAX_LAYERS}"), type=int)
    heads: int | None = option(None, "attention heads", WIDTH, type=int)
    kv_heads: int | None = option(None, "key/value heads, grouped-query attention", WIDTH, type=int)
    ffn_dim: int | None = option(None, "the MLP's hidden size (MoE: an expert's)", WIDTH, type=int)
    vocab: int | None = option(None, "vocabulary size", WIDTH, type=int)
    moe: bool = option(False, "every MLP a mixture of experts (dropless; top 2 of --experts, each as wide "
                              "as the dense MLP, --ffn-dim: Mixtral's rule)")
    experts: int | None = option(None, "experts per MoE layer (default: the file's, else 4)", WIDTH, type=int)


@dataclass(frozen=True)
class PlanOutput:
    json: bool = option(False, "the plan as one JSON object, for scripts and spreadsheets")


OPTIONS = (MeshSizes, ModelOptions, TrainConfig, RunConfig)  # in --help's order, then a command's classes
PRESET = "the --model's"  # what decides an option left out, as --help says it
GPU = "the --gpu preset's"
DEMO = dict(dp=2, tp=2, max_grad_norm=1.0)  # where check and train depart from the fields' defaults
RUN = dict.fromkeys(("global_batch", "seq_len"), PRESET)
SIZES = dict.fromkeys(("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab"), PRESET)
# ModelConfig's names in a rule's words, by the option that overrides each (vocab_size: config.json's key too)
MODEL_ALIASES = {"n_layers": "layers", "n_heads": "heads", "n_kv_heads": "kv_heads", "n_experts": "experts"}
COMMANDS = {  # the first runs when argv names none
    "train": foundation.Command(
        "train on text (the default): checkpoints, --resume, MFU, a sample", DEMO,
        dict(SIZES, **RUN, microbatches="1, or 2 with pp > 1", mixed_precision="on with a GPU, off on a CPU",
             lr=PRESET)),
    "check": foundation.Command(
        "prove the mesh equal to one device on synthetic data; each rank's bytes beside the plan",
        dict(DEMO, steps=3, microbatches=2, model="check", global_batch=8, seq_len=32),  # any --model's proof
        dict(SIZES, mixed_precision="off")),
    "plan": foundation.Command(
        "price a model on a cluster that is not here: the fastest meshes that fit, or the mesh given",
        dict(compile=True), dict(SIZES, **RUN, **dict.fromkeys(DIMS, "searched"), **dict.fromkeys(
            GPU_FIELDS, GPU), microbatches="global_batch / dp: one sequence each"), (Cluster, PlanOutput)),
}


def options_of(cls, args: argparse.Namespace, **others):
    """A cls from this sub-command's options of its fields; others: its other fields, those left None."""
    given = {f.name: getattr(args, f.name) for f in foundation.option_fields((cls,), args.command)}
    return cls(**others | {k: v for k, v in given.items() if v is not None or k not in others})


def model_spec(args: argparse.Namespace) -> tuple:
    """--model (a preset, byte-level unless it sets a vocabulary, or a config.json by 01's from_hf), the
    sizes given overriding it: (ModelConfig, (experts, top-k) or None, its (seq_len, global_batch, lr))."""
    if args.model in PRESETS:
        sizes, *run = PRESETS[args.model]
        experts = None
        cfg = foundation.ModelConfig(**{"vocab_size": 256, **sizes})
    elif args.model.endswith(".json"):
        run = PRESETS["llama3-8b"][1:]  # a config.json has no run: Llama 3 8B's
        try:
            config = json.loads(Path(args.model).read_text())
            cfg, experts = foundation.ModelConfig.from_hf(config if isinstance(config, dict) else {},
                                                          args.seq_len or run[0])
        except (OSError, ValueError) as error:  # json's errors are ValueErrors
            raise ValueError(f"--model {args.model}: {error}") from None
    else:
        presets = ", ".join(PRESETS)
        raise ValueError(f"--model {args.model!r} is neither a preset ({presets}) nor a .json file")
    kv_heads = args.kv_heads
    if kv_heads is None and cfg.n_kv_heads == cfg.n_heads:  # no grouping: --heads sets both
        kv_heads = args.heads
    given = dict(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=kv_heads,
                 ffn_dim=args.ffn_dim, vocab_size=args.vocab)
    return dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None}), experts, run


def configure(args: argparse.Namespace) -> Job:
    """The Job of these options, made once: an option left None takes the default --help names (COMMANDS);
    a config.json's MoE (Mixtral's) brings its top-k and expert size."""
    cfg, experts, (seq_len, global_batch, lr) = model_spec(args)
    if args.moe and not experts:  # --moe's own: 4 experts (or --experts), top 2
        experts = (4, 2)
    moe = None
    if experts:
        n_experts, top_k = experts
        moe = expert_parallel.MoEConfig(n_experts=args.experts or n_experts, top_k=top_k,
                                        expert_ffn_dim=cfg.ffn_dim, aux_loss_coef=0)
    elif args.ep > 1 or args.experts:  # a dense model has no experts to split or count
        given = f"--ep {args.ep}" if args.ep > 1 else f"--experts {args.experts}"
        raise ValueError(f"{given} is an option of an MoE model: add --moe (or a config.json with experts)")
    mixed_precision = {"train": torch.cuda.is_available(), "check": False, "plan": True}[args.command]
    microbatches = None if args.command == "plan" else 1 + ((args.pp or 1) > 1)
    train = options_of(TrainConfig, args, global_batch=global_batch, seq_len=seq_len, lr=lr, adam_eps=1e-6,
                       microbatches=microbatches, mixed_precision=mixed_precision, moe=moe)
    cluster = None
    if args.command == "plan":
        cluster = options_of(Cluster, args, **dict(zip(GPU_FIELDS, GPUS[args.gpu])))
    return Job(args.command, args.model, cfg, mesh={d: getattr(args, d) for d in DIMS}, ep=args.ep,
               train=train, run=options_of(RunConfig, args), cluster=cluster,
               gpus=getattr(args, "gpus", None), json=getattr(args, "json", False))


SAMPLE_OPTIONS = ("prompt", "temperature", "top_k")  # what only the sample reads
SAVE_OPTIONS = ("save_every", "keep")  # what only the checkpoints read (and the sample, which loads one)


def unread_run_options(run: RunConfig) -> str | None:
    """An option set away from its default that this run does not read (--no-save: no checkpoint, so no
    sample; --no-sample), said as one line, or None: silently ignored, it looked like it worked."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    if run.folder is None:
        off = "--no-save"
        unread = [*SAVE_OPTIONS, *SAMPLE_OPTIONS]
        if run.sample_bytes:  # --no-sample beside it leaves nothing unread
            unread.append("sample_bytes")
    elif not run.sample_bytes:
        off = "--no-sample"
        unread = list(SAMPLE_OPTIONS)
    else:
        return None
    changed = [foundation.flag(fields[name]) for name in unread if getattr(run, name) != fields[name].default]
    if not changed:
        return None
    return f"{off} leaves {', '.join(changed)} unread: drop {'it' if len(changed) == 1 else 'them'} or {off}"


def check_before_launch(job: Job, world: int) -> None:
    """The rules between options, then validate against the world that will run; for train also the text, the
    checkpoint folder and the checkpoint to resume: a ValueError (exit 2) before any rank starts."""
    cfg = job.cfg
    train = job.train
    run = job.run
    broken = [message for wrong, message in (
        (cfg.tie_embeddings, f"--model {job.model} ties its LM head to the embedding: 09 trains them apart "
                             f"(01's GPT ties; plan prices it)"),
        (train.bf16_optimizer and not train.mixed_precision,
         "--bf16-optimizer keeps AdamW's state in the bf16 of mixed precision: add --bf16"),
        (train.fp32_grads and not train.mixed_precision,
         "--fp32-grads adds mixed precision's bf16 gradients into fp32: add --bf16"),
        (train.attention == "cudnn", "--attention cudnn is plan's price of SDPA's cuDNN backend: train and "
                                     "check run sdpa or flash"),
        (train.attention == "unfused", "--attention unfused is plan's price of PyTorch's eager attention: "
                                       "train and check run sdpa or flash"),
        (train.attention_dropout, "--attention-dropout is plan's price of Megatron's dropout of the "
                                  "attention probabilities: 01's model has no dropout"),
        (train.recompute == "whole",
         "--recompute whole is plan's price of a reentrant checkpoint (Megatron's): train and check run "
         "full, which keeps the same tensors and stops its rerun at down_proj's input")) if wrong]
    broken += () if job.command != "train" else [message for wrong, message in (
        (cfg.vocab_size < 256,
         f"train reads bytes: a vocabulary of {cfg.vocab_size} cannot hold them (--vocab)"),
        (run.sample_bytes and cfg.vocab_size != 256 and run.folder is not None,
         f"the sample decodes bytes: a vocabulary of {cfg.vocab_size} is not 256 "
         f"(--vocab 256, or --no-sample)"),
        (run.resume not in (None, "latest") and not run.resume.isdigit(),
         f"--resume takes the step of a kept checkpoint (a number), not {run.resume!r}"),
        (run.trace is not None and not run.profile,
         "--trace writes --profile's trace: give --profile STEPS too"),
        (run.profile and run.steps < run.profile + 2,  # it profiled fewer, saying nothing
         f"--profile {run.profile} needs --steps >= {run.profile + 2} (the first two compile and measure), "
         f"not {run.steps}"),
        (run.sample_bytes and run.prompt == "",
         "--prompt must not be empty: the sample continues it (--no-sample: no sample)"),
        (run.folder == "", "--checkpoint-dir must name a folder (--no-save: no checkpoints)")) if wrong]
    if job.command == "train" and (unread := unread_run_options(run)):
        broken.append(unread)
    if broken:
        raise ValueError(broken[0])
    sizes = job.sizes
    validate(cfg, sizes, train, world)
    if not torch.cuda.is_available():  # the ranks share this machine: the plan's tensors of them all must fit
        need = sum(r.total - r.memory["fragmentation"] - r.memory["cuda_nccl"]
                   for r in plan(cfg, sizes, train))
        experts = f" --moe --experts {train.moe.n_experts}" if train.moe else ""  # the parameters: theirs
        batch = f"--global-batch {train.global_batch} x --seq-len {train.seq_len}"
        foundation.check_memory(cfg, train.global_batch, train.seq_len, world, {
            "09's plan of the tensors (a GPU's allowances aside)": int(need * world // sizes.pp)},
            f"--model {job.model}{experts} with {batch}", weights=False)  # the plan's tensors hold them
    if job.command == "check":
        return
    if run.data is not None and Path(run.data).is_file():  # read whole (its bytes, then a copy) by each rank
        read = {"its bytes and their copy in each rank and here": 2 * (world + 1) * os.path.getsize(run.data)}
        foundation.check_memory(None, 0, 0, world, read, f"--data {run.data}")
    train_tokens, _ = split_tokens(read_tokens(run.data), train.seq_len, train.global_batch)
    if run.trace is not None:  # written by rank 0 after the profiled steps: a bad path strands the others
        pipeline.check_writable("--trace", run.trace)
    if run.resume and run.folder is None:
        raise ValueError("--resume reads the checkpoint folder that --no-save turns off: drop --no-save")
    if run.resume and not os.path.isdir(run.folder):  # refused before claim_folder would make it
        raise ValueError(f"--resume: checkpoint folder {run.folder} does not exist "
                         f"(a new run: drop --resume)")
    if run.folder is not None and not run.resume and os.path.isdir(run.folder):  # a new run saves over none
        latest = zero.latest_checkpoint(run.folder)  # a save LATEST names, even damaged, was finished
        earlier = sorted(p.name for p in Path(run.folder).glob("step_*")
                         if zero.step_of(p) is not None and ((p / "meta.json").is_file() or p == latest))
        if earlier:
            more = f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
            raise ValueError(f"checkpoint folder {run.folder} holds an earlier run's checkpoints "
                             f"({', '.join(earlier[-3:])}{more}): --resume continues that run; a new run "
                             f"needs a new or empty folder (it removes no save it did not write)")
    if run.folder is not None and "RANK" not in os.environ:  # under torchrun, rank 0 locks (train_run)
        zero.claim_folder(run.folder).close()  # refused: a file, unwritable, held, holding a user's files
    if run.resume:  # damaged, another model, other data: refused before any rank starts
        _, meta = zero.open_checkpoint(run.folder, cfg, run.resume_step, checksums=False,
                                       resume_command=resume_command)  # the ranks hash
        loader = ShardedLoader(train_tokens, train.seq_len, train.global_batch, seed=run.seed)
        loader.load_state_dict(meta["loader"])


def print_report(report: str) -> None:
    """The plan on stdout; a reader that stops early (`plan | head`) closes the pipe: not an error."""
    try:
        print(report, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flushes nothing more


def main() -> None:
    # each option's rule: one line, exit 2
    parser, args = foundation.parse_options(__doc__, OPTIONS, COMMANDS, aliases=MODEL_ALIASES)
    try:
        job = configure(args)
        if job.command == "plan":  # plan builds nothing, starts no rank
            report, fits = plan_report(job)
    except ValueError as error:
        parser.refuse(error)
    if job.command == "plan":
        if foundation.prints_here():  # under torchrun, rank 0 alone prints
            print_report(report)
        sys.exit(0 if fits else 1)  # a plan that does not fit: exit 1, as grep's "not found"
    program = check_run if job.command == "check" else train_run
    foundation.launch_lesson(parser, job, program, rules=[functools.partial(check_before_launch, job)])


if __name__ == "__main__":
    main()
