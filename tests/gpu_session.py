"""The GPU session: what a lent GPU checks, prepared here and run there in one call of at most 9 minutes.

    python tests/gpu_session.py              # a GPU machine: every step below, then a summary
    python tests/gpu_session.py --rehearse   # a CPU: the same steps on tiny shapes (the plumbing only)

A session gets a GPU for minutes, rarely: kernel work is developed and proved on the CPU, and the GPU
runs this one script. Each step is a command of the course, with its own time limit so that one that
hangs cannot eat the others' time, run in order until the session's limit; each one's whole output
goes to $OUT/<step>.log (the device tool returns $OUT), the summary to stdout and $OUT/summary.txt:
  versions   the device, torch, triton and Python
  tests      the GPU tests (those the CPU skips: 07's and 08's bf16, FP8 and Hopper kernels)
  07 bench   ours, the Hopper variant, SDPA's flash and cuDNN backends at head dim 128, 4k-16k tokens
  08 bench   FP8 GEMMs against bf16, and the casts' GB/s beside a copy's
  09 1b      the 1b preset compiled, with 07's kernel and with SDPA: ms a step, MFU, peak memory
             (allocated and reserved) beside the planner's prediction for the same run
  09 2b      the 2b preset (Llama 3 8B's layer), FP8 against bf16
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

COURSE = Path(__file__).resolve().parent.parent
PY = sys.executable
RUN_1B = ["09_full_train.py", "--dp", "1", "--tp", "1", "--model", "1b", "--steps", "15", "--no-save",
          "--compile"]
RUN_2B = ["09_full_train.py", "--dp", "1", "--tp", "1", "--model", "2b", "--steps", "12", "--no-save",
          "--compile", "--attention", "flash"]
TINY = ["09_full_train.py", "--dp", "1", "--tp", "1", "--steps", "3", "--no-save", "--seq-len", "16",
        "--global-batch", "2", "--eval-every", "2"]
VERSIONS = ("import sys, torch, triton; print('device', torch.cuda.get_device_name() if torch.cuda.is_available() "
            "else 'CPU', '| torch', torch.__version__, '| triton', triton.__version__, '| python', "
            "sys.version.split()[0])")
# (step, its command on a GPU, on a CPU rehearsal, seconds it may take, the lines the summary keeps)
STEPS = [
    ("versions", ["-c", VERSIONS], ["-c", VERSIONS], 30, r"^device .*"),
    ("tests", ["-m", "pytest", "tests/test_07_flash_attention.py", "tests/test_08_fp8.py", "-q", "-p",
               "no:cacheprovider", "-k", "gpu or cuda or hopper"],
     ["-m", "pytest", "tests/test_07_flash_attention.py", "-q", "-p", "no:cacheprovider", "-k", "gpu_deterministic"],
     100, r"^\d+ (passed|failed|skipped).*"),
    ("07 bench", ["07_flash_attention.py", "--bench", "--bench-head-dims", "128", "--bench-seqs", "4096", "8192",
                  "16384"], ["07_flash_attention.py", "--seq", "64", "--head-dim", "32"], 80,
     r"^\s*(128|max|out|lse).*"),
    ("08 bench", ["08_fp8.py", "--bench"], ["08_fp8.py", "--steps", "2", "--batch", "2", "--seq-len", "16"], 70,
     r"^\s*(\d{4,5} |bf16 copy|fused|tensorwise \(|\d+ -> ).*|.*(SQNR|steps).*"),
    ("09 1b flash", [*RUN_1B, "--attention", "flash"], [*TINY, "--attention", "flash"], 90,
     r"^(final|GPU memory|activations).*"),
    ("09 1b sdpa", [*RUN_1B, "--attention", "sdpa"], [*TINY, "--attention", "sdpa"], 75,
     r"^(final|GPU memory|activations).*"),
    ("09 2b bf16", RUN_2B, [*TINY, "--attention", "flash"], 75, r"^(final|GPU memory|activations).*"),
    ("09 2b fp8", [*RUN_2B, "--fp8"], [*TINY, "--fp8"], 75, r"^(final|GPU memory|activations).*"),
]
SESSION_S = 540  # 9 minutes: a call may take 10, and the machine's start counts against the same budget


def run_step(name: str, argv: list[str], limit: float, keep: str, out: Path) -> list[str]:
    """Run one step from the course's folder; its output to out/<name>.log; the lines to keep."""
    start = time.monotonic()
    try:
        done = subprocess.run([PY, *argv], cwd=COURSE, capture_output=True, text=True, timeout=limit)
        text, status = done.stdout + done.stderr, f"exit {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"").decode() + (expired.stderr or b"").decode()
        status = f"stopped at its {limit:.0f} s limit"
    (out / f"{name.replace(' ', '_')}.log").write_text(text)
    kept = [line.rstrip() for line in text.splitlines() if re.match(keep, line)]
    return [f"== {name}: {status}, {time.monotonic() - start:.0f} s", *kept[-12:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on a CPU: the plumbing only")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="these steps only (e.g. '09 1b flash')")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", COURSE / "gpu_session"))
    out.mkdir(parents=True, exist_ok=True)
    summary, start = [], time.monotonic()
    for name, gpu_argv, cpu_argv, limit, keep in STEPS:
        if args.only and name not in args.only:
            continue
        left = SESSION_S - (time.monotonic() - start)
        if left < 20:
            summary.append(f"== {name}: not run, the session's {SESSION_S} s are spent")
            continue
        summary += run_step(name, cpu_argv if args.rehearse else gpu_argv, min(limit, left), keep, out)
        print("\n".join(summary[-1:]), flush=True)
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
