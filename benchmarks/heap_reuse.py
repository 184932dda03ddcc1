"""Where a Llama-shaped block's time beyond the floor goes: the kernel's share, and what reusing freed memory gives.

Runs one block's Gram stages (each task) and its solve, `--reps` times over, in a child process per setting, on a
kept run directory whose block 0 Gram stages can run (a `featcal run --no-prefect` stopped, with SIGKILL, during
block 0's solve: its activations and statistics are still there). Each setting's child reports user and system CPU
seconds, minor page faults and wall time per stage, and its peak RSS. Settings:

- `default`: as `featcal run` runs (torch's THP_MEM_ALLOC_ENABLE=1; the C heap trimmed before each solve).
- `thp-off`: THP_MEM_ALLOC_ENABLE=0: 4 KiB pages.
- `heap-kept-env`: glibc never maps a large block on its own (MALLOC_MMAP_MAX_=0) nor trims its heap
  (MALLOC_TRIM_THRESHOLD_ 64 GiB), from the process's start, and the solve's trim is skipped.
- `keep-freed-memory`: what `runtime.keep_freed_memory: true` does (`featcal.devices.keep_freed_memory`, by
  mallopt once the process runs, one arena too), and the solve's trim skipped: memory a stage frees serves the next.

    python -m benchmarks.heap_reuse --run RUN_DIR --reps 3 --out benchmarks/results/heap_reuse_llama.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "default": {"THP_MEM_ALLOC_ENABLE": "1"},
    "thp-off": {"THP_MEM_ALLOC_ENABLE": "0"},
    "heap-kept-env": {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_MAX_": "0",
                      "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)},
    "keep-freed-memory": {"THP_MEM_ALLOC_ENABLE": "1"},
}
KEEPS_HEAP = {"heap-kept-env", "keep-freed-memory"}


def child(run_dir: str, reps: int, setting: str) -> None:
    """The stages in this process; one JSON line per stage on stdout."""
    import resource

    import torch

    torch.set_num_threads(1)
    from featcal.devices import keep_freed_memory
    from tasks import gram, solve
    from tasks.context import context

    if setting == "keep-freed-memory":
        keep_freed_memory()
    if setting in KEEPS_HEAP:  # the kept run's config leaves runtime.keep_freed_memory false
        solve.release_freed_memory = lambda: None
    ctx = context(run_dir)
    for rep in range(reps):
        stages = [(f"gram {task}", lambda task=task: gram.gram(ctx, task, 0)) for task in ctx.tasks]
        for name, stage in [*stages, ("solve", lambda: solve.solve(ctx, 0))]:
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            stage()
            after = resource.getrusage(resource.RUSAGE_SELF)
            print(json.dumps({"rep": rep, "stage": name, "wall": time.perf_counter() - start,
                              "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
                              "minflt": after.ru_minflt - before.ru_minflt,
                              "maxrss_gib": after.ru_maxrss / 2**20}), flush=True)


def measured(run_dir: Path, reps: int, setting: str) -> list[dict]:
    env = {**os.environ, **SETTINGS[setting], "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.heap_reuse", "--child", setting, "--run", str(run_dir),
           "--reps", str(reps)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def table(rows_by_setting: dict[str, list[dict]], reps: int) -> list[str]:
    lines = ["| setting | stage | wall (s) | user (s) | system (s) | minor faults | peak RSS so far (GiB) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for setting, rows in rows_by_setting.items():
        for r in rows:
            if r["rep"] == reps - 1:
                lines.append(f"| {setting} | {r['stage']} | {r['wall']:.1f} | {r['user']:.1f} | {r['sys']:.1f} | "
                             f"{r['minflt']} | {r['maxrss_gib']:.2f} |")
    lines += ["", "Block (all its stages) in the last repetition, and over every repetition:", "",
              "| setting | block wall, last (s) | system, last (s) | blocks wall, each rep (s) | peak RSS (GiB) |",
              "|---|---:|---:|---|---:|"]
    for setting, rows in rows_by_setting.items():
        per_rep = [sum(r["wall"] for r in rows if r["rep"] == k) for k in range(reps)]
        sys_last = sum(r["sys"] for r in rows if r["rep"] == reps - 1)
        lines.append(f"| {setting} | {per_rep[-1]:.1f} | {sys_last:.1f} | {', '.join(f'{w:.1f}' for w in per_rep)} | "
                     f"{max(r['maxrss_gib'] for r in rows):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a kept run directory (see above)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(str(args.run), args.reps, args.child)
        return
    results = {}
    for setting in args.settings:  # one after the other: the 2 cores are not shared between settings
        started = time.strftime("%H:%M UTC", time.gmtime())
        results[setting] = measured(args.run, args.reps, setting)
        print(f"{setting} (started {started}): done", flush=True)
    from flows.pipeline import machine

    head = [f"# Block 0 of a kept run, {args.reps} repetitions a setting, one child process each",
            "", f"Machine: {machine()}; load average at the end {os.getloadavg()[0]:.1f}. Run directory: "
            f"`{args.run}`. Command: `python -m benchmarks.heap_reuse {' '.join(sys.argv[1:])}`.", ""]
    text = "\n".join(head + table(results, args.reps)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
