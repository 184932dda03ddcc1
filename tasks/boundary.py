"""Where a stage reads and writes the activations between blocks: the stored model inputs, a boundary's chunks and an
encoder–decoder's encoder output (the activation store's arrays, storage/activations.py), and what a block reads
besides its boundary."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from featcal.adapters import BlockInput
from featcal.devices import to_device
from storage.behind import written_behind
from tasks.context import RunContext

# The array beside a task's model inputs that marks its foreign rows (calibration.shared_inputs), one int per stored
# row: 0 the task's own; j + 1 a row of example j of another task's draw (the example that task holds out in fold k
# when j mod N = N − 1 − k); −1 a pool row. Written only when there are foreign rows; not a model input.
FOREIGN_ROWS = "foreign_rows"


def stored_inputs(ctx: RunContext, task: str) -> Iterator[dict[str, torch.Tensor]]:
    """The task's stored model inputs, one batch at a time."""
    store = ctx.run.store
    root = store.location(ctx.run.inputs(task))
    streams = {n: store.iter_row_blocks(f"{root}/{n}", ctx.cfg.calibration.batch_size)
               for n in store.array_names(root) if n != FOREIGN_ROWS}
    while True:
        try:
            yield {n: next(s) for n, s in streams.items()}
        except StopIteration:
            return



def boundary_chunks(ctx: RunContext, task: str, layer: int,
                    sides: tuple[str, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """(mask [B,T], then one [B,T,H] chunk per side) for boundary `layer` of a task, chunk by chunk; the mask is
    the one of block `layer`'s stack (an encoder–decoder's decoder blocks have their own). At the head side (block
    L), only the tokens its statistics count (`Adapter.head_side_tokens`)."""
    bs, tokens = ctx.cfg.calibration.batch_size, tokens_of(ctx, task, layer)
    store = ctx.run.store
    masks = store.iter_row_blocks(mask_of(ctx, task, layer), bs)
    streams = [row_blocks(ctx, ctx.run.acts(task, layer, side), bs * tokens) for side in sides]
    kept = ctx.adapter.head_side_tokens() if layer == ctx.num_blocks else slice(None)
    for mask, *chunks in zip(masks, *streams, strict=True):
        # To a GPU through pinned memory, asynchronously: reading the next chunk overlaps this one's compute.
        moved = to_device({"mask": mask, **{side: c for side, c in zip(sides, chunks, strict=True)}}, ctx.device)
        mask = moved.pop("mask")
        yield mask[:, kept], *(c.to(ctx.dtype).reshape(mask.shape[0], tokens, -1)[:, kept] for c in moved.values())


def encoder_memory(ctx: RunContext, task: str, layer: int, side: str) -> Iterator[dict[str, torch.Tensor]]:
    """Chunk by chunk, what block `layer` reads besides its own boundary: one stream's encoder output and its mask
    for a decoder block (nothing for any other block)."""
    if not ctx.adapter.reads_encoder(layer):
        yield from itertools.repeat({})
        return
    bs, tokens, store = ctx.cfg.calibration.batch_size, tokens_of(ctx, task, 0), ctx.run.store
    masks = store.iter_row_blocks(mask_of(ctx, task, 0), bs)
    hidden = row_blocks(ctx, ctx.run.encoder_output(task, side), bs * tokens)
    for mask, h in zip(masks, hidden, strict=True):
        moved = to_device({"encoder_attention_mask": mask, "encoder_hidden_states": h}, ctx.device)
        moved["encoder_hidden_states"] = moved["encoder_hidden_states"].to(ctx.dtype).reshape(mask.shape[0], tokens, -1)
        yield moved


def block_input(ctx: RunContext, layer: int, mask: torch.Tensor, memory: dict[str, torch.Tensor],
                 weights_of: str) -> BlockInput:
    """Block `layer`'s extra inputs in the stream whose encoder output is `memory`, for a block of checkpoint
    `weights_of` (what a block takes from its stack's first block comes from the same checkpoint)."""
    return ctx.adapter.block_input({"attention_mask": mask, **memory}, layer, ctx.checkpoint(weights_of).get)



def stack_end(ctx: RunContext, layer: int, checkpoint: str) -> torch.nn.Module | None:
    """The module (of `checkpoint`) that turns block `layer`'s output into the encoder output later blocks read,
    when block `layer` ends the encoder of an encoder–decoder; None otherwise."""
    name = ctx.adapter.ends_stack(layer)
    return None if name is None else ctx.on_device(
        ctx.skeleton.materialize(name, ctx.checkpoint(checkpoint).with_prefix(f"{name}.")))


def write_next_boundary(ctx: RunContext, task: str, layer: int, side: str, rows: Iterator[torch.Tensor]) -> str:
    """What block `layer` hands on for one side, chunked and shaped like boundary `layer`: boundary `layer + 1`, or
    the encoder output when block `layer` ends the encoder (the decoder's first boundary comes from prepare).
    Returns its output name."""
    store = ctx.run.store
    rel = ctx.run.encoder_output(task, side) if ctx.adapter.ends_stack(layer) else ctx.run.acts(task, layer + 1, side)
    shape = store.open_array(store.location(ctx.run.acts(task, layer, side))).shape
    write_rows(ctx, rel, tuple(shape), ctx.cfg.calibration.batch_size * tokens_of(ctx, task, layer), rows)
    if ctx.resident is not None:  # boundary `layer` of this side has had its last reader: this stage
        ctx.resident.drop(ctx.run.acts(task, layer, side))
    return rel


def write_rows(ctx: RunContext, rel: str, shape: tuple[int, ...], chunk_rows: int,
               rows: Iterator[torch.Tensor]) -> None:
    """Row blocks into a new array of the store at output `rel`, in the run's storage dtype: written by a writer
    thread while this thread computes the next block; on the resident path, also kept in memory as stored."""
    store = ctx.run.store
    stored = torch.bfloat16 if ctx.dtype == torch.bfloat16 else torch.float32
    kept: list[torch.Tensor] = []

    def as_stored() -> Iterator[torch.Tensor]:
        for block in rows:
            # What the store holds and hands back: rounded to bf16 (as the store rounds) or float32, on the CPU;
            # rounded where it was computed, so a GPU copies half the bytes in bf16.
            block = block.detach().to(stored).to("cpu")
            if ctx.resident is not None:
                kept.append(block)
            yield block

    written_behind(lambda blocks: store.write_array(store.location(rel), shape, chunk_rows, ctx.storage_dtype,
                                                    blocks), as_stored())
    if ctx.resident is not None:
        ctx.resident.keep(rel, kept)


def row_blocks(ctx: RunContext, rel: str, rows: int) -> Iterator[torch.Tensor]:
    """Output `rel`'s row blocks of `rows` rows: from memory where the resident path kept it (its blocks are the
    ones it was written in, `rows` each), else from the store."""
    kept = ctx.resident.chunks(rel) if ctx.resident is not None else None
    if kept is not None:
        same = all(block.shape[0] == rows for block in kept[:-1]) and kept[-1].shape[0] <= rows
        return iter(kept if same else torch.cat(kept).split(rows))
    store = ctx.run.store
    return store.iter_row_blocks(store.location(rel), rows)


def tokens_of(ctx: RunContext, task: str, layer: int = 0) -> int:
    return ctx.run.store.open_array(mask_of(ctx, task, layer)).shape[1]


def foreign_rows(ctx: RunContext, task: str) -> torch.Tensor | None:
    """Per stored row of the task, its FOREIGN_ROWS mark (calibration.shared_inputs); None when all are its own."""
    location = ctx.run.store.location(f"{ctx.run.inputs(task)}/{FOREIGN_ROWS}")
    if not ctx.run.store.exists(location):
        return None
    return torch.as_tensor(np.asarray(ctx.run.store.open_array(location)[:])).long()


def mask_of(ctx: RunContext, task: str, layer: int = 0) -> str:
    return ctx.run.store.location(f"{ctx.run.inputs(task)}/{ctx.adapter.mask_name(layer)}")

