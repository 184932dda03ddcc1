"""Paired comparisons (featcal_bench.paired) against brute-force references, the per-example predictions the
evaluation keeps for them, and the benchmark report's paired table and per-task gaps on hand-made results."""

import math

import numpy as np
import pytest
import torch

from featcal.evaluation import TaskScores, summarize
from featcal.evaluation import markdown as run_markdown
from featcal_bench.minilm.recipe import STUDY
from featcal_bench.paired import mcnemar, p_text, paired_bootstrap
from featcal_bench.report import build_report, markdown
from featcal_bench.study import load_study

MINILM = load_study(STUDY)  # the MiniLM benchmark's rows and curves


def _pair(only_a: int, only_b: int, both: int = 3, neither: int = 2) -> tuple[list[bool], list[bool]]:
    """Two correctness lists with the given discordant counts, shuffled so the order carries nothing."""
    rows = [(True, False)] * only_a + [(False, True)] * only_b + [(True, True)] * both + [(False, False)] * neither
    order = np.random.default_rng(only_a * 100 + only_b).permutation(len(rows))
    return [rows[i][0] for i in order], [rows[i][1] for i in order]


def _exact_two_sided(b: int, c: int) -> float:
    """Two-sided exact binomial p-value with p = 1/2, by hand: twice the smaller tail, at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)


@pytest.mark.parametrize("b, c", [(0, 0), (0, 5), (5, 0), (3, 3), (1, 4), (2, 9), (10, 10), (30, 12), (1, 0)])
def test_mcnemar_matches_the_exact_binomial_tail(b, c):
    a_correct, b_correct = _pair(b, c)
    result = mcnemar(a_correct, b_correct)
    assert (result["only_a_right"], result["only_b_right"]) == (b, c)
    assert result["p_value"] == pytest.approx(_exact_two_sided(b, c), rel=1e-9)


def test_mcnemar_known_values_and_symmetry():
    assert mcnemar(*_pair(0, 5))["p_value"] == pytest.approx(2 / 32)
    assert mcnemar(*_pair(1, 4))["p_value"] == pytest.approx(12 / 32)
    assert mcnemar(*_pair(3, 3))["p_value"] == 1.0
    a, b = _pair(2, 9)
    assert mcnemar(a, b)["p_value"] == mcnemar(b, a)["p_value"]
    with pytest.raises(ValueError):
        mcnemar([True, False], [True])


def _tasks(seed: int, rates_a: list[float], rates_b: list[float], rows: list[int]):
    g = np.random.default_rng(seed)
    a = {f"t{i}": list(g.random(n) < r) for i, (r, n) in enumerate(zip(rates_a, rows))}
    b = {f"t{i}": list(g.random(n) < r) for i, (r, n) in enumerate(zip(rates_b, rows))}
    return a, b


def _task_average(correct: dict[str, list[bool]]) -> float:
    return sum(sum(c) / len(c) for c in correct.values()) / len(correct)


def test_bootstrap_point_estimate_is_the_task_averaged_difference_and_inside_its_ci():
    a, b = _tasks(1, [0.8, 0.6, 0.7], [0.75, 0.65, 0.6], [50, 80, 30])  # unequal rows: tasks still weigh equally
    result = paired_bootstrap(a, b, resamples=2000)
    assert result["difference"] == pytest.approx(_task_average(a) - _task_average(b), abs=1e-12)
    low, high = result["ci"]
    assert low < result["difference"] < high


def test_bootstrap_identical_methods_give_a_zero_width_ci_at_zero():
    a, _ = _tasks(2, [0.7, 0.5], [0.7, 0.5], [40, 40])
    assert paired_bootstrap(a, {t: list(c) for t, c in a.items()}, resamples=500) == {
        "difference": 0.0,
        "ci": [0.0, 0.0],
    }


def test_bootstrap_large_difference_excludes_zero_and_is_reproducible():
    a, b = _tasks(3, [0.9] * 4, [0.6] * 4, [200] * 4)
    first = paired_bootstrap(a, b, resamples=3000, seed=7)
    assert first["ci"][0] > 0.2 and first["difference"] == pytest.approx(_task_average(a) - _task_average(b), abs=1e-12)
    assert paired_bootstrap(a, b, resamples=3000, seed=7) == first
    assert paired_bootstrap(a, b, resamples=3000, seed=8)["ci"] != first["ci"]


def _percentile(values: list[float], q: float) -> float:
    """numpy's default ("linear") percentile, by hand."""
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def _loop_bootstrap(a: dict[str, list[bool]], b: dict[str, list[bool]], resamples: int, seed: int) -> list[float]:
    """The paired bootstrap by loops, from the documented draws: one (resamples × rows) index matrix per task."""
    rng = np.random.default_rng(seed)
    draws = {t: rng.integers(0, len(a[t]), size=(resamples, len(a[t]))) for t in a}
    differences = []
    for r in range(resamples):
        total = 0.0
        for t in a:
            rows = [int(i) for i in draws[t][r]]
            total += sum(a[t][i] for i in rows) / len(rows) - sum(b[t][i] for i in rows) / len(rows)
        differences.append(total / len(a))
    return [_percentile(differences, 2.5), _percentile(differences, 97.5)]


def test_vectorised_bootstrap_equals_the_loop_over_the_same_draws():
    a = {"x": [True, False, True, True, False], "y": [False, True, True], "z": [True, True, False, False]}
    b = {"x": [True, True, False, True, False], "y": [False, False, True], "z": [False, True, True, False]}
    vectorised = paired_bootstrap(a, b, resamples=400, seed=11)["ci"]
    assert vectorised == pytest.approx(_loop_bootstrap(a, b, 400, 11), abs=1e-12)
    assert vectorised[0] < vectorised[1]  # a real interval, not a degenerate one


def test_bootstrap_rejects_mismatched_tasks_and_rows():
    with pytest.raises(ValueError, match="same, non-empty set of tasks"):
        paired_bootstrap({"x": [True]}, {"y": [True]})
    with pytest.raises(ValueError, match="task 'x'"):
        paired_bootstrap({"x": [True, False]}, {"x": [True]})


def test_task_scores_keep_predictions_and_labels_in_row_order():
    scores = TaskScores()
    batches = [(torch.tensor([0, 1, 2]), {"merged": [0, 2, 2], "calibrated": [0, 1, 1]}),
               (torch.tensor([1, 0]), {"merged": [1, 1], "calibrated": [1, 0]})]
    for labels, predicted in batches:
        for model, ids in predicted.items():
            scores.add_predictions(model, torch.nn.functional.one_hot(torch.tensor(ids), 3).float(), labels)
        scores.seen += len(labels)
    summary = scores.summary()
    assert summary["labels"] == [0, 1, 2, 1, 0]
    assert summary["predictions"] == {"merged": [0, 2, 2, 1, 1], "calibrated": [0, 1, 1, 1, 0]}
    assert summary["accuracy"] == {"merged": 3 / 5, "calibrated": 4 / 5}
    assert "predictions" not in TaskScores().summary() and "labels" not in TaskScores().summary()
    # The run's summary and report.md read accuracy only: the per-row lists change neither.
    bare = {k: v for k, v in summary.items() if k not in ("predictions", "labels")}
    assert summarize({"t": summary}) == summarize({"t": bare})
    report = {"method": "featcal", "models": ["merged", "calibrated"], "tasks": {"t": summary}}
    md = run_markdown({**report, "summary": summarize({"t": summary})})
    assert md == run_markdown({**report, "tasks": {"t": bare}, "summary": summarize({"t": bare})})
    assert "[0, 1" not in md and "60.0" in md and "80.0" in md


TASKS = ["a", "b"]
LABELS = {"a": [0, 1, 1, 0], "b": [2, 0, 1, 1, 0]}
PREDICTIONS = {
    "ta_featcal": {"a": {"expert": [0, 1, 1, 0], "merged": [0, 0, 1, 1], "calibrated": [0, 1, 1, 1]},
                   "b": {"expert": [2, 0, 1, 1, 0], "merged": [2, 1, 1, 0, 0], "calibrated": [2, 0, 1, 0, 0]}},
    "regmean": {"a": {"calibrated": [1, 1, 0, 0]}, "b": {"calibrated": [2, 0, 0, 0, 0]}},
}
COST = {"merge_seconds": 1.0, "calibration_seconds": 2.0, "peak_rss_mib": 100.0, "merge_peak_rss_mib": 50.0}


def _result(predictions: dict[str, dict[str, list[int]]]) -> dict:
    accuracy = {t: {m: sum(p == y for p, y in zip(ids, LABELS[t])) / len(ids) for m, ids in models.items()}
                for t, models in predictions.items()}
    return {"accuracy": accuracy, "predictions": predictions, "labels": LABELS, "cost": COST, "drift": {}}


def _correct(run: str, model: str, predictions: dict = PREDICTIONS) -> dict[str, list[bool]]:
    return {t: [p == y for p, y in zip(predictions[run][t][model], LABELS[t])] for t in TASKS}


def test_report_pairs_featcal_with_every_method_and_gives_the_gaps():
    results = {run: _result(p) for run, p in PREDICTIONS.items()}
    surgery = _result({"a": {"calibrated": [0, 1, 0, 0]}, "b": {"calibrated": [2, 0, 1, 1, 1]}})
    results["ta_surgery"] = {k: v for k, v in surgery.items() if k not in ("predictions", "labels")}  # an old result
    predictions = {
        **PREDICTIONS,
        "ta_probsurgery": {"a": {"calibrated": [0, 1, 1, 0]}, "b": {"calibrated": [2, 0, 1, 1, 1]}},
    }
    results["ta_probsurgery"] = _result(predictions["ta_probsurgery"])
    report = build_report(results, TASKS, {}, MINILM)
    # experts: a 4/4, b 5/5; task arithmetic: a 2/4, b 3/5
    assert report["gaps"] == pytest.approx({"a": 0.5, "b": 0.4}, abs=1e-15)
    paired = report["paired"]
    assert paired["without_predictions"] == ["TA + Surgery"]
    assert (paired["reference"], paired["resamples"], paired["seed"]) == ("TA + FeatCal", 10_000, 0)
    rows = {c["method"]: c for c in paired["comparisons"]}
    assert list(rows) == ["experts (individual)", "task arithmetic", "RegMean", "TA + ProbSurgery"]
    # TA + FeatCal: a 3/4, b 4/5. Discordant rows by hand, p = twice the smaller binomial tail.
    expected = {"experts (individual)": ("ta_featcal", "expert", -0.225, 0, 2, 0.5),
                "task arithmetic": ("ta_featcal", "merged", 0.225, 2, 0, 0.5),
                "RegMean": ("regmean", "calibrated", 0.225, 3, 1, 10 / 16),
                "TA + ProbSurgery": ("ta_probsurgery", "calibrated", -0.125, 1, 2, 1.0)}  # a 4/4, b 4/5
    for method, (run, model, difference, featcal_only, other_only, p) in expected.items():
        row = rows[method]
        assert (row["run"], row["model"]) == (run, model)
        assert row["difference"] == pytest.approx(difference, abs=1e-12)
        assert (row["featcal_only_right"], row["other_only_right"]) == (featcal_only, other_only)
        assert row["p_value"] == pytest.approx(p, rel=1e-9)
        assert (
            row["ci"] == paired_bootstrap(_correct("ta_featcal", "calibrated"), _correct(run, model, predictions))["ci"]
        )
        assert row["ci"][0] <= difference <= row["ci"][1]
    md = markdown(report, MINILM)
    assert "| *gap (expert − TA)* | *+50.0* | *+40.0* | *+45.0* | | | | |" in md
    assert md.index("*gap (expert − TA)*") < md.index("| experts (individual) |")
    assert "## Paired comparisons: TA + FeatCal against each method" in md
    low, high = rows["RegMean"]["ci"]
    assert f"| RegMean | +22.5 | [{100 * low:+.1f}, {100 * high:+.1f}] | 0.625 | 3 | 1 |" in md
    assert "| experts (individual) | -22.5 |" in md and "10,000 resamples, seed 0" in md
    assert "No per-example predictions for: TA + Surgery." in md


def test_report_without_any_predictions_names_the_methods_and_draws_no_table():
    results = {run: {k: v for k, v in _result(p).items() if k != "predictions"} for run, p in PREDICTIONS.items()}
    report = build_report(results, TASKS, {}, MINILM)
    assert report["paired"]["comparisons"] == []
    assert report["paired"]["without_predictions"] == ["experts (individual)", "task arithmetic", "RegMean",
                                                       "TA + FeatCal"]
    md = markdown(report, MINILM)
    assert "| method | Δ accuracy" not in md and "No per-example predictions for: experts (individual)" in md


def test_each_calibrated_row_is_paired_with_the_row_it_started_from():
    """TA + FeatCal against task arithmetic (its merge), RegMean + FeatCal against RegMean (its `start` run's
    calibrated model); RegMean's own merge (the average) was not scored, so RegMean has no start row. Values by hand;
    the composed row's time includes RegMean's."""
    predictions = {**PREDICTIONS,
                   "regmean_featcal": {"a": {"calibrated": [0, 1, 0, 0]}, "b": {"calibrated": [2, 0, 1, 0, 0]}}}
    results = {run: _result(p) for run, p in predictions.items()}
    results["ta_featcal"].update(merge="task_arithmetic", scaling=0.3)
    results["regmean"].update(merge="average", scaling=0.3)
    results["regmean_featcal"].update(merge="given", scaling=0.3, start="regmean")
    report = build_report(results, TASKS, {}, MINILM)
    starts = report["paired_with_start"]
    assert starts["without_predictions"] == [] and (starts["resamples"], starts["seed"]) == (10_000, 0)
    rows = {c["method"]: c for c in starts["comparisons"]}
    assert list(rows) == ["TA + FeatCal", "RegMean + FeatCal"]
    # RegMean + FeatCal: a 3/4 vs RegMean's 2/4, b 4/5 vs 3/5; right where RegMean was wrong on a[0] and b[2] only.
    expected = {
        "TA + FeatCal": ("task arithmetic", ("ta_featcal", "calibrated"), ("ta_featcal", "merged"), 0.225, 2, 0),
        "RegMean + FeatCal": ("RegMean", ("regmean_featcal", "calibrated"), ("regmean", "calibrated"), 0.225, 2, 0)}
    for method, (start, ours, theirs, difference, only_ours, only_start) in expected.items():
        row = rows[method]
        assert row["start"] == start and row["difference"] == pytest.approx(difference, abs=1e-12)
        assert (row["calibrated_only_right"], row["start_only_right"]) == (only_ours, only_start)
        assert row["p_value"] == pytest.approx(_exact_two_sided(only_ours, only_start), rel=1e-9)
        assert row["ci"] == paired_bootstrap(_correct(*ours, predictions), _correct(*theirs, predictions))["ci"]
    methods = {r["method"]: r for r in report["methods"]}
    assert methods["RegMean + FeatCal"]["merge_row"] == "RegMean"
    assert methods["RegMean + FeatCal"]["change_vs_merge"] == pytest.approx({"a": 0.25, "b": 0.2}, abs=1e-12)
    assert "merge_row" not in methods["RegMean"]
    cost = COST["merge_seconds"] + COST["calibration_seconds"]
    assert (methods["RegMean + FeatCal"]["seconds"], methods["RegMean"]["seconds"]) == (2 * cost, cost)
    md = markdown(report, MINILM)
    assert "## Paired comparisons: each calibrated method against its starting point" in md
    low, high = rows["RegMean + FeatCal"]["ci"]
    assert f"| RegMean + FeatCal | RegMean | +22.5 [{100 * low:+.1f}, {100 * high:+.1f}] | 0.500 |" in md


def test_agreement_with_each_tasks_expert_is_reported_per_row_without_labels():
    """Share of test rows where a row predicts what that task's expert predicts (by hand from PREDICTIONS); the labels
    are not read: changing them leaves the agreement as it was."""
    results = {run: _result(p) for run, p in PREDICTIONS.items()}
    relabelled = {run: {**r, "labels": {t: [9] * len(y) for t, y in LABELS.items()}} for run, r in results.items()}
    for res in (results, relabelled):
        methods = {r["method"]: r for r in build_report(res, TASKS, {}, MINILM)["methods"]}
        assert methods["task arithmetic"]["expert_agreement"] == pytest.approx({"a": 0.5, "b": 0.6}, abs=1e-12)
        assert methods["TA + FeatCal"]["expert_agreement"] == pytest.approx({"a": 0.75, "b": 0.8}, abs=1e-12)
        assert methods["RegMean"]["expert_agreement"] == pytest.approx({"a": 0.5, "b": 0.6}, abs=1e-12)
    md = markdown(build_report(results, TASKS, {}, MINILM), MINILM)
    assert "## Agreement with each task's expert" in md and "| TA + FeatCal | 75.0 | 80.0 | 77.5 |" in md
    assert "| experts (individual) |" not in md.split("## Agreement")[1].split("\n## ")[0]
    without = {run: {k: v for k, v in r.items() if k != "predictions"} for run, r in results.items()}
    assert all("expert_agreement" not in r for r in build_report(without, TASKS, {}, MINILM)["methods"])


def test_p_values_print_three_decimals_and_a_floor() -> None:
    """A p of 0.0004 once printed as `0.000` in a benchmark table; every table prints it through p_text."""
    assert [p_text(p) for p in (0.0004, 0.001, 0.0123, 1.0)] == ["< 0.001", "0.001", "0.012", "1.000"]


def test_a_row_with_an_option_is_paired_with_the_same_run_without_it(tmp_path):
    """TA + FeatCal + head refit (a 4/4, b 4/5) against TA + FeatCal (a 3/4, b 4/5): only a's last row differs."""
    predictions = {**PREDICTIONS,
                   "ta_featcal_refit": {"a": {"calibrated": [0, 1, 1, 0]}, "b": {"calibrated": [2, 0, 1, 0, 0]}}}
    report = build_report({run: _result(p) for run, p in predictions.items()}, TASKS, {}, MINILM)
    (row,) = report["paired_against"]["comparisons"]
    assert (row["method"], row["against"], row["covers"]) == ("TA + FeatCal + head refit", "TA + FeatCal", "test rows")
    assert row["difference"] == pytest.approx(0.125, abs=1e-12)
    assert (row["method_only_right"], row["against_only_right"], row["p_value"]) == (1, 0, 1.0)
    assert row["ci"] == paired_bootstrap(_correct("ta_featcal_refit", "calibrated", predictions),
                                         _correct("ta_featcal", "calibrated"))["ci"]
    md = markdown(report, MINILM)
    low, high = row["ci"]
    assert "## Paired comparisons: each option against the same run without it" in md
    assert (f"| TA + FeatCal + head refit | TA + FeatCal | +12.5 [{100 * low:+.1f}, {100 * high:+.1f}] | 1.000 | 1 | "
            "0 |") in md
    study = tmp_path / "study.yaml"
    study.write_text("reference: r\npaired_reference: x\nruns: {r: {merge: task_arithmetic, method: featcal}}\n"
                     "rows: [{label: x, run: r, model: calibrated, against: nobody}]\n")
    with pytest.raises(ValueError, match=r"rows: against \['nobody'\]: no row has that label"):
        load_study(study)
