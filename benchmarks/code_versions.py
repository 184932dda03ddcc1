"""Two checkouts of this project side by side in one invocation, on `pipeline_cost.py`'s synthetic inputs: CPU
seconds, wall time, peak RSS and stage sums of `featcal run` (each run its own child process), and whether the two
calibrated models are bit-identical. For a change meant to cost less without changing a weight; with
`--after-runtime KEY=VALUE ...`, the after runs also set those runtime fields (one checkout as both, for a setting:
`--before . --after . --after-runtime keep_freed_memory=true`).

    git worktree add /tmp/before HEAD~1
    python benchmarks/code_versions.py --before /tmp/before --after . --repeats 2 --concurrent \
        --out benchmarks/results/freed_memory.md

With `--concurrent` the before and after runs of each repeat start together (one core each on a 2-core host), so
they share whatever else the machine is doing; read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_cost import (  # noqa: E402
    KINDS,
    build_inputs,
    config_file,
    run_once,
    runtime_field,
    same_weights,
    weight_gap,
)
from benchmarks.solve_precision import cpu_line  # noqa: E402
from flows.pipeline import machine  # noqa: E402


def commit_of(code: Path) -> str:
    out = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + (" + uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the code after it")
    parser.add_argument("--shape", default="vit-b32", help="a pipeline_cost.py shape (tiny: a quick check)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--concurrent", action="store_true", help="start each repeat's two runs together")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-bench"))
    parser.add_argument("--after-runtime", nargs="+", default=[], type=runtime_field, metavar="KEY=VALUE",
                        help="runtime fields the after runs also set")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work / args.shape
    build_inputs(work, args.shape, args.experts, args.examples)
    runtime = {"precision": args.precision, "device": "cpu"}
    after_runtime = dict(args.after_runtime)
    configs = {"before": config_file(work, args.experts, args.examples, runtime),
               "after": config_file(work, args.experts, args.examples, {**runtime, **after_runtime})}
    codes = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, list[dict]] = {name: [] for name in codes}
    dirs: dict[str, Path] = {}
    for rep in range(args.repeats):
        stamp = time.time_ns()
        with ThreadPoolExecutor(max_workers=2 if args.concurrent else 1) as pool:
            futures = {}
            for name, code in codes.items():
                dirs[name] = args.work / f"{name}-{args.shape}-{stamp}"
                futures[name] = pool.submit(run_once, configs[name], dirs[name], args.threads, False, code)
            for name, future in futures.items():
                results[name].append(future.result())
                print(rep, name, results[name][-1], flush=True)
    identical = same_weights(dirs["after"], dirs["before"])
    lines = [
        f"# Two code versions side by side — {args.shape} shape, {args.experts} experts × {args.examples} examples, "
        f"{args.precision}, {args.threads} thread(s), evaluation off",
        "",
        f"Machine: {machine()}. CPU: {cpu_line()}. Date: {time.strftime('%Y-%m-%d %H:%M %Z')}. Runs: "
        f"{'each repeat’s two at once' if args.concurrent else 'one after another'}, {args.repeats} repeat(s). "
        f"Before: {commit_of(codes['before'])}; after: {commit_of(codes['after'])}"
        + "".join(f", runtime.{k}: {v}" for k, v in after_runtime.items()) + ". "
        f"Command: `python benchmarks/code_versions.py {' '.join(sys.argv[1:])}`",
        "",
        "| code | CPU (s) | wall (s) | peak RSS (GiB) | " + " | ".join(KINDS) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(KINDS),
    ]
    for name, runs in results.items():
        for rep, r in enumerate(runs):
            lines.append(f"| {name} (repeat {rep + 1}) | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                         f"{r['peak_rss_gib']:.3f} | " + " | ".join(f"{r['stages_s'].get(k, 0.0):.1f}" for k in KINDS)
                         + " |")
    ratio = {key: median(a[key] / b[key] for a, b in zip(results["after"], results["before"], strict=True))
             for key in ("cpu_s", "wall_s", "peak_rss_gib")}
    lines += ["", f"After / before, median over repeats: CPU {ratio['cpu_s']:.3f}, wall {ratio['wall_s']:.3f}, "
                  f"peak RSS {ratio['peak_rss_gib']:.3f}. Calibrated weights of the last repeat: "
                  + ("bit-identical." if identical else "different; the weight matrices at most "
                     f"{weight_gap(dirs['after'], dirs['before']):.2g} apart (‖Δ‖/‖W‖, `pipeline_cost.weight_gap`).")]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
