"""bf16 GPU table for featcal_kernels.dual_gram (needs CUDA and Triton); prints markdown.

    python -m benchmarks.kernels_gpu [--peak-tflops P] [--out FILE]

Compares the Triton kernel with the dense bf16 tensor-core peak, with cuBLAS bf16 matmuls of
the same shapes (xs.T @ xs and xs.T @ xe, unweighted, bf16 out: the speed of light for the
work) and with the exact torch expression (fp32 upcast; TF32 off).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton.testing

import featcal_kernels
import featcal_kernels.triton_gram  # noqa: F401  (fails loudly if the Triton kernel cannot load)
from benchmarks.kernel_speed import N_ROWS, naive_dual_gram, useful_gram_flops

DIMS = (768, 1536, 3072, 4096)
# Dense (no sparsity) bf16 tensor-core peaks from vendor datasheets, first name match wins.
DENSE_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
                     ("L4", 121.0))


def cublas_pair(xs: torch.Tensor, xe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two products of the Gram stage, unweighted, as cuBLAS computes them: the speed of light for the work."""
    return xs.T @ xs, xs.T @ xe


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak, if the device is not in the table")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((p for key, p in DENSE_BF16_TFLOPS if key in name), None)
    if peak is None:
        parser.error(f"no dense bf16 peak known for {name!r}: pass --peak-tflops")
    lines = [
        f"GPU: {name}, dense bf16 peak {peak:.0f} TFLOP/s; torch {torch.__version__}, triton {triton.__version__}; "
        f"N = {N_ROWS}, bf16 inputs, fp32 weights. Useful FLOPs: N·d·(d+1) + 2·N·d².",
        "",
        "| d | dual_gram ms | TFLOP/s (% peak) | cuBLAS bf16 ms | cuBLAS TFLOP/s (% peak) | dual_gram / cuBLAS time "
        "| exact torch fp32 ms | speed-up vs exact | max rel. diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in DIMS:
        gen = torch.Generator(device="cuda").manual_seed(d)
        xs = torch.randn(N_ROWS, d, device="cuda", generator=gen).to(torch.bfloat16)
        xe = torch.randn(N_ROWS, d, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.rand(N_ROWS, device="cuda", generator=gen)
        ours = featcal_kernels.dual_gram(xs, xe, w)
        exact = naive_dual_gram(xs, xe, w)
        max_rel = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(ours[:2], exact[:2]))
        t_ours = median_ms(partial(featcal_kernels.dual_gram, xs, xe, w))
        t_cublas = median_ms(partial(cublas_pair, xs, xe))
        t_exact = median_ms(partial(naive_dual_gram, xs, xe, w))
        tflops = useful_gram_flops(N_ROWS, d) / t_ours / 1e9
        cublas_tflops = 4 * N_ROWS * d * d / t_cublas / 1e9
        lines.append(
            f"| {d} | {t_ours:.2f} | {tflops:.0f} ({100 * tflops / peak:.0f} %) | {t_cublas:.2f} "
            f"| {cublas_tflops:.0f} ({100 * cublas_tflops / peak:.0f} %) | {t_ours / t_cublas:.2f} "
            f"| {t_exact:.2f} | {t_exact / t_ours:.1f}× | {max_rel:.1e} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
