"""The solve stage of this checkout against another one (the code before a change), side by side in one invocation,
on a finished run's own statistics: CPU seconds per block and precision, where the time goes, and how far the
weights moved.

    featcal run CONFIG --run-dir RUN --no-prefect --set runtime.threads=1
    git archive BASE_COMMIT | tar -x -C /tmp/before
    python benchmarks/solve_speed.py RUN --before /tmp/before --layers 0 5 11 --out benchmarks/results/solve_speed.md

Each (checkout, precision, block) runs in a child process of its own, one thread, the two checkouts alternating so
that load on a shared machine hits both alike; each child runs the block's solve once to warm up, then
`--repeats` times, and keeps the best CPU seconds (`time.process_time`). Its last call runs under cProfile, whose
functions are summed into parts (reads, float64 casts, the products, Cholesky, triangular solves, ...). The block
file each writes is kept apart and compared: float64 must match the other checkout's within 1e-12 relative."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.solve_precision import cpu_line  # noqa: E402

# cProfile function names → the part of the solve they are (first match wins); the rest is "other".
PARTS = (
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
)

CHILD = r"""
import cProfile, json, pstats, shutil, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from tasks.calibration import solve
from tasks.context import context
run, layer, precision, repeats, keep = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
ctx = context(Path(run))
ctx.cfg.runtime.solve_precision = precision
solve(ctx, layer)
best = float("inf")
for _ in range(repeats):
    start = time.process_time()
    outputs, info = solve(ctx, layer)
    best = min(best, time.process_time() - start)
prof = cProfile.Profile()
prof.enable()
solve(ctx, layer)
prof.disable()
own = {}
for (file, line, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
    key = name if file == "~" else f"{Path(file).name}:{line}({name})"
    own[key] = own.get(key, 0.0) + tt
shutil.copy(ctx.run / outputs[0], keep)
print(json.dumps({"seconds": best, "own": own, "paths": info.get("solve_path", {})}))
"""


def child(code: Path, run: Path, layer: int, precision: str, repeats: int, keep: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(run), str(layer), precision, str(repeats), str(keep)],
                         cwd=code, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"solve of block {layer} ({precision}) with {code} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parts(own: dict[str, float]) -> dict[str, float]:
    """cProfile own times summed into PARTS."""
    total: dict[str, float] = {name: 0.0 for name, _ in PARTS}
    total["other"] = 0.0
    for key, seconds in own.items():
        name = next((n for n, needles in PARTS if any(s in key for s in needles)), "other")
        total[name] += seconds
    return total


def gap(a: Path, b: Path) -> float:
    """Largest relative Frobenius difference between two block files' tensors."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return max(float((x[k].double() - y[k].double()).norm() / y[k].double().norm().clamp_min(1e-300)) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path, help="a finished run (its statistics files are what the solve reads)")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 5, 11])
    parser.add_argument("--precision", nargs="+", default=["float64", "mixed"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    keep = args.out.parent / f".{args.out.stem}-blocks"
    keep.mkdir(parents=True, exist_ok=True)
    codes = {"before": args.before.resolve(), "after": ROOT}
    results: dict[tuple[str, str, int], dict] = {}
    for precision in args.precision:
        for layer in args.layers:
            for name, code in codes.items():
                results[name, precision, layer] = child(code, args.run_dir, layer, precision, args.repeats,
                                                        keep / f"{name}-{precision}-{layer}.safetensors")
                print(name, precision, layer, f"{results[name, precision, layer]['seconds']:.3f} s", flush=True)
    lines = ["# Solve stage before/after, one invocation", "",
             f"`python benchmarks/solve_speed.py {args.run_dir} --before {args.before} --layers "
             f"{' '.join(map(str, args.layers))} --repeats {args.repeats}`", "",
             f"- CPU: {cpu_line()}; one thread; {time.strftime('%Y-%m-%d %H:%M')}",
             "- seconds: best CPU seconds of the block's solve stage (reads, products, solves, write) of "
             f"{args.repeats} after a warm-up; before = `{args.before}`", "",
             "| precision | block | before s | after s | speed-up | max rel. weight diff after vs before |",
             "|---|---|---|---|---|---|"]
    sums = {}
    for precision in args.precision:
        for layer in args.layers:
            b, a = results["before", precision, layer], results["after", precision, layer]
            diff = gap(keep / f"after-{precision}-{layer}.safetensors", keep / f"before-{precision}-{layer}.safetensors")
            lines.append(f"| {precision} | {layer} | {b['seconds']:.3f} | {a['seconds']:.3f} | "
                         f"{b['seconds'] / a['seconds']:.2f}× | {diff:.1e} |")
            for name in codes:
                sums[name, precision] = sums.get((name, precision), 0.0) + results[name, precision, layer]["seconds"]
    lines += ["", "| precision | before s | after s | speed-up |", "|---|---|---|---|"]
    lines += [f"| {p} | {sums['before', p]:.2f} | {sums['after', p]:.2f} | {sums['before', p] / sums['after', p]:.2f}× |"
              for p in args.precision]
    for precision in args.precision:
        lines += ["", f"Where the time goes ({precision}, cProfile own seconds summed over the blocks' profiled calls):",
                  "", "| part | before s | after s |", "|---|---|---|"]
        split = {name: [parts(results[name, precision, layer]["own"]) for layer in args.layers] for name in codes}
        for part in (*(n for n, _ in PARTS), "other"):
            before = sum(s[part] for s in split["before"])
            after = sum(s[part] for s in split["after"])
            lines.append(f"| {part} | {before:.3f} | {after:.3f} |")
        paths = {name: sorted({p for layer in args.layers
                               for p in results[name, precision, layer]["paths"].values()}) for name in codes}
        if any(paths.values()):
            lines += ["", f"Solve paths ({precision}): before {paths['before']}; after {paths['after']}"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
