"""Every benchmark as two Prefect flows, whatever its recipe: `build` (its build graph: base, data, experts) and `run`
(its method runs, each in its own process, then one report).

Every stage is a Prefect task keyed by our own digest of its inputs and trusted only when its outputs on disk still
match their record (tasks.record.recorded), like the pipeline's stages: a build or run killed at any point resumes at
the first stage not done, and a changed input reruns only the stages it reaches.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import yaml
from prefect import flow, task
from transformers.utils import logging as hf_logging

from featcal.config import digest_of
from featcal_bench import method, probsurgery, surgery, surgery_run
from featcal_bench import report as bench_report
from featcal_bench import runs as run_defs
from featcal_bench.builtin import recipe_of, recipes
from featcal_bench.layout import CONFIGS
from featcal_bench.recipe import Call, Recipe, SavedSpec, Stage
from featcal_bench.study import load_study
from flows import signals
from flows.pipeline import code_digest, code_version, machine
from flows.prefect_flow import key_parameter
from storage.atomic import read_json, write_bytes
from storage.rundir import Record, RunDir
from tasks.record import recorded

log = logging.getLogger("featcal")

RESULTS_DIR = ".prefect-results"
METHOD_MODULES = (
    method,
    run_defs,
    probsurgery,
    surgery,
    surgery_run,
)  # what every recipe's method runs execute besides the pipeline


def stage_kinds() -> dict[str, Stage]:
    """Every stage kind: each recipe's build stages, a method run and a report."""
    kinds: dict[str, Stage] = {"method": run_method_process, "report": write_report}
    for recipe in recipes().values():
        kinds.update(recipe.stages)
    return kinds


@task(persist_result=True, cache_key_fn=key_parameter)
def bench_stage(bench_dir: str, kind: str, stage: str, key: str, params: dict[str, Any]) -> Record:
    """Returns the stage's record (paths and digests)."""
    return recorded(RunDir(bench_dir), stage, key, lambda: stage_kinds()[kind](Path(bench_dir), **params))


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
    return recorded(RunDir(bench_dir), name, key, lambda: stage_kinds()[kind](Path(bench_dir), **params))


# ---- bench build ---------------------------------------------------------------------------------
def recipe_of_spec(spec: SavedSpec) -> Recipe:
    for recipe in recipes().values():
        if type(spec) is recipe.spec:
            return recipe
    raise TypeError(f"{type(spec).__name__} is no registered recipe's spec")


@flow(name="featcal-bench-build", flow_run_name="bench build · {bench_dir}")
def build_flow(bench_dir: str, spec: Any) -> dict[str, Record]:
    return build_stages(Path(bench_dir), spec, prefect_call)


def build_stages(bench: Path, spec: SavedSpec, stage: Call) -> dict[str, Record]:
    """The spec's recipe's build graph, each stage cached on the digests of its inputs and of the recipe's build code
    (edits elsewhere keep the experts); then, where the recipe asks, every method run's config under configs/."""
    recipe = recipe_of_spec(spec)
    bench = prepared_bench(bench, spec)
    code = code_digest(Path(inspect.getfile(m)) for m in recipe.build_modules)
    records = recipe.build(bench, spec, stage, code, bench / "records" / "fingerprints.json")
    if recipe.write_configs:
        runs = recipe.runs(spec, load_study(recipe.study))
        write_run_configs(bench / CONFIGS, {name: recipe.run_config(bench, spec, run) for name, run in runs.items()})
    return records


def build_bench(spec: SavedSpec, out: str | Path) -> tuple[Path, str | None]:
    """The built benchmark's directory, and what running it will cost here where its recipe says (None otherwise)."""
    bench = Path(out).resolve()
    build_flow(str(bench), spec)
    estimate = recipe_of_spec(spec).estimate
    return bench, estimate(bench, spec) if estimate else None


def prepared_bench(bench: Path, spec: SavedSpec) -> Path:
    """The benchmark directory made and its spec saved; returns it resolved."""
    # Per-save and per-load bars would drown the stages' own progress lines.
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    bench = bench.resolve()
    bench.mkdir(parents=True, exist_ok=True)
    spec.save(bench)
    return bench


def write_run_configs(directory: Path, configs: dict[str, dict[str, Any]]) -> None:
    """Each method run's pipeline config as `directory/{run}.yaml` (`featcal plan` / `featcal run` ready), a file
    rewritten only when its text changes."""
    for name, raw in configs.items():
        text = yaml.safe_dump(raw, sort_keys=False, width=120)
        config = directory / f"{name}.yaml"
        if not config.is_file() or config.read_text() != text:
            write_bytes(config, text.encode())


# ---- bench run -----------------------------------------------------------------------------------
class MethodRunFailed(ValueError):
    """A method run's process failed. A ValueError, as bad input is: `featcal` reports it in one line, and Prefect
    logs it without a traceback (flows/cli.py), since the run's own traceback is in its log."""


# The line a Python process ends a traceback with, or featcal's own one-line refusal.
_CAUSE = re.compile(r"^(?:featcal: error: .+|[A-Za-z_][\w.]*(?:Error|Exception|Refused|Interrupt)\b.*)$")


def failure_cause(log_text: str) -> str:
    """The one line that says why a process failed: the last error line of its output, else its last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    causes = [line for line in lines if _CAUSE.match(line)]
    return (causes or lines or ["no output"])[-1]


def run_method_process(bench: Path, run: str, study: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """A method in a fresh process (`python -m featcal_bench.method BENCH RUN [STUDY]`): its peak RSS is its
    own, not the flow's or another method's. Its output goes to runs/RUN.log, kept on disk; a failure is reported by
    its cause, in one line, with that log's path."""
    result = bench / "results" / f"{run}.json"
    log_path = bench / "runs" / f"{run}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("benchmark run %s: its log is %s", run, log_path)
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.run([sys.executable, "-m", method.__name__, str(bench), run, *([study] if study else [])],
                              text=True, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result.is_file():
        cause = failure_cause(log_path.read_text(encoding="utf-8", errors="replace"))
        raise MethodRunFailed(f"benchmark run {run!r} failed: {cause} (exit {proc.returncode}; its log: {log_path}; "
                              f"its run directory: {bench / 'runs' / run})")
    return [f"results/{run}.json"], read_json(result)["cost"]


def write_report(bench: Path, runs: list[str], out_dir: str | None = None,
                 study: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """The report stage: the recipe's report of runs `runs` as study file `study` (default: the recipe's) tabulates
    them, with what every report carries (title, what was built, the machine, the spec)."""
    recipe = recipe_of(bench)
    spec = recipe.spec.load(bench)
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    meta = {"title": recipe.report.title(spec), "about": recipe.report.about(bench, spec),
            "machine": f"{machine()}, {time.strftime('%Y-%m-%d')}", "spec": spec.model_dump(mode="json")}
    return recipe.report.write(bench, spec, results, meta, out_dir, load_study(study or recipe.study))


@flow(name="featcal-bench-run", flow_run_name="bench run · {bench_dir}")
def run_flow(bench_dir: str, runs: list[str] | None = None, out_dir: str | None = None,
             study: str | None = None, draws: int = 1) -> dict[str, Record]:
    return run_stages(Path(bench_dir), runs, out_dir, prefect_call, study, draws)


def built_outputs(bench: Path, stages: list[str]) -> list[dict[str, str]]:
    """The output digests of build stages `stages`, each still as recorded: what the method runs are keyed on."""
    built, outputs = RunDir(bench), []
    for name in stages:
        rec = built.verified(name, (built.record(name) or {}).get("key", ""))
        if rec is None:
            raise FileNotFoundError(
                f"{bench}: build stage {name} is missing or changed; run `featcal bench build` first"
            )
        outputs.append(rec["outputs"])
    return outputs


def run_stages(bench: Path, runs: list[str] | None, out_dir: str | None, stage: Call,
               study: str | None = None, draws: int = 1) -> dict[str, Record]:
    """Every method run `runs` (default: all the study's) of study file `study` (default: the recipe's), each in its
    own process and cached on the built inputs, the code and its definition, then the report from their results. A run
    that needs another (its `start`, the run it `protect`s against) comes after it (added where not asked for) and is
    cached on its result too: one that changes reruns it. With `draws` N > 1, every run with a calibration method
    also runs on N − 1 further draws of its calibration rows (runs `{run}_draw{k}`, runs.drawn), and the report
    gives each calibrated row's spread over the N draws."""
    bench = bench.resolve()
    recipe = recipe_of(bench)
    spec = recipe.spec.load(bench)
    inputs = built_outputs(bench, recipe.run_inputs(spec))
    code = [code_version(), code_digest(Path(inspect.getfile(m)) for m in (*METHOD_MODULES, *recipe.method_modules))]
    chosen = load_study(study or recipe.study)
    known = recipe.runs(spec, chosen)
    names = runs or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--runs: unknown {spec.name} runs {unknown}; known: {sorted(known)}")
    names = run_defs.ordered_runs(names, known)
    names, known = run_defs.with_draws(names, known, draws)
    records: dict[str, Record] = {}
    for r in names:
        after = [records[need]["outputs"][f"results/{need}.json"] for need in known[r].needs]
        # draw 0 and no shared inputs: keys as before those fields existed
        defined = {k: v for k, v in dataclasses.asdict(known[r]).items() if k not in ("draw", "shared_inputs") or v}
        records[r] = stage(bench, "method", f"method/{r}", digest_of([code, r, defined, inputs, *after]), run=r,
                           study=study)
    digests = [records[r]["outputs"][f"results/{r}.json"] for r in names]
    report_modules = {bench_report, sys.modules[__name__], *recipe.report.modules}
    report_code = code_digest(Path(inspect.getfile(m)) for m in report_modules)
    records["report"] = stage(bench, "report", "report",
                              digest_of([report_code, chosen.report_part(), names, digests, out_dir]),
                              runs=names, out_dir=out_dir, study=study)
    return records
