"""The merge's NaN/inf check on one tensor, one thread: `storage.checkpoint.finite` (its sum first, the element count
only when the sum is not finite) against the element-by-element `isfinite().all()` it replaced, per dtype.

    python benchmarks/finite_check.py --out benchmarks/results/finite_check.md

A Llama-3.2-3B gate_proj weight is 8192 × 3072; the merge checks every tensor of every expert it reads.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gram_profile import cpu_seconds  # noqa: E402
from benchmarks.solve_precision import cpu_line  # noqa: E402
from storage.checkpoint import finite  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 3072])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(*args.shape, generator=g).to(dtype)
        old = cpu_seconds(lambda: bool(torch.isfinite(t).all()), repeats=args.repeats)
        new = cpu_seconds(lambda: finite(t, "w", "experts.a", Path(".")), repeats=args.repeats)
        rows.append(f"| {str(dtype).removeprefix('torch.')} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.1f}× |")
        print(rows[-1], flush=True)
    lines = [f"# The merge's NaN/inf check on one {args.shape[0]} × {args.shape[1]} tensor, one thread", "",
             f"Machine: {cpu_line()}, Python {platform.python_version()}, torch {torch.__version__}. Date: "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. CPU milliseconds, best of {args.repeats} after "
             f"one warm-up call. Command: `python benchmarks/finite_check.py --shape {args.shape[0]} {args.shape[1]} "
             f"--repeats {args.repeats} --out {args.out}`",
             "", "| dtype | isfinite().all() (ms) | finite(): sum first (ms) | speed-up |", "|---|---:|---:|---:|",
             *rows, ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
