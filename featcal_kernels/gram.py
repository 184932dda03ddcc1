"""Weighted dual Gram: C_ss = xs^T diag(w) xs and C_se = xs^T diag(w) xe in one pass.

The op ``featcal::dual_gram`` has a blocked torch implementation (CPU, and the fallback
on any other device) and, when Triton and CUDA are present, a Triton kernel registered
for "cuda" (see ``triton_gram``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from featcal_kernels.checks import check_finite_sums, check_gram_shapes, check_weight_values

# Rows per block: the only temporaries are a few [BLOCK_ROWS, d] fp32 buffers, reused.
BLOCK_ROWS = 8192
# Width of the C_ss column panels; only panel rows on or above the diagonal are computed.
PANEL = 128

GramOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class DualGram(NamedTuple):
    """fp32 statistics of one chunk; the caller adds them into float64 running sums."""

    c_ss: torch.Tensor  # [d, d] symmetric
    c_se: torch.Tensor  # [d, d], or [0] without xe
    sum_s: torch.Tensor  # [d] = xs^T w
    sum_e: torch.Tensor  # [d], or [0] without xe
    sum_w: torch.Tensor  # [] = sum(w)


def output_shapes(d: int, has_xe: bool) -> list[tuple[int, ...]]:
    """Shapes of (c_ss, c_se, sum_s, sum_e, sum_w); absent xe statistics have shape [0]."""
    return [(d, d), (d, d) if has_xe else (0,), (d,), (d,) if has_xe else (0,), ()]


def mirror_upper(c: torch.Tensor) -> torch.Tensor:
    """Full symmetric matrix from the upper triangle of ``c`` (the lower one is ignored)."""
    upper = c.triu()
    return upper + upper.triu(1).T


def _add_upper_gram(c_ss: torch.Tensor, wxs: torch.Tensor, xs: torch.Tensor) -> None:
    """c_ss += wxs^T xs on the upper triangle only, panel by panel (diagonal panels in full)."""
    d = xs.shape[1]
    for j0 in range(0, d, PANEL):
        j1 = min(j0 + PANEL, d)
        c_ss[:j1, j0:j1].addmm_(wxs[:, :j1].T, xs[:, j0:j1])


@torch.library.custom_op("featcal::dual_gram", mutates_args=())
def _dual_gram_op(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None) -> GramOutputs:
    """Blocked torch implementation: fp32 buffers of one block of rows, reused across blocks."""
    check_gram_shapes(xs, xe, w)
    w32 = None if w is None else w.to(torch.float32)
    if w32 is not None:
        check_weight_values(w32)
    n, d = xs.shape
    c_ss, c_se, sum_s, sum_e, sum_w = (
        torch.zeros(shape, dtype=torch.float32, device=xs.device) for shape in output_shapes(d, xe is not None)
    )
    rows = max(1, min(BLOCK_ROWS, n))

    def buffer() -> torch.Tensor:
        return torch.empty(rows, d, dtype=torch.float32, device=xs.device)

    upcast = xs.dtype != torch.float32
    xs_buf = buffer() if upcast else None
    xe_buf = buffer() if upcast and xe is not None else None
    wxs_buf = buffer() if w32 is not None else None
    for start in range(0, n, rows):
        block = slice(start, min(start + rows, n))
        b = block.stop - start
        xs_b = xs_buf[:b].copy_(xs[block]) if upcast else xs[block]
        wxs_b = xs_b if w32 is None else torch.mul(xs_b, w32[block, None], out=wxs_buf[:b])
        sum_s += wxs_b.sum(0)
        _add_upper_gram(c_ss, wxs_b, xs_b)
        if xe is not None:
            xe_b = xe_buf[:b].copy_(xe[block]) if upcast else xe[block]
            c_se.addmm_(wxs_b.T, xe_b)
            sum_e += xe_b.sum(0) if w32 is None else xe_b.T @ w32[block]
    if w32 is None:
        sum_w.fill_(n)
    else:
        sum_w.copy_(w32.sum())
    check_finite_sums(sum_s, sum_e)
    return mirror_upper(c_ss), c_se, sum_s, sum_e, sum_w


@_dual_gram_op.register_fake
def _dual_gram_fake(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None) -> GramOutputs:
    check_gram_shapes(xs, xe, w)
    shapes = output_shapes(xs.shape[1], xe is not None)
    return tuple(xs.new_empty(shape, dtype=torch.float32) for shape in shapes)


def dual_gram(xs: torch.Tensor, xe: torch.Tensor | None = None, w: torch.Tensor | None = None) -> DualGram:
    """Weighted uncentred moments of one chunk of module inputs, products accumulated in fp32.

    xs, xe: [N, d] float32/bfloat16/float16 (xe optional); w: [N] weights >= 0 (None = ones).
    """
    check_gram_shapes(xs, xe, w)  # before dispatch, so that non-tensors get the same clear error
    return DualGram(*torch.ops.featcal.dual_gram(xs, xe, w))
