"""Lesson 04 as a specification: schedules are valid programs, and every schedule trains exactly
like one device.

Tolerances (fp32 on CPU), those of test_01_ddp.py, measured here again:
- loss per step: atol 1e-5. The pipeline sums m microbatch losses / m, the reference takes one mean:
  the same sum in another order; measured <= 7.2e-7 over 30 random configurations of the kind drawn
  below (p 2-4, every schedule, m 1-8, 3 steps).
- gradients of the first step: atol 1e-6 + rtol 1e-4. Each is a sum of m microbatch gradients instead
  of one batch gradient; measured <= 1.2e-7 absolute over the same 30. Forgetting the 1/m makes
  every gradient m times too large (>= 100% off for m >= 2); a wrong stage cut, a microbatch sent to
  the wrong stage or a missing W is off by the gradient itself.
- parameters after 3 AdamW steps (eps raised to 1e-6, see test_01_ddp.py): atol 1e-5; measured
  <= 4.2e-7. Any real bug moves parameters by ~lr = 1e-3.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import re
import weakref
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import run_script

foundation = importlib.import_module("01_ddp")
pipeline = importlib.import_module("04_pipeline")

LOSS_ATOL, GRAD_ATOL, GRAD_RTOL, PARAM_ATOL, ADAM_EPS = 1e-5, 1e-6, 1e-4, 1e-5, 1e-6


@st.composite
def schedule_specs(draw, max_pp: int = 5) -> tuple[str, int, int, int]:
    """(name, pp, microbatches, virtual): make_schedule's arguments. Examples are these, not
    schedules, so that no schedule is made while the file is imported."""
    name = draw(st.sampled_from(pipeline.SCHEDULES))
    pp = draw(st.integers(1, max_pp))
    if name == "interleaved":
        virtual, m = draw(st.integers(1, 3)), pp * draw(st.integers(1, 3))
    else:
        virtual, m = 1, draw(st.integers(1, 10))
    return name, pp, m, virtual


# --- schedules as data ------------------------------------------------------------------------

def payload(action: "pipeline.Action") -> tuple[str, int, int]:
    """What a transfer carries, named by the stage that receives it."""
    if action.kind == "SEND_F":
        return "act", action.stage + 1, action.microbatch
    if action.kind == "SEND_B":
        return "grad", action.stage - 1, action.microbatch
    return ("act" if action.kind == "RECV_F" else "grad"), action.stage, action.microbatch


def run_with_rendezvous(plan: "pipeline.Schedule") -> None:
    """Execute every rank's list in a model of the strictest point-to-point semantics: a compute
    action needs its input (computed here, or received), and a batch of consecutive transfers is
    posted at once and completes only when the peer of every transfer in it has posted the matching
    one (the k-th send from a to b matches the k-th receive on b from a). Asserts that the matched
    transfers carry the same data and that every rank reaches the end of its list."""
    pp, last = plan.pp, plan.n_stages - 1
    position, done, have = [0] * pp, set(), [set() for _ in range(pp)]
    posted = defaultdict(list)        # (src, dst, "send" | "recv") -> payloads in posting order
    waiting: dict[int, list] = {}     # rank -> its posted batch: (channel key, index, action)

    def ready(rank: int, a) -> bool:
        here = lambda s: s % pp == rank  # noqa: E731
        if a.kind == "F":
            return a.stage == 0 or (("F", a.stage - 1, a.microbatch) in done if here(a.stage - 1)
                                    else ("act", a.stage, a.microbatch) in have[rank])
        if a.kind == "B":
            upstream = a.stage == last or (("B", a.stage + 1, a.microbatch) in done if here(a.stage + 1)
                                           else ("grad", a.stage, a.microbatch) in have[rank])
            return ("F", a.stage, a.microbatch) in done and upstream
        return ("B", a.stage, a.microbatch) in done

    while any(position[r] < len(plan.actions[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            actions = plan.actions[r]
            if r in waiting:
                ops = waiting[r]
                other = {"send": "recv", "recv": "send"}
                if all(len(posted[(src, dst, other[kind])]) > i for (src, dst, kind), i, _ in ops):
                    for (src, dst, kind), i, a in ops:
                        assert posted[(src, dst, "send")][i] == posted[(src, dst, "recv")][i], \
                            f"transfer {i} from rank {src} to {dst} carries different data on both ends"
                        if kind == "recv":
                            have[r].add(payload(a))
                    del waiting[r]
                    progressed = True
                continue
            if position[r] == len(actions):
                continue
            a = actions[position[r]]
            if a.kind in pipeline.COMPUTE:
                if ready(r, a):
                    done.add((a.kind, a.stage, a.microbatch))
                    position[r] += 1
                    progressed = True
                continue
            ops = []
            while position[r] < len(actions) and actions[position[r]].kind not in pipeline.COMPUTE:
                a = actions[position[r]]
                position[r] += 1
                if a.kind in pipeline.SEND:
                    produced = ("F" if a.kind == "SEND_F" else "B", a.stage, a.microbatch)
                    assert produced in done, f"rank {r} sends {a} before computing it"
                    key = (r, a.peer, "send")
                else:
                    key = (a.peer, r, "recv")
                ops.append((key, len(posted[key]), a))
                posted[key].append(payload(a))
            waiting[r] = ops
            progressed = True
        assert progressed, f"deadlock: positions {position}, waiting ranks {sorted(waiting)}"
    assert not waiting
    for key in [k for k in posted if k[2] == "send"]:
        assert posted[key] == posted[(key[0], key[1], "recv")], f"unmatched transfers on {key[:2]}"


@given(spec=schedule_specs())
def test_schedules_are_complete_ordered_and_never_deadlock(spec):
    plan = pipeline.make_schedule(*spec)
    n_stages, m = plan.n_stages, plan.microbatches
    kinds = ("F", "B", "W") if plan.split_backward else ("F", "B")
    for rank, actions in enumerate(plan.actions):
        compute = [a for a in actions if a.kind in pipeline.COMPUTE]
        owned = range(rank, n_stages, plan.pp)
        assert sorted((a.kind, a.stage, a.microbatch) for a in compute) == \
            sorted((k, s, i) for k in kinds for s in owned for i in range(m)), "each action exactly once"
        place = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(compute)}
        for s in owned:
            for i in range(m):
                assert place[("F", s, i)] < place[("B", s, i)], "backward before its forward"
                if plan.split_backward:
                    assert place[("B", s, i)] < place[("W", s, i)], "weight gradient before B"
        # In-flight activations, counted from the list: the bound holds, and is reached.
        held = peak = weighted = weighted_peak = 0  # weighted: stage s holds s + 1 (unlike amounts)
        frees = "W" if plan.split_backward else "B"
        for a in compute:
            held += (a.kind == "F") - (a.kind == frees)
            weighted += (a.stage + 1) * ((a.kind == "F") - (a.kind == frees))
            peak, weighted_peak = max(peak, held), max(weighted_peak, weighted)
        assert peak == pipeline.in_flight_bound(plan.name, rank, plan.pp, m, plan.virtual)
        assert weighted_peak == pipeline.held_at_peak(plan.name, rank, plan.pp, m, plan.virtual, lambda s: s + 1)
    run_with_rendezvous(plan)


def test_the_rendezvous_model_catches_mismatches_and_deadlocks():
    plan = pipeline.make_schedule("1f1b", 3, 4)
    rank1 = plan.actions[1]
    first, second = [i for i, a in enumerate(rank1) if a.kind == "SEND_F"][:2]
    rank1[first], rank1[second] = rank1[second], rank1[first]
    with pytest.raises(AssertionError, match="before computing it"):
        run_with_rendezvous(plan)
    # Rank 0 waits for the first gradient before sending the second activation, which rank 1
    # needs before it can produce that gradient: a cycle.
    plan = pipeline.make_schedule("1f1b", 2, 2)
    assert [str(a) for a in plan.actions[0][:5]] == ["F0@s0", "SEND_F0@s0<->1", "F1@s0", "SEND_F1@s0<->1",
                                                    "RECV_B0@s0<->1"]
    plan.actions[0].insert(2, plan.actions[0].pop(4))
    with pytest.raises(AssertionError, match="deadlock"):
        run_with_rendezvous(plan)


def test_planned_bubble_equals_the_formula():
    """Every schedule schedule_specs draws from (195, made in a tenth of a second), not a sample: a formula
    goes wrong at a boundary (ZB-H1's changes at m = p - 1), which 5 draws missed in a workshop review."""
    for name, pp in itertools.product(pipeline.SCHEDULES, range(1, 6)):
        sizes = [(m, 1) for m in range(1, 11)]
        if name == "interleaved":  # v stages a rank: (p-1) / (v m + p - 1)
            sizes = [(pp * k, v) for k in (1, 2, 3) for v in (1, 2, 3)]
        for m, v in sizes:
            plan = pipeline.make_schedule(name, pp, m, v)
            step = max(end for _, end in plan.nominal.values())
            busy = sum(end - start for start, end in plan.nominal.values())
            bubble = pipeline.bubble_formula(name, pp, m, v)
            assert 1 - busy / (pp * step) == pytest.approx(bubble, abs=1e-12), (name, pp, m, v)


def test_schedule_shapes_on_a_known_case():
    """p = 2, m = 3, drawn by hand from the definitions in the module docstring."""
    def order(name: str, rank: int) -> list[str]:
        actions = pipeline.make_schedule(name, 2, 3).actions[rank]
        return [f"{a.kind}{a.microbatch}" for a in actions if a.kind in pipeline.COMPUTE]

    assert order("gpipe", 0) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert order("1f1b", 0) == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert order("1f1b", 1) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert order("zb-h1", 0) == ["F0", "F1", "B0", "W0", "F2", "B1", "W1", "B2", "W2"]
    assert order("zb-h1", 1) == ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]
    assert str(pipeline.make_schedule("1f1b", 2, 3)).splitlines() == [
        "rank 0 |F0F1. . B0--F2B1--. B2--|",
        "rank 1 |. F0B0--F1B1--F2B2--. . |"]


@given(n_layers=st.integers(1, 9), n_stages=st.integers(1, 9))
def test_stage_cut_is_balanced_and_covers_every_layer(n_layers, n_stages):
    assume(n_stages <= n_layers)
    cut = pipeline.stage_layers(n_layers, n_stages)
    assert [i for r in cut for i in r] == list(range(n_layers))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1
    sizes = [len(r) for r in cut]
    assert sizes == sorted(sizes, reverse=True), "the first stages take the remainder (the last has the head)"


@given(n_layers=st.integers(1, 40), n_stages=st.integers(1, 16))
def test_ends_as_layers_balances_the_embedding_and_the_head_as_a_layer_each(n_layers, n_stages):
    """Megatron's account_for_embedding/loss_in_pipeline_split: the stages' layers, with one more place on
    the first (the embedding) and the last (the head), are stage_layers' cut of n_layers + 2; refused
    where the first or last stage would hold no layer."""
    try:
        pipeline.validate_pipeline(n_layers, n_stages, 1, 1, "1f1b", 1, ends_as_layers=True)
    except ValueError as error:
        assert n_layers + 2 < 2 * n_stages or n_layers < n_stages, error
        return
    cut = pipeline.stage_layers(n_layers, n_stages, ends_as_layers=True)
    assert [i for r in cut for i in r] == list(range(n_layers)) and min(map(len, cut)) >= 1
    places = [len(r) + (s == 0) + (s == n_stages - 1) for s, r in enumerate(cut)]
    assert places == [len(r) for r in pipeline.stage_layers(n_layers + 2, n_stages)]


def test_cut_stage_keeps_the_layers_of_the_cut_it_is_given():
    """6 layers on 4 stages: 2 2 1 1 by default, 1 2 2 1 with the embedding and the head as layers."""
    cfg = foundation.ModelConfig(vocab_size=30, dim=8, n_heads=2, ffn_dim=16, n_layers=6)
    for ends_as_layers, expected in ((False, [[0, 1], [2, 3], [4], [5]]), (True, [[0], [1, 2], [3, 4], [5]])):
        kept = [sorted(int(i) for i in pipeline.cut_stage(foundation.GPT(cfg), s, 4, ends_as_layers).layers)
                for s in range(4)]
        assert kept == expected, (ends_as_layers, kept)


# --- every schedule trains like one device ----------------------------------------------------

def assert_matches_reference(runs, reference) -> None:
    """Every rank's loss, and the gradients and parameters of all ranks' stages put together."""
    grads, params = {}, {}
    for result, _, _ in runs:
        assert result.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
        assert not params.keys() & result.params.keys(), "a parameter lives on two ranks"
        grads.update(result.first_grads)
        params.update(result.params)
    assert grads.keys() == reference.first_grads.keys(), "every gradient lives on some rank"
    assert params.keys() == reference.params.keys(), "every parameter lives on some rank"
    for n, g in reference.first_grads.items():
        torch.testing.assert_close(grads[n], g, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda msg, n=n: f"gradient of {n}: {msg}")
    for n, p in reference.params.items():
        torch.testing.assert_close(params[n], p, atol=PARAM_ATOL, rtol=0,
                                   msg=lambda msg, n=n: f"parameter {n} after training: {msg}")


def check_against_single_device(rank_pool, pp, name, m, virtual, seed=0, per_micro=1, seq_len=5):
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=24, seed=seed,
                                 n_layers=pp * virtual + seed % 2)
    steps, batch = 3, m * per_micro
    runs = rank_pool.run(pp, pipeline.train_pipeline, cfg, steps, batch, seq_len, schedule=name,
                         microbatches=m, virtual=virtual, adam_eps=ADAM_EPS)
    reference = foundation.train_single_device(cfg, steps, batch, seq_len, adam_eps=ADAM_EPS)
    assert_matches_reference(runs, reference)
    # The meter: m activations forward over each stage boundary a rank's stage sends from, m
    # gradients back over each boundary it receives from; one microbatch is per_micro x seq x dim.
    boundary = batch * seq_len * cfg.dim * 4
    for rank, (_, meter, logs) in enumerate(runs):
        mine = range(rank, pp * virtual, pp)
        expected = sum((s < pp * virtual - 1) + (s > 0) for s in mine) * boundary * steps
        assert meter.traffic("send") == expected and meter.payload("recv") == expected
        # and each step's check of the stages (run_schedule: one all-reduce of a flag per stage)
        assert meter.calls() == meter.calls("send") + meter.calls("recv") + steps
        assert meter.traffic("all_reduce") == steps * Fraction(2 * (pp - 1), pp) * 4 * pp * virtual
        assert meter.traffic("all_reduce") == steps * pipeline.stage_trains_traffic(pp, virtual)
        plan = pipeline.make_schedule(name, pp, m, virtual)
        assert {log.peak_in_flight for log in logs} == {pipeline.in_flight_bound(name, rank, pp, m, virtual)}
        assert [r[:3] for r in logs[0].records] == \
            [(a.kind, a.stage, a.microbatch) for a in plan.actions[rank] if a.kind in pipeline.COMPUTE]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("name", pipeline.SCHEDULES)
def test_every_schedule_equals_single_device(rank_pool, pp, name):
    """Fewer microbatches than stages where the schedule allows it (interleaved needs m = k pp)."""
    if name == "interleaved":
        check_against_single_device(rank_pool, pp, name, m=pp, virtual=2)
    else:
        check_against_single_device(rank_pool, pp, name, m=pp - 1, virtual=1)


@given(pp=st.sampled_from([2, 3, 4]), name=st.sampled_from(pipeline.SCHEDULES), k=st.integers(1, 2),
       m=st.integers(1, 6), virtual=st.integers(1, 2), seed=st.integers(0, 99),
       per_micro=st.integers(1, 2), seq_len=st.integers(1, 6))
def test_pipeline_equals_single_device(rank_pool, pp, name, k, m, virtual, seed, per_micro, seq_len):
    if name == "interleaved":
        m = k * pp
    else:
        virtual = 1
    check_against_single_device(rank_pool, pp, name, m, virtual, seed, per_micro, seq_len)


def pipelines_on_subgroups(cfg, steps: int, batch: int, seq_len: int):
    """4 ranks: pipelines of two on {0, 2} and {1, 3}, then one-rank pipelines (every stage local).
    Nothing may assume the world group."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    singles = [dist.new_group([r]) for r in range(4)]
    common = dict(microbatches=2, adam_eps=ADAM_EPS)
    return (pipeline.train_pipeline(cfg, steps, batch, seq_len, schedule="zb-h1", group=pairs[rank % 2], **common),
            pipeline.train_pipeline(cfg, steps, batch, seq_len, schedule="interleaved", virtual=2,
                                    group=singles[rank], **common))


def test_pipelines_on_subgroups_and_on_one_rank(rank_pool):
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=24, n_layers=2, seed=7)
    runs = rank_pool.run(4, pipelines_on_subgroups, cfg, 2, 4, 5)
    reference = foundation.train_single_device(cfg, 2, 4, 5, adam_eps=ADAM_EPS)
    for members in ((0, 2), (1, 3)):
        grads = {n: g for r in members for n, g in runs[r][0][0].first_grads.items()}
        params = {n: p for r in members for n, p in runs[r][0][0].params.items()}
        for n, g in reference.first_grads.items():
            torch.testing.assert_close(grads[n], g, atol=GRAD_ATOL, rtol=GRAD_RTOL)
            torch.testing.assert_close(params[n], reference.params[n], atol=PARAM_ATOL, rtol=0)
        for r in members:
            assert {ranks for _, ranks in runs[r][0][1].stats} == {members}
    for rank, ((pair, _, _), (single, meter, _)) in enumerate(runs):
        assert pair.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
        assert single.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
        for n, g in reference.first_grads.items():
            torch.testing.assert_close(single.first_grads[n], g, atol=GRAD_ATOL, rtol=GRAD_RTOL)
            torch.testing.assert_close(single.params[n], reference.params[n], atol=PARAM_ATOL, rtol=0)
        assert meter.calls() == 0, f"rank {rank}: one rank owns every stage, nothing to send"


FROZEN = ("layers.0.attn.q_proj.weight", "lm_head.weight")  # on the first and on the last stage


def step_with_frozen_parameters(cfg, name: str, m: int, batch: int, seq_len: int) -> dict:
    """One step of the executor on stages with some parameters frozen: their .grad stays None."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    plan = pipeline.make_schedule(name, pp, m)
    stages = {rank: pipeline.cut_stage(foundation.GPT(cfg), rank, pp)}
    for n, p in stages[rank].named_parameters():
        p.requires_grad_(n not in FROZEN)
    tokens, targets = foundation.synthetic_batch(cfg, batch, seq_len, 0)
    pipeline.run_schedule(plan, stages, tokens, targets)
    return {n: p.grad for n, p in stages[rank].named_parameters()}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_frozen_parameters_get_no_gradient_and_the_rest_are_unchanged(rank_pool, name):
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=24, n_layers=2)
    grads = {}
    for per_rank in rank_pool.run(2, step_with_frozen_parameters, cfg, name, 2, 4, 5):
        grads.update(per_rank)
    reference = foundation.GPT(cfg)
    for n, p in reference.named_parameters():
        p.requires_grad_(n not in FROZEN)
    reference(*foundation.synthetic_batch(cfg, 4, 5, 0)).backward()
    for n, p in reference.named_parameters():
        if n in FROZEN:
            assert grads[n] is None, n
        else:
            torch.testing.assert_close(grads[n], p.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL)


def accumulations_before_the_last_backward(cfg, name: str, m: int, virtual: int) -> list[tuple]:
    """(stage, microbatches whose weight gradient had accumulated when before_last_backward(stage) was
    called, how many had at the end), counted by a post-accumulate hook (what ZeRO's reduction waits for)."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    plan = pipeline.make_schedule(name, pp, m, virtual)
    stages = {s: pipeline.cut_stage(foundation.GPT(cfg), s, pp * virtual) for s in range(rank, pp * virtual, pp)}
    counts = dict.fromkeys(stages, 0)
    for s, module in stages.items():
        weight = next(p for p in module.parameters())
        weight.register_post_accumulate_grad_hook(lambda p, s=s: counts.__setitem__(s, counts[s] + 1))
    calls = []
    pipeline.run_schedule(plan, stages, *foundation.synthetic_batch(cfg, 2 * m, 4, 0),
                          before_last_backward=lambda s: calls.append((s, counts[s])))
    return [(s, before, counts[s]) for s, before in calls]


@pytest.mark.parametrize("name, virtual", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1)])
def test_before_last_backward_comes_once_a_stage_before_its_last_weight_gradient(rank_pool, name, virtual):
    """Where 09 lets ZeRO reduce a stage's gradients: once per stage, when m - 1 microbatches' weight
    gradients have accumulated and the last is about to (ZB-H1: its W, whose hooks fire as B's would)."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=1, ffn_dim=8, n_layers=4)
    for rank, calls in enumerate(rank_pool.run(2, accumulations_before_the_last_backward, cfg, name, 4, virtual)):
        assert sorted(calls) == [(s, 3, 4) for s in range(rank, 2 * virtual, 2)], calls


def sends_held_at_most(schedule: "pipeline.Schedule", rank: int) -> int:
    """The most sends run_schedule holds at once on rank, walking its actions: each send held from its
    transfer until a compute reads a message send_receipts says proves it received."""
    receipts = pipeline.send_receipts(schedule, rank)
    held = set()
    most = 0
    for a in schedule.actions[rank]:
        if a.kind in pipeline.SEND:
            held.add(pipeline.mailbox_key(a))
            most = max(most, len(held))
        elif a.kind in pipeline.COMPUTE:
            held -= set(receipts.get((a.kind, a.stage, a.microbatch), ()))
    return most


@pytest.mark.parametrize("name", pipeline.SCHEDULES)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_a_sends_receipt_comes_from_its_peer_after_it_read_the_send(name, pp):
    """send_receipts on every schedule, pp 2-4: each proving message comes from the send's peer, which
    sends it after its compute that read ours (so waiting for the send then returns at once), and is one
    this rank receives. With them the sends held at once do not grow with m (2pp and 4pp microbatches),
    but in GPipe, whose m forwards all come first: m, its own in-flight bound. (A review's mutants that
    took a reply from any peer, or searched from the peer's receive, passed the 2-rank run test.)"""
    virtual = 2 if name == "interleaved" else 1
    most = []
    for m in (2 * pp, 4 * pp):
        schedule = pipeline.make_schedule(name, pp, m, virtual)
        for rank in range(pp):
            received = {pipeline.mailbox_key(a): a.peer for a in schedule.actions[rank] if a.kind.startswith("RECV")}
            sends = {pipeline.mailbox_key(a): a for a in schedule.actions[rank] if a.kind in pipeline.SEND}
            for reply, proved in pipeline.send_receipts(schedule, rank).items():
                peer_actions = schedule.actions[received[reply]]
                sent_back = next(i for i, a in enumerate(peer_actions) if a.kind in pipeline.SEND
                                 and pipeline.mailbox_key(a) == reply)
                for key in proved:
                    assert sends[key].peer == received[reply]
                    assert peer_actions.index(pipeline.Action(*key)) < sent_back, (rank, reply, key)
        most.append([sends_held_at_most(schedule, rank) for rank in range(pp)])
    if name == "gpipe":
        assert most == [[2 * pp] * pp, [4 * pp] * pp]
    else:
        assert most[0] == most[1], most


def sends_held_at_each_backward(cfg, name: str, m: int, virtual: int) -> list[int]:
    """A schedule on 2 ranks, on this rank: how many of the tensors it sent were still alive (weakly
    referenced) as each of its backwards made a weight gradient (a parameter's hook, once a microbatch)."""
    rank = dist.get_rank()
    stages = {s: pipeline.cut_stage(foundation.GPT(cfg), s, 2 * virtual) for s in range(rank, 2 * virtual, 2)}
    sent = []
    batch_p2p = foundation.batch_p2p

    def recording(ops, group=None):
        sent.extend(weakref.ref(tensor) for kind, tensor, _ in ops if kind == "send")
        return batch_p2p(ops, group)

    held = []
    for stage in stages.values():
        next(stage.parameters()).register_hook(lambda grad: held.append(sum(ref() is not None for ref in sent)))
    foundation.batch_p2p = recording
    try:
        pipeline.run_schedule(pipeline.make_schedule(name, 2, m, virtual), stages,
                              *foundation.synthetic_batch(cfg, m, 4, 0))
    finally:
        foundation.batch_p2p = batch_p2p
    return held


@pytest.mark.parametrize("name, virtual", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_a_send_is_let_go_once_proved_received_so_memory_does_not_grow_with_m(rank_pool, name, virtual):
    """1F1B's promise: rank r holds p - r microbatches, whatever m. The executor kept every sent tensor
    until the step's end, so rank 0 held all the outputs it had sent (8 at its last backward, m = 8) and
    rank 1 all its input gradients. Now a send goes once a later message of its peer proves it received
    (send_receipts): the most held at a backward is the same at m = 8 and m = 16, and under 8."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=1, ffn_dim=8, n_layers=2 * virtual)
    most = []
    for m in (8, 16):
        runs = rank_pool.run(2, sends_held_at_each_backward, cfg, name, m, virtual)
        assert all(len(held) == m * virtual for held in runs), runs
        most.append([max(held) for held in runs])
    assert most[0] == most[1] and max(most[0]) < 8, most


def run_a_schedule_that_says_every_stage_trains(cfg, name: str) -> None:
    """Stage 0 frozen, the schedule made without trains= (every stage trains): rank 0 alone can see
    the mismatch, rank 1's stage matches."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    stages = {rank: freeze_stages(foundation.GPT(cfg), (0,), pp) if rank == 0 else foundation.GPT(cfg)}
    stages = {s: pipeline.cut_stage(model, s, pp) for s, model in stages.items()}
    pipeline.run_schedule(pipeline.make_schedule(name, pp, 2), stages, *foundation.synthetic_batch(cfg, 2, 4, 0))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_schedule_that_does_not_match_the_stages_fails_on_every_rank(rank_pool, name):
    """Before: rank 0 raised, and rank 1, already inside the step's first collective, died with
    'Connection closed by peer' (or hung until the timeout)."""
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=1, ffn_dim=8, n_layers=2)
    rank_pool.expect_invalid(2, run_a_schedule_that_says_every_stage_trains, cfg, name,
                             match=r"stage 0 \(rank 0\) is frozen, but the schedule's trains\[0\]=True: make "
                                   r"the schedule with stage_trains\(\)")


def freeze_stages(model, frozen: tuple[int, ...], n_stages: int):
    """Freeze every parameter of the given stages of the cut pipeline.cut_stage makes."""
    cut = pipeline.stage_layers(model.cfg.n_layers, n_stages)
    modules = [model.layers[str(i)] for s in frozen for i in cut[s]]
    modules += [model.embed] * (0 in frozen) + [model.norm, model.lm_head] * (n_stages - 1 in frozen)
    for module in modules:
        module.requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", [(0,), (1,), (0, 1)])
@pytest.mark.parametrize("name", pipeline.SCHEDULES)
def test_a_fully_frozen_stage_trains_the_rest_as_on_one_device(rank_pool, name, frozen):
    """Before: a frozen first stage raised 'element 0 of tensors does not require grad' (ZB-H1: 'inputs
    to grad() cannot be empty' for a middle one) and its peers died. Now a frozen stage sends its
    input gradient back only if a stage before it trains, and computes no weight gradient."""
    pp, virtual, m = (2, 2, 2) if name == "interleaved" else (3, 1, 3)
    n_stages = pp * virtual
    cfg = foundation.ModelConfig(vocab_size=32, dim=16, n_heads=2, ffn_dim=24, n_layers=n_stages)
    freeze = functools.partial(freeze_stages, frozen=frozen, n_stages=n_stages)
    runs = rank_pool.run(pp, pipeline.train_pipeline, cfg, 3, m, 4, schedule=name, microbatches=m,
                         virtual=virtual, adam_eps=ADAM_EPS, transform=freeze)
    reference = foundation.train_single_device(cfg, 3, m, 4, adam_eps=ADAM_EPS, transform=freeze)
    assert_matches_reference(runs, reference)
    boundary = m * 4 * cfg.dim * 4  # one step's activations (or gradients) over one stage boundary
    for rank, (_, meter, _) in enumerate(runs):
        sends = sum((s < n_stages - 1) + (s > 0 and any(t not in frozen for t in range(s)))
                    for s in range(rank, n_stages, pp))
        assert meter.traffic("send") == 3 * sends * boundary, f"rank {rank}: a gradient nobody needs"


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_layers=2, pp=2, virtual=2, schedule="interleaved", m=2),
     r"n_layers=2 cannot fill pp x virtual = 2 x 2 = 4 stages"),
    (dict(n_layers=1, pp=2, virtual=1, schedule="1f1b", m=2), r"n_layers=1 cannot fill"),
    (dict(n_layers=4, pp=2, virtual=2, schedule="interleaved", m=3, batch=6),
     r"microbatches=3 is not a multiple of pp=2"),
    (dict(n_layers=2, pp=2, virtual=1, schedule="gpipe", m=4, batch=6),
     r"global_batch=6 is not divisible by microbatches=4"),
    (dict(n_layers=4, pp=2, virtual=2, schedule="1f1b", m=2), r"virtual=2 stages per rank needs"),
    (dict(n_layers=2, pp=2, virtual=1, schedule="zb-h2", m=2), r"schedule='zb-h2' must be one of"),
    (dict(n_layers=2, pp=2, virtual=1, schedule="gpipe", m=0), r"must all be >= 1"),
])
def test_bad_configuration_fails_on_every_rank_without_hanging(rank_pool, kwargs, message):
    cfg = foundation.ModelConfig(vocab_size=16, dim=8, n_heads=1, ffn_dim=8, n_layers=kwargs["n_layers"])
    rank_pool.expect_invalid(kwargs["pp"], pipeline.train_pipeline, cfg, 1, kwargs.get("batch", 4), 3,
                             schedule=kwargs["schedule"], microbatches=kwargs["m"],
                             virtual=kwargs["virtual"], match=message)


# --- measured timelines -----------------------------------------------------------------------

def test_measured_timeline_drawing_bubble_and_trace():
    """Two ranks, made-up records: rank 0 busy 0-2 (F) and 3-4 (b, a later chunk), rank 1 1-4."""
    records = [[("F", 0, 0, 0.0, 2.0), ("B", 2, 0, 3.0, 4.0)], [("F", 1, 0, 1.0, 4.0)]]
    assert pipeline.measured_bubble(records) == pytest.approx(1 - 6 / 8)
    assert pipeline.draw_measured(records, pp=2, width=8).splitlines() == ["rank 0 |FFFF..bb|",
                                                                           "rank 1 |..FFFFFF|"]
    events = json.loads(json.dumps(pipeline.trace_events("1f1b", 3, records)))
    slices = [e for e in events if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["ts"], e["dur"]) for e in slices] == \
        [(0, "F0", 0.0, 2e6), (0, "B0", 3e6, 1e6), (1, "F0", 1e6, 3e6)]
    assert {e["pid"] for e in events} == {3}


def test_script_runs_as_plain_python(tmp_path):
    """The launcher end to end on 2 CPU ranks: differences printed small, bytes = formula, one
    measured timeline per schedule, and a trace file that parses."""
    trace = tmp_path / "trace.json"
    stdout = run_script("04_pipeline.py", "--nproc", "2", "--steps", "2", "--global-batch", "4",
                        "--seq-len", "4", "--microbatches", "2", "--unit-ms", "5", "--trace",
                        str(trace))
    rows = re.findall(r"^(\S+)(?: v=\d)?\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d,]+), ([\d,]+)$",
                      stdout, re.M)
    assert [r[0] for r in rows] == list(pipeline.SCHEDULES), stdout
    assert "B3-- = its backward" in stdout and re.search(r"load average [\d.]+ over the last minute", stdout)
    for _, *diffs, sent0, sent1 in rows:  # the demo keeps Adam's default eps: 10x more room
        assert float(diffs[0]) <= LOSS_ATOL, stdout
        assert float(diffs[1]) <= GRAD_ATOL and float(diffs[2]) <= 10 * PARAM_ATOL, stdout
    assert len(re.findall(r"bubble measured [\d.]+, formula [\d.]+", stdout)) == 4, stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}


def test_script_on_one_rank_sends_nothing_and_its_formula_says_so():
    """--nproc 1, as a reader without a second process might try: one rank holds every stage, so no
    byte is sent. Before, the interleaved row printed '0 (formula 262,144)': its two stages' boundary,
    local on one rank, was counted as sent."""
    stdout = run_script("04_pipeline.py", "--nproc", "1", "--steps", "1", "--global-batch", "2",
                        "--seq-len", "4", "--microbatches", "2", "--unit-ms", "0")
    rows = re.findall(r"^(\S+)(?: v=\d)?\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)   (.*)$", stdout, re.M)
    assert [(name, sent) for name, *_, sent in rows] == [(name, "0") for name in pipeline.SCHEDULES], stdout
    assert all(float(loss) <= LOSS_ATOL and float(grad) <= GRAD_ATOL for _, loss, grad, *_ in rows), stdout
    assert "on 1 rank (" in stdout and len(re.findall(r"^rank 0 \|", stdout, re.M)) == 8, stdout


def test_fewer_microbatches_than_ranks_show_gpipes_bubble_and_leave_interleaved_out():
    """A new user's review: the demo refused --microbatches 1 on 2 ranks (interleaved needs a multiple of pp),
    so GPipe's bubble with m < p could not be seen. Now the other three run, equal to one device, bubble by
    its formula (p - 1) / (m + p - 1) = 1/2 for GPipe and 1F1B, and the demo says why interleaved did not.
    At --seq-len 1 it also says why the parameters part more than at 4 (01's lone_token_note)."""
    stdout = run_script("04_pipeline.py", "--nproc", "2", "--steps", "1", "--global-batch", "2",
                        "--seq-len", "1", "--microbatches", "1", "--unit-ms", "5")
    rows = re.findall(r"^(\S+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)   ", stdout, re.M)
    assert [r[0] for r in rows] == ["gpipe", "1f1b", "zb-h1"], stdout
    assert all(float(loss) <= LOSS_ATOL and float(grad) <= GRAD_ATOL for _, loss, grad, _ in rows), stdout
    assert "interleaved: not run, --microbatches 1 is not a multiple of pp=2" in stdout
    assert foundation.lone_token_note(1) in stdout
    formulas = re.findall(r"^(\S+), p=2, m=1, v=1: bubble measured [\d.]+, formula ([\d.]+)", stdout, re.M)
    assert [name for name, _ in formulas] == ["gpipe", "1f1b", "zb-h1"], stdout
    assert formulas[0][1] == formulas[1][1] == "0.500", stdout


def test_the_demo_runs_interleaved_where_m_is_a_multiple_of_pp_and_the_bench_always():
    """m = 4 on 4 ranks at v = 2 runs interleaved (its rule is m a multiple of pp, not of pp x v); m = 2
    leaves it out of the demo, not of --bench (torch's schedules beside ours, which keep the rule)."""
    runs = functools.partial(pipeline.schedule_runs, pp=4)
    assert ("interleaved", 2) in runs(argparse.Namespace(bench=False, microbatches=4, virtual=2))
    assert [name for name, _ in runs(argparse.Namespace(bench=False, microbatches=2, virtual=2))] == [
        "gpipe", "1f1b", "zb-h1"]
    assert len(runs(argparse.Namespace(bench=True, microbatches=2, virtual=2))) == 4


@pytest.mark.parametrize("options, message", [
    (["--trace", "{tmp}/missing/t.json"], "its folder does not exist"),
    (["--trace", "{tmp}"], "is a folder: name a file in it"),
    (["--trace", "/proc/self/t.json"], "cannot be written"),  # even by root
    (["--trace", "{tmp}/mine.json"], "mine.json exists: name a new file (a run overwrites none it did not make)"),
    (["--trace", ""], "--trace needs a file name, not an empty one"),  # before: no trace, and not a word
    (["--unit-ms", "nan"], "--unit-ms must be >= 0, not nan"),  # the rules beside the option
    (["--unit-ms", "inf"], "--unit-ms must be <= 1000, not inf"),
    (["--unit-ms", "-1"], "--unit-ms must be >= 0, not -1.0"),
    (["--unit-ms", "1e9"], "--unit-ms must be <= 1000, not 1000000000.0"),
])
def test_options_that_would_fail_late_are_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path,
                                                                         options, message):
    """Before: a missing folder, a folder or an unwritable path as --trace ran the whole demo, then
    every rank's traceback; --unit-ms nan printed 'F = nan ms', inf ended in an OverflowError; a user's
    file as --trace was overwritten at the end."""
    (tmp_path / "mine.json").write_text("a user's trace")
    options = [o.format(tmp=tmp_path) for o in options]
    monkeypatch.setattr("sys.argv", ["04_pipeline.py", "--nproc", "2", *options])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    with pytest.raises(SystemExit) as exit_:
        pipeline.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == [tmp_path / "mine.json"], "the check leaves nothing behind"
    assert (tmp_path / "mine.json").read_text() == "a user's trace"


def test_a_file_made_at_the_trace_path_during_the_run_is_left_as_it_is(tmp_path, capsys):
    """--trace is checked free before the run (check_writable), written after it: a file someone made
    there meanwhile was overwritten (an edge hunt's run: a user's file became the trace). 04 and 09 write
    through write_new, which refuses to replace it and says so."""
    path = tmp_path / "t.json"
    pipeline.check_writable("--trace", str(path))
    assert not path.exists()
    path.write_text("a user's file")
    assert not pipeline.write_new("--trace", str(path), "the trace")
    assert path.read_text() == "a user's file"
    assert f"--trace {path} was made by something else during the run" in capsys.readouterr().err
    fresh = tmp_path / "fresh.json"
    assert pipeline.write_new("--trace", str(fresh), "the trace") and fresh.read_text() == "the trace"


@pytest.mark.parametrize("change, message", [
    ("tie", r"embed\.weight is shared by stages \[0, 1\] \(tied weights\)"),
    ("root", r"logit_scale is registered outside embed, layers, norm and lm_head"),
])
def test_a_parameter_no_single_stage_owns_is_refused(change, message):
    """A tied embedding and LM head on the first and last stages, or a parameter on the model
    itself, would be two independent copies training apart: refused by cut_stage (so before any
    collective, on every rank alike); with one stage there is nothing to split."""
    def model():
        gpt = foundation.GPT(foundation.ModelConfig(vocab_size=16, dim=16, n_heads=2, ffn_dim=16, n_layers=2))
        if change == "tie":
            gpt.lm_head.weight = gpt.embed.weight
        else:
            gpt.logit_scale = torch.nn.Parameter(torch.ones(()))
        return gpt
    with pytest.raises(ValueError, match=message):
        pipeline.cut_stage(model(), 0, 2)
    assert pipeline.cut_stage(model(), 0, 1).embed is not None
