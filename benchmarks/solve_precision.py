"""The solve stage's linear solves in float64 and in mixed precision (runtime.solve_precision), side by side in one
process, on ViT-B/32-shaped modules: per block q/k/v/out_proj (768 → 768), fc1 (768 → 3072) and fc2 (3072 → 768),
each solved by the FeatCal method exactly as tasks/solve.py calls it.

    python -m benchmarks.solve_precision --experts 4 --examples 32 --blocks 2 \
        --out benchmarks/results/solve_precision.md

The statistics are synthetic: per task, merged-side inputs X_s [examples·50 tokens, d] with a decaying spectrum
(as activations have) and expert-side inputs X_e = X_s + noise, so the normalised Gram is rank-deficient at
d = 3072 and only λ makes it solvable, as in a real run. The stage's file reads are not timed: only the solves.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

import featcal_kernels
from benchmarks.common import cpu_line
from featcal.calibration_methods import ModuleData, calibration_method
from featcal.config import FeatCalConfig

HIDDEN, INTERMEDIATE, TOKENS = 768, 3072, 50
MODULES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, HIDDEN), "v_proj": (HIDDEN, HIDDEN),
           "out_proj": (HIDDEN, HIDDEN), "fc1": (HIDDEN, INTERMEDIATE), "fc2": (INTERMEDIATE, HIDDEN)}


def task_stats(rows: int, d: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One task's float64 sums for a linear module with input width d (the keys statistics files hold)."""
    scale = torch.logspace(0, -3, d, dtype=torch.float64)  # a decaying spectrum, as activations have
    xs = torch.randn(rows, d, generator=g, dtype=torch.float64) * scale
    xe = xs + 0.1 * torch.randn(rows, d, generator=g, dtype=torch.float64) * scale
    w = torch.ones(rows, dtype=torch.float64)
    return {"ss": xs.T @ xs, "se": xs.T @ xe, "sum_s": xs.sum(0), "sum_e": xe.sum(0), "sum_w": w.sum()}


def module_data(name: str, d_in: int, d_out: int, experts: int, rows: int, seed: int) -> ModuleData:
    g = torch.Generator().manual_seed(seed)
    stats = [task_stats(rows, d_in, g) for _ in range(experts)]
    base = 0.02 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    weights = [base + 0.002 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64) for _ in range(experts)]
    biases = [0.01 * torch.randn(d_out, generator=g, dtype=torch.float64) for _ in range(experts)]
    zero = torch.zeros_like(base)  # sum()'s start: 0.0 + x is x, bit for bit
    merged = {"weight": base + sum((w - base for w in weights), zero) * 0.3,
              "bias": sum(biases, torch.zeros(d_out, dtype=torch.float64)) / experts}
    return ModuleData(where=name, tasks=tuple(f"t{t}" for t in range(experts)), task_weights=(1.0,) * experts,
                      has_bias=True, stats=lambda: ({k: v.clone() for k, v in s.items()} for s in stats),  # fresh
                      merged=lambda part: merged[part],
                      base=lambda part: base if part == "weight" else torch.zeros(d_out, dtype=torch.float64),
                      expert=lambda t, part: weights[t] if part == "weight" else biases[t])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lambda", dest="lam", type=float, default=0.05, help="featcal.lambda (default: the config's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fc = FeatCalConfig.model_validate({"lambda": args.lam})
    methods = {p: calibration_method(fc, p) for p in ("float64", "mixed")}
    rows = args.examples * TOKENS
    lines = ["# Solve stage: float64 vs mixed precision (runtime.solve_precision)", "",
             f"`python -m benchmarks.solve_precision --experts {args.experts} --examples {args.examples} "
             f"--blocks {args.blocks} --threads {args.threads} --lambda {args.lam:g}`", "",
             f"- CPU: {cpu_line()}", f"- torch {torch.__version__}, Python {platform.python_version()}, "
             f"{args.threads} thread(s)",
             f"- ViT-B/32 shapes, {args.experts} experts × {args.examples} examples × {TOKENS} tokens, "
             f"λ = {args.lam:g}, synthetic statistics; timed: each module's `solve_linear` (moments, right-hand "
             "side, solve, bias; best of 2), not the stage's file reads", "",
             "| block | module | float64 s | mixed s | speed-up | path (mixed) | max rel. weight diff |",
             "|---|---|---|---|---|---|---|"]
    for method in methods.values():  # warm-up: allocator, BLAS threads
        method.solve_linear(module_data("warm-up", HIDDEN, HIDDEN, args.experts, rows, seed=99))
    totals = {"float64": 0.0, "mixed": 0.0}
    worst = 0.0
    for block in range(args.blocks):
        for i, (name, (d_in, d_out)) in enumerate(MODULES.items()):
            data = module_data(name, d_in, d_out, args.experts, rows, seed=100 * block + i)
            seconds, solved = {}, {}
            for precision, method in methods.items():
                seconds[precision] = float("inf")
                for _ in range(2):  # best of 2: the first call of a module also pays the page faults of new memory
                    start = time.perf_counter()
                    solved[precision] = method.solve_linear(data)
                    seconds[precision] = min(seconds[precision], time.perf_counter() - start)
                totals[precision] += seconds[precision]
            gap = max(float((solved["mixed"].tensors[k] - solved["float64"].tensors[k]).norm()
                            / solved["float64"].tensors[k].norm()) for k in ("weight", "bias"))
            worst = max(worst, gap)
            row = (f"| {block} | {name} ({d_in}→{d_out}) | {seconds['float64']:.3f} | {seconds['mixed']:.3f} | "
                   f"{seconds['float64'] / seconds['mixed']:.2f}× | {solved['mixed'].report['solve_path']} | "
                   f"{gap:.2e} |")
            print(row, flush=True)
            lines.append(row)
    lines += ["", f"**Total: float64 {totals['float64']:.2f} s, mixed {totals['mixed']:.2f} s, "
                  f"{totals['float64'] / totals['mixed']:.2f}× ; largest relative weight difference {worst:.2e}.**", ""]
    lines += ["The ridge kernel alone ((a + 1e-8·I) x = b, a a normalised Gram + λI as the solve builds it, "
              "best of 3):", "", "| d × k | ridge_solve (float64) s | ridge_solve_mixed s | speed-up | path |",
              "|---|---|---|---|---|"]
    # the module shapes, then narrow right-hand sides at d = 3072: where mixed stops paying (featcal_kernels.mixed_pays)
    for d, k in ((HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN), (INTERMEDIATE, 16),
                 (INTERMEDIATE, 64), (INTERMEDIATE, 128)):
        stats = task_stats(rows, d, torch.Generator().manual_seed(d + k))
        a = stats["ss"] / torch.linalg.matrix_norm(stats["ss"]) + args.lam * torch.eye(d, dtype=torch.float64)
        b = torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        best = {}
        for name, fn in (("float64", featcal_kernels.ridge_solve), ("mixed", featcal_kernels.ridge_solve_mixed)):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                sol = fn(a, b, 1e-8)
                times.append(time.perf_counter() - start)
            best[name] = min(times)
        row = (f"| {d} × {k} | {best['float64']:.3f} | {best['mixed']:.3f} | {best['float64'] / best['mixed']:.2f}× | "
               f"{sol.path}, {sol.steps} steps |")
        print(row, flush=True)
        lines.append(row)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
