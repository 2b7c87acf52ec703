"""Staging module for lesson 09 part 2: the pieces of a real training run that do not depend on the
mesh (data, learning-rate schedule, MFU, activation recompute, sharded checkpoints, NaN guard,
greedy sampling). They move into 09_full_train.py."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

ddp = importlib.import_module("01_ddp")
tpm = importlib.import_module("03_tensor_parallel")

# ----------------------------------------------------------------------------------------------
# Data: bytes are tokens (vocabulary 256), windows of seq_len + 1 in a seeded order per epoch
# ----------------------------------------------------------------------------------------------

DEFAULT_CORPUS_BYTES = 2 << 20  # enough text for a CPU run; a fixed cap keeps it quick and fixed


def read_tokens(path: str | os.PathLike | None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """The bytes of `path` as uint8 tokens; with no path, the standard library's top-level .py
    files in sorted order (every Python install has them, so no download), up to max_bytes."""
    if path is None:
        sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(source.read_bytes() for source in sources)[:max_bytes]
    elif not Path(path).is_file():
        raise ValueError(f"--data {path}: no such file")
    else:
        data = Path(path).read_bytes()
    if not data:
        raise ValueError(f"--data {path}: the file is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_tokens(tokens: torch.Tensor, seq_len: int, global_batch: int,
                 val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last val_fraction of the text validates. Each part must hold one
    global batch of windows of seq_len + 1 tokens (neighbouring windows share one token)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1)")
    need, n_val = global_batch * seq_len + 1, int(len(tokens) * val_fraction)
    if min(n_val, len(tokens) - n_val) < need:
        raise ValueError(f"the text is too short: {len(tokens) - n_val:,} training and {n_val:,} "
                         f"validation tokens ({val_fraction:.0%}), and each part needs >= "
                         f"global_batch x seq_len + 1 = {global_batch} x {seq_len} + 1 = {need:,}")
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


class ShardedLoader:
    """Window i = tokens[i s : i s + s + 1]. Each epoch visits the windows in a permutation seeded
    by (seed, epoch), one global batch of B windows at a time; data-parallel rank r of d takes rows
    [r B/d, (r+1) B/d). The windows that do not fill a last batch wait for the next epoch's
    permutation. The state counts global batches, not rank rows, so a run can resume on another d.
    Context-parallel ranks of one data-parallel rank get the same rows (the model slices them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len={seq_len} and global_batch={global_batch} must be >= 1")
        if global_batch % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp={dp_size}, or "
                             f"dp_rank={dp_rank} is not in [0, {dp_size})")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.rows = slice(dp_rank * global_batch // dp_size, (dp_rank + 1) * global_batch // dp_size)
        self.seed, self.n_windows = seed, (len(tokens) - 1) // seq_len
        self.batches_per_epoch = self.n_windows // global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(tokens)} tokens hold fewer than global_batch={global_batch} "
                             f"windows of seq_len + 1 = {seq_len + 1} tokens")
        self.epoch = self.position = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), (B/d, s) int64 each, of the next global batch. A fresh
        loader with the same seed repeats them: validation takes one per evaluation."""
        order = torch.randperm(self.n_windows, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.epoch))
        batch = order[self.position * self.global_batch:][:self.global_batch]
        starts = batch[self.rows] * self.seq_len
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


# ----------------------------------------------------------------------------------------------
# Activation recompute: trade a second forward for the activations backward would keep
# ----------------------------------------------------------------------------------------------

RECOMPUTE_MODES = ("none", "selective", "full")


def recomputed(fn: Callable) -> Callable:
    """fn whose intermediate results are not saved for backward but recomputed from its saved
    inputs when backward reaches it (collectives inside fn run again, in the same order on every
    rank, so a tensor- or context-parallel fn stays correct)."""

    @functools.wraps(fn)
    def run(*args: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, *args, use_reentrant=False)

    return run


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """selective: each attention function (scores, softmax, weighted sum; whichever is plugged in:
    SDPA, lesson 05's ring, lesson 07's kernel) keeps only its inputs q, k, v, while the
    projections keep their outputs (Megatron's selective recompute). full: each block keeps only
    its input and recomputes everything else, its tensor-parallel collectives included. Parameter
    names stay (the wrappers are attributes, not modules), and ZeRO-3 still gathers a block's
    parameters before its recompute (when the block's output gradient arrives)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} must be one of {RECOMPUTE_MODES}")
    if getattr(model, "recompute", "none") != "none":
        raise ValueError(f"this model already recomputes ({model.recompute}): apply_recompute once")
    model.recompute = mode
    for block in model.layers.values():
        if mode == "selective":
            block.attn.attn_fn = recomputed(block.attn.attn_fn)
        elif mode == "full":
            block.forward = recomputed(block.forward)  # an attribute: parameter names stay
    return model


def activation_bytes(run: Callable[[], torch.Tensor], params: Iterable[torch.Tensor],
                     device: torch.device) -> tuple[torch.Tensor, int]:
    """run()'s result and the activation bytes it leaves for backward. CPU: the bytes autograd
    saves, each storage once, parameters excluded (lesson 03's accounting, for any forward).
    GPU: the peak allocated above what was allocated before (activations and temporaries)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = run()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - before
    kept = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in kept:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def layer_activation_formula(cfg: "ddp.ModelConfig", batch: int, seq_len: int, tp: int,
                             sequence_parallel: bool, mode: str) -> int:
    """Lesson 03's per-layer activation bytes (fp32) under each mode. selective drops what the
    attention function saved beyond its inputs: the log-sum-exp (s b a / t; the output is kept by
    out_proj as its input). full keeps the block's input and the RoPE tables it reads."""
    if mode == "full":
        return 4 * (seq_len * batch * cfg.dim // (tp if sequence_parallel else 1)
                    + seq_len * cfg.head_dim)
    lse = 4 * seq_len * batch * cfg.n_heads // tp if mode == "selective" else 0
    return tpm.activation_formula(cfg, batch, seq_len, tp, sequence_parallel) - lse


# ----------------------------------------------------------------------------------------------
# Learning rate, MFU, the NaN guard
# ----------------------------------------------------------------------------------------------


def learning_rate(step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr: float) -> float:
    """Linear warmup to max_lr over warmup_steps (step 0 already trains at max_lr / warmup), then
    a half cosine down to min_lr at total_steps, and min_lr after."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


# Dense bf16 tensor-core peaks from NVIDIA's datasheets, which print twice these "with sparsity":
# H100 SXM 989 TFLOP/s, H100 PCIe 756, H100 NVL and H200 NVL 835, H200 SXM 989, A100 312 (SXM4
# and PCIe). Looked up by substring of torch.cuda.get_device_name(); the first match wins.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12),
                   ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, None on a CPU or an unknown GPU (no MFU shown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def matmul_params(cfg: "ddp.ModelConfig") -> int:
    """N of the PaLM formula: every parameter but the token embedding, whose lookup multiplies
    nothing (the untied LM head does: it counts). The norms' few weights count too, as in PaLM."""
    kv = cfg.n_kv_heads * cfg.head_dim
    per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    return cfg.n_layers * per_layer + cfg.dim + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: "ddp.ModelConfig", seq_len: int) -> int:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T for forward + backward: 6 per
    weight (2 forward, 4 backward) and the attention scores and weighted sum, L layers, H heads of
    size Q, context T. Recompute's extra forward is not counted: MFU counts useful work only."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def mfu(tokens_per_s: float, cfg: "ddp.ModelConfig", seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over the hardware's peak (per device: pass the
    tokens per second of one device)."""
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops


def check_finite_loss(loss: float, step: int) -> None:
    """Stop on a NaN or inf loss, before the step is checkpointed: the last good checkpoint stays.
    Pass the loss reduced over the ranks, so that every rank stops at the same step."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss}; stopping without saving, the "
                                 f"last good checkpoint is kept")


@torch.no_grad()
def greedy_sample(model: nn.Module, prompt: bytes, n_new: int) -> bytes:
    """n_new bytes continuing prompt, each the most likely next byte (a byte-level lesson-01 GPT
    on one device). The whole text is re-read each step: simple, and a sample is short."""
    if not prompt:
        raise ValueError("the prompt must hold at least one byte")
    if model.cfg.vocab_size != 256:
        raise ValueError(f"a byte-level model has vocab_size 256, not {model.cfg.vocab_size}")
    device = next(model.parameters()).device
    tokens = torch.tensor(list(prompt), device=device)[None]
    was_training = model.training
    model.eval()
    for _ in range(n_new):
        next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    model.train(was_training)
    return bytes(tokens[0, len(prompt):].tolist())


# ----------------------------------------------------------------------------------------------
# Checkpoints: each rank saves pieces of global tensors; any mesh can read them back
# ----------------------------------------------------------------------------------------------
# A piece names what it holds in global terms, never in mesh terms: a TP shard is a slice of one
# dimension, a ZeRO shard a flat range of what the rank would otherwise hold, a replica the whole
# tensor. Loading asks for the pieces a rank holds NOW and copies every element from whichever
# saved piece holds it, so the mesh (tp, dp, ZeRO stage) may change between save and resume.
#   folder/step_00000100/rank00000.pt ...   each rank's pieces (parameter, AdamW moments) and RNG
#   folder/step_00000100/meta.pt            step, loader state, world size, model configuration
#   folder/LATEST                           the last complete checkpoint, written last, atomically


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of the global tensor `name` of `shape`: the box [start, stop) per dimension, then,
    if flat = (lo, hi), only elements [lo, hi) of that box flattened (a ZeRO shard of a TP shard)."""
    name: str
    shape: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]
    flat: tuple[int, int] | None = None

    @classmethod
    def whole(cls, name: str, shape: Iterable[int]) -> Piece:
        return cls(name, tuple(shape), tuple((0, n) for n in shape))

    def __post_init__(self) -> None:
        box = [stop - start for start, stop in self.slices]
        if len(self.slices) != len(self.shape) or any(
                not 0 <= start <= stop <= n for (start, stop), n in zip(self.slices, self.shape)):
            raise ValueError(f"{self.name}: slices {self.slices} do not fit the shape {self.shape}")
        if self.flat is not None and not 0 <= self.flat[0] <= self.flat[1] <= math.prod(box):
            raise ValueError(f"{self.name}: flat range {self.flat} outside the {math.prod(box)} "
                             f"elements of its box")

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.flat is not None:
            return (self.flat[1] - self.flat[0],)
        return tuple(stop - start for start, stop in self.slices)

    def global_index(self) -> torch.Tensor:
        """Each element's index in the flattened global tensor, in the piece's order: increasing,
        since a row-major walk of a box never goes back."""
        index = torch.zeros((), dtype=torch.long)
        for dim, (start, stop) in enumerate(self.slices):
            index = index[..., None] + torch.arange(start, stop) * math.prod(self.shape[dim + 1:])
        index = index.flatten()
        return index if self.flat is None else index[self.flat[0]:self.flat[1]]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of the global tensor `full` (a view where it can be)."""
        box = full[tuple(slice(start, stop) for start, stop in self.slices)]
        return box if self.flat is None else box.flatten()[self.flat[0]:self.flat[1]]

    def overlaps(self, other: Piece) -> bool:
        return all(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(self.slices, other.slices))


SavedPieces = list[tuple[Piece, dict[str, torch.Tensor]]]  # a piece and its tensors by kind


def flat_shard_pieces(boxes: list[Piece], lo: int, hi: int) -> list[tuple[Piece, int]]:
    """The pieces of elements [lo, hi) of the boxes flattened and concatenated in order (a ZeRO
    shard of a flat unit, lesson 02), each with the offset in the shard where its data starts."""
    pieces, start = [], 0
    for box in boxes:
        size = math.prod(box.local_shape)
        first, last = max(lo, start), min(hi, start + size)
        if first < last:
            pieces.append((dataclasses.replace(box, flat=(first - start, last - start)), first - lo))
        start += size
    return pieces


def checkpoint_config(cfg: "ddp.ModelConfig") -> dict:
    """What must match for a checkpoint to load: every field that shapes the model. Not the seed,
    which only draws the initial weights that a checkpoint replaces."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seed"}


def _atomic_save(obj: object, path: Path) -> None:
    """A reader sees the old file or the whole new one, never a part: write aside, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    pointer = Path(folder) / "LATEST"
    return Path(folder) / pointer.read_text().strip() if pointer.exists() else None


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(folder: str | os.PathLike, step: int, pieces: SavedPieces, meta: dict,
                    config: dict, rank: int, world: int, barrier: Callable[[], None]) -> Path:
    """Every rank calls this with its pieces; barrier() waits for all ranks (dist.barrier; tests
    pass a no-op or a threading.Barrier). meta holds plain values and tensors (torch.load reads it
    with weights_only). The files live on a filesystem every rank sees. A crash before LATEST
    moves leaves the previous checkpoint the one that loads; once it has moved, the older folders
    (and any partial one from a crashed save) are deleted."""
    for piece, data in pieces:
        if any(t.shape != piece.local_shape for t in data.values()):
            raise ValueError(f"{piece.name}: tensors of {[tuple(t.shape) for t in data.values()]} "
                             f"for a piece of shape {piece.local_shape}")
    root = Path(folder)
    target = root / f"step_{step:08d}"
    if latest_checkpoint(root) == target:  # resumed here: the same state is already saved
        return target
    target.mkdir(parents=True, exist_ok=True)
    # clone: torch.save writes a view's whole storage (all of a full tensor for a narrow of it)
    rows = [(dataclasses.astuple(piece), {kind: t.detach().to("cpu", copy=True).contiguous()
                                          for kind, t in data.items()}) for piece, data in pieces]
    _atomic_save({"pieces": rows, "rng": rng_state()}, target / f"rank{rank:05d}.pt")
    if rank == 0:
        _atomic_save({**meta, "step": step, "world": world, "config": config}, target / "meta.pt")
    barrier()
    if rank == 0:
        missing = [r for r in range(world) if not (target / f"rank{r:05d}.pt").exists()]
        if missing:
            raise RuntimeError(f"{target}: ranks {missing} wrote no file; LATEST not moved")
        pointer = root / "LATEST.tmp"
        pointer.write_text(target.name)
        os.replace(pointer, root / "LATEST")
        for old in root.glob("step_*"):
            if old != target:
                shutil.rmtree(old)
    barrier()
    return target


def assemble(wanted: Piece, saved: SavedPieces) -> dict[str, torch.Tensor]:
    """The tensors of `wanted`, element by element from every saved piece that holds some of
    them. Indices are increasing in each piece, so a binary search matches them."""
    index, found = wanted.global_index(), {}
    covered = torch.zeros(len(index), dtype=torch.bool)
    for piece, data in saved:
        if piece.name != wanted.name:
            continue
        if piece.shape != wanted.shape:
            raise ValueError(f"{wanted.name}: saved with global shape {piece.shape}, wanted "
                             f"{wanted.shape}")
        for kind, tensor in data.items():
            found.setdefault(kind, torch.empty(len(index), dtype=tensor.dtype))
        have = piece.global_index() if piece.overlaps(wanted) else index[:0]
        if not len(have):
            continue
        at = torch.searchsorted(have, index).clamp(max=len(have) - 1)
        hit = have[at] == index
        for kind, tensor in data.items():
            found[kind][hit] = tensor.flatten()[at[hit]]
        covered |= hit
    if not covered.all():
        raise ValueError(f"{wanted.name}: {int((~covered).sum())} of the {len(index)} elements of "
                         f"{wanted} are in no saved piece")
    return {kind: t.view(wanted.local_shape) for kind, t in found.items()}


def load_checkpoint(folder: str | os.PathLike, wanted: list[Piece], config: dict,
                    rank: int = 0) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """The tensors of each wanted piece (what this rank holds now, on whatever mesh) from the
    last complete checkpoint, and its metadata with this rank's saved RNG state ("rng"; None if
    the saved world was smaller). Files are memory-mapped: only the elements used are read."""
    target = latest_checkpoint(folder)
    if target is None:
        raise ValueError(f"{folder} holds no complete checkpoint (no LATEST file)")
    meta = torch.load(target / "meta.pt", weights_only=True)
    if meta["config"] != config:
        diff = ", ".join(f"{k}={meta['config'].get(k)} (this model: {config.get(k)})"
                         for k in sorted(meta["config"].keys() | config.keys())
                         if meta["config"].get(k) != config.get(k))
        raise ValueError(f"{target} was saved by another model configuration: {diff}; refusing "
                         f"to load it")
    files = [torch.load(target / f"rank{r:05d}.pt", mmap=True, weights_only=True)
             for r in range(meta["world"])]
    saved = [(Piece(name, tuple(shape), tuple(map(tuple, slices)), flat and tuple(flat)), data)
             for file in files for (name, shape, slices, flat), data in file["pieces"]]
    meta["rng"] = files[rank]["rng"] if rank < len(files) else None
    return [assemble(piece, saved) for piece in wanted], meta


def load_model(model: nn.Module, folder: str | os.PathLike, config: dict) -> dict:
    """Load the last checkpoint's parameters into a whole model on one device (e.g. rank 0's
    lesson-01 GPT, to sample from); returns the metadata."""
    names, params = zip(*model.named_parameters())
    loaded, meta = load_checkpoint(folder, [Piece.whole(n, p.shape) for n, p in zip(names, params)],
                                   config)
    with torch.no_grad():
        for param, data in zip(params, loaded):
            param.copy_(data["param"])
    return meta
