"""Weighted dual Gram: C_ss = xs^T diag(w) xs and C_se = xs^T diag(w) xe in one pass.

The op ``featcal::dual_gram`` has a blocked torch implementation (CPU, and the fallback
on any other device) and, when Triton and CUDA are present, a Triton kernel registered
for "cuda" (see ``triton_gram``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from featcal_kernels.bf16 import add_product, bf16_units_serve, group_rows, weight_groups
from featcal_kernels.checks import check_finite_sums, check_gram_shapes, check_weight_values

# Bytes of one fp32 block buffer (a few are reused across blocks: no temporary grows with N).
# Fewer, larger blocks also mean fewer thread synchronisations, which is what costs most on a
# busy machine; 64 MiB is 21845 rows at d = 768 and 5461 at d = 3072.
BLOCK_BYTES = 64 * 2**20
# Width of the C_ss column panels; only panel rows down to the diagonal are computed.
PANEL = 128
# The same for bf16 inputs on the bf16 units: two products a panel, which pay off only on wider panels (256 beat
# 128 and 512 at in = 768 and 3072, 1600 rows, one thread).
BF16_PANEL = 256

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


# Tile of the in-place mirror: a transposed copy is cache-friendly only in small blocks.
MIRROR_TILE = 256


def mirror_upper(c: torch.Tensor) -> torch.Tensor:
    """``c`` made symmetric in place from its upper triangle (the lower one is overwritten), and returned.

    Tile by tile: a whole-matrix ``u + u.T`` reads one operand across rows and cost a d = 3072 Gram about 6× as
    long, a fifth of its products on one thread."""
    d = c.shape[0]
    for i in range(0, d, MIRROR_TILE):
        rows = slice(i, i + MIRROR_TILE)
        diagonal = c[rows, rows]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).T)
        for j in range(i + MIRROR_TILE, d, MIRROR_TILE):
            cols = slice(j, j + MIRROR_TILE)
            c[cols, rows] = c[rows, cols].T
    return c


def _add_upper_gram(c_ss: torch.Tensor, wxs: torch.Tensor, xs: torch.Tensor) -> None:
    """c_ss += wxs^T xs in column panels, each computed only down to its diagonal block."""
    d = xs.shape[1]
    for j0 in range(0, d, PANEL):
        j1 = min(j0 + PANEL, d)
        c_ss[:j1, j0:j1].addmm_(wxs[:, :j1].T, xs[:, j0:j1])


def bf16_dual_gram(xs: torch.Tensor, xe: torch.Tensor | None, w32: torch.Tensor) -> GramOutputs:
    """The dual Gram of bf16 rows with the products on the bf16 units: per block of rows and per weight value v,
    v·X_vᵀX_v (C_ss panels down to the diagonal) and v·X_vᵀE_v from `add_product` (fp32 accumulation, kept as
    two bf16 terms), added into fp32; the sums Σ w x in fp32 from upcast rows. No x is rescaled or rounded."""
    n, d = xs.shape
    c_ss, c_se, sum_s, sum_e = (
        torch.zeros(shape, dtype=torch.float32, device=xs.device) for shape in output_shapes(d, xe is not None)[:4]
    )
    rows = max(1, min(BLOCK_BYTES // (4 * d), n))
    upcast = torch.empty(rows, d, dtype=torch.float32, device=xs.device)
    for start in range(0, n, rows):
        block = slice(start, min(start + rows, n))
        b = block.stop - start
        sum_s.addmv_(upcast[:b].copy_(xs[block]).T, w32[block])
        if xe is not None:
            sum_e.addmv_(upcast[:b].copy_(xe[block]).T, w32[block])
        for value, picked in weight_groups(w32[block]):
            xs_v = group_rows(xs[block], picked)
            for j0 in range(0, d, BF16_PANEL):
                j1 = min(j0 + BF16_PANEL, d)
                add_product(c_ss[:j1, j0:j1], xs_v[:, :j1], xs_v[:, j0:j1], value)
            if xe is not None:
                add_product(c_se, xs_v, group_rows(xe[block], picked), value)
    return mirror_upper(c_ss), c_se, sum_s, sum_e, w32.sum()


@torch.library.custom_op("featcal::dual_gram", mutates_args=())
def _dual_gram_op(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None) -> GramOutputs:
    """Blocked torch implementation: fp32 buffers of one block of rows, reused across blocks; bf16 rows on a CPU
    with bf16 units go to `bf16_dual_gram`."""
    check_gram_shapes(xs, xe, w)
    n, d = xs.shape
    if w is None:
        w32 = torch.ones(n, device=xs.device)
    else:
        w32 = w.to(torch.float32)
        check_weight_values(w32)
    if bf16_units_serve(xs, xe, w32):
        c_ss, c_se, sum_s, sum_e, sum_w = bf16_dual_gram(xs, xe, w32)
        check_finite_sums(sum_s, sum_e, sum_w)
        return c_ss, c_se, sum_s, sum_e, sum_w
    c_ss, c_se, sum_s, sum_e = (
        torch.zeros(shape, dtype=torch.float32, device=xs.device) for shape in output_shapes(d, xe is not None)[:4]
    )
    rows = max(1, min(BLOCK_BYTES // (4 * d), n))
    upcast = xs.dtype != torch.float32

    def buffer() -> torch.Tensor:
        return torch.empty(rows, d, dtype=torch.float32, device=xs.device)

    xs_buf, wxs_buf = buffer() if upcast else None, buffer()
    xe_buf = buffer() if upcast and xe is not None else None
    for start in range(0, n, rows):
        block = slice(start, min(start + rows, n))
        b = block.stop - start
        xs_b = xs_buf[:b].copy_(xs[block]) if xs_buf is not None else xs[block]  # None unless upcast
        wxs_b = torch.mul(xs_b, w32[block, None], out=wxs_buf[:b])
        sum_s += wxs_b.sum(0)
        _add_upper_gram(c_ss, wxs_b, xs_b)
        if xe is not None:
            xe_b = xe_buf[:b].copy_(xe[block]) if xe_buf is not None else xe[block]
            c_se.addmm_(wxs_b.T, xe_b)
            sum_e.addmv_(xe_b.T, w32[block])
    sum_w = w32.sum()
    check_finite_sums(sum_s, sum_e, sum_w)
    return mirror_upper(c_ss), c_se, sum_s, sum_e, sum_w


@_dual_gram_op.register_fake
def _dual_gram_fake(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None) -> GramOutputs:
    check_gram_shapes(xs, xe, w)
    shapes = output_shapes(xs.shape[1], xe is not None)
    c_ss, c_se, sum_s, sum_e, sum_w = (xs.new_empty(shape, dtype=torch.float32) for shape in shapes)
    return c_ss, c_se, sum_s, sum_e, sum_w


def dual_gram(xs: torch.Tensor, xe: torch.Tensor | None = None, w: torch.Tensor | None = None) -> DualGram:
    """Weighted uncentred moments of one chunk of module inputs, products accumulated in fp32.

    xs, xe: [N, d] float32/bfloat16/float16 (xe optional); w: [N] weights >= 0 (None = ones).
    """
    check_gram_shapes(xs, xe, w)  # before dispatch, so that non-tensors get the same clear error
    return DualGram(*torch.ops.featcal.dual_gram(xs, xe, w))
