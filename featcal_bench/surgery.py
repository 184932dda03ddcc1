"""Representation Surgery (Yang et al., ICML 2024, "Representation Surgery for Multi-Task Model Merging").

A gradient-trained baseline: per task, a small adapter on the merged model's final feature z removes the
"representation bias" z − z_t, and the task's own head reads the corrected feature:

    ẑ = z − W_up · ReLU(W_down · z),   logits_t = head_t(ẑ)

z is what the head reads: for `BertForSequenceClassification` the pooler output the classifier reads; for a
head-less CLIP vision tower with a zero-shot head (`featcal.zeroshot`) the image feature, its pooled output through
CLIP's visual projection (512-d for ViT-B/32), which the head normalises and compares with the class embeddings:
where the original code puts the adapter for CLIP (its image encoder's output, before the normalising head).

Interface (independent of any pipeline run directory):

    from featcal_bench.surgery import train_surgery, surgery_classifier
    states = train_surgery(merged_dir, {"topic": "experts/topic", ...}, {"topic": [batch, ...], ...},
                           steps=1000, batch_size=16, seed=0, cache_features=False)
    model = surgery_classifier(merged_dir, "experts/topic", states["topic"])
    logits = model(**batch)

With zero-shot heads, pass `heads={task: head tensors}` (a run's `merged/heads/{task}.safetensors`) to
`train_surgery`, and the task's head to `surgery_classifier`.

- `merged_dir`: a checkpoint holding the merged body (e.g. a run's `merged/`); it is read through
  `featcal.modeling.task_model(expert_dir, body_from=CanonicalCheckpoint(merged_dir, adapter))`.
- expert directories: each loads with `from_pretrained(dir, local_files_only=True)` and has its own head.
- batches: per task, a list of dicts of model inputs (`input_ids`, `attention_mask`, `token_type_ids`
  tensors [B, T], or `pixel_values` [B, 3, H, W]); together they are the task's unlabelled calibration pool.
  Token widths may differ.
- the result: per task, the state dict of a `SurgeryAdapter` (small; save it with safetensors).

Protocol of the original code (EnnengYang/RepresentationSurgery, src/merging_model.py and
src/main_*_with_surgery.py), kept here: rank 16; W_down initialised like `nn.Linear`
(kaiming_uniform, a = √5) and W_up at zero, so every adapter starts as the identity; L1 loss (mean
absolute error) between ẑ and the expert's feature z_t of the same input; Adam, lr 1e-3, betas
(0.9, 0.999), no weight decay; every step draws a fresh random batch of 16 per task and runs the
frozen merged model without gradient; 500 iterations × 2 batches = 1000 steps per task.
Differences, on purpose:
- The expert's features z_t are computed once per pool example (one expert in memory at a time)
  instead of at every step. Eval-mode forwards are deterministic, so the targets are the same: this only
  saves the expert forwards, which makes our Surgery timing a lower bound of the original's.
- Each task's adapter has its own Adam. The original shares one optimizer, but with torch >= 2
  `zero_grad()` sets gradients to None and Adam skips parameters without one: the same updates.
- `cache_features=True` also computes the merged features once per pool example, so training never
  runs the transformer. Same objective and batches, far fewer forwards: the benchmark can time both.

`method="probsurgery"` trains ProbSurgery's adapters (featcal_bench.probsurgery) through the same loop, pools, features
and heads instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, BertForSequenceClassification

from featcal.adapters import adapter_for
from featcal.config import digest_of
from featcal.evaluation import hms
from featcal.modeling import task_model
from featcal.zeroshot import ZeroShotClassifier
from featcal_bench.probsurgery import ProbSurgeryAdapter
from storage.checkpoint import CanonicalCheckpoint

log = logging.getLogger("featcal")
PROGRESS_EVERY = 50  # training steps between progress lines: a CPU run takes tens of minutes

Batch = dict[str, torch.Tensor]
Head = Mapping[str, torch.Tensor]  # a zero-shot head file's tensors (featcal.zeroshot.zero_shot_head)
SUPPORTED = ("BertForSequenceClassification", "ZeroShotClassifier")


class SurgeryAdapter(nn.Module):
    """ẑ = z − W_up·ReLU(W_down·z); W_up starts at zero, so a new adapter is exactly the identity."""

    RANK = 16  # the original's

    def __init__(self, dim: int, rank: int = RANK, generator: torch.Generator | None = None):
        super().__init__()
        self.down = nn.utils.skip_init(nn.Linear, dim, rank, bias=False)
        self.up = nn.utils.skip_init(nn.Linear, rank, dim, bias=False)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.up.weight)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z - self.up(torch.relu(self.down(z)))

    def training_loss(self, z: torch.Tensor, target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """L1 between the corrected feature and the expert's (`generator` unused: the objective draws nothing)."""
        return F.l1_loss(self(z), target)


Adapter = SurgeryAdapter | ProbSurgeryAdapter
ADAPTERS: dict[str, type[Adapter]] = {"surgery": SurgeryAdapter, "probsurgery": ProbSurgeryAdapter}


def _adapter_class(method: str) -> type[Adapter]:
    if method not in ADAPTERS:
        raise ValueError(f"surgery method {method!r} is not one of {sorted(ADAPTERS)}")
    return ADAPTERS[method]


def _adapter_from_state(method: str, state: Mapping[str, torch.Tensor]) -> Adapter:
    """A trained adapter of `method` back from its state dict (both kinds hold `down.weight` [rank, d])."""
    rank, dim = state["down.weight"].shape
    adapter = _adapter_class(method)(dim, rank)
    adapter.load_state_dict(state, strict=True)
    return adapter


def _check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise ValueError(f"Representation Surgery here supports {SUPPORTED} (BERT's pooler output → classifier, CLIP's "
                         f"image feature → zero-shot head); got {name}")


def features(model: nn.Module, inputs: Batch) -> torch.Tensor:
    """The final feature the head reads [B, d]: BERT's pooler output, or CLIP's image feature (the vision tower's
    pooled output through the visual projection, not yet normalised)."""
    _check_supported(model)
    if isinstance(model, ZeroShotClassifier):
        pooled = model.vision(pixel_values=inputs["pixel_values"]).pooler_output.float()
        return pooled @ model.head["visual_projection.weight"].T
    return cast(BertForSequenceClassification, model).bert(**inputs).pooler_output  # the one other SUPPORTED name


class SurgeryClassifier(nn.Module):
    """A task model (merged body + the task's head) with the task's adapter between feature and head."""

    def __init__(self, model: nn.Module, adapter: Adapter):
        super().__init__()
        _check_supported(model)
        self.model, self.adapter = model.eval(), adapter.eval()

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        z = self.adapter(features(self.model, inputs))
        if isinstance(self.model, ZeroShotClassifier):  # featcal.zeroshot.zero_shot_logits, after the projection
            head = self.model.head
            return head["logit_scale"].exp() * F.normalize(z, dim=-1) @ head["class_embeddings"].T
        bert = cast(BertForSequenceClassification, self.model)  # the one other SUPPORTED name
        return bert.classifier(bert.dropout(z))


def _task_model(expert_dir: str | Path, body_from: CanonicalCheckpoint | None, head: Head | None) -> nn.Module:
    """The task's model (`featcal.modeling.task_model`), with its zero-shot head where it has one."""
    model = task_model(expert_dir, body_from)
    return model if head is None else ZeroShotClassifier(model, head)


def _merged_task_model(merged_dir: str | Path, expert_dir: str | Path, head: Head | None = None) -> nn.Module:
    adapter = adapter_for(AutoConfig.from_pretrained(expert_dir, local_files_only=True))
    return _task_model(expert_dir, CanonicalCheckpoint(merged_dir, adapter), head)


def surgery_classifier(merged_dir: str | Path, expert_dir: str | Path, state: Mapping[str, torch.Tensor],
                       head: Head | None = None, method: str = "surgery") -> SurgeryClassifier:
    """The evaluation model of one task: merged body, the expert's head (or the zero-shot `head`), the trained
    adapter `state` of `method` (surgery | probsurgery)."""
    adapter = _adapter_from_state(method, state)
    return SurgeryClassifier(_merged_task_model(merged_dir, expert_dir, head), adapter)


def _pool(batches: Sequence[Batch], where: str) -> Batch:
    """One task's batches as one set of rows; token inputs right-padded with 0 (masked) to one width."""
    if not batches:
        raise ValueError(f"{where}: no calibration batches")
    keys = set(batches[0])
    if any(set(b) != keys for b in batches):
        raise ValueError(f"{where}: batches carry different inputs {sorted({k for b in batches for k in b})}")
    pool = {}
    for key in sorted(keys):
        parts = [b[key] for b in batches]
        if parts[0].dim() == 2:
            width = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, width - p.shape[1])) for p in parts]
        pool[key] = torch.cat(parts)
    return pool


def _row_features(model: nn.Module, pool: Batch, idx: torch.Tensor) -> torch.Tensor:
    return features(model, _rows(pool, idx))


def _rows(pool: Batch, idx: torch.Tensor) -> Batch:
    """Rows `idx` of a pool, cut to their longest real sequence (padding changes no real token's output)."""
    rows = {k: v[idx] for k, v in pool.items()}
    mask = rows.get("attention_mask")
    if mask is not None:
        width = int(mask.any(0).nonzero().max()) + 1
        rows = {k: v[:, :width] if v.dim() == 2 else v for k, v in rows.items()}
    return rows


def _pool_features(model: nn.Module, pool: Batch, batch_size: int) -> torch.Tensor:
    n = next(iter(pool.values())).shape[0]
    with torch.no_grad():
        return torch.cat([features(model, _rows(pool, torch.arange(i, min(i + batch_size, n))))
                          for i in range(0, n, batch_size)])


def _generator(seed: int, task: str) -> torch.Generator:
    """One generator per (seed, task), so a task's result does not depend on which other tasks train."""
    return torch.Generator().manual_seed(int(digest_of([seed, task]), 16) % 2**63)


def fit_adapters(
    merged_features: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], targets: Mapping[str, torch.Tensor], *,
    method: str = "surgery", rank: int | None = None, lr: float = 1e-3, steps: int = 1000, batch_size: int = 16,
    seed: int = 0,
) -> dict[str, Adapter]:
    """Train one adapter per task on random batches of the task's pool: Surgery's min L1(adapter(z), z_t), or
    ProbSurgery's objective (featcal_bench.probsurgery). `rank`: the method's own (16, 128) unless given.

    `merged_features[task](idx)` gives the frozen merged model's features [B, d] of pool rows `idx`;
    `targets[task]` holds the expert's features [N_t, d] of every pool row. Tasks take turns each step,
    as in the original; each task's batches, initialisation and noise come from its own seeded generator."""
    cls = _adapter_class(method)
    rank = cls.RANK if rank is None else rank
    if set(merged_features) != set(targets):
        raise ValueError(f"merged_features has tasks {sorted(merged_features)}, targets {sorted(targets)}")
    if steps < 1 or batch_size < 1 or rank < 1:
        raise ValueError(f"steps, batch_size and rank must be >= 1, got {steps}, {batch_size}, {rank}")
    tasks = sorted(targets)
    gens = {t: _generator(seed, t) for t in tasks}
    adapters = {t: cls(targets[t].shape[1], rank, gens[t]) for t in tasks}
    optims = {t: torch.optim.Adam(adapters[t].parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
              for t in tasks}
    first: dict[str, float] = {}
    started = time.perf_counter()
    for step in range(steps):
        if step and step % PROGRESS_EVERY == 0:
            elapsed = time.perf_counter() - started
            log.info("%s: step %d/%d, elapsed %s, ETA %s", method, step, steps, hms(elapsed),
                     hms(elapsed / step * (steps - step)))
        for t in tasks:
            n = targets[t].shape[0]
            idx = torch.randperm(n, generator=gens[t])[:batch_size]
            with torch.no_grad():
                z = merged_features[t](idx)
            loss = adapters[t].training_loss(z, targets[t][idx], gens[t])
            optims[t].zero_grad(set_to_none=True)
            loss.backward()
            optims[t].step()
            if step == 0:
                first[t] = loss.item()
            if step == steps - 1:
                log.info("%s · %s: batch loss to the expert's features %.4g at step 1, %.4g at step %d",
                         method, t, first[t], loss.item(), steps)
    return {t: a.eval() for t, a in adapters.items()}


def train_surgery(
    merged_dir: str | Path, expert_dirs: Mapping[str, str | Path], batches: Mapping[str, Sequence[Batch]], *,
    method: str = "surgery", rank: int | None = None, lr: float = 1e-3, steps: int = 1000, batch_size: int = 16,
    seed: int = 0, cache_features: bool = False, heads: Mapping[str, Head] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Representation Surgery (or `method="probsurgery"`) on a merged checkpoint: per task, the trained adapter's
    state dict.

    Expert features are computed once per pool example (one expert loaded at a time). With
    cache_features=False every step runs the merged model on the drawn batch (the original protocol);
    with True the merged features are computed once too. `heads`: per task, its zero-shot head, for head-less
    CLIP experts (only its visual projection makes the features). See the module docstring."""
    _adapter_class(method)  # a bad method fails before any model is loaded
    if set(expert_dirs) != set(batches):
        raise ValueError(f"expert_dirs has tasks {sorted(expert_dirs)}, batches {sorted(batches)}")
    tasks = sorted(expert_dirs)
    pools = {t: _pool(batches[t], f"batches[{t!r}]") for t in tasks}
    targets = {}
    for t in tasks:
        expert = _task_model(expert_dirs[t], None, heads[t] if heads else None)
        targets[t] = _pool_features(expert, pools[t], batch_size)
        del expert
    # The body is shared and the heads are not used (a zero-shot head's visual projection is the CLIPModel's, the
    # same in every task's head).
    merged = _merged_task_model(merged_dir, expert_dirs[tasks[0]], heads[tasks[0]] if heads else None)
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]]
    if cache_features:
        cached = {t: _pool_features(merged, pools[t], batch_size) for t in tasks}
        fns = {t: cached[t].__getitem__ for t in tasks}
    else:
        fns = {t: partial(_row_features, merged, pools[t]) for t in tasks}
    adapters = fit_adapters(fns, targets, method=method, rank=rank, lr=lr, steps=steps, batch_size=batch_size,
                            seed=seed)
    return {t: {k: v.detach().clone() for k, v in adapters[t].state_dict().items()} for t in tasks}
