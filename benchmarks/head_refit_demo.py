"""featcal.head_refit on the 3-task MiniLM demo (issue 54 §1 and §3): each FeatCal setting with and without each task's
head refitted, paired with the same run without it; at 8 examples a task over several draws of the calibration rows.

    python -m benchmarks.head_refit_demo --bench DEMO/bench [--draws 4] [--out benchmarks/results/head_refit_demo.md]

DEMO/bench is the benchmark `featcal demo --out DEMO` builds (or `featcal bench build demo --out DEMO/bench`). The
runs go under DEMO/bench/runs as `featcal bench run` puts them (cached there: a rerun only writes the report). The
64-example runs run once: the demo's calibration pool is 64 examples a task, so every draw would take all of them;
the 8-example runs run on `--draws` draws (calibration.seed 42, 43, …). One report of all of them (featcal_bench's
own) goes to `--out`, with the machine, the date and the command."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, command_line, commit_of, cpu_line
from featcal_bench.builtin import recipe_of
from featcal_bench.report import build_report, draws_of, markdown
from featcal_bench.stages import direct_call, run_stages
from featcal_bench.study import load_study
from storage.atomic import read_json, write_bytes

FULL_RUNS = ["ta_featcal", "ta_featcal_refit", "ta_featcal_auto", "ta_featcal_auto_refit"]
FEW_RUNS = ["ta_featcal_auto_n008", "ta_featcal_auto_refit_n008"]
STUDY = {
    "include": [str(ROOT / "featcal_bench" / "studies" / "settings.yaml")],
    "settings": {"tuned": {"lambda": 0.5, "rho": 3.0, "alpha": 0.25}},  # featcal_bench/minilm/study.yaml's
    "runs": {
        "ta_featcal": {"merge": "task_arithmetic", "method": "featcal", "featcal": "tuned",
                       "models": ["base", "merged", "calibrated", "expert"]},
        "ta_featcal_refit": {"merge": "task_arithmetic", "method": "featcal",
                             "featcal": {"use": "tuned", "head_refit": True}},
        "ta_featcal_auto": {"merge": "task_arithmetic", "method": "featcal", "featcal": "auto"},
        "ta_featcal_auto_refit": {"merge": "task_arithmetic", "method": "featcal",
                                  "featcal": {"use": "auto", "head_refit": True}},
        "ta_featcal_auto_n008": {"merge": "task_arithmetic", "method": "featcal", "examples": 8, "featcal": "auto"},
        "ta_featcal_auto_refit_n008": {"merge": "task_arithmetic", "method": "featcal", "examples": 8,
                                       "featcal": {"use": "auto", "head_refit": True}},
    },
    "rows": [
        ["experts (individual)", "ta_featcal", "expert"],
        ["task arithmetic", "ta_featcal", "merged", "merge"],
        ["TA + FeatCal", "ta_featcal", "calibrated", "total"],
        {"label": "TA + FeatCal + head refit", "run": "ta_featcal_refit", "model": "calibrated", "cost": "total",
         "against": "TA + FeatCal"},
        ["TA + FeatCal (λ auto)", "ta_featcal_auto", "calibrated", "total"],
        {"label": "TA + FeatCal (λ auto) + head refit", "run": "ta_featcal_auto_refit", "model": "calibrated",
         "cost": "total", "against": "TA + FeatCal (λ auto)"},
        ["TA + FeatCal (λ auto), 8 examples", "ta_featcal_auto_n008", "calibrated", "total"],
        {"label": "TA + FeatCal (λ auto) + head refit, 8 examples", "run": "ta_featcal_auto_refit_n008",
         "model": "calibrated", "cost": "total", "against": "TA + FeatCal (λ auto), 8 examples"},
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, type=Path, help="a built `demo` benchmark directory")
    parser.add_argument("--draws", type=int, default=4, help="draws of the 8-example runs' calibration rows")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "head_refit_demo.md")
    parser.add_argument("--only", choices=("full", "few"), help="run only the 64-example runs, or only the 8-example "
                        "ones (two copies of a bench can then run at once; copy one's results/ into the other's)")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: the report of the results already under BENCH/results (those runs missing are "
                             "left out, and the draws found are counted)")
    args = parser.parse_args()
    bench = args.bench.resolve()
    study_path = bench / "head_refit_demo_study.yaml"
    write_bytes(study_path, yaml.safe_dump(STUDY, sort_keys=False, allow_unicode=True).encode())
    started = time.time()
    if not args.report_only and args.only != "few":
        run_stages(bench, FULL_RUNS, None, direct_call, str(study_path))
    if not args.report_only and args.only != "full":
        run_stages(bench, FEW_RUNS, None, direct_call, str(study_path), args.draws)
    study = load_study(study_path)
    found = {p.stem: None for p in (bench / "results").glob("*.json")}
    names = [*(r for r in FULL_RUNS if r in found),
             *(d for r in FEW_RUNS if r in found for d in draws_of(found, r)[:args.draws])]
    results = {r: read_json(bench / "results" / f"{r}.json") for r in names}
    draws = max((len(draws_of(found, r)[:args.draws]) for r in FEW_RUNS if r in found), default=0)
    recipe = recipe_of(bench)
    spec = recipe.spec.load(bench)
    report = build_report(results, spec.tasks, {"title": "featcal.head_refit on the 3-task MiniLM demo"}, study)
    took = "" if args.report_only else f", {(time.time() - started) / 60:.0f} min (cached runs included)"
    few = (f"The 8-example rows ran on {draws} draw{'s' * (draws > 1)} of their calibration rows." if draws else
           "No 8-example run finished.")
    header = (f"Host: {cpu_line()}, shared with other jobs (accuracies do not depend on load). "
              f"{time.strftime('%Y-%m-%d')}, code {commit_of(ROOT)}{took}.\n\nCommand: `{command_line()}`.\n\n"
              "The demo's calibration pool holds 64 examples a task: the rows without '8 examples' use all 64 (so "
              f"they have one draw); test: each task's 500 rows. {few}\n")
    if args.report_only:
        header += ("\nThis report read the results already there: to finish in time on a busy machine, the runs "
                   "were spread over two copies of the bench at once (`--only full` on one, `--only few` on the "
                   "other for draws 0 and 1, and the further draws as `python -m featcal_bench.method BENCH RUN "
                   "STUDY`, the process `bench run` starts for each run), their results/ copied into one.")
    text = markdown(report, study).split("\n## Sample efficiency")[0]  # this study has no sample curves
    text = text.replace("\n\n", "\n\n" + header + "\n", 1)
    write_bytes(args.out, text.encode())
    print(text)


if __name__ == "__main__":
    main()
