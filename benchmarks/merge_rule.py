"""Applies the rule that picks the default starting merge (docs/benchmarks.md, "The rule that picks the default
starting merge"): each candidate merge followed by FeatCal at today's defaults, against task arithmetic followed by
the same FeatCal, read on each benchmark's validation rows through the head check (agreement with each task's expert,
no labels), never on test rows.

    python -m benchmarks.merge_rule --bench minilm8=M8/bench --bench demo=DEMO/bench:train:200 \\
        --out benchmarks/results/merge_rule.md

Runs are found by the MiniLM study's names: `ta_featcal_paper` and `{merge}_featcal`. A candidate not run on every
benchmark is judged where it ran and cannot be adopted; a missing `ta_featcal_paper` stops the tool."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import bench_arguments, benches_line, results_header, write_rule_report
from benchmarks.default_rule import (
    BAR,
    COSTLY,
    COSTLY_GAIN,
    MAX_LOSS,
    MIN_GAIN,
    REQUIRED,
    agreement_changes,
    shared_conditions,
)

BASELINE = ("task_arithmetic", "ta_featcal_paper")
CANDIDATES = (("tsv_m", "tsv_m_featcal"), ("iso_c", "iso_c_featcal"), ("iso_cts", "iso_cts_featcal"),
              ("wudi", "wudi_featcal"))


@dataclass(frozen=True)
class Agreement:
    """One run on one benchmark: the calibrated model's agreement with the experts (task mean, points), the worst
    task's change against its own merge (points), merge + calibration seconds, and per task."""

    mean: float
    worst: float
    seconds: float
    per_task: dict[str, float]


def _agreement(bench: Path, split: str, rows: int | None, run: str) -> Agreement | None:
    """None where the run was not made on this benchmark."""
    from featcal_bench.protect import head_check  # torch, transformers: only once the arguments are good
    from storage.atomic import read_json

    if not (bench / "results" / f"{run}.json").is_file():
        return None
    tasks = head_check(bench, run, split, rows)["tasks"]
    calibrated = {t: 100 * e["calibrated"]["agreement"] for t, e in tasks.items()}
    worst = min(agreement_changes(tasks).values())
    cost = read_json(bench / "results" / f"{run}.json")["cost"]
    return Agreement(statistics.fmean(calibrated.values()), worst,
                     cost["calibration_seconds"] + cost["merge_seconds"], calibrated)


def _passes(new: dict[str, Agreement], old: dict[str, Agreement]) -> tuple[bool, float, str]:
    """The rule's conditions, a candidate against TA + FeatCal: (passes, mean Δ agreement, why)."""
    deltas = {b: new[b].mean - old[b].mean for b in new}
    mean, losing, costly = shared_conditions(deltas, {b: (new[b].seconds, old[b].seconds) for b in new})
    reasons = [f"mean Δ {mean:+.2f} < +{MIN_GAIN}"] if mean < MIN_GAIN else []
    reasons += [f"{b} {deltas[b]:+.2f} < −{MAX_LOSS}" for b in losing]
    reasons += [f"{b}: worst task {new[b].worst:+.1f} against its merge" for b in new if new[b].worst < BAR]
    if costly and mean < COSTLY_GAIN:
        reasons.append(f"more than {COSTLY:g}× the seconds on {', '.join(costly)} with mean Δ {mean:+.2f} "
                       f"< +{COSTLY_GAIN}")
    summary = f"mean Δ agreement {mean:+.2f} (" + ", ".join(f"{b} {d:+.2f}" for b, d in deltas.items()) + ")"
    return not reasons, mean, summary + ("" if not reasons else ": " + "; ".join(reasons))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="append", required=True, metavar="NAME=DIR[:SPLIT[:ROWS]]",
                        help="a benchmark directory (MiniLM-8 and the demo required), the split its head checks "
                             "read (default validation; the demo has none: train) and how many rows a task")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    benches = bench_arguments(args.bench)
    found = {run: {b: _agreement(d, split, rows, run) for b, (d, split, rows) in benches.items()}
             for _, run in (BASELINE, *CANDIDATES)}
    measured = {run: {b: a for b, a in by_bench.items() if a is not None} for run, by_bench in found.items()}
    lacking = [b for b in benches if b not in measured[BASELINE[1]]]
    if lacking:
        raise SystemExit(f"{BASELINE[1]} is missing on {', '.join(lacking)}; make it with `featcal bench run DIR "
                         f"--runs {BASELINE[1]}`")
    table = [f"| {b} | `{run}` | {a.mean:.2f} | {a.worst:+.1f} | {a.seconds:.0f} | "
             + ", ".join(f"{t} {v:.1f}" for t, v in a.per_task.items()) + " |"
             for run, by_bench in measured.items() for b, a in by_bench.items()]
    lines, passed = [], {}
    for merge, run in CANDIDATES:
        unmeasured = [b for b in benches if b not in measured[run]]
        if not measured[run]:
            lines.append(f"- **{merge}** (`{run}`): not run on any benchmark")
            continue
        ok, mean, why = _passes(measured[run], measured[BASELINE[1]])
        if unmeasured:  # judged where it ran; adopted only with every benchmark's figures
            why += f"; not run on {', '.join(unmeasured)}"
        lines.append(f"- **{merge}** (`{run}` against `{BASELINE[1]}`): "
                     + ("passes; " if ok and not unmeasured else "fails; " if not ok else "not adoptable; ") + why)
        if ok and not unmeasured:
            passed[merge] = mean
    chosen = max(passed, key=passed.__getitem__) if passed else BASELINE[0]
    missing = [b for b in REQUIRED if b not in benches]
    lines.append(f"\n**Outcome:** `merge.method: {chosen}`" + (" (unchanged)." if chosen == BASELINE[0] else ".")
                 if not missing else f"\n**Outcome:** no default changes: the rule needs {' and '.join(REQUIRED)}, "
                 f"and {', '.join(missing)} was not measured; on {', '.join(benches)} alone it would pick `{chosen}`.")
    header = [
        *results_header("The rule that picks the default starting merge, applied (issue 52 §5)"),
        benches_line(benches), "",
        "The rule: docs/benchmarks.md, *The rule that picks the default starting merge*. *agreement*: the task mean "
        "of how often the calibrated model's top class is its expert's (points, no labels); *worst*: the lowest "
        "task's change in agreement against the run's own merge; seconds: merge + calibration, wall time on a "
        "shared machine.", "",
        "| benchmark | run | agreement | worst | seconds | per task |", "|---|---|---:|---:|---:|---|"]
    write_rule_report(args.out, header, table, lines)


if __name__ == "__main__":
    main()
