"""The FLAN-T5 benchmark's part of its cost estimate (featcal_bench/estimate.py). Its passes are encoder–decoder runs
on a prompt: calibration forwards teacher-forced on the prompt's answer, as the pipeline runs them; evaluation greedy
`generate` calls of up to MAX_NEW_TOKENS tokens, plus teacher-forced forwards where drift is measured
(tasks/evaluate.py). Both are timed on the base, a generate call as the pipeline makes it (featcal.t5.generated): a
timing of the real thing, not a count of decoder steps, so it stops where the base's answers stop."""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, T5ForConditionalGeneration

from featcal.t5 import generated
from featcal_bench.estimate import (
    CALIBRATION_PASSES,
    Passes,
    Speed,
    calibration_rows,
    cost_estimate,
    drifting_models,
    evaluation_passes,
    per_device,
    seconds_per_row,
    test_rows,
)
from featcal_bench.layout import BASE, data_dir
from featcal_bench.runs import MethodRun
from featcal_bench.study import load_study
from featcal_bench.t5.build import TARGET, TEXT
from featcal_bench.t5.methods import MAX_LENGTH, MAX_NEW_TOKENS, MAX_TARGET_LENGTH

TIMED_PROMPTS = 16
STUDY = Path(__file__).with_name("study.yaml")  # the runs the estimate counts


def prompt_passes(run: MethodRun, rows: dict[str, dict[str, int]]) -> Passes:
    """One method run's passes: CALIBRATION_PASSES teacher-forced forwards per calibration example; per test row a
    generate call of every scored model (and of the expert as drift reference), and, where drift is measured,
    teacher-forced forwards of the expert and each drifting model on the expert's answer."""
    drifting = drifting_models(run.models)
    return Passes(
        forward=CALIBRATION_PASSES * calibration_rows(run, rows) + (drifting + bool(drifting)) * test_rows(rows),
        generate=evaluation_passes(run.models) * test_rows(rows),
    )


def prompt_speeds(bench: Path, task: str) -> dict[str, Speed]:
    """One prompt through the base on each device here, a batch of up to 16 of `task`'s calibration prompts: a
    forward teacher-forced on its answer, and a greedy generate call."""
    model = T5ForConditionalGeneration.from_pretrained(bench / BASE, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(bench / BASE, local_files_only=True)
    rows = datasets.load_from_disk(str(bench / data_dir(task)))["calibration"][:TIMED_PROMPTS]
    inputs = tokenizer(rows[TEXT], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    labels = tokenizer(text_target=rows[TARGET], padding=True, truncation=True, max_length=MAX_TARGET_LENGTH,
                       return_tensors="pt")["input_ids"]
    n = len(rows[TEXT])

    def speed(device: torch.device) -> Speed:
        on, x, y = model.to(device), {k: v.to(device) for k, v in inputs.items()}, labels.to(device)
        return Speed(forward=seconds_per_row(lambda: on(**x, labels=y), n, device),
                     generate=seconds_per_row(lambda: generated(on, x, MAX_NEW_TOKENS), n, device))

    return per_device(speed)


def t5_cost_estimate(bench: Path, rows: dict[str, dict[str, int]]) -> str:
    """The FLAN-T5 benchmark's estimate (markdown); `rows`: per task, its calibration pool and test split size."""
    passes = {name: prompt_passes(run, rows) for name, run in load_study(STUDY).runs.items()}
    about = (f"Time, from encoder–decoder passes through the base timed here (batches of {TIMED_PROMPTS} prompts): "
             "forwards teacher-forced on the answer, and greedy generate calls of up to "
             f"{MAX_NEW_TOKENS} tokens as evaluation makes them. FeatCal's and RegMean's calibration counts "
             f"{CALIBRATION_PASSES:g} forwards per example (their stages measured against their forward floor on "
             "ViT-B/32, benchmarks/results/pipeline_cost_vitb32.md); evaluation one generate call per test row and "
             "scored model, plus the expert as drift reference, and teacher-forced forwards where drift is measured.")
    return cost_estimate(bench, passes, prompt_speeds(bench, sorted(rows)[0]), about)
