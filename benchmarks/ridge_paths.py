"""The ridge solve's two paths side by side in one process, one thread: the factor's two triangular solves
(`cholesky_solve`) against its inverse and one product (`cholesky_inverse`, then a GEMM), for a d × d system with k
right-hand sides. `featcal_kernels.ridge` takes the inverse from k ≥ INVERSE_MIN_RHS_SHARE·d on; this measures where
it pays on this host.

    python benchmarks/ridge_paths.py --dim 3072 --rhs 3072 8192 12288 16384 --out benchmarks/results/ridge_paths.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.solve_precision import cpu_line  # noqa: E402
from featcal_kernels.ridge import INVERSE_MIN_RHS_SHARE  # noqa: E402


def best_of(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--rhs", type=int, nargs="+", default=[3072, 8192, 12288, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    d = args.dim
    x = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    a = x @ x.T / (2 * d)
    a.diagonal().add_(0.01)
    factor = torch.linalg.cholesky(a)
    rows = []
    for k in args.rhs:
        b = torch.randn(k, d, generator=g, dtype=torch.float64).T  # column-major, as the solve stage passes it
        t_solve, x_solve = best_of(lambda: torch.cholesky_solve(b, factor), args.repeats)
        t_inv, x_inv = best_of(lambda: (b.mT @ torch.cholesky_inverse(factor)).mT, args.repeats)
        gap = float((x_inv - x_solve).norm() / x_solve.norm())
        rows.append(f"| {k} | {k / d:.2f} | {t_solve:.2f} | {t_inv:.2f} | {t_solve / t_inv:.2f} | {gap:.1e} | "
                    f"{'inverse' if k >= INVERSE_MIN_RHS_SHARE * d else 'triangular solves'} |")
        print(rows[-1], flush=True)
    lines = [f"# Ridge solve paths, d = {d}, float64, one thread", "",
             f"Machine: {cpu_line()}, Python {platform.python_version()}, torch {torch.__version__}. Date: "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Best of {args.repeats} seconds each. Command: "
             f"`python benchmarks/ridge_paths.py --dim {d} --rhs {' '.join(map(str, args.rhs))} --out {args.out}`", "",
             "| k | k / d | triangular solves (s) | inverse + product (s) | speed-up | relative gap | path taken |",
             "|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
