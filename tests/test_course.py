"""The course as a whole: what every lesson must do, read from their sources or run through their
main() up to the launch (no rank starts), and the multi-rank harness the lessons' tests stand on."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, RankFailure, run_script

foundation = importlib.import_module("01_ddp")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
NINE = ("01_ddp", "02_zero", "03_tensor_parallel", "04_pipeline", "05_context_parallel", "06_expert_parallel",
        "07_flash_attention", "08_fp8", "09_full_train")
LESSONS = [ROOT / f"{name}.py" for name in NINE]
MAX_LINE = 110

# --- every lesson's main(): one line before any rank starts -------------------------------------

# Imported now, at collection: lessons 07 and 08 import triton, which must come after 01_ddp's
# interpreter switch (an AdamW step in an earlier test would import it first).
LESSON_MODULES = {name: importlib.import_module(name) for name in NINE}
ONE_PROCESS = {"07_flash_attention": "--seq", "08_fp8": "--steps"}  # no --nproc: an option to break


def test_the_course_is_its_nine_scripts():
    """The brief's nine scripts and no other: a lesson that grows gets sections and a map, never a
    second file (DESIGN.md, Layout)."""
    assert sorted(path.name for path in ROOT.glob("*.py")) == [f"{name}.py" for name in NINE]


@pytest.mark.parametrize("script, command, message", [
    ("02_zero", [], "--global-batch 16 is not divisible by the 3 ranks"),
    ("03_tensor_parallel", [], "--seq-len 32 is not divisible by the 3 ranks"),
    ("04_pipeline", ["--bench"], "--microbatches 8 is not a multiple of pp=3"),  # the demo leaves interleaved out
    ("05_context_parallel", [], "--seq-len 64 is not divisible by 2 x cp = 6"),
    ("05_context_parallel", ["--seq-len", "66", "--work-seq-len", "100"],  # it named seq_len, not the option
     "--work-seq-len 100 is not divisible by 2 x cp = 6"),
    ("05_context_parallel", ["--seq-len", "66", "--work-seq-len", "66", "--heads", "4", "--kv-heads", "3"],
     "--heads 4 is not divisible by --kv-heads 3"),  # its rule's n_heads, said as the option (aliases)
    ("06_expert_parallel", [], "--experts 8 is not divisible by the 3 ranks"),
    ("08_fp8", ["distributed"], "--seq-len 64 is not divisible by the 3 ranks"),
])
def test_every_lesson_checks_the_world_that_will_run(monkeypatch, capsys, script, command, message):
    """Every lesson of several ranks ends its main() in launch_lesson: its defaults are checked against
    the 3 local ranks that would start, not a stray WORLD_SIZE=1, in one line before any rank starts."""
    lesson = LESSON_MODULES[script]
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *command, "--nproc", "3"])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    with pytest.raises(SystemExit) as exit_:
        lesson.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.match(rf"{script}\.py( distributed)?: error: .*{re.escape(message)}", err) and err.count("\n") == 1, err


@pytest.mark.parametrize("script, options, message", [
    ("01_ddp", ["--bench", "--steps", "2", "--global-batch", "3"],
     "--bench times a workload of its own and does not read --global-batch, --steps: drop them"),
    ("01_ddp", ["--bench-steps", "2"], "only --bench reads --bench-steps: drop it"),
    ("02_zero", ["--bench", "--max-grad-norm", "5"], "does not read --max-grad-norm: drop it"),  # it clips at 1
    ("03_tensor_parallel", ["--bench", "--batch", "3", "--seq-len", "7"], "does not read --batch, --seq-len"),
    ("04_pipeline", ["--bench", "--trace", "t.json"], "does not read --trace: drop it"),  # it wrote no file
    ("06_expert_parallel", ["--bench", "--dropless"], "does not read --dropless: drop it"),  # always dropless
    ("07_flash_attention", ["--bench-group", "2"], "only --bench reads --bench-group: drop it"),
    ("08_fp8", ["--eager"], "only --bench reads --eager: drop it"),
    ("04_pipeline", ["--bench", "--microbatches", "4", "--bench-rounds", "2", "--nproc", "2"], None),  # it reads
    ("06_expert_parallel", ["--bench", "--experts", "4", "--top-k", "1", "--bench-tokens", "64"], None),
])
def test_an_option_the_run_does_not_read_is_refused_not_ignored(monkeypatch, capsys, script, options, message):
    """--bench times a workload of its own (a review: 01 --bench --global-batch 3 ran its 4 x ranks
    sequences; 04 --bench --trace wrote no trace; 06 --bench --dropless changed nothing); --bench's own
    options typed without it did nothing either. Now one line, exit 2, before any rank; what --bench
    does read (04's microbatches, 06's experts) is taken."""
    lesson = LESSON_MODULES[script]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *options])
    launched = []
    monkeypatch.setattr(foundation, "launch_lesson", lambda *args, **kwargs: launched.append(args))
    if message is None:
        lesson.main()
        assert len(launched) == 1 and capsys.readouterr().err == ""
        return
    with pytest.raises(SystemExit) as exit_:
        lesson.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not launched and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("script", sorted(ONE_PROCESS))
@pytest.mark.parametrize("env, options, message", [
    ({}, ["{option}", "0"], "{option} must be >= 1, not 0"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT="29500"), [],
     "runs in one process: start it with python, not torchrun (WORLD_SIZE=2)"),
    (dict(RANK="0"), [], "RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not: a partial torchrun"),
    (dict(WORLD_SIZE="2"), [], None),  # left in a shell without RANK: not torchrun, the demo runs
])
def test_a_lesson_of_one_process_refuses_bad_options_and_torchrun_before_its_demo(
        monkeypatch, capsys, script, env, options, message):
    """check_options, as launch_lesson's: one line and exit 2 before the demo runs; under torchrun every
    rank would run the whole demo, so more than one process is refused (torchrun: RANK set, as for
    the lessons that launch ranks; a stray WORLD_SIZE alone does not count)."""
    lesson = LESSON_MODULES[script]
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *(o.format(option=ONE_PROCESS[script]) for o in options)])
    message = message and message.format(option=ONE_PROCESS[script])
    ran = []
    monkeypatch.setattr(lesson, "demo", ran.append)
    if message is None:
        lesson.main()
        assert len(ran) == 1 and capsys.readouterr().err == ""
        return
    with pytest.raises(SystemExit) as exit_:
        lesson.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.match(rf"{script}\.py( single)?: error: {re.escape(message)}", err), err
    assert err.count("\n") == 1
    assert not ran, "the demo ran"


@pytest.mark.parametrize("script, options, at_least", [
    ("01_ddp", ["--global-batch", "4000000000"], 4_000_000_000 * 64 * 128 * 4),  # the fp32 logits
    ("02_zero", ["--seq-len", "1000000000"], 16 * 1_000_000_000 * 125 * 4),
    ("03_tensor_parallel", ["--vocab", "1000000000000"], 1_000_000_000_000 * 64 * 4),  # the embedding
    ("03_tensor_parallel", ["--seq-len", "1000000000"], 4 * 1_000_000_000 * 127 * 4),
    ("04_pipeline", ["--global-batch", "4000000000"], 4_000_000_000 * 32 * 128 * 4),
    ("06_expert_parallel", ["--global-batch", "4000000000"], 4_000_000_000 * 32 * 128 * 4),
    # the layers' fp32 weights (01's default layer: q, k, v, out of 64 x 64, SwiGLU's 3 of 64 x 176):
    # before, 04's check counted 2 layers, not pp x virtual, and 05's none; the run went silent for minutes
    ("04_pipeline", ["--virtual", "1000000"], 4 * 2 * 1_000_000 * (4 * 64 * 64 + 3 * 64 * 176)),
    ("05_context_parallel", ["--heads", "2", "--kv-heads", "2", "--head-dim", "524288"], 4 * 2 * 4 * 1_048_576 ** 2),
    # --bench had no check: an allocator's traceback after every rank started
    ("04_pipeline", ["--bench", "--microbatches", "100000000"], 2 * 100_000_000 * 64 * 1024 * 4),  # the logits
    ("06_expert_parallel", ["--bench", "--bench-dim", "1000000"], 4 * 8 * 3 * 4 * 1_000_000 ** 2),
    ("06_expert_parallel", ["--experts", "100000000"], 4 * 2 * 100_000_000 * 3 * 64 * 64),  # the experts
    ("05_context_parallel", ["--seq-len", "1000000"], 8 * 2 * 8 * 1_000_000 ** 2),  # float64 scores
    pytest.param("07_flash_attention", ["--seq", "40000", "--heads", "8"], 2 * 8 * 2 * 8 * 40_000 ** 2,
                 marks=pytest.mark.skipif(not LESSON_MODULES["07_flash_attention"].INTERPRETED,
                                          reason="on a GPU the reference is on the GPU: CUDA's error says it")),
    ("08_fp8", ["--seq-len", "10000000000"], 16 * 10_000_000_000 * 128 * 4),
    ("08_fp8", ["distributed", "--seq-len", "10000000000"], 16 * 10_000_000_000 * 128 * 4),
])
def test_every_lesson_refuses_sizes_that_cannot_be_allocated(monkeypatch, capsys, script, options, at_least):
    """Before: every rank started, then an allocator's traceback after seconds (07: the system killed the
    demo for memory, exit 137, in a reviewer's run). Now one line before launch, with a lower bound on the
    bytes needed (at least the largest tensor's, derived here: 07's float64 scores and probabilities)."""
    lesson = LESSON_MODULES[script]
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    one_process = script in ONE_PROCESS and options[0] != "distributed"
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *options, *([] if one_process else ["--nproc", "2"])])
    monkeypatch.setattr(foundation, "launch", lambda *a, **kw: pytest.fail("launched ranks that must fail"))
    if one_process:
        monkeypatch.setattr(lesson, "demo", lambda *a: pytest.fail("ran the demo that must be refused"))
    with pytest.raises(SystemExit) as exit_:
        lesson.main()
    err = capsys.readouterr().err
    needed = re.search(r"would need at least ([\d,]+) bytes .*; this machine has ([\d,]+)$", err)
    assert exit_.value.code == 2 and err.count("\n") == 1 and needed, err
    assert int(needed.group(1).replace(",", "")) >= at_least > int(needed.group(2).replace(",", ""))


# --- every lesson's source ----------------------------------------------------------------------

@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_every_lesson_makes_its_command_line_from_option_fields(lesson):
    """One option machinery, 01's: no other lesson builds a parser or adds an argument itself (read
    from the source), and every option field a lesson defines has a help sentence for --help."""
    calls = [ast.unparse(node) for node in ast.walk(ast.parse(lesson.read_text())) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("add_argument", "ArgumentParser")]
    assert lesson.stem == "01_ddp" or not calls, calls
    module = LESSON_MODULES[lesson.stem]
    classes = [c for c in vars(module).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == module.__name__]
    fields = [f for c in classes for f in dataclasses.fields(c) if "help" in f.metadata]
    assert fields and all(f.metadata["help"].strip() for f in fields), lesson.name


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_a_lesson_imports_only_earlier_lessons(lesson):
    """The reading order (DESIGN.md): a reader of a lesson has met the lessons before it only, so it
    imports no lesson at or after its place (read from the source: every import_module call)."""
    imported = [node.args[0].value for node in ast.walk(ast.parse(lesson.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value)[:2].isdigit()]
    order = [path.stem for path in LESSONS]
    later = [name for name in imported if order.index(name) >= order.index(lesson.stem)]
    assert not later, f"{lesson.name} imports {later}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_every_line_of_every_lesson_fits_the_style(lesson):
    """Lines of at most 110 characters (the style's limit), so that two files fit side by side."""
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lesson.read_text().splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, long


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_a_count_beside_its_noun_goes_through_counted(lesson):
    """A count the user sets (--nproc 1, --steps 1, --layers 1) printed before a plural noun read "1
    ranks", "1 AdamW steps", "1 microbatches"; 01's counted() makes the noun singular at one. A
    placeholder right before such a noun in a lesson's source is a count that went round it."""
    nouns = ("ranks|local ranks|steps|AdamW steps|timed steps|microbatches|layers|MoE layers|rank files|processes|"
             "calls|buckets|all-reduces|heads|query heads|K/V heads|key-value heads|experts")
    found = [f"line {i}: {line.strip()}" for i, line in enumerate(lesson.read_text().splitlines(), 1)
             if re.search(rf"}} ({nouns})\b", line)]
    assert not found, found


def packed_assignments(source: str) -> list[int]:
    """Lines that pack several values into one assignment (`a, b = x, y`: a tuple on both sides)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
            and isinstance(node.targets[0], (ast.Tuple, ast.List)) and isinstance(node.value, ast.Tuple)]


def test_one_idea_a_line():
    """Minimalist means easy to follow, not dense (DESIGN.md, Layout): a function with a name is a def,
    never a lambda bound to a name; values packed into one assignment only where they belong together (a
    swap, a range, a shape, a pair made together): at most 100 such lines in the nine (issue 53: 243)."""
    packed = {}
    for lesson in LESSONS:
        tree = ast.parse(lesson.read_text())
        named = [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                 and isinstance(node.value, ast.Lambda)]
        assert not named, f"{lesson.name}: lambdas bound to names at lines {named}"
        packed[lesson.name] = packed_assignments(lesson.read_text())
    assert sum(map(len, packed.values())) <= 100, packed


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_what_only_the_plan_reads_is_each_lessons_last_part(lesson):
    """A GPU's seconds, which only 09's plan reads, never stand between a lesson's technique and its demo
    (issue 53): in lessons 01-08 every function that returns seconds (named *_seconds) comes after the
    lesson's main()."""
    if lesson.stem == "09_full_train":
        return
    tree = ast.parse(lesson.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    main = next(node.lineno for node in functions if node.name == "main")
    early = [node.name for node in functions if node.name.endswith("_seconds") and node.lineno < main]
    assert not early, f"{lesson.name}: {early} before main()"


def test_the_readme_is_a_course_map_not_a_lab_report():
    """The README stays within DESIGN's 3,500 words (as `wc -w` counts them): results beyond one compact
    table per lesson belong in the lessons' "Look at" lines."""
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 3500, f"README.md has {words} words"


# --- the harness itself --------------------------------------------------------------------------

def rank_one_raises_while_rank_zero_waits():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke before the all-reduce")
    foundation.all_reduce(torch.ones(1))  # never joined by rank 1: rank 0 waits in it


def test_harness_names_the_failing_and_the_silent_rank(rank_pool):
    # The call ends only at its timeout (rank 0 never answers), by which rank 1's error must be in:
    # it takes milliseconds on an idle machine, so 20 s is generous even under heavy load.
    with pytest.raises(RankFailure) as failure:
        rank_pool.run(2, rank_one_raises_while_rank_zero_waits, timeout=20)
    assert "rank 1 broke before the all-reduce" in failure.value.errors[1]
    assert failure.value.errors[0].startswith("no answer")
    assert rank_pool.run(2, dist.get_rank) == [0, 1], "a fresh pool replaces the broken one"


def rank_one_fails_then_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(2)  # rank 1's error is in long before (milliseconds on an idle machine)
        raise RuntimeError("rank 0 failed second")
    raise KeyError("rank 1 failed first")


def test_harness_lists_the_failed_ranks_in_the_order_they_failed(rank_pool):
    """The first to fail is the cause, the others often its consequence: the workshop's grade names
    the first (first_error_line reads the first exception of the report)."""
    with pytest.raises(RankFailure) as failure:
        rank_pool.run(2, rank_one_fails_then_rank_zero, timeout=60)
    assert list(failure.value.errors) == [1, 0]
    report = str(failure.value)
    assert report.index("--- rank 1 ---") < report.index("KeyError") < report.index("--- rank 0 ---")


def groups_after_making(make: int) -> int:
    """Make `make` groups and use each; return how many groups this rank is in."""
    for _ in range(make):
        foundation.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))
    return len(dist.distributed_c10d._world.pg_map)


def groups_then_refused(make: int) -> None:
    groups_after_making(make)
    raise ValueError("refused after making groups")


def test_after_a_call_every_rank_leaves_the_groups_it_made(rank_pool):
    """Each gloo group keeps a thread polling its sockets every millisecond: the groups the suite's calls
    left behind kept idle workers busy (a core in all), and the suite ran 2-8x slower than its tests
    alone. After a call every rank finished, only the default group is left, whether it returned or
    every rank refused it (a ValueError); a failed call's rejoin (through the store each worker keeps)
    leaves the pool usable, time after time."""
    assert rank_pool.run(2, groups_after_making, 3) == [4, 4]
    assert rank_pool.run(2, groups_after_making, 0) == [1, 1]
    rank_pool.expect_invalid(2, groups_then_refused, 2, match="refused after making groups")
    assert rank_pool.run(2, groups_after_making, 0) == [1, 1]
    for _ in range(2):
        with pytest.raises(RankFailure):
            rank_pool.run(2, rank_one_fails_then_rank_zero, timeout=60)
        assert rank_pool.run(2, groups_after_making, 1) == [2, 2]
    assert rank_pool.run(2, groups_after_making, 0) == [1, 1]


def test_a_script_test_runs_as_from_a_readers_shell_whatever_torchrun_left_exported(monkeypatch):
    """A shell left by a torchrun job (RANK=1 ...): run_script starts the lesson without those, so a
    script test neither waits for a world that is gone nor runs as a silent rank 1."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "left-over")
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="localhost",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    assert "llama3-8b" in run_script("09_full_train.py", "plan", "--model", "llama3-8b", "--gpus", "8")
