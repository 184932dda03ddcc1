"""The official FeatCal code and ours, side by side in one invocation, on the same ViT-B/32-shaped model and data,
the same threads: wall time, calibration time, peak RSS (each run in its own child process) and how far our fp32
calibrated weights are from the official code's.

    python -m benchmarks.vs_official --official /work/official --experts 8 --examples 32 --threads 1 \
        --precision fp32 bf16 --out benchmarks/results/vs_official.md

`--official` is a checkout of github.com/egangu/featcal given at run time (never copied here); it runs through
`official_driver.py` on `pipeline_cost.py`'s synthetic inputs with its own defaults (Task Arithmetic 0.3, λ = 0.05,
ρ = 2.2, α = 0.25), which are also our config's defaults; ours runs `featcal run` with evaluation off. The official
code runs first, then ours, back to back (or, with `--concurrent`, all at once, for a machine so busy that one after
another would not finish in time): the machine may be shared, so the ratios are what to read, CPU seconds first.

`--ours-before DIR` also runs another checkout of this project (the commit before a change) with the same precisions
and solves, in the same invocation, so that one table says whether the change made the CPU path slower.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from benchmarks.common import ROOT, child_cost, child_env, cpu_line, runtime_field, same_weights, weight_gap
from benchmarks.pipeline_cost import KINDS, build_inputs, config_file, run_once
from flows.pipeline import machine

# Goals of issue 32 §3 (1 thread, 8 experts × 32 examples): speed-up over the official code by our precision, our
# peak RSS as a fraction of the official code's, and the fp32 weight gap.
SPEEDUP_GOALS = {"fp32": 1.5, "bf16": 2.5}
RSS_GOAL = 0.25
GAP_GOAL = 1e-5


def run_official(official: Path, work: Path, run_dir: Path, experts: int, examples: int, threads: int,
                 device: str = "cpu") -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "official_driver.py"), "--official", str(official),
           "--work", str(work), "--experts", str(experts), "--examples", str(examples), "--threads", str(threads),
           "--device", device, "--out", str(run_dir)]
    run_dir.mkdir(parents=True)
    env = child_env(threads, official.resolve() / "src")  # its package is also named featcal: nothing of ours
    site = os.environ.get("FEATCAL_GPU_SITE")  # gpu_check.sh's carried wheels (datasets, ...), which it needs too
    if site and Path(site).is_dir():
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
    wall, rss, cpu = child_cost(cmd, run_dir, env)
    timing = json.loads((run_dir / "timing.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "calibration_s": timing["calibration_s"], "peak_rss_gib": rss}


def run_ours(work: Path, run_dir: Path, experts: int, examples: int, threads: int, precision: str,
             solve: str, extra: dict[str, str], device: str = "cpu", code: Path = ROOT) -> dict:
    """One `featcal run` of the checkout at `code` (this one by default)."""
    runtime = {"precision": precision, "solve_precision": solve, "device": device, **extra}
    result = run_once(config_file(work, experts, examples, runtime), run_dir, threads, prefect=False, code=code)
    return {**result, "calibration_s": sum(result["stages_s"].get(k, 0.0) for k in KINDS)}


def met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--official", type=Path, required=True, help="checkout of github.com/egangu/featcal")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=sorted(SPEEDUP_GOALS), nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--solve", choices=["float64", "mixed"], nargs="+", default=["float64"],
                        help="our runs' runtime.solve_precision; each precision runs with each")
    parser.add_argument("--concurrent", action="store_true",
                        help="start all runs at once (on a machine already oversubscribed, so that they share the "
                             "same load and finish in time; compare CPU seconds then)")
    parser.add_argument("--runtime", nargs="+", default=[], type=runtime_field, metavar="KEY=VALUE",
                        help="more runtime fields for our runs (keep_freed_memory=true, ...)")
    parser.add_argument("--shape", default="vit-b32", help="a pipeline_cost.py shape (tiny: a quick check)")
    parser.add_argument("--device", default="cpu", help="where both codes compute: cpu, cuda or cuda:N")
    parser.add_argument("--ours-before", type=Path, metavar="CHECKOUT",
                        help="another checkout of this project (before a change) run beside this one, same runs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-bench"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if "fp32" not in args.precision:
        parser.error("--precision must include fp32: the weight gap is measured on our fp32 run")
    work = args.work / args.shape
    build_inputs(work, args.shape, args.experts, args.examples)
    extra = dict(args.runtime)
    stamp = time.time_ns()
    codes = {"ours": ROOT} if args.ours_before is None else {"ours-before": args.ours_before.resolve(), "ours": ROOT}
    # "official", then (code, precision, solve) for each of our runs
    Key = str | tuple[str, str, str]
    dirs: dict[Key, Path] = {"official": args.work / f"official-{args.shape}-{stamp}"}
    jobs: dict[Key, Callable[[], dict]] = {
        "official": lambda: run_official(args.official.resolve(), work, dirs["official"], args.experts, args.examples,
                                         args.threads, args.device)}
    ours = [(c, p, s) for c in codes for p in args.precision for s in args.solve]
    for code, precision, solve in ours:
        dirs[code, precision, solve] = args.work / f"{code}-{args.shape}-{precision}-{solve}-{stamp}"
        jobs[code, precision, solve] = partial(run_ours, work, dirs[code, precision, solve], args.experts,
                                               args.examples, args.threads, precision, solve, extra, args.device,
                                               codes[code])
    loads = [os.getloadavg()[0]]
    results: dict[Key, dict] = {}
    with ThreadPoolExecutor(max_workers=len(jobs) if args.concurrent else 1) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        for name, future in futures.items():
            results[name] = future.result()
            loads.append(os.getloadavg()[0])
            print(name, json.dumps(results[name]), flush=True)
    rows = [{"code": "official", "precision": "fp32", "solve": "fp32", **results["official"]}]
    rows += [{"code": c, "precision": p, "solve": s, **results[c, p, s],
              "gap": weight_gap(dirs[c, p, s], dirs["official"]) if p == "fp32" else None} for c, p, s in ours]
    official = rows[0]
    gap = max(r["gap"] for r in rows[1:] if r["gap"] is not None and r["code"] == "ours")
    order = "all at once" if args.concurrent else "one after another, the official code first"
    lines = [
        f"# Ours against the official FeatCal code — {args.shape} shape, {args.experts} experts × {args.examples} "
        f"examples, {args.threads} thread(s), device {args.device}, evaluation off",
        "",
        f"Machine: {machine()}. CPU: {cpu_line()}. Date: {time.strftime('%Y-%m-%d %H:%M %Z')}. Runs: {order}. "
        f"1-minute load average at the start and as each run was collected: "
        f"{' → '.join(f'{x:.1f}' for x in loads)} (each run adds about {args.threads}). "
        f"Command: `python -m benchmarks.vs_official {' '.join(sys.argv[1:])}`",
        "",
        "| code | precision | solve | CPU (s) | wall (s) | calibration (s) | peak RSS (GiB) | CPU speed-up "
        "| wall speed-up | RSS / official's | weight matrices vs official |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['code']} | {r['precision']} | {r['solve']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['calibration_s']:.1f} | {r['peak_rss_gib']:.2f} | {official['cpu_s'] / r['cpu_s']:.2f}× | "
                     f"{official['wall_s'] / r['wall_s']:.2f}× | {r['peak_rss_gib'] / official['peak_rss_gib']:.2f} | "
                     + (f"{r['gap']:.1e}" if r.get("gap") is not None else "–") + " |")
    if args.ours_before is not None:
        lines += ["", f"This checkout (`ours`) against `ours-before` ({args.ours_before}), CPU seconds, the goal being "
                  "no slower:"]
        for _, p, s in ours[:len(ours) // 2]:
            ratio = results["ours", p, s]["cpu_s"] / results["ours-before", p, s]["cpu_s"]
            same = same_weights(dirs["ours", p, s], dirs["ours-before", p, s])
            lines.append(f"- {p} ({s} solve): after / before = {ratio:.3f} — {met(ratio <= 1.0)}; calibrated "
                         f"weights {'bit-identical' if same else 'differ'} "
                         f"(gap {weight_gap(dirs['ours', p, s], dirs['ours-before', p, s]):.1e})")
    lines += ["", "Goals (issue 32 §3), speed on CPU seconds (wall in brackets):"]
    for r in rows[1:]:
        if r["code"] != "ours":
            continue
        speedup = official["cpu_s"] / r["cpu_s"]
        goal = SPEEDUP_GOALS[r["precision"]]
        lines.append(f"- {r['precision']} ({r['solve']} solve) ≥ {goal}× faster than the official code: {speedup:.2f}× "
                     f"({official['wall_s'] / r['wall_s']:.2f}×) — {met(speedup >= goal)}")
    rss = max(r["peak_rss_gib"] for r in rows[1:] if r["code"] == "ours") / official["peak_rss_gib"]
    lines += [f"- peak RSS ≤ {RSS_GOAL}× the official code's: {rss:.2f}× (our larger run) — {met(rss <= RSS_GOAL)}",
              f"- fp32 weights within {GAP_GOAL:.0e} of the official code's: {gap:.1e} (our farther fp32 run) — "
              f"{met(gap <= GAP_GOAL)}",
              "",
              "CPU: user + system seconds of the child process (each run is one process, one thread); wall: that",
              "process from start to exit (interpreter, imports, model loads), which on a shared machine also counts",
              "the time it waited for a core. Calibration (wall): the official code from its Task Arithmetic merge to",
              "the saved model (timed in `official_driver.py`); ours, the sum of its stages (merge, prepare, Gram,",
              "solve, propagate, assemble) from the run's records. Weight gap: the largest relative Frobenius",
              "difference over the calibrated weight matrices (`pipeline_cost.weight_gap`)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
