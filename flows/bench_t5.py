"""The FLAN-T5-base GLUE benchmark as Prefect flows: `build` (the base, one dataset rendered into prompts and one
expert per task, from the hub or a local mirror) and `run` (the paper's method runs, one report with its figures
beside ours).

The stages run through `flows.bench`'s machinery: each a Prefect task keyed by our own digest of its inputs and
trusted only when its outputs on disk still match their record (tasks.record.recorded).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow

from featcal.bench import methods, mirror, t5_build, t5_methods, t5_prompts, t5_report, t5_spec
from featcal.bench import report as bench_report
from featcal.bench.estimate import CONFIGS, split_sizes, write_estimate
from featcal.bench.methods import paper_method_runs
from featcal.bench.t5_estimate import t5_cost_estimate
from featcal.bench.t5_spec import BASE_MODEL, GLUE_TASKS, T5BenchSpec
from featcal.config import digest_of
from flows import bench as bench_flow
from flows.bench import (STAGES, Call, built_outputs, chosen_runs, method_and_report_stages, prefect_call, prepared_bench,
                         mirrored_task_stages, save_report, write_run_configs)
from flows.pipeline import code_digest, code_version, machine
from storage.atomic import read_json
from storage.fingerprint import fingerprint
from storage.rundir import Record

# Not featcal/bench/build.py: the T5 build takes only its directory names (edits to the MiniLM fine-tuning there must
# not copy every model and dataset again).
BUILD_MODULES = (mirror, t5_build, t5_prompts, t5_spec)
METHOD_MODULES = (methods, t5_build, t5_methods, t5_prompts, t5_spec)
METHODS_MODULE = "featcal.bench.t5_methods"  # what each method run's process runs


# ---- bench build ---------------------------------------------------------------------------------
@flow(name="featcal-bench-t5-build", flow_run_name="bench build · {bench_dir}")
def t5_build_flow(bench_dir: str, spec: T5BenchSpec) -> dict[str, Record]:
    return t5_build_stages(Path(bench_dir), spec, prefect_call)


def t5_build_stages(bench: Path, spec: T5BenchSpec, stage: Call) -> dict[str, Record]:
    """The base, then one dataset and one expert per task, each cached on its source's fingerprint (a mirror's
    content, or a hub id's name); then every method run's pipeline config under configs/."""
    bench, memo = prepared_bench(bench, spec)
    code = code_digest(Path(m.__file__) for m in BUILD_MODULES)
    records = {"base": stage(bench, "t5-base", "base", digest_of(
        [code, "base", fingerprint(spec.model_source(BASE_MODEL), memo)]))}
    records.update(mirrored_task_stages(bench, spec, stage, "t5", code, memo, lambda t: GLUE_TASKS[t].expert(t)))
    write_run_configs(bench / CONFIGS, {name: t5_methods.pipeline_config(bench, spec, run)
                                        for name, run in paper_method_runs().items()})
    return records


def build_t5_bench(spec: T5BenchSpec, out: str | Path) -> tuple[Path, str]:
    """The built benchmark's directory, and what running it will cost here (also written to its estimate.md)."""
    bench = Path(out).resolve()
    t5_build_flow(str(bench), spec)
    return bench, t5_estimate(bench, spec)


def t5_estimate(bench: Path, spec: T5BenchSpec) -> str:
    """What running the built benchmark will cost here, also written to its estimate.md."""
    return write_estimate(bench, t5_cost_estimate(bench, split_sizes(bench, spec.tasks)))


# ---- bench run -----------------------------------------------------------------------------------
def write_t5_report(bench: Path, runs: list[str], out_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    spec = T5BenchSpec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    rows = split_sizes(bench, spec.tasks)
    meta = {"title": f"FeatCal benchmark `{spec.name}`: FLAN-T5-base, {len(spec.tasks)} GLUE tasks, text to text",
            "about": t5_report.about(spec, {t: r["test"] for t, r in rows.items()},
                                     {t: r["calibration"] for t, r in rows.items()}),
            "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}", "spec": spec.model_dump(mode="json")}
    report = t5_report.t5_report(results, spec, meta)
    return save_report(bench, spec.name, report, results, out_dir, t5_report.CURVES)


STAGES.update({**t5_build.T5_BUILD_STAGES, "t5-report": write_t5_report})


@flow(name="featcal-bench-t5-run", flow_run_name="bench run · {bench_dir}")
def t5_run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None) -> dict[str, Record]:
    return t5_run_stages(Path(bench_dir), runs, out_dir, prefect_call)


def t5_run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Every method run (each cached on the built models and data and on the code), then the report."""
    bench = bench.resolve()
    spec = T5BenchSpec.load(bench)
    inputs = built_outputs(bench, ["base", *(f"{k}/{t}" for t in spec.tasks for k in ("data", "expert"))])
    code = [code_version(), code_digest(Path(m.__file__) for m in METHOD_MODULES)]
    names = chosen_runs(runs, paper_method_runs(), "FLAN-T5 benchmark")
    report_files = [*(Path(m.__file__) for m in (bench_report, t5_report, t5_prompts, t5_spec, bench_flow)),
                    Path(__file__)]
    return method_and_report_stages(bench, names, inputs, code, METHODS_MODULE, ("t5-report", report_files), out_dir,
                                    stage)
