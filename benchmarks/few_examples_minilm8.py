"""Few examples on a built MiniLM benchmark (issue 33 §2): each FeatCal setting at 8 calibration examples per task
against the same setting at 256, as a share of its 256-example gain over task arithmetic, paired on the test rows.

    featcal bench run BENCH --runs ta_featcal ta_featcal_auto ta_featcal_auto_n008 ...   # the runs named below
    python benchmarks/few_examples_minilm8.py BENCH --out benchmarks/results/few_examples_minilm8.md

A setting whose runs are missing is left out of its table; ta_featcal (task arithmetic's row) is required. The
benchmark's runs all draw their 8 rows a task with one seed; to show how much the draw decides, this script also
calibrates λ auto, λ auto + head metric and the tuned setting on three more draws (about a minute each on 2 cores,
cached under BENCH/few_draws/).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_summary import summarise  # noqa: E402
from featcal.config import config_from_dict  # noqa: E402
from featcal_bench.minilm.recipe import (  # noqa: E402
    AUTO,  # noqa: E402
    FEATCAL,
    pipeline_config,
)
from featcal_bench.minilm.spec import BenchSpec  # noqa: E402
from featcal_bench.paired import RESAMPLES, SEED, compared, p_text  # noqa: E402
from featcal_bench.report import correct_rows  # noqa: E402
from featcal_bench.runs import MethodRun  # noqa: E402
from flows.pipeline import machine, run_pipeline  # noqa: E402
from storage.atomic import read_json  # noqa: E402

# (setting, its run at 8 examples per task, the run at 256 it is measured against)
SETTINGS = [
    ("λ auto (ρ 2.2)", "ta_featcal_auto_n008", "ta_featcal_auto"),
    ("λ auto, half the rows held out", "ta_featcal_auto_h2_n008", "ta_featcal_auto"),
    ("λ auto, 4-fold cross-validated", "ta_featcal_auto_cv4_n008", "ta_featcal_auto_cv4"),
    ("λ auto, 8-fold cross-validated", "ta_featcal_auto_cv8_n008", "ta_featcal_auto_cv8"),
    ("λ and ρ auto", "ta_featcal_auto_rho_n008", "ta_featcal_auto"),
    ("λ auto from 0.001 + shrinkage auto", "ta_featcal_auto_shrink_n008", "ta_featcal_auto_shrink"),
    ("λ auto + head metric η 1", "ta_featcal_auto_head1_n008", "ta_featcal_auto_head1"),
    ("paper's λ 0.05, ρ 2.2 (fixed)", "ta_featcal_paper_n008", "ta_featcal_paper"),
    ("validation-tuned λ 0.5, ρ 3 (fixed)", "ta_featcal_n008", "ta_featcal"),
]


# Further draws of the 8 rows a task (calibration.seed; the benchmark's runs drew with 42), for three settings:
# (setting, its 8-example run, its config, its 256-example run).
DRAWS = (43, 44, 45)
DRAWN = [("λ auto (ρ 2.2)", "auto", AUTO, "ta_featcal_auto"),
         ("λ auto, 4-fold cross-validated", "auto_cv4", {**AUTO, "holdout_every": 4, "holdout_folds": 4},
          "ta_featcal_auto_cv4"),
         ("λ auto, 8-fold cross-validated", "auto_cv8", {**AUTO, "holdout_every": 8, "holdout_folds": 8},
          "ta_featcal_auto_cv8"),
         ("λ auto + head metric η 1", "auto_head1", {**AUTO, "head_metric": 1.0}, "ta_featcal_auto_head1"),
         ("validation-tuned λ 0.5, ρ 3 (fixed)", "tuned", FEATCAL, "ta_featcal")]


def average(correct: dict[str, list[bool]]) -> float:
    return 100 * sum(sum(c) / len(c) for c in correct.values()) / len(correct)


def drawn_average(bench: Path, slug: str, featcal: dict, seed: int) -> float:
    """The test average of TA + FeatCal calibrated on 8 rows a task drawn with `seed`."""
    raw = pipeline_config(bench, BenchSpec.load(bench), MethodRun("task_arithmetic", "featcal", examples=8,
                                                                   featcal=featcal))
    raw["calibration"]["seed"] = seed
    run_dir = bench / "few_draws" / f"{slug}_n008_s{seed}"
    run_pipeline(config_from_dict(raw, root=bench, source=f"few draws {slug} {seed}"), run_dir, reuse=True)
    tasks = read_json(run_dir / "report.json")["tasks"]
    return 100 * sum(s["accuracy"]["calibrated"] for s in tasks.values()) / len(tasks)


def markdown(bench: Path) -> str:
    results = {p.stem: read_json(p) for p in (bench / "results").glob("*.json")}
    if "ta_featcal" not in results:
        raise SystemExit(f"{bench / 'results' / 'ta_featcal.json'} is missing: task arithmetic's row comes from run "
                         f"ta_featcal (featcal bench run {bench} --runs ta_featcal)")
    tasks = sorted(results["ta_featcal"]["accuracy"])
    ta = average(correct_rows(results["ta_featcal"], "merged", tasks))
    lines = [f"# Few examples on `{bench.name}`, {len(tasks)} tasks (issue 33 §2)", "",
             f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; written by `benchmarks/few_examples_minilm8.py`.", "",
             f"Task arithmetic (0.3): {ta:.2f}. Share: (8-example average − TA) / (256-example average − TA). "
             "Δ: the 8-example row minus the 256-example row on the same test rows, with its paired-bootstrap 95 % "
             f"interval (each task's rows resampled, {RESAMPLES:,} resamples, seed {SEED}) and McNemar's exact p. Goal: a share "
             "≥ 80 %.", "",
             "| setting | 8 examples | 256 examples | share of the 256-example gain | Δ 8 − 256 [95 % CI] | p |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, few, full in SETTINGS:
        if few not in results or full not in results:
            continue
        a, b = (correct_rows(results[r], "calibrated", tasks) for r in (few, full))
        c = compared(a, b, tasks)
        share = (average(a) - ta) / (average(b) - ta)
        lo, hi = c["ci"]
        lines.append(f"| {name} | {average(a):.2f} | {average(b):.2f} | {100 * share:.0f} % | "
                     f"{100 * c['difference']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] | {p_text(c['p_value'])} |")
    lines += ["", "Runs (8 / 256): " + "; ".join(f"`{few}` / `{full}`" for _, few, full in SETTINGS) + ".", "",
              "## At 256 examples, against λ auto", "",
              "Each setting's 256-example row minus λ auto's (`ta_featcal_auto`), paired on the test rows as above: "
              "the goal asks that the 256-example accuracy not be lower.", "",
              "| setting | 256 examples | λ auto | Δ [95 % CI] | p |", "|---|---:|---:|---:|---:|"]
    auto = correct_rows(results["ta_featcal_auto"], "calibrated", tasks) if "ta_featcal_auto" in results else None
    for name, _, full in SETTINGS:
        if auto is None or full == "ta_featcal_auto" or full not in results:
            continue
        b = correct_rows(results[full], "calibrated", tasks)
        c = compared(b, auto, tasks)
        lo, hi = c["ci"]
        lines.append(f"| {name} | {average(b):.2f} | {average(auto):.2f} | {100 * c['difference']:+.2f} "
                     f"[{100 * lo:+.2f}, {100 * hi:+.2f}] | {p_text(c['p_value'])} |")
    lines += ["",
              "## Other draws of the 8 rows", "",
              f"The same settings calibrated on 8 rows a task drawn with `calibration.seed` {', '.join(map(str, DRAWS))} "
              "(the runs above: 42); share of the 256-example run's gain over TA.", "",
              "| setting | " + " | ".join(f"seed {d}" for d in (42, *DRAWS)) + " | mean share | range |",
              "|---|" + "---:|" * (len(DRAWS) + 3)]
    for name, slug, featcal, full in DRAWN:
        if full not in results or f"{full}_n008" not in results:
            continue
        gain = average(correct_rows(results[full], "calibrated", tasks)) - ta
        first = average(correct_rows(results[f"{full}_n008"], "calibrated", tasks))
        shares = [(a - ta) / gain for a in (first, *(drawn_average(bench, slug, featcal, d) for d in DRAWS))]
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.0f} %" for x in shares) +
                     f" | **{100 * sum(shares) / len(shares):.0f} %** | {100 * min(shares):.0f}–{100 * max(shares):.0f} % |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    summarise(__doc__.splitlines()[0], markdown)
