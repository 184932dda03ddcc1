"""LOT Merging (`featcal.method: lot`, arXiv 2505.23859) against its closed form computed the direct way: the
pseudoinverse of explicitly concatenated module inputs, on small random problems, and on the tiny example's run from
that run's own stored statistics."""

import pytest
import torch
from safetensors.torch import load_file

from featcal.calibration_methods import METHODS, ModuleData, StatisticsPlan, calibration_method
from featcal.config import ConfigError, FeatCalConfig, config_from_dict
from featcal_bench.runs import MethodRun, model_sections
from flows.pipeline import run_pipeline
from storage.checkpoint import CanonicalCheckpoint
from storage.rundir import RunDir
from tasks.context import context
from tasks.preflight import check_method_reads
from tests.conftest import example_config

D_IN, D_OUT = 6, 4


def _lot():
    return calibration_method(FeatCalConfig(method="lot"))


def test_lot_reads_no_key_and_the_experts_own_streams():
    """Nothing in the closed form is a knob; X_t is expert t's block on its own stream, as RegMean's."""
    method = _lot()
    assert type(method) is METHODS["lot"] and method.keys == () and dict(method.settings) == {}
    assert method.statistics == StatisticsPlan("expert", "expert", expert_side=False)
    assert not method.weighs_tasks and method.joins_readers


@pytest.mark.parametrize("key, value", [("trust", 0.5), ("task_weights", {"a": 2.0}), ("calibrate_head_side", True)])
def test_featcal_options_that_lot_would_ignore_are_refused_before_the_run(tmp_path, key, value):
    raw = {"base": "b", "experts": {"a": "ea"}, "calibration": {"data": {"a": {"path": "da"}}},
           "featcal": {"method": "lot", key: value}}
    with pytest.raises(ConfigError, match=f"^featcal.{key}: only with featcal.method featcal, not lot$"):
        check_method_reads(config_from_dict(raw, tmp_path))


def test_a_bench_run_of_lot_runs_the_pipeline_with_lot(tmp_path):
    sections = model_sections(tmp_path, ["a"], MethodRun("average", "lot", examples=16))
    assert sections["merge"]["method"] == "average" and sections["featcal"] == {"method": "lot", "head_refit": False}


def _inputs(seed: int, rows: tuple[int, ...], rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each task's module inputs x [n, D_IN] (spanning `rank` directions in all) and token weights (0: padding)."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randn(rank, D_IN, generator=g, dtype=torch.float64)
    out = []
    for n in rows:
        x = torch.randn(n, rank, generator=g, dtype=torch.float64) @ span
        w = torch.ones(n, dtype=torch.float64)
        w[-1] = 0.0  # one padding token per task: it must not count
        out.append((x, w))
    return out


def _linear_module(inputs, params) -> ModuleData:
    def sums(x, w):  # a statistics file's entries (RegMean's plan: no expert side)
        return {"ss": (x * w[:, None]).T @ x, "sum_s": (x * w[:, None]).sum(0), "sum_e": (x * w[:, None]).sum(0),
                "sum_w": w.sum()}

    return ModuleData(where="layer.0.fc", tasks=tuple(f"t{k}" for k in range(len(inputs))),
                      task_weights=(1.0,) * len(inputs), has_bias=True,
                      stats=lambda: iter([sums(x, w) for x, w in inputs]),
                      merged=lambda part: params[f"merged.{part}"], base=lambda part: params[f"base.{part}"],
                      expert=lambda t, part: params[f"e{t}.{part}"])


def _params(seed: int, tasks: int, shape_w: tuple[int, ...], shape_b: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{who}.{part}": torch.randn(*(shape_w if part == "weight" else shape_b), generator=g,
                                         dtype=torch.float64)
            for who in ("merged", "base", *(f"e{t}" for t in range(tasks))) for part in ("weight", "bias")}


@pytest.mark.parametrize("rows, rank", [((9, 14, 6), D_IN), ((3, 2, 2), D_IN), ((20, 30, 25), 4)],
                         ids=["full rank", "fewer tokens than inputs", "inputs in a subspace"])
def test_lot_linear_solve_is_the_pseudoinverse_closed_form(rows, rank):
    """T* = (Σ_t X_tᵀX_t)⁺ Σ_t X_tᵀX_t T_t, T_t = W_t − W0, from X = the tasks' real rows concatenated: the least-
    squares task vector of least norm, pinv(X)·Y with Y the rows' T_t-outputs stacked. Along input directions no row
    reaches, W is the base's; the bias keeps the merged value."""
    inputs = _inputs(3, rows, rank)
    p = _params(4, len(rows), (D_OUT, D_IN), (D_OUT,))
    solved = _lot().solve_linear(_linear_module(inputs, p))

    real = [x[w > 0] for x, w in inputs]
    x = torch.cat(real)
    w0 = p["base.weight"]
    tasks = [p[f"e{t}.weight"] - w0 for t in range(len(rows))]
    closed = torch.linalg.pinv(x.T @ x, hermitian=True) @ sum(r.T @ r @ t.T for r, t in zip(real, tasks, strict=True))
    least_norm = torch.linalg.pinv(x) @ torch.cat([r @ t.T for r, t in zip(real, tasks, strict=True)])
    torch.testing.assert_close(closed, least_norm, rtol=1e-9, atol=1e-11)  # the two direct forms agree
    torch.testing.assert_close(solved.tensors["weight"], w0 + closed.T, rtol=1e-9, atol=1e-11)
    assert set(solved.tensors) == {"weight"}  # the merged bias stays
    reached = min(sum(n - 1 for n in rows), rank)
    assert solved.report == {"pinv_rank": reached}
    if reached < D_IN:  # unseen directions: the task vector is 0 there, W = W0 along them
        null = torch.linalg.svd(x).Vh[reached:]
        assert float(((solved.tensors["weight"] - w0) @ null.T).abs().max()) < 1e-10
        assert float(((p["e0.weight"] - w0) @ null.T).abs().max()) > 0.1  # where the experts do differ from W0


def test_lot_weighs_tasks_by_their_tokens_and_one_task_gives_its_expert():
    """Sums, not means: a task whose rows are repeated counts more (RegMean's means would not move); one task with
    inputs of full rank gives back its own expert's weight exactly."""
    inputs = _inputs(5, (12, 15), D_IN)
    p = _params(6, 2, (D_OUT, D_IN), (D_OUT,))
    once = _lot().solve_linear(_linear_module(inputs, p)).tensors["weight"]
    (x0, w0), second = inputs
    twice = _lot().solve_linear(_linear_module([(x0.repeat(3, 1), w0.repeat(3)), second], p)).tensors["weight"]
    assert float((twice - once).abs().max()) > 1e-3
    single = _lot().solve_linear(_linear_module(inputs[:1], p))
    torch.testing.assert_close(single.tensors["weight"], p["e0.weight"], rtol=1e-8, atol=1e-10)
    assert single.report == {"pinv_rank": D_IN}


def test_a_task_of_padding_only_is_named_in_one_line():
    inputs = _inputs(9, (4, 5), D_IN)
    inputs[1][1].zero_()
    module = _linear_module(inputs, _params(10, 2, (D_OUT, D_IN), (D_OUT,)))
    with pytest.raises(ValueError, match=r"^module layer\.0\.fc: no token carries weight \(Σw = 0\.0\); is every token "
                                         r"padding\?$"):
        _lot().solve_linear(module)


@pytest.mark.parametrize("with_shift", [True, False], ids=["LayerNorm", "RMSNorm"])
def test_lot_norm_scale_is_the_pseudoinverse_closed_form(with_shift):
    """Per dimension j, γ_j = γ0_j + t*_j with t*_j the least-norm minimiser of Σ_t ‖z_t[:, j]·(γ_tj − γ0_j − t)‖²
    (pinv of the concatenated column): the tasks' scale task vectors averaged with the weights Σ z². A dimension no
    token reaches keeps γ0; the shift β (LayerNorm) keeps the merged value."""
    g = torch.Generator().manual_seed(7)
    d, rows = 5, (8, 11, 6)
    zs = [torch.randn(n, d, generator=g, dtype=torch.float64) * torch.rand(d, generator=g, dtype=torch.float64)
          for n in rows]
    for z in zs:
        z[:, 2] = 0.0  # a dimension nothing reaches
    weights = [torch.ones(n, dtype=torch.float64) for n in rows]
    weights[1][:3] = 0.0  # padding
    p = _params(8, len(rows), (d,), (d,))
    stats = [{"sum_z": (z * w[:, None]).sum(0), "sum_z2": (z * z * w[:, None]).sum(0), "sum_w": w.sum()}
             for z, w in zip(zs, weights, strict=True)]
    module = ModuleData(where="layer.0.norm", tasks=("t0", "t1", "t2"), task_weights=(1.0,) * 3,
                        has_bias=with_shift, stats=lambda: iter(stats), merged=lambda part: p[f"merged.{part}"],
                        base=lambda part: p[f"base.{part}"], expert=lambda t, part: p[f"e{t}.{part}"])
    solved = _lot().solve_norm(module)
    assert solved is not None and set(solved.tensors) == {"weight"}

    g0 = p["base.weight"]
    want = torch.empty(d, dtype=torch.float64)
    for j in range(d):
        col = torch.cat([z[w > 0, j] for z, w in zip(zs, weights, strict=True)])[:, None]
        target = torch.cat([z[w > 0, j] * (p[f"e{t}.weight"][j] - g0[j])
                            for t, (z, w) in enumerate(zip(zs, weights, strict=True))])
        want[j] = g0[j] + (torch.linalg.pinv(col) @ target)[0]
    torch.testing.assert_close(solved.tensors["weight"], want, rtol=1e-12, atol=1e-12)
    assert solved.tensors["weight"][2] == g0[2] and solved.tensors["weight"][2] != p["merged.weight"][2]


# ---- through the pipeline, on the tiny BERT example ----------------------------------------------------------
def _config(root, **sections):
    return example_config(root, "bert", merge={"method": "average"}, featcal={"method": "lot"},
                          evaluation={"enabled": False}, **sections)


def _sums(stats: dict[str, torch.Tensor], module: str, key: str) -> torch.Tensor:
    """`key` of `module` in one task's statistics file: its own sums, or those of the input it shares (q+k+v:ss)."""
    return next(v for k, v in stats.items() if module in k.rsplit(":", 1)[0].split("+") and k.endswith(f":{key}"))


LINEAR = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
          "intermediate.dense", "output.dense")
NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


def test_lot_run_solves_each_module_from_its_own_stored_statistics(tiny_example, tmp_path):
    """Block 1 of a three-expert run: every linear weight is W0 + (pinv(Σ_t S_t) Σ_t S_t T_tᵀ)ᵀ on the Grams S_t in
    the run's statistics files, every norm scale the Σz²-weighted average of the tasks' scale task vectors; biases,
    norm shifts and everything outside the blocks are the merge's (here the average), bit for bit."""
    cfg = _config(tiny_example, runtime={"keep_activations": True})  # the statistics files stay
    run_pipeline(cfg, tmp_path / "run")
    ctx, run = context(tmp_path / "run"), RunDir(tmp_path / "run")
    prefix = ctx.adapter.block_prefix(1)
    base = CanonicalCheckpoint(cfg.base, ctx.adapter).with_prefix(prefix)
    experts = [CanonicalCheckpoint(cfg.experts[t], ctx.adapter).with_prefix(prefix) for t in cfg.tasks]
    merged_all = CanonicalCheckpoint(tmp_path / "run" / "merged", ctx.adapter)
    merged = merged_all.with_prefix(prefix)
    solved = load_file(tmp_path / "run" / run.block(1))
    stats = [load_file(tmp_path / "run" / run.stats(t, 1)) for t in cfg.tasks]
    assert len(stats) == 3
    ranks = run.record("solve/l01")["info"]["pinv_rank"]
    for name in LINEAR:
        grams = [_sums(s, name, "ss") for s in stats]
        w0 = base.get(f"{name}.weight").double()
        a = sum(grams)
        b = sum(g @ (e.get(f"{name}.weight").double() - w0).T for g, e in zip(grams, experts, strict=True))
        want = w0 + (torch.linalg.pinv(a, hermitian=True) @ b).T
        got = solved[f"{name}.weight"].double()
        assert float((got - want).norm() / want.norm()) < 1e-6, name
        assert float((got - merged[f"{name}.weight"].double()).norm() / want.norm()) > 1e-3, name  # it moved
        assert ranks[name] == torch.linalg.matrix_rank(a, hermitian=True) == a.shape[0], name
        assert torch.equal(solved[f"{name}.bias"], merged[f"{name}.bias"]), name
    for name in NORMS:
        sq = [_sums(s, name, "sum_z2") for s in stats]
        g0 = base.get(f"{name}.weight").double()
        want = g0 + sum(s * (e.get(f"{name}.weight").double() - g0) for s, e in zip(sq, experts, strict=True)) / sum(sq)
        torch.testing.assert_close(solved[f"{name}.weight"].double(), want, rtol=1e-6, atol=1e-7)
        assert float((want - merged[f"{name}.weight"].double()).abs().max()) > 1e-4, name  # not the average
        assert torch.equal(solved[f"{name}.bias"], merged[f"{name}.bias"]), name
    calibrated = CanonicalCheckpoint(tmp_path / "run" / "calibrated", ctx.adapter)
    outside = [n for n in calibrated.names() if not n.startswith("encoder.layer.")]
    assert outside and all(torch.equal(calibrated.get(n), merged_all.get(n)) for n in outside)


def test_lot_of_one_expert_is_that_expert_wherever_its_inputs_reach(tiny_example, tmp_path):
    """One expert (the merge: its average, itself): every linear weight is the expert's along the directions its own
    inputs span and the base's along the rest (the task vector of least norm), so on those inputs every map is the
    expert's; norms and biases come back as the expert's."""
    full = example_config(tiny_example, "bert")
    task = full.tasks[0]
    cfg = _config(tiny_example, experts={task: full.experts[task]},
                  calibration__data={task: full.calibration.data[task].model_dump()},
                  runtime={"keep_activations": True})
    run_pipeline(cfg, tmp_path / "run")
    ctx, run = context(tmp_path / "run"), RunDir(tmp_path / "run")
    calibrated = CanonicalCheckpoint(tmp_path / "run" / "calibrated", ctx.adapter)
    expert = CanonicalCheckpoint(cfg.experts[task], ctx.adapter)
    base = CanonicalCheckpoint(cfg.base, ctx.adapter)
    partial = 0
    for layer in range(ctx.num_blocks):
        prefix, stats = ctx.adapter.block_prefix(layer), load_file(tmp_path / "run" / run.stats(task, layer))
        ranks = run.record(f"solve/l{layer:02d}")["info"]["pinv_rank"]
        for name in LINEAR:
            got, w1, w0 = (c.get(f"{prefix}{name}.weight").double() for c in (calibrated, expert, base))
            evals, v = torch.linalg.eigh(_sums(stats, name, "ss"))
            reached = evals > 1e-7 * float(evals.norm())
            assert int(reached.sum()) == ranks[name], name
            seen, unseen = v[:, reached], v[:, ~reached]
            assert float(((got - w1) @ seen).norm() / (w1 @ seen).norm()) < 1e-6, name
            assert float(((got - w0) @ unseen).norm()) < 1e-6 * float(w0.norm()), name
            partial += int(unseen.shape[1] > 0 and float(((w1 - w0) @ unseen).norm()) > 1e-3)
    assert partial > 0  # some map's inputs miss a direction along which the expert moved: LOT keeps the base there
    for name in calibrated.names():
        if name.startswith("encoder.layer.") and not name.endswith(tuple(f"{m}.weight" for m in LINEAR)):
            got, want = calibrated.get(name).double(), expert.get(name).double()
            assert float((got - want).norm() / want.norm()) < 1e-6, name
