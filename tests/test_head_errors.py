"""A task's head-space error (issue 33 §1): KL to the expert's prediction and agreement with it, no labels read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from featcal.evaluation import TaskScores, head_error_sums
from tasks.context import context
from tasks.evaluate import head_errors


def test_head_error_sums_match_brute_force():
    g = torch.Generator().manual_seed(0)
    expert, model = torch.randn(9, 4, generator=g), torch.randn(9, 4, generator=g)
    model[0] = expert[0] + 3.0  # a shifted row: same distribution, KL 0, same top class
    kl, agree = head_error_sums(expert, model)
    want_kl, want_agree = 0.0, 0
    for e, m in zip(expert.tolist(), model.tolist(), strict=True):
        ze, zm = sum(math.exp(v) for v in e), sum(math.exp(v) for v in m)
        p, q = [math.exp(v) / ze for v in e], [math.exp(v) / zm for v in m]
        want_kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
        want_agree += int(max(range(4), key=e.__getitem__) == max(range(4), key=m.__getitem__))
    assert kl == pytest.approx(want_kl, rel=1e-12) and agree == want_agree
    assert head_error_sums(expert[:1], model[:1]) == (pytest.approx(0.0, abs=1e-12), 1)


def test_task_scores_keep_head_errors_per_model():
    g = torch.Generator().manual_seed(1)
    scores = TaskScores()
    batches = [(torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)) for _ in range(2)]
    for expert, model in batches:
        scores.add_head_errors("merged", expert, model)
    summary = scores.summary()
    sums = [head_error_sums(e, m) for e, m in batches]
    assert summary["expert_agreement"] == {"merged": sum(a for _, a in sums) / 10}
    assert summary["expert_kl"]["merged"] == pytest.approx(sum(k for k, _ in sums) / 10, rel=1e-12)
    assert "expert_agreement" not in TaskScores().summary()


def test_head_errors_of_a_run_read_each_tasks_own_head(example_runs):
    """head_errors on any rows, and the evaluate stage's report on the evaluation rows, give the same figures."""
    cfg, run_dir, _ = example_runs("bert")
    ctx = context(run_dir)
    task = cfg.tasks[0]
    source = cfg.calibration.data[task]
    errors = head_errors(ctx, task, source, f"calibration.data.{task}", ("expert", "merged", "calibrated"))
    assert errors["expert"] == {"kl": 0.0, "agreement": 1.0}  # the expert against itself, through its own head
    for name in ("merged", "calibrated"):
        assert errors[name]["kl"] > 0 and 0.0 <= errors[name]["agreement"] <= 1.0
    assert errors["merged"] != errors["calibrated"]
    report = json.loads((run_dir / "report.json").read_text())
    for t in cfg.tasks:
        on_eval = head_errors(ctx, t, cfg.evaluation.data[t], f"evaluation.data.{t}")
        reported = report["tasks"][t]
        for name in ("merged", "calibrated"):
            assert reported["expert_agreement"][name] == on_eval[name]["agreement"]
            assert reported["expert_kl"][name] == pytest.approx(on_eval[name]["kl"], rel=1e-9)
    assert "## Agreement with each task's expert (no labels)" in (run_dir / "report.md").read_text()
