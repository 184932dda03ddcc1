"""Each closed form of docs/design.md §2 against a brute-force least-squares solve of the same objective."""

import pytest
import torch

from featcal.closed_form import (
    LIFTED,
    UNRESOLVED,
    BiasTerm,
    Hyper,
    LinearMoments,
    NormMoments,
    anchor,
    numerical_rank,
    solve_linear_bias,
    solve_linear_weight,
    solve_norm_affine,
    unresolved_directions,
)

torch.manual_seed(0)
D_IN, D_OUT, N, T = 6, 4, 200, 3


def _task_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, D_IN, generator=g, dtype=torch.float64) + 0.3
    xe = xs @ (torch.eye(D_IN, dtype=torch.float64) + 0.3 * torch.randn(D_IN, D_IN, generator=g, dtype=torch.float64))
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w[:10] = 0.0  # padding tokens
    return xs, xe, w


def _moments(xs, xe, w) -> LinearMoments:
    sw = w.sum()
    return LinearMoments(c_ss=(xs * w[:, None]).T @ xs / sw, c_se=(xs * w[:, None]).T @ xe / sw,
                         mu_s=(w[:, None] * xs).sum(0) / sw, mu_e=(w[:, None] * xe).sum(0) / sw)


@pytest.fixture(params=[0.0, 0.05, 1.5], ids=["no-anchor", "lambda-0.05", "lambda-1.5"])
def problem(request):
    hp = Hyper(lam=request.param, rho=2.2, alpha=0.25, eps=1e-14)
    data = [_task_data(s) for s in range(T)]
    g = torch.Generator().manual_seed(99)
    w_t = [torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(T)]
    b_t = [torch.randn(D_OUT, generator=g, dtype=torch.float64) for _ in range(T)]
    w_m, w_0 = (
        torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64),
        torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64),
    )
    b_m, b_0 = (
        torch.randn(D_OUT, generator=g, dtype=torch.float64),
        torch.randn(D_OUT, generator=g, dtype=torch.float64),
    )
    return hp, data, w_t, b_t, (w_m, w_0), (b_m, b_0)


def _norm_of(xs, w):
    sw = w.sum()
    return float(torch.linalg.matrix_norm((xs * w[:, None]).T @ xs / sw))


def test_linear_weight_matches_least_squares(problem):
    hp, data, w_t, _, (w_m, w_0), _ = problem
    rows, targets = [], []
    for (xs, xe, w), wt in zip(data, w_t):
        c = (w / w.sum() / _norm_of(xs, w)).sqrt()[:, None]
        xt = hp.alpha * xe + (1 - hp.alpha) * xs
        rows.append(c * xs)
        targets.append(c * (xt @ wt.T))
    if hp.lam > 0:
        rows.append(hp.lam**0.5 * torch.eye(D_IN, dtype=torch.float64))
        targets.append(hp.lam**0.5 * (hp.rho * w_m + (1 - hp.rho) * w_0).T)
    brute = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    got = solve_linear_weight(zip([_moments(*d) for d in data], w_t), w_m, w_0, hp)
    torch.testing.assert_close(got.weight, brute, rtol=1e-8, atol=1e-9)


def test_linear_bias_matches_least_squares(problem):
    hp, data, w_t, b_t, (w_m, w_0), (b_m, b_0) = problem
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    rows, targets = [], []
    for (xs, xe, w), wt, bt in zip(data, w_t, b_t):
        c = (w / w.sum() / _norm_of(xs, w)).sqrt()[:, None]
        xt = hp.alpha * xe + (1 - hp.alpha) * xs
        y = xt @ wt.T + bt - xs @ weight.T  # b must match y per token
        rows.append(c * torch.ones(N, 1, dtype=torch.float64))
        targets.append(c * y)
    if hp.lam > 0:
        rows.append(torch.full((1, 1), hp.lam**0.5, dtype=torch.float64))
        targets.append(hp.lam**0.5 * anchor(b_m, b_0, hp.rho)[None])
    brute = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution[0]
    terms = [BiasTerm.of(_moments(*d), wt, bt, hp.alpha) for d, wt, bt in zip(data, w_t, b_t)]
    got = solve_linear_bias(terms, weight, b_m, b_0, hp)
    torch.testing.assert_close(got, brute, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("with_beta", [True, False], ids=["layernorm", "rmsnorm"])
def test_norm_affine_matches_least_squares(problem, with_beta):
    hp = problem[0]
    d = 5
    g = torch.Generator().manual_seed(11)
    zs = [torch.randn(N, d, generator=g, dtype=torch.float64) * 1.3 + 0.2 for _ in range(T)]
    ws = [torch.rand(N, generator=g, dtype=torch.float64) for _ in range(T)]
    gam_t = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(T)]
    bet_t = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(T)]
    gam_m, gam_0, bet_m, bet_0 = (torch.randn(d, generator=g, dtype=torch.float64) for _ in range(4))
    expected_g, expected_b = torch.empty(d, dtype=torch.float64), torch.empty(d, dtype=torch.float64)
    for j in range(d):  # each dimension is its own small least-squares problem
        rows, targets = [], []
        for z, w, gt, bt in zip(zs, ws, gam_t, bet_t):
            c = (w / w.sum()).sqrt()
            cols = [c * z[:, j]] + ([c] if with_beta else [])
            rows.append(torch.stack(cols, 1))
            targets.append(c * (gt[j] * z[:, j] + (bt[j] if with_beta else 0.0)))
        if hp.lam > 0:
            k = 2 if with_beta else 1
            rows.append(hp.lam**0.5 * torch.eye(k, dtype=torch.float64))
            a = [anchor(gam_m, gam_0, hp.rho)[j]] + ([anchor(bet_m, bet_0, hp.rho)[j]] if with_beta else [])
            targets.append(hp.lam**0.5 * torch.stack(a))
        sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)[:, None]).solution[:, 0]
        expected_g[j] = sol[0]
        if with_beta:
            expected_b[j] = sol[1]
    moms = [
        NormMoments(m=(w[:, None] * z).sum(0) / w.sum(), e=(w[:, None] * z * z).sum(0) / w.sum())
        for z, w in zip(zs, ws)
    ]
    gamma, beta = solve_norm_affine(moms, gam_t, bet_t if with_beta else None, gam_m, gam_0,
                                    bet_m if with_beta else None, bet_0 if with_beta else None, hp)
    torch.testing.assert_close(gamma, expected_g, rtol=1e-8, atol=1e-10)
    if with_beta:
        torch.testing.assert_close(beta, expected_b, rtol=1e-8, atol=1e-10)
    else:
        assert beta is None


def test_weight_solve_ignores_padding_tokens():
    """Zero-weight tokens must not move the solution, whatever their values."""
    hp = Hyper(lam=0.05, rho=2.2, alpha=0.25, eps=1e-14)
    xs, xe, w = _task_data(0)
    wt = torch.randn(D_OUT, D_IN, dtype=torch.float64)
    w_m, w_0 = torch.randn(D_OUT, D_IN, dtype=torch.float64), torch.randn(D_OUT, D_IN, dtype=torch.float64)
    clean = solve_linear_weight([(_moments(xs, xe, w), wt)], w_m, w_0, hp).weight
    xs2, xe2 = xs.clone(), xe.clone()
    xs2[:10] = 1e3
    xe2[:10] = -1e3
    noisy = solve_linear_weight([(_moments(xs2, xe2, w), wt)], w_m, w_0, hp).weight
    torch.testing.assert_close(clean, noisy, rtol=1e-10, atol=1e-12)


def test_single_task_alpha_one_recovers_linear_expert():
    """T=1, α=1, λ→0 and x_e a linear image of x_s: the solve returns exactly W_t·M (the expert's map)."""
    hp = Hyper(lam=0.0, rho=2.2, alpha=1.0, eps=1e-12)
    xs, _, w = _task_data(3)
    m = torch.randn(D_IN, D_IN, dtype=torch.float64)
    xe = xs @ m.T
    wt = torch.randn(D_OUT, D_IN, dtype=torch.float64)
    got = solve_linear_weight([(_moments(xs, xe, w), wt)], wt * 0, wt * 0, hp).weight
    torch.testing.assert_close(got, wt @ m, rtol=1e-7, atol=1e-9)


def test_task_weights_and_trust_match_least_squares(problem):
    """Σ_t c_t/n_t·(E‖W x_s − W_t x_t‖² + μ E‖W x_s − W_m x_s‖²) + λ‖W − A(W)‖², and its bias counterpart."""
    hp, data, w_t, b_t, (w_m, w_0), (b_m, b_0) = problem
    hp = Hyper(lam=hp.lam, rho=hp.rho, alpha=hp.alpha, eps=hp.eps, trust=0.7)
    c_t = [0.5, 1.0, 2.5]
    rows, targets, bias_rows, bias_targets = [], [], [], []
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    for (xs, xe, w), wt, bt, ct in zip(data, w_t, b_t, c_t):
        c = (w / w.sum() * ct / _norm_of(xs, w)).sqrt()[:, None]
        xt = hp.alpha * xe + (1 - hp.alpha) * xs
        rows += [c * xs, hp.trust**0.5 * c * xs]
        targets += [c * (xt @ wt.T), hp.trust**0.5 * c * (xs @ w_m.T)]
        ones = torch.ones(N, 1, dtype=torch.float64)
        bias_rows += [c * ones, hp.trust**0.5 * c * ones]
        bias_targets += [c * (xt @ wt.T + bt - xs @ weight.T), hp.trust**0.5 * c * (xs @ (w_m - weight).T + b_m)]
    if hp.lam > 0:
        rows.append(hp.lam**0.5 * torch.eye(D_IN, dtype=torch.float64))
        targets.append(hp.lam**0.5 * anchor(w_m, w_0, hp.rho).T)
        bias_rows.append(torch.full((1, 1), hp.lam**0.5, dtype=torch.float64))
        bias_targets.append(hp.lam**0.5 * anchor(b_m, b_0, hp.rho)[None])
    moms = []
    for d, ct in zip(data, c_t):
        mom = _moments(*d)
        mom.weight = ct
        moms.append(mom)
    brute = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    torch.testing.assert_close(solve_linear_weight(zip(moms, w_t), w_m, w_0, hp).weight, brute, rtol=1e-8, atol=1e-9)
    brute_b = torch.linalg.lstsq(torch.cat(bias_rows), torch.cat(bias_targets)).solution[0]
    terms = [BiasTerm.of(m, wt, bt, hp.alpha) for m, wt, bt in zip(moms, w_t, b_t)]
    torch.testing.assert_close(solve_linear_bias(terms, weight, b_m, b_0, hp, merged_weight=w_m), brute_b,
                               rtol=1e-8, atol=1e-10)


def test_norm_task_weights_match_least_squares():
    hp = Hyper(lam=0.05, rho=2.2, alpha=0.25, eps=1e-14)
    d, c_t = 4, [0.3, 1.0, 3.0]
    g = torch.Generator().manual_seed(12)
    zs = [torch.randn(N, d, generator=g, dtype=torch.float64) + 0.2 for _ in range(T)]
    gam_t = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(T)]
    bet_t = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(T)]
    gam_m, gam_0, bet_m, bet_0 = (torch.randn(d, generator=g, dtype=torch.float64) for _ in range(4))
    moms = [NormMoments(m=z.mean(0), e=(z * z).mean(0), weight=ct) for z, ct in zip(zs, c_t)]
    gamma, beta = solve_norm_affine(moms, gam_t, bet_t, gam_m, gam_0, bet_m, bet_0, hp)
    for j in range(d):
        rows, targets = [], []
        for z, gt, bt, ct in zip(zs, gam_t, bet_t, c_t):
            c = (ct / N) ** 0.5
            rows.append(c * torch.stack([z[:, j], torch.ones(N, dtype=torch.float64)], 1))
            targets.append(c * (gt[j] * z[:, j] + bt[j]))
        rows.append(hp.lam**0.5 * torch.eye(2, dtype=torch.float64))
        targets.append(hp.lam**0.5 * torch.stack([anchor(gam_m, gam_0, hp.rho)[j], anchor(bet_m, bet_0, hp.rho)[j]]))
        sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)[:, None]).solution[:, 0]
        torch.testing.assert_close(torch.stack([gamma[j], beta[j]]), sol, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_anchor_is_scaled_interpolation_and_leaves_its_inputs(dtype):
    """The brute-force references above call anchor() themselves: its own formula is checked here, and a float64
    base (which .double() would not copy) must come back untouched."""
    g = torch.Generator().manual_seed(3)
    merged, base = torch.randn(5, 4, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)
    kept_m, kept_b = merged.clone(), base.clone()
    got = anchor(merged, base, 2.2, 0.05)
    want = 0.05 * (2.2 * merged.double() + (1 - 2.2) * base.double())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-16)
    assert torch.equal(merged, kept_m) and torch.equal(base, kept_b)
    torch.testing.assert_close(anchor(merged, base, 2.2), 2.2 * merged.double() - 1.2 * base.double(),
                               rtol=1e-14, atol=1e-16)


def test_unresolved_directions_and_numerical_rank_count_eigenvalues_below_the_gram_rounding(monkeypatch):
    """Against a Gram of known eigenvalues: while reg is below LIFTED·‖a‖_F, unresolved_directions counts those below
    UNRESOLVED·‖a‖_F, and numerical_rank those at or above it; a reg that is not that weak answers 0 with no
    eigendecomposition."""
    eigen = torch.tensor([2.0, 1.0, 1e-3, 5e-8, 1e-9, 0.0], dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    a = q @ torch.diag(eigen) @ q.T
    norm = float(eigen.norm())  # ‖a‖_F from the eigenvalues: 2.24
    assert int((eigen < UNRESOLVED * norm).sum()) == 3 and LIFTED * norm > 2e-6
    for reg in (1e-9, 2e-6):
        assert unresolved_directions(a, reg) == 3
    assert numerical_rank(a) == 3

    def refused(*args, **kwargs):
        raise AssertionError("an eigendecomposition where reg is not below LIFTED")

    monkeypatch.setattr(torch.linalg, "eigvalsh", refused)
    assert unresolved_directions(a, LIFTED * norm) == 0


def test_weight_solve_reports_directions_a_repeated_row_leaves_unresolved():
    """A task whose rows repeat two inputs (as a decoder's greedy targets repeating one token): at λ → 0 the solve
    reports the other d − 2 directions, at the default λ none (the ridge lifts them: no eigendecomposition)."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(2, D_IN, generator=g, dtype=torch.float64).repeat(50, 1)
    w = torch.ones(len(rows), dtype=torch.float64)
    wt = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    for lam, want in ((1e-9, D_IN - 2), (0.05, 0)):
        hp = Hyper(lam=lam, rho=1.0, alpha=1.0, eps=1e-8)
        assert solve_linear_weight([(_moments(rows, rows, w), wt)], wt, wt, hp).unresolved == want
