"""Where one Gram stage and one solve of a finished run spend their time: best-of-3 seconds and a cProfile of each,
functions ranked by their own time, so the gap between a run and its floor (benchmarks/pipeline_cost.py) can be
pinned on what costs it.

    featcal run CONFIG --run-dir RUN --no-prefect --set runtime.keep_activations=true --set runtime.threads=1
    python -m benchmarks.stage_profile RUN --layer 5 --task task0 --out benchmarks/results/stage_profile_vitb32.md

The stages run in this process on the run's own inputs, one thread. Each Gram call first removes the outputs it
writes (its statistics and its next boundary), as in a first run: replacing a large file costs what a first run
never pays. What it writes back is what the run wrote (the stages are deterministic)."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `featcal run` sets it, before torch loads

import torch

from flows.pipeline import machine
from tasks.context import context
from tasks.gram import gram
from tasks.solve import solve


def best_of(fn: Callable[[], object], before: Callable[[], None], repeats: int = 3) -> float:
    fn()  # warm-up: page cache, allocator
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def profile_rows(fn: Callable[[], object], before: Callable[[], None], top: int) -> tuple[float, list[tuple]]:
    """(total seconds, [(function, calls, own seconds)]) of one profiled call, the `top` costliest by own time."""
    before()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append((where, calls, own))
    rows.sort(key=lambda r: -r[2])
    return stats.total_tt, rows[:top]  # type: ignore[attr-defined]


def table(title: str, seconds: float, total: float, rows: list[tuple]) -> list[str]:
    lines = [f"### {title}: best of 3 {seconds:.3f} s (profiled call {total:.3f} s)", "",
             "| function | calls | own time (s) | share of the profiled call |", "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {calls} | {own:.3f} | {own / total:.0%} |" for name, calls, own in rows]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path, help="a finished run kept with runtime.keep_activations: true")
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--task", default=None, help="the Gram stage's task (default: the run's first)")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = context(args.run_dir)
    task = args.task or ctx.tasks[0]
    if not (ctx.run / ctx.run.acts(task, args.layer, "merged")).exists():
        raise SystemExit(f"{args.run_dir}: no activations of block {args.layer} for {task}; run it with "
                         "runtime.keep_activations: true")

    def fresh_gram() -> None:
        (ctx.run / ctx.run.stats(task, args.layer)).unlink(missing_ok=True)
        shutil.rmtree(ctx.run / ctx.run.acts(task, args.layer + 1, "expert"), ignore_errors=True)

    def run_gram() -> object:
        return gram(ctx, task, args.layer)

    def run_solve() -> object:
        return solve(ctx, args.layer)

    lines = [f"# One Gram stage and one solve, profiled — {args.run_dir.name}, block {args.layer}", "",
             f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. One thread. {len(ctx.tasks)} tasks. "
             f"Command: `python -m benchmarks.stage_profile {args.run_dir} --layer {args.layer} --task {task} "
             f"--out {args.out}`", ""]
    for title, fn, before in ((f"gram · {task} · block {args.layer}", run_gram, fresh_gram),
                              (f"solve · block {args.layer}", run_solve, lambda: None)):
        seconds = best_of(fn, before)
        total, rows = profile_rows(fn, before, args.top)
        lines += table(title, seconds, total, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
