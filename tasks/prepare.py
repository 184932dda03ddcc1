"""The prepare stage: a task's calibration inputs, stored once, and both sides' embeddings (boundary 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from featcal.config import DataSource
from featcal.data import InputBuilder, load_split, pad_to, pick_examples, row_batches, token_views
from featcal.hub import local_dir
from featcal.t5 import column_targets, decoder_batches, greedy_targets
from tasks.boundary import FOREIGN_ROWS, mask_of, stored_inputs, tokens_of, write_rows
from tasks.context import RunContext
from tasks.input_cache import InputCache
from tasks.merge import MERGED

Batches = Callable[[], Iterator[dict[str, torch.Tensor]]]


def _sources(ctx: RunContext, task: str) -> list[tuple[str, DataSource, int]]:
    """Where task `task`'s stored rows come from, in order: its own data, then with calibration.shared_inputs on the
    other tasks' data (task order) and the pool: (field, source, examples asked)."""
    cal = ctx.cfg.calibration
    own = [(f"calibration.data.{task}", cal.data[task], cal.examples_per_task)]
    shared = cal.shared_inputs
    if not shared.weights:
        return own
    others = [(f"calibration.data.{u}", cal.data[u], cal.examples_per_task) for u in ctx.tasks if u != task]
    pool = [] if shared.pool is None else [("calibration.shared_inputs.pool", shared.pool, shared.pool_examples)]
    return own + others + pool


def _model_inputs(ctx: RunContext, task: str) -> tuple[Batches, int, dict[str, Any], np.ndarray | None]:
    """Batches of the task's calibration inputs (its own examples first, then the foreign ones of
    calibration.shared_inputs), padded to one width for the whole task (decoder inputs too, for an encoder–decoder),
    and with foreign rows, each stored row's mark (boundary.FOREIGN_ROWS)."""
    cal = ctx.cfg.calibration
    sources = []
    for where, source, n in _sources(ctx, task):
        picked = pick_examples(load_split(source, where), n, cal.seed, where)
        sources.append((picked, InputBuilder(ctx.cfg.base, ctx.adapter.model_input_names(), source, cal.max_length,
                                             picked.column_names, where, ctx.device)))
    picked, builder = sources[0]
    where, source = f"calibration.data.{task}", cal.data[task]
    width = (max(b(rows)["input_ids"].shape[1] for p, b in sources for rows in row_batches(p, cal.batch_size))
             if builder.is_text else 0)
    views = cal.views.count  # preflight refused views of images and of encoder–decoder inputs

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        offset = 0  # examples of the sources before this one: view seeds run on over the foreign examples
        for rows_of, build in sources:
            for first, rows in zip(range(0, len(rows_of), cal.batch_size), row_batches(rows_of, cal.batch_size)):
                inputs = pad_to(build(rows), width, build.pad_id) if build.is_text else build(rows)
                yield token_views(inputs, views, cal.views.drop, build.special_ids, build.pad_id, cal.seed,
                                  offset + first) if views else inputs
            offset += len(rows_of)

    info: dict[str, Any] = {"examples": len(picked), "examples_requested": cal.examples_per_task}
    if views:
        info["views_per_example"] = views
    foreign = sum(len(p) for p, _ in sources[1:])
    marks = None
    if foreign:
        info["foreign_examples"] = foreign
        pool = len(sources) - 1 if ctx.cfg.calibration.shared_inputs.pool is not None else None
        marks = np.concatenate([np.zeros(len(picked), np.int32)] + [
            np.full(len(p), -1, np.int32) if k == pool else np.arange(1, len(p) + 1, dtype=np.int32)
            for k, (p, _) in enumerate(sources) if k]).repeat(1 + views)
    if not ctx.adapter.has_decoder:
        return batches, (len(picked) + foreign) * (1 + views), info, marks
    if foreign:  # preflight refuses shared inputs of encoder–decoders: their targets are per task
        raise ValueError("calibration.shared_inputs: not for encoder–decoders")
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

    return joined_batches, len(picked), info, None



def prepare(ctx: RunContext, task: str, inputs_key: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """A task's model inputs (from runtime.input_cache when it holds them under `inputs_key`, else prepared, and
    then kept there), and both sides' embeddings of them: boundary 0."""
    store, bs = ctx.run.store, ctx.cfg.calibration.batch_size
    inputs_rel = ctx.run.inputs(task)
    location = store.location(inputs_rel)
    cache = InputCache(ctx.cfg.runtime.input_cache, inputs_key) if ctx.cfg.runtime.input_cache and inputs_key else None
    if cache is not None and cache.info() is not None:
        info = {**cache.restore(store, location, bs), "inputs": "from runtime.input_cache"}
    else:
        info = _stored_model_inputs(ctx, task)
        if cache is not None:
            cache.save(store, location, bs, info)
            info["inputs"] = "prepared, then kept in runtime.input_cache"
    mask = store.open_array(mask_of(ctx, task))
    info.update(tokens_per_example=mask.shape[1], real_tokens=int(np.asarray(mask[:]).sum()))
    outputs = [inputs_rel]
    for side, ckpt in (("merged", MERGED), ("expert", task)):
        outputs += _embedded(ctx, task, side, ckpt, mask.shape[0])
    return outputs, info


def _stored_model_inputs(ctx: RunContext, task: str) -> dict[str, Any]:
    """The task's model inputs written to the run's store, and what the prepare record says about them."""
    batches, n, info, marks = _model_inputs(ctx, task)
    bs = ctx.cfg.calibration.batch_size
    first = next(batches())
    store = ctx.run.store
    with store.staged(store.location(ctx.run.inputs(task))) as tmp:
        for name, value in first.items():
            shape = (n, *value.shape[1:])
            store.write_array(f"{tmp}/{name}", shape, bs, str(value.numpy().dtype), (b[name] for b in batches()))
        if marks is not None:  # which rows are the task's own and which are foreign
            store.write_array(f"{tmp}/{FOREIGN_ROWS}", (n,), bs, "int32", [marks])
        # Every architecture gets a token mask: padding is weight 0 in every statistic downstream.
        if "attention_mask" not in first:
            tokens = ctx.adapter.embed(ctx.skeleton.embedding(ctx.checkpoint(MERGED)), first).shape[1]
            store.write_array(f"{tmp}/attention_mask", (n, tokens), bs, "int64",
                              [np.ones((n, tokens), dtype=np.int64)])
    return info


def _embedded(ctx: RunContext, task: str, side: str, ckpt: str, n: int) -> list[str]:
    """One side's embedding outputs, stack by stack. Its own function so that side's embedding modules are freed
    before the other side's load: an LLM's embedding is the largest thing any stage holds."""
    modules = ctx.skeleton.embedding(ctx.checkpoint(ckpt))
    hidden, bs = ctx.adapter.text_or_vision_config().hidden_size, ctx.cfg.calibration.batch_size
    outputs = []
    for start in ctx.adapter.stack_starts():  # each stack's input: the encoder's, then the decoder's
        rel, tokens = ctx.run.acts(task, start, side), tokens_of(ctx, task, start)
        with torch.inference_mode():
            rows = (ctx.adapter.embed_at(start, modules, b).reshape(-1, hidden) for b in stored_inputs(ctx, task))
            write_rows(ctx, rel, (n * tokens, hidden), bs * tokens, rows)
        outputs.append(rel)
    return outputs
