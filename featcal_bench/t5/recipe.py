"""The FLAN-T5-base GLUE eight-task recipe (`flan-t5-base-glue8`): the base, one dataset rendered into prompts and one
expert per task, from the hub or a local mirror; the paper's method runs, scored text to text; one report with the
paper's figures beside ours."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal.config import digest_of
from featcal_bench import mirror
from featcal_bench.estimate import split_sizes, write_estimate
from featcal_bench.method import paper_method_runs
from featcal_bench.recipe import BuildOptions, Call, Preset, Recipe, Report
from featcal_bench.stages import mirrored_task_stages, save_report
from featcal_bench.t5 import build, methods, prompts, report, spec as spec_module
from featcal_bench.t5.estimate import t5_cost_estimate
from featcal_bench.t5.spec import BASE_MODEL, T5_PRESETS, T5BenchSpec
from storage.fingerprint import fingerprint
from storage.rundir import Record


def build_graph(bench: Path, spec: T5BenchSpec, stage: Call, code: str, memo: Path) -> dict[str, Record]:
    """The base, then one dataset and one expert per task, each cached on its source's fingerprint (a mirror's
    content, or a hub id's name)."""
    records = {"base": stage(bench, "t5-base", "base", digest_of(
        [code, "base", fingerprint(spec.model_source(BASE_MODEL), memo)]))}
    records.update(mirrored_task_stages(bench, spec, stage, "t5", code, memo))
    return records


def about(bench: Path, spec: T5BenchSpec) -> str:
    rows = split_sizes(bench, spec.tasks)
    return report.about(spec, {t: r["test"] for t, r in rows.items()}, {t: r["calibration"] for t, r in rows.items()})


def write_report(bench: Path, spec: T5BenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None) -> tuple[list[str], dict[str, Any]]:
    return save_report(bench, spec.name, report.t5_report(results, spec, meta), results, out_dir, report.CURVES)


def t5_estimate(bench: Path, spec: T5BenchSpec) -> str:
    """What running the built benchmark will cost here, also written to its estimate.md."""
    return write_estimate(bench, t5_cost_estimate(bench, split_sizes(bench, spec.tasks)))


def located(name: str, options: BuildOptions) -> T5BenchSpec:
    return mirror.preset_spec(T5_PRESETS[name], options.models_from, options.data_from, options.tasks,
                              options.test_rows)


RECIPE = Recipe(
    name="t5",
    spec=T5BenchSpec,
    presets={"flan-t5-base-glue8": Preset("the paper's FLAN-T5-base on 8 GLUE tasks, text to text",
                                          "`bench build` prints it: passes timed here on the base (estimate.md)")},
    access="hub or mirror",
    options=frozenset({"models_from", "data_from", "tasks", "test_rows"}),
    located=located,
    build=build_graph,
    # Not the MiniLM build: edits to its fine-tuning must not copy every model and dataset again.
    build_modules=(mirror, build, prompts, spec_module),
    stages=build.T5_BUILD_STAGES,
    runs=lambda spec: paper_method_runs(),
    run_config=methods.pipeline_config,
    method_modules=(build, methods, prompts, spec_module),
    report=Report(
        title=lambda spec: f"FeatCal benchmark `{spec.name}`: FLAN-T5-base, {len(spec.tasks)} GLUE tasks, text to text",
        about=about, write=write_report, modules=(report, prompts, spec_module, sys.modules[__name__])),
    estimate=t5_estimate,
    write_configs=True,
)
