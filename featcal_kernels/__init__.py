"""FeatCal kernels: weighted dual Gram statistics and ridge solves (the Gram and the float64 solve as torch custom ops).

``featcal::dual_gram`` runs a blocked torch implementation on CPU (and as the fallback on
other devices); on CUDA, when Triton is installed, a Triton kernel replaces it.
``featcal::ridge_solve`` is a float64 Cholesky with damping that grows on failure; ``ridge_solve_mixed`` factors in
fp32 and refines against a float64 residual, falling back to it when refinement stalls.
"""

from __future__ import annotations

import torch

from featcal_kernels.gram import DualGram, dual_gram
from featcal_kernels.ridge import RidgeSolution, mixed_pays, ridge_solve, ridge_solve_mixed, ridge_sweep

__all__ = ["DualGram", "RidgeSolution", "dual_gram", "mixed_pays", "ridge_solve", "ridge_solve_mixed", "ridge_sweep"]

if torch.cuda.is_available():
    try:
        from featcal_kernels import triton_gram
    except ImportError:  # no Triton: the torch implementation serves CUDA tensors too
        pass
    else:
        triton_gram.register()
