"""MergeBench on Llama-3.2-3B as Prefect flows: `build` (the base, one dataset rendered into text and one expert per
domain, from the hub or a local mirror) and `run` (TA, TIES, TA + FeatCal, RegMean, RegMean++; one report of
held-out token losses with the paper's figures beside ours).

The stages run through `flows.bench`'s machinery: each a Prefect task keyed by our own digest of its inputs and
trusted only when its outputs on disk still match their record (tasks.record.recorded).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow

from featcal.bench import llm_build, llm_methods, llm_report, llm_spec, methods, mirror
from featcal.bench import report as bench_report
from featcal.bench.estimate import CONFIGS, split_sizes
from featcal.bench.llm_methods import llm_method_runs
from featcal.bench.llm_spec import BASE_MODEL, DOMAINS, LlmBenchSpec
from featcal.config import digest_of
from flows.bench import (STAGES, Call, built_outputs, chosen_runs, method_and_report_stages, prefect_call, prepared_bench,
                         mirrored_task_stages, saved_report_files, write_run_configs)
from flows.pipeline import code_digest, code_version, machine
from storage.atomic import read_json
from storage.fingerprint import fingerprint
from storage.rundir import Record

# Not featcal/bench/build.py: the build takes only its directory names from it.
BUILD_MODULES = (mirror, llm_build, llm_spec)
METHOD_MODULES = (methods, llm_build, llm_methods, llm_spec)
METHODS_MODULE = "featcal.bench.llm_methods"  # what each method run's process runs


# ---- bench build ---------------------------------------------------------------------------------
@flow(name="featcal-bench-llm-build", flow_run_name="bench build · {bench_dir}")
def llm_build_flow(bench_dir: str, spec: LlmBenchSpec) -> dict[str, Record]:
    return llm_build_stages(Path(bench_dir), spec, prefect_call)


def llm_build_stages(bench: Path, spec: LlmBenchSpec, stage: Call) -> dict[str, Record]:
    """The base, then one dataset and one expert per domain, each cached on its source's fingerprint (a mirror's
    content, or a hub id's name); then every method run's pipeline config under configs/."""
    bench, memo = prepared_bench(bench, spec)
    code = code_digest(Path(m.__file__) for m in BUILD_MODULES)
    records = {"base": stage(bench, "llm-base", "base", digest_of(
        [code, "base", fingerprint(spec.model_source(BASE_MODEL), memo)]))}
    records.update(mirrored_task_stages(bench, spec, stage, "llm", code, memo, lambda d: DOMAINS[d].expert(d)))
    write_run_configs(bench / CONFIGS, {name: llm_methods.pipeline_config(bench, spec, run)
                                        for name, run in llm_method_runs().items()})
    return records


def build_llm_bench(spec: LlmBenchSpec, out: str | Path) -> Path:
    """The built benchmark's directory."""
    bench = Path(out).resolve()
    llm_build_flow(str(bench), spec)
    return bench


# ---- bench run -----------------------------------------------------------------------------------
def write_llm_report(bench: Path, runs: list[str], out_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """`report/{name}.json` and `.md` (also copied to `out_dir` where given): the report stage's outputs."""
    spec = LlmBenchSpec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    rows = split_sizes(bench, spec.tasks)
    meta = {"title": f"FeatCal benchmark `{spec.name}`: {BASE_MODEL}, {len(spec.tasks)} MergeBench domains, "
                     "held-out token loss",
            "about": llm_report.about(spec, {d: r["test"] for d, r in rows.items()},
                                      {d: r["calibration"] for d, r in rows.items()}),
            "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}", "spec": spec.model_dump(mode="json")}
    report = llm_report.llm_report(results, spec, meta)
    files = saved_report_files(bench, spec.name, report, results, out_dir, llm_report.markdown(report))
    return files, {"average_loss": {r["method"]: round(r["average_loss"], 4) for r in report["methods"]}}


STAGES.update({**llm_build.LLM_BUILD_STAGES, "llm-report": write_llm_report})


@flow(name="featcal-bench-llm-run", flow_run_name="bench run · {bench_dir}")
def llm_run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None) -> dict[str, Record]:
    return llm_run_stages(Path(bench_dir), runs, out_dir, prefect_call)


def llm_run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Every method run (each cached on the built models and data and on the code), then the report."""
    bench = bench.resolve()
    spec = LlmBenchSpec.load(bench)
    inputs = built_outputs(bench, ["base", *(f"{k}/{d}" for d in spec.tasks for k in ("data", "expert"))])
    code = [code_version(), code_digest(Path(m.__file__) for m in METHOD_MODULES)]
    names = chosen_runs(runs, llm_method_runs(), "MergeBench")
    report_files = [*(Path(m.__file__) for m in (bench_report, llm_report, llm_spec)), Path(__file__)]
    return method_and_report_stages(bench, names, inputs, code, METHODS_MODULE, ("llm-report", report_files), out_dir,
                                    stage)
