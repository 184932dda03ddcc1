"""bf16 × bf16 products with fp32 accumulation on a CPU's bf16 units, as two bf16 terms.

CPU torch has no bf16 × bf16 → fp32 product: its bf16 matmul (oneDNN) accumulates in fp32 and rounds the result to
bf16, which keeps 3 digits. `addmm(hi, a, b, beta=-1)` adds −hi into that same fp32 accumulator before the rounding,
so it returns hi's rounding error, itself rounded: hi + lo is the fp32-accumulated product to about 2⁻¹⁸ relative
(measured 2.4e-6 on a 1600-row Gram), for two bf16 products, which on AVX512-BF16 cost less than one fp32 product.
"""

from __future__ import annotations

import torch

# bf16 inputs take the bf16 units when their token weights take at most this many non-zero values: each value's
# rows make one product, so no w·x is rounded to bf16 (pooled and padded tokens give 1 to 3 values).
BF16_WEIGHT_VALUES = 4


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without them torch emulates it."""
    cpu = torch.cpu
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, probe, lambda: False)() for probe in probes)


def product_terms(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), bf16 [p, q] each, with hi + lo = aᵀb accumulated in fp32, for bf16 a [N, p] and b [N, q]."""
    hi = a.T @ b
    return hi, torch.addmm(hi, a.T, b, beta=-1)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
    """out += scale · aᵀb, out fp32 [p, q], the product from `product_terms`."""
    hi, lo = product_terms(a, b)
    out.add_(hi, alpha=scale).add_(lo, alpha=scale)


def weight_groups(w: torch.Tensor) -> list[tuple[float, torch.Tensor | None]]:
    """(value, row indices) of each non-zero value of the token weights w, in increasing order; None: all rows."""
    values = torch.unique(w)
    values = values[values != 0]
    if len(values) == 1 and bool((w == values[0]).all()):
        return [(float(values[0]), None)]
    return [(float(v), (w == v).nonzero().squeeze(1)) for v in values]


def group_rows(t: torch.Tensor, picked: torch.Tensor | None) -> torch.Tensor:
    """The rows of `t` in one weight group of `weight_groups` (all of them for None)."""
    return t if picked is None else t.index_select(0, picked)


def bf16_units_serve(xs: torch.Tensor, xe: torch.Tensor | None, w32: torch.Tensor) -> bool:
    """Whether `bf16_dual_gram` takes this chunk: bf16 rows on a CPU with bf16 units, few distinct weights."""
    return (xs.dtype == torch.bfloat16 and (xe is None or xe.dtype == torch.bfloat16) and xs.device.type == "cpu"
            and cpu_has_native_bf16() and len(torch.unique(w32[w32 != 0])) <= BF16_WEIGHT_VALUES)


def bf16_target_product(xs: torch.Tensor, w32: torch.Tensor, w_t: torch.Tensor, y: torch.Tensor,
                        bias: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """P_t = Σ w x (α·(y − b) + (1−α)·W_t x)ᵀ, fp32 [in, out], of one chunk of bf16 rows on the bf16 units, y the
    expert module's bf16 output. W_t x comes as two bf16 terms (`product_terms`); the target, mixed in fp32, goes
    back to bf16 as two terms too (hi and its rounding error lo): X_vᵀ·hi in two terms and X_vᵀ·lo, a 2⁻⁹-relative
    correction, in one. Five bf16 products in all, where P_e and P_s apart took seven."""
    z_hi, z_lo = product_terms(xs.T, w_t.T)
    target = z_hi.float().add_(z_lo.float()).mul_(1.0 - alpha)
    target.add_(y.float() if bias is None else y.float() - bias.float(), alpha=alpha)
    t_hi = target.bfloat16()
    t_lo = target.sub_(t_hi.float()).bfloat16()
    del target
    pt = torch.zeros(xs.shape[1], w_t.shape[0], dtype=torch.float32, device=xs.device)
    for value, picked in weight_groups(w32):
        x_v = group_rows(xs, picked)
        add_product(pt, x_v, group_rows(t_hi, picked), value)
        pt.add_(x_v.T @ group_rows(t_lo, picked), alpha=value)
    return pt
