"""Triton kernel for ``featcal::dual_gram`` on CUDA, also runnable on CPU under TRITON_INTERPRET=1.

One program owns one [BLOCK_D, BLOCK_D] output tile (i, j) and one slice of rows (split-K).
It loads the xs column tile i once per row block, scales it by w in registers and uses it for
both products: C_se[i, j] always, C_ss[i, j] only when i <= j (the upper triangle; mirrored on
the host). Each split writes its own partial outputs and the host sums them over the split axis:
a fixed-order reduction, so results are bit-reproducible (no atomics).

Products: fp32 and fp16 inputs are upcast and multiplied with ``input_precision="ieee"`` (no
TF32). bf16 inputs use bf16 tensor-core dots with fp32 accumulation: the unscaled operand is
exact in bf16, and the w-scaled one is split into BF16_TERMS bf16 terms (hi + lo, about 16
significant bits; one exact term when w is None). The interpreter computes the same terms but
multiplies them in fp32, because its tl.dot on bf16 operands is wrong.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from featcal_kernels.checks import check_finite_sums, check_gram_shapes, check_weight_values
from featcal_kernels.gram import GramOutputs, mirror_upper

# Tile width the split count is planned with, and the rows one split should at least get.
_PLAN_TILE = 64
_MIN_ROWS_PER_SPLIT = 1024
_MAX_SPLITS = 16


@triton.jit
def _load_tile(ptr, stride, rows, cols, n, d):
    mask = (rows[:, None] < n) & (cols[None, :] < d)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _add_scaled_dot(acc, wa, b, BF16_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc += wa^T b, with wa (fp32, w-scaled) [BLOCK_K, BLOCK_D] and b [BLOCK_K, BLOCK_D]."""
    if BF16_TERMS == 0:
        acc = tl.dot(tl.trans(wa), b.to(tl.float32), acc, input_precision="ieee")
    else:
        rest = wa
        for _ in tl.static_range(BF16_TERMS):
            term = rest.to(tl.bfloat16)
            rest = rest - term.to(tl.float32)
            acc = tl.dot(tl.trans(term.to(DOT_DTYPE)), b.to(DOT_DTYPE), acc, input_precision="ieee")
    return acc


@triton.jit
def _tile_program(
    xs_ptr, xe_ptr, w_ptr, css_ptr, cse_ptr, ss_ptr, se_ptr, sw_ptr,
    n, d, stride_xs, stride_xe, ti, tj, split, row_start, row_stop,
    DO_SS: tl.constexpr, HAS_XE: tl.constexpr, HAS_W: tl.constexpr,
    BF16_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Accumulate tile (i, j) over the rows of one split and store its partial outputs."""
    offs_i = ti * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_j = tj * BLOCK_D + tl.arange(0, BLOCK_D)
    acc_ss = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    acc_se = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    sum_s = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_e = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(row_start, row_stop, BLOCK_K):
        rows = k + tl.arange(0, BLOCK_K)
        a = _load_tile(xs_ptr, stride_xs, rows, offs_i, n, d)
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=rows < n, other=0.0)
        else:
            w = (rows < n).to(tl.float32)
        wa = a.to(tl.float32) * w[:, None]
        sum_s += tl.sum(wa, axis=0)
        sum_w += w
        if DO_SS:
            b = _load_tile(xs_ptr, stride_xs, rows, offs_j, n, d)
            acc_ss = _add_scaled_dot(acc_ss, wa, b, BF16_TERMS, DOT_DTYPE)
        if HAS_XE:
            e = _load_tile(xe_ptr, stride_xe, rows, offs_j, n, d)
            acc_se = _add_scaled_dot(acc_se, wa, e, BF16_TERMS, DOT_DTYPE)
            sum_e += tl.sum(e.to(tl.float32) * w[:, None], axis=0)
    tile_mask = (offs_i[:, None] < d) & (offs_j[None, :] < d)
    tile_offs = split.to(tl.int64) * d * d + offs_i[:, None] * d + offs_j[None, :]
    if DO_SS:
        tl.store(css_ptr + tile_offs, acc_ss, mask=tile_mask)
        if ti == tj:
            tl.store(ss_ptr + split * d + offs_i, sum_s, mask=offs_i < d)
            if ti == 0:
                tl.store(sw_ptr + split, tl.sum(sum_w, axis=0))
    if HAS_XE:
        tl.store(cse_ptr + tile_offs, acc_se, mask=tile_mask)
        if ti == 0:
            tl.store(se_ptr + split * d + offs_j, sum_e, mask=offs_j < d)


@triton.jit
def _dual_gram_kernel(
    xs_ptr, xe_ptr, w_ptr, css_ptr, cse_ptr, ss_ptr, se_ptr, sw_ptr,
    n, d, stride_xs, stride_xe,
    HAS_XE: tl.constexpr, HAS_W: tl.constexpr, BF16_TERMS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (tiles_d * tiles_d, splits); outputs per split: [splits, d, d], [splits, d], [splits]."""
    tiles_d = tl.cdiv(d, BLOCK_D)
    ti = tl.program_id(0) // tiles_d
    tj = tl.program_id(0) % tiles_d
    split = tl.program_id(1)
    rows_per_split = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK_K) * BLOCK_K
    row_start = split * rows_per_split
    row_stop = tl.minimum(row_start + rows_per_split, n)
    # Branch outside the row loop so that each loop body is straight-line code.
    if ti <= tj:
        _tile_program(xs_ptr, xe_ptr, w_ptr, css_ptr, cse_ptr, ss_ptr, se_ptr, sw_ptr,
                      n, d, stride_xs, stride_xe, ti, tj, split, row_start, row_stop,
                      True, HAS_XE, HAS_W, BF16_TERMS, DOT_DTYPE, BLOCK_D, BLOCK_K)
    elif HAS_XE:
        _tile_program(xs_ptr, xe_ptr, w_ptr, css_ptr, cse_ptr, ss_ptr, se_ptr, sw_ptr,
                      n, d, stride_xs, stride_xe, ti, tj, split, row_start, row_stop,
                      False, HAS_XE, HAS_W, BF16_TERMS, DOT_DTYPE, BLOCK_D, BLOCK_K)


# Short list; sm_90 compiles of the 64-wide tiles do not spill registers (two accumulators live
# at once), the 128-wide one spills a little but halves the re-reads of x for large d.
_dual_gram_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_D": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_D": 64, "BLOCK_K": 32}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_D": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_D": 128, "BLOCK_K": 16}, num_warps=8, num_stages=3),
    ],
    key=["d", "HAS_XE", "HAS_W", "BF16_TERMS"],
)(_dual_gram_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _default_splits(n: int, d: int, device: torch.device) -> int:
    """Enough row splits for about two waves of programs, each split keeping a useful row count."""
    if device.type != "cuda":
        return 1
    programs = torch.cuda.get_device_properties(device).multi_processor_count * 2
    tiles = triton.cdiv(d, _PLAN_TILE) ** 2
    by_rows = max(1, n // _MIN_ROWS_PER_SPLIT)
    return max(1, min(triton.cdiv(programs, tiles), by_rows, _MAX_SPLITS))


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def triton_dual_gram(
    xs: torch.Tensor,
    xe: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    block_d: int | None = None,
    block_k: int | None = None,
) -> GramOutputs:
    """Launch the kernel on the tensors' device (CUDA, or CPU under TRITON_INTERPRET=1).

    ``splits``, ``block_d`` and ``block_k`` override the split count and the autotuned tile
    sizes (tests use them to cover several tiles and splits on small inputs); the interpreter
    cannot autotune and uses 64 x 32 tiles unless told otherwise.
    """
    check_gram_shapes(xs, xe, w)
    w32 = None if w is None else w.to(torch.float32).contiguous()
    if w32 is not None:
        check_weight_values(w32)
    n, d = xs.shape
    xs = _row_major(xs)
    xe = None if xe is None else _row_major(xe)
    n_splits = splits or _default_splits(n, d, xs.device)
    e = d if xe is not None else 0
    f32, dev = torch.float32, xs.device
    p_ss, p_s = torch.empty(n_splits, d, d, dtype=f32, device=dev), torch.empty(n_splits, d, dtype=f32, device=dev)
    p_w = torch.empty(n_splits, dtype=f32, device=dev)
    p_se, p_e = torch.empty(n_splits, e, e, dtype=f32, device=dev), torch.empty(n_splits, e, dtype=f32, device=dev)
    args = (
        xs, xe if xe is not None else xs, w32 if w32 is not None else p_w,  # unused stand-ins when absent
        p_ss, p_se if xe is not None else p_ss, p_s, p_e if xe is not None else p_s, p_w,
        n, d, xs.stride(0), xe.stride(0) if xe is not None else 0,
    )
    flags = dict(
        HAS_XE=xe is not None,
        HAS_W=w32 is not None,
        BF16_TERMS=0 if xs.dtype != torch.bfloat16 else (1 if w32 is None else 2),
        DOT_DTYPE=tl.float32 if _interpreting() else tl.bfloat16,
    )
    if block_d is None and block_k is None and not _interpreting():  # the autotuner needs a GPU to time
        _dual_gram_tuned[lambda meta: (triton.cdiv(d, meta["BLOCK_D"]) ** 2, n_splits)](*args, **flags)
    else:
        bd, bk = block_d or 64, block_k or 32
        _dual_gram_kernel[(triton.cdiv(d, bd) ** 2, n_splits)](*args, **flags, BLOCK_D=bd, BLOCK_K=bk)
    sum_s, sum_e, sum_w = p_s.sum(0), p_e.sum(0), p_w.sum(0)
    check_finite_sums(sum_s, sum_e, sum_w)
    c_se = p_se.sum(0) if xe is not None else p_se.new_zeros(0)
    return mirror_upper(p_ss.sum(0)), c_se, sum_s, sum_e, sum_w


def register(device: str = "cuda") -> None:
    """Make this kernel the implementation of featcal::dual_gram for ``device``."""
    torch.library.register_kernel("featcal::dual_gram", device, triton_dual_gram)
