"""The propagate stage: the calibrated block on one task's merged-side boundary gives the next one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load_file

from tasks.boundary import block_input, boundary_chunks, encoder_memory, stack_end, write_next_boundary
from tasks.context import RunContext
from tasks.merge import MERGED


def calibrated_tensors(ctx: RunContext, layer: int) -> dict[str, torch.Tensor]:
    """Block `layer`'s calibrated parameters (names relative to the block): the merged block with every solve
    group's file laid over it."""
    tensors = ctx.checkpoint(MERGED).with_prefix(ctx.adapter.block_prefix(layer))
    groups = ctx.solve_group_count(layer)
    for group in range(groups):
        tensors.update(load_file(ctx.run / ctx.run.block(layer, group, groups)))
    return tensors


def calibrated_block(ctx: RunContext, layer: int) -> torch.nn.Module:
    """Block `layer` calibrated; on the resident path built once per layer (for as long as its solved files are the
    same ones: a solve run again writes others)."""
    def build() -> torch.nn.Module:
        path = ctx.adapter.block_prefix(layer).rstrip(".")
        return ctx.on_device(ctx.skeleton.materialize(path, calibrated_tensors(ctx, layer)))

    if ctx.resident is None:
        return build()
    groups = ctx.solve_group_count(layer)
    files = [ctx.run / ctx.run.block(layer, g, groups) for g in range(groups)]
    return ctx.resident.block(("calibrated", layer, *((f.stat().st_mtime_ns, f.stat().st_size) for f in files)), build)


def propagate(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    block = calibrated_block(ctx, layer)
    finish = stack_end(ctx, layer, MERGED)  # the encoder's final norm is merged, never calibrated

    def outputs() -> Iterator[torch.Tensor]:
        chunks = boundary_chunks(ctx, task, layer, ("merged",))
        for (mask, s), memory in zip(chunks, encoder_memory(ctx, task, layer, "merged")):
            with torch.inference_mode():
                # The relative position bias table is not calibrated: the merged checkpoint's is the calibrated one.
                out = ctx.adapter.run_block(block, s, block_input(ctx, layer, mask, memory, MERGED))
                if finish is not None:
                    out = finish(out)
            yield out.reshape(-1, out.shape[-1])

    return [write_next_boundary(ctx, task, layer, "merged", outputs())], {}
