"""CPU benchmark of featcal_kernels against the plain torch expressions, written as markdown.

    python -m benchmarks.kernel_speed --out benchmarks/results/kernels_cpu.md

These machines are shared and noisy, so every repeat runs the contenders back to back (order
alternating) next to a square fp32 matmul that measures the peak of that moment; tables quote
medians of the per-repeat figures (speed ratios and fractions of that repeat's peak).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import featcal_kernels

N_ROWS = 65536
GRAM_DIMS = (384, 768, 1536, 3072)
GRAM_REPEATS = {384: 7, 768: 7, 1536: 5, 3072: 3}
RIDGE_DIMS = (768, 3072, 4096)
RIDGE_REPEATS = 3
RIDGE_CONDITION = 1e10
RIDGE_DAMPING = 1e-8
PEAK_SIZE = 4096


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_peak_gflops(a: torch.Tensor, b: torch.Tensor) -> float:
    """fp32 GFLOP/s of one large square matmul: the machine's practical peak right now."""
    return 2 * a.shape[0] ** 3 / seconds(lambda: a @ b) / 1e9


def naive_dual_gram(xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What one writes without the kernel: upcast everything, then the two full products."""
    s, e = xs.float(), xe.float()
    return s.T @ (w[:, None] * s), s.T @ (w[:, None] * e), s.T @ w, e.T @ w, w.sum()


def useful_gram_flops(n: int, d: int) -> int:
    """C_ss counted on one triangle (N·d·(d+1)), C_se in full (2·N·d²)."""
    return n * d * (d + 1) + 2 * n * d * d


def machine_lines(load_start: float, load_end: float) -> list[str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    return [
        f"- CPU: {fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} logical CPUs",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- 1-minute load average at start / end of the run: {load_start:.1f} / {load_end:.1f} "
        f"(this run adds about {torch.get_num_threads()}; the rest is other work sharing the machine)",
    ]


def bench_gram(d: int, dtype: torch.dtype, peaks: list[float], peak_ab: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Per repeat: the peak matmul, then naive and dual_gram back to back (order alternating)."""
    gen = torch.Generator().manual_seed(d)
    xs = torch.randn(N_ROWS, d, generator=gen).to(dtype)
    xe = torch.randn(N_ROWS, d, generator=gen).to(dtype)
    w = torch.rand(N_ROWS, generator=gen)
    ours = featcal_kernels.dual_gram(xs, xe, w)  # warm-up, and a sanity check of agreement
    ref = naive_dual_gram(xs, xe, w)
    max_rel = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(ours[:2], ref[:2]))
    t_naive, t_ours, rep_peaks = [], [], []
    for rep in range(GRAM_REPEATS[d]):
        rep_peaks.append(matmul_peak_gflops(*peak_ab))
        runs = [(t_naive, lambda: naive_dual_gram(xs, xe, w)), (t_ours, lambda: featcal_kernels.dual_gram(xs, xe, w))]
        for times, fn in runs if rep % 2 == 0 else runs[::-1]:
            times.append(seconds(fn))
    peaks.extend(rep_peaks)
    useful = useful_gram_flops(N_ROWS, d) / 1e9
    return {
        "naive_ms": 1e3 * statistics.median(t_naive),
        "ours_ms": 1e3 * statistics.median(t_ours),
        "ratio": statistics.median(a / b for a, b in zip(t_naive, t_ours)),
        "naive_gflops": useful / statistics.median(t_naive),
        "ours_gflops": useful / statistics.median(t_ours),
        "naive_of_peak": statistics.median(useful / t / p for t, p in zip(t_naive, rep_peaks)),
        "ours_of_peak": statistics.median(useful / t / p for t, p in zip(t_ours, rep_peaks)),
        "max_rel_diff": max_rel,
    }


def ill_conditioned_gram(d: int, condition: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), d, dtype=torch.float64)) @ q.T
    return (a + a.T) / 2


def relative_residual(a: torch.Tensor, damping: float, x: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a @ x + damping * x - b) / torch.linalg.norm(b))


def bench_ridge(d: int) -> dict[str, float]:
    a = ill_conditioned_gram(d, RIDGE_CONDITION, seed=d)
    b = torch.randn(d, d, generator=torch.Generator().manual_seed(d + 1), dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    t_ours, t_solve = [], []
    for _ in range(RIDGE_REPEATS):
        start = time.perf_counter()
        sol = featcal_kernels.ridge_solve(a, b, damping=RIDGE_DAMPING)
        t_ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        x_solve = torch.linalg.solve(a + RIDGE_DAMPING * eye, b)
        t_solve.append(time.perf_counter() - start)
    return {
        "ours_s": statistics.median(t_ours),
        "solve_s": statistics.median(t_solve),
        "ratio": statistics.median(s / o for s, o in zip(t_solve, t_ours)),
        "damping": sol.damping,
        "ours_residual": relative_residual(a, sol.damping, sol.x, b),
        "solve_residual": relative_residual(a, RIDGE_DAMPING, x_solve, b),
    }


def gram_section(peaks: list[float], rows: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    lines = [
        "## Weighted dual Gram (CPU)",
        "",
        f"N = {N_ROWS} rows, inputs x_s, x_e [N, d] and weights w [N]. `naive` = "
        "`xs.T @ (w[:,None]*xs)`, `xs.T @ (w[:,None]*xe)` plus the weighted sums, after upcasting the "
        "whole input to fp32 (bf16 rows). GFLOP/s count useful FLOPs: C_ss on one triangle "
        "N·d·(d+1), C_se 2·N·d². Speed-up = median over repeats of naive time / dual_gram time; "
        "% peak = median over repeats of useful GFLOP/s / the peak measured in the same repeat.",
        "",
        f"fp32 matmul peak ({PEAK_SIZE}×{PEAK_SIZE} square, measured {len(peaks)} times in this run): "
        f"median {statistics.median(peaks):.0f} GFLOP/s (min {min(peaks):.0f}, max {max(peaks):.0f}).",
        *(
            [
                "",
                "**Noisy run**: the peak varied more than 1.5× between repeats, so other work shared "
                "the cores; a % peak above 100 comes from a repeat whose peak matmul met a busy moment.",
            ]
            if max(peaks) > 1.5 * min(peaks)
            else []
        ),
        "",
        "| dtype | d | repeats | naive ms | dual_gram ms | speed-up | naive GFLOP/s (% peak) "
        "| dual_gram GFLOP/s (% peak) | max rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (dtype, d), r in rows.items():
        lines.append(
            f"| {dtype} | {d} | {GRAM_REPEATS[d]} | {r['naive_ms']:.0f} | {r['ours_ms']:.0f} | {r['ratio']:.2f}× "
            f"| {r['naive_gflops']:.0f} ({100 * r['naive_of_peak']:.0f} %) "
            f"| {r['ours_gflops']:.0f} ({100 * r['ours_of_peak']:.0f} %) | {r['max_rel_diff']:.1e} |"
        )
    return lines


def ridge_section(rows: dict[int, dict[str, float]]) -> list[str]:
    lines = [
        "## Ridge solve (CPU, float64)",
        "",
        f"a: Gram with condition number {RIDGE_CONDITION:.0e} (eigenvalues log-spaced), b: [d, d]; both "
        f"solve (a + {RIDGE_DAMPING:g}·I) x = b. `ridge_solve` = Cholesky (cholesky_ex + cholesky_solve); "
        f"`linalg.solve` = LU. Residual = ‖(a + δI)x − b‖ / ‖b‖. Medians of {RIDGE_REPEATS} repeats.",
        "",
        "| d | ridge_solve s | linalg.solve s | speed-up | damping used | residual ridge_solve "
        "| residual linalg.solve |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r in rows.items():
        lines.append(
            f"| {d} | {r['ours_s']:.2f} | {r['solve_s']:.2f} | {r['ratio']:.2f}× | {r['damping']:g} "
            f"| {r['ours_residual']:.1e} | {r['solve_residual']:.1e} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    peak_ab = (torch.randn(PEAK_SIZE, PEAK_SIZE, generator=gen), torch.randn(PEAK_SIZE, PEAK_SIZE, generator=gen))
    matmul_peak_gflops(*peak_ab)  # warm-up
    peaks: list[float] = []
    gram_rows = {}
    for d in GRAM_DIMS:
        for dtype in (torch.float32, torch.bfloat16):
            gram_rows[(str(dtype).removeprefix("torch."), d)] = bench_gram(d, dtype, peaks, peak_ab)
            print(f"dual_gram d={d} {dtype}: {gram_rows[(str(dtype).removeprefix('torch.'), d)]}", flush=True)
    ridge_rows = {}
    for d in RIDGE_DIMS:
        ridge_rows[d] = bench_ridge(d)
        print(f"ridge_solve d={d}: {ridge_rows[d]}", flush=True)
    report = [
        "# featcal_kernels benchmark (CPU)",
        "",
        "Written by `python -m benchmarks.kernel_speed --out benchmarks/results/kernels_cpu.md`.",
        "",
        *machine_lines(load_start, os.getloadavg()[0]),
        "",
        *gram_section(peaks, gram_rows),
        "",
        *ridge_section(ridge_rows),
        "",
        "## GPU",
        "",
        "Not measured: no GPU was available in this session. `benchmarks/kernels_gpu.py` produces the "
        "bf16 table on a CUDA machine.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
