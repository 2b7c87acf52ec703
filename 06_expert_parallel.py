"""Lesson 06: mixture of experts (MoE), and expert parallelism over all-to-all.

The parts, in order (MoEConfig first: top-k, CAPACITY and BALANCE's knobs; the technique starts at AllToAll):
  Dispatch: AllToAll (autograd reverses it), kept_per_source (CAPACITY), plan_dispatch, dispatch, combine
  The MoE layer: MoE (route, forward with the aux loss, update_selection_bias: BALANCE), convert_to_moe
  Expert parallelism: apply_expert_parallel, sync_gradients, all_to_all_traffic (COST); train_moe
  RUN IT: demo, all_gather_moe_forward (the other dispatcher), bench; then the command line: Options, main
Nothing here is for lesson 09's plan only: what it reads, moe_parameter_shapes, is tested as built.

THE IDEA. An MoE layer replaces a block's MLP by E small MLPs ("experts") and a router. Each token goes
to only k of them: parameters grow E-fold, compute per token k-fold. The router maps a token to E
logits, softmax -> probabilities p (T, E); the token's top-k experts' outputs are mixed with their
probabilities renormalised to sum to 1 (k = 1 keeps the raw p, as Switch does: a weight of 1 would
cut the router off from the loss).

BALANCE. Left alone, the load drifts apart (a large model's router can collapse onto a few experts),
and an overloaded expert drops tokens or, dropless, makes its rank the straggler. Two remedies:
- the Switch/GShard auxiliary loss  aux = E x sum_i f_i P_i,  f_i = the fraction of assignments
  to expert i (counted, no gradient), P_i = its mean router probability (differentiable). It is 1
  when f or P is uniform and grows when both concentrate on the same experts; its gradient lowers
  P_i in proportion to f_i. The loss adds aux_loss_coef x aux for every MoE layer.
- auxiliary-loss-free balancing (DeepSeek-V3): a per-expert selection bias b is added to p only to
  CHOOSE the top-k, never to weight the outputs; after each step b_i += rate x sign(mean load -
  load_i), so under-loaded experts become easier to pick. The gradient never sees it.

CAPACITY. With a capacity factor c, expert i takes at most C = ceil(c x T x k / E) of the step's T x k
assignments, T counting every token of the expert-parallel group. Assignments queue in global token
order (rank 0's first, as rows of the global batch); those past C are dropped: the slot adds 0 and the
token flows on through the block's residual. So expert parallelism drops exactly the tokens one device
would. capacity_factor=None is dropless.

EXPERT PARALLELISM. Each of the ep ranks of a group holds E/ep experts and its own slice of the batch
(the group doubles as a data-parallel group: ep borrows ranks from dp x cp). A forward
  1. routes locally and all-gathers the (ep, E) matrix of assignment counts: every rank then knows
     its queue positions, what it will receive from whom and the global load, with no further
     collective (Megatron's dispatcher gathers counts the same way);
  2. sorts the kept assignments by expert (= by owner rank) and all-to-alls the token rows with
     uneven splits; the owner regroups what it received by expert and runs its experts;
  3. all-to-alls the results back (the reverse splits), restores the assignment order and mixes.
Both exchanges are autograd functions whose backward is the reverse all-to-all. Replicated
(non-expert) weights get their gradients all-reduced and divided by ep (data parallelism); an
expert's gradient already arrives summed over the group's tokens through the backward all-to-all,
so it is only divided by ep. All-reducing it too, or forgetting the division, is the "gradients
doubled at EP=2" bug; the tests compare every gradient with one device.

COST (per MoE layer, per rank, element size s, model dim D). The dispatch all-to-all: (assignments
this rank sends to other ranks' experts) x D x s; the combine sends back what it received. Uniform
routing and no drops make that T_rank x k x (ep-1)/ep x D x s each way, and as much again in backward.
An all-gather dispatcher (every rank gathers all tokens, keeps its experts' share, reduce-scatters the
results) moves (ep-1) x T_rank x D x s each way: ep / k times more.

RUN IT
    python 06_expert_parallel.py                       # 4 local CPU ranks
    python 06_expert_parallel.py --bench               # all-to-all vs all-gather dispatcher
Look at: max |difference| from one device (rounding only); the imbalance max/mean tokens per expert
and the dropped tokens under the aux loss, the selection bias and neither; all-to-all bytes = formula.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

foundation = importlib.import_module("01_ddp")


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 64
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing; 0 turns it off

    def __post_init__(self) -> None:
        for name, least in (("n_experts", 1), ("expert_ffn_dim", 1), ("aux_loss_coef", 0),
                            ("bias_update_rate", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {least}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be positive and finite "
                             f"(or None: dropless, --dropless on the command line)")


# --- Dispatch: capacity, the plan of which rows go where, and an all-to-all autograd can reverse ---
class AllToAll(torch.autograd.Function):
    """Rows input_splits[j] go to rank j; backward, the reverse all-to-all, sends gradient rows back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.reverse = input_splits, output_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        foundation.all_to_all(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, *ctx.reverse), None, None, None


def exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return x if group is None else AllToAll.apply(x, output_splits, input_splits, group)


def kept_per_source(counts: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """counts (ep, E): assignments of each source rank to each expert -> how many are kept (CAPACITY)."""
    if cfg.capacity_factor is None:
        return counts
    capacity = math.ceil(cfg.capacity_factor * int(counts.sum()) / cfg.n_experts)  # T k = sum
    queued_before = counts.cumsum(0) - counts
    return torch.minimum(counts, (capacity - queued_before).clamp(min=0))


@dataclass
class DispatchPlan:
    kept_slots: torch.Tensor     # indices into the T x k assignments: the kept ones, by expert
    top_k: int
    send_splits: list[int]       # rows to each rank of the group
    recv_splits: list[int]       # rows from each rank
    by_expert: torch.Tensor      # received rows -> (local expert, source) order
    rows_per_expert: list[int]   # rows of each local expert, in that order
    group: dist.ProcessGroup | None


def plan_dispatch(experts: torch.Tensor, kept: torch.Tensor, rank: int,
                  group: dist.ProcessGroup | None) -> DispatchPlan:
    """experts (T, k) of this rank; kept (ep, E) from kept_per_source. Nothing is communicated."""
    ep, n_experts = kept.shape
    local = n_experts // ep
    flat = experts.flatten()  # token-major: the queue order within an expert is the token order
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    position = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    kept_slots = order[position < kept[rank][flat[order]]]  # this rank's first kept[rank, e] of e
    # The owner receives, from each source in turn, that source's rows for its experts in order.
    from_sources = kept[:, rank * local:(rank + 1) * local]  # (ep sources, local experts)
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=kept.device).repeat(ep),
                                            from_sources.flatten())
    return DispatchPlan(kept_slots, experts.shape[1], kept[rank].view(ep, local).sum(1).tolist(),
                        from_sources.sum(1).tolist(), torch.argsort(expert_of_row, stable=True),
                        from_sources.sum(0).tolist(), group)


def dispatch(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x (T, D) -> the rows this rank's experts must process, grouped by local expert."""
    rows = exchange(x[plan.kept_slots // plan.top_k], plan.recv_splits, plan.send_splits, plan.group)
    return rows[plan.by_expert]


def combine(y: torch.Tensor, plan: DispatchPlan, n_tokens: int) -> torch.Tensor:
    """The experts' outputs (grouped as dispatch left them) -> (T, k, D), zero for dropped slots."""
    back = exchange(y[torch.argsort(plan.by_expert)], plan.send_splits, plan.recv_splits, plan.group)
    slots = y.new_zeros(n_tokens * plan.top_k, y.shape[-1]).index_copy(0, plan.kept_slots, back)
    return slots.view(n_tokens, plan.top_k, y.shape[-1])


# --- The MoE layer --------------------------------------------------------------------------------
class MoE(nn.Module):
    """Router + E SwiGLU experts, stacked as (E, ...) tensors so that a rank can hold a slice. After each
    forward it records aux_loss (this rank's share: the group mean is the whole batch's), load
    (assignments per expert over the group), dropped, and kept (ep, E)."""

    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, dim: int, cfg: MoEConfig, seed: int, init_std: float = 0.02,
                 n_layers: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = None  # one device until apply_expert_parallel
        self.rank = 0
        self.ep = 1
        gen = torch.Generator().manual_seed(seed)
        e, f = cfg.n_experts, cfg.expert_ffn_dim  # the experts' shape
        self.router = nn.Linear(dim, e, bias=False)
        self.router.weight = nn.Parameter(torch.randn(e, dim, generator=gen) * init_std)
        self.gate_proj = nn.Parameter(torch.randn(e, f, dim, generator=gen) * init_std)
        self.up_proj = nn.Parameter(torch.randn(e, f, dim, generator=gen) * init_std)
        self.down_proj = nn.Parameter(torch.randn(e, dim, f, generator=gen) * init_std
                                      / math.sqrt(2 * n_layers))  # a residual branch, as in GPT
        self.register_buffer("selection_bias", torch.zeros(e))
        self.register_buffer("load_since_update", torch.zeros(e, dtype=torch.long))

    def expert_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in self.expert_names]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, D) -> chosen experts (T, k), their mixing weights (T, k), probabilities (T, E)."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        experts = torch.topk(probs.detach() + self.selection_bias, self.cfg.top_k, dim=-1).indices
        weights = probs.gather(1, experts)  # the bias chose, the probabilities weigh
        if self.cfg.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights, probs

    def gather_counts(self, experts: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(experts.flatten(), minlength=self.cfg.n_experts)
        if self.group is None:
            return counts[None]
        everyone = counts.new_empty(self.ep * self.cfg.n_experts)
        foundation.all_gather(everyone, counts, group=self.group)
        return everyone.view(self.ep, -1)

    def expert(self, j: int, h: torch.Tensor) -> torch.Tensor:
        """Local expert j (a SwiGLU) on rows h."""
        return (F.silu(h @ self.gate_proj[j].T) * (h @ self.up_proj[j].T)) @ self.down_proj[j].T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights, probs = self.route(flat)
        counts = self.gather_counts(experts)
        kept = kept_per_source(counts, self.cfg)
        plan = plan_dispatch(experts, kept, self.rank, self.group)
        rows = dispatch(flat, plan).split(plan.rows_per_expert)
        y = torch.cat([self.expert(j, h) for j, h in enumerate(rows)])
        out = (combine(y, plan, flat.shape[0]) * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        self.load = counts.sum(0)
        self.kept = kept
        self.dropped = counts.sum() - kept.sum()
        self.load_since_update += self.load
        total = counts.sum().clamp(min=1)  # T x k over the group; 0 only if the group has no token
        # E sum_i f_i P_i with P_i = (sum over the group's tokens of p_i) / T: this rank contributes
        # its tokens' sum, scaled so that the mean over the ep ranks is the whole-batch value.
        fraction = self.load.float() / total
        tokens = total / self.cfg.top_k
        self.aux_loss = self.cfg.n_experts * self.ep / tokens * (fraction * probs.sum(0)).sum()
        return out.view_as(x)

    @torch.no_grad()
    def update_selection_bias(self) -> None:
        """BALANCE's bias update, after the optimizer step; the load is the group's, so every rank agrees."""
        load = self.load_since_update.float()
        self.selection_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()


def moe_parameter_shapes(dim: int, cfg: MoEConfig, ep: int = 1) -> dict[str, tuple[int, ...]]:
    """An MoE layer's parameters (names inside the layer) on one of ep expert-parallel ranks, in
    named_parameters() order, without building it (lesson 09's plan)."""
    e, f = cfg.n_experts // ep, cfg.expert_ffn_dim  # the experts' shape on one rank
    return {"gate_proj": (e, f, dim), "up_proj": (e, f, dim), "down_proj": (e, dim, f),
            "router.weight": (cfg.n_experts, dim)}


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@dataclass
class LossWithAux:
    """GPT's loss_fn for an MoE model: cross-entropy + aux_loss_coef x each layer's aux loss."""
    layers: list[MoE]

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = foundation.cross_entropy_loss(logits, targets)
        return loss + sum(layer.cfg.aux_loss_coef * layer.aux_loss for layer in self.layers)


def convert_to_moe(model: nn.Module, cfg: MoEConfig) -> nn.Module:
    """Replace every block's MLP of a reference GPT by an MoE layer, seeded from the model's seed
    and the layer index, so that every rank (and every run) builds the same weights."""
    gpt_cfg = model.cfg
    for index, block in model.layers.items():
        block.mlp = MoE(gpt_cfg.dim, cfg, seed=gpt_cfg.seed * 1009 + int(index) + 1,
                        init_std=gpt_cfg.init_std, n_layers=gpt_cfg.n_layers)
    model.loss_fn = LossWithAux(moe_layers(model))
    return model


# --- Expert parallelism, and training on one device or over a group on the same global batches ----
def apply_expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer and route through the group. The experts
    are sliced from the existing (identical on every rank) weights. Build the optimizer after."""
    ep = foundation.group_size(group)
    rank = dist.get_rank(group)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layer: convert_to_moe(model, cfg) first")
    if indivisible := [layer.cfg.n_experts for layer in layers if layer.cfg.n_experts % ep]:
        raise ValueError(f"n_experts={indivisible[0]} is not divisible by the expert-parallel "
                         f"group size ep={ep}")
    foundation.claim_gradient_sync(model, "expert parallelism")
    for layer in layers:
        local = layer.cfg.n_experts // ep
        for name in layer.expert_names:
            shard = getattr(layer, name).detach()[rank * local:(rank + 1) * local].clone()
            setattr(layer, name, nn.Parameter(shard))
        layer.group = group or dist.group.WORLD
        layer.rank = rank
        layer.ep = ep
    return model


def sync_gradients(model: nn.Module, group=None) -> None:
    """A rank's loss is the mean over its own tokens, the model's the mean over ranks (EXPERT PARALLELISM)."""
    ep = foundation.group_size(group)
    experts = {p for layer in moe_layers(model) for p in layer.expert_parameters()}
    for name, param in model.named_parameters():
        if not param.requires_grad:  # frozen on every rank alike: nothing to sync
            continue
        if param.grad is None:  # skipping it would pair different tensors across ranks
            raise RuntimeError(f"{name} got no gradient")
        if param not in experts:
            foundation.all_reduce(param.grad, group=group)
        param.grad.div_(ep)


def unshard_experts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of name -> tensor (parameters or gradients), expert shards all-gathered over their group:
    named and shaped like the single-device model's. Every rank must pass the same names."""
    sharded = {id(p): layer for layer in moe_layers(model) if layer.group is not None
               for p in layer.expert_parameters()}
    out = {}
    for name, param in model.named_parameters():
        if name not in tensors:  # e.g. the gradient of a frozen parameter
            continue
        t = tensors[name].detach()
        if (layer := sharded.get(id(param))) is not None:
            whole = t.new_empty((layer.ep * t.shape[0], *t.shape[1:]))
            foundation.all_gather(whole, t.contiguous(), group=layer.group)
            t = whole
        out[name] = t
    return foundation.cpu_copy(out.items())


def all_to_all_traffic(kept: torch.Tensor, rank: int, dim: int, element_size: int) -> tuple[int, int]:
    """The formula: bytes leaving `rank` in one forward's (dispatch, combine) all-to-alls."""
    ep, n_experts = kept.shape
    mine = slice(rank * n_experts // ep, (rank + 1) * n_experts // ep)
    sent = int(kept[rank].sum() - kept[rank, mine].sum())
    returned = int(kept[:, mine].sum() - kept[rank, mine].sum())
    return sent * dim * element_size, returned * dim * element_size


@dataclass
class MoETrainResult(foundation.TrainResult):
    load: list[list[list[int]]] = field(default_factory=list)  # step -> layer -> tokens per expert
    dropped: list[list[int]] = field(default_factory=list)     # step -> layer
    aux: list[list[float]] = field(default_factory=list)       # step -> layer (group mean)
    formula_traffic: int = 0                                   # all-to-all bytes, by the formula


def train_moe(cfg: "foundation.ModelConfig", moe_cfg: MoEConfig, steps: int, global_batch: int,
              seq_len: int, *, expert_parallel: bool = False, group=None, lr: float = 1e-3,
              adam_eps: float = 1e-8, device: torch.device | str = "cpu"
              ) -> tuple[MoETrainResult, "foundation.CommMeter"]:
    """One device on the whole batch, or (expert_parallel) this rank's rows of it with the experts sharded
    over `group` -> the result (gradients, parameters reassembled), a meter of the loop's communication."""
    ep = foundation.group_size(group) if expert_parallel else 1
    rank = dist.get_rank(group) if expert_parallel else 0
    if global_batch % ep:
        raise ValueError(f"global_batch={global_batch} is not divisible by ep={ep}")
    model = convert_to_moe(foundation.GPT(cfg), moe_cfg)
    if expert_parallel:
        apply_expert_parallel(model, group)
    model.to(device)
    optimizer = foundation.make_optimizer(model, lr, adam_eps)
    result = MoETrainResult([], {}, {})
    grads = {}
    local_losses = []
    with foundation.comm_meter() as meter:
        for step in range(steps):
            tokens, targets = foundation.synthetic_batch(cfg, global_batch, seq_len, step, rank, ep)
            loss = model(tokens.to(device), targets.to(device))
            loss.backward()
            if expert_parallel:
                sync_gradients(model, group)
            local_losses.append(loss.detach())
            layers = moe_layers(model)
            result.load.append([layer.load.tolist() for layer in layers])
            result.dropped.append([int(layer.dropped) for layer in layers])
            result.aux.append([layer.aux_loss.detach() for layer in layers])
            result.formula_traffic += sum(2 * sum(all_to_all_traffic(layer.kept, rank, cfg.dim, 4))
                                          for layer in layers)  # x2: backward sends as much
            if step == 0:
                grads = {n: p.grad for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for layer in layers:
                layer.update_selection_bias()
    # Outside the meter: group means of the losses and aux losses, whole tensors from the shards.
    aux = [torch.stack(layers_aux) for layers_aux in result.aux]
    if expert_parallel:
        result.losses = foundation.mean_over_ranks(local_losses, group)
        result.aux = foundation.mean_over_ranks(aux, group)
    else:
        result.losses = torch.stack(local_losses).tolist()
        result.aux = torch.stack(aux).tolist()
    result.first_grads = unshard_experts(model, grads)
    result.params = unshard_experts(model, dict(model.named_parameters()))
    return result, meter


# --- RUN IT: the demo, the benchmark, the command line ---------------------------------------------
BALANCING = {"aux loss": dict(aux_loss_coef=0.1, bias_update_rate=0.0),
             "selection bias": dict(aux_loss_coef=0.0, bias_update_rate=0.01),
             "neither": dict(aux_loss_coef=0.0, bias_update_rate=0.0)}


def demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()
    cfg = foundation.ModelConfig()
    capacity = args.capacity_factor  # None: --dropless
    runs = {}
    for name, balancing in BALANCING.items():
        moe_cfg = MoEConfig(args.experts, args.top_k, args.expert_ffn_dim, capacity, **balancing)
        train = dict(cfg=cfg, moe_cfg=moe_cfg, steps=args.steps, global_batch=args.global_batch,
                     seq_len=args.seq_len, lr=args.lr, device=device)
        parallel, meter = train_moe(**train, expert_parallel=True)
        runs[name] = (moe_cfg, parallel, meter, train_moe(**train)[0] if rank == 0 else None)
    if rank == 0:
        print(f"Expert parallelism over {foundation.counted(world, 'rank')} ({dist.get_backend()}, "
              f"{device.type}): {foundation.counted(args.experts, 'expert')} ({args.experts // world} per "
              f"rank), top-{args.top_k}, capacity factor {capacity or 'none (dropless)'}; "
              f"{foundation.counted(cfg.n_layers, 'MoE layer')}, {args.global_batch} x {args.seq_len} tokens "
              f"per step, {foundation.counted(args.steps, 'AdamW step')}.\n")
        print(f"{'balancing':<16}{'cross-entropy: first':>21}{'last':>7}{'max |EP - one device|: loss':>30}"
              f"{'step-0 grads':>14}{'params':>10}")
        for name, (moe_cfg, parallel, _, single) in runs.items():
            first, last = (parallel.losses[i] - moe_cfg.aux_loss_coef * sum(parallel.aux[i]) for i in (0, -1))
            loss, grads, params = parallel.max_differences(single)
            print(f"{name:<16}{first:>21.4f}{last:>7.4f}{loss:>30.2e}{grads:>14.2e}{params:>10.2e}")
        width = max(1, args.steps // 5)
        windows = slice(0, width), slice(args.steps - width, args.steps)
        print(f"\nFirst -> last {foundation.counted(width, 'step')}: imbalance max/mean tokens per expert "
              f"(layer 0/1), layer 0's tokens per expert (last steps), dropped assignments per step and "
              f"layer (of {args.global_batch * args.seq_len * args.top_k}), aux loss:")
        differ = []
        for name, (_, parallel, _, single) in runs.items():
            load = [torch.tensor(parallel.load[w]).sum(0) for w in windows]  # (layer, expert) each
            before, after = ("/".join(f"{x:.2f}" for x in (l.amax(1) / l.double().mean(1)).tolist())
                             for l in load)
            dropped = [statistics.mean(map(statistics.mean, parallel.dropped[w])) for w in windows]
            same = parallel.load == single.load and parallel.dropped == single.dropped
            differ += [] if same else [name]
            print(f"  {name:<15} imbalance {before} -> {after}   {load[1][0].tolist()}   dropped "
                  f"{dropped[0]:.1f} -> {dropped[1]:.1f}   aux {statistics.mean(parallel.aux[0]):.3f} -> "
                  f"{statistics.mean(parallel.aux[-1]):.3f}   "
                  f"{'same' if same else 'NOT the same'} loads and drops as one device")
        tokens_rank = args.global_batch // world * args.seq_len
        uniform = 4 * cfg.n_layers * tokens_rank * args.top_k * (world - 1) // world * cfg.dim * 4
        print(f"\nall-to-all bytes leaving rank 0 per step (dispatch + combine, forward + backward, "
              f"{foundation.counted(cfg.n_layers, 'layer')}): measured / formula from the exchanged counts:")
        for name, (_, parallel, meter, _) in runs.items():
            print(f"  {name:<16}{float(meter.traffic('all_to_all')) / args.steps:>12,.0f} B"
                  f"{parallel.formula_traffic / args.steps:>12,.0f} B   (+ counts all-gather "
                  f"{float(meter.traffic('all_gather')) / args.steps:,.0f} B)")
        print(f"  uniform routing, no drops: 4 x layers x T_rank k (ep-1)/ep x D x 4 B = {uniform:,} B")
        print(foundation.lone_token_note(args.seq_len), end="")
        print("Notice: EP computes the one-device model (same drops, same loads" + (
            ")." if not differ else f"; not in {', '.join(differ)}: over these steps a rounding "
            f"difference tipped a near-tie in the router, and from there the runs part as any two "
            f"trainings with other rounding do).") + " Without balancing "
              "the load drifts apart; the selection bias evens it without touching the loss; the aux "
              "loss, through the gradient, mostly holds it where it started and cuts the drops.")
    foundation.exit_distributed()


@torch.no_grad()
def all_gather_moe_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """COST's all-gather dispatcher (dropless), the alternative to dispatch and combine."""
    everyone = x.new_empty(layer.ep * x.shape[0], x.shape[1])
    foundation.all_gather(everyone, x, group=layer.group)
    experts, weights, _ = layer.route(everyone)
    out = torch.zeros_like(everyone)
    local = layer.cfg.n_experts // layer.ep
    for j in range(local):
        token, slot = (experts == layer.rank * local + j).nonzero(as_tuple=True)
        out.index_add_(0, token, layer.expert(j, everyone[token]) * weights[token, slot, None])
    mine = torch.empty_like(x)
    foundation.reduce_scatter(mine, out, group=layer.group)
    return mine


def bench(args: argparse.Namespace) -> None:
    """The same expert-parallel layer, forward only, through both dispatchers, interleaved."""
    device = foundation.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()
    cfg = MoEConfig(args.experts, args.top_k, 4 * args.bench_dim)
    layer = apply_expert_parallel(MoE(args.bench_dim, cfg, seed=0)).to(device)
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(args.bench_tokens, args.bench_dim, generator=gen).to(device)
    dispatchers = {"all-to-all": lambda: layer(x), "all-gather": lambda: all_gather_moe_forward(layer, x)}
    outputs = {}
    traffic = {}
    with torch.no_grad():
        for name, fn in dispatchers.items():
            with foundation.comm_meter() as meter:
                outputs[name] = fn()
            traffic[name] = meter.traffic()
        med = foundation.interleaved_medians(dispatchers, args.bench_rounds, args.bench_steps, device)
    if rank == 0:
        diff = (outputs["all-to-all"] - outputs["all-gather"]).abs().max().item()
        print(f"MoE layer forward on {foundation.counted(world, 'rank')} ({dist.get_backend()}, "
              f"{device.type}): dim {args.bench_dim}, {foundation.counted(args.experts, 'expert')}, "
              f"top-{args.top_k}, {args.bench_tokens} tokens per rank, {foundation.median_of(args, 'call')}; "
              f"outputs differ by {diff:.1e}.")
        sent, gathered = (float(traffic[name]) for name in dispatchers)
        print(f"  bytes leaving rank 0: all-to-all {sent:,.0f}, all-gather {gathered:,.0f}, ratio "
              f"{sent / gathered:.3f} (k/ep = {args.top_k / world:.3f} without drops, plus the counts)")
        print(f"  time: {foundation.ratio_line(med)}")
    foundation.exit_distributed()


def check_run_memory(args: argparse.Namespace, ep: int) -> None:
    """The demo's GPT and its experts (each rank builds every expert, then keeps its own), or --bench's
    layer (experts of 4 x --bench-dim) and each rank's tokens, against this machine's memory."""
    if args.bench:
        ranks = foundation.counted(ep, "rank")
        tensors = {"the layer's fp32 experts": 4 * args.experts * 3 * args.bench_dim * 4 * args.bench_dim,
                   f"the tokens of {ranks}": 4 * ep * args.bench_tokens * args.bench_dim}
        sizes = f"--bench-tokens {args.bench_tokens} x --bench-dim {args.bench_dim}, --experts {args.experts}"
        foundation.check_memory(None, 0, 0, ep, tensors, what=sizes)
        return
    cfg = foundation.ModelConfig()
    layers = foundation.counted(cfg.n_layers, "layer")
    expert_bytes = 4 * cfg.n_layers * args.experts * 3 * cfg.dim * args.expert_ffn_dim
    experts = {f"the fp32 experts of {layers}": expert_bytes}
    sizes = (f"--experts {args.experts} x --expert-ffn-dim {args.expert_ffn_dim}, --global-batch "
             f"{args.global_batch} x --seq-len {args.seq_len}")
    foundation.check_memory(cfg, args.global_batch, args.seq_len, ep, experts, what=sizes)


@dataclass
class Options:
    steps: int = foundation.option(60, "AdamW steps of each MoE run", ">= 1")
    global_batch: int = foundation.option(16, "sequences per step, split over the ranks", ">= 1")
    seq_len: int = foundation.option(32, "tokens per sequence", ">= 1")
    lr: float = foundation.option(1e-2, "AdamW learning rate", ("> 0", "<= 1"))
    experts: int = foundation.option(8, "experts per MoE layer (divisible by the ranks)", ">= 1")
    top_k: int = foundation.option(2, "experts each token is routed to", ">= 1")
    expert_ffn_dim: int = foundation.option(64, "hidden size of each expert's SwiGLU", ">= 1")
    capacity_factor: float = foundation.option(
        1.25, "an expert takes at most this x its even share of the routed tokens; the rest are dropped",
        "> 0", off=("--dropless", None, "no capacity limit"))
    bench: bool = foundation.option(False, "all-to-all vs all-gather dispatcher")
    bench_tokens: int = foundation.option(2048, "--bench: tokens per rank", ">= 1")
    bench_dim: int = foundation.option(256, "--bench: model width", ">= 1")


def main() -> None:
    parser, args = foundation.parse_options(__doc__, (Options, foundation.Ranks, foundation.BenchRounds),
                                            bench_reads=("experts", "top_k"))
    divisible = {"--experts": args.experts, "--global-batch": args.global_batch}
    moe_options = functools.partial(MoEConfig, args.experts, args.top_k, args.expert_ffn_dim,
                                    args.capacity_factor)
    # top_k <= experts, a finite capacity: no option's own rule sees them
    rules = [lambda ep: moe_options(), functools.partial(check_run_memory, args)]
    foundation.launch_lesson(parser, args, bench if args.bench else demo, divisible=divisible, rules=rules)


if __name__ == "__main__":
    main()
