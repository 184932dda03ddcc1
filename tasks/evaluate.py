"""Stage `evaluate`: accuracy of the models in `evaluation.models` and per-block drift, per task.

Drift is measured over all real tokens and over the token the head reads (`featcal.evaluation`); every task's
split is loaded first, so that the per-batch progress lines can give an ETA for the whole stage."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from featcal.config import DataSource
from featcal.data import InputBuilder, load_split, pick_examples, row_batches
from featcal.evaluation import (
    DRIFT_MODELS,
    MODELS,
    EvalProgress,
    TaskScores,
    drift_definition,
    drift_plot,
    markdown,
    summarize,
)
from featcal.hub import local_dir
from featcal.modeling import task_model
from featcal.t5 import answer_kind, decoder_batches, first_number, generated, predicted_ids, targets_of
from featcal.zeroshot import ZeroShotClassifier
from storage.atomic import atomic_path, write_bytes, write_json
from tasks.context import RunContext, context
from tasks.head_refit import refits_heads, with_head
from tasks.merge import MERGED, head_file

log = logging.getLogger("featcal")
REPORT_FILES = ("report.json", "report.md", "drift.png")
CHECK_SEED = 0  # which rows a head check on a subset of a split reads: the same for every run compared


@dataclass
class _Split:
    source: DataSource
    where: str
    rows: datasets.Dataset


def _split(ctx: RunContext, task: str) -> _Split:
    ev = ctx.cfg.evaluation
    source = ev.data.get(task) or ctx.cfg.calibration.data[task]
    where = f"evaluation.data.{task}" if task in ev.data else f"calibration.data.{task} (no evaluation.data entry)"
    ds = load_split(source, where)
    if ev.max_examples:
        ds = pick_examples(ds, ev.max_examples, ctx.cfg.calibration.seed, where)
    return _Split(source, where, ds)


def _task_model(ctx: RunContext, task: str, name: str) -> torch.nn.Module:
    """The task's expert with the body of checkpoint `name` (its own for "expert") and the task's head: the expert's
    own, or with `zero_shot` the zero-shot head the merge stage stored for it (featcal/zeroshot.py); the calibrated
    model's with featcal.head_refit, the head refitted at assembly (tasks/head_refit.py)."""
    model = task_model(ctx.checkpoint_dir(task), None if name == "expert" else ctx.canonical(name),
                       ctx.checkpoint_dir("base"))
    if name == "calibrated" and refits_heads(ctx):
        return with_head(model, load_file(ctx.run / name / head_file(task)), ctx.cfg.zero_shot is not None)
    if ctx.cfg.zero_shot is None:
        return model
    return ZeroShotClassifier(model, load_file(ctx.run / MERGED / head_file(task)))


def run_task_model(run_dir: str | Path, task: str, name: str = "calibrated") -> torch.nn.Module:
    """Task `task`'s model from a run directory as the run's report scored it: checkpoint `name`'s body (`calibrated`
    or `merged`) with the task's head, refitted where the run refitted heads (featcal.head_refit, on by default),
    zero-shot where the run has zero-shot heads. The way to use a run's result for one task."""
    return _task_model(context(run_dir), task, name)


def _models(ctx: RunContext, task: str) -> tuple[dict[str, torch.nn.Module], list[str]]:
    """The listed models for one task, plus the expert whenever its hidden states are the drift reference; and the
    models whose drift is measured."""
    listed = ctx.cfg.evaluation.models
    drifting: list[str] = [m for m in DRIFT_MODELS if m in listed]
    models: dict[str, torch.nn.Module] = {name: _task_model(ctx, task, name) for name in listed}
    if drifting and "expert" not in models:
        models["expert"] = _task_model(ctx, task, "expert")
    return models, drifting


def _task_scores(ctx: RunContext, task: str, split: _Split, progress: EvalProgress) -> dict[str, Any]:
    if ctx.adapter.has_decoder:
        return _text_to_text_scores(ctx, task, split, progress)
    ev = ctx.cfg.evaluation
    source, ds = split.source, split.rows
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, ctx.cfg.calibration.max_length,
                           ds.column_names, split.where)
    listed = ev.models
    models, drifting = _models(ctx, task)
    lm = ctx.adapter.language_model
    label_column = source.label_column if task in ev.data and not lm else None
    scores = TaskScores(head_index=ctx.adapter.pooled_index())
    for batch, rows in enumerate(row_batches(ds, ev.batch_size), start=1):
        inputs = builder(rows)
        mask = inputs.get("attention_mask")
        hidden, logits = {}, {}
        with torch.inference_mode():
            for name, m in models.items():
                out = ctx.adapter.evaluate_forward(m, inputs)
                hidden[name] = out.hidden_states
                if lm and name in listed:  # scored now: one [B, T, vocab] logits tensor alive at a time
                    scores.add_next_tokens(name, out.logits, inputs["input_ids"], inputs["attention_mask"])
                elif not lm and hasattr(out, "logits"):
                    logits[name] = out.logits
                del out
        if "expert" in logits:  # agreement with the expert through the task's head: no labels needed
            for name in drifting:
                scores.add_head_errors(name, logits["expert"], logits[name])
        if drifting:
            if mask is None:
                mask = torch.ones(hidden["expert"][0].shape[:2], dtype=torch.long)
            scores.add_reference(hidden["expert"], mask)
            for name in drifting:
                scores.add_drift(name, hidden[name], hidden["expert"], mask)
        if label_column and logits.keys() >= set(listed):
            labels = torch.as_tensor(rows[label_column])
            for name in listed:
                scores.add_predictions(name, logits[name], labels)
        n = len(next(iter(rows.values())))
        scores.seen += n
        progress.step(task, batch, scores.seen, n)
    if not label_column:
        scores.correct, scores.predictions, scores.labels = {}, {}, []
    return scores.summary()


def _text_to_text_scores(ctx: RunContext, task: str, split: _Split, progress: EvalProgress) -> dict[str, Any]:
    """An encoder–decoder scored on its greedy generations: exact match of the normalised label word (classification)
    or Spearman's ρ of the first number in the answer (regression). Drift is measured teacher-forced on the expert's
    greedy output, at every encoder and then decoder boundary (each stack's last one after its final norm)."""
    ev = ctx.cfg.evaluation
    source, ds = split.source, split.rows
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, ctx.cfg.calibration.max_length,
                           ds.column_names, split.where)
    models, drifting = _models(ctx, task)
    label_column = source.label_column if task in ev.data else None
    words = answer_kind(ds.features, label_column, ev.label_words.get(task), split.where) if label_column else None
    tokenizer = AutoTokenizer.from_pretrained(local_dir(ctx.cfg.base), local_files_only=True) if label_column else None
    scores = TaskScores(head_index=None, metric="spearman" if label_column and words is None else "accuracy")
    config = ctx.adapter.config
    for batch, rows in enumerate(row_batches(ds, ev.batch_size), start=1):
        inputs = {k: v for k, v in builder(rows).items() if k in ctx.adapter.model_input_names()}
        sequences = {name: generated(m, inputs, ev.max_new_tokens) for name, m in models.items()}
        if drifting:
            targets = targets_of(models["expert"], sequences["expert"])
            forced = {**inputs, **decoder_batches(targets, len(targets), config.decoder_start_token_id,
                                                  config.pad_token_id)[0]}
            with torch.inference_mode():
                outs = {name: models[name](**forced, output_hidden_states=True) for name in ("expert", *drifting)}
            hidden = {name: (*o.encoder_hidden_states, *o.decoder_hidden_states) for name, o in outs.items()}
            masks = ([forced["attention_mask"]] * len(outs["expert"].encoder_hidden_states)
                     + [forced["decoder_attention_mask"]] * len(outs["expert"].decoder_hidden_states))
            scores.add_reference(hidden["expert"], masks)
            for name in drifting:
                scores.add_drift(name, hidden[name], hidden["expert"], masks)
        if label_column and tokenizer is not None:  # a tokenizer is loaded whenever there are labels
            for name in ev.models:
                texts = tokenizer.batch_decode(sequences[name], skip_special_tokens=True)
                if words is None:
                    scores.add_values(name, [first_number(t) for t in texts], [float(v) for v in rows[label_column]])
                else:
                    scores.add_predicted(name, predicted_ids(texts, words), torch.as_tensor(rows[label_column]))
        n = len(next(iter(rows.values())))
        scores.seen += n
        progress.step(task, batch, scores.seen, n)
    return scores.summary()


def head_errors(ctx: RunContext, task: str, source: DataSource, where: str,
                models: tuple[str, ...] = DRIFT_MODELS, subset: int | None = None) -> dict[str, dict[str, float]]:
    """Each of `models` against the task's expert on `source`'s rows (a seeded subset of `subset` of them, if given),
    read through the task's head; labels are not read. Per model: `kl`, the mean KL(p_expert ‖ p_model) in nats, and
    `agreement`, the share of rows whose top class is the expert's."""
    if ctx.adapter.has_decoder or ctx.adapter.language_model:
        raise ValueError(f"{where}: head errors need a classification head; task {task} is scored by generation or "
                         "next-token loss")
    ds = load_split(source, where)
    if subset is not None:
        ds = pick_examples(ds, subset, CHECK_SEED, where)
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, ctx.cfg.calibration.max_length,
                           ds.column_names, where)
    expert = _task_model(ctx, task, "expert")
    compared = {name: _task_model(ctx, task, name) for name in models}
    scores = TaskScores()
    with torch.inference_mode():
        for rows in row_batches(ds, ctx.cfg.evaluation.batch_size):
            inputs = builder(rows)
            target = ctx.adapter.evaluate_forward(expert, inputs).logits
            for name, model in compared.items():
                scores.add_head_errors(name, target, ctx.adapter.evaluate_forward(model, inputs).logits)
    summary = scores.summary()
    return {name: {"kl": summary["expert_kl"][name], "agreement": summary["expert_agreement"][name]}
            for name in models}


def run(ctx: RunContext, warnings: list[str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """`warnings`: the degenerate set-ups preflight found (featcal/setup_checks.py), listed in the report."""
    splits = {task: _split(ctx, task) for task in ctx.tasks}
    progress = EvalProgress({task: len(s.rows) for task, s in splits.items()}, ctx.cfg.evaluation.batch_size)
    tasks = {}
    for task in ctx.tasks:
        tasks[task] = _task_scores(ctx, task, splits[task], progress)
        log.info("evaluate · %s: %s", task, {k: round(v, 4) for k, v in tasks[task]["accuracy"].items()})
    report = {"method": ctx.cfg.featcal.method, "models": [m for m in MODELS if m in ctx.cfg.evaluation.models],
              "tasks": tasks, "summary": summarize(tasks),
              "drift_definition": drift_definition(ctx.adapter.pooled_index()),
              "config_fingerprint": ctx.cfg.fingerprint(), **({"warnings": warnings} if warnings else {})}
    write_json(ctx.run / "report.json", report)
    write_bytes(ctx.run / "report.md", markdown(report).encode())
    with atomic_path(ctx.run / "drift.png") as tmp:
        drift_plot(report, tmp)
    return list(REPORT_FILES), {"summary": report["summary"]}
