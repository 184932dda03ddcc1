"""The Gram stage: one task's statistics of block `layer`'s module inputs, and the expert side's next boundary."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from featcal.adapters import BlockInput
from featcal.calibration_methods import StatisticsPlan, calibration_method
from featcal.modeling import calibrated_modules
from featcal.statistics import (
    FOREIGN,
    Stats,
    accumulate,
    captured_inputs,
    example_rows,
    flatten_stats,
    held_prefix,
    input_owners,
    new_stats,
    stats_flops,
    stats_layout,
)
from storage.atomic import atomic_path
from storage.checkpoint import save_tensors
from tasks.boundary import (
    block_input,
    boundary_chunks,
    encoder_memory,
    foreign_rows,
    mask_of,
    stack_end,
    write_next_boundary,
)
from tasks.context import RunContext
from tasks.merge import MERGED


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


# The statistics file's metadata key for the α its product-form sums P_t were taken with (the solve checks it).
STATS_ALPHA = "featcal.alpha"


def _sq_norms(diff: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    m = mask.float()[..., None]
    return float(((diff.float() * m) ** 2).sum()), float(((ref.float() * m) ** 2).sum())


@dataclass
class GramBlocks:
    """Block `layer` as one task's Gram stage runs it. Which block runs on which stream is the run's calibration
    method's `StatisticsPlan` (featcal/calibration_methods.py): x_s from its fit block on its fit stream, x_e from
    the expert block on E_t when the plan keeps the expert side (else x_s fills both slots)."""

    plan: StatisticsPlan
    expert: torch.nn.Module
    expert_modules: dict[str, torch.nn.Module]
    merged: torch.nn.Module | None  # runs only when the plan reads its inputs; its output error is then measured
    fit: torch.nn.Module
    fit_checkpoint: str
    stats_modules: dict[str, torch.nn.Module]
    finish: torch.nn.Module | None  # the expert's stack end, when block `layer` ends the encoder
    head_side: bool  # featcal.calibrate_head_side's block L

    @classmethod
    def load(cls, ctx: RunContext, task: str, layer: int) -> GramBlocks:
        plan = calibration_method(ctx.cfg.featcal, foreign_weights=ctx.cfg.calibration.shared_inputs.weights).statistics
        expert = ctx.on_device(ctx.skeleton.block(layer, ctx.checkpoint(task)))
        merged = merged_block(ctx, layer) if plan.fit_block == "merged" else None
        fit, fit_checkpoint = (merged, MERGED) if merged is not None else (expert, task)
        return cls(plan, expert, calibrated_modules(expert), merged, fit, fit_checkpoint,
                   calibrated_modules(merged if merged is not None else expert), stack_end(ctx, layer, task),
                   layer == ctx.num_blocks)

    def run(self, ctx: RunContext, block: torch.nn.Module, modules: dict[str, torch.nn.Module], hidden: torch.Tensor,
            extra: BlockInput, outputs: dict[str, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`block`'s output on `hidden`, and the inputs (and into `outputs`, the outputs) of its `modules`."""
        sink: dict[str, torch.Tensor] = {}
        with captured_inputs(modules, sink, outputs):
            if self.head_side:
                return ctx.adapter.run_head_side(block, hidden), sink
            return ctx.adapter.run_block(block, hidden, extra), sink


class GramSums:
    """What one task's Gram stage of block `layer` accumulates: its statistics (laid out at the first chunk, whose
    module inputs show which modules read the same input), the held-out folds' own, and the drifts it reports."""

    def __init__(self, ctx: RunContext, task: str, layer: int, blocks: GramBlocks):
        self.ctx, self.task, self.layer, self.blocks = ctx, task, layer, blocks
        self.examples = ctx.run.store.open_array(mask_of(ctx, task, layer)).shape[0]
        self.stats: Stats = {}
        self.laid_out = False
        self.owners: dict[str, str] = {}
        self.folds: list[Stats] = []
        self.foreign_rows = foreign_rows(ctx, task)  # marks (boundary.FOREIGN_ROWS); None: every row is own
        self.foreign: Stats = {}  # the foreign rows' sums (calibration.shared_inputs), apart from the own rows'
        self.foreign_folds: list[Stats] = []  # those of other tasks' examples that their task holds out, by fold
        self.drift = {"in_diff": 0.0, "in_ref": 0.0, "out_diff": 0.0, "out_ref": 0.0}

    def marks_of(self, seen: int, chunk_examples: int, device: torch.device) -> torch.Tensor | None:
        """The FOREIGN_ROWS marks of the chunk's stored rows after `seen`; None when none is foreign."""
        if self.foreign_rows is None:
            return None
        marks = self.foreign_rows[seen:seen + chunk_examples]
        return marks.to(device) if bool(marks.any()) else None

    def add_drift(self, kind: str, diff: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                  marks: torch.Tensor | None = None) -> None:
        """The drifts are measured on the task's own rows."""
        d, r = _sq_norms(diff, ref, mask if marks is None else mask * (marks == 0)[:, None])
        self.drift[f"{kind}_diff"] += d
        self.drift[f"{kind}_ref"] += r

    def add(self, weights: dict[str, torch.Tensor], sink_s: dict[str, torch.Tensor], sink_e: dict[str, torch.Tensor],
            outs_e: dict[str, torch.Tensor] | None, chunk_examples: int, marks: torch.Tensor | None = None) -> None:
        """The chunk's sums: its own rows' into the statistics, its foreign rows' (`marks`: FOREIGN_ROWS, or None:
        none is foreign) into the foreign rows' own sums."""
        ctx, plan, modules = self.ctx, self.blocks.plan, self.blocks.stats_modules
        if not self.laid_out:
            self.laid_out = True
            # Foreign rows keep sums, never rows: the solve mixes own and foreign moments per w
            rows_of_tasks = (len(ctx.tasks) if plan.keeps_rows(ctx.cfg.runtime.row_statistics)
                             and self.foreign_rows is None else 0)
            forms, self.owners = stats_layout(modules, weights, (sink_s, sink_e), self.examples, chunk_examples,
                                              keeps_expert=plan.expert_side, rows_of_tasks=rows_of_tasks)
            alpha = ctx.cfg.featcal.alpha
            self.stats = new_stats(modules, forms, self.owners, ctx.device, alpha)
            self.folds = ([new_stats(modules, forms, self.owners, ctx.device, alpha)
                           for _ in range(plan.held_out_folds)] if plan.held_out_every else [])
            if self.foreign_rows is not None:
                self.foreign = new_stats(modules, forms, self.owners, ctx.device, alpha)
                self.foreign_folds = [new_stats(modules, forms, self.owners, ctx.device, alpha) for _ in self.folds]
        elif input_owners(list(self.owners), weights, sink_s, sink_e) != self.owners:
            raise RuntimeError(f"block {self.layer}, task {self.task}: modules that shared one input in the first "
                               "chunk do not in a later one")
        if marks is None:
            accumulate(self.stats, modules, sink_s, sink_e, weights, outs_e, self.blocks.expert_modules)
            return
        self._add_rows(self.stats, marks == 0, weights, sink_s, sink_e, outs_e)
        self._add_rows(self.foreign, marks != 0, weights, sink_s, sink_e, outs_e)

    def _add_rows(self, into: Stats, chosen: torch.Tensor, weights: dict[str, torch.Tensor],
                  sink_s: dict[str, torch.Tensor], sink_x: dict[str, torch.Tensor],
                  outs_e: dict[str, torch.Tensor] | None) -> None:
        """The `chosen` examples' rows (a bool per example of the chunk) into the sums `into`."""
        if bool(chosen.any()):
            w, xs, xx, out = example_rows(weights, chosen, sink_s, sink_x, outs_e if outs_e is not None else {})
            accumulate(into, self.blocks.stats_modules, xs, xx, w, out if outs_e is not None else None,
                       self.blocks.expert_modules)

    def add_held_out(self, weights: dict[str, torch.Tensor], sink_s: dict[str, torch.Tensor],
                     sink_x: dict[str, torch.Tensor], outs_e: dict[str, torch.Tensor] | None, seen: int,
                     chunk_examples: int, device: torch.device, marks: torch.Tensor | None = None) -> None:
        """Rows held out to choose hyperparameters get sums of their own, fold by fold (fold k: the examples i with
        i mod N = N − 1 − k); an example's views are held out with it. Only own rows are held out; a foreign row of
        another task's example j (`marks`, FOREIGN_ROWS) is summed apart in fold k when that task holds j out there
        (j mod N = N − 1 − k), so that fold's fit leaves it out of every task's term; pool rows are always fitted."""
        every = self.blocks.plan.held_out_every
        if not every:
            return
        example = torch.arange(seen, seen + chunk_examples, device=device) // (1 + self.ctx.cfg.calibration.views.count)
        for fold, held in enumerate(self.folds):
            chosen = (example % every) == every - 1 - fold
            if marks is None:
                self._add_rows(held, chosen, weights, sink_s, sink_x, outs_e)
                continue
            self._add_rows(held, chosen & (marks == 0), weights, sink_s, sink_x, outs_e)
            held_there = (marks > 0) & ((marks - 1) % every == every - 1 - fold)
            self._add_rows(self.foreign_folds[fold], held_there, weights, sink_s, sink_x, outs_e)

    def save(self) -> str:
        """The statistics file (written over an earlier block's released one, in place); its output name."""
        ctx = self.ctx
        rel = ctx.run.stats(self.task, self.layer)
        held = {k: v for fold, sums in enumerate(self.folds) for k, v in flatten_stats(sums, held_prefix(fold)).items()}
        foreign = flatten_stats(self.foreign, FOREIGN) if self.foreign else {}
        for fold, sums in enumerate(self.foreign_folds):
            foreign.update(flatten_stats(sums, FOREIGN + held_prefix(fold)))
        with atomic_path(ctx.run / rel) as tmp:
            ctx.run.claim_spare(tmp)
            save_tensors({**flatten_stats(self.stats), **held, **foreign}, tmp,
                         {STATS_ALPHA: repr(ctx.cfg.featcal.alpha)})
        return rel

    def info(self) -> dict[str, Any]:
        drift, stats = self.drift, self.stats
        info = {"drift_in": (drift["in_diff"] / max(drift["in_ref"], 1e-30)) ** 0.5,
                "gram_flops": stats_flops(stats) + sum(stats_flops(held) for held in (*self.folds, self.foreign,
                                                                                       *self.foreign_folds)),
                "product_form": sorted(m for m, s in stats.items() if getattr(s, "form", None) == "product"),
                "row_form": sorted(m for m, s in stats.items() if getattr(s, "form", None) == "rows")}
        if self.blocks.merged is not None:  # the uncalibrated merged block ran: its output's distance from the expert's
            info["drift_out_uncalibrated"] = (drift["out_diff"] / max(drift["out_ref"], 1e-30)) ** 0.5
        return info


def merged_block(ctx: RunContext, layer: int) -> torch.nn.Module:
    """Block `layer` of the merged checkpoint; on the resident path built once per layer and thread (a Gram stage
    hooks its modules, so two stages running at once must not share one)."""
    def build() -> torch.nn.Module:
        return ctx.on_device(ctx.skeleton.block(layer, ctx.checkpoint(MERGED)))

    if ctx.resident is None:
        return build()
    return ctx.resident.block(("merged", layer, threading.get_ident()), build)


def expert_outputs(ctx: RunContext, task: str, layer: int, blocks: GramBlocks, sums: GramSums,
                   ) -> Iterator[torch.Tensor]:
    """Block `layer`'s chunks of one task, each added to `sums`; yields E_t(layer+1), the expert block on E_t."""
    plan, stats_modules = blocks.plan, blocks.stats_modules
    emphasis = emphasis_for(ctx, layer, list(stats_modules), plan.pooled_token_weight)
    memories = zip(encoder_memory(ctx, task, layer, "merged"), encoder_memory(ctx, task, layer, "expert"))
    seen = 0  # examples before the current chunk
    for (mask, s, e), (memory_s, memory_e) in zip(boundary_chunks(ctx, task, layer, ("merged", "expert")), memories):
        extra_e = block_input(ctx, layer, mask, memory_e, task)
        marks = sums.marks_of(seen, mask.shape[0], mask.device)
        outs_e: dict[str, torch.Tensor] | None = {} if plan.expert_side else None
        with torch.inference_mode():
            out_e, sink_e = blocks.run(ctx, blocks.expert, blocks.expert_modules, e, extra_e, outs_e)
            weights = token_weights(mask, list(stats_modules), emphasis, ctx.adapter.pooled_index())
            if memory_s:  # cross-attention keys/values: one row per encoder token
                weights.update(dict.fromkeys([m for m in ctx.adapter.memory_modules if m in stats_modules],
                                             memory_s["encoder_attention_mask"].reshape(-1).float()))
            if plan.fit_stream == "expert":  # the expert block on E_t: the run above
                sink_s = sink_e
            else:
                extra_s = block_input(ctx, layer, mask, memory_s, blocks.fit_checkpoint)
                out_s, sink_s = blocks.run(ctx, blocks.fit, stats_modules, s, extra_s)
                if blocks.merged is not None:
                    sums.add_drift("out", out_s - out_e, out_e, mask, marks)
            sink_x = sink_e if plan.expert_side else sink_s  # one side only: it fills both of the statistics' slots
            sums.add(weights, sink_s, sink_x, outs_e, mask.shape[0], marks)
            sums.add_held_out(weights, sink_s, sink_x, outs_e, seen, mask.shape[0], mask.device, marks)
            if blocks.finish is not None:
                out_e = blocks.finish(out_e)
        sums.add_drift("in", s - e, e, mask, marks)
        seen += mask.shape[0]
        yield out_e.reshape(-1, out_e.shape[-1])


def gram(ctx: RunContext, task: str, layer: int) -> tuple[list[str], dict[str, Any]]:
    """Statistics of block `layer`'s module inputs for one task, and E_t(layer+1) (expert block on E_t); the last
    calibrated block hands nothing on."""
    blocks = GramBlocks.load(ctx, task, layer)
    sums = GramSums(ctx, task, layer, blocks)
    rows = expert_outputs(ctx, task, layer, blocks, sums)
    outputs = []
    if layer == ctx.calibrated_blocks - 1:
        for _ in rows:
            pass
    else:
        outputs.append(write_next_boundary(ctx, task, layer, "expert", rows))
    outputs.append(sums.save())
    return outputs, sums.info()
