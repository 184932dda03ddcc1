"""Stage `evaluate`: accuracy of the models in `evaluation.models` and per-block drift, per task."""

from __future__ import annotations

import logging
from typing import Any

import torch

from featcal.data import InputBuilder, load_split, pick_examples, row_batches
from featcal.evaluation import MODELS, TaskScores, drift_plot, markdown, summarize
from featcal.modeling import task_model
from storage.atomic import atomic_path, write_bytes, write_json
from tasks.context import RunContext

log = logging.getLogger("featcal")
REPORT_FILES = ("report.json", "report.md", "drift.png")


def _task_scores(ctx: RunContext, task: str) -> dict[str, Any]:
    ev = ctx.cfg.evaluation
    source = ev.data.get(task) or ctx.cfg.calibration.data[task]
    where = f"evaluation.data.{task}" if task in ev.data else f"calibration.data.{task} (no evaluation.data entry)"
    ds = load_split(source, where)
    if ev.max_examples:
        ds = pick_examples(ds, ev.max_examples, ctx.cfg.calibration.seed, where)
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, ctx.cfg.calibration.max_length,
                           ds.column_names, where)
    expert_dir = ctx.checkpoint_dir(task)
    listed = ev.models
    drifting = [m for m in ("merged", "calibrated") if m in listed]
    # Each model is the task's expert with the body of checkpoint `name`; the expert also runs unlisted
    # while its hidden states are the drift reference.
    models = {name: task_model(expert_dir, None if name == "expert" else ctx.checkpoint(name)) for name in listed}
    if drifting and "expert" not in models:
        models["expert"] = task_model(expert_dir)
    label_column = source.label_column if task in ev.data else None
    scores = TaskScores()
    for rows in row_batches(ds, ev.batch_size):
        inputs = builder(rows)
        mask = inputs.get("attention_mask")
        with torch.inference_mode():
            outs = {name: ctx.adapter.evaluate_forward(m, inputs) for name, m in models.items()}
        if drifting:
            ref = outs["expert"].hidden_states
            if mask is None:
                mask = torch.ones(ref[0].shape[:2], dtype=torch.long)
            scores.add_reference(ref, mask)
            for name in drifting:
                scores.add_drift(name, outs[name].hidden_states, ref, mask)
        if label_column and all(hasattr(out, "logits") for out in outs.values()):
            labels = torch.as_tensor(rows[label_column])
            for name in listed:
                scores.add_predictions(name, outs[name].logits, labels)
        scores.seen += len(next(iter(rows.values())))
    if not label_column:
        scores.correct = {}
    return scores.summary()


def run(ctx: RunContext) -> tuple[list[str], dict[str, Any]]:
    tasks = {}
    for task in ctx.tasks:
        tasks[task] = _task_scores(ctx, task)
        log.info("evaluate · %s: %s", task, {k: round(v, 4) for k, v in tasks[task]["accuracy"].items()})
    report = {"method": ctx.cfg.featcal.method, "models": [m for m in MODELS if m in ctx.cfg.evaluation.models],
              "tasks": tasks, "summary": summarize(tasks), "config_fingerprint": ctx.cfg.fingerprint()}
    write_json(ctx.run / "report.json", report)
    write_bytes(ctx.run / "report.md", markdown(report).encode())
    with atomic_path(ctx.run / "drift.png") as tmp:
        drift_plot(report, tmp)
    return list(REPORT_FILES), {"summary": report["summary"]}
