"""featcal.calibrate_head_side on the tiny offline BERT example (its experts read through BERT's pooler), off and
on, side by side in one invocation; MiniLM-8's rows are in benchmarks/results/minilm8.md.

    python benchmarks/head_side_example.py WORK_DIR

The tiny CLIP example is not measured: its experts are CLIPForImageClassification, whose head averages the last
block's patch tokens and never reads post_layernorm, so it has no head side to calibrate (the pipeline refuses it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from featcal.config import config_from_dict
from featcal_bench.example import build_tiny_example
from flows.console import setup_logging
from flows.pipeline import machine, run_pipeline

OUT = Path(__file__).resolve().parent / "results" / "head_side_example.md"
SETTINGS = {"paper (λ 0.05, ρ 2.2)": {}, "λ, ρ auto": {"lambda": "auto", "rho": "auto"}}


def main(work: Path) -> None:
    setup_logging()
    root = build_tiny_example(work / "example", archs=("bert",)) / "bert"
    rows = []
    for label, featcal in SETTINGS.items():
        for head_side in (False, True):
            raw = yaml.safe_load((root / "example.yaml").read_text())
            raw["featcal"].update(featcal, calibrate_head_side=head_side)
            name = f"{'auto' if featcal else 'paper'}_{'head' if head_side else 'blocks'}"
            started = time.perf_counter()
            run_pipeline(config_from_dict(raw, root, source=name), work / name)
            report = json.loads((work / name / "report.json").read_text())
            avg, tasks = report["summary"]["average_accuracy"], report["tasks"]
            rows.append(f"| {label} | {'yes' if head_side else 'no'} | {100 * avg['merged']:.1f} | "
                        f"{100 * avg['calibrated']:.1f} | {100 * avg['expert']:.1f} | "
                        + " | ".join(f"{100 * tasks[t]['accuracy']['calibrated']:.1f}" for t in sorted(tasks))
                        + f" | {time.perf_counter() - started:.0f} |")
    tasks = sorted(tasks)
    text = "\n".join([
        "# Head-side calibration on the tiny BERT example", "",
        f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; `python benchmarks/head_side_example.py WORK`. Three "
        "synthetic tasks, 64 calibration examples each, test accuracy (%) on 200 rows a task (one row = 0.5 "
        "point of a task, 0.17 of the average).", "",
        "| setting | head side | TA | TA + FeatCal | experts | " + " | ".join(tasks) + " | run (s) |",
        "|---|---|---:|---:|---:|" + "---:|" * (len(tasks) + 1), *rows, ""])
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
