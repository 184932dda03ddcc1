"""A linear probe on the frozen base: the accuracy a task gets without fine-tuning the body at all. An expert
that does not beat it has learnt nothing a merge could lose, so the competence rule asks for a margin over it.

Features are the base's mean-pooled last hidden states over real tokens (how all-MiniLM-L6-v2 embeds a
sentence), standardised on the train split; the probe is a multinomial logistic regression fitted to the train
split in float64 by L-BFGS, its L2 strength chosen on the validation split from `L2_GRID`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import BertModel

from featcal.devices import one_thread
from featcal_bench.finetune import EVAL_BATCH, encode

log = logging.getLogger("featcal")

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
MAX_ITER = 500


def mean_pooled(model: BertModel, tokenizer: Any, rows: datasets.Dataset, max_length: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for start in range(0, len(rows), EVAL_BATCH):
            inputs = encode(tokenizer, rows[start: start + EVAL_BATCH], max_length)
            hidden = model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(out).double()


def fitted_probe(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float) -> torch.Tensor:
    """Weights [D + 1, K] (last row: bias) minimising mean cross-entropy + l2/2 · ‖W‖² (bias not penalised)."""
    w = torch.zeros(x.shape[1] + 1, classes, dtype=torch.float64, requires_grad=True)
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=MAX_ITER, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = torch.nn.functional.cross_entropy(xb @ w, y) + 0.5 * l2 * (w[:-1] ** 2).sum()
        value.backward()
        return value

    opt.step(loss)
    return w.detach()


def _accuracy(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x @ w[:-1] + w[-1]).argmax(-1) == y).double().mean())


def probe_figures(model: BertModel, tokenizer: Any, splits: datasets.DatasetDict, where: str,
                  max_length: int) -> dict[str, Any]:
    """Test accuracy of the probe on the frozen base `model`, with the L2 strength chosen on validation and every
    validation score; `where` names the task's data in errors."""
    if "validation" not in splits:
        raise ValueError(f"{where}: the probe chooses its L2 strength on a validation split; it has none")
    with one_thread():
        feats = {s: mean_pooled(model, tokenizer, splits[s], max_length) for s in ("train", "validation", "test")}
        labels = {s: torch.tensor(splits[s]["label"]) for s in feats}
        mean, std = feats["train"].mean(0), feats["train"].std(0).clamp_min(1e-12)
        feats = {s: (f - mean) / std for s, f in feats.items()}
        classes = splits["train"].features["label"].num_classes
        fits = {l2: fitted_probe(feats["train"], labels["train"], classes, l2) for l2 in L2_GRID}
    scores = {l2: _accuracy(w, feats["validation"], labels["validation"]) for l2, w in fits.items()}
    l2 = max(L2_GRID, key=lambda c: (scores[c], c))  # ties: the stronger regularisation
    test = _accuracy(fits[l2], feats["test"], labels["test"])
    log.info("probe · %s: L2 %g (validation %.1f %%), test %.1f %%", Path(where).name, l2, 100 * scores[l2], 100 * test)
    return {"probe": test, "probe_l2": l2, "probe_validation": {f"{c:g}": round(s, 4) for c, s in scores.items()}}
