"""One expert per task: a full fine-tune of the base (body and a new head), seeded and single-threaded."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import datasets
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer, BertForSequenceClassification
from transformers.utils import logging as hf_logging

log = logging.getLogger("featcal")


class FineTune(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: float = Field(2.0, gt=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of steps with a linear warm-up")
    max_length: int = Field(64, ge=8)


def encode(tokenizer: Any, rows: dict[str, list], max_length: int) -> dict[str, torch.Tensor]:
    """Padded to the longest row of `rows` (dynamic padding: short glosses cost a fraction of long e-mails)."""
    enc = tokenizer(rows["text"], rows.get("text_pair"), padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    return {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def fine_tune(base_dir: Path, data_dir: Path, out: Path, hp: FineTune, seed: int) -> dict[str, Any]:
    """Train on the `train` split of `data_dir`, save the expert (HF layout + tokenizer) to `out`."""
    train = datasets.load_from_disk(str(data_dir))["train"]
    labels = train.features["label"].names
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the new head as "missing": expected here
    try:
        model = BertForSequenceClassification.from_pretrained(
            base_dir, local_files_only=True, num_labels=len(labels),
            id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    finally:
        hf_logging.set_verbosity(verbosity)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr)
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
            group["lr"] = hp.lr * _lr_factor(step, total, warmup)
        loss = model(**encode(tokenizer, rows, hp.max_length), labels=torch.tensor(rows["label"])).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step + 1 == total:
            log.info("  %s: step %d/%d, loss %.3f (mean of last 25), %.0f s", out.name, step + 1, total,
                     sum(losses[-25:]) / len(losses[-25:]), time.perf_counter() - started)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"steps": total, "train_examples": len(train), "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
            "seconds": round(time.perf_counter() - started, 1)}
