"""Lesson 02, second part: saving and loading sharded state, a model no rank holds whole.

THE IDEA
No rank could hold the whole state to write it, so each writes what it holds, as pieces: (name, the
whole tensor's shape, the runs of consecutive elements of the flattened tensor that the rank holds):
a ZeRO shard is one run per parameter, a tensor-parallel slice of columns (lesson 09) one run per row.
Each element is written once, by one of its holders.
INTEGRITY: every file is written aside, then renamed; meta.json records each rank file's bytes and
sha256, and LATEST moves last, so a crash leaves the previous checkpoint whole, and a damaged file is
one line naming it and the previous complete step. A lock on the folder keeps a second run out
(claim_folder, at a run's start). RESHARDING: a resume on another group size or stage reads, for each
piece it holds now, only the saved runs that overlap it (two binary searches over sorted runs, in
memory-mapped files); load_zeros has every rank agree that all could read before any loads.

COST: on disk (parameters + 2 AdamW moments) x 4 B x Psi, whatever N, + metadata; a resume reads
12 B x its shard's elements on each rank (12 Psi / N), never the whole.

RUN IT
    python 02_zero_checkpoints.py            # 4 local CPU ranks: ZeRO-3 trains and saves, ZeRO-1 on 2 loads
    torchrun --nproc_per_node=4 02_zero_checkpoints.py
Look at: the checkpoint's bytes on disk beside 12 B x Psi; the bytes each rank of half the group read
beside its shard; the loaded state equal to the saved one bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import math
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

foundation = importlib.import_module("01_ddp")
zero = importlib.import_module("02_zero")


# ----------------------------------------------------------------------------------------------
# Pieces, the files of a checkpoint and its folder
# ----------------------------------------------------------------------------------------------
#   folder/step_00000100/rank00000.pt ...   the pieces a rank writes (their runs, their elements of
#                                           each kind: parameters, AdamW moments) and its RNG state
#   folder/step_00000100/meta.json          the step, the caller's record, the model configuration,
#                                           every rank file's bytes and sha256
#   folder/LATEST                           the last complete checkpoint, written last, atomically
#   folder/LOCK                             held by the run that writes here (a second one is refused)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or a folder that cannot be written: one line, what to do."""


@dataclass
class Piece:
    """The elements of one tensor that a rank holds: runs of consecutive elements of the whole tensor
    flattened, rows (first index in the whole tensor, offset in the rank's values, length), sorted
    and disjoint. The rank's values have `size` elements; those no run covers are padding."""
    name: str
    shape: tuple[int, ...]
    runs: torch.Tensor  # int64, (runs, 3)
    size: int

    def narrow(self, start: int, stop: int) -> Piece:
        """The piece of the values [start, stop) (a ZeRO shard of them), offsets counted from start."""
        begin = self.runs[:, 1].clamp(min=start)
        end = (self.runs[:, 1] + self.runs[:, 2]).clamp(max=stop)
        runs = torch.stack([self.runs[:, 0] + begin - self.runs[:, 1], begin - start, end - begin], 1)
        return Piece(self.name, self.shape, runs[begin < end], stop - start)

    def elements(self) -> int:
        return int(self.runs[:, 2].sum())


def whole_piece(name: str, shape: tuple[int, ...]) -> Piece:
    """A whole tensor, one run (what one device holds)."""
    return Piece(name, tuple(shape), torch.tensor([[0, 0, math.prod(shape)]]), math.prod(shape))


def overlaps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two pieces' runs (each sorted and disjoint) -> the elements they share, as rows (offset in a,
    offset in b, length). The runs of b that meet a run of a lie between two binary searches."""
    a_start, b_start = a[:, 0].contiguous(), b[:, 0].contiguous()
    a_end, b_end = a_start + a[:, 2], b_start + b[:, 2]
    first = torch.searchsorted(b_end, a_start, right=True)  # b's first run that ends after a's starts
    count = (torch.searchsorted(b_start, a_end) - first).clamp(min=0)
    i = torch.repeat_interleave(torch.arange(len(a)), count)
    j = first[i] + torch.arange(len(i)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    begin, end = torch.maximum(a_start[i], b_start[j]), torch.minimum(a_end[i], b_end[j])
    return torch.stack([a[i, 1] + begin - a_start[i], b[j, 1] + begin - b_start[j], end - begin], 1)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> int:
    """A reader sees the old file or the whole new one, never a part: write aside, then rename (a
    write that fails removes its part). Returns the bytes written."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path.stat().st_size


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def all_ranks(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's obj, in rank order, on every rank of group (an all-gather: it also waits for all)."""
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def first_problem(problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The lowest rank's problem (None: no rank has one), on every rank: they all stop, or none."""
    return next((p for p in all_ranks(problem, group) if p is not None), None)


def os_error(error: OSError) -> str:
    return f"{type(error).__name__}: {error}"


def lock_checkpoints(folder: str | os.PathLike) -> IO:
    """Hold folder/LOCK while the returned file stays open (the kernel releases an flock when its
    process ends, killed too: no stale lock). A folder that is a file, that cannot be written, or
    that a running run holds is refused in one line."""
    root, handle = Path(folder), None
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} is a file, not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / "LOCK", "a+")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fd, probe = tempfile.mkstemp(".tmp", dir=root)  # an earlier run's LOCK may be writable where
        os.close(fd)                                     # the folder is not (read-only since)
        os.unlink(probe)
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(sys.argv)}")
        handle.flush()
        return handle
    except BlockingIOError:  # flock: another process holds it
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(f"checkpoint folder {folder} is in use by a running run ({holder}): wait for "
                              f"it to end, or choose another folder") from None
    except OSError as error:
        if handle is not None:
            handle.close()
        raise CheckpointError(f"checkpoint folder {folder} cannot be written ({os_error(error)})") from None


def step_of(path: Path) -> int | None:
    number = path.name.removeprefix("step_")
    return int(number) if path.name.startswith("step_") and number.isdigit() else None


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    pointer = Path(folder) / "LATEST"
    return Path(folder) / pointer.read_text(errors="replace").strip() if pointer.is_file() else None


def remove_unfinished_saves(folder: str | os.PathLike) -> list[str]:
    """What a save stopped midway (a kill) left: files written aside (*.tmp) and step folders without
    meta.json that LATEST does not name. Removes them (hold the lock) and returns their names."""
    root, latest = Path(folder), latest_checkpoint(folder)
    folders = [p for p in root.glob("step_*")
               if p.is_dir() and p != latest and not (p / "meta.json").exists()]
    files = [p for p in [*root.glob("*.tmp"), *root.glob("step_*/*.tmp")] if p.parent not in folders]
    unfinished = folders + files
    for path in unfinished:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return sorted(str(p.relative_to(root)) for p in unfinished)


def claim_folder(folder: str | os.PathLike) -> IO | None:
    """A run's start: rank 0 locks folder (held while the returned file stays open, or until its
    process ends) and removes what a killed save left, saying so. A problem stops every rank with the
    same CheckpointError (the ranks agree by a collective)."""
    lock = problem = None
    if dist.get_rank() == 0:
        try:
            lock = lock_checkpoints(folder)
            if unfinished := remove_unfinished_saves(folder):
                print(f"removed what an interrupted save left in {folder}: {', '.join(unfinished)}")
        except CheckpointError as error:
            problem = str(error)
    if (problem := first_problem(problem)) is not None:
        raise CheckpointError(problem)
    return lock


def checkpoint_config(cfg: foundation.ModelConfig) -> dict:
    """What must match for a checkpoint to load: every field that shapes the model. Not the seed,
    which only draws the initial weights that a checkpoint replaces."""
    return {k: v for k, v in asdict(cfg).items() if k != "seed"}


def save_checkpoint(folder: str | os.PathLike, step: int, pieces: list[tuple[Piece, dict[str, torch.Tensor]]],
                    meta: dict, config: dict, rank: int = 0, world: int = 1,
                    exchange: Callable[[object], list] = lambda x: [x], keep: Sequence[int] = ()) -> Path:
    """Every rank calls this with the pieces it writes (each element once across the ranks) and their
    values of each kind, on a filesystem every rank sees; exchange(x) returns every rank's x (all_ranks).
    Rank files, meta.json, LATEST, then the step folders but this one and `keep` go. A write failing on
    any rank is a CheckpointError on every rank naming the folder, the error and the last complete step."""
    root = Path(folder)
    target, name = root / f"step_{step:08d}", f"rank{rank:05d}.pt"
    # Each piece's name, shape, runs as (first, length) and the elements they cover, packed.
    rows = [(piece.name, tuple(piece.shape), piece.runs[:, [0, 2]].tolist(),
             {kind: torch.cat([t[o:o + n] for _, o, n in piece.runs.tolist()]) for kind, t in data.items()})
            for piece, data in pieces if len(piece.runs)]
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    try:
        target.mkdir(parents=True, exist_ok=True)
        size = atomic_write(target / name, lambda f: torch.save({"pieces": rows, "rng": rng}, f))
        record = (name, size, file_sha256(target / name), None)
    except OSError as error:
        record = (name, 0, "", os_error(error))
    records = exchange(record)
    problem = next((f"rank {r}: {error}" for r, (*_, error) in enumerate(records) if error), None)
    files = {n: {"bytes": b, "sha256": h} for n, b, h, _ in records}
    if problem is None and (missing := [n for n in files if not (target / n).exists()]):
        problem = f"{missing} are not there (is {root} on a filesystem every rank sees?)"  # on every rank
    if problem is None:
        try:
            if rank == 0:
                text = json.dumps({**meta, "step": step, "world": world, "config": config, "files": files})
                atomic_write(target / "meta.json", lambda f: f.write(text.encode()))
                for stale in target.iterdir():  # an earlier run's save at this step, on more ranks
                    if stale.name not in files and stale.name != "meta.json":
                        stale.unlink()
                atomic_write(root / "LATEST", lambda f: f.write(target.name.encode()))
                kept = {target.name, *(f"step_{s:08d}" for s in keep)}
                for old in root.glob("step_*"):  # complete now: an old one that will not go stays
                    if old.is_dir() and old.name not in kept:
                        shutil.rmtree(old, ignore_errors=True)
        except OSError as error:
            problem = f"rank 0: {os_error(error)}"
        problem = exchange(problem)[0]
    if problem is not None:
        latest = latest_checkpoint(root)
        last = f"step {step_of(latest)} ({latest})" if latest else "none"
        raise CheckpointError(f"checkpoint step {step} could not be saved in {target} ({problem}); the last "
                              f"complete checkpoint: {last}")
    return target


def checkpoint_problem(target: Path, rank: int = 0, world: int = 1,
                       checksums: bool = True) -> tuple[str | None, dict]:
    """What is wrong with the checkpoint folder target (None: nothing), and its metadata. Every file
    must be there at its recorded size; with checksums, this rank hashes every world-th file from
    its rank (between them, the ranks of a resume read each file once)."""
    if not target.is_dir():
        return "its folder is missing", {}
    try:
        meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
        files = [(name, record["bytes"], record["sha256"]) for name, record in meta["files"].items()]
        lacking = sorted({"step", "world", "config"} - meta.keys())
    except FileNotFoundError:
        return "meta.json is missing", {}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"meta.json cannot be read ({type(error).__name__}: {error})", {}
    if lacking:
        return f"meta.json lacks {', '.join(lacking)}", {}
    for i, (name, size, sha256) in enumerate(files):
        path = target / name
        if not path.is_file():
            return f"{name} is missing", meta
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes where meta.json records {size:,}", meta
        if checksums and i % world == rank and file_sha256(path) != sha256:
            return f"{name} does not match the sha256 that meta.json records (altered bytes)", meta
    return None, meta


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """The steps whose checkpoint has every file at its recorded size (not hashed), in order."""
    return sorted(s for p in Path(folder).glob("step_*")
                  if (s := step_of(p)) is not None and checkpoint_problem(p, checksums=False)[0] is None)


def open_checkpoint(folder: str | os.PathLike, config: dict, step: int | None = None, rank: int = 0,
                    world: int = 1, checksums: bool = True,
                    resume_command: Callable[[int], str] | None = None) -> tuple[Path, dict]:
    """The checkpoint of `step` (None: the one LATEST names) and its metadata, checked: every file at
    its recorded size, this rank's share of them hashed (checksums), the same model configuration.
    A damaged one is a CheckpointError naming the step, the file, the previous complete checkpoint
    and (resume_command(step)) the command that resumes from it."""
    root = Path(folder)
    target = root / f"step_{step:08d}" if step is not None else latest_checkpoint(folder)
    command = (lambda s: f": {resume_command(s)}") if resume_command else (lambda s: "")
    if target is None:
        if not (complete := complete_steps(root)):
            raise CheckpointError(f"{folder} holds no complete checkpoint (no LATEST file)")
        raise CheckpointError(f"{folder} has no LATEST file (each save writes it last, naming its step); the "
                              f"complete checkpoints there are steps {', '.join(map(str, complete))}: resume "
                              f"from the last{command(complete[-1])}")
    problem, meta = checkpoint_problem(target, rank, world, checksums)
    if problem is not None:
        number = step_of(target)
        previous = max((s for s in complete_steps(root) if number is None or s < number), default=None)
        where = f"step {number} ({target})" if number is not None else f"{target} (named by LATEST)"
        advice = (f"the previous complete checkpoint is step {previous} ({root / f'step_{previous:08d}'}); "
                  f"resume from it{command(previous)}" if previous is not None else
                  "no earlier complete checkpoint is kept: train afresh")
        raise CheckpointError(f"checkpoint {where} cannot be used: {problem}; {advice}")
    if meta["config"] != config:
        diff = ", ".join(f"{k}={meta['config'].get(k)} (this model: {config.get(k)})"
                         for k in sorted(meta["config"].keys() | config.keys())
                         if meta["config"].get(k) != config.get(k))
        raise ValueError(f"{target} was saved by another model configuration: {diff}; refusing to load it")
    return target, meta


class CheckpointReader:
    """A checked checkpoint's rank files, memory-mapped: read(piece) copies out only the runs the piece
    shares with the saved ones (the rest of the files: their runs and RNG states); bytes_read counts it."""

    def __init__(self, target: Path, meta: dict) -> None:
        self.saved: dict[str, list[tuple[tuple[int, ...], torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self.rng = []  # by saved rank
        for name in meta["files"]:
            file = torch.load(target / name, mmap=True, weights_only=True)
            self.rng.append(file["rng"])
            for piece_name, shape, pairs, data in file["pieces"]:
                first, length = torch.tensor(pairs).T
                runs = torch.stack([first, length.cumsum(0) - length, length], 1)  # packed: offsets add up
                self.saved.setdefault(piece_name, []).append((tuple(shape), runs, data))
        self.bytes_read = 0

    def read(self, piece: Piece, kinds: tuple[str, ...] = zero.CHECKPOINT_KINDS) -> dict[str, torch.Tensor]:
        """piece's values of each kind; padding holds zeros."""
        out = {kind: torch.zeros(piece.size) for kind in kinds}
        covered = 0
        for shape, runs, data in self.saved.get(piece.name, ()):
            if shape != tuple(piece.shape):
                raise ValueError(f"{piece.name} was saved with shape {shape}, not {tuple(piece.shape)}")
            for to, at, n in overlaps(piece.runs, runs).tolist():
                for kind in kinds:
                    out[kind][to:to + n] = data[kind][at:at + n]
                covered += n
        if covered != piece.elements():
            raise ValueError(f"the saved pieces do not cover every element of {piece.name} exactly once")
        self.bytes_read += covered * 4 * len(kinds)
        return out


def load_model(model: nn.Module, folder: str | os.PathLike) -> dict:
    """The last checkpoint's parameters into a whole one-device lesson-01 model; returns the metadata
    and the bytes read."""
    target, meta = open_checkpoint(folder, checkpoint_config(model.cfg))
    reader = CheckpointReader(target, meta)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reader.read(whole_piece(name, param.shape), ("params",))["params"].view(param.shape))
    return {**meta, "bytes_read": reader.bytes_read}


# --- ZeRO's shards as pieces ----------------------------------------------------------------------


def whole_tensor(unit: zero.FlatUnit, i: int) -> Piece:
    return whole_piece(unit.names[i], unit.shapes[i])


PieceOf = Callable[[zero.FlatUnit, int], Piece]  # parameter i of a unit as this rank holds it before ZeRO


def shard_pieces(unit: zero.FlatUnit, piece_of: PieceOf = whole_tensor) -> Iterator[tuple[int, Piece, slice]]:
    """(i, piece, where its values lie in this rank's shard) for each parameter i with elements in the
    shard. piece_of: the parameter before ZeRO flattens it (here the whole tensor; lesson 09: a rank's
    tensor- or expert-parallel slice of the reference model's), narrowed to the shard's elements."""
    for i, start, stop in zero.shard_parts(unit):
        at = unit.offsets[i] + start - unit.owned.start
        yield i, piece_of(unit, i).narrow(start, stop), slice(at, at + stop - start)


def zero_pieces(optimizer: zero.ZeRO, piece_of: PieceOf = whole_tensor,
                writes: Callable[[nn.Parameter], bool] = lambda p: True
                ) -> list[tuple[Piece, dict[str, torch.Tensor]]]:
    """The pieces this rank writes of a ZeRO, with their values of each kind: its shard's of the
    parameters `writes` accepts (stage 0: the group's rank 0 writes all; lesson 09: tp rank 0 those
    replicated over tp), and the frozen parameters (whole on every rank, no moments) by rank 0."""
    first, out = dist.get_rank(optimizer.group) == 0, []
    for unit in optimizer.units if optimizer.stage > 0 or first else ():
        state = optimizer.shard_state(unit)
        out += [(piece, {k: v[at].detach().float().cpu() for k, v in state.items()})
                for i, piece, at in shard_pieces(unit, piece_of) if writes(unit.params[i])]
    return out + [(whole_piece(n, p.shape), {"params": p.detach().float().cpu().flatten()})
                  for n, p in optimizer.frozen if first]


@torch.no_grad()
def read_shards(optimizer: zero.ZeRO, reader: CheckpointReader,
                piece_of: PieceOf = whole_tensor) -> list[dict]:
    """A ZeRO's shards (of any group size and stage) from a checkpoint of any other, for its
    load_shards: only the saved runs that overlap them are read, no whole tensor is built; frozen
    parameters are copied in as read. No collective: ranks can agree that all read before any loads."""
    shards = []
    for unit in optimizer.units:
        size = unit.owned.stop - unit.owned.start
        values = {k: torch.zeros(size) for k in zero.CHECKPOINT_KINDS}  # padding: 0
        for _, piece, at in shard_pieces(unit, piece_of):
            for k, v in reader.read(piece).items():
                values[k][at] = v
        shards.append(values)
    for name, p in optimizer.frozen:
        p.copy_(reader.read(whole_piece(name, p.shape), ("params",))["params"].view(p.shape))
    return shards


def load_zeros(folder: str | os.PathLike, config: dict, step: int | None,
               zeros: list[tuple[zero.ZeRO, PieceOf]], resume_command: Callable[[int], str] | None = None,
               group: dist.ProcessGroup | None = None) -> tuple[Path, dict, CheckpointReader]:
    """A resume on every rank of group: each ZeRO (with its piece_of) loads its shards from the
    checkpoint of `step` (None: LATEST's). Each rank hashes its share of the files and reads only the
    runs that overlap its pieces; a problem any rank finds (a damaged file, a piece missing, a file that
    cannot be read) stops every rank with the same CheckpointError, before any rank has loaded anything."""
    rank, world, problem = dist.get_rank(group), dist.get_world_size(group), None
    try:
        target, meta = open_checkpoint(folder, config, step, rank, world, resume_command=resume_command)
    except (ValueError, OSError) as error:
        problem = str(error)
    if (problem := first_problem(problem, group)) is not None:
        raise CheckpointError(problem)
    try:  # e.g. pieces missing for one pipeline stage's parameters: only its ranks see it
        reader = CheckpointReader(target, meta)
        shards = [read_shards(optimizer, reader, piece_of) for optimizer, piece_of in zeros]
    except (ValueError, OSError) as error:
        problem = f"{target}: {error}"
    if (problem := first_problem(problem, group)) is not None:
        raise CheckpointError(problem)
    for (optimizer, _), shard in zip(zeros, shards):
        optimizer.load_shards(shard, meta["step"])
    return target, meta, reader


def disk_bytes(target: Path, parameters: int) -> str:
    """A checkpoint's bytes on disk beside the formula: each element of the state once, + metadata."""
    disk = sum(f.stat().st_size for f in target.iterdir())
    formula = 4 * len(zero.CHECKPOINT_KINDS) * parameters
    return (f"{disk:,} B on disk = (params + 2 AdamW moments) x 4 B x {parameters:,} parameters, each "
            f"element once ({formula:,}) + {disk - formula:,} B of metadata (meta.json; each rank file's "
            f"runs, RNG and headers)")


# ----------------------------------------------------------------------------------------------
# RUN IT: the demo and the command line
# ----------------------------------------------------------------------------------------------


def checkpoint_demo(cfg: foundation.ModelConfig, saved: dict, device: torch.device) -> None:
    """A ZeRO-3 on every rank saves the state `saved` (the fp32 ZeRO-3 run's, gathered to compare
    with); ZeRO-1 on half the ranks loads it, then one device's model: each reads what it holds."""
    rank, world, step, config = dist.get_rank(), dist.get_world_size(), saved["step"], checkpoint_config(cfg)
    optimizer = zero.ZeRO(foundation.GPT(cfg).to(device), 3)
    optimizer.load_full_state_dict(saved)  # a real run saves the ZeRO it trains, without gathering
    folder = all_ranks(tempfile.mkdtemp(prefix="02_zero.") if rank == 0 else None)[0]  # one machine
    target = save_checkpoint(folder, step, zero_pieces(optimizer), {}, config, rank, world, all_ranks)
    half = max(1, world // 2)
    group, report = dist.new_group(list(range(half))), None
    if rank < half:
        smaller = zero.ZeRO(foundation.GPT(cfg).to(device), 1, group)
        _, _, reader = load_zeros(folder, config, step, [(smaller, whole_tensor)], group=group)
        loaded = smaller.full_state_dict()
        same = all(torch.equal(loaded[k][n], saved[k][n]) for k in zero.CHECKPOINT_KINDS for n in saved[k])
        elements = sum(stop - start for unit in smaller.units for _, start, stop in zero.shard_parts(unit))
        report = (reader.bytes_read, 4 * len(zero.CHECKPOINT_KINDS) * elements, same)
    reports = all_ranks(report)
    if rank == 0:
        one = foundation.GPT(cfg)
        one_read = load_model(one, folder)["bytes_read"]
        one_same = all(torch.equal(p, saved["params"][n]) for n, p in one.named_parameters())
        psi = sum(p.numel() for p in one.parameters())
        print(f"A sharded checkpoint: ZeRO-3 on {world} ranks saved step {step} as {world} rank "
              f"files + meta.json: {disk_bytes(target, psi)}.\nZeRO-1 on {half} rank{'s' * (half > 1)} "
              f"loads it; bytes each rank read (memory-mapped) | its shard, (params + 2 moments) x 4 B x its "
              f"elements:")
        for r, (read, shard, same) in enumerate(reports[:half]):
            print(f"  rank {r}: {read:,} | {shard:,} {'equal' if read == shard else 'DIFFERENT'}; the state "
                  f"{'equals' if same else 'DIFFERS from'} the saved one bit for bit")
        print(f"One device's GPT loads the parameters alone, bytes read | 4 B x {psi:,} parameters: "
              f"{one_read:,} | {4 * psi:,}; the parameters {'equal' if one_same else 'DIFFER from'} the "
              f"saved ones bit for bit.")
        print("Notice: the checkpoint is the same bytes whatever the group that wrote it; each reader "
              "reads its shard, not the whole.")
        shutil.rmtree(folder)


def demo(args: argparse.Namespace) -> None:
    device = foundation.init_distributed()
    cfg = foundation.ModelConfig(**zero.DEMO_MODEL)
    trained, _ = zero.train_zero(cfg, args.steps, args.global_batch, args.seq_len, stage=3, device=device)
    checkpoint_demo(cfg, trained.state, device)
    foundation.exit_distributed()


def main() -> None:
    parser = foundation.lesson_parser(__doc__)
    for option, default, what in (
            ("--steps", 3, "AdamW steps of ZeRO-3 before the save"),
            ("--global-batch", 16, "sequences per step, split over the ranks"),
            ("--seq-len", 32, "tokens per sequence")):
        parser.add_argument(option, type=int, default=default, help=what)
    args = parser.parse_args()

    def validate(world: int) -> None:
        if args.global_batch % world:
            raise ValueError(f"global_batch={args.global_batch} is not divisible by the group size {world}")
        foundation.check_memory(f"--global-batch {args.global_batch} x --seq-len {args.seq_len}",
                                foundation.ModelConfig(**zero.DEMO_MODEL), args.global_batch, args.seq_len,
                                world)

    foundation.launch_lesson(parser, args, demo, ("steps", "global_batch", "seq_len"), validate)


if __name__ == "__main__":
    main()
