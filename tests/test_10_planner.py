"""Lesson 10 as a specification: the planner builds nothing, searches only meshes 09 accepts, and its
step time adds up, moves the right way and predicts published runs within 15%.

What is exact and what is a tolerance: the plans are 09's plan() (proved equal to what a running mesh
measures in test_09); the step's parts add up to it within float rounding (rel 1e-12); the
predictions of published runs are held to 15% (the README's table states each error), the model's
stated accuracy: a change that moves a prediction further is a change to the model, to be argued.
"""
from __future__ import annotations

import importlib
import itertools
import math
import re
import sys

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import ROOT

foundation = importlib.import_module("01_ddp")
full_train = importlib.import_module("09_full_train")
planner = importlib.import_module("10_planner")


# --- the plan at scale -------------------------------------------------------------------------

def plan_main(monkeypatch, capsys, *options: str) -> tuple[int, str, str]:
    """10's main in this process: it builds nothing and starts no rank. (exit code, stdout, stderr)"""
    monkeypatch.setattr(sys, "argv", ["10_planner.py", *options])
    try:
        planner.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    assert not torch.distributed.is_initialized()
    out, err = capsys.readouterr()
    return code, out, err


def preset(name: str) -> "foundation.ModelConfig":
    return foundation.ModelConfig(**{"vocab_size": 256, **planner.PRESETS[name][0]})


def test_plan_of_llama3_70b_on_256_gpus_prints_the_fastest_meshes_that_fit(monkeypatch, capsys):
    _, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-70b", "--gpus", "256")
    assert "llama3-70b: 70.6B parameters" in out and "batch 1,024 x 8,192 tokens" in out
    meshes = re.findall(r"\n(\d)\. dp=(\d+) pp=(\d+) cp=(\d+) tp=(\d+)", out)
    assert [int(m[0]) for m in meshes] == list(range(1, planner.TOP_MESHES + 1))
    assert all(math.prod(map(int, m[1:])) == 256 and int(m[4]) <= 8 for m in meshes)
    fullest = [float(x) for x in re.findall(r"fullest GPU ([\d.]+) GB", out)]
    assert len(fullest) == planner.TOP_MESHES and max(fullest) <= 80
    steps = [float(x) for x in re.findall(r"\n   step ([\d.]+) s predicted", out)]
    assert len(steps) == planner.TOP_MESHES and steps == sorted(steps), "fastest first"
    bubbles = re.findall(r" \+ bubble ([\d.]+) s \((\d+)% of the step", out)  # once 04's fraction alone
    assert len(bubbles) == planner.TOP_MESHES
    assert all(abs(100 * float(b) / step - int(share)) <= 1 for (b, share), step in zip(bubbles, steps)), bubbles


@given(gpus=st.sampled_from([8, 16, 64]), memory_gb=st.floats(8, 160), more=st.floats(1, 4),
       model=st.sampled_from(["1b", "llama3-8b"]), zero_stage=st.integers(0, 3),
       recompute=st.sampled_from(full_train.tensor_parallel.RECOMPUTE_MODES), sequence_parallel=st.booleans())
def test_the_search_returns_valid_meshes_that_fit_and_more_memory_never_slows_it(
        gpus, memory_gb, more, model, zero_stage, recompute, sequence_parallel):
    cfg, (_, seq_len, batch, _) = preset(model), planner.PRESETS[model]
    train = full_train.TrainConfig(global_batch=batch, seq_len=seq_len, zero_stage=zero_stage,
                                   mixed_precision=True, recompute=recompute,
                                   sequence_parallel=sequence_parallel)
    search = lambda gb: planner.search_meshes(  # noqa: E731
        cfg, train, gpus, dict.fromkeys(full_train.DIMS), None, 1, planner.Cluster(gpu_memory=gb))
    valid, fitting, _ = search(memory_gb)
    for sizes, run, plans, _ in valid:
        full_train.validate(cfg, sizes, run, gpus)  # raises if it does not accept the mesh
        assert sizes.tp <= 8 and plans == full_train.plan(cfg, sizes, run)
    fits = [v for v in valid if max(p.total for p in v[2]) <= memory_gb * 1e9]
    assert sorted(map(id, fitting)) == sorted(map(id, fits)), "every mesh that fits, and only those"
    _, with_more, _ = search(memory_gb * more)
    if fitting:
        assert with_more[0][3]["step"] <= fitting[0][3]["step"]


def test_a_model_that_cannot_fit_is_one_line_saying_by_how_much(monkeypatch, capsys):
    _, out, _ = plan_main(monkeypatch, capsys, "--model", "llama3-405b", "--gpus", "8")
    needs, ratio = re.fullmatch(r"llama3-405b does not fit on 8 GPUs of 80 GB: the leanest of \d+ valid "
                                r"meshes \(dp=\d+ pp=\d+ cp=1 tp=\d+, .*\) needs ([\d,.]+) GB on its fullest "
                                r"GPU, ([\d.]+)x the memory\n", out).groups()
    assert float(needs.replace(",", "")) / 80 == pytest.approx(float(ratio), abs=0.05)
    _, out, _ = plan_main(monkeypatch, capsys, *"--model llama3-70b --dp 4 --pp 1 --cp 1 --tp 8".split())
    assert re.search(r"\ndoes not fit: the fullest GPU needs [\d,.]+ GB, [\d,.]+ GB \(\d+%\) more than its "
                     r"80 GB\n$", out)


@pytest.mark.parametrize("options, message", [
    ("--gpu-memory 0", "--gpu-memory must be > 0, not 0.0"),
    ("--gpu-memory -5", "--gpu-memory must be > 0, not -5.0"),
    ("--hbm-tbps 0", "--hbm-tbps must be > 0, not 0.0"),
    ("--hbm-tbps -3", "--hbm-tbps must be > 0, not -3.0"),
    ("--peak-tflops 0", "--peak-tflops must be > 0, not 0.0"),
    ("--nvlink-gbps 0", "--nvlink-gbps must be > 0, not 0.0"),
    ("--network-gbps 0", "--network-gbps must be > 0, not 0.0"),
    ("--gpus-per-node 0", "--gpus-per-node must be >= 1, not 0"),
    ("--dp 0", "--dp must be >= 1, not 0"),
])
def test_plan_refuses_an_impossible_input_in_one_line_before_any_work(monkeypatch, capsys, options, message):
    """Zeros divided the step time (a ZeroDivisionError), a negative memory or bandwidth were
    planned, --dp 0 was "no sizes multiply to it": each is one line naming the option, exit 2."""
    monkeypatch.setattr(planner, "search_meshes", lambda *args: pytest.fail("planned"))
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8", *options.split())
    assert (code, out, err) == (2, "", f"10_planner.py: error: {message}\n")


@pytest.mark.parametrize("options, given", [
    ("", "neither"),
    ("--gpus 8 --dp 2 --pp 1 --cp 1 --tp 2", "--gpus 8 --dp 2 --pp 1 --cp 1 --tp 2"),  # 4 GPUs, not 8
    ("--dp 2 --pp 1 --cp 1", "--dp 2 --pp 1 --cp 1"),  # no --tp, no --gpus
])
def test_plan_without_a_gpu_count_says_what_it_needs_and_was_given(monkeypatch, capsys, options, given):
    """The first command a student types (no options) printed a Python dict of Nones."""
    monkeypatch.setattr(planner, "search_meshes", lambda *args: pytest.fail("planned"))
    code, out, err = plan_main(monkeypatch, capsys, *options.split())
    needs = "10_planner.py: error: plan needs --gpus N or every mesh size (--dp --pp --cp --tp), sizes that multiply"
    assert (code, out) == (2, "") and err == f"{needs} to N; given: {given}\n", err


@pytest.mark.parametrize("rank, torchrun, prints", [
    ("0", True, True), ("1", True, False), ("1", False, True)],
    ids=["torchrun rank 0", "torchrun rank 1", "a shell's stray RANK=1"])
def test_under_torchrun_the_plan_and_an_error_are_printed_once(monkeypatch, capsys, rank, torchrun, prints):
    """torchrun --nproc_per_node=2 printed the plan twice; a RANK left in a shell silenced the errors."""
    for name, value in dict(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, MASTER_ADDR="localhost",
                            MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none").items():
        monkeypatch.setenv(name, value)
    if not torchrun:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "8")
    assert code == 0 and not err and out.startswith("llama3-8b: 8.03B parameters") == prints, (out, err)
    code, out, err = plan_main(monkeypatch, capsys, "--model", "llama3-8b", "--gpus", "0")
    assert code == 2 and not out and err.startswith("10_planner.py: error: --gpus") == prints, err


def test_llama3_405b_on_metas_mesh_is_planned_without_building_it():
    """tp 8, pp 16, dp 64 on 8,192 GPUs (Meta's): nothing is built; the pipeline ranks' TP-local
    parameters x 8 add up to the model's (vocabulary 128,256, heads and ffn all divide by 8: no
    padding) and 7 more copies of the norms, which every tp rank holds whole."""
    cfg, sizes = preset("llama3-405b"), full_train.MeshSizes(dp=64, pp=16, tp=8)
    train = full_train.TrainConfig(global_batch=2048, seq_len=8192, microbatches=32, mixed_precision=True,
                             sequence_parallel=True, recompute="full")
    full_train.validate(cfg, sizes, train, 8192)
    plans = full_train.plan(cfg, sizes, train)
    assert [p.layers for p in plans] == [8] * 14 + [7] * 2
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    model = sum(map(math.prod, foundation.parameter_shapes(cfg).values()))
    assert sum(p.params for p in plans) * 8 - 7 * norms == model
    assert [p.in_flight for p in plans] == list(range(16, 0, -1))


# --- the step time, predicted from the operations ---------------------------------------------------

def timed(model: str, mesh: tuple[int, int, int, int], microbatches: int | None = None, **train) -> tuple:
    """planned() of a preset on mesh (dp, pp, cp, tp), bf16 with fp32 masters, H100 nodes:
    (sizes, the run, plans, step time)."""
    cfg, (_, seq_len, batch, _) = preset(model), planner.PRESETS[model]
    run = full_train.TrainConfig(**dict(dict(global_batch=batch, seq_len=seq_len, mixed_precision=True), **train))
    return planner.planned(cfg, full_train.MeshSizes(*mesh), run, microbatches, planner.Cluster())


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_leaves_no_elementwise_work_replicated(tp):
    """With SP every elementwise byte of a stage with the final norm and loss is split t ways
    (norms and residual adds by tokens, RoPE and SwiGLU by heads and ffn, the loss by vocabulary):
    t ranks move what one device moves. Plain TP repeats the norms and adds (10h forward, 12h
    backward per token and layer) on every rank. The embedding's lookup is every rank's."""
    cfg = foundation.ModelConfig(vocab_size=512, dim=64, n_layers=3, n_heads=8, n_kv_heads=4, ffn_dim=176)
    tokens, at = 96, dict(layers=3, embed=False, head=True, elem_bytes=2)
    one = planner.elementwise_bytes(cfg, tokens, 1, False, **at)
    sp = planner.elementwise_bytes(cfg, tokens, tp, True, **at)
    plain = planner.elementwise_bytes(cfg, tokens, tp, False, **at)
    assert [tp * x for x in sp] == list(one)
    extra = [(tp - 1) * (per_layer * 3 + norm) * cfg.dim * tokens * 2 for per_layer, norm in ((10, 2), (12, 3))]
    assert [tp * x - y for x, y in zip(plain, one)] == extra
    embed = planner.elementwise_bytes(cfg, tokens, tp, True, layers=0, embed=True, head=False)
    assert list(embed) == [2 * cfg.dim * tokens * 2, 3 * cfg.dim * tokens * 2]


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_the_step_is_its_parts_and_the_pipeline_spans_the_slowest_rank_over_one_minus_the_bubble(
        schedule, virtual):
    """Issue 34: compute stretched by 1 + bubble instead of / (1 - bubble) passed, as the tests
    checked only the order of meshes. On pp 8 with 8 microbatches 04's bubble is 7/15 (1F1B), so
    the two differ by 1.9x: the span must be the slowest rank's busy time / (1 - bubble) plus the
    fill and drain's sends, each rank's idle time in it at least busy x bubble / (1 - bubble), and
    the parts add up to the step."""
    _, run, plans, timing = timed("llama3-8b", (2, 8, 1, 4), 8, schedule=schedule, virtual=virtual,
                                  sequence_parallel=True)
    bubble, busy, parts = full_train.pipeline.bubble_formula(schedule, 8, 8, virtual), timing["busy"], timing["parts"]
    assert timing["bubble"] == bubble > 0.2 and len(busy) == len(plans) == 8
    assert timing["span"] == pytest.approx(max(busy) / (1 - bubble) + parts["PP"], rel=1e-12)
    assert parts["bubble"] >= max(busy) * bubble / (1 - bubble) * (1 - 1e-12)
    assert sum(parts.values()) == pytest.approx(timing["step"], rel=1e-12)
    assert timing["overlap"] <= timing["step"] <= timing["no_overlap"]


def test_the_prediction_moves_the_right_way_when_one_input_changes():
    """More tp: more exposed TP time (each rank sends (t-1)/t of the same activations); more
    microbatches: a smaller bubble; a slower network: a slower step, the GEMMs unchanged."""
    tp_seconds = [timed("llama3-70b", (4, 4, 1, tp), recompute="full", sequence_parallel=True)[3]["parts"]["TP"]
                  for tp in (2, 4, 8)]
    assert 0 < tp_seconds[0] < tp_seconds[1] < tp_seconds[2]
    bubbles = [timed("llama3-70b", (4, 8, 1, 8), m, recompute="full")[3] for m in (8, 32, 128)]
    assert [t["parts"]["bubble"] for t in bubbles] == sorted((t["parts"]["bubble"] for t in bubbles), reverse=True)
    assert bubbles[0]["parts"]["bubble"] > 3 * bubbles[2]["parts"]["bubble"] > 0
    cfg, (sizes, run, plans, fast) = preset("llama3-70b"), timed("llama3-70b", (16, 4, 1, 4), recompute="full")
    slow = planner.step_time(cfg, sizes, run, plans, planner.Cluster(network_gbps=12.5))
    assert slow["parts"]["GEMMs"] == fast["parts"]["GEMMs"] and slow["step"] > fast["step"]
    assert slow["parts"]["DP"] > fast["parts"]["DP"] and slow["parts"]["PP"] > fast["parts"]["PP"]



def test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node():
    """Every mesh of sizes 1-3 and every kind of group, on nodes of each size that divides the world
    (and of twice the world): inside_node is true iff each group, derived here from the grid of ranks
    (tp fastest: rank = ((d pp + p) cp + c) tp + t), has its ranks on one node. A block that merely
    fits in a node (not aligned to it), or one of the group's own sizes only, fails here."""
    for shape in itertools.product((1, 2, 3), repeat=len(full_train.DIMS)):
        world, grid = math.prod(shape), torch.arange(math.prod(shape)).reshape(shape)
        for kind, dims in full_train.GROUP_DIMS.items():
            moving = [full_train.DIMS.index(d) for d in dims]
            held = [axis for axis in range(len(shape)) if axis not in moving]
            groups = grid.permute(*held, *moving).reshape(-1, math.prod(shape[axis] for axis in moving))
            for per_node in [g for g in range(1, world + 1) if world % g == 0] + [2 * world]:
                expected = bool((groups // per_node == groups[:, :1] // per_node).all())
                assert planner.inside_node(full_train.MeshSizes(*shape), kind, per_node) == expected, (
                    f"dp, pp, cp, tp = {shape}, nodes of {per_node}: {kind} groups inside a node: {expected}")


@given(busy=st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=8), bubble=st.floats(0.0, 0.9),
       boundary=st.floats(1e-6, 1e-2), pp=st.integers(1, 8), microbatches=st.integers(1, 16),
       virtual=st.integers(1, 3), hide=st.booleans())
@example(busy=[1.0], bubble=0.0, boundary=1e-3, pp=1, microbatches=2, virtual=2, hide=False)
def test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain(
        busy, bubble, boundary, pp, microbatches, virtual, hide):
    """Outside the fill and drain's sends, the slowest rank is busy max(busy) and idle the bubble's
    fraction of the span (04's bubble is that idle fraction; stretched by 1 + bubble, it would idle
    bubble / (1 + bubble)). The sends: with overlap, those the first forward and the last backward
    make (pp - 1 each); without, every microbatch's, both ways, at each of the pp x virtual - 1
    boundaries between consecutive stages; pp = 1 sends nothing (one rank holds its stages: the
    example). Tolerance: span - fill rounds off about 1e-16 x the fill (under 10 s), which the idle
    fraction divides by >= 1e-3 s."""
    span, fill = planner.pipeline_span(busy, bubble, boundary, pp, microbatches, virtual, hide)
    crossings = 0 if pp == 1 else 2 * (pp - 1) if hide else 2 * microbatches * (pp * virtual - 1)
    assert fill == pytest.approx(crossings * boundary, rel=1e-12), f"fill: not {crossings} boundary sends"
    pipeline_seconds = span - fill
    idle = (pipeline_seconds - max(busy)) / pipeline_seconds
    assert idle == pytest.approx(bubble, rel=1e-9, abs=1e-9), f"idles {idle:.6g} of the span, not {bubble}"

# The README's table: label -> (preset, mesh (dp, pp, cp, tp), plan's options, the published figure:
# ms a step, tokens/s per GPU, or TFLOP/s per GPU as 09's flops_per_token counts them: PaLM's (Meta's
# MFU), for these models also Megatron's formula). Knobs not published, chosen a priori: one sequence
# per microbatch, Megatron's 1F1B, Llama 3's interleaving with v = 2 (torchtitan's default), SP with
# tp > 1, no recompute unless published; Meta's FSDP that keeps the parameters after forward as ZeRO-2,
# Megatron's distributed optimizer ZeRO-1, MPT's FULL_SHARD ZeRO-3.
LLAMA3_405B = dict(schedule="interleaved", virtual=2, zero_stage=2, sequence_parallel=True)
PUBLISHED = {
    "09 `1b`": ("1b", (1, 1, 1, 1), dict(microbatches=1, attention="flash"), (199.2, "ms")),
    "09 `1b`, SDPA": ("1b", (1, 1, 1, 1), dict(microbatches=1), (181.0, "ms")),
    "09 `1b`, FP8": ("1b", (1, 1, 1, 1), dict(microbatches=1, attention="flash", fp8=True), (226.5, "ms")),
    "09 `2b`": ("2b", (1, 1, 1, 1), dict(microbatches=1, attention="flash"), (345.8, "ms")),
    "09 `2b`, FP8": ("2b", (1, 1, 1, 1), dict(microbatches=1, attention="flash", fp8=True), (305.4, "ms")),
    "Llama 3 405B": ("llama3-405b", (64, 16, 1, 8), LLAMA3_405B, (430, "TFLOP/s")),
    "Llama 3 405B, 16,384 GPUs": ("llama3-405b", (128, 16, 1, 8), LLAMA3_405B, (400, "TFLOP/s")),
    "Llama 3 405B, 131k tokens": ("llama3-405b", (8, 16, 16, 8), dict(LLAMA3_405B, seq_len=131_072, global_batch=128),
                                  (380, "TFLOP/s")),
    **{f"Megatron-Core {size.upper()}": (f"megatron-{size}", (48, pp, 1, tp), dict(zero_stage=1, sequence_parallel=tp > 1),
                                         (tflops, "TFLOP/s")) for size, pp, tp, tflops in (
        ("1.7b", 1, 1, 408.8), ("7.1b", 1, 2, 465.9), ("16b", 1, 4, 489.1), ("32b", 1, 8, 459.6), ("70b", 2, 8, 419.7),
        ("119b", 4, 8, 420.5), ("177b", 6, 8, 432.8), ("314b", 8, 8, 474.4), ("462b", 16, 8, 459.9))},
    "MPT-1B": ("mpt-1b", (8, 1, 1, 1), dict(microbatches=1, zero_stage=3), (45_455, "tokens/s")),
    "MPT-7B": ("mpt-7b", (8, 1, 1, 1), dict(microbatches=1, zero_stage=3), (10_643, "tokens/s")),
    "MPT-70B": ("mpt-70b", (512, 1, 1, 1), dict(microbatches=1, zero_stage=3, recompute="full"), (1_007, "tokens/s")),
}


def published_and_predicted(label: str) -> tuple[float, dict]:
    """The published run's step in seconds (from its figure) and plan's step time for its mesh."""
    model, mesh, options, (figure, unit) = PUBLISHED[label]
    sizes, run, _, timing = timed(model, mesh, **options)
    tokens_per_gpu = run.global_batch * run.seq_len / sizes.world
    per_second = {"ms": 1e3 / figure, "tokens/s": figure / tokens_per_gpu,
                  "TFLOP/s": figure * 1e12 / (tokens_per_gpu * full_train.flops_per_token(preset(model), run.seq_len))}
    return 1 / per_second[unit], timing


def test_the_1b_run_measured_on_one_h100_is_predicted_within_15_percent():
    """README, "On a GPU": the 1b preset on one H100, 8 x 2,048 tokens in one microbatch, ZeRO-1
    over one rank, compiled. With SDPA: 181.0 ms a step. With 07's kernel 196-199 ms, of which the
    profile found the GPU busy 190.5 ms (forward 50.8, backward 120.3, sync 2.2, optimizer 17.2) and
    idle 24.3 while the CPU launched the graph-broken blocks, which the model does not price: it is
    held to the GPU's 190.5 ms (the step is 17-18% above it). cuBLAS's GEMMs took 104.6 ms a step."""
    for label, measured in (("09 `1b`, SDPA", 0.181), ("09 `1b`", 0.1905)):
        timing = published_and_predicted(label)[1]
        assert abs(timing["step"] / measured - 1) <= 0.15, (label, timing["step"])
        assert abs(timing["parts"]["GEMMs"] / 0.1046 - 1) <= 0.15


def test_llama3_405b_on_8192_gpus_is_predicted_within_15_percent():
    """Meta's Llama 3 paper, Table 4, row 1: tp 8, pp 16, dp 64 on 8,192 H100s, 2,048 sequences of
    8,192 tokens; 430 TFLOP/s per GPU as PaLM counts them (43% MFU). The knobs the paper leaves out
    are PUBLISHED's a priori choices (interleaved with v = 2, one sequence per microbatch)."""
    published, timing = published_and_predicted("Llama 3 405B")
    assert abs(timing["step"] / published - 1) <= 0.15, (timing["step"], published)


def test_the_readmes_table_of_published_runs_is_what_plan_predicts():
    """Every row of README's planning table: its mesh, its published step and plan's, the error."""
    text = (ROOT / "README.md").read_text()
    for label, (_, mesh, _, (figure, unit)) in PUBLISHED.items():
        row = re.search(rf"\n\| {re.escape(label)} \| (.*) \|\n", text)
        assert row, label
        published, timing = published_and_predicted(label)
        error = round(100 * (timing["step"] / published - 1))
        assert row[1].split(" | ") == ["·".join(map(str, mesh)), f"{figure:,} {unit}",
                                       f"{published:#.3g} / {timing['step']:#.3g} s", f"{error:+d}%"], label


PLAN_OPTIONS = {"--dp", "--pp", "--cp", "--tp", "--ep", "--moe", "--experts", "--zero", "--schedule",
                "--microbatches", "--virtual", "--sequence-parallel", "--fp8", "--recompute", "--kv-heads",
                "--global-batch", "--seq-len", "--model", "--gpus", "--gpus-per-node", "--gpu-memory",
                "--peak-tflops", "--hbm-tbps", "--nvlink-gbps", "--network-gbps", "--attention"}


def test_the_planner_offers_the_meshs_and_clusters_options_and_says_what_decides_the_rest(
        monkeypatch, capsys):
    """09's fields that name plan, and Cluster's, each once with one default; the mesh sizes left
    out are searched, the microbatches one sequence each: --help says so."""
    monkeypatch.setenv("COLUMNS", "200")
    code, text, _ = plan_main(monkeypatch, capsys, "--help")
    options = {option.split()[0].rstrip(","): option for option in re.split(r"\n  (?=-)", text)[1:]}
    assert code == 0 and options.keys() == PLAN_OPTIONS | {"-h"} and "(default: None)" not in text
    assert all(option.count("default") <= 1 and len(option.split()) > 2 for option in options.values())
    assert all("(default: searched)" in options[f"--{d}"] for d in full_train.DIMS)
    assert "(default: global_batch / dp: one sequence each)" in options["--microbatches"]


def test_published_presets_are_the_planners_and_09_trains_its_own():
    """A published model's vocabulary needs a tokenizer (bytes are 09's tokens): 09 trains its own
    presets, which 10 plans too, and 10 alone has the published ones."""
    assert full_train.MODELS.items() <= planner.PRESETS.items()
    assert all("vocab_size" not in config for config, *_ in full_train.MODELS.values())
    published = planner.PRESETS.keys() - full_train.MODELS.keys()
    assert published and all("vocab_size" in planner.PRESETS[name][0] for name in published)
