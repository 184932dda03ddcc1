"""The FLAN-T5 GLUE benchmark's report: the benchmark report's tables (featcal_bench.report) over the FLAN-T5 method
runs, with the paper's published figures in a column beside ours."""

from __future__ import annotations

from typing import Any

from featcal_bench.report import add_paper_column, build_report
from featcal_bench.study import Study
from featcal_bench.t5.prompts import LABEL_WORDS
from featcal_bench.t5.spec import BASE_MODEL, GLUE, GLUE_TASKS, T5BenchSpec

# The paper's averages over the eight tasks (FeatCal, arXiv 2605.13030; FLAN-T5-base, 256 examples per task), in %.
PAPER = {"experts (individual)": 86.4, "task arithmetic": 78.9, "TA + FeatCal": 85.2}
PAPER_SURGERY = {"TA + Surgery": 83.7, "TA + ProbSurgery": 82.2}  # rows this recipe leaves out


def about(spec: T5BenchSpec, test_rows: dict[str, int], calibration_rows: dict[str, int]) -> str:
    def source(root: str | None) -> str:
        return f"a local mirror ({root})" if root else "the Hugging Face hub"

    def answers(task: str) -> str:
        return f"answers {' / '.join(LABEL_WORDS[task])}" if task in LABEL_WORDS else "answers a score, Spearman's ρ"

    lines = [f"- `{t}`: {GLUE_TASKS[t].about}; data `{GLUE}` `{t}`, expert `{GLUE_TASKS[t].expert(t)}`; "
             f"{GLUE_TASKS[t].validation} {test_rows[t]:,} rows, calibration pool {calibration_rows[t]}; {answers(t)}"
             for t in spec.tasks]
    test = ("all of each validation split" if spec.test_rows is None else
            f"a seeded subset of {spec.test_rows} validation rows per task")
    return (f"Base `{BASE_MODEL}`, full `T5ForConditionalGeneration` experts, models from {source(spec.models_from)}, "
            f"data from {source(spec.data_from)}. Calibration pool: a seeded subset of each train split (seed "
            f"{spec.seed}), its decoder teacher-forced on the answer the expert was trained to give; scored on {test} "
            "(GLUE's test labels are hidden). Every model answers FusionBench's prompt for the task "
            "(featcal_bench/t5/prompts.py) greedily; an answer counts when, normalised, it is the label word; stsb's "
            "figure is Spearman's ρ of the first number in the answer.\n\n" + "\n".join(lines))


def t5_report(
    results: dict[str, dict[str, Any]], spec: T5BenchSpec, meta: dict[str, Any], study: Study
) -> dict[str, Any]:
    """The report of the runs in `results` (run name → its results JSON), with the paper's figures on every row the
    paper reports. No standard errors or paired comparisons: stsb's figure is a correlation, not a proportion of
    rows answered right."""
    report = build_report(results, spec.tasks, meta, study)
    report.pop("paired", None)
    report.pop("paired_with_start", None)
    add_paper_column(report, PAPER)
    subset = sorted(set(GLUE_TASKS) - set(spec.tasks))
    surgery = ", ".join(f"{k} {v}" for k, v in PAPER_SURGERY.items())
    report["notes"] = [
        "*paper*: the averages the FeatCal paper publishes for FLAN-T5-base over all eight GLUE tasks (256 calibration "
        "examples per task, TA at 0.3, FeatCal λ 0.05, ρ 2.2, α 0.25)"
        + (f"; this build leaves out {', '.join(subset)}, so its averages are over other tasks." if subset else "."),
        "`stsb` is scored by Spearman's ρ, the other tasks by exact-match accuracy; the averages mix them, as the "
        "paper's, so there are no binomial standard errors and no paired comparisons here.",
        f"Not run here: the paper's {surgery} (Surgery trains an adapter on the feature a task's head reads; a "
        "text-to-text model has no such head)."]
    return report
