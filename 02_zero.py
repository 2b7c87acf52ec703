"""Lesson 02: ZeRO, stages 1, 2 and 3, from reduce-scatter and all-gather; then sharded checkpoints.

The parts, in order:
  The cost models: zero_memory_per_rank (the paper's table), zero_traffic_per_step, zero_transient_bytes
  The ZeRO optimizer: zero_units, FlatUnit (a unit as one flat vector), ZeRO (its stages' hooks, step)
  Training: train_zero, ZeRO on N ranks (its one-device twin: lesson 01's train_single_device)
  Sharded checkpoints (lesson 09's run calls them): Piece (runs of elements), overlaps; the files:
    save_checkpoint, open_checkpoint; the folder lock: claim_folder; slice reads: CheckpointReader,
    load_model; ZeRO's shards as pieces: zero_pieces, load_checkpoint
  RUN IT: demo (every stage; then ZeRO-3's checkpoint loaded on half the ranks and on one device), bench
  Last, for lesson 09's plan only (a GPU's seconds, not measured here): zero_step_bytes, zero_exposed_seconds

ZERO: THE IDEA
Data parallelism (lesson 01) keeps N copies of the parameters, gradients and optimizer state. But
AdamW is elementwise: element i of the update needs only element i of the parameter, gradient and
moments. So N ranks can cut the flattened model into N shards, each rank keeping the optimizer
state of its own 1/N (Rajbhandari et al., "ZeRO", 2020):
- stage 1 shards the optimizer state. A reduce-scatter (the first half of an all-reduce) leaves
  each rank the averaged gradient of its shard; it updates its shard; an all-gather (the second
  half) gives every rank the whole updated model.
- stage 2 also shards the gradients: each module's full gradient is freed once sent, and its send
  buffer once the next module's gradient is complete (one reduction in flight at a time).
- stage 3 also shards the parameters: a module's full parameters are all-gathered just before its
  forward and again before its backward, and freed after each; meanwhile the next module's gather
  is already in flight (prefetch).
Every stage reduces a module's gradient from a backward hook the moment backward completes it
(lesson 01's buckets: the reduction runs while backward computes the modules before it).
Stage 0, plain data parallelism (an all-reduce of the gradients), is the tables' baseline.
UNITS: the embedding, each block, the final norm and the head each flatten their parameters into one
vector (a unit), zero-padded to a multiple of N (the padding's value, gradient and moments stay zero);
rank r owns [r s, (r+1) s), s = padded / N. The model's own unit, gathered around its whole forward
(FSDP2's root), takes a parameter registered on the model itself or tied between two modules (an LM
head that is the embedding: one slot, one gradient, one checkpoint entry). Frozen parameters are
never updated nor synchronised, as in torch: they stay whole on every rank (FSDP2 shards them too).
GRADIENT CLIPPING must see the whole gradient: ||g||^2 is the sum over ranks of their shards'
squared norms (one scalar all-reduce). Clipping each shard by its own norm is the classic bug.

COST per rank for Psi parameters, P and G bytes per parameter and gradient element, K bytes of
optimizer state per parameter (mixed precision: bf16 P = G = 2, fp32 master weights, momentum and
variance K = 12; plain fp32: P = G = 4, K = 8, the fp32 parameters being their own master; BF16
AdamW, bf16_optimizer: the bf16 parameters are their own master, the moments bf16 too, K = 4, and an
update below a parameter's last bit, 2^-8 of it, is lost, as weight decay's lr x 0.1 always is):
    memory, stage 0: (P + G + K) Psi     stage 1: (P + G) Psi + K Psi / N
            stage 2: P Psi + (G + K) Psi / N     stage 3: (P + G + K) Psi / N
The paper's example, Psi = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
Traffic per step (ring): DDP's all-reduce moves 2 (N-1)/N G Psi. Stages 1 and 2 move a reduce-scatter
plus an all-gather, (N-1)/N (G + P) Psi: the same. Stage 3 gathers the parameters twice (forward
and backward): (N-1)/N (G + 2P) Psi = 1.5x DDP.
FP32 GRADIENTS (fp32_grads, stages 0-1 of mixed precision): each backward's bf16 gradient is added
into an fp32 buffer and dropped (a parameter's .grad stays None: read flat_grad, grad_shard), and the
buffer is reduced in fp32, as Megatron's main_grad and FSDP2's reduce_dtype under a pipeline do: G = 4,
the reduction's bytes twice bf16's, and each addition of the microbatches' and ranks' sum rounded at
fp32's 2^-24, not bf16's 2^-8.

SHARDED CHECKPOINTS
No rank holds the whole state to write it, so each writes what it holds, as pieces: (name, the whole
tensor's shape, the runs of consecutive elements of the flattened tensor that the rank holds): a ZeRO
shard is one run per parameter, a tensor-parallel slice of columns (lesson 09) one run per row. Each
element is written once, by one of its holders.
INTEGRITY: a step's folder (step_00000100/) holds a file per rank (rank00000.pt: its pieces and RNG
state) and meta.json (the step, the caller's record, the model's configuration, each rank file's bytes
and sha256). Every file is written aside, then renamed, and LATEST (naming the step) moves last, so a
crash leaves the previous checkpoint whole; a save that fails on any rank (a full disk) is one line on
every rank and leaves nothing partial; a damaged file is one line naming it and the previous complete
step. A lock on the folder (LOCK) keeps a second run out and marks the folder a run's: a run removes only its
own names there, and refuses a folder that holds anything else (a user's files stay as they are).
RESHARDING: a load on another group size or stage reads, for each piece it holds now, only the saved
runs that overlap it (two binary searches over sorted runs, in memory-mapped files), once every rank
agrees that all could read. It is the one way state changes layout here: lesson 09's resume on another
mesh, train_zero's resume_after, the demo's smaller group and one device.
COST: on disk (parameters + 2 AdamW moments) x 4 B x Psi, whatever N, + metadata; a load reads 12 B x
its shard's elements on each rank (12 Psi / N), never the whole.

RUN IT
    python 02_zero.py                       # 4 local CPU ranks (one per GPU on a GPU node)
    python 02_zero.py --bench               # ZeRO-3 against PyTorch's FSDP2 (fully_shard)
Look at: the max |difference| from one device running AdamW with the same clipping (rounding only);
the paper's table; the bytes each rank actually holds (live tensors' storages) beside the formula;
the traffic per step beside 1x and 1.5x DDP; the gathers in flight in stage 3; the checkpoint's bytes
on disk beside 12 B x Psi, the bytes each rank of half the group read beside its shard, and the state
they loaded equal to the saved one bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import importlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

foundation = importlib.import_module("01_ddp")

STAGES = (0, 1, 2, 3)
ADAM_KEYS = foundation.ADAM_KEYS  # AdamW's moments
ADAM_MOMENT_BYTES = 8  # both in fp32
CHECKPOINT_KINDS = ("params", *ADAM_KEYS)  # what a shard holds of each element: fp32 value, moments
STEP_COUNTER_BYTES = 4  # torch's AdamW keeps `step` as one fp32 scalar tensor per parameter tensor


# --- The cost models ---------------------------------------------------------------------------------------
def validate_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} must be one of {STAGES}")


def zero_memory_per_rank(psi: int, n: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
                         optim_bytes: int = 12) -> dict[str, Fraction]:
    """Bytes one of n ranks holds for psi parameters: (parameters, gradients, optimizer state)."""
    validate_stage(stage)
    return {"params": Fraction(param_bytes * psi, n if stage >= 3 else 1),
            "grads": Fraction(grad_bytes * psi, n if stage >= 2 else 1),
            "optimizer": Fraction(optim_bytes * psi, n if stage >= 1 else 1)}


def zero_traffic_per_step(psi: int, n: int, stage: int, param_bytes: int,
                          grad_bytes: int) -> dict[str, Fraction]:
    """Ring traffic per rank per step, by collective (the scalar norm all-reduce aside)."""
    validate_stage(stage)
    if stage == 0:
        return {"all_reduce": foundation.ring_traffic("all_reduce", grad_bytes * psi, n)}
    gathers = 2 if stage == 3 else 1  # stage 3 gathers before forward and again before backward
    return {"reduce_scatter": foundation.ring_traffic("reduce_scatter", grad_bytes * psi, n),
            "all_gather": gathers * foundation.ring_traffic("all_gather", param_bytes * psi, n)}


def padded_size(numel: int, n: int) -> int:
    """A flat vector of numel elements zero-padded to a multiple of n (each of n ranks owns 1/n)."""
    return -(-numel // n) * n


def zero_memory_formula(padded: int, units: int, n: int, stage: int, mixed_precision: bool,
                        bf16_optimizer: bool = False, fp32_grads: bool = False) -> dict[str, Fraction]:
    """What a ZeRO below holds per rank for `units` flat vectors of `padded` elements in all: COST's
    formula plus AdamW's step counter per unit."""
    size = 2 if mixed_precision else 4
    grad_size = 4 if fp32_grads else size
    if bf16_optimizer:  # two bf16 moments; the bf16 parameters are their own master
        state = 2 * 2
    else:  # two fp32 moments, and beside bf16 parameters an fp32 master
        state = ADAM_MOMENT_BYTES + 4 * mixed_precision
    formula = zero_memory_per_rank(padded, n, stage, size, grad_size, state)
    formula["optimizer"] += STEP_COUNTER_BYTES * units
    return formula


def zero_transient_bytes(psi: int, unit: int, n: int, stage: int, mixed_precision: bool,
                         bf16_optimizer: bool = False, fp32_grads: bool = False) -> tuple[int, int]:
    """The most one ZeRO holds beyond zero_memory_formula: (in backward, at the step). Backward: stage 3's
    gathered unit and the one prefetched, a unit's full gradient and the one before it in its send buffer
    (stage 2: those two), `unit` elements each; stage 1's reduce-scatter output, made as backward
    completes each unit (the head's first, while the activations are still held). The step: the shard's
    gradient copied into the master's dtype where the two differ (a bf16 gradient beside fp32 masters,
    an fp32 one beside BF16 AdamW's), stage 1's output. Fused AdamW (on a GPU) makes no temporaries
    (foreach: 4 B an element)."""
    g = 2 if mixed_precision and not fp32_grads else 4  # the gradient buffer's bytes an element
    master = 2 if bf16_optimizer else 4
    shard = psi if stage == 0 else -(-psi // n)
    output = g * shard * (stage == 1)
    copy = master * shard * (g != master)
    return 2 * g * unit * ((stage >= 2) + (stage == 3)) + output, copy + output


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind tensors that are not in `seen` yet, each once (views and
    aliases share a storage); adds them to `seen`."""
    storages = [(t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # DTensor: its shard
                for t in tensors if t is not None]
    new = {s.data_ptr(): s.nbytes() for s in storages if s.nbytes() and s.data_ptr() not in seen}
    seen.update(new)
    return sum(new.values())


# --- The ZeRO optimizer ------------------------------------------------------------------------------------
def zero_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose parameters are flattened together, in the order forward runs them. In
    stage 3 each is gathered as one piece: gathering per block keeps one block's full weights alive."""
    names = ["embed", *(f"layers.{i}" for i in getattr(model, "layers", ())), "norm", "lm_head"]
    return [(name, model.get_submodule(name)) for name in names
            if getattr(model, name.split(".")[0], None) is not None]


def unit_parameters(model: nn.Module, owns: Callable[[nn.Parameter], bool]
                    ) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(module, its unit's (name, parameter) pairs) for each unit that has any: the model's own first,
    then zero_units(model). A trainable parameter's unit is its module's, or the model's own (UNITS)."""
    units = [("", model), *zero_units(model)]
    home: dict[nn.Parameter, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        unit = next((i for i, (prefix, _) in enumerate(units[1:], 1) if name.startswith(prefix + ".")), 0)
        home[p] = unit if home.get(p, unit) == unit else 0
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in units]
    for name, p in model.named_parameters():
        if p.requires_grad and owns(p):
            members[home[p]].append((name, p))
    return [(module, named) for (_, module), named in zip(units, members) if named]


class FlatUnit:
    """A unit's parameters as one flat vector (see UNITS), by stage full or sharded (see COST)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], world: int, rank: int, stage: int,
                 dtype: torch.dtype, master_dtype: torch.dtype = torch.float32,
                 grad_dtype: torch.dtype | None = None) -> None:
        self.names, self.params = map(list, zip(*named))
        self.shapes = [p.shape for p in self.params]
        self.offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
        self.padded = padded_size(self.offsets[-1], world)
        s = self.padded // world
        self.owned = slice(0, self.padded) if stage == 0 else slice(rank * s, (rank + 1) * s)
        full = self.flatten([p.detach() for p in self.params], torch.float32)
        self.released = full.new_empty(0, dtype=dtype)  # what the parameters point at while freed
        self.flat_param = self.gathered = self.flat_grad = self.grad_shard = self.grad_views = None
        if stage < 3:  # the full parameters persist; the module's parameters are views of them
            self.flat_param = full.to(dtype, copy=True)
            self.bind(self.flat_param)
            self.shard = self.flat_param[self.owned]
        else:  # only the shard persists; `gathered` holds the full parameters around each use
            self.shard = full[self.owned].to(dtype, copy=True)
            self.release()
        # The parameters in the master's dtype are their own master (an alias, no copy). Mixed precision:
        # an fp32 copy of the shard, taken from the fp32 initial values, never from their bf16 rounding.
        self.master = nn.Parameter(self.shard if dtype == master_dtype else full[self.owned].clone())
        if stage < 2:  # gradients accumulate in place into views of one full flat buffer
            self.flat_grad = torch.zeros(self.padded, dtype=grad_dtype or dtype, device=full.device)
            if self.flat_grad.dtype == dtype:
                for p, view in zip(self.params, self.views(self.flat_grad), strict=True):
                    p.grad = view
            else:  # a .grad has its parameter's dtype: ZeRO's hook adds each one into its fp32 view
                self.grad_views = self.views(self.flat_grad)
        else:  # only this rank's averaged gradient persists
            self.grad_shard = torch.zeros_like(self.shard)
        # In flight: stage 3's all-gather, the gradients' (reduction, its input until released); `ready`: the
        # indices of the parameters whose gradient backward has completed.
        self.gather_work = None
        self.reduction = None
        self.ready = set()

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=dtype, device=tensors[0].device)
        for i, t in enumerate(tensors):
            flat[self.offsets[i]:self.offsets[i + 1]].copy_(t.flatten())
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[self.offsets[i]:self.offsets[i + 1]].view(shape) for i, shape in enumerate(self.shapes)]

    def gather_input(self) -> torch.Tensor:
        """What ZeRO-3's all-gather sends for this unit: the shard itself. A subclass may send
        another encoding of it (lesson 08: the weights' FP8 casts) and bind() what arrives."""
        return self.shard

    def bind(self, flat: torch.Tensor) -> None:
        """Point the parameters at views of flat (autograd keeps the same leaf tensors)."""
        for p, view in zip(self.params, self.views(flat), strict=True):
            p.data = view

    def release(self) -> None:
        for p in self.params:
            p.data = self.released
        self.gathered = None


def shard_parts(unit: FlatUnit) -> list[tuple[int, int, int]]:
    """(i, start, stop) for each parameter i with elements [start, stop) in this rank's shard, in
    order: they follow one another from the shard's start, at unit.offsets[i] + start - owned.start."""
    parts = [(i, max(begin, unit.owned.start) - begin, min(end, unit.owned.stop) - begin)
             for i, (begin, end) in enumerate(zip(unit.offsets, unit.offsets[1:]))]
    return [(i, start, stop) for i, start, stop in parts if start < stop]


class ZeRO:
    """Shards AdamW (stage 1), gradients (2) and parameters (3) of `model` over `group`.

        zero = ZeRO(model, stage=3, max_grad_norm=1.0)
        model(x, y).backward()         # each unit's reduction launches from a backward hook
        grad_norm = zero.step()        # sync, clip by the global norm, AdamW on the shard, gather
        zero.zero_grad()
    Microbatches: run all but the last backward (or all, then finish_gradient_sync()) in no_sync().
    """

    unit_type = FlatUnit  # a subclass may flatten and gather its units otherwise (lesson 08)

    def __init__(self, model: nn.Module, stage: int, group=None, *, lr: float = 1e-3,
                 adam_eps: float = 1e-8, max_grad_norm: float = math.inf,
                 mixed_precision: bool = False, bf16_optimizer: bool = False, fp32_grads: bool = False,
                 prefetch: bool = True, owns: Callable[[nn.Parameter], bool] | None = None) -> None:
        """owns: shard only the parameters it accepts (lesson 09 gives an MoE's experts, which
        differ between the ranks of `group`, a ZeRO of their own over another group); the caller
        then answers for the others, so the model is not claimed."""
        validate_stage(stage)  # every check before the first collective: no rank is left waiting
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0")
        if bf16_optimizer and not mixed_precision:
            raise ValueError("bf16_optimizer keeps AdamW's state in the bf16 of mixed precision's "
                             "parameters: it needs mixed_precision=True")
        if fp32_grads and not mixed_precision:
            raise ValueError("fp32_grads adds mixed precision's bf16 gradients into fp32: it needs "
                             "mixed_precision=True (fp32 parameters have fp32 gradients)")
        if fp32_grads and stage >= 2:
            raise ValueError(f"fp32_grads keeps stages 0-1's whole gradient buffer in fp32; stage {stage} "
                             f"frees each unit's gradient once sent: use stage 0 or 1")
        owned = owns or (lambda p: True)
        units = unit_parameters(model, owned)
        if not units:
            raise ValueError("the model has no trainable parameter (requires_grad=True) to shard")
        self.world = foundation.group_size(group)
        rank = dist.get_rank(group)
        if owns is None:
            foundation.claim_gradient_sync(model, f"ZeRO-{stage}")
            foundation.broadcast_parameters(model, group)
        else:
            for p in filter(owns, model.parameters()):
                foundation.broadcast(p.detach(), src=0, group=group)
        self.model = model
        self.stage = stage
        self.group = group
        self.prefetch = prefetch
        self.max_grad_norm = max_grad_norm
        self.dtype = torch.bfloat16 if mixed_precision else torch.float32
        # Frozen parameters (see UNITS) stay whole, in the compute dtype: no slot, no state, no traffic.
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad and owned(p)]
        for _, p in self.frozen:
            p.data = p.data.to(self.dtype)
        master_dtype = self.dtype if bf16_optimizer else torch.float32
        grad_dtype = torch.float32 if fp32_grads else self.dtype
        self.units = [self.unit_type(named, self.world, rank, stage, self.dtype, master_dtype, grad_dtype)
                      for _, named in units]
        masters = nn.ParameterList(u.master for u in self.units)
        self.optimizer = foundation.make_optimizer(masters, lr, adam_eps)
        self.sync_gradients = True
        self.sending = None  # stages 2-3: the unit whose reduction still reads its send buffer
        self.max_gathers_in_flight = 0
        self.prefetched_gathers = 0
        for index, (unit, (module, _)) in enumerate(zip(self.units, units)):
            for i, p in enumerate(unit.params):
                on_grad_ready = foundation.weak_hook(self._on_grad_ready, index, i)
                p.register_post_accumulate_grad_hook(on_grad_ready)
            if stage == 3:
                module.register_forward_pre_hook(lambda m, args, i=index: self._gather(i, i + 1))
                module.register_forward_hook(lambda m, args, out, i=index: self._after_forward(i, out))

    # --- stage 3: parameters exist only around their module's forward and backward -------------
    def _launch_gather(self, unit: FlatUnit) -> None:
        if unit.gathered is None:
            send = unit.gather_input()
            unit.gathered = send.new_empty(unit.padded)
            unit.gather_work = foundation.all_gather(unit.gathered, send, group=self.group, async_op=True)
            in_flight = sum(u.gather_work is not None and not u.gather_work.is_completed()
                            for u in self.units)
            self.max_gathers_in_flight = max(self.max_gathers_in_flight, in_flight)

    def _gather(self, index: int, next_index: int) -> None:
        """Wait for unit index's parameters (prefetched, or gathered now); prefetch next_index's."""
        unit = self.units[index]
        self.prefetched_gathers += unit.gathered is not None
        self._launch_gather(unit)
        if unit.gather_work is not None:  # None: still gathered from an earlier use
            unit.gather_work.wait()
            unit.gather_work = None
        unit.bind(unit.gathered)
        if self.prefetch and 0 <= next_index < len(self.units):
            self._launch_gather(self.units[next_index])

    def _after_forward(self, index: int, output: torch.Tensor) -> None:
        self.units[index].release()
        if output.requires_grad:  # backward reaches this module when output's gradient is ready
            output.register_hook(foundation.weak_hook(self._gather_for_backward, index))

    def _gather_for_backward(self, index: int, grad: torch.Tensor) -> None:
        """Unit index's output hook: backward reaches its module, which needs its parameters again."""
        self._gather(index, index - 1)

    # --- every stage: reduce each unit's gradient as soon as backward completes it ---------------
    def _on_grad_ready(self, index: int, i: int, param: nn.Parameter) -> None:
        """The hook of unit index's parameter i (param): its gradient is complete."""
        unit = self.units[index]
        if unit.reduction is not None:
            raise RuntimeError("a second backward before step(): ZeRO here reduces every backward's "
                               "gradients; call step() after each backward, or run the earlier "
                               "backwards under no_sync()")
        if unit.grad_views is not None:  # fp32_grads: this backward's bf16 gradient, added in fp32
            unit.grad_views[i].add_(param.grad)
            param.grad = None
        unit.ready.add(i)
        if len(unit.ready) < len(unit.params):
            return
        unit.ready.clear()
        if self.stage == 3:
            unit.release()  # every use of these parameters in this backward is done
        if self.sync_gradients:
            self._reduce(unit)

    def _reduce(self, unit: FlatUnit) -> None:
        """Launch the unit's reduction; it runs while backward computes the units before this one."""
        if self.stage == 0:  # in place: the buffer the gradients accumulate in
            unit.grad_shard = unit.flat_grad
            work = foundation.all_reduce(unit.flat_grad, group=self.group, async_op=True)
            unit.reduction = (work, unit.flat_grad)
            return
        if self.stage == 1:  # the full buffer stays: the next step accumulates into it
            unit.grad_shard = unit.flat_grad.new_empty(unit.shard.numel())
            send = unit.flat_grad
        else:
            self._release_send_buffer()
            send = unit.flatten([p.grad for p in unit.params], self.dtype)
            for p in unit.params:
                p.grad = None  # the full gradient is freed: only the send buffer lives until the wait
            self.sending = unit
        work = foundation.reduce_scatter(unit.grad_shard, send, group=self.group, async_op=True)
        unit.reduction = (work, send)

    def _release_send_buffer(self) -> None:
        """Wait for the reduction still reading the previous unit's send buffer, and drop the buffer.
        The price, FSDP2's by default (one reduce-scatter input kept; a larger cap buys overlap): a
        reduction longer than the next unit's backward stalls it (the head's, behind the final norm's)."""
        if self.sending is None:
            return
        work, _ = self.sending.reduction
        work.wait()
        self.sending.reduction = (work, None)
        self.sending = None

    # Microbatches: lesson 01's no_sync(); backward passes inside only add to the full gradients (.grad).
    no_sync = foundation.BucketedDataParallel.no_sync

    # --- the step ---------------------------------------------------------------------------
    def finish_gradient_sync(self) -> None:
        """Leave every unit's grad_shard holding the gradient of the global mean loss."""
        for unit in self.units:
            if unit.reduction is None:  # accumulated under no_sync(), or by autograd.grad
                if unit.flat_grad is None and (  # stages 0-1: a gradient never given stays 0 in flat_grad
                        missing := [n for n, p in zip(unit.names, unit.params) if p.grad is None]):
                    raise RuntimeError(f"parameters got no gradient this step (unused "
                                       f"parameters are not supported): {missing[:5]}")
                if self.stage == 3:
                    unit.release()
                self._reduce(unit)
            unit.reduction[0].wait()
            unit.reduction = None
            if self.sending is unit:
                self.sending = None
            unit.ready.clear()
            unit.grad_shard.div_(self.world)

    @torch.no_grad()
    def grad_squares(self, share: Callable[[nn.Parameter], float] = lambda p: 1.0) -> torch.Tensor:
        """The squared norm of the averaged gradient, summed over the group. share(p) weighs each
        parameter's part: a model that is itself split over more ranks (tensor, pipeline parallel)
        sums the parts of all ranks, and a parameter held by t of them counts 1/t on each."""
        squares = torch.zeros((), device=self.units[0].shard.device)
        for unit in self.units:
            parts = [(share(unit.params[i]), stop - start) for i, start, stop in shard_parts(unit)]
            begin = 0  # the parts follow one another: neighbours of equal share are one reduction
            for weight, run in itertools.groupby(parts, key=lambda part: part[0]):
                end = begin + sum(length for _, length in run)
                grads = unit.grad_shard[begin:end]  # summed in fp32, without an fp32 copy of a bf16 one
                squares += torch.linalg.vector_norm(grads, dtype=torch.float32).square() * weight
                begin = end
        if self.stage > 0:  # each rank has its shard's share of the sum
            foundation.all_reduce(squares, group=self.group)
        return squares

    @torch.no_grad()
    def clip_and_update(self, squares: torch.Tensor | None = None) -> torch.Tensor:
        """Clip by the global gradient norm, AdamW on the shards, refresh the compute parameters.
        squares: the squared norm over a larger model than this one (default grad_squares()).
        Returns the norm before clipping, as torch.nn.utils.clip_grad_norm_ does."""
        grads = [u.grad_shard.to(u.master.dtype) for u in self.units]  # the same tensors where dtypes match
        norm = (self.grad_squares() if squares is None else squares).sqrt()
        scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s rule
        for unit, grad in zip(self.units, grads, strict=True):
            unit.master.grad = grad.mul_(scale)
        self.optimizer.step()
        for unit in self.units:
            unit.master.grad = None
            if self.stage < 2:
                unit.grad_shard = None  # stage 1's reduce-scatter output; stage 0's is flat_grad
            self._refresh_compute_params(unit)
        return norm

    def _refresh_compute_params(self, unit: FlatUnit) -> None:
        """After the master shard changed: its compute copy, and (stages 1-2) the full parameters."""
        if unit.master.data_ptr() != unit.shard.data_ptr():
            unit.shard.copy_(unit.master)  # mixed precision: round the fp32 master to bf16
        if self.stage in (1, 2) and self.world > 1:  # in place of the old full ones; stage 3 gathers later
            foundation.all_gather(unit.flat_param, unit.shard.clone(), group=self.group)

    def step(self) -> torch.Tensor:
        self.finish_gradient_sync()
        return self.clip_and_update()

    def zero_grad(self) -> None:
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()

    # --- measurement and checkpoints ---------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by storage_bytes (a master aliasing the parameters counts as them)."""
        seen: set[int] = set()
        own = [p for u in self.units for p in u.params]
        params = [*own, *(p for _, p in self.frozen),
                  *(t for u in self.units for t in (u.flat_param, u.shard))]
        grads = [*(p.grad for p in own), *(t for u in self.units for t in (u.flat_grad, u.grad_shard))]
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": storage_bytes(params, seen), "grads": storage_bytes(grads, seen),
                "optimizer": storage_bytes([*(u.master for u in self.units), *state], seen)}

    def memory_formula(self) -> dict[str, Fraction]:
        formula = zero_memory_formula(sum(u.padded for u in self.units), len(self.units), self.world,
                                      self.stage, self.dtype != torch.float32,
                                      self.units[0].master.dtype != torch.float32,
                                      self.units[0].grad_views is not None)
        formula["params"] += sum(p.nbytes for _, p in self.frozen)  # whole on every rank
        return formula

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One shard per unit (stage 0: the whole vector) -> the full CPU tensors by parameter name,
        on every rank: the gradients (for tests), the parameters and AdamW state (full_state_dict)."""
        full = {}
        for unit, shard in zip(self.units, shards, strict=True):
            flat = shard.new_empty(unit.padded) if self.stage else shard
            if self.stage:
                foundation.all_gather(flat, shard.detach().contiguous(), group=self.group)
            full.update(foundation.cpu_copy(zip(unit.names, unit.views(flat), strict=True)))
        return full

    def shard_state(self, unit: FlatUnit) -> dict[str, torch.Tensor]:
        """This rank's shard of unit's fp32 parameters and AdamW moments (zeros before a step)."""
        adam = self.optimizer.state.get(unit.master, {})
        return {"params": unit.master, **{k: adam.get(k, torch.zeros_like(unit.master)) for k in ADAM_KEYS}}

    def full_state_dict(self) -> dict:
        """Unsharded fp32 parameters and AdamW state by parameter name, gathered on every rank: the
        parameters as torch's state_dict() gives them (a tied one under each of its names, so a strict
        load_state_dict takes them), the moments under the first name; frozen ones have no state."""
        shards = [self.shard_state(u) for u in self.units]
        state = {key: self.unshard([s[key] for s in shards]) for key in CHECKPOINT_KINDS}
        params = state["params"] = {**state["params"], **foundation.cpu_copy(self.frozen)}
        first = {p: name for name, p in self.model.named_parameters()}
        params.update((name, params[first[p]]) for name, p in
                      self.model.named_parameters(remove_duplicate=False) if first[p] in params)
        step = self.optimizer.state.get(self.units[0].master, {}).get("step", 0)
        return {**state, "step": int(step)}

    @torch.no_grad()
    def load_shards(self, shards: list[dict[str, torch.Tensor]], step: int) -> None:
        """This rank's shards, one {kind: values of unit.owned} per unit, as load_checkpoint reads them."""
        for unit, values in zip(self.units, shards, strict=True):
            unit.master.copy_(values["params"])
            moments = {key: values[key].to(unit.master, copy=True) for key in ADAM_KEYS}  # its device, dtype
            self.optimizer.state[unit.master] = {"step": torch.tensor(float(step)), **moments}
            self._refresh_compute_params(unit)


# --- Training: ZeRO on N ranks (its one-device twin: 01's train_single_device) -----------------------------
@dataclass
class ZeroResult(foundation.TrainResult):
    held: dict[str, int] = field(default_factory=dict)      # bytes held per rank after the last step
    formula: dict[str, Fraction] = field(default_factory=dict)


def train_zero(cfg: "foundation.ModelConfig", steps: int, global_batch: int, seq_len: int, *, stage: int,
               lr: float = 1e-3, adam_eps: float = 1e-8, max_grad_norm: float = math.inf,
               mixed_precision: bool = False, bf16_optimizer: bool = False, fp32_grads: bool = False,
               prefetch: bool = True, folder: str | None = None, resume_after: int | None = None, group=None,
               device: torch.device | str = "cpu",
               transform: Callable | None = None) -> tuple[ZeroResult, "foundation.CommMeter"]:
    """Train on this rank's slice of the global batches 01's train_single_device sees (transform: as
    there). folder: save a checkpoint there after the last step and, with resume_after=k, after k
    steps, when a fresh model and ZeRO load it (load_checkpoint) and go on. Returns the result and a
    meter of the training steps' communication (not of the test probes: step-0 gradients, full states)."""
    world = foundation.group_size(group)
    rank = dist.get_rank(group)
    if global_batch % world:
        raise ValueError(f"global_batch={global_batch} is not divisible by the group size {world}")
    if resume_after is not None and folder is None:
        raise ValueError("resume_after resumes from a checkpoint: give its folder")

    def build() -> tuple[nn.Module, ZeRO]:
        model = foundation.GPT(cfg)
        model = (transform(model) if transform else model).to(device)
        return model, ZeRO(model, stage, group, lr=lr, adam_eps=adam_eps, max_grad_norm=max_grad_norm,
                           mixed_precision=mixed_precision, bf16_optimizer=bf16_optimizer,
                           fp32_grads=fp32_grads, prefetch=prefetch)

    model, zero = build()
    result = ZeroResult([], {}, {})
    steps_meter = foundation.CommMeter()
    local_losses = []
    for step in range(steps):
        if step == resume_after:
            save_checkpoint(folder, step, zero_pieces(zero), cfg, group=group)
            model, zero = build()
            load_checkpoint(folder, cfg, [(zero, whole_tensor)], group=group)
        tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step, rank, world)
        with foundation.comm_meter() as meter:
            loss = model(tokens.to(device), targets.to(device))
            loss.backward()
            zero.finish_gradient_sync()
        if step == 0:
            result.first_grads = zero.unshard([u.grad_shard for u in zero.units])
        with foundation.comm_meter() as update_meter:
            result.grad_norms.append(zero.clip_and_update().item())
        steps_meter += meter
        steps_meter += update_meter
        local_losses.append(loss.detach())
        zero.zero_grad()
    if folder is not None:
        save_checkpoint(folder, steps, zero_pieces(zero), cfg, group=group)
    result.held = zero.held_bytes()
    result.formula = zero.memory_formula()
    result.losses = foundation.mean_over_ranks(local_losses, group)
    result.state = zero.full_state_dict()
    result.params = result.state["params"]
    result.stats = dict(units=len(zero.units), padded_params=sum(u.padded for u in zero.units),
                        max_gathers_in_flight=zero.max_gathers_in_flight,
                        prefetched_gathers=zero.prefetched_gathers)
    return result, steps_meter


# --- Sharded checkpoints: pieces, the files, the folder lock, slice reads, then ZeRO's shards as pieces ----
class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or a folder that cannot be written: one line, what to do."""


@dataclass
class Piece:
    """The elements of one tensor that a rank holds: runs of consecutive elements of the whole tensor
    flattened, rows (first index in the whole tensor, offset in the rank's values, length), sorted
    and disjoint. The rank's values have `size` elements; those no run covers are padding."""
    name: str
    shape: tuple[int, ...]
    runs: torch.Tensor  # int64, (runs, 3)
    size: int

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> Piece:
        """A whole tensor, one run (what one device holds)."""
        return cls(name, tuple(shape), torch.tensor([[0, 0, math.prod(shape)]]), math.prod(shape))

    def narrow(self, start: int, stop: int) -> Piece:
        """The piece of the values [start, stop) (a ZeRO shard of them), offsets counted from start."""
        begin = self.runs[:, 1].clamp(min=start)
        end = (self.runs[:, 1] + self.runs[:, 2]).clamp(max=stop)
        runs = torch.stack([self.runs[:, 0] + begin - self.runs[:, 1], begin - start, end - begin], 1)
        return Piece(self.name, self.shape, runs[begin < end], stop - start)

    def elements(self) -> int:
        return int(self.runs[:, 2].sum())


def overlaps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two pieces' runs (each sorted and disjoint) -> the elements they share, as rows (offset in a,
    offset in b, length). The runs of b that meet a run of a lie between two binary searches."""
    a_start = a[:, 0].contiguous()
    b_start = b[:, 0].contiguous()
    a_end = a_start + a[:, 2]
    b_end = b_start + b[:, 2]
    first = torch.searchsorted(b_end, a_start, right=True)  # b's first run that ends after a's starts
    count = (torch.searchsorted(b_start, a_end) - first).clamp(min=0)
    i = torch.repeat_interleave(torch.arange(len(a)), count)
    j = first[i] + torch.arange(len(i)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    begin, end = torch.maximum(a_start[i], b_start[j]), torch.minimum(a_end[i], b_end[j])
    return torch.stack([a[i, 1] + begin - a_start[i], b[j, 1] + begin - b_start[j], end - begin], 1)


# --- the files of a checkpoint --------------------------------------------------------------------
def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> int:
    """A reader sees the old file or the whole new one, never a part: write aside, then rename (a
    write that fails removes its part). Returns the bytes written."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path.stat().st_size


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def os_error(error: BaseException | None) -> str | None:
    """'OSError: [Errno 28] No space left on device' for an OSError or an error raised while handling one
    (torch.save's zip writer reports a full disk as a RuntimeError, "unexpected pos"); else None."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return None if error is None else f"{type(error).__name__}: {error}"


def step_of(path: Path) -> int | None:
    number = path.name.removeprefix("step_")
    return int(number) if path.name.startswith("step_") and number.isdigit() else None


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    pointer = Path(folder) / "LATEST"
    return Path(folder) / pointer.read_text(errors="replace").strip() if pointer.is_file() else None


def checkpoint_config(cfg: foundation.ModelConfig | None) -> dict:
    """What must match for a checkpoint to load: every field that shapes the model. Not the seed,
    which only draws the initial weights that a checkpoint replaces. None: no model (bare tensors)."""
    return {k: v for k, v in asdict(cfg).items() if k != "seed"} if cfg is not None else {}


def save_checkpoint(folder: str | os.PathLike, step: int, pieces: list[tuple[Piece, dict[str, torch.Tensor]]],
                    cfg: foundation.ModelConfig | None = None, record: dict | None = None,
                    keep: Sequence[int] = (), group: dist.ProcessGroup | None = None,
                    exchange: Callable[[object], list] | None = None) -> Path:
    """Every rank of group calls this with the pieces it writes (each element once across the ranks)
    and their values of each kind, on a filesystem every rank sees: rank files, meta.json (with record
    and cfg), LATEST, then the step folders but this one and `keep` go. exchange: all_ranks (tests)."""
    root = Path(folder)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    exchange = exchange or (lambda x: foundation.all_ranks(x, group) if dist.is_initialized() else [x])
    target = root / f"step_{step:08d}"
    name = f"rank{rank:05d}.pt"
    # Each piece's name, shape, runs as (first, length) and the elements they cover, packed.
    rows = [(piece.name, tuple(piece.shape), piece.runs[:, [0, 2]].tolist(),
             {kind: torch.cat([t[o:o + n] for _, o, n in piece.runs.tolist()]) for kind, t in data.items()})
            for piece, data in pieces if len(piece.runs)]
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    try:
        target.mkdir(parents=True, exist_ok=True)
        size = atomic_write(target / name, lambda f: torch.save({"pieces": rows, "rng": rng}, f))
        written = (name, size, file_sha256(target / name), None)
    except Exception as error:
        if os_error(error) is None:
            raise
        written = (name, 0, "", os_error(error))
    records = exchange(written)
    problem = next((f"rank {r}: {error}" for r, (*_, error) in enumerate(records) if error), None)
    files = {n: {"bytes": b, "sha256": h} for n, b, h, _ in records}
    if problem is None and (missing := [n for n in files if not (target / n).exists()]):
        problem = f"{missing} are not there (is {root} on a filesystem every rank sees?)"  # on every rank
    if problem is None:
        try:
            if rank == 0:
                meta = {**(record or {}), "step": step, "world": len(records),
                        "config": checkpoint_config(cfg), "files": files}
                atomic_write(target / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
                for stale in target.iterdir():  # an earlier run's save at this step, on more ranks
                    if stale.name not in files and stale.name != "meta.json" and SAVED.fullmatch(stale.name):
                        stale.unlink()
                atomic_write(root / "LATEST", lambda f: f.write(target.name.encode()))
                kept = {target.name, *(f"step_{s:08d}" for s in keep)}
                for old in root.glob("step_*"):  # complete now: an old one that will not go stays
                    if step_of(old) is not None and old.is_dir() and old.name not in kept:
                        with contextlib.suppress(OSError):
                            remove_save(old)
        except OSError as error:
            problem = f"rank 0: {os_error(error)}"
        problem = exchange(problem)[0]
    if problem is not None:
        latest = latest_checkpoint(root)
        if rank == 0 and target.is_dir() and target != latest:  # every rank is past its write
            with contextlib.suppress(OSError):
                remove_save(target)  # nothing partial stays
        last = f"step {step_of(latest)} ({latest})" if latest else "none"
        raise CheckpointError(f"checkpoint step {step} could not be saved in {target} ({problem}); the last "
                              f"complete checkpoint: {last}")
    return target


def checkpoint_problem(target: Path, rank: int = 0, world: int = 1,
                       checksums: bool = True) -> tuple[str | None, dict]:
    """What is wrong with the checkpoint folder target (None: nothing), and its metadata. Every file
    must be there at its recorded size; with checksums, this rank hashes every world-th file from
    its rank (between them, the ranks of a load hash each file once)."""
    if not target.is_dir():
        return "its folder is missing", {}
    try:
        meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
        files = [(name, record["bytes"], record["sha256"]) for name, record in meta["files"].items()]
        lacking = sorted({"step", "world", "config"} - meta.keys())
    except FileNotFoundError:
        return "meta.json is missing", {}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"meta.json cannot be read ({type(error).__name__}: {error})", {}
    if lacking:
        return f"meta.json lacks {', '.join(lacking)}", {}
    for i, (name, size, sha256) in enumerate(files):
        path = target / name
        if not path.is_file():
            return f"{name} is missing", meta
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes where meta.json records {size:,}", meta
        if checksums and i % world == rank and file_sha256(path) != sha256:
            return f"{name} does not match the sha256 that meta.json records (altered bytes)", meta
    return None, meta


def open_checkpoint(folder: str | os.PathLike, cfg: foundation.ModelConfig | None = None,
                    step: int | None = None, rank: int = 0, world: int = 1, checksums: bool = True,
                    resume_command: Callable[[int], str] | None = None) -> tuple[Path, dict]:
    """The checkpoint of `step` (None: the one LATEST names) and its metadata, checked (checkpoint_problem)
    and saved by cfg's configuration. A damaged one is a CheckpointError naming the step, the file, the
    previous complete checkpoint (its files at their sizes, not hashed) and resume_command(that step)."""
    root = Path(folder)
    config = checkpoint_config(cfg)
    target = root / f"step_{step:08d}" if step is not None else latest_checkpoint(folder)
    command = (lambda s: f": {resume_command(s)}") if resume_command else (lambda s: "")
    complete = sorted(s for p in root.glob("step_*")
                      if (s := step_of(p)) is not None and checkpoint_problem(p, checksums=False)[0] is None)
    held = f"step{'s' * (len(complete) > 1)} {', '.join(map(str, complete))}" if complete else "none"
    if step is not None and not target.exists():  # a step never saved, or no longer kept
        advice = f"; resume from the last{command(complete[-1])}" if complete else ""
        raise CheckpointError(f"{folder} holds no checkpoint of step {step} (complete ones: {held}){advice}")
    if target is None:
        if not complete:
            raise CheckpointError(f"{folder} holds no complete checkpoint (no LATEST file)")
        raise CheckpointError(f"{folder} has no LATEST file (each save writes it last, naming its step); the "
                              f"complete checkpoints there are {held}: resume from the last"
                              f"{command(complete[-1])}")
    problem, meta = checkpoint_problem(target, rank, world, checksums)
    if problem is not None:
        number = step_of(target)
        previous = max((s for s in complete if number is None or s < number), default=None)
        where = f"step {number} ({target})" if number is not None else f"{target} (named by LATEST)"
        advice = (f"the previous complete checkpoint is step {previous} ({root / f'step_{previous:08d}'}); "
                  f"resume from it{command(previous)}" if previous is not None else
                  "no earlier complete checkpoint is kept: train afresh")
        raise CheckpointError(f"checkpoint {where} cannot be used: {problem}; {advice}")
    if meta["config"] != config:
        diff = ", ".join(f"{k}={meta['config'].get(k)} (this model: {config.get(k)})"
                         for k in sorted(meta["config"].keys() | config.keys())
                         if meta["config"].get(k) != config.get(k))
        raise ValueError(f"{target} was saved by another model configuration: {diff}; refusing to load it")
    return target, meta


def disk_bytes(target: Path, parameters: int) -> str:
    disk = sum(f.stat().st_size for f in target.iterdir())
    formula = 4 * len(CHECKPOINT_KINDS) * parameters
    return (f"{disk:,} B on disk = (params + 2 AdamW moments) x 4 B x {parameters:,} parameters, each "
            f"element once ({formula:,}) + {disk - formula:,} B of metadata (meta.json; each rank file's "
            f"runs, RNG and headers)")


# --- the folder lock: one run writes a folder, and only what it writes ---------------------------------
OWN = re.compile(r"LOCK|LATEST(\.tmp)?|LOCK\.\w+\.tmp|step_\d{8,}")  # a run's names in its folder
SAVED = re.compile(r"(rank\d{5,}\.pt|meta\.json)(\.tmp)?")  # and in a step's folder
LOCK_LINE = "pid {pid} on {host} since {since}: {command}"  # what a run writes in its LOCK, and only a run
RUNS_LOCK = re.compile(r"pid \d+ on \S+ since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d: .*")  # one line


def remove_save(target: Path) -> None:
    """A step folder: the files a save writes, then the folder (which stays if anything else is in it)."""
    for path in target.iterdir():
        if SAVED.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()
    target.rmdir()


def claimed_by_a_run(root: Path) -> bool:
    """root holds a LOCK that a run wrote: its line (LOCK_LINE), nothing else (a user's LOCK stays theirs)."""
    lock = root / "LOCK"
    if not lock.is_file() or lock.is_symlink() or lock.stat().st_size > 1 << 16:
        return False
    return RUNS_LOCK.fullmatch(lock.read_text(errors="replace").removesuffix("\n")) is not None  # echo's \n


def foreign_entries(root: Path, claimed: bool | None = None) -> list[str]:
    """What in root no run of the course wrote: all of it, unless a run has claimed root (its LOCK; claimed:
    as if it had, or not); else all but a run's names (OWN, SAVED) as files or step folders, not links."""
    entries = sorted(root.iterdir()) if root.is_dir() else []
    if not (claimed_by_a_run(root) if claimed is None else claimed):
        return [p.name for p in entries]
    out = []
    for path in entries:
        step = step_of(path) is not None
        if not OWN.fullmatch(path.name) or path.is_symlink() or path.is_dir() != step:
            out.append(path.name)
        elif step:
            out += [f"{path.name}/{p.name}" for p in sorted(path.iterdir())
                    if not SAVED.fullmatch(p.name) or p.is_symlink() or not p.is_file()]
    return out


def lost_its_lock(root: Path) -> bool:
    """root holds a run's complete saves and only a run's names, but no LOCK a run wrote (deleted)."""
    saved = any(step_of(path) is not None and (path / "meta.json").is_file() for path in root.iterdir())
    return saved and not foreign_entries(root, claimed=True)


def mark_command(root: Path) -> str:
    """The shell line that writes a run's LOCK (LOCK_LINE) into root again, by hand."""
    mark = LOCK_LINE.format(pid=0, host="restored", since="2000-01-01 00:00:00", command="by hand")
    return f"echo '{mark}' > {shlex.quote(str(root / 'LOCK'))}"


def lock_checkpoints(folder: str | os.PathLike) -> IO:
    """Hold folder/LOCK while the returned file stays open (the kernel releases an flock when its
    process ends, killed too: no stale lock). Each refusal below is one line, leaving the folder as it is."""
    root = Path(folder)
    handle = None
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} is a file, not a folder")
    try:
        if foreign := foreign_entries(root):
            named = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            if lost_its_lock(root):
                raise CheckpointError(f"checkpoint folder {folder} holds a run's names ({named}) but no "
                                      f"LOCK a run wrote, the mark of a run's folder: left as it is; if a "
                                      f"run of this course wrote it, put the mark back: {mark_command(root)}")
            advice = "choose a new or empty folder"
            if claimed_by_a_run(root):  # a run's folder with a stray file: --resume goes on once it is out
                them = "it" if len(foreign) == 1 else "them"
                advice = f"move {them} out to go on with its run, or {advice}"
            raise CheckpointError(f"checkpoint folder {folder} holds what no run of this course wrote "
                                  f"({named}): left as it is; {advice} (a run writes only LOCK, LATEST "
                                  f"and step_NNNNNNNN/ in it)")
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / "LOCK", "a+")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fd, probe = tempfile.mkstemp(".tmp", "LOCK.", dir=root)  # an earlier run's LOCK may be writable
        os.close(fd)                                              # where the folder is not (read-only since)
        os.unlink(probe)
        handle.truncate(0)
        handle.write(LOCK_LINE.format(pid=os.getpid(), host=socket.gethostname() or "localhost",
                                      since=time.strftime("%Y-%m-%d %H:%M:%S"),
                                      command=shlex.join(sys.argv).replace("\n", "\\n")))
        handle.flush()
        return handle
    except BlockingIOError:  # flock: another process holds it
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(f"checkpoint folder {folder} is in use by a running run ({holder}): wait for "
                              f"it to end, or choose another folder") from None
    except OSError as error:
        if handle is not None:
            handle.close()
        raise CheckpointError(f"checkpoint folder {folder} cannot be written ({os_error(error)})") from None


def remove_unfinished_saves(folder: str | os.PathLike) -> list[str]:
    """What a save stopped midway (a kill) left: files written aside (*.tmp) and step folders without
    meta.json that LATEST does not name. Removes them (hold the lock: lock_checkpoints found nothing else
    in folder) and returns their names."""
    root = Path(folder)
    latest = latest_checkpoint(folder)
    folders = [p for p in root.glob("step_*")
               if step_of(p) is not None and p.is_dir() and p != latest and not (p / "meta.json").exists()]
    files = [p for p in [*root.glob("*.tmp"), *root.glob("step_*/*.tmp")] if p.parent not in folders]
    unfinished = folders + files
    for path in unfinished:
        try:
            remove_save(path) if path.is_dir() else path.unlink()
        except OSError as error:  # e.g. immutable (chattr +i)
            raise CheckpointError(f"checkpoint folder {folder}: {path.relative_to(root)}, left by an "
                                  f"interrupted save, cannot be removed ({os_error(error)}): remove it, or "
                                  f"choose another folder") from None
    return sorted(str(p.relative_to(root)) for p in unfinished)


def first_problem(problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The lowest rank's problem (None: no rank has one), on every rank: they all stop, or none."""
    problems = foundation.all_ranks(problem, group) if dist.is_initialized() else [problem]
    return next((p for p in problems if p is not None), None)


def claim_folder(folder: str | os.PathLike) -> IO | None:
    """A run's start (every rank, or one process before a launch): rank 0 locks folder (lock_checkpoints)
    and removes what a killed save left, saying so; a problem is one CheckpointError on every rank."""
    lock = problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            lock = lock_checkpoints(folder)
            if unfinished := remove_unfinished_saves(folder):
                print(f"removed what an interrupted save left in {folder}: {', '.join(unfinished)}")
        except CheckpointError as error:
            problem = str(error)
            if lock is not None:
                lock.close()
    if (problem := first_problem(problem)) is not None:
        raise CheckpointError(problem)
    return lock


# --- slice reads: each rank reads only the saved runs that overlap what it holds ------------------
class CheckpointReader:
    """A checked checkpoint's rank files, memory-mapped: read(piece) copies out only the runs the piece
    shares with the saved ones (the rest of the files: their runs and RNG states); bytes_read counts it."""

    def __init__(self, target: Path, meta: dict) -> None:
        self.saved: dict[str, list[tuple[tuple[int, ...], torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self.rng = []  # by saved rank
        for name in meta["files"]:
            file = torch.load(target / name, mmap=True, weights_only=True)
            self.rng.append(file["rng"])
            for piece_name, shape, pairs, data in file["pieces"]:
                first, length = torch.tensor(pairs).T
                runs = torch.stack([first, length.cumsum(0) - length, length], 1)  # packed: offsets add up
                self.saved.setdefault(piece_name, []).append((tuple(shape), runs, data))
        self.bytes_read = 0

    def read(self, piece: Piece, kinds: tuple[str, ...] = CHECKPOINT_KINDS) -> dict[str, torch.Tensor]:
        """piece's values of each kind; padding holds zeros."""
        out = {kind: torch.zeros(piece.size) for kind in kinds}
        covered = 0
        for shape, runs, data in self.saved.get(piece.name, ()):
            if shape != tuple(piece.shape):
                raise ValueError(f"{piece.name} was saved with shape {shape}, not {tuple(piece.shape)}")
            for to, at, n in overlaps(piece.runs, runs).tolist():
                for kind in kinds:
                    out[kind][to:to + n] = data[kind][at:at + n]
                covered += n
        if covered != piece.elements():
            raise ValueError(f"the saved pieces do not cover every element of {piece.name} exactly once")
        self.bytes_read += covered * 4 * len(kinds)
        return out


def load_model(model: nn.Module, folder: str | os.PathLike) -> dict:
    """The last checkpoint's parameters into one device's whole model: its metadata and bytes read."""
    target, meta = open_checkpoint(folder, model.cfg)
    reader = CheckpointReader(target, meta)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reader.read(Piece.whole(name, param.shape), ("params",))["params"].view(param.shape))
    return {**meta, "bytes_read": reader.bytes_read}


# --- ZeRO's shards as pieces ----------------------------------------------------------------------
def whole_tensor(unit: FlatUnit, i: int) -> Piece:
    return Piece.whole(unit.names[i], unit.shapes[i])


PieceOf = Callable[[FlatUnit, int], Piece]  # parameter i of a unit as this rank holds it before ZeRO


def shard_pieces(unit: FlatUnit, piece_of: PieceOf = whole_tensor) -> Iterator[tuple[int, Piece, slice]]:
    """(i, piece, where its values lie in this rank's shard) for each parameter i with elements in the
    shard: piece_of(unit, i) (lesson 09: a tensor- or expert-parallel slice), narrowed to the shard."""
    for i, start, stop in shard_parts(unit):
        at = unit.offsets[i] + start - unit.owned.start
        yield i, piece_of(unit, i).narrow(start, stop), slice(at, at + stop - start)


def zero_pieces(optimizer: ZeRO, piece_of: PieceOf = whole_tensor,
                writes: Callable[[nn.Parameter], bool] = lambda p: True
                ) -> list[tuple[Piece, dict[str, torch.Tensor]]]:
    """The pieces this rank writes of a ZeRO, with their values of each kind: its shard's of the
    parameters `writes` accepts (stage 0: the group's rank 0 writes all; lesson 09: tp rank 0 those
    replicated over tp), and the frozen parameters (whole on every rank, no moments) by rank 0."""
    first = dist.get_rank(optimizer.group) == 0
    out = []
    for unit in optimizer.units if optimizer.stage > 0 or first else ():
        state = optimizer.shard_state(unit)
        out += [(piece, {k: v[at].detach().float().cpu() for k, v in state.items()})
                for i, piece, at in shard_pieces(unit, piece_of) if writes(unit.params[i])]
    return out + [(Piece.whole(n, p.shape), {"params": p.detach().float().cpu().flatten()})
                  for n, p in optimizer.frozen if first]


@torch.no_grad()
def read_shards(optimizer: ZeRO, reader: CheckpointReader, piece_of: PieceOf = whole_tensor) -> list[dict]:
    """A ZeRO's shards for its load_shards, reading only the saved runs that overlap them (no whole
    tensor is built); frozen parameters are copied in as read. No collective: see load_checkpoint."""
    shards = []
    for unit in optimizer.units:
        values = {k: torch.zeros(unit.owned.stop - unit.owned.start) for k in CHECKPOINT_KINDS}  # padding: 0
        for _, piece, at in shard_pieces(unit, piece_of):
            for k, v in reader.read(piece).items():
                values[k][at] = v
        shards.append(values)
    for name, p in optimizer.frozen:
        p.copy_(reader.read(Piece.whole(name, p.shape), ("params",))["params"].view(p.shape))
    return shards


def load_checkpoint(folder: str | os.PathLike, cfg: foundation.ModelConfig | None,
                    zeros: list[tuple[ZeRO, PieceOf]], step: int | None = None,
                    resume_command: Callable[[int], str] | None = None,
                    group: dist.ProcessGroup | None = None) -> tuple[Path, dict, CheckpointReader]:
    """On every rank of group: each ZeRO (with its piece_of) loads its shards from the checkpoint of
    `step` (None: LATEST's), saved on any group size and stage. A problem any rank finds (a damaged file,
    a piece missing, a file that cannot be read) stops every rank with the same CheckpointError, before
    any rank has loaded anything. Returns the checkpoint's folder, metadata and reader (bytes_read, rng)."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    problem = None
    try:
        target, meta = open_checkpoint(folder, cfg, step, rank, world, resume_command=resume_command)
    except (ValueError, OSError) as error:
        problem = str(error)
    if (problem := first_problem(problem, group)) is not None:
        raise CheckpointError(problem)
    try:  # e.g. pieces missing for one pipeline stage's parameters: only its ranks see it
        reader = CheckpointReader(target, meta)
        shards = [read_shards(optimizer, reader, piece_of) for optimizer, piece_of in zeros]
    except (ValueError, OSError) as error:
        problem = f"{target}: {error}"
    if (problem := first_problem(problem, group)) is not None:
        raise CheckpointError(problem)
    for (optimizer, _), shard in zip(zeros, shards):
        optimizer.load_shards(shard, meta["step"])
    return target, meta, reader


# --- RUN IT: the demo, the benchmark, the command line -----------------------------------------------------
def print_tables(runs: dict, references: dict, world: int, steps: int) -> None:
    columns = ("loss", "grads", "params", "exp_avg", "exp_avg_sq")
    print(f"max |difference| from one device (AdamW + clip_grad_norm_), "
          f"{foundation.counted(steps, 'step')}:\n"
          f"  {'run':<17}" + "".join(f"{c:>11}" for c in columns))
    for (precision, stage), (result, _) in runs.items():
        ref = references[precision]  # result.params is result.state["params"], and ref's the same
        diffs = [*result.max_differences(ref), *(foundation.max_abs_diff(result.state[k], ref.state[k])
                                                  for k in ADAM_KEYS)]
        print(f"  {precision:<10} ZeRO-{stage}" + "".join(f"{d:>11.1e}" for d in diffs))
    print("  (fp32: the same sums in another order. bf16: gradients rounded to 8 bits after sums in\n"
          "   another order; Adam turns that into lr-sized moves of the few elements whose gradient is ~0.\n"
          "   bf16+bf16, BF16 AdamW: an update under a weight's last bit, 2^-8 of it, is lost on both;\n"
          "   fp32 grads: bf16+fp32 whose gradients are summed and reduced in fp32, 4 B an element)")
    print("\nThe paper's table, GB per rank: Psi = 7.5B, N = 64, P = G = 2 (fp16), K = 12:")
    for stage in STAGES:
        mem = zero_memory_per_rank(7_500_000_000, 64, stage)
        print(f"  ZeRO-{stage} {float(sum(mem.values())) / 1e9:7.2f} GB = "
              + " + ".join(f"{float(v) / 1e9:.2f} {k}" for k, v in mem.items()))
    psi = sum(t.numel() for t in references["fp32"].params.values())
    padded = runs["fp32", 0][0].stats["padded_params"]
    print(f"\nThe tiny model on {foundation.counted(world, 'rank')}: {psi:,} parameters, padded module by "
          f"module to {padded:,}.\n"
          f"Bytes one rank holds after a step, live tensors' storages | formula on the padded count "
          f"(+ {STEP_COUNTER_BYTES} B per module: AdamW's step):")
    for (precision, stage), (result, _) in runs.items():
        cells = "  ".join(f"{k} {result.held[k]:>9,}|{int(result.formula[k]):<9,}" for k in result.held)
        same = "equal" if result.held == result.formula else "DIFFERENT"
        print(f"  {precision:<10} ZeRO-{stage}  {cells} {same}")
    ddp_bytes = foundation.ring_traffic("all_reduce", 4 * padded, world)  # DDP over the same padded buffers
    print(f"\nTraffic per rank per step, fp32, ring (DDP: 2(N-1)/N x 4 B x padded Psi = "
          f"{float(ddp_bytes):,.0f} B):")
    for stage in STAGES:
        meter = runs["fp32", stage][1]
        formula = zero_traffic_per_step(padded, world, stage, 4, 4)
        measured = {op: meter.traffic(op) / steps for op in formula}
        norm = meter.traffic("all_reduce") / steps - formula.get("all_reduce", 0)
        ratio = f" = {float(sum(measured.values()) / ddp_bytes):.3f} x DDP" if world > 1 else ""
        print(f"  ZeRO-{stage}  " + ", ".join(f"{op} {float(v):,.0f} B" for op, v in measured.items())
              + f" {'=' if measured == formula else '!='} formula{ratio}"
              + (f"; + {float(norm):.0f} B all-reduced for the gradient norm" if stage else ""))
    stats = runs["fp32", 3][0].stats
    print(f"\nZeRO-3 gathers {stats['units']} modules one at a time: {stats['prefetched_gathers']} of "
          f"{2 * stats['units'] * steps} gathers were prefetched (launched while the module before "
          f"computed);\nup to {stats['max_gathers_in_flight']} in flight at once.")
    print("\nNotice: every stage takes the one-device step; each stage shards one more of the optimizer "
          "state, the gradients and the parameters, so the bytes held fall towards 16 Psi / N, while the "
          "traffic stays DDP's until ZeRO-3 adds a second all-gather (1.5 x DDP).")


def print_checkpoint(cfg: foundation.ModelConfig, folder: str, saved: dict, reports: list,
                     world: int) -> None:
    """The demo's checkpoint lines (see demo); reports: (bytes read, shard bytes, state equal) a rank."""
    target = latest_checkpoint(folder)
    one = foundation.GPT(cfg)
    one_read = load_model(one, folder)["bytes_read"]
    one_same = all(torch.equal(p, saved["params"][n]) for n, p in one.named_parameters())
    psi = sum(p.numel() for p in one.parameters())
    half = len(reports)
    print(f"\nA sharded checkpoint: ZeRO-3 on {foundation.counted(world, 'rank')} saved step {saved['step']} "
          f"as {foundation.counted(world, 'rank file')} + meta.json: {disk_bytes(target, psi)}.\n"
          f"ZeRO-1 on {foundation.counted(half, 'rank')} loads it; bytes "
          f"each rank read (memory-mapped) | its shard, (params + 2 moments) x 4 B x its elements:")
    for r, (read, shard, same) in enumerate(reports):
        print(f"  rank {r}: {read:,} | {shard:,} {'equal' if read == shard else 'DIFFERENT'}; the state "
              f"{'equals' if same else 'DIFFERS from'} the saved one bit for bit")
    print(f"One device's GPT loads the parameters alone, bytes read | 4 B x {psi:,} parameters: "
          f"{one_read:,} | {4 * psi:,}; the parameters {'equal' if one_same else 'DIFFER from'} the saved "
          f"ones bit for bit.")
    print("Notice: the checkpoint is the same bytes whatever the group that wrote it; each reader reads its "
          "shard, not the whole.")


# Module sizes (8,250 embedding, 66 norm weights) not divisible by 4: the padding shows.
DEMO_MODEL = dict(vocab_size=125, dim=66, n_heads=3, ffn_dim=177)


# The demo's precisions: compute + AdamW's master weights and moments
PRECISIONS = {"fp32": {}, "bf16+fp32": dict(mixed_precision=True),
              "bf16+bf16": dict(mixed_precision=True, bf16_optimizer=True)}
FP32_GRADS = dict(mixed_precision=True, fp32_grads=True)  # stages 0-1; its twin is bf16+fp32's


def demo(args: argparse.Namespace) -> None:
    """Every stage in each of PRECISIONS beside one device; the fp32 ZeRO-3 run saves its last step."""
    device = foundation.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()
    cfg = foundation.ModelConfig(**DEMO_MODEL)
    shape = (cfg, args.steps, args.global_batch, args.seq_len)
    kwargs = dict(max_grad_norm=args.max_grad_norm, device=device)
    folder = foundation.all_ranks(tempfile.mkdtemp(prefix="02_zero.") if rank == 0 else None)[0]  # one host
    runs = {(precision, stage): train_zero(*shape, stage=stage, **settings, **kwargs,
                                           folder=folder if (precision, stage) == ("fp32", 3) else None)
            for precision, settings in PRECISIONS.items() for stage in STAGES}
    runs |= {("fp32 grads", stage): train_zero(*shape, stage=stage, **FP32_GRADS, **kwargs)
             for stage in (0, 1)}
    saved = runs["fp32", 3][0].state
    half = max(1, world // 2)
    group = dist.new_group(list(range(half)))
    report = None
    if rank < half:
        smaller = ZeRO(foundation.GPT(cfg).to(device), 1, group)
        _, _, reader = load_checkpoint(folder, cfg, [(smaller, whole_tensor)], group=group)
        loaded = smaller.full_state_dict()
        same = all(torch.equal(loaded[k][n], saved[k][n]) for k in CHECKPOINT_KINDS for n in saved[k])
        elements = sum(stop - start for unit in smaller.units for _, start, stop in shard_parts(unit))
        report = (reader.bytes_read, 4 * len(CHECKPOINT_KINDS) * elements, same)
    reports = foundation.all_ranks(report, dst=0)
    if rank == 0:
        references = {precision: foundation.train_single_device(*shape, **settings, **kwargs)
                      for precision, settings in PRECISIONS.items()}
        references["fp32 grads"] = references["bf16+fp32"]
        print(f"ZeRO on {foundation.counted(world, 'rank')} ({dist.get_backend()}, {device.type}); "
              f"global batch {args.global_batch} x {args.seq_len}; clipping at {args.max_grad_norm}.\n")
        print_tables(runs, references, world, args.steps)
        print(foundation.lone_token_note(args.seq_len), end="")
        print_checkpoint(cfg, folder, saved, reports[:half], world)
        shutil.rmtree(folder)
    foundation.exit_distributed()


def bench(args: argparse.Namespace) -> None:
    """ZeRO-3 against FSDP2 fully_shard on the same modules, model, batch and clipping."""
    from torch.distributed.fsdp import fully_shard
    device = foundation.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()
    cfg = foundation.ModelConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=8, ffn_dim=688)
    tokens, targets = (t.to(device) for t in foundation.synthetic_batch(cfg, 4 * world, 128, 0, rank, world))
    ours_model = foundation.GPT(cfg).to(device)
    torch_model = foundation.GPT(cfg).to(device)
    n_params = sum(p.numel() for p in torch_model.parameters())
    zero = ZeRO(ours_model, 3, max_grad_norm=1.0)
    for _, module in [*zero_units(torch_model), ("", torch_model)]:
        fully_shard(module)
    torch_opt = foundation.make_optimizer(torch_model, 1e-3)

    def ours_step() -> None:
        ours_model(tokens, targets).backward()
        zero.step()

    def torch_step() -> None:
        torch_opt.zero_grad(set_to_none=True)  # first: the bytes below are counted with gradients
        torch_model(tokens, targets).backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
        torch_opt.step()

    med = foundation.interleaved_medians({"ZeRO-3": ours_step, "FSDP2": torch_step}, args.bench_rounds,
                                         args.bench_steps, device)
    # After a step, as ours: the (sharded) parameters, gradients and AdamW state.
    state = [t for s in torch_opt.state.values() for t in s.values() if torch.is_tensor(t)]
    theirs = storage_bytes([*torch_model.parameters(), *(p.grad for p in torch_model.parameters()), *state],
                           set())
    ours = sum(zero.held_bytes().values())
    if rank == 0:
        print(f"ZeRO-3 vs FSDP2 fully_shard on {foundation.counted(world, 'rank')} ({dist.get_backend()}, "
              f"{device.type}), {n_params / 1e6:.1f}M parameters, fp32, clipping, "
              f"{foundation.median_of(args)}:\n  {foundation.ratio_line(med)}\n"
              f"  bytes held per rank after a step: ZeRO-3 {ours:,}, FSDP2 {theirs:,}, "
              f"ratio {ours / theirs:.3f}")
    foundation.exit_distributed()


@dataclass
class Options:
    steps: int = foundation.option(5, "AdamW steps of every stage and of the reference", ">= 1")
    global_batch: int = foundation.option(16, "sequences per step, split over the ranks", ">= 1")
    seq_len: int = foundation.option(32, "tokens per sequence", ">= 1")
    max_grad_norm: float = foundation.option(1.0, "clip the global gradient norm to this (inf: no clipping)",
                                             "> 0")
    bench: bool = foundation.option(False, "ZeRO-3 against FSDP2 fully_shard")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options, foundation.Ranks, foundation.BenchRounds))
    if args.bench:
        foundation.launch_lesson(parser, args, bench)
        return
    cfg = foundation.ModelConfig(**DEMO_MODEL)
    memory = functools.partial(foundation.check_memory, cfg, args.global_batch, args.seq_len)
    foundation.launch_lesson(parser, args, demo, divisible={"--global-batch": args.global_batch},
                             rules=[memory])


# --- For lesson 09's plan: ZeRO's own memory passes and its exposed seconds (no demo here reads them) -------
def zero_step_bytes(psi: int, n: int, stage: int, microbatches: int, mixed_precision: bool,
                    bf16_optimizer: bool = False, fp32_grads: bool = False) -> int:
    """Memory traffic of ZeRO's own passes on one rank per step, outside the collectives, each pass
    reading and writing its tensors once (lesson 09 prices it at the HBM's bandwidth); P = 2 mixed, 4
    fp32; G = P, or 4 with fp32_grads; M, the master's: 2 with BF16 AdamW, else 4. On the psi full
    gradients: each microbatch's added into .grad (3 G; fp32_grads: its bf16 gradient into the fp32
    buffer, P + 2 G; stages 2-3 keep the first one), then zeroed (stages 0-1: G) or flattened to send
    (2-3: 2 G). On the shard (psi / n; stage 0: psi): / n (2 G), the norm (G), the copy into the
    master's dtype and the clip (G + 3 M where M differs from G; in place: 2 G), fused AdamW (reads the
    fp32 master, moments and gradient, writes three: 28; BF16 AdamW: 14), the bf16 copy of the fp32
    master (mixed: 4 + 2), and stages 1-2's copy of the shard sent to the all-gather (2 P)."""
    p = 2 if mixed_precision else 4
    g = 4 if fp32_grads else p
    master = 2 if bf16_optimizer else 4
    fp32_master = mixed_precision and not bf16_optimizer  # beside the bf16 parameters
    shard = psi if stage == 0 else -(-psi // n)
    add = p + 2 * g if fp32_grads else 3 * g
    full = add * (microbatches - (stage >= 2)) + g * (1 + (stage >= 2))
    clip = g + 3 * master if g != master else 2 * g
    adam = 14 if bf16_optimizer else 28
    step = 3 * g + clip + adam + 6 * fp32_master + 2 * p * (stage in (1, 2) and n > 1)
    return full * psi + step * shard


def zero_exposed_seconds(psi: int, n: int, stage: int, units: int, microbatches: int, elem_bytes: float,
                         send: Callable[[float, int], float], last_backward: float,
                         unit_compute: tuple[float, float], hide: bool = True,
                         grad_bytes: int | None = None) -> float:
    """Seconds of a step's ZeRO traffic (zero_traffic_per_step, priced by send(bytes, calls)) that
    compute does not hide: the gradients' reduction overlaps the last microbatch's backward but for
    its last unit's (last_backward = 0: reduced after it, all exposed); stages 1-2's all-gather (after
    the step, before the next forward) is exposed; stage 3's gather of each unit, before its forward and
    its backward, hides behind the previous unit's compute (unit_compute: one unit's forward, backward)
    but for the first. hide=False: none. elem_bytes: a gathered parameter's (a mean where 08's FP8 weights
    gather 1 B); grad_bytes: the reduction's bytes an element (default elem_bytes)."""
    ops = zero_traffic_per_step(psi, n, stage, elem_bytes, grad_bytes or elem_bytes)
    reduce = send(ops.get("reduce_scatter", 0) + ops.get("all_reduce", 0), units)
    gather = send(ops["all_gather"], units) if "all_gather" in ops else 0.0  # stage 0: none, not even a call
    if stage == 3:
        one = gather / 2 / units
        gather = one + microbatches * (units - 1) * sum(exposed(one, t, hide) for t in unit_compute)
    return max(reduce / units, exposed(reduce, last_backward, hide)) + gather


def exposed(comm: float, behind: float, hide: bool = True) -> float:
    """The seconds of communication that `behind` seconds of compute running beside it leave exposed
    (hide=False: every second, the no-overlap bound)."""
    return max(0.0, comm - behind) if hide else comm


if __name__ == "__main__":
    main()
