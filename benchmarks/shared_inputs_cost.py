"""What calibration.shared_inputs costs (issue 54 §2): the tiny BERT example (3 tasks) at 8 examples a task, without
the option, with w fixed and with w auto, each with λ fixed and λ auto: the rows each task's stages read, and the
stage kinds' summed seconds from the run records.

    python -m benchmarks.shared_inputs_cost [--out benchmarks/results/shared_inputs_cost.md] [--repeats 3]

Seconds are the median over `--repeats` fresh runs (the machine is shared: read the rows' ratios, not the seconds).
The accuracy is not measured here: the tiny example's tasks say nothing about quality (the MiniLM study's row does)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, command_line, commit_of, cpu_line
from featcal.config import config_from_dict
from featcal_bench.example import build_tiny_example
from flows.pipeline import run_pipeline
from storage.atomic import write_bytes
from storage.rundir import RunDir
from tests.tiny_example_inputs import set_key

EXAMPLES = 8
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("λ 0.1, no shared inputs", {"featcal.lambda": 0.1}),
    ("λ 0.1, shared inputs w 0.5", {"featcal.lambda": 0.1, "calibration.shared_inputs.weight": 0.5}),
    ("λ 0.1, shared inputs w auto", {"featcal.lambda": 0.1, "calibration.shared_inputs.weight": "auto"}),
    ("λ auto, no shared inputs", {"featcal.lambda": "auto"}),
    ("λ auto, shared inputs w auto", {"featcal.lambda": "auto", "calibration.shared_inputs.weight": "auto"}),
]
KINDS = ("prepare", "gram", "solve", "propagate")


def _config(example: Path, overrides: dict[str, Any]):
    import yaml

    raw = yaml.safe_load((example / "bert" / "example.yaml").read_text())
    for key, value in {"calibration.examples_per_task": EXAMPLES, "evaluation.enabled": False, **overrides}.items():
        set_key(raw, key, value)
    return config_from_dict(raw, example / "bert")


def _one_run(example: Path, overrides: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    cfg = _config(example, overrides)
    started = time.perf_counter()
    run_pipeline(cfg, run_dir)
    wall = time.perf_counter() - started
    records = RunDir(run_dir).stage_records()
    seconds: dict[str, float] = defaultdict(float)
    for stage, record in records.items():
        seconds[stage.split("/")[0]] += record["seconds"]
    info = records[f"prepare/{cfg.tasks[0]}"]["info"]
    return {"wall": wall, "seconds": dict(seconds), "rows": info["examples"] + info.get("foreign_examples", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shared_inputs_cost.md")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shared_inputs_cost_") as tmp:
        example = Path(tmp) / "example"
        build_tiny_example(example, ("bert",))
        results = []
        for label, overrides in SETTINGS:
            runs = [_one_run(example, overrides, Path(tmp) / f"run{len(results)}_{k}") for k in range(args.repeats)]
            results.append((label, runs))
    lines = [
        "# What calibration.shared_inputs costs on the tiny BERT example (3 tasks, 8 examples a task)",
        "",
        f"Host: {cpu_line()}, shared with other jobs. {time.strftime('%Y-%m-%d')}, code {commit_of(ROOT)}.",
        "",
        f"Command: `{command_line()}`.",
        "",
        f"Each setting ran {args.repeats} times from scratch (evaluation off); seconds are medians of the run records' "
        "stage seconds summed by kind, and of the whole run's wall time. *rows* is what each task's prepare, Gram and "
        "propagate stages read: its own examples, plus with shared inputs the other two tasks'.",
        "",
        "| setting | rows a task | " + " | ".join(f"{k} (s)" for k in KINDS) + " | run wall (s) |",
        "|---|---:|" + "---:|" * len(KINDS) + "---:|",
    ]
    for label, runs in results:
        med = {k: statistics.median(r["seconds"].get(k, 0.0) for r in runs) for k in KINDS}
        wall = statistics.median(r["wall"] for r in runs)
        lines.append(f"| {label} | {runs[0]['rows']} | " + " | ".join(f"{med[k]:.2f}" for k in KINDS)
                     + f" | {wall:.1f} |")
    write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
