"""The workshop: participants write the heart of each lesson, and the course's own tests grade it.

    python tests/workshop.py list [ID ...]                     the exercises; with ids, their tasks
    python tests/workshop.py copy DIR [--exercises 02.1,04.1 | --all]
    python tests/workshop.py check ID [ID ...] [--copy DIR] [--proof NODE_ID ...]   (--all: every exercise)

copy writes the course (README.md, requirements.txt, the lessons, tests/) into DIR, new or empty, with
each chosen exercise's bodies replaced by their full-line comments and raise NotImplementedError(
"Exercise 02.1: ..."): signature, decorators and docstring stay, and every other byte. Later lessons
import the exercised functions as before, so they work once the exercise is solved.

check runs an exercise's proofs (tests/exercises.py) on the lessons of DIR: by default the course
this tests/ folder belongs to, so a participant runs it inside their copy, and an instructor grades any
copy with the course's own tests (--copy DIR). One pytest session in this process: conftest's
--lessons DIR, the `grade` hypothesis profile (few examples, no shrinking), and a plugin that prints
one line per proof as it finishes: passed, or the first line of its error (with the greatest
difference when tensors differ); BLOCKED where the error is another exercise's blank, whose code the
proof runs too (write that one first). Run from the course itself, check grades the solutions: all pass.

Exit status: 0 every proof passed, 1 some did not, 2 bad usage (one line on stderr, nothing written).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shutil
import signal
import sys
import time
import tokenize
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from exercises import EXERCISES, Exercise

TESTS = Path(__file__).resolve().parent
COURSE = TESTS.parent
LESSONS = tuple(sorted(path.name for path in COURSE.glob("[0-9][0-9]_*.py")))
BY_ID = {exercise.id: exercise for exercise in EXERCISES}
BLANK = re.compile(r'raise NotImplementedError\("(Exercise \d\d\.\d): ')


class UsageError(Exception):
    """A command that cannot run: reported in one line, exit status 2, nothing written."""


# ----------------------------------------------------------------------------------------------
# Blanking: a function's body after its docstring becomes its comments and a raise
# ----------------------------------------------------------------------------------------------


def function_node(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The function or method `qualname` ("ZeRO._gather", "conjugate.Conjugate.forward")."""
    scope: list[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(f"{qualname}: no {part!r} there")
        scope = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"{qualname} is not a function")
    return node


def comment_lines(source: str) -> set[int]:
    """Line numbers (1-based) that hold only a comment."""
    lines = source.splitlines()
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and not lines[token.start[0] - 1][:token.start[1]].strip()}


def body_span(source: str, node: ast.FunctionDef) -> tuple[int, int, str]:
    """(first, last) 1-based lines of the body after its docstring, and the body's indentation."""
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    code = body[1:] if has_doc else body
    if not code or code[0].lineno == node.lineno:
        raise LookupError(f"{node.name} has no body of its own lines to blank")
    lines = source.splitlines()
    if has_doc:
        first = body[0].end_lineno + 1
    else:  # the body's leading comments belong to it: back up to the signature's last line
        first = code[0].lineno
        while lines[first - 2].strip() == "" or lines[first - 2].lstrip().startswith("#"):
            first -= 1
    indent = lines[code[0].lineno - 1][:code[0].col_offset]
    return first, code[-1].end_lineno, indent


def blank(source: str, exercises: list[Exercise]) -> str:
    """source with the exercises' functions blanked; every other line as it was, byte for byte."""
    tree, comments = ast.parse(source), comment_lines(source)
    spans = sorted((*body_span(source, function_node(tree, name)), exercise)
                   for exercise in exercises for name in exercise.names)
    lines = source.splitlines(keepends=True)
    for (_, last, _, _), (first, _, _, _) in zip(spans, spans[1:]):
        if first <= last:
            raise LookupError("two blanked bodies overlap")
    for first, last, indent, exercise in reversed(spans):
        hints = [f"{indent}{lines[i - 1].strip()}\n" for i in range(first, last + 1) if i in comments]
        raise_line = f'{indent}raise NotImplementedError("Exercise {exercise.id}: {exercise.title}")\n'
        lines[first - 1:last] = [*hints, raise_line]
    return "".join(lines)


# ----------------------------------------------------------------------------------------------
# The commands
# ----------------------------------------------------------------------------------------------


def select(ids: list[str]) -> list[Exercise]:
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        raise UsageError(f"unknown exercise {', '.join(unknown)}: the exercises are {', '.join(BY_ID)}")
    return [BY_ID[i] for i in dict.fromkeys(ids)]


def course_files(root: Path) -> list[Path]:
    """What a copy holds, relative to the course: README, requirements, the lessons, the tests."""
    return [Path("README.md"), Path("requirements.txt"), *map(Path, LESSONS),
            *(Path("tests") / p.name for p in sorted((root / "tests").glob("*.py")))]


def blanked_in(folder: Path) -> list[str]:
    """The exercises whose raise is still in folder's lessons (a participant's to-do list)."""
    return sorted({m.group(1)[len("Exercise "):] for name in LESSONS if (folder / name).is_file()
                   for m in BLANK.finditer((folder / name).read_text())})


def copy(dest: Path, exercises: list[Exercise]) -> None:
    if blanked_in(COURSE):
        raise UsageError(f"{COURSE} is itself a workshop copy (exercises {', '.join(blanked_in(COURSE))} are "
                         f"blank): make copies from the course")
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} is a file, not a folder: copy writes into a new or empty folder")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} is not an empty folder: copy writes into a new or empty one, and "
                         f"overwrites nothing")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{dest} cannot be created ({type(error).__name__}: {error.strerror})") from None
    by_file = defaultdict(list)
    for exercise in exercises:
        by_file[exercise.file].append(exercise)
    blanked = {name: blank((COURSE / name).read_bytes().decode(), chosen) for name, chosen in by_file.items()}
    for path in course_files(COURSE):
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        if path.name in blanked:
            (dest / path).write_bytes(blanked[path.name].encode())
            shutil.copymode(COURSE / path, dest / path)
        else:
            shutil.copy2(COURSE / path, dest / path)
    chosen = ", ".join(e.id for e in exercises) or "none (the course as it is)"
    print(f"wrote the course into {dest}; exercises blanked: {chosen}")
    if exercises:
        minutes = sum(e.minutes for e in exercises)
        print(f"about {minutes} minutes of work; a participant runs, inside the copy:\n"
              f"    python tests/workshop.py list {exercises[0].id}\n"
              f"    python tests/workshop.py check {exercises[0].id}")


def list_exercises(exercises: list[Exercise], detailed: bool) -> None:
    todo = set(blanked_in(COURSE))
    for e in exercises:
        needs = f"  (its proofs also run {', '.join(e.needs)})" if e.needs else ""  # not an order: both ways
        mark = "  [to do in this copy]" if e.id in todo else ""
        print(f"{e.id}  {e.minutes:>3} min  {e.title}{needs}{mark}")
        if detailed:
            print(f"    {e.file}: {', '.join(e.names)}")
            for label, text in (("task", e.task), ("hint", e.hint)):
                print(f"    {label}: {text}")
            print("    proofs (python tests/workshop.py check " + e.id + "):")
            for node_id in e.node_ids:
                print(f"      {node_id}")
    if not detailed:
        print(f"{len(exercises)} exercises, {sum(e.minutes for e in exercises)} minutes in all; "
              f"`list ID` gives an exercise's task")


# ----------------------------------------------------------------------------------------------
# Grading: the proofs, one pytest session, one line each
# ----------------------------------------------------------------------------------------------

EXERCISE_ERROR = re.compile(r"Exercise \d\d\.\d: [^\n'\"\\)]*")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt)\b")
GREATEST = re.compile(r"Greatest absolute difference: (\S+)")
WHERE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
CALL_TIMEOUT = re.compile(r"\(timeout ([\d.]+)s\)")
# A proof's call on the ranks waits at most GRADE_CALL_TIMEOUT_S (the pool then starts anew), and a proof
# at most PROOF_TIMEOUT_S in all: the proofs' calls take seconds on an idle machine, so both leave 10x
# over a loaded one, and a participant's hang (a collective one rank never joins, a loop) is a verdict
# in a minute or two, not a wait.
GRADE_CALL_TIMEOUT_S, PROOF_TIMEOUT_S = 60, 300


def blank_of(error: str | None) -> str | None:
    """The exercise whose blank raised a proof's error (first_error_line's), or None."""
    found = re.match(r"NotImplementedError: Exercise (\d\d\.\d):", error or "")
    return found and found.group(1)


def first_error_line(text: str, width: int = 200) -> str:
    """The line of a failure's report that says what went wrong: a blank exercise, else the first
    error message (on the rank pool: of the rank that failed first; every rank silent: a timeout),
    with the greatest difference when tensors were compared. A syntax error where a lesson is
    imported: its message and place, then the line and its caret, indented below."""
    if found := EXERCISE_ERROR.search(text):
        return f"NotImplementedError: {found.group(0).strip()}"
    reported = [line[1:] for line in text.splitlines() if line.startswith("E ")]
    errors = [line.strip() for line in reported]
    if errors and (where := WHERE.fullmatch(errors[0])):
        end = next((i for i, line in enumerate(errors) if EXCEPTION_LINE.match(line)), len(errors) - 1)
        shown = [line for line in reported[1:end] if line.strip()]
        indent = min((len(line) - len(line.lstrip()) for line in shown), default=0)
        return (f"{errors[end]} ({Path(where['file']).name}, line {where['line']})"
                + "".join(f"\n      {line[indent:]}" for line in shown))
    lines = errors or [line.strip() for line in text.splitlines() if line.strip()][-1:] or ["(no message)"]
    line = lines[0]
    if "RankFailure" in line:
        on_rank = [l for l in lines[1:] if EXCEPTION_LINE.match(l)]
        if on_rank:
            line = f"{on_rank[0]} (on a rank)"
        elif any(l.startswith("no answer (waiting") for l in lines) and (limit := CALL_TIMEOUT.search(line)):
            line = f"timed out: a collective waits for a rank (no answer in {float(limit.group(1)):g} s)"
    if (greatest := GREATEST.search(text)) and "difference" not in line:
        line += f" (greatest absolute difference {greatest.group(1)})"
    return line if len(line) <= width else line[:width - 3] + "..."


def each_line_marked(text: str) -> str:
    """pytest's "line" style marks an exception's first line "E" and indents the others by 4; its
    long style, which first_error_line reads, marks each line."""
    lines, inside = [], False
    for line in text.splitlines():
        inside = line.startswith("E ") or (inside and line.startswith("    "))
        lines.append("E" + line[1:] if inside else line)
    return "\n".join(lines)


@dataclass
class ProofResult:
    seconds: float = 0.0
    passed: bool = False
    error: str | None = None
    skipped: str | None = None


@dataclass
class Grader:
    """A pytest plugin: records each proof's outcome and prints its line when it finishes."""
    owners: dict[str, list[str]]  # node id -> the exercises it proves
    out: object
    results: dict[str, ProofResult] = field(default_factory=lambda: defaultdict(ProofResult))
    collect_errors: dict[str, str] = field(default_factory=dict)  # test file -> error line
    held_errors: dict[str, str] = field(default_factory=dict)  # node id -> a blank's error its test caught

    def pytest_collection_modifyitems(self, config, items: list) -> None:
        """Only the proofs run. They are chosen here, not named on the command line: a test file that
        cannot be imported (a blank called while the module loads) would end the whole session."""
        chosen = [item for item in items if item.nodeid in self.owners]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in self.owners])
        items[:] = chosen

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors[report.nodeid.split("::")[0]] = first_error_line(report.longreprtext)

    def pytest_runtest_makereport(self, item, call) -> None:
        """A blank's error that the test caught and holds in a local (a test that expects a RuntimeError
        catches the blank's NotImplementedError, or returns its message), which the report's error
        lines do not show: each local as --showlocals shows it. The report is "line" style, since
        pytest's long style (source and locals) parsed each failure's files anew: 60 of a blanked
        copy's 86 s."""
        from _pytest._io.saferepr import saferepr

        if call.excinfo is None:
            return
        for entry in call.excinfo.traceback:
            for value in entry.locals.values():
                if found := EXERCISE_ERROR.search(saferepr(value)):
                    self.held_errors.setdefault(item.nodeid, f"NotImplementedError: {found.group(0).strip()}")
                    return

    def pytest_runtest_logreport(self, report) -> None:
        result = self.results[report.nodeid]
        result.seconds += report.duration
        if report.failed and result.error is None:
            result.error = (self.held_errors.get(report.nodeid)
                            or first_error_line(each_line_marked(report.longreprtext)))
        elif report.skipped:
            result.skipped = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "skipped"
        elif report.when == "call" and report.passed:
            result.passed = True

    def pytest_runtest_setup(self, item) -> None:
        """Arm the proof's alarm (its setup starts rank pools: it counts too); teardown disarms it."""
        def expire(signum, frame):
            raise TimeoutError(f"timed out: the proof ran past {PROOF_TIMEOUT_S} s (a loop that never ends?)")
        signal.signal(signal.SIGALRM, expire)
        signal.alarm(PROOF_TIMEOUT_S)

    def pytest_runtest_teardown(self, item) -> None:
        signal.alarm(0)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.write(nodeid, self.results[nodeid])

    def line(self, nodeid: str, result: ProofResult | None) -> str:
        owners = ",".join(self.owners.get(nodeid, ["?"]))
        if result is None:
            error = self.collect_errors.get(nodeid.split("::")[0])
            if error:  # its test file failed to import: the proof fails
                return f"{owners}  FAILED   {nodeid}  (not collected)  {error}"
            return f"{owners}  not run  {nodeid}  not run (not collected)"
        if result.error:
            status = "BLOCKED" if blank_of(result.error) not in (None, *owners.split(",")) else "FAILED "
            return f"{owners}  {status}  {nodeid}  ({result.seconds:.1f} s)  {result.error}"
        if result.skipped:
            return f"{owners}  skipped  {nodeid}  {result.skipped}"
        return f"{owners}  passed   {nodeid}  ({result.seconds:.1f} s)"

    def write(self, nodeid: str, result: ProofResult | None) -> None:
        print(self.line(nodeid, result), file=self.out, flush=True)


def verdict(exercise: Exercise, results: list[ProofResult | None]) -> tuple[bool, str]:
    """Solved: no proof failed and at least one passed (a proof skipped here, a GPU's, proves
    nothing); the exercise's line of the grade."""
    passed = sum(bool(r and r.passed and not r.error) for r in results)
    skipped = sum(bool(r and r.skipped and not r.passed and not r.error) for r in results)
    failed = len(results) - passed - skipped
    blockers = [blank_of(r.error) for r in results if r and blank_of(r.error) not in (None, exercise.id)]
    blocked = ""
    if blockers:
        blanks = ", ".join(sorted(set(blockers)))
        blocked = f" ({len(blockers)} blocked by {blanks}, still blank here: write it first)"
    return failed == 0 and passed > 0, (
        f"{exercise.id} {exercise.title}: {passed} of {len(results)} proofs passed"
        + (f", {failed} did not{blocked}" if failed else "") + (f", {skipped} skipped" if skipped else "")
        + ("" if passed or failed else ": it cannot be graded on this machine"))


def is_copy(folder: Path) -> bool:
    return folder.is_dir() and all((folder / name).is_file() for name in LESSONS)


def check(exercises: list[Exercise], folder: Path, only: list[str] | None = None) -> int:
    """Grade exercises on folder's lessons with their proofs, or (only) with those of their proofs
    named there, by node id as `list ID` prints it."""
    if not is_copy(folder):
        missing = [name for name in LESSONS if not (folder / name).is_file()]
        raise UsageError(f"{folder} is not a workshop copy: it lacks {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more lessons" if len(missing) > 3 else ""))
    chosen = {node_id for exercise in exercises for node_id in exercise.node_ids}
    if unknown := [node_id for node_id in only or () if node_id not in chosen]:
        raise UsageError(f"{unknown[0]} is not a proof of {', '.join(e.id for e in exercises)} "
                         f"(python tests/workshop.py list ID shows them)")
    import pytest  # here: list and copy need no test framework

    owners: dict[str, list[str]] = defaultdict(list)
    for exercise in exercises:
        for node_id in exercise.node_ids:
            if only is None or node_id in only:
                owners[node_id].append(exercise.id)
    out, captured = sys.stdout, io.StringIO()
    grader = Grader(owners, out)
    print(f"checking {', '.join(e.id for e in exercises)} on the lessons of {folder}", flush=True)
    start = time.perf_counter()
    # --lessons=DIR as one argument: pytest looks for conftests in every argument that is a folder
    test_files = dict.fromkeys(node_id.split("::")[0] for node_id in owners)
    args = [*(str(TESTS / name) for name in test_files), f"--lessons={folder}", f"--rootdir={TESTS}",
            "-p", "no:cacheprovider", "--hypothesis-profile=grade", "--continue-on-collection-errors", "-q",
            f"--call-timeout={GRADE_CALL_TIMEOUT_S}", "--no-proof-audit",
            "--tb=line"]  # each failure's error lines, not its source: see Grader.pytest_runtest_makereport
    with contextlib.redirect_stdout(captured):
        code = pytest.main(args, plugins=[grader])
    for node_id in owners:  # what never ran (a lesson that does not import, a proof that is gone)
        if node_id not in grader.results:
            grader.write(node_id, None)
    if code == pytest.ExitCode.USAGE_ERROR or code == pytest.ExitCode.INTERNAL_ERROR:
        said = captured.getvalue().splitlines()
        reason = next((l for l in said if l.startswith(("ERROR", "INTERNALERROR"))), f"exit code {int(code)}")
        print(f"pytest could not run the proofs: {reason}", file=out)
    verdicts = [verdict(exercise, [grader.results.get(n) for n in exercise.node_ids if n in owners])
                for exercise in exercises]
    for solved, line in verdicts:
        print(line, file=out)
    solved = all(solved for solved, _ in verdicts)
    print(f"{'solved' if solved else 'not yet'} ({time.perf_counter() - start:.0f} s)", file=out)
    return 0 if solved else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workshop.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the exercises, with times; with ids, each one's task")
    listing.add_argument("ids", nargs="*", help="exercise ids such as 02.1")
    copying = commands.add_parser("copy", help="write the course into a new or empty folder, exercises blank")
    copying.add_argument("dest", type=Path, help="the folder to write")
    which = copying.add_mutually_exclusive_group()
    which.add_argument("--exercises", default="", help="comma-separated ids to blank, e.g. 02.1,04.1")
    which.add_argument("--all", action="store_true", help="blank every exercise")
    checking = commands.add_parser("check", help="run the proofs of exercises on a copy's lessons")
    checking.add_argument("ids", nargs="*", help="exercise ids such as 02.1")
    checking.add_argument("--all", action="store_true", help="every exercise")
    checking.add_argument("--copy", type=Path, default=COURSE,
                          help="the folder whose lessons are graded (default: the course of this tests/)")
    checking.add_argument("--proof", action="append", metavar="NODE_ID",
                          help="run only this proof (as `list ID` prints it; repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            list_exercises(select(args.ids) if args.ids else list(EXERCISES), detailed=bool(args.ids))
            return 0
        if args.command == "copy":
            ids = list(BY_ID) if args.all else [i for i in args.exercises.split(",") if i]
            copy(args.dest.resolve(), select(ids))
            return 0
        if not args.ids and not args.all:
            raise UsageError("check needs exercise ids (python tests/workshop.py list shows them) or --all")
        return check(list(EXERCISES) if args.all else select(args.ids), args.copy.resolve(), args.proof)
    except UsageError as error:
        print(f"workshop.py: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
