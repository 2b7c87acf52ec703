"""The workshop (tests/workshop.py, tests/exercises.py): copies with exercises blanked, graded by the
course's own proofs.

What is proved here, and why this way (the suite must stay within ~10 minutes on 2 cores, so the
proofs of every exercise are not run twice each):
- the list: two to four exercises per lesson (its files together), each naming functions of its lesson
  that have a body to write, proofs that are tests of the lesson's test file, needs that come earlier
  (read from the sources: no process starts);
- blanking changes exactly the chosen bodies: the blanked module's syntax tree is the original's with
  those bodies replaced by (docstring, raise), nothing else; the body's full-line comments stay;
- a copy with no exercise is the course byte for byte, so a solved exercise (its body written back)
  is the course's own code;
- every proof of every exercise fails on its blank, naming the exercise, and passes solved: a few
  pytest sessions, not one per exercise. Two each blank a wave of exercises whose needs are written
  in their copy (the first wave those that need none, the second the rest), so a proof meets its own
  exercise's blank first; one grades every exercise on the course itself, the solutions;
- a plausible wrong answer for every exercise (and the ones a review found graded "solved": 01.1
  for the world group, 02.2 without a replicated share, 08.1 with e4m3's maximum for both formats or
  its floor added, 06.1 with the all-to-all's splits swapped, which hung) fails its check, the proof
  named on each line: planted in copies where no planted exercise's proofs run another's code;
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
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import workshop
from exercises import EXERCISES

TESTS = Path(workshop.__file__).resolve().parent
COURSE = TESTS.parent
PROOF_LINE = re.compile(r"^(?P<owners>\d\d\.\d(?:,\d\d\.\d)*)  (?P<status>passed|FAILED|skipped|not run) +"
                        r"(?P<node>\S+)  (?P<detail>.*)$")
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


def proof_lines(stdout: str) -> dict[str, tuple[str, str, str]]:
    """node id -> (owners, status, detail) from check's output."""
    found = {}
    for line in stdout.splitlines():
        if match := PROOF_LINE.match(line):
            found[match["node"]] = (match["owners"], match["status"], match["detail"])
    return found


def assert_one_line_each(result: subprocess.CompletedProcess, exercises: list) -> None:
    """A header, one line per proof, one per exercise, the verdict: no traceback anywhere."""
    proofs = {node for e in exercises for node in e.node_ids}
    assert len(result.stdout.splitlines()) == 1 + len(proofs) + len(exercises) + 1, result.stdout
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


# --- the list ----------------------------------------------------------------------------------

def test_two_to_four_exercises_per_lesson_each_a_function_with_a_body_and_real_proofs():
    ids = [e.id for e in EXERCISES]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"0[1-9]\.[1-9]", i) for i in ids)
    per_lesson = Counter(e.file[:2] for e in EXERCISES)
    lessons = sorted({name[:2] for name in workshop.LESSONS})
    assert sorted(per_lesson) == lessons and all(2 <= n <= 4 for n in per_lesson.values()), per_lesson
    seen = set()
    for e in EXERCISES:
        assert e.file[:2] == e.id[:2] and e.file in workshop.LESSONS, e.id
        assert not re.search(r"[\"'\\()]", e.title), f"{e.id}: the title goes into the raise's message"
        assert 1 <= e.minutes <= 60 and e.task and e.hint and e.proofs, e.id
        assert set(e.needs) <= seen, f"{e.id} needs an exercise listed after it"
        seen.add(e.id)
        source = (COURSE / e.file).read_text()
        for name in e.names:
            first, last, _ = workshop.body_span(source, workshop.function_node(ast.parse(source), name))
            assert first <= last, name
        tests = {node.name for node in ast.walk(ast.parse((TESTS / e.test_file).read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert {proof.split("[")[0] for proof in e.proofs} <= tests, f"{e.id}: a proof is not a test"


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


# --- grading: blanks fail their proofs; planted bugs fail; solved exercises pass ---------------------

def waves() -> list[list[str]]:
    """Exercises grouped so that none needs another of its group: depth 0 needs nothing, depth
    d needs exercises of depths < d only (solved in that wave's copy)."""
    depth: dict[str, int] = {}
    for e in EXERCISES:
        depth[e.id] = 1 + max((depth[n] for n in e.needs), default=-1)
    return [[i for i, d in depth.items() if d == level] for level in range(max(depth.values()) + 1)]


WAVES = waves()
# A plausible wrong answer for every exercise (the argument or case it could ignore, the slip it could
# make), planted in a copy where its exercise is otherwise written: (exercise, lesson, [(the right text in
# the exercise's body, the wrong one), ...]). Grouped into copies so that no planted exercise's proofs run
# another planted one's code (one per lesson, or ones whose proofs never meet, an exercise after those it
# needs): a failure is the exercise's own. Copy "second wave" blanks the second wave too, so it plants
# only first-wave exercises that none of the second wave needs.
WRONG = {
    "second wave": [  # the first wave's exercises that no second-wave exercise needs (its proofs run them)
        ("01.1", "01_ddp.py", [("all_reduce(param.grad, group=group)", "all_reduce(param.grad)"),
                               ("dist.get_world_size(group)", "dist.get_world_size()")]),  # the world's
        ("09.3", "09_full_train.py", [("gpus_per_node % block == 0", "block <= gpus_per_node")]),  # unaligned
        ("09.4", "09_full_train.py", [("max(busy) / (1 - bubble)", "max(busy) * (1 + bubble)")]),
    ],
    "wrong answers 1": [
        ("01.2", "01_ddp.py", [("params):\n                break", "params):\n                continue")]),
        ("02.2", "02_zero.py", [(".square() * weight", ".square()")]),  # a replicated share counted whole
        ("03.1", "03_tensor_parallel.py", [("return backward(grad, ctx.group), None",
                                            "return forward(grad, ctx.group), None")]),  # f's own backward
        ("04.1", "04_pipeline.py", [("min(m, pp - rank - 1)", "min(m, pp - rank)")]),  # a warm-up too many
        ("05.1", "05_context_parallel.py", [("lse_a - F.logsigmoid(diff)", "lse_a + F.logsigmoid(diff)")]),
        ("06.1", "06_expert_parallel.py", [("plan.recv_splits, plan.send_splits, plan.group)",
                                            "plan.send_splits, plan.recv_splits, plan.group)")]),  # swapped
        ("07.1", "07_flash_attention.py", [("start_m + shift + 1)", "start_m + shift)")]),  # the diagonal
        ("08.1", "08_fp8.py", [("fp8_max(dtype)) / amax", "fp8_max(E4M3)) / amax")]),  # e4m3's for both
        ("09.1", "09_full_train.py", [("for dim in reversed(DIMS):", "for dim in DIMS:")]),  # dp fastest
    ],
    "wrong answers 2": [
        ("02.1", "02_zero.py", [("if self.sync_gradients:\n            self._reduce_scatter(unit)",
                                 "self._reduce_scatter(unit)")]),  # reduce-scatters inside no_sync() too
        ("03.2", "03_tensor_parallel.py", [('logits = logits.masked_fill(ids >= vocab_size, float("-inf"))',
                                            "logits = logits")]),  # the padding's logits counted
        ("04.2", "04_pipeline.py", [("(virtual * m if schedule == \"interleaved\" else m)", "m")]),
        ("05.2", "05_context_parallel.py", [("(rank, 2 * self.cp - 1 - rank)", "(rank, self.cp + rank)")]),
        ("06.2", "06_expert_parallel.py", [("if param not in experts:\n            foundation.all_reduce",
                                            "if True:\n            foundation.all_reduce")]),  # experts too
        ("07.2", "07_flash_attention.py", [("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")]),
        ("08.2", "08_fp8.py", [("y.clamp(-fp8_max(dtype), fp8_max(dtype))", "y")]),  # no saturation
        ("09.2", "09_full_train.py", [("range(getattr(self, d)) for d in dims))",
                                       "range(getattr(self, d)) for d in reversed(dims)))")]),
    ],
    "wrong answers 3": [
        ("02.3", "02_zero.py", [("        self.units[index].release()\n", "")]),  # kept after its forward
        ("03.3", "03_tensor_parallel.py", [("f = GatherSequence if ctx.sequence_parallel else CopyToRegion",
                                            "f = CopyToRegion")]),  # SP ignored
        ("05.3", "05_context_parallel.py", [("_block_pairs(layout, me, owner, causal)",
                                             "_block_pairs(layout, me, owner, False)")]),  # the mask ignored
        ("08.3", "08_fp8.py", [(" / 2.0 ** self.margin", "")]),  # the margin ignored
    ],
    "wrong answers 4": [  # 08.1 again: 08.2 and 08.3 build on it, so alone
        ("08.1", "08_fp8.py", [("amax.float().clamp(min=AMAX_EPS)", "amax.float() + AMAX_EPS")]),  # floor added
    ],
}


def plant(copy: Path, exercise_id: str, file: str, changes: list[tuple[str, str]]) -> None:
    """Each right text, exactly once in the exercise's bodies, replaced by the wrong one."""
    for right, wrong in changes:
        source = (copy / file).read_text()
        lines = source.splitlines(keepends=True)
        spans = [workshop.body_span(source, workshop.function_node(ast.parse(source), name))[:2]
                 for name in workshop.BY_ID[exercise_id].names]
        bodies = ["".join(lines[first - 1:last]) for first, last in spans]
        assert sum(body.count(right) for body in bodies) == 1, f"{exercise_id}: {right!r} is not in it once"
        (first, last), body = next((span, body) for span, body in zip(spans, bodies) if right in body)
        (copy / file).write_text("".join(lines[:first - 1]) + body.replace(right, wrong) + "".join(lines[last:]))


@pytest.fixture(scope="module")
def graded() -> dict[str, tuple[list, subprocess.CompletedProcess]]:
    """Check sessions, by name: (the exercises it graded, its output). "first wave" blanks the first
    wave in a copy; "second wave" blanks the second in another, whose needs are written there, some
    of them wrong (WRONG); "wrong answers k" plant the other wrong answers in copies of the course;
    "solutions" grades every exercise on the course itself, where all are solved. Two run at once (a
    session's time is mostly its rank pools starting and gloo's waits); seven at once on CI's two
    cores made a proof's call wait past the grader's minute (13x an idle machine's time)."""
    assert len(WAVES) == 2, "two sessions for all the exercises: a third wave costs CI time, think first"
    assert {e for e, _, _ in WRONG["second wave"]} <= set(WAVES[0])
    assert sorted(e for wrongs in WRONG.values() for e, _, _ in wrongs) == sorted([*workshop.BY_ID, "08.1"])
    with contextlib.ExitStack() as cleanup:
        runs = {}
        for name in ("first wave", "second wave", *(k for k in WRONG if k.startswith("wrong"))):
            # Not tmp_path_factory's folders: another pytest run of this user may delete them meanwhile.
            copy = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="workshop-"))) / "copy"
            blank = {"first wave": WAVES[0], "second wave": WAVES[1]}.get(name, [])
            assert run_workshop("copy", copy, "--exercises", ",".join(blank)).returncode == 0
            for exercise_id, file, changes in WRONG.get(name, []):
                plant(copy, exercise_id, file, changes)
            ids = [*blank, *(e for e, _, _ in WRONG.get(name, []))]
            runs[name] = (ids, ("check", *ids, "--copy", copy))
        runs["solutions"] = (list(workshop.BY_ID), ("check", "--all"))
        graded, running = {}, []
        for name, (ids, command) in runs.items():
            running.append((name, ids, WorkshopRun(*command)))
            cleanup.callback(running[-1][2].stop)  # before its copy is deleted, if a session failed
            while len(running) == 2 or (running and name == "solutions"):
                done, ids_done, run = running.pop(0)
                graded[done] = ([workshop.BY_ID[i] for i in ids_done], run.result(CHECK_TIMEOUT))
        return graded


@pytest.mark.parametrize("wave", [0, 1], ids=["first wave", "second wave"])
def test_every_blanked_exercise_fails_each_of_its_proofs_naming_itself(graded, wave):
    exercises, result = graded[["first wave", "second wave"][wave]]
    assert result.returncode == 1, result.stdout + result.stderr
    assert_one_line_each(result, exercises)
    lines = proof_lines(result.stdout)
    for e in (workshop.BY_ID[i] for i in WAVES[wave]):
        for node in e.node_ids:
            owners, status, detail = lines[node]
            assert owners == e.id and status == "FAILED", lines[node]
            assert re.fullmatch(rf"\(([\d.]+ s|not collected)\)  NotImplementedError: Exercise {e.id}: "
                                rf"{re.escape(e.title)}", detail), lines[node]
        n = len(e.proofs)
        assert f"{e.id} {e.title}: 0 of {n} proofs passed, {n} did not" in result.stdout


@pytest.mark.parametrize("session, exercise_id", [(name, e) for name, wrongs in WRONG.items() for e, _, _ in wrongs])
def test_a_planted_wrong_answer_fails_its_check_naming_the_proof(graded, session, exercise_id):
    """Every exercise's proofs fail a plausible wrong answer, each failing proof named with its error
    (not a blank's, not a hang's wait: a collective some rank never joins is a timeout in a minute)."""
    _, result = graded[session]
    lines = proof_lines(result.stdout)
    failed = [node for node in workshop.BY_ID[exercise_id].node_ids if lines[node][1] == "FAILED"]
    assert failed, f"{exercise_id}: every proof passed a wrong answer:\n{result.stdout}"
    for node in failed:
        assert f"{exercise_id}  FAILED   {node}  (" in result.stdout
        assert "NotImplementedError" not in lines[node][2], lines[node]
        assert "Error" in lines[node][2] or lines[node][2].split("  ", 1)[-1].startswith(("assert", "timed out")), \
            lines[node]
    assert re.search(rf"^{re.escape(exercise_id)} .*: \d+ of \d+ proofs passed, \d+ did not$", result.stdout, re.M)


def test_every_solved_exercise_passes_its_check(graded):
    """Every exercise, graded on the course itself: its solution passes every proof."""
    exercises, result = graded["solutions"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert_one_line_each(result, exercises)
    lines = proof_lines(result.stdout)
    for e in exercises:
        assert all(lines[node][1] == "passed" for node in e.node_ids), result.stdout
        assert f"{e.id} {e.title}: {len(e.proofs)} of {len(e.proofs)} proofs passed\n" in result.stdout


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
