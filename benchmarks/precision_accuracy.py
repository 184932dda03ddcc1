"""What runtime.precision bf16 costs in accuracy: the same calibration in fp32 and bf16, side by side in one
invocation, on any pipeline config with evaluation (real weights and labelled test data).

    featcal demo --out demo                                   # builds the demo benchmark (real MiniLM, 3 tasks)
    python -m benchmarks.precision_accuracy demo/demo.yaml --examples 256 --calibration-split train \\
        --work /tmp/precision --out benchmarks/results/precision_accuracy.md

(The demo's calibration split holds 64 examples a task; its train split, unlabelled here, has 256 and more.)

For MiniLM-8, pass one of its method configs instead: `featcal bench run bench/minilm8 --runs ta_featcal` leaves
it in `bench/minilm8/runs/ta_featcal/run.yaml` (benchmarks/results/precision_accuracy_minilm8.md). Reports each
task's calibrated accuracy in both precisions, the gap closed, the relative difference of the calibrated weights
per block (weight matrices, ‖W_bf16 − W_fp32‖ / ‖W_fp32‖) and each run's stage seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from featcal.config import config_from_dict
from flows.pipeline import machine, run_pipeline
from storage.checkpoint import CanonicalCheckpoint
from tasks.context import context

PRECISIONS = ("fp32", "bf16")


def run(config: Path, examples: int | None, split: str | None, precision: str, run_dir: Path) -> dict:
    raw = yaml.safe_load(config.read_text())
    for source in raw["calibration"]["data"].values() if split else ():
        source["split"] = split
    raw.setdefault("runtime", {})["precision"] = precision
    raw["runtime"].pop("device", None)
    if examples is not None:
        raw["calibration"]["examples_per_task"] = examples
    started = time.perf_counter()
    run_pipeline(config_from_dict(raw, config.parent), run_dir)
    seconds = time.perf_counter() - started
    stages: dict[str, float] = {}
    for path in (run_dir / "records").glob("*.json"):
        rec = json.loads(path.read_text())
        if "key" in rec:
            kind = rec["stage"].split("/")[0]
            stages[kind] = stages.get(kind, 0.0) + rec["seconds"]
    return {"report": json.loads((run_dir / "report.json").read_text()), "seconds": seconds, "stages": stages}


def block_gaps(fp32_dir: Path, bf16_dir: Path) -> list[float]:
    """Per block, the largest relative Frobenius difference among its weight matrices."""
    ctx = context(fp32_dir)
    a = CanonicalCheckpoint(fp32_dir / "calibrated", ctx.adapter)
    b = CanonicalCheckpoint(bf16_dir / "calibrated", ctx.adapter)
    gaps = []
    for layer in range(ctx.num_blocks):
        wa, wb = a.with_prefix(ctx.adapter.block_prefix(layer)), b.with_prefix(ctx.adapter.block_prefix(layer))
        gaps.append(max(float((wb[k].double() - wa[k].double()).norm() / wa[k].double().norm())
                        for k in wa if wa[k].dim() == 2))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path, help="a pipeline config with evaluation enabled")
    parser.add_argument("--examples", type=int, help="calibration examples per task (default: the config's)")
    parser.add_argument("--calibration-split", help="the split calibration examples come from (default: the config's)")
    parser.add_argument("--work", type=Path, required=True, help="where the two run directories go")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {p: run(args.config.resolve(), args.examples, args.calibration_split, p, args.work / p)
               for p in PRECISIONS}
    tasks = sorted(results["fp32"]["report"]["tasks"])

    def acc(p: str, task: str, model: str = "calibrated") -> float:
        return 100 * results[p]["report"]["tasks"][task]["accuracy"][model]

    def mean(p: str, model: str = "calibrated") -> float:
        return sum(acc(p, t, model) for t in tasks) / len(tasks)

    lines = [
        "# Calibration in bf16 against fp32: accuracy and weights",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Config: `{args.config}`"
        + (f", {args.examples} calibration examples per task" if args.examples else "")
        + (f" from its {args.calibration_split} split" if args.calibration_split else "") + ". Command: "
        f"`python -m benchmarks.precision_accuracy {' '.join(sys.argv[1:])}`",
        "",
        "| model | " + " | ".join(tasks) + " | average | gap closed |",
        "|---|" + "---:|" * (len(tasks) + 2),
        "| experts | " + " | ".join(f"{acc('fp32', t, 'expert'):.1f}" for t in tasks)
        + f" | {mean('fp32', 'expert'):.1f} | |",
        "| merged | " + " | ".join(f"{acc('fp32', t, 'merged'):.1f}" for t in tasks)
        + f" | {mean('fp32', 'merged'):.1f} | |",
    ]
    for p in PRECISIONS:
        gap = results[p]["report"]["summary"]["gap_closed"]
        lines.append(f"| calibrated, {p} | " + " | ".join(f"{acc(p, t):.1f}" for t in tasks)
                     + f" | {mean(p):.1f} | {100 * gap:.1f} % |")
    delta = mean("bf16") - mean("fp32")
    lines += ["", f"bf16 − fp32, task average: {delta:+.2f} points (goal: within ±0.2).", "",
              "Relative difference of the calibrated weight matrices, bf16 against fp32, per block (largest in the "
              "block): " + ", ".join(f"{g:.1e}" for g in block_gaps(args.work / "fp32", args.work / "bf16")) + ".",
              "", "| precision | wall (s) | "
              + " | ".join(f"{k} (s)" for k in ("prepare", "gram", "solve", "propagate"))
              + " |", "|---|---:|---:|---:|---:|---:|"]
    for p in PRECISIONS:
        st = results[p]["stages"]
        lines.append(f"| {p} | {results[p]['seconds']:.1f} | "
                     + " | ".join(f"{st.get(k, 0.0):.1f}" for k in ("prepare", "gram", "solve", "propagate")) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
