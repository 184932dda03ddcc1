"""`featcal bench run --draws N`: the runs each draw adds, the paired bootstrap over test rows and calibration draws
against a loop over its documented draws, and the report's spread per calibrated row on hand-made results."""

import numpy as np
import pytest

from featcal_bench.minilm.recipe import STUDY
from featcal_bench.paired import compared, paired_bootstrap, paired_bootstrap_draws
from featcal_bench.report import build_report, markdown
from featcal_bench.runs import MethodRun, draw_name, drawn, split_draw, with_draws
from featcal_bench.study import load_study
from tests.test_paired import _percentile

MINILM = load_study(STUDY)


def test_draw_names_round_trip():
    assert [draw_name("ta_featcal_n008", k) for k in (0, 1, 3)] == [
        "ta_featcal_n008", "ta_featcal_n008_draw1", "ta_featcal_n008_draw3"]
    assert split_draw("ta_featcal_n008_draw3") == ("ta_featcal_n008", 3)
    assert split_draw("ta_featcal") == ("ta_featcal", 0) and split_draw("x_draw0") == ("x_draw0", 0)


def test_each_draw_follows_the_draws_it_needs_and_scores_its_calibrated_model_only():
    known = {"merge_only": MethodRun("task_arithmetic", None, models=("merged",)),
             "regmean": MethodRun("average", "regmean", models=("merged", "calibrated")),
             "regmean_featcal": MethodRun("given", "featcal", start="regmean"),
             "auto": MethodRun("task_arithmetic", "featcal", models=("base", "merged", "calibrated", "expert")),
             "protected": MethodRun("task_arithmetic", "featcal", protect="auto")}
    names, runs = with_draws(list(known), known, 3)
    assert names == [*known, "regmean_draw1", "regmean_featcal_draw1", "auto_draw1", "protected_draw1",
                     "regmean_draw2", "regmean_featcal_draw2", "auto_draw2", "protected_draw2"]  # no merge-only draw
    assert runs["regmean_featcal_draw2"] == MethodRun("given", "featcal", start="regmean_draw2", draw=2)
    assert runs["protected_draw1"].protect == "auto_draw1" and runs["auto_draw1"].models == ("calibrated",)
    assert drawn(known["regmean_featcal"], 1, {**known, "regmean": known["merge_only"]}).start == "regmean"
    assert with_draws(list(known), known, 1) == (list(known), known)
    with pytest.raises(ValueError, match="--draws: must be >= 1"):
        with_draws([], known, 0)


def _correct(seed: int, rates: dict[str, float], rows: dict[str, int]) -> dict[str, list[bool]]:
    g = np.random.default_rng(seed)
    return {t: [bool(v) for v in g.random(rows[t]) < rates[t]] for t in rows}


ROWS = {"x": 7, "y": 5, "z": 9}


def _loop_draws(a, b, resamples: int, seed: int) -> list[float]:
    """The bootstrap over draws by loops, from the documented draws: first a draw per resample, then one
    (resamples × rows) index matrix per task."""
    rng = np.random.default_rng(seed)
    k = max(len(a), len(b))
    picks = rng.integers(0, k, size=resamples)
    index = {t: rng.integers(0, ROWS[t], size=(resamples, ROWS[t])) for t in a[0]}
    values = []
    for r in range(resamples):
        d = int(picks[r])
        one, two = a[d % len(a)], b[d % len(b)]
        values.append(sum(sum(one[t][i] for i in index[t][r]) / ROWS[t] - sum(two[t][i] for i in index[t][r]) / ROWS[t]
                          for t in ROWS) / len(ROWS))
    return [_percentile(values, 2.5), _percentile(values, 97.5)]


def test_the_bootstrap_over_draws_equals_the_loop_and_one_draw_is_the_plain_bootstrap():
    a = [_correct(s, {"x": 0.8, "y": 0.6, "z": 0.7}, ROWS) for s in range(3)]
    b = [_correct(10 + s, {"x": 0.6, "y": 0.6, "z": 0.5}, ROWS) for s in range(3)]
    merged = [_correct(99, {"x": 0.5, "y": 0.5, "z": 0.5}, ROWS)]  # a row no draw changes
    for one, two in ((a, b), (a, merged)):
        got = paired_bootstrap_draws(one, two, resamples=300, seed=5)
        assert got["ci"] == pytest.approx(_loop_draws(one, two, 300, 5), abs=1e-12)
        # the point estimate: the mean over draws of the task-averaged accuracy difference
        by_hand = np.mean([np.mean([np.mean(one[k % len(one)][t]) - np.mean(two[k % len(two)][t]) for t in ROWS])
                           for k in range(3)])
        assert got["difference"] == pytest.approx(by_hand, abs=1e-12)
        assert got["ci"][0] < got["difference"] < got["ci"][1]
    assert paired_bootstrap_draws(a[:1], b[:1], 300, 5) == paired_bootstrap(a[0], b[0], 300, 5)
    assert compared(a[0], b[0], list(ROWS))["covers"] == "test rows"
    assert compared(a, merged, list(ROWS))["covers"] == "test rows and 3 calibration draws"
    with pytest.raises(ValueError, match="3 against 2"):
        paired_bootstrap_draws(a, b[:2])
    with pytest.raises(ValueError, match="task 'y'"):
        paired_bootstrap_draws(a, [*b[:2], {**b[2], "y": [True]}])


TASKS = ["a", "b"]
LABELS = {"a": [0, 1, 1, 0], "b": [2, 0, 1, 1, 0]}
COST = {"merge_seconds": 1.0, "calibration_seconds": 2.0, "peak_rss_mib": 100.0, "merge_peak_rss_mib": 50.0}


def _result(predictions: dict[str, dict[str, list[int]]]) -> dict:
    accuracy = {t: {m: sum(p == y for p, y in zip(ids, LABELS[t])) / len(ids) for m, ids in models.items()}
                for t, models in predictions.items()}
    return {"accuracy": accuracy, "predictions": predictions, "labels": LABELS, "cost": COST, "drift": {}}


def test_the_report_gives_each_calibrated_rows_spread_over_draws_and_intervals_that_say_what_they_cover():
    """TA + FeatCal on three draws (task averages 0.775, 0.55, 0.9), RegMean on three (0.55, 0.675, 0.75), task
    arithmetic on one (0.55); spreads and differences by hand."""
    results = {
        "ta_featcal": _result({"a": {"expert": [0, 1, 1, 0], "merged": [0, 0, 1, 1], "calibrated": [0, 1, 1, 1]},
                               "b": {"expert": [2, 0, 1, 1, 0], "merged": [2, 1, 1, 0, 0],
                                     "calibrated": [2, 0, 1, 0, 0]}}),  # a 3/4, b 4/5: 0.775
        "ta_featcal_draw1": _result({"a": {"calibrated": [0, 1, 0, 1]}, "b": {"calibrated": [2, 0, 0, 0, 0]}}),  # 0.55
        "ta_featcal_draw2": _result({"a": {"calibrated": [0, 1, 1, 0]}, "b": {"calibrated": [2, 0, 1, 0, 0]}}),  # 0.9
        "regmean": _result({"a": {"calibrated": [1, 1, 0, 0]}, "b": {"calibrated": [2, 0, 0, 0, 0]}}),  # 0.55
        "regmean_draw1": _result({"a": {"calibrated": [0, 1, 0, 0]}, "b": {"calibrated": [2, 0, 0, 0, 0]}}),  # 0.675
        "regmean_draw2": _result({"a": {"calibrated": [1, 1, 0, 0]}, "b": {"calibrated": [2, 0, 1, 1, 0]}}),  # 0.75
    }
    report = build_report(results, TASKS, {}, MINILM)
    rows = {r["method"]: r for r in report["methods"]}
    assert rows["TA + FeatCal"]["average"] == pytest.approx(0.775)  # the table's own column: the first draw
    spread = rows["TA + FeatCal"]["draws"]
    assert spread["count"] == 3 and spread["values"] == pytest.approx([0.775, 0.55, 0.9])
    assert (spread["mean"], spread["min"], spread["max"]) == pytest.approx((2.225 / 3, 0.55, 0.9))
    assert spread["sd"] == pytest.approx(np.std([0.775, 0.55, 0.9], ddof=1))
    assert rows["RegMean"]["draws"]["values"] == pytest.approx([0.55, 0.675, 0.75])
    assert "draws" not in rows["task arithmetic"] and "draws" not in rows["experts (individual)"]
    paired = {c["method"]: c for c in report["paired"]["comparisons"]}
    assert paired["RegMean"]["covers"] == "test rows and 3 calibration draws"
    assert paired["RegMean"]["difference"] == pytest.approx((2.225 - 1.975) / 3)
    assert paired["task arithmetic"]["covers"] == "test rows and 3 calibration draws"  # FeatCal's draws, TA's one
    assert paired["task arithmetic"]["difference"] == pytest.approx(2.225 / 3 - 0.55)
    assert paired["experts (individual)"]["covers"] == "test rows and 3 calibration draws"
    md = markdown(report, MINILM)
    assert "| average | over 3 draws: mean ± sd [min–max] | normalized |" in md
    assert f"| TA + FeatCal | 75.0 | 80.0 | 77.5 | 74.2 ± {100 * spread['sd']:.1f} [55.0–90.0] |" in md
    assert "| task arithmetic | 50.0 | 60.0 | 55.0 |  |" in md  # no draws: an empty cell
    low, high = paired["RegMean"]["ci"]
    assert (f"| RegMean | +8.3 | [{100 * low:+.1f}, {100 * high:+.1f}] | test rows and 3 calibration draws |"
            in md)
    assert "| *gap (expert − TA)* | *+50.0* | *+40.0* | *+45.0* | | | | | |" in md  # one more empty cell
    one_draw = markdown(build_report({k: v for k, v in results.items() if "draw" not in k}, TASKS, {}, MINILM), MINILM)
    assert "draws" not in one_draw and "95 % CI (paired bootstrap over test rows)" in one_draw


def test_sample_curve_points_are_means_over_draws_and_the_8_example_share_is_per_draw():
    """TA at 0.55 on average; TA + FeatCal 0.775 at 256 (one draw) and 0.675, 0.65 at 8 (two draws): shares
    (0.675 − 0.55)/(0.775 − 0.55) and (0.65 − 0.55)/(0.775 − 0.55), their mean the sentence's figure."""
    base = _result({"a": {"expert": [0, 1, 1, 0], "merged": [0, 0, 1, 1], "calibrated": [0, 1, 1, 1]},
                    "b": {"expert": [2, 0, 1, 1, 0], "merged": [2, 1, 1, 0, 0], "calibrated": [2, 0, 1, 0, 0]}})
    results = {"ta_featcal": base,
               "ta_featcal_n008": _result({"a": {"calibrated": [0, 1, 1, 1]}, "b": {"calibrated": [2, 0, 1, 0, 1]}}),
               "ta_featcal_n008_draw1": _result({"a": {"calibrated": [0, 0, 1, 1]},
                                                 "b": {"calibrated": [2, 0, 1, 1, 1]}})}
    report = build_report(results, TASKS, {}, MINILM)
    assert report["sample_efficiency"]["featcal"] == pytest.approx({8: 0.6625, 256: 0.775})
    assert report["sample_efficiency_draws"]["featcal"] == {8: pytest.approx([0.675, 0.65])}
    shares = [(0.675 - 0.55) / 0.225, (0.65 - 0.55) / 0.225]
    assert report["featcal_8_of_256_gain"] == pytest.approx(np.mean(shares))
    assert report["featcal_8_of_256_gain_draws"]["values"] == pytest.approx(shares)
    md = markdown(report, MINILM)
    assert "TA + FeatCal at 8: 2 draws, 65.0–67.5." in md
    assert ("keeps 50.0 % of its 256-example gain over TA. (the mean over 2 draws of the calibration rows, each "
            "draw's share from 44 to 56 %, sd 8 points)") in md
