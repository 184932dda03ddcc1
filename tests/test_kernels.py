"""Tests of featcal_kernels: dual Gram (torch and interpreted Triton), ridge solves, op registration."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import featcal_kernels
from featcal_kernels import dual_gram, ridge_solve, ridge_sweep
from featcal_kernels import gram as gram_module

GRAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_gram_inputs(
    n: int, d: int, dtype: torch.dtype, *, seed: int = 0, with_xe: bool = True, weights: str = "random"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Random inputs; ``weights`` is "random" (some exactly 0), "none", "zero" or "float64"."""
    gen = torch.Generator().manual_seed(seed)
    xs = (torch.randn(n, d, generator=gen) + 0.5).to(dtype)
    xe = (torch.randn(n, d, generator=gen) - 0.25).to(dtype) if with_xe else None
    w: torch.Tensor | None = torch.rand(n, generator=gen) * 2
    w[torch.rand(n, generator=gen) < 0.2] = 0.0
    if weights == "none":
        w = None
    elif weights == "zero":
        w = torch.zeros(n)
    elif weights == "float64":
        w = w.double()
    return xs, xe, w


def assert_matches_reference(
    got: tuple[torch.Tensor, ...], xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor | None, rel: float
) -> None:
    """Compare with float64 statistics of the same (already rounded) inputs.

    Each entry may be off by ``rel`` times the same statistic of |x| (the size of the summed
    products), which is how fp32 accumulation error scales.
    """
    got = featcal_kernels.DualGram(*got)
    x = xs.double()
    wt = w.double() if w is not None else x.new_ones(x.shape[0])
    pairs = {"c_ss": (x, x), "sum_s": (x, None)}
    if xe is not None:
        pairs.update(c_se=(x, xe.double()), sum_e=(xe.double(), None))
    else:
        assert got.c_se.shape == (0,) and got.sum_e.shape == (0,)
    for name, (left, right) in pairs.items():
        value = getattr(got, name)
        assert value.dtype == torch.float32, name
        if right is None:
            ref, bound = left.T @ wt, left.abs().T @ wt
        else:
            ref, bound = left.T @ (wt[:, None] * right), left.abs().T @ (wt[:, None] * right.abs())
        assert value.shape == ref.shape, name
        err = (value.double() - ref).abs()
        allowed = rel * bound + 1e-12
        assert bool((err <= allowed).all()), f"{name}: max error {err.max():.3g}, max allowed {allowed.max():.3g}"
    assert got.sum_w.shape == () and abs(float(got.sum_w) - float(wt.sum())) <= rel * float(wt.sum()) + 1e-12


GRAM_CASES = {
    "weighted": dict(n=77, d=37),
    "no_weights": dict(n=77, d=37, weights="none"),
    "zero_weights": dict(n=40, d=19, weights="zero"),
    "float64_weights": dict(n=45, d=21, weights="float64"),
    "single_row": dict(n=1, d=23),
    "no_xe": dict(n=65, d=33, with_xe=False),
    "no_xe_no_weights": dict(n=65, d=33, with_xe=False, weights="none"),
    "no_rows": dict(n=0, d=5),
}


@pytest.mark.parametrize("dtype", GRAM_DTYPES, ids=str)
@pytest.mark.parametrize("case", GRAM_CASES.values(), ids=GRAM_CASES.keys())
def test_dual_gram_matches_float64_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, case: dict) -> None:
    # Small blocks and panels so that odd sizes cross several of each, with ragged last ones.
    monkeypatch.setattr(gram_module, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(gram_module, "PANEL", 16)
    n, d = case["n"], case["d"]
    xs, xe, w = make_gram_inputs(n, d, dtype, with_xe=case.get("with_xe", True), weights=case.get("weights", "random"))
    got = dual_gram(xs, xe, w)
    assert isinstance(got, featcal_kernels.DualGram)
    assert torch.equal(got.c_ss, got.c_ss.T), "c_ss must be exactly symmetric"
    assert_matches_reference(tuple(got), xs, xe, w, rel=1e-5)


def test_dual_gram_strided_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column slices (row stride != d) over several row blocks and panels."""
    monkeypatch.setattr(gram_module, "BLOCK_BYTES", 2**20)  # 873 rows at d = 300
    xs_wide, xe, w = make_gram_inputs(2000, 303, torch.bfloat16, seed=1)
    xs = xs_wide[:, :-3]  # not contiguous
    xe = xe[:, :-3]
    got = dual_gram(xs, xe, w)
    assert_matches_reference(tuple(got), xs, xe, w, rel=1e-5)


def test_dual_gram_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same inputs, same bits (the pipeline's resume promises bit-identical weights)."""
    monkeypatch.setattr(gram_module, "BLOCK_BYTES", 2**20)
    xs, xe, w = make_gram_inputs(3000, 200, torch.bfloat16, seed=2)
    first, second = dual_gram(xs, xe, w), dual_gram(xs.clone(), xe.clone(), w.clone())
    assert all(torch.equal(a, b) for a, b in zip(first, second))


BAD_GRAM_INPUTS = {
    "xs_1d": (lambda xs, xe, w: (xs[:, 0], xe, w), "xs"),
    "xs_int": (lambda xs, xe, w: (xs.to(torch.int32), None, w), "xs"),
    "xs_float64": (lambda xs, xe, w: (xs.double(), None, w), "xs"),
    "xs_not_tensor": (lambda xs, xe, w: (xs.tolist(), None, None), "xs"),
    "xs_no_columns": (lambda xs, xe, w: (xs[:, :0], None, None), "xs"),
    "xs_nan": (lambda xs, xe, w: (xs.index_fill(0, torch.tensor([2]), float("nan")), xe, w), "xs"),
    "xe_shape": (lambda xs, xe, w: (xs, xe[:-1], w), "xe"),
    "xe_dtype": (lambda xs, xe, w: (xs, xe.to(torch.bfloat16), w), "xe"),
    "xe_inf": (lambda xs, xe, w: (xs, xe.index_fill(1, torch.tensor([0]), float("inf")), w), "xe"),
    "w_shape": (lambda xs, xe, w: (xs, xe, w[:-1]), "w"),
    "w_2d": (lambda xs, xe, w: (xs, xe, w[:, None]), "w"),
    "w_int": (lambda xs, xe, w: (xs, xe, torch.ones(len(w), dtype=torch.int64)), "w"),
    "w_negative": (lambda xs, xe, w: (xs, xe, w - 1), "w"),
    "w_nan": (lambda xs, xe, w: (xs, xe, w.index_fill(0, torch.tensor([3]), float("nan"))), "w"),
    "w_inf": (lambda xs, xe, w: (xs, xe, w.index_fill(0, torch.tensor([3]), float("inf"))), "w"),
}


@pytest.mark.parametrize("mutate,name", BAD_GRAM_INPUTS.values(), ids=BAD_GRAM_INPUTS.keys())
def test_dual_gram_rejects_bad_input(mutate, name: str) -> None:
    xs, xe, w = mutate(*make_gram_inputs(10, 4, torch.float32))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        dual_gram(xs, xe, w)


@pytest.mark.parametrize("with_xe,with_w", [(True, True), (False, True), (True, False), (False, False)])
def test_dual_gram_opcheck(with_xe: bool, with_w: bool) -> None:
    xs, xe, w = make_gram_inputs(19, 6, torch.bfloat16, with_xe=with_xe, weights="random" if with_w else "none")
    torch.library.opcheck(torch.ops.featcal.dual_gram.default, (xs, xe, w))


def randn64(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def spd_matrix(d: int, eigenvalues: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Q diag(eigenvalues) Q^T for a random orthogonal Q, symmetrised exactly."""
    q, _ = torch.linalg.qr(randn64(d, d, seed=seed))
    a = q @ torch.diag(eigenvalues.double()) @ q.T
    return (a + a.T) / 2


def test_ridge_solve_matches_linalg_solve() -> None:
    d = 40
    a = spd_matrix(d, torch.logspace(-3, 2, d))
    b = randn64(d, 3, seed=10)
    sol = ridge_solve(a, b, damping=1e-6)
    assert isinstance(sol, featcal_kernels.RidgeSolution)
    assert sol.damping == 1e-6
    expected = torch.linalg.solve(a + 1e-6 * torch.eye(d, dtype=torch.float64), b)
    torch.testing.assert_close(sol.x, expected, rtol=1e-9, atol=1e-9 * float(expected.abs().max()))


def test_ridge_solve_grows_damping_on_singular_matrix(caplog: pytest.LogCaptureFixture) -> None:
    d = 30
    # PSD up to rounding: two exact zeros and one slightly negative eigenvalue, as a float32
    # accumulated Gram of rank-deficient inputs can give.
    eigenvalues = torch.cat([torch.linspace(1, 10, d - 3), torch.tensor([0.0, 0.0, -1e-7])])
    a = spd_matrix(d, eigenvalues, seed=1)
    b = randn64(d, 2, seed=11)
    with caplog.at_level(logging.WARNING, logger="featcal_kernels"):
        sol = ridge_solve(a, b, damping=1e-8)
    assert sol.damping > 1e-8
    residual = (a + sol.damping * torch.eye(d, dtype=torch.float64)) @ sol.x - b
    assert float(residual.norm() / b.norm()) < 1e-8
    assert any("damping" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_ridge_solve_leaves_a_as_it_was_on_both_paths() -> None:
    """The factor is written in place over a column-major copy of a: a itself must come back untouched, whether
    the first damping succeeds or it grows (a failed factorisation has overwritten the copy by then)."""
    d = 30
    good = spd_matrix(d, torch.logspace(-2, 1, d))
    bad = spd_matrix(d, torch.cat([torch.linspace(1, 10, d - 1), torch.tensor([-1e-7])]), seed=2)
    b = randn64(d, 2, seed=12)
    for a, grew in ((good, False), (bad, True)):
        kept = a.clone()
        sol = ridge_solve(a, b, damping=1e-8)
        assert (sol.damping > 1e-8) == grew
        assert torch.equal(a, kept)
        expected = torch.linalg.solve(a + sol.damping * torch.eye(d, dtype=torch.float64), b)
        torch.testing.assert_close(sol.x, expected, rtol=1e-8, atol=1e-8 * float(expected.abs().max()))


def test_ridge_solve_gives_up_past_max_damping() -> None:
    a = -torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"3x3.*max_damping=0\.01"):
        ridge_solve(a, torch.ones(3, 1, dtype=torch.float64), damping=1e-8, max_damping=1e-2)


BAD_RIDGE_INPUTS = {
    "a_not_square": (lambda a, b: (a[:, :-1], b), {}, "a"),
    "a_float32": (lambda a, b: (a.float(), b), {}, "a"),
    "a_nan": (lambda a, b: (a.index_fill(0, torch.tensor([0]), float("nan")), b), {}, "a"),
    "b_rows": (lambda a, b: (a, b[:-1]), {}, "b"),
    "b_1d": (lambda a, b: (a, b[:, 0]), {}, "b"),
    "b_float32": (lambda a, b: (a, b.float()), {}, "b"),
    "damping_zero": (lambda a, b: (a, b), {"damping": 0.0}, "damping"),
    "max_below_damping": (lambda a, b: (a, b), {"damping": 1.0, "max_damping": 0.1}, "max_damping"),
}


@pytest.mark.parametrize("mutate,kwargs,name", BAD_RIDGE_INPUTS.values(), ids=BAD_RIDGE_INPUTS.keys())
def test_ridge_solve_rejects_bad_input(mutate, kwargs: dict, name: str) -> None:
    a, b = mutate(torch.eye(4, dtype=torch.float64), torch.ones(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ridge_solve(a, b, **kwargs)


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def test_ridge_solve_mixed_refines_a_well_conditioned_system_to_float64() -> None:
    # FeatCal's system: a normalised Gram (eigenvalues up to 1, some near 0) plus λ = 0.01·I.
    d = 120
    a = spd_matrix(d, torch.cat([torch.logspace(-8, 0, d - 2), torch.zeros(2)]), seed=3) + 0.01 * torch.eye(
        d, dtype=torch.float64)
    b = randn64(d, 7, seed=14)
    reference = ridge_solve(a, b, damping=1e-8)
    sol = featcal_kernels.ridge_solve_mixed(a, b, damping=1e-8)
    assert (sol.path, sol.fallback, sol.damping) == ("mixed", None, 1e-8)
    assert 1 <= sol.steps <= 4
    assert _relative(sol.x, reference.x) < 1e-9
    # the fp32 solve alone, without refinement, is far from that: the refinement is doing the work
    unrefined = torch.cholesky_solve(b.float(), torch.linalg.cholesky((a + 1e-8 * torch.eye(d, dtype=torch.float64))
                                                                      .float())).double()
    assert _relative(unrefined, reference.x) > 1e-7


def test_ridge_solve_mixed_falls_back_on_regmean_eps_only_system() -> None:
    # RegMean: a Gram with eigenvalues down to 1e-9 and only ε = 1e-8 on the diagonal, κ ≈ 1e8 > 1/u_fp32.
    d = 80
    a = spd_matrix(d, torch.logspace(-9, 0, d), seed=4)
    b = randn64(d, 3, seed=15)
    reference = ridge_solve(a, b, damping=1e-8)
    sol = featcal_kernels.ridge_solve_mixed(a, b, damping=1e-8)
    assert sol.path == "float64" and sol.steps == 0
    assert sol.fallback is not None and ("stalled" in sol.fallback or "fp32 Cholesky failed" in sol.fallback)
    assert torch.equal(sol.x, reference.x) and sol.damping == reference.damping


def test_ridge_solve_mixed_falls_back_when_fp32_factorisation_fails() -> None:
    # Nearly singular: PSD only up to rounding, so the fp32 factor fails and float64 grows the damping.
    d = 30
    a = spd_matrix(d, torch.cat([torch.linspace(1, 10, d - 3), torch.tensor([0.0, 0.0, -1e-7])]), seed=1)
    b = randn64(d, 2, seed=11)
    sol = featcal_kernels.ridge_solve_mixed(a, b, damping=1e-8)
    reference = ridge_solve(a, b, damping=1e-8)
    assert sol.path == "float64" and sol.fallback == "fp32 Cholesky failed at damping 1e-08"
    assert torch.equal(sol.x, reference.x) and sol.damping == reference.damping > 1e-8


@pytest.mark.parametrize("mutate,kwargs,name", BAD_RIDGE_INPUTS.values(), ids=BAD_RIDGE_INPUTS.keys())
def test_ridge_solve_mixed_rejects_bad_input(mutate, kwargs: dict, name: str) -> None:
    a, b = mutate(torch.eye(4, dtype=torch.float64), torch.ones(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        featcal_kernels.ridge_solve_mixed(a, b, **kwargs)


def test_ridge_sweep_matches_ridge_solve() -> None:
    d = 25
    a = spd_matrix(d, torch.logspace(-4, 1, d), seed=2)
    b = randn64(d, 4, seed=12)
    lambdas = [1e-5, 1e-2, 1.0, 30.0]
    swept = ridge_sweep(a, b, lambdas)
    assert swept.shape == (len(lambdas), d, 4) and swept.dtype == torch.float64
    for lam, x in zip(lambdas, swept):
        expected = ridge_solve(a, b, damping=lam).x
        torch.testing.assert_close(x, expected, rtol=1e-8, atol=1e-8 * float(expected.abs().max()))


def test_ridge_sweep_rejects_non_positive_lambda() -> None:
    with pytest.raises(ValueError, match=r"^lambdas\b"):
        ridge_sweep(torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64), [1.0, 0.0])


def test_ridge_solve_opcheck() -> None:
    a = spd_matrix(8, torch.linspace(0.5, 4, 8))
    b = randn64(8, 2, seed=13)
    torch.library.opcheck(torch.ops.featcal.ridge_solve.default, (a, b, 1e-8, 1e2))


def test_import_without_triton() -> None:
    code = "import sys; sys.modules['triton'] = None; import featcal_kernels; print(featcal_kernels.dual_gram)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_triton_kernel_under_interpreter() -> None:
    """TRITON_INTERPRET must be set before the kernels are decorated, hence a fresh process running
    tests/triton_interpreted.py (not collected here: its checks only make sense under the interpreter)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("triton_interpreted.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=script.parent.parent)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("k", [7, 4 * 40, 5 * 40 + 3])  # triangular solves; from 4·d on, the factor's inverse
def test_ridge_solve_x_is_column_major_so_its_transpose_is_the_weight_without_a_copy(k: int) -> None:
    a = spd_matrix(40, torch.linspace(0.1, 1, 40), seed=5)
    b = randn64(40, k, seed=16)
    sol = ridge_solve(a, b, damping=1e-8)
    assert sol.x.T.is_contiguous()
    torch.testing.assert_close(sol.x, torch.linalg.solve(a + 1e-8 * torch.eye(40, dtype=torch.float64), b),
                               rtol=1e-10, atol=1e-12)


def test_ridge_solve_of_many_right_hand_sides_keeps_float64_accuracy_on_an_ill_conditioned_system() -> None:
    """The inverse path on a RegMean-like system (κ = 1e8, ε-only damping): as accurate as the triangular solves,
    column by column, against linalg.solve."""
    d = 60
    a = spd_matrix(d, torch.logspace(-8, 0, d), seed=6)
    b = randn64(d, 4 * d, seed=17)
    wide = ridge_solve(a, b, damping=1e-12)
    narrow = torch.cat([ridge_solve(a, b[:, i:i + 8], damping=1e-12).x for i in range(0, 4 * d, 8)], dim=1)
    expected = torch.linalg.solve(a + 1e-12 * torch.eye(d, dtype=torch.float64), b)
    error = [float((x - expected).norm() / expected.norm()) for x in (wide.x, narrow)]
    assert error[0] < 1e-6 and error[0] < 10 * error[1], error


def test_mixed_pays_only_for_a_narrow_right_hand_side() -> None:
    """The measured break-even at d = 3072 was k = 64: the mixed path is taken up to d/48 right-hand sides."""
    assert featcal_kernels.mixed_pays(3072, 64) and featcal_kernels.mixed_pays(96, 2)
    assert not featcal_kernels.mixed_pays(3072, 65) and not featcal_kernels.mixed_pays(768, 768)
    assert not featcal_kernels.mixed_pays(3072, 768) and not featcal_kernels.mixed_pays(5, 3)
