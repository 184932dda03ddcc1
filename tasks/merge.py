"""Stage `merge`: stream the experts into one merged checkpoint; heads stay per task under heads/ (the expert's own,
or, with `zero_shot`, one made from a CLIPModel's text tower: featcal/zeroshot.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from featcal.merging import chunk_rows, merged_rows, merged_tensor
from featcal.zeroshot import zero_shot_heads
from storage.checkpoint import CanonicalCheckpoint, finite, write_checkpoint
from tasks.context import RunContext

MERGED = "merged"


def head_file(task: str) -> str:
    return f"heads/{task}.safetensors"


def run(ctx: RunContext) -> tuple[list[str], dict[str, Any]]:
    base = ctx.checkpoint("base")
    experts = {f"experts.{t}": ctx.checkpoint(t) for t in ctx.tasks}

    def read(owner: str, ckpt: CanonicalCheckpoint, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return finite(ckpt.get(name, rows), name, owner, ckpt.directory)

    def merged(name: str) -> torch.Tensor:
        shape, dtype = base.shape(name), base.dtype(name)
        rows = chunk_rows(shape, ctx.cfg.merge) if dtype.is_floating_point else None
        if rows is None:
            return merged_tensor(read("base", base, name), lambda: (read(o, e, name) for o, e in experts.items()),
                                 ctx.cfg.merge)
        # A large tensor (an LLM's embedding) a block of rows at a time: the same values, without float64 copies of
        # the whole tensor per pass (featcal/merging.py).
        return merged_rows(shape, dtype, lambda a, b: read("base", base, name, (a, b)),
                           lambda a, b: (read(o, e, name, (a, b)) for o, e in experts.items()), ctx.cfg.merge, rows)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in base.names():
            if ctx.adapter.is_head(name):
                yield base.file_name(name), read("base", base, name)
                continue
            yield base.file_name(name), merged(name)

    heads = {
        head_file(task): {n: read(owner, e, n) for n in e.names() if ctx.adapter.is_head(n)}
        for task, (owner, e) in zip(ctx.tasks, experts.items())
    }
    metadata: dict[str, dict[str, str]] = {}
    if ctx.cfg.zero_shot is not None:  # head-less experts: each task's head comes from the CLIPModel's text tower
        for task, (head, meta) in zero_shot_heads(ctx.cfg).items():
            heads[head_file(task)], metadata[head_file(task)] = head, meta
    write_checkpoint(ctx.run / MERGED, tensors(), side_files_from=base.directory, extra_files=heads,
                     extra_metadata=metadata)
    return [MERGED], {"method": ctx.cfg.merge.method, "tensors": len(base.names())}
