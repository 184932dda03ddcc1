"""The benchmark report: one table of methods, the sample-efficiency curve, costs, and plots.

Gap closed = (method − TA) / (experts − TA), on the task-averaged accuracy. Where the runs kept their per-example
predictions, TA + FeatCal is compared with every other method on the same test rows (featcal_bench.paired), and each
calibrated row with the row it started from (its merge, or the run whose calibrated model it calibrated).
The rows, curves and reference run come from the study (featcal_bench/study.py: each recipe's study.yaml); rows
carrying a published figure (`paper`) get a column of their own.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from featcal_bench.paired import RESAMPLES, SEED, compared, p_text  # noqa: E402
from featcal_bench.runs import FULL, SAMPLE_SIZES, draw_name  # noqa: E402
from featcal_bench.study import Curve, Study  # noqa: E402
from storage.atomic import write_bytes, write_json  # noqa: E402


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _standard_error(accuracies: dict[str, float], rows: int | Mapping[str, int]) -> float:
    """Binomial standard error of a task average, each task scored on `rows` (or its own `rows[task]`) test rows:
    how far apart two methods must be before the benchmark can tell them apart."""
    count = rows if isinstance(rows, Mapping) else dict.fromkeys(accuracies, rows)
    return sum(a * (1 - a) / count[t] for t, a in accuracies.items()) ** 0.5 / len(accuracies)


def draws_of(results: Mapping[str, Any], run: str) -> list[str]:
    """Run `run` and its further draws of calibration rows present in `results` (`featcal bench run --draws`), in
    draw order: [run, run_draw1, …]."""
    found = [run]
    while draw_name(run, len(found)) in results:
        found.append(draw_name(run, len(found)))
    return found


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Values over draws: their count, the values, mean, sample standard deviation (n − 1), min and max."""
    mean = _mean(list(values))
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"count": len(values), "values": list(values), "mean": mean, "sd": sd, "min": min(values),
            "max": max(values)}


def correct_rows(result: dict[str, Any], model: str, tasks: list[str]) -> dict[str, list[bool]] | None:
    """Per task, whether `model` got each test row right, in row order; None when the run kept no per-example
    predictions for it (results written before they were kept, or a task missing)."""
    predictions, labels = result.get("predictions", {}), result.get("labels", {})
    if any(model not in predictions.get(t, {}) or t not in labels for t in tasks):
        return None
    return {t: [p == y for p, y in zip(predictions[t][model], labels[t], strict=True)] for t in tasks}


Draws = list[dict[str, list[bool]]]  # a row's per-task correctness, one entry per draw of its calibration rows


def _paired(correct: dict[str, Draws | None], tasks: list[str],
            rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """Row `label` (TA + FeatCal) against every other method row on the same test rows (`paired.compared`), over its
    draws too where it has several. Rows without per-example predictions (its own included) are listed under
    `without_predictions`."""
    reference = correct.get(label)
    comparisons = []
    for row in rows:
        other = correct[row["method"]]
        if row["method"] == label or reference is None or other is None:
            continue
        c = compared(reference, other, tasks)
        comparisons.append({"method": row["method"], "run": row["run"], "model": row["model"],
                            "difference": c["difference"], "ci": c["ci"], "covers": c["covers"],
                            "p_value": c["p_value"], "featcal_only_right": c["only_a_right"],
                            "other_only_right": c["only_b_right"]})
    return {"reference": label, "resamples": RESAMPLES, "seed": SEED, "comparisons": comparisons,
            "without_predictions": [m for m, c in correct.items() if c is None]}


def _correct_draws(results: dict[str, dict[str, Any]], row: dict[str, Any], tasks: list[str]) -> Draws | None:
    """A row's per-task correctness on every draw of its run (`draws_of`; one for a row no draw changes); only the
    first where a draw kept no per-example predictions; None where the first kept none."""
    runs = draws_of(results, row["run"]) if row["model"] == "calibrated" else [row["run"]]
    found = [c for c in (correct_rows(results[r], row["model"], tasks) for r in runs) if c is not None]
    if len(found) == len(runs):
        return found
    first = correct_rows(results[runs[0]], row["model"], tasks)
    return None if first is None else [first]


def _starting_rows(methods: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each calibrated row's starting point, by its label: the calibrated model of the run it started from (a run
    with a `start`, e.g. RegMean + FeatCal from RegMean), else the merged model with its merge method and scale."""
    def merge_of(run: str) -> tuple[Any, Any]:
        return results[run].get("merge"), results[run].get("scaling")

    merges = {merge_of(r["run"]): r for r in methods if r["model"] == "merged"}
    calibrated = {r["run"]: r for r in methods if r["model"] == "calibrated"}
    starts = {}
    for row in methods:
        if row["model"] != "calibrated":
            continue
        start = results[row["run"]].get("start")
        found = calibrated.get(start) if start is not None else merges.get(merge_of(row["run"]))
        if found is not None:
            starts[row["method"]] = found
    return starts


def _paired_with_start(correct: dict[str, Draws | None], tasks: list[str],
                       starts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each calibrated row against the row it started from (`_starting_rows`), on the same test rows: what the
    calibration itself changed (`paired.compared`); pairs missing per-example predictions under
    `without_predictions`."""
    comparisons, missing = [], []
    for method, start in starts.items():
        own, started = correct[method], correct[start["method"]]
        if own is None or started is None:
            missing.append(method)
            continue
        c = compared(own, started, tasks)
        comparisons.append({"method": method, "start": start["method"], "difference": c["difference"], "ci": c["ci"],
                            "covers": c["covers"], "p_value": c["p_value"], "calibrated_only_right": c["only_a_right"],
                            "start_only_right": c["only_b_right"]})
    return {"resamples": RESAMPLES, "seed": SEED, "comparisons": comparisons, "without_predictions": missing}


def _paired_against(correct: dict[str, Draws | None], tasks: list[str],
                    pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Each row the study pairs with another (`against`: the same run without one option) against that row, on the
    same test rows (and draws): the option's own effect (`paired.compared`). Pairs whose rows did not run are left
    out; pairs missing per-example predictions are under `without_predictions`."""
    comparisons, missing = [], []
    for label, other in pairs:
        if label not in correct or other not in correct:
            continue
        own, theirs = correct[label], correct[other]
        if own is None or theirs is None:
            missing.append(label)
            continue
        c = compared(own, theirs, tasks)
        comparisons.append({"method": label, "against": other, "difference": c["difference"], "ci": c["ci"],
                            "covers": c["covers"], "p_value": c["p_value"], "method_only_right": c["only_a_right"],
                            "against_only_right": c["only_b_right"]})
    return {"resamples": RESAMPLES, "seed": SEED, "comparisons": comparisons, "without_predictions": missing}


def _add_changes_against_start(methods: list[dict[str, Any]], starts: dict[str, dict[str, Any]]) -> None:
    """Each calibrated row's per-task change against the row it started from (`_starting_rows`: its merge, or the run
    it calibrated), and its worst task: a task below 0 is one the calibration left behind."""
    for row in methods:
        start = starts.get(row["method"])
        if start is None:
            continue
        change = {t: row["accuracy"][t] - start["accuracy"][t] for t in row["accuracy"]}
        worst = min(change, key=lambda t: change[t])
        row.update(change_vs_merge=change, merge_row=start["method"],
                   worst_task={"task": worst, "change": change[worst]})


def _agreement_with_experts(results: dict[str, dict[str, Any]], methods: list[dict[str, Any]], tasks: list[str],
                            reference: str) -> None:
    """Each row's share of test rows where it predicts what the task's own expert predicts, per task: a signal read
    through each task's head that needs no labels (issue 33 §1), next to accuracy. Rows whose run kept no
    per-example predictions, or a report without the experts' (the study's reference run), get none."""
    experts = results.get(reference, {}).get("predictions", {})
    if any("expert" not in experts.get(t, {}) for t in tasks):
        return
    for row in methods:
        own = results[row["run"]].get("predictions", {})
        if all(row["model"] in own.get(t, {}) for t in tasks):
            row["expert_agreement"] = {
                t: _mean([float(p == e) for p, e in zip(own[t][row["model"]], experts[t]["expert"], strict=True)])
                for t in tasks
            }


def _seconds_from_experts(results: dict[str, dict[str, Any]], run: str) -> float:
    """A calibrated model's time from the experts: its run's merge and calibration, and those of the run it started
    from, if any (RegMean + FeatCal costs RegMean too)."""
    cost, start = results[run]["cost"], results[run].get("start")
    own = cost["merge_seconds"] + cost["calibration_seconds"]
    return own + (_seconds_from_experts(results, start) if start is not None else 0.0)


def _sample_run(run: str, n: int) -> str:
    return run if n == FULL else f"{run}_n{n:03d}"


def build_report(results: dict[str, dict[str, Any]], tasks: list[str], meta: dict[str, Any],
                 study: Study) -> dict[str, Any]:
    """`results`: run name → the JSON a method run wrote; the study's rows and curves read them. `meta` is copied into
    the report; its `test_rows` (per task) or `spec.test` (one count for every task) sizes the standard errors."""

    def acc(run: str, model: str) -> dict[str, float] | None:
        if run not in results:
            return None
        per_task = {t: results[run]["accuracy"][t].get(model) for t in tasks}
        return None if any(v is None for v in per_task.values()) else per_task

    test_rows = meta.get("test_rows") or meta.get("spec", {}).get("test")
    experts, ta = acc(study.reference, "expert"), acc(study.reference, "merged")
    expert_avg = _mean(list(experts.values())) if experts else None
    ta_avg = _mean(list(ta.values())) if ta else None
    methods = []
    for label, run, model, cost_kind in ((r.label, r.run, r.model, r.cost) for r in study.rows):
        per_task = acc(run, model)
        if per_task is None:
            continue
        avg = _mean(list(per_task.values()))
        row: dict[str, Any] = {"method": label, "run": run, "model": model, "accuracy": per_task, "average": avg}
        if test_rows:
            row["standard_error"] = _standard_error(per_task, test_rows)
        if expert_avg:
            row["normalized"] = avg / expert_avg
        if expert_avg is not None and ta_avg is not None and expert_avg != ta_avg:
            row["gap_closed"] = (avg - ta_avg) / (expert_avg - ta_avg)
        if model == "calibrated" and len(draws_of(results, run)) > 1:  # its spread over calibration draws
            scored = [acc(r, model) for r in draws_of(results, run)]
            row["draws"] = spread([_mean(list(a.values())) for a in scored if a is not None])
        if cost_kind is not None:
            cost = results[run]["cost"]
            row["seconds"] = cost["merge_seconds"] if cost_kind == "merge" else _seconds_from_experts(results, run)
            row["calibration_seconds"] = 0.0 if cost_kind == "merge" else cost["calibration_seconds"]
            row["peak_rss_mib"] = cost["merge_peak_rss_mib"] if cost_kind == "merge" else cost["peak_rss_mib"]
        methods.append(row)
    starts = _starting_rows(methods, results)
    _add_changes_against_start(methods, starts)
    _agreement_with_experts(results, methods, tasks, study.reference)
    curve: dict[str, dict[int, float]] = {}
    curve_draws: dict[str, dict[int, list[float]]] = {}  # per curve and size, each draw's average
    for name, line in study.curves.items():
        points = {}
        for n in SAMPLE_SIZES:  # with draws, each point is their mean
            drawn = [acc(r, "calibrated") for r in draws_of(results, _sample_run(line.run, n))]
            averages = [_mean(list(a.values())) for a in drawn if a is not None]
            if averages:
                points[n] = _mean(averages)
                if len(averages) > 1:
                    curve_draws.setdefault(name, {})[n] = averages
        if points:
            curve[name] = points
    out: dict[str, Any] = {**meta, "tasks": tasks, "methods": methods, "sample_efficiency": curve}
    if curve_draws:
        out["sample_efficiency_draws"] = curve_draws
    if experts and ta:
        out["gaps"] = {t: experts[t] - ta[t] for t in tasks}
    correct = {r["method"]: _correct_draws(results, r, tasks) for r in methods}
    if any(row["method"] == study.paired_reference for row in methods):
        out["paired"] = _paired(correct, tasks, methods, study.paired_reference)
    if starts:
        out["paired_with_start"] = _paired_with_start(correct, tasks, starts)
    against = [(r.label, r.against) for r in study.rows if r.against is not None]
    if against:
        out["paired_against"] = _paired_against(correct, tasks, against)
    for name in study.gains:  # the share of the 256-example gain over TA that 8 examples keep
        points = curve.get(name, {})
        if ta_avg is not None and 8 in points and FULL in points and points[FULL] != ta_avg:
            at_8 = curve_draws.get(name, {}).get(8, [points[8]])
            at_full = curve_draws.get(name, {}).get(FULL, [points[FULL]])
            # draw k at 8 examples against draw k at 256 (its only one where 256 has one); with draws, their mean
            shares = [(v - ta_avg) / (at_full[k % len(at_full)] - ta_avg) for k, v in enumerate(at_8)]
            out[f"{name}_8_of_256_gain"] = _mean(shares)
            if len(shares) > 1:
                out[f"{name}_8_of_256_gain_draws"] = spread(shares)
    if study.reference in results:
        out["drift"] = results[study.reference].get("drift", {})
    if study.choices is not None and results.get(study.choices.run, {}).get("chosen"):
        out["auto_choices"] = results[study.choices.run]["chosen"]
    return out


def add_paper_column(report: dict[str, Any], paper: Mapping[str, float]) -> None:
    """`paper` (a row label → its published figure in %) on every row the paper reports, as a fraction: the markdown
    then gives those figures a column of their own, after ours."""
    for row in report["methods"]:
        if row["method"] in paper:
            row["paper"] = paper[row["method"]] / 100


def language_model_report(results: dict[str, dict[str, Any]], tasks: list[str], meta: dict[str, Any],
                          study: Study) -> dict[str, Any]:
    """`build_report` of causal-LM runs, whose "accuracy" is next-token accuracy: each row also gets its per-task
    next-token `loss`, `average_loss` and `gap_closed_loss`, (TA − row) / (TA − experts) on the average loss. A loss
    has no right or wrong rows to pair, and these benchmarks have no sample curves."""
    report = build_report(results, tasks, meta, study)
    report.pop("paired", None)
    report.pop("paired_with_start", None)
    report.pop("sample_efficiency")
    for row in report["methods"]:
        lm = results[row["run"]]["language_model"]
        row["loss"] = {t: lm[t][row["model"]]["loss"] for t in tasks}
        row["average_loss"] = _mean(list(row["loss"].values()))
    average = {(r["run"], r["model"]): r["average_loss"] for r in report["methods"]}
    ta, experts = average.get((study.reference, "merged")), average.get((study.reference, "expert"))
    if ta is not None and experts is not None and ta != experts:
        for row in report["methods"]:
            row["gap_closed_loss"] = (ta - row["average_loss"]) / (ta - experts)
    return report


def markdown(report: dict[str, Any], study: Study) -> str:
    tasks = report["tasks"]
    paper = any("paper" in row for row in report["methods"])  # a column of published figures, after ours
    draws = max((row["draws"]["count"] for row in report["methods"] if "draws" in row), default=0)
    lines = [f"# {report.get('title', 'Benchmark')}", ""]
    lines += [str(report[k]) for k in ("about",) if k in report] + [""]
    lines.append("| method | " + " | ".join(tasks) + " | average |"
                 + (f" over {draws} draws: mean ± sd [min–max] |" if draws else "") + (" paper |" if paper else "")
                 + " normalized | gap closed | worst task vs its merge | time (s) | peak RSS (MiB) |")
    lines.append("|---|" + "---:|" * (len(tasks) + 6 + paper + bool(draws)))
    if "gaps" in report:
        gaps = [report["gaps"][t] for t in tasks]  # then their average, under "average"; the other columns empty
        lines.append("| *gap (expert − TA)* | " + " | ".join(f"*{100 * g:+.1f}*" for g in [*gaps, _mean(gaps)])
                     + " |" * (6 + paper + bool(draws)))
    for row in report["methods"]:
        cells = [f"{100 * row['accuracy'][t]:.1f}" for t in tasks]
        extra = [
            f"{100 * row['average']:.1f}"
            + (f" ± {100 * row['standard_error']:.1f}" if "standard_error" in row else ""),
            *([_spread_cell(row.get("draws"))] if draws else []),
            *([f"{100 * row['paper']:.1f}" if "paper" in row else ""] if paper else []),
            f"{100 * row['normalized']:.1f}" if "normalized" in row else "",
            f"{100 * row['gap_closed']:.1f} %" if "gap_closed" in row else "",
            _worst(row),
            f"{row['seconds']:.1f}" if "seconds" in row else "",
            f"{row['peak_rss_mib']:.0f}" if "peak_rss_mib" in row else "",
        ]
        lines.append(f"| {row['method']} | " + " | ".join(cells + extra) + " |")
    if "gaps" in report:
        lines += ["", "*gap (expert − TA)*: the experts' accuracy minus task arithmetic's, in points, per task and "
                      "on average: what calibration can win back."]
    if draws:
        lines += ["", f"Each calibrated row also ran on further draws of its calibration rows (`--draws {draws}`: "
                      "calibration.seed, +1, …); *over draws* is the task-averaged accuracy's mean, standard deviation "
                      "and range over them. Every other column is the first draw's (the study's own seed)."]
    if any("standard_error" in row for row in report["methods"]):
        has_pairs = bool(report.get("paired", {}).get("comparisons"))
        lines += ["", "± is one binomial standard error of the task average over the test rows; two methods scored "
                      "on the same rows differ less by chance than two independent samples would (√2 × that)"
                  + ("; the paired comparisons below test the differences themselves." if has_pairs else ".")]
    lines += changes_markdown(report)
    lines += agreement_markdown(report)
    lines += paired_markdown(report)
    lines += start_markdown(report)
    lines += against_markdown(report)
    lines += [
        "",
        "## Sample efficiency (average accuracy, %)",
        "",
        "| examples/task | " + " | ".join(str(n) for n in SAMPLE_SIZES) + " |",
        "|---|" + "---:|" * len(SAMPLE_SIZES),
    ]
    curves = study.curves
    curve_rows = [(curves[name].label, points) for name, points in report["sample_efficiency"].items()]
    published = report.get("paper_sample_efficiency")  # {"curve": name, "points": {n: accuracy}}
    if published:
        curve_rows.append((f"paper ({curves[published['curve']].label})", published["points"]))
    for label, points in curve_rows:
        lines.append(
            f"| {label} | " + " | ".join(f"{100 * points[n]:.1f}" if n in points else "" for n in SAMPLE_SIZES) + " |"
        )
    if report.get("sample_efficiency_draws"):
        lines += ["", "A point run on several draws of its calibration rows is their mean: "
                  + "; ".join(f"{curves[name].label} at {n}: {len(v)} draws, {100 * min(v):.1f}–{100 * max(v):.1f}"
                              for name, sizes in report["sample_efficiency_draws"].items()
                              for n, v in sorted(sizes.items())) + "."]
    for name in study.gains:
        if f"{name}_8_of_256_gain" in report:
            gain = curves[name].gain or ""
            lines += ["", gain.format(percent=100 * report[f"{name}_8_of_256_gain"])]
            spread_8 = report.get(f"{name}_8_of_256_gain_draws")
            if spread_8:
                lines[-1] += (f" (the mean over {spread_8['count']} draws of the calibration rows, each draw's share "
                              f"from {100 * spread_8['min']:.0f} to {100 * spread_8['max']:.0f} %, sd "
                              f"{100 * spread_8['sd']:.0f} points)")
    if "auto_choices" in report and study.choices is not None:
        lines += ["", f"## {study.choices.heading}", "",
                  "Median over each block's modules of the values chosen on held-out calibration rows.", "",
                  "| solve | λ | ρ |", "|---|---:|---:|"]
        lines += [f"| {stage} | {v['lambda']:g} | {v['rho']:g} |" for stage, v in report["auto_choices"].items()]
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _spread_cell(draws: dict[str, Any] | None) -> str:
    """A row's spread over draws as the table prints it (empty for a row no draw changes)."""
    if draws is None:
        return ""
    return (f"{100 * draws['mean']:.1f} ± {100 * draws['sd']:.1f} [{100 * draws['min']:.1f}–"
            f"{100 * draws['max']:.1f}]")


def _worst(row: dict[str, Any]) -> str:
    if "worst_task" not in row:
        return ""
    worst = row["worst_task"]
    return f"{worst['task']} {100 * worst['change']:+.1f}" + (" ⚠" if worst["change"] < 0 else "")


def changes_markdown(report: dict[str, Any]) -> list[str]:
    """Per task, each calibrated row's change against its merge: which tasks a calibration serves and which it
    leaves behind (below its merge, marked ⚠ in the table above)."""
    rows = [r for r in report["methods"] if "change_vs_merge" in r]
    if not rows:
        return []
    tasks = report["tasks"]
    lines = [
        "",
        "## Change against the merge (or the run it calibrated), per task (points)",
        "",
        "| method | from | " + " | ".join(tasks) + " | tasks below their merge |",
        "|---|---|" + "---:|" * (len(tasks) + 1),
    ]
    for r in rows:
        below = [t for t in tasks if r["change_vs_merge"][t] < 0]
        lines.append(
            f"| {r['method']} | {r['merge_row']} | "
            + " | ".join(f"{100 * r['change_vs_merge'][t]:+.1f}" for t in tasks)
            + f" | {', '.join(below) or '—'} |"
        )
    return lines


def agreement_markdown(report: dict[str, Any]) -> list[str]:
    """Per task, how often each row predicts what that task's expert predicts (test rows, no labels used)."""
    rows = [r for r in report["methods"] if "expert_agreement" in r and r["model"] != "expert"]
    if not rows:
        return []
    tasks = report["tasks"]
    lines = ["", "## Agreement with each task's expert (% of test rows; no labels used)", "",
             "The head-space signal next to accuracy: a calibration that moves a task's features away from what its "
             "head reads shows here as lower agreement than its merge's.", "",
             "| method | " + " | ".join(tasks) + " | average |", "|---|" + "---:|" * (len(tasks) + 1)]
    for r in rows:
        values = [r["expert_agreement"][t] for t in tasks]
        lines.append(f"| {r['method']} | " + " | ".join(f"{100 * v:.1f}" for v in [*values, _mean(values)]) + " |")
    return lines


def paired_markdown(report: dict[str, Any]) -> list[str]:
    """The paired-comparison section: one row per method, Δ = TA + FeatCal − that method."""
    paired = report.get("paired")
    if not paired:
        return []
    lines = ["", f"## Paired comparisons: {paired['reference']} against each method", ""]
    if paired["comparisons"]:
        drawn = _drawn(paired["comparisons"])
        lines += ["| method | Δ accuracy (points) | 95 % CI (paired bootstrap"
                  + (") | CI covers" if drawn else " over test rows)") + " | McNemar p | "
                  "FeatCal right, other wrong | FeatCal wrong, other right |", "|---|" + "---:|" * (5 + drawn)]
        for c in paired["comparisons"]:
            low, high = c["ci"]
            lines.append(f"| {c['method']} | {100 * c['difference']:+.1f} | [{100 * low:+.1f}, {100 * high:+.1f}] | "
                         + (f"{c['covers']} | " if drawn else "")
                         + f"{p_text(c['p_value'])} | {c['featcal_only_right']} | {c['other_only_right']} |")
        lines += [
            "",
            f"Δ is {paired['reference']}'s task-averaged accuracy minus the method's. The CI is the 2.5–97.5 "
            "percentile range of a paired bootstrap: each task's test rows resampled with replacement within "
            f"that task, the same rows for both methods, {paired['resamples']:,} resamples, seed "
            f"{paired['seed']}. McNemar's test is exact (binomial on the rows where the two disagree), on the "
            "test rows of all tasks pooled." + _DRAWS_NOTE * drawn,
        ]
    if paired["without_predictions"]:
        lines += ["", "No per-example predictions for: " + ", ".join(paired["without_predictions"]) + "."]
    return lines


_DRAWS_NOTE = (" Where a row ran on several draws of its calibration rows, Δ is the mean over draws, each resample "
               "first picks one draw (the same one for both rows: draw k of each ran on the same calibration rows) "
               "and the CI then covers the test rows and the draws; McNemar's test reads the first draw.")


def _drawn(comparisons: list[dict[str, Any]]) -> bool:
    """Whether any paired interval covers calibration draws besides test rows."""
    return any(c.get("covers", "test rows") != "test rows" for c in comparisons)


def start_markdown(report: dict[str, Any]) -> list[str]:
    """The calibrated-against-its-start section: one row per calibrated method, Δ = that method − its start."""
    paired = report.get("paired_with_start")
    if not paired or not paired["comparisons"]:
        return []
    drawn = _drawn(paired["comparisons"])
    lines = ["", "## Paired comparisons: each calibrated method against its starting point", "",
             "| method | starting point | Δ accuracy (points) [95 % CI] |" + (" CI covers |" if drawn else "")
             + " McNemar p |", "|---|---|---:|" + "---:|" * (1 + drawn)]
    for c in paired["comparisons"]:
        low, high = c["ci"]
        lines.append(f"| {c['method']} | {c['start']} | {100 * c['difference']:+.1f} [{100 * low:+.1f}, "
                     f"{100 * high:+.1f}] | " + (f"{c['covers']} | " if drawn else "") + f"{p_text(c['p_value'])} |")
    lines += ["", "Δ is the method's task-averaged accuracy minus that of the model it calibrated (its merge, or the "
                  "calibrated model of the run it started from), on the same test rows; the CI from a paired bootstrap "
                  f"of each task's rows ({paired['resamples']:,} resamples, seed {paired['seed']}), McNemar's exact "
                  "test on the rows of all tasks pooled." + _DRAWS_NOTE * drawn]
    if paired["without_predictions"]:
        lines += ["", "No per-example predictions for (or for the start of): "
                  + ", ".join(paired["without_predictions"]) + "."]
    return lines


def against_markdown(report: dict[str, Any]) -> list[str]:
    """The section of rows paired with the same run without one option: Δ = the row − that run."""
    paired = report.get("paired_against")
    if not paired or not (paired["comparisons"] or paired["without_predictions"]):
        return []
    drawn = _drawn(paired["comparisons"])
    lines = ["", "## Paired comparisons: each option against the same run without it", ""]
    if paired["comparisons"]:
        lines += ["| method | without the option | Δ accuracy (points) [95 % CI] |" + (" CI covers |" if drawn else "")
                  + " McNemar p | option right, other wrong | option wrong, other right |",
                  "|---|---|---:|" + "---:|" * (3 + drawn)]
        for c in paired["comparisons"]:
            low, high = c["ci"]
            lines.append(f"| {c['method']} | {c['against']} | {100 * c['difference']:+.1f} [{100 * low:+.1f}, "
                         f"{100 * high:+.1f}] | " + (f"{c['covers']} | " if drawn else "")
                         + f"{p_text(c['p_value'])} | {c['method_only_right']} | {c['against_only_right']} |")
        lines += ["", "Δ is the row's task-averaged accuracy minus that of the same run without the option, on the "
                      f"same test rows; the CI from a paired bootstrap of each task's rows ({paired['resamples']:,} "
                      f"resamples, seed {paired['seed']}), McNemar's exact test on the rows of all tasks pooled."
                  + _DRAWS_NOTE * drawn]
    if paired["without_predictions"]:
        lines += ["", "No per-example predictions for (or for the row it is paired with): "
                  + ", ".join(paired["without_predictions"]) + "."]
    return lines


def _saved(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")  # tight_layout cannot fit long method names in small figures
    plt.close(fig)
    return path


def plots(report: dict[str, Any], out_dir: Path, stem: str, curves: Mapping[str, Curve]) -> list[Path]:
    paths = []
    rows = report["methods"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["method"] for r in rows][::-1], [100 * r["average"] for r in rows][::-1], color="tab:blue")
    for y, r in enumerate(rows[::-1]):
        ax.text(100 * r["average"] + 0.3, y, f"{100 * r['average']:.1f}", va="center", fontsize=8)
    ax.set_xlabel("average accuracy over tasks (%)")
    lo = min(100 * r["average"] for r in rows)
    ax.set_xlim(max(0, lo - 10), 100)
    paths.append(_saved(fig, out_dir / f"{stem}_accuracy.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in report["sample_efficiency"].items():
        ns = sorted(points)
        dotted = len(ns) < len(SAMPLE_SIZES)  # sizes between its points were not run: no line through them
        ax.plot(ns, [100 * points[n] for n in ns], ":" if dotted else "-", marker="o", label=curves[name].label)
    for r in rows:
        if r["method"] in ("task arithmetic", "experts (individual)"):
            ax.axhline(100 * r["average"], ls="--", color="grey")
            ax.text(8, 100 * r["average"] + 0.3, r["method"], fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration examples per task")
    ax.set_ylabel("average accuracy (%)")
    ax.legend()
    paths.append(_saved(fig, out_dir / f"{stem}_sample_efficiency.png"))

    drift = report.get("drift") or {}
    if drift:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model, style in (("merged", "--"), ("calibrated", "-")):
            if model in drift:
                ax.plot(range(len(drift[model])), drift[model], style, marker="o",
                        label="TA" if model == "merged" else "TA + FeatCal")
        ax.set_xlabel("block boundary")
        ax.set_ylabel("relative drift from the expert, task average")
        ax.legend()
        paths.append(_saved(fig, out_dir / f"{stem}_drift.png"))
    return paths


def save_report(bench: Path, stem: str, report: dict[str, Any], results: dict[str, dict[str, Any]], out_dir: str | None,
                study: Study) -> tuple[list[str], dict[str, Any]]:
    """The accuracy benchmarks' report stage: its files with the plots, and each method's average."""
    if not report["methods"]:
        raise ValueError(f"report: no row of the study reads the runs that ran ({', '.join(sorted(results))}); give "
                         "them rows in the study's `rows:` (runs without rows are still kept under results/)")
    (bench / "report").mkdir(parents=True, exist_ok=True)
    drawn = plots(report, bench / "report", stem, study.curves)
    files = saved_report_files(bench, stem, report, results, out_dir, markdown(report, study), drawn)
    return files, {"methods": {r["method"]: round(100 * r["average"], 2) for r in report["methods"]}}


def save_loss_report(bench: Path, stem: str, report: dict[str, Any], results: dict[str, dict[str, Any]],
                     out_dir: str | None, markdown: str) -> tuple[list[str], dict[str, Any]]:
    """The language-model benchmarks' report stage: its files, and each method's average held-out loss."""
    files = saved_report_files(bench, stem, report, results, out_dir, markdown)
    return files, {"average_loss": {r["method"]: round(r["average_loss"], 4) for r in report["methods"]}}


def saved_report_files(bench: Path, stem: str, report: dict[str, Any], results: dict[str, dict[str, Any]],
                       out_dir: str | None, markdown: str, plots: Sequence[Path] = ()) -> list[str]:
    """`report/{stem}.json`, `.md` and `plots`, also copied to `out_dir` where given: a report stage's outputs."""
    # Each run's record without its per-example predictions (the paired comparisons summarise them).
    report["runs"] = {
        r: {k: v for k, v in res.items() if k not in ("predictions", "labels")} for r, res in results.items()
    }
    files = [f"report/{stem}.json", f"report/{stem}.md"]
    write_json(bench / files[0], report)
    write_bytes(bench / files[1], markdown.encode())
    files += [str(p.relative_to(bench)) for p in plots]
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for rel in files:
            shutil.copy2(bench / rel, Path(out_dir) / Path(rel).name)
    return files
