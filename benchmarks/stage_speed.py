"""The solve and Gram stages of this checkout against another one (the code before a change), side by side in one
invocation, on a finished run's own statistics and activations: CPU seconds per block, where the time goes, and
whether the outputs moved.

    featcal run CONFIG --run-dir RUN --no-prefect --set runtime.keep_activations=true --set runtime.threads=1
    git archive BASE_COMMIT | tar -x -C /tmp/before
    python benchmarks/stage_speed.py RUN --before /tmp/before --layers 0 5 11 --out benchmarks/results/stage_speed.md

Each (stage, precision, checkout, block) runs in a child process of its own, one thread, with
THP_MEM_ALLOC_ENABLE=1 as `featcal run` sets it, the two checkouts alternating so that load on a shared machine hits
both alike. A child runs the stage once to warm up, then `--repeats` times, and keeps the best CPU seconds
(`time.process_time`); its last call runs under cProfile, whose functions' own times are summed into parts. The Gram
stage runs on the run's first task and removes its outputs before each call, as a first run has none. The file each
writes (the block's solved weights; the task's statistics) is kept apart and compared with the other checkout's."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.solve_precision import cpu_line  # noqa: E402

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


def child(code: Path, run: Path, stage: str, layer: int, precision: str, repeats: int, keep: Path) -> dict:
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


def gap(a: Path, b: Path) -> float:
    """Largest relative Frobenius difference between two safetensors files' tensors."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        raise RuntimeError(f"{a} and {b} hold different tensors")
    return max(float((x[k].double() - y[k].double()).norm() / y[k].double().norm().clamp_min(1e-300)) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path, help="a finished run kept with runtime.keep_activations: true")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 5, 11])
    parser.add_argument("--cases", nargs="+", default=["solve:float64", "solve:mixed", "gram:float64"],
                        help="STAGE:SOLVE_PRECISION pairs")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    keep = Path(tempfile.mkdtemp(prefix="stage_speed-"))  # the files each child wrote
    codes = {"before": args.before.resolve(), "after": ROOT}
    cases = [tuple(c.split(":")) for c in args.cases]
    results: dict[tuple, dict] = {}
    for stage, precision in cases:
        for layer in args.layers:
            for name, code in codes.items():
                key = (name, stage, precision, layer)
                results[key] = child(code, args.run_dir, stage, layer, precision, args.repeats,
                                     keep / f"{'-'.join(map(str, key))}.safetensors")
                print(*key, f"{results[key]['seconds']:.3f} s", flush=True)
    lines = ["# Solve and Gram stages before/after, one invocation", "",
             f"`python benchmarks/stage_speed.py {args.run_dir} --before {args.before} --layers "
             f"{' '.join(map(str, args.layers))} --cases {' '.join(args.cases)} --repeats {args.repeats}`", "",
             f"- CPU: {cpu_line()}; one thread; {time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- seconds: best CPU seconds of the stage of {args.repeats} after a warm-up; before = `{args.before}`; "
             "the Gram stage is the run's first task's", "",
             "| stage | solve precision | block | before s | after s | speed-up | max rel. difference of the outputs |",
             "|---|---|---|---|---|---|---|"]
    sums: dict[tuple, float] = {}
    for stage, precision in cases:
        for layer in args.layers:
            b, a = (results[name, stage, precision, layer] for name in codes)
            diff = gap(*(keep / f"{name}-{stage}-{precision}-{layer}.safetensors" for name in ("after", "before")))
            lines.append(f"| {stage} | {precision} | {layer} | {b['seconds']:.3f} | {a['seconds']:.3f} | "
                         f"{b['seconds'] / a['seconds']:.2f}× | {diff:.1e} |")
            for name in codes:
                sums[name, stage, precision] = sums.get((name, stage, precision), 0.0) + \
                    results[name, stage, precision, layer]["seconds"]
    lines += ["", "| stage | solve precision | before s | after s | speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {p} | {sums['before', s, p]:.2f} | {sums['after', s, p]:.2f} | "
              f"{sums['before', s, p] / sums['after', s, p]:.2f}× |" for s, p in cases]
    for stage, precision in cases:
        lines += ["", f"Where the time goes ({stage}, {precision}): cProfile own seconds, summed over the blocks' "
                  "profiled calls:", "", "| part | before s | after s |", "|---|---|---|"]
        split = {name: [parts(stage, results[name, stage, precision, layer]["own"]) for layer in args.layers]
                 for name in codes}
        for part in split["after"][0]:
            lines.append(f"| {part} | {sum(s[part] for s in split['before']):.3f} | "
                         f"{sum(s[part] for s in split['after']):.3f} |")
        paths = {name: sorted({p for layer in args.layers
                               for p in results[name, stage, precision, layer]["paths"].values()}) for name in codes}
        if any(paths.values()):
            lines += ["", f"Solve paths ({precision}): before {paths['before']}; after {paths['after']}"]
    shutil.rmtree(keep)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
