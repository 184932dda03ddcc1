"""The calibration-method registry (featcal/calibration_methods.py): every method declares the keys it reads and
the statistics it needs, the config accepts exactly the registered names, and a method's module solve is its
objective's least-squares solution when called the way the solve stage calls it."""

from dataclasses import replace

import pytest
import torch

from featcal.calibration_methods import (
    CONFIG_KEYS,
    CONFIG_METHODS,
    METHODS,
    CalibrationMethod,
    ModuleData,
    StatisticsPlan,
    calibration_method,
    register,
)
from featcal.config import ConfigError, FeatCalConfig, config_from_dict
from featcal.statistics import HELD

D_IN, D_OUT, N, T = 5, 3, 120, 2
RAW = {"base": "b", "experts": {"a": "ea"}, "calibration": {"data": {"a": {"path": "da"}}}}


def _featcal(**keys) -> FeatCalConfig:
    return FeatCalConfig.model_validate(keys)


def test_the_config_accepts_exactly_the_registered_methods(tmp_path):
    assert sorted(METHODS) == sorted(CONFIG_METHODS) == ["featcal", "lot", "regmean", "regmean_plus_plus"]
    with pytest.raises(ConfigError) as err:
        config_from_dict({**RAW, "featcal": {"method": "fisher"}}, tmp_path)
    assert str(err.value) == ("featcal.method: Input should be 'featcal', 'regmean', 'regmean_plus_plus' or 'lot' "
                              "(got 'fisher', from config)")


def test_an_unknown_method_is_named_with_the_known_ones():
    """A FeatCalConfig built without validation (the only way past the config's own check)."""
    with pytest.raises(ValueError) as err:
        calibration_method(FeatCalConfig.model_construct(method="fisher"))
    assert (
        str(err.value)
        == "featcal.method: unknown calibration method 'fisher'; known: featcal, lot, regmean, regmean_plus_plus"
    )


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_method_declares_its_keys_and_statistics(name):
    method = calibration_method(_featcal(method=name))
    assert set(method.keys) <= CONFIG_KEYS and (method.keys or name == "lot")  # LOT's closed form has no knob
    assert dict(method.settings) == {k: FeatCalConfig().model_dump(by_alias=True)[k] for k in method.keys}
    assert isinstance(method.statistics, StatisticsPlan)


def test_statistics_plans():
    plans = {name: calibration_method(_featcal(method=name)).statistics for name in METHODS}
    assert plans["featcal"] == StatisticsPlan("merged", "merged", expert_side=True, pooled_token_weight=0.01,
                                              rows=True)
    assert plans["regmean"] == StatisticsPlan("expert", "expert", expert_side=False)
    assert plans["regmean_plus_plus"] == StatisticsPlan("expert", "merged", expert_side=False)
    assert plans["lot"] == plans["regmean"]
    # Held-out rows only where the method chooses λ / ρ on them: FeatCal with either on auto.
    assert calibration_method(_featcal(rho="auto", holdout_every=3)).statistics.held_out_every == 3
    assert calibration_method(_featcal(method="regmean", **{"lambda": "auto"})).statistics.held_out_every is None
    # Rows only where the solve's objective is the plain one that the row form solves.
    for changed in ({"rho": "auto"}, {"trust": 0.1}, {"shrinkage": 0.1}, {"head_metric": 0.5}):
        assert not calibration_method(_featcal(**changed)).statistics.rows, changed
    with pytest.raises(ValueError, match="^StatisticsPlan: the merged block runs on the merged stream only"):
        StatisticsPlan("merged", "expert", expert_side=True)


def test_keys_of_another_method_are_accepted_and_never_reach_it(tmp_path):
    """As before the registry: RegMean validates FeatCal's keys (the YAML may hold them) and ignores them; it is
    handed only regmean_off_diagonal and eps. (calibrate_head_side with RegMean is refused by preflight:
    tests/test_head_side.py.)"""
    cfg = config_from_dict({**RAW, "featcal": {"method": "regmean", "lambda": 0.7, "alpha": 0.9, "trust": 0.5,
                                               "calibrate_norm": False, "regmean_off_diagonal": 0.6}}, tmp_path)
    method = calibration_method(cfg.featcal)
    assert dict(method.settings) == {"regmean_off_diagonal": 0.6, "eps": 1e-8}
    with pytest.raises(KeyError):
        method.settings["lambda"]
    assert not method.weighs_tasks and calibration_method(_featcal()).weighs_tasks


def test_registering_a_name_or_key_the_config_lacks_is_refused():
    class Fisher(CalibrationMethod):
        name, keys = "fisher", ("eps",)

    class Typo(CalibrationMethod):
        name, keys = "regmean", ("eps", "lamda")

    with pytest.raises(ValueError, match=r"^calibration method 'fisher': featcal.method does not accept it"):
        register(Fisher)
    with pytest.raises(ValueError, match=r"^calibration method 'regmean' reads \['lamda'\], which are not featcal"):
        register(Typo)
    assert METHODS["regmean"].__name__ == "RegMean" and "fisher" not in METHODS


# ---- a module solve, called as the solve stage calls it ----------------------------------------------------
def _sums(xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor, held: torch.Tensor) -> dict[str, torch.Tensor]:
    """A linear module's statistics file entries for one task (full form C_se), held-out rows' sums as well."""
    def of(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        ww, s, e = w * rows, xs, xe
        return {"ss": (s * ww[:, None]).T @ s, "se": (s * ww[:, None]).T @ e, "sum_s": (ww[:, None] * s).sum(0),
                "sum_e": (ww[:, None] * e).sum(0), "sum_w": ww.sum()}

    return {**of(torch.ones(N, dtype=torch.float64)), **{HELD + k: v for k, v in of(held).items()}}


@pytest.fixture
def linear():
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(T):
        xs = torch.randn(N, D_IN, generator=g, dtype=torch.float64) + 0.2
        rows.append((xs, xs + 0.3 * torch.randn(N, D_IN, generator=g, dtype=torch.float64),
                     torch.rand(N, generator=g, dtype=torch.float64)))
    held = (torch.arange(N) % 4 == 3).double()
    tensors = {f"{who}.{part}": torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) if part == "weight"
               else torch.randn(D_OUT, generator=g, dtype=torch.float64)
               for who in ("merged", "base", "e0", "e1") for part in ("weight", "bias")}
    data = ModuleData(where="layer.0.fc", tasks=("t0", "t1"), task_weights=(1.0, 1.0), has_bias=True,
                      stats=lambda: iter([_sums(*r, held) for r in rows]),
                      merged=lambda part: tensors[f"merged.{part}"], base=lambda part: tensors[f"base.{part}"],
                      expert=lambda t, part: tensors[f"e{t}.{part}"])
    return data, rows, tensors


def test_featcal_module_solve_is_its_least_squares_solution(linear):
    """W minimises Σ_t (1/n_t)·E_w‖W x_s − W_t x_t‖² + λ‖W − A(W)‖², x_t = α x_e + (1−α) x_s, n_t = ‖C_ss‖_F; the
    bias is b = [Σ_t (b_t + W_t μ_t − W μ_s)/n_t + λ A(b)] / (Σ_t 1/n_t + λ)."""
    data, rows, p = linear
    lam, rho, alpha = 0.3, 2.2, 0.25
    solved = calibration_method(_featcal(**{"lambda": lam, "rho": rho, "alpha": alpha, "eps": 1e-14})).solve_linear(
        data
    )
    a_w = rho * p["merged.weight"] + (1 - rho) * p["base.weight"]
    a_b = rho * p["merged.bias"] + (1 - rho) * p["base.bias"]
    lhs, rhs, num, den = [], [], lam * a_b, lam
    for t, (xs, xe, w) in enumerate(rows):
        n_t = float(torch.linalg.matrix_norm((xs * w[:, None]).T @ xs / w.sum()))
        c = (w / w.sum() / n_t).sqrt()[:, None]
        lhs.append(c * xs)
        rhs.append(c * ((alpha * xe + (1 - alpha) * xs) @ p[f"e{t}.weight"].T))
    lhs.append(lam ** 0.5 * torch.eye(D_IN, dtype=torch.float64))
    rhs.append(lam ** 0.5 * a_w.T)
    brute = torch.linalg.lstsq(torch.cat(lhs), torch.cat(rhs)).solution.T
    torch.testing.assert_close(solved.tensors["weight"], brute, rtol=1e-9, atol=1e-10)
    for t, (xs, xe, w) in enumerate(rows):
        n_t = float(torch.linalg.matrix_norm((xs * w[:, None]).T @ xs / w.sum()))
        mu_s, mu_t = (w[:, None] * xs).sum(0) / w.sum(), (w[:, None] * (alpha * xe + (1 - alpha) * xs)).sum(0) / w.sum()
        num = num + (p[f"e{t}.bias"] + p[f"e{t}.weight"] @ mu_t - brute @ mu_s) / n_t
        den += 1 / n_t
    torch.testing.assert_close(solved.tensors["bias"], num / den, rtol=1e-9, atol=1e-10)
    assert solved.damping == 1e-14 and solved.eps == 1e-14 and solved.report == {}


def test_featcal_choice_on_a_one_point_grid_is_the_fixed_solve_and_is_reported(linear):
    data = linear[0]
    fixed = calibration_method(_featcal(**{"lambda": 0.3})).solve_linear(data)
    chosen = calibration_method(_featcal(**{"lambda": "auto", "lambda_grid": [0.3], "rho": "auto",
                                            "rho_grid": [2.2]})).solve_linear(data)
    assert all(torch.equal(fixed.tensors[k], chosen.tensors[k]) for k in ("weight", "bias"))
    assert chosen.report == {"lambda": 0.3, "rho": 2.2}
    no_bias = calibration_method(_featcal(calibrate_bias=False)).solve_linear(data)
    assert set(no_bias.tensors) == {"weight"}  # the merged bias stays


@pytest.mark.parametrize("off_diagonal", [1.0, 0.6])
def test_regmean_module_solve_is_its_least_squares_solution(linear, off_diagonal):
    """Wᵀ = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ with G_t each task's weighted per-token mean Gram, G̃ = aG + (1−a)diag(G) (at
    a = 1 the minimiser of Σ_t E_w‖W x − W_t x‖²); the bias and every norm keep the merged values."""
    data, rows, p = linear
    method = calibration_method(_featcal(method="regmean", regmean_off_diagonal=off_diagonal, eps=1e-14))
    solved = method.solve_linear(data)
    grams = [(xs * w[:, None]).T @ xs / w.sum() for xs, _, w in rows]  # per-token weighted means
    shrunk = [off_diagonal * g + (1 - off_diagonal) * torch.diag(g.diagonal()) for g in grams]
    lhs = sum(shrunk)
    rhs = sum(g @ p[f"e{t}.weight"].T for t, g in enumerate(shrunk))
    torch.testing.assert_close(solved.tensors["weight"], torch.linalg.solve(lhs, rhs).T, rtol=1e-9, atol=1e-10)
    assert set(solved.tensors) == {"weight"} and method.solve_norm(data) is None
    assert calibration_method(_featcal(calibrate_norm=False)).solve_norm(data) is None


# ---- runtime.solve_precision: mixed ---------------------------------------------------------------------------
def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def _narrow_module(d_in: int, d_out: int, seed: int) -> tuple[ModuleData, dict[str, torch.Tensor]]:
    """A linear module whose statistics are fresh at every stats() call (the solve divides them in place)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(T):
        xs = torch.randn(N, d_in, generator=g, dtype=torch.float64) + 0.2
        rows.append((xs, xs + 0.3 * torch.randn(N, d_in, generator=g, dtype=torch.float64),
                     torch.rand(N, generator=g, dtype=torch.float64)))
    tensors = {f"{who}.{part}": torch.randn(d_out, d_in, generator=g, dtype=torch.float64) if part == "weight"
               else torch.randn(d_out, generator=g, dtype=torch.float64)
               for who in ("merged", "base", "e0", "e1") for part in ("weight", "bias")}
    data = ModuleData(where="layer.0.fc", tasks=("t0", "t1"), task_weights=(1.0, 1.0), has_bias=True,
                      stats=lambda: iter([_sums(*r, r[2]) for r in rows]),
                      merged=lambda part: tensors[f"merged.{part}"], base=lambda part: tensors[f"base.{part}"],
                      expert=lambda t, part: tensors[f"e{t}.{part}"])
    return data, tensors


def test_featcal_mixed_solve_refines_to_the_float64_weights_and_says_so():
    """λ = 0.01 relative to the normalised Gram: well conditioned, so fp32 + refinement reaches float64; one
    right-hand side for 96 unknowns, narrow enough for the mixed path to be taken."""
    data, _ = _narrow_module(96, 1, seed=6)
    fc = _featcal(**{"lambda": 0.01, "rho": 2.2, "eps": 1e-14})
    exact = calibration_method(fc).solve_linear(data)
    mixed = calibration_method(fc, "mixed").solve_linear(data)
    assert _relative(mixed.tensors["weight"], exact.tensors["weight"]) < 1e-9
    assert _relative(mixed.tensors["bias"], exact.tensors["bias"]) < 1e-9
    assert mixed.report["solve_path"] in {f"mixed, {n} steps" for n in range(1, 5)} and "solve_path" not in exact.report


def test_featcal_mixed_solve_of_a_wide_right_hand_side_is_the_float64_solve_and_says_why(linear):
    """3 right-hand sides for 5 unknowns: float64 residuals would cost more than the fp32 factor saves, so the
    module is solved in float64, bit for bit, and the record says why."""
    data = linear[0]
    fc = _featcal(**{"lambda": 0.01, "rho": 2.2, "eps": 1e-14})
    exact = calibration_method(fc).solve_linear(data)
    mixed = calibration_method(fc, "mixed").solve_linear(data)
    assert torch.equal(mixed.tensors["weight"], exact.tensors["weight"])
    assert torch.equal(mixed.tensors["bias"], exact.tensors["bias"])
    assert mixed.report["solve_path"] == ("float64: 3 right-hand sides for 5 unknowns, too many for the fp32 factor "
                                          "to pay for the float64 residuals")


def test_featcal_solve_reads_fresh_statistics_each_time_and_matches_the_brute_force_solution():
    """The solve divides the sums it is handed in place: two solves of the same module agree bit for bit, and the
    weight is the normal equations' solution built from the rows themselves."""
    data, p = _narrow_module(6, 4, seed=8)
    hp = {"lambda": 0.05, "rho": 2.2, "alpha": 0.25, "eps": 1e-14}
    method = calibration_method(_featcal(**hp))
    first, second = method.solve_linear(data), method.solve_linear(data)
    assert torch.equal(first.tensors["weight"], second.tensors["weight"])
    lhs = torch.zeros(6, 6, dtype=torch.float64)
    rhs = hp["lambda"] * (hp["rho"] * p["merged.weight"] + (1 - hp["rho"]) * p["base.weight"]).T
    for t, sums in enumerate(data.stats()):
        c_ss, c_se = sums["ss"] / sums["sum_w"], sums["se"] / sums["sum_w"]
        n_t = float(torch.linalg.matrix_norm(c_ss))
        lhs += c_ss / n_t
        rhs += (hp["alpha"] * c_se + (1 - hp["alpha"]) * c_ss) @ p[f"e{t}.weight"].T / n_t
    want = torch.linalg.solve(lhs + (hp["lambda"] + hp["eps"]) * torch.eye(6, dtype=torch.float64), rhs).T
    torch.testing.assert_close(first.tensors["weight"], want, rtol=1e-10, atol=1e-12)


def test_regmean_mixed_solve_falls_back_to_float64_on_a_nearly_singular_gram():
    """ε-only regularisation and two inputs that are almost the same feature: fp32 cannot solve it, float64 does."""
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(N, D_IN, generator=g, dtype=torch.float64)
    xs[:, 4] = xs[:, 3] + 1e-6 * torch.randn(N, generator=g, dtype=torch.float64)
    w = torch.ones(N, dtype=torch.float64)
    experts = [torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(T)]
    data = ModuleData(where="layer.0.fc", tasks=("t0", "t1"), task_weights=(1.0, 1.0), has_bias=False,
                      stats=lambda: iter([_sums(xs, xs, w, w) for _ in range(T)]),
                      merged=lambda part: experts[0], base=lambda part: experts[0],
                      expert=lambda t, part: experts[t])
    fc = _featcal(method="regmean", regmean_off_diagonal=1.0, eps=1e-14)  # a < 1 would add a diagonal
    exact = calibration_method(fc).solve_linear(data)
    mixed = calibration_method(fc, "mixed").solve_linear(data)
    assert mixed.report["solve_path"].startswith("float64: ")
    assert torch.equal(mixed.tensors["weight"], exact.tensors["weight"]) and mixed.damping == exact.damping


def test_solve_precision_is_checked_with_a_one_line_error(tmp_path):
    assert (
        config_from_dict({**RAW, "runtime": {"solve_precision": "mixed"}}, tmp_path).runtime.solve_precision == "mixed"
    )
    assert config_from_dict(RAW, tmp_path).runtime.solve_precision == "float64"
    with pytest.raises(ConfigError) as err:
        config_from_dict({**RAW, "runtime": {"solve_precision": "fp16"}}, tmp_path)
    assert str(err.value) == "runtime.solve_precision: Input should be 'float64' or 'mixed' (got 'fp16', from config)"


@pytest.mark.parametrize("keys", [{}, {"lambda": "auto"}], ids=["fixed λ", "λ auto"])
def test_a_module_solve_holds_one_task_statistics_at_a_time(linear, keys):
    """A solve streams the tasks' d × d sums (fc2's C_ss is 72 MiB a task on ViT-B/32): when a task's statistics are
    read, nothing may still hold the previous task's (not the loop variables, not zip's reused result tuple)."""
    import weakref

    data, rows, _ = linear
    held = (torch.arange(N) % 4 == 3).double()
    alive: list[bool] = []

    def stats():
        before = None
        for r in rows:
            alive.append(before is not None and before() is not None)
            sums = _sums(*r, held)
            before = weakref.ref(sums["ss"])
            yield sums
            del sums

    solved = calibration_method(_featcal(**keys)).solve_linear(replace(data, stats=stats))
    assert len(alive) >= T and not any(alive) and torch.isfinite(solved.tensors["weight"]).all()
