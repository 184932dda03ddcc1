"""The MergeBench recipe on Llama-3.2-3B (`mergebench-llama-3.2-3b`): the base, one dataset rendered into text and one
expert per domain, from the hub or a local mirror; TA, TIES, TA + FeatCal, RegMean, RegMean++ at MergeBench's
settings; one report of held-out token losses with the paper's figures beside ours."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal_bench import mirror
from featcal_bench.catalog import entry
from featcal_bench.estimate import rows_about
from featcal_bench.llm import build, methods, report
from featcal_bench.llm import spec as spec_module
from featcal_bench.llm.spec import BASE_MODEL, LLM_PRESETS, LlmBenchSpec
from featcal_bench.mirror import mirrored_build
from featcal_bench.recipe import Recipe, Report
from featcal_bench.report import save_loss_report
from featcal_bench.study import Study


def write_report(bench: Path, spec: LlmBenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    """`report/{name}.json` and `.md` (also copied to `out_dir` where given): the report stage's outputs."""
    made = report.llm_report(results, spec, meta, study)
    return save_loss_report(bench, spec.name, made, results, out_dir, report.markdown(made))


RECIPE = Recipe(
    entry=entry("mergebench"),
    spec=LlmBenchSpec,
    options=frozenset({"models_from", "data_from", "tasks", "test_rows"}),
    located=mirror.located(LLM_PRESETS),
    build=mirrored_build("llm"),
    build_modules=(mirror, build, spec_module),
    stages=build.LLM_BUILD_STAGES,
    study=Path(__file__).with_name("study.yaml"),
    run_config=methods.pipeline_config,
    method_modules=(build, methods, spec_module),
    report=Report(
        title=lambda spec: (f"FeatCal benchmark `{spec.name}`: {BASE_MODEL}, {len(spec.tasks)} MergeBench domains, "
                            "held-out token loss"),
        about=rows_about(report.about), write=write_report, modules=(report, spec_module, sys.modules[__name__])),
    write_configs=True,
)
