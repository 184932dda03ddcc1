"""Wall time of `featcal bench list` (a fresh interpreter each time, as a user's shell starts it) for one or more
checkouts side by side, runs alternating between them so the machine's load falls on each alike; and the modules
whose import costs the most in the last checkout (python -X importtime).

    python -m benchmarks.bench_list_time --repeat 3 --out benchmarks/results/bench_list_time.md BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_line
from flows.pipeline import machine


def wall_seconds(checkout: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "featcal_bench.cli", "bench", "list"], env=env, cwd=checkout, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def heaviest_imports(checkout: Path, top: int) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the `top` costliest imports of a listing, nested ones included (a module's
    figure holds those it imports)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "featcal_bench.cli", "bench", "list"], env=env,
                         cwd=checkout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        rows.append((int(cumulative) / 1e6, name))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    times: dict[Path, list[float]] = {c: [] for c in args.checkouts}
    for _ in range(args.repeat):
        for checkout in args.checkouts:
            times[checkout].append(wall_seconds(checkout))
    load = os.getloadavg()
    lines = ["# `featcal bench list`: wall time per checkout", "",
             f"Machine: {machine()}; CPU: {cpu_line()}; shared with other jobs (load average "
             f"{load[0]:.1f} at the end). Written by `python -m benchmarks.bench_list_time --repeat {args.repeat}`; "
             "runs alternate between checkouts.", "",
             "| checkout | median wall (s) | runs (s) |", "|---|---:|---|"]
    for checkout, walls in times.items():
        lines.append(f"| {checkout} | {statistics.median(walls):.2f} | {', '.join(f'{w:.2f}' for w in walls)} |")
    last = args.checkouts[-1]
    lines += ["", f"Costliest imports of a listing in {last} (cumulative s, nested ones included, one run):", "",
              "| module | s |", "|---|---:|"]
    lines += [f"| {name} | {seconds:.2f} |" for seconds, name in heaviest_imports(last, 8)]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
