"""One A/B harness: the code before a change against the code after it (two checkouts, or one checkout with runtime
fields set on the after side), side by side in one invocation, at the grain the change touches:

- `--stage run`: whole `featcal run`s on `pipeline_cost`'s synthetic inputs, each its own child process: CPU and wall
  seconds, peak RSS, stage sums, and whether the two calibrated models are bit-identical.
- `--stage merge`: the merge stage on any config, each run stopped once its merge is recorded: the merge record's
  seconds and the run process's CPU seconds up to then (preflight scan included).
- `--stage gram` / `--stage solve`: one task's Gram stage or the solve of a finished run kept with
  `runtime.keep_activations: true`, per block, each (checkout, block) in a child process of its own with one thread
  and THP_MEM_ALLOC_ENABLE=1 as `featcal run` sets it: best CPU seconds after a warm-up, the cProfile time split into
  parts, and how far the outputs moved.

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.ab --stage run --before /tmp/before --after . --repeats 2 --concurrent --out FILE
    python -m benchmarks.ab --stage merge --before /tmp/before --after . --config WORK/config.yaml --work /tmp/ab \
        --out FILE
    featcal run CONFIG --run-dir RUN --no-prefect --set runtime.keep_activations=true --set runtime.threads=1
    python -m benchmarks.ab --stage solve --before /tmp/before --after . --run RUN --layers 0 5 11 \
        --solve-precision float64 mixed --out FILE

The two sides alternate (or, for `run` with `--concurrent`, start together), so that load on a shared machine hits both
alike: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

from benchmarks.common import (
    child_env,
    command_line,
    commit_of,
    cpu_line,
    file_gap,
    runtime_field,
    same_weights,
    weight_gap,
)
from benchmarks.pipeline_cost import KINDS, build_inputs, config_file, run_once
from flows.pipeline import machine

SIDES = ("before", "after")


def header(args: argparse.Namespace, title: str, how: str) -> list[str]:
    """A results file's title and its machine, date, commits and command line."""
    after_runtime = "".join(f", runtime.{k}: {v}" for k, v in args.after_runtime)
    return [f"# {title}", "",
            f"Machine: {machine()}. CPU: {cpu_line()}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
            f"{how} Before: {commit_of(args.before)}; after: {commit_of(args.after)}{after_runtime}. "
            f"Command: `{command_line()}`", ""]


# ---- --stage run ---------------------------------------------------------------------------------------------------
def whole_runs(args: argparse.Namespace) -> list[str]:
    work = args.work / args.shape
    build_inputs(work, args.shape, args.experts, args.examples)
    runtime = {"precision": args.precision, "device": "cpu"}
    configs = {"before": config_file(work, args.experts, args.examples, runtime),
               "after": config_file(work, args.experts, args.examples, {**runtime, **dict(args.after_runtime)})}
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    dirs: dict[str, Path] = {}
    for rep in range(args.repeats):
        stamp = time.time_ns()
        with ThreadPoolExecutor(max_workers=2 if args.concurrent else 1) as pool:
            futures = {}
            for side in SIDES:
                dirs[side] = args.work / f"{side}-{args.shape}-{stamp}"
                futures[side] = pool.submit(run_once, configs[side], dirs[side], args.threads, False,
                                            getattr(args, side))
            for side, future in futures.items():
                results[side].append(future.result())
                print(rep, side, results[side][-1], flush=True)
    identical = same_weights(dirs["after"], dirs["before"])
    order = "each repeat's two at once" if args.concurrent else "one after another"
    lines = header(args, f"Two code versions side by side — {args.shape} shape, {args.experts} experts × "
                   f"{args.examples} examples, {args.precision}, {args.threads} thread(s), evaluation off",
                   f"Runs: {order}, {args.repeats} repeat(s).")
    lines += ["| code | CPU (s) | wall (s) | peak RSS (GiB) | " + " | ".join(KINDS) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(KINDS)]
    for side, runs in results.items():
        for rep, r in enumerate(runs):
            lines.append(f"| {side} (repeat {rep + 1}) | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                         f"{r['peak_rss_gib']:.3f} | " + " | ".join(f"{r['stages_s'].get(k, 0.0):.1f}" for k in KINDS)
                         + " |")
    ratio = {key: median(a[key] / b[key] for a, b in zip(results["after"], results["before"], strict=True))
             for key in ("cpu_s", "wall_s", "peak_rss_gib")}
    lines += ["", f"After / before, median over repeats: CPU {ratio['cpu_s']:.3f}, wall {ratio['wall_s']:.3f}, "
                  f"peak RSS {ratio['peak_rss_gib']:.3f}. Calibrated weights of the last repeat: "
                  + ("bit-identical." if identical else "different; the weight matrices at most "
                     f"{weight_gap(dirs['after'], dirs['before']):.2g} apart (‖Δ‖/‖W‖, `common.weight_gap`).")]
    return lines


# ---- --stage merge -------------------------------------------------------------------------------------------------
def merge_run(code: Path, config: Path, run_dir: Path, sets: list[str]) -> dict[str, float]:
    """One `featcal run` of the checkout at `code`, killed once records/merge.json appears."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir), "--no-prefect", *sets]
    proc = subprocess.Popen(cmd, cwd=code, env=child_env(1, code), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    record = run_dir / "records" / "merge.json"
    try:
        while not record.is_file():
            if proc.poll() is not None:
                raise SystemExit(f"{code}: the run ended (exit {proc.returncode}) before its merge was recorded")
            time.sleep(0.2)
        with open(f"/proc/{proc.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime of the run process
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = json.loads(record.read_text())["seconds"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"merge_s": seconds, "cpu_s": cpu}


def merge_stages(args: argparse.Namespace) -> list[str]:
    if args.config is None:
        raise SystemExit("--stage merge needs --config: the pipeline config both sides run")
    sets = {"before": [], "after": [f"--set=runtime.{k}={v}" for k, v in args.after_runtime]}
    rows, results = [], {side: [] for side in SIDES}
    for repeat in range(1, args.repeats + 1):
        for side in SIDES:
            got = merge_run(getattr(args, side), args.config.resolve(), args.work / side, sets[side])
            results[side].append(got)
            rows.append(f"| {side} ({repeat}) | {got['merge_s']:.1f} | {got['cpu_s']:.1f} |")
            print(rows[-1], flush=True)
    best = {side: min(r["merge_s"] for r in rs) for side, rs in results.items()}
    return [*header(args, f"The merge stage of two checkouts — `{args.config.name}`",
                    "One after another, alternating, one thread."),
            "| run | merge stage (s) | run process CPU until then (s, with the preflight scan) |", "|---|---:|---:|",
            *rows, "", f"Best merge stage: before {best['before']:.1f} s, after {best['after']:.1f} s "
            f"({best['before'] / best['after']:.2f}× faster)."]


# ---- --stage gram / solve ------------------------------------------------------------------------------------------
# cProfile function names → the part of a stage they are (first match wins); the rest is "other".
PARTS = {
    "solve": (
        ("read moments from disk", ("readinto", "read_header", "io.open")),
        ("write the block file", ("serialize_file", "fsync", "posix.replace")),
        ("triangular solves (cholesky_solve)", ("cholesky_solve",)),
        ("Cholesky factorisation", ("linalg_cholesky_ex",)),
        ("C_st·W_tᵀ products (addmm_)", ("addmm_",)),
        ("float64 casts (.double)", ("'double'",)),
        ("moments ÷ Σw (linear_moments)", ("statistics.py", "div_")),
        ("adds into A and B (add_)", ("'add_'",)),
        ("copies (clone/contiguous/copy_)", ("'clone'", "'contiguous'", "'copy_'")),
        ("‖C_ss‖_F (matrix_norm)", ("matrix_norm",)),
        ("allocations (zeros/eye)", ("torch.zeros", "torch.eye")),
        ("bias and anchor terms", ("solve_linear_bias", "(anchor)", "(of)", "addmv")),
    ),
    "gram": (
        ("block forwards (linear, attention, activations)", ("_nn.linear", "scaled_dot_product", "sigmoid",
                                                             "layer_norm", "'var'", "gelu")),
        ("C_ss panels and C_se (addmm_)", ("addmm_",)),
        ("P_t product (add_target_product)", ("add_target_product", "bf16_target_product")),
        ("fp32 → float64 accumulation", ("add_widened", "statistics.py:")),
        ("zeroed buffers (zeros)", ("torch.zeros",)),
        ("mirror of C_ss", ("mirror_upper", "'copy_'", "'triu'")),
        ("Zarr read / write", ("readinto", "zarr", "numcodecs", "blosc", "'read'", "'write'")),
        ("statistics file write", ("serialize_file", "fsync", "posix.replace")),
    ),
}

CHILD = r"""
import cProfile, json, pstats, shutil, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from tasks.gram import gram
from tasks.solve import solve
from tasks.context import context
run, stage, precision, keep = sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[6]
layer, repeats = int(sys.argv[3]), int(sys.argv[5])
ctx = context(Path(run))
ctx.cfg.runtime.solve_precision = precision
task = ctx.tasks[0]

def fresh():
    if stage == "gram":
        (ctx.run / ctx.run.stats(task, layer)).unlink(missing_ok=True)
        shutil.rmtree(ctx.run / ctx.run.acts(task, layer + 1, "expert"), ignore_errors=True)

def call():
    return solve(ctx, layer) if stage == "solve" else gram(ctx, task, layer)

fresh(); call()
best = float("inf")
for _ in range(repeats):
    fresh()
    start = time.process_time()
    outputs, info = call()
    best = min(best, time.process_time() - start)
fresh()
prof = cProfile.Profile()
prof.enable()
outputs, info = call()
prof.disable()
own = {}
for (file, line, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
    key = name if file == "~" else f"{Path(file).name}:{line}({name})"
    own[key] = own.get(key, 0.0) + tt
kept = outputs[0] if stage == "solve" else ctx.run.stats(task, layer)
shutil.copy(ctx.run / kept, keep)
print(json.dumps({"seconds": best, "own": own, "paths": info.get("solve_path", {})}))
"""


def stage_child(code: Path, run: Path, stage: str, layer: int, precision: str, repeats: int, keep: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "THP_MEM_ALLOC_ENABLE": "1", "PYTHONPATH": str(code)}
    args = [str(run), stage, str(layer), precision, str(repeats), str(keep)]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=code, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{stage} of block {layer} ({precision}) with {code} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parts(stage: str, own: dict[str, float]) -> dict[str, float]:
    """cProfile own times summed into the stage's PARTS."""
    total = {name: 0.0 for name, _ in PARTS[stage]} | {"other": 0.0}
    for key, seconds in own.items():
        name = next((n for n, needles in PARTS[stage] if any(s in key for s in needles)), "other")
        total[name] += seconds
    return total


def block_stages(args: argparse.Namespace) -> list[str]:
    if args.run is None:
        raise SystemExit(f"--stage {args.stage} needs --run: a finished run kept with runtime.keep_activations: true")
    stage = args.stage
    keep = Path(tempfile.mkdtemp(prefix="ab-"))  # the files each child wrote
    results: dict[tuple[str, str, int], dict] = {}
    for precision in args.solve_precision:
        for layer in args.layers:
            for side in SIDES:
                results[side, precision, layer] = stage_child(getattr(args, side), args.run, stage, layer, precision,
                                                              args.repeats, keep / f"{side}-{precision}-{layer}.st")
                print(side, stage, precision, layer, f"{results[side, precision, layer]['seconds']:.3f} s", flush=True)
    lines = header(args, f"The {stage} stage of two checkouts, per block", f"One thread; best CPU seconds of "
                   f"{args.repeats} after a warm-up" + ("; the run's first task." if stage == "gram" else "."))
    lines += ["| solve precision | block | before s | after s | speed-up | max rel. difference of the outputs |",
              "|---|---|---|---|---|---|"]
    for precision in args.solve_precision:
        for layer in args.layers:
            b, a = (results[side, precision, layer] for side in SIDES)
            diff = file_gap(*(keep / f"{side}-{precision}-{layer}.st" for side in ("after", "before")))
            lines.append(f"| {precision} | {layer} | {b['seconds']:.3f} | {a['seconds']:.3f} | "
                         f"{b['seconds'] / a['seconds']:.2f}× | {diff:.1e} |")
    for precision in args.solve_precision:
        lines += ["", f"Where the time goes ({stage}, {precision}): cProfile own seconds, summed over the blocks' "
                  "profiled calls:", "", "| part | before s | after s |", "|---|---|---|"]
        split = {side: [parts(stage, results[side, precision, layer]["own"]) for layer in args.layers]
                 for side in SIDES}
        for part in split["after"][0]:
            lines.append(f"| {part} | {sum(s[part] for s in split['before']):.3f} | "
                         f"{sum(s[part] for s in split['after']):.3f} |")
        paths = {side: sorted({p for layer in args.layers for p in results[side, precision, layer]["paths"].values()})
                 for side in SIDES}
        if any(paths.values()):
            lines += ["", f"Solve paths ({precision}): before {paths['before']}; after {paths['after']}"]
    shutil.rmtree(keep)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--stage", choices=["run", "merge", "gram", "solve"], required=True)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout of the code after it (default .)")
    parser.add_argument("--after-runtime", nargs="+", default=[], type=runtime_field, metavar="KEY=VALUE",
                        help="runtime fields the after side also sets (run, merge)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-ab"), help="inputs and run directories")
    parser.add_argument("--out", type=Path, required=True)
    run = parser.add_argument_group("--stage run: pipeline_cost's synthetic inputs")
    run.add_argument("--shape", default="vit-b32", help="a pipeline_cost shape (tiny: a quick check)")
    run.add_argument("--experts", type=int, default=8)
    run.add_argument("--examples", type=int, default=32)
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    run.add_argument("--concurrent", action="store_true", help="start each repeat's two runs together")
    merge = parser.add_argument_group("--stage merge")
    merge.add_argument("--config", type=Path, help="the pipeline config both sides run")
    block = parser.add_argument_group("--stage gram / solve")
    block.add_argument("--run", type=Path, help="a finished run kept with runtime.keep_activations: true")
    block.add_argument("--layers", type=int, nargs="+", default=[0, 5, 11])
    block.add_argument("--solve-precision", nargs="+", choices=["float64", "mixed"], default=["float64"],
                       help="runtime.solve_precision of each case")
    args = parser.parse_args()
    args.before, args.after = args.before.resolve(), args.after.resolve()
    if args.after_runtime and args.stage in ("gram", "solve"):
        raise SystemExit("--after-runtime applies to --stage run and merge; gram and solve read the kept run's config")
    lines = {"run": whole_runs, "merge": merge_stages, "gram": block_stages, "solve": block_stages}[args.stage](args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
