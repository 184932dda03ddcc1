"""Stage `assemble`: the merged checkpoint with every block (and the head side, when calibrated) replaced by its
calibrated weights; with featcal.head_refit, each task's head then refitted to the calibrated features
(tasks/head_refit.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load_file

from storage.checkpoint import read_metadata, write_checkpoint
from tasks.context import RunContext
from tasks.head_refit import refits_heads, write_refitted_heads
from tasks.merge import MERGED, head_file
from tasks.propagate import calibrated_tensors

CALIBRATED = "calibrated"


def run(ctx: RunContext) -> tuple[list[str], dict[str, Any]]:
    merged = ctx.canonical(MERGED)
    prefixes = [ctx.adapter.block_prefix(layer) for layer in range(ctx.calibrated_blocks)]  # and the head side

    def tensors() -> Iterator[torch.Tensor]:
        layer_loaded, block = -1, {}
        for name in merged.names():
            layer = next((i for i, p in enumerate(prefixes) if name.startswith(p)), None)
            if layer is None:
                yield merged.get(name)
                continue
            if layer != layer_loaded:  # one calibrated block in memory at a time
                block, layer_loaded = calibrated_tensors(ctx, layer), layer
            yield block[name[len(prefixes[layer]):]]

    paths = {head_file(t): ctx.run / MERGED / head_file(t) for t in ctx.tasks}
    write_checkpoint(ctx.run / CALIBRATED, [merged.spec(n) for n in merged.names()], tensors(),
                     side_files_from=merged.directory,
                     extra_files={rel: load_file(path) for rel, path in paths.items()},
                     extra_metadata={rel: read_metadata(path) for rel, path in paths.items()})
    info: dict[str, Any] = {"blocks": ctx.num_blocks}
    if refits_heads(ctx):  # the calibrated body is written: each task's head is refitted to its features
        info.update(write_refitted_heads(ctx))
    return [CALIBRATED], info
