"""Stage `merge`: stream the experts into one merged checkpoint; heads stay per task under heads/ (the expert's own,
or, with `zero_shot`, one made from a CLIPModel's text tower: featcal/zeroshot.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from featcal.merging import merged_tensor
from featcal.zeroshot import zero_shot_heads
from storage.checkpoint import CanonicalCheckpoint, finite, write_checkpoint
from tasks.context import RunContext

MERGED = "merged"


def head_file(task: str) -> str:
    return f"heads/{task}.safetensors"


def run(ctx: RunContext) -> tuple[list[str], dict[str, Any]]:
    base = ctx.checkpoint("base")
    experts = {f"experts.{t}": ctx.checkpoint(t) for t in ctx.tasks}

    def read(owner: str, ckpt: CanonicalCheckpoint, name: str) -> torch.Tensor:
        return finite(ckpt.get(name), name, owner, ckpt.directory)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in base.names():
            if ctx.adapter.is_head(name):
                yield base.file_name(name), read("base", base, name)
                continue
            yield base.file_name(name), merged_tensor(
                read("base", base, name), lambda: (read(o, e, name) for o, e in experts.items()), ctx.cfg.merge)

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
