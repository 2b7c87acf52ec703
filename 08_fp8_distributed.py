"""Lesson 08, second part: FP8 in distributed training - ZeRO-3 all-gathers in FP8, FP8 under TP.

08_fp8.py made one device's linear layers compute in FP8. Spread over ranks, two things change: a
weight that ZeRO-3 shards can travel in FP8, a quarter of fp32's bytes; and a tensor that TP splits
must still be scaled as one device scales the whole tensor, or every FP8 number differs.

FP8 COMMUNICATION (ZeRO-3, lesson 02; torchao's "float8 all-gather"). A weight does not change
inside an optimizer step: cast it once per step (weights_cast_once), and, sharded, before the
all-gather: one all-reduce (MAX) of each rank's amaxes of its pieces gives every weight's global
amax, so each rank casts its piece with the whole weight's scale, and the gathered bytes are bit
for bit the whole weight's cast, wherever the shard boundaries fall. Per step, for Psi_8
Float8Linear weight elements, N ranks, m microbatches: all-gathers of 2m (N-1)/N x 1 B x Psi_8
instead of 2 B (bf16) or 4 B (fp32), plus 2 (N-1)/N x 4 B per weight for the amaxes; each rank
keeps its cast shard (Psi_8 / N B). Gradients reduce-scatter in full precision (Float8ZeRO).

FP8 UNDER TENSOR PARALLELISM (lesson 03; torchao's float8 on DTensor). A rank scaling by its own
piece of a split tensor casts with another scale than one device, so every amax of a split tensor
is the MAX over the tp group (tensor_parallel_scales): the weights' (once per step) and, per call,
the operand split where it is cast: a column-parallel layer's output gradient, a row-parallel one's
input, both for a layer 03 leaves whole on sequence shards (SP). Per step, L layers, m microbatches:
2 (t-1)/t x 4 B x L (7 + 7 m), the amaxes of 7 weights and 7 split operands a layer. These make
every FP8 number of a step's casts one device's; the split sums still add in another order, and
where that moves a value across an e4m3 rounding boundary (rare), AdamW turns the flip into an
lr-sized move of that element: the runs stay close to one device's, not bit for bit.

RUN IT
    python 08_fp8_distributed.py            # CPU: 4 local ranks (--nproc), a few seconds: ZeRO-3 of the
                                            # FP8 GPT with fp32 vs FP8 all-gathers, then FP8 under TP
    torchrun --nproc_per_node=4 08_fp8_distributed.py
Look at: the weights' all-gather bytes at a quarter, beside the formula, no bit changed; under TP, the
amaxes' bytes beside the formula, and the distance from one device's FP8 run with whole-tensor scales
and without them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
from fractions import Fraction
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
tensor_parallel = importlib.import_module("03_tensor_parallel")
fp8 = importlib.import_module("08_fp8")

AMAX_BYTES = 4  # an fp32 amax


# ----------------------------------------------------------------------------------------------
# FP8 communication: each weight cast once per step; ZeRO-3 all-gathers the casts
# ----------------------------------------------------------------------------------------------


def float8_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of model's Float8Linear layers, each once."""
    return list(dict.fromkeys(m.weight for m in model.modules() if isinstance(m, fp8.Float8Linear)))


@contextlib.contextmanager
def weights_cast_once(model: nn.Module) -> Iterator[None]:
    """Around one optimizer step's forward and backward passes: each Float8Linear weight is cast on
    entry, used inside, dropped on exit. Whole weights only (Float8ZeRO casts ZeRO-3's shards); under
    TP one all-reduce (MAX) of all their amaxes gives each the whole weight's scale."""
    weights, group = float8_weights(model), tensor_parallel_group(model)
    if any(w.numel() == 0 for w in weights):
        raise ValueError("weights_cast_once needs whole weights, not ZeRO-3's released ones: "
                         "Float8ZeRO casts their shards once per step")
    try:
        if weights:
            amaxes = torch.stack([w.detach().float().abs().amax() for w in weights])
            if group is not None:
                amaxes = fp8.all_reduce_amax(amaxes, group)
            for w, scale in zip(weights, fp8.amax_to_scale(amaxes, fp8.E4M3).view(-1, 1, 1), strict=True):
                w.float8_cast = fp8.cast_to_fp8(w.detach(), scale, fp8.E4M3), scale
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
        for p, shape, cast, scale in zip(self.params, self.shapes, self.views(flat.view(fp8.E4M3)),
                                         self.scales, strict=True):
            p.data = self.released.new_zeros(()).expand(shape)
            p.float8_cast = (cast, scale.view(1, 1))

    def release(self) -> None:
        for p in self.params:
            p.float8_cast = None
        super().release()


class Float8ZeRO(zero.ZeRO):
    """ZeRO-3 of model's Float8Linear weights, all-gathered in FP8 (the docstring's FP8
    COMMUNICATION); everything else is lesson 02's. The other parameters need a ZeRO of their own,
    both clipped by one norm: train_float8_zero shows the pair. clip_and_update recasts the shards."""

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
        """Each piece of a weight here cast with the whole weight's scale: one all-reduce (MAX) of
        all the pieces' amaxes (under TP a second one, over tp)."""
        pieces = [unit.shard[piece].float() for unit in self.units for piece in unit.pieces()]
        nothing = torch.zeros((), device=pieces[0].device)  # the amax of a weight with no piece here
        amaxes = torch.stack([piece.abs().amax() if piece.numel() else nothing for piece in pieces])
        amaxes = fp8.all_reduce_amax(amaxes, self.group)
        if self.tensor_parallel_group is not None:
            amaxes = fp8.all_reduce_amax(amaxes, self.tensor_parallel_group)
        scales = iter(fp8.amax_to_scale(amaxes, fp8.E4M3))
        for unit in self.units:
            unit.cast_shard = torch.zeros_like(unit.shard, dtype=torch.uint8)
            unit.scales = tuple(next(scales) for _ in unit.params)
            for piece, scale in zip(unit.pieces(), unit.scales):
                if piece.start < piece.stop:
                    cast = fp8.cast_to_fp8(unit.shard[piece], scale, fp8.E4M3)
                    unit.cast_shard[piece] = cast.view(torch.uint8)
                    self.weight_casts += 1
            unit.cast_version = unit.master._version

    def held_bytes(self) -> dict[str, int]:
        held = super().held_bytes()  # + the cast shards and the scales
        casts = [t for u in self.units for t in (u.cast_shard, *u.scales)]
        held["params"] += zero.storage_bytes(casts, set())
        return held

    def memory_formula(self) -> dict[str, Fraction]:
        formula = super().memory_formula()  # + 1 B per element of the shard, 4 B per weight's scale
        padded, n_weights = sum(u.padded for u in self.units), sum(len(u.params) for u in self.units)
        formula["params"] += Fraction(padded, self.world) + AMAX_BYTES * n_weights
        return formula


def float8_zero_traffic(padded: int, n_weights: int, n: int, grad_bytes: int = 4) -> dict[str, Fraction]:
    """Ring bytes one rank sends per step (one microbatch) for Float8ZeRO's padded weights: 02's
    ZeRO-3 traffic with 1 B parameters, and the amaxes' all-reduce (the clipping norm's aside)."""
    traffic = zero.zero_traffic_per_step(padded, n, 3, param_bytes=1, grad_bytes=grad_bytes)
    return {**traffic, "all_reduce": Fraction(2 * (n - 1), n) * AMAX_BYTES * n_weights}


FLOAT8_ZERO_MODES = ("unsharded", "zero3", "zero3-fp8")


def train_float8_zero(cfg: foundation.ModelConfig, steps: int, global_batch: int, seq_len: int, *, mode: str,
                      microbatches: int = 1, lr: float = 1e-3, adam_eps: float = 1e-8, group=None,
                      device: torch.device | str = "cpu") -> tuple[zero.ZeroResult, foundation.CommMeter]:
    """02's train_zero for the FP8 GPT, in microbatches. mode "unsharded": data parallel (ZeRO-0),
    each weight cast once per step; "zero3": 02's ZeRO-3, fp32 all-gathers, a cast in each forward;
    "zero3-fp8": the weights under Float8ZeRO. stats: padded elements and casts."""
    world, rank = foundation.group_size(group), dist.get_rank(group)
    if mode not in FLOAT8_ZERO_MODES:
        raise ValueError(f"mode={mode!r} must be one of {FLOAT8_ZERO_MODES}")
    if microbatches < 1 or global_batch % (world * microbatches):
        raise ValueError(f"global_batch={global_batch} is not divisible by the group size x microbatches "
                         f"= {world} x {microbatches}")
    model = fp8.convert_to_float8(foundation.GPT(cfg)).to(device)
    weights, settings = set(float8_weights(model)), dict(lr=lr, adam_eps=adam_eps)
    if mode == "unsharded":
        zeros = [zero.ZeRO(model, 0, group, **settings)]
    else:
        rest = zero.ZeRO(model, 3, group, owns=lambda p: p not in weights, **settings)
        zeros = [rest, Float8ZeRO(model, group, **settings) if mode == "zero3-fp8"
                 else zero.ZeRO(model, 3, group, owns=lambda p: p in weights, **settings)]
    initial_casts = getattr(zeros[-1], "weight_casts", 0)
    result, steps_meter, local_losses = zero.ZeroResult([], {}, {}), foundation.CommMeter(), []
    for step in range(steps):
        tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step, rank, world)
        with foundation.comm_meter() as meter:
            with contextlib.ExitStack() as accumulate:
                for zero_opt in zeros:
                    accumulate.enter_context(zero_opt.no_sync())
                if mode == "unsharded":
                    accumulate.enter_context(weights_cast_once(model))
                loss = 0.0
                for x, y in zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True):
                    microbatch_loss = model(x.to(device), y.to(device)) / microbatches
                    microbatch_loss.backward()
                    loss += microbatch_loss.detach()
            for zero_opt in zeros:
                zero_opt.finish_gradient_sync()
        if step == 0:
            for zero_opt in zeros:
                result.first_grads.update(zero_opt.gather_full([u.grad_shard for u in zero_opt.units]))
        with foundation.comm_meter() as update_meter:
            squares = sum(zero_opt.grad_squares() for zero_opt in zeros)
            for zero_opt in zeros:
                zero_opt.clip_and_update(squares)
                zero_opt.zero_grad()
        steps_meter += meter
        steps_meter += update_meter
        local_losses.append(loss)
    losses = torch.stack(local_losses).double()
    foundation.all_reduce(losses, group=group)
    result.losses = (losses / world).tolist()
    result.params = {k: v for z in zeros for k, v in z.full_state_dict()["params"].items()}
    result.stats = dict(padded=[sum(u.padded for u in z.units) for z in zeros], n_weights=len(weights),
                        weight_casts=getattr(zeros[-1], "weight_casts", 0) - initial_casts)
    return result, steps_meter


# ----------------------------------------------------------------------------------------------
# FP8 under tensor parallelism: every scale the whole tensor's
# ----------------------------------------------------------------------------------------------


def tensor_parallel_scales(model: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """After lesson 03 split model over group: each Float8Linear takes the scales one device would
    (the docstring's FP8 UNDER TENSOR PARALLELISM; a layer whole on SP's sequence shards: 06's router)."""
    if foundation.group_size(group) == 1:
        return model
    group = dist.group.WORLD if group is None else group  # None: torch's default group, the world
    column, row = (tensor_parallel.SPLIT_DIM[style] for style in (tensor_parallel.column_parallel,
                                                                  tensor_parallel.row_parallel))
    for layer in model.modules():
        if isinstance(layer, fp8.Float8Linear):
            dim = getattr(layer.weight, "tp_shard_dim", None)
            on_shards = dim is None and sequence_parallel  # whole, outside the regions
            split = (dim == row or on_shards, True, dim == column or on_shards)  # x, weight, grad
            layer.amax_groups = tuple(group if is_split else None for is_split in split)
    return model


def tensor_parallel_group(model: nn.Module):
    """The group model's Float8Linear layers reduce their amaxes over (tensor_parallel_scales), or None."""
    groups = {layer.amax_groups[1] for layer in model.modules() if isinstance(layer, fp8.Float8Linear)}
    if len(groups) > 1:
        raise ValueError(f"the Float8Linear layers of one model reduce amaxes over {len(groups)} different "
                         f"groups: tensor_parallel_scales once, after apply_tensor_parallel")
    return next(iter(groups), None)


def tensor_parallel_amax_traffic(tp: int, layers: int, microbatches: int = 1, *, mlp: bool = True,
                                 sequence_parallel: bool = False, recompute: str = "none") -> Fraction:
    """Bytes one rank sends per step in tensor_parallel_scales' all-reduces (4 B amaxes) over tp
    ranks for `layers` layers: every weight's amax once per step; per microbatch and layer, one for
    each split operand: the output gradients of q, k, v, gate, up and the inputs of out, down.
    mlp=False (06's MoE layers): attention's 4, with SP the router's input and output gradient.
    recompute="full" casts each layer's row-parallel inputs (SP: the router's) again in backward."""
    weights = 7 if mlp else 5  # q, k, v, out + gate, up, down | the router
    split = 7 if mlp else 4 + 2 * sequence_parallel
    again = (2 if mlp else 1 + sequence_parallel) if recompute == "full" else 0
    return Fraction(2 * (tp - 1), tp) * AMAX_BYTES * layers * (weights + microbatches * (split + again))


def train_float8_tensor_parallel(cfg: foundation.ModelConfig, steps: int, global_batch: int, seq_len: int, *,
                                 sequence_parallel: bool = False, microbatches: int = 1,
                                 whole_tensor_scales: bool = True, lr: float = 1e-3, adam_eps: float = 1e-8,
                                 group=None, device: torch.device | str = "cpu"):
    """03's train_tensor_parallel for the FP8 GPT, in microbatches, each weight cast once per step.
    whole_tensor_scales=False: each rank scales by its own pieces (what tensor_parallel_scales
    prevents)."""
    if microbatches < 1 or global_batch % microbatches:
        raise ValueError(f"global_batch={global_batch} is not divisible by microbatches={microbatches}")
    model = fp8.convert_to_float8(foundation.GPT(cfg)).to(device)
    model = tensor_parallel.apply_tensor_parallel(model, group, sequence_parallel)
    if whole_tensor_scales:
        tensor_parallel_scales(model, group, sequence_parallel)
    optimizer, result = foundation.make_optimizer(model, lr, adam_eps), foundation.TrainResult([], {}, {})
    with foundation.comm_meter() as meter:
        for step in range(steps):
            tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step)
            loss = 0.0
            with weights_cast_once(model):
                for x, y in zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True):
                    microbatch_loss = model(x.to(device), y.to(device)) / microbatches
                    microbatch_loss.backward()
                    loss += microbatch_loss.detach()
            result.losses.append(loss)
            if step == 0:
                grads = [(n, p.grad.clone(), p) for n, p in model.named_parameters() if p.grad is not None]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result.losses = [loss.item() for loss in result.losses]
    unshard = tensor_parallel.unshard
    result.first_grads = foundation.cpu_copy((n, unshard(g, group, like=p)) for n, g, p in grads)
    result.params = foundation.cpu_copy((n, unshard(p, group)) for n, p in model.named_parameters())
    return result, meter


# ----------------------------------------------------------------------------------------------
# RUN IT: the demo and the command line
# ----------------------------------------------------------------------------------------------

# The demo's GPT: FFN 192 (not 176) so that its TP splits (96, 48) keep CUDA's FP8 GEMMs at multiples of 16.
DEMO_MODEL = foundation.ModelConfig(ffn_dim=192)


def zero_demo(args: argparse.Namespace, device: torch.device, steps: int) -> None:
    """On each rank: the three modes of train_float8_zero; rank 0 prints the bytes beside the formulas."""
    world, m = dist.get_world_size(), 2
    runs = {mode: train_float8_zero(DEMO_MODEL, steps, args.batch, args.seq_len, mode=mode,
                                    microbatches=m, device=device) for mode in FLOAT8_ZERO_MODES}
    casts = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(runs["zero3-fp8"][0].stats["weight_casts"] // steps, casts, dst=0)
    if dist.get_rank() == 0:
        (rest, weights), n = runs["zero3"][0].stats["padded"], runs["zero3"][0].stats["n_weights"]
        ring = Fraction(world - 1, world)
        gathered = {b: m * 2 * ring * b * weights for b in (4, 2, 1)}  # the weights' part, b B an element
        print(f"\nZeRO-3 of the FP8 GPT on {world} ranks ({dist.get_backend()}, {device.type}), {m} "
              f"microbatches, {steps} steps. Its {n} Float8Linear weights\n({weights:,} elements, padded per "
              f"block) in a ZeRO of their own, the other parameters ({rest:,}) in lesson 02's.\nAll-gather "
              f"bytes per rank per step, measured | formula 2m (N-1)/N x (4 B x {rest:,} + b x {weights:,}):")
        for mode, b in (("zero3", 4), ("zero3-fp8", 1)):
            measured = runs[mode][1].traffic("all_gather") / steps
            formula = gathered[b] + m * 2 * ring * 4 * rest
            print(f"  the weights in {'fp32' if b == 4 else 'FP8 '} (b = {b} B): {float(measured):>11,.0f} | "
                  f"{float(formula):<11,.0f}{'' if measured == formula else ' (!=)'} of which the weights "
                  f"{float(gathered[b]):>11,.0f}")
        print(f"  (in bf16, b = 2 B, the weights' part would be {float(gathered[2]):,.0f}.) The gradients "
              f"reduce-scatter in fp32 either way.")
        calls = {mode: runs[mode][1].calls("all_reduce") // steps for mode in ("zero3", "zero3-fp8")}
        amax = (runs["zero3-fp8"][1].traffic("all_reduce") - runs["zero3"][1].traffic("all_reduce")) / steps
        print(f"All-reduces per step: {calls['zero3']} with fp32 gathers (each ZeRO's clipping norm), "
              f"{calls['zero3-fp8']} with FP8 ones: + every weight's\n  amax, {float(amax):.0f} B | "
              f"2 (N-1)/N x {AMAX_BYTES} B x {n} = {float(2 * ring * AMAX_BYTES * n):.0f} B, whatever the "
              f"microbatches.")
        print(f"Weight pieces cast per step, rank by rank: {casts} = the {n} weights + {sum(casts) - n} "
              f"where a shard boundary cuts one:\n  each element once per step (fp32 gathers: each weight "
              f"in each of the {m} forwards, {m * n} casts per rank).")
        for mode, label in (("zero3", "the fp32-gather run"),
                            ("unsharded", "the unsharded run (ZeRO-0, each weight cast once per step)")):
            loss, grads, params = runs["zero3-fp8"][0].max_differences(runs[mode][0])
            print(f"max |difference| of the FP8-gather run from {label}: loss {loss:.1e}, step-0 gradients "
                  f"{grads:.1e}, parameters after {steps} steps {params:.1e}")
        print("Notice: a byte per gathered weight element, one small all-reduce per step, and the same bits "
              "as casting whole weights\n(the unsharded run sums its gradients in another order).")


def tensor_parallel_demo(args: argparse.Namespace, device: torch.device, steps: int) -> None:
    """train_float8_tensor_parallel over all ranks: with and without SP, and with each rank's own
    scales; rank 0 prints the differences from one device's FP8 and the amax bytes beside the formula."""
    cfg, tp = DEMO_MODEL, dist.get_world_size()
    eps = 1e-6  # not AdamW's 1e-8, which turns fp32 rounding on gradients near 0 into lr-sized moves (01)
    runs = {(sp, whole): train_float8_tensor_parallel(cfg, steps, args.batch, args.seq_len, adam_eps=eps,
                                                      sequence_parallel=sp, whole_tensor_scales=whole,
                                                      device=device)
            for sp, whole in ((False, True), (True, True), (False, False))}
    if dist.get_rank() == 0:
        reference = foundation.train_single_device(cfg, steps, args.batch, args.seq_len, adam_eps=eps,
                                                   device=device, transform=fp8.convert_to_float8)
        ring = Fraction(2 * (tp - 1), tp)
        print(f"\nThe FP8 GPT under tensor parallelism over {tp} ranks (lesson 03), {steps} steps of batch "
              f"{args.batch} x {args.seq_len}, against one device's FP8:\n  {'scales from':<30}max "
              f"|difference|: {'loss':>7}{'step-0 gradients':>17}{'parameters':>11}   amax all-reduces per "
              f"step, measured | formula 2(t-1)/t x 4 B x L (7 + 7m), m = 1")
        for (sp, whole), (result, meter) in runs.items():
            megatron = tensor_parallel.comm_formula(cfg, args.batch, args.seq_len, sp)["all_reduce"][1]
            measured = (meter.traffic("all_reduce") - steps * ring * megatron) / steps
            formula = tensor_parallel_amax_traffic(tp, cfg.n_layers, sequence_parallel=sp) if whole else 0
            label = ("whole tensors'" if whole else "each rank's own pieces'") + (", SP" if sp else "")
            loss, grads, params = result.max_differences(reference)
            print(f"  {label:<48}{loss:>7.1e}{grads:>17.1e}{params:>11.1e}   {float(measured):,.0f} B | "
                  f"{float(formula):,.0f} B{'' if measured == formula else ' (!=)'}")
        print("Notice: with the whole tensors' scales a split layer casts one device's FP8 numbers (the "
              "tests compare them byte for byte), but its split\nsums add in another order: where that tips "
              "a value across an e4m3 rounding (rare), AdamW makes it an lr-sized move, close to one\n"
              "device, not bit for bit. With each rank's own scales the FP8 roundings differ everywhere, for "
              "a few bytes of amaxes less.")


def demo(args: argparse.Namespace) -> None:
    """On each rank: ZeRO-3 with FP8 all-gathers, then FP8 under tensor parallelism; rank 0 prints."""
    device, steps = foundation.init_distributed(), 3
    zero_demo(args, device, steps)
    tensor_parallel_demo(args, device, steps)
    foundation.exit_distributed()


def main() -> None:
    parser = foundation.lesson_parser(__doc__)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (ZeRO-3: 2 microbatches)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    args = parser.parse_args()

    def validate(world: int) -> None:
        if args.batch % (2 * world):
            raise ValueError(f"--batch {args.batch} is not divisible by 2 microbatches x {world} ranks")
        rows = {"a rank's ZeRO-3 microbatch": args.batch // (2 * world) * args.seq_len,
                "a rank's sequence shard under SP": args.batch * args.seq_len // world}
        if fp8.training_device().type == "cuda" and (odd := [f"{k} {n}" for k, n in rows.items() if n % 16]):
            raise ValueError(f"FP8 GEMMs on CUDA need rows in multiples of 16, not {', '.join(odd)} (--batch "
                             f"x --seq-len)")
        # the tensor-parallel demo splits the GPT's heads, its MLP and (SP) the sequence over the ranks
        tensor_parallel.validate_tensor_parallel(DEMO_MODEL, world)
        if args.seq_len % world:
            raise ValueError(f"--seq-len {args.seq_len} is not divisible by the {world} ranks (sequence "
                             f"parallelism)")
        foundation.check_memory(f"--batch {args.batch} x --seq-len {args.seq_len}", DEMO_MODEL, args.batch,
                                args.seq_len, world)

    foundation.launch_lesson(parser, args, demo, ("batch", "seq_len"), validate)


if __name__ == "__main__":
    main()
