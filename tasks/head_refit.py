"""featcal.head_refit in the assemble stage: each task's calibration rows through the calibrated model (the features
its own head reads) and through its expert (the logits to match), and the head refitted to them
(featcal/head_refit.py). Heads the tasks share (a causal LM's or an encoder–decoder's merged LM head) are left."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from featcal.adapters import Adapter, UnsupportedModelError
from featcal.config import RunConfig
from featcal.head_refit import held_out_folds, refit_head
from featcal.modeling import task_model
from featcal.zeroshot import ZeroShotClassifier, zero_shot_logits
from storage.atomic import atomic_path
from storage.checkpoint import CanonicalCheckpoint, CheckpointError, read_metadata, save_tensors
from tasks.boundary import foreign_rows, stored_inputs
from tasks.context import RunContext
from tasks.merge import MERGED, head_file

log = logging.getLogger("featcal")

CLASSIFIER = "classifier"  # the one linear head of BERT, ViT and CLIP image classifiers: classifier.weight, .bias
ZERO_SHOT_WEIGHT = "class_embeddings"  # a zero-shot head's linear part (featcal/zeroshot.py)


AUTO_MIN_EXAMPLES = 64  # head_refit auto: below this a refit head was measured to hurt (docs/benchmarks.md, issue 54)


def shared_head(adapter: Adapter) -> str | None:
    """Why the run has no per-task head to refit (the tasks read the merged LM head), or None."""
    if adapter.head_is_merged or not adapter.head_prefixes:
        return (f"featcal.head_refit: every task of a {adapter.architecture} reads the merged LM head, shared by all "
                "tasks; it is left as merged (only per-task heads are refitted)")
    return None


def heads_left(cfg: RunConfig, adapter: Adapter, expert_names: Callable[[str], Collection[str]]) -> str | None:
    """Why this run leaves every task's head as its expert's (None: the assemble stage refits them). With `true` an
    expert whose head is not one linear `classifier` is refused; with `auto` it, like too few calibration examples,
    is a reason to leave the heads, said where the plan is shown."""
    setting = cfg.featcal.head_refit
    if setting is False:
        return "featcal.head_refit is off"
    if (why := shared_head(adapter)) is not None:
        return why
    examples = cfg.calibration.examples_per_task
    if setting == "auto" and examples < AUTO_MIN_EXAMPLES:
        return (f"featcal.head_refit auto: calibration.examples_per_task is {examples}, below "
                f"{AUTO_MIN_EXAMPLES}, where a refitted head was measured to hurt; every task keeps its expert's head")
    if cfg.zero_shot is not None:
        return None
    for task in cfg.tasks:
        names = set(expert_names(task))
        if f"{CLASSIFIER}.weight" not in names:
            held = sorted(n for n in names if n.startswith(f"{CLASSIFIER}.")) or "none"
            if setting is True:
                raise CheckpointError(f"featcal.head_refit: experts.{task} has no linear head to refit: expected "
                                      f"tensor {CLASSIFIER}.weight, its {CLASSIFIER} tensors are {held}")
            return (f"featcal.head_refit auto: experts.{task} has no linear head (no tensor {CLASSIFIER}.weight; its "
                    f"{CLASSIFIER} tensors are {held}); every task keeps its expert's head")
    return None


def refits_heads(ctx: RunContext) -> bool:
    """Whether this run's assemble stage refits each task's head (`heads_left` is None)."""
    return heads_left(ctx.cfg, ctx.adapter, lambda task: ctx.checkpoint(task).names()) is None


def _classifier(model: nn.Module, where: str) -> nn.Linear:
    head = getattr(model, CLASSIFIER, None)
    if not isinstance(head, nn.Linear):
        raise UnsupportedModelError(f"featcal.head_refit: {where} has no linear `classifier` head to refit")
    return head


def _rows(ctx: RunContext, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Z): the features task `task`'s head reads from the calibrated model, and the expert's logits, on the task's
    stored calibration inputs, in row order, float64."""
    names = ctx.adapter.model_input_names()
    calibrated = task_model(ctx.checkpoint_dir(task), CanonicalCheckpoint(ctx.run / "calibrated", ctx.adapter),
                            ctx.checkpoint_dir("base"))
    expert = task_model(ctx.checkpoint_dir(task), None, ctx.checkpoint_dir("base"))
    xs, zs = [], []
    if ctx.cfg.zero_shot is not None:
        head = load_file(ctx.run / MERGED / head_file(task))
        scale = head["logit_scale"].exp()
        with torch.inference_mode():
            for batch in stored_inputs(ctx, task):
                pixels = batch["pixel_values"]
                pooled = calibrated(pixel_values=pixels).pooler_output
                xs.append(scale * F.normalize(pooled.float() @ head["visual_projection.weight"].T, dim=-1))
                zs.append(zero_shot_logits(expert(pixel_values=pixels).pooler_output, head))
    else:
        seen: list[torch.Tensor] = []
        hook = _classifier(calibrated, f"expert {task}").register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        try:
            with torch.inference_mode():
                for batch in stored_inputs(ctx, task):
                    inputs = {n: v for n, v in batch.items() if n in names}
                    calibrated(**inputs)
                    zs.append(expert(**inputs).logits)
        finally:
            hook.remove()
        xs = seen
    return torch.cat(xs).double(), torch.cat(zs).double()


def _expert_head(ctx: RunContext, task: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = load_file(ctx.run / MERGED / head_file(task))
    if ctx.cfg.zero_shot is not None:
        return head[ZERO_SHOT_WEIGHT], None
    return head[f"{CLASSIFIER}.weight"], head.get(f"{CLASSIFIER}.bias")


def refitted(ctx: RunContext, task: str) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Task `task`'s refitted head tensors (the names and dtypes of its head file) and what the stage records: the λ
    chosen, the rows, and the relative error of the head's logits to the expert's on those rows, before and after.
    With head_refit auto, a task whose data held fewer than AUTO_MIN_EXAMPLES examples keeps its expert's head (None
    and why)."""
    fc = ctx.cfg.featcal
    x, z = _rows(ctx, task)
    marks = foreign_rows(ctx, task)
    if marks is not None:  # calibration.shared_inputs: the head is refitted on the task's own rows only
        x, z = x[marks == 0], z[marks == 0]
    examples = [r // (1 + ctx.cfg.calibration.views.count) for r in range(len(x))]
    if fc.head_refit == "auto" and len(set(examples)) < AUTO_MIN_EXAMPLES:
        return None, {"left": f"featcal.head_refit auto: {task} has {len(set(examples))} calibration examples, "
                              f"below {AUTO_MIN_EXAMPLES}; it keeps its expert's head"}
    w_e, b_e = _expert_head(ctx, task)
    fit = refit_head(x, z, w_e, b_e, fc.lambda_grid, held_out_folds(examples, fc.holdout_every, fc.holdout_folds))
    head = load_file(ctx.run / MERGED / head_file(task))
    if ctx.cfg.zero_shot is not None:
        head[ZERO_SHOT_WEIGHT] = fit.weight.to(head[ZERO_SHOT_WEIGHT].dtype)
    else:
        head[f"{CLASSIFIER}.weight"] = fit.weight.to(w_e.dtype)
        if fit.bias is not None and b_e is not None:
            head[f"{CLASSIFIER}.bias"] = fit.bias.to(b_e.dtype)
    before = _relative_error(x, z, w_e.double(), None if b_e is None else b_e.double())
    info = {"lambda": fit.lam, "rows": len(x), "logit_error_before": before,
            "logit_error_after": _relative_error(x, z, fit.weight, fit.bias)}
    return head, info


def _relative_error(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """‖XWᵀ + b − Z‖/‖Z‖ over the rows."""
    logits = x @ w.T + (0 if b is None else b)
    return float(torch.linalg.norm(logits - z) / torch.linalg.norm(z))


def write_refitted_heads(ctx: RunContext) -> dict[str, Any]:
    """Every task's head in calibrated/heads/ refitted (each file replaced whole), and the stage record's entry."""
    done: dict[str, Any] = {}
    for task in ctx.tasks:
        head, done[task] = refitted(ctx, task)
        if head is None:
            log.info("%s", done[task]["left"])
            continue
        path = ctx.run / "calibrated" / head_file(task)
        metadata = read_metadata(path)
        with atomic_path(path) as tmp:
            save_tensors(head, tmp, metadata or None)
        log.info("head refit · %s: λ %g, logits' relative error to the expert's on %d calibration rows %.4f → %.4f",
                 task, done[task]["lambda"], done[task]["rows"], done[task]["logit_error_before"],
                 done[task]["logit_error_after"])
    return {"head_refit": done}


def with_head(model: nn.Module, head: Mapping[str, torch.Tensor], zero_shot: bool) -> nn.Module:
    """A task model (featcal.modeling.task_model) reading the head file `head` instead of its expert's head."""
    if zero_shot:
        return ZeroShotClassifier(model, head)
    linear = _classifier(model, "the task model")
    with torch.no_grad():
        linear.weight.copy_(head[f"{CLASSIFIER}.weight"])
        if linear.bias is not None:
            linear.bias.copy_(head[f"{CLASSIFIER}.bias"])
    return model

