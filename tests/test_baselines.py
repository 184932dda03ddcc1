"""Baselines: RegMean / RegMean++ as pipeline methods, evaluation of a subset of models, Representation Surgery
(and ProbSurgery on the same tiny BERT; its unit tests are in tests/test_probsurgery.py)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from featcal.closed_form import solve_regmean_weight
from featcal.config import ConfigError, config_from_dict
from featcal.modeling import task_model
from featcal_bench.probsurgery import ProbSurgeryAdapter
from featcal_bench.surgery import (
    SurgeryAdapter,
    SurgeryClassifier,
    features,
    fit_adapters,
    surgery_classifier,
    train_surgery,
)
from flows.pipeline import run_pipeline
from storage.checkpoint import CanonicalCheckpoint
from storage.rundir import RunDir
from tasks.boundary import stored_inputs
from tasks.context import context
from tests.conftest import example_config

D_IN, D_OUT = 7, 5


# ---- the RegMean closed form ---------------------------------------------------------------------
def _task(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, D_IN, generator=g, dtype=torch.float64)
         @ torch.randn(D_IN, D_IN, generator=g, dtype=torch.float64))
    w = (torch.rand(n, generator=g) > 0.2).double()  # 0 = padding
    return x, w, torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)


def _mean_gram(x, w):
    return (x * w[:, None]).T @ x / w.sum()


@pytest.mark.parametrize("a", [1.0, 0.95, 0.6])
def test_regmean_weight_matches_least_squares(a):
    """min Σ_t a/n_t·‖X_t(Wᵀ − W_tᵀ)‖² + (1−a)·‖diag(G_t)^½(Wᵀ − W_tᵀ)‖², whose normal equations are RegMean's."""
    tasks = [_task(s, n) for s, n in ((0, 40), (1, 300), (2, 90))]
    rows, targets = [], []
    for x, w, w_t in tasks:
        real = x[w > 0]
        scaled = (a / len(real)) ** 0.5 * real
        diag = torch.diag(((1 - a) * _mean_gram(x, w).diagonal()).sqrt())
        rows += [scaled, diag]
        targets += [scaled @ w_t.T, diag @ w_t.T]
    brute = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    got = solve_regmean_weight(((_mean_gram(x, w), w_t) for x, w, w_t in tasks), a, eps=1e-14)
    torch.testing.assert_close(got.weight, brute, rtol=1e-9, atol=1e-11)
    assert got.damping == 1e-14


def test_regmean_single_task_returns_its_weight_and_tasks_weigh_equally():
    x, w, w_t = _task(3, 50)
    got = solve_regmean_weight([(_mean_gram(x, w), w_t)], 0.95, eps=1e-14).weight
    torch.testing.assert_close(got, w_t, rtol=1e-10, atol=1e-12)
    # Means, not sums: repeating one task's tokens five times changes nothing.
    tasks = [_task(4, 30), _task(5, 60)]
    once = solve_regmean_weight(((_mean_gram(x, w), wt) for x, w, wt in tasks), 0.95, eps=1e-14).weight
    (x0, w0, wt0), rest = tasks[0], tasks[1]
    repeated = [(x0.repeat(5, 1), w0.repeat(5), wt0), rest]
    again = solve_regmean_weight(((_mean_gram(x, w), wt) for x, w, wt in repeated), 0.95, eps=1e-14).weight
    torch.testing.assert_close(again, once, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="off_diagonal must be in"):
        solve_regmean_weight([(_mean_gram(x, w), w_t)], 0.0, eps=1e-8)


@pytest.mark.parametrize("changes, field", [
    ({"featcal": {"regmean_off_diagonal": 0.0}}, "featcal.regmean_off_diagonal"),
    ({"featcal": {"method": "fisher"}}, "featcal.method"),
    ({"evaluation": {"models": ["calibrated", "teacher"]}}, "evaluation.models"),
    ({"evaluation": {"models": ["calibrated", "calibrated"]}}, "evaluation.models"),
    ({"evaluation": {"models": []}}, "evaluation.models"),
])
def test_new_config_fields_are_checked(tmp_path, changes, field):
    raw = {"base": "b", "experts": {"a": "ea"}, "calibration": {"data": {"a": {"path": "da"}}}, **changes}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict(raw, tmp_path)
    defaults = config_from_dict({k: v for k, v in raw.items() if k not in changes}, tmp_path)
    assert defaults.featcal.method == "featcal" and defaults.featcal.regmean_off_diagonal == 0.95
    assert defaults.evaluation.models == ["base", "merged", "calibrated", "expert"]


# ---- RegMean / RegMean++ through the pipeline ----------------------------------------------------
def _config(root, method, **sections):
    return example_config(root, "bert", merge={"method": "average"}, featcal={"method": method},
                          evaluation__models=["merged", "calibrated"], evaluation__max_examples=48, **sections)


@pytest.fixture(scope="module")
def regmean_runs(tiny_example, tmp_path_factory):
    runs = {}
    for method in ("regmean", "regmean_plus_plus"):
        cfg = _config(tiny_example, method, runtime={"keep_activations": True})  # the checks read the model inputs
        run_dir = tmp_path_factory.mktemp(method)
        run_pipeline(cfg, run_dir)
        runs[method] = cfg, run_dir
    return runs


def _linear_reference(cfg, run_dir, layer: int, stream: str) -> dict[str, torch.Tensor]:
    """RegMean weights of block `layer` by a stacked least-squares solve on module inputs captured in the
    full HF models: expert t's block on its own hidden states (regmean) or on the calibrated model's (++)."""
    ctx = context(run_dir)
    a = cfg.featcal.regmean_off_diagonal
    rows: dict[str, list[torch.Tensor]] = {}
    targets: dict[str, list[torch.Tensor]] = {}
    for task in cfg.tasks:
        expert = task_model(cfg.experts[task])
        feeder = expert if stream == "expert" else task_model(
            cfg.experts[task], CanonicalCheckpoint(run_dir / "calibrated", ctx.adapter))
        block = copy.deepcopy(expert.bert.encoder.layer[layer])  # hooked alone: the feeder may be the expert
        linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
        hooks = [m.register_forward_pre_hook(
                     lambda _, args, n=n, seen=seen: seen[n].append(args[0].reshape(-1, args[0].shape[-1])))
                 for n, m in linears.items()]
        real = []
        for batch in stored_inputs(ctx, task):
            inputs = {k: v for k, v in batch.items() if k in ctx.adapter.model_input_names()}
            with torch.inference_mode():
                hidden = feeder(**inputs, output_hidden_states=True).hidden_states[layer]
                ctx.adapter.run_block(block, hidden, ctx.adapter.block_input(inputs))
            real.append(inputs["attention_mask"].reshape(-1).bool())
        for h in hooks:
            h.remove()
        keep = torch.cat(real)
        for n, m in linears.items():
            x = torch.cat(seen[n])[keep].double()
            scaled = (a / len(x)) ** 0.5 * x
            diag = torch.diag(((1 - a) * (x * x).mean(0)).sqrt())
            w_t = m.weight.detach().double()
            rows.setdefault(n, []).extend([scaled, diag])
            targets.setdefault(n, []).extend([scaled @ w_t.T, diag @ w_t.T])
    return {n: torch.linalg.lstsq(torch.cat(rows[n]), torch.cat(targets[n])).solution.T for n in rows}


@pytest.mark.parametrize("method, stream", [("regmean", "expert"), ("regmean_plus_plus", "merged")])
def test_regmean_block_matches_brute_force(regmean_runs, method, stream):
    cfg, run_dir = regmean_runs[method]
    solved = load_file(run_dir / "blocks" / "l01.safetensors")
    reference = _linear_reference(cfg, run_dir, 1, stream)
    assert len(reference) == 6  # q, k, v, attention output, intermediate, output
    for name, ref in reference.items():
        got = solved[f"{name}.weight"].double()
        assert float((got - ref).norm() / ref.norm()) < 1e-4, name
    # Everything else is the merged checkpoint's (here: the average), bit for bit.
    merged = CanonicalCheckpoint(run_dir / "merged", context(run_dir).adapter).with_prefix("encoder.layer.1.")
    others = [k for k in solved if k.removesuffix(".weight") not in reference]
    assert others and all(torch.equal(solved[k], merged[k]) for k in others)


def test_regmean_and_plus_plus_differ_and_report_subset(regmean_runs):
    blocks = {m: load_file(run_dir / "blocks" / "l01.safetensors") for m, (_, run_dir) in regmean_runs.items()}
    name = "intermediate.dense.weight"
    assert not torch.allclose(blocks["regmean"][name], blocks["regmean_plus_plus"][name], atol=1e-4)
    cfg, run_dir = regmean_runs["regmean"]
    assert RunDir(run_dir).record("solve/l00")["info"]["damping_grown"] == {}
    report = json.loads((run_dir / "report.json").read_text())
    assert report["method"] == "regmean" and report["models"] == ["merged", "calibrated"]
    for scores in report["tasks"].values():
        assert set(scores["accuracy"]) == {"merged", "calibrated"} and scores["examples"] == 48
        assert set(scores["drift"]) == {"merged", "calibrated"}
    assert set(report["summary"]["average_accuracy"]) == {"merged", "calibrated"}
    assert "gap_closed" not in report["summary"] and "normalized_accuracy" not in report["summary"]
    md = (run_dir / "report.md").read_text()
    assert md.startswith("# RegMean report") and "| task | merged | calibrated | examples |" in md


def test_evaluating_only_the_calibrated_model_reruns_only_evaluate(regmean_runs):
    cfg, run_dir = regmean_runs["regmean"]
    run = RunDir(run_dir)
    before = {s: run.record(s)["key"] for s in ("solve/l02", "assemble", "evaluate")}
    only = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"models": ["calibrated"]})})
    run_pipeline(only, run_dir, reuse=True)  # another evaluation config: the directory is taken over knowingly
    after = {s: run.record(s)["key"] for s in before}
    assert after["solve/l02"] == before["solve/l02"] and after["assemble"] == before["assemble"]
    assert after["evaluate"] != before["evaluate"]
    report = json.loads((run_dir / "report.json").read_text())
    for scores in report["tasks"].values():
        # The expert still ran, as the drift reference, but its accuracy is not reported.
        assert set(scores["accuracy"]) == {"calibrated"} and set(scores["drift"]) == {"calibrated"}
        assert len(scores["drift"]["calibrated"]) == context(run_dir).num_blocks + 1
    assert "| task | calibrated | examples |" in (run_dir / "report.md").read_text()
    assert (run_dir / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_regmean_plus_plus_single_expert_returns_the_expert(tiny_example, tmp_path):
    """One expert, merged = the expert: every solve must land on the expert's own weights."""
    full = example_config(tiny_example, "bert")
    task = full.tasks[0]
    cfg = _config(tiny_example, "regmean_plus_plus", experts={task: full.experts[task]},
                  calibration__data={task: full.calibration.data[task].model_dump()}, evaluation={"enabled": False})
    run_pipeline(cfg, tmp_path / "run")
    adapter = context(tmp_path / "run").adapter
    calibrated = CanonicalCheckpoint(tmp_path / "run" / "calibrated", adapter)
    expert = CanonicalCheckpoint(cfg.experts[task], adapter)
    linear = [n for n in calibrated.names() if n.startswith("encoder.layer.") and n.endswith("weight")
              and calibrated.get(n).dim() == 2]
    assert len(linear) == 6 * context(tmp_path / "run").num_blocks
    for name in linear:
        got, want = calibrated.get(name).double(), expert.get(name).double()
        assert float((got - want).norm() / want.norm()) < 1e-4, name


# ---- Representation Surgery ----------------------------------------------------------------------
def _distorted(seed: int = 0):
    """Targets that are a known rank-4 ReLU distortion of the input: the adapter's own form."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(256, 32, generator=g)
    up, down = torch.randn(32, 4, generator=g) * 0.5, torch.randn(4, 32, generator=g) / 32**0.5
    return z, z - torch.relu(z @ down.T) @ up.T


def test_surgery_adapter_starts_as_identity():
    adapter = SurgeryAdapter(32, 16, torch.Generator().manual_seed(0))
    z = torch.randn(8, 32)
    assert torch.equal(adapter(z), z)
    assert torch.count_nonzero(adapter.up.weight) == 0
    bound = 1 / 32**0.5  # nn.Linear's own init: kaiming_uniform(a=√5) = U(−1/√fan_in, 1/√fan_in)
    assert 0.8 * bound < float(adapter.down.weight.detach().abs().max()) <= bound


def test_surgery_training_removes_a_low_rank_distortion(torch_on_one_thread, caplog):
    z, target = _distorted()
    with caplog.at_level("INFO", logger="featcal"):
        fit = fit_adapters({"x": z.__getitem__}, {"x": target}, seed=0)  # original protocol: 1000 steps, Adam 1e-3
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("surgery: step")]
    assert len(progress) == 19 and progress[0].startswith("surgery: step 50/1000, elapsed ")  # a line per 50 steps
    with torch.no_grad():
        before, after = float(F.l1_loss(z, target)), float(F.l1_loss(fit["x"](z), target))
    assert before == pytest.approx(0.4725, abs=1e-4)
    assert after < before / 20, (before, after)
    again = fit_adapters({"x": z.__getitem__}, {"x": target}, seed=0)["x"]
    other = fit_adapters({"x": z.__getitem__}, {"x": target}, seed=1)["x"]
    assert all(torch.equal(p, q) for p, q in zip(fit["x"].parameters(), again.parameters()))
    assert not torch.equal(fit["x"].down.weight, other.down.weight)


def test_surgery_on_tiny_bert(regmean_runs, torch_on_one_thread):
    cfg, run_dir = regmean_runs["regmean"]
    ctx = context(run_dir)
    names = ctx.adapter.model_input_names()
    batches = {t: [{k: v for k, v in b.items() if k in names} for b in stored_inputs(ctx, t)] for t in cfg.tasks}
    states = {cache: train_surgery(run_dir / "merged", cfg.experts, batches, steps=40, seed=0, cache_features=cache)
              for cache in (False, True)}
    for t in cfg.tasks:
        assert set(states[False][t]) == {"down.weight", "up.weight"}
        assert states[False][t]["down.weight"].shape == (16, 64)
        for k, v in states[False][t].items():
            torch.testing.assert_close(states[True][t][k], v, rtol=1e-3, atol=1e-4)
    task = cfg.tasks[0]
    merged = task_model(cfg.experts[task], CanonicalCheckpoint(run_dir / "merged", ctx.adapter))
    expert = task_model(cfg.experts[task])
    batch = batches[task][0]
    with torch.no_grad():
        # At init the adapter is the identity: the merged task model's own logits.
        start = SurgeryClassifier(merged, SurgeryAdapter(64, 16).eval())
        torch.testing.assert_close(start(**batch), merged(**batch).logits)
        trained = surgery_classifier(run_dir / "merged", cfg.experts[task], states[False][task])
        z, z_t = features(merged, batch), features(expert, batch)
        assert float(F.l1_loss(trained.adapter(z), z_t)) < 0.9 * float(F.l1_loss(z, z_t))
        logits = trained(**batch)
    assert logits.shape == (batch["input_ids"].shape[0], expert.config.num_labels)
    # ProbSurgery through the same loop and features: its own state, its mean path in the evaluation model.
    prob = train_surgery(run_dir / "merged", cfg.experts, batches, method="probsurgery", steps=40, seed=0,
                         cache_features=True)
    assert {k: tuple(v.shape) for k, v in prob[task].items()} == {
        "down.weight": (128, 64), "mean.weight": (64, 128), "log_var.weight": (64, 128)}
    with torch.no_grad():
        trained = surgery_classifier(run_dir / "merged", cfg.experts[task], prob[task], method="probsurgery")
        assert isinstance(trained.adapter, ProbSurgeryAdapter)
        assert float(F.l1_loss(trained.adapter(z), z_t)) < 0.9 * float(F.l1_loss(z, z_t))
        assert trained(**batch).shape == logits.shape
