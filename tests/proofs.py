"""Which exercise's code each test runs: recorded while the suite runs, checked at its end.

An exercise's proofs are derived, not picked: the tests of its lesson's own test file that run its
code (tests/exercises.py reads them from tests/ran.py, which the suite writes). conftest imports
every lesson through `Loader`, which compiles it with one statement added at the top of each
exercise's function, after its docstring (no line moves): `__exercise_ran__("02.1")` adds the id
to what the running test ran (a fixture being set up: every test that uses the fixture ran it). In
a rank pool's worker a call's ids travel back with its result (conftest). Lessons compiled this way
are never written to __pycache__, where a plain import would meet them.

Triton's device functions (07's _key_range, _query_range, _attend) never run as this Python code:
Triton compiles them again from their source text. In its interpreter (no GPU) each call is a call
of an object of the lesson's module, whose class then records it (_record_device_calls); compiled
for a GPU it runs where Python cannot see, so there the audit leaves those exercises out.

At a session's end (the `ci` hypothesis profile: `dev` draws other examples, the grader's `grade`
runs the proofs only), `audit` lists every test that passed and ran other exercises than its entry
in tests/ran.py says; `--update-ran` writes them there instead. Not recorded: the lessons a test
runs as scripts (run_script, subprocess: new processes without this harness), whose demos print
what the in-process tests prove.
"""
from __future__ import annotations

import ast
import importlib.machinery
import marshal
import types
from pathlib import Path

from torch.compiler import is_compiling

import ran
from exercises import EXERCISES
from workshop import function_node

RAN_FILE = Path(ran.__file__)
RECORD = "__exercise_ran__"
_now: set[str] = set()  # what the code running now records into
unrecorded: set[str] = set()  # exercises whose code runs where it cannot be seen (compiled Triton)


def record(exercise_id: str) -> None:
    if not is_compiling():  # traced by torch.compile: a side effect would break its graph
        _now.add(exercise_id)


def record_all(ids) -> None:
    """What a rank pool's call ran (its ids, back with its result)."""
    _now.update(ids)


def record_into(ids: set[str]) -> set[str]:
    """From now on the lessons' exercises record into ids; returns what they recorded into before."""
    global _now
    before, _now = _now, ids
    return before


# ----------------------------------------------------------------------------------------------
# The lessons, compiled with a record at the top of each exercise
# ----------------------------------------------------------------------------------------------


def _is_kernel(node: ast.FunctionDef) -> bool:
    """A Triton function: its decorator names jit."""
    return any("jit" in ast.dump(decorator) for decorator in node.decorator_list)


def instrument(source: str, lesson: str) -> ast.Module:
    """The lesson's syntax tree with a record at the top of each of its exercises' functions."""
    tree = ast.parse(source)
    for exercise in (e for e in EXERCISES if e.file == lesson):
        for name in exercise.names:
            node = function_node(tree, name)
            if _is_kernel(node):
                continue
            first = int(ast.get_docstring(node, clean=False) is not None and len(node.body) > 1)
            call = ast.Call(ast.Name(RECORD, ast.Load()), [ast.Constant(exercise.id)], [])
            node.body.insert(first, ast.copy_location(ast.Expr(call), node.body[first]))
    return ast.fix_missing_locations(tree)


def _record_device_calls(module) -> None:
    """In Triton's interpreter a device function is an object whose call runs it (from the source it
    compiles again): its class becomes one that records each call first."""
    for exercise in (e for e in EXERCISES if e.file == f"{module.__name__}.py"):
        for name in exercise.names:
            function = getattr(module, name, None)
            if "." in name or isinstance(function, types.FunctionType):
                continue  # Python's own: its record is compiled in
            if type(function).__name__ == "InterpretedFunction":
                function.__class__ = _recording(type(function), exercise.id)
            else:
                unrecorded.add(exercise.id)


def _recording(base: type, exercise_id: str) -> type:
    class Recorded(base):
        def __call__(self, *args, **kwargs):
            record(exercise_id)
            return super().__call__(*args, **kwargs)
    return Recorded


_compiled: dict[str, bytes] = {}  # a lesson's path -> its code with records, marshalled


def compiled(folder: Path) -> dict[str, bytes]:
    """Every lesson of folder compiled with its records: the workers get them ready (each would
    compile the lessons it imports again, a fraction of a second per rank a pool starts)."""
    for path in sorted(folder.glob("[0-9][0-9]_*.py")):
        if str(path) not in _compiled:
            code = compile(instrument(path.read_text(), path.name), str(path), "exec", dont_inherit=True)
            _compiled[str(path)] = marshal.dumps(code)
    return _compiled


def use_compiled(codes: dict[str, bytes]) -> None:
    _compiled.update(codes)


class Loader(importlib.machinery.SourceFileLoader):
    """A lesson compiled with its records."""

    def get_code(self, fullname: str):
        path = Path(self.path)
        return marshal.loads(compiled(path.parent)[str(path)])

    def exec_module(self, module) -> None:
        setattr(module, RECORD, record)
        super().exec_module(module)
        _record_device_calls(module)


# ----------------------------------------------------------------------------------------------
# The audit, and tests/ran.py written from what ran
# ----------------------------------------------------------------------------------------------


def audit(ran_by: dict[str, set[str]], passed: set[str], collected: set[str], outside: set[str]) -> list[str]:
    """One line per difference between tests/ran.py and this session. ran_by: test
    ("test_01_ddp.py::test_x[a]") -> the exercises it ran; passed: the tests that passed (only they
    ran all they run); collected: every test collected; outside: the exercises run outside any test
    (at a module's top level, where a blank would fail the import of every test of the file)."""
    findings = [f"{', '.join(sorted(outside))} ran outside any test (at a module's top level): a blank "
                f"would fail every test that imports it"] if outside else []
    for test in sorted(passed):
        runs, listed = ran_by.get(test, set()) - unrecorded, set(ran.RAN.get(test, ())) - unrecorded
        if runs - listed:
            findings.append(f"{test} runs {', '.join(sorted(runs - listed))}, not in its entry")
        if listed - runs:
            findings.append(f"{test} never ran {', '.join(sorted(listed - runs))} of its entry")
    files = {test.split("::")[0] for test in collected}
    for test in sorted(set(ran.RAN) - collected):
        if test.split("::")[0] in files:
            findings.append(f"{test} is no test of its file any more")
    return findings


def write(ran_by: dict[str, set[str]], passed: set[str], collected: set[str]) -> None:
    """tests/ran.py with the entries of the tests that passed here as they ran; the others as they
    were (a test not run here, or that failed); none for a test its file no longer has."""
    files = {test.split("::")[0] for test in collected}
    entries = {test: ids for test, ids in ran.RAN.items()
               if test in collected or test.split("::")[0] not in files}
    for test in passed:
        runs = (ran_by.get(test, set()) - unrecorded) | (set(entries.pop(test, ())) & unrecorded)
        if runs:
            entries[test] = tuple(sorted(runs))
    lines = [f"    {test!r}: {ids!r}," for test, ids in sorted(entries.items())]
    RAN_FILE.write_text(f'"""{ran.__doc__}"""\n\nRAN = {{\n' + "".join(f"{line}\n" for line in lines) + "}\n")
