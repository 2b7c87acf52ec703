"""Lesson 10: planning a run at scale. What a model and a cluster that are not here would hold, send and take
per step, on every mesh of N GPUs, from the course's own formulas and measurements, nothing built.

WHAT IT COMPOSES
Lesson 09's plan() gives each pipeline rank's bytes held (02's ZeRO memory on the stage's TP-local
parameters, 03's activations x 04's microbatches in flight) and sent (03's TP all-reduces, 05's ring
hops, 04's boundary sends, 02's ZeRO traffic, 08's FP8 gathers); 09's `check` proves them equal to
what a running mesh measures. This lesson sets them against a GPU's memory and prices a step.

THE STEP TIME, from the operations (step_time): each one priced by the lesson that owns it, no MFU
assumed. GEMMs at their TP-local shapes by 08's roofline (the rate measured on an H100, or the bytes
at the HBM's bandwidth); attention at 07's measured rate; elementwise work (elementwise_bytes, split as
03 splits the layer) and the optimizer (02) at the HBM's bandwidth; recompute's forward again.
Messages go at their link's speed (NVLink inside a node, the NIC across: ranks are numbered tp
fastest, so inside_node knows which groups stay in one) plus a latency, exposed where nothing hides
them. The slowest pipeline rank's microbatches / (1 - 04's
bubble) span the pipeline. Two bounds frame it: perfect overlap, and none.

THE SEARCH (search_meshes): every dp x pp x cp x tp = N with tp inside a node that 09's validate
accepts; those that fit in memory, fastest first. The README's planning table checks the predictions
against published runs (Megatron-Core's H100 table, MosaicML's MPT, Meta's Llama 3 405B): PRESETS,
tests/test_10_planner.py.

RUN IT
    python 10_planner.py --model llama3-70b --gpus 256      # the fastest meshes that fit
    python 10_planner.py --model llama3-405b --dp 64 --pp 16 --cp 1 --tp 8 --sequence-parallel \
        --zero 2 --schedule interleaved --virtual 2                   # Meta's mesh, per pipeline rank
Look at: the fullest GPU's bytes beside its 80 GB; which terms of the step are exposed communication
and which the bubble; how far apart the two bounds are.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import math
import sys
from dataclasses import dataclass

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
tensor_parallel = importlib.import_module("03_tensor_parallel")
pipeline = importlib.import_module("04_pipeline")
context_parallel = importlib.import_module("05_context_parallel")
flash = importlib.import_module("07_flash_attention")
fp8 = importlib.import_module("08_fp8")
full_train = importlib.import_module("09_full_train")

# 09's mesh, configuration and per-rank plan, which this lesson prices; its options machinery
MeshSizes, TrainConfig, RankPlan = full_train.MeshSizes, full_train.TrainConfig, full_train.RankPlan
DIMS, option, PLAN = full_train.DIMS, full_train.option, full_train.PLAN

# 09's presets and published ones (Meta's Llama 3; the runs the README's planning table checks): (model,
# seq_len, global_batch, lr). Peak lr from the Llama 3 paper; batches of 4M, 8M and 16M tokens (405B:
# Meta's last). Megatron-Core's H100 table (vocabulary 131,072, 4,096 tokens) and MosaicML's MPT (50,368,
# 2,048) as (dim, layers, batch): heads of 128, their GELU MLP of 4 x dim priced as our SwiGLU with its
# parameters (ffn 8 dim / 3).
LLAMA3 = dict(vocab_size=128_256, n_kv_heads=8, rope_theta=500_000.0)
MEGATRON_H100 = {"1.7b": (2048, 24, 192), "7.1b": (4096, 30, 192), "16b": (6144, 32, 192),
                 "32b": (7168, 48, 192), "70b": (8192, 84, 384), "119b": (10240, 92, 768),
                 "177b": (12288, 96, 1152), "314b": (16384, 96, 1536), "462b": (18432, 112, 3072)}
MPT = {"1b": (2048, 24, 112), "7b": (4096, 32, 48), "70b": (8192, 80, 4096)}
PRESETS = full_train.MODELS | {
    "llama3-8b": (dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **LLAMA3), 8192, 512, 3e-4),
    "llama3-70b": (dict(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **LLAMA3), 8192, 1024, 1.5e-4),
    "llama3-405b": (dict(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, **LLAMA3), 8192, 2048, 8e-5),
} | {f"{family}-{k}": (dict(dim=d, n_layers=n, n_heads=d // 128, ffn_dim=round(d / 3) * 8, vocab_size=vocab),
                      seq_len, b, 1e-4)
     for family, runs, vocab, seq_len in (("megatron", MEGATRON_H100, 131_072, 4096),
                                          ("mpt", MPT, 50_368, 2048)) for k, (d, n, b) in runs.items()}


@dataclass(frozen=True)
class PlanModel:
    model: str = option("tiny", "the preset: 09's, or a published run's", commands=PLAN, choices=PRESETS)


# --- A cluster, and a step's time on it ------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """The machines, by default H100 SXM nodes: NVIDIA's datasheet (989 dense bf16 TFLOP/s, 3.35 TB/s
    HBM3, NVLink 4 at 450 GB/s each way) and the DGX H100's 400 Gb/s NIC per GPU. GEMMs and attention
    run at the course's own H100 measurements (08's and 07's tables), x peak_tflops / 989."""
    gpus: int | None = option(None, "GPUs (default: the product of the mesh sizes)", ">= 1", PLAN, type=int)
    gpus_per_node: int = option(8, "GPUs per node (tp stays in one)", ">= 1", PLAN)
    gpu_memory: float = option(80.0, "GB per GPU", "> 0", PLAN)
    peak_tflops: float = option(989.0, "dense bf16 TFLOP/s per GPU: scales the H100's measured rates", "> 0",
                                PLAN)
    hbm_tbps: float = option(3.35, "TB/s of GPU memory (elementwise work, the optimizer, thin GEMMs)", "> 0",
                             PLAN)
    nvlink_gbps: float = option(450.0, "GB/s per GPU each way in a node (NVLink 4)", "> 0", PLAN)
    network_gbps: float = option(50.0, "GB/s per GPU each way between nodes (a 400 Gb/s NIC)", "> 0", PLAN)
    latency: float = 10e-6  # s a collective or send costs beyond its bytes: NCCL's tuning model
    # (src/graph/tuning.cc) puts a ring's base latency at 4-8 us, plus 0.5-3 us a hop on NVLink


def inside_node(sizes: MeshSizes, kind: str, gpus_per_node: int) -> bool:
    """Whether every group of this kind lies in one node: ranks are numbered tp fastest, so a group
    stays within aligned blocks of (its slowest dimension's size x the faster dimensions' sizes)."""
    moving = [d for d in DIMS if d in full_train.GROUP_DIMS.get(kind, ("dp", "cp")) and getattr(sizes, d) > 1]
    block = math.prod(getattr(sizes, d) for d in DIMS[DIMS.index(moving[0]):]) if moving else 1
    return gpus_per_node % block == 0


def pipeline_span(busy: list[float], bubble: float, boundary: float, pp: int, microbatches: int,
                  virtual: int, hide: bool) -> tuple[float, float]:
    """(span, fill): the pipeline's seconds, and of them the fill and drain's sends (boundary seconds
    each: the first forward's pp - 1 hops before the last rank starts, the last backward's after it
    ends; hide=False: every microbatch's, both ways, over all pp x virtual - 1 boundaries; pp = 1:
    none, one rank holds every stage). Outside them the slowest rank is busy max(busy) and idle 04's
    bubble, its idle fraction."""
    fill = (pp > 1) * boundary * (2 * (pp - 1) if hide else 2 * microbatches * (pp * virtual - 1))
    return max(busy) / (1 - bubble) + fill, fill


def elementwise_bytes(cfg, tokens: int, tp: int, sequence_parallel: bool, *, layers: int, embed: bool,
                      head: bool, mlp: bool = True, elem_bytes: int = 2) -> tuple[int, int]:
    """Memory traffic (forward, backward) of one rank's elementwise work on a microbatch of `tokens`
    tokens through a stage (03's comm_formula keywords), each operation reading its inputs and writing
    its output once (torch.compile fuses them). Per layer, between the regions (/ t with SP): two
    RMSNorms (h in, h out), two residual adds (2h, h); on the rank's heads and ffn / t: RoPE on q and
    k, silu(gate) x up (2f, f). Plus the embedding's lookup, the final norm, and the loss's two fp32
    passes over the V / t logits. Backward reads what forward read and the output's gradient, writes
    the inputs' gradients: a norm or an add 3h, SwiGLU 5f, the embedding 3h, the loss two passes."""
    h, e, mid = cfg.dim, elem_bytes, tokens // (tp if sequence_parallel else 1)  # mid: between the regions
    qk, f = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // tp, cfg.ffn_dim // tp * mlp
    loss = head * 2 * 4 * -(-cfg.vocab_size // tp) * tokens
    forward = layers * (10 * h * mid + (2 * qk + 3 * f) * tokens) + 2 * h * (embed * tokens + head * mid)
    backward = layers * (12 * h * mid + (2 * qk + 5 * f) * tokens) + 3 * h * (embed * tokens + head * mid)
    return forward * e + loss, backward * e + loss


PARTS = ("GEMMs", "attention", "elementwise", "TP", "DP", "PP", "CP", "bubble")  # a step's, as printed


def step_time(cfg, sizes: MeshSizes, train: TrainConfig, plans: list[RankPlan], cluster: Cluster,
              hide: bool = True) -> dict:
    """Seconds per step from the operations, each priced by the lesson that owns it: the linears at
    their TP-local shapes (08's roofline: the GEMM rate measured on an H100, or the bytes at the HBM's
    bandwidth), attention at 07's measured rate, elementwise work (03) and the optimizer (02) at the
    HBM's bandwidth, recompute's forward again. Messages go at their link's speed plus a latency,
    exposed where nothing hides them: TP's all, the ring's hops beyond a block's attention, the
    gradient reduction beyond the last microbatch's backward, ZeRO-1/2's gather after the step,
    ZeRO-3's beyond the previous layer, the pipeline's sends in its fill and drain. The slowest rank's
    microbatches / (1 - 04's bubble) span the pipeline. parts: that rank's (bubble: its idle time in
    the span). The bounds: hide=False, no communication hidden; the compute alone, or the busiest
    link's bytes."""
    tp, cp, pp, m, n, moe = sizes.tp, sizes.cp, sizes.pp, train.microbatches, sizes.dp * sizes.cp, train.moe
    e, rows, s = 2 if train.mixed_precision else 4, train.global_batch // sizes.dp // m, train.seq_len // cp
    tokens, hbm = rows * s, cluster.hbm_tbps * 1e12  # a microbatch's tokens on a rank
    speed = cluster.peak_tflops * 1e12 / dict(full_train.PEAK_BF16_FLOPS)["H100"]
    link = lambda kind: 1e9 * (cluster.nvlink_gbps if inside_node(sizes, kind, cluster.gpus_per_node)
                               else cluster.network_gbps)
    send = lambda kind, nbytes, calls=1: float(nbytes) / link(kind) + calls * cluster.latency
    exposed = lambda comm, behind: max(0.0, comm - behind) if hide else comm
    shapes = full_train.local_shapes(cfg, tp, moe, sizes.ep)

    def linears(prefix: str) -> list[float]:  # (forward, backward); 06's experts share top_k x the tokens
        out = [0.0, 0.0]
        for *experts, n_out, n_in in (v for k, v in shapes.items() if k.startswith(prefix) and len(v) > 1):
            count = experts[0] if experts else 1
            f, b = fp8.linear_seconds(tokens * (moe.top_k if experts else 1) // count, n_in, n_out, hbm,
                                      train.fp8 and not experts and prefix == "layers.", speed)
            out = [out[0] + count * f, out[1] + count * b]
        return out

    elementwise = lambda **at: [x / hbm for x in elementwise_bytes(
        cfg, tokens, tp, train.sequence_parallel, mlp=moe is None, elem_bytes=e, **at)]
    attention = flash.attention_seconds(rows, cfg.n_heads // tp, s, cfg.head_dim,
                                        "flash" if cp > 1 else train.attention, cp, speed)  # 09's ring: 07's
    layer = {"GEMMs": linears("layers."), "attention": list(attention),
             "elementwise": elementwise(layers=1, embed=False, head=False)}
    rerun = {"none": (), "selective": ("attention",), "full": tuple(layer)}[train.recompute]
    layer = {k: [f, b + f * (k in rerun)] for k, (f, b) in layer.items()}  # recompute: the forward again
    ranks = []
    for p in plans:
        first, last = 0 in p.stages, pp * train.virtual - 1 in p.stages
        ends = {"GEMMs": linears("lm_head") if last else [0, 0], "attention": [0, 0],
                "elementwise": elementwise(layers=0, embed=first, head=last)}
        work = {k: [p.layers * layer[k][i] + ends[k][i] for i in (0, 1)] for k in layer}
        parts = {k: m * sum(v) for k, v in work.items()} | dict.fromkeys(("TP", "CP", "DP"), 0.0)
        if tp > 1:  # (ZB-H1's W re-runs part of the backward's: priced as 1F1B's)
            messages = full_train.tp_messages(cfg, sizes, train, p.layers, first, last)
            parts["TP"] = sum(send("tp", sent, calls) for calls, sent in messages)
        if cp > 1:  # each of the cp - 1 hops behind one block's attention; recompute: the forward's twice
            hops = context_parallel.attention_bytes("ring", tokens * cfg.dim // tp,
                                                    tokens * cfg.n_kv_heads * cfg.head_dim // tp, cp, e)
            f, b = (exposed(send("cp", hops[d] / (cp - 1)), t / cp) for d, t in zip(hops, attention))
            parts["CP"] = m * p.layers * (cp - 1) * (f * (1 + (train.recompute != "none")) + b)
        after = zero.zero_step_bytes(p.params, n, train.zero_stage, m, train.mixed_precision) / hbm
        if n > 1:  # 02's over dp x cp; units: each layer, the embedding, the norm and head
            unit, units = [sum(v[i] for v in layer.values()) for i in (0, 1)], p.layers + first + 2 * last
            last_backward = sum(v[1] for v in work.values())
            parts["DP"] = zero.zero_exposed_seconds(p.params, n, train.zero_stage, units, m, e,
                                                    lambda *x: send("dp_cp", *x), last_backward, unit, hide)
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
    links, comm = {"NVLink": 0.0, "network": 0.0}, {}
    for kind in dict.fromkeys(k for p in plans for k in p.traffic):
        sent = [p.traffic.get(kind, 0) for p in plans]
        where = "NVLink" if inside_node(sizes, kind, cluster.gpus_per_node) else "network"
        comm[kind] = None if None in sent else (float(max(sent)), where)
        links[where] += 0 if comm[kind] is None else comm[kind][0] / link(kind)
    flops = train.global_batch * train.seq_len * full_train.flops_per_token(cfg, train.seq_len)  # MFU's count
    return dict(step=max(totals), parts={k: parts[k] for k in PARTS}, bubble=bubble, busy=busy, span=span,
                flops=flops, mfu=flops / (max(totals) * sizes.world * cluster.peak_tflops * 1e12), comm=comm,
                overlap=max(compute, *links.values()),
                no_overlap=step_time(cfg, sizes, train, plans, cluster, hide=False)["step"] if hide else None)


def planned(cfg, sizes: MeshSizes, train: TrainConfig, microbatches: int | None, cluster: Cluster) -> tuple:
    """(sizes, train as run on them, plans, step time), or validate's ValueError. microbatches None:
    one sequence each (global_batch / dp)."""
    train = dataclasses.replace(train, microbatches=microbatches or max(train.global_batch // sizes.dp, 1))
    full_train.validate(cfg, sizes, train, sizes.world)
    plans = full_train.plan(cfg, sizes, train)
    return sizes, train, plans, step_time(cfg, sizes, train, plans, cluster)


def search_meshes(cfg, train: TrainConfig, gpus: int, fixed: dict[str, int | None], microbatches: int | None,
                  ep: int, cluster: Cluster) -> tuple[list, list, str]:
    """The meshes of gpus GPUs (tp within a node, the sizes given kept) that validate accepts, as
    planned() gives them; those that fit in a GPU's memory, fastest first (by the predicted step); the
    first refusal."""
    valid, refusals = [], []
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        sizes = MeshSizes(gpus // (tp * cp * pp), pp, cp, tp, ep)
        if gpus % (tp * cp * pp) or cluster.gpus_per_node % tp or any(
                fixed[d] not in (None, getattr(sizes, d)) for d in DIMS):
            continue
        try:
            valid.append(planned(cfg, sizes, train, microbatches, cluster))
        except ValueError as error:
            refusals.append(f"{full_train.mesh_name(sizes)}: {error}".replace("\n", " "))
    fitting = sorted((v for v in valid if max(p.total for p in v[2]) <= cluster.gpu_memory * 1e9),
                     key=lambda v: v[3]["step"])
    return valid, fitting, refusals[0] if refusals else "no sizes multiply to it (tp divides --gpus-per-node)"


# ==============================================================================================
# RUN IT: the report of one mesh, or of the fastest that fit; the command line
# ==============================================================================================

GROUP_NAMES = {"tp": "tp", "cp": "cp", "pp": "pp", "dp_cp": "dp x cp", "ep_dp": "experts' dp", "ep": "ep"}


def gigabytes(x) -> str:
    return "n/a" if x is None else f"{float(x) / 1e9:,.1f}" if x >= 1e9 else f"{float(x) / 1e9:.2g}"


def describe(sizes: MeshSizes, train: TrainConfig, plans: list[RankPlan], timing: dict, table: bool) -> str:
    """The mesh and run; memory per pipeline rank (table: the first two, the fullest and the last two
    ranks, else the fullest); bytes sent per group; the step time's terms and bounds."""
    lines = [f"{full_train.mesh_name(sizes)}, ZeRO-{train.zero_stage}, {train.schedule} x "
             f"{train.microbatches} microbatches of {train.global_batch // sizes.dp // train.microbatches}, "
             f"recompute {train.recompute}, SP {'on' if train.sequence_parallel else 'off'}"]
    totals = [p.total for p in plans]
    fullest = totals.index(max(totals))
    if table:
        lines.append("GB held per GPU   params   grads   optim   activ   total")
        ends = {0, 1, fullest, len(plans) - 2, len(plans) - 1}
        shown = sorted(ends if len(plans) > 6 else range(len(plans)))
        for rank in shown:
            p, pairs = plans[rank], "microbatch-stages" if train.virtual > 1 else "microbatches"
            what = (("embedding + " if 0 in p.stages else "") + f"{p.layers} layers"
                    + (" + head" if len(plans) * train.virtual - 1 in p.stages else ""))
            lines += ["  ..."] * (rank > 0 and rank - 1 not in shown) + [
                f"  pp {rank:<11}" + "".join(f"{gigabytes(p.memory[k]):>8}" for k in p.memory)
                + f"{gigabytes(totals[rank]):>8}  {what}, in flight: {p.in_flight} {pairs}"]
    else:
        lines.append(f"fullest GPU {gigabytes(totals[fullest])} GB (pp {fullest}: "
                     + ", ".join(f"{k} {gigabytes(v)}" for k, v in plans[fullest].memory.items()) + ")")
    lines.append("sent per GPU per step (its busiest pipeline rank): " + (", ".join(
        f"{GROUP_NAMES[k]} " + ("n/a (no formula)" if v is None else f"{gigabytes(v[0])} GB ({v[1]})")
        for k, v in timing["comm"].items()) or "nothing"))
    t, seconds = timing, lambda x: f"{x:,.1f}" if x >= 10 else f"{x:.3g}"
    part = {k: seconds(v) for k, v in t["parts"].items()}
    useful = (f"{t['flops'] / sizes.world / t['step'] / 1e12:,.0f} TFLOP/s per GPU, MFU {t['mfu']:.0%}"
              if train.moe is None else "MFU n/a (flops_per_token counts dense MLPs)")
    compute = " + ".join(f"{k} {part[k]}" for k in ("GEMMs", "attention", "elementwise"))
    lines += [f"step {seconds(t['step'])} s predicted: {useful}; "
              f"bounds {seconds(t['overlap'])} s (perfect overlap) to {seconds(t['no_overlap'])} s (none)",
              f"  {compute} + exposed " + ", ".join(f"{k} {part[k]}" for k in ("TP", "DP", "PP", "CP"))
              + f" + bubble {part['bubble']} s ({t['parts']['bubble'] / t['step']:.0%} of the step: 04's "
              f"idle fraction {t['bubble']:.0%}, and the stages' imbalance)"]
    return "\n".join(lines)


TOP_MESHES = 3  # the search prints this many


def plan_report(args: argparse.Namespace) -> str:
    """The given mesh's breakdown, or the fastest meshes that fit; one line if none fits."""
    cfg, fixed = full_train.build_model_config(args, PRESETS), {d: getattr(args, d) for d in DIMS}
    train = full_train.train_config(args, models=PRESETS)
    train = dataclasses.replace(train, mixed_precision=True)  # a GPU run: bf16 + fp32 masters
    cluster, memory = Cluster(**full_train.options_of(Cluster, args)), args.gpu_memory * 1e9
    gpus = args.gpus or (math.prod(fixed.values()) if None not in fixed.values() else 0)
    if gpus < 1 or None not in fixed.values() and math.prod(fixed.values()) != gpus:
        given = [f"--{d} {v}" for d, v in {"gpus": args.gpus, **fixed}.items() if v is not None]
        raise ValueError(f"plan needs --gpus N or every mesh size (--dp --pp --cp --tp), sizes that multiply "
                         f"to N; given: {' '.join(given) or 'neither'}")
    n_params = sum(map(math.prod, foundation.parameter_shapes(cfg).values()))
    header = (f"{args.model}: {n_params / 1e9:,.3g}B parameters (dim {cfg.dim}, {cfg.n_layers} layers, "
              f"{cfg.n_heads} heads / {cfg.n_kv_heads} K/V, ffn {cfg.ffn_dim}, vocabulary "
              f"{cfg.vocab_size:,}), bf16 + fp32 masters{' + FP8 GEMMs' if train.fp8 else ''}; batch "
              f"{train.global_batch:,} x {train.seq_len:,} tokens; {gpus:,} GPUs of {args.gpu_memory:g} GB, "
              f"{cluster.gpus_per_node} per node.\nPriced: GEMMs and attention ({train.attention}) at the "
              f"course's H100 rates x {cluster.peak_tflops:g} / 989 TFLOP/s, the rest at "
              f"{cluster.hbm_tbps:g} TB/s; {cluster.nvlink_gbps:g} GB/s per GPU each way in a node, "
              f"{cluster.network_gbps:g} across nodes,\n{cluster.latency * 1e6:g} us a message. Memory "
              f"leaves out the logits and loss, the embedding's output, temporaries, CUDA and NCCL buffers, "
              f"fragmentation.")
    valid, fitting, refusal = search_meshes(cfg, train, gpus, fixed, args.microbatches, args.ep, cluster)
    if None not in fixed.values() and valid:  # the mesh given
        need = max(p.total for p in valid[0][2])
        verdict = (f"fits: {gigabytes(need)} of {args.gpu_memory:g} GB on the fullest GPU" if need <= memory
                   else
                   f"does not fit: the fullest GPU needs {gigabytes(need)} GB, {gigabytes(need - memory)} GB "
                   f"({need / memory - 1:.0%}) more than its {args.gpu_memory:g} GB")
        return "\n".join([header, describe(*valid[0], table=True), verdict])
    if not valid:
        return f"no mesh of {gpus:,} GPUs passes validate: {refusal}"
    if not fitting:
        sizes, run, plans, _ = min(valid, key=lambda v: max(p.total for p in v[2]))
        need = max(p.total for p in plans)
        leanest = describe(sizes, run, plans, valid[0][3], False).splitlines()[0]
        return (f"{args.model} does not fit on {gpus:,} GPUs of {args.gpu_memory:g} GB: the leanest of "
                f"{len(valid)} valid meshes ({leanest}) needs {gigabytes(need)} GB on its fullest GPU, "
                f"{need / memory:.1f}x the memory")
    lines = [header, f"{len(valid)} meshes pass validate, {len(fitting)} fit; the fastest:"]
    for rank, choice in enumerate(fitting[:TOP_MESHES], start=1):
        lines.append(f"{rank}. " + describe(*choice, table=False).replace("\n", "\n   "))
    return "\n".join(lines)


OPTIONS = (MeshSizes, PlanModel, full_train.ModelOptions, TrainConfig, Cluster)  # in --help's order
PRESET = full_train.PRESET
DECIDED = dict(dict.fromkeys(DIMS, "searched"), microbatches="global_batch / dp: one sequence each",
               kv_heads=PRESET, global_batch=PRESET, seq_len=PRESET)  # options left None: what decides


def main() -> None:
    """One program, 09's option fields that name "plan" (mesh, model, training) and Cluster's: a
    ValueError naming the option, before any work; nothing is launched."""
    parser = foundation.LessonParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     allow_abbrev=False, formatter_class=foundation.DefaultsHelpFormatter)
    full_train.add_options(parser, "plan", {}, DECIDED, OPTIONS)
    args = parser.parse_args(sys.argv[1:])
    args.command, args.moe = "plan", args.moe or args.ep > 1
    try:
        problems = full_train.broken_rules(args, full_train.option_fields("plan", OPTIONS), flagged=True)
        if problems:
            raise ValueError(problems[0])
        report = plan_report(args)
        if foundation.prints_here():  # once under torchrun, though nothing needs it
            print(report)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
