"""The multi-rank test harness, and the hypothesis profiles.

Starting torch processes is slow on a small machine (8 spawned gloo ranks take ~13 s on two cores,
most of it each one importing torch), so the workers are forked from a server that imported torch
once, and a pool of them per world size is started once and kept for the whole session. A test
asks the pool to run a module-level function (of a numbered script or of a test module) on every
rank and gets the per-rank return values back:

    def test_something(rank_pool):
        results = rank_pool.run(4, some_module.some_function, arg)   # list, by rank

If a rank raises, the test fails with every failing rank's traceback, and the ranks leave their
process groups (with whatever the call left in flight) for a fresh one; if a rank does not answer in
time (a collective that some rank never joined; after a rank failed, within FAILURE_GRACE_S), the
test fails naming the silent ranks and the pool is replaced. Nothing hangs. After a call that every
rank finished, they destroy the groups it made: an idle gloo group still polls its sockets.

Hypothesis profiles: `ci` (the default; few examples, derandomized so CI is reproducible), `dev`
(many more examples): HYPOTHESIS_PROFILE=dev python -m pytest tests, and `grade` (tests/workshop.py's
check: fewer examples, no shrinking, one failure reported: a verdict, not a diagnosis).

A test module may start slow work in the background once the suite is collected
(pytest_collection_finish): tests/test_workshop.py's grading runs beside the other files' tests.

`--lessons DIR` runs the suite on the lessons of DIR (a workshop copy, tests/workshop.py) instead of
this course's: in this process, in the rank pools' workers, and in the scripts run_script starts.

The lessons are imported with a record at the top of each exercise's function (tests/proofs.py), here
and in the workers: at the session's end, every test that passed and ran an exercise's code must be
one of its proofs (tests/exercises.py), and every proof that passed must have run it; else the
session fails, the findings listed in its summary. `--no-proof-audit`: plain imports, no audit
(tests/workshop.py's check, which grades with the proofs and needs no list of them).
"""
from __future__ import annotations

import datetime
import importlib
import importlib.abc
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, settings

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
for path in (str(TESTS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import proofs  # noqa: E402 - from TESTS, on the path now

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("grade", max_examples=5, deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Timeouts turn a hang into a failure; they never judge speed. An idle 2-core machine runs the slowest
# awaited call (lesson 09's 16-rank mesh, its pool's start-up, 09's `check` demo) in under a minute, a
# loaded one 5-10x slower (a load average of 30 was seen), and more helpers may share it: each limit
# leaves 10x over the loaded time. A hang costs that wait, once.
COLLECTIVE_TIMEOUT_S = 600  # inside the workers: a collective some rank never joins raises after this
CALL_TIMEOUT_S = 600        # a call on every rank of a pool (its start-up too)
SCRIPT_TIMEOUT_S = 900      # a lesson run as `python 0X_name.py`
REJOIN_TIMEOUT_S = 60       # the ranks of a pool leaving their groups after a failed call, joining anew
LEAVE_SUBGROUPS = b"leave the call's groups"  # a task: not a pickled call
# After one rank of a call fails, the others answer within this or never: a rank left in a collective
# with the failed one waits for it until the collective's own timeout. Their own errors (a check every
# rank makes before any collective) come within milliseconds; 15 s leaves room for a loaded machine.
FAILURE_GRACE_S = 15
LESSON_NAME = re.compile(r"\d\d_\w+")


class _LessonFinder(importlib.abc.MetaPathFinder):
    """Imports every lesson ("02_zero") from one folder, whatever sys.path says (a test module may
    put the course's own folder first)."""

    def __init__(self, folder: Path, recorded: bool) -> None:
        self.folder = folder
        self.recorded = recorded

    def find_spec(self, name, path=None, target=None):
        if path is not None or not LESSON_NAME.fullmatch(name):
            return None
        file = self.folder / f"{name}.py"
        if not file.is_file():  # never the course's own lesson in its place
            raise ModuleNotFoundError(f"no {file.name} in {self.folder}", name=name)
        loader = proofs.Loader(name, str(file)) if self.recorded else None
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def use_lessons(folder: Path, recorded: bool) -> None:
    """Lessons come from folder from now on, in this process, with their exercises' records if
    recorded; the pools' workers and run_script follow ROOT. Called before any test module imports
    a lesson (pytest_configure)."""
    global ROOT, RECORDED
    ROOT = folder
    RECORDED = recorded
    sys.path.insert(0, str(folder))
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LessonFinder)]
    sys.meta_path.insert(0, _LessonFinder(folder, recorded))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lessons", type=Path, metavar="DIR",
                     help="import the lessons from DIR (a workshop copy) instead of this course's folder")
    parser.addoption("--call-timeout", type=float, default=CALL_TIMEOUT_S, metavar="SECONDS",
                     help="the longest a call on the ranks may take, whatever a test asks (the workshop's "
                          "grading: a collective some rank never joins fails in a minute, not ten)")
    parser.addoption("--no-proof-audit", action="store_true",
                     help="import the lessons as they are, without their exercises' records, and skip the "
                          "audit of tests/ran.py at the session's end")
    parser.addoption("--update-ran", action="store_true",
                     help="write what the tests that passed ran into tests/ran.py instead of auditing it")


RECORDED = False  # the lessons' exercises record which test ran them (tests/proofs.py)


class ProofAudit:
    """A plugin: which test (or fixture) is running, so that the exercises record into its set;
    which tests were collected and passed; at the session's end, proofs.audit's findings fail it."""

    def __init__(self, update: bool) -> None:
        self.update = update
        self.outside: set[str] = set()  # ran while no test ran: a module's top level
        proofs.record_into(self.outside)
        self.by_test: dict[str, set[str]] = {}
        self.by_fixture: dict[object, set[str]] = {}
        self.collected: set[str] = set()
        self.passed: set[str] = set()
        self.findings: list[str] = []

    @staticmethod
    def name(nodeid: str, path) -> str:
        """"test_01_ddp.py::test_x[a]", whatever the root pytest runs from."""
        return f"{Path(path).name}::{nodeid.split('::', 1)[1]}"

    def pytest_itemcollected(self, item) -> None:
        self.collected.add(self.name(item.nodeid, item.path))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item):
        proofs.record_into(self.by_test.setdefault(self.name(item.nodeid, item.path), set()))
        try:
            return (yield)
        finally:
            proofs.record_into(self.outside)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        before = proofs.record_into(self.by_fixture.setdefault(fixturedef, set()))
        try:
            return (yield)
        finally:
            proofs.record_into(before)

    def pytest_runtest_logreport(self, report) -> None:
        name = self.name(report.nodeid, report.fspath)
        if report.when == "call" and report.passed:
            self.passed.add(name)
        elif report.failed:
            self.passed.discard(name)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        ran_by = {}
        for item in session.items:
            runs = set(self.by_test.get(self.name(item.nodeid, item.path), ()))
            for name in item.fixturenames:  # a fixture set up for an earlier test ran for this one too
                for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ())[-1:]:
                    runs |= self.by_fixture.get(fixturedef, set())
            ran_by[self.name(item.nodeid, item.path)] = runs
        if self.update:
            proofs.write(ran_by, self.passed, self.collected)
            return
        self.findings = proofs.audit(ran_by, self.passed, self.collected, self.outside)
        if self.findings and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.findings:
            terminalreporter.section("what the tests ran is not tests/ran.py (python -m pytest tests "
                                     "--update-ran writes it)", red=True)
            for line in self.findings:
                terminalreporter.line(line)


@pytest.hookimpl(trylast=True)  # after hypothesis's plugin has loaded --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    folder = config.getoption("--lessons")
    audited = not config.getoption("--no-proof-audit") and settings.get_current_profile_name() == "ci"
    if folder is not None or audited:
        use_lessons((folder or ROOT).resolve(), recorded=audited)
    if audited:
        config.pluginmanager.register(ProofAudit(config.getoption("--update-ran")), "proof-audit")


def pytest_collection_finish(session: pytest.Session) -> None:
    """A test module may start slow work of its own as soon as the suite is collected, to run beside
    the tests before it: conftest calls its start_in_background(config, items), items being its tests
    that will run (tests/test_workshop.py's grading: subprocesses on the core that the suite's
    one-process tests leave idle). Not when nothing runs (--collect-only, --setup-plan)."""
    if session.config.option.collectonly or session.config.option.setupplan:
        return
    by_module: dict[Any, list[pytest.Item]] = {}
    for item in session.items:
        by_module.setdefault(getattr(item, "module", None), []).append(item)
    for module, items in by_module.items():
        if hasattr(module, "start_in_background"):
            module.start_in_background(session.config, items)


class RankFailure(AssertionError):
    """Raised in the test process when some rank raised or did not answer."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors  # rank -> traceback text (or "no answer")


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue,
            sys_path: list[str], lessons: str, compiled: dict[str, bytes] | None) -> None:
    sys.path[:] = sys_path
    use_lessons(Path(lessons), recorded=compiled is not None)
    proofs.use_compiled(compiled or {})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    # Kept for the rejoins: a client connecting anew after each failed call waited 5 s in TCPStore's connect
    # in 20 of 294 rejoins of two blanked workshop copies graded at once (100 s of their 100-110 s each).
    pool_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    results.put(("ready", rank, "ok", b"", ()))
    while (task := tasks.get()) is not None:
        call_id, payload = task
        if payload is None:
            results.put(_rejoin(call_id, rank, world_size, pool_store))
            continue
        if payload == LEAVE_SUBGROUPS:
            results.put(_leave_subgroups(call_id, rank))
            continue
        ran: set[str] = set()  # the exercises this call runs: they go back with its result
        proofs.record_into(ran)
        try:
            fn, args, kwargs = pickle.loads(payload)
            # Pickled here, not in the queue's feeder thread, where a failure would vanish silently.
            results.put((call_id, rank, "ok", pickle.dumps(fn(*args, **kwargs)), tuple(ran)))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the test process
            # A ValueError is a validation error raised before any collective: the group is intact.
            status = "invalid" if isinstance(exc, ValueError) else "error"
            results.put((call_id, rank, status, traceback.format_exc(), tuple(ran)))


def _leave_subgroups(call_id: str, rank: int) -> tuple:
    """Destroy every group but the default one, once every rank has finished the call that made them
    (nothing is in flight on them then). Each gloo group keeps a thread that wakes every millisecond: a
    pool whose calls had made 64 groups kept its idle workers at 7% of a core each, and the suite's
    pools together took about a core from the tests, which ran 2-8x slower in the suite than alone."""
    import torch.distributed as dist

    try:
        for group in [g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD]:
            dist.destroy_process_group(group)
        return call_id, rank, "ok", b"", ()
    except BaseException:  # noqa: BLE001 - then the pool is replaced
        return call_id, rank, "error", traceback.format_exc(), ()


def _rejoin(call_id: str, rank: int, world_size: int, pool_store) -> tuple:
    """Leave every process group, with whatever a failed call left on them (operations in flight or
    half-matched), and join a fresh default group through the pool's store: the processes, their
    imports and torch stay, at a fraction of a second (a new pool costs seconds a rank)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.PrefixStore(call_id, pool_store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        return call_id, rank, "ok", b"", ()
    except BaseException:  # noqa: BLE001 - then the pool is replaced
        return call_id, rank, "error", traceback.format_exc(), ()


def _start_method() -> mp.context.BaseContext:
    """multiprocessing's forkserver, its server preloaded with torch: a worker starts as a fork of it,
    torch already imported (4 ranks measured 1.7-3.2 s against 7.8-14.2 s spawned, on a busy 2-core
    machine), yet never a fork of the test process and its threads. The server imports torch only: the
    lessons come from ROOT in each worker, and triton must wait for 01_ddp's interpreter switch."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class RankPool:
    """world_size gloo worker processes that run functions on request."""

    def __init__(self, world_size: int, startup_timeout: float = CALL_TIMEOUT_S) -> None:
        ctx = _start_method()
        self.world_size = world_size
        self.healthy = True
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        import torch.distributed as dist

        # Every rank joins this store (01_ddp.launch's way): its port is never free for another process.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self.store.port
        compiled = proofs.compiled(ROOT) if RECORDED else None
        self.procs = [ctx.Process(target=_worker, daemon=True, args=(r, world_size, port, self.tasks[r], self.results,
                                                                     list(sys.path), str(ROOT), compiled))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0
        # Start-up (the process, its imports, the rendezvous) must not eat into the first call's timeout.
        ready = self._collect("ready", startup_timeout)
        if len(ready) < world_size:
            self.close(deadline=time.monotonic() + 1)
            raise RankFailure(f"a pool of {world_size} ranks did not start in {startup_timeout}s: "
                              f"{self._silent(ready)}", {})

    def _collect(self, call_id, timeout: float) -> dict[int, tuple[str, Any]]:
        """rank -> (status "ok" | "invalid" | "error", pickled result or traceback)."""
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size and time.monotonic() < deadline:
            try:
                cid, rank, status, value, ran = self.results.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    break
                continue
            if cid == call_id:
                answers[rank] = (status, value)
                proofs.record_all(ran)
                if status != "ok":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return answers

    def _silent(self, answers: dict) -> dict[int, str]:
        return {r: ("no answer (waiting, e.g. in a collective that a peer never joined)"
                    if p.is_alive() else f"no answer (process died, exit code {p.exitcode})")
                for r, p in enumerate(self.procs) if r not in answers}

    def run(self, fn: Callable, *args: Any, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        payload = pickle.dumps((fn, args, kwargs))  # an unpicklable argument fails here, loudly
        self.calls += 1
        for q in self.tasks:
            q.put((self.calls, payload))
        answers = self._collect(self.calls, timeout)
        silent = self._silent(answers)
        failed = {r: tb for r, (status, tb) in answers.items() if status != "ok"}
        if silent or failed:
            # Reusable if every failing rank raised a validation error before any collective (and all
            # then left the groups the call made), or if every rank answered and all rejoined a fresh
            # group; a silent rank (a timeout, a rank stuck in a collective) may never answer: the
            # pool is replaced.
            if silent:
                self.healthy = False
            elif all(status != "error" for status, _ in answers.values()):
                self.healthy = not self._leave_subgroups()
            else:
                self.healthy = self._rejoin()
            # In the order the ranks failed (answers arrive in that order), then the silent ones: the
            # first is the cause, the others often its consequence (a peer's collective broke).
            errors = {**failed, **silent}
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items())
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)} of {self.world_size}"
                              f" (timeout {timeout}s):\n{detail}", errors)
        not_left = self._leave_subgroups()
        if not_left:
            self.healthy = False
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in not_left.items())
            raise RankFailure(f"ranks {sorted(not_left)} of {self.world_size} did not leave the call's groups:\n"
                              f"{detail}", not_left)
        return [pickle.loads(answers[r][1]) for r in range(self.world_size)]

    def _ask_every_rank(self, what: str, payload: bytes | None) -> dict[int, tuple[str, Any]]:
        """A task of the harness's own (not a call) on every rank: their answers in time."""
        self.calls += 1
        call_id = f"{what} {self.calls}"
        for q in self.tasks:
            q.put((call_id, payload))
        return self._collect(call_id, REJOIN_TIMEOUT_S)

    def _leave_subgroups(self) -> dict[int, str]:
        """After a call every rank finished: every rank destroys the groups it made (_leave_subgroups).
        Returns the ranks that did not: rank -> traceback, or why it was silent."""
        answers = self._ask_every_rank("leave", LEAVE_SUBGROUPS)
        return {**{r: tb for r, (status, tb) in answers.items() if status != "ok"}, **self._silent(answers)}

    def _rejoin(self) -> bool:
        """Every rank leaves its groups and joins a fresh one (_rejoin): True if all did in time."""
        answers = self._ask_every_rank("rejoin", None)
        return len(answers) == self.world_size and all(status == "ok" for status, _ in answers.values())

    def close(self, deadline: float) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # e.g. stuck in a collective that timed out on a peer
                p.kill()
                p.join()
        for q in [*self.tasks, self.results]:
            q.cancel_join_thread()  # never block the test process on data for a dead worker


class RankPools:
    """One pool per world size, started on first use; a pool that lost a rank is replaced. No call
    waits longer than call_timeout (--call-timeout), whatever its test asks."""

    def __init__(self, call_timeout: float = CALL_TIMEOUT_S) -> None:
        self.pools: dict[int, RankPool] = {}
        self.call_timeout = call_timeout

    def run(self, world_size: int, fn: Callable, *args: Any, timeout: float = CALL_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = RankPool(world_size)
        try:
            return pool.run(fn, *args, timeout=min(timeout, self.call_timeout), **kwargs)
        except RankFailure:
            # Validation errors raised by every rank before any collective leave the group usable;
            # anything else (a timeout, a rank stuck in a collective) may not.
            if not pool.healthy:
                pool.close(deadline=time.monotonic() + 1)
                del self.pools[world_size]
            raise

    def expect_invalid(self, world_size: int, fn: Callable, *args: Any, match: str,
                       timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> None:
        """Assert that fn raises a ValueError matching `match` on every rank: a size check that runs
        before any collective, so that no rank is left waiting for the others."""
        with pytest.raises(RankFailure) as failure:
            self.run(world_size, fn, *args, timeout=timeout, **kwargs)
        assert sorted(failure.value.errors) == list(range(world_size)), failure.value
        for tb in failure.value.errors.values():
            assert "ValueError" in tb and re.search(match, tb), tb

    def close(self) -> None:
        deadline = time.monotonic() + 1
        for pool in self.pools.values():
            pool.close(deadline)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_script(script: str, *args: str, timeout: float = SCRIPT_TIMEOUT_S) -> str:
    """`python <script> <args>` as a reader runs it (its own local ranks, on the CPU even on a GPU
    machine); its whole process group is killed if it overruns. Asserts exit 0 and no resource
    tracker's warning at exit (a semaphore a rank left behind); returns stdout."""
    # a reader's shell, not a torchrun rank's: a RANK left exported would wait for a world that is gone
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES
           and not name.startswith("TORCHELASTIC_")} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr
    assert "resource_tracker" not in stderr, stderr
    return stdout


@pytest.fixture(scope="session")
def rank_pool(pytestconfig):
    pools = RankPools(pytestconfig.getoption("--call-timeout"))
    yield pools
    pools.close()
