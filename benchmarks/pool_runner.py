"""Does `--runner pool` use both cores? The same calibration three ways, side by side in one invocation: one
process with 2 torch threads, one process with 1 thread, and a pool of 2 workers × 1 thread; wall time of each,
and whether the pool's weights are bit-identical to the 1-thread run's (they must be: same thread count per stage).

    python -m benchmarks.pool_runner --shape vit-b32 --experts 8 --examples 32 --out benchmarks/results/pool_runner.md
    python -m benchmarks.pool_runner --shape tiny --experts 2 --examples 8 --out /tmp/pool_runner_tiny.md   # smoke

Inputs are benchmarks/pipeline_cost.py's synthetic CLIP vision models and data (built once under --work, reused).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# this script's neighbour: the same synthetic inputs
from benchmarks.common import ROOT, same_weights
from benchmarks.pipeline_cost import SHAPES, build_inputs, config_file
from flows.pipeline import machine

WORK = Path("/tmp/featcal-bench")  # pipeline_cost.py's default: its inputs are reused
# name → (label, featcal run options)
WAYS = {
    "seq-2t": ("sequential, 1 process × 2 threads", ["--set", "runtime.threads=2"]),
    "seq-1t": ("sequential, 1 process × 1 thread", ["--set", "runtime.threads=1"]),
    "pool-2x1": ("pool, 2 workers × 1 thread", ["--runner", "pool", "--workers", "2", "--worker-threads", "1"]),
}


def run(config: Path, run_dir: Path, options: list[str]) -> float:
    """Wall seconds of one `featcal run --no-prefect` in a child process (start-up and imports included)."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir), "--no-prefect", *options]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit-b32")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--work", type=Path, default=WORK)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work / args.shape
    build_inputs(work, args.shape, args.experts, args.examples)
    config = config_file(work, args.experts, args.examples)
    stamp = time.time_ns()
    dirs = {name: args.work / f"pool-{args.shape}-{args.experts}-{name}-{stamp}" for name in WAYS}
    walls = {}
    for name, (label, options) in WAYS.items():
        walls[name] = run(config, dirs[name], options)
        print(f"{label}: {walls[name]:.1f} s", flush=True)
    identical = same_weights(dirs["pool-2x1"], dirs["seq-1t"])
    command = (f"python -m benchmarks.pool_runner --shape {args.shape} --experts {args.experts} "
               f"--examples {args.examples}{'' if args.work == WORK else f' --work {args.work}'} --out {args.out}")
    lines = [
        f"# `--runner pool` against one process — {args.shape} shape, {args.experts} experts × "
        f"{args.examples} examples",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`",
        "",
        "| how | wall (s) | vs. sequential 1 thread | vs. sequential 2 threads |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {walls[name]:.1f} | {walls['seq-1t'] / walls[name]:.2f}× | "
          f"{walls['seq-2t'] / walls[name]:.2f}× |"
          for name, (label, _) in WAYS.items()),
        "",
        f"Calibrated weights of the pool (2 × 1 thread) and of the sequential 1-thread run bit-identical: "
        f"**{'yes' if identical else 'NO'}**.",
        "",
        "Each is one `featcal run --no-prefect` in a child process, start-up, imports and preflight included, run one",
        "after the other on the same inputs (benchmarks/pipeline_cost.py's synthetic CLIP vision models and data);",
        "a ratio above 1× means faster than that sequential run.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())
    if not identical:
        sys.exit("the pool's weights differ from the sequential 1-thread run's")


if __name__ == "__main__":
    main()
