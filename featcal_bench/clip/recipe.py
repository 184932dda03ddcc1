"""The CLIP ViT-B/32 eight-task recipe (`clip-vit-b32-ta8`): the CLIPModel, its vision tower as the base, one dataset
and one expert per task, from the hub or a local mirror; the paper's method runs, TA + Surgery and TA + ProbSurgery,
scored with zero-shot heads; one report with the paper's figures beside ours."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal.config import digest_of
from featcal_bench import mirror
from featcal_bench.catalog import entry
from featcal_bench.clip import build, methods, prompts, report
from featcal_bench.clip import spec as spec_module
from featcal_bench.clip.estimate import clip_cost_estimate
from featcal_bench.clip.spec import BASE_MODEL, CLIP_PRESETS, ClipBenchSpec
from featcal_bench.estimate import rows_about, split_sizes, write_estimate
from featcal_bench.mirror import mirrored_task_stages
from featcal_bench.recipe import Call, Recipe, Report
from featcal_bench.report import save_report
from featcal_bench.study import Study
from storage.fingerprint import fingerprint
from storage.rundir import Record


def build_graph(bench: Path, spec: ClipBenchSpec, stage: Call, code: str, memo: Path) -> dict[str, Record]:
    """The CLIPModel and its vision tower, then one dataset and one expert per task, each cached on its source's
    fingerprint (a mirror's content, or a hub id's name)."""
    records = {"clip": stage(bench, "clip-clip", "clip", digest_of(
        [code, "clip", fingerprint(spec.model_source(BASE_MODEL), memo)]))}
    records["base"] = stage(
        bench, "clip-base", "base", digest_of([code, "base", records["clip"]["outputs"][build.CLIP]])
    )
    records.update(mirrored_task_stages(bench, spec, stage, "clip", code, memo))
    return records


def write_report(bench: Path, spec: ClipBenchSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    test_rows = {t: r["test"] for t, r in split_sizes(bench, spec.tasks).items()}
    return save_report(bench, spec.name, report.clip_report(results, spec, meta, test_rows, study), results, out_dir,
                       study)


RECIPE = Recipe(
    entry=entry("clip"),
    spec=ClipBenchSpec,
    options=frozenset({"models_from", "data_from", "tasks", "test_rows"}),
    located=mirror.located(CLIP_PRESETS),
    build=build_graph,
    # Not the MiniLM build: edits to its fine-tuning must not copy every model and dataset again.
    build_modules=(build, prompts, spec_module, mirror),
    stages=build.CLIP_BUILD_STAGES,
    study=Path(__file__).with_name("study.yaml"),
    run_config=methods.pipeline_config,
    method_modules=(methods, prompts, spec_module),
    report=Report(
        title=lambda spec: f"FeatCal benchmark `{spec.name}`: CLIP ViT-B/32, {len(spec.tasks)} tasks, zero-shot heads",
        about=rows_about(report.about),
        write=write_report,
        modules=(report, prompts, spec_module, sys.modules[__name__]),
    ),
    run_inputs=lambda spec: ["clip", "base", *(f"{k}/{t}" for t in spec.tasks for k in ("data", "expert"))],
    estimate=lambda bench, spec: write_estimate(bench, clip_cost_estimate(bench, split_sizes(bench, spec.tasks))),
    cache_surgery_features=True,
    write_configs=True,
)
