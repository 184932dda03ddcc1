"""Input validation shared by the real and fake implementations of the ops.

Shape and dtype checks run in the fake (meta) implementations too, so a bad call
fails the same way under tracing as in eager mode; value checks need the data and
run only in the real kernels.
"""

from __future__ import annotations

import torch

GRAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise a ValueError naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_gram_shapes(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None) -> None:
    """Check shapes, dtypes and devices of the dual-Gram inputs."""
    require_tensor("xs", xs)
    if xs.dim() != 2:
        raise ValueError(f"xs must be a 2-D [N, d] tensor, got shape {tuple(xs.shape)}")
    if xs.dtype not in GRAM_DTYPES:
        raise ValueError(f"xs must be float32, bfloat16 or float16, got {xs.dtype}")
    n, d = xs.shape
    if d == 0:
        raise ValueError("xs must have at least one column (d >= 1), got shape [N, 0]")
    if xe is not None:
        require_tensor("xe", xe)
        if tuple(xe.shape) != (n, d):
            raise ValueError(f"xe must have the shape of xs [{n}, {d}], got {tuple(xe.shape)}")
        if xe.dtype != xs.dtype:
            raise ValueError(f"xe must have the dtype of xs ({xs.dtype}), got {xe.dtype}")
        if xe.device != xs.device:
            raise ValueError(f"xe must be on the device of xs ({xs.device}), got {xe.device}")
    if w is not None:
        require_tensor("w", w)
        if tuple(w.shape) != (n,):
            raise ValueError(f"w must be a 1-D tensor of shape [{n}] (one weight per row of xs), got {tuple(w.shape)}")
        if not w.dtype.is_floating_point:
            raise ValueError(f"w must be a floating-point tensor, got {w.dtype}")
        if w.device != xs.device:
            raise ValueError(f"w must be on the device of xs ({xs.device}), got {w.device}")


def check_weight_values(w: torch.Tensor) -> None:
    """Weights must be >= 0 (negative ones break the PSD Gram); NaN fails the same comparison."""
    if not bool((w >= 0).all()):
        found = "NaN" if bool(torch.isnan(w).any()) else f"a minimum of {float(w.min())}"
        raise ValueError(f"w must be finite and >= 0, got {found}")


def check_finite_sums(sum_s: torch.Tensor, sum_e: torch.Tensor, sum_w: torch.Tensor) -> None:
    """Non-finite inputs show in the sums: inf weights in sum(w), NaN/inf in a column of x in
    that column's weighted sum (0 * inf = NaN too); checking them costs nothing next to a pass."""
    if not bool(torch.isfinite(sum_w)):
        raise ValueError("w contains inf (or sums to more than float32 holds)")
    for name, total in (("xs", sum_s), ("xe", sum_e)):
        if not bool(torch.isfinite(total).all()):
            raise ValueError(f"{name} contains NaN or inf (or its weighted column sums overflow float32)")


def check_ridge_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """Check the shapes and dtypes of a ridge system a x = b."""
    require_tensor("a", a)
    require_tensor("b", b)
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"a must be a square 2-D [d, d] matrix, got shape {tuple(a.shape)}")
    if a.dtype != torch.float64:
        raise ValueError(f"a must be float64, got {a.dtype}")
    d = a.shape[0]
    if b.dim() != 2 or b.shape[0] != d:
        raise ValueError(f"b must be a 2-D [{d}, k] matrix, got shape {tuple(b.shape)}")
    if b.dtype != torch.float64:
        raise ValueError(f"b must be float64, got {b.dtype}")
    if b.device != a.device:
        raise ValueError(f"b must be on the device of a ({a.device}), got {b.device}")
