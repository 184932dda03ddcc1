"""featcal.head_refit: each task's head refitted to the calibrated features, towards the expert's logits, without
labels (featcal/head_refit.py). The closed form against torch.linalg.lstsq on the stacked augmented system, the
held-out λ choice against a loop over the grid, and the tiny BERT example end to end."""

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig

from featcal.adapters import adapter_for
from featcal.config import config_from_dict
from featcal.head_refit import held_out_folds, refit_head, solve_head
from flows.pipeline import run_pipeline
from storage.checkpoint import CheckpointError, read_metadata
from storage.rundir import RunDir
from tasks.boundary import stored_inputs
from tasks.context import RunContext
from tasks.evaluate import _task_model
from tasks.head_refit import heads_left, shared_head
from tests.conftest import example_config
from tests.llm_fixture import llm_config
from tests.t5_fixture import t5_config
from tests.test_zeroshot import NAMES, _head_less_config

N, D, C = 30, 6, 4


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64) + 0.5
    w_e, b_e = torch.randn(C, D, generator=g, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64)
    z = x @ (w_e + 0.3 * torch.randn(C, D, generator=g, dtype=torch.float64)).T + 0.1 * torch.randn(
        N, C, generator=g, dtype=torch.float64)
    return x, z, w_e, b_e


def _stacked(x, z, w_e, b_e, lam):
    """The objective as one least-squares problem: the data rows scaled by 1/√(n·n_c), then √λ·[I, 0] rows whose
    target is √λ·W_eᵀ (no row pulls the bias)."""
    bias = b_e is not None
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1) if bias else x
    n_c = float(torch.linalg.matrix_norm(xa.T @ xa / len(x)))
    scale = (len(x) * n_c) ** -0.5
    penalty = torch.cat([torch.eye(D, dtype=x.dtype), torch.zeros(D, int(bias), dtype=x.dtype)], 1)
    a = torch.cat([scale * xa, lam**0.5 * penalty])
    b = torch.cat([scale * z, lam**0.5 * w_e.T])
    theta = torch.linalg.lstsq(a, b).solution.T
    return theta[:, :D], (theta[:, D] if bias else None)


@pytest.mark.parametrize("lam", [1e-3, 0.1, 10.0])
@pytest.mark.parametrize("bias", [True, False])
def test_solve_head_equals_the_stacked_least_squares(problem, lam, bias):
    x, z, w_e, b_e = problem
    b_e = b_e if bias else None
    w, b = solve_head(x, z, w_e, b_e, lam)
    w_ref, b_ref = _stacked(x, z, w_e, b_e, lam)
    torch.testing.assert_close(w, w_ref, rtol=1e-9, atol=1e-10)
    if bias:
        torch.testing.assert_close(b, b_ref, rtol=1e-9, atol=1e-10)
    else:
        assert b is None


def test_solve_head_limits(problem):
    """λ large: the expert's weight, with the bias that centres the residual; λ small with n > d: the unpulled
    least-squares fit of the logits."""
    x, z, w_e, b_e = problem
    w, b = solve_head(x, z, w_e, b_e, 1e9)
    torch.testing.assert_close(w, w_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(b, (z - x @ w_e.T).mean(0), rtol=0, atol=1e-6)
    w, b = solve_head(x, z, w_e, b_e, 1e-12)
    xa = torch.cat([x, torch.ones(N, 1, dtype=x.dtype)], 1)
    free = torch.linalg.lstsq(xa, z).solution.T
    torch.testing.assert_close(w, free[:, :D], rtol=0, atol=1e-7)
    torch.testing.assert_close(b, free[:, D], rtol=0, atol=1e-7)


def test_folds_are_the_bodys_examples_with_their_views():
    folds = held_out_folds([r // 2 for r in range(16)], every=4, folds=2)  # 8 examples, one view each
    assert folds[0].nonzero().flatten().tolist() == [6, 7, 14, 15]  # examples 3 and 7
    assert folds[1].nonzero().flatten().tolist() == [4, 5, 12, 13]  # examples 2 and 6


def test_the_choice_is_the_grid_lambda_of_least_held_out_error(problem):
    x, z, w_e, b_e = problem
    z = z + 2.0 * torch.randn(N, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # noisy logits
    lams = [0.001, 0.01, 0.1, 1.0, 10.0]
    held = held_out_folds(range(N), 3, 2)
    fit = refit_head(x, z, w_e, b_e, lams, held)
    expected = []
    for lam in lams:  # brute force: each fold's fit by lstsq, scored on its held-out rows
        total = 0.0
        for h in held:
            w, b = _stacked(x[~h], z[~h], w_e, b_e, lam)
            total += float(((x[h] @ w.T + b - z[h]) ** 2).sum())
        expected.append(total)
    torch.testing.assert_close(torch.tensor(fit.scores), torch.tensor(expected), rtol=1e-8, atol=0)
    assert fit.lam == lams[min(range(len(lams)), key=expected.__getitem__)]
    assert fit.lam not in (lams[0], lams[-1])  # a real choice: the noisy logits want some pull, not all
    w, b = _stacked(x, z, w_e, b_e, fit.lam)  # the refit uses every row
    torch.testing.assert_close(fit.weight, w, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(fit.bias, b, rtol=1e-9, atol=1e-10)


def test_no_choice_without_rows_on_both_sides(problem):
    x, z, w_e, b_e = problem
    assert refit_head(x, z, w_e, b_e, [0.1, 2.0], held_out_folds([0] * N, 4, 1)).lam == 2.0  # nothing held out
    assert refit_head(x, z, w_e, b_e, [0.3], held_out_folds(range(N), 4, 1)).lam == 0.3


def _logit_errors(run_dir, task: str) -> tuple[float, int]:
    """On the task's calibration rows: the relative error of the calibrated task model's logits to the expert's,
    the model as the evaluate stage builds it (so with the refitted head when the run refits)."""
    ctx = RunContext(run_dir)
    expert, calibrated = _task_model(ctx, task, "expert"), _task_model(ctx, task, "calibrated")
    diff = ref = 0.0
    rows = 0
    with torch.inference_mode():
        for batch in stored_inputs(ctx, task):
            inputs = {n: v for n, v in batch.items() if n in ctx.adapter.model_input_names()}
            z, y = expert(**inputs).logits.double(), calibrated(**inputs).logits.double()
            diff, ref = diff + float(((y - z) ** 2).sum()), ref + float((z**2).sum())
            rows += len(z)
    return (diff / ref) ** 0.5, rows


def test_the_tiny_example_refit_brings_every_tasks_logits_closer_to_its_experts(tiny_example, tmp_path):
    """Same body (the block stages are cached across the two configs), the heads refitted: on every task's
    calibration rows the calibrated model's logits come closer to its expert's."""
    sections = {"evaluation": {"enabled": False}, "runtime": {"keep_activations": True}}
    run_dir = tmp_path / "run"
    run_pipeline(example_config(tiny_example, "bert", featcal__head_refit=False, **sections), run_dir)
    plain = {t: _logit_errors(run_dir, t)[0] for t in ("topic", "negation", "count")}
    body = load_file(run_dir / "calibrated" / "model.safetensors")
    run_pipeline(example_config(tiny_example, "bert", featcal__head_refit=True, **sections), run_dir, reuse=True)
    refit = {t: _logit_errors(run_dir, t) for t in ("topic", "negation", "count")}
    after = load_file(run_dir / "calibrated" / "model.safetensors")
    assert all(torch.equal(body[k], after[k]) for k in body)  # the body is untouched
    assert plain == pytest.approx({"topic": 0.7662, "negation": 0.9994, "count": 0.8257}, abs=2e-3)
    assert {t: e for t, (e, _) in refit.items()} == pytest.approx(
        {"topic": 0.4355, "negation": 0.7782, "count": 0.6146}, abs=2e-3)
    recorded = RunDir(run_dir).stage_records()["assemble"]["info"]["head_refit"]
    for t, (error, rows) in refit.items():
        assert rows == 64  # every calibration example is a row
        assert recorded[t]["rows"] == 64 and recorded[t]["lambda"] in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        assert recorded[t]["logit_error_before"] == pytest.approx(plain[t], abs=1e-4)  # the stage's own float64 figures
        assert recorded[t]["logit_error_after"] == pytest.approx(error, abs=1e-4)


def test_a_head_every_task_shares_is_left_and_said_so():
    """A decoder's LM head (merged with the body) and T5's have no per-task head to refit; BERT's classifier is one."""
    for config in (llm_config(64), t5_config()):
        why = shared_head(adapter_for(config))
        assert why is not None and "merged LM head, shared by all tasks; it is left as merged" in why
    assert shared_head(adapter_for(BertConfig(architectures=["BertForSequenceClassification"]))) is None


def test_zero_shot_class_embeddings_are_refitted_and_read_by_the_evaluation(tmp_path):
    """Head-less CLIP experts with zero-shot heads: the class embeddings (no bias) are the refitted weight, the rest of
    the head file (projection, scale, metadata) stays; the evaluate stage's calibrated model reads the refitted head,
    and its logits on the calibration rows are as close to the expert's as the assemble record says."""
    raw = _head_less_config(tmp_path, experts=2)
    raw["zero_shot"]["class_names"] = {task: NAMES[:4] for task in raw["experts"]}
    raw["evaluation"]["enabled"] = False
    raw["runtime"]["keep_activations"] = True
    raw["featcal"]["head_refit"] = True
    run_pipeline(config_from_dict(raw, tmp_path), tmp_path / "run")
    ctx, recorded = RunContext(tmp_path / "run"), RunDir(tmp_path / "run").stage_records()["assemble"]["info"]
    for task in ctx.tasks:
        merged, refit = (tmp_path / "run" / side / "heads" / f"{task}.safetensors" for side in ("merged", "calibrated"))
        before, after = load_file(merged), load_file(refit)
        assert read_metadata(refit) == read_metadata(merged)
        assert not torch.equal(after["class_embeddings"], before["class_embeddings"])
        assert all(torch.equal(after[k], before[k]) for k in before if k != "class_embeddings")
        info = recorded["head_refit"][task]
        assert info["logit_error_after"] < info["logit_error_before"]
        expert, calibrated = _task_model(ctx, task, "expert"), _task_model(ctx, task, "calibrated")
        diff = ref = 0.0
        with torch.inference_mode():
            for batch in stored_inputs(ctx, task):
                z, y = (m(pixel_values=batch["pixel_values"]).logits.double() for m in (expert, calibrated))
                diff, ref = diff + float(((y - z) ** 2).sum()), ref + float((z**2).sum())
        assert (diff / ref) ** 0.5 == pytest.approx(info["logit_error_after"], abs=1e-5)


def test_which_runs_refit_their_heads(tiny_example):
    """heads_left: None where the assemble stage refits (auto or true, one linear head a task, ≥ 64 examples); with
    auto, too few examples or a head that is not one linear layer leave every head, said in one line; with true that
    head is refused naming the expert; off says so; a shared LM head is left whatever is asked."""
    linear = ["bert.pooler.dense.weight", "classifier.weight", "classifier.bias"]
    nested = ["bert.pooler.dense.weight", "classifier.dense.weight", "classifier.out_proj.weight"]

    def left(names, examples=64, **featcal):
        cfg = example_config(tiny_example, "bert", calibration__examples_per_task=examples,
                             **{f"featcal__{k}": v for k, v in featcal.items()})
        return heads_left(cfg, adapter_for(BertConfig(architectures=["BertForSequenceClassification"])),
                          lambda task: linear if task != "negation" else names)

    assert left(linear) is None and left(linear, head_refit=True) is None and left(linear, examples=8,
                                                                                    head_refit=True) is None
    assert left(linear, examples=63) == (
        "featcal.head_refit auto: calibration.examples_per_task is 63, below 64, where a refitted head was measured "
        "to hurt; every task keeps its expert's head")
    assert left(nested) == (
        "featcal.head_refit auto: experts.negation has no linear head (no tensor classifier.weight; its classifier "
        "tensors are ['classifier.dense.weight', 'classifier.out_proj.weight']); every task keeps its expert's head")
    with pytest.raises(CheckpointError, match=r"^featcal.head_refit: experts.negation has no linear head to refit: "
                                              r"expected tensor classifier.weight"):
        left(nested, head_refit=True)
    assert left(linear, head_refit=False) == "featcal.head_refit is off"
    llm = example_config(tiny_example, "bert", featcal__head_refit=True)
    assert "merged LM head, shared by all tasks" in heads_left(llm, adapter_for(llm_config(64)), lambda _t: linear)


def test_auto_leaves_the_head_of_a_task_with_fewer_than_64_examples(tiny_example, tmp_path):
    """The default (auto) at 64 examples a task refits every head, except that of a task whose data held only 40 rows
    (fewer than examples_per_task asks): its calibrated head file is the merge's, bit for bit, and the record says
    why."""
    small = tmp_path / "topic40"
    # in memory: a filter's cache files would land in the shared example's data directory and change its fingerprint
    datasets.load_from_disk(str(tiny_example / "bert" / "data" / "topic")).filter(
        lambda _row, i: i < 40, with_indices=True, keep_in_memory=True).save_to_disk(str(small))
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False},
                         calibration__data__topic__path=str(small))
    assert cfg.featcal.head_refit == "auto" and cfg.calibration.examples_per_task == 64
    run_pipeline(cfg, tmp_path / "run")
    recorded = RunDir(tmp_path / "run").stage_records()["assemble"]["info"]["head_refit"]
    assert recorded["topic"] == {"left": "featcal.head_refit auto: topic has 40 calibration examples, below 64; it "
                                         "keeps its expert's head"}
    assert recorded["negation"]["rows"] == recorded["count"]["rows"] == 64
    heads = {side: load_file(tmp_path / "run" / side / "heads" / "topic.safetensors") for side in ("merged",
                                                                                                    "calibrated")}
    assert all(torch.equal(heads["merged"][k], heads["calibrated"][k]) for k in heads["merged"])
    negation = {side: load_file(tmp_path / "run" / side / "heads" / "negation.safetensors")["classifier.weight"]
                for side in ("merged", "calibrated")}
    assert not torch.equal(negation["merged"], negation["calibrated"])
