"""Why FeatCal closes less of the gap on MiniLM-8 than on CLIP: hyperparameters, token weighting, the
pooler, tasks that share a source, few examples; measured on each task's validation split where the benchmark
has one (else on 200 rows of its *train* split, as the committed sweep, run before benchmarks held validation
rows out, was), never on test.

    python benchmarks/minilm8_tuning.py BENCH_DIR OUT_DIR [VARIANT ...]

Each variant is a pipeline run with 64 calibration examples per task unless it names another number or a
subset of the tasks (the sweep must be cheap); the tables are written to OUT_DIR/tuning.md and printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from featcal.config import config_from_dict
from featcal.data import InputBuilder, load_split, pick_examples, row_batches
from featcal.modeling import task_model
from featcal_bench.minilm.recipe import pipeline_config
from featcal_bench.minilm.spec import BenchSpec
from featcal_bench.runs import MethodRun
from flows.pipeline import run_pipeline
from storage.checkpoint import CanonicalCheckpoint

EXAMPLES = 64
VALIDATION = 200
DISTINCT_SOURCES = ["noun_category", "party", "sentiment", "spam"]  # WordNet, debates, Rotten Tomatoes, e-mail
WORDNET_ONLY = ["gloss_match", "gloss_pos", "noun_category", "verb_category"]
VARIANTS: dict[str, dict] = {
    "default": {},
    "rho1": {"rho": 1.0},
    "rho1.5": {"rho": 1.5},
    "lambda0.005": {"lambda": 0.005},
    "lambda0.5": {"lambda": 0.5},
    "alpha0.5": {"alpha": 0.5},
    "alpha1": {"alpha": 1.0},
    "no_pooled_emphasis": {"pooled_token_weight": None},
    "lambda0.2": {"lambda": 0.2},
    "rho3": {"rho": 3.0},
    "rho3_lambda0.5": {"rho": 3.0, "lambda": 0.5},
    "lambda2": {"lambda": 2.0},
    # Control: is the gain only the anchor's extrapolation? TA at 3 × 0.3 (ρ 3's anchor), then FeatCal.
    "ta_scaling0.9": {"merge_scaling": 0.9},
    # FeatCal on a stronger merge: which task-arithmetic scale should FeatCal start from?
    "ta_scaling0.6": {"merge_scaling": 0.6},
    "ta_scaling0.6_rho3_lambda0.5": {"merge_scaling": 0.6, "rho": 3.0, "lambda": 0.5},
    "ta_scaling0.9_rho1": {"merge_scaling": 0.9, "rho": 1.0},
    "ta_scaling0.9_lambda0.5": {"merge_scaling": 0.9, "lambda": 0.5},
    # Why so little of the gap: do tasks that read the same kind of text compete for the shared weights?
    # Two 4-task benchmarks, each task from its own source vs all four from WordNet glosses; noun_category is
    # in both, so its accuracy is compared with and without same-source neighbours.
    "distinct_sources": {"tasks": DISTINCT_SOURCES, "rho": 3.0, "lambda": 0.5},
    "wordnet_only": {"tasks": WORDNET_ONLY, "rho": 3.0, "lambda": 0.5},
    "distinct_sources_defaults": {"tasks": DISTINCT_SOURCES},
    "wordnet_only_defaults": {"tasks": WORDNET_ONLY},
    # Why 8 examples keep less of the gain: fewer tokens than inputs of the wide modules, so λ and the anchor
    # decide more of each solve; does a stronger λ suit that size?
    "n8_rho3_lambda0.5": {"examples": 8, "rho": 3.0, "lambda": 0.5},
    "n8_rho3_lambda2": {"examples": 8, "rho": 3.0, "lambda": 2.0},
    "n8_rho3_lambda0.1": {"examples": 8, "rho": 3.0, "lambda": 0.1},
}
BASELINE_SCALING = 0.3  # the benchmark's task arithmetic: gap closed is also reported against it
NOT_FEATCAL = ("merge_scaling", "examples", "tasks")  # variant keys that are not FeatCal hyperparameters


def validation_config(bench: Path, variant: dict) -> dict:
    spec = BenchSpec.load(bench)
    if "tasks" in variant:
        spec = spec.model_copy(update={"tasks": variant["tasks"]})
    featcal = {k: v for k, v in variant.items() if k not in NOT_FEATCAL}
    raw = pipeline_config(bench, spec, MethodRun("task_arithmetic", "featcal", examples=variant.get("examples", EXAMPLES),
                                                 models=("merged", "calibrated", "expert"), featcal=featcal,
                                                 scaling=variant.get("merge_scaling", BASELINE_SCALING)))
    for source in raw["evaluation"]["data"].values():
        source["split"] = "validation" if spec.validation else "train"
    if not spec.validation:
        raw["evaluation"]["max_examples"] = VALIDATION
    raw["runtime"]["threads"] = 1
    return raw


@torch.inference_mode()
def expert_pooler_accuracy(run_dir: Path, cfg) -> float:
    """Calibrated body, but each task's own fine-tuned pooler (does the uncalibrated pooler cost accuracy?)."""
    accs = []
    for task in cfg.tasks:
        expert = task_model(cfg.experts[task])
        calibrated = task_model(cfg.experts[task], _checkpoint(run_dir, cfg))
        calibrated.bert.pooler.load_state_dict(expert.bert.pooler.state_dict())
        source = cfg.evaluation.data[task]
        ds = pick_examples(load_split(source, task), VALIDATION, cfg.calibration.seed, task)
        builder = InputBuilder(cfg.base, ("input_ids", "attention_mask", "token_type_ids"), source,
                               cfg.calibration.max_length, ds.column_names, task)
        correct = sum(int((calibrated(**builder(rows)).logits.argmax(-1) == torch.tensor(rows["label"])).sum())
                      for rows in row_batches(ds, 64))
        accs.append(correct / len(ds))
    return sum(accs) / len(accs)


def _checkpoint(run_dir: Path, cfg) -> CanonicalCheckpoint:
    from featcal.modeling import Skeleton

    return CanonicalCheckpoint(run_dir / "calibrated", Skeleton.from_checkpoint(cfg.experts[cfg.tasks[0]]).adapter)


def runnable(bench: Path, names: list[str], named: bool) -> list[str]:
    """The variants to run: a task-subset variant needs its tasks in the benchmark (the subsets were drawn from the
    old 8-task set). Named ones must fit, else stop before any run; of the default all, those that do not fit are
    left out, and said so."""
    tasks = set(BenchSpec.load(bench).tasks)
    unfit = [n for n in names if n not in VARIANTS or not set(VARIANTS[n].get("tasks", [])) <= tasks]
    if named and unfit:
        raise SystemExit(f"variants {unfit}: unknown, or name tasks this benchmark lacks (it has {sorted(tasks)})")
    if unfit:
        print(f"left out, their tasks are not all in this benchmark: {', '.join(unfit)}", file=sys.stderr)
    return [n for n in names if n not in unfit]


def main(bench: Path, out: Path, names: list[str]) -> None:
    for name in names:
        cfg = config_from_dict(validation_config(bench, VARIANTS[name]), root=bench, source=name)
        run_pipeline(cfg, out / name)
        summary = json.loads((out / name / "report.json").read_text())["summary"]
        avg = summary["average_accuracy"]
        row = {"variant": name, **VARIANTS[name], "merged": avg["merged"], "calibrated": avg["calibrated"],
               "expert": avg["expert"], "gap_closed": summary.get("gap_closed"),
               "last_drift": summary["average_drift"]["calibrated"][-1],
               "per_task": {t: r["accuracy"] for t, r in json.loads((out / name / "report.json").read_text())["tasks"].items()}}
        if name == "default":
            row["calibrated_with_expert_pooler"] = expert_pooler_accuracy(out / name, cfg)
        print(json.dumps(row), flush=True)
        with open(out / "tuning.jsonl", "a") as fh:  # one line per finished variant: several sweeps add up
            fh.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in (out / "tuning.jsonl").read_text().splitlines()]
    (out / "tuning.md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = [f"# FeatCal hyperparameters on MiniLM-8: validation sweep ({EXAMPLES} calibration examples/task)", "",
             f"Validation = each task's validation split where the benchmark has one, else {VALIDATION} seeded rows "
             "of its train split (`minilm8_tuning.md`: the build before `minilm8_tasks.md`). Never the test split.",
             "Task-averaged accuracy (%); defaults λ 0.05, ρ 2.2, α 0.25, pooled-token weight 0.01.", "",
             "`gap closed` is against the TA that FeatCal started from; `vs TA 0.3` against the benchmark's TA "
             f"(scale {BASELINE_SCALING}), from the rows that use it.", "",
             "| variant | changed | TA | TA + FeatCal | experts | gap closed | vs TA 0.3 | drift at last boundary |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    subsets = [r for r in rows if "tasks" in VARIANTS[r["variant"]]]
    rows = [r for r in rows if "tasks" not in VARIANTS[r["variant"]]]
    reference = [r["merged"] for r in rows if VARIANTS[r["variant"]].get("merge_scaling", BASELINE_SCALING) == BASELINE_SCALING]
    for r in rows:
        changed = ", ".join(f"{k} {v}" for k, v in VARIANTS[r["variant"]].items()) or "—"
        versus = (f"{100 * (r['calibrated'] - reference[-1]) / (r['expert'] - reference[-1]):.1f} %" if reference else "")
        lines.append(f"| {r['variant']} | {changed} | {100 * r['merged']:.1f} | {100 * r['calibrated']:.1f} | "
                     f"{100 * r['expert']:.1f} | {100 * r['gap_closed']:.1f} % | {versus} | {r['last_drift']:.3f} |")
    pooler = [r for r in rows if "calibrated_with_expert_pooler" in r]
    if pooler:
        lines += ["", f"Default calibrated body with each task's own fine-tuned pooler: "
                      f"{100 * pooler[0]['calibrated_with_expert_pooler']:.1f} % (vs {100 * pooler[0]['calibrated']:.1f} %)."]
    if subsets:
        lines += ["", "## Tasks that share a source, against tasks that do not (4-task benchmarks, same experts)", "",
                  f"`distinct_sources` = {', '.join(DISTINCT_SOURCES)} (four sources); `wordnet_only` = "
                  f"{', '.join(WORDNET_ONLY)} (all WordNet glosses). noun_category is in both.", "",
                  "| variant | changed | TA | TA + FeatCal | experts | gap closed | noun_category: TA → FeatCal (expert) "
                  "| drift at last boundary |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in subsets:
            changed = ", ".join(f"{k} {v}" for k, v in VARIANTS[r["variant"]].items() if k != "tasks") or "—"
            noun = r["per_task"]["noun_category"]
            lines.append(f"| {r['variant']} | {changed} | {100 * r['merged']:.1f} | {100 * r['calibrated']:.1f} | "
                         f"{100 * r['expert']:.1f} | {100 * r['gap_closed']:.1f} % | {100 * noun['merged']:.1f} → "
                         f"{100 * noun['calibrated']:.1f} ({100 * noun['expert']:.1f}) | {r['last_drift']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    bench_dir = Path(sys.argv[1]).resolve()
    main(bench_dir, Path(sys.argv[2]).resolve(), runnable(bench_dir, sys.argv[3:] or list(VARIANTS), bool(sys.argv[3:])))
