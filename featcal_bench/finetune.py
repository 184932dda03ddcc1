"""One expert per task: a full fine-tune of the base (body and a new head), seeded and single-threaded; with a
validation split, the learning rate and the number of epochs are chosen on it and the best checkpoint is kept."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import datasets
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoTokenizer, BertForSequenceClassification
from transformers.utils import logging as hf_logging

log = logging.getLogger("featcal")

DEFAULT_LR = 1e-4
EVAL_BATCH = 64  # the pipeline's evaluation batch (featcal_bench.method.pipeline_config)


class Selection(BaseModel):
    """Choose each expert on its task's validation split: one run per learning rate of `lrs`, each scheduled
    for the recipe's `epochs` and scored on validation after every epoch; a run stops after `patience` epochs
    without a better score; the best (learning rate, epoch) checkpoint is the expert (ties: the earlier epoch,
    then the earlier learning rate of the grid)."""

    model_config = ConfigDict(extra="forbid")

    lrs: tuple[float, ...] = Field((1e-4, 2e-4), min_length=1)
    patience: int = Field(2, ge=1)


class FineTune(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: float = Field(2.0, gt=0, description="training length; with `select`, the longest run (whole epochs)")
    batch_size: int = Field(32, ge=1)
    lr: float | None = Field(None, gt=0, description="the learning rate, 1e-4 unless given; with `select`, none")
    weight_decay: float = Field(0.01, ge=0)
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of steps with a linear warm-up")
    max_length: int = Field(64, ge=8)
    select: Selection | None = None

    @model_validator(mode="after")
    def _selection_is_consistent(self) -> FineTune:
        if self.select is None:
            self.lr = DEFAULT_LR if self.lr is None else self.lr
        elif self.lr is not None:
            raise ValueError("finetune: give either lr or select.lrs, not both")
        elif self.epochs != int(self.epochs):
            raise ValueError(f"finetune.epochs: with select it must be a whole number of epochs, got {self.epochs}")
        return self


def encode(tokenizer: Any, rows: dict[str, list], max_length: int) -> dict[str, torch.Tensor]:
    """Padded to the longest row of `rows` (dynamic padding: short glosses cost a fraction of long e-mails)."""
    enc = tokenizer(rows["text"], rows.get("text_pair"), padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    return {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}


def accuracy(model: torch.nn.Module, tokenizer: Any, rows: datasets.Dataset, max_length: int) -> float:
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(rows), EVAL_BATCH):
            batch = rows[start: start + EVAL_BATCH]
            logits = model(**encode(tokenizer, batch, max_length)).logits
            correct += int((logits.argmax(-1) == torch.tensor(batch["label"])).sum())
    return correct / len(rows)


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _new_model(base_dir: Path, labels: list[str], seed: int) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the new head as "missing": expected here
    try:
        return BertForSequenceClassification.from_pretrained(
            base_dir, local_files_only=True, num_labels=len(labels),
            id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    finally:
        hf_logging.set_verbosity(verbosity)


class _Best:
    """The best checkpoint of a selection so far, and the validation scores of every epoch tried."""

    def __init__(self) -> None:
        self.score, self.lr, self.epoch, self.state = -1.0, 0.0, 0, None
        self.scores: dict[str, list[float]] = {}

    def offer(self, model: torch.nn.Module, lr: float, epoch: int, score: float) -> bool:
        self.scores.setdefault(f"{lr:g}", []).append(round(score, 4))
        if score <= self.score:
            return False
        self.score, self.lr, self.epoch = score, lr, epoch
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True


def _train(model: torch.nn.Module, train: datasets.Dataset, tokenizer: Any, hp: FineTune, lr: float, seed: int,
           name: str, validate: Any = None) -> dict[str, Any]:
    """`validate(epoch) -> bool` runs after each whole epoch; False stops the run."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps_per_epoch = math.ceil(len(train) / hp.batch_size)
    total = max(1, round(hp.epochs * steps_per_epoch))
    warmup = max(1, round(hp.warmup * total))
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    model.train()
    started, losses = time.perf_counter(), []
    for step in range(total):
        if len(order) < hp.batch_size:
            order += torch.randperm(len(train), generator=g).tolist()
        idx, order = order[: hp.batch_size], order[hp.batch_size:]
        rows = train[idx]
        for group in optimiser.param_groups:
            group["lr"] = lr * _lr_factor(step, total, warmup)
        loss = model(**encode(tokenizer, rows, hp.max_length), labels=torch.tensor(rows["label"])).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step + 1 == total:
            log.info("  %s: step %d/%d, loss %.3f (mean of last 25), %.0f s", name, step + 1, total,
                     sum(losses[-25:]) / len(losses[-25:]), time.perf_counter() - started)
        if validate is not None and (step + 1) % steps_per_epoch == 0:
            model.eval()
            go_on = validate((step + 1) // steps_per_epoch)
            model.train()
            if not go_on:
                break
    model.eval()
    return {"steps": step + 1, "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
            "seconds": round(time.perf_counter() - started, 1)}


def fine_tune(base_dir: Path, data_dir: Path, out: Path, hp: FineTune, seed: int) -> dict[str, Any]:
    """Train on the `train` split of `data_dir` (choosing on its `validation` split where `hp.select` says so),
    save the expert (HF layout + tokenizer) to `out`."""
    splits = datasets.load_from_disk(str(data_dir))
    train = splits["train"]
    labels = train.features["label"].names
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    if hp.select is None:
        model = _new_model(base_dir, labels, seed)
        assert hp.lr is not None  # filled in by FineTune's validator
        info = _train(model, train, tokenizer, hp, hp.lr, seed, out.name)
    else:
        model, info = _selected(base_dir, splits, labels, tokenizer, hp, seed, out.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"train_examples": len(train), **info}


def _selected(base_dir: Path, splits: datasets.DatasetDict, labels: list[str], tokenizer: Any, hp: FineTune, seed: int,
              name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    if "validation" not in splits:
        raise ValueError(f"{name}: finetune.select needs a validation split; the benchmark's `validation` is 0")
    assert hp.select is not None
    validation, best, runs = splits["validation"], _Best(), {}
    for lr in hp.select.lrs:
        model = _new_model(base_dir, labels, seed)
        run = {"best": -1.0, "stale": 0}  # this learning rate's best score, and epochs since it

        def validate(epoch: int, lr: float = lr, model: torch.nn.Module = model, run: dict = run) -> bool:
            score = accuracy(model, tokenizer, validation, hp.max_length)
            improved = best.offer(model, lr, epoch, score)
            run["stale"] = 0 if score > run["best"] else run["stale"] + 1
            run["best"] = max(run["best"], score)
            log.info("  %s: lr %g, epoch %d/%d: validation %.1f %%%s", name, lr, epoch, int(hp.epochs), 100 * score,
                     " (best so far)" if improved else "")
            return run["stale"] < hp.select.patience

        runs[f"{lr:g}"] = _train(model, splits["train"], tokenizer, hp, lr, seed, f"{name} (lr {lr:g})", validate)
    model = _new_model(base_dir, labels, seed)
    model.load_state_dict(best.state)
    model.eval()
    return model, {"validation_examples": len(validation), "lr": best.lr, "epochs": best.epoch,
                   "validation_accuracy": round(best.score, 4), "validation_by_lr": best.scores, "runs": runs,
                   "seconds": round(sum(r["seconds"] for r in runs.values()), 1)}
