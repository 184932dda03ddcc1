"""The MiniLM benchmarks (`minilm8`, `demo`): all-MiniLM-L6-v2 fine-tuned here into one expert per task, on tasks
made from offline sources (featcal_bench/minilm/task_data.py); every method against them, one report.

The build graph: the base copy, one dataset and one expert per task, then the spec's competence rule where it states
one (it raises when an expert fails it); each cached on its inputs' digests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

from featcal import merging
from featcal.config import digest_of
from featcal_bench import finetune
from featcal_bench import sources as sources_module
from featcal_bench.catalog import entry
from featcal_bench.layout import BASE, data_dir
from featcal_bench.minilm import build, competence, probe, task_data
from featcal_bench.minilm import spec as spec_module
from featcal_bench.minilm.presets import PRESETS
from featcal_bench.minilm.spec import BenchSpec
from featcal_bench.minilm.task_data import RECIPES
from featcal_bench.recipe import NO_OPTIONS, BuildOptions, Call, Recipe, Report, Stage
from featcal_bench.report import build_report, save_report
from featcal_bench.runs import MethodRun, model_sections
from featcal_bench.sources import locate
from featcal_bench.study import Study, load_study
from flows.pipeline import code_digest
from storage.fingerprint import fingerprint
from storage.rundir import Record

STUDY = Path(__file__).with_name("study.yaml")  # its runs, the report's rows and curves
# FeatCal's hyperparameters for this benchmark, chosen on a validation split (the study's `tuned` setting), and the
# label-free one (`auto`): what the demo and the benchmark scripts run outside the study.
FEATCAL, AUTO = (load_study(STUDY).settings[name] for name in ("tuned", "auto"))


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
        records["check"] = stage(
            bench,
            "check",
            "check/competence",
            digest_of(
                [
                    code,
                    check_code,
                    "check",
                    spec.competence.model_dump(),
                    spec.finetune.max_length,
                    spec.tasks,
                    records["base"]["outputs"],
                    [records[f"{k}/{t}"]["outputs"] for t in spec.tasks for k in ("data", "expert")],
                ]
            ),
        )
    return records


def located_spec(name: str, options: BuildOptions = NO_OPTIONS) -> BenchSpec:
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
        recipe = (
            f"lr {' or '.join(f'{lr:g}' for lr in ft.select.lrs)} and up to {ft.epochs:g} epochs, the best "
            f"checkpoint on the validation split (stopped after {ft.select.patience} epochs without a better one)"
        )
    validation = f", validation {spec.validation}" if spec.validation else ""
    return (
        f"Splits per task: test {spec.test}, calibration pool {spec.calibration}{validation}, "
        f"train ≤ {spec.train_max}; "
        f"experts: full fine-tune, {recipe}, batch {ft.batch_size}, ≤ {ft.max_length} tokens, seed {spec.seed}.\n\n"
        + "\n".join(lines)
    )


def write_report(bench: Path, spec: BenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    return save_report(bench, spec.name, build_report(results, spec.tasks, meta, study), results, out_dir, study)


RECIPE = Recipe(
    entry=entry("minilm"),
    spec=BenchSpec,
    options=frozenset({"spam_assassin", "wordnet"}),
    located=located_spec,
    build=build_graph,
    build_modules=(build, finetune, sources_module, spec_module, task_data),
    # build.py's stage map is inferred as plain functions; its bytes key the experts, so it stays unannotated
    stages={**cast("dict[str, Stage]", build.BUILD_STAGES), "check": competence.check},
    study=STUDY,
    run_config=pipeline_config,
    method_modules=(sys.modules[__name__],),
    report=Report(title=lambda spec: f"FeatCal benchmark `{spec.name}`: all-MiniLM-L6-v2, {len(spec.tasks)} tasks",
                  about=about, write=write_report, modules=(sys.modules[__name__],)),
)
