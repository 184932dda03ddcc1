"""Ridge solves: float64 Cholesky with growing damping, a mixed fp32/float64 solve with iterative refinement,
and an eigendecomposition sweep over λ."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from featcal_kernels.checks import check_ridge_inputs

log = logging.getLogger("featcal_kernels")

DAMPING_GROWTH = 10.0
REFINE_TOL = 1e-10  # the last correction's size relative to x: well under the 1e-6 the weights must keep
REFINE_MAX_STEPS = 10
REFINE_MIN_CONTRACTION = 0.5  # a correction that shrinks by less than this means κ·u_fp32 is near 1: give up early
# Each refinement step's float64 residual b − A·x costs 2·d²·k, as much as the float64 solve's own triangular solves,
# while the fp32 factor saves part of d³/3 only: ridge_solve_mixed beat ridge_solve at d = 3072 for k = 16 (1.12×),
# tied at k = 64 and lost from k = 128 on (0.81×; 0.49× at k = 768), one thread on the development EPYC
# (benchmarks/results/solve_precision.md).
MIXED_MAX_RHS_SHARE = 1 / 48
# From this many right-hand sides per unknown on, x = (a + damping I)⁻¹·b from the factor's inverse (2/3·d³ more)
# and one product at the GEMM rate beats the two triangular solves: at d = 3072, one thread on the development EPYC,
# the triangular solves ran at 41 GFLOP/s and the product at 51, so the inverse (0.75 s) broke even at k = 2.67·d
# and gained 1.03× at 4·d and 1.07× at k = 16384, the stacked gate and up of the Llama-3.2-3B shape: 7.13 → 6.65 s
# (benchmarks/results/ridge_paths.md).
INVERSE_MIN_RHS_SHARE = 4


def mixed_pays(d: int, k: int) -> bool:
    """Whether the mixed solve of a d × d system with k right-hand sides can beat the float64 one."""
    return k <= d * MIXED_MAX_RHS_SHARE


class RidgeSolution(NamedTuple):
    x: torch.Tensor  # [d, k] float64
    damping: float  # the damping actually added to the diagonal
    path: str = "float64"  # "float64" or "mixed" (fp32 factor + float64-residual refinement)
    steps: int = 0  # refinement steps the mixed path took (0 on the float64 path)
    fallback: str | None = None  # why a mixed solve fell back to float64, or None


def _check_damping(damping: float, max_damping: float) -> None:
    if not damping > 0:
        raise ValueError(f"damping must be > 0 (it grows by multiplication), got {damping}")
    if not max_damping >= damping:
        raise ValueError(f"max_damping ({max_damping}) must be >= damping ({damping})")


@torch.library.custom_op("featcal::ridge_solve", mutates_args=())
def _ridge_solve_op(
    a: torch.Tensor, b: torch.Tensor, damping: float, max_damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve (a + damping I) x = b; on a failed factorisation, damping *= 10 and retry."""
    check_ridge_inputs(a, b)
    _check_damping(damping, max_damping)
    d = a.shape[0]
    current = damping
    while current <= max_damping * (1 + 1e-9):  # slack for rounding in current *= 10
        # Factored in place: a is symmetric, so its copy read column-major is a again, which is the layout LAPACK
        # writes; one d × d copy instead of two (72 MiB less at d = 3072).
        factor = a.clone().mT
        factor.diagonal().add_(current)
        _, info = torch.linalg.cholesky_ex(factor, out=(factor, torch.empty((), dtype=torch.int32, device=a.device)))
        if int(info) == 0:
            if current != damping:
                log.warning(
                    "ridge_solve: Cholesky of a %dx%d system failed at damping %.3g; succeeded with damping %.3g",
                    d, d, damping, current,
                )
            used = torch.tensor(current, dtype=torch.float64)
            if b.shape[1] >= INVERSE_MIN_RHS_SHARE * d:
                return (b.mT @ torch.cholesky_inverse(factor)).mT, used  # the inverse is symmetric: x.T = b.T·a⁻¹
            # column-major, as LAPACK leaves it: x.T is then a contiguous [k, d] weight with no copy
            return torch.cholesky_solve(b, factor), used
        if current == damping and not bool(torch.isfinite(a).all()):  # checked only when it matters
            raise ValueError("a contains NaN or inf")
        current *= DAMPING_GROWTH
    raise ValueError(
        f"ridge_solve: Cholesky of the {d}x{d} system failed for every damping from {damping:.3g} "
        f"up to max_damping={max_damping:.3g} (last tried {current / DAMPING_GROWTH:.3g})"
    )


@_ridge_solve_op.register_fake
def _ridge_solve_fake(
    a: torch.Tensor, b: torch.Tensor, damping: float, max_damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_ridge_inputs(a, b)
    return b.new_empty(b.shape[::-1]).T, a.new_empty((), dtype=torch.float64, device="cpu")


def ridge_solve(a: torch.Tensor, b: torch.Tensor, damping: float = 1e-8, max_damping: float = 1e2) -> RidgeSolution:
    """Solve (a + damping I) x = b for symmetric PSD float64 a [d, d] and b [d, k]; x is column-major.

    The damping grows tenfold until the Cholesky factorisation succeeds (logged at WARNING);
    a ValueError is raised once it would exceed max_damping.
    """
    check_ridge_inputs(a, b)  # before dispatch, so that non-tensors get the same clear error
    x, used = torch.ops.featcal.ridge_solve(a, b, float(damping), float(max_damping))
    return RidgeSolution(x, float(used))


def ridge_sweep(a: torch.Tensor, b: torch.Tensor, lambdas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Solve (a + lam I) x = b for every lam from one eigendecomposition of a.

    Returns [len(lambdas), d, k] float64. Eigenvalues of the PSD matrix a that come out
    slightly negative (rounding) are clamped to 0, so every lam must be > 0.
    """
    check_ridge_inputs(a, b)
    lams = torch.as_tensor(lambdas, dtype=torch.float64, device=a.device).reshape(-1)
    if not bool((lams > 0).all()):
        raise ValueError(f"lambdas must all be > 0, got {lams.tolist()}")
    evals, evecs = torch.linalg.eigh(a)
    rotated = evecs.T @ b  # [d, k]
    scale = 1.0 / (evals.clamp_min(0)[None, :] + lams[:, None])  # [L, d]
    return evecs @ (scale[:, :, None] * rotated)


def ridge_solve_mixed(a: torch.Tensor, b: torch.Tensor, damping: float = 1e-8, max_damping: float = 1e2,
                      tol: float = REFINE_TOL, max_steps: int = REFINE_MAX_STEPS) -> RidgeSolution:
    """Solve (a + damping I) x = b with an fp32 Cholesky factor refined against a float64 residual.

    Each step solves (a + damping I) dx = r with the fp32 factor, r = b − (a + damping I) x in float64.
    The stopping test is on the correction, ‖dx‖_F ≤ tol·‖x‖_F: the last correction estimates the
    forward error of the previous iterate, which is what the weights need (a small residual alone can hide
    a large error when a is ill conditioned). No separate condition estimate is made: refinement contracts
    by about κ·u_fp32 per step, so the ratio of successive corrections measures the conditioning for free;
    when it is ≥ REFINE_MIN_CONTRACTION, or max_steps pass, or the fp32 factorisation fails at `damping`,
    the system is solved by `ridge_solve` in float64 (which also grows the damping) and `fallback` says why.
    """
    check_ridge_inputs(a, b)
    _check_damping(damping, max_damping)
    shifted = a.clone()
    shifted.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(shifted.float())
    reason: str
    if int(info) != 0:
        reason = f"fp32 Cholesky failed at damping {damping:.3g}"
    else:
        x = torch.cholesky_solve(b.float(), factor).double()
        b_norm = float(torch.linalg.norm(b))
        previous = float("inf")
        reason = f"no convergence to {tol:g} in {max_steps} refinement steps"
        for step in range(1, max_steps + 1):
            residual = b - shifted @ x
            dx = torch.cholesky_solve(residual.float(), factor).double()
            x += dx
            size = float(torch.linalg.norm(dx))
            x_norm = float(torch.linalg.norm(x))
            if not (size == size and x_norm == x_norm):  # NaN: overflow in fp32
                reason = "refinement produced NaN"
                break
            if size <= tol * x_norm or b_norm == 0.0:
                return RidgeSolution(x, damping, "mixed", step, None)
            if size >= REFINE_MIN_CONTRACTION * previous:
                reason = f"refinement stalled at step {step} (correction {size / max(x_norm, 1e-300):.2g} of x)"
                break
            previous = size
    sol = ridge_solve(a, b, damping, max_damping)
    return RidgeSolution(sol.x, sol.damping, "float64", 0, reason)
