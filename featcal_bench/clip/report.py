"""The CLIP benchmark's report: the benchmark report's tables (featcal_bench.report) over the CLIP method runs, with
the paper's published figures in a column beside ours."""

from __future__ import annotations

from typing import Any

from featcal_bench.clip.prompts import CLASS_NAMES, TEMPLATES
from featcal_bench.clip.spec import BASE_MODEL, CLIP_TASKS, ClipBenchSpec
from featcal_bench.report import add_paper_column, build_report
from featcal_bench.study import Study

# The paper's averages over the eight tasks (FeatCal, arXiv 2605.13030; CLIP ViT-B/32, 256 examples per task unless
# the sample-efficiency row says otherwise), in %. docs/design.md §5 keeps the same figures.
PAPER = {"experts (individual)": 90.3, "zero-shot": 48.2, "task arithmetic": 67.5, "TIES": 72.2, "RegMean": 82.4,
         "RegMean++": 84.4, "TA + Surgery": 77.0, "TA + ProbSurgery": 78.8, "TA + FeatCal": 85.5}
PAPER_SAMPLE_EFFICIENCY = {8: 82.9, 256: 85.5}


def about(spec: ClipBenchSpec, test_rows: dict[str, int], calibration_rows: dict[str, int]) -> str:
    def source(root: str | None) -> str:
        return f"a local mirror ({root})" if root else "the Hugging Face hub"

    lines = [f"- `{t}`: {CLIP_TASKS[t].about}; data `{CLIP_TASKS[t].dataset}`, expert `{CLIP_TASKS[t].expert}`; "
             f"test {test_rows[t]:,} rows, calibration pool {calibration_rows[t]}; {len(CLASS_NAMES[t])} class names × "
             f"{len(TEMPLATES[t])} prompt template(s)" for t in spec.tasks]
    test = (
        "all of each test split"
        if spec.test_rows is None
        else f"a seeded subset of {spec.test_rows} test rows per task"
    )
    return (f"Base `{BASE_MODEL}` (its vision tower; the text tower makes the zero-shot heads), head-less "
            f"`CLIPVisionModel` experts, models from {source(spec.models_from)}, data from {source(spec.data_from)}. "
            f"Calibration pool: a seeded subset of each train split (seed {spec.seed}); scored on {test}. Every model "
            "is scored zero-shot: cosine to the class names in the task's prompt templates (the task-arithmetic "
            "authors' templates, FusionBench's class names: featcal_bench/clip/prompts.py).\n\n" + "\n".join(lines))


def clip_report(results: dict[str, dict[str, Any]], spec: ClipBenchSpec, meta: dict[str, Any],
                test_rows: dict[str, int], study: Study) -> dict[str, Any]:
    """The report of the runs in `results` (run name → its results JSON), with the paper's figures: `paper` on every
    row the paper reports, and its sample-efficiency points."""
    report = build_report(results, spec.tasks, {**meta, "test_rows": test_rows}, study)
    add_paper_column(report, PAPER)
    report["paper_sample_efficiency"] = {
        "curve": "featcal",
        "points": {n: v / 100 for n, v in PAPER_SAMPLE_EFFICIENCY.items()},
    }
    subset = sorted(set(CLIP_TASKS) - set(spec.tasks))
    report["notes"] = [
        "*paper*: the averages the FeatCal paper publishes for CLIP ViT-B/32 over all eight tasks (256 calibration "
        "examples per task, TA at 0.3, FeatCal λ 0.05, ρ 2.2, α 0.25)"
        + (f"; this build leaves out {', '.join(subset)}, so its averages are over other tasks." if subset else ".")]
    if "ta_surgery" in results or "ta_probsurgery" in results:
        report["notes"].append(
            "TA + Surgery and TA + ProbSurgery train their adapters on the image feature the zero-shot head reads, "
            "from features of the merged model computed once per calibration image (the original protocols' batches "
            "and objectives, far fewer forward passes), so their times are lower bounds of the originals'.")
    return report
