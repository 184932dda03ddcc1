"""The solve's options beyond the paper: λ and ρ chosen on held-out calibration rows (featcal.lambda / rho: auto),
per-task weights from drift and a trust weight, in a real run."""

import pytest
import torch

from featcal.closed_form import (
    Hyper,
    LinearMoments,
    NormMoments,
    choose_linear_hyper,
    choose_norm_hyper,
    cross_validated,
    solve_linear_weight,
    solve_norm_affine,
)
from featcal.config import FeatCalConfig
from flows.pipeline import run_pipeline
from storage.atomic import digest
from storage.rundir import RunDir
from tests.conftest import example_config

D_IN, D_OUT, T = 5, 3, 3
LAMS, RHOS = [0.01, 0.1, 1.0, 10.0, 100.0, 1000.0], [1.0, 2.2, 3.0]


def _rows(g: torch.Generator, n: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    xs = torch.randn(n, D_IN, generator=g, dtype=torch.float64) + 0.2
    return xs, xs + noise * torch.randn(n, D_IN, generator=g, dtype=torch.float64)


def _moments(xs: torch.Tensor, xe: torch.Tensor) -> LinearMoments:
    n = xs.shape[0]
    return LinearMoments(c_ss=xs.T @ xs / n, c_se=xs.T @ xe / n, mu_s=xs.mean(0), mu_e=xe.mean(0))


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(3)
    fit = [_rows(g, 12, 0.5) for _ in range(T)]  # few rows: a finite λ should generalise best
    held = [_rows(g, 400, 0.5) for _ in range(T)]
    w_t = [torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(T)]
    w_0 = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    w_m = w_0 + 0.3 * sum(w - w_0 for w in w_t)
    return fit, held, w_t, w_m, w_0, Hyper(lam=0.0, rho=0.0, alpha=0.25, eps=1e-12)


def _held_error(weight, held, w_t, hp) -> float:
    """Σ_t (1/n_t) mean ‖W x_s − W_t x_t‖² over the held-out rows, x_t = α x_e + (1−α) x_s, from the rows."""
    total = 0.0
    for (xs, xe), wt in zip(held, w_t):
        n_t = float(torch.linalg.matrix_norm(xs.T @ xs / xs.shape[0]))
        xt = hp.alpha * xe + (1 - hp.alpha) * xs
        total += float(((xs @ weight.T - xt @ wt.T) ** 2).sum(1).mean()) / n_t
    return total


def test_linear_choice_scores_equal_brute_force_up_to_a_constant(problem):
    fit, held, w_t, w_m, w_0, hp = problem
    tasks = [(_moments(*f), _moments(*h), w) for f, h, w in zip(fit, held, w_t)]
    choice = choose_linear_hyper(tasks, w_m, w_0, hp, LAMS, RHOS)
    brute = torch.tensor([[_held_error(solve_linear_weight(
        [(_moments(*f), w) for f, w in zip(fit, w_t)], w_m, w_0, Hyper(lam, rho, hp.alpha, hp.eps)).weight,
        held, w_t, hp) for rho in RHOS] for lam in LAMS], dtype=torch.float64)
    offset = brute - choice.scores[0]  # the targets' own energy, the same at every grid point
    torch.testing.assert_close(offset, torch.full_like(offset, float(offset[0, 0])), rtol=0, atol=1e-9)
    best = int(brute.argmin())
    assert (choice.lam, choice.rho) == (LAMS[best // len(RHOS)], RHOS[best % len(RHOS)])
    assert choice.lam not in (LAMS[0], LAMS[-1])  # 12 noisy rows: neither end of the grid (else the test is weak)


def test_held_out_rows_like_the_fit_rows_choose_the_weakest_anchor(problem):
    fit, _, w_t, w_m, w_0, hp = problem
    tasks = [(_moments(*f), _moments(*f), w) for f, w in zip(fit, w_t)]
    assert choose_linear_hyper(tasks, w_m, w_0, hp, LAMS, RHOS).lam == LAMS[0]


def test_anchor_that_is_the_common_optimum_is_chosen(problem):
    """Every expert equals ρ*·W_m + (1−ρ*)·W_0 and α = 1 with x_e = x_s: at ρ = ρ* every λ reproduces the experts
    exactly, so the held-out error is 0 there and ρ* must be chosen."""
    fit, held, _, w_m, w_0, hp = problem
    target = 3.0 * w_m - 2.0 * w_0
    same = [(_moments(xs, xs), _moments(hs, hs), target) for (xs, _), (hs, _) in zip(fit, held)]
    choice = choose_linear_hyper(same, w_m, w_0, Hyper(0.0, 0.0, alpha=1.0, eps=1e-12), LAMS, RHOS)
    assert choice.rho == 3.0


def test_norm_choice_scores_equal_brute_force_up_to_a_constant():
    g = torch.Generator().manual_seed(4)
    k = 6
    z_fit = [torch.randn(10, k, generator=g, dtype=torch.float64) + 0.5 for _ in range(T)]
    z_held = [torch.randn(300, k, generator=g, dtype=torch.float64) + 0.5 for _ in range(T)]
    gam = [1 + 0.3 * torch.randn(k, generator=g, dtype=torch.float64) for _ in range(T)]
    bet = [0.3 * torch.randn(k, generator=g, dtype=torch.float64) for _ in range(T)]
    gm, g0, bm, b0 = (torch.randn(k, generator=g, dtype=torch.float64) for _ in range(4))
    moms = lambda zs: [NormMoments(m=z.mean(0), e=(z**2).mean(0)) for z in zs]  # noqa: E731
    hp = Hyper(0.0, 0.0, alpha=0.25, eps=1e-12)
    choice = choose_norm_hyper(moms(z_fit), moms(z_held), gam, bet, gm, g0, bm, b0, hp, LAMS, RHOS)
    brute = torch.empty(len(LAMS), len(RHOS), dtype=torch.float64)
    for i, lam in enumerate(LAMS):
        for j, rho in enumerate(RHOS):
            gamma, beta = solve_norm_affine(moms(z_fit), gam, bet, gm, g0, bm, b0, Hyper(lam, rho, 0.25, 1e-12))
            brute[i, j] = sum(float(((z * gamma + beta - z * gt - bt) ** 2).sum(1).mean())
                              for z, gt, bt in zip(z_held, gam, bet))
    torch.testing.assert_close(choice.scores[0], brute, rtol=1e-10, atol=1e-10)  # [γ, λ, ρ], one γ
    best = int(brute.argmin())
    assert (choice.lam, choice.rho) == (LAMS[best // len(RHOS)], RHOS[best % len(RHOS)])


def test_auto_with_a_one_point_grid_is_the_fixed_run(tiny_example, tmp_path):
    """The refit uses every row, as a fixed-λ run does: with one grid point the weights are the same bits, and every
    solved module's choice is in the solve record."""
    common = {"evaluation": {"enabled": False}}
    fixed = example_config(tiny_example, "bert", featcal={"lambda": 0.1, "rho": 2.2}, **common)
    auto = example_config(tiny_example, "bert", featcal={"lambda": "auto", "rho": "auto", "lambda_grid": [0.1],
                                                         "rho_grid": [2.2]}, **common)
    run_pipeline(fixed, tmp_path / "fixed")
    run_pipeline(auto, tmp_path / "auto")
    rel = "calibrated/model.safetensors"
    assert digest(tmp_path / "fixed" / rel) == digest(tmp_path / "auto" / rel)
    info = RunDir(tmp_path / "auto").record("solve/l00")["info"]
    assert info["modules"] > 0 and set(info["lambda"]) >= {"attention.self.query", "output.LayerNorm"}
    assert set(info["lambda"].values()) == {0.1} and set(info["rho"].values()) == {2.2}
    assert "lambda" not in RunDir(tmp_path / "fixed").record("solve/l00")["info"]


def test_auto_chooses_from_the_grid_and_says_so(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert", featcal={"lambda": "auto"}, evaluation={"enabled": False})
    run_pipeline(cfg, tmp_path / "run")
    info = RunDir(tmp_path / "run").record("solve/l01")["info"]
    assert set(info["lambda"].values()) <= set(cfg.featcal.lambda_grid)
    assert set(info["rho"].values()) == {cfg.featcal.rho}


def test_too_few_examples_to_hold_out_are_named(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": 4},
                         calibration__examples_per_task=3, evaluation={"enabled": False})
    with pytest.raises(ValueError, match=r"no held-out calibration rows .*examples_per_task must be >= "
                                         r"featcal.holdout_every"):
        run_pipeline(cfg, tmp_path / "run")


def test_task_weights_follow_drift_and_trust_moves_the_weights(tiny_example, tmp_path):
    base = example_config(tiny_example, "bert", evaluation={"enabled": False})
    run_pipeline(base, tmp_path / "plain")
    weighted = example_config(tiny_example, "bert", featcal={"task_weight_power": 1.0, "trust": 0.5},
                              evaluation={"enabled": False})
    run_pipeline(weighted, tmp_path / "weighted")
    run = RunDir(tmp_path / "weighted")
    weights = run.record("solve/l01")["info"]["task_weights"]
    drift = {t: run.record(f"gram/l01/{t}")["info"]["drift_out_uncalibrated"] for t in weighted.tasks}
    assert sum(weights.values()) == pytest.approx(len(weights))
    assert sorted(weights, key=weights.get) == sorted(drift, key=drift.get) and len(set(weights.values())) > 1
    rel = "calibrated/model.safetensors"
    assert digest(tmp_path / "plain" / rel) != digest(tmp_path / "weighted" / rel)
    # featcal.task_weights multiplies the drift weights: one task named, the others keep theirs (block 0, whose
    # drift no earlier solve changes)
    raised, first = base.tasks[0], run.record("solve/l00")["info"]["task_weights"]
    given = example_config(tiny_example, "bert", featcal={"task_weight_power": 1.0, "trust": 0.5,
                                                          "task_weights": {raised: 4.0}}, evaluation={"enabled": False})
    run_pipeline(given, tmp_path / "given")
    times = RunDir(tmp_path / "given").record("solve/l00")["info"]["task_weights"]
    assert times == pytest.approx({t: w * (4.0 if t == raised else 1.0) for t, w in first.items()}, rel=1e-12)
    assert digest(tmp_path / "given" / rel) != digest(tmp_path / "weighted" / rel)


def test_task_weights_name_experts_and_are_positive(tiny_example):
    with pytest.raises(ValueError, match=r"featcal.task_weights names task\(s\) \['nope'\] that are not in experts"):
        example_config(tiny_example, "bert", featcal={"task_weights": {"nope": 2.0}})
    with pytest.raises(ValueError, match=r"every weight must be > 0"):
        example_config(tiny_example, "bert", featcal={"task_weights": {"x": 0.0}})


def test_mixed_precision_solve_keeps_the_weights_and_records_each_modules_path(tiny_example, tmp_path):
    """runtime.solve_precision: mixed gives the float64 run's weights within 1e-6 relative, and the solve record
    names each linear module's path; a float64 run's record has no such entry."""
    from safetensors.torch import load_file

    exact = example_config(tiny_example, "bert", evaluation={"enabled": False})
    mixed = example_config(tiny_example, "bert", runtime__solve_precision="mixed", evaluation={"enabled": False})
    run_pipeline(exact, tmp_path / "exact")
    run_pipeline(mixed, tmp_path / "mixed")
    rel = "calibrated/model.safetensors"
    a, b = load_file(tmp_path / "exact" / rel), load_file(tmp_path / "mixed" / rel)
    assert a.keys() == b.keys()
    for name in a:
        gap = float((a[name].double() - b[name].double()).norm() / a[name].double().norm().clamp_min(1e-300))
        assert gap <= 1e-6, name
    info = RunDir(tmp_path / "mixed").record("solve/l00")["info"]
    assert "attention.self.query" in info["solve_path"] and "output.LayerNorm" not in info["solve_path"]
    assert all(p.startswith(("mixed, ", "float64: ")) for p in info["solve_path"].values())
    assert "solve_path" not in RunDir(tmp_path / "exact").record("solve/l00")["info"]


@pytest.fixture
def folded():
    """Three folds of 5 rows a task: each fold's choice from the sums, and the brute-force held-out error of each fold
    at every grid point (the weight solved from the other folds' rows, scored on the fold's) [fold, λ, ρ]."""
    g = torch.Generator().manual_seed(5)
    w_t = [torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(T)]
    w_0 = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    w_m = w_0 + 0.3 * sum(w - w_0 for w in w_t)
    hp = Hyper(lam=0.0, rho=0.0, alpha=0.25, eps=1e-12)
    folds = 3
    rows = [_rows(g, 15, 0.5) for _ in range(T)]  # 5 rows a fold and task
    parts = [[(xs[k::folds], xe[k::folds]) for xs, xe in rows] for k in range(folds)]

    def rest(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(torch.cat([parts[j][t][side] for j in range(folds) if j != k]) for side in (0, 1))
                for t in range(T)]

    choices = [choose_linear_hyper([(_moments(*f), _moments(*h), w) for f, h, w in zip(rest(k), parts[k], w_t)],
                                   w_m, w_0, hp, LAMS, RHOS) for k in range(folds)]
    brute = torch.tensor([[[_held_error(solve_linear_weight(
        [(_moments(*f), w) for f, w in zip(rest(k), w_t)], w_m, w_0, Hyper(lam, rho, hp.alpha, hp.eps)).weight,
        parts[k], w_t, hp) for rho in RHOS] for lam in LAMS] for k in range(folds)], dtype=torch.float64)
    return choices, brute


def test_cross_validated_scores_equal_brute_force_summed_over_folds(folded):
    """featcal.holdout_folds: each fold of rows held out in turn, the weight fitted on the others at every grid
    point and scored on the fold; the summed scores match that brute force up to one constant, and rank the grid
    as it does."""
    choices, brute = folded
    choice = cross_validated(choices, LAMS, RHOS, [0.0])
    offset = brute.sum(0) - choice.scores[0]
    torch.testing.assert_close(offset, torch.full_like(offset, float(offset[0, 0])), rtol=0, atol=1e-9)
    best = int(brute.sum(0).argmin())
    assert (choice.lam, choice.rho) == (LAMS[best // len(RHOS)], RHOS[best % len(RHOS)])
    # the folds disagree, so the sum decides (else the test is weak); one fold alone is that fold's own choice
    assert len({(c.lam, c.rho) for c in choices}) > 1 and choice.lam not in (LAMS[0], LAMS[-1])
    alone = cross_validated(choices[:1], LAMS, RHOS, [0.0])
    assert (alone.lam, alone.rho) == (choices[0].lam, choices[0].rho) and torch.equal(alone.scores, choices[0].scores)


def test_one_standard_error_rule_equals_its_brute_force(folded):
    """featcal.lambda_choice one_standard_error: from the brute-force fold errors, the largest λ (at the best point's
    ρ) whose mean excess over the best point is at most the standard error of that excess over the folds."""
    choices, brute = folded
    lowest = cross_validated(choices, LAMS, RHOS, [0.0])
    rule = cross_validated(choices, LAMS, RHOS, [0.0], one_standard_error=True)
    i, j = LAMS.index(lowest.lam), RHOS.index(lowest.rho)
    excess = brute[:, :, j] - brute[:, i:i + 1, j]
    kept = [lam for m, lam in enumerate(LAMS) if lam >= lowest.lam
            and float(excess[:, m].mean()) <= float(excess[:, m].std()) / 3 ** 0.5]
    assert (rule.lam, rule.rho) == (max(kept), lowest.rho)
    assert rule.lam > lowest.lam  # the rule moves λ here: the test can fail
    with pytest.raises(
        ValueError, match=r"lambda_choice one_standard_error needs the folds' spread: holdout_folds >= 2"
    ):
        FeatCalConfig.model_validate({"lambda": "auto", "lambda_choice": "one_standard_error"})


def test_folds_partition_the_examples_and_the_first_is_the_single_held_out_fold(tiny_example, tmp_path):
    """With holdout_folds = holdout_every every example's rows are in exactly one fold (the folds' sums add up to
    the all-row sums), and fold 0 is the held-out fold of a one-fold run, bit for bit."""
    from safetensors.torch import load_file

    off = {"evaluation": {"enabled": False}, "runtime": {"keep_activations": True}}  # the statistics files stay
    run_pipeline(example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": 3}, **off),
                 tmp_path / "one")
    cfg = example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": 3, "holdout_folds": 3},
                         **off)
    run_pipeline(cfg, tmp_path / "cv")
    task = cfg.tasks[0]
    rel = RunDir(tmp_path / "cv").stats(task, 0)  # block 0: no earlier solve, whose choice may differ, moved its input
    one, cv = load_file(tmp_path / "one" / rel), load_file(tmp_path / "cv" / rel)
    plain = [k for k in cv if ":held" not in k]
    assert plain and {k for k in one if ":held_" in k} == {k for k in cv if ":held_" in k}
    for key in plain:
        reader, name = key.rsplit(":", 1)
        folds = [cv[f"{reader}:{prefix}{name}"] for prefix in ("held_", "held1_", "held2_")]
        assert all(float(f.abs().sum()) > 0 for f in folds), key  # every fold holds rows
        # fp32 within a chunk: sums in another grouping differ by ~1e-6; a lost or doubled example by a third
        torch.testing.assert_close(sum(folds), cv[key], rtol=1e-5, atol=1e-5 * float(cv[key].abs().max()))
        assert torch.equal(cv[f"{reader}:held_{name}"], one[f"{reader}:held_{name}"])
    info = RunDir(tmp_path / "cv").record("solve/l01")["info"]
    assert set(info["lambda"].values()) <= set(cfg.featcal.lambda_grid)
    # one_standard_error on the same statistics: block 0 (same inputs) takes λ at least the lowest score's
    run_pipeline(example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": 3, "holdout_folds": 3,
                                                               "lambda_choice": "one_standard_error"}, **off),
                 tmp_path / "se")
    lowest, se = (RunDir(tmp_path / r).record("solve/l00")["info"]["lambda"] for r in ("cv", "se"))
    assert lowest.keys() == se.keys() and all(se[m] >= lowest[m] for m in lowest)


def test_more_folds_than_holdout_every_are_refused():
    with pytest.raises(ValueError, match=r"holdout_folds \(5\) must be <= holdout_every \(4\)"):
        FeatCalConfig.model_validate({"holdout_folds": 5})
