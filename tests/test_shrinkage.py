"""featcal.shrinkage: each task's C_ss and C_st shrunk towards T_t (tr(C_ss)/d·I or diag(C_ss)), against a
brute-force least-squares solve of the shrunk objective and a brute-force held-out score of the (γ, λ, ρ) grid."""

import pytest
import torch
from pydantic import ValidationError

from featcal.closed_form import Hyper, LinearMoments, choose_linear_hyper, solve_linear_weight
from featcal.config import FeatCalConfig
from flows.pipeline import run_pipeline
from storage.atomic import digest
from storage.rundir import RunDir
from tests.conftest import example_config

D_IN, D_OUT, T = 7, 3, 3
LAMS, RHOS, GAMMAS = [0.01, 0.1, 1.0, 10.0], [1.0, 2.2], [0.0, 0.1, 0.3, 0.7, 1.0]


def _rows(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = torch.linspace(0.3, 2.0, D_IN, dtype=torch.float64)  # unequal variances: the two targets differ
    xs = (torch.randn(n, D_IN, generator=g, dtype=torch.float64) + 0.2) * scales
    return xs, xs + 0.4 * torch.randn(n, D_IN, generator=g, dtype=torch.float64)


def _moments(xs: torch.Tensor, xe: torch.Tensor) -> LinearMoments:
    n = xs.shape[0]
    return LinearMoments(c_ss=xs.T @ xs / n, c_se=xs.T @ xe / n, mu_s=xs.mean(0), mu_e=xe.mean(0))


def _target(xs: torch.Tensor, kind: str) -> torch.Tensor:
    """T_t from the rows, as a full matrix."""
    c = xs.T @ xs / xs.shape[0]
    return torch.eye(D_IN, dtype=torch.float64) * c.trace() / D_IN if kind == "identity" else torch.diag(c.diagonal())


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(5)
    fit = [_rows(g, 5) for _ in range(T)]  # 5 rows < 7 inputs: each C_ss is singular
    held = [_rows(g, 300) for _ in range(T)]
    w_t = [torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(T)]
    w_0 = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    return fit, held, w_t, w_0 + 0.3 * sum(w - w_0 for w in w_t), w_0


@pytest.mark.parametrize("kind", ["identity", "diagonal"])
@pytest.mark.parametrize("gamma,lam", [(0.3, 0.0), (1.0, 0.0), (0.3, 0.5)])
def test_shrunk_weight_matches_least_squares(problem, kind, gamma, lam):
    """Σ_t (1/n_t)[(1−γ) E‖W x_s − W_t x_t‖² + γ‖(W − W_t) T_t^½‖²] + λ‖W − A‖², stacked as rows and solved by lstsq:
    the γ part is what shrinking C_ss and C_st alike to T_t adds (with λ = 0 only the shrinkage makes it solvable)."""
    fit, _, w_t, w_m, w_0 = problem
    hp = Hyper(lam=lam, rho=2.2, alpha=0.25, eps=1e-14, shrink=gamma, shrink_target=kind)
    rows, targets = [], []
    for (xs, xe), wt in zip(fit, w_t):
        n_t = float(torch.linalg.matrix_norm(xs.T @ xs / xs.shape[0]))
        xt = hp.alpha * xe + (1 - hp.alpha) * xs
        c = ((1 - gamma) / xs.shape[0] / n_t) ** 0.5
        root = (gamma / n_t) ** 0.5 * _target(xs, kind).sqrt()  # diagonal: the elementwise root is the matrix root
        rows += [c * xs, root]
        targets += [c * (xt @ wt.T), root @ wt.T]
    if lam:
        rows.append(lam**0.5 * torch.eye(D_IN, dtype=torch.float64))
        targets.append(lam**0.5 * (hp.rho * w_m + (1 - hp.rho) * w_0).T)
    brute = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    got = solve_linear_weight([(_moments(*f), w) for f, w in zip(fit, w_t)], w_m, w_0, hp)
    torch.testing.assert_close(got.weight, brute, rtol=1e-8, atol=1e-9)


def test_zero_shrinkage_is_the_unshrunk_solve_bit_for_bit(problem):
    fit, held, w_t, w_m, w_0 = problem
    hp = Hyper(lam=0.1, rho=2.2, alpha=0.25, eps=1e-12)
    tasks = [(_moments(*f), w) for f, w in zip(fit, w_t)]
    # Wᵀ = (Σ C_ss/n + λI)⁻¹(Σ C_st W_tᵀ/n + λAᵀ), accumulated as before the option existed
    a = sum(m.c_ss / m.normaliser() for m, _ in tasks) + 0.1 * torch.eye(D_IN, dtype=torch.float64)
    assert torch.equal(solve_linear_weight(tasks, w_m, w_0, hp).weight,
                       solve_linear_weight(tasks, w_m, w_0, Hyper(0.1, 2.2, 0.25, 1e-12, shrink=0.0,
                                                                  shrink_target="diagonal")).weight)
    torch.testing.assert_close(solve_linear_weight(tasks, w_m, w_0, hp).weight.T, torch.linalg.solve(
        a, sum(m.add_target(torch.zeros(D_IN, D_OUT, dtype=torch.float64), 0.25, w) / m.normaliser()
               for m, w in tasks) + 0.1 * (2.2 * w_m - 1.2 * w_0).T), rtol=1e-9, atol=1e-10)
    split = [(_moments(*f), _moments(*h), w) for f, h, w in zip(fit, held, w_t)]
    plain = choose_linear_hyper(split, w_m, w_0, hp, LAMS, RHOS)
    assert torch.equal(plain.scores, choose_linear_hyper(split, w_m, w_0, hp, LAMS, RHOS, [0.0]).scores)


def _held_error(weight, held, w_t, alpha) -> float:
    """Σ_t (1/n_t) mean ‖W x_s − W_t x_t‖² over the held-out rows (never shrunk), from the rows."""
    total = 0.0
    for (xs, xe), wt in zip(held, w_t):
        n_t = float(torch.linalg.matrix_norm(xs.T @ xs / xs.shape[0]))
        total += float(((xs @ weight.T - (alpha * xe + (1 - alpha) * xs) @ wt.T) ** 2).sum(1).mean()) / n_t
    return total


@pytest.mark.parametrize("kind", ["identity", "diagonal"])
def test_joint_choice_scores_equal_brute_force_up_to_a_constant(problem, kind):
    fit, held, w_t, w_m, w_0 = problem
    hp = Hyper(lam=0.0, rho=0.0, alpha=0.25, eps=1e-12, shrink_target=kind)
    split = [(_moments(*f), _moments(*h), w) for f, h, w in zip(fit, held, w_t)]
    choice = choose_linear_hyper(split, w_m, w_0, hp, LAMS, RHOS, GAMMAS)
    fits = [(_moments(*f), w) for f, w in zip(fit, w_t)]
    brute = torch.tensor([[[_held_error(solve_linear_weight(fits, w_m, w_0, Hyper(
        lam, rho, hp.alpha, hp.eps, shrink=gamma, shrink_target=kind)).weight, held, w_t, hp.alpha)
        for rho in RHOS] for lam in LAMS] for gamma in GAMMAS], dtype=torch.float64)
    offset = brute - choice.scores  # the targets' own energy, the same at every grid point
    torch.testing.assert_close(offset, torch.full_like(offset, float(offset.reshape(-1)[0])), rtol=0, atol=1e-9)
    best = int(brute.argmin())
    k, rest = divmod(best, len(LAMS) * len(RHOS))
    assert (choice.shrink, choice.lam, choice.rho) == (GAMMAS[k], LAMS[rest // len(RHOS)], RHOS[rest % len(RHOS)])
    assert choice.shrink > 0  # 5 rows in 7 dimensions: the held-out rows ask for shrinkage (else the test is weak)


@pytest.mark.parametrize("field,value,expected", [
    ("shrinkage", 1.5, "must be in [0, 1] or 'auto', got 1.5"),
    ("shrinkage_grid", [0.0, -0.1], "every value must be in [0, 1], got [0.0, -0.1]"),
    ("shrinkage_target", "eye", "'identity' or 'diagonal'"),
])
def test_bad_shrinkage_settings_are_named(field, value, expected):
    with pytest.raises(ValidationError, match=field) as err:
        FeatCalConfig.model_validate({field: value})
    assert expected in str(err.value)


def test_auto_shrinkage_in_a_run_chooses_from_the_grid_and_a_zero_grid_is_the_plain_run(tiny_example, tmp_path):
    off = {"evaluation": {"enabled": False}}
    run_pipeline(example_config(tiny_example, "bert", featcal={"lambda": "auto"}, **off), tmp_path / "plain")
    run_pipeline(example_config(tiny_example, "bert", featcal={"lambda": "auto", "shrinkage": "auto",
                                                               "shrinkage_grid": [0.0]}, **off), tmp_path / "zero")
    cfg = example_config(tiny_example, "bert", featcal={"lambda": "auto", "shrinkage": "auto",
                                                        "shrinkage_target": "diagonal"}, **off)
    run_pipeline(cfg, tmp_path / "auto")
    rel = "calibrated/model.safetensors"
    assert digest(tmp_path / "plain" / rel) == digest(tmp_path / "zero" / rel)
    info = RunDir(tmp_path / "auto").record("solve/l01")["info"]
    assert set(info["shrinkage"].values()) <= set(cfg.featcal.shrinkage_grid)
    assert "attention.self.query" in info["shrinkage"] and "output.LayerNorm" not in info["shrinkage"]
    assert "shrinkage" not in RunDir(tmp_path / "plain").record("solve/l01")["info"]
