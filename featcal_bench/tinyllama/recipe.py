"""The tinyllama-domains recipe: texts per domain, a tokenizer, rows per domain, a small Llama pretrained here on their
mix, one expert per domain (all offline, single-threaded and seeded); TA, TIES, RegMean, RegMean++ and TA + FeatCal;
one report of held-out token losses.

Each stage is keyed on its code, its settings and its inputs' output digests: a rerun after a crash resumes at the
first stage not done, and an unchanged rerun of an earlier stage keeps the later ones.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any, cast

from featcal.config import digest_of
from featcal_bench import sources
from featcal_bench.catalog import entry
from featcal_bench.layout import BASE, data_dir
from featcal_bench.recipe import NO_OPTIONS, BuildOptions, Call, Recipe, Report, Stage
from featcal_bench.report import save_loss_report
from featcal_bench.study import Study
from featcal_bench.tinyllama import build, methods, report
from featcal_bench.tinyllama.build import TOKENIZER, TinyLlamaSpec, located_sources, texts_file
from storage.fingerprint import fingerprint
from storage.rundir import Record, RunDir

NAME = "tinyllama-domains"
STEM = "tinyllama_domains"  # the report's file names


def _source_identity(spec: TinyLlamaSpec, domain: str, memo: Path) -> str:
    """The content fingerprint of a domain's source; the standard library (about 1 GB with site-packages) is named by
    its path and this Python's version instead, which fix it."""
    path = spec.source(domain)
    if build.DOMAINS[domain][0] == "python_stdlib":
        return f"{path} (Python {platform.python_version()})"
    return fingerprint(path, memo)


def build_graph(bench: Path, spec: TinyLlamaSpec, stage: Call, code: str, memo: Path) -> dict[str, Record]:
    """Texts per domain, the tokenizer, rows per domain, the base, one expert per domain."""
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


def located_spec(name: str = NAME, options: BuildOptions = NO_OPTIONS) -> TinyLlamaSpec:
    """The benchmark's spec with the paths of its sources (a missing one says what it is)."""
    return TinyLlamaSpec(sources=located_sources())


def build_summary(bench: Path, spec: TinyLlamaSpec) -> dict[str, Any]:
    """The build stages' records (info and seconds) for the report, and the build's wall time by stage kind."""
    done = RunDir(bench)
    names = [*(f"{k}/{d}" for k in ("texts", "data", "expert") for d in spec.tasks), "tokenizer", "base"]
    records = {}
    for n in names:
        record = done.record(n)
        if record is None:
            raise FileNotFoundError(f"{bench}: build stage {n} has no record; run `featcal bench build` first")
        records[n] = record
    kinds: dict[str, float] = {}
    for name, rec in records.items():
        kinds[name.split("/")[0]] = kinds.get(name.split("/")[0], 0.0) + rec["seconds"]
    return {**{n: {"info": r["info"], "seconds": r["seconds"]} for n, r in records.items()},
            "seconds": sum(kinds.values()), "seconds_by_kind": kinds}


def write_report(bench: Path, spec: TinyLlamaSpec, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    """`report/tinyllama_domains.json` and `.md`, also copied to `out_dir` where given."""
    meta = {**meta, "build": build_summary(bench, spec),
            # The pipeline stages' own seconds, as recorded when each ran (a rerun resumed from cache takes far less).
            "run_seconds": sum(sum(res["cost"]["stage_seconds"].values()) for res in results.values())}
    made = report.tinyllama_report(results, spec, meta, study)
    return save_loss_report(bench, STEM, made, results, out_dir, report.markdown(made, spec))


RECIPE = Recipe(
    entry=entry("tinyllama"),
    spec=TinyLlamaSpec,
    options=frozenset(),
    located=located_spec,
    build=build_graph,
    build_modules=(sources, build),
    # build.py's stage map is inferred as plain functions; its bytes key the experts, so it stays unannotated
    stages=cast("dict[str, Stage]", build.BUILD_STAGES),
    study=Path(__file__).with_name("study.yaml"),
    run_config=methods.pipeline_config,
    method_modules=(build, methods),
    report=Report(title=lambda spec: (f"FeatCal benchmark `{NAME}`: a small Llama made here, {len(spec.tasks)} "
                                      "text domains"),
                  about=lambda bench, spec: report.about(spec), write=write_report,
                  modules=(report, sys.modules[__name__])),
    threads=1,
)
