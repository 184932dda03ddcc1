"""The MergeBench benchmark's report: per method, the next-token loss on each domain's held-out text (lower is
better), its average and the loss gap closed, with the paper's figures beside ours, labelled as theirs and as another
metric (an average of MergeBench's harness scores, which this recipe does not compute).

The table's rows, costs and next-token accuracies come from the benchmark report (featcal_bench.report), whose
"accuracy" is here each run's next-token accuracy; the losses are added to its rows."""

from __future__ import annotations

import math
from typing import Any

from featcal_bench.llm.spec import (
    BASE_MODEL,
    DOMAINS,
    MAX_LENGTH,
    PAPER,
    REGMEAN_OFF_DIAGONAL,
    REGMEAN_PP_OFF_DIAGONAL,
    TA_SCALING,
    TIES_TOP_K,
    LlmBenchSpec,
)
from featcal_bench.report import add_paper_column, language_model_report
from featcal_bench.study import Study

PAPER_COLUMN = "paper: harness average, theirs (%)"


def about(spec: LlmBenchSpec, test_rows: dict[str, int], calibration_rows: dict[str, int]) -> str:
    def source(root: str | None) -> str:
        return f"a local mirror ({root})" if root else "the Hugging Face hub"

    lines = [f"- `{d}`: {DOMAINS[d].about}; data `{DOMAINS[d].dataset(d)}`, expert `{DOMAINS[d].expert(d)}`; "
             f"calibration pool {calibration_rows[d]} rows, held out {test_rows[d]:,} rows" for d in spec.tasks]
    return (
        f"Base `{BASE_MODEL}`, MergeBench's full fine-tunes as experts, models from {source(spec.models_from)}, "
        f"data from {source(spec.data_from)}. Each domain's MergeBench held-out set is rendered as its data-using "
        f"merges read it (an Alpaca-style prompt, then the response), cut at {MAX_LENGTH} tokens, and split by a "
        f"seeded permutation (seed {spec.seed}): a calibration pool of {spec.calibration} rows, the rest held out "
        "for evaluation (disjoint). Every model is scored by its mean next-token loss in nats over every real token "
        f"of the held-out text. Settings (MergeBench's): task arithmetic {TA_SCALING}, TIES top {TIES_TOP_K:.0%} of "
        f"each task vector and {TA_SCALING}, RegMean off-diagonal {REGMEAN_OFF_DIAGONAL}, RegMean++ "
        f"{REGMEAN_PP_OFF_DIAGONAL}; FeatCal λ 0.05, ρ 2.2, α 0.25 (the paper's).\n\n" + "\n".join(lines)
    )


def llm_report(
    results: dict[str, dict[str, Any]], spec: LlmBenchSpec, meta: dict[str, Any], study: Study
) -> dict[str, Any]:
    """`language_model_report` of the runs in `results` (run name → its results JSON), with, where the paper reports
    the row, `paper` (their harness average, a different metric)."""
    report = language_model_report(results, spec.tasks, meta, study)
    add_paper_column(report, PAPER)
    report["harness_tasks"] = {d: {"lm_eval": list(DOMAINS[d].harness_tasks), "other": DOMAINS[d].other_harness}
                               for d in spec.tasks}
    report["notes"] = notes(spec)
    return report


def notes(spec: LlmBenchSpec) -> list[str]:
    subset = sorted(set(DOMAINS) - set(spec.tasks))
    lm_eval = "; ".join(f"{d}: {', '.join(DOMAINS[d].harness_tasks)}" for d in spec.tasks if DOMAINS[d].harness_tasks)
    others = "; ".join(f"{d}: {DOMAINS[d].other_harness}" for d in spec.tasks if DOMAINS[d].other_harness)
    return [
        f"*{PAPER_COLUMN}*: the FeatCal paper's figures for {BASE_MODEL} on MergeBench, **theirs, and a different "
        "metric**: an average of MergeBench's harness scores over its five domains (higher is better), not a token "
        "loss. They sit beside our rows for reference, not for comparison number for number; the TA scaling, "
        "calibration size and averaging behind them are not published in what we could read"
        + (f". This build also leaves out {', '.join(subset)}." if subset else "."),
        "Not run by this recipe: MergeBench's harness scores (lm-evaluation-harness tasks "
        + (lm_eval or "none for these domains") + (f"; other harnesses, {others}" if others else "")
        + "). `harness_tasks` in the report's JSON lists them per domain.",
        "Where this differs from MergeBench: its TA and TIES keep the embeddings and LM head at the base's values and "
        "its RegMean keeps the base's embeddings, where here they are merged (or averaged) like every other tensor; "
        f"FeatCal's paper does not say how many calibration rows it used (here {spec.calibration} per domain; "
        "MergeBench's RegMean reads all of each ~1,000-row set); the loss counts prompt tokens as well as response "
        "tokens.",
    ]


def markdown(report: dict[str, Any]) -> str:
    """The loss table (lower is better), our next-token accuracy, the paper's column and the costs, then the notes."""
    tasks, rows = report["tasks"], report["methods"]
    paper = any("paper" in r for r in rows)
    head = [*tasks, "average loss (perplexity)", "gap closed (loss)", "next-token accuracy (%)",
            *([PAPER_COLUMN] if paper else []), "time (s)", "peak RSS (MiB)"]
    lines = [f"# {report.get('title', 'Benchmark')}", "", str(report.get("about", "")), "",
             "## Next-token loss on each domain's held-out text (nats, lower is better)", "",
             "| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['loss'][t]:.4f}" for t in tasks]
        cells += [f"{r['average_loss']:.4f} ({math.exp(r['average_loss']):.2f})",
                  f"{100 * r['gap_closed_loss']:.1f} %" if "gap_closed_loss" in r else "",
                  f"{100 * r['average']:.1f}",
                  *([f"{100 * r['paper']:.1f}" if "paper" in r else ""] if paper else []),
                  f"{r['seconds']:.1f}" if "seconds" in r else "",
                  f"{r['peak_rss_mib']:.0f}" if "peak_rss_mib" in r else ""]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "*gap closed (loss)*: (TA − row) / (TA − experts) on the average loss: 0 at task arithmetic, 100 % "
                  "at the experts. *next-token accuracy*: the share of held-out tokens each model predicts first, "
                  "averaged over domains."]
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"
