"""What a hub benchmark will cost on this machine, said by `bench build` before anything runs: `featcal plan`'s figures
for one FeatCal run's config (disk and RAM; plan estimates no time), and a time estimate from the passes every method
run makes, at the speed the base runs here: on the CPU, and on the GPU too when torch sees one. Each benchmark says
what its passes are and times them on its base (featcal_bench/clip/estimate.py, featcal_bench/t5/estimate.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal.evaluation import DRIFT_MODELS
from featcal_bench.runs import MethodRun
from storage.atomic import write_bytes
from storage.rundir import RunDir

CONFIGS = "configs"  # one pipeline config per method run, `featcal plan` / `featcal run` ready
ESTIMATE = "estimate.md"
# FeatCal's calibration stages took 5.4 × their floor of forward passes (the expert's and the merged model's, 2 per
# example) on the ViT-B/32 shape with 8 experts: benchmarks/results/pipeline_cost_vitb32.md. RegMean's run the same
# stages (docs/design.md §2.10).
CALIBRATION_PASSES = 2 * 5.4


@dataclass(frozen=True)
class Passes:
    """One method run's work: forward passes, and (encoder–decoder evaluation) greedy generate calls, one row each."""

    forward: float
    generate: float = 0.0

    def seconds(self, speed: Speed) -> float:
        return self.forward * speed.forward + self.generate * speed.generate


@dataclass(frozen=True)
class Speed:
    """Seconds one row takes through the base on one device: a forward pass, and a greedy generate call."""

    forward: float
    generate: float = 0.0


def split_sizes(bench: Path, tasks: list[str]) -> dict[str, dict[str, int]]:
    """Per task, the sizes of its calibration pool and test split, as its data stage recorded them."""
    sizes = {}
    for t in tasks:
        record = RunDir(bench).record(f"data/{t}")
        if record is None:
            raise FileNotFoundError(f"{bench}: build stage data/{t} has no record; run `featcal bench build` first")
        sizes[t] = {split: record["info"][split] for split in ("calibration", "test")}
    return sizes


def rows_about(about: Callable[[Any, dict[str, int], dict[str, int]], str]) -> Callable[[Path, Any], str]:
    """A report's `about` from a recipe's `about(spec, test rows, calibration rows)`, both per task as built."""

    def built(bench: Path, spec: Any) -> str:
        rows = split_sizes(bench, list(spec.tasks))
        return about(spec, {t: r["test"] for t, r in rows.items()}, {t: r["calibration"] for t, r in rows.items()})

    return built


def calibration_rows(run: MethodRun, rows: dict[str, dict[str, int]]) -> int:
    """The examples the run calibrates on: its examples per task, at most each task's pool."""
    return sum(min(run.examples, r["calibration"]) for r in rows.values())


def test_rows(rows: dict[str, dict[str, int]]) -> int:
    return sum(r["test"] for r in rows.values())


def drifting_models(models: tuple[str, ...]) -> int:
    """The scored models whose drift from the expert is measured (tasks/evaluate.py)."""
    return len(set(DRIFT_MODELS) & set(models))


def evaluation_passes(models: tuple[str, ...]) -> int:
    """Models run per test row: every scored model, and the expert as the drift reference whenever the merged or
    calibrated model is scored (tasks/evaluate.py)."""
    return len(models) + int(bool(drifting_models(models)) and "expert" not in models)


def devices() -> list[torch.device]:
    """Where the pass is timed: the CPU always, and the GPU when torch sees one."""
    return [torch.device("cpu"), *([torch.device("cuda")] if torch.cuda.is_available() else [])]


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"CPU ({torch.get_num_threads()} torch threads)"


def per_device(speed: Callable[[torch.device], Speed]) -> dict[str, Speed]:
    """`speed` measured on every device here, by its label."""
    return {device_label(d): speed(d) for d in devices()}


def seconds_per_row(call: Callable[[], object], rows: int, device: torch.device) -> float:
    """`call` (a batch of `rows` rows) timed: the median of 3 calls after one to warm up, waiting for the GPU to
    finish each so its time is the work's, not the launch's."""
    seconds = []
    with torch.inference_mode():
        for _ in range(4):
            started = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:]) / rows


def duration(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 3600
        else f"{seconds / 60:.1f} min"
        if seconds >= 60
        else f"{seconds:.0f} s"
    )


def _table(passes: dict[str, Passes], speeds: dict[str, Speed]) -> list[str]:
    """One row per method run and one for them all: its passes (generate calls only where there are any) and its
    time on each device."""
    generates = any(p.generate for p in passes.values())
    rows = {**passes, "**all** (`featcal bench run`)": Passes(sum(p.forward for p in passes.values()),
                                                              sum(p.generate for p in passes.values()))}
    head = ["method run", "forward passes", *(["generate calls"] if generates else []), *(f"time, {d}" for d in speeds)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, p in rows.items():
        counts = [f"{p.forward:,.0f}", *([f"{p.generate:,.0f}"] if generates else [])]
        lines.append("| " + " | ".join([name, *counts, *(duration(p.seconds(s)) for s in speeds.values())]) + " |")
    return lines


def _machine(speeds: dict[str, Speed]) -> str:
    """Where the times were measured; without a GPU, how to get its figure (none is made up)."""
    from flows.pipeline import machine

    line = f"Measured on {machine()}: {', '.join(speeds)}."
    if not torch.cuda.is_available():
        line += " No GPU here: run `featcal bench build` on a GPU machine for the GPU time."
    return line


def cost_estimate(bench: Path, passes: dict[str, Passes], speeds: dict[str, Speed], about: str) -> str:
    """Markdown: `featcal plan` on the TA + FeatCal run's config, then each method run's passes and time at the
    `speeds` measured here; `about` says what a pass is and how it was timed."""
    from featcal.config import load_config
    from flows.plan import plan, render

    config = bench / CONFIGS / "ta_featcal.yaml"
    speed = "; ".join(
        f"{d}: {s.forward * 1000:.3g} ms per forward"
        + (f", {s.generate * 1000:.3g} ms per generate" if s.generate else "")
        for d, s in speeds.items()
    )
    lines = [
        f"`featcal plan {config}` (one method run; plan estimates disk and RAM, not time):",
        "",
        "```",
        render(plan(load_config(config))),
        "```",
        "",
        f"{about} Per row, {speed}.",
        "",
        _machine(speeds),
        "",
        *_table(passes, speeds),
        "",
        "Where evaluation dominates, `featcal bench build ... --test-rows N` scores every method on a seeded subset "
        "of N test rows per task instead.",
    ]
    return "\n".join(lines) + "\n"


def write_estimate(bench: Path, estimate: str) -> str:
    """`estimate`, also written to the benchmark's estimate.md."""
    write_bytes(bench / ESTIMATE, estimate.encode())
    return estimate
