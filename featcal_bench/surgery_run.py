"""The TA + Surgery and TA + ProbSurgery runs: adapters trained on the same calibration examples FeatCal sees, on the
task-arithmetic checkpoint of the `ta_featcal` run, evaluated on the same test splits (with the zero-shot heads
that run made, where its config has a `zero_shot` section). Both get the same steps, batch and learning rate."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from featcal.adapters import adapter_for
from featcal.config import RunConfig
from featcal.data import InputBuilder, load_split, pick_examples, row_batches
from featcal_bench.probsurgery import KL_WEIGHT
from featcal_bench.surgery import ADAPTERS, surgery_classifier, train_surgery
from storage.atomic import read_json
from tasks.merge import MERGED, head_file

log = logging.getLogger("featcal")

SOURCE_RUN = "ta_featcal"
STEPS = 1000  # the original's 500 iterations × 2 batches per task
BATCH = 16
LABELS = {"surgery": "TA + Surgery", "probsurgery": "TA + ProbSurgery"}  # the report's rows (featcal_bench.report)


def _batches(cfg: RunConfig, task: str, split: str,
             inputs: tuple[str, ...]) -> Iterator[tuple[dict[str, torch.Tensor], list[int]]]:
    """Model inputs and labels a batch at a time, so a large image test split is never held whole."""
    sources = cfg.calibration.data if split == "calibration" else cfg.evaluation.data
    where = f"{split}.data.{task}"
    ds = load_split(sources[task], where)
    if split == "calibration":
        ds = pick_examples(ds, cfg.calibration.examples_per_task, cfg.calibration.seed, where)
    builder = InputBuilder(cfg.base, inputs, sources[task], cfg.calibration.max_length, ds.column_names, where)
    for rows in row_batches(ds, cfg.evaluation.batch_size):
        yield builder(rows), list(rows.get("label", []))


def surgery_result(bench: Path, cfg: RunConfig, cache_features: bool, method: str = "surgery") -> dict[str, Any]:
    """TA + Surgery (or TA + ProbSurgery, `method="probsurgery"`) on the benchmark whose method runs use `cfg`'s
    experts and data: accuracies, per-example predictions and costs, like a pipeline run's result.
    `cache_features`: see featcal_bench.surgery."""
    label = LABELS[method]
    source_run = bench / "runs" / SOURCE_RUN
    merged = source_run / MERGED
    merge_record = source_run / "records" / "merge.json"
    if not merge_record.is_file() or not merged.is_dir():
        raise FileNotFoundError(f"{merged}: {label} trains on the task-arithmetic checkpoint of the "
                                f"{SOURCE_RUN!r} run; run that one first")
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    inputs = adapter_for(AutoConfig.from_pretrained(cfg.base, local_files_only=True)).model_input_names()
    heads = {t: load_file(merged / head_file(t)) for t in cfg.tasks} if cfg.zero_shot is not None else None
    pools = {t: [batch for batch, _ in _batches(cfg, t, "calibration", inputs)] for t in cfg.tasks}
    started = time.perf_counter()
    states = train_surgery(str(merged), cfg.experts, pools, method=method, steps=STEPS, batch_size=BATCH,
                           seed=cfg.calibration.seed, cache_features=cache_features, heads=heads)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    accuracy: dict[str, dict[str, float]] = {}
    predictions: dict[str, dict[str, list[int]]] = {}
    labels: dict[str, list[int]] = {}
    for t in cfg.tasks:
        model = surgery_classifier(str(merged), cfg.experts[t], states[t], heads[t] if heads else None, method)
        parts: list[torch.Tensor] = []
        labels[t] = []
        for batch, rows in _batches(cfg, t, "test", inputs):
            with torch.inference_mode():
                parts.append(model(**batch).argmax(-1))
            labels[t] += rows
        predicted = torch.cat(parts)
        accuracy[t] = {"calibrated": float((predicted == torch.tensor(labels[t])).float().mean())}
        predictions[t] = {"calibrated": predicted.tolist()}
        log.info("%s · %s: %.4f", label, t, accuracy[t]["calibrated"])
    merge = read_json(merge_record)
    cost = {"stage_seconds": {method: round(seconds, 2)}, "merge_seconds": round(merge["seconds"], 2),
            "calibration_seconds": round(seconds, 2), "peak_rss_mib": round(peak, 1),
            "merge_peak_rss_mib": merge["peak_rss_mib"], "steps": STEPS, "batch_per_task": BATCH,
            "rank": ADAPTERS[method].RANK, "cached_merged_features": cache_features,
            **({"kl_weight": KL_WEIGHT} if method == "probsurgery" else {})}
    return {"run_dir": str(source_run), "cost": cost, "accuracy": accuracy, "predictions": predictions,
            "labels": labels, "drift": {}}
