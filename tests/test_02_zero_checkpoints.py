"""Lesson 02's second file as a specification: a sharded checkpoint writes each element once, reads
back exactly what was written into any group size and stage, reading only the runs a rank holds, and
a damaged, foreign or unfinished one is one line naming what is wrong and what to resume from.
"""
from __future__ import annotations

import dataclasses
import errno
import importlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, run_script
from test_02_zero import freeze_some

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")
checkpoints = importlib.import_module("02_zero_checkpoints")

# --- pieces, each element once, slice reads, integrity ---------------------------------------------

def runs_of(mask: list[bool]) -> torch.Tensor:
    """The held elements of mask as runs (first, offset in the packed values, length)."""
    runs, packed = [], 0
    for first, group in itertools.groupby(range(len(mask)), key=lambda g: mask[g]):
        group = list(group)
        if first:
            runs.append([group[0], packed, len(group)])
            packed += len(group)
    return torch.tensor(runs, dtype=torch.int64).view(-1, 3)


@given(a=st.lists(st.booleans(), min_size=1, max_size=40), b=st.lists(st.booleans(), min_size=1, max_size=40))
def test_overlaps_are_the_elements_two_pieces_share(a, b):
    """overlaps plans a read by binary searches: the same (offset in a, offset in b) pairs as
    comparing every element."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    where_a = {g: i for i, g in enumerate(g for g in range(n) if a[g])}
    where_b = {g: i for i, g in enumerate(g for g in range(n) if b[g])}
    expected = [(where_a[g], where_b[g]) for g in range(n) if a[g] and b[g]]
    shared = checkpoints.overlaps(runs_of(a), runs_of(b)).tolist()
    assert [(i + k, j + k) for i, j, length in shared for k in range(length)] == expected


def save_one(folder, step: int, pieces: list, config: dict | None = None, **kwargs) -> Path:
    return checkpoints.save_checkpoint(folder, step, [(piece, {"params": values}) for piece, values in pieces],
                                       {}, config or {}, **kwargs)


def read_whole(folder, name: str, shape: tuple[int, ...], config: dict | None = None) -> torch.Tensor:
    reader = checkpoints.CheckpointReader(*checkpoints.open_checkpoint(folder, config or {}))
    return reader.read(checkpoints.whole_piece(name, shape), ("params",))["params"].view(shape)


def test_another_model_configuration_and_uncovered_or_doubled_elements_are_refused(tmp_path):
    cfg = foundation.ModelConfig(vocab_size=256, dim=16, n_heads=2, ffn_dim=32)
    rows = checkpoints.whole_piece("w", (4, 3)).narrow(0, 6)  # rows 0-1 of 4
    save_one(tmp_path, 1, [(rows, torch.ones(6))], checkpoints.checkpoint_config(cfg))
    other = checkpoints.checkpoint_config(foundation.ModelConfig(vocab_size=256, dim=32, n_heads=2, ffn_dim=32,
                                                          seed=5))
    with pytest.raises(ValueError, match=r"another model configuration: dim=16 \(this model: 32\); refusing"):
        checkpoints.open_checkpoint(tmp_path, other)
    with pytest.raises(ValueError, match="do not cover every element of w exactly once"):
        read_whole(tmp_path, "w", (4, 3), checkpoints.checkpoint_config(cfg))
    with pytest.raises(ValueError, match=r"w was saved with shape \(4, 3\), not \(3, 4\)"):
        read_whole(tmp_path, "w", (3, 4), checkpoints.checkpoint_config(cfg))
    save_one(tmp_path / "twice", 1, [(rows, torch.ones(6)), (checkpoints.whole_piece("w", (4, 3)), torch.ones(12))])
    with pytest.raises(ValueError, match="do not cover every element of w exactly once"):
        read_whole(tmp_path / "twice", "w", (4, 3))
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        checkpoints.open_checkpoint(tmp_path / "nothing", {})


def test_a_fresh_run_saving_at_an_earlier_runs_step_replaces_it(tmp_path):
    for value in (1.0, 7.0):  # two runs into one folder, each saving at step 200
        save_one(tmp_path, 200, [(checkpoints.whole_piece("w", (6,)), torch.full((6,), value))])
    assert torch.equal(read_whole(tmp_path, "w", (6,)), torch.full((6,), 7.0))


def resume_with(step: int) -> str:
    return f"train.py --resume {step}"


def test_the_previous_complete_checkpoint_and_the_steps_left_without_latest_are_named(tmp_path):
    """Three kept, the newest damaged: the advice names the one before it, not the oldest kept. LATEST
    deleted while steps 3 and 6 are complete: the steps found, and the command that continues."""
    three, piece = tmp_path / "three", checkpoints.whole_piece("w", (6,))
    for step in (1, 2, 3):
        save_one(three, step, [(piece, torch.full((6,), step))], keep=(1, 2))
    size = (three / "step_00000003" / "rank00000.pt").stat().st_size
    os.truncate(three / "step_00000003" / "rank00000.pt", 10)
    with pytest.raises(checkpoints.CheckpointError) as error:
        checkpoints.open_checkpoint(three, {}, resume_command=resume_with)
    assert str(error.value) == (
        f"checkpoint step 3 ({three / 'step_00000003'}) cannot be used: rank00000.pt has 10 bytes where "
        f"meta.json records {size:,}; the previous complete checkpoint is step 2 "
        f"({three / 'step_00000002'}); resume from it: train.py --resume 2")
    for step in (3, 6):
        save_one(tmp_path / "six", step, [(piece, torch.full((6,), step))], keep=(3,))
    (tmp_path / "six" / "LATEST").unlink()
    (tmp_path / "six" / "step_00000009").mkdir()  # a save killed before its meta.json: not complete
    with pytest.raises(checkpoints.CheckpointError) as error:
        checkpoints.open_checkpoint(tmp_path / "six", {}, resume_command=resume_with)
    assert str(error.value) == (f"{tmp_path / 'six'} has no LATEST file (each save writes it last, naming "
                                f"its step); the complete checkpoints there are steps 3, 6: resume from the "
                                f"last: train.py --resume 6")


KILLED_SAVE = """
import importlib, os, signal, sys, torch
checkpoints = importlib.import_module("02_zero_checkpoints")
folder, where = sys.argv[1:]
kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
save = lambda step, exchange: checkpoints.save_checkpoint(
    folder, step, [(checkpoints.whole_piece("w", (1000,)), {"params": torch.full((1000,), float(step))})],
    {}, {}, exchange=exchange)
save(1, lambda x: [x])
if where == "writing":
    torch.save = lambda obj, f: (f.write(b"half a file"), kill())
save(2, kill)  # "exchange": every rank file is written, meta.json and LATEST not yet
"""


@pytest.mark.parametrize("where", ["writing", "exchange"])
def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, where):
    """Nothing written half is picked up (a rank file is written aside and renamed, LATEST moves
    last); the next run's remove_unfinished_saves deletes what the kill left."""
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), where], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = tmp_path / "step_00000002" / ("rank00000.pt.tmp" if where == "writing" else "rank00000.pt")
    assert partial.exists(), "the process died inside the second save"
    assert checkpoints.open_checkpoint(tmp_path, {})[1]["step"] == 1
    assert torch.equal(read_whole(tmp_path, "w", (1000,)), torch.ones(1000))
    (tmp_path / "step_00000001" / "rank00003.pt.tmp").write_bytes(b"a kill inside an earlier save at step 1")
    assert checkpoints.remove_unfinished_saves(tmp_path) == ["step_00000001/rank00003.pt.tmp", "step_00000002"]
    left = sorted(p.name for p in tmp_path.rglob("*"))
    assert left == ["LATEST", "meta.json", "rank00000.pt", "step_00000001"]
    assert torch.equal(read_whole(tmp_path, "w", (1000,)), torch.ones(1000))


def failing_save(obj, f):
    f.write(b"half a file")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("failure", ["a full disk", "a file where the step's folder goes",
                                     "rank 1 fails", "LATEST cannot be replaced"])
def test_a_save_that_fails_is_one_line_naming_the_folder_the_error_and_the_last_complete_step(
        tmp_path, monkeypatch, failure):
    """Before: a traceback from every rank. Each rank's write and rank 0's meta.json and LATEST are
    agreed on (exchange); every rank raises the same CheckpointError; no .tmp is left, LATEST still
    names step 1, which loads."""
    piece = checkpoints.whole_piece("w", (6,))
    save_one(tmp_path, 1, [(piece, torch.ones(6))])
    target, exchange, world = tmp_path / "step_00000002", (lambda x: [x]), 1
    if failure == "a full disk":
        monkeypatch.setattr(torch, "save", failing_save)
        error = "rank 0: OSError: [Errno 28] No space left on device"
    elif failure == "a file where the step's folder goes":
        target.write_text("")
        error = f"rank 0: FileExistsError: [Errno 17] File exists: '{target}'"
    elif failure == "rank 1 fails":  # rank 1's record, as all_ranks returns it
        error = "rank 1: PermissionError: [Errno 13] Permission denied: 'x'"
        exchange, world = (lambda x: [x, ("rank00001.pt", 0, "", error.removeprefix("rank 1: "))]), 2
    else:
        (tmp_path / "LATEST.tmp").mkdir()
        error = f"rank 0: IsADirectoryError: [Errno 21] Is a directory: '{tmp_path / 'LATEST.tmp'}'"
    with pytest.raises(checkpoints.CheckpointError) as raised:
        save_one(tmp_path, 2, [(piece, torch.full((6,), 2.0))], world=world, exchange=exchange)
    assert str(raised.value) == (f"checkpoint step 2 could not be saved in {target} ({error}); the last "
                                 f"complete checkpoint: step 1 ({tmp_path / 'step_00000001'})")
    assert not [p for p in tmp_path.rglob("*.tmp") if p.is_file()], "a failed write leaves no part"
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_00000001"
    assert torch.equal(read_whole(tmp_path, "w", (6,)), torch.ones(6))


def test_a_folder_in_use_or_that_cannot_be_written_is_refused_in_one_line(tmp_path, monkeypatch):
    """Before: the folder lock's mkdir raised an 18-line PermissionError traceback, and a folder that
    became read-only passed (its old LOCK file could still be opened). As root, chmod stops no
    write: a folder under a regular file, and tempfile.mkstemp raising what it raises in a read-only
    folder (a user other than root also meets the real one)."""
    held = checkpoints.lock_checkpoints(tmp_path / "run")
    with pytest.raises(checkpoints.CheckpointError, match=rf"checkpoint folder {tmp_path / 'run'} is in use by a "
                                                    rf"running run \(pid {os.getpid()} on "):
        checkpoints.lock_checkpoints(tmp_path / "run")
    held.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(checkpoints.CheckpointError) as error:
        checkpoints.lock_checkpoints(tmp_path / "file" / "run")
    under = tmp_path / "file" / "run"
    assert str(error.value) == (f"checkpoint folder {under} cannot be written (NotADirectoryError: "
                                f"[Errno 20] Not a directory: '{under}')")

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "run" / "tmpx.tmp"))

    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "mkstemp", read_only)
        with pytest.raises(checkpoints.CheckpointError) as error:
            checkpoints.lock_checkpoints(tmp_path / "run")
    assert str(error.value) == (f"checkpoint folder {tmp_path / 'run'} cannot be written (PermissionError: "
                                f"[Errno 13] Permission denied: '{tmp_path / 'run' / 'tmpx.tmp'}')")
    checkpoints.lock_checkpoints(tmp_path / "run").close()  # released by the refusal
    if os.geteuid() != 0:
        (tmp_path / "run").chmod(0o555)
        try:
            with pytest.raises(checkpoints.CheckpointError, match="cannot be written \\(PermissionError"):
                checkpoints.lock_checkpoints(tmp_path / "run")
        finally:
            (tmp_path / "run").chmod(0o755)


def save_zero(cfg, stage: int, folder: str, steps: int):
    """Train a ZeRO of this stage over the pool `steps` steps and save it; return its full state."""
    model = freeze_some(foundation.GPT(cfg))
    optimizer = zero.ZeRO(model, stage)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        model(*foundation.synthetic_batch(cfg, world, 4, step, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoints.save_checkpoint(folder, steps, checkpoints.zero_pieces(optimizer), {}, checkpoints.checkpoint_config(cfg), rank,
                         world, checkpoints.all_ranks)
    return optimizer.full_state_dict()


def load_zero(cfg, stage: int, folder: str):
    """A fresh ZeRO of this stage over the pool, loaded from the checkpoint: its full state, the bytes
    this rank read and (params + 2 moments) x 4 B x its shard's elements."""
    optimizer = zero.ZeRO(freeze_some(foundation.GPT(cfg)), stage)
    _, _, reader = checkpoints.load_zeros(folder, checkpoints.checkpoint_config(cfg), None,
                                          [(optimizer, checkpoints.whole_tensor)])
    elements = sum(stop - start for unit in optimizer.units for _, start, stop in zero.shard_parts(unit))
    frozen = sum(p.numel() for _, p in optimizer.frozen)  # whole on every rank: parameters only
    return optimizer.full_state_dict(), reader.bytes_read, 12 * elements + 4 * frozen


def test_a_zero3_checkpoint_on_4_ranks_loads_on_other_group_sizes_and_stages_reading_only_its_shard(
        rank_pool, tmp_path):
    """Each element once on disk: (params + 2 moments) x 4 B x Psi + metadata; every load, bit for bit
    the saved state, reads exactly its shard; one device's model reads 4 B x Psi."""
    cfg = foundation.ModelConfig(vocab_size=37, dim=10, n_heads=1, ffn_dim=13, seed=3)
    saved = rank_pool.run(4, save_zero, cfg, 3, str(tmp_path), 2, timeout=600)[0]
    psi = sum(p.numel() for p in foundation.GPT(cfg).parameters())
    frozen = sum(p.numel() for p in freeze_some(foundation.GPT(cfg)).parameters() if not p.requires_grad)
    payload = sum(t.untyped_storage().nbytes() for f in (tmp_path / "step_00000002").glob("rank*.pt")
                  for *_, data in torch.load(f, weights_only=True)["pieces"] for t in data.values())
    assert payload == 12 * (psi - frozen) + 4 * frozen, "each element once (frozen: no moments)"
    for world, stage in ((2, 1), (3, 0), (1, 2), (4, 3)):
        for rank, (state, read, shard) in enumerate(rank_pool.run(world, load_zero, cfg, stage, str(tmp_path),
                                                                  timeout=600)):
            assert read == shard, (world, stage, rank)
            for key in ("params", *zero.ADAM_KEYS):
                assert state[key].keys() == saved[key].keys()
                assert all(torch.equal(state[key][n], saved[key][n]) for n in saved[key]), (key, world, stage)
    one = freeze_some(foundation.GPT(cfg))
    assert checkpoints.load_model(one, tmp_path)["bytes_read"] == 4 * psi
    assert all(torch.equal(p, saved["params"][n]) for n, p in one.named_parameters())


def load_with_a_gap_on_the_last_rank(cfg, folder: str) -> tuple[str, bool]:
    """load_zeros where the last rank's piece_of names a tensor the checkpoint does not hold: only that
    rank finds the problem (in read_shards). Returns the error and whether this rank's shard is as built."""
    optimizer = zero.ZeRO(freeze_some(foundation.GPT(cfg)), 1)
    last = dist.get_rank() == dist.get_world_size() - 1

    def renamed_on_the_last_rank(unit: zero.FlatUnit, i: int) -> checkpoints.Piece:
        piece = checkpoints.whole_tensor(unit, i)
        return dataclasses.replace(piece, name="missing." + piece.name) if last else piece

    before = [optimizer.shard_state(unit)["params"].clone() for unit in optimizer.units]
    try:
        checkpoints.load_zeros(folder, checkpoints.checkpoint_config(cfg), None,
                               [(optimizer, renamed_on_the_last_rank)])
    except checkpoints.CheckpointError as error:
        return str(error), all(torch.equal(b, optimizer.shard_state(unit)["params"])
                               for b, unit in zip(before, optimizer.units))
    return "loaded", False


def test_a_problem_one_rank_finds_stops_every_rank_before_any_loads(rank_pool, tmp_path):
    """load_zeros' second agreement: the ranks that could read wait for the one that could not, raise
    its error and have loaded nothing (the ranks of a resume never mix two states)."""
    cfg = foundation.ModelConfig(vocab_size=37, dim=10, n_heads=1, ffn_dim=13, seed=3)
    rank_pool.run(2, save_zero, cfg, 1, str(tmp_path), 1, timeout=600)
    results = rank_pool.run(2, load_with_a_gap_on_the_last_rank, cfg, str(tmp_path), timeout=600)
    message = results[0][0]
    assert message.startswith(f"{tmp_path / 'step_00000001'}: the saved pieces do not cover every element "
                              f"of missing."), message
    assert results == [(message, True)] * 2


def claim_and_try_again(folder: str) -> tuple[str, bool]:
    """claim_folder on every rank, then every rank tries to lock the folder again while rank 0 holds it."""
    lock = checkpoints.claim_folder(folder)
    try:
        checkpoints.lock_checkpoints(folder).close()
        again = "locked again"
    except checkpoints.CheckpointError as error:
        again = str(error)
    checkpoints.all_ranks(None)  # every rank has tried before rank 0 lets go
    if lock is not None:
        lock.close()
    return again, lock is not None


def test_a_claimed_folder_stays_locked_for_the_run_and_loses_a_killed_saves_leftovers(rank_pool, tmp_path):
    """claim_folder: rank 0 holds the lock while the run keeps the returned file (any other process, a
    second run's included, is refused) and removes what a save killed midway left."""
    run = tmp_path / "run"
    (run / "step_00000003").mkdir(parents=True)
    (run / "step_00000003" / "rank00001.pt.tmp").write_bytes(b"half")
    results = rank_pool.run(2, claim_and_try_again, str(run), timeout=600)
    assert [held for _, held in results] == [True, False], "rank 0 alone holds the lock"
    assert all(f"checkpoint folder {run} is in use by a running run" in again for again, _ in results), results
    assert not (run / "step_00000003").exists(), "a step folder without meta.json is an unfinished save"
    checkpoints.lock_checkpoints(run).close()  # released once rank 0 closed it


# --- the script itself -------------------------------------------------------------------------

def test_script_runs_as_plain_python():
    """Saved by ZeRO-3 on 2 ranks, loaded by ZeRO-1 on 1 (its shard: everything) and by one device's
    model (the parameters alone); every printed figure equals its formula."""
    stdout = run_script("02_zero_checkpoints.py", "--nproc", "2", "--steps", "2", "--global-batch", "4",
                        "--seq-len", "8", timeout=900)
    psi = sum(p.numel() for p in foundation.GPT(foundation.ModelConfig(**zero.DEMO_MODEL)).parameters())
    disk, n, formula = re.search(r"([\d,]+) B on disk = \(params \+ 2 AdamW moments\) x 4 B x ([\d,]+) "
                                 r"parameters, each element once \(([\d,]+)\)", stdout).groups()
    assert int(n.replace(",", "")) == psi and int(formula.replace(",", "")) == 12 * psi, stdout
    assert int(disk.replace(",", "")) > 12 * psi, stdout
    assert f"rank 0: {12 * psi:,} | {12 * psi:,} equal; the state equals the saved one bit for bit" in stdout
    assert f"{4 * psi:,} | {4 * psi:,}; the parameters equal the saved ones bit for bit" in stdout, stdout
    assert stdout.splitlines()[-1].startswith("Notice: the checkpoint is the same bytes"), stdout
