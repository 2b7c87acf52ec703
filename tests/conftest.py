"""The multi-rank test harness, and the hypothesis profiles.

Starting torch processes is slow on a small machine (8 gloo ranks take ~13 s on two cores), so a
pool of worker processes per world size is started once and kept for the whole session. A test
asks the pool to run a module-level function (of a numbered script or of a test module) on every
rank and gets the per-rank return values back:

    def test_something(rank_pool):
        results = rank_pool.run(4, some_module.some_function, arg, timeout=60)   # list, by rank

If a rank raises, the test fails with every failing rank's traceback; if a rank does not answer in
time (a collective that some rank never joined), the test fails naming the silent ranks and the
pool is replaced. Nothing hangs.

Hypothesis profiles: `ci` (the default; few examples, derandomized so CI is reproducible) and `dev`
(many more examples): HYPOTHESIS_PROFILE=dev python -m pytest tests
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
for path in (str(TESTS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

COLLECTIVE_TIMEOUT_S = 60  # inside the workers: a collective some rank never joins raises after this


class RankFailure(AssertionError):
    """Raised in the test process when some rank raised or did not answer."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors  # rank -> traceback text (or "no answer")


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue,
            sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while (task := tasks.get()) is not None:
        call_id, fn, args, kwargs = task
        try:
            results.put((call_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure must reach the test process
            results.put((call_id, rank, False, traceback.format_exc()))


class RankPool:
    """world_size gloo worker processes that run functions on request."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.healthy = True
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = importlib.import_module("01_ddp").free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results, list(sys.path)))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0

    def run(self, fn: Callable, *args: Any, timeout: float = 120, **kwargs: Any) -> list[Any]:
        self.calls += 1
        call_id = self.calls
        for q in self.tasks:
            q.put((call_id, fn, args, kwargs))
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size and time.monotonic() < deadline:
            try:
                cid, rank, ok, value = self.results.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    break
                continue
            if cid == call_id:
                answers[rank] = (ok, value)
        errors = {r: v for r, (ok, v) in answers.items() if not ok}
        errors.update({r: "no answer (dead, or waiting in a collective)"
                       for r in range(self.world_size) if r not in answers})
        if errors:
            self.healthy = len(answers) == self.world_size and all(
                "ValueError" in tb for tb in errors.values())
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)} of {self.world_size}"
                              f" (timeout {timeout}s):\n{detail}", errors)
        return [answers[r][1] for r in range(self.world_size)]

    def close(self, deadline: float) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # e.g. stuck in a collective that timed out on a peer
                p.kill()


class RankPools:
    """One pool per world size, started on first use; a pool that lost a rank is replaced."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable, *args: Any, timeout: float = 120,
            **kwargs: Any) -> list[Any]:
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = RankPool(world_size)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        except RankFailure:
            # Validation errors raised by every rank before any collective leave the group usable;
            # anything else (a timeout, a rank stuck in a collective) may not.
            if not pool.healthy:
                pool.close(deadline=time.monotonic() + 1)
                del self.pools[world_size]
            raise

    def close(self) -> None:
        deadline = time.monotonic() + 1
        for pool in self.pools.values():
            pool.close(deadline)


@pytest.fixture(scope="session")
def rank_pool():
    pools = RankPools()
    yield pools
    pools.close()
