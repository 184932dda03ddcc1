"""The benchmark as Prefect flows: `build` (data + experts) and `run` (every method, one report).

Every stage is a Prefect task keyed by our own digest of its inputs and trusted only when its
outputs on disk still match their record (tasks.record.recorded), like the pipeline's stages.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import yaml
from prefect import flow, task
from transformers.utils import logging as hf_logging

from featcal import merging
from featcal.bench import build, competence, finetune, methods, probe, sources, spec as spec_module, surgery, surgery_run, tasks
from featcal.bench import report as bench_report
from featcal.bench.sources import locate
from featcal.bench.presets import PRESETS
from featcal.bench.spec import BenchSpec
from featcal.config import digest_of
from flows import signals
from flows.pipeline import code_digest, code_version, machine
from flows.prefect_flow import key_parameter
from storage.atomic import read_json, write_bytes, write_json
from storage.fingerprint import fingerprint
from storage.rundir import Record, RunDir
from tasks.record import recorded

log = logging.getLogger("featcal")

RESULTS_DIR = ".prefect-results"
BUILD_MODULES = (build, finetune, sources, spec_module, tasks)
METHOD_MODULES = (methods, surgery, surgery_run)
STAGES: dict[str, Callable[..., tuple[list[str], dict[str, Any]]]] = {**build.BUILD_STAGES, "check": competence.check}


@task(persist_result=True, cache_key_fn=key_parameter)
def bench_stage(bench_dir: str, kind: str, stage: str, key: str, params: dict[str, Any]) -> Record:
    """Returns the stage's record (paths and digests)."""
    return recorded(RunDir(bench_dir), stage, key, lambda: STAGES[kind](Path(bench_dir), **params))


Call = Callable[..., Record]


def prefect_call(bench_dir: Path, kind: str, name: str, key: str, **params: Any) -> Record:
    """A stage as a Prefect task; Prefect's cache is trusted only when our record verifies."""
    configured = bench_stage.with_options(
        name=f"bench-{kind}", task_run_name=name, refresh_cache=RunDir(bench_dir).verified(name, key) is None,
        result_storage=bench_dir / RESULTS_DIR)
    signals.at_stage(name)  # a stop names the stage it interrupted
    record = configured(str(bench_dir), kind, name, key, params)
    signals.at_stage(None)
    return record


def direct_call(bench_dir: Path, kind: str, name: str, key: str, **params: Any) -> Record:
    """A stage in this process, without Prefect (tests)."""
    return recorded(RunDir(bench_dir), name, key, lambda: STAGES[kind](Path(bench_dir), **params))


@flow(name="featcal-bench-build", flow_run_name="bench build · {bench_dir}")
def build_flow(bench_dir: str, spec: BenchSpec) -> dict[str, Record]:
    return build_stages(Path(bench_dir), spec, prefect_call)


def prepared_bench(bench: Path, spec: Any) -> tuple[Path, Path]:
    """The benchmark directory made and its spec saved; returns it resolved, with the fingerprint memo's path."""
    # Per-save and per-load bars would drown the stages' own progress lines.
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    bench = bench.resolve()
    bench.mkdir(parents=True, exist_ok=True)
    spec.save(bench)
    return bench, bench / "records" / "fingerprints.json"


def mirrored_task_stages(bench: Path, spec: Any, stage: Call, kind: str, code: str, memo: Path,
                         expert_hub_id: Callable[[str], str]) -> dict[str, Record]:
    """A hub recipe's `{kind}-data` and `{kind}-expert` stages, one of each per task, each cached on its source's
    fingerprint (a mirror's content, or a hub id's name)."""
    records = {}
    for t in spec.tasks:
        records[f"data/{t}"] = stage(bench, f"{kind}-data", f"data/{t}", digest_of(
            [code, "data", t, spec.calibration, spec.test_rows, spec.seed, fingerprint(spec.data_source(t), memo)]), task=t)
    for t in spec.tasks:
        records[f"expert/{t}"] = stage(bench, f"{kind}-expert", f"expert/{t}", digest_of(
            [code, "expert", t, fingerprint(spec.model_source(expert_hub_id(t)), memo)]), task=t)
    return records


def build_stages(bench: Path, spec: BenchSpec, stage: Call) -> dict[str, Record]:
    """Base copy, then one dataset and one expert per task, then the spec's competence rule where it states one
    (it raises when an expert fails it); each cached on its inputs' digests."""
    bench, memo = prepared_bench(bench, spec)
    sources = {k: fingerprint(v, memo) if v else None for k, v in spec.sources.items()}
    code = code_digest(Path(m.__file__) for m in BUILD_MODULES)  # edits elsewhere keep the experts
    records = {"base": stage(bench, "base", "base", digest_of([code, "base", sources["minilm"]]))}
    for t in spec.tasks:
        recipe_source = build.RECIPES[t].source
        records[f"data/{t}"] = stage(bench, "data", f"data/{t}", digest_of(
            [code, "data", t, spec.sizes, spec.seed, sources[recipe_source]]), task=t)
    for t in spec.tasks:
        records[f"expert/{t}"] = stage(bench, "expert", f"expert/{t}", digest_of(
            [code, "expert", t, spec.finetune.model_dump(), spec.seed, records["base"]["outputs"][build.BASE],
             records[f"data/{t}"]["outputs"][build.data_dir(t)]]), task=t)
    if spec.competence is not None:
        check_code = code_digest([Path(competence.__file__), Path(probe.__file__), Path(merging.__file__)])
        records["check"] = stage(bench, "check", "check/competence", digest_of(
            [code, check_code, "check", spec.competence.model_dump(), spec.finetune.max_length, spec.tasks,
             records["base"]["outputs"], [records[f"{k}/{t}"]["outputs"] for t in spec.tasks for k in ("data", "expert")]]))
    return records


def located_spec(name: str, spam_assassin: str | None = None, wordnet: str | None = None) -> BenchSpec:
    """Preset `name` with the paths of the sources it needs (a missing one says how to install it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[name]
    found = locate(spam_assassin=spam_assassin, wordnet=wordnet)
    for needed in {"minilm", *(build.RECIPES[t].source for t in preset.tasks)}:
        found.require(needed)
    return preset.model_copy(update={"sources": {k: str(v) if v else None for k, v in vars(found).items()}})


def build_bench(name: str, out: str | Path, spam_assassin: str | None = None, wordnet: str | None = None) -> Path:
    build_flow(str(Path(out).resolve()), located_spec(name, spam_assassin, wordnet))
    return Path(out).resolve()


# ---- bench run -----------------------------------------------------------------------------------
def run_method_process(bench: Path, run: str, module: str = "featcal.bench.methods") -> tuple[list[str], dict[str, Any]]:
    """A method in a fresh process (`python -m MODULE BENCH RUN`): its peak RSS is its own, not the flow's or another
    method's."""
    result = bench / "results" / f"{run}.json"
    proc = subprocess.run([sys.executable, "-m", module, str(bench), run], text=True)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"benchmark run {run!r} failed (exit {proc.returncode}); its log is above, its run "
                           f"directory is {bench / 'runs' / run}")
    return [f"results/{run}.json"], read_json(result)["cost"]


def write_report(bench: Path, runs: list[str], out_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    spec = BenchSpec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    meta = {"title": f"FeatCal benchmark `{spec.name}`: all-MiniLM-L6-v2, {len(spec.tasks)} tasks",
            "about": about(spec), "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}", "spec": spec.model_dump(mode="json")}
    report = bench_report.build_report(results, spec.tasks, meta)
    return save_report(bench, spec.name, report, results, out_dir)


def save_report(bench: Path, stem: str, report: dict[str, Any], results: dict[str, dict[str, Any]], out_dir: str | None,
                curves: bench_report.Curves = bench_report.CURVES) -> tuple[list[str], dict[str, Any]]:
    """The accuracy benchmarks' report stage: its files with the plots, and each method's average."""
    (bench / "report").mkdir(parents=True, exist_ok=True)
    plots = bench_report.plots(report, bench / "report", stem, curves)
    files = saved_report_files(bench, stem, report, results, out_dir, bench_report.markdown(report, curves), plots)
    return files, {"methods": {r["method"]: round(100 * r["average"], 2) for r in report["methods"]}}


def saved_report_files(bench: Path, stem: str, report: dict[str, Any], results: dict[str, dict[str, Any]],
                       out_dir: str | None, markdown: str, plots: Sequence[Path] = ()) -> list[str]:
    """`report/{stem}.json`, `.md` and `plots`, also copied to `out_dir` where given: a report stage's outputs."""
    # Each run's record without its per-example predictions (the paired comparisons summarise them).
    report["runs"] = {r: {k: v for k, v in res.items() if k not in ("predictions", "labels")} for r, res in results.items()}
    files = [f"report/{stem}.json", f"report/{stem}.md"]
    write_json(bench / files[0], report)
    write_bytes(bench / files[1], markdown.encode())
    files += [str(p.relative_to(bench)) for p in plots]
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for rel in files:
            shutil.copy2(bench / rel, Path(out_dir) / Path(rel).name)
    return files


def about(spec: BenchSpec) -> str:
    lines = [f"- `{t}`: {build.RECIPES[t].about}" for t in spec.tasks]
    ft = spec.finetune
    if ft.select is None:
        recipe = f"{ft.epochs:g} epoch(s), lr {ft.lr:g}"
    else:
        recipe = (f"lr {' or '.join(f'{lr:g}' for lr in ft.select.lrs)} and up to {ft.epochs:g} epochs, the best "
                  f"checkpoint on the validation split (stopped after {ft.select.patience} epochs without a better one)")
    validation = f", validation {spec.validation}" if spec.validation else ""
    return (f"Splits per task: test {spec.test}, calibration pool {spec.calibration}{validation}, train ≤ {spec.train_max}; "
            f"experts: full fine-tune, {recipe}, batch {ft.batch_size}, ≤ {ft.max_length} tokens, seed {spec.seed}.\n\n"
            + "\n".join(lines))


STAGES.update({"method": run_method_process, "report": write_report})


@flow(name="featcal-bench-run", flow_run_name="bench run · {bench_dir}")
def run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None) -> dict[str, Record]:
    return run_stages(Path(bench_dir), runs, out_dir, prefect_call)


def built_outputs(bench: Path, stages: list[str]) -> list[dict[str, str]]:
    """The output digests of build stages `stages`, each still as recorded: what the method runs are keyed on."""
    built, outputs = RunDir(bench), []
    for name in stages:
        rec = built.verified(name, (built.record(name) or {}).get("key", ""))
        if rec is None:
            raise FileNotFoundError(f"{bench}: build stage {name} is missing or changed; run `featcal bench build` first")
        outputs.append(rec["outputs"])
    return outputs


def write_run_configs(directory: Path, configs: dict[str, dict[str, Any]]) -> None:
    """Each method run's pipeline config as `directory/{run}.yaml` (`featcal plan` / `featcal run` ready), a file
    rewritten only when its text changes."""
    for name, raw in configs.items():
        text = yaml.safe_dump(raw, sort_keys=False, width=120)
        config = directory / f"{name}.yaml"
        if not config.is_file() or config.read_text() != text:
            write_bytes(config, text.encode())


def method_and_report_stages(bench: Path, names: list[str], inputs: list[dict[str, str]], code: list[str], module: str,
                             report: tuple[str, list[Path]], out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Method runs `names` of a hub benchmark, each in its own process (`python -m MODULE`) and cached on the built
    `inputs` and `code`, then its report stage (`report`: the stage kind, and the files its code digest covers)."""
    records = {r: stage(bench, "method", f"method/{r}", digest_of([code, r, inputs]), run=r, module=module)
               for r in names}
    digests = [records[r]["outputs"][f"results/{r}.json"] for r in names]
    kind, report_files = report
    records["report"] = stage(bench, kind, "report", digest_of([code_digest(report_files), names, digests, out_dir]),
                              runs=names, out_dir=out_dir)
    return records


def chosen_runs(runs: list[str] | None, known: dict[str, Any], benchmark: str) -> list[str]:
    """`--runs` (default: every known run), an unknown one named in one line."""
    names = runs or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--runs: unknown {benchmark} runs {unknown}; known: {sorted(known)}")
    return names


def run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call) -> dict[str, Record]:
    """Every method run (cached on the experts, data and code), then the report from their results."""
    bench = bench.resolve()
    spec = BenchSpec.load(bench)
    inputs = built_outputs(bench, ["base", *(f"{k}/{t}" for t in spec.tasks for k in ("data", "expert"))])
    code = [code_version(), code_digest(Path(m.__file__) for m in METHOD_MODULES)]
    known = methods.method_runs()
    names = runs or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--runs: unknown benchmark runs {unknown}; known: {sorted(known)}")
    records = {r: stage(bench, "method", f"method/{r}", digest_of([code, r, inputs]), run=r) for r in names}
    digests = [records[r]["outputs"][f"results/{r}.json"] for r in names]
    report_code = code_digest([Path(bench_report.__file__), Path(__file__)])
    records["report"] = stage(bench, "report", "report", digest_of([report_code, names, digests, out_dir]),
                              runs=names, out_dir=out_dir)
    return records


# ---- the embedded demo ---------------------------------------------------------------------------
DEMO_EXAMPLES = 64


@flow(name="featcal-demo", flow_run_name="demo · {out}")
def demo_flow(out: str, spec: BenchSpec) -> Path:
    """Build the 3-task demo benchmark, then TA + FeatCal on it through the pipeline's own flow."""
    from flows.prefect_flow import featcal_flow

    root = Path(out).resolve()
    build_flow(str(root / "bench"), spec)
    run = methods.MethodRun("task_arithmetic", "featcal", examples=DEMO_EXAMPLES,
                              models=("merged", "calibrated", "expert"), featcal=methods.FEATCAL)
    config = root / "demo.yaml"
    text = yaml.safe_dump(methods.pipeline_config(root / "bench", spec, run), sort_keys=False)
    if not config.is_file() or config.read_text() != text:
        write_bytes(config, text.encode())
    featcal_flow(str(config), str(root / "run"))
    return root / "run"


def run_demo(out: str | Path) -> Path:
    return demo_flow(str(Path(out).resolve()), located_spec("demo"))


def demo_table(report: dict[str, Any]) -> str:
    names = {"expert": "experts", "merged": "task arithmetic", "calibrated": "TA + FeatCal"}
    tasks = sorted(report["tasks"])
    lines = ["| model | " + " | ".join(tasks) + " | average |", "|---|" + "---:|" * (len(tasks) + 1)]
    for model, label in names.items():
        accs = [report["tasks"][t]["accuracy"][model] for t in tasks]
        lines.append(f"| {label} | " + " | ".join(f"{100 * a:.1f}" for a in accs) + f" | {100 * sum(accs) / len(accs):.1f} |")
    gap = report["summary"].get("gap_closed")
    if gap is not None:
        lines.append(f"\nFeatCal closes {100 * gap:.1f} % of the gap between task arithmetic and the experts.")
    last = report["summary"].get("average_last_boundary_drift", {})
    if {"merged", "calibrated"} <= last.keys():
        head = (report.get("drift_definition") or {}).get("head_token_index") is not None
        kinds = [("all_tokens", "all tokens"), ("head_token", "token the head reads")]
        if not head:
            kinds = [("all_tokens", "all tokens, all read by the head")]
        figures = ", ".join(f"{label} {last['merged'][k]:.3f} → {last['calibrated'][k]:.3f}" for k, label in kinds)
        lines.append(f"\nDrift from the experts at the last block, task average (lower is better): {figures}.")
    return "\n".join(lines)
