"""Lesson 05: context parallelism: ring attention, zigzag load balancing, Ulysses.

The parts, in order (the technique starts at merge_partials, the first function):
  Merging partial attention: merge_partials (THE MERGE RULE), merge_into (in place); naive_attention (what
    all must compute); the torch block, torch_block_forward and torch_block_backward; BlockAttention
  Sharding the sequence: SequenceLayout (contiguous or zigzag: LOAD BALANCE), validate_context_parallel
  Ring attention: _block_pairs (the causal skip), _kv_ring, RingAttention (THE BACKWARD RING too)
  Ulysses: relayout (the all-to-alls), ulysses_attention; ContextParallelAttention
  COST: attention_bytes (sent), ring_saved_bytes (kept for backward)
  The whole model under context parallelism: train_context_parallel (THE MODEL)
  RUN IT: sharded_attention, demo; then the command line: Options, demo_memory, main

THE IDEA. A long sequence does not fit one device's activation memory, so each of the P ranks of a
cp group holds S / P of its tokens. Everything but attention is per token (embedding, norms, MLP,
loss) and runs on the local shard; RoPE too, if each rank rotates its tokens by their *global*
positions (the reference GPT takes them explicitly). Attention needs every query to see every
(earlier) key: that is what this lesson distributes, in two designs.

THE MERGE RULE. Split a query row's keys into blocks A and B: each alone gives a normalised partial
output o_A and its log-sum-exp l_A = log sum_j exp(s_j) (lesson 07's kernel returns both). The row is
    o = (e^l_A o_A + e^l_B o_B) / (e^l_A + e^l_B) = sigmoid(l_A - l_B) o_A + sigmoid(l_B - l_A) o_B
    l = log(e^l_A + e^l_B)                       = l_A - logsigmoid(l_A - l_B)
which never overflows (sigmoid and logsigmoid are stable for any difference). A block in a row's
future has l = -inf and weight 0; a row whose first blocks are all masked must not become NaN
(-inf - -inf), so empty blocks are selected out before any difference is taken.

RING ATTENTION. Rank r keeps its queries and starts with its own keys/values. In each of P steps it
sends the K/V block it holds to rank r+1 and receives the next from rank r-1 (batched isend/irecv,
in flight while the current block is computed), and merges the block's partial attention into the
running (o, l). Causal masking uses global positions: blocks wholly in a query chunk's future are
skipped, wholly past ones run unmasked, only diagonal ones are masked. THE BACKWARD RING recomputes
each block's probabilities P = exp(s - l) with the *final* l (the global softmax's entries: nothing
to merge), accumulates dQ locally and sends dK/dV accumulators around the ring to the keys' owners.

LOAD BALANCE. Causally, contiguous shards are unfair: rank 0's queries see one block, rank P-1's see
P. Zigzag cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r (one early, one
late): every rank computes 2P+1 chunk pairs, 2 of them diagonal, the same work.

ULYSSES (DeepSpeed). All-to-alls turn the q, k, v sequence shards into head shards: each rank holds
all S tokens of H / P heads and runs ordinary attention; a fourth all-to-all turns the output back.

GROUPED-QUERY ATTENTION (Llama 3: g query heads share each of the H_kv = H / g K/V heads). K and V keep
their H_kv heads everywhere: the ring circulates them and their dK/dV accumulators, g times fewer bytes
than K/V repeated to the query heads (a Llama-3-8B layer, 32 query / 8 K/V heads: 4x); a block computes
each K/V head against its g query heads and sums their dK/dV. Ulysses gives rank j the query heads
[j H/P, (j+1) H/P) and the K/V heads they read, [j H_kv/P, (j+1) H_kv/P): P must divide both counts.

COST per attention call, one rank, shards of S/P tokens: A = b x H x S/P x d elements of q (e bytes
each), A_kv = b x H_kv x S/P x d of k or of v:
    ring forward    (P-1) hops of K and V                          2 (P-1) A_kv
    ring backward   (P-1) hops of K, V and (P-1) of dK, dV (fp32)  2 (P-1) A_kv + 2 (P-1) A_kv_fp32
    Ulysses         q, k, v, out forward; dout, dq, dk, dv back    4 (P-1)/P (A + A_kv) (+ the lse if asked)
The ring's traffic grows with P but hides behind block compute; Ulysses' stays flat but cannot hide.

THE MODEL. Each rank's loss is its tokens' share of the global mean: (sum of its token losses) /
(all tokens of the group) = local mean / P. The shares sum to the global mean; once the ring has
delivered every dK/dV to its owner, each rank's gradients of the replicated weights are its part of
the global gradient, so they are summed over the cp group. Dividing by P twice (shares, then a mean
over ranks) halves the loss at cp = 2; local means with summed gradients double the gradients.

RUN IT: python 05_context_parallel.py [--nproc 4]. Look at the max differences against full attention
and the single-device model, zigzag's per-rank work beside contiguous's, and the bytes moved per layer
beside the formulas.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

foundation = importlib.import_module("01_ddp")

METHODS = ("ring", "ulysses")
COMM_OP = {"ring": "send", "ulysses": "all_to_all"}  # the meter's operation for each method's bytes


# --- Merging partial attention, and the block attention functions ------------------------------------------
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of A and B from the two partial results; lse -inf means no key."""
    empty_a, empty_b = lse_a == float("-inf"), lse_b == float("-inf")
    diff = torch.where(empty_a | empty_b, 0.0, lse_a - lse_b)  # never -inf - -inf, even in backward
    lse = torch.where(empty_a, lse_b, torch.where(empty_b, lse_a, lse_a - F.logsigmoid(diff)))
    weight_a = torch.where(empty_a, 0.0, torch.where(empty_b, 1.0, torch.sigmoid(diff)))[..., None]
    weight_a = weight_a.to(out_a.dtype)  # the lse may be float64 (the ring's), the outputs fp32
    return weight_a * out_a + (1 - weight_a) * out_b, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """merge_partials in place, on the ring's running out and lse or views of their rows (a copy would be
    lost); the weight is lse-sized, so out moves in two passes: 20 B a query element, not 40."""
    one = torch.ones_like(lse, dtype=out.dtype)[..., None]
    weight, merged_lse = merge_partials(one, lse, torch.zeros_like(one), part_lse.to(lse.dtype))
    out.mul_(weight).addcmul_(part_out, 1 - weight)
    lse.copy_(merged_lse)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None, q_offset: int = 0, k_offset: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention the O(N^2)-memory way; rows that see no key get out 0, lse -inf, finite gradients."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    rows = q_offset + torch.arange(q.shape[2], device=q.device)
    cols = k_offset + torch.arange(k.shape[2], device=q.device)
    visible = (rows[:, None] >= cols) | (not causal)
    has_key = visible.any(-1)
    scores = (scale * q @ k.transpose(-2, -1)).masked_fill(~visible, float("-inf"))
    # logsumexp of an all -inf row has a NaN gradient: give such rows zeros, then mask them out.
    lse = torch.logsumexp(scores.masked_fill(~has_key[:, None], 0.0), dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v
    return out, lse.masked_fill(~has_key, float("-inf"))


def grouped_scores(q, k, q_offset: int, k_offset: int, causal: bool) -> torch.Tensor:
    """scale q k^T in fp32, -inf where masked, as (batch, kv_heads, g, seq_q, seq_k), K broadcast over g (no
    copy). Forward and backward share its bits: at scores of 1000, one rounding moves P by 1e-4 of itself."""
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    q = q.float().unflatten(1, (kv_heads, group))
    k = k.float()[:, :, None]
    scores = q.shape[-1] ** -0.5 * q @ k.transpose(-2, -1)
    if causal:
        rows = q_offset + torch.arange(q.shape[3], device=q.device)
        cols = k_offset + torch.arange(k.shape[3], device=q.device)
        scores = scores.masked_fill(rows[:, None] < cols, float("-inf"))
    return scores


def torch_block_forward(q, k, v, q_offset: int, k_offset: int, causal: bool):
    """(out fp32, lse float64) of queries at q_offset.. against keys at k_offset.., differentiable. The
    softmax subtracts each row's max (exp(s - max) / sum, as PyTorch's does), never the large lse."""
    scores = grouped_scores(q, k, q_offset, k_offset, causal)
    top = scores.amax(-1, keepdim=True).detach()  # out and lse do not depend on it: no gradient
    top = torch.where(top == float("-inf"), 0.0, top)  # a row that sees no key: out 0, lse -inf
    probs = torch.exp(scores - top)
    total = probs.sum(-1, keepdim=True)
    out = probs @ v.float()[:, :, None] / torch.where(total == 0, 1.0, total)
    lse = top.double() + total.double().log()
    return out.flatten(1, 2), lse.squeeze(-1).flatten(1, 2)


def torch_block_backward(q, k, v, out, lse, dout, dlse, q_offset: int, k_offset: int, causal: bool):
    """dq, dk, dv of one block from the *global* out and lse (THE BACKWARD RING)."""
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    scores = grouped_scores(q, k, q_offset, k_offset, causal)
    q, out, dout = (t.float().unflatten(1, (kv_heads, group)) for t in (q, out, dout))
    k, v = (t.float()[:, :, None] for t in (k, v))  # (batch, kv_heads, 1, seq_k, head_dim)
    lse = lse.double().unflatten(1, (kv_heads, group))
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # a row that sees no key: P = 0
    probs = torch.exp(scores.double() - lse[..., None]).float()
    delta = (out * dout).sum(-1)
    if dlse is not None:  # d lse_i / d s_ij = P_ij
        delta = delta - dlse.unflatten(1, (kv_heads, group))
    dscores = probs * (dout @ v.transpose(-2, -1) - delta[..., None])
    scale = q.shape[-1] ** -0.5
    dk = scale * dscores.transpose(-2, -1) @ q
    dv = probs.transpose(-2, -1) @ dout
    return (scale * dscores @ k).flatten(1, 2), dk.sum(2), dv.sum(2)


@dataclass(frozen=True)
class BlockAttention:
    """forward -> (out, lse), differentiable (Ulysses uses autograd); backward -> dq, dk, dv (the ring)."""
    name: str
    forward: Callable
    backward: Callable


TORCH_BLOCK = BlockAttention("torch", torch_block_forward, torch_block_backward)


@dataclass
class BlockWork:
    """What one rank's ring computed; seconds on a CPU are the thread's CPU time, all the compute with one
    torch thread per rank: wall time would charge ranks sharing cores for each other's work."""
    blocks: int = 0
    scores: int = 0
    seconds: float = 0.0

    def timed(self, fn: Callable, q: torch.Tensor, k: torch.Tensor, *args):
        clock = time.perf_counter if q.is_cuda else time.thread_time
        start = clock()
        result = fn(q, k, *args)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        self.blocks += 1
        self.scores += q.shape[2] * k.shape[2]
        self.seconds += clock() - start
        return result


# --- Sharding the sequence: contiguous or zigzag -----------------------------------------------------------
@dataclass(frozen=True)
class SequenceLayout:
    """The sequence cut into equal chunks (LOAD BALANCE); a rank's shard: its chunks, in order."""
    seq_len: int
    cp: int
    zigzag: bool

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1")
        if self.seq_len % self.n_chunks:
            what = "2 x cp" if self.zigzag else "cp"
            raise ValueError(f"seq_len={self.seq_len} is not divisible by {what} = {self.n_chunks}"
                             + (" (zigzag gives each rank two chunks)" if self.zigzag else ""))

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.n_chunks

    def chunks(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.cp - 1 - rank) if self.zigzag else (rank,)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        return self.shard(torch.arange(self.seq_len, device=device), rank, dim=0)

    def shard(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        return torch.cat([x.narrow(dim, c * self.chunk_len, self.chunk_len) for c in self.chunks(rank)], dim)

    def unshard(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The inverse: the whole sequence from every rank's shard, in rank order."""
        pieces = {c: shard.narrow(dim, i * self.chunk_len, self.chunk_len)
                  for rank, shard in enumerate(shards) for i, c in enumerate(self.chunks(rank))}
        return torch.cat([pieces[c] for c in range(self.n_chunks)], dim)


def validate_context_parallel(seq_len: int, n_heads: int, cp: int, method: str, zigzag: bool,
                              n_kv_heads: int | None = None) -> SequenceLayout:
    """Check the sizes (on every rank, before any collective, so none hangs); return the layout."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}")
    layout = SequenceLayout(seq_len, cp, zigzag)
    kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if kv_heads < 1 or n_heads % kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={kv_heads}")
    if method == "ulysses":
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", kv_heads)):
            if heads % cp:
                raise ValueError(f"{name}={heads} is not divisible by cp={cp} (Ulysses gives each rank "
                                 f"n_heads / cp whole query heads and the n_kv_heads / cp they read)")
    return layout


def local_layout(q: torch.Tensor, k: torch.Tensor, group, zigzag: bool,
                 method: str = "ring") -> SequenceLayout:
    """The layout of the whole sequence, from this rank's shard of it (every shard is equal)."""
    cp = foundation.group_size(group)
    return validate_context_parallel(q.shape[2] * cp, q.shape[1], cp, method, zigzag, k.shape[1])


# --- Ring attention ----------------------------------------------------------------------------------------
def _block_pairs(layout: SequenceLayout, me: int, owner: int, causal: bool):
    """(my query rows, the owner's key columns, their offsets, masked) of each chunk pair to compute."""
    n = layout.chunk_len
    for i, qc in enumerate(layout.chunks(me)):
        for j, kc in enumerate(layout.chunks(owner)):
            if not (causal and kc > qc):
                rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
                yield rows, cols, qc * n, kc * n, causal and kc == qc


def _pass_right(tensor: torch.Tensor, group, me: int, cp: int) -> tuple[torch.Tensor, list]:
    received = torch.empty_like(tensor)
    works = foundation.batch_p2p([("send", tensor, (me + 1) % cp), ("recv", received, (me - 1) % cp)], group)
    return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _kv_ring(k: torch.Tensor, v: torch.Tensor, group, me: int, cp: int):
    """Yield (owner, its K and V stacked) for the P blocks in ring order, the next already in flight."""
    kv = torch.stack([k, v])
    for step in range(cp - 1):
        next_kv, works = _pass_right(kv, group, me, cp)
        yield (me - step) % cp, kv
        _wait(works)
        kv = next_kv
    yield (me - (cp - 1)) % cp, kv  # the last block: nothing more to fetch


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: SequenceLayout, causal: bool, block: BlockAttention,
                work: BlockWork | None):
        me = dist.get_rank(group)
        compute = work.timed if work is not None else (lambda fn, *args: fn(*args))
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # float64: an fp32 lse of size L drifts by ulp(L) a merge, and P = exp(s - lse) with it
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64, device=q.device)
        for owner, kv in _kv_ring(k, v, group, me, layout.cp):
            for rows, cols, q_off, k_off, masked in _block_pairs(layout, me, owner, causal):
                part_out, part_lse = compute(block.forward, q[:, :, rows], kv[0][:, :, cols],
                                             kv[1][:, :, cols], q_off, k_off, masked)
                merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        # Kept for backward: the output as the caller gets it, and the lse one precision above the
        # compute's, float64 beside fp32 (the proofs' large scores need it) and fp32 beside bf16, where
        # bf16's own rounding (2^-8) dwarfs fp32's (FlashAttention's and Transformer Engine's saves).
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse if q.dtype == torch.float32 else lse.float())
        ctx.args = (group, layout, causal, block, compute)
        ctx.set_materialize_grads(False)  # an unused out or lse gets None, not zeros
        return out.to(q.dtype), lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, block, compute = ctx.args
        me = dist.get_rank(group)
        dout = torch.zeros_like(q) if dout is None else dout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The dK/dV of rank o's keys start at rank o+1, pick up every other rank's share along the
        # ring and reach o after P-1 hops, where o's own share waits.
        own_dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        arriving = None  # the accumulator on its way from the previous rank
        dkv_works = []
        for step, (owner, kv) in enumerate(_kv_ring(k, v, group, me, layout.cp)):
            dkv = own_dkv if step == 0 else torch.zeros_like(own_dkv)
            for rows, cols, q_off, k_off, masked in _block_pairs(layout, me, owner, causal):
                grads = compute(block.backward, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
                                None if dlse is None else dlse[:, :, rows], q_off, k_off, masked)
                dq[:, :, rows].add_(grads[0])  # in fp32, in place: 10 B an element (cast, then +=: 18)
                dkv[0, :, :, cols].add_(grads[1])
                dkv[1, :, :, cols].add_(grads[2])
            _wait(dkv_works)
            if arriving is not None:
                dkv += arriving
            if step > 0:
                arriving, dkv_works = _pass_right(dkv, group, me, layout.cp)
        _wait(dkv_works)
        if arriving is not None:
            own_dkv += arriving
        return dq.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, zigzag: bool = True,
                   causal: bool = True, block: BlockAttention = TORCH_BLOCK,
                   work: BlockWork | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries against the whole sequence; q, k, v: its shard of the layout."""
    return RingAttention.apply(q, k, v, group, local_layout(q, k, group, zigzag), causal, block, work)


# --- Ulysses: all-to-all from sequence shards to head shards and back --------------------------------------
def relayout(x: torch.Tensor, group, layout: SequenceLayout, to_heads: bool) -> torch.Tensor:
    """to_heads: (batch, heads, S / P, ...) sequence shard -> (batch, heads / P, S, ...) head shard (ULYSSES
    and GROUPED-QUERY ATTENTION above: which heads rank j gets); else the way back."""
    cp = layout.cp
    if to_heads:  # row j: my tokens of rank j's heads
        send = x.unflatten(1, (cp, x.shape[1] // cp)).movedim(1, 0).contiguous()
    else:  # row j: rank j's tokens of my heads
        send = torch.stack([layout.shard(x, rank, dim=2) for rank in range(cp)]).contiguous()
    received = torch.empty_like(send)
    foundation.all_to_all(received, send, group=group)
    return layout.unshard(list(received.unbind(0)), 2) if to_heads else received.movedim(0, 1).flatten(1, 2)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout: SequenceLayout, to_heads: bool):
        ctx.args = (group, layout, to_heads)
        return relayout(x, group, layout, to_heads)

    @staticmethod
    def backward(ctx, grad):
        group, layout, to_heads = ctx.args
        return relayout(grad.contiguous(), group, layout, not to_heads), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, zigzag: bool = True,
                      causal: bool = True, block: BlockAttention = TORCH_BLOCK,
                      with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse or None): the same contract as ring_attention; the lse costs one more all-to-all."""
    layout = local_layout(q, k, group, zigzag, "ulysses")
    q, k, v = (_Relayout.apply(t, group, layout, True) for t in (q, k, v))
    out, lse = block.forward(q, k, v, 0, 0, causal)
    out = _Relayout.apply(out.to(q.dtype), group, layout, False)
    return out, _Relayout.apply(lse.float(), group, layout, False) if with_lse else None


@dataclass
class ContextParallelAttention:
    """The GPT's attention function under context parallelism: q, k, v are this rank's shard."""
    group: dist.ProcessGroup | None = None
    method: str = "ring"
    zigzag: bool = True
    block: BlockAttention = TORCH_BLOCK

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {METHODS}")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attend = ring_attention if self.method == "ring" else ulysses_attention
        return attend(q, k, v, self.group, self.zigzag, True, self.block)[0]


# --- COST: the bytes one rank sends, and keeps for backward, per attention call ---------------------------
def attention_bytes(method: str, q_elems: int, kv_elems: int, cp: int, elem_bytes: int = 4,
                    with_lse_elems: int = 0) -> dict[str, Fraction]:
    """COST's formula for q_elems elements of q (and out), kv_elems of k and v, with_lse_elems of the lse."""
    a = q_elems * elem_bytes
    a_kv = kv_elems * elem_bytes
    if method == "ring":
        return dict(forward=Fraction(2 * (cp - 1) * a_kv),
                    backward=Fraction(2 * (cp - 1) * a_kv + 2 * (cp - 1) * kv_elems * 4))
    per_pass = Fraction(cp - 1, cp) * (2 * a + 2 * a_kv + 4 * with_lse_elems)  # the lse: fp32
    return dict(forward=per_pass, backward=per_pass)


def ring_saved_bytes(q_elems: int, lse_elems: int, elem_bytes: int = 4) -> int:
    """What RingAttention keeps for backward beyond q, k, v (03's attention_saves takes it): out and lse."""
    lse_bytes = 8 if elem_bytes == 4 else 4
    return elem_bytes * q_elems + lse_bytes * lse_elems


# --- The whole model under context parallelism -------------------------------------------------------------
def train_context_parallel(cfg, steps: int, global_batch: int, seq_len: int, *, method: str = "ring",
                           zigzag: bool = True, block: BlockAttention = TORCH_BLOCK, lr: float = 1e-3,
                           adam_eps: float = 1e-8, group=None, device: torch.device | str = "cpu"
                           ) -> tuple["foundation.TrainResult", "foundation.CommMeter"]:
    """The same training as foundation.train_single_device, each rank holding seq_len / cp tokens a row."""
    cp = foundation.group_size(group)
    rank = dist.get_rank(group)
    layout = validate_context_parallel(seq_len, cfg.n_heads, cp, method, zigzag, cfg.n_kv_heads)

    def share(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # this rank's share: THE MODEL
        return foundation.cross_entropy_loss(logits, targets) / cp

    model = foundation.GPT(cfg, attn_fn=ContextParallelAttention(group, method, zigzag, block),
                           loss_fn=share).to(device)
    optimizer = foundation.make_optimizer(model, lr, adam_eps)  # GPT's seeded init agrees on every rank
    positions = layout.positions(rank, device)
    result = foundation.TrainResult([], {}, {})
    local_means = []
    with foundation.comm_meter() as meter:
        for step in range(steps):
            batch = foundation.synthetic_batch(cfg, global_batch, seq_len, step)
            tokens, targets = (layout.shard(t, rank, dim=1).to(device) for t in batch)
            loss = model(tokens, targets, positions=positions)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.requires_grad]  # replicated: sum the parts
            flat = torch.cat([g.flatten() for g in grads])  # in one call, not one per parameter
            foundation.all_reduce(flat, group=group)
            for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(summed.view_as(grad))
            local_means.append(cp * loss.detach().double())  # the rank's mean loss, exactly
            if step == 0:
                result.first_grads = foundation.cpu_copy((n, p.grad) for n, p in model.named_parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result.losses = foundation.mean_over_ranks(local_means, group)
    result.params = foundation.cpu_copy(model.named_parameters())
    return result, meter


# --- RUN IT: every variant beside full attention and the one-device model; the command line ---------------
def outputs_and_grads(attn, q, k, v, dout, dlse=None) -> list[torch.Tensor | None]:
    """[out, lse, dq, dk, dv] of attn(q, k, v) -> (out, lse or None) under the loss
    sum(out * dout) + sum(lse * dlse) (rows with lse = -inf excluded; dout None: no out term)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = attn(q, k, v)
    loss = 0.0 if dout is None else (out * dout).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse.isinf(), 0.0) * dlse).sum()
    return [out, lse, *torch.autograd.grad(loss, (q, k, v), materialize_grads=True)]  # zeros, not None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, where equal values (the -inf of rows that see no key) count as 0."""
    return torch.where(a == b, 0.0, (a.double() - b.double()).abs()).max().item()


def attention_inputs(batch: int, heads: int, seq_len: int, head_dim: int, seed: int,
                     dtype: torch.dtype = torch.float32, device=None,
                     kv_heads: int | None = None) -> list[torch.Tensor]:
    """q, k, v, dout, dlse: the whole sequence, the same on every rank (drawn on the CPU from the seed)."""
    gen = torch.Generator().manual_seed(seed)
    q_shape = (batch, heads, seq_len, head_dim)
    kv_shape = (batch, heads if kv_heads is None else kv_heads, seq_len, head_dim)
    tensors = [torch.randn(shape, generator=gen)
               for shape in (q_shape, kv_shape, kv_shape, q_shape, q_shape[:3])]
    return [t.to(device=device, dtype=dtype if t.dim() == 4 else torch.float32) for t in tensors]


def sharded_attention(batch: int, heads: int, seq_len: int, head_dim: int, *, method: str, zigzag: bool,
                      causal: bool, block: BlockAttention = TORCH_BLOCK, seed: int = 0, dtype=torch.float32,
                      group=None, device=None, kv_heads: int | None = None):
    """On every rank: outputs_and_grads of its shard, the meter of its forward + backward, the ring's work."""
    cp = foundation.group_size(group)
    rank = dist.get_rank(group)
    layout = validate_context_parallel(seq_len, heads, cp, method, zigzag, kv_heads)
    shards = [layout.shard(t, rank, dim=2) for t in attention_inputs(batch, heads, seq_len, head_dim,
                                                                     seed, dtype, device, kv_heads)]
    work = BlockWork()
    attend = {"ring": lambda q, k, v: ring_attention(q, k, v, group, zigzag, causal, block, work),
              "ulysses": lambda q, k, v: ulysses_attention(q, k, v, group, zigzag, causal, block,
                                                           with_lse=True)}
    with foundation.comm_meter() as meter:
        results = outputs_and_grads(attend[method], *shards)
    return [t.detach() for t in results], meter, work


def demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    rank = dist.get_rank()
    cp = dist.get_world_size()

    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines)

    b = 2
    h = args.heads
    kv = args.kv_heads
    s = args.seq_len
    d = args.head_dim
    variants = [("ring, contiguous", "ring", False), ("ring, zigzag", "ring", True),
                ("Ulysses", "ulysses", True)]
    if h % cp or kv % cp:
        variants.pop()
        say(f"(Ulysses left out: --heads {h} and --kv-heads {kv} must both be divisible by cp={cp})")
    say(f"Context parallelism on {foundation.counted(cp, 'rank')} ({dist.get_backend()}, {device.type}).\n\n"
        f"max |difference| from full attention in float64 (fp32, causal; batch {b}, "
        f"{foundation.counted(h, 'query head')} reading {foundation.counted(kv, 'K/V head')}, seq {s}, "
        f"head dim {d}):")
    say(f"  {'':<20}" + "".join(f"{n:>10}" for n in ("out", "lse", "dq", "dk", "dv")))
    inputs = attention_inputs(b, h, s, d, seed=0, dtype=torch.float64, device=device, kv_heads=kv)
    reference = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, True), *inputs)
    a = b * h * s // cp * d  # one shard's elements of q, of k, of the lse
    a_kv = b * kv * s // cp * d
    lse = b * h * s // cp
    byte_rows = []
    for name, method, zigzag in variants:
        got, meter, _ = sharded_attention(b, h, s, d, method=method, zigzag=zigzag, causal=True,
                                          device=device, kv_heads=kv)
        layout = SequenceLayout(s, cp, zigzag)
        diffs = [max_diff(g, layout.shard(r, rank, dim=2)) for g, r in zip(got, reference, strict=True)]
        say(f"  {name:<20}" + "".join(f"{max(col):>10.1e}" for col in zip(*foundation.all_ranks(diffs))))
        _, repeated, _ = sharded_attention(b, h, s, d, method=method, zigzag=zigzag, causal=True,
                                           device=device)  # K/V repeated to h heads
        byte_rows.append((name, *(float(m.traffic(COMM_OP[method])) for m in (meter, repeated)),
                          float(sum(attention_bytes(method, a, a_kv, cp, with_lse_elems=lse).values()))))

    say(f"\nper-rank work of causal ring attention, forward + backward (seq {args.work_seq_len}, "
        f"{foundation.counted(h, 'head')}, head dim {d}): block calls / query x key scores / seconds "
        f"computing (CPU time on a CPU)")
    for name, zigzag in (("contiguous", False), ("zigzag", True)):
        for _ in range(2):  # the first run warms up (allocator, kernel compilation): time the second
            _, _, work = sharded_attention(1, h, args.work_seq_len, d, method="ring", zigzag=zigzag,
                                           causal=True, device=device, kv_heads=kv)
        rows = foundation.all_ranks([work.blocks, work.scores, work.seconds])
        say(f"  {name:<11}" + "  ".join(f"r{r}: {bl:>2} / {sc:>8,} / {sec:.3f}s"
                                        for r, (bl, sc, sec) in enumerate(rows)))
        imbalance = [max(col) / (sum(col) / cp) for col in list(zip(*rows))[1:]]
        say(f"  {'':<11}slowest / mean: scores {imbalance[0]:.2f}, seconds {imbalance[1]:.2f}")

    say(f"\nbytes one rank sends per attention call, forward + backward (fp32, with the lse), "
        f"{foundation.counted(kv, 'K/V head')}; last column: the same call with K/V repeated to all "
        f"{foundation.counted(h, 'head')}:")
    for name, measured, repeated, formula in byte_rows:
        say(f"  {name:<20}{measured:>12,.0f} B   formula {formula:>12,.0f} B   "
            f"repeated K/V {repeated:>12,.0f} B")
    say(f"  ring: 2(P-1) A_kv forward + 4(P-1) A_kv backward; Ulysses: 2(P-1)/P (A + A_kv) + (P-1)/P L per "
        f"pass;\n  A = one shard of q = {a * 4:,} B, A_kv of k = {a_kv * 4:,} B, "
        f"L of the lse = {lse * 4:,} B")

    cfg = gpt_config(args)
    say(f"\nthe whole GPT ({foundation.counted(cfg.n_layers, 'layer')}, {h} query / "
        f"{foundation.counted(kv, 'K/V head')}), batch {args.global_batch} x seq {s}, "
        f"{foundation.counted(args.steps, 'AdamW step')}, against one device:")
    ref = None if rank else foundation.train_single_device(cfg, args.steps, args.global_batch, s,
                                                           device=device)
    for name, method, zigzag in variants:
        result, meter = train_context_parallel(cfg, args.steps, args.global_batch, s, method=method,
                                               zigzag=zigzag, device=device)
        if rank == 0:
            losses, grads, params = result.max_differences(ref)
            say(f"  {name:<20} step-0 loss {result.losses[0]:.6f} (one device {ref.losses[0]:.6f}), "
                f"max |diff|: losses {losses:.1e}, step-0 gradients {grads:.1e}, parameters {params:.1e}")
        op = COMM_OP[method]
        layer = float(meter.traffic(op)) / (args.steps * cfg.n_layers)
        tokens = args.global_batch * s // cp
        formula = sum(attention_bytes(method, tokens * cfg.dim, tokens * kv * cfg.head_dim, cp).values())
        say(f"  {'':<20} {op} per layer per step {layer:,.0f} B, formula {float(formula):,.0f} B")
    say("\nNotice: every variant computes full attention and the one-device model; zigzag evens out "
        "the work that contiguous piles on the last rank; the ring's bytes grow with P, Ulysses' do not; "
        "both move the K/V heads only, not K/V repeated to every query head.")
    foundation.exit_distributed()


@dataclass
class Options:
    seq_len: int = foundation.option(64, "tokens of the sharded sequence (divisible by 2 x ranks)", ">= 1")
    heads: int = foundation.option(8, "query heads", ">= 1")
    kv_heads: int = foundation.option(4, "key/value heads (grouped-query attention)", ">= 1")
    head_dim: int = foundation.option(16, "size of each head", ">= 1")
    work_seq_len: int = foundation.option(2048, "sequence of the work comparison", ">= 1")
    global_batch: int = foundation.option(2, "sequences per step of the GPT runs", ">= 1")
    steps: int = foundation.option(3, "AdamW steps of the GPT runs and of the reference", ">= 1")


def gpt_config(args: argparse.Namespace) -> foundation.ModelConfig:
    """The GPT runs' model: the attention tables' heads, each --head-dim wide."""
    return foundation.ModelConfig(dim=args.heads * args.head_dim, n_heads=args.heads,
                                  n_kv_heads=args.kv_heads, seed=1)


def demo_memory(args: argparse.Namespace, cp: int) -> None:
    """The demo's largest tensors (the GPT runs', the attention scores) against this machine's memory."""
    scores = {"the float64 reference attention's scores": 8 * 2 * args.heads * args.seq_len ** 2,
              "the work comparison's block scores": 8 * args.heads * args.work_seq_len ** 2 // cp}
    sizes = (f"--global-batch {args.global_batch}, --seq-len {args.seq_len}, --work-seq-len "
             f"{args.work_seq_len}, --heads {args.heads} x --head-dim {args.head_dim}")
    foundation.check_memory(gpt_config(args), args.global_batch, args.seq_len, cp, scores, what=sizes)


def validate_sequences(args: argparse.Namespace, cp: int) -> None:
    """Both lengths the demo splits over the cp ranks in zigzag, an error naming its option."""
    for option, seq_len in (("--seq-len", args.seq_len), ("--work-seq-len", args.work_seq_len)):
        try:
            validate_context_parallel(seq_len, args.heads, cp, "ring", True, args.kv_heads)
        except ValueError as error:
            raise ValueError(str(error).replace(f"seq_len={seq_len}", f"{option} {seq_len}")) from None


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options, foundation.Ranks),
                                            aliases={"n_heads": "heads", "n_kv_heads": "kv_heads"})
    rules = [functools.partial(validate_sequences, args), functools.partial(demo_memory, args)]
    foundation.launch_lesson(parser, args, demo, rules=rules)


if __name__ == "__main__":
    main()
