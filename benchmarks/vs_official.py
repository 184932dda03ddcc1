"""The official FeatCal code and ours, side by side in one invocation, on the same ViT-B/32-shaped model and data,
the same threads: wall time, calibration time, peak RSS (each run in its own child process) and how far our fp32
calibrated weights are from the official code's.

    python benchmarks/vs_official.py --official /work/official --experts 8 --examples 32 --threads 1 \
        --precision fp32 bf16 --out benchmarks/results/vs_official.md

`--official` is a checkout of github.com/egangu/featcal given at run time (never copied here); it runs through
`official_driver.py` on `pipeline_cost.py`'s synthetic inputs with its own defaults (Task Arithmetic 0.3, λ = 0.05,
ρ = 2.2, α = 0.25), which are also our config's defaults; ours runs `featcal run` with evaluation off. The official
code runs first, then ours, back to back: the machine may be shared, so the ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_cost import (  # noqa: E402
    KINDS, build_inputs, child_cost, child_env, config_file, run_once, weight_gap,
)
from benchmarks.solve_precision import cpu_line  # noqa: E402
from flows.pipeline import machine  # noqa: E402

# Goals of issue 32 §3 (1 thread, 8 experts × 32 examples): speed-up over the official code by our precision, our
# peak RSS as a fraction of the official code's, and the fp32 weight gap.
SPEEDUP_GOALS = {"fp32": 1.5, "bf16": 2.5}
RSS_GOAL = 0.25
GAP_GOAL = 1e-5


def run_official(official: Path, work: Path, run_dir: Path, experts: int, examples: int, threads: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "official_driver.py"), "--official", str(official),
           "--work", str(work), "--experts", str(experts), "--examples", str(examples), "--threads", str(threads),
           "--out", str(run_dir)]
    run_dir.mkdir(parents=True)
    wall, rss = child_cost(cmd, run_dir, child_env(threads, None))
    timing = json.loads((run_dir / "timing.json").read_text())
    return {"wall_s": wall, "calibration_s": timing["calibration_s"], "peak_rss_gib": rss}


def met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--official", type=Path, required=True, help="checkout of github.com/egangu/featcal")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=sorted(SPEEDUP_GOALS), nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--shape", default="vit-b32", help="a pipeline_cost.py shape (tiny: a quick check)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-bench"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if "fp32" not in args.precision:
        parser.error("--precision must include fp32: the weight gap is measured on our fp32 run")
    work = args.work / args.shape
    build_inputs(work, args.shape, args.experts, args.examples)
    stamp = time.time_ns()
    loads = [os.getloadavg()[0]]
    rows = [{"code": "official", "precision": "fp32",
             **run_official(args.official.resolve(), work, args.work / f"official-{args.shape}-{stamp}", args.experts,
                            args.examples, args.threads)}]
    loads.append(os.getloadavg()[0])
    print(json.dumps(rows[-1]), flush=True)
    dirs = {"official": args.work / f"official-{args.shape}-{stamp}"}
    for precision in args.precision:
        run_dir = args.work / f"ours-{args.shape}-{precision}-{stamp}"
        result = run_once(config_file(work, args.experts, args.examples, {"precision": precision, "device": "cpu"}),
                          run_dir, args.threads, prefect=False)
        loads.append(os.getloadavg()[0])
        dirs[precision] = run_dir
        rows.append({"code": "ours", "precision": precision, **result,
                     "calibration_s": sum(result["stages_s"].get(k, 0.0) for k in KINDS)})
        print(json.dumps(rows[-1]), flush=True)
    official = rows[0]
    gap = weight_gap(dirs["fp32"], dirs["official"])
    lines = [
        f"# Ours against the official FeatCal code — {args.shape} shape, {args.experts} experts × {args.examples} "
        f"examples, {args.threads} thread(s), evaluation off",
        "",
        f"Machine: {machine()}. CPU: {cpu_line()}. Date: {time.strftime('%Y-%m-%d %H:%M %Z')}. "
        f"1-minute load average before / after each run: {' → '.join(f'{x:.1f}' for x in loads)} "
        f"(a run adds about {args.threads}). Command: `python benchmarks/vs_official.py {' '.join(sys.argv[1:])}`",
        "",
        "| code | precision | wall (s) | calibration (s) | peak RSS (GiB) | wall speed-up | calibration speed-up "
        "| RSS / official's | weight matrices vs official |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['code']} | {r['precision']} | {r['wall_s']:.1f} | {r['calibration_s']:.1f} | "
                     f"{r['peak_rss_gib']:.2f} | {official['wall_s'] / r['wall_s']:.2f}× | "
                     f"{official['calibration_s'] / r['calibration_s']:.2f}× | "
                     f"{r['peak_rss_gib'] / official['peak_rss_gib']:.2f} | "
                     + (f"{gap:.1e}" if r["code"] == "ours" and r["precision"] == "fp32" else "–") + " |")
    lines += ["", "Goals (issue 32 §3), on wall time:"]
    for r in rows[1:]:
        speedup = official["wall_s"] / r["wall_s"]
        goal = SPEEDUP_GOALS[r["precision"]]
        lines.append(f"- {r['precision']} ≥ {goal}× faster than the official code: {speedup:.2f}× — {met(speedup >= goal)}")
    rss = max(r["peak_rss_gib"] for r in rows[1:]) / official["peak_rss_gib"]
    lines += [f"- peak RSS ≤ {RSS_GOAL}× the official code's: {rss:.2f}× (our larger run) — {met(rss <= RSS_GOAL)}",
              f"- fp32 weights within {GAP_GOAL:.0e} of the official code's: {gap:.1e} — {met(gap <= GAP_GOAL)}",
              "",
              "Wall: the child process from start to exit (interpreter, imports, model loads). Calibration: the official",
              "code from its Task Arithmetic merge to the saved model (timed in `official_driver.py`); ours, the sum of",
              "its stages (merge, prepare, Gram, solve, propagate, assemble) from the run's records. Weight gap: the",
              "largest relative Frobenius difference over the calibrated weight matrices (`pipeline_cost.weight_gap`)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
