"""The CLIP ViT-B/32 benchmark as Prefect flows: `build` (the CLIPModel, its vision tower, one dataset and one expert
per task, from the hub or a local mirror) and `run` (the paper's method runs, one report with its figures beside ours).

The stages run through `flows.bench`'s machinery: each a Prefect task keyed by our own digest of its inputs and
trusted only when its outputs on disk still match their record (tasks.record.recorded).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow

from featcal.bench import clip_build, clip_methods, clip_prompts, clip_report, clip_spec, methods, mirror, surgery, surgery_run
from featcal.bench import report as bench_report
from featcal.bench.clip_estimate import clip_cost_estimate
from featcal.bench.clip_spec import BASE_MODEL, CLIP_TASKS, ClipBenchSpec
from featcal.bench.estimate import CONFIGS, split_sizes, write_estimate
from featcal.config import digest_of
from flows import bench as bench_flow
from flows.bench import (STAGES, Call, built_outputs, chosen_runs, method_and_report_stages, prefect_call, prepared_bench,
                         mirrored_task_stages, save_report, write_run_configs)
from flows.pipeline import code_digest, code_version, machine
from storage.atomic import read_json
from storage.fingerprint import fingerprint
from storage.rundir import Record

# Not featcal/bench/build.py: the CLIP build takes only its directory names, and edits to the MiniLM fine-tuning there
# must not copy every model and dataset again.
BUILD_MODULES = (clip_build, clip_prompts, clip_spec, mirror)
METHOD_MODULES = (clip_methods, clip_prompts, clip_spec, methods, surgery, surgery_run)
METHODS_MODULE = "featcal.bench.clip_methods"  # what each method run's process runs


# ---- bench build ---------------------------------------------------------------------------------
@flow(name="featcal-bench-clip-build", flow_run_name="bench build · {bench_dir}")
def clip_build_flow(bench_dir: str, spec: ClipBenchSpec) -> dict[str, Record]:
    return clip_build_stages(Path(bench_dir), spec, prefect_call)


def clip_build_stages(bench: Path, spec: ClipBenchSpec, stage: Call) -> dict[str, Record]:
    """The CLIPModel and its vision tower, then one dataset and one expert per task, each cached on its source's
    fingerprint (a mirror's content, or a hub id's name); then every method run's pipeline config under configs/."""
    bench, memo = prepared_bench(bench, spec)
    code = code_digest(Path(m.__file__) for m in BUILD_MODULES)
    records = {"clip": stage(bench, "clip-clip", "clip", digest_of(
        [code, "clip", fingerprint(spec.model_source(BASE_MODEL), memo)]))}
    records["base"] = stage(bench, "clip-base", "base", digest_of(
        [code, "base", records["clip"]["outputs"][clip_build.CLIP]]))
    records.update(mirrored_task_stages(bench, spec, stage, "clip", code, memo, lambda t: CLIP_TASKS[t].expert))
    write_run_configs(bench / CONFIGS, {name: clip_methods.pipeline_config(bench, spec, run)
                                        for name, run in clip_methods.clip_method_runs().items()})
    return records


def build_clip_bench(spec: ClipBenchSpec, out: str | Path) -> tuple[Path, str]:
    """The built benchmark's directory, and what running it will cost here (also written to its estimate.md)."""
    bench = Path(out).resolve()
    clip_build_flow(str(bench), spec)
    return bench, write_estimate(bench, clip_cost_estimate(bench, split_sizes(bench, spec.tasks)))


# ---- bench run -----------------------------------------------------------------------------------
def write_clip_report(bench: Path, runs: list[str], out_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    spec = ClipBenchSpec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    rows = split_sizes(bench, spec.tasks)
    test_rows = {t: r["test"] for t, r in rows.items()}
    meta = {"title": f"FeatCal benchmark `{spec.name}`: CLIP ViT-B/32, {len(spec.tasks)} tasks, zero-shot heads",
            "about": clip_report.about(spec, test_rows, {t: r["calibration"] for t, r in rows.items()}),
            "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}", "spec": spec.model_dump(mode="json")}
    report = clip_report.clip_report(results, spec, meta, test_rows)
    return save_report(bench, spec.name, report, results, out_dir, clip_report.CURVES)


STAGES.update({**clip_build.CLIP_BUILD_STAGES, "clip-report": write_clip_report})


@flow(name="featcal-bench-clip-run", flow_run_name="bench run · {bench_dir}")
def clip_run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None) -> dict[str, Record]:
    return clip_run_stages(Path(bench_dir), runs, out_dir, prefect_call)


def clip_run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Every method run (each cached on the built models and data and on the code), then the report."""
    bench = bench.resolve()
    spec = ClipBenchSpec.load(bench)
    inputs = built_outputs(bench, ["clip", "base", *(f"{k}/{t}" for t in spec.tasks for k in ("data", "expert"))])
    code = [code_version(), code_digest(Path(m.__file__) for m in METHOD_MODULES)]
    names = chosen_runs(runs, clip_methods.clip_method_runs(), "CLIP benchmark")
    report_files = [*(Path(m.__file__) for m in (bench_report, clip_report, clip_prompts, clip_spec, bench_flow)),
                    Path(__file__)]
    return method_and_report_stages(bench, names, inputs, code, METHODS_MODULE, ("clip-report", report_files), out_dir,
                                    stage)
