"""The float64 part of a Llama-3.2-3B block's solve, timed on its own, one thread: what a block cannot go below
while the solve is float64 (docs/design.md, numbers), against the time a block may take for issue 32 §4's goal
(2× its floor).

    python benchmarks/solve_floor.py --tasks 2 --rows 1024 --floor 9.5 \
        --out benchmarks/results/solve_floor_llama.md

Each solve unit of the block (q/k/v stacked, o, gate/up stacked, down) runs in the form the cost model picks for
this many rows (`featcal.statistics.row_form_pays`; the Gram form with P_t, `expert_side_form`, at this size), on
random statistics of its shape: the real solve, whole (`solve_linear_weight_rows` or `solve_linear_weight`), and its
float64 steps alone. In row form those are the n × n ridge solve (`featcal_kernels.ridge_solve`, the path it takes)
and the product that turns its solution into the weight, Qᵀ·Z ([out, n] × [n, in]); in Gram form, the in × in ridge
solve. What stays when the sums of the tasks' statistics, the fp32 products, conversions and file reads are taken
away is the float64 floor. `--floor` is the block's forward
floor (three forwards per task and the Gram FLOPs at the matmul rate) from a `large_model.py` report, given by
hand: the goal allows a block 2 × floor, and Gram and propagate take at least one floor, so the solve has at most
one floor left.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gram_profile import cpu_seconds  # noqa: E402
from benchmarks.solve_precision import cpu_line  # noqa: E402
from featcal.closed_form import (  # noqa: E402
    Hyper,
    LinearRows,
    LinearSolution,
    solve_linear_weight,
    solve_linear_weight_rows,
)
from featcal.statistics import row_form_pays  # noqa: E402
from featcal_kernels import ridge_solve  # noqa: E402

# Llama-3.2-3B: hidden 3072, intermediate 8192, 24 heads and 8 key-value heads of 128. Modules reading one input
# are solved as one map (tasks/solve.py, _solve_units).
# Each unit: its input width and its readers' output widths.
UNITS = {"q/k/v": (3072, [3072, 1024, 1024]), "o": (3072, [3072]), "gate/up": (3072, [8192, 8192]),
         "down": (8192, [3072])}


def unit_rows(tasks: int, rows: int, d_in: int, d_out: int, g: torch.Generator) -> list[LinearRows]:
    """Random rows of bf16 values (the bf16 run's module inputs), stored fp32 as the Gram stage keeps them."""
    out = []
    for _ in range(tasks):
        x = torch.randn(rows, d_in, generator=g).bfloat16().float()
        y = torch.randn(rows, d_out, generator=g)
        out.append(LinearRows(x=x, y=y, w=torch.ones(rows), sum_w=float(rows)))
    return out


def _solve_from_moments(moments: list, merged: torch.Tensor, base: torch.Tensor, hp: Hyper) -> LinearSolution:
    return solve_linear_weight(((m, merged) for m in moments), merged, base, hp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1024, help="token rows a task (8 examples × 128 tokens)")
    parser.add_argument("--floor", type=float, required=True, help="the block's forward floor in seconds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hp = Hyper(lam=0.05, rho=2.2, alpha=0.25, eps=1e-8)
    n = args.tasks * args.rows
    lines, total_whole, total_f64, total_flops = [], 0.0, 0.0, 0.0
    for name, (d_in, readers) in UNITS.items():
        d_out = sum(readers)
        rows = unit_rows(args.tasks, args.rows, d_in, d_out, g)
        merged = torch.randn(d_out, d_in, generator=g) * 0.02
        base = merged + torch.randn(d_out, d_in, generator=g) * 0.002
        if row_form_pays(args.rows, args.tasks, d_in, readers):
            form = f"rows ({n} × {d_in})"
            whole = cpu_seconds(partial(solve_linear_weight_rows, rows, merged, base, hp), repeats=args.repeats)
            x = torch.cat([r.x for r in rows]).double()
            system = x @ x.T / n
            system.diagonal().add_(hp.lam)
            rhs = torch.randn(n, d_out, generator=g, dtype=torch.float64)
            solve = cpu_seconds(partial(ridge_solve, system, rhs, damping=hp.eps), repeats=args.repeats)
            z = ridge_solve(system, rhs, damping=hp.eps).x
            back = cpu_seconds(partial(torch.matmul, z.T, x), repeats=args.repeats)
            flops = n**3 / 3 + 2 * n * n * d_out + 2 * n * d_in * d_out
        else:
            form = f"Gram ({d_in} × {d_in}), P_t"
            zero = torch.zeros(d_in, dtype=torch.float64)
            moments = [r.moments(zero, zero) for r in rows]
            whole = cpu_seconds(partial(_solve_from_moments, moments, merged, base, hp), repeats=args.repeats)
            system = sum((m.c_ss / m.normaliser() for m in moments), torch.zeros(d_in, d_in, dtype=torch.float64))
            system.diagonal().add_(hp.lam)
            rhs = torch.randn(d_out, d_in, generator=g, dtype=torch.float64).T  # column-major, as the solve's
            solve = cpu_seconds(partial(ridge_solve, system, rhs, damping=hp.eps), repeats=args.repeats)
            back = 0.0
            flops = d_in**3 / 3 + 2 * d_in * d_in * d_out
        total_whole, total_f64, total_flops = total_whole + whole, total_f64 + solve + back, total_flops + flops
        lines.append(f"| {name} | {d_in} → {d_out} | {form} | {whole:.2f} | {solve:.2f} | {back:.2f} | "
                     f"{solve + back:.2f} | {flops / 1e9:.0f} | {flops / (solve + back) / 1e9:.0f} |")
        print(lines[-1], flush=True)
    budget = args.floor
    verdict = "above" if total_f64 > budget else "within"
    report = [
        f"# The float64 floor of a Llama-3.2-3B block's solve ({args.tasks} tasks × {args.rows} rows, one thread)", "",
        f"Machine: {cpu_line()}, Python {platform.python_version()}, torch {torch.__version__}. Date: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. CPU seconds, best of {args.repeats} after one warm-up "
        f"call. Command: `python benchmarks/solve_floor.py --tasks {args.tasks} --rows {args.rows} "
        f"--floor {args.floor} --repeats {args.repeats} --out {args.out}`", "",
        "| unit | in → out | form | whole solve (s) | ridge solve, float64 (s) | Qᵀ·Z, float64 (s) | float64 steps (s) "
        "| float64 GFLOP | GFLOP/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|", *lines,
        f"| **block** | | | **{total_whole:.2f}** | | | **{total_f64:.2f}** | {total_flops / 1e9:.0f} | "
        f"{total_flops / total_f64 / 1e9:.0f} |", "",
        f"The goal (issue 32 §4) allows a block 2 × its floor; Gram and propagate take at least the floor "
        f"({args.floor} s, given by hand from a `large_model.py` report), so the solve may take at most "
        f"{budget:.1f} s. Its float64 steps alone take {total_f64:.1f} s, **{verdict}** that budget "
        f"({total_f64 / budget:.2f}×).", ""]
    args.out.write_text("\n".join(report))


if __name__ == "__main__":
    main()
