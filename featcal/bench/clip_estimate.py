"""What the CLIP benchmark will cost on this machine, said by `bench build` before anything runs: `featcal plan`'s
figures for one FeatCal run's config (disk and RAM; plan estimates no time), and a time estimate from the forward
passes every method run makes, at the speed the base vision tower runs here."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoImageProcessor, CLIPVisionModel

from featcal.bench.build import BASE, data_dir
from featcal.bench.clip_methods import clip_method_runs
from featcal.bench.clip_prompts import CLASS_NAMES, TEMPLATES
from featcal.bench.methods import MethodRun
from storage.rundir import RunDir

CONFIGS = "configs"  # one pipeline config per method run, `featcal plan` / `featcal run` ready
# FeatCal's calibration stages took 5.4 × their floor of forward passes (the expert's and the merged model's, 2 per
# example) on the ViT-B/32 shape with 8 experts: benchmarks/results/pipeline_cost_vitb32.md. RegMean's run the same
# stages (docs/design.md §2.10).
CALIBRATION_PASSES = 2 * 5.4
SURGERY_PASSES = 2  # the expert's and the merged model's features of each pool image, once (featcal/bench/clip_methods.py)
TIMED_IMAGES = 16


def split_sizes(bench: Path, tasks: list[str]) -> dict[str, dict[str, int]]:
    """Per task, the sizes of its calibration pool and test split, as its data stage recorded them."""
    return {t: {split: RunDir(bench).record(f"data/{t}")["info"][split] for split in ("calibration", "test")}
            for t in tasks}


def evaluation_passes(models: tuple[str, ...]) -> int:
    """Forward passes per test row: every scored model, and the expert as the drift reference whenever the merged or
    calibrated model is scored (tasks/evaluate.py)."""
    reference = bool({"merged", "calibrated"} & set(models)) and "expert" not in models
    return len(models) + int(reference)


def forward_passes(run: MethodRun, rows: dict[str, dict[str, int]]) -> float:
    """Image forward passes of one method run (text-tower passes for the zero-shot prompts counted alike): `rows` is
    each task's calibration pool and test split size."""
    calibration = sum(min(run.examples, r["calibration"]) for r in rows.values())
    test = sum(r["test"] for r in rows.values())
    if run.method == "surgery":
        return SURGERY_PASSES * calibration + test
    prompts = sum(len(CLASS_NAMES[t]) * len(TEMPLATES[t]) for t in rows)
    return CALIBRATION_PASSES * calibration + evaluation_passes(run.models) * test + prompts


def seconds_per_image(bench: Path, task: str) -> float:
    """One image through the base vision tower here, with torch's threads: the median of 3 batches of up to 16 of
    `task`'s calibration images, after one to warm up."""
    model = CLIPVisionModel.from_pretrained(bench / BASE, local_files_only=True).eval()
    images = datasets.load_from_disk(str(bench / data_dir(task)))["calibration"][:TIMED_IMAGES]["image"]
    pixels = AutoImageProcessor.from_pretrained(bench / BASE, local_files_only=True)(images, return_tensors="pt")
    seconds = []
    with torch.inference_mode():
        for _ in range(4):
            started = time.perf_counter()
            model(pixel_values=pixels["pixel_values"])
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:]) / len(images)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def cost_estimate(bench: Path, rows: dict[str, dict[str, int]]) -> str:
    """Markdown: `featcal plan` on the TA + FeatCal run's config, then each method run's forward passes and time at
    the speed measured here. `rows`: per task, its calibration pool and test split size."""
    from featcal.config import load_config
    from flows.plan import plan, render

    config = bench / CONFIGS / "ta_featcal.yaml"
    per_image = seconds_per_image(bench, sorted(rows)[0])
    runs = clip_method_runs()
    passes = {name: forward_passes(run, rows) for name, run in runs.items()}
    lines = [f"`featcal plan {config}` (one method run; plan estimates disk and RAM, not time):", "", "```",
             render(plan(load_config(config))), "```", "",
             f"Time, from forward passes at {per_image * 1000:.3g} ms per image through the base vision tower on this "
             f"machine ({torch.get_num_threads()} torch threads; batches of {TIMED_IMAGES}). FeatCal's and RegMean's "
             f"calibration counts {CALIBRATION_PASSES:g} passes per example (their stages measured against their "
             "forward floor, benchmarks/results/pipeline_cost_vitb32.md); evaluation one per test row and scored "
             "model, plus the expert as drift reference:", "",
             "| method run | forward passes | estimated time |", "|---|---:|---:|"]
    lines += [f"| {name} | {passes[name]:,.0f} | {_duration(passes[name] * per_image)} |" for name in runs]
    total = sum(passes.values())
    lines += [f"| **all** (`featcal bench run`) | {total:,.0f} | {_duration(total * per_image)} |", "",
              "Evaluation dominates on a CPU: `featcal bench build ... --test-rows N` scores every method on a seeded "
              "subset of N test rows per task instead."]
    return "\n".join(lines) + "\n"
