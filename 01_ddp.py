"""Lesson 01: data parallelism, and the foundation every later lesson stands on.

THE IDEA
Every rank holds a full copy of the model and takes a different slice of the global batch. After
backward each rank has the gradient of *its* mean loss; the average of those gradients over the N
ranks is exactly the gradient of the mean loss over the global batch (the slices are equal sized), so
one all-reduce(SUM) / N per gradient makes every rank take the same optimizer step as a single
device would on the whole batch. Parameters stay identical because they start identical (broadcast
from rank 0) and every rank applies the same update.

THREE VERSIONS, in the order a student meets them
(a) naive: after backward, all-reduce every gradient, one call per parameter. Correct, but the
    network idles during backward and many small messages pay latency many times.
(b) bucketed with overlap: gradients are packed into fixed-size flat buckets, in reverse
    registration order (roughly the order backward produces them). A post-accumulate-grad hook
    copies each gradient into its bucket; the moment a bucket is full its all-reduce is launched
    asynchronously, so communication for the last layers runs while backward still computes the
    first ones. Everything is waited on just before the optimizer step.
(c) gradient accumulation: K micro-steps per optimizer step; gradients accumulate locally in .grad
    and only the last micro-step's backward communicates. Communication per optimizer step is the
    same as without accumulation, so it amortises over K times more compute.

COST
A ring all-reduce of S bytes sends (and receives) 2(N-1)/N x S bytes per rank: a reduce-scatter
((N-1)/N x S) then an all-gather ((N-1)/N x S). DDP moves 2(N-1)/N x (parameter count x bytes per
gradient element) per optimizer step, independent of batch size. Memory: every rank holds all
parameters, gradients and optimizer state (for AdamW: 4 + 4 + 8 = 16 bytes per parameter in fp32),
plus one extra gradient copy in the buckets. Lesson 02 (ZeRO) removes that redundancy.

THE FOUNDATION (imported by lessons 02-09)
- init_distributed / launch: torchrun environment -> process group (NCCL + one GPU per local rank
  with CUDA, else gloo on CPU), with a timeout so a broken collective fails instead of hanging.
  `python 0X_name.py` with no torchrun starts its own local processes.
- the comm meter: thin wrappers over every collective the course uses; each call is counted with
  its payload bytes per operation and per group, and converted to per-rank traffic with the ring
  cost model above. The wrappers also hide torch 2.11 -> 2.13 API drift.
- ModelConfig / GPT: the single-device reference model (Llama-style), and synthetic_batch.

RUN IT
    python 01_ddp.py                       # 4 local CPU processes (one per GPU on a GPU node)
    torchrun --nproc_per_node=4 01_ddp.py  # the same under torchrun
    python 01_ddp.py --bench               # step time against torch.nn.parallel.DistributedDataParallel
Look at: the per-step loss, the max |parameter difference| against one process training on the
whole batch (rounding level, ~1e-6 in fp32), and the all-reduced bytes per step beside 2(N-1)/N x
gradient bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def init_distributed(timeout_s: float = 120.0) -> torch.device:
    """Join the process group described by the torchrun environment; return this rank's device.

    With CUDA: NCCL, one GPU per local rank. Without: gloo on CPU. The timeout turns a collective
    that some rank never joins into an error instead of a silent hang.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 4


def _launched_rank(local_rank: int, fn: Callable, args: tuple, nproc: int, port: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Like torchrun: N processes x all cores each would oversubscribe the CPU many times over.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    fn(*args)


def launch(fn: Callable, *args, nproc: int) -> None:
    """Run fn(*args) on every rank: directly under torchrun, else in nproc fresh local processes.

    The processes get the same environment variables torchrun would set, so fn's code cannot tell
    the difference. fn must be a module-level function (it is pickled by name).
    """
    if "RANK" in os.environ:
        fn(*args)
        return
    mp.start_processes(_launched_rank, args=(fn, args, nproc, free_port()), nprocs=nproc,
                       start_method="spawn")


# ----------------------------------------------------------------------------------------------
# The comm meter: every collective in the course goes through these wrappers
# ----------------------------------------------------------------------------------------------
# A meter counts, per (operation, group), the calls, the payload (the bytes of the tensor handed to
# the collective) and the traffic: the bytes one rank sends under the textbook algorithm (ring for
# all-reduce / all-gather / reduce-scatter, direct for all-to-all and point-to-point). Traffic is a
# Fraction so that "measured == formula" can be asserted exactly. Meters are scoped, not global:
#     with comm_meter() as meter:
#         train_step()
#     meter.traffic("all_reduce")


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    traffic_bytes: Fraction = Fraction(0)


class CommMeter:
    def __init__(self) -> None:
        self.stats: dict[tuple[str, tuple[int, ...]], OpStats] = defaultdict(OpStats)

    def record(self, op: str, group: dist.ProcessGroup | None, payload: int, traffic: Fraction) -> None:
        entry = self.stats[(op, group_ranks(group))]
        entry.calls += 1
        entry.payload_bytes += payload
        entry.traffic_bytes += traffic

    def _select(self, op: str | None, group) -> list[OpStats]:
        ranks = None if group is None else group_ranks(group)
        return [s for (o, r), s in self.stats.items()
                if (op is None or o == op) and (ranks is None or r == ranks)]

    def calls(self, op: str | None = None, group=None) -> int:
        return sum(s.calls for s in self._select(op, group))

    def payload(self, op: str | None = None, group=None) -> int:
        return sum(s.payload_bytes for s in self._select(op, group))

    def traffic(self, op: str | None = None, group=None) -> Fraction:
        return sum((s.traffic_bytes for s in self._select(op, group)), Fraction(0))

    def table(self) -> str:
        rows = [f"{'op':<15}{'group ranks':<18}{'calls':>7}{'payload B':>14}{'traffic/rank B':>16}"]
        for (op, ranks), s in sorted(self.stats.items()):
            rows.append(f"{op:<15}{str(list(ranks)):<18}{s.calls:>7}{s.payload_bytes:>14}"
                        f"{float(s.traffic_bytes):>16.0f}")
        return "\n".join(rows)


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
        meter.record(op, group, payload, traffic)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In place. Ring cost: reduce-scatter then all-gather, 2(N-1)/N x size per rank."""
    n = dist.get_world_size(group)
    _record("all_reduce", group, _nbytes(tensor), Fraction(2 * (n - 1), n) * _nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """output = the N inputs concatenated along dim 0. Ring cost: (N-1)/N x output size per rank."""
    n = dist.get_world_size(group)
    _record("all_gather", group, _nbytes(output), Fraction(n - 1, n) * _nbytes(output))
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single and deprecated the old name.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                   async_op: bool = False):
    """output = this rank's 1/N chunk (dim 0) of the sum of inputs. Ring: (N-1)/N x input size."""
    n = dist.get_world_size(group)
    _record("reduce_scatter", group, _nbytes(input), Fraction(n - 1, n) * _nbytes(input))
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, group=None, async_op: bool = False):
    """Rank i sends input rows input_splits[j] to rank j. Traffic: what leaves this rank."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    row_bytes = _nbytes(input) // max(input.shape[0], 1)
    kept_rows = input_splits[me] if input_splits is not None else input.shape[0] // n
    _record("all_to_all", group, _nbytes(input), Fraction(_nbytes(input) - kept_rows * row_bytes))
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                  async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """src is the rank *within the group* (translated here, so callers never need global ranks)."""
    _record("broadcast", group, _nbytes(tensor), Fraction(_nbytes(tensor)))
    return dist.broadcast(tensor, src=global_rank(group, src), group=group, async_op=async_op)


def global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _record("send", group, _nbytes(tensor), Fraction(_nbytes(tensor)))
    dist.send(tensor, dst=global_rank(group, dst), group=group)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    _record("recv", group, _nbytes(tensor), Fraction(0))
    dist.recv(tensor, src=global_rank(group, src), group=group)


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], group=None) -> list:
    """ops: ("send" | "recv", tensor, peer rank within the group). Returns the works to wait on.

    Launching sends and receives together lets a ring exchange proceed without the deadlock that
    blocking send-then-recv on every rank would cause.
    """
    p2p_ops = []
    for kind, tensor, peer in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"p2p op kind must be 'send' or 'recv', got {kind!r}")
        _record(kind, group, _nbytes(tensor), Fraction(_nbytes(tensor) if kind == "send" else 0))
        fn = dist.isend if kind == "send" else dist.irecv
        p2p_ops.append(dist.P2POp(fn, tensor, global_rank(group, peer), group))
    return dist.batch_isend_irecv(p2p_ops) if p2p_ops else []


# ----------------------------------------------------------------------------------------------
# The reference model: a small Llama-style decoder that every later lesson transforms
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 176  # SwiGLU hidden size, ~8/3 x dim
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference attention function: (batch, heads, seq, head_dim) -> same shape, causal.

    GPT calls whatever function it is given with this signature: lesson 05 swaps in ring
    attention, lesson 07 the Triton FlashAttention kernel.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


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
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x (batch, seq, heads, head_dim) by its angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_fn: Callable) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_fn = attn_fn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not cfg.n_heads: after tensor parallelism a rank holds only its share of heads.
        q = apply_rope(self.q_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class GPT(nn.Module):
    """embed -> n_layers x Block -> norm -> lm_head (untied) -> mean cross-entropy.

    layers is a ModuleDict keyed "0", "1", ... so a pipeline stage that keeps only some layers keeps
    their names, and its parameters still line up with the reference model's by name.
    """

    def __init__(self, cfg: ModelConfig, attn_fn: Callable = causal_attention) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, attn_fn) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
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
            std = self.cfg.init_std
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * self.cfg.n_layers)
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab), or the mean loss if targets are given.
        positions (seq,) default to 0..seq-1."""
        h = self.embed(tokens)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def synthetic_batch(cfg: ModelConfig, global_batch: int, seq_len: int, step: int, rank: int = 0,
                    world_size: int = 1, data_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) rows [rank*b, (rank+1)*b) of the global batch for this step, b = B / N.

    Every rank draws the same global batch and keeps its slice, so the data of a parallel run is
    identical to the single-device run by construction. The text is learnable: each next token
    follows a fixed random bigram table 3 times in 4, else it is uniform noise.
    """
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by world_size={world_size}")
    table = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(data_seed))
    gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step + 1)
    seq = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(cfg.vocab_size, (global_batch,), generator=gen)
    noise = torch.randint(cfg.vocab_size, (global_batch, seq_len), generator=gen)
    follow = torch.rand(global_batch, seq_len, generator=gen) < 0.75
    for t in range(seq_len):
        seq[:, t + 1] = torch.where(follow[:, t], table[seq[:, t]], noise[:, t])
    rows = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    return seq[rows, :-1], seq[rows, 1:]
