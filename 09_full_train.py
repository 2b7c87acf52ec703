"""Lesson 09: every technique at once. A (dp, pp, cp, tp) mesh, one model, proved equal to one device.

THE MESH
world = dp x pp x cp x tp ranks, numbered with tp fastest: rank = ((d pp + p) cp + c) tp + t. So
the ranks of a tensor-parallel group are adjacent (the same node, the fastest link: TP talks in
every layer), then context, pipeline and data parallelism, which talk less often. Every rank creates
every group of every dimension in the same order (dist.new_group is a collective over the world)
and keeps those it belongs to. Expert parallelism needs no ranks of its own: the dp x cp ranks of
one (pp, tp) position hold different tokens anyway, so an MoE layer may spread its experts over
them (ep divides dp x cp); each expert is then data-parallel over the other dp x cp / ep ranks.

ONE MODEL, TRANSFORMED IN ONE ORDER (each step an earlier lesson's own function)
  01 GPT(cfg) -> 06 convert_to_moe + apply_expert_parallel (--moe, --ep) -> 08 convert_to_float8
  (--fp8) -> 03 apply_tensor_parallel (+ SP) -> 05 ContextParallelAttention as the attention
  function (zigzag ring; 07's kernel on a GPU) -> 04 cut_stage (v stages per rank for interleaved
  1F1B) -> 02 ZeRO stage 0-3 over dp x cp (the experts: over the ranks holding the same ones).
TP rewrites modules and needs the whole model, CP only swaps a function, a stage cut deletes
modules, ZeRO flattens the parameters as they finally are. EP comes before TP: it slices the
experts into new parameters, and SP's hook must be registered on those. MoE layers are not split
over tp: each tp rank runs them on its tokens (its sequence shard with SP).

GRADIENTS EQUAL ONE DEVICE'S, because each reduction happens exactly once:
- tp: Megatron's f/g inside the model; with SP every replicated parameter's partial gradient is
  summed over tp (03's hook). Nothing else reduces over tp.
- pp: each stage owns its parameters; microbatch losses are divided by m (04).
- dp x cp: every rank's loss is the mean over its own tokens (its rows, its sequence chunks, equal
  counts) and the ring returns every dK/dV to its owner, so the mean over dp x cp of the ranks'
  gradients is the batch's: ZeRO's reduce-scatter (or all-reduce) / (dp cp), once per step after
  the last microbatch (ZeRO.no_sync around the schedule). An expert's gradient arrives summed over
  the ep group (06's backward all-to-all): / ep, then its own ZeRO / (dp cp / ep).
- clipping: ||g||^2 sums ZeRO's shards, then the ep (experts), tp and pp ranks; a parameter
  replicated over tp counts 1/tp on each. Every rank then scales alike.
MoE here is dropless without balancing: capacity drops, the aux loss and the selection bias's
load depend on which tokens share a forward, which microbatches and sequence chunks change.

COST per step per rank (the summary prints measured | formula per group of ranks)
  tp: 03's comm_formula for the stage's layers, m microbatches (n/a under ZB-H1, whose W re-runs
      part of the backward). cp: 05's ring per attention call (ZB-H1: the backward twice).
  pp: 04's boundaries. dp x cp: 02's ZeRO traffic on the padded parameters (+ the norm's scalar).
  ep: the all-to-alls depend on the routing (06 prints them): n/a.
Memory: 02's formula on the stage's TP-local parameters: the dimensions multiply.

RUN IT
    python 09_full_train.py --dp 2 --tp 2 --pp 2          # 8 local CPU processes
    torchrun --nproc_per_node=8 09_full_train.py --dp 2 --tp 2 --pp 2 --zero 3
    python 09_full_train.py --dp 2 --cp 2 --tp 2 --sequence-parallel
    python 09_full_train.py --dp 2 --tp 2 --pp 2 --ep 2   # MoE, experts over 2 of the dp ranks
Look at: the printed rank map; the max |difference| from one device (loss, every gradient
reassembled from the shards, parameters after the steps); bytes per mesh dimension beside the
formulas.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import math
import os
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn

ddp = importlib.import_module("01_ddp")
zero_lesson = importlib.import_module("02_zero")
tp_lesson = importlib.import_module("03_tensor_parallel")
pp_lesson = importlib.import_module("04_pipeline")
cp_lesson = importlib.import_module("05_context_parallel")
moe_lesson = importlib.import_module("06_expert_parallel")
fp8_lesson = importlib.import_module("08_fp8")

DIMS = ("dp", "pp", "cp", "tp")  # slowest to fastest varying

# ----------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshSizes:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # not a dimension: expert parallelism borrows ranks from dp x cp

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


@dataclass
class Mesh:
    sizes: MeshSizes
    rank: int
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup]  # this rank's group of each kind in GROUP_DIMS


def build_mesh(sizes: MeshSizes) -> Mesh:
    """Create every group of every kind, in the same order on every rank; keep this rank's."""
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
    rows = []
    for r in range(sizes.world):
        at = sizes.coords(r)
        expert = f" ep={(at['dp'] * sizes.cp + at['cp']) % sizes.ep}" if sizes.ep > 1 else ""
        rows.append(f"  rank {r:>2}: " + " ".join(f"{d}={i}" for d, i in at.items()) + expert)
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------
# The whole configuration, checked before any collective
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    global_batch: int = 8
    seq_len: int = 16
    zero_stage: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1  # pipeline stages per rank (interleaved 1F1B)
    sequence_parallel: bool = False
    fp8: bool = False
    lr: float = 1e-3
    adam_eps: float = 1e-8
    max_grad_norm: float = math.inf
    moe: "moe_lesson.MoEConfig | None" = None  # every MLP an MoE layer (lesson 06)
    mixed_precision: bool = False  # bf16 compute, fp32 masters in ZeRO (lesson 02)


def validate(cfg, sizes: MeshSizes, train: TrainConfig, world: int) -> None:
    """Every violation, each lesson's rule in its own words, in one ValueError."""
    problems = []

    def check(rule, *args, rename: tuple[str, str] = ("", "")) -> None:
        try:
            rule(*args)
        except ValueError as error:
            problems.append(str(error).replace(*rename) if rename[0] else str(error))

    if min(getattr(sizes, d) for d in DIMS) < 1:
        problems.append(f"every mesh size must be >= 1, got {sizes}")
    elif sizes.world != world:
        problems.append(f"dp x pp x cp x tp = {sizes.dp} x {sizes.pp} x {sizes.cp} x {sizes.tp} = "
                        f"{sizes.world} is not the world size {world}")
    if train.global_batch < 1:
        problems.append(f"global_batch={train.global_batch} must be >= 1")
    tp, cp = max(sizes.tp, 1), max(sizes.cp, 1)
    check(tp_lesson.validate_tensor_parallel, cfg, tp)
    check(cp_lesson.validate_context_parallel, train.seq_len, cfg.n_heads, cp, "ring", True)
    check(zero_lesson.validate_stage, train.zero_stage)
    if train.global_batch % max(sizes.dp, 1):
        problems.append(f"global_batch={train.global_batch} is not divisible by dp={sizes.dp}")
    else:
        rows = train.global_batch // max(sizes.dp, 1)
        check(pp_lesson.validate_pipeline, cfg.n_layers, max(sizes.pp, 1), rows, train.microbatches,
              train.schedule, train.virtual, rename=(f"global_batch={rows}", f"global_batch / dp = {rows}"))
    if train.sequence_parallel and (train.seq_len // cp) % tp:
        problems.append(f"sequence parallelism splits each rank's seq_len / cp = {train.seq_len} / "
                        f"{cp} tokens over tp={tp}: not divisible")
    if sizes.ep > 1 and train.moe is None:
        problems.append(f"ep={sizes.ep} needs an MoE model (--moe)")
    if sizes.ep < 1 or (sizes.dp * sizes.cp) % sizes.ep:
        problems.append(f"ep={sizes.ep} must divide dp x cp = {sizes.dp * sizes.cp}: expert "
                        f"parallelism borrows its ranks from them")
    elif train.moe is not None:
        if train.moe.n_experts % sizes.ep:
            problems.append(f"n_experts={train.moe.n_experts} is not divisible by ep={sizes.ep}")
        if train.moe.capacity_factor is not None or train.moe.aux_loss_coef or train.moe.bias_update_rate:
            problems.append("MoE here is dropless and unbalanced (capacity_factor=None, aux_loss_coef=0, "
                            "bias_update_rate=0): drops, the aux loss and the load behind the bias "
                            "depend on which tokens share a forward, which microbatches, sequence "
                            "chunks and shards change")
    if problems:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))


# ----------------------------------------------------------------------------------------------
# Where each held parameter comes from: the contract for reassembly and checkpoints
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """This rank's piece of one parameter of the lesson-01 reference model."""
    name: str                      # the reference model's parameter name
    full_shape: tuple[int, ...]    # its global shape
    stage: int                     # the pipeline stage that holds it
    tp_dim: int | None             # the dim split over tp (None: replicated over tp)
    tp_start: int                  # first global index along tp_dim of this rank's TP shard
    tp_length: int                 # real (unpadded) length of the TP shard along tp_dim
    local_shape: tuple[int, ...]   # this rank's TP-local tensor (padded to a multiple of tp)
    flat_start: int                # this rank's ZeRO shard: elements [flat_start, flat_stop) of
    flat_stop: int                 # the flattened TP-local tensor
    ep_start: int | None = None    # an MoE expert tensor: the first expert held (dim 0)

    def global_indices(self) -> torch.Tensor:
        """For each element of this rank's shard: its index in the flattened global parameter,
        -1 for padding."""
        index = torch.arange(math.prod(self.full_shape)).view(self.full_shape)
        if self.ep_start is not None:
            index = index.narrow(0, self.ep_start, self.local_shape[0])
        if self.tp_dim is not None:
            index = index.narrow(self.tp_dim, self.tp_start, self.tp_length)
            pad = list(self.local_shape)
            pad[self.tp_dim] -= self.tp_length
            index = torch.cat([index, index.new_full(pad, -1)], self.tp_dim)
        return index.flatten()[self.flat_start:self.flat_stop]


def assemble(pieces: list[tuple[ShardSpec, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole parameters (or gradients) by reference name from every rank's (spec, values)."""
    full = {}
    for spec, values in pieces:
        flat = full.setdefault(spec.name, torch.full(spec.full_shape, math.nan)).view(-1)
        index = spec.global_indices()
        real = index >= 0
        flat[index[real]] = values.float()[real]
    return full


# ----------------------------------------------------------------------------------------------
# The composed model and its step
# ----------------------------------------------------------------------------------------------


def build_stage_model(cfg, mesh: Mesh, train: TrainConfig, stage: int, n_stages: int,
                      device: torch.device) -> nn.Module:
    """The documented order: GPT -> MoE + EP -> FP8 -> TP (+SP) -> CP attention -> stage cut. EP
    comes before TP here: it slices the experts into new parameters, and SP's hook (sum a
    replicated parameter's gradient over tp) must be registered on the ones that train."""
    model = ddp.GPT(cfg)
    plan = tp_lesson.TENSOR_PARALLEL_PLAN
    if train.moe is not None:  # experts are not split over tp: each tp rank runs them on its tokens
        model = moe_lesson.convert_to_moe(model, train.moe)
        plan = {name: styles for name, styles in plan.items() if ".mlp" not in name}
        if mesh.sizes.ep > 1:
            moe_lesson.apply_expert_parallel(model, mesh.groups["ep"])
    if train.fp8:
        model = fp8_lesson.convert_to_float8(model)
    model = tp_lesson.apply_tensor_parallel(model.to(device), mesh.groups["tp"], train.sequence_parallel, plan)
    if mesh.sizes.cp > 1:
        attention = cp_lesson.ContextParallelAttention(mesh.groups["cp"], "ring", zigzag=True,
                                                       block=cp_lesson.FLASH_BLOCK if device.type == "cuda"
                                                       else cp_lesson.TORCH_BLOCK)
        for block in model.layers.values():
            block.attn.attn_fn = attention
    return pp_lesson.cut_stage(model, stage, n_stages)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for layer in moe_lesson.moe_layers(model) for p in layer.expert_parameters()}


class Trainer:
    """One rank's part of the 4D-parallel training: its pipeline stages, each TP- and CP-parallel,
    each with a ZeRO optimizer over dp x cp.

        trainer = Trainer(cfg, mesh, train, device)
        loss = trainer.step(rows)   # this dp rank's (global_batch / dp, seq_len + 1) token rows
    """

    def __init__(self, cfg, mesh: Mesh, train: TrainConfig, device: torch.device) -> None:
        validate(cfg, mesh.sizes, train, mesh.sizes.world)
        self.cfg, self.mesh, self.train, self.device = cfg, mesh, train, device
        sizes, at = mesh.sizes, mesh.coords
        self.plan = pp_lesson.make_schedule(train.schedule, sizes.pp, train.microbatches, train.virtual)
        self.layout = cp_lesson.SequenceLayout(train.seq_len, sizes.cp, zigzag=True)
        positions = self.layout.positions(at["cp"], device)
        self.stages = {}
        for stage in range(at["pp"], self.plan.n_stages, sizes.pp):
            model = build_stage_model(cfg, mesh, train, stage, self.plan.n_stages, device)
            model.register_forward_pre_hook(  # global positions: RoPE on CP chunks and SP shards
                lambda _, args, kwargs: (args, {**kwargs, "positions": positions}), with_kwargs=True)
            self.stages[stage] = model
        self.moe_bytes = sum(p.nbytes for model in self.stages.values()  # before ZeRO-3 releases them
                             for layer in moe_lesson.moe_layers(model) for p in layer.parameters())
        # (stage, the group kind it reduces over, ZeRO). Experts differ across the ep ranks of dp x cp:
        # their own ZeRO over the ranks holding the same experts; their gradients arrive summed over
        # the ep group by the backward all-to-all, so / ep here and / (dp cp / ep) in ZeRO.
        self.zeros = []
        for stage, model in self.stages.items():
            experts = expert_parameters(model) if sizes.ep > 1 else set()
            for p in experts:
                p.register_hook(lambda grad: grad / sizes.ep)
            for kind, owns in (("dp_cp", lambda p, e=experts: p not in e),
                               ("ep_dp", lambda p, e=experts: p in e)):
                if kind == "dp_cp" or experts:
                    self.zeros.append((stage, kind, zero_lesson.ZeRO(
                        model, train.zero_stage, mesh.groups[kind], lr=train.lr, adam_eps=train.adam_eps,
                        max_grad_norm=train.max_grad_norm, mixed_precision=train.mixed_precision,
                        owns=owns if experts else None)))
        rows = train.global_batch // sizes.dp // train.microbatches
        seq = train.seq_len // sizes.cp // (sizes.tp if train.sequence_parallel else 1)
        self.boundary_shape = (rows, seq, cfg.dim)
        self.meter = ddp.CommMeter()  # every step's communication, accumulated
        self.steps = 0

    def set_lr(self, lr: float) -> None:
        for *_, zero in self.zeros:
            for group in zero.optimizer.param_groups:
                group["lr"] = lr

    def forward_backward(self, rows: torch.Tensor) -> float:
        """Forward and backward of the schedule on this rank's rows, gradients averaged over
        dp x cp; returns the global batch's mean loss (on every rank)."""
        sizes, at = self.mesh.sizes, self.mesh.coords
        if rows.shape != (self.train.global_batch // sizes.dp, self.train.seq_len + 1):
            raise ValueError(f"rows of shape {tuple(rows.shape)}: this dp rank expects "
                             f"(global_batch / dp, seq_len + 1) = ({self.train.global_batch // sizes.dp}, "
                             f"{self.train.seq_len + 1})")
        tokens, targets = (self.layout.shard(t, at["cp"], dim=1).to(self.device)
                           for t in (rows[:, :-1], rows[:, 1:]))
        with ddp.comm_meter() as meter:
            with contextlib.ExitStack() as accumulate:
                for *_, zero in self.zeros:
                    accumulate.enter_context(zero.no_sync())
                log = pp_lesson.run_schedule(self.plan, self.stages, tokens, targets, self.mesh.groups["pp"],
                                             boundary_shape=self.boundary_shape)
            for *_, zero in self.zeros:
                zero.finish_gradient_sync()
        self._add(meter)
        # Outside the meter: the last stage's local mean, averaged over dp x cp, sent to every stage.
        loss = (log.loss if log.loss is not None else torch.zeros((), device=self.device)).double()
        for kind in ("dp_cp", "pp"):
            ddp.all_reduce(loss, group=self.mesh.groups[kind])
        return loss.item() / (sizes.dp * sizes.cp)

    def update(self) -> float:
        """Clip by the norm over the whole mesh, AdamW on every shard; returns the norm."""
        sizes = self.mesh.sizes

        def share(p: nn.Parameter) -> float:  # held by tp ranks alike: count once over tp
            return 1.0 if hasattr(p, "tp_shard_dim") else 1 / sizes.tp

        with ddp.comm_meter() as meter:
            squares = {kind: sum(z.grad_squares(share) for _, k, z in self.zeros if k == kind)
                       for kind in ("dp_cp", "ep_dp")}
            if sizes.ep > 1:  # each ep rank holds other experts
                ddp.all_reduce(squares["ep_dp"], group=self.mesh.groups["ep"])
            squares = squares["dp_cp"] + squares["ep_dp"]
            for kind in ("tp", "pp"):
                if getattr(sizes, kind) > 1:
                    ddp.all_reduce(squares, group=self.mesh.groups[kind])
            for *_, zero in self.zeros:
                zero.clip_and_update(squares)
                zero.zero_grad()
        self._add(meter)
        self.steps += 1
        return squares.sqrt().item()

    def step(self, rows: torch.Tensor) -> float:
        loss = self.forward_backward(rows)
        self.update()
        return loss

    def _add(self, meter: "ddp.CommMeter") -> None:
        self.meter = zero_lesson.merge_meters([self.meter, meter])

    # --- what this rank holds ---------------------------------------------------------------

    def shard_specs(self) -> list[tuple[ShardSpec, object, object, int]]:
        """(spec, ZeRO, its unit, index in the unit) of every parameter piece this rank holds."""
        tp_rank, out = self.mesh.coords["tp"], []
        ep_rank = dist.get_rank(self.mesh.groups["ep"])
        for stage, kind, zero in self.zeros:
            for unit in zero.units:
                for i, (name, p) in enumerate(zip(unit.names, unit.params)):
                    begin = max(unit.offsets[i], unit.owned.start) - unit.offsets[i]
                    end = min(unit.offsets[i + 1], unit.owned.stop) - unit.offsets[i]
                    if begin >= end:
                        continue
                    dim = getattr(p, "tp_shard_dim", None)
                    full, start, length = list(unit.shapes[i]), 0, 0
                    if dim is not None:
                        full[dim] = p.tp_full_size
                        start = tp_rank * unit.shapes[i][dim]
                        length = max(0, min(unit.shapes[i][dim], p.tp_full_size - start))
                    ep_start = None
                    if kind == "ep_dp":
                        ep_start, full[0] = ep_rank * full[0], full[0] * self.mesh.sizes.ep
                    spec = ShardSpec(name, tuple(full), stage, dim, start, length, tuple(unit.shapes[i]),
                                     begin, end, ep_start)
                    out.append((spec, zero, unit, i))
        return out

    def shards(self, kind: str = "params") -> list[tuple[ShardSpec, torch.Tensor]]:
        """(spec, CPU values) of this rank's pieces: "params" (fp32 masters), "grads" (averaged,
        before clipping: between forward_backward and update), or an AdamW state key."""
        out = []
        for spec, zero, unit, i in self.shard_specs():
            source = {"params": unit.master, "grads": unit.grad_shard}.get(kind)
            if source is None:
                source = zero.optimizer.state[unit.master][kind]
            begin = unit.offsets[i] + spec.flat_start - unit.owned.start
            values = source[begin:begin + spec.flat_stop - spec.flat_start]
            out.append((spec, values.detach().float().cpu().clone()))
        return out

    def summary(self) -> dict:
        """Parameters held, bytes held against 02's formula, and bytes sent per step per mesh
        dimension against each lesson's formula."""
        zeros = [z for *_, z in self.zeros]
        held = {k: sum(z.held_bytes()[k] for z in zeros) for k in ("params", "grads", "optimizer")}
        formula = {k: sum(z.memory_formula()[k] for z in zeros) for k in held}
        # Groups of different kinds may be the same ranks (cp and dp x cp when dp = 1): their
        # operations tell them apart, else (ZeRO's and the router's all-gathers) they share an entry.
        entries: list[tuple[list[str], tuple[int, ...], set[str]]] = []
        for kind, group in self.mesh.groups.items():
            if kind == "dp" or kind.startswith("ep") and self.mesh.sizes.ep == 1 or ddp.group_size(group) == 1:
                continue  # dp alone carries nothing (ZeRO: dp x cp); ep = 1: dp x cp's ranks again
            ranks, ops = ddp.group_ranks(group), set(GROUP_OPS[kind])
            shared = [e for e in entries if e[1] == ranks and e[2] & ops]
            if shared:
                shared[0][0].append(kind)
                shared[0][2].update(ops)
            else:
                entries.append(([kind], ranks, ops))
        by_kind, steps = self.traffic_formula(), max(self.steps, 1)
        traffic, traffic_formula = {}, {}
        for names, ranks, ops in entries:
            traffic["+".join(names)] = sum(self.meter.traffic(op, ranks) for op in ops) / steps
            parts = [by_kind.get(n, 0) for n in names]
            traffic_formula["+".join(names)] = None if "ep" in names or None in parts else sum(parts)
        return dict(params=sum(u.offsets[-1] for z in zeros for u in z.units),
                    shard=sum(spec.flat_stop - spec.flat_start for spec, *_ in self.shard_specs()),
                    held=held, memory_formula=formula, traffic=traffic, traffic_formula=traffic_formula)

    def traffic_formula(self) -> dict[str, Fraction]:
        """Bytes this rank sends per step in each group of size > 1, by the lessons' formulas."""
        sizes, train, cfg = self.mesh.sizes, self.train, self.cfg
        b, m, s = train.global_batch // sizes.dp, train.microbatches, train.seq_len // sizes.cp
        layers = sum(len(model.layers) for model in self.stages.values())
        norm = {n: Fraction(2 * (n - 1), n) * 4 for n in (sizes.tp, sizes.pp)}
        out = {}
        if sizes.tp > 1:  # 03: activations and the loss; + the clipping norm's scalar
            ops = tp_lesson.comm_formula(cfg, b, s, train.sequence_parallel, layers=layers, microbatches=m,
                                         embed=0 in self.stages, head=self.plan.n_stages - 1 in self.stages,
                                         mlp=train.moe is None)
            ring = Fraction(sizes.tp - 1, sizes.tp)
            out["tp"] = norm[sizes.tp] + sum(ring * payload * (2 if op == "all_reduce" else 1)
                                             for op, (_, payload) in ops.items())
            if train.sequence_parallel:  # SP sums every replicated gradient over tp: the MoE layers' too
                out["tp"] += 2 * ring * m * self.moe_bytes
            if self.plan.split_backward:  # ZB-H1's W re-runs the part of backward the weights need
                out["tp"] = None
        if sizes.cp > 1:  # 05: every attention call of every microbatch
            shard = b // m * (cfg.n_heads // sizes.tp) * s * cfg.head_dim
            ring = cp_lesson.attention_bytes("ring", shard, sizes.cp)
            for st, model in self.stages.items():  # ZB-H1's W re-runs the ring's backward (B: stage > 0)
                backwards = 2 if self.plan.split_backward and st > 0 else 1
                out["cp"] = out.get("cp", 0) + m * len(model.layers) * (ring["forward"] + backwards * ring["backward"])
        if sizes.pp > 1:  # 04: one activation and one gradient per boundary and microbatch
            boundaries = sum((st < self.plan.n_stages - 1) + (st > 0) for st in self.stages)
            out["pp"] = norm[sizes.pp] + boundaries * m * math.prod(self.boundary_shape) * 4
        for _, kind, z in self.zeros:  # 02: ZeRO on the stage's padded parameters (+ the norm's scalar)
            n = ddp.group_size(self.mesh.groups[kind])
            ops = zero_lesson.zero_traffic_per_step(sum(u.padded for u in z.units), n, train.zero_stage, 4, 4)
            gathers = m if train.zero_stage == 3 else 1  # ZeRO-3: around each microbatch's F and B
            out[kind] = (out.get(kind, 0) + ops.get("all_gather", 0) * gathers + ops.get("reduce_scatter", 0)
                         + ops.get("all_reduce", 0) + (Fraction(2 * (n - 1), n) * 4 if train.zero_stage else 0))
        return out  # no formula for ep: its all-to-alls depend on the routing (06 prints that)


def build_trainer(cfg, sizes: MeshSizes, train: TrainConfig, device: torch.device) -> Trainer:
    """Check everything on every rank before any collective, create the mesh's groups, then build
    this rank's part."""
    validate(cfg, sizes, train, dist.get_world_size())
    return Trainer(cfg, build_mesh(sizes), train, device)


# ----------------------------------------------------------------------------------------------
# Demo
# ----------------------------------------------------------------------------------------------


def demo_model() -> "ddp.ModelConfig":
    return ddp.ModelConfig(vocab_size=127, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len, zero_stage=args.zero,
                       schedule=args.schedule, microbatches=args.microbatches, virtual=args.virtual,
                       sequence_parallel=args.sequence_parallel, fp8=args.fp8, lr=args.lr,
                       mixed_precision=args.bf16,
                       adam_eps=1e-6, max_grad_norm=args.max_grad_norm,
                       moe=moe_lesson.MoEConfig(n_experts=args.experts, top_k=2, expert_ffn_dim=64,
                                                aux_loss_coef=0.0) if args.moe else None)


def reference_transform(train: TrainConfig):
    """What the one-device reference converts its GPT with (an MoE model, or none)."""
    return None if train.moe is None else lambda model: moe_lesson.convert_to_moe(model, train.moe)


def dp_rows(cfg, train: TrainConfig, step: int, mesh: Mesh) -> torch.Tensor:
    """This dp rank's rows of lesson 01's global batch, as (rows, seq_len + 1) token sequences."""
    tokens, targets = ddp.synthetic_batch(cfg, train.global_batch, train.seq_len, step,
                                          mesh.coords["dp"], mesh.sizes.dp)
    return torch.cat([tokens, targets[:, -1:]], dim=1)


def print_summaries(sizes: MeshSizes, summaries: list[dict]) -> None:
    print("\nPer rank (dp,pp,cp,tp): its stages' TP-local parameters and its ZeRO shard of them; bytes held\n"
          "(live storages) | 02's formula; bytes sent per step "
          "per mesh dimension, measured | formula (fp32):")
    for rank, s in enumerate(summaries):
        memory = " ".join(f"{k} {s['held'][k]:,}|{int(s['memory_formula'][k]):,}" for k in s["held"])
        traffic = "  ".join(f"{k} {float(v):,.0f}|" + ("n/a" if (f := s["traffic_formula"][k]) is None
                                                       else f"{float(f):,.0f}" + ("" if v == f else " (!=)"))
                            for k, v in s["traffic"].items())
        coords = ",".join(str(i) for i in sizes.coords(rank).values())
        print(f"  rank {rank:>2} ({coords}) {s['params']:>7,} params, ZeRO shard {s['shard']:>7,} | "
              f"{memory} | {traffic}")


def demo(args: argparse.Namespace) -> None:
    device = ddp.init_distributed()
    sizes, cfg, train = MeshSizes(args.dp, args.pp, args.cp, args.tp, args.ep), demo_model(), train_config(args)
    trainer = build_trainer(cfg, sizes, train, device)
    mesh, losses = trainer.mesh, []
    for step in range(args.steps):
        losses.append(trainer.forward_backward(dp_rows(cfg, train, step, mesh)))
        if step == 0:
            grads = trainer.shards("grads")
        trainer.update()
    pieces = [None] * sizes.world if mesh.rank == 0 else None
    dist.gather_object((grads, trainer.shards("params"), trainer.summary()), pieces, dst=0)
    if mesh.rank == 0:
        ref = zero_lesson.train_reference(cfg, args.steps, train.global_batch, train.seq_len, lr=train.lr,
                                          adam_eps=train.adam_eps, max_grad_norm=train.max_grad_norm,
                                          mixed_precision=train.mixed_precision,
                                          transform=reference_transform(train))
        moe = train.moe and f"MoE {train.moe.n_experts} experts top-{train.moe.top_k} over ep={sizes.ep}; "
        print(f"4D parallelism: dp={sizes.dp} pp={sizes.pp} cp={sizes.cp} tp={sizes.tp} on {sizes.world} "
              f"ranks ({dist.get_backend()}, {device.type}); ZeRO-{train.zero_stage}, {train.schedule} "
              f"with {train.microbatches} microbatches, SP {'on' if train.sequence_parallel else 'off'}"
              f"{', FP8' if train.fp8 else ''}{', bf16' if train.mixed_precision else ''}; {moe or ''}global batch {train.global_batch} x {train.seq_len}.\n"
              f"Rank map (tp fastest):\n{rank_map(sizes)}\n")
        print(f"{'step':<6}{'4D loss':>12}{'one device':>12}")
        for step, (a, b) in enumerate(zip(losses, ref.losses)):
            print(f"{step:<6}{a:>12.6f}{b:>12.6f}")
        grads_full = assemble([p for g, _, _ in pieces for p in g])
        params_full = assemble([p for _, q, _ in pieces for p in q])
        print(f"max |difference| from one device (AdamW + clip_grad_norm_ at {train.max_grad_norm}): loss "
              f"{max(abs(a - b) for a, b in zip(losses, ref.losses)):.1e}, step-0 gradients "
              f"{ddp.max_abs_diff(grads_full, ref.first_grads):.1e}, parameters after {args.steps} steps "
              f"{ddp.max_abs_diff(params_full, ref.params):.1e} (every element reassembled from ShardSpecs)"
              + ("\n(FP8: the reference computes in fp32, so these are FP8's rounding, ~1e-3)" if train.fp8 else ""))
        print_summaries(sizes, [s for _, _, s in pieces])
        print("Notice: the bytes held shrink with tp and pp (and dp x cp for ZeRO-3); each dimension's "
              "traffic is its own lesson's formula.")
    ddp.exit_distributed()


def main() -> None:
    parser = ddp.lesson_parser(__doc__)
    for dim in DIMS:
        parser.add_argument(f"--{dim}", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism, borrowed from dp x cp")
    parser.add_argument("--moe", action="store_true", help="every MLP a mixture of experts (dropless)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp x cp")
    parser.add_argument("--schedule", default="1f1b", choices=pp_lesson.SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--virtual", type=int, default=1, help="stages per rank (interleaved)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="lesson 08's Float8Linear layers")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 masters (02's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()
    args.moe = args.moe or args.ep > 1
    sizes = MeshSizes(args.dp, args.pp, args.cp, args.tp, args.ep)
    if "RANK" not in os.environ:
        args.nproc = sizes.world  # the mesh sets how many local processes to start

    def check(world: int) -> None:
        validate(demo_model(), sizes, train_config(args), world)

    ddp.launch_lesson(parser, args, demo, ("steps",), check)


if __name__ == "__main__":
    main()
