"""The new merges alone and + FeatCal on the tiny example (issue 52 item 4): one pipeline run per architecture and
merge, FeatCal at the example's settings (λ 0.05, ρ 2.2, α 0.25) and, with --auto, also λ and ρ chosen on held-out
calibration rows; each run scores the merge and the calibrated model on every task's test split.

    python -m benchmarks.new_merges_example --example /tmp/example --work /tmp/new-merges \\
        --out benchmarks/results/new_merges_example.md

The tiny example's experts are a few minutes of training on toy tasks (featcal_bench/example.py): the table says how
the merges and FeatCal behave on them, not how they rank on real benchmarks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import example_run, model_means, results_header
from featcal_bench.example import build_tiny_example

MERGES = ("task_arithmetic", "ties", "tsv_m", "iso_c", "iso_cts", "wudi")
SETTINGS: dict[str, dict[str, Any]] = {"λ 0.05, ρ 2.2": {}, "λ, ρ auto": {"lambda": "auto", "rho": "auto"}}


def run(example: Path, work: Path, arch: str, merge: str, setting: str) -> tuple[dict[str, dict[str, float]], float]:
    """Per task, the accuracy of the merge, the calibrated model and the expert; and the run's seconds."""
    raw = yaml.safe_load((example / arch / "example.yaml").read_text())
    raw["merge"] = {"method": merge, **({"scaling": 0.3} if merge in ("task_arithmetic", "ties") else {})}
    raw["featcal"] = {**raw["featcal"], **SETTINGS[setting]}
    raw["evaluation"]["models"] = ["merged", "calibrated", "expert"]
    run_dir = work / f"{arch}-{merge}-{'auto' if SETTINGS[setting] else 'fixed'}"
    return example_run(raw, example / arch, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the run directories go")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--auto", action="store_true", help="also run FeatCal with λ and ρ auto")
    args = parser.parse_args()
    example = build_tiny_example(args.example)
    settings = list(SETTINGS) if args.auto else list(SETTINGS)[:1]
    rows = []
    for arch in ("bert", "clip"):
        for setting in settings:
            for merge in MERGES:
                acc, seconds = run(example, args.work, arch, merge, setting)
                means = model_means(acc)
                merged, calibrated, expert = means["merged"], means["calibrated"], means["expert"]
                worst = min(a["calibrated"] - a["merged"] for a in acc.values())
                rows.append(f"| {arch} | {merge} | {setting} | {100 * expert:.1f} | {100 * merged:.1f} | "
                            f"{100 * calibrated:.1f} | {100 * (calibrated - merged) / (expert - merged):.0f} % | "
                            f"{100 * worst:+.1f} | {seconds:.0f} |")
                print(rows[-1], flush=True)
    lines = [*results_header("The new merges alone and + FeatCal on the tiny example "
                             "(`benchmarks/new_merges_example.py`)"),
             "Mean test accuracy over the example's 3 tasks (BERT: topic, negation, count; CLIP: quadrant, colour, "
             "stripes), %. TA and TIES at scale 0.3; TSV-M, Iso-C, Iso-CTS at α 1 and WUDI with 300 Adam steps at "
             "1e-5 (FusionBench's defaults). `gap closed`: (FeatCal − merge) / (expert − merge) on the means; "
             "`worst task`: the lowest per-task change from the merge to FeatCal, points. `s`: the whole run "
             "(merge, calibration, evaluation) on this shared 2-core machine.", "",
             "| model | merge | FeatCal | experts | merge | + FeatCal | gap closed | worst task | s |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
