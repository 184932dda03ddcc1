"""The Triton dual-Gram kernel run by Triton's CPU interpreter (TRITON_INTERPRET=1 in a fresh process).

Run by tests/test_kernels.py::test_triton_kernel_under_interpreter; not collected on its own."""

from __future__ import annotations

import os

import pytest
import torch

from featcal_kernels import dual_gram
from tests.test_kernels import assert_matches_reference, make_gram_inputs

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/triton_interpreted.py needs TRITON_INTERPRET=1 set before triton is imported")


# (n, d, dtype, weights, with_xe, splits, block_d, block_k): odd sizes over several tiles and splits.
TRITON_CASES = [
    (77, 37, torch.float32, "random", True, 3, 16, 16),
    (50, 20, torch.float32, "none", True, 1, 16, 32),
    (33, 40, torch.float32, "random", False, 2, 32, 16),
    (1, 17, torch.float32, "random", True, 1, 16, 16),
    (77, 37, torch.bfloat16, "random", True, 3, 16, 16),
    (50, 20, torch.bfloat16, "none", True, 2, 16, 16),
    (33, 40, torch.bfloat16, "zero", False, 1, 16, 16),
    (61, 24, torch.float16, "random", True, 2, 16, 16),
]


def test_triton_interpreted_cases() -> None:
    from featcal_kernels.triton_gram import triton_dual_gram

    for n, d, dtype, weights, with_xe, splits, block_d, block_k in TRITON_CASES:
        xs, xe, w = make_gram_inputs(n, d, dtype, seed=n + d, with_xe=with_xe, weights=weights)
        got = triton_dual_gram(xs, xe, w, splits=splits, block_d=block_d, block_k=block_k)
        assert torch.equal(got[0], got[0].T)
        # bf16 with weights: w*x is carried as two bf16 terms, and the interpreter truncates
        # fp32 -> bf16 (GPUs round to nearest), so each product keeps about 14 bits.
        rel = 2e-4 if dtype == torch.bfloat16 and weights != "none" else 1e-5
        assert_matches_reference(got, xs, xe, w, rel=rel)
    # Per-split partials summed in a fixed order: the same bits every time.
    again = triton_dual_gram(xs, xe, w, splits=splits, block_d=block_d, block_k=block_k)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    xs, xe, w = make_gram_inputs(10, 16, torch.float32)
    with pytest.raises(ValueError, match=r"^w\b"):
        triton_dual_gram(xs, xe, -w - 1, block_d=16, block_k=16)


def test_triton_interpreted_op_kernel() -> None:
    """Registered for a device ("cpu" here, in a throwaway process), the kernel serves the public op."""
    from featcal_kernels import triton_gram

    triton_gram.register("cpu")
    xs, xe, w = make_gram_inputs(40, 20, torch.float32, seed=3)
    assert_matches_reference(tuple(dual_gram(xs, xe, w)), xs, xe, w, rel=1e-5)
    torch.library.opcheck(torch.ops.featcal.dual_gram.default, (xs, xe, w))
