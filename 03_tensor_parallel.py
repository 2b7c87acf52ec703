"""Lesson 03: tensor parallelism (Megatron), vocab-parallel embedding and cross-entropy, sequence
parallelism, and grouped-query attention.

The parts, in order (the technique starts at conjugate: Megatron's f and g):
  The conjugate communication operators: _collective (one operator a collective), conjugate
  Vocab-parallel embedding and cross-entropy: VocabParallelEmbedding, VocabParallelCrossEntropy, LossInChunks
  The plan: column_parallel, row_parallel, enter_region, exit_region, SP's Projections and its overlapped
    backward (_sequence_parallel_backward); apply_tensor_parallel
  Training, communication and memory: train_tensor_parallel, comm_formula
  Activation memory, lean saves and recompute: apply_lean_saves, apply_recompute, layer_activation_formula
  RUN IT: demo, bench (against DTensor: dtensor_plan); the command line: Options, main

THE IDEA
Data parallelism copies the model; tensor parallelism (TP) splits every big matrix over the t ranks
of a group, so each rank stores and multiplies 1/t of the weights, on the same tokens.
- Column-parallel linear, W = [W_1 .. W_t] split by output features: rank r computes Y_r = X W_r^T,
  its slice of the output. Needs the whole input X; produces a sharded output.
- Row-parallel linear, W split by input features: rank r computes X_r W_r^T from its input slice;
  the true output is the SUM over ranks. Needs a sharded input; produces partial sums.
Chaining them costs one reduction per pair (Megatron-LM, Shoeybi et al. 2019):
- attention: q, k, v column-parallel = split by heads (heads are independent), out_proj
  row-parallel. Grouped-query attention (Llama 3: query head i reads key/value head
  i // (n_heads / n_kv_heads)) splits both head counts by t, so a rank's query heads find their
  key/value heads locally: t must divide n_heads and n_kv_heads.
- SwiGLU MLP: gate and up column-parallel (silu(gate) * up is elementwise, so it stays local), down
  row-parallel. t must divide ffn_dim.

THE CONJUGATE OPERATORS (autograd functions; each region is  f -> local work -> g; none at t = 1)
  f: forward identity,   backward all-reduce   (the input is used by every rank: sum its gradients)
  g: forward all-reduce, backward identity     (the output is a sum of partials)
An all-reduce of a (b, s, h) activation costs 2(t-1)/t x b s h x bytes per rank (ring). Per layer
and step: g after attention and after the MLP (forward), f before each (backward): 4 all-reduces
of b x s x h. Once per step: the embedding's g, the LM head's f, the loss's 3 of b x s numbers.

VOCAB PARALLELISM (the embedding and the LM head are the largest matrices of a small model)
Embedding: rank r holds rows [r V/t, (r+1) V/t); an id outside them looks up zeros, and g sums the
partial embeddings. LM head: column-parallel over the vocabulary, and the cross-entropy never
materialises the full logits: loss = log sum_v e^(z_v - m) - (z_target - m) needs 3 all-reduces of
one number per token: the max m (MAX), the sum of exponentials and the target logit (SUM); the
gradient softmax - onehot is local. The vocabulary is padded to a multiple of t with -inf logits (no
loss, no gradient). Both split the (V, h) table by rows, so a tied LM head (Llama 3.2) stays one
parameter, its gradient the sum of both uses; a plan that splits a tie's ends differently is refused.
The loss holds 12 B a logit in fp32 at its peak (the V / t logits of every token: Llama 3's 128k ids,
8k tokens: 11.7 GiB at t = 1). LossInChunks computes it and its gradient in forward, a slice of the
tokens at a time: one slice's 12 B live, and backward keeps the gradient, 2 B a logit in bf16.

SEQUENCE PARALLELISM (Korthikanti et al. 2022)
Between the regions (norms, residual adds) plain TP computes the same thing on every rank and
stores t copies. SP splits those activations along the sequence (s must divide by t): g becomes a
reduce-scatter (forward; all-gather backward) and f an all-gather (forward; reduce-scatter
backward). All-reduce = reduce-scatter + all-gather, so the traffic is the same: per layer per
step 4 all-gathers + 4 reduce-scatters of b x s x h. The replicated norm weights see only their
rank's tokens: their gradients are summed over the group (an all-reduce of h numbers per norm).
The linears of a region (q, k, v; gate, up) read its gathered input, which backward needs for their
weight gradients: they keep this rank's sequence shard of it and all-gather it again in backward, once
for all of them (Projections, Megatron's): 2 all-gathers of b x s x h more a layer, t x less kept.
Their backward hides two collectives as Megatron's does: that all-gather travels while the input's
gradient is made (GEMMs that do not read it), and the input gradient's reduce-scatter while the
weights' gradients are (_sequence_parallel_backward, one operator, so a compiler keeps the order): of
a layer's 10 collectives of b x s x h, 4 run beside GEMMs; the other 6 have every GEMM wait for them.

ACTIVATION MEMORY (what a layer keeps for backward; Korthikanti's accounting)
GPT-3 in 16 bits: s b h (34 + 5 a s / h) bytes without TP; s b h (10 + 24/t + 5 a s / (h t)) with
TP (10: the norms' inputs, dropout masks and the regions' inputs, replicated); s b h / t (34 +
5 a s / h) with TP + SP, which re-gathers each region's input in backward (above). Ours, a token in
bf16 (layer_activation_formula; a heads of d, h = a d, k K/V heads, f = ffn_dim): autograd keeps each
norm's input in fp32 and x / rms, the SwiGLU's gate, silu(gate), up and their product: 20h + 4kd + 8f +
4a + 8. LEAN SAVES (apply_lean_saves), what Megatron-Core with Transformer Engine keeps: a norm keeps x
and 1/rms (backward recomputes x / rms), the SwiGLU gate and up (backward recomputes silu): 8h + 4ad +
4kd + 4a + 6f + 8, with SP all of it / t. The gradients are autograd's up to rounding.
RECOMPUTE (apply_recompute): "selective" keeps only each attention function's q, k, v and recomputes
its inside (Megatron's: the 5 a s / h scores term; a fused kernel's log-sum-exp); "elementwise", on
lean saves, drops what lean saves keep for the linears' weight gradients but can rebuild in one
elementwise pass: each norm's output (from x, which is kept) and SwiGLU's product (from gate and up):
4h + 2f a token less, their storage emptied once the region has run, refilled when backward reaches it
(Megatron-Core's recompute_modules "layernorm" and the activation's); "full" keeps only each block's
input and reruns the block, ~1/3 more compute ("op", torchtitan's: and the outputs of its odd matmuls
and attention). Gradients are bitwise the same.

RUN IT
    python 03_tensor_parallel.py                       # 4 local CPU ranks, tp = 4
    python 03_tensor_parallel.py --bench               # against DTensor parallelize_module
Look at: the max |difference| from one device (rounding only); the communication per layer per
step, measured = formula, with and without SP; one layer's activations per rank, measured = formula,
before (autograd's saves, each region's input gathered) and after (re-gathered, lean saves).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import fnmatch
import functools
import importlib
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

foundation = importlib.import_module("01_ddp")


# --- The conjugate communication operators -----------------------------------------------------------------
# Each collective is one PyTorch operator (torch.library.custom_op): torch.compile keeps it as one node of
# a block's single graph, and the comm meter counts every call (traced through: only while tracing).
_group_of = dist.distributed_c10d._resolve_process_group  # an operator takes a group by its name


def _collective_output(x: torch.Tensor, group_name: str, kind: str) -> torch.Tensor:
    n = foundation.group_size(_group_of(group_name))  # also: this rank is in the group
    rows = {"gather": x.shape[0] * n, "scatter": x.shape[0] // n}.get(kind, x.shape[0])
    return x.new_empty((rows, *x.shape[1:]))


@torch.library.custom_op("lesson03::collective", mutates_args=())
def _collective(x: torch.Tensor, group_name: str, kind: str) -> torch.Tensor:
    """A new tensor (x may be shared: never reduced in place): kind "sum" or "max", x all-reduced;
    "gather", every rank's x concatenated along dim 0; "scatter", this rank's dim-0 chunk of the sum."""
    group = _group_of(group_name)
    out = _collective_output(x, group_name, kind)
    if kind == "gather":
        foundation.all_gather(out, x, group)
    elif kind == "scatter":
        foundation.reduce_scatter(out, x, group)
    else:
        foundation.all_reduce(out.copy_(x), group, getattr(dist.ReduceOp, kind.upper()))
    return out


_collective.register_fake(_collective_output)


def _all_reduced(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    return _collective(x, (group or dist.group.WORLD).group_name, op)


def _gathered(x: torch.Tensor, group, dim: int = 1, kind: str = "gather") -> torch.Tensor:
    """Every rank's x concatenated along dim (default: (b, s/t, h) sequence shards -> (b, s, h)), or
    with kind "scatter" this rank's slice of the sum; through dim 0, where the collective works."""
    out = _collective(x.movedim(dim, 0).contiguous(), (group or dist.group.WORLD).group_name, kind)
    return out.movedim(0, dim).contiguous()  # else each linear reading it saves its own copy


_reduce_scattered = functools.partial(_gathered, dim=1, kind="scatter")  # (b, s, h) partials -> (b, s/t, h)


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)


def conjugate(forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function: forward(x, group) on the input, backward(grad, group) on the gradient.
    The four operators below differ only in this pair."""
    class Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            return backward(grad, ctx.group), None

    return Conjugate


CopyToRegion = conjugate(_identity, _all_reduced)  # f
ReduceFromRegion = conjugate(_all_reduced, _identity)  # g
GatherSequence = conjugate(_gathered, _reduce_scattered)  # SP's f
ReduceScatterSequence = conjugate(_reduce_scattered, _gathered)  # SP's g


# --- Vocab-parallel embedding and cross-entropy ------------------------------------------------------------
def vocab_shard(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """(first id, ids per rank) of rank's slice of the vocabulary padded to a multiple of tp."""
    per_rank = math.ceil(vocab_size / tp)
    return rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight_shard: nn.Parameter, first_id: int) -> None:
        super().__init__()
        self.weight = weight_shard
        self.first_id = first_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return rows.masked_fill(outside[..., None], 0.0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over all V from this rank's slice (N, V/t) of the logits: 3 all-reduces of N."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, first_id: int, vocab_size: int,
                group) -> torch.Tensor:
        ids = first_id + torch.arange(logits.shape[1], device=logits.device)
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))  # padding: e^-inf = 0
        row_max = _all_reduced(logits.max(dim=1).values, group, "max")
        exp = (logits - row_max[:, None]).exp()
        sum_exp = _all_reduced(exp.sum(dim=1), group)
        local_target = targets - first_id
        mine = (local_target >= 0) & (local_target < logits.shape[1])
        local_target = local_target.masked_fill(~mine, 0)
        picked = logits.gather(1, local_target[:, None]).squeeze(1) - row_max
        picked = torch.where(mine, picked, torch.zeros_like(picked))  # never -inf * 0
        target_logit = _all_reduced(picked, group)
        ctx.save_for_backward(exp / sum_exp[:, None], local_target, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, mine = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target), all local; the onehot only where this rank
        # holds the target (a scatter, not boolean indexing, which would sync a GPU).
        grad = softmax.scatter_add(1, local_target[:, None], -mine.to(softmax.dtype)[:, None])
        return (grad * (grad_loss / grad.shape[0])).to(ctx.dtype), None, None, None, None


class LossInChunks(torch.autograd.Function):
    """The module docstring's loss in slices (Liger's fused loss keeps, as here, the gradient; Megatron's
    fused one an fp32 copy). loss_fn: a mean over the tokens of the logits alone (not 06's aux loss, no
    ignored ids); backward only scales what forward kept (kept in fp16, a gradient would underflow before
    a loss scale: the course runs bf16, fp32). with_gradient False (no backward to come): the loss alone."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, chunks: int,
                with_gradient: bool) -> torch.Tensor:
        flat = logits.detach().flatten(0, 1)
        grad = torch.empty_like(flat) if with_gradient else flat[:0]  # none: empty slices of it
        tokens = flat.shape[0]
        total = 0
        slices = [whole.tensor_split(chunks) for whole in (flat, targets.flatten(), grad)]
        for piece, piece_targets, piece_grad in zip(*slices):
            if not len(piece):  # fewer tokens than chunks: every rank skips the same (equal shapes)
                continue
            piece = piece.detach().requires_grad_()
            share = len(piece) / tokens
            with torch.set_grad_enabled(with_gradient):
                loss = loss_fn(piece[None], piece_targets[None]) * share
            if with_gradient:
                piece_grad.copy_(torch.autograd.grad(loss, piece)[0])
            total = total + loss.detach()
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad, = ctx.saved_tensors
        # grad_loss stays fp32 (1/m in bf16 is 0.2% off for m = 3): the product in fp32, rounded once
        return (grad * grad_loss).view(ctx.shape), None, None, None, None


@dataclass
class ChunkedLoss:
    """A drop-in for GPT.loss_fn: loss_fn (a mean over the tokens) by LossInChunks."""
    loss_fn: Callable
    chunks: int

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not targets.numel():  # no token: the loss at once (NaN, a mean of nothing), as unsliced
            return self.loss_fn(logits, targets)
        with_gradient = torch.is_grad_enabled() and logits.requires_grad
        return LossInChunks.apply(logits, targets, self.loss_fn, self.chunks, with_gradient)


def loss_bytes(tokens: int, vocab_size: int, tp: int, elem_bytes: int, chunks: int = 1) -> int:
    """The loss's peak bytes above the activations, logits of elem_bytes 2 or 4: 12 a logit of (tokens,
    V / t), + elem_bytes if tp > 1 (the logits). chunks > 1 (LossInChunks): the logits and their gradient
    whole, and one chunk's tokens' 12 a logit, 14 for bf16 logits over tp > 1 (as measured: the
    vocab-parallel loss upcasts a bf16 slice into a new fp32 tensor, an fp32 one it reads in place)."""
    vocab = -(-vocab_size // tp)
    if chunks == 1:
        return tokens * vocab * (12 + elem_bytes * (tp > 1))
    per_slice_logit = 12 + (tp > 1) * (4 - elem_bytes)
    return tokens * vocab * 2 * elem_bytes + -(-tokens // chunks) * vocab * per_slice_logit


@dataclass
class VocabParallelLoss:
    """A drop-in for GPT.loss_fn: (batch, seq, V/t) logits -> the mean loss over all V."""
    first_id: int
    vocab_size: int
    group: object

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                               self.first_id, self.vocab_size, self.group)


# --- The plan: how each module of the reference GPT is split -----------------------------------------------
@dataclass
class Context:
    group: object
    tp: int
    rank: int
    sequence_parallel: bool
    regather: bool = True  # SP: the regions' linears keep their input's sequence shard (keep_sequence_shard)
    shards: dict = field(default_factory=dict)  # full weight -> its shard (keys hash by identity)


def _shard(weight: torch.Tensor, dim: int, ctx: Context) -> nn.Parameter:
    """This rank's 1/tp slice along dim, after zero-padding dim to a multiple of tp. A weight met
    again (tied: the embedding as the LM head) gets the same shard: the tie holds."""
    if weight in ctx.shards:
        return ctx.shards[weight]
    full_size = weight.shape[dim]
    per_rank = math.ceil(full_size / ctx.tp)
    padded = F.pad(weight.detach(), [0, 0] * (weight.dim() - 1 - dim) + [0, per_rank * ctx.tp - full_size])
    param = nn.Parameter(padded.narrow(dim, ctx.rank * per_rank, per_rank).clone(),
                         requires_grad=weight.requires_grad)  # a frozen weight stays frozen
    param.tp_shard_dim = dim  # as Megatron's: for unshard() and checkpoints
    param.tp_full_size = full_size
    ctx.shards[weight] = param
    return param


# A style is a function (module, ctx) -> module; the plan lists the styles of each module name.
def column_parallel(linear: nn.Linear, ctx: Context) -> nn.Module:
    linear.weight = _shard(linear.weight, 0, ctx)
    linear.out_features = linear.weight.shape[0]
    return linear


def row_parallel(linear: nn.Linear, ctx: Context) -> nn.Module:
    linear.weight = _shard(linear.weight, 1, ctx)
    linear.in_features = linear.weight.shape[1]
    return linear


def vocab_parallel(embedding: nn.Embedding, ctx: Context) -> nn.Module:
    first_id, _ = vocab_shard(embedding.num_embeddings, ctx.tp, ctx.rank)
    return VocabParallelEmbedding(_shard(embedding.weight, 0, ctx), first_id)


def keeps_sequence_shard(module: nn.Module, ctx: Context) -> bool:
    """SP with ctx.regather: a region's projections (01's project hook) take its input's sequence shard."""
    return ctx.sequence_parallel and ctx.regather and ctx.tp > 1 and hasattr(module, "project")


def enter_region(module: nn.Module, ctx: Context) -> nn.Module:
    """f on the module's input (with SP: all-gather along the sequence); other arguments pass.
    At tp = 1 f and g have nothing to communicate: no hook, no autograd function. Nor where the
    module's linears gather their input themselves (keeps_sequence_shard: SP's Projections)."""
    f = GatherSequence if ctx.sequence_parallel else CopyToRegion
    if ctx.tp > 1 and not keeps_sequence_shard(module, ctx):
        module.register_forward_pre_hook(lambda _, args: (f.apply(args[0], ctx.group), *args[1:]))
    return module


def exit_region(module: nn.Module, ctx: Context) -> nn.Module:
    """g on the module's output (with SP: reduce-scatter along the sequence)."""
    g = ReduceScatterSequence if ctx.sequence_parallel else ReduceFromRegion
    if ctx.tp > 1:
        module.register_forward_hook(lambda _, args, out: g.apply(out, ctx.group))
    return module


class LinearMath:
    """nn.Linear's GEMMs (no bias) on what it keeps of its input: the input itself. Lesson 08's
    Float8Linear brings its own (its `math`): FP8 GEMMs on the input's FP8 cast."""

    @staticmethod
    def keep(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    @staticmethod
    def operands(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:  # kept of a weight beside itself: none
        return ()

    @staticmethod
    def forward(kept: tuple[torch.Tensor, ...], weight: torch.Tensor,
                operands: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.linear(kept[0], weight)

    @staticmethod
    def grad_operand(grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # what both backward GEMMs read of it
        return (grad.flatten(0, -2),)

    @staticmethod
    def weight_operand(weight: torch.Tensor, operands: tuple) -> tuple[torch.Tensor, ...]:  # what dx reads
        return (weight,)

    @staticmethod
    def grad_input(grad: tuple, weight: tuple, dtype: torch.dtype) -> torch.Tensor:  # (tokens, in_features)
        return grad[0] @ weight[0]

    @staticmethod
    def grad_weight(grad: tuple, kept: tuple, dtype: torch.dtype) -> torch.Tensor:
        return grad[0].t() @ kept[0].flatten(0, -2)


# The maths' backward GEMMs by name, for the operator below (which takes tensors, numbers and strings): a
# lesson with its own math adds it (08: Float8Math)
MATHS = {"LinearMath": LinearMath}


@torch.library.custom_op("lesson03::sequence_parallel_backward", mutates_args=())
def _sequence_parallel_backward(grads: list[torch.Tensor], weights: list[torch.Tensor],
                                kept: list[torch.Tensor], math_name: str, group_name: str,
                                dtype: torch.dtype, needs: list[bool]) -> list[torch.Tensor]:
    """Projections' backward from SP's kept shard (kept[0], sequence first), overlapped as the module
    docstring says. One operator, so that a compiler keeps this order (Inductor, given each collective's
    start and wait as operators, moved a region's all-gather after its GEMMs). grads, weights: math's
    operands, the same count a linear; needs: the input's, each weight's. Returns their gradients, in
    dtype (an empty tensor where not needed)."""
    math = MATHS[math_name]
    group = _group_of(group_name)
    tp = foundation.group_size(group)
    linears = len(needs) - 1
    grads = [tuple(grads[i::linears]) for i in range(linears)]
    weights = [tuple(weights[i::linears]) for i in range(linears)]
    shard = kept[0]
    gathered = shard.new_empty((tp * shard.shape[0], *shard.shape[1:]))
    regather = foundation.all_gather(gathered, shard, group, async_op=True)
    seq, batch = gathered.shape[:2]
    grad_input = None
    if needs[0]:
        for grad, weight in zip(grads, weights):
            grad_x = math.grad_input(grad, weight, dtype)
            grad_input = grad_x if grad_input is None else grad_input.add_(grad_x)
    regather.wait()
    kept = (gathered.movedim(0, 1).contiguous(), *kept[1:])
    if needs[0]:
        by_sequence = grad_input.view(batch, seq, -1).movedim(1, 0).contiguous()
        grad_shard = by_sequence.new_empty((seq // tp, *by_sequence.shape[1:]))
        scatter = foundation.reduce_scatter(grad_shard, by_sequence, group, async_op=True)
    # an empty tensor for each gradient not needed: an operator's outputs may not alias each other
    grad_weights = [math.grad_weight(grad, kept, dtype) if need else shard.new_empty(0, dtype=dtype)
                    for grad, need in zip(grads, needs[1:])]
    if needs[0]:
        scatter.wait()
        grad_input = grad_shard.movedim(0, 1).contiguous()
    return [grad_input if needs[0] else shard.new_empty(0, dtype=dtype), *grad_weights]


@_sequence_parallel_backward.register_fake
def _(grads, weights, kept, math_name, group_name, dtype, needs):
    shard = kept[0]
    seq, batch, dim = shard.shape
    grad_input = shard.new_empty((batch, seq, dim) if needs[0] else 0, dtype=dtype)
    linears = len(needs) - 1
    return [grad_input, *[weight.new_empty(weight.shape if need else 0, dtype=dtype)
                          for weight, need in zip(weights[:linears], needs[1:])]]


class Projections(torch.autograd.Function):
    """The linears that read one input x (q, k, v; gate, up), as one autograd node that keeps x once for
    all of them, as `math` keeps it (LinearMath: x; lesson 08: its FP8 cast). shard = (group, rank, t):
    x is SP's sequence shard, gathered here (f); it keeps only its shard of what math keeps, and its
    backward is _sequence_parallel_backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: tuple | None, math, *weights: torch.Tensor):
        shard_input = x
        if shard is not None:
            x = _gathered(x, shard[0])
        kept = math.keep(x)
        operands = [math.operands(weight) for weight in weights]
        outs = tuple(math.forward(kept, weight, operand) for weight, operand in zip(weights, operands))
        if shard is not None:  # this rank's rows of the sequence (dim 1), for the regather; the gathered x
            _, rank, tp = shard  # is freed. Where math keeps x, they are the shard it came as, kept as it
            rows = kept[0].shape[1] // tp  # is (03's elementwise recompute empties and refills it)
            mine = shard_input if kept[0] is x else kept[0].narrow(1, rank * rows, rows).clone(
                memory_format=torch.contiguous_format)  # a copy even where the rows are contiguous (b = 1)
            kept = (mine, *kept[1:])
        ctx.save_for_backward(*kept, *itertools.chain(*operands))
        ctx.sizes = [len(kept), *map(len, operands)]
        ctx.weights = weights  # read at backward: ZeRO-3 gathers them again, a saved one loses its attributes
        ctx.shard = shard
        ctx.math = math
        ctx.dtype = x.dtype
        ctx.rows = x.shape[:-1]
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # Grad mode is on here only under create_graph=True: its collectives and FP8 casts record no graph
        if torch.is_grad_enabled():
            raise RuntimeError("03's linears (tensor-parallel, lean saves, FP8) are once differentiable: "
                               "create_graph=True (a second derivative) is not supported; use nn.Linear")
        saved = ctx.saved_tensors  # once: a checkpoint's recompute answers each unpack only once
        ends = list(itertools.accumulate(ctx.sizes))
        kept, *operands = [saved[end - n:end] for n, end in zip(ctx.sizes, ends)]
        math = ctx.math
        grads = [math.grad_operand(grad) for grad in grads]  # FP8: its cast, once for both GEMMs
        weights = [math.weight_operand(weight, operand) for weight, operand in zip(ctx.weights, operands)]
        needs = [ctx.needs_input_grad[0], *ctx.needs_input_grad[3:]]
        if ctx.shard is not None:
            group_name = (ctx.shard[0] or dist.group.WORLD).group_name  # operands: each linear's first, ...
            sequence_first = [kept[0].movedim(1, 0).contiguous(), *kept[1:]]  # as the all-gather reads it
            grad_input, *grad_weights = _sequence_parallel_backward(
                [*itertools.chain(*zip(*grads))], [*itertools.chain(*zip(*weights))], sequence_first,
                type(math).__name__, group_name, ctx.dtype, needs)
        else:
            grad_input = None
            if needs[0]:
                for grad, weight in zip(grads, weights):
                    grad_x = math.grad_input(grad, weight, ctx.dtype)
                    grad_input = grad_x if grad_input is None else grad_input + grad_x
                grad_input = grad_input.view(*ctx.rows, -1)
            grad_weights = [math.grad_weight(grad, kept, ctx.dtype) if need else None
                            for grad, need in zip(grads, needs[1:])]
        outputs = [grad if need else None for grad, need in zip([grad_input, *grad_weights], needs)]
        return outputs[0], None, None, *outputs[1:]


def project(x: torch.Tensor, *linears: nn.Module, shard: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """01's project hook by Projections, with the linears' math (08's Float8Linear: its own); an empty x,
    or linears of different kinds, go each to each linear, which handles it (a shard gathered first)."""
    if x.numel() == 0 or len({type(linear) for linear in linears}) > 1:
        whole = x if shard is None else GatherSequence.apply(x, shard[0])
        return foundation.linears_of(whole, *linears)
    math = linears[0].math(x) if hasattr(linears[0], "math") else LinearMath()
    outs = Projections.apply(x, shard, math, *(linear.weight for linear in linears))
    return tuple(y if linear.bias is None else y + linear.bias for y, linear in zip(outs, linears))


def keep_sequence_shard(module: nn.Module, ctx: Context) -> nn.Module:
    """Where keeps_sequence_shard: Projections gathers the region's input (f) and keeps its shard."""
    if keeps_sequence_shard(module, ctx):
        module.project = functools.partial(project, shard=(ctx.group, ctx.rank, ctx.tp))
    return module


SPLIT_DIM = {column_parallel: 0, row_parallel: 1, vocab_parallel: 0}  # how each style splits .weight

TENSOR_PARALLEL_PLAN = {  # module name pattern -> styles; unlisted parameters stay replicated
    "embed": [vocab_parallel, exit_region],  # the partial embeddings are summed
    "layers.*.attn": [enter_region, keep_sequence_shard, exit_region],
    "layers.*.attn.[qkv]_proj": [column_parallel],  # split by (query / key-value) heads
    "layers.*.attn.out_proj": [row_parallel],
    "layers.*.mlp": [enter_region, keep_sequence_shard, exit_region],
    "layers.*.mlp.gate_proj": [column_parallel],
    "layers.*.mlp.up_proj": [column_parallel],
    "layers.*.mlp.down_proj": [row_parallel],
    "lm_head": [enter_region, column_parallel],  # the logits stay split by vocabulary
}


def split_dim(name: str, plan: dict | None = None) -> int | None:
    """The dimension `plan` splits parameter `name` (its reference name) along; None: replicated."""
    module, _, attr = name.rpartition(".")
    dims = [SPLIT_DIM[style] for pattern, styles in (plan or TENSOR_PARALLEL_PLAN).items()
            if fnmatch.fnmatchcase(module, pattern) for style in styles if style in SPLIT_DIM]
    return dims[0] if dims and attr == "weight" else None


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int, plan: dict | None = None) -> tuple[int, ...]:
    """Parameter `name`'s shape on each rank of apply_tensor_parallel(plan), padded, without building it."""
    dim = split_dim(name, plan)
    return tuple(shape) if dim is None else (*shape[:dim], -(-shape[dim] // tp), *shape[dim + 1:])


def validate_tensor_parallel(cfg, tp: int) -> None:
    """Raised identically on every rank before any collective."""
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by tp={tp}")


def validate_ties(model: nn.Module, plan: dict) -> None:
    """A parameter under several names (tied) is one shard: the plan must split it alike under each."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    for tied in names.values():
        dims = {name: split_dim(name, plan) for name in tied}
        if len(set(dims.values())) > 1:
            how = ", ".join(f"{n} {'not at all' if d is None else f'along dim {d}'}" for n, d in dims.items())
            raise ValueError(f"{' and '.join(tied)} are one tied parameter, but the plan splits them "
                             f"differently ({how}): untie them or split both ends alike")


def apply_tensor_parallel(model: nn.Module, group=None, sequence_parallel: bool = False,
                          plan: dict | None = None, check_ids: bool = True,
                          regather: bool = True) -> nn.Module:
    """Shard the lesson-01 GPT in place over `group` (each rank keeps its slice of the weights,
    broadcast over the group first); model(tokens) returns this rank's vocabulary slice of the logits,
    model(tokens, targets) the full mean loss. check_ids=False: the caller checks the ids where it
    is cheap (lesson 09: on the CPU, before they move to the GPU); regather=False: no keep_sequence_shard."""
    tp = foundation.group_size(group)
    rank = dist.get_rank(group)
    validate_tensor_parallel(model.cfg, tp)
    if any(hasattr(p, "tp_shard_dim") for p in model.parameters()):
        raise ValueError("this model is already tensor-parallel: apply_tensor_parallel once")
    plan = plan or TENSOR_PARALLEL_PLAN
    validate_ties(model, plan)
    # The logits are split by vocabulary where the plan splits the head's rows; else whole: no collective
    vocab_split = tp > 1 and split_dim("lm_head.weight", plan) == 0
    if sequence_parallel and tp > 1 and not vocab_split:
        raise ValueError("sequence parallelism needs a plan that splits lm_head's rows (enter_region, "
                         "column_parallel): a whole head would read only this rank's shard of the sequence")
    ctx = Context(group, tp, rank, sequence_parallel, regather)
    foundation.broadcast_parameters(model, group)
    vocab_size = model.cfg.vocab_size
    for name, module in list(model.named_modules()):
        for pattern, styles in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                for style in styles:
                    module = style(module, ctx)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, module)
    model.loss_fn = (VocabParallelLoss(vocab_shard(vocab_size, tp, rank)[0], vocab_size, group) if vocab_split
                     else foundation.cross_entropy_loss)
    if sequence_parallel and tp > 1:
        # a replicated parameter (the norm weights) sees only this rank's tokens: f on the parameter
        for param in model.parameters():
            if param.requires_grad and not hasattr(param, "tp_shard_dim"):
                param.register_hook(lambda grad: _all_reduced(grad, group))

    def check_inputs(_, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        tokens = None if tokens.is_floating_point() else tokens  # hidden states: a pipeline stage (09)
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        if sequence_parallel and tokens is not None and tokens.shape[1] % tp:
            raise ValueError(f"sequence length {tokens.shape[1]} is not divisible by tp={tp} "
                             f"(sequence parallelism splits the sequence)")
        # A shard would silently ignore an id no rank holds (one device raises). min/max cost a
        # device sync per step on a GPU: the price of an error instead of a wrong loss.
        for ids in (tokens, targets) if check_ids else ():
            if ids is not None and ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token and target ids must lie in [0, {vocab_size})")

    model.register_forward_pre_hook(check_inputs, with_kwargs=True)
    return model


def unshard(param: torch.Tensor, group=None, like: nn.Parameter | None = None) -> torch.Tensor:
    """The full tensor of a sharded parameter (or of its gradient: pass the parameter as `like`),
    padding removed. Replicated tensors come back as they are."""
    layout = param if like is None else like
    if not hasattr(layout, "tp_shard_dim"):
        return param.detach()
    full = _gathered(param.detach(), group, layout.tp_shard_dim)
    return full.narrow(layout.tp_shard_dim, 0, layout.tp_full_size)


# --- Training, communication and memory --------------------------------------------------------------------
def train_tensor_parallel(cfg, steps: int, global_batch: int, seq_len: int, *,
                          sequence_parallel: bool = False, regather: bool = True, microbatches: int = 1,
                          lr: float = 1e-3, adam_eps: float = 1e-8, group=None,
                          device: torch.device | str = "cpu",
                          transform=None, after=None, around_step=lambda model: contextlib.nullcontext()):
    """Every rank trains on the whole global batch with its shards. Returns the result (step-0 gradients
    and final parameters reassembled) and a meter of the steps' communication. Hooks: transform (the GPT,
    before the split: apply_lean_saves, 08's FP8), after (the split model), around_step(model)."""
    if microbatches < 1 or global_batch % microbatches:
        raise ValueError(f"global_batch={global_batch} is not divisible by microbatches={microbatches}")
    model = (transform or (lambda model: model))(foundation.GPT(cfg)).to(device)
    model = apply_tensor_parallel(model, group, sequence_parallel, regather=regather)
    model = (after or (lambda model: model))(model)
    optimizer = foundation.make_optimizer(model, lr, adam_eps)
    losses = []
    with foundation.comm_meter() as meter:
        for step in range(steps):
            tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step)
            with around_step(model):
                loss = foundation.accumulate_microbatches(model, tokens, targets, microbatches, device)
            losses.append(loss)  # .item() here would sync the GPU every step
            if step == 0:
                grads = [(n, p.grad.clone(), p) for n, p in model.named_parameters() if p.grad is not None]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    first_grads = foundation.cpu_copy((n, unshard(g, group, like=p)) for n, g, p in grads)
    params = foundation.cpu_copy((n, unshard(p, group))  # as state_dict(): a tied one under each name
                                 for n, p in model.named_parameters(remove_duplicate=False))
    return foundation.TrainResult([loss.item() for loss in losses], first_grads, params), meter


def comm_formula(cfg, batch: int, seq_len: int, sequence_parallel: bool, *, layers: int | None = None,
                 embed: bool = True, head: bool = True, microbatches: int = 1, mlp: bool = True,
                 elem_bytes: int = 4, recompute: str = "none", regather: bool = True, loss_chunks: int = 1,
                 kept_input: tuple[int, int] | None = None) -> dict[str, tuple[int, int]]:
    """op -> (calls, payload bytes) in one training step, any t > 1: the module docstring's collectives
    of activations of elem_bytes, SP's re-gathers at kept_input's bytes an element. recompute="full"
    reruns attention's g (SP: also both regions' f), not the MLP's g: each block reruns up to down_proj's
    input; "whole" (09's plan: a reentrant checkpoint, Megatron's) reruns the block to its end, the MLP's
    g too. LossInChunks: the loss's 3 on each of its loss_chunks slices that is not empty. The other
    keywords are lesson 09's, for a pipeline stage: `layers` layers, each collective once per microbatch,
    embedding and head or not, MoE layers (mlp=False: 2 a layer)."""
    layers = cfg.n_layers if layers is None else layers
    m = microbatches
    bsh = batch * seq_len * cfg.dim * elem_bytes
    kept = elem_bytes if kept_input is None else kept_input[0]
    slices = min(loss_chunks, batch // m * seq_len)  # none empty
    loss = (3 * head * m * slices, 3 * head * batch * seq_len * 4)  # (calls, bytes): 3 fp32 numbers a token
    activations = (2 + 2 * mlp) * layers + embed + head
    norms = 2 * layers + head
    again = layers if recompute in ("full", "whole") else 0
    mlp_again = layers * mlp if recompute == "whole" else 0  # the MLP's g, after down_proj
    if not sequence_parallel:
        calls = activations + again + mlp_again
        return {"all_reduce": (m * calls + loss[0], calls * bsh + loss[1])}
    gathers = activations + again * (1 + mlp)
    scatters = activations + again + mlp_again
    regathers = (1 + mlp) * layers * regather
    gathered = gathers * bsh + regathers * batch * seq_len * cfg.dim * kept
    return {"all_gather": (m * (gathers + regathers), gathered),
            "reduce_scatter": (m * scatters, scatters * bsh),
            "all_reduce": (m * norms + loss[0], m * norms * cfg.dim * elem_bytes + loss[1])}


# --- Activation memory, and recompute: a second forward instead of the activations backward would keep -----
RECOMPUTE_MODES = ("none", "selective", "elementwise", "op", "full")


def recomputed(fn: Callable, policy: Callable = torch.utils.checkpoint.noop_context_fn) -> Callable:
    """fn whose intermediate results are recomputed from its saved inputs when backward reaches it
    (collectives inside fn run again, in the same order on every rank: TP and CP stay correct)."""
    return functools.wraps(fn)(functools.partial(checkpoint, fn, use_reentrant=False, context_fn=policy))


def odd_matmuls_and_attention():  # "op": keep odd matmuls' and attention's outputs (forward, rerun alike)
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)  # 08's FP8 GEMMs on a GPU
    calls = collections.Counter()  # matmuls so far: in the forward, in its rerun
    def policy(ctx, op, *args, **kwargs):  # noqa: E306
        calls[ctx.is_recompute] += op in matmuls
        keep = "attention" in str(op) or op in matmuls and calls[ctx.is_recompute] % 2
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """The module docstring's modes, whichever attention function is plugged in. Parameter names stay
    (the wrappers are attributes); ZeRO-3 still gathers a block's parameters before its recompute."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} must be one of {RECOMPUTE_MODES}")
    if getattr(model, "recompute", "none") != "none":
        raise ValueError(f"this model already recomputes ({model.recompute}): apply_recompute once")
    if mode == "elementwise" and not getattr(model, "lean_saves", False):
        raise ValueError("recompute elementwise rebuilds the norms' outputs and SwiGLU's product from what "
                         "lean saves keep: apply_lean_saves first")
    model.recompute = mode
    for block in model.layers.values():
        if mode == "selective":
            block.attn.attn_fn = recomputed(block.attn.attn_fn)
        elif mode == "elementwise":
            recompute_elementwise(block)
        elif mode != "none":  # full, or op's policy
            block.forward = recomputed(block.forward, *[odd_matmuls_and_attention] * (mode == "op"))
    return model


class RMSNormKeepingInput(torch.autograd.Function):
    """01's RMSNorm y = (x r) w, r = 1/rms(x) in fp32, keeping only x and r (Transformer Engine's,
    PyTorch's fused rms_norm). dL/dx = r (g - x r mean(g x r)) with g = dL/d(x r) = dL/dy w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.type_as(x)).sum_to_size(weight.shape)
        g = (grad * weight).float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class SwiGLUKeepingInputs(torch.autograd.Function):
    """01's swiglu, silu(gate) x up, keeping only gate and up (Megatron's fused SwiGLU): backward recomputes
    silu(gate), which autograd keeps beside gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return foundation.swiglu(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # silu' = s (1 + gate (1 - s)), s = sigmoid(gate): the kernel autograd's own silu backward runs
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, F.silu(gate).mul_(grad)  # in place: no more temporaries than autograd's


def lean_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return RMSNormKeepingInput.apply(x, norm.weight, norm.eps)


def refill_in_backward(output: torch.Tensor, rebuild: Callable[[], torch.Tensor],
                       region_output: torch.Tensor) -> None:
    """Megatron's CheckpointWithoutOutput: output's storage is emptied now (its region has run) and
    refilled with rebuild()'s values, bitwise the same, when the gradient reaches region_output, before
    the region's backward reads it. Until then nothing may read output (a forward hook that logs it
    would crash on the empty storage)."""
    storage = output.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    pending = [storage, rebuild]  # dropped once refilled: the graph keeps this hook past backward

    def refill(grad: torch.Tensor) -> None:
        if not pending:  # a second backward of a kept graph (zb-h1's W pass): refilled already
            return
        storage, rebuild = pending
        pending.clear()
        with torch.no_grad():
            rebuilt = rebuild()
        storage.resize_(nbytes)
        storage.copy_(rebuilt.untyped_storage())  # the storage, not the tensor: its version stays

    region_output.register_hook(refill)


def recompute_elementwise(block: nn.Module) -> None:
    """The "elementwise" mode on one block (under 06's MoE the norms' outputs only: its experts keep their
    own inputs). It hooks the block's modules as they are now: apply it after every transform."""
    made = {}  # what this forward made: the norms' (input, output), SwiGLU's (gate, up, product)

    def remember_norm(norm: nn.Module, args: tuple, output: torch.Tensor) -> None:
        made[norm] = (args[0], output)

    def swiglu_remembered(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        made["swiglu"] = (gate, up, SwiGLUKeepingInputs.apply(gate, up))
        return made["swiglu"][2]

    def empty_after(norm: nn.Module, region: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x, normed = made.pop(norm)
        if not output.requires_grad:  # no backward will read them
            made.pop("swiglu", None)
            return
        refill_in_backward(normed, functools.partial(lean_rms_norm, norm, x), output)
        if "swiglu" in made:
            gate, up, product = made.pop("swiglu")
            refill_in_backward(product, functools.partial(foundation.swiglu, gate, up), output)

    for norm, region in ((block.attn_norm, block.attn), (block.mlp_norm, block.mlp)):
        norm.register_forward_hook(remember_norm)
        region.register_forward_hook(functools.partial(empty_after, norm))
    if isinstance(block.mlp, foundation.SwiGLU):
        block.mlp.gated = swiglu_remembered


def apply_lean_saves(model: nn.Module) -> nn.Module:
    """Every block's norms and SwiGLU keep only what their backward reads (06's MoE keeps its own)."""
    if getattr(model, "lean_saves", False):
        raise ValueError("this model already keeps lean saves: apply_lean_saves once")
    model.lean_saves = True
    for block in model.layers.values():
        for norm in (block.attn_norm, block.mlp_norm):
            norm.forward = functools.partial(lean_rms_norm, norm)
        if isinstance(block.mlp, foundation.SwiGLU):
            block.mlp.gated = SwiGLUKeepingInputs.apply
    return model


def activation_bytes(run: Callable[[], torch.Tensor], params: Iterable[torch.Tensor], device: torch.device,
                     inside: Iterable[nn.Module] = (), at_end: bool = False) -> tuple[torch.Tensor, int]:
    """run()'s result and the most activation bytes it held for backward at once (at_end: those it
    still held when it returned, after "elementwise" emptied what it rebuilds in backward). CPU: the
    tensors autograd saves, each storage counted from its saving until backward frees it, at its size
    (0 while emptied), parameters excluded (inside: only those saved in these modules' forwards). GPU:
    the peak allocated above what was allocated before (temporaries too), or what is allocated at the end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = run()
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) if at_end else torch.cuda.max_memory_allocated(device)
        return out, held - before
    params = list(params)
    inside = list(inside)
    saved_on = collections.Counter()  # storage -> saved tensors on it: it counts while > 0
    live = {}  # storage -> the storage, while it counts
    count = collections.Counter()  # the peak of the bytes held; depth: inside those modules' forwards

    def held() -> int:
        return sum(storage.nbytes() for storage in live.values())

    class Saved:  # what autograd keeps instead of the tensor: dropped when backward frees it
        def __init__(self, t: torch.Tensor) -> None:
            # detached: a saved output kept as itself would hold its own grad_fn (a reference cycle)
            self.tensor = t.detach()
            storage = t.untyped_storage()
            self.key = storage._cdata  # the storage itself: an emptied one has no data pointer
            live[self.key] = storage
            saved_on[self.key] += 1
            count["peak"] = max(count["peak"], held())

        def __del__(self) -> None:
            saved_on[self.key] -= 1
            if not saved_on[self.key]:
                del live[self.key]

    def pack(t: torch.Tensor):
        weights = {p.untyped_storage().data_ptr() for p in params}  # ZeRO-3 gathers them anew
        counted = (count["depth"] or not inside) and t.untyped_storage().data_ptr() not in weights
        return Saved(t) if counted else t

    def unpack(saved):
        return saved.tensor if isinstance(saved, Saved) else saved

    hooks = [h for m in inside for h in (m.register_forward_pre_hook(lambda *_: count.update(depth=1)),
                                         m.register_forward_hook(lambda *_: count.subtract(depth=1)))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = run()
    finally:
        for hook in hooks:
            hook.remove()
    return out, held() if at_end else count["peak"]


def measure_layer(cfg, batch: int, seq_len: int, sequence_parallel: bool, device: torch.device | str = "cpu",
                  lean: bool = False, regather: bool = True, context: Callable = contextlib.nullcontext,
                  recompute: str = "none") -> tuple[int, "foundation.CommMeter"]:
    """Layer 0 of the tensor-parallel GPT (lean saves or not, a recompute mode), forward and backward on this
    rank's (b, s, h) (SP: (b, s/t, h)) activations: the bytes autograd saves for backward (activation_bytes:
    on a CPU, not the outputs "op"'s policy keeps outside autograd) and its collectives. context(split model)
    yields the model to run (lesson 08's: its FP8 linears, each weight cast once, as a training step does)."""
    model = foundation.GPT(cfg).to(device)
    model = apply_tensor_parallel(apply_lean_saves(model) if lean else model, None, sequence_parallel,
                                  regather=regather)
    model = apply_recompute(model, recompute)
    shards = dist.get_world_size() if sequence_parallel else 1
    x = torch.randn(batch, seq_len // shards, cfg.dim, device=device, requires_grad=True)
    cos, sin = foundation.rope_angles(torch.arange(seq_len, device=device), cfg.head_dim, cfg.rope_theta)
    with context(model) as run_model, foundation.comm_meter() as meter:
        layer = run_model.layers["0"]
        out, saved = activation_bytes(lambda: layer(x, cos, sin), layer.parameters(), torch.device("cpu"),
                                      at_end=True)
        out.sum().backward()
    return saved, meter


def layer_activation_formula(cfg, batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                             mode: str = "none", elem_bytes: int = 4, attention_saves: int | None = None,
                             layers: int = 1, *, lean: bool = False, regather: bool = True,
                             kept_input: tuple[int, int] | None = None) -> int:
    """The bytes `layers` consecutive layers of one forward save per rank: the module docstring's
    ACTIVATION MEMORY and RECOMPUTE for activations of elem_bytes (f = ffn_dim). Without recompute:
    - each norm: 1/rms (s b, fp32) and its input, in fp32 with x / rms too (lean: as it is), split by t
      along the sequence with SP;
    - each region's input, kept by its column-parallel linears: with SP the gathered one, or with
      regather this rank's sequence shard of it;
    - sharded by t: q, k and v (K/V unrepeated); out_proj's input, the attention's output; the MLP's
      gate, up (autograd: and silu(gate)) and down_proj's input;
    - attention_saves bytes the attention function keeps beyond q, k, v (default: SDPA's and lesson
      07's fp32 log-sum-exp, one per query head and token, and its output where out_proj keeps a copy).
    kept_input = (bytes an element, bytes a tensor): each linear keeps a copy of its input instead (08's
    Float8Linear: its FP8 cast and scale), which "elementwise" does not rebuild. "op" keeps q, v, gate,
    attention's output and saves, and down_proj's (b s h partial sums). The layers share the RoPE tables."""
    sb = seq_len * batch  # the paper's letters: s b tokens of h = dim features, e bytes each
    h = cfg.dim
    f = cfg.ffn_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    e = elem_bytes
    kept = e if kept_input is None else kept_input[0]
    attention = 4 * sb * cfg.n_heads // tp if attention_saves is None else attention_saves
    per_layer = e * sb * h // (tp if sequence_parallel else 1)  # "full"'s: the block's input
    per_layer += (mode == "op") * (e * sb * ((2 * h + kv + f) // tp + h) + attention)
    if mode in ("none", "selective", "elementwise"):
        split = tp if sequence_parallel else 1
        norms = 2 * ((e if lean else 4 + e) * sb * h + 4 * sb)
        regions = 2 * kept * sb * h // (split if regather else 1)
        down_input = kept * f
        if mode == "elementwise" and kept_input is None:  # the norms' outputs, where the linears kept them
            gathered_copy = tp > 1 and sequence_parallel and not regather  # kept instead: not rebuilt
            regions = regions if gathered_copy else 0
            down_input = 0  # SwiGLU's product
        sharded = sb * (e * (h + 2 * kv) + kept * h + down_input + (2 if lean else 3) * e * f) // tp
        if kept_input is not None and attention_saves is None:  # SDPA's output, not out_proj's input
            attention += e * sb * h // tp
        scales = 4 * (0 if kept_input is None else kept_input[1])  # of the 4 linears' inputs
        per_layer = norms // split + regions + sharded + scales + (0 if mode == "selective" else attention)
    return layers * per_layer + (4 * seq_len * cfg.head_dim if layers else 0)  # the RoPE tables


def korthikanti_bytes(cfg, batch: int, seq_len: int, tp: int, sequence_parallel: bool) -> float:
    """The paper's per-layer activations (GPT-3 layer, 16-bit, attention scores stored)."""
    sbh = seq_len * batch * cfg.dim
    scores = 5 * cfg.n_heads * seq_len / cfg.dim  # 5 a s / h
    return sbh * (34 + scores) / tp if sequence_parallel else sbh * (10 + (24 + scores) / tp)


# --- RUN IT: the demo, the benchmark against DTensor, the command line ------------------------------------
DEMO_MODEL = dict(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=176)  # grouped-query: 2 queries per K/V
BENCH_MODEL = dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)


def demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    tp = dist.get_world_size()
    cfg = foundation.ModelConfig(vocab_size=args.vocab, **DEMO_MODEL)
    b, s = args.batch, args.seq_len  # the batch's shape
    bsh = b * s * cfg.dim * 4  # one fp32 activation
    label = {False: "TP", True: "TP + SP"}
    # with SP or not: (result, the steps' meter, layer 0's saved bytes, layer 0's meter)
    runs = {sp: (*train_tensor_parallel(cfg, args.steps, b, s, sequence_parallel=sp, device=device),
                 *measure_layer(cfg, b, s, sp, device)) for sp in (False, True)}
    kept = {  # layer 0's saved bytes: (label, SP, lean, regather, recompute) -> measured
        ("TP, autograd's saves", False, False, True, "none"): runs[False][2],
        ("TP + SP, each region's input gathered", True, False, False, "none"):
            measure_layer(cfg, b, s, True, device, regather=False)[0],
        ("TP + SP, its shard, re-gathered", True, False, True, "none"): runs[True][2],
        ("TP + SP, re-gathered, lean saves", True, True, True, "none"):
            measure_layer(cfg, b, s, True, device, lean=True)[0],
        ("... and elementwise recompute", True, True, True, "elementwise"):
            measure_layer(cfg, b, s, True, device, lean=True, recompute="elementwise")[0]}
    if dist.get_rank() != 0:
        foundation.exit_distributed()
    reference = foundation.train_single_device(cfg, args.steps, b, s, device=device)
    print(f"Tensor parallelism over tp={foundation.counted(tp, 'rank')} ({dist.get_backend()}, "
          f"{device.type}): {foundation.counted(cfg.n_layers, 'layer')}, dim {cfg.dim}, {cfg.n_heads} "
          f"query / {foundation.counted(cfg.n_kv_heads, 'key-value head')}, ffn {cfg.ffn_dim}, vocab "
          f"{cfg.vocab_size} (padded to {math.ceil(cfg.vocab_size / tp) * tp}); batch {b} x {s} tokens, "
          f"{foundation.counted(args.steps, 'AdamW step')}.\n")
    print(f"{'step':<6}{'TP':>12}{'TP + SP':>12}{'single device':>16}")
    for step in range(args.steps):
        print(f"{step:<6}" + "".join(f"{result.losses[step]:>12.6f}" for result, *_ in runs.values())
              + f"{reference.losses[step]:>16.6f}")
    print(f"\n{'max |difference| from one device':<42}{'step-0 gradients':>18}{'end parameters':>16}")
    for sp, (result, *_) in runs.items():
        _, grads, params = result.max_differences(reference)
        print(f"  {label[sp]:<40}{grads:>18.2e}{params:>16.2e}")
    print(foundation.lone_token_note(args.seq_len), end="")
    megatron = 4 * foundation.ring_traffic("all_reduce", bsh, tp)  # 4 all-reduces of b s h per layer
    regathers = 2 * foundation.ring_traffic("all_gather", bsh, tp)  # SP: each region's input, in backward
    print(f"\ncommunication, b x s x h = {bsh:,} B{'calls':>16}{'payload':>12}{'traffic per rank':>19}"
          + ("" if tp > 1 else ": none at tp = 1"))
    for sp, (_, meter, _, layer) in runs.items():
        for op, expected in (comm_formula(cfg, b, s, sp) if tp > 1 else {}).items():
            calls = meter.calls(op) // args.steps
            payload = meter.payload(op) // args.steps
            traffic = float(meter.traffic(op)) / args.steps
            print(f"  {label[sp]:<8} a step: {op:<15}{calls:>6}{payload:>10,} B{traffic:>17,.0f} B"
                  + ("  = formula" if (calls, payload) == expected else "  MISMATCH with formula"))
        ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        measured = sum(layer.traffic(op) for op in ops)
        formula = megatron + (regathers if sp else 0)
        print(f"  {label[sp]:<8} a layer: " + " + ".join(f"{layer.calls(op)} {op}" for op in ops)
              + f" = {float(measured):,.0f} B; 4 all-reduces" + (" + 2 re-gathers" if sp else " (Megatron's)")
              + f": {float(formula):,.0f} B" + ("  = formula" if measured == formula else "  MISMATCH"))
    print(f"\nactivations saved by one layer, per rank:{'measured (fp32)':>18}{'our formula':>14}"
          f"{'Korthikanti, GPT-3 16-bit layer':>34}")
    for (name, sp, lean, regather, recompute), saved in kept.items():
        formula = layer_activation_formula(cfg, b, s, tp, sp, recompute, lean=lean, regather=regather)
        paper = korthikanti_bytes(cfg, b, s, tp, sp)
        print(f"  {name:<40}{saved:>16,} B{formula:>12,} B{paper:>32,.0f} B")
    print(f"  tp = 1 for scale: {layer_activation_formula(cfg, b, s, 1, False):,} B")
    foundation.exit_distributed()


def dtensor_plan(sequence_parallel: bool) -> dict:
    """TENSOR_PARALLEL_PLAN in PyTorch's DTensor vocabulary (torchtitan's Llama plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    between = Shard(1) if sequence_parallel else Replicate()  # the layout outside the regions
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "layers.*.attn.[qkv]_proj": ColwiseParallel(),
            "layers.*.attn.out_proj": RowwiseParallel(output_layouts=between),
            "layers.*.mlp.gate_proj": ColwiseParallel(), "layers.*.mlp.up_proj": ColwiseParallel(),
            "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=between),
            "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                       use_local_output=False)}
    if sequence_parallel:  # norms on sequence shards, each region's input gathered
        plan |= {"layers.*.*_norm": SequenceParallel(), "norm": SequenceParallel(),
                 "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),  # None: RoPE
                                                     desired_input_layouts=(Replicate(), None, None)),
                 "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),))}
    return plan


def bench(args: argparse.Namespace) -> None:
    """Ours against DTensor parallelize_module on the same model and batch, interleaved rounds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    device = foundation.init_distributed()
    tp = dist.get_world_size()
    cfg = foundation.ModelConfig(**BENCH_MODEL)
    mesh = init_device_mesh(device.type, (tp,))
    tokens, targets = (t.to(device) for t in foundation.synthetic_batch(cfg, args.bench_batch, 128, 0))
    models = {}
    for sp in (False, True):
        models["ours", sp] = apply_tensor_parallel(foundation.GPT(cfg).to(device), None, sp)
        models["DTensor", sp] = parallelize_module(foundation.GPT(cfg).to(device), mesh, dtensor_plan(sp))
    # eps 1e-6 as in the tests: Adam would magnify rounding on tiny gradients (see 01_ddp.py)
    optimizers = {key: foundation.make_optimizer(model, 1e-3, 1e-6) for key, model in models.items()}
    losses = {key: [] for key in models}

    def step(key) -> None:
        with loss_parallel() if key[0] == "DTensor" else contextlib.nullcontext():
            loss = models[key](tokens, targets)
            loss.backward()
        losses[key].append(loss.full_tensor() if key[0] == "DTensor" else loss.detach())
        optimizers[key].step()
        optimizers[key].zero_grad(set_to_none=True)

    med = foundation.interleaved_medians({key: functools.partial(step, key) for key in models},
                                         args.bench_rounds, args.bench_steps, device)
    params = {key: {n: (p.full_tensor() if isinstance(p, DTensor) else unshard(p)).detach().cpu()
                    for n, p in model.named_parameters()} for key, model in models.items()}
    if dist.get_rank() == 0:
        print(f"TP step time on {foundation.counted(tp, 'rank')} ({dist.get_backend()}, {device.type}), "
              f"{sum(p.numel() for p in params['ours', False].values()) / 1e6:.1f}M parameters, batch "
              f"{args.bench_batch} x 128, {foundation.median_of(args)}; both "
              f"trained the same {foundation.counted(len(losses['ours', False]), 'step')} on the same batch:")
        for sp in (False, True):
            ours = ("ours", sp)
            theirs = ("DTensor", sp)
            loss_diff = max(abs(a - b).item() for a, b in zip(losses[ours], losses[theirs], strict=True))
            times = foundation.ratio_line({"ours": med[ours], "DTensor": med[theirs]})
            print(f"  {'TP + SP' if sp else 'TP':<8} {times}; max |loss difference| {loss_diff:.1e}, "
                  f"max |parameter difference| {foundation.max_abs_diff(params[ours], params[theirs]):.1e}")
    foundation.exit_distributed()


@dataclass
class Options:
    steps: int = foundation.option(3, "AdamW steps, with and without SP, and of the reference", ">= 1")
    batch: int = foundation.option(4, "sequences per step (every tp rank sees them all)", ">= 1")
    seq_len: int = foundation.option(32, "tokens per sequence (SP: divisible by the ranks)", ">= 1")
    vocab: int = foundation.option(127, "vocabulary size; not a multiple of tp: padded", ">= 1")
    bench: bool = foundation.option(False, "step time against DTensor")
    bench_batch: int = foundation.option(4, "--bench: sequences of 128 tokens per step", ">= 1")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options, foundation.Ranks, foundation.BenchRounds),
                                            defaults=dict(bench_steps=3))
    if args.bench:  # tp divides its 4 key-value heads, so its 128 tokens too: SP can split them
        heads = functools.partial(validate_tensor_parallel, foundation.ModelConfig(**BENCH_MODEL))
        foundation.launch_lesson(parser, args, bench, rules=[heads])
        return
    cfg = foundation.ModelConfig(vocab_size=args.vocab, **DEMO_MODEL)
    heads = functools.partial(validate_tensor_parallel, cfg)
    # rank 0's one-device reference keeps every layer's activations (--batch 100000 passed a rule without
    # them, and the kernel killed a rank 101 s in)
    saved = {"the reference's activations": layer_activation_formula(cfg, args.batch, args.seq_len, 1, False,
                                                                     layers=cfg.n_layers)}
    memory = functools.partial(foundation.check_memory, cfg, args.batch, args.seq_len, more=saved,
                               what=f"--batch {args.batch} x --seq-len {args.seq_len}, --vocab {args.vocab}")
    foundation.launch_lesson(parser, args, demo, divisible={"--seq-len": args.seq_len},  # SP splits it
                             rules=[heads, memory])


if __name__ == "__main__":
    main()
