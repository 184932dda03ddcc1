"""The CLIP benchmark's part of its cost estimate (featcal_bench/estimate.py): a pass is one image (or zero-shot
prompt) through a vision (or text) tower, timed on the base vision tower."""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from transformers import AutoImageProcessor, CLIPVisionModel

from featcal_bench.clip.prompts import CLASS_NAMES, TEMPLATES
from featcal_bench.estimate import (
    CALIBRATION_PASSES,
    Passes,
    Speed,
    calibration_rows,
    cost_estimate,
    evaluation_passes,
    per_device,
    seconds_per_row,
    test_rows,
)
from featcal_bench.layout import BASE, data_dir
from featcal_bench.runs import SURGERY_METHODS, MethodRun
from featcal_bench.study import load_study

SURGERY_PASSES = (
    2  # the expert's and the merged model's features of each pool image, once (featcal_bench/clip/methods.py)
)
TIMED_IMAGES = 16
STUDY = Path(__file__).with_name("study.yaml")  # the runs the estimate counts


def forward_passes(run: MethodRun, rows: dict[str, dict[str, int]]) -> Passes:
    """Image forward passes of one method run (text-tower passes for the zero-shot prompts counted alike): `rows` is
    each task's calibration pool and test split size."""
    if run.method in SURGERY_METHODS:
        return Passes(SURGERY_PASSES * calibration_rows(run, rows) + test_rows(rows))
    prompts = sum(len(CLASS_NAMES[t]) * len(TEMPLATES[t]) for t in rows)
    return Passes(CALIBRATION_PASSES * calibration_rows(run, rows) + evaluation_passes(run.models) * test_rows(rows)
                  + prompts)


def image_speeds(bench: Path, task: str) -> dict[str, Speed]:
    """One image through the base vision tower on each device here: batches of up to 16 of `task`'s calibration
    images."""
    model = CLIPVisionModel.from_pretrained(bench / BASE, local_files_only=True).eval()
    images = datasets.load_from_disk(str(bench / data_dir(task)))["calibration"][:TIMED_IMAGES]["image"]
    pixels = AutoImageProcessor.from_pretrained(bench / BASE, local_files_only=True)(images, return_tensors="pt")

    def speed(device: torch.device) -> Speed:
        on, x = model.to(device), pixels["pixel_values"].to(device)
        return Speed(seconds_per_row(lambda: on(pixel_values=x), len(images), device))

    return per_device(speed)


def clip_cost_estimate(bench: Path, rows: dict[str, dict[str, int]]) -> str:
    """The CLIP benchmark's estimate (markdown); `rows`: per task, its calibration pool and test split size."""
    passes = {name: forward_passes(run, rows) for name, run in load_study(STUDY).runs.items()}
    about = (f"Time, from forward passes through the base vision tower timed here (batches of {TIMED_IMAGES} images). "
             f"FeatCal's and RegMean's calibration counts {CALIBRATION_PASSES:g} passes per example (their stages "
             "measured against their forward floor, benchmarks/results/pipeline_cost_vitb32.md); evaluation one per "
             "test row and scored model, plus the expert as drift reference.")
    return cost_estimate(bench, passes, image_speeds(bench, sorted(rows)[0]), about)
