"""The workshop (tests/workshop.py, tests/exercises.py): copies with exercises blanked, graded by the
course's own proofs.

What is proved here, and why this way (the suite must stay within ~10 minutes on 2 cores, so the
proofs of every exercise are not run twice each):
- the list: two to four exercises per lesson (its files together), each naming functions of its lesson
  that have a body to write; its proofs, the tests of the lesson's test file that run its code
  (tests/ran.py, which the audit at the end of every session keeps true: tests/proofs.py), needing no
  later lesson's exercise;
- the record: each lesson compiles with one record at the top of each exercise's function and no line
  moved; the audit names each test that ran more or less than its entry, and --update-ran writes it;
- blanking changes exactly the chosen bodies: the blanked module's syntax tree is the original's with
  those bodies replaced by (docstring, raise), nothing else; the body's full-line comments stay;
- a copy with no exercise is the course byte for byte, so a solved exercise (its body written back)
  is the course's own code;
- every proof of every exercise fails on its blank, naming the exercise; for every rule a task states
  that a wrong body can break (RULES: a group, a share, a dtype, a guard, a fallback, an order, a
  count...), a body that breaks that rule only fails a proof, named with its error, among them the
  wrong answers an outside review found graded "solved" (issue 54). A blank or a broken rule is a
  change; the changes share copies (COPIES) where no test run for one runs another's exercise's code,
  and each copy is one check session running only the proofs its changes need (--proof);
- solved: on the course every proof passes, which the suite itself shows (each proof is one of its
  tests); the tool's answer then is checked on two exercises;
- bad commands: one line, exit status 2, nothing written.
"""
from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

import proofs
import workshop
from exercises import EXERCISES
from ran import RAN

TESTS = Path(workshop.__file__).resolve().parent
COURSE = TESTS.parent
PROOF_LINE = re.compile(r"^(?P<owners>\d\d\.\d(?:,\d\d\.\d)*)  (?P<status>passed|FAILED|BLOCKED|skipped|not run) +"
                        r"(?P<rest>.*)$")
# Hang guards only (conftest's rule: 10x a loaded machine's time): list and copy take a second, each check
# session below a few minutes on 2 idle cores, over 20 on a machine shared by several test runs.
COMMAND_TIMEOUT, CHECK_TIMEOUT = 600, 3600


class WorkshopRun:
    """The tool as an instructor runs it, on the CPU even on a GPU machine, started now and awaited by
    result(): several can run at once (their output goes to files, so no pipe fills and blocks one)."""

    def __init__(self, *args) -> None:
        self.command = [sys.executable, str(TESTS / "workshop.py"), *map(str, args)]
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.command, stdout=self.out, stderr=self.err, text=True,
                                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, start_new_session=True)
        self.started = time.monotonic()

    def result(self, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
        """Its exit status and output. On a timeout its whole process group (the rank pools' workers
        too) is killed and what it printed is shown."""
        try:
            self.proc.wait(timeout=max(0.0, self.started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            timed_out = True
        else:
            timed_out = False
        for stream in (self.out, self.err):
            stream.seek(0)
        stdout, stderr = self.out.read(), self.err.read()
        if timed_out:
            pytest.fail(f"{' '.join(self.command[1:])} did not finish in {timeout} s; it printed:\n"
                        f"{stdout}{stderr}")
        return subprocess.CompletedProcess(self.command, self.proc.returncode, stdout, stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_workshop(*args, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    return WorkshopRun(*args).result(timeout)


def proof_lines(stdout: str, nodes) -> dict[str, tuple[str, str, str]]:
    """node id -> (owners, status, detail) from check's output, for the node ids given (a node id may
    hold spaces: its parameters')."""
    found = {}
    for line in stdout.splitlines():
        if match := PROOF_LINE.match(line):
            node = max((n for n in nodes if match["rest"].startswith(f"{n}  ")), key=len, default=None)
            if node is not None:
                found[node] = (match["owners"], match["status"], match["rest"][len(node) + 2:])
    return found


def assert_one_line_each(result: subprocess.CompletedProcess, exercises: int, proofs: set[str]) -> None:
    """A header, one line per proof, one per exercise, the verdict: no traceback anywhere."""
    assert len(result.stdout.splitlines()) == 1 + len(proofs) + exercises + 1, result.stdout
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


# --- the list ----------------------------------------------------------------------------------

def test_two_to_four_exercises_per_lesson_each_a_function_with_a_body_and_real_proofs():
    ids = [e.id for e in EXERCISES]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"0[1-9]\.[1-9]", i) for i in ids)
    per_lesson = Counter(e.file[:2] for e in EXERCISES)
    lessons = sorted({name[:2] for name in workshop.LESSONS})
    assert sorted(per_lesson) == lessons and all(2 <= n <= 4 for n in per_lesson.values()), per_lesson
    for e in EXERCISES:
        assert e.file[:2] == e.id[:2] and e.file in workshop.LESSONS, e.id
        assert not re.search(r"[\"'\\()]", e.title), f"{e.id}: the title goes into the raise's message"
        assert 1 <= e.minutes <= 60 and e.task and e.hint and e.proofs, e.id
        assert set(e.needs) <= set(workshop.BY_ID) and all(n[:2] <= e.id[:2] for n in e.needs), e.id
        source = (COURSE / e.file).read_text()
        for name in e.names:
            first, last, _ = workshop.body_span(source, workshop.function_node(ast.parse(source), name))
            assert first <= last, name
        tests = {node.name for node in ast.walk(ast.parse((TESTS / e.test_file).read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert {proof.split("[")[0] for proof in e.proofs} <= tests, f"{e.id}: a proof is not a test"


def test_every_entry_of_ran_is_a_test_and_names_exercises():
    files = {test.split("::", 1)[0] for test in RAN}
    functions = {file: {node.name for node in ast.walk(ast.parse((TESTS / file).read_text()))
                        if isinstance(node, ast.FunctionDef)} for file in files}
    for test, ids in RAN.items():
        file, name = test.split("::", 1)
        assert name.split("[")[0] in functions[file] and ids and set(ids) <= set(workshop.BY_ID), test


def test_each_lesson_compiles_with_one_record_per_exercise_function_and_no_line_moved():
    """Its syntax tree is the lesson's with `__exercise_ran__(id)` first in each exercise's body (after
    the docstring), placed at the line it precedes; Triton's device functions get none (their calls
    are recorded in the interpreter)."""
    for lesson in workshop.LESSONS:
        source = (COURSE / lesson).read_text()
        tree = proofs.instrument(source, lesson)
        records = [node for node in ast.walk(tree) if isinstance(node, ast.Expr)
                   and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == proofs.RECORD]
        expected = ast.parse(source)
        for e in (e for e in EXERCISES if e.file == lesson):
            for name in e.names:
                node = workshop.function_node(expected, name)
                if not any("jit" in ast.dump(d) for d in node.decorator_list):
                    first = int(ast.get_docstring(node, clean=False) is not None)
                    node.body.insert(first, ast.Expr(ast.Call(ast.Name(proofs.RECORD, ast.Load()),
                                                              [ast.Constant(e.id)], [])))
        assert ast.dump(tree) == ast.dump(expected), lesson
        for record in records:
            body = next(n.body for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and record in n.body)
            assert record.lineno == body[body.index(record) + 1].lineno, lesson


def test_the_audit_names_each_test_that_ran_more_or_less_than_its_entry(monkeypatch):
    monkeypatch.setattr(proofs.ran, "RAN", {"test_01_ddp.py::test_a": ("01.1",), "test_01_ddp.py::test_b": ("01.2",),
                                            "test_01_ddp.py::test_gone": ("01.1",), "test_09_x.py::test_c": ("09.1",)})
    ran_by = {"test_01_ddp.py::test_a": {"01.1", "01.2"}, "test_01_ddp.py::test_b": set(),
              "test_01_ddp.py::test_d": {"01.1"}}
    passed = {"test_01_ddp.py::test_a", "test_01_ddp.py::test_b", "test_01_ddp.py::test_d"}
    assert proofs.audit(ran_by, passed, set(ran_by), {"04.1"}) == [
        "04.1 ran outside any test (at a module's top level): a blank would fail every test that imports it",
        "test_01_ddp.py::test_a runs 01.2, not in its entry",
        "test_01_ddp.py::test_b never ran 01.2 of its entry",
        "test_01_ddp.py::test_d runs 01.1, not in its entry",
        "test_01_ddp.py::test_gone is no test of its file any more"]  # test_c: its file did not run
    written = Path(tempfile.mkdtemp()) / "ran.py"
    monkeypatch.setattr(proofs, "RAN_FILE", written)
    proofs.write(ran_by, passed, set(ran_by))
    namespace = {}
    exec(written.read_text(), namespace)
    assert namespace["RAN"] == {"test_01_ddp.py::test_a": ("01.1", "01.2"), "test_01_ddp.py::test_d": ("01.1",),
                                "test_09_x.py::test_c": ("09.1",)}
    assert namespace["__doc__"] == proofs.ran.__doc__


def test_the_readmes_workshop_table_is_the_list():
    """The README's table (id and minutes of every exercise) says what tests/exercises.py says."""
    section = (COURSE / "README.md").read_text().split("\n## Workshop\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if re.match(r"\| 0[1-9] \|", line)]
    listed = {i: int(m) for row in rows for i, m in re.findall(r"(\d\d\.\d) [^,(|]+ \((\d+)\)", row)}
    assert listed == {e.id: e.minutes for e in EXERCISES}


def test_blanking_replaces_the_chosen_bodies_and_nothing_else():
    """Per lesson, all its exercises at once: the blanked syntax tree equals the original's with
    each chosen body replaced by its docstring (if any) and the exercise's raise; every full-line
    comment of those bodies is kept, in order; every line fits the style's 110 characters."""
    by_file = defaultdict(list)
    for e in EXERCISES:
        by_file[e.file].append(e)
    for file, exercises in by_file.items():
        source = (COURSE / file).read_text()
        blanked = workshop.blank(source, exercises)
        expected, comments = ast.parse(source), []
        for e in exercises:
            for name in e.names:
                node = workshop.function_node(expected, name)
                first, last, _ = workshop.body_span(source, node)
                comments += [line.strip() for line in source.splitlines()[first - 1:last]
                             if line.strip().startswith("#")]
                message = ast.Constant(f"Exercise {e.id}: {e.title}")
                raise_ = ast.Raise(ast.Call(ast.Name("NotImplementedError", ast.Load()), [message], []))
                docstring = node.body[:1] if ast.get_docstring(node, clean=False) is not None else []
                node.body = [*docstring, raise_]
        assert ast.dump(ast.parse(blanked)) == ast.dump(expected), file
        kept = iter(line.strip() for line in blanked.splitlines())
        assert all(comment in kept for comment in comments), f"{file}: a comment of a blanked body was lost"
        assert max(map(len, blanked.splitlines())) <= 110, file
    assert any(by_file.values()), "nothing was checked"


# --- copies and bad commands -------------------------------------------------------------------

def test_a_copy_without_exercises_is_the_course_byte_for_byte(tmp_path):
    result = run_workshop("copy", tmp_path / "copy")
    assert result.returncode == 0, result.stderr
    copied = sorted(p.relative_to(tmp_path / "copy") for p in (tmp_path / "copy").rglob("*") if p.is_file())
    expected = sorted(workshop.course_files(COURSE))
    assert copied == expected and Path("tests/conftest.py") in copied
    assert workshop.LESSONS == tuple(f"{name}.py" for name in (
        "01_ddp", "02_zero", "03_tensor_parallel", "04_pipeline", "05_context_parallel", "06_expert_parallel",
        "07_flash_attention", "08_fp8", "09_full_train"))
    for path in expected:
        assert (tmp_path / "copy" / path).read_bytes() == (COURSE / path).read_bytes(), path


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command, message", [
    (["copy", "{dir}", "--all"], r"is not an empty folder: copy writes into a new or empty one"),
    (["copy", "{file}", "--all"], r"notes\.txt is a file, not a folder"),
    (["copy", "{file}/copy", "--all"], r"notes\.txt/copy cannot be created \(NotADirectoryError: "),
    (["copy", "{new}", "--exercises", "02.1,99.9"], r"unknown exercise 99\.9: the exercises are 01\.1, "),
    (["check", "99.9", "--copy", "{dir}"], r"unknown exercise 99\.9"),
    (["list", "02.1", "99.9"], r"unknown exercise 99\.9"),
    (["check", "02.1", "--copy", "{dir}"], "is not a workshop copy: it lacks " + re.escape(", ".join(
        workshop.LESSONS[:3])) + f" and {len(workshop.LESSONS) - 3} more lessons$"),
    (["check", "02.1", "--copy", "{new}"], r"is not a workshop copy"),
    (["check"], r"check needs exercise ids"),
], ids=["copy into a non-empty folder", "copy onto a file", "copy under a file", "copy an unknown exercise", "check an unknown exercise",
        "list an unknown exercise", "check a folder that is not a copy", "check a folder that is not there",
        "check nothing"])
def test_a_bad_command_is_one_line_exit_2_and_writes_nothing(tmp_path, command, message):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("a participant's notes\n")
    before = snapshot(tmp_path)
    result = run_workshop(*(arg.format(dir=folder, new=tmp_path / "new", file=folder / "notes.txt")
                            for arg in command))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("workshop.py: error: "), result.stderr
    assert re.search(message, result.stderr.rstrip("\n")), result.stderr
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()


# --- grading: blanks fail their proofs; a body that breaks one rule fails one; solutions pass --------

# Every rule an exercise's task states that a wrong body can break: a body that breaks that rule only
# (each right text exactly once in the exercise's bodies, and the wrong text in its place) and the
# proof that fails then. "review": a wrong answer an outside review found graded "solved" (issue 54).
RULES = [
    ("01.1", "all-reduce over the group", "test_naive_averaging_stays_within_its_group",
     [("all_reduce(param.grad, group=group)", "all_reduce(param.grad)")]),
    ("01.1", "divide by the group's size", "test_naive_averaging_stays_within_its_group",
     [("dist.get_world_size(group)", "dist.get_world_size()")]),
    ("01.1", "one metered all_reduce a parameter (01's wrapper)", "test_data_parallel_equals_single_device",
     [("all_reduce(param.grad, group=group)", "dist.all_reduce(param.grad, group=group)")]),
    ("01.1", "frozen parameters are skipped",
     "test_frozen_parameters_are_skipped_and_unused_trainable_ones_refused[naive]",
     [("if not param.requires_grad:", "if False:")]),
    ("01.1", "a trainable parameter without a gradient is refused",
     "test_frozen_parameters_are_skipped_and_unused_trainable_ones_refused[naive]",
     [('raise RuntimeError(f"{name} got no gradient: unused parameters are not supported")', "continue")]),

    ("01.2", "nothing under no_sync()",
     "test_accumulation_skips_frozen_parameters_and_refuses_a_backward_out_of_place",
     [("if not self.sync_gradients:", "if False:")]),
    ("01.2", "the gradient is copied into its bucket",
     "test_buckets_launch_in_order_even_if_a_later_one_fills_first",
     [("self.bucket_of[param].add(param)",
       "self.bucket_of[param].ready.add(self.bucket_of[param].slot[param])")]),
    ("01.2", "launched async, its work in bucket.work",
     "test_buckets_fill_in_reverse_order_and_launch_during_backward",
     [("group=self.group, async_op=True)", "group=self.group)")]),
    ("01.2", "in order, stopping at the first bucket not full",
     "test_buckets_launch_in_order_even_if_a_later_one_fills_first",
     [("params):\n                break", "params):\n                continue")]),
    ("01.2", "review: over self.group", "test_data_parallel_on_a_subgroup",
     [("group=self.group, async_op=True)", "async_op=True)")]),
    ("01.2", "max_in_flight counts the launched and unfinished",
     "test_max_in_flight_counts_the_launched_all_reduces_not_yet_finished",
     [("b.work is not None and not b.work.is_completed()", "b.work is not None")]),
    ("01.2", "unpack waits for the all-reduce",
     "test_unpack_waits_then_averages_each_view_into_its_gradient_and_empties_the_bucket",
     [("        self.work.wait()\n", "")]),
    ("01.2", "unpack divides by the group's size", "test_data_parallel_on_a_subgroup",
     [("self.buffer.div_(world)", "self.buffer.div_(dist.get_world_size())")]),
    ("01.2", "unpack empties ready",
     "test_unpack_waits_then_averages_each_view_into_its_gradient_and_empties_the_bucket",
     [("        self.ready.clear()\n", "")]),
    ("01.2", "unpack forgets the work",
     "test_unpack_waits_then_averages_each_view_into_its_gradient_and_empties_the_bucket",
     [("        self.work = None\n", "")]),

    ("02.1", "a second backward before step() is refused", "test_misuse_is_refused_and_nan_propagates",
     [("if unit.reduction is not None:", "if False:")]),
    ("02.1", "once all the unit's parameters are ready", "test_no_sync_accumulates_microbatches[2]",
     [("if len(unit.ready) < len(unit.params):", "if len(unit.ready) < 1:")]),
    ("02.1", "unit.ready is cleared", "test_no_sync_accumulates_microbatches[2]",
     [("        unit.ready.clear()\n", "")]),
    ("02.1", "stage 3 releases the unit's parameters",
     "test_zero3_gathers_one_module_at_a_time_and_prefetches[True]",
     [("            unit.release()  # every use", "            pass  # every use")]),
    ("02.1", "nothing under no_sync()", "test_no_sync_accumulates_microbatches[2]",
     [("if self.sync_gradients:\n            self._reduce(unit)", "self._reduce(unit)")]),
    ("02.1", "flattened in self.dtype", "test_mixed_precision_equals_its_one_device_twin[2-2-False]",
     [("unit.flatten([p.grad for p in unit.params], self.dtype)",
       "unit.flatten([p.grad for p in unit.params], torch.float32)")]),
    ("02.1", "review: the full gradients are freed", "test_zero_equals_single_device",
     [("p.grad = None", "pass")]),
    ("02.1", "launched async, kept in unit.reduction", "test_no_sync_accumulates_microbatches[2]",
     [("send, group=self.group, async_op=True)", "send, group=self.group)")]),
    ("02.1", "over self.group", "test_zero_on_a_subgroup",
     [("send, group=self.group, async_op=True)", "send, async_op=True)")]),

    ("02.2", "each parameter weighed by its share",
     "test_grad_squares_weighs_each_parameter_by_its_share[1-False]",
     [(".square() * weight", ".square()")]),
    ("02.2", "each element by its own parameter's share",
     "test_grad_squares_weighs_each_parameter_by_its_share[1-False]",
     [("share(unit.params[i])", "share(unit.params[0])")]),
    ("02.2", "squares summed in fp32", "test_grad_squares_weighs_each_parameter_by_its_share[1-True]",
     [("vector_norm(grads, dtype=torch.float32)", "vector_norm(grads)")]),
    ("02.2", "all-reduced only where each rank has a part",
     "test_grad_squares_weighs_each_parameter_by_its_share[0-False]",
     [("if self.stage > 0:", "if True:")]),
    ("02.2", "over self.group", "test_zero_on_a_subgroup",
     [("all_reduce(squares, group=self.group)", "all_reduce(squares)")]),

    ("02.3", "an in-flight gather is counted as prefetched",
     "test_zero3_evaluates_under_no_grad_one_module_at_a_time[True]",
     [("self.prefetched_gathers += unit.gathered is not None", "self.prefetched_gathers += 1")]),
    ("02.3", "the all-gather is waited for", "test_zero3_uses_a_unit_only_after_its_all_gather_is_waited_for",
     [("            unit.gather_work.wait()\n", "")]),
    ("02.3", "prefetch only with self.prefetch",
     "test_zero3_evaluates_under_no_grad_one_module_at_a_time[False]",
     [("if self.prefetch and 0 <= next_index", "if 0 <= next_index")]),
    ("02.3", "prefetch only a unit that exists",
     "test_tied_root_and_frozen_parameters_train_as_on_one_device[freeze_some-3]",
     [("0 <= next_index < len(self.units)", "next_index < len(self.units)")]),
    ("02.3", "released after its forward", "test_zero3_evaluates_under_no_grad_one_module_at_a_time[True]",
     [("        self.units[index].release()\n", "")]),
    ("02.3", "a backward hook only where the output requires grad",
     "test_zero3_evaluates_under_no_grad_one_module_at_a_time[True]",
     [("if output.requires_grad:", "if True:")]),
    ("02.3", "backward gathers again, prefetching index - 1",
     "test_zero3_gathers_one_module_at_a_time_and_prefetches[True]",
     [("self._gather(index, index - 1)", "self._gather(index, index + 1)")]),
    ("02.3", "the output's hook holds the ZeRO weakly", "test_a_dropped_zero_frees_its_model[3]",
     [("foundation.weak_hook(self._gather_for_backward, index)", "lambda grad: self._gather(index, index - 1)")]),

    ("03.1", "backward applies backward", "test_conjugate_operators_match_their_definitions[2]",
     [("return backward(grad, ctx.group), None", "return forward(grad, ctx.group), None")]),
    ("03.1", "forward applies forward", "test_conjugate_operators_match_their_definitions[2]",
     [("return forward(x, group)", "return backward(x, group)")]),
    ("03.1", "over the group kept in ctx", "test_tensor_parallel_on_a_subgroup[False]",
     [("return backward(grad, ctx.group), None", "return backward(grad, None), None")]),
    ("03.1", "no gradient for the group", "test_conjugate_operators_match_their_definitions[2]",
     [("return backward(grad, ctx.group), None", "return backward(grad, ctx.group)")]),

    ("03.2", "review: bf16 logits summed in fp32", "test_bf16_logits_are_summed_in_fp32",
     [("logits.to(torch.promote_types(logits.dtype, torch.float32))", "logits")]),
    ("03.2", "at least fp32: float64 stays float64",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-16]",
     [("logits.to(torch.promote_types(logits.dtype, torch.float32))", "logits.float()")]),
    ("03.2", "ctx.dtype is the input's",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-16]",
     [("ctx.dtype = logits.dtype", "ctx.dtype = torch.float32")]),
    ("03.2", "padding ids are -inf", "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-7]",
     [('logits = logits.masked_fill(ids >= vocab_size, float("-inf"))', "logits = logits")]),
    ("03.2", "the row max over the group",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-16]",
     [('_all_reduced(logits.max(dim=1).values, group, "max")', "logits.max(dim=1).values")]),
    ("03.2", "the sum of exponentials over the group",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-16]",
     [("_all_reduced(exp.sum(dim=1), group)", "exp.sum(dim=1)")]),
    ("03.2", "the target's logit from its holder only, never -inf x 0",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[4-3]",
     [("torch.where(mine, picked, torch.zeros_like(picked))", "picked * mine")]),
    ("03.2", "local targets clamped to 0 where not held",
     "test_vocab_parallel_loss_and_embedding_match_their_definitions[2-16]",
     [("local_target = local_target.masked_fill(~mine, 0)", "local_target = local_target")]),

    ("03.3", "sequence parallelism's f",
     "test_frozen_parameters_stay_frozen_and_the_rest_trains_as_on_one_device[True]",
     [("f = GatherSequence if ctx.sequence_parallel else CopyToRegion", "f = CopyToRegion")]),
    ("03.3", "sequence parallelism's g",
     "test_frozen_parameters_stay_frozen_and_the_rest_trains_as_on_one_device[True]",
     [("g = ReduceScatterSequence if ctx.sequence_parallel else ReduceFromRegion", "g = ReduceFromRegion")]),
    ("03.3", "the other arguments pass",
     "test_frozen_parameters_stay_frozen_and_the_rest_trains_as_on_one_device[False]",
     [("(f.apply(args[0], ctx.group), *args[1:])", "(f.apply(args[0], ctx.group),)")]),
    ("03.3", "nothing at tp = 1", "test_at_tp_1_nothing_is_inserted[False]",
     [("if ctx.tp > 1 and not keeps_sequence_shard(module, ctx):",
       "if not keeps_sequence_shard(module, ctx):")]),
    ("03.3", "no f where the linears gather their input",
     "test_frozen_parameters_stay_frozen_and_the_rest_trains_as_on_one_device[True]",
     [("if ctx.tp > 1 and not keeps_sequence_shard(module, ctx):", "if ctx.tp > 1:")]),
    ("03.3", "over ctx.group", "test_tensor_parallel_on_a_subgroup[False]",
     [("g.apply(out, ctx.group)", "g.apply(out, None)")]),

    ("04.1", "1F1B: pp - rank - 1 warm-up forwards", "test_schedule_shapes_on_a_known_case",
     [("min(m, pp - rank - 1)", "min(m, pp - rank)")]),
    ("04.1", "GPipe: every forward first", "test_schedule_shapes_on_a_known_case",
     [('m if schedule == "gpipe" else min', "min")]),
    ("04.1", "ZB-H1: rank r postpones its first r W's", "test_schedule_shapes_on_a_known_case",
     [("if weight_grads and k >= rank:", "if weight_grads:")]),
    ("04.1", "interleaved: stages rank, rank + pp, ...",
     "test_schedules_are_complete_ordered_and_never_deadlock",
     [("chunk * pp + rank", "rank * virtual + chunk")]),
    ("04.1", "interleaved: backward through the chunks in reverse",
     "test_schedules_are_complete_ordered_and_never_deadlock",
     [('chunk if kind == "F" else virtual - 1 - chunk', "chunk")]),
    ("04.1", "interleaved: microbatches in groups of pp",
     "test_schedules_are_complete_ordered_and_never_deadlock",
     [("(k // (pp * virtual)) * pp + k % pp", "k // virtual")]),
    ("04.1", "interleaved: its warm-up", "test_schedules_are_complete_ordered_and_never_deadlock",
     [("2 * (pp - rank - 1) + (virtual - 1) * pp", "(pp - rank - 1) + (virtual - 1) * pp")]),

    ("04.2", "GPipe and 1F1B: (p - 1) / (m + p - 1)", "test_planned_bubble_equals_the_formula",
     [("else m) + pp - 1)", "else m))")]),
    ("04.2", "interleaved divides the warm-up by v", "test_planned_bubble_equals_the_formula",
     [('(virtual * m if schedule == "interleaved" else m)', "m")]),
    ("04.2", "ZB-H1 fills the tail with W's", "test_planned_bubble_equals_the_formula",
     [('if schedule == "zb-h1":', "if False:")]),
    ("04.2", "ZB-H1, m < p: the last rank's chain", "test_planned_bubble_equals_the_formula",
     [("max(3 * m + pp - 1, 2 * m + 2 * pp - 1)", "(3 * m + pp - 1)")]),

    ("05.1", "lse = lse_a - logsigmoid(lse_a - lse_b)", "test_merge_rule_equals_the_unsplit_softmax",
     [("lse_a - F.logsigmoid(diff)", "lse_a + F.logsigmoid(diff)")]),
    ("05.1", "weights sigmoid(lse_a - lse_b)", "test_merge_rule_equals_the_unsplit_softmax",
     [("torch.sigmoid(diff)", "torch.sigmoid(-diff)")]),
    ("05.1", "an empty block: the other block's result", "test_merge_rule_equals_the_unsplit_softmax",
     [("torch.where(empty_a, 0.0, torch.where(empty_b, 1.0, torch.sigmoid(diff)))", "torch.sigmoid(diff)")]),
    ("05.1", "an empty B: A's lse (a review: A's + ln 2 passed)", "test_merge_rule_equals_the_unsplit_softmax",
     [("torch.where(empty_b, lse_a, lse_a - F.logsigmoid(diff))", "lse_a - F.logsigmoid(diff)")]),
    ("05.1", "no -inf - -inf, even in backward", "test_merge_rule_equals_the_unsplit_softmax",
     [("torch.where(empty_a | empty_b, 0.0, lse_a - lse_b)", "lse_a - lse_b")]),
    ("05.1", "the weight in out_a's dtype", "test_the_merge_keeps_the_outputs_dtype_beside_a_float64_lse",
     [("weight_a = weight_a.to(out_a.dtype)", "weight_a = weight_a")]),

    ("05.2", "zigzag: chunks r and 2P - 1 - r", "test_layout_shards_tile_the_sequence",
     [("(rank, 2 * self.cp - 1 - rank)", "(rank, self.cp + rank)")]),
    ("05.2", "contiguous: chunk r", "test_layout_shards_tile_the_sequence",
     [("if self.zigzag else (rank,)", "if self.zigzag else (self.cp - 1 - rank,)")]),
    ("05.2", "shard: the chunks in that order", "test_layout_shards_tile_the_sequence",
     [("for c in self.chunks(rank)], dim)", "for c in sorted(self.chunks(rank), reverse=True)], dim)")]),
    ("05.2", "shard: along dim", "test_layout_shards_tile_the_sequence",
     [("x.narrow(dim, c * self.chunk_len", "x.narrow(0, c * self.chunk_len")]),
    ("05.2", "unshard: each rank's chunks from its shard", "test_layout_shards_tile_the_sequence",
     [("shard.narrow(dim, i * self.chunk_len, self.chunk_len)", "shard.narrow(dim, 0, self.chunk_len)")]),

    ("05.3", "the causal mask", "test_sharded_attention_equals_full_attention",
     [("_block_pairs(layout, me, owner, causal)", "_block_pairs(layout, me, owner, False)")]),
    ("05.3", "review: the running lse in float64",
     "test_ring_saved_bytes_is_what_ring_attention_keeps_for_backward[False]",
     [("dtype=torch.float64, device=q.device)", "dtype=torch.float32, device=q.device)")]),
    ("05.3", "the running lse starts at -inf", "test_sharded_attention_equals_full_attention",
     [('torch.full(q.shape[:3], float("-inf")', "torch.full(q.shape[:3], 0.0")]),
    ("05.3", "each block through compute", "test_sharded_attention_equals_full_attention",
     [("compute(block.forward, ", "block.forward(")]),
    ("05.3", "the lse returned in fp32", "test_sharded_attention_equals_full_attention",
     [("return out.to(q.dtype), lse.float()", "return out.to(q.dtype), lse")]),
    ("05.3", "over the group", "test_context_parallel_on_a_subgroup[ring]",
     [("_kv_ring(k, v, group, me, layout.cp)", "_kv_ring(k, v, None, me, layout.cp)")]),

    ("06.1", "the kept assignments' tokens", "test_moe_layer_equals_a_per_token_loop",
     [("x[plan.kept_slots // plan.top_k]", "x[plan.kept_slots % x.shape[0]]")]),
    ("06.1", "dispatch: rows go as the splits say", "test_dispatch_then_combine_restores_input_and_gradient",
     [("plan.recv_splits, plan.send_splits, plan.group)",
       "plan.send_splits, plan.recv_splits, plan.group)")]),
    ("06.1", "dispatch: regrouped by local expert", "test_dispatch_then_combine_restores_input_and_gradient",
     [("return rows[plan.by_expert]", "return rows")]),
    ("06.1", "combine: the regrouping undone", "test_expert_parallel_on_a_subgroup",
     [("y[torch.argsort(plan.by_expert)]", "y[plan.by_expert]")]),
    ("06.1", "combine: exchanged back", "test_dispatch_then_combine_restores_input_and_gradient",
     [("plan.send_splits, plan.recv_splits, plan.group)",
       "plan.recv_splits, plan.send_splits, plan.group)")]),
    ("06.1", "combine: each row in its (token, slot)", "test_moe_layer_equals_a_per_token_loop",
     [("slots.view(n_tokens, plan.top_k, y.shape[-1])",
       "slots.view(plan.top_k, n_tokens, y.shape[-1]).transpose(0, 1)")]),
    ("06.1", "over plan.group", "test_dispatch_then_combine_restores_input_and_gradient",
     [("plan.recv_splits, plan.send_splits, plan.group)", "plan.recv_splits, plan.send_splits, None)")]),

    ("06.2", "replicated weights all-reduced over the group", "test_expert_parallel_on_a_subgroup",
     [("foundation.all_reduce(param.grad, group=group)", "foundation.all_reduce(param.grad)")]),
    ("06.2", "divided by the group's size", "test_expert_parallel_on_a_subgroup",
     [("ep = foundation.group_size(group)", "ep = foundation.group_size(None)")]),
    ("06.2", "review: over the world, divided by its size", "test_expert_parallel_on_a_subgroup",
     [("foundation.all_reduce(param.grad, group=group)", "foundation.all_reduce(param.grad)"),
      ("ep = foundation.group_size(group)", "ep = foundation.group_size(None)")]),
    ("06.2", "experts are not all-reduced", "test_expert_parallel_layer_equals_one_device[2]",
     [("if param not in experts:\n            foundation.all_reduce",
       "if True:\n            foundation.all_reduce")]),
    ("06.2", "experts are divided by ep too", "test_expert_parallel_layer_equals_one_device[2]",
     [("group=group)\n        param.grad.div_(ep)", "group=group)\n            param.grad.div_(ep)")]),
    ("06.2", "frozen parameters are skipped", "test_frozen_parameters_are_skipped_and_the_rest_still_matches",
     [("if not param.requires_grad:", "if False:")]),
    ("06.2", "a trainable parameter without a gradient is refused",
     "test_frozen_parameters_are_skipped_and_the_rest_still_matches",
     [('raise RuntimeError(f"{name} got no gradient")', "continue")]),

    ("07.1", "causal: keys before the diagonal need no mask",
     "test_block_skipping_matches_brute_force_visibility[True-32-16]",
     [("start_m + shift + 1)", "start_m + shift)")]),
    ("07.1", "causal: keys past the diagonal are skipped",
     "test_block_skipping_matches_brute_force_visibility[True-32-16]",
     [("start_m + BLOCK_M + shift))", "start_m + BLOCK_M + shift + BLOCK_N))")]),
    ("07.1", "without the mask only the sequence's end needs one",
     "test_block_skipping_matches_brute_force_visibility[False-32-16]",
     [("seq_k // BLOCK_N * BLOCK_N, seq_k", "seq_k, seq_k")]),
    ("07.1", "queries before lo see none of the block's keys",
     "test_block_skipping_matches_brute_force_visibility[True-32-16]",
     [("tl.maximum(0, start_n - shift) // BLOCK_M * BLOCK_M)", "tl.maximum(0, start_n - shift))")]),
    ("07.1", "queries from full_start see all of them",
     "test_block_skipping_matches_brute_force_visibility[True-32-16]",
     [("start_n + BLOCK_N - 1 - shift)", "start_n - shift)")]),
    ("07.1", "q_end: the padded end of the queries",
     "test_the_triton_kernel_as_ring_block_equals_the_torch_block[False-ulysses]",
     [("q_end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M", "q_end = seq_q")]),

    ("07.2", "l = alpha l + rowsum p", "test_attention_matches_float64",
     [("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")]),
    ("07.2", "acc = alpha acc + p V", "test_attention_matches_float64",
     [("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")]),
    ("07.2", "m_new = max(m, rowmax s)", "test_attention_matches_float64",
     [("m_new = tl.maximum(m_i, tl.max(s, 1))", "m_new = tl.max(s, 1)")]),
    ("07.2", "masked to -inf where not visible", "test_attention_matches_float64",
     [('s = tl.where(_visible(rows, cols, seq_k, shift, CAUSAL), s, float("-inf"))', "s = s")]),
    ("07.2", "a row that has seen no key subtracts 0", "test_block_entry_with_offsets_and_lse_gradient",
     [('m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_sub = m_new")]),
    ("07.2", "scores in log2 units: exp2", "test_attention_matches_float64",
     [("p = tl.exp2(s - m_sub[:, None])", "p = tl.exp(s - m_sub[:, None])")]),
    ("07.2", "p in V's dtype for the dot", "test_attention_matches_float64",
     [("tl.dot(p.to(v.dtype), v", "tl.dot(p, v")]),

    ("08.1", "the format's own maximum", "test_scale_is_finite_and_maps_amax_to_fp8_max",
     [("fp8_max(dtype)) / amax", "fp8_max(E4M3)) / amax")]),
    ("08.1", "the amax clamped at AMAX_EPS", "test_scale_is_finite_and_maps_amax_to_fp8_max",
     [("amax.float().clamp(min=AMAX_EPS)", "amax.float() + AMAX_EPS")]),
    ("08.1", "finite for a zero amax", "test_scale_is_finite_and_maps_amax_to_fp8_max",
     [("amax.float().clamp(min=AMAX_EPS)", "amax.float()")]),
    ("08.1", "in fp32", "test_a_bf16_or_float64_amax_gives_an_fp32_scale[amax_dtype0]",
     [("amax.float().clamp(min=AMAX_EPS)", "amax.clamp(min=AMAX_EPS)")]),

    ("08.2", "beyond fp8_max saturates", "test_format_limits_and_saturating_cast",
     [("y.clamp(-fp8_max(dtype), fp8_max(dtype))", "y")]),
    ("08.2", "a finite value whose product overflows saturates",
     "test_finite_values_whose_scaled_product_overflows_fp32_saturate[dtype0]",
     [("is_inf = x.isinf() & y.isinf()", "is_inf = y.isinf()")]),
    ("08.2", "NaN stays NaN", "test_format_limits_and_saturating_cast",
     [("y.clamp(-fp8_max(dtype), fp8_max(dtype))",
       "y.nan_to_num(0.0).clamp(-fp8_max(dtype), fp8_max(dtype))")]),
    ("08.2", "e5m2: an infinite input stays infinite", "test_format_limits_and_saturating_cast",
     [("inf = y if INF_BITS[dtype] != NAN_BITS else torch.full_like(y, torch.nan)",
       "inf = torch.full_like(y, torch.nan)")]),
    ("08.2", "e4m3fn: an infinite input becomes NaN", "test_format_limits_and_saturating_cast",
     [("inf = y if INF_BITS[dtype] != NAN_BITS else torch.full_like(y, torch.nan)", "inf = y")]),

    ("08.3", "from the max of the history", "test_delayed_scaling_history_window_and_margin",
     [("self.amax_history.max() if self.calls", "self.amax_history[0] if self.calls")]),
    ("08.3", "the first call from its own amax", "test_delayed_scaling_history_window_and_margin",
     [("if self.calls else first_amax", "if True else first_amax")]),
    ("08.3", "the first call from max |x| (a review: max x passed)",
     "test_delayed_scaling_first_call_takes_the_largest_magnitude",
     [("x.detach().abs().amax()", "x.detach().amax()")]),
    ("08.3", "no history and no amax: None", "test_delayed_scaling_history_window_and_margin",
     [("if amax is None:\n            return None", "if False:\n            return None")]),
    ("08.3", "divided by 2^margin", "test_delayed_scaling_history_window_and_margin",
     [(" / 2.0 ** self.margin", "")]),
    ("08.3", "guard: 1 for a zero amax", "test_delayed_scaling_after_an_all_zero_call[dtype0]",
     [("(amax > 0) & amax.isfinite()", "amax.isfinite()")]),
    ("08.3", "review: guard: 1 for an amax not finite",
     "test_delayed_scaling_after_a_non_finite_call[dtype0-+inf]",
     [("(amax > 0) & amax.isfinite()", "(amax > 0)")]),
    ("08.3", "a (1, 1) scale", "test_delayed_scaling_history_window_and_margin",
     [("1.0).view(1, 1)", "1.0)")]),
    ("08.3", "an empty x is refused", "test_bad_input_gets_one_line_naming_the_constraint[empty delayed]",
     [("if x.dim() == 0 or x.numel() == 0:", "if x.dim() == 0:")]),
    ("08.3", "the newest amax at the front of the history", "test_delayed_scaling_history_window_and_margin",
     [("torch.cat([amax.view(1), self.amax_history[:-1]])",
       "torch.cat([self.amax_history[1:], amax.view(1)])")]),
    ("08.3", "each call counted", "test_delayed_scaling_history_window_and_margin",
     [("self.calls + 1", "self.calls")]),
    ("08.3", "q shaped like x", "test_delayed_scaling_clips_a_spike_until_it_enters_the_history",
     [("return q.view(x.shape), scale", "return q, scale")]),

    ("09.1", "coords: tp fastest", "test_mesh_coordinates_and_groups",
     [("for dim in reversed(DIMS):", "for dim in DIMS:")]),
    ("09.1", "rank: the inverse of coords", "test_mesh_coordinates_and_groups",
     [("        for dim in DIMS:\n", "        for dim in reversed(DIMS):\n")]),

    ("09.2", "each group's ranks in mesh order", "test_mesh_coordinates_and_groups",
     [("range(getattr(self, d)) for d in dims))", "range(getattr(self, d)) for d in reversed(dims)))")]),
    ("09.2", "the groups in mesh order", "test_mesh_coordinates_and_groups",
     [("out.append([", "out.insert(0, [")]),

    ("09.3", "a node holds whole aligned blocks",
     "test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node",
     [("start // gpus_per_node == (start + block - 1) // gpus_per_node", "block <= gpus_per_node")]),
    ("09.3", "only the job's ranks count",
     "test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node",
     [("min(sizes.world, period)", "period")]),
    ("09.3", "review: a kind that is no mesh dimension: dp x cp",
     "test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node",
     [('GROUP_DIMS.get(kind, ("dp", "cp"))', "GROUP_DIMS[kind]")]),
    ("09.3", "only the group's dims of size > 1 move",
     "test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node",
     [(" and getattr(sizes, d) > 1]", "]")]),
    ("09.3", "the block: the slowest moving dim's size x every faster dim's",
     "test_inside_node_exactly_when_no_group_of_the_kind_crosses_a_node",
     [("for d in DIMS[DIMS.index(moving[0]):])", "for d in moving)")]),

    ("09.4", "the busy seconds over 1 - bubble",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("max(busy) / (1 - bubble)", "max(busy) * (1 + bubble)")]),
    ("09.4", "with overlap, the first forward's and last backward's crossings",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("2 * (pp - 1) if hide", "(pp - 1) if hide")]),
    ("09.4", "without, every microbatch's at pp x virtual - 1 boundaries",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("(pp * virtual - 1)", "(pp - 1)")]),
    ("09.4", "none at pp = 1",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("(pp > 1) * boundary", "boundary")]),
    ("09.4", "the slowest rank",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("max(busy) / (1 - bubble)", "sum(busy) / len(busy) / (1 - bubble)")]),
    ("09.4", "plus the fill",
     "test_the_pipeline_span_idles_the_slowest_rank_the_bubble_plus_the_fill_and_drain",
     [("/ (1 - bubble) + fill, fill", "/ (1 - bubble), fill")]),
]


@dataclass(frozen=True)
class Change:
    """A blank (rule None: every proof runs) or a body that breaks one rule (its proof runs)."""
    exercise: str
    rule: str | None
    edits: tuple[tuple[str, str], ...] = ()
    proof: str | None = None

    @property
    def node_ids(self) -> tuple[str, ...]:
        exercise = workshop.BY_ID[self.exercise]
        return exercise.node_ids if self.rule is None else (f"{exercise.test_file}::{self.proof}",)

    @property
    def meets(self) -> set[str]:
        """The exercises whose code the tests it runs run."""
        return {i for node in self.node_ids for i in RAN.get(node, ())}


CHANGES = [Change(e.id, None) for e in EXERCISES] + [Change(e, rule, tuple(edits), proof)
                                                     for e, rule, proof, edits in RULES]


def copies(changes: list[Change]) -> list[list[Change]]:
    """First fit: a copy takes a change when its exercise has none there yet and no test run for one
    change of the copy runs another's exercise's code, so that each failure is its own change's."""
    grouped: list[list[Change]] = []
    for change in changes:
        for group in grouped:
            if all(other.exercise != change.exercise and other.exercise not in change.meets
                   and change.exercise not in other.meets for other in group):
                group.append(change)
                break
        else:
            grouped.append([change])
    return grouped


COPIES = copies(CHANGES)


def planted_bodies(change: Change) -> dict[str, str]:
    """The exercise's bodies as the course has them -> as planted: each right text, exactly once in the
    bodies, replaced by the wrong one. Parsed here, in the suite's thread, never in the grading's: two
    threads in Python 3.11's ast at once corrupt its recursion count (a .ci/run's grading thread raised
    "AST constructor recursion depth mismatch", and every graded test failed)."""
    source = (COURSE / workshop.BY_ID[change.exercise].file).read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    spans = [workshop.body_span(source, workshop.function_node(tree, name))[:2]
             for name in workshop.BY_ID[change.exercise].names]
    planted = {body: body for body in ("".join(lines[first - 1:last]) for first, last in spans)}
    for right, wrong in change.edits:
        found = [body for body, now in planted.items() if right in now]
        assert sum(now.count(right) for now in planted.values()) == 1, \
            f"{change.exercise}: {right!r} is not in it once"
        planted[found[0]] = planted[found[0]].replace(right, wrong)
    return planted


def plant(copy: Path, change: Change, planted: dict[str, str]) -> None:
    """The planted bodies in the copy, in place of the course's (each there once: a copy blanks other
    exercises only)."""
    file = copy / workshop.BY_ID[change.exercise].file
    source = file.read_text()
    for body, now in planted.items():
        assert source.count(body) == 1, f"{change.exercise}: a body is not in {file.name} once"
        source = source.replace(body, now)
    file.write_text(source)


class Grading:
    """The check sessions the graded tests read: copy k (COPIES[k]: its exercises blanked or planted)
    graded with the proofs its changes run, and "solved": two exercises on the course itself.

    They start in the background as soon as the suite is collected (conftest's pytest_collection_finish
    calls start_in_background): one at a time beside the rest of the suite, whose one-process tests
    (the Triton interpreter, the planner) leave a core idle, then two at a time once a test waits for
    them. Measured on 2 cores (2026-12-02): the suite without this file took 720 s with 32% of the two
    cores idle; the whole suite 1,055 s, where .ci/run had taken 1,323 s waiting for the grading at its
    end (c3c1dff).
    Two at once is the most: three took as long on two cores (304 s for all, 291 s, with fewer copies),
    and seven at once on CI's two cores made a proof's call wait past the grader's minute (13x an idle
    machine's time)."""

    def __init__(self) -> None:
        self.graded: dict[int | str, subprocess.CompletedProcess] = {}
        self.at_once = 1
        self.thread: threading.Thread | None = None
        self.pending: list[int | str] = []
        self.planted: dict[tuple[int, str], dict[str, str]] = {}  # (copy, exercise): planted_bodies
        self.failure: BaseException | None = None
        self.closing = threading.Event()
        self.cleanup = contextlib.ExitStack()
        self.check_timeout = CHECK_TIMEOUT

    def start(self, sessions: set[int | str]) -> None:
        """Grade these sessions (copy numbers, "solved"), in ALL_SESSIONS' order."""
        if self.thread is None:
            self.pending = [name for name in ALL_SESSIONS if name in sessions]
            self.planted = {(name, change.exercise): planted_bodies(change) for name in self.pending
                            if name != "solved" for change in COPIES[name] if change.rule is not None}
            self.thread = threading.Thread(target=self._grade, name="workshop grading", daemon=True)
            self.thread.start()

    def results(self) -> dict[int | str, subprocess.CompletedProcess]:
        """The results of the sessions started (all of them if none was), waiting for those still to
        run, two at a time."""
        self.at_once = 2
        self.start(set(ALL_SESSIONS))
        self.thread.join()
        if self.failure is not None:
            raise self.failure
        return self.graded

    def close(self) -> None:
        """At the session's end: the sessions still running are killed, then their copies deleted."""
        self.closing.set()
        if self.thread is not None:
            self.thread.join()
        self.cleanup.close()

    def _command(self, name: int | str) -> tuple:
        if name == "solved":
            return ("check", *SOLVED)
        group = COPIES[name]
        # Not tmp_path_factory's folders: another pytest run of this user may delete them meanwhile.
        copy = Path(self.cleanup.enter_context(tempfile.TemporaryDirectory(prefix="workshop-"))) / "copy"
        blank = [change.exercise for change in group if change.rule is None]
        assert run_workshop("copy", copy, "--exercises", ",".join(blank)).returncode == 0
        for change in group:
            if change.rule is not None:
                plant(copy, change, self.planted[name, change.exercise])
        proofs = [f"--proof={node}" for change in group for node in change.node_ids]
        return ("check", *(change.exercise for change in group), "--copy", copy, *proofs)

    @staticmethod
    def _start(command: tuple) -> WorkshopRun:
        return WorkshopRun(*command)

    def _finished_or_overdue(self, run: WorkshopRun) -> bool:
        return run.proc.poll() is not None or time.monotonic() > run.started + self.check_timeout

    def _grade(self) -> None:
        """The next session starts as soon as one ends (or overruns CHECK_TIMEOUT), whichever it is:
        waiting for the one started first left a slot idle while a long session ran (339 s for all,
        291 s). A failure (a copy not made, a session overdue) stops the grading and every session."""
        running: dict[int | str, WorkshopRun] = {}
        try:
            while (self.pending or running) and not self.closing.is_set():
                for name in [name for name, run in running.items() if self._finished_or_overdue(run)]:
                    self.graded[name] = running.pop(name).result(self.check_timeout)
                while self.pending and len(running) < self.at_once and not self.closing.is_set():
                    name = self.pending.pop(0)
                    running[name] = self._start(self._command(name))
                    self.cleanup.callback(running[name].stop)  # before its copy is deleted
                self.closing.wait(0.2)
        except BaseException as failure:  # noqa: BLE001 - the waiting test raises it
            self.failure = failure
        finally:
            for run in running.values():
                run.stop()


ALL_SESSIONS = (*range(len(COPIES)), "solved")
GRADING = pytest.StashKey[Grading]()


def grading(config: pytest.Config) -> Grading:
    """This pytest session's grading, made on first use and closed at the session's end."""
    if GRADING not in config.stash:
        config.stash[GRADING] = Grading()
        config.add_cleanup(config.stash[GRADING].close)
    return config.stash[GRADING]


def start_in_background(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Called by conftest once the suite is collected, with this module's tests that will run: the
    sessions they read (-k 04.2: the 5 copies of its blank and its 4 rules, of 21)."""
    sessions = set().union(*(sessions_read(item) for item in items if "graded" in item.fixturenames))
    if sessions:
        grading(config).start(sessions)


def sessions_read(item: pytest.Item) -> set[int | str]:
    """The check sessions a graded test reads: its blank's copy, its change's copy, or "solved"
    (every session for a graded test not named here)."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if item.originalname == "test_every_proof_fails_on_its_exercises_blank_naming_it":
        return {copy_of(Change(params["exercise_id"], None))}
    if item.originalname == "test_a_body_that_breaks_one_rule_fails_its_proof":
        return {copy_of(params["change"])}
    if item.originalname == "test_a_solved_exercise_passes_its_check":
        return {"solved"}
    return set(ALL_SESSIONS)


@pytest.fixture(scope="module")
def graded(pytestconfig) -> dict[int | str, subprocess.CompletedProcess]:
    return grading(pytestconfig).results()


def copy_of(change: Change) -> int:
    return next(k for k, group in enumerate(COPIES) if change in group)


def test_each_change_is_in_one_copy_alone_with_its_proofs_and_each_rules_proof_is_a_proof():
    """A failure in a copy is its own change's: no two changes of a copy share an exercise, and no
    test run for one runs the other's exercise's code. (So there are more copies than the 12 changes of
    08.3, the most of one exercise: a lesson's tests often run several of its exercises, whose changes
    then never share a copy.)"""
    for change in CHANGES:
        assert set(change.node_ids) <= set(workshop.BY_ID[change.exercise].node_ids), change
    assert sorted(map(repr, (c for group in COPIES for c in group))) == sorted(map(repr, CHANGES))
    for group in COPIES:
        for one in group:
            for other in group:
                if one is not other:
                    assert one.exercise != other.exercise and one.exercise not in other.meets, (one, other)


@pytest.mark.parametrize("exercise_id", list(workshop.BY_ID))
def test_every_proof_fails_on_its_exercises_blank_naming_it(graded, exercise_id):
    exercise = workshop.BY_ID[exercise_id]
    group = COPIES[copy_of(Change(exercise_id, None))]
    result = graded[copy_of(Change(exercise_id, None))]
    assert result.returncode == 1, result.stdout + result.stderr
    assert_one_line_each(result, len(group), {node for change in group for node in change.node_ids})
    lines = proof_lines(result.stdout, exercise.node_ids)
    for node in exercise.node_ids:
        owners, status, detail = lines[node]
        assert owners == exercise.id and status == "FAILED", lines[node]
        assert re.fullmatch(rf"\(([\d.]+ s|not collected)\)  NotImplementedError: Exercise {exercise.id}: "
                            rf"{re.escape(exercise.title)}", detail), lines[node]
    n = len(exercise.proofs)
    assert f"{exercise.id} {exercise.title}: 0 of {n} proofs passed, {n} did not" in result.stdout


def test_a_solved_exercise_whose_proof_runs_a_blank_one_is_blocked_by_it_not_failed(tmp_path):
    """In a copy where 04.1 is blank, 04.2's body (the course's) is right, but its proof builds each
    schedule with 04.1's order: a participant who does 04.2 first reads BLOCKED by 04.1, not a failure
    of their own (the review's --all copy said FAILED, naming 04.1's NotImplementedError)."""
    copy = tmp_path / "copy"
    assert run_workshop("copy", copy, "--exercises", "04.1").returncode == 0
    result = run_workshop("check", "04.2", "--copy", copy, timeout=CHECK_TIMEOUT)
    [node] = workshop.BY_ID["04.2"].node_ids
    owners, status, detail = proof_lines(result.stdout, [node])[node]
    assert (result.returncode, owners, status) == (1, "04.2", "BLOCKED"), result.stdout
    assert detail.endswith("NotImplementedError: Exercise 04.1: the order of forwards and backwards on a rank")
    assert "0 of 1 proofs passed, 1 did not (1 blocked by 04.1, still blank here: write it first)" in result.stdout


@pytest.mark.parametrize("change", CHANGES[len(EXERCISES):], ids=[f"{c.exercise} {c.rule}" for c in CHANGES[len(EXERCISES):]])
def test_a_body_that_breaks_one_rule_fails_its_proof(graded, change):
    """Its check says not yet, the proof named with its error (not a blank's, not a hang's wait: a
    collective some rank never joins is a timeout in a minute)."""
    result = graded[copy_of(change)]
    [node] = change.node_ids
    owners, status, detail = proof_lines(result.stdout, [node])[node]
    assert owners == change.exercise and status == "FAILED", f"{change}: the proof passed:\n{result.stdout}"
    assert "NotImplementedError" not in detail, detail
    assert "Error" in detail or detail.split("  ", 1)[-1].startswith(("assert", "timed out")), detail
    assert re.search(rf"^{re.escape(change.exercise)} .*: 0 of 1 proofs passed, 1 did not$", result.stdout, re.M)


class SleepingRun(WorkshopRun):
    """A session that never ends by itself (a process in its own session, as WorkshopRun's): the
    grading's own machinery under test, without a check session's minutes."""

    def __init__(self) -> None:
        self.command = [sys.executable, "-c", "import time; time.sleep(60)"]
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.command, stdout=self.out, stderr=self.err, start_new_session=True)
        self.started = time.monotonic()


class SleepingGrading(Grading):
    """A Grading whose sessions sleep (failing: the copy of that one cannot be made), two at a time; runs:
    the sessions it started. A subclass, not a patch of this module: the suite's own grading may still
    be running beside these tests."""

    def __init__(self, failing: int | None = None) -> None:
        super().__init__()
        self.failing = failing
        self.runs: list[SleepingRun] = []
        self.at_once = 2

    def _command(self, name: int | str) -> tuple:
        if name == self.failing:
            raise OSError(f"copy {name} could not be made")
        return ("check",)

    def _start(self, command: tuple) -> SleepingRun:
        self.runs.append(SleepingRun())
        return self.runs[-1]


def test_a_failure_in_the_grading_is_raised_by_the_waiting_test_and_stops_its_sessions():
    """The second session's copy cannot be made: results() raises that error, and the first session,
    started and still running, is stopped then, not at pytest's end."""
    grading = SleepingGrading(failing=1)
    grading.start({0, 1})
    with pytest.raises(OSError, match="copy 1 could not be made"):
        grading.results()
    assert len(grading.runs) == 1 and grading.runs[0].proc.poll() is not None
    grading.close()


def test_a_session_past_its_timeout_fails_the_waiting_test_and_stops_the_others():
    grading = SleepingGrading()
    grading.check_timeout = 1
    grading.start({0, 1})
    with pytest.raises(pytest.fail.Exception, match="did not finish in 1 s"):
        grading.results()
    assert len(grading.runs) == 2 and all(run.proc.poll() is not None for run in grading.runs)
    grading.close()


def test_closing_the_grading_stops_its_sessions_at_once():
    """pytest's end (or Ctrl-C) while sessions run: close() kills them and starts no other."""
    grading = SleepingGrading()
    grading.at_once = 1
    grading.start({0, 1, 2})
    deadline = time.monotonic() + 30  # a hang guard: the thread starts the first session at once
    while not grading.runs and time.monotonic() < deadline:
        time.sleep(0.05)
    closing = threading.Thread(target=grading.close, daemon=True)
    closing.start()
    closing.join(timeout=30)  # a hang guard: it takes well under a second
    assert not closing.is_alive(), "close() is still waiting for its sessions"
    assert len(grading.runs) == 1 and grading.runs[0].proc.poll() is not None and grading.pending == [1, 2]


SOLVED = ("04.2", "09.3")  # pure functions: a quick session


def test_a_solved_exercise_passes_its_check(graded):
    """On the course itself every proof passes: the suite runs them all (under `ci`: `grade` draws the
    first of the same examples), and tests/ran.py, which the audit keeps true, says which they are.
    The tool's answer when they pass, from the course itself: one line each, "solved", exit status 0."""
    result = graded["solved"]
    exercises = [workshop.BY_ID[i] for i in SOLVED]
    assert result.returncode == 0, result.stdout + result.stderr
    assert_one_line_each(result, len(exercises), {node for e in exercises for node in e.node_ids})
    lines = proof_lines(result.stdout, [node for e in exercises for node in e.node_ids])
    for e in exercises:
        assert all(lines[node][1] == "passed" for node in e.node_ids), result.stdout
        assert f"{e.id} {e.title}: {len(e.proofs)} of {len(e.proofs)} proofs passed\n" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("solved (")


def test_the_error_line_of_a_failure():
    """first_error_line on reports of the shapes the suite produces."""
    rank_failure = ("E   conftest.RankFailure: train_zero failed on ranks [0, 1] of 2 (timeout 120s):\n"
                    "E   --- rank 0 ---\nE   Traceback (most recent call last):\n"
                    'E     File "02_zero.py", line 3, in step\nE       raise RuntimeError("boom")\n'
                    "E   RuntimeError: boom\n")
    assert workshop.first_error_line(rank_failure) == "RuntimeError: boom (on a rank)"
    close = ("    torch.testing.assert_close(a, b)\nE   AssertionError: gradient of embed.weight: "
             "Tensor-likes are not close!\nE   \nE   Mismatched elements: 3 / 8 (37.5%)\n"
             "E   Greatest absolute difference: 0.03125 at index (1,) (up to 1e-06 allowed)\n")
    assert workshop.first_error_line(close) == ("AssertionError: gradient of embed.weight: Tensor-likes are "
                                                "not close! (greatest absolute difference 0.03125)")
    blank = "triton.runtime.errors.InterpreterError: NotImplementedError('Exercise 07.2: the recurrence')"
    assert workshop.first_error_line(blank) == "NotImplementedError: Exercise 07.2: the recurrence"
    assert workshop.first_error_line("E   assert 3 == 2\nE    +  where 2 = f()") == "assert 3 == 2"
    assert len(workshop.first_error_line("E   " + "x" * 500)) == 200


def test_the_error_line_names_the_first_rank_to_fail_and_a_collective_that_waits():
    """The harness lists failed ranks in the order they failed (test_course proves it), so the
    grade names the cause, not a peer's consequence; every rank silent at the call's limit (a
    collective some rank never joins: 06.1 with its all-to-all's splits swapped) is a timeout."""
    failed = ("E   conftest.RankFailure: step failed on ranks [1, 0] of 2 (timeout 60s):\nE   --- rank 1 ---\n"
              "E   Traceback (most recent call last):\nE   KeyError: 'expert 3'\nE   \nE   --- rank 0 ---\n"
              "E   Traceback (most recent call last):\nE   RuntimeError: Connection closed by peer\n")
    assert workshop.first_error_line(failed) == "KeyError: 'expert 3' (on a rank)"
    silent = ("E   conftest.RankFailure: step failed on ranks [0, 1] of 2 (timeout 60.0s):\nE   --- rank 0 ---\n"
              "E   no answer (waiting, e.g. in a collective that a peer never joined)\nE   --- rank 1 ---\n"
              "E   no answer (waiting, e.g. in a collective that a peer never joined)\n")
    assert workshop.first_error_line(silent) == "timed out: a collective waits for a rank (no answer in 60 s)"


def test_a_syntax_error_shows_its_message_place_and_caret():
    """A participant's syntax error fails the lesson's import, where the proofs are collected."""
    collected = ("tests/test_04_pipeline.py:33: in <module>\n    pipeline = importlib.import_module(...)\n"
                 'E     File "/copy/04_pipeline.py", line 195\nE       return (pp - 1) / (m + pp - 1 if x\n'
                 "E                         ^\nE   SyntaxError: '(' was never closed\n")
    assert workshop.first_error_line(collected) == ("SyntaxError: '(' was never closed (04_pipeline.py, line 195)"
                                                    "\n      return (pp - 1) / (m + pp - 1 if x"
                                                    "\n                        ^")


@pytest.mark.parametrize("outcomes, solved, line", [
    ("pp", True, "2 of 2 proofs passed"),
    ("ps", True, "1 of 2 proofs passed, 1 skipped"),
    ("ss", False, "0 of 2 proofs passed, 2 skipped: it cannot be graded on this machine"),
    ("pf", False, "1 of 2 proofs passed, 1 did not"),
    ("p-", False, "1 of 2 proofs passed, 1 did not"),  # a proof that never ran (not collected)
])
def test_an_exercise_is_solved_when_no_proof_fails_and_one_ran(outcomes, solved, line):
    """A proof skipped on this machine (a GPU's) proves nothing: all skipped is not solved."""
    made = {"p": workshop.ProofResult(passed=True), "s": workshop.ProofResult(skipped="Skipped: needs CUDA"),
            "f": workshop.ProofResult(passed=True, error="AssertionError"), "-": None}
    exercise = workshop.BY_ID["07.2"]
    assert workshop.verdict(exercise, [made[o] for o in outcomes]) == (solved, f"07.2 {exercise.title}: {line}")
