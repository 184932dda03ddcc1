"""The FLAN-T5-base GLUE eight-task recipe (`flan-t5-base-glue8`): the base, one dataset rendered into prompts and one
expert per task, from the hub or a local mirror; the paper's method runs, scored text to text; one report with the
paper's figures beside ours."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal_bench import mirror
from featcal_bench.catalog import entry
from featcal_bench.estimate import rows_about, split_sizes, write_estimate
from featcal_bench.mirror import mirrored_build
from featcal_bench.recipe import Recipe, Report
from featcal_bench.report import save_report
from featcal_bench.study import Study
from featcal_bench.t5 import build, methods, prompts, report
from featcal_bench.t5 import spec as spec_module
from featcal_bench.t5.estimate import t5_cost_estimate
from featcal_bench.t5.spec import T5_PRESETS, T5BenchSpec


def write_report(bench: Path, spec: T5BenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    return save_report(bench, spec.name, report.t5_report(results, spec, meta, study), results, out_dir, study)


def t5_estimate(bench: Path, spec: T5BenchSpec) -> str:
    """What running the built benchmark will cost here, also written to its estimate.md."""
    return write_estimate(bench, t5_cost_estimate(bench, split_sizes(bench, spec.tasks)))


RECIPE = Recipe(
    entry=entry("t5"),
    spec=T5BenchSpec,
    options=frozenset({"models_from", "data_from", "tasks", "test_rows"}),
    located=mirror.located(T5_PRESETS),
    build=mirrored_build("t5"),
    # Not the MiniLM build: edits to its fine-tuning must not copy every model and dataset again.
    build_modules=(mirror, build, prompts, spec_module),
    stages=build.T5_BUILD_STAGES,
    study=Path(__file__).with_name("study.yaml"),
    run_config=methods.pipeline_config,
    method_modules=(build, methods, prompts, spec_module),
    report=Report(
        title=lambda spec: f"FeatCal benchmark `{spec.name}`: FLAN-T5-base, {len(spec.tasks)} GLUE tasks, text to text",
        about=rows_about(report.about),
        write=write_report,
        modules=(report, prompts, spec_module, sys.modules[__name__]),
    ),
    estimate=t5_estimate,
    write_configs=True,
)
