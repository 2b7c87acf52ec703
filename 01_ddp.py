"""Lesson 01: data parallelism, and the foundation every later lesson stands on.

The lesson first (data parallelism, its training loop, its demo), then THE FOUNDATION that lessons
02-09 import, in the order they need it. The parts, in order:
  Data parallelism: broadcast_parameters; (a) all_reduce_gradients; (b, c) GradBucket, BucketedDataParallel
    and its hooks' weak_hook (which 02 reuses)
  Training: TrainResult; train_single_device (the reference every lesson equals), train_data_parallel;
    accumulate_microbatches and mean_over_ranks, the loop's two pieces later lessons reuse
  RUN IT: demo (every version beside one device), bench (against torch's DDP)
THE FOUNDATION (line ~475 on: read it once the lesson is clear, or from 02 on)
  Devices and launch: init_distributed, launch (plain python starts its ranks as torchrun would),
    exit_distributed, counted, check_memory; median_of, interleaved_medians and ratio_line (--bench's timing)
  The comm meter: ring_traffic (the textbook formula), CommMeter, comm_meter; the wrappers all_reduce ...
    batch_p2p, all_ranks
  The reference model: ModelConfig, GPT (Llama-style, grouped-query attention), synthetic_batch
  Options: option (a dataclass field that is also an option, its rule beside it), parse_options,
    launch_lesson (the sizes' rules, then the ranks); then 01's own command line: Options, main

THE IDEA
Every rank holds a full copy of the model and takes a different, equal-sized slice of the global
batch. After backward each rank has the gradient of *its* mean loss; their average over the N ranks
is exactly the gradient of the global batch's mean loss, so one all-reduce(SUM) / N per gradient
makes every rank take the step a single device would take on the whole batch. Parameters stay
identical: they start identical (broadcast from rank 0) and every rank applies the same update.

THREE VERSIONS, in the order a student meets them
(a) naive: after backward, all-reduce every gradient, one call per parameter. Correct, but the
    network idles during backward and many small messages pay latency many times.
(b) bucketed with overlap: gradients are packed into fixed-size flat buckets in reverse registration
    order (roughly the order backward produces them). A post-accumulate-grad hook copies each
    gradient into its bucket; a full bucket's all-reduce is launched at once, asynchronously, so the
    last layers communicate while backward still computes the first; all is waited on at the step.
(c) gradient accumulation: K micro-steps per optimizer step; gradients accumulate locally in .grad
    and only the last micro-step's backward communicates: the same bytes per optimizer step as
    without accumulation, amortised over K times more compute.

COST
A ring all-reduce of S bytes sends (and receives) 2(N-1)/N x S bytes per rank: a reduce-scatter
((N-1)/N x S) then an all-gather ((N-1)/N x S). DDP moves 2(N-1)/N x gradient bytes per optimizer
step, independent of batch size. Memory: every rank holds all parameters, gradients and optimizer
state (AdamW in fp32: 4 + 4 + 8 = 16 bytes per parameter), plus a gradient copy in the buckets.
Lesson 02 (ZeRO) removes that redundancy.

RUN IT
    python 01_ddp.py                       # 4 local CPU processes (one per GPU on a GPU node)
    torchrun --nproc_per_node=4 01_ddp.py  # the same under torchrun
    python 01_ddp.py --bench               # step time against torch's DistributedDataParallel
Look at: the max |difference| from one process training on the whole batch: ~1e-8 on gradients (the
same sums in another order), a few 1e-6 on parameters (Adam divides each gradient by its own size,
magnifying rounding on gradients near 1e-9); the all-reduced bytes beside 2(N-1)/N x gradient bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import difflib
import functools
import math
import operator
import os
import re
import shlex
import signal
import statistics
import sys
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm


# --- Data parallelism ---------------------------------------------------------------------------------------
def broadcast_parameters(model: nn.Module, group=None) -> None:
    """Start every rank from rank 0's weights and buffers: a checkpoint or a random init might differ."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            broadcast(tensor, src=0, group=group)


def all_reduce_gradients(model: nn.Module, group=None) -> None:
    """(a) Naive DDP: one blocking all-reduce per parameter, after backward has finished."""
    world = dist.get_world_size(group)
    for name, param in model.named_parameters():
        if not param.requires_grad:  # frozen: no gradient to average (as in torch DDP)
            continue
        if param.grad is None:  # skipping it would pair different tensors across ranks
            raise RuntimeError(f"{name} got no gradient: unused parameters are not supported")
        all_reduce(param.grad, group=group)
        param.grad.div_(world)


class GradBucket:
    """A flat buffer holding the gradients of a few parameters, all-reduced in one call."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.buffer = params[0].new_zeros(sum(p.numel() for p in params))  # their dtype and device
        self.views = self.buffer.split([p.numel() for p in params])  # slot i holds params[i]'s grad
        self.slot = {p: i for i, p in enumerate(params)}
        self.ready: set[int] = set()  # the slots filled since the last unpack
        self.work = None  # the pending all-reduce

    def add(self, param: nn.Parameter) -> None:
        if self.work is not None:
            raise RuntimeError("a second backward outside no_sync() before finish_gradient_sync() "
                               "would overwrite a bucket that is still being all-reduced")
        self.views[self.slot[param]].copy_(param.grad.flatten())
        self.ready.add(self.slot[param])

    def unpack(self, world: int) -> None:
        """Wait for the all-reduce, then write the averaged gradients back into param.grad."""
        self.work.wait()
        self.buffer.div_(world)
        for p, view in zip(self.params, self.views):
            p.grad.copy_(view.view_as(p))
        self.ready.clear()
        self.work = None


def claim_gradient_sync(model: nn.Module, owner: str) -> None:
    """Mark `model`'s gradients as synchronised by `owner`. A second wrapper (a re-run notebook cell,
    ZeRO over a DDP-wrapped model) would reduce every gradient twice: refused when built."""
    current = getattr(model, "gradient_sync_owner", None)
    if current is not None:
        raise ValueError(f"cannot wrap with {owner}: this model's gradients are already "
                         f"synchronised by {current}; build one wrapper per model")
    model.gradient_sync_owner = owner


def weak_hook(method: Callable, *args) -> Callable:
    """A hook that calls method(*args, *what torch passes it) while method's object lives, and does nothing
    once it is gone. torch keeps hooks in C++, out of the garbage collector's sight, so a cycle through one is
    never collected: a hook holding its wrapper (parameter, hook, wrapper, model, parameter) would keep the
    wrapper, its model and its process group alive until the process exits. So it holds the wrapper weakly,
    and args are plain values (indices, not units of parameters, which would close the cycle again)."""
    weak_method = weakref.WeakMethod(method)

    def hook(*passed):
        bound = weak_method()
        if bound is not None:  # None: the wrapper is gone, and with it what the hook would do
            return bound(*args, *passed)

    return hook


class BucketedDataParallel:
    """(b) + (c): bucketed, overlapped gradient all-reduce, with no_sync() for accumulation.

        ddp = BucketedDataParallel(model, group, bucket_bytes=1 << 20)
        with ddp.no_sync():                  # micro-steps 1..K-1: accumulate locally
            model(x, y).backward()
        model(x, y).backward()               # last micro-step: buckets launch during backward
        ddp.finish_gradient_sync()           # wait, average, write back; then optimizer.step()
    """

    def __init__(self, model: nn.Module, group=None, bucket_bytes: int = 25 << 20) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
        params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameter (requires_grad=True) to synchronise")
        claim_gradient_sync(model, type(self).__name__)  # after the checks: a failed build claims nothing
        self.model = model
        self.group = group
        self.world = dist.get_world_size(group)
        broadcast_parameters(model, group)
        groups: list[list[nn.Parameter]] = [[]]
        for p in params:
            if groups[-1] and (p.dtype != groups[-1][0].dtype or
                               sum(q.nbytes for q in groups[-1]) + p.nbytes > bucket_bytes):
                groups.append([])
            groups[-1].append(p)
        self.buckets = [GradBucket(group_params) for group_params in groups]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.sync_gradients = True
        self.next_to_launch = 0
        self.max_in_flight = self.finished_before_wait = 0  # statistics for the demo
        for p in params:
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync_gradients = False
        try:
            yield
        finally:
            self.sync_gradients = True

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_gradients:
            return
        self.bucket_of[param].add(param)
        # Collectives are matched by call order, so every rank must launch buckets in the same
        # order: launch bucket i only after buckets 0..i-1, even if it happened to fill first.
        for bucket in self.buckets[self.next_to_launch:]:
            if len(bucket.ready) < len(bucket.params):
                break
            bucket.work = all_reduce(bucket.buffer, group=self.group, async_op=True)
            self.next_to_launch += 1
            in_flight = sum(b.work is not None and not b.work.is_completed() for b in self.buckets)
            self.max_in_flight = max(self.max_in_flight, in_flight)

    def finish_gradient_sync(self) -> None:
        if not any(b.ready for b in self.buckets):
            raise RuntimeError("no gradient reached the buckets: the last backward of a step must "
                               "run outside no_sync()")
        if self.next_to_launch != len(self.buckets):
            missing = [name for name, p in self.model.named_parameters() if p in self.bucket_of
                       and self.bucket_of[p].slot[p] not in self.bucket_of[p].ready]
            raise RuntimeError(f"parameters got no gradient this step (unused parameters are not "
                               f"supported): {missing[:5]}")
        self.finished_before_wait = sum(b.work.is_completed() for b in self.buckets)
        for bucket in self.buckets:
            bucket.unpack(self.world)
        self.next_to_launch = 0


# --- Training: the single-device reference and the data-parallel run, on the same global batches ------------
DP_MODES = ("naive", "bucketed")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's moments


@dataclass
class TrainResult:
    losses: list[float]                   # mean loss over the global batch, per optimizer step
    first_grads: dict[str, torch.Tensor]  # averaged gradients of step 0, before the update
    params: dict[str, torch.Tensor]       # parameters after the last step
    stats: dict[str, int] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)  # global norm before clipping, per step
    state: dict = field(default_factory=dict)               # params and AdamW state at the end

    def max_differences(self, reference: TrainResult) -> tuple[float, float, float]:
        """max |difference| from reference's losses, step-0 gradients and last parameters (those this
        result holds: a pipeline stage's are some of the reference's)."""
        return (max(abs(a - b) for a, b in zip(self.losses, reference.losses, strict=True)),
                max_abs_diff(reference.first_grads, self.first_grads),
                max_abs_diff(reference.params, self.params))


def make_optimizer(model: nn.Module, lr: float, eps: float = 1e-8) -> torch.optim.Optimizer:
    """AdamW's update g / (sqrt(v) + eps) magnifies a gradient's rounding error by up to 1/eps: the tests
    raise eps. Fused on a GPU: one kernel reads and writes each tensor once (foreach: ~3x the bytes)."""
    params = list(model.parameters())
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.1,
                             fused=fused or None)


def lone_token_note(seq_len: int) -> str:
    """Why a demo's last parameters part from one device's by ~lr at --seq-len 1 (empty otherwise)."""
    if seq_len != 1:
        return ""
    return ("At --seq-len 1 a token attends to itself alone, and a softmax of one score is 1 whatever the "
            "score: q_proj and\nk_proj get gradients of rounding noise (~1e-10), which AdamW scales to steps "
            "of about lr, so their\nparameters part by that noise, not by the technique.\n")


def cpu_copy(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().cpu().clone() for name, t in named}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


def train_single_device(cfg: ModelConfig, steps: int, global_batch: int, seq_len: int,
                        lr: float = 1e-3, adam_eps: float = 1e-8, max_grad_norm: float = math.inf,
                        mixed_precision: bool = False, bf16_optimizer: bool = False,
                        device: torch.device | str = "cpu",
                        transform: Callable[[nn.Module], nn.Module] | None = None,
                        progress: str | None = None) -> TrainResult:
    """The reference every lesson's parallel run must equal: one process, the whole global batch per
    step, torch's clip_grad_norm_ (its two halves: the norm of fp32 gradients, then the scaling; at inf
    it scales by exactly 1) and AdamW. mixed_precision: a bf16 model computes, AdamW updates fp32
    masters of the initial values, rounded back into the model after each step (as lesson 02's ZeRO);
    bf16_optimizer: AdamW updates the bf16 parameters themselves, its moments bf16. `transform` rewrites
    the model first (08: FP8 linears, 09: MoE MLPs; frozen parameters get no update, as in AdamW)."""
    if bf16_optimizer and not mixed_precision:  # as lesson 02's ZeRO refuses it
        raise ValueError("bf16_optimizer keeps AdamW's state in the bf16 of mixed precision's parameters: "
                         "it needs mixed_precision=True")
    model = (transform(GPT(cfg)) if transform else GPT(cfg)).to(device)
    fp32_masters = mixed_precision and not bf16_optimizer
    masters = [nn.Parameter(p.detach().clone()) if fp32_masters else p for p in model.parameters()]
    if mixed_precision:
        model.to(torch.bfloat16)
    optimizer = make_optimizer(nn.ParameterList(masters), lr, adam_eps)
    result = TrainResult([], {}, {})
    for step in tqdm(range(steps), desc=progress, disable=progress is None, leave=False):
        tokens, targets = synthetic_batch(cfg, global_batch, seq_len, step)
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        result.losses.append(loss.item())
        if step == 0:  # frozen parameters have none
            result.first_grads = cpu_copy((n, p.grad) for n, p in model.named_parameters()
                                          if p.grad is not None)
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.to(master.dtype)
        norm = nn.utils.get_total_norm([m.grad.float() for m in masters if m.grad is not None])
        nn.utils.clip_grads_with_norm_(masters, max_grad_norm, norm)
        result.grad_norms.append(norm.item())
        optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters(), strict=True):
                if master is not p:
                    p.copy_(master)
                master.grad = p.grad = None
    master = dict(zip(model.parameters(), masters))  # as state_dict(): a tied parameter under each name
    result.params = cpu_copy((n, master[p]) for n, p in model.named_parameters(remove_duplicate=False))
    adam = {n: optimizer.state[master[p]] for n, p in model.named_parameters()}
    result.state = {"params": result.params, "step": int(max(s.get("step", 0) for s in adam.values())),
                    **{key: cpu_copy((n, s[key]) for n, s in adam.items() if s) for key in ADAM_KEYS}}
    return result


def validate_data_parallel(global_batch: int, world: int, accum_steps: int, mode: str) -> None:
    """Raised identically on every rank before any collective, so no rank is left waiting."""
    if mode not in DP_MODES:
        raise ValueError(f"mode={mode!r} must be one of {DP_MODES}")
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps} must be >= 1")
    if global_batch % (world * accum_steps):
        raise ValueError(f"global_batch={global_batch} is not divisible by {counted(world, 'rank')} x "
                         f"accum_steps={accum_steps} = {world * accum_steps}")


def accumulate_microbatches(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, n: int,
                            device: torch.device | str, around: Callable | None = None) -> torch.Tensor:
    """Forward and backward of a batch in n microbatches, each loss scaled by 1/n: their gradients add
    up in .grad to the gradient of the batch's mean loss; around(i) wraps microbatch i (01's: no_sync()).
    Returns the batch's mean loss on the device (an .item() would stall a GPU every microbatch)."""
    loss = torch.zeros((), device=device)
    for i, (x, y) in enumerate(zip(tokens.chunk(n), targets.chunk(n), strict=True)):
        with around(i) if around else contextlib.nullcontext():
            part = model(x.to(device), y.to(device)) / n
            part.backward()
        loss += part.detach()
    return loss


def mean_over_ranks(values: list[torch.Tensor], group=None) -> list[float]:
    """Each value (a step's mean loss on this rank) averaged over the group's ranks, in fp64, by one
    all-reduce after the loop. Equal token counts make it the global batch's mean loss."""
    total = torch.stack(values).double()
    all_reduce(total, group=group)
    return (total / group_size(group)).tolist()


def train_data_parallel(cfg: ModelConfig, steps: int, global_batch: int, seq_len: int, *,
                        mode: str = "bucketed", accum_steps: int = 1, bucket_bytes: int = 1 << 20,
                        lr: float = 1e-3, adam_eps: float = 1e-8, group=None,
                        device: torch.device | str = "cpu") -> tuple[TrainResult, CommMeter]:
    """Train on rows [r B/N, (r+1) B/N) of train_single_device's global batches, accum_steps microbatches
    a step (accumulate_microbatches). Returns the result and a meter of the training loop's communication."""
    world = group_size(group)
    rank = dist.get_rank(group)
    validate_data_parallel(global_batch, world, accum_steps, mode)
    model = GPT(cfg).to(device)
    ddp = BucketedDataParallel(model, group, bucket_bytes) if mode == "bucketed" else None
    if ddp is None:
        broadcast_parameters(model, group)  # BucketedDataParallel does it when it is built
    optimizer = make_optimizer(model, lr, adam_eps)

    def around(micro: int) -> contextlib.AbstractContextManager:
        return ddp.no_sync() if ddp is not None and micro < accum_steps - 1 else contextlib.nullcontext()

    result = TrainResult([], {}, {})
    local_losses = []
    with comm_meter() as meter:
        for step in range(steps):
            tokens, targets = synthetic_batch(cfg, global_batch, seq_len, step, rank, world)
            local_losses.append(accumulate_microbatches(model, tokens, targets, accum_steps, device, around))
            if ddp is not None:
                ddp.finish_gradient_sync()
            else:
                all_reduce_gradients(model, group)
            if step == 0:
                result.first_grads = cpu_copy((n, p.grad) for n, p in model.named_parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result.losses = mean_over_ranks(local_losses, group)  # outside the meter: not training traffic
    result.params = cpu_copy(model.named_parameters())
    if ddp is not None:
        result.stats = dict(buckets=len(ddp.buckets), max_in_flight=ddp.max_in_flight,
                            finished_before_wait=ddp.finished_before_wait)
    return result, meter


# --- RUN IT: the demo, every version beside one device; the benchmark against torch's DDP -----------------
def demo(args: argparse.Namespace) -> None:
    device = init_distributed()
    world = dist.get_world_size()
    cfg = ModelConfig()
    bucketed = dict(mode="bucketed", bucket_bytes=args.bucket_kib << 10)
    runs = {"naive": dict(mode="naive"), "bucketed": bucketed,
            f"bucketed, accum x{args.accum}": dict(bucketed, accum_steps=args.accum)}
    results = {name: train_data_parallel(cfg, args.steps, args.global_batch, args.seq_len,
                                         device=device, **kw) for name, kw in runs.items()}
    if dist.get_rank() == 0:
        reference = train_single_device(cfg, args.steps, args.global_batch, args.seq_len, device=device)
        n_params = sum(p.numel() for p in reference.params.values())
        grad_bytes = n_params * 4
        print(f"Data parallelism on {counted(world, 'rank')} ({dist.get_backend()}, {device.type}): "
              f"{n_params:,} parameters = {grad_bytes:,} gradient bytes (fp32); global batch "
              f"{args.global_batch} x {args.seq_len} tokens, {counted(args.steps, 'AdamW step')}. Losses:\n")
        print(f"{'step':<6}" + "".join(f"{name:>24}" for name in results) + f"{'single device':>16}")
        for step in range(args.steps):
            print(f"{step:<6}" + "".join(f"{r.losses[step]:>24.6f}" for r, _ in results.values())
                  + f"{reference.losses[step]:>16.6f}")
        print(f"\n{'max |difference| from one device':>58}{'all-reduces per step':>30}\n"
              f"{'step-0 gradients':>42}{'end parameters':>18}{'calls':>8}{'traffic per rank':>20}")
        for name, (result, meter) in results.items():
            calls = meter.calls("all_reduce") // args.steps
            traffic = meter.traffic("all_reduce") / args.steps
            _, grads, params = result.max_differences(reference)
            print(f"  {name:<24}{grads:>16.2e}{params:>18.2e}{calls:>8}{float(traffic):>18,.0f} B")
        print(f"  ring formula 2(N-1)/N x gradient bytes = 2x{world - 1}/{world} x {grad_bytes:,} "
              f"= {float(ring_traffic('all_reduce', grad_bytes, world)):,.0f} B")
        stats = results["bucketed"][0].stats
        print(f"\nbucketed: {counted(stats['buckets'], 'bucket')} of <= {args.bucket_kib} KiB, all launched "
              f"from backward hooks; up to {counted(stats['max_in_flight'], 'all-reduce')} in flight at once "
              f"during backward, {stats['finished_before_wait']} already finished when backward returned.")
        print(lone_token_note(args.seq_len), end="")
        print("Notice: every version computes the single-device step, and the bytes moved per step "
              "depend on the parameter count only, not on batch size or accumulation.")
    exit_distributed()


def bench(args: argparse.Namespace) -> None:
    """Ours (bucketed, overlapped) against torch's DistributedDataParallel: same model, batch, buckets."""
    device = init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()
    cfg = ModelConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=8, ffn_dim=688)
    tokens, targets = (t.to(device) for t in synthetic_batch(cfg, 4 * world, 128, 0, rank, world))
    ours_model = GPT(cfg).to(device)
    torch_model = GPT(cfg).to(device)
    ours = BucketedDataParallel(ours_model, bucket_bytes=args.bench_bucket_mb << 20)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=args.bench_bucket_mb)
    ours_optimizer = make_optimizer(ours_model, 1e-3)
    torch_optimizer = make_optimizer(torch_model, 1e-3)

    def ours_step() -> None:
        ours_model(tokens, targets).backward()
        ours.finish_gradient_sync()
        ours_optimizer.step()
        ours_optimizer.zero_grad(set_to_none=True)

    def torch_step() -> None:
        theirs(tokens, targets).backward()  # torch DDP synchronises inside backward
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    med = interleaved_medians({"ours": ours_step, "torch DDP": torch_step}, args.bench_rounds,
                              args.bench_steps, device)
    if rank == 0:
        n_params = sum(p.numel() for p in ours_model.parameters())
        print(f"DDP step time on {counted(world, 'rank')} ({dist.get_backend()}, {device.type}), "
              f"{n_params / 1e6:.1f}M parameters, {args.bench_bucket_mb} MB buckets, "
              f"{median_of(args)}:")
        print("  " + ratio_line(med))
    exit_distributed()


# ======= THE FOUNDATION, which every later lesson imports ==================================================
# --- Devices and launch ------------------------------------------------------------------------------------
# Without a GPU, lessons 07 and 08's Triton kernels run in Triton's interpreter, which Triton picks as each
# @triton.jit function is defined: so here, in the module every lesson imports first. A process started
# with TRITON_INTERPRET=0 (tests/test_gpu_compile.py compiles for an absent GPU) keeps the compiler.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def init_distributed(timeout_s: float = 120.0) -> torch.device:
    """Join torchrun's process group and return this rank's device: with CUDA, NCCL and one GPU per local
    rank, else gloo on CPU. The timeout makes a collective some rank never joins an error."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # device_id: NCCL creates its communicators eagerly
        dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), device_id=device if cuda else None,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return device


def _launched_rank(local_rank: int, fn: Callable, args: tuple, nproc: int, port: int,
                   listening: bool) -> None:
    if listening:  # spawned deaf to Ctrl-C (launch); now torch's spawn wrapper ends a rank on it quietly
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # rank 0 too joins launch()'s store
    # Like torchrun: N processes x all cores each would oversubscribe the CPU many times over.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    # tqdm's default lock is a multiprocessing semaphore, which a spawned rank shares with no one and
    # exit_distributed's os._exit never releases ("leaked" at exit): a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    fn(*args)


def launch_world_size(nproc: int) -> int:
    """The ranks launch() runs, to validate sizes against: torchrun's WORLD_SIZE if RANK is set, else
    nproc (local processes get their own environment: a stray WORLD_SIZE does not count)."""
    if "RANK" not in os.environ:
        return nproc
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"RANK is set but {', '.join(missing)} not: a partial torchrun environment "
                         f"(run under torchrun, or unset RANK to launch "
                         f"{counted(nproc, 'local process', 'local processes')})")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        if not os.environ[name].isdigit():
            raise ValueError(f"{name}={os.environ[name]!r} is not a number: torchrun's environment, by hand?")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if rank >= world:  # its peers would never come: init_process_group would wait for them, silent
        raise ValueError(f"RANK={rank} must be below WORLD_SIZE={world}: torchrun's environment, by hand?")
    return world


# A rank's memory before any tensor: Python with torch imported and gloo joined (the most resident, measured).
LOCAL_PROCESS_BYTES = 220 << 20


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """'1 rank', '4 ranks': a count and its noun, plural (noun + s unless given) unless one."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


def check_memory(cfg: "ModelConfig | None", batch: int, seq_len: int, ranks: int,
                 more: dict[str, int] | None = None, what: str | None = None, weights: bool = True) -> None:
    """A rule of launch_lesson: refuse sizes whose largest tensors alone exceed this machine's memory. A
    lower bound: every rank draws the whole batch (synthetic_batch: 17 bytes a token) and holds the fp32
    embedding and LM head; the fp32 logits and (weights) the layers' fp32 weights exist once (cfg None: no
    model); more: other tensors' bytes."""
    what = what or f"--global-batch {batch} x --seq-len {seq_len}"
    parts = {}
    if cfg is not None:
        parts[f"the batch, embedding, LM head and logits of {counted(ranks, 'rank')}"] = (
            ranks * (17 * batch * (seq_len + 1) + 2 * 4 * cfg.vocab_size * cfg.dim)
            + 4 * batch * seq_len * cfg.vocab_size)
    if cfg is not None and weights:
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        layer = cfg.dim * (2 * cfg.dim + 2 * kv_dim) + 3 * cfg.dim * cfg.ffn_dim  # attention's 4, SwiGLU's 3
        parts[f"the fp32 weights of {counted(cfg.n_layers, 'layer')}"] = 4 * cfg.n_layers * layer
    parts.update(more or {})
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if sum(parts.values()) > memory:
        raise ValueError(f"{what} would need at least {sum(parts.values()):,} bytes ({', '.join(parts)}); "
                         f"this machine has {memory:,}")


class StopOnce:
    """launch's SIGINT and SIGTERM handler: the first signal as a KeyboardInterrupt carrying its number;
    the next ones (a second Ctrl-C, `timeout` passing one on) arrive while the ranks stop: ignored."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame) -> None:
        if not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt(signum)


def launch(fn: Callable, *args, nproc: int) -> None:
    """fn(*args) on every rank: here under torchrun, else in nproc fresh local processes given the
    environment torchrun would set (fn is pickled by name: module-level)."""
    launch_world_size(nproc)  # a partial torchrun environment fails here, not in every rank
    if "RANK" in os.environ:
        fn(*args)
        return
    # The rendezvous store is served from here, as torchrun's agent serves it, on a port the system
    # picks and this process holds: a port chosen here and bound later by rank 0 could be taken between.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # A Ctrl-C while a new rank imports torch printed its KeyboardInterrupt traceback (spawn's bootstrap
    # catches none): the ranks start with SIGINT ignored, inherited across exec, and listen once running.
    # (One in the instant of the forks is ignored here too: press again. Blocked instead, it would wait, but
    # spawn clears a child's signal mask.)
    listening = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ranks = mp.start_processes(_launched_rank, args=(fn, args, nproc, store.port, listening),
                                   nprocs=nproc, start_method="spawn", join=False)
    finally:
        signal.signal(signal.SIGINT, before)
    # `kill` sends SIGTERM, whose default would end this process alone and leave the ranks running on:
    # stop them as Ctrl-C does (launch runs in the main thread, where a signal handler may be set).
    stop = StopOnce()
    # A shell's `cmd &` starts this process with Ctrl-C ignored: it stays ignored.
    handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        while not ranks.join(grace_period=10):  # a rank fails: the others get 10 s to stop themselves
            pass
    except KeyboardInterrupt as interrupt:  # Ctrl-C (the whole process group), or a signal to this one
        for process in ranks.processes:  # SIGTERM stops a rank where it is (checkpoints are atomic)
            process.terminate()
        for process in ranks.processes:
            process.join(10)
            if process.is_alive():  # stuck in native code: no signal handler runs there
                process.kill()
                process.join()
        print(f"interrupted: the {counted(nproc, 'local rank')} stopped", file=sys.stderr)
        for signum in handlers:  # a signal arriving while this process ends: ignored, not its death
            signal.signal(signum, signal.SIG_IGN)
        signum = interrupt.args[0] if interrupt.args else signal.SIGINT  # one raised by no handler of ours
        raise SystemExit(128 + signum) from None  # as a shell reports a process a signal stopped
    except mp.ProcessExitedException as error:
        if error.exit_code > 0:  # it left through exit_distributed(error): its line says why
            raise SystemExit(error.exit_code) from None
        if error.exit_code < 0:  # a signal: SIGKILL is mostly the kernel's, out of memory (not a traceback)
            name = signal.Signals(-error.exit_code).name
            print(f"{os.path.basename(sys.argv[0])}: error: rank {error.error_index} was killed by {name}"
                  + (" (the system out of memory, most likely: smaller sizes, or fewer ranks)"
                     if -error.exit_code == signal.SIGKILL else ""), file=sys.stderr)
            raise SystemExit(128 - error.exit_code) from None
        raise
    finally:
        if not stop.stopping:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)


def exit_distributed(error: str | None = None, code: int = 2) -> None:
    """A rank's last call: leave the group, os._exit: the interpreter's teardown aborts (1 run in 5 here)
    while gloo's threads release the last tensors ("terminate called without an active exception",
    pytorch PR #179291). error: one every rank found (by a collective): each prints it, then exit `code`."""
    if error is not None:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        dist.barrier()  # every rank has printed before the first exits: the launcher then stops the rest
    # On success no rank waits for another: the launchers wait for every process that exits with 0, while
    # rank 0 alone may still run the one-device reference for longer than a collective may wait.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else code)


def median_of(args: argparse.Namespace, noun: str = "step") -> str:
    """--bench's heading: 'median of 10 steps', those timed (BenchRounds: the first round warms up)."""
    return f"median of {counted(args.bench_steps * (args.bench_rounds - 1), noun)}"


def interleaved_medians(steps: dict[str, Callable[[], None]], rounds: int, steps_per_round: int,
                        device: torch.device) -> dict[str, float]:
    """--bench's timing: each named step's median seconds over `rounds` rounds taking turns (ours,
    PyTorch's, ours...) so both see the same load; the first round warms up (allocator, compilation,
    autotuning) and is dropped. Each call starts at a barrier: timed as its slowest rank ends."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds):
        for name, step_fn in steps.items():
            for _ in range(steps_per_round):
                dist.barrier()
                start = time.perf_counter()
                step_fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_ > 0:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def ratio_line(medians: dict[str, float]) -> str:
    """--bench's verdict, ours first: "ours 12.3 ms, torch DDP 10.1 ms, ratio ours / torch DDP = 1.218"."""
    (ours, mine), (theirs, other) = medians.items()
    return (f"{ours} {mine * 1e3:.1f} ms, {theirs} {other * 1e3:.1f} ms, "
            f"ratio {ours} / {theirs} = {mine / other:.3f}")


# --- The comm meter: every collective in the course goes through these wrappers -----------------------------
# A meter counts, per (operation, group), the calls, the payload (the tensor handed to the collective) and
# the traffic: what one rank sends under the textbook algorithm (each wrapper says which), a Fraction so
# that "measured == formula" holds exactly. Scoped, not global: `with comm_meter() as meter: step()`.
def ring_traffic(op: str, nbytes: int | Fraction, n: int) -> Fraction:
    """The bytes one of n ranks sends in a ring `op` of nbytes (which tensor's: each wrapper says): n - 1 of
    the n chunks per pass (COST). The course's one ring formula: wrappers meter, lessons predict with it."""
    passes = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op]
    return passes * Fraction(n - 1, n) * nbytes


ANY_GROUP = object()


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    traffic_bytes: Fraction = Fraction(0)


class CommMeter:
    def __init__(self) -> None:
        self.stats: dict[tuple[str, tuple[int, ...]], OpStats] = defaultdict(OpStats)

    # Queries: op=None sums over operations, group=ANY_GROUP over groups. A group is a process group
    # (None: the world, as in the wrappers) or a tuple of global ranks (usable off the ranks, too).
    def _select(self, op: str | None, group) -> list[OpStats]:
        ranks = None if group is ANY_GROUP else group if isinstance(group, tuple) else group_ranks(group)
        return [s for (o, r), s in self.stats.items()
                if (op is None or o == op) and (ranks is None or r == ranks)]

    def calls(self, op: str | None = None, group=ANY_GROUP) -> int:
        return sum(s.calls for s in self._select(op, group))

    def payload(self, op: str | None = None, group=ANY_GROUP) -> int:
        return sum(s.payload_bytes for s in self._select(op, group))

    def traffic(self, op: str | None = None, group=ANY_GROUP) -> Fraction:
        return sum((s.traffic_bytes for s in self._select(op, group)), Fraction(0))

    def __iadd__(self, other: CommMeter) -> CommMeter:
        """meter += other: other's counts added to meter's (a run's meter from its steps' meters)."""
        for key, stats in other.stats.items():
            self.stats[key].calls += stats.calls
            self.stats[key].payload_bytes += stats.payload_bytes
            self.stats[key].traffic_bytes += stats.traffic_bytes
        return self


_active_meters: list[CommMeter] = []


@contextlib.contextmanager
def comm_meter() -> Iterator[CommMeter]:
    meter = CommMeter()
    _active_meters.append(meter)
    try:
        yield meter
    finally:
        _active_meters.remove(meter)


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _record(op: str, group, payload: int, traffic: Fraction) -> None:
    for meter in _active_meters:
        entry = meter.stats[(op, group_ranks(group))]
        entry.calls += 1
        entry.payload_bytes += payload
        entry.traffic_bytes += traffic


def group_size(group) -> int:
    """The group's size, after checking that this rank belongs to it (torch would silently skip)."""
    if dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in the group of ranks {list(group_ranks(group))}")
    return dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In place. Ring cost: reduce-scatter then all-gather, 2(N-1)/N x size per rank."""
    _record("all_reduce", group, tensor.nbytes, ring_traffic("all_reduce", tensor.nbytes, group_size(group)))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for *_single, which 2.11 lacks.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """output = the N inputs concatenated along dim 0. Ring cost: (N-1)/N x output size per rank."""
    _record("all_gather", group, output.nbytes, ring_traffic("all_gather", output.nbytes, group_size(group)))
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                   async_op: bool = False):
    """output = this rank's 1/N chunk (dim 0) of the sum of inputs. Ring: (N-1)/N x input size."""
    traffic = ring_traffic("reduce_scatter", input.nbytes, group_size(group))
    _record("reduce_scatter", group, input.nbytes, traffic)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, group=None, async_op: bool = False):
    """Rank i sends input rows input_splits[j] to rank j. Traffic: what leaves this rank."""
    n = group_size(group)  # also: this rank is in the group
    row_bytes = input.nbytes // max(input.shape[0], 1)
    kept_rows = input.shape[0] // n if input_splits is None else input_splits[dist.get_rank(group)]
    _record("all_to_all", group, input.nbytes, Fraction(input.nbytes - kept_rows * row_bytes))
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """src is the rank *within the group*, so callers never need global ranks. Traffic: S per rank,
    as in a pipelined chain where each rank forwards what it receives."""
    group_size(group)
    _record("broadcast", group, tensor.nbytes, Fraction(tensor.nbytes))
    return dist.broadcast(tensor, group=group, async_op=async_op, group_src=src)


def all_ranks(obj: object, group=None, dst: int | None = None) -> list | None:
    """Every rank's obj, in rank order, on every rank of group (an all-gather: it also waits for all);
    with dst (a rank within group), there only, None elsewhere. Python objects, pickled and not metered:
    the demos' rows of figures and the ranks' agreements, not training traffic."""
    objects = [None] * group_size(group)
    if dst is None:
        dist.all_gather_object(objects, obj, group=group)
        return objects
    here = dist.get_rank(group) == dst
    dist.gather_object(obj, objects if here else None, group=group, group_dst=dst)
    return objects if here else None


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], group=None) -> list:
    """Point-to-point: ops are ("send" | "recv", tensor, peer rank within the group); returns a work to wait
    on for each op (NCCL coalesces a batch into one work: it stands for each). Launched together, a ring
    exchange cannot deadlock as blocking send-then-recv on each rank would. Traffic: what a rank sends."""
    group_size(group)
    p2p_ops = []
    for kind, tensor, peer in ops:
        fn = {"send": dist.isend, "recv": dist.irecv}[kind]  # any other kind: a KeyError naming it
        _record(kind, group, tensor.nbytes, Fraction(tensor.nbytes if kind == "send" else 0))
        p2p_ops.append(dist.P2POp(fn, tensor, group=group, group_peer=peer))
    if not p2p_ops:
        return []
    works = dist.batch_isend_irecv(p2p_ops)
    if len(works) == 1:
        return works * len(p2p_ops)
    return works


# --- The reference model: a small Llama-style decoder that every later lesson transforms --------------------
# A config.json's sizes past these are refused (a typo, or a model 80x deeper or 4x wider than any published:
# Llama 3 405B has 126 layers, vocabularies reach 262,144); within them 09's plan answers in seconds.
MAX_LAYERS = 10_000
MAX_WIDTH = 1_000_000
HF_DEFAULTS = {  # transformers' LlamaConfig, MistralConfig, MixtralConfig: a key config.json lacks
    "llama": dict(rms_norm_eps=1e-6, rope_theta=1e4),
    "mistral": dict(num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1e4, sliding_window=4096),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8,
                    num_experts_per_tok=2),
}
HF_KEYS = frozenset({"model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "num_hidden_layers", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
                     "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "head_dim",
                     "sliding_window", "num_local_experts", "num_experts_per_tok"})  # what from_hf reads


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention (Llama 3); None means n_heads
    ffn_dim: int = 176  # SwiGLU hidden size, ~8/3 x dim
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0
    tie_embeddings: bool = False  # the LM head is the embedding (Llama 3.2): one parameter, two uses

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)  # frozen: set once, here
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, config: dict, seq_len: int) -> tuple["ModelConfig", tuple[int, int] | None]:
        """A Hugging Face config.json (a dict) as a ModelConfig, and (experts, top-k) of a Mixtral MoE, or
        None, read as transformers reads it (HF_DEFAULTS; null K/V heads are the heads, a null tie or window
        none). Refused, naming the field: another model_type, a key unread but close to one missing (a
        misspelling: transformers would ignore it and take a default), what GPT lacks (a window as long as the
        run's seq_len is full attention), a size not positive or past its bound; rope_scaling unread."""
        defaults = HF_DEFAULTS.get(config.get("model_type"))
        if defaults is None:
            raise ValueError(f"model_type={config.get('model_type')!r} is not llama, mistral or mixtral")
        for key in sorted(config.keys() - HF_KEYS):
            near = difflib.get_close_matches(key, HF_KEYS - config.keys(), n=1, cutoff=0.8)
            if near:
                raise ValueError(f"{key}: transformers reads no such key; is it {near[0]}, which the file "
                                 f"lacks?")

        def read(key: str, kind: type | tuple = int, default=None, most: float = MAX_WIDTH):
            value = config[key] if key in config else defaults.get(key, default)
            value = default if value is None else value
            if not (isinstance(value, bool) if kind is bool else isinstance(value, kind)
                    and not isinstance(value, bool) and 0 < value < math.inf):
                must = {int: "a positive integer", bool: "true or false"}.get(kind, "a positive number")
                raise ValueError(f"{key}={value!r}: " + ("missing" if value is None else f"must be {must}"))
            if value > most:
                shown = f"{value:,}" if value < 1e18 else f"~10^{len(str(value)) - 1}"
                raise ValueError(f"{key}={shown} is past the bound of {most:,} (beyond any published model)")
            return value
        dim = read("hidden_size")
        heads = read("num_attention_heads")
        lacks = dict(hidden_act=lambda v: v not in ("silu", "swish"), attention_bias=bool, mlp_bias=bool,
                     head_dim=lambda v: v not in (None, dim / heads))
        for key in (key for key, wrong in lacks.items() if key in config and wrong(config[key])):
            raise ValueError(f"{key}={config[key]!r}: a feature 01's GPT (a plain Llama) lacks")
        window = config["sliding_window"] if "sliding_window" in config else defaults.get("sliding_window")
        if window is not None and not (type(window) is int and window >= seq_len):
            given = "" if "sliding_window" in config else " (its default)"
            raise ValueError(f"sliding_window={window!r}{given}: attention within a window shorter than the "
                             f"run's seq_len {seq_len:,} is a feature 01's GPT (a plain Llama) lacks")
        vocab, ffn = map(read, ("vocab_size", "intermediate_size"))
        layers = read("num_hidden_layers", most=MAX_LAYERS)
        theta = read("rope_theta", (int, float), most=math.inf)
        eps = read("rms_norm_eps", (int, float), most=math.inf)
        mixtral = config["model_type"] == "mixtral"
        moe = (read("num_local_experts"), read("num_experts_per_tok")) if mixtral else None
        return cls(vocab, dim, layers, heads, read("num_key_value_heads", default=heads), ffn, theta, eps,
                   tie_embeddings=read("tie_word_embeddings", bool, False)), moe


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference attention, causal: q (batch, heads, seq, head_dim), k and v (batch, kv_heads,
    seq, head_dim) -> q's shape. With grouped-query attention (kv_heads < heads) query head i reads
    K/V head i // (heads / kv_heads): SDPA's enable_gqa groups them, building no repeated K/V. GPT
    calls any function of this signature: lesson 05's ring attention, lesson 07's Triton kernel."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq, head_dim/2). Positions are explicit so that a
    context-parallel rank holding tokens 96..127 (or a zigzag of chunks) rotates them correctly."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions.float()[:, None] * (theta ** -exponents)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x (batch, seq, heads, head_dim) by its angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def linears_of(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(linear(x) for linear in linears)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_fn: Callable) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_fn = attn_fn
        self.project = linears_of

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, self.q_proj, self.k_proj, self.v_proj)
        # -1 heads, not cfg.n_heads: after tensor parallelism a rank holds only its share of heads.
        q = apply_rope(q.unflatten(-1, (-1, self.head_dim)), cos, sin)
        k = apply_rope(k.unflatten(-1, (-1, self.head_dim)), cos, sin)
        v = v.unflatten(-1, (-1, self.head_dim))
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out_proj(out.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.project = linears_of
        self.gated = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.gated(gate, up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_fn: Callable) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, attn_fn)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)  # lesson 06 replaces this with a mixture of experts

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference loss: mean cross-entropy over every token, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(nn.Module):
    """embed -> n_layers x Block -> norm -> lm_head (untied unless cfg.tie_embeddings) -> loss_fn.

    Hooks for the transformations of later lessons, each a no-op on the reference model:
    - layers is a ModuleDict keyed "0", "1", ...: a pipeline stage's layers keep the reference's names;
    - a model whose embed is None starts from hidden states, one whose lm_head is None returns them
      (a pipeline stage sets the modules it does not own to None);
    - loss_fn(logits, targets) is an attribute: vocab-parallel cross-entropy replaces it;
    - each block's projections of one input are one call (project), SwiGLU's activation an attribute
      (gated): lesson 03 keeps less for backward, 08 casts an input to FP8 once."""

    def __init__(self, cfg: ModelConfig, attn_fn: Callable = causal_attention,
                 loss_fn: Callable = cross_entropy_loss) -> None:
        super().__init__()
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, attn_fn) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one parameter: its gradient sums both uses (02 and 03 keep the tie)
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic from cfg.seed and identical on every device: values are drawn on the CPU
        in registration order. Residual-branch outputs get std / sqrt(2 n_layers) (GPT-2)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            residual = name.endswith(("out_proj.weight", "down_proj.weight"))
            std = self.cfg.init_std / (math.sqrt(2 * self.cfg.n_layers) if residual else 1)
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab), or the loss given targets; positions: (seq,)."""
        h = self.embed(tokens) if self.embed is not None else tokens
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.lm_head is None:
            return h
        logits = self.lm_head(self.norm(h))
        return logits if targets is None else self.loss_fn(logits, targets)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape in GPT(cfg), in registration order, without building it
    (lesson 09's plan prices models far too big for this machine)."""
    d = cfg.dim
    kv = cfg.n_kv_heads * cfg.head_dim
    f = cfg.ffn_dim
    layer = {"attn_norm.weight": (d,), "attn.q_proj.weight": (d, d), "attn.k_proj.weight": (kv, d),
             "attn.v_proj.weight": (kv, d), "attn.out_proj.weight": (d, d), "mlp_norm.weight": (d,),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    return {"embed.weight": (cfg.vocab_size, d),
            **{f"layers.{i}.{name}": shape for i in range(cfg.n_layers) for name, shape in layer.items()},
            "norm.weight": (d,), **({} if cfg.tie_embeddings else {"lm_head.weight": (cfg.vocab_size, d)})}


def synthetic_batch(cfg: ModelConfig, global_batch: int, seq_len: int, step: int, rank: int = 0,
                    world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets): rows [rank*b, (rank+1)*b), b = B / N, of this step's global batch, which every rank
    draws whole, so a parallel run's data is the single-device run's by construction. The text is learnable:
    each next token follows a fixed random bigram table 3 times in 4, else it is uniform noise."""
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global_batch={global_batch} and seq_len={seq_len} must be >= 1")
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by world_size={world_size}")
    table = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(step + 1)
    seq = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(cfg.vocab_size, (global_batch,), generator=gen)
    noise = torch.randint(cfg.vocab_size, (global_batch, seq_len), generator=gen)
    follow = torch.rand(global_batch, seq_len, generator=gen) < 0.75
    for t in range(seq_len):
        seq[:, t + 1] = torch.where(follow[:, t], table[seq[:, t]], noise[:, t])
    rows = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    return seq[rows, :-1], seq[rows, 1:]


# --- Options: every lesson's command line is made from dataclass fields, each with its help and rule --------
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}  # NaN breaks every rule


def option(default, help: str, rule: str | tuple[str, ...] = (), commands: tuple[str, ...] | None = None,
           **argparse_kwargs):
    """A dataclass field that is also the option --field-name (of these sub-commands; None: of all).
    rule: ">= 1", "> 0", "<= 128", or several; argparse_kwargs: option="--other-name", choices, type,
    metavar, nargs, const, and off=(flag, value, help): a second option that sets the field to value."""
    return field(default=default, metadata=dict(help=help, rules=(rule,) if isinstance(rule, str) else rule,
                                                 commands=commands, argparse=argparse_kwargs))


def flag(option_field) -> str:
    return option_field.metadata["argparse"].get("option", "--" + option_field.name.replace("_", "-"))


def option_fields(classes: tuple[type, ...], command: str | None = None) -> list:
    found = (f for cls in classes for f in dataclasses.fields(cls) if "help" in f.metadata)
    return [f for f in found if f.metadata["commands"] is None or command in f.metadata["commands"]]


def broken_rules(values, fields: list, flagged: bool = False) -> list[str]:
    """The rules and choices beside these fields that values (a config, or the parsed options, where
    None is left to other options) break, each naming the field (flagged: its option) and value."""
    out = []
    for f in (f for f in fields if "help" in f.metadata):
        value = getattr(values, f.name)
        choices = f.metadata["argparse"].get("choices")
        for v in [] if value is None else value if isinstance(value, (list, tuple)) else [value]:
            broken = [r for r in f.metadata["rules"] if not COMPARE[r.split()[0]](v, float(r.split()[1]))]
            if broken or (choices is not None and v not in choices):
                must = "must be " + (broken[0] if broken else f"one of {tuple(choices)}")
                out.append(f"{flag(f)} {must}, not {v}" if flagged else f"{f.name}={value!r} {must}")
                break
    return out


def prints_here() -> bool:
    """Under torchrun every rank runs main(): rank 0 alone prints what is said once (the help, an
    option's error, 09's plan). A RANK torchrun did not set (left in a shell) silences nothing."""
    return os.environ.get("RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ


def as_typed(option_flag: str, field_value: re.Match) -> str:
    """A rule's field=value as the reader would type it: --option value, quoted where the shell needs it."""
    quoted, bare = field_value.groups()
    return f"{option_flag} {shlex.quote(bare if quoted is None else quoted)}"


class LessonParser(argparse.ArgumentParser):
    """Every rank parses alike and exits alike (2 on an error), printing only where prints_here(); no
    abbreviations (a misspelt option is an error, not a guess)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(allow_abbrev=False, **kwargs)
        self.flags: dict[str, str] = {}  # a field's name -> its option (parse_options fills it)

    def _print_message(self, message: str, file=None) -> None:
        if prints_here():
            super()._print_message(message, file)

    def refuse(self, error: Exception) -> None:
        """Exit 2 with a broken rule in one line. A rule names a field as Python does (global_batch=3); the
        reader typed its option, so each field=value of an option is said as --field-name 3 (as_typed)."""
        message = str(error)
        for name, option_flag in self.flags.items():
            field_value = rf"(?<![\w.-]){name}=(?:'([^']*)'|([^\s,;:()']+))"  # quoted, or up to a space
            message = re.sub(field_value, functools.partial(as_typed, option_flag), message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_options(parser: argparse.ArgumentParser, fields: list, defaults: dict, decided: dict) -> None:
    """One option per field: a flag for a bool, else a value of the default's type; defaults and decided:
    a Command's. --help shows each default once (not after a help text that states it)."""
    for f in fields:
        kwargs = {k: v for k, v in f.metadata["argparse"].items() if k not in ("option", "off")}
        if isinstance(f.default, bool) and "type" not in kwargs:
            kwargs["action"] = "store_true"
        elif f.default is not None:
            kwargs.setdefault("type", type(f.default[0] if isinstance(f.default, tuple) else f.default))
        default = None if f.name in decided else defaults.get(f.name, f.default)
        stated = default is None or default is False or "default" in f.metadata["help"]
        shown = decided.get(f.name, None if stated else default)
        # an option and its off flag set one field: both given, argparse refuses (else the last would win)
        options = parser.add_mutually_exclusive_group() if "off" in f.metadata["argparse"] else parser
        options.add_argument(flag(f), dest=f.name, default=default, **kwargs,
                             help=f.metadata["help"] + ("" if shown is None else f" (default: {shown})"))
        if "off" in f.metadata["argparse"]:
            name, value, text = f.metadata["argparse"]["off"]
            options.add_argument(name, dest=f.name, action="store_const", const=value, help=text)


class Command(NamedTuple):
    """A sub-command: what it does, its defaults where not the fields', its options left None (with
    what decides them), and the classes of options only it has."""
    what: str
    defaults: dict = {}
    decided: dict = {}
    classes: tuple[type, ...] = ()


def parse_options(doc: str, classes: tuple[type, ...], commands: dict[str, Command] | None = None,
                  defaults: dict = {}, argv: list[str] | None = None, aliases: dict[str, str] = {},
                  bench_reads: tuple[str, ...] = (), bench_only: tuple[str, ...] = ()
                  ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The lesson's options, one per field of classes, each checked against its rule. commands: sub-commands,
    each with the fields that name it; argv starting with none of them (nor --help) runs the first. aliases: a
    name the lesson's rules use -> the option field that sets it (n_heads -> heads), for LessonParser.refuse;
    bench_reads, bench_only: see unread_options. Returns the parser errors exit through, and the options."""
    argv = sys.argv[1:] if argv is None else argv
    parser = LessonParser(description=" ".join(doc.split("\n\n")[0].split()))
    parsers = {None: (parser, option_fields(classes))}
    if commands is None:
        add_options(parser, parsers[None][1], defaults, {})
    else:
        first = next(iter(commands))
        subparsers = parser.add_subparsers(dest="command", title=f"sub-commands (none given: {first})")
        for name, command in commands.items():
            parsers[name] = (subparsers.add_parser(name, help=command.what, description=command.what),
                             option_fields(classes + command.classes, name))
            add_options(*parsers[name], command.defaults, command.decided)
        if not argv or argv[0] not in commands and argv[0] not in ("-h", "--help"):
            argv = [first, *argv]
    args, unknown = parser.parse_known_args(argv)
    chosen, fields = parsers[getattr(args, "command", None)]
    chosen.flags = {f.name: flag(f) for f in fields}
    chosen.flags |= {name: chosen.flags[field] for name, field in aliases.items() if field in chosen.flags}
    if unknown:  # perhaps another sub-command's option: say whose
        given = unknown[0].split("=")[0]
        owners = [name for name, (p, _) in parsers.items() if name and given in p._option_string_actions]
        hint = f" ({given} is an option of {' and '.join(owners)})" if owners else ""
        if commands and not given.startswith("-"):  # a mistyped sub-command, taken for the first's argument
            hint = f" (the sub-commands: {', '.join(commands)})"
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if problems := broken_rules(args, fields, flagged=True):
        chosen.exit(2, f"{chosen.prog}: error: {problems[0]}\n")
    if unread := unread_options(chosen, argv, args, fields, bench_reads, bench_only):
        chosen.exit(2, f"{chosen.prog}: error: {unread}\n")
    return chosen, args


def unread_options(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace, fields: list,
                   bench_reads: tuple[str, ...], bench_only: tuple[str, ...]) -> str | None:
    """--bench times a workload of its own: the demo's options typed beside it (but bench_reads), or --bench's
    own (bench_*, bench_only) typed without it, would be silently ignored. What is wrong, or None."""
    names = {f.name for f in fields}
    if "bench" not in names:
        return None
    typed = {}  # field -> the option typed for it (an off flag is its field's too: --dropless)
    for word in argv:
        if word.split("=")[0] in parser._option_string_actions:
            typed[parser._option_string_actions[word.split("=")[0]].dest] = word.split("=")[0]
    bench_own = {name for name in names if name.startswith("bench_")} | set(bench_only)
    if args.bench:
        demo_only = typed.keys() - bench_own - set(bench_reads) - {"bench", "nproc"}
        unread = [typed[name] for name in sorted(demo_only)]
        said = "--bench times a workload of its own and does not read"
    else:
        unread = [typed[name] for name in sorted(typed.keys() & bench_own)]
        said = "only --bench reads"
    if not unread:
        return None
    return f"{said} {', '.join(unread)}: drop {'it' if len(unread) == 1 else 'them'}"


@dataclass
class Ranks:
    """The option of every lesson that runs on several ranks, but 09 (its mesh sets them)."""
    nproc: int = option(torch.cuda.device_count() if torch.cuda.is_available() else 4,
                        "ranks when not under torchrun", ">= 1")


@dataclass
class BenchRounds:
    """--bench's timing (interleaved_medians), beside a lesson's own --bench flag."""
    bench_steps: int = option(5, "timed steps per round", ">= 1")
    bench_rounds: int = option(3, "rounds of --bench-steps; the first warms up", ">= 2")


def launch_lesson(parser: argparse.ArgumentParser, args, fn: Callable, *, divisible: dict | None = None,
                  rules: Iterable[Callable[[int], None]] = ()) -> None:
    """The end of every lesson's main(): its size rules against the world that will run (1 for a lesson
    without --nproc), then fn(args) on every rank (here, for a lesson of one process); args: the options, or
    what a lesson made of them (09's Job). divisible: each size (by its option) the world must divide; rules:
    functions of the world (a lesson's validate_* and check_memory, their other arguments bound) that raise
    ValueError. A broken rule exits 2 (LessonParser.refuse) before any rank starts."""
    try:
        world = launch_world_size(getattr(args, "nproc", 1))  # torchrun's, where RANK is set
        if not hasattr(args, "nproc") and world > 1:
            raise ValueError(f"runs in one process: start it with python, not torchrun (WORLD_SIZE={world})")
        # One GPU a rank (init_distributed): too many for a node's GPUs fail here, not in the ranks (a
        # launcher other than torchrun may not say how many share the node: LOCAL_WORLD_SIZE, else no check).
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if "RANK" in os.environ else world
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else ranks_here
        if ranks_here > gpus:
            raise ValueError(f"{counted(ranks_here, 'rank')} on this node need a GPU each, but {gpus} "
                             f"{'is' if gpus == 1 else 'are'} visible: run at most {gpus} per node, or "
                             f"CUDA_VISIBLE_DEVICES= to run on the CPU")
        if hasattr(args, "nproc") and "RANK" not in os.environ:  # launch starts them, each importing torch
            local = counted(world, "local process", "local processes")
            processes = {f"{local} of Python and torch, {LOCAL_PROCESS_BYTES >> 20} MiB each":
                         world * LOCAL_PROCESS_BYTES}
            named = f"--nproc {world}" if isinstance(args, argparse.Namespace) else local  # 09: its mesh's
            check_memory(None, 0, 0, world, processes, what=named)
        for name, size in (divisible or {}).items():
            if size % world:
                raise ValueError(f"{name} {size} is not divisible by the {counted(world, 'rank')}")
        for rule in rules:
            rule(world)
    except ValueError as error:
        parser.refuse(error)
    if hasattr(args, "nproc"):
        launch(fn, args, nproc=args.nproc)
        return
    try:
        fn(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, as launch says it, not the traceback of where it was
        print("interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


# --- The command line of lesson 01 -------------------------------------------------------------------------
@dataclass
class Options:
    steps: int = option(5, "AdamW steps of each run and of the one-device reference", ">= 1")
    global_batch: int = option(16, "sequences per step, split over the ranks", ">= 1")
    seq_len: int = option(64, "tokens per sequence", ">= 1")
    accum: int = option(2, "micro-steps per optimizer step", ">= 1")
    bucket_kib: int = option(128, "gradient bucket size in KiB (small: several buckets)", ">= 1")
    bench: bool = option(False, "step time against torch DDP")
    bench_bucket_mb: int = option(25, "--bench: both DDPs' bucket size in MB", ">= 1")


def main() -> None:
    parser, args = parse_options(__doc__, (Options, Ranks, BenchRounds), aliases={"accum_steps": "accum"})
    if args.bench:
        launch_lesson(parser, args, bench)
        return
    batch_splits = functools.partial(validate_data_parallel, args.global_batch, accum_steps=args.accum,
                                     mode="bucketed")
    memory = functools.partial(check_memory, ModelConfig(), args.global_batch, args.seq_len)
    launch_lesson(parser, args, demo, rules=[batch_splits, memory])


if __name__ == "__main__":
    main()
