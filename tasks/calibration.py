"""Stages of the layer-by-layer calibration: prepare, gram, solve, propagate (DESIGN.md §2–§3)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from featcal.closed_form import (
    BiasTerm, Hyper, LinearMoments, solve_linear_bias, solve_linear_weight, solve_norm_affine,
)
from featcal.data import InputBuilder, load_split, pad_to, pick_examples, row_batches
from featcal.modeling import calibrated_modules, is_norm
from featcal.statistics import (
    accumulate, captured_inputs, flatten_stats, linear_moments, new_stats, norm_moments, unflatten_stats,
)
from storage.activations import iter_row_blocks, open_array, write_array
from storage.atomic import atomic_path
from storage.checkpoint import read_header, read_tensor
from tasks.context import RunContext
from tasks.merge import MERGED

log = logging.getLogger("featcal")


# ---- prepare ------------------------------------------------------------------------------------
def _model_inputs(ctx: RunContext, task: str) -> tuple[Callable[[], Iterator[dict[str, torch.Tensor]]], int, dict[str, Any]]:
    """Batches of the task's calibration inputs, padded to one width for the whole task."""
    cal = ctx.cfg.calibration
    where = f"calibration.data.{task}"
    source = cal.data[task]
    picked = pick_examples(load_split(source, where), cal.examples_per_task, cal.seed, where)
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, cal.max_length, picked.column_names, where)
    width = max(builder(rows)["input_ids"].shape[1] for rows in row_batches(picked, cal.batch_size)) if builder.is_text else 0

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for rows in row_batches(picked, cal.batch_size):
            yield pad_to(builder(rows), width, builder.pad_id) if builder.is_text else builder(rows)

    info = {"examples": len(picked), "examples_requested": cal.examples_per_task}
    return batches, len(picked), info


def stored_inputs(ctx: RunContext, task: str) -> Iterator[dict[str, torch.Tensor]]:
    """The task's stored model inputs, one batch at a time."""
    root = ctx.run / ctx.run.inputs(task)
    names = sorted(p.name for p in root.iterdir() if (p / "zarr.json").is_file())
    streams = {n: iter_row_blocks(root / n, ctx.cfg.calibration.batch_size) for n in names}
    while True:
        try:
            yield {n: next(s) for n, s in streams.items()}
        except StopIteration:
            return


def prepare(ctx: RunContext, task: str) -> tuple[list[str], dict[str, Any]]:
    batches, n, info = _model_inputs(ctx, task)
    bs = ctx.cfg.calibration.batch_size
    inputs_rel = ctx.run.inputs(task)
    first = next(batches())
    with atomic_path(ctx.run / inputs_rel) as tmp:
        for name, value in first.items():
            shape = (n, *value.shape[1:])
            write_array(tmp / name, shape, bs, str(value.numpy().dtype), (b[name] for b in batches()))
        # Every architecture gets a token mask: padding is weight 0 in every statistic downstream.
        if "attention_mask" not in first:
            tokens = ctx.adapter.embed(ctx.skeleton.embedding(ctx.checkpoint(MERGED)), first).shape[1]
            write_array(tmp / "attention_mask", (n, tokens), bs, "int64", [np.ones((n, tokens), dtype=np.int64)])
    mask = open_array(ctx.run / inputs_rel / "attention_mask")
    tokens = mask.shape[1]
    info.update(tokens_per_example=tokens, real_tokens=int(np.asarray(mask[:]).sum()))
    outputs = [inputs_rel]
    for side, ckpt in (("merged", MERGED), ("expert", task)):
        modules = ctx.skeleton.embedding(ctx.checkpoint(ckpt))
        rel = ctx.run.acts(task, 0, side)
        with torch.inference_mode():
            rows = (ctx.adapter.embed(modules, b).reshape(-1, ctx.adapter.text_or_vision_config().hidden_size)
                    for b in stored_inputs(ctx, task))
            hidden = ctx.adapter.text_or_vision_config().hidden_size
            write_array(ctx.run / rel, (n * tokens, hidden), bs * tokens, "float32", rows)
        outputs.append(rel)
    return outputs, info


# ---- gram ---------------------------------------------------------------------------------------
def token_weights(mask: torch.Tensor, modules: list[str], emphasis: dict[str, float] | None,
                  pooled: int | None) -> dict[str, torch.Tensor]:
    """Per-token weights per module: padding 0, real tokens 1; with `emphasis` (last block only), tokens
    other than the pooled one get emphasis[module] instead of 1."""
    base = mask.reshape(-1).float()
    if emphasis is None or pooled is None:
        return dict.fromkeys(modules, base)
    out = {}
    for module in modules:
        scale = torch.full_like(mask, emphasis[module], dtype=torch.float32)
        scale[:, pooled] = 1.0
        out[module] = base * scale.reshape(-1)
    return out


def emphasis_for(ctx: RunContext, layer: int, modules: list[str]) -> dict[str, float] | None:
    """In the last block the head reads one token: others get pooled_token_weight, except key/value inputs."""
    ptw = ctx.cfg.featcal.pooled_token_weight
    if layer != ctx.num_blocks - 1 or ptw is None:
        return None
    return {m: 1.0 if m in ctx.adapter.kv_modules else ptw for m in modules}


def _boundary(ctx: RunContext, task: str, layer: int, sides: tuple[str, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """(mask [B,T], then one [B,T,H] chunk per side) for boundary `layer` of a task, chunk by chunk."""
    bs, tokens = ctx.cfg.calibration.batch_size, _tokens(ctx, task)
    masks = iter_row_blocks(ctx.run / ctx.run.inputs(task) / "attention_mask", bs)
    streams = [iter_row_blocks(ctx.run / ctx.run.acts(task, layer, side), bs * tokens) for side in sides]
    for mask, *chunks in zip(masks, *streams, strict=True):
        yield mask, *(c.reshape(mask.shape[0], tokens, -1) for c in chunks)


def _sq_norms(diff: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    m = mask.float()[..., None]
    return float(((diff * m) ** 2).sum()), float(((ref * m) ** 2).sum())


def gram(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    merged_block = ctx.skeleton.block(layer, ctx.checkpoint(MERGED))
    expert_block = ctx.skeleton.block(layer, ctx.checkpoint(task))
    modules_m, modules_e = calibrated_modules(merged_block), calibrated_modules(expert_block)
    stats = new_stats(modules_m)
    emphasis = emphasis_for(ctx, layer, list(modules_m))
    drift = {"in_diff": 0.0, "in_ref": 0.0, "out_diff": 0.0, "out_ref": 0.0}
    last = layer == ctx.num_blocks - 1

    def expert_outputs() -> Iterator[torch.Tensor]:
        for mask, s, e in _boundary(ctx, task, layer, ("merged", "expert")):
            sink_m: dict[str, torch.Tensor] = {}
            sink_e: dict[str, torch.Tensor] = {}
            extra = ctx.adapter.block_input({"attention_mask": mask})
            with torch.inference_mode():
                with captured_inputs(modules_m, sink_m):
                    out_m = ctx.adapter.run_block(merged_block, s, extra)
                with captured_inputs(modules_e, sink_e):
                    out_e = ctx.adapter.run_block(expert_block, e, extra)
                weights = token_weights(mask, list(modules_m), emphasis, ctx.adapter.pooled_index())
                accumulate(stats, modules_m, sink_m, sink_e, weights)
            for k, (a, b) in (("in", (s - e, e)), ("out", (out_m - out_e, out_e))):
                d, r = _sq_norms(a, b, mask)
                drift[f"{k}_diff"] += d
                drift[f"{k}_ref"] += r
            yield out_e.reshape(-1, out_e.shape[-1])

    outputs = []
    if last:
        for _ in expert_outputs():
            pass
    else:
        rel = ctx.run.acts(task, layer + 1, "expert")
        shape = open_array(ctx.run / ctx.run.acts(task, layer, "expert")).shape
        write_array(ctx.run / rel, tuple(shape), ctx.cfg.calibration.batch_size * _tokens(ctx, task), "float32",
                    expert_outputs())
        outputs.append(rel)
    stats_rel = ctx.run.stats(task, layer)
    with atomic_path(ctx.run / stats_rel) as tmp:
        save_file(flatten_stats(stats), str(tmp))
    outputs.append(stats_rel)
    info = {
        "drift_in": (drift["in_diff"] / max(drift["in_ref"], 1e-30)) ** 0.5,
        "drift_out_uncalibrated": (drift["out_diff"] / max(drift["out_ref"], 1e-30)) ** 0.5,
    }
    return outputs, info


def _tokens(ctx: RunContext, task: str) -> int:
    return open_array(ctx.run / ctx.run.inputs(task) / "attention_mask").shape[1]


# ---- solve --------------------------------------------------------------------------------------
def _task_stats(ctx: RunContext, layer: int, module: str) -> Iterator[dict[str, torch.Tensor]]:
    """One module's statistics, task after task in task order, read without mmap: one task's at a time."""
    for task in ctx.tasks:
        path = ctx.run / ctx.run.stats(task, layer)
        header, start = read_header(path)
        wanted = {k: read_tensor(path, e, start) for k, e in header.items() if k.rsplit(":", 1)[0] == module}
        yield unflatten_stats(wanted)[module]


def solve(ctx: RunContext, layer: int) -> tuple[list[str], dict[str, Any]]:
    fc = ctx.cfg.featcal
    hp = Hyper(lam=fc.lam, rho=fc.rho, alpha=fc.alpha, eps=fc.eps)
    prefix = ctx.adapter.block_prefix(layer)
    merged = ctx.checkpoint(MERGED).with_prefix(prefix)
    base = ctx.checkpoint("base")
    experts = [ctx.checkpoint(t) for t in ctx.tasks]
    solved = dict(merged)
    damping: dict[str, float] = {}
    for name, module in calibrated_modules(ctx.skeleton.block_template(layer)).items():
        p = f"{name}." if name else ""
        weight, bias = f"{p}weight", f"{p}bias"
        has_bias = bias in merged
        where = f"{prefix}{name}"
        if is_norm(module):
            if not fc.calibrate_norm:
                continue
            moms = [norm_moments(s, where) for s in _task_stats(ctx, layer, name)]
            gamma, beta = solve_norm_affine(
                moms, [e.get(prefix + weight) for e in experts],
                [e.get(prefix + bias) for e in experts] if has_bias else None,
                merged[weight], base.get(prefix + weight),
                merged.get(bias), base.get(prefix + bias) if has_bias else None, hp,
            )
            solved[weight] = gamma.to(merged[weight].dtype)
            if has_bias:
                solved[bias] = beta.to(merged[bias].dtype)
            continue
        bias_terms: list[BiasTerm] = []

        def per_task() -> Iterator[tuple[LinearMoments, torch.Tensor]]:
            for stats, expert in zip(_task_stats(ctx, layer, name), experts, strict=True):
                mom, w_t = linear_moments(stats, where), expert.get(prefix + weight)
                if has_bias:
                    bias_terms.append(BiasTerm.of(mom, w_t, expert.get(prefix + bias), hp.alpha))
                yield mom, w_t

        sol = solve_linear_weight(per_task(), merged[weight], base.get(prefix + weight), hp)
        solved[weight] = sol.weight.to(merged[weight].dtype)
        damping[name] = sol.damping
        if sol.damping > hp.eps:
            log.warning("block %d module %s: Cholesky needed damping %.3g (asked %.3g)", layer, name, sol.damping, hp.eps)
        if has_bias and fc.calibrate_bias:
            b = solve_linear_bias(bias_terms, sol.weight, merged[bias], base.get(prefix + bias), hp)
            solved[bias] = b.to(merged[bias].dtype)
    rel = ctx.run.block(layer)
    with atomic_path(ctx.run / rel) as tmp:
        save_file({k: v.contiguous() for k, v in solved.items()}, str(tmp))
    grown = {m: d for m, d in damping.items() if d > hp.eps}
    return [rel], {"modules": len(damping), "damping_grown": grown}


# ---- propagate ----------------------------------------------------------------------------------
def calibrated_block(ctx: RunContext, layer: int) -> torch.nn.Module:
    path = ctx.adapter.block_prefix(layer).rstrip(".")
    return ctx.skeleton.materialize(path, load_file(ctx.run / ctx.run.block(layer)))


def propagate(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    block = calibrated_block(ctx, layer)

    def outputs() -> Iterator[torch.Tensor]:
        for mask, s in _boundary(ctx, task, layer, ("merged",)):
            with torch.inference_mode():
                out = ctx.adapter.run_block(block, s, ctx.adapter.block_input({"attention_mask": mask}))
            yield out.reshape(-1, out.shape[-1])

    rel = ctx.run.acts(task, layer + 1, "merged")
    shape = open_array(ctx.run / ctx.run.acts(task, layer, "merged")).shape
    write_array(ctx.run / rel, tuple(shape), ctx.cfg.calibration.batch_size * _tokens(ctx, task), "float32", outputs())
    return [rel], {}
