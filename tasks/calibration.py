"""Stages of the layer-by-layer calibration: prepare, gram, solve, propagate (docs/design.md §2–§3)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from featcal.adapters import BlockInput
from featcal.calibration_methods import CalibrationMethod, ModuleData, calibration_method
from featcal.data import InputBuilder, load_split, pad_to, pick_examples, row_batches, token_views
from featcal.devices import release_freed_memory, solve_device, to_device
from featcal.hub import local_dir
from featcal.modeling import as_out_in, calibrated_modules, is_norm, linear_dims, norm_scale_offset
from featcal.statistics import (
    READERS,
    Stats,
    accumulate,
    captured_inputs,
    example_rows,
    flatten_stats,
    held_prefix,
    input_owners,
    module_keys,
    new_stats,
    shared_inputs,
    stats_flops,
    stats_layout,
)
from featcal.t5 import column_targets, decoder_batches, greedy_targets
from storage.atomic import atomic_path
from storage.checkpoint import CanonicalCheckpoint, read_header, read_metadata, read_tensor, save_tensors
from storage.lora import LoraCheckpoint
from tasks.context import RunContext
from tasks.merge import MERGED, head_file

log = logging.getLogger("featcal")


# ---- prepare ------------------------------------------------------------------------------------
def _model_inputs(ctx: RunContext, task: str) -> tuple[Callable[[], Iterator[dict[str, torch.Tensor]]], int, dict[str, Any]]:
    """Batches of the task's calibration inputs, padded to one width for the whole task (decoder inputs too, for an
    encoder–decoder)."""
    cal = ctx.cfg.calibration
    where = f"calibration.data.{task}"
    source = cal.data[task]
    picked = pick_examples(load_split(source, where), cal.examples_per_task, cal.seed, where)
    builder = InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, cal.max_length, picked.column_names, where)
    width = max(builder(rows)["input_ids"].shape[1] for rows in row_batches(picked, cal.batch_size)) if builder.is_text else 0
    views = cal.views.count  # preflight refused views of images and of encoder–decoder inputs

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for first, rows in zip(range(0, len(picked), cal.batch_size), row_batches(picked, cal.batch_size)):
            inputs = pad_to(builder(rows), width, builder.pad_id) if builder.is_text else builder(rows)
            yield token_views(inputs, views, cal.views.drop, builder.special_ids, builder.pad_id, cal.seed,
                              first) if views else inputs

    info = {"examples": len(picked), "examples_requested": cal.examples_per_task}
    if views:
        info["views_per_example"] = views
    if not ctx.adapter.has_decoder:
        return batches, len(picked) * (1 + views), info
    encoder = list(batches())  # token ids only: small, and generation must not run once per stored array
    if source.target_column is not None:  # preflight checked that the column exists
        targets = column_targets(picked[source.target_column], local_dir(ctx.cfg.base), cal.max_target_length, where)
        info["decoder_targets"] = f"column {source.target_column}"
    else:
        targets = greedy_targets(ctx.checkpoint_dir(task), encoder, cal.max_target_length,
                                 ctx.checkpoint_dir("base"))
        info["decoder_targets"] = f"expert greedy output (at most {cal.max_target_length} tokens)"
    config = ctx.adapter.config
    decoder = decoder_batches(targets, cal.batch_size, config.decoder_start_token_id, config.pad_token_id)
    joined = [{**e, **d} for e, d in zip(encoder, decoder, strict=True)]

    def joined_batches() -> Iterator[dict[str, torch.Tensor]]:
        return iter(joined)

    return joined_batches, len(picked), info


def stored_inputs(ctx: RunContext, task: str) -> Iterator[dict[str, torch.Tensor]]:
    """The task's stored model inputs, one batch at a time."""
    store = ctx.run.store
    root = store.location(ctx.run.inputs(task))
    streams = {n: store.iter_row_blocks(f"{root}/{n}", ctx.cfg.calibration.batch_size) for n in store.array_names(root)}
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
    store = ctx.run.store
    with store.staged(store.location(inputs_rel)) as tmp:
        for name, value in first.items():
            shape = (n, *value.shape[1:])
            store.write_array(f"{tmp}/{name}", shape, bs, str(value.numpy().dtype), (b[name] for b in batches()))
        # Every architecture gets a token mask: padding is weight 0 in every statistic downstream.
        if "attention_mask" not in first:
            tokens = ctx.adapter.embed(ctx.skeleton.embedding(ctx.checkpoint(MERGED)), first).shape[1]
            store.write_array(f"{tmp}/attention_mask", (n, tokens), bs, "int64",
                              [np.ones((n, tokens), dtype=np.int64)])
    mask = store.open_array(_mask(ctx, task))
    info.update(tokens_per_example=mask.shape[1], real_tokens=int(np.asarray(mask[:]).sum()))
    outputs = [inputs_rel]
    for side, ckpt in (("merged", MERGED), ("expert", task)):
        outputs += _embedded(ctx, task, side, ckpt, n)
    return outputs, info


def _embedded(ctx: RunContext, task: str, side: str, ckpt: str, n: int) -> list[str]:
    """One side's embedding outputs, stack by stack. Its own function so that side's embedding modules are freed
    before the other side's load: an LLM's embedding is the largest thing any stage holds."""
    modules = ctx.skeleton.embedding(ctx.checkpoint(ckpt))
    hidden, bs, store = ctx.adapter.text_or_vision_config().hidden_size, ctx.cfg.calibration.batch_size, ctx.run.store
    outputs = []
    for start in ctx.adapter.stack_starts():  # each stack's input: the encoder's, then the decoder's
        rel, tokens = ctx.run.acts(task, start, side), _tokens(ctx, task, start)
        with torch.inference_mode():
            rows = (ctx.adapter.embed_at(start, modules, b).reshape(-1, hidden) for b in stored_inputs(ctx, task))
            store.write_array(store.location(rel), (n * tokens, hidden), bs * tokens, ctx.storage_dtype, rows)
        outputs.append(rel)
    return outputs


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


def emphasis_for(ctx: RunContext, layer: int, modules: list[str],
                 pooled_token_weight: float | None) -> dict[str, float] | None:
    """In the last block the head reads one token: others get `pooled_token_weight`, except key/value inputs."""
    if layer != ctx.num_blocks - 1 or pooled_token_weight is None:
        return None
    return {m: 1.0 if m in ctx.adapter.kv_modules else pooled_token_weight for m in modules}


def _boundary(ctx: RunContext, task: str, layer: int, sides: tuple[str, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """(mask [B,T], then one [B,T,H] chunk per side) for boundary `layer` of a task, chunk by chunk; the mask is
    the one of block `layer`'s stack (an encoder–decoder's decoder blocks have their own). At the head side (block
    L), only the tokens its statistics count (`Adapter.head_side_tokens`)."""
    bs, tokens = ctx.cfg.calibration.batch_size, _tokens(ctx, task, layer)
    store = ctx.run.store
    masks = store.iter_row_blocks(_mask(ctx, task, layer), bs)
    streams = [store.iter_row_blocks(store.location(ctx.run.acts(task, layer, side)), bs * tokens) for side in sides]
    kept = ctx.adapter.head_side_tokens() if layer == ctx.num_blocks else slice(None)
    for mask, *chunks in zip(masks, *streams, strict=True):
        # To a GPU through pinned memory, asynchronously: reading the next chunk overlaps this one's compute.
        moved = to_device({"mask": mask, **{side: c for side, c in zip(sides, chunks, strict=True)}}, ctx.device)
        mask = moved.pop("mask")
        yield mask[:, kept], *(c.to(ctx.dtype).reshape(mask.shape[0], tokens, -1)[:, kept] for c in moved.values())


def _memory(ctx: RunContext, task: str, layer: int, side: str) -> Iterator[dict[str, torch.Tensor]]:
    """Chunk by chunk, what block `layer` reads besides its own boundary: one stream's encoder output and its mask
    for a decoder block (nothing for any other block)."""
    if not ctx.adapter.reads_encoder(layer):
        yield from itertools.repeat({})
        return
    bs, tokens, store = ctx.cfg.calibration.batch_size, _tokens(ctx, task, 0), ctx.run.store
    masks = store.iter_row_blocks(_mask(ctx, task, 0), bs)
    hidden = store.iter_row_blocks(store.location(ctx.run.encoder_output(task, side)), bs * tokens)
    for mask, h in zip(masks, hidden, strict=True):
        moved = to_device({"encoder_attention_mask": mask, "encoder_hidden_states": h}, ctx.device)
        moved["encoder_hidden_states"] = moved["encoder_hidden_states"].to(ctx.dtype).reshape(mask.shape[0], tokens, -1)
        yield moved


def _block_input(ctx: RunContext, layer: int, mask: torch.Tensor, memory: dict[str, torch.Tensor],
                 weights_of: str) -> BlockInput:
    """Block `layer`'s extra inputs in the stream whose encoder output is `memory`, for a block of checkpoint
    `weights_of` (what a block takes from its stack's first block comes from the same checkpoint)."""
    return ctx.adapter.block_input({"attention_mask": mask, **memory}, layer, ctx.checkpoint(weights_of).get)


def _sq_norms(diff: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    m = mask.float()[..., None]
    return float(((diff.float() * m) ** 2).sum()), float(((ref.float() * m) ** 2).sum())


def gram(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    """Statistics of block `layer`'s module inputs for one task, and E_t(layer+1) (expert block on E_t).

    Which block runs on which stream is the run's calibration method's `StatisticsPlan`
    (featcal/calibration_methods.py): x_s from its fit block on its fit stream, and x_e from the expert block on E_t
    when the plan keeps the expert side (else x_s fills both slots)."""
    plan = calibration_method(ctx.cfg.featcal).statistics
    expert_block = ctx.on_device(ctx.skeleton.block(layer, ctx.checkpoint(task)))
    modules_e = calibrated_modules(expert_block)
    # The uncalibrated merged block runs only when the plan reads its inputs; its output error is then measured too.
    merged_block = (ctx.on_device(ctx.skeleton.block(layer, ctx.checkpoint(MERGED))) if plan.fit_block == "merged"
                    else None)
    fit_block, fit_checkpoint = (merged_block, MERGED) if merged_block is not None else (expert_block, task)
    stats_modules = calibrated_modules(merged_block) if merged_block is not None else modules_e
    every = plan.held_out_every  # rows held out to choose hyperparameters get sums of their own, fold by fold
    rows_per_example = 1 + ctx.cfg.calibration.views.count  # an example's views are held out with it
    # Built at the first chunk, whose module inputs show which modules read the same input.
    made: dict[str, Any] = {}
    emphasis = emphasis_for(ctx, layer, list(stats_modules), plan.pooled_token_weight)
    drift = {"in_diff": 0.0, "in_ref": 0.0, "out_diff": 0.0, "out_ref": 0.0}
    last = layer == ctx.calibrated_blocks - 1
    head_side = layer == ctx.num_blocks  # featcal.calibrate_head_side's block L
    finish_e = _stack_end(ctx, layer, task)
    examples = ctx.run.store.open_array(_mask(ctx, task, layer)).shape[0]

    def run(block: torch.nn.Module, modules: dict[str, torch.nn.Module], hidden: torch.Tensor, extra: Any,
            outputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sink: dict[str, torch.Tensor] = {}
        with captured_inputs(modules, sink, outputs):
            if head_side:
                return ctx.adapter.run_head_side(block, hidden), sink
            return ctx.adapter.run_block(block, hidden, extra), sink

    def add_drift(kind: str, diff: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> None:
        d, r = _sq_norms(diff, ref, mask)
        drift[f"{kind}_diff"] += d
        drift[f"{kind}_ref"] += r

    def add(weights: dict[str, torch.Tensor], sink_s: dict[str, torch.Tensor], sink_e: dict[str, torch.Tensor],
            outs_e: dict[str, torch.Tensor] | None, chunk_examples: int) -> None:
        if not made:
            rows_of_tasks = len(ctx.tasks) if plan.keeps_rows(ctx.cfg.runtime.row_statistics) else 0
            forms, owners = stats_layout(stats_modules, weights, (sink_s, sink_e), examples, chunk_examples,
                                         keeps_expert=plan.expert_side, rows_of_tasks=rows_of_tasks)
            alpha = ctx.cfg.featcal.alpha
            made.update(stats=new_stats(stats_modules, forms, owners, ctx.device, alpha), owners=owners,
                        held=[new_stats(stats_modules, forms, owners, ctx.device, alpha)
                              for _ in range(plan.held_out_folds)] if every else [])
        elif input_owners(list(made["owners"]), weights, sink_s, sink_e) != made["owners"]:
            raise RuntimeError(f"block {layer}, task {task}: modules that shared one input in the first chunk do "
                               "not in a later one")
        accumulate(made["stats"], stats_modules, sink_s, sink_e, weights, outs_e, modules_e)

    def expert_outputs() -> Iterator[torch.Tensor]:
        memories = zip(_memory(ctx, task, layer, "merged"), _memory(ctx, task, layer, "expert"))
        seen = 0  # examples before the current chunk
        for (mask, s, e), (memory_s, memory_e) in zip(_boundary(ctx, task, layer, ("merged", "expert")), memories):
            extra_e = _block_input(ctx, layer, mask, memory_e, task)
            outs_e: dict[str, torch.Tensor] | None = {} if plan.expert_side else None
            with torch.inference_mode():
                out_e, sink_e = run(expert_block, modules_e, e, extra_e, outs_e)
                weights = token_weights(mask, list(stats_modules), emphasis, ctx.adapter.pooled_index())
                if memory_s:  # cross-attention keys/values: one row per encoder token
                    weights.update(dict.fromkeys([m for m in ctx.adapter.memory_modules if m in stats_modules],
                                                 memory_s["encoder_attention_mask"].reshape(-1).float()))
                if plan.fit_stream == "expert":  # the expert block on E_t: the run above
                    sink_s = sink_e
                else:
                    extra_s = _block_input(ctx, layer, mask, memory_s, fit_checkpoint)
                    out_s, sink_s = run(fit_block, stats_modules, s, extra_s)
                    if merged_block is not None:
                        add_drift("out", out_s - out_e, out_e, mask)
                sink_x = sink_e if plan.expert_side else sink_s  # one side only: it fills both of the statistics' slots
                add(weights, sink_s, sink_x, outs_e, mask.shape[0])
                example = torch.arange(seen, seen + mask.shape[0], device=mask.device) // rows_per_example
                for fold, held in enumerate(made["held"]):  # fold k: the examples i with i mod N = N − 1 − k
                    chosen = (example % every) == every - 1 - fold
                    if bool(chosen.any()):
                        held_w, held_s, held_x, held_o = example_rows(weights, chosen, sink_s, sink_x,
                                                                      outs_e if outs_e is not None else {})
                        accumulate(held, stats_modules, held_s, held_x, held_w, held_o, modules_e)
                if finish_e is not None:
                    out_e = finish_e(out_e)
            add_drift("in", s - e, e, mask)
            seen += mask.shape[0]
            yield out_e.reshape(-1, out_e.shape[-1])

    outputs = []
    if last:
        for _ in expert_outputs():
            pass
    else:
        outputs.append(_write_next_boundary(ctx, task, layer, "expert", expert_outputs()))
    stats: Stats = made["stats"]
    folds: list[Stats] = made["held"]
    stats_rel = ctx.run.stats(task, layer)
    with atomic_path(ctx.run / stats_rel) as tmp:
        ctx.run.claim_spare(tmp)  # an earlier block's statistics, released: written over in place
        save_tensors({**flatten_stats(stats), **{k: v for fold, held in enumerate(folds)
                                                 for k, v in flatten_stats(held, held_prefix(fold)).items()}}, tmp,
                     {STATS_ALPHA: repr(ctx.cfg.featcal.alpha)})
    outputs.append(stats_rel)
    info = {"drift_in": (drift["in_diff"] / max(drift["in_ref"], 1e-30)) ** 0.5,
            "gram_flops": stats_flops(stats) + sum(stats_flops(held) for held in folds),
            "product_form": sorted(m for m, s in stats.items() if getattr(s, "form", None) == "product"),
            "row_form": sorted(m for m, s in stats.items() if getattr(s, "form", None) == "rows")}
    if merged_block is not None:  # the uncalibrated merged block ran: how far its output is from the expert's
        info["drift_out_uncalibrated"] = (drift["out_diff"] / max(drift["out_ref"], 1e-30)) ** 0.5
    return outputs, info


def _stack_end(ctx: RunContext, layer: int, checkpoint: str) -> torch.nn.Module | None:
    """The module (of `checkpoint`) that turns block `layer`'s output into the encoder output later blocks read,
    when block `layer` ends the encoder of an encoder–decoder; None otherwise."""
    name = ctx.adapter.ends_stack(layer)
    return None if name is None else ctx.on_device(
        ctx.skeleton.materialize(name, ctx.checkpoint(checkpoint).with_prefix(f"{name}.")))


def _write_next_boundary(ctx: RunContext, task: str, layer: int, side: str, rows: Iterator[torch.Tensor]) -> str:
    """What block `layer` hands on for one side, chunked and shaped like boundary `layer`: boundary `layer + 1`, or
    the encoder output when block `layer` ends the encoder (the decoder's first boundary comes from prepare).
    Returns its output name."""
    store = ctx.run.store
    rel = ctx.run.encoder_output(task, side) if ctx.adapter.ends_stack(layer) else ctx.run.acts(task, layer + 1, side)
    shape = store.open_array(store.location(ctx.run.acts(task, layer, side))).shape
    store.write_array(store.location(rel), tuple(shape), ctx.cfg.calibration.batch_size * _tokens(ctx, task, layer),
                      ctx.storage_dtype, rows)
    return rel


def _tokens(ctx: RunContext, task: str, layer: int = 0) -> int:
    return ctx.run.store.open_array(_mask(ctx, task, layer)).shape[1]


def _mask(ctx: RunContext, task: str, layer: int = 0) -> str:
    return ctx.run.store.location(f"{ctx.run.inputs(task)}/{ctx.adapter.mask_name(layer)}")


# ---- solve --------------------------------------------------------------------------------------
# The statistics file's metadata key for the α its product-form sums P_t were taken with.
STATS_ALPHA = "featcal.alpha"


def _task_stats(ctx: RunContext, layer: int, members: tuple[str, ...],
                device: torch.device | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The statistics of `members` (one module, or modules that read one input, solved as one map with their outputs
    stacked) on `device`, task after task in task order, read without mmap: one task's at a time. The input's sums
    are read once; each member's own (P_t, row targets) sit side by side along their output axis, in member order."""
    for task in ctx.tasks:
        path = ctx.run / ctx.run.stats(task, layer)
        header, start = read_header(path)
        keys = [module_keys(list(header), m) for m in members]
        parts = {part for ks in keys for part in ks.values()}
        if {"pt", "yt"} & parts:  # P_t and the row form's targets hold α: another α's are not this run's
            summed_for = read_metadata(path).get(STATS_ALPHA)
            if summed_for != repr(ctx.cfg.featcal.alpha):
                kept = "P_t was summed" if "pt" in parts else "row targets were taken"
                raise ValueError(f"{path}: module {READERS.join(members)}'s {kept} for featcal.alpha {summed_for}, "
                                 f"the run asks {ctx.cfg.featcal.alpha}; rerun its Gram stage")

        def read(key: str) -> torch.Tensor:
            return read_tensor(path, header[key], start).to(device)

        shared = {key: part for key, part in keys[0].items() if all(key in ks for ks in keys)}
        own = [{part: key for key, part in ks.items() if key not in shared} for ks in keys]
        yield {**{part: read(key) for key, part in shared.items()},
               **{part: torch.cat([read(mine[part]) for mine in own], dim=-1) for part in own[0]}}


def solve_groups(modules: dict[str, torch.nn.Module], groups: int) -> list[list[str]]:
    """A block's modules in `groups` lists of about equal solve cost, each in block order.

    A linear map costs about in² · (in + out) (its Gram products and its Cholesky), a norm its width; the
    costliest module goes first to the least loaded group (ties: the lower group), so the split is fixed."""
    if not 1 <= groups <= len(modules):
        raise ValueError(f"runtime.solve_groups must be between 1 and {len(modules)} (the calibrated modules of a "
                         f"block), got {groups}")
    order = list(modules)

    def cost(name: str) -> int:
        m = modules[name]
        if is_norm(m):
            return m.weight.shape[0]
        d_in, d_out = linear_dims(m)
        return d_in ** 2 * (d_in + d_out)

    members: list[list[str]] = [[] for _ in range(groups)]
    load = [0] * groups
    for name in sorted(order, key=lambda n: (-cost(n), order.index(n))):
        g = min(range(groups), key=lambda i: (load[i], i))
        members[g].append(name)
        load[g] += cost(name)
    return [sorted(m, key=order.index) for m in members]


def solve(ctx: RunContext, layer: int, group: int = 0, groups: int = 1) -> tuple[list[str], dict[str, Any]]:
    """The modules of solve group `group` (of `groups`) of block `layer`, each solved by the run's calibration method
    (featcal/calibration_methods.py) from the tasks' statistics summed in task order; the group's file holds every
    parameter of its modules, solved or kept (a part the method leaves keeps the merged value)."""
    if not ctx.cfg.runtime.keep_freed_memory:
        release_freed_memory()
    fc = ctx.cfg.featcal
    method = calibration_method(fc, ctx.cfg.runtime.solve_precision)
    weights = (_task_weights(ctx, layer, fc.task_weight_power, fc.task_weights) if method.weighs_tasks
               else [1.0] * len(ctx.tasks))
    merged = ctx.checkpoint(MERGED).with_prefix(ctx.adapter.block_prefix(layer))
    modules = calibrated_modules(ctx.skeleton.block_template(layer))
    solved: dict[str, torch.Tensor] = {}
    damping: dict[str, float] = {}
    grown: dict[str, float] = {}
    solved_on: set[str] = set()  # float64 solves: on the run's device when it has room, else the CPU
    reports: dict[str, dict[str, Any]] = {}  # per-module facts the method reports (a chosen λ, ...), by kind
    row_form, inputs = _block_layout(ctx, layer, modules)
    for members in _solve_units(ctx, layer, solve_groups(modules, groups)[group], merged, inputs, method):
        for name in members:
            solved.update({k: merged[k] for k in _part_names(name).values() if k in merged})
        data, stored = _module_data(ctx, layer, members, modules, merged, tuple(weights), solved_on,
                                    members[0] in row_form)
        result = method.solve_norm(data) if is_norm(modules[members[0]]) else method.solve_linear(data)
        if result is None:
            continue
        solved.update(stored(result.tensors))
        for name in members:
            for kind, value in result.report.items():
                reports.setdefault(kind, {})[name] = value
            if result.damping is None:
                continue
            damping[name] = result.damping
            if result.eps is not None and result.damping > result.eps:
                grown[name] = result.damping
                log.warning("block %d module %s: Cholesky needed damping %.3g (asked %.3g)", layer, name,
                            result.damping, result.eps)
    rel = ctx.run.block(layer, group, groups)
    with atomic_path(ctx.run / rel) as tmp:
        save_tensors(solved, tmp)
    info: dict[str, Any] = {"method": fc.method, "modules": len(damping), "damping_grown": grown,
                            "solved_on": sorted(solved_on)}
    if fc.task_weight_power or fc.task_weights:
        info["task_weights"] = dict(zip(ctx.tasks, weights, strict=True))
    info.update(reports)
    return [rel], info


def _part_names(module: str) -> dict[str, str]:
    """A module's weight and bias names within its block."""
    return {part: f"{module}.{part}" if module else part for part in ("weight", "bias")}


def _module_data(ctx: RunContext, layer: int, members: tuple[str, ...], modules: dict[str, torch.nn.Module],
                 merged: dict[str, torch.Tensor], weights: tuple[float, ...], solved_on: set[str],
                 rows: bool) -> tuple[ModuleData, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """`members` of block `layer` (one module, or linear maps that read one input, as one map with their outputs
    stacked) as a method's solve reads them, and how solved tensors go back to the checkpoint's names, layout and
    dtype. A linear map's tensors move to its solve's device (noted in `solved_on`), its weight as [out, in] (Conv1D
    stores [in, out]); a norm's stay on the CPU, γ as offset + the stored weight (Gemma's (1 + w) norms)."""
    prefix = ctx.adapter.block_prefix(layer)
    base, experts = ctx.checkpoint("base"), [ctx.checkpoint(t) for t in ctx.tasks]
    names = [_part_names(m) for m in members]
    first = modules[members[0]]
    if is_norm(first):
        device = None
        off = norm_scale_offset(first)

        def solve_layout(part: str, tensors: list[torch.Tensor]) -> torch.Tensor:
            return tensors[0] + off if part == "weight" else tensors[0]

        def stored(solved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {names[0][part]: (t - off if part == "weight" else t).to(merged[names[0][part]].dtype)
                    for part, t in solved.items()}
    else:
        outs = [linear_dims(modules[m])[1] for m in members]
        device = solve_device(ctx.device, linear_dims(first)[0], sum(outs))
        solved_on.add(str(device))

        def solve_layout(part: str, tensors: list[torch.Tensor]) -> torch.Tensor:
            laid = [as_out_in(modules[m], t) if part == "weight" else t for m, t in zip(members, tensors, strict=True)]
            return (laid[0] if len(laid) == 1 else torch.cat(laid)).to(device)

        def stored(solved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = {}
            for part, stacked in solved.items():
                for m, own, t in zip(members, names, stacked.split(outs), strict=True):
                    t = as_out_in(modules[m], t) if part == "weight" else t
                    out[own[part]] = t.to("cpu", merged[own[part]].dtype).contiguous()
            return out

    data = ModuleData(
        where=prefix + READERS.join(members), tasks=tuple(ctx.tasks), task_weights=weights,
        has_bias=names[0]["bias"] in merged,
        stats=lambda: _task_stats(ctx, layer, members, device),
        merged=lambda part: solve_layout(part, [merged[n[part]] for n in names]),
        base=lambda part: solve_layout(part, [base.get(prefix + n[part]) for n in names]),
        expert=lambda t, part: solve_layout(part, [experts[t].get(prefix + n[part]) for n in names]),
        head=_head(ctx, layer, members[0], experts, device), rows=rows)
    return data, stored


def _block_layout(ctx: RunContext, layer: int, modules: Iterable[str]) -> tuple[set[str], list[tuple[str, ...]]]:
    """From the statistics files of block `layer` (one header read per task): those of `modules` whose rows (row
    form), not sums, every task keeps; and the inputs that several of them read, each as its readers in block order
    (q, k and v; gate and up), where every task's file keeps the input's sums once for them all."""
    headers = [list(read_header(ctx.run / ctx.run.stats(task, layer))[0]) for task in ctx.tasks]
    rows = {m for m in modules if all("xs" in module_keys(keys, m).values() for keys in headers)}
    return rows, sorted(set.intersection(*(shared_inputs(keys) for keys in headers)))


def _solve_units(ctx: RunContext, layer: int, names: list[str], merged: dict[str, torch.Tensor],
                 inputs: list[tuple[str, ...]], method: CalibrationMethod) -> list[tuple[str, ...]]:
    """`names` (a solve group of block `layer`, in block order) as the units the solve takes one at a time: the
    linear maps that read one input, where the method solves them as one map (their system matrix is one: one
    Cholesky factor instead of one each, the input's sums read once), each other module alone. Readers with and
    without a bias go alone, as does the module that feeds a head metric."""
    joined: dict[str, tuple[str, ...]] = {}
    if method.joins_readers:
        for readers in inputs:
            present = tuple(m for m in names if m in readers)
            biased = {_part_names(m)["bias"] in merged for m in present}
            heads = [m for m in present if _feeds_head_metric(ctx, layer, m)]
            if len(present) > 1 and len(biased) == 1 and not heads:
                joined.update(dict.fromkeys(present, present))
    return list(dict.fromkeys(joined.get(name, (name,)) for name in names))  # a joined unit once, at its first member


def _feeds_head_metric(ctx: RunContext, layer: int, name: str) -> bool:
    return bool(ctx.cfg.featcal.head_metric) and layer == ctx.num_blocks - 1 and name == ctx.adapter.head_input_module()


def _head(ctx: RunContext, layer: int, name: str, experts: list[CanonicalCheckpoint | LoraCheckpoint],
          device: torch.device | None) -> Callable[[int], torch.Tensor] | None:
    """Task t's head map for module `name` of block `layer` where featcal.head_metric weighs its error, else None:
    from the task's expert, or from the merged checkpoint where every task reads the merged head (causal LMs)."""
    if not _feeds_head_metric(ctx, layer, name):
        return None
    if ctx.adapter.head_is_merged:
        shared = ctx.adapter.head_map(ctx.checkpoint(MERGED)).to(device)
        return lambda t: shared
    if ctx.cfg.zero_shot is not None:  # head-less experts: the merge wrote each task's head from its class names
        merged = ctx.checkpoint(MERGED)
        return lambda t: ctx.adapter.zero_shot_head_map(load_file(ctx.run / MERGED / head_file(ctx.tasks[t])),
                                                        merged).to(device)
    return lambda t: ctx.adapter.head_map(experts[t]).to(device)


def _task_weights(ctx: RunContext, layer: int, power: float, given: dict[str, float]) -> list[float]:
    """c_t ∝ d_t^power with mean 1, d_t = task t's relative output drift of the uncalibrated merged block (measured
    by its Gram stage): power > 0 leans towards the tasks the merge moved most, < 0 protects
    those it served well; then times the task's `given` weight (featcal.task_weights)."""
    if power == 0:
        return [given.get(task, 1.0) for task in ctx.tasks]
    drift = []
    for task in ctx.tasks:
        record = ctx.run.record(f"gram/l{layer:02d}/{task}")
        if record is None:
            raise ValueError(f"featcal.task_weight_power: block {layer} has no Gram record for task {task}")
        drift.append(max(float(record["info"]["drift_out_uncalibrated"]), 1e-12) ** power)
    mean = sum(drift) / len(drift)
    return [d / mean * given.get(task, 1.0) for d, task in zip(drift, ctx.tasks, strict=True)]


# ---- propagate ----------------------------------------------------------------------------------
def calibrated_tensors(ctx: RunContext, layer: int) -> dict[str, torch.Tensor]:
    """Block `layer`'s calibrated parameters (names relative to the block): the merged block with every solve
    group's file laid over it."""
    tensors = ctx.checkpoint(MERGED).with_prefix(ctx.adapter.block_prefix(layer))
    groups = ctx.solve_group_count(layer)
    for group in range(groups):
        tensors.update(load_file(ctx.run / ctx.run.block(layer, group, groups)))
    return tensors


def calibrated_block(ctx: RunContext, layer: int) -> torch.nn.Module:
    path = ctx.adapter.block_prefix(layer).rstrip(".")
    return ctx.on_device(ctx.skeleton.materialize(path, calibrated_tensors(ctx, layer)))


def propagate(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    block = calibrated_block(ctx, layer)
    finish = _stack_end(ctx, layer, MERGED)  # the encoder's final norm is merged, never calibrated

    def outputs() -> Iterator[torch.Tensor]:
        for (mask, s), memory in zip(_boundary(ctx, task, layer, ("merged",)), _memory(ctx, task, layer, "merged")):
            with torch.inference_mode():
                # The relative position bias table is not calibrated: the merged checkpoint's is the calibrated one.
                out = ctx.adapter.run_block(block, s, _block_input(ctx, layer, mask, memory, MERGED))
                if finish is not None:
                    out = finish(out)
            yield out.reshape(-1, out.shape[-1])

    return [_write_next_boundary(ctx, task, layer, "merged", outputs())], {}
