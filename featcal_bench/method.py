"""A benchmark's method runs: each is a pipeline run (or Surgery, ProbSurgery) in its own process, so its peak RSS
is its own; each writes `results/{run}.json` with accuracies and the cost of its stages. One entry point serves every
recipe (the built directory's spec file names the recipe, featcal_bench/builtin.py):

    python -m featcal_bench.method BENCH_DIR RUN [STUDY_FILE]

What a run is (MethodRun) and the helpers recipes share live in featcal_bench/runs.py; this module is the process.
"""

from __future__ import annotations

import json
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from featcal.config import config_from_dict
from featcal_bench.builtin import recipe_of
from featcal_bench.protect import head_check, raised_weights
from featcal_bench.runs import SURGERY_METHODS, MethodRun, drawn, is_drawn, run_dir, split_draw
from featcal_bench.study import load_study
from featcal_bench.surgery_run import surgery_result
from storage.atomic import read_json, write_json

log = logging.getLogger("featcal")


def _stage_cost(run_dir: Path) -> dict[str, Any]:
    """Seconds per stage kind, and the peak RSS before evaluation (records carry the process peak so far)."""
    seconds: dict[str, float] = {}
    peak = merge_peak = 0.0
    for path in (run_dir / "records").glob("*.json"):
        rec = read_json(path)
        if "key" not in rec:
            continue
        kind = rec["stage"].split("/")[0]
        seconds[kind] = seconds.get(kind, 0.0) + rec["seconds"]
        if kind != "evaluate":
            peak = max(peak, rec["peak_rss_mib"])
        if kind == "merge":
            merge_peak = rec["peak_rss_mib"]
    calibration = sum(v for k, v in seconds.items() if k not in ("merge", "evaluate"))
    return {
        "stage_seconds": {k: round(v, 2) for k, v in sorted(seconds.items())},
        "merge_seconds": round(seconds.get("merge", 0.0), 2),
        "calibration_seconds": round(calibration, 2),
        "peak_rss_mib": peak,
        "merge_peak_rss_mib": merge_peak,
    }


def chosen_hyper(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per solve stage, the median over its modules of the λ and ρ that `auto` chose (empty for fixed values)."""
    out = {}
    for path in sorted((run_dir / "records").glob("solve__*.json")):
        info = read_json(path).get("info", {})
        if "lambda" in info:
            out[path.stem.split("__", 1)[1]] = {"lambda": statistics.median(info["lambda"].values()),
                                                "rho": statistics.median(info["rho"].values())}
    return out


def pipeline_result(bench: Path, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Pipeline config `raw` run in `bench/runs/{name}`: its accuracies, per-example predictions, drift and costs."""
    from flows.pipeline import run_pipeline

    cfg = config_from_dict(raw, root=bench, source=f"bench run {name}")
    directory = run_dir(bench, name)
    run_pipeline(cfg, directory, reuse=True)  # the directory is the named run's, whatever its recipe says today
    report = read_json(directory / "report.json")
    tasks, summary = report["tasks"], report["summary"]
    result = {"run_dir": str(directory), "cost": _stage_cost(directory), "chosen": chosen_hyper(directory),
              "accuracy": {t: s["accuracy"] for t, s in tasks.items()},
              "predictions": {t: s["predictions"] for t, s in tasks.items() if "predictions" in s},
              "labels": {t: s["labels"] for t, s in tasks.items() if "labels" in s},
              "drift": summary.get("average_drift", {})}
    if all("language_model" in s for s in tasks.values()):  # a causal LM: its losses per task and model too
        result["language_model"] = {t: s["language_model"] for t, s in tasks.items()}
        result["loss_summary"] = {k: summary[k] for k in ("average_loss", "gap_closed_loss") if k in summary}
    return result


def run_method(bench: Path, name: str, study: str | None = None) -> dict[str, Any]:
    """Method run `name` of the benchmark built in `bench`, by the recipe that built it, as study file `study` (default:
    the recipe's) defines it: a pipeline run (or its Surgery or ProbSurgery row), its result written to
    `bench/results/{name}.json`."""
    recipe = recipe_of(bench)
    spec = recipe.spec.load(bench)
    runs = recipe.runs(spec, load_study(study or recipe.study))
    base, draw = split_draw(name)
    if base not in runs or (draw and not is_drawn(runs[base])):
        raise ValueError(f"unknown {spec.name} run {name!r}; known: {sorted(runs)}")
    run = drawn(runs[base], draw, runs) if draw else runs[base]
    for need in run.needs:
        if not (bench / "results" / f"{need}.json").is_file():
            raise FileNotFoundError(f"run {name} needs run {need}, which has not run here "
                                    f"({bench / 'results' / f'{need}.json'} is missing); run it first")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    raw = recipe.run_config(bench, spec, run)
    if run.draw:  # another draw of the calibration rows
        raw["calibration"]["seed"] = raw["calibration"].get("seed", 42) + run.draw
    if run.shared_inputs:
        raw["calibration"]["shared_inputs"] = dict(run.shared_inputs)
    if run.protect is not None:
        raw["featcal"]["task_weights"] = raised_weights(head_check(bench, run.protect))
    method = run.method
    if method is not None and method in SURGERY_METHODS:
        cfg = config_from_dict(raw, root=bench, source=f"bench run {name}")
        return timed_result(bench, name, run,
                            lambda: surgery_result(bench, cfg, recipe.cache_surgery_features, method))
    return timed_result(bench, name, run, lambda: pipeline_result(bench, name, raw))


def timed_result(bench: Path, name: str, run: MethodRun, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()`'s result with what the run was, its wall time and this process's peak RSS, written to
    `bench/results/{name}.json` (the file `bench run` caches)."""
    started = time.perf_counter()
    result = compute()
    result.update(run=name, merge=run.merge, scaling=run.scaling, method=run.method, examples=run.examples,
                  start=run.start, protect=run.protect, draw=run.draw,
                  process_seconds=round(time.perf_counter() - started, 2),
                  process_peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    write_json(bench / "results" / f"{name}.json", result)
    return result


def main(argv: list[str]) -> int:
    """`python -m featcal_bench.method BENCH_DIR RUN [STUDY_FILE]`: the process `bench run` starts per method run."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    bench, name, study = Path(argv[0]).resolve(), argv[1], (argv[2] if len(argv) > 2 else None)
    print(json.dumps(run_method(bench, name, study)["cost"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
