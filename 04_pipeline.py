"""Lesson 04: pipeline parallelism. GPipe, 1F1B, interleaved 1F1B and ZB-H1, with measured bubbles.

The parts, in order:
  Cutting the reference model into stages: validate_pipeline, stage_layers, cut_stage
  Schedules as data: compute_order (a rank's forwards and backwards: the technique), bubble_formula,
    in_flight_bound; simulate and place_communication (the transfers); make_schedule
  The executor, one for every schedule: mailbox_key, send_receipts (when a sent tensor can go), run_schedule;
    train_pipeline on lesson 01's batches
  RUN IT: the measured timelines (draw_measured, trace_events), demo, bench; the command line: Options, main

THE IDEA
Cut the model by depth into stages: the first owns the embedding, the last the final norm, the head
and the loss. The global batch is split into m microbatches so that the p ranks can work on
different microbatches at once. A rank sends its stage's output activations (b/m x seq x dim) to the
next stage's rank and, in backward, the gradient of its stage input back to the previous one. Each
microbatch loss is divided by m, so the accumulated gradients are exactly those of the batch mean
loss (forget the 1/m and every gradient is m times too large while the logged loss looks right).

SCHEDULES ARE DATA
A schedule is a pure function of (p, m, v) giving each rank an ordered list of actions: F (forward of
one stage on one microbatch), B (its backward), W (weight gradient, zero-bubble only), sends and
receives. One executor runs any list. With unit times F = 1, B = 2 (or B = W = 1 when split):
- GPipe (all forwards, then all backwards): bubble (p-1)/(m+p-1) of the step, and a rank holds the
  activations of all m microbatches at once.
- 1F1B: rank r does p-r-1 warm-up forwards, then alternates one forward, one backward. Same bubble,
  but rank r holds at most p-r microbatches: memory no longer grows with m.
- interleaved 1F1B: rank r owns v stages (r, r+p, ...), so a microbatch passes every rank v times
  with 1/v of the work each: bubble (p-1)/(vm+p-1) (Megatron writes it relative to the ideal time:
  (p-1)/(vm)), for v times more point-to-point messages. Needs m a multiple of p.
- ZB-H1 (zero bubble, Qi et al. 2023): backward split into B (input gradient: what the previous
  stage waits for) and W (weight gradient: nobody waits for it). Rank r postpones its first r W's
  to fill the pipeline's tail: for m >= p the bubble is (p-1)/(3m+p-1), a third of 1F1B's, with at
  most p microbatches held (W needs the activations too). Our W is a second backward towards the
  weights (autograd.backward, inputs=them), which re-runs the backward chain: simple, not free.
Transfers are placed by simulating the compute orders in unit times: each is posted on both ends at
the instant its data is produced, those of one instant as one batched isend/irecv (01's batch_p2p).
Ranks reach their instants in time order, so none waits on a peer that waits on it (the tests check
every list under the strictest point-to-point semantics). A receive is waited for just before the
compute that needs it, a send at the end of the step: no device-specific synchronisation.
FROZEN STAGES (fine-tuning with a frozen embedding stage): the plan knows which stages train
(stage_trains, one all-reduce of a flag per stage). A stage with nothing to train does no W, and its
input gradient is computed and sent back only if some stage before it trains. Each step starts with
the same all-reduce, so every rank sees a plan that does not match the stages and raises alike.

COST
Per step a stage boundary carries m activations forward and m gradients back: rank r sends
(its stages that are not last + those not first) x m x (b/m) x seq x dim x bytes (none at p = 1:
its stages hand over in place), plus the check's all-reduce of p v fp32 flags, 2(p-1)/p x 4 p v bytes.

RUN IT
    python 04_pipeline.py                    # 4 local ranks; torchrun --nproc_per_node=4 works too
    python 04_pipeline.py --trace trace.json # open in https://ui.perfetto.dev or chrome://tracing
    python 04_pipeline.py --microbatches 2   # m < p: GPipe's bubble grows (interleaved left out)
    python 04_pipeline.py --bench            # step time against torch.distributed.pipelining
Look at: the max |difference| from one device (rounding only), the bytes each rank sent beside the
formula, the timelines ('.' is the bubble), the measured bubble beside the formula, and the peak
number of microbatches each rank held.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn

foundation = importlib.import_module("01_ddp")

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE = ("F", "B", "W")
SEND = ("SEND_F", "SEND_B")
ACTION_LABELS = {"F": "forward", "B": "backward", "W": "backward"}  # W: the weight half of B
# Nominal cost of each action: a backward is two matmuls per forward one (input and weight gradient).
UNIT_TIMES = {"F": 1, "B": 2}
UNIT_TIMES_SPLIT = {"F": 1, "B": 1, "W": 1}
MB_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"  # one character per microbatch in the drawings


# --- Cutting the reference model into stages ---------------------------------------------------------------
def validate_pipeline(n_layers: int, pp: int, global_batch: int, microbatches: int, schedule: str,
                      virtual: int, ends_as_layers: bool = False) -> None:
    """Raised identically on every rank before any send, so no rank is left waiting."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    if min(pp, microbatches, virtual) < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual={virtual} must all be >= 1")
    if virtual > 1 and schedule != "interleaved":
        raise ValueError(f"virtual={virtual} stages per rank needs schedule='interleaved'")
    if n_layers < pp * virtual:
        raise ValueError(f"n_layers={n_layers} cannot fill pp x virtual = {pp} x {virtual} = "
                         f"{pp * virtual} stages: every stage needs at least one layer")
    if ends_as_layers and n_layers + 2 < 2 * pp * virtual:
        raise ValueError(f"ends_as_layers: the embedding and the head take a layer's place, and n_layers "
                         f"+ 2 = {n_layers + 2} places cannot give the first and last of {pp * virtual} "
                         f"stages a layer")
    if global_batch % microbatches:
        raise ValueError(f"global_batch={global_batch} is not divisible by microbatches={microbatches}")
    if schedule == "interleaved" and microbatches % pp:
        raise ValueError(f"interleaved 1F1B sends microbatches round the ranks in groups of pp: "
                         f"microbatches={microbatches} is not a multiple of pp={pp}")


def stage_layers(n_layers: int, n_stages: int, ends_as_layers: bool = False) -> list[range]:
    """Balanced by layers; the first stages take the remainder (the last one also has the head).
    ends_as_layers: the embedding and the head each take a layer's place (Megatron's
    account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split), so the first and
    last stages hold a layer less and their extra activations (the embedding's output, the logits) fit."""
    if ends_as_layers:  # place 0 is the embedding, place n_layers + 1 the head
        places = stage_layers(n_layers + 2, n_stages)
        return [range(max(p.start - 1, 0), min(p.stop - 1, n_layers)) for p in places]
    base, extra = divmod(n_layers, n_stages)
    starts = [s * base + min(s, extra) for s in range(n_stages + 1)]
    return [range(begin, end) for begin, end in zip(starts, starts[1:])]


def cut_stage(model: nn.Module, stage: int, n_stages: int, ends_as_layers: bool = False) -> nn.Module:
    """In place: keep this stage's modules of a whole GPT, however transformed before; delete the rest or set
    them to None, so its parameters keep the reference names and values (initialisation ran on the whole
    model). A parameter no single stage owns would train apart on each copy: refused before any collective."""
    layers = stage_layers(model.cfg.n_layers, n_stages, ends_as_layers)
    if n_stages > 1:  # embed on the first stage, a layer on its own, norm and lm_head on the last
        home = {"embed": 0, "norm": n_stages - 1, "lm_head": n_stages - 1,
                **{f"layers.{i}": s for s, held in enumerate(layers) for i in held}}
        holders: dict[nn.Parameter, tuple[str, set[int | None]]] = {}  # its first name, its stages
        for name, p in model.named_parameters(remove_duplicate=False):
            owner = next((home[m] for m in home if name.startswith(m + ".")), None)  # None: no stage's
            holders.setdefault(p, (name, set()))[1].add(owner)
        shared = {name: held for name, held in holders.values() if len(held) > 1 or None in held}
        if shared:
            raise ValueError("a pipeline stage owns its parameters, but " + "; ".join(
                f"{name} is registered outside embed, layers, norm and lm_head" if None in held
                else f"{name} is shared by stages {sorted(held)} (tied weights)"
                for name, held in shared.items())
                + f": untie them or use pp=1 (n_stages={n_stages})")
    for name in [n for n in model.layers if int(n) not in layers[stage]]:
        del model.layers[name]
    if stage > 0:
        model.embed = None
    if stage < n_stages - 1:
        model.norm = model.lm_head = None
    return model


# --- Schedules as data -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    kind: str        # F, B, W, or SEND_F / RECV_F (activations) / SEND_B / RECV_B (gradients)
    stage: int       # the stage that computes, sends, or receives
    microbatch: int
    peer: int | None = None  # the other rank of a send or receive

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"<->{self.peer}"
        return f"{self.kind}{self.microbatch}@s{self.stage}{peer}"


def compute_order(schedule: str, rank: int, pp: int, m: int, virtual: int) -> list[Action]:
    """The order in which one rank computes (SCHEDULES ARE DATA); place_communication adds the transfers."""
    if schedule == "interleaved":  # Megatron: microbatches in groups of pp, cycling the chunks
        def act(kind: str, k: int) -> Action:
            chunk = (k // pp) % virtual
            chunk = chunk if kind == "F" else virtual - 1 - chunk  # backward runs the chunks in reverse
            return Action(kind, chunk * pp + rank, (k // (pp * virtual)) * pp + k % pp)
        total, warmup = m * virtual, min(m * virtual, 2 * (pp - rank - 1) + (virtual - 1) * pp)
    else:
        def act(kind: str, k: int) -> Action:
            return Action(kind, rank, k)
        total, warmup = m, m if schedule == "gpipe" else min(m, pp - rank - 1)
    order = [act("F", k) for k in range(warmup)]
    weight_grads = [act("W", k) for k in range(total)] if schedule == "zb-h1" else []
    for k in range(total):
        if warmup + k < total:
            order.append(act("F", warmup + k))
        order.append(act("B", k))
        if weight_grads and k >= rank:  # ZB-H1: rank r postpones its first r W's to the tail
            order.append(weight_grads.pop(0))
    return order + weight_grads


def bubble_formula(schedule: str, pp: int, m: int, virtual: int = 1) -> float:
    """The idle fraction of a step with unit times (F = 1, B = 2 or B = W = 1)."""
    if schedule == "zb-h1":  # with m < p the last rank's F, B, F, B... chain sets the length
        return 1 - 3 * m / max(3 * m + pp - 1, 2 * m + 2 * pp - 1)
    return (pp - 1) / ((virtual * m if schedule == "interleaved" else m) + pp - 1)


def in_flight_bound(schedule: str, rank: int, pp: int, m: int, virtual: int = 1) -> int:
    """Most microbatch-stage pairs whose activations `rank` holds at once (until W in ZB-H1, else B)."""
    return {"gpipe": m, "1f1b": min(m, pp - rank), "zb-h1": min(m, pp),
            "interleaved": min(virtual * m, 2 * (pp - rank - 1) + (virtual - 1) * pp + 1)}[schedule]


def held_at_peak(schedule: str, rank: int, pp: int, m: int, virtual: int, held: Callable[[int], int]) -> int:
    """in_flight_bound weighted by held(stage), what each microbatch-stage pair holds until freed; where
    the rank's stages hold different amounts (interleaved, uneven layers), by walking the compute order."""
    if len({held(stage) for stage in range(rank, pp * virtual, pp)}) == 1:
        return in_flight_bound(schedule, rank, pp, m, virtual) * held(rank)
    frees = "W" if schedule == "zb-h1" else "B"
    now = peak = 0
    for a in compute_order(schedule, rank, pp, m, virtual):
        now += held(a.stage) * ((a.kind == "F") - (a.kind == frees))
        peak = max(peak, now)
    return peak


def simulate(orders: list[list[Action]], n_stages: int,
             durations: dict[str, float]) -> dict[Action, tuple[float, float]]:
    """Start and end of every compute action when each rank runs its order as early as its inputs
    allow. Raises if the orders wait on each other in a cycle."""
    times: dict[Action, tuple[float, float]] = {}
    position = [0] * len(orders)  # per rank: its next action
    free_at = [0.0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                needs = {"F": [Action("F", a.stage - 1, a.microbatch)] if a.stage > 0 else [],
                         "B": [Action("F", a.stage, a.microbatch)]
                         + ([Action("B", a.stage + 1, a.microbatch)] if a.stage < n_stages - 1 else []),
                         "W": [Action("B", a.stage, a.microbatch)]}[a.kind]
                if any(n not in times for n in needs):
                    break
                start = max([free_at[r]] + [times[n][1] for n in needs])
                times[a] = (start, start + durations[a.kind])
                free_at[r] = start + durations[a.kind]
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[position[r]]) for r, o in enumerate(orders) if position[r] < len(o)}
            raise RuntimeError(f"the compute orders wait on each other: {stuck}")
    return times


def place_communication(orders: list[list[Action]], times: dict, n_stages: int,
                        trains: tuple[bool, ...]) -> list[list[Action]]:
    """Insert each transfer on both ends at the instant its data is produced (SCHEDULES ARE DATA)."""
    pp = len(orders)
    # Per rank: (instant, order within one instant: 0 send, 1 receive, 2 compute, action).
    events = [[(times[a][0], 2, a) for a in order] for order in orders]
    for a, (_, end) in times.items():
        to = a.stage + {"F": 1, "B": -1, "W": 0}[a.kind]  # activations go up, gradients down
        here, there = a.stage % pp, to % pp
        if 0 <= to < n_stages and there != here and (a.kind == "F" or any(trains[:a.stage])):
            events[here].append((end, 0, Action("SEND_" + a.kind, a.stage, a.microbatch, there)))
            events[there].append((end, 1, Action("RECV_" + a.kind, to, a.microbatch, here)))
    return [[a for *_, a in sorted(rank, key=lambda e: e[:2])] for rank in events]


@dataclass
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int
    actions: list[list[Action]]                  # per rank, in execution order
    nominal: dict[Action, tuple[float, float]]   # unit-time start and end of each compute action
    trains: tuple[bool, ...]                     # per stage: has it any trainable parameter?

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def split_backward(self) -> bool:
        return self.name == "zb-h1"

    def __str__(self) -> str:
        end = int(max(stop for _, stop in self.nominal.values()))
        rows = [[". "] * end for _ in range(self.pp)]
        for a, (start, stop) in self.nominal.items():
            kind = a.kind if a.stage < self.pp else a.kind.lower()
            cells = [kind + MB_CHARS[a.microbatch % len(MB_CHARS)]] + ["--"] * int(stop - start - 1)
            rows[a.stage % self.pp][int(start):int(stop)] = cells
        return "\n".join(f"rank {r} |{''.join(row)}|" for r, row in enumerate(rows))


def make_schedule(name: str, pp: int, microbatches: int, virtual: int = 1,
                  trains: tuple[bool, ...] | None = None) -> Schedule:
    """Every rank's ordered actions, computed alike on every rank. trains: see stage_trains (default: all)."""
    trains = (True,) * (pp * virtual) if trains is None else tuple(trains)
    if len(trains) != pp * virtual:
        raise ValueError(f"trains has {len(trains)} entries for pp x virtual = {pp * virtual} stages")
    orders = [compute_order(name, r, pp, microbatches, virtual) for r in range(pp)]
    times = simulate(orders, pp * virtual, UNIT_TIMES_SPLIT if name == "zb-h1" else UNIT_TIMES)
    actions = place_communication(orders, times, pp * virtual, trains)
    return Schedule(name, pp, microbatches, virtual, actions, times, trains)


def stage_trains(stages: dict[int, nn.Module], n_stages: int, group=None) -> tuple[bool, ...]:
    """Per stage, whether any of its parameters trains (FROZEN STAGES; one rank: nothing to send)."""
    flags = torch.zeros(n_stages, device=next(next(iter(stages.values())).parameters()).device)
    for stage, module in stages.items():
        flags[stage] = any(p.requires_grad for p in module.parameters())
    if foundation.group_size(group) > 1:
        foundation.all_reduce(flags, group=group, op=dist.ReduceOp.MAX)
    return tuple(bool(f) for f in flags.tolist())


def stage_trains_traffic(pp: int, virtual: int = 1) -> Fraction:
    return foundation.ring_traffic("all_reduce", 4 * pp * virtual, pp)


# --- The executor, one for every schedule, and training on lesson 01's batches -----------------------------
def mailbox_key(transfer: Action) -> tuple[str, int, int]:
    """Both ends' name for a transfer: ("F" activations | "B" gradients, receiving stage, microbatch)."""
    kind = transfer.kind[-1]
    if transfer.kind in SEND:
        return kind, transfer.stage + (1 if kind == "F" else -1), transfer.microbatch
    return kind, transfer.stage, transfer.microbatch


def send_receipts(schedule: Schedule, rank: int) -> dict[tuple, list[tuple]]:
    """For each message this rank receives, its own sends that the message proves received: their tensors
    can go (kept to the step's end, a rank held every output it sent, m a stage; 1F1B promises p - r)."""
    receipts = {}
    for send in (a for a in schedule.actions[rank] if a.kind in SEND):
        kind, stage, microbatch = mailbox_key(send)
        peer_actions = schedule.actions[send.peer]
        used = peer_actions.index(Action(kind, stage, microbatch))  # the peer's compute that reads it
        reply = next((a for a in peer_actions[used:] if a.kind in SEND and a.peer == rank), None)
        if reply is not None:
            receipts.setdefault(mailbox_key(reply), []).append((kind, stage, microbatch))
    return receipts


@dataclass
class StepLog:
    # (kind, stage, microbatch, start, end) of each compute action, seconds from the step's start
    records: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    peak_in_flight: int = 0           # microbatch-stage pairs whose activations were held at once
    loss: torch.Tensor | None = None  # the batch mean loss, on the last stage's rank


def run_schedule(schedule: Schedule, stages: dict[int, nn.Module], tokens: torch.Tensor,
                 targets: torch.Tensor, group=None, work_s: dict[str, float] | None = None,
                 boundary_shape: tuple[int, ...] | None = None,
                 before_last_backward: Callable[[int], None] | None = None) -> StepLog:
    """Run this rank's actions on its stages (stage index -> module). Gradients accumulate in .grad. work_s
    pads every compute action to a fixed duration. boundary_shape: one microbatch's activations between
    stages, (b/m, seq, dim) unless split (03's SP: (b/m, seq/t, dim)). before_last_backward(stage): called
    before a stage's last action that makes weight gradients, where 09's ZeRO reduces them while it runs."""
    rank = dist.get_rank(group)
    m = schedule.microbatches
    last = schedule.n_stages - 1
    # Every rank checks every stage (FROZEN STAGES); the all-reduce also starts the timelines together.
    trains = stage_trains(stages, schedule.n_stages, group)
    wrong = [stage for stage, flag in enumerate(trains) if flag != schedule.trains[stage]]
    if wrong:
        s = wrong[0]
        state = "trains" if trains[s] else "is frozen"
        raise ValueError(f"stage {s} (rank {s % schedule.pp}) {state}, but the schedule's trains[{s}]="
                         f"{schedule.trains[s]}: make the schedule with stage_trains()")
    x_mbs, y_mbs = tokens.chunk(m), targets.chunk(m)
    shape = boundary_shape or (*x_mbs[0].shape, next(iter(stages.values())).cfg.dim)
    dtype = next(next(iter(stages.values())).parameters()).dtype  # activations: the weights' (bf16...)
    inbox = {}  # what arrived, or a local stage handed over
    arriving = {}  # receives posted, not yet waited for
    sent = {}  # mailbox key -> (work, tensor) of the sends in flight
    receipts = send_receipts(schedule, rank)
    saved = {}  # (stage, microbatch) -> (input, output) from F until B
    wait_for_w = {}  # ZB-H1: (stage, microbatch) -> (output, gradient) from B until W
    outbox = inbox if schedule.pp == 1 else {}  # one rank owns every stage: hand over directly
    weights_kind = "W" if schedule.split_backward else "B"
    last_backward = {a.stage: a for a in schedule.actions[rank] if a.kind == weights_kind}  # the last wins
    log = StepLog()
    losses = []
    t0 = time.perf_counter()
    for compute, run in itertools.groupby(schedule.actions[rank], lambda a: a.kind in COMPUTE):
        if not compute:  # consecutive transfers: one batched isend/irecv
            ops = []
            keys = []
            for a in run:
                keys.append(mailbox_key(a))
                ops.append(("send", outbox.pop(keys[-1]), a.peer) if a.kind in SEND
                           else ("recv", torch.empty(shape, dtype=dtype, device=tokens.device), a.peer))
            works = foundation.batch_p2p(ops, group)
            for (kind, tensor, _), key, work in zip(ops, keys, works, strict=True):
                if kind == "recv":
                    inbox[key] = tensor
                    arriving[key] = work
                else:  # completes in the background; the tensor must live until then
                    sent[key] = (work, tensor)
            continue
        for a in run:
            key = (a.stage, a.microbatch)
            module = stages[a.stage]
            if (a.kind, *key) in arriving:  # wait only now: a late peer delays only what needs it
                arriving.pop((a.kind, *key)).wait()
                for proved in receipts.get((a.kind, *key), ()):
                    sent.pop(proved)[0].wait()  # finished: the peer computed with it before sending this
            received = inbox.pop((a.kind, *key), None)  # from a peer or a local stage, if any
            start = time.perf_counter()  # after any wait for a peer: waiting is bubble, not work
            trains = schedule.trains[a.stage]
            if before_last_backward is not None and last_backward.get(a.stage) is a:
                before_last_backward(a.stage)
            with torch.profiler.record_function(ACTION_LABELS[a.kind]):  # a profile's names (09)
                if a.kind == "F":  # the input needs a gradient if some stage before this one trains
                    x = received if a.stage > 0 else x_mbs[a.microbatch]
                    x.requires_grad_(any(schedule.trains[:a.stage]))
                    out = module(x, y_mbs[a.microbatch]) / m if a.stage == last else module(x)
                    if a.stage == last:
                        losses.append(out.detach())
                    else:
                        outbox[("F", a.stage + 1, a.microbatch)] = out.detach()
                    saved[key] = x, out
                    log.peak_in_flight = max(log.peak_in_flight, len(saved) + len(wait_for_w))
                elif a.kind == "B":  # a frozen stage with nothing before it that trains: nothing to do
                    x, out = saved.pop(key)
                    grad = received  # None on the last stage: out is the loss
                    if schedule.split_backward:  # input gradient only; the weights wait for W
                        if x.requires_grad:
                            (x_grad,) = torch.autograd.grad(out, x, grad, retain_graph=trains)
                        if trains:
                            wait_for_w[key] = (out, grad)
                    elif out.requires_grad:
                        torch.autograd.backward(out, grad)
                        x_grad = x.grad
                    if x.requires_grad:
                        outbox[("B", a.stage - 1, a.microbatch)] = x_grad
                elif trains:  # W: the weight gradients, accumulated into .grad (hooks fire) (frozen: none)
                    out, grad = wait_for_w.pop(key)
                    params = [p for p in module.parameters() if p.requires_grad]
                    torch.autograd.backward(out, grad, inputs=params)
                    del out, grad  # W leaves B's path alone: its saved tensors go with the graph, now
            if work_s is not None:
                time.sleep(max(0.0, start + work_s[a.kind] - time.perf_counter()))
            log.records.append((a.kind, *key, start - t0, time.perf_counter() - t0))
    for work, _ in sent.values():
        work.wait()
    if losses:
        log.loss = torch.stack(losses).sum()
    return log


def named_parameters(stages: dict[int, nn.Module]):
    for module in stages.values():
        yield from module.named_parameters()  # reference names: layers keep their global index


def train_pipeline(cfg, steps: int, global_batch: int, seq_len: int, *, schedule: str = "1f1b",
                   microbatches: int = 4, virtual: int = 1, lr: float = 1e-3, adam_eps: float = 1e-8,
                   group=None, device: torch.device | str = "cpu",
                   work_s: dict[str, float] | None = None, transform=None):
    """Returns (TrainResult of this rank's parameters, its CommMeter, one StepLog per step).
    Every rank draws the whole batch; the first stage reads the tokens, the last the targets.
    transform as in foundation.train_single_device, on the whole model before the cut."""
    pp = foundation.group_size(group)
    rank = dist.get_rank(group)
    validate_pipeline(cfg.n_layers, pp, global_batch, microbatches, schedule, virtual)
    n_stages = pp * virtual
    stages = {s: cut_stage((transform or (lambda model: model))(foundation.GPT(cfg)), s, n_stages).to(device)
              for s in range(rank, n_stages, pp)}
    plan = make_schedule(schedule, pp, microbatches, virtual, stage_trains(stages, n_stages, group))
    optimizer = foundation.make_optimizer(nn.ModuleList(stages.values()), lr, adam_eps)
    result = foundation.TrainResult([], {}, {})
    logs = []
    with foundation.comm_meter() as meter:
        for step in range(steps):
            tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step)
            logs.append(run_schedule(plan, stages, tokens.to(device), targets.to(device), group, work_s))
            if step == 0:
                result.first_grads = foundation.cpu_copy((n, p.grad) for n, p in named_parameters(stages)
                                                         if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    losses = torch.stack([torch.zeros((), device=device) if log.loss is None else log.loss
                          for log in logs]).double()  # outside the meter: only the last stage has them
    foundation.all_reduce(losses, group=group)
    result.losses = losses.tolist()
    result.params = foundation.cpu_copy(named_parameters(stages))
    return result, meter, logs


# --- RUN IT: the measured timelines, the demo, the benchmark against torch, the command line ---------------
def measured_bubble(records: list[list[tuple]]) -> float:
    """1 - busy / (ranks x step time), from every rank's StepLog.records."""
    step = max(end for rec in records for *_, end in rec)
    busy = sum(end - start for rec in records for *_, start, end in rec)
    return 1 - busy / (len(records) * step)


def draw_measured(records: list[list[tuple]], pp: int, width: int = 96) -> str:
    """One row per rank, each character a 1/width slice of the step, lettered as a Schedule's; '.' idle."""
    step = max(end for rec in records for *_, end in rec)
    rows = []
    for rank, rec in enumerate(records):
        row = ["."] * width
        for kind, stage, _, start, end in rec:
            for c in range(int(start / step * width + 0.5), int(end / step * width + 0.5)):
                row[min(c, width - 1)] = kind if stage < pp else kind.lower()
        rows.append(f"rank {rank} |{''.join(row)}|")
    return "\n".join(rows)


def trace_events(name: int | str, pid: int, records: list[list[tuple]]) -> list[dict]:
    """Chrome trace-event JSON: one process per schedule, one thread per rank, times in us."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    for rank, rec in enumerate(records):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for kind, stage, mb, start, end in rec:
            events.append({"ph": "X", "pid": pid, "tid": rank, "name": f"{kind}{mb}", "cat": kind,
                           "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "args": {"stage": stage, "microbatch": mb}})
    return events


def schedule_runs(args: argparse.Namespace, pp: int) -> list[tuple[str, int]]:
    """(schedule, virtual) of each run: the demo's interleaved only where m is a multiple of pp, so that
    GPipe's and 1F1B's bubbles show with fewer microbatches than ranks; --bench runs all four."""
    every = [(name, args.virtual if name == "interleaved" else 1) for name in SCHEDULES]
    if args.bench:
        return every
    return [(name, v) for name, v in every if name != "interleaved" or args.microbatches % pp == 0]


def demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    pp = dist.get_world_size()
    rank = dist.get_rank()
    cfg = run_sizes(args, pp)[0]
    # The timelines pad every action to its unit time, on a model whose real compute fits well inside
    small = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=1, ffn_dim=8, n_layers=cfg.n_layers)
    m = args.microbatches
    ref = foundation.train_single_device(cfg, args.steps, args.global_batch, args.seq_len, device=device)
    boundary = args.global_batch * args.seq_len * cfg.dim * 4 * (pp > 1)  # a step's; pp = 1: handed over
    report = []
    for name, v in schedule_runs(args, pp):
        result, meter, _ = train_pipeline(cfg, args.steps, args.global_batch, args.seq_len, schedule=name,
                                          microbatches=m, virtual=v, device=device)
        stats = [*result.max_differences(ref), float(meter.traffic("send")) / args.steps,
                 sum((s < pp * v - 1) + (s > 0) for s in range(rank, pp * v, pp)) * boundary]
        unit = args.unit_ms / 1e3 / v
        work = {"F": unit, "B": unit if name == "zb-h1" else 2 * unit, "W": unit} if unit else None
        _, _, logs = train_pipeline(small if work else cfg, 2, m, 4 if work else args.seq_len,
                                    schedule=name, microbatches=m, virtual=v, device=device, work_s=work)
        report.append((make_schedule(name, pp, m, v),  # on rank 0: every rank's row, and its records
                       foundation.all_ranks([*stats, logs[-1].peak_in_flight], dst=0),
                       foundation.all_ranks(logs[-1].records, dst=0)))
    if rank != 0:
        foundation.exit_distributed()
    print(f"Pipeline parallelism on {foundation.counted(pp, 'rank')} ({dist.get_backend()}): "
          f"{foundation.counted(cfg.n_layers, 'layer')}, global batch {args.global_batch} x {args.seq_len} "
          f"in {foundation.counted(m, 'microbatch', 'microbatches')}, "
          f"{foundation.counted(args.steps, 'AdamW step')}.")
    print(f"\n{'schedule':<16}{'loss diff':>11}{'grad diff':>11}{'param diff':>11}"
          f"   bytes sent per rank per step (formula)")
    for plan, per_rank, _ in report:  # a row: 3 differences, bytes sent, the formula's, peak held
        diffs = "".join(f"{max(column):>11.1e}" for column in list(zip(*per_rank))[:3])
        sent = ", ".join(f"{int(s):,}" + ("" if s == f else f" (formula {int(f):,})")
                         for *_, s, f, _ in per_rank)
        print(f"{plan.name + (f' v={plan.virtual}' if plan.virtual > 1 else ''):<16}{diffs}   {sent}")
    print("(max |difference| from one device training on the whole batch: rounding only)")
    if len(report) < len(SCHEDULES):
        print(f"interleaved: not run, --microbatches {m} is not a multiple of pp={pp} (it sends microbatches "
              f"round the ranks in groups of pp)")
    print(foundation.lone_token_note(args.seq_len), end="")
    work = "real compute" if args.unit_ms == 0 else f"balanced synthetic work, F = {args.unit_ms} ms / v"
    print(f"\nTimelines ({work}): per rank, the plan, then what ran. The plan has two characters a "
          f"unit of time:\nF3 = forward of microbatch 3, B3-- = its backward (two units; ZB-H1's B is one, "
          f"its W3 the weight gradient),\nlowercase f3 / b3 = the rank's later stages (interleaved), "
          f"'. ' = idle. The measured row has one letter a time slice, '.' = idle.\nMeasured bubbles "
          f"include what else the machine runs: load average {os.getloadavg()[0]:.1f} over the last "
          f"minute, {os.cpu_count()} cores.")
    trace = []
    for pid, (plan, per_rank, records) in enumerate(report):
        peaks = [row[-1] for row in per_rank]
        bounds = [in_flight_bound(plan.name, r, pp, m, plan.virtual) for r in range(pp)]
        bubble = bubble_formula(plan.name, pp, m, plan.virtual)
        print(f"\n{plan.name}, p={pp}, m={m}, v={plan.virtual}: bubble measured "
              f"{measured_bubble(records):.3f}, formula {bubble:.3f}; "
              f"peak microbatches held per rank {peaks} (bound {bounds})")
        print(f"{plan}\n{draw_measured(records, pp)}")
        trace += trace_events(f"{plan.name} (v={plan.virtual})", pid, records)
    print("\nNotice: 1F1B has GPipe's bubble but holds at most p - rank microbatches instead of m; "
          "interleaving divides the bubble by about v; ZB-H1 fills most of it with weight gradients.")
    if args.trace is not None:
        text = json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"})
        if write_new("--trace", args.trace, text):
            print(f"Wrote {args.trace}: open it in https://ui.perfetto.dev or chrome://tracing.")
    foundation.exit_distributed()


def bench(args: argparse.Namespace) -> None:
    """Ours against torch.distributed.pipelining on the same stages, microbatches and batch, schedule for
    schedule (for ZB-H1: their interleaved zero-bubble schedule, on one stage per rank)."""
    from torch.distributed import pipelining as torch_pp

    device = foundation.init_distributed()
    pp = dist.get_world_size()
    rank = dist.get_rank()
    cfg, batch, seq = run_sizes(args, pp)
    m = args.microbatches
    tokens, targets = (t.to(device) for t in foundation.synthetic_batch(cfg, batch, seq, 0))
    torch_schedules = {"gpipe": torch_pp.ScheduleGPipe, "1f1b": torch_pp.Schedule1F1B,
                       "interleaved": torch_pp.ScheduleInterleaved1F1B,
                       "zb-h1": torch_pp.ScheduleInterleavedZeroBubble}
    rows = []
    for name, v in schedule_runs(args, pp):
        torch_schedule = torch_schedules[name]
        plan = make_schedule(name, pp, m, v)
        ours, theirs = ({s: cut_stage(foundation.GPT(cfg), s, pp * v).to(device)
                         for s in range(rank, pp * v, pp)} for _ in range(2))
        torch_stages = [torch_pp.PipelineStage(mod, s, pp * v, device) for s, mod in theirs.items()]
        multi = name in ("interleaved", "zb-h1")  # torch's multi-stage schedules take a list
        schedule = torch_schedule(torch_stages if multi else torch_stages[0], m,
                                  loss_fn=foundation.cross_entropy_loss)
        opts = [foundation.make_optimizer(nn.ModuleList(s.values()), 1e-3) for s in (ours, theirs)]

        def ours_step() -> None:
            opts[0].zero_grad(set_to_none=True)
            run_schedule(plan, ours, tokens, targets)
            opts[0].step()

        def torch_step() -> None:
            opts[1].zero_grad(set_to_none=True)
            inputs = (tokens,) if rank == 0 else ()
            schedule.step(*inputs, **(dict(target=targets, losses=[]) if rank == pp - 1 else {}))
            opts[1].step()

        ours_step(), torch_step()  # one step from the same weights: the gradients must agree
        diff = max(foundation.all_ranks(foundation.max_abs_diff(
            *({n: p.grad for n, p in named_parameters(s)} for s in (ours, theirs)))))
        med = foundation.interleaved_medians({"ours": ours_step, torch_schedule.__name__: torch_step},
                                             args.bench_rounds, args.bench_steps, device)
        rows.append((f"{name} v={v}", diff, med))
    if rank == 0:
        n_params = sum(p.numel() for p in foundation.GPT(cfg).parameters())
        print(f"Pipeline step time on {foundation.counted(pp, 'rank')} ({dist.get_backend()}, "
              f"{device.type}), {n_params / 1e6:.1f}M parameters, batch {batch} x {seq} in "
              f"{foundation.counted(m, 'microbatch', 'microbatches')}, "
              f"{foundation.median_of(args)}:")
        for name, diff, med in rows:
            print(f"  {name:<16} {foundation.ratio_line(med)}; max |grad diff| {diff:.1e}")
    foundation.exit_distributed()


def check_writable(option: str, path: str) -> None:
    """Refuse, before the run, an output file that is there already or could not be written at its end."""
    if not path:
        raise ValueError(f"{option} needs a file name, not an empty one")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a folder: name a file in it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{option} {path}: its folder does not exist")
    if os.path.lexists(path):
        raise ValueError(f"{option} {path} exists: name a new file (a run overwrites none it did not make)")
    try:
        open(path, "x").close()  # the one reliable test (permissions, read-only mounts, root)
    except OSError as error:
        raise ValueError(f"{option} {path} cannot be written: {error.strerror}") from None
    os.remove(path)


def run_sizes(args: argparse.Namespace, pp: int) -> tuple[foundation.ModelConfig, int, int]:
    """The model (pp x virtual layers), batch and sequence length that main() runs on pp ranks."""
    if args.bench:
        model = foundation.ModelConfig(vocab_size=1024, dim=128, n_layers=pp * args.virtual, n_heads=4,
                                       ffn_dim=344)
        return model, 2 * args.microbatches, 64
    return foundation.ModelConfig(n_layers=pp * args.virtual), args.global_batch, args.seq_len


def check_run_memory(args: argparse.Namespace, pp: int) -> None:
    cfg, batch, seq_len = run_sizes(args, pp)
    sizes = f"--global-batch {batch} x --seq-len {seq_len}"
    if args.bench:
        sizes = f"--bench's --microbatches {args.microbatches}"
    ranks = foundation.counted(pp, "rank")
    foundation.check_memory(cfg, batch, seq_len, pp, what=f"{ranks} x --virtual {args.virtual}, {sizes}")


def write_new(option: str, path: str, text: str) -> bool:
    """Write text to path, checked free before the run (check_writable): a file made there since is
    someone else's and stays as it is (False, said on stderr)."""
    try:
        with open(path, "x") as f:
            f.write(text)
    except FileExistsError:
        print(f"{option} {path} was made by something else during the run: left as it is, nothing written",
              file=sys.stderr)
        return False
    return True


def validate_runs(args: argparse.Namespace, pp: int) -> None:
    """The sizes of each schedule main() runs on pp ranks (--bench: 2 rows a microbatch, m >= pp)."""
    rows = 2 * args.microbatches if args.bench else args.global_batch
    for name, v in schedule_runs(args, pp):
        validate_pipeline(pp * args.virtual, pp, rows, args.microbatches, name, v)


@dataclass
class Options:
    steps: int = foundation.option(3, "AdamW steps of each schedule and of the reference", ">= 1")
    global_batch: int = foundation.option(16, "sequences per step, cut into microbatches", ">= 1")
    seq_len: int = foundation.option(32, "tokens per sequence", ">= 1")
    microbatches: int = foundation.option(8, "microbatches per step (m)", ">= 1")
    virtual: int = foundation.option(2, "stages per rank, interleaved schedule", ">= 1")
    # at most 1000 ms: 4 schedules x 2 steps x (m + p - 1) x 3 units: minutes already
    unit_ms: float = foundation.option(50, "synthetic forward time per rank for the timelines, at most "
                                       "1000; 0: real compute", (">= 0", "<= 1000"), type=float)
    trace: str | None = foundation.option(None, "write the measured timelines to FILE as Chrome trace-event "
                                          "JSON (open it in Perfetto or chrome://tracing)", metavar="FILE")
    bench: bool = foundation.option(False, "step time against torch.distributed.pipelining")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options, foundation.Ranks, foundation.BenchRounds),
                                            bench_reads=("microbatches", "virtual"))
    rules = [functools.partial(validate_runs, args), functools.partial(check_run_memory, args)]
    if args.trace is not None:  # written at the end of the run: refused before it
        rules.insert(0, lambda pp: check_writable("--trace", args.trace))
    foundation.launch_lesson(parser, args, bench if args.bench else demo, rules=rules)


if __name__ == "__main__":
    main()
