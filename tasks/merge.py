"""Stage `merge`: stream the experts into one merged checkpoint, or, with `merge.method: given`, copy a merge made
elsewhere (its body; preflight checked its names and shapes); heads stay per task under heads/ (the expert's own, or,
with `zero_shot`, one made from a CLIPModel's text tower: featcal/zeroshot.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from featcal.hub import local_dir
from featcal.merging import chunk_rows, drop_masks, merged_rows, merged_tensor, method_class, whole_tensor_rows
from featcal.zeroshot import zero_shot_heads
from storage.checkpoint import CanonicalCheckpoint, CheckpointError, finite, write_checkpoint
from storage.lora import LoraCheckpoint
from tasks.context import RunContext

MERGED = "merged"


def head_file(task: str) -> str:
    return f"heads/{task}.safetensors"


def run(ctx: RunContext) -> tuple[list[str], dict[str, Any]]:
    cfg = ctx.cfg
    base = ctx.canonical("base")
    experts = {f"experts.{t}": ctx.checkpoint(t) for t in ctx.tasks}

    def read(owner: str, ckpt: CanonicalCheckpoint | LoraCheckpoint, name: str,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        return finite(ckpt.get(name, rows), name, owner, ckpt.directory)

    given = None
    if cfg.merge.method == "given":
        if cfg.merge.path is None:  # the config refuses this before any stage
            raise ValueError("merge.path: required with merge.method given")
        path = local_dir(cfg.merge.path)  # a hub id: its snapshot, fetched by preflight
        if Path(path).resolve() == Path(ctx.run / MERGED).resolve():
            raise CheckpointError(f"merge.path: {cfg.merge.path} is this run's own merged/, which the merge writes; "
                                  "give a copy, or another run's merged/")
        given = CanonicalCheckpoint(path, ctx.adapter)

    def merged(name: str) -> torch.Tensor:
        shape, dtype = base.shape(name), base.dtype(name)
        if given is not None:  # in the base's dtype, as every merge here writes it
            return read("merge.path", given, name).to(dtype)
        masks = drop_masks(cfg.merge, ctx.tasks, name, shape) if method_class(cfg.merge).draws_masks else None
        rows = chunk_rows(shape, cfg.merge) if dtype.is_floating_point else None
        if rows is None:
            kept = None if masks is None else (lambda t: masks(t, 0, whole_tensor_rows(shape)))
            return merged_tensor(read("base", base, name), lambda: (read(o, e, name) for o, e in experts.items()),
                                 cfg.merge, kept)
        # A large tensor (an LLM's embedding) a block of rows at a time: the same values, without float64 copies of
        # the whole tensor per pass (featcal/merging.py).
        return merged_rows(shape, dtype, lambda a, b: read("base", base, name, (a, b)),
                           lambda a, b: (read(o, e, name, (a, b)) for o, e in experts.items()), cfg.merge, rows, masks)

    def tensors() -> Iterator[torch.Tensor]:
        for name in base.names():
            yield read("base", base, name) if ctx.adapter.is_head(name) else merged(name)

    heads = {
        head_file(task): {n: read(owner, e, n) for n in e.names() if ctx.adapter.is_head(n)}
        for task, (owner, e) in zip(ctx.tasks, experts.items())
    }
    metadata: dict[str, dict[str, str]] = {}
    if cfg.zero_shot is not None:  # head-less experts: each task's head comes from the CLIPModel's text tower
        for task, (head, meta) in zero_shot_heads(cfg).items():
            heads[head_file(task)], metadata[head_file(task)] = head, meta
    write_checkpoint(ctx.run / MERGED, [base.spec(n) for n in base.names()], tensors(), side_files_from=base.directory,
                     extra_files=heads, extra_metadata=metadata)
    return [MERGED], {"method": cfg.merge.method, "tensors": len(base.names())}
