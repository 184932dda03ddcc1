"""Where the bf16 Gram stage's time goes, and the Gram products' rate on the bf16 units against the machine's
bf16 matmul rate, measured in one invocation on a finished bf16 run's own activations.

    featcal run CONFIG --run-dir RUN --no-prefect --set runtime.keep_activations=true --set runtime.threads=1
    python -m benchmarks.gram_profile RUN --layer 5 --task task0 --out benchmarks/results/gram_profile_vitb32_bf16.md

All times are CPU seconds of this one-thread process (`time.process_time`, best of 5), so other work sharing the
machine inflates them less than wall time. Parts, per task and block on the ViT-B/32 shape (hidden 768, MLP 3072):
- Zarr read and decode of the block's merged and expert input rows (bf16 words);
- the statistics of each module input as `featcal.statistics` keeps them (q/k/v share one input; out_proj and fc1
  keep C_ss and C_se; fc2 keeps C_ss, P_e and P_s), split into bf16 → fp32 conversion, products, and the float64
  accumulation of the chunk's sums, on the fp32 path (rows upcast, as before) and on the bf16 units;
- the whole Gram stage (`tasks.gram.gram`) with the bf16 units off and on.
The 768-wide inputs are the run's own rows; the 3072-wide ones and fc2's output are seeded random bf16 rows of the
same count (the run does not keep module inputs inside a block)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `featcal run` sets it, before torch loads

import torch

from benchmarks.common import cpu_line, matmul_rate
from featcal_kernels import bf16 as bf16_module
from featcal_kernels.bf16 import bf16_target_product
from featcal_kernels.gram import bf16_dual_gram, dual_gram
from flows.pipeline import machine
from tasks.context import context
from tasks.gram import gram

ALPHA = 0.25  # featcal.alpha's default: the products' cost does not depend on it


def cpu_seconds(fn: Callable[[], object], before: Callable[[], None] = lambda: None, repeats: int = 5) -> float:
    """Best of `repeats` CPU seconds of fn, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        before()
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def fp32_products(xs32: torch.Tensor, xe32: torch.Tensor | None, w: torch.Tensor, w_t: torch.Tensor | None,
                  y32: torch.Tensor | None) -> None:
    """The fp32 path's products of one module input, on rows already upcast."""
    dual_gram(xs32, xe32, w)
    if w_t is not None and y32 is not None:  # P_t as featcal.statistics.LinearStats.add_target_product takes it
        target = (xs32 @ w_t.float().T).mul_(1.0 - ALPHA).add_(y32, alpha=ALPHA)
        (xs32 * w[:, None]).T @ target


def bf16_path(xs: torch.Tensor, xe: torch.Tensor | None, w: torch.Tensor, w_t: torch.Tensor | None,
              y: torch.Tensor | None) -> None:
    bf16_dual_gram(xs, xe, w)
    if w_t is not None and y is not None:
        bf16_target_product(xs, w, w_t, y, None, ALPHA)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path, help="a finished bf16 run kept with runtime.keep_activations: true")
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--task", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = context(args.run_dir)
    task = args.task or ctx.tasks[0]
    store = ctx.run.store
    sides = {side: store.location(ctx.run.acts(task, args.layer, side)) for side in ("merged", "expert")}
    if store.array_dtype(sides["merged"]) != torch.bfloat16:
        raise SystemExit(f"{args.run_dir}: block {args.layer} activations of {task} are not bf16; profile a bf16 run")

    def read_rows() -> dict[str, torch.Tensor]:
        return {side: torch.cat(list(store.iter_row_blocks(loc, 1 << 20))) for side, loc in sides.items()}

    read_s = cpu_seconds(read_rows)
    rows = read_rows()
    xs, xe = (rows[s].reshape(-1, rows[s].shape[-1]) for s in ("merged", "expert"))
    n, hidden = xs.shape
    g = torch.Generator().manual_seed(0)
    wide_s, wide_e = (torch.randn(n, 4 * hidden, generator=g).bfloat16() for _ in range(2))
    w_fc2 = (0.02 * torch.randn(hidden, 4 * hidden, generator=g)).bfloat16()
    y_fc2 = torch.randn(n, hidden, generator=g).bfloat16()
    w = torch.ones(n)
    # (name, xs, xe or None, W_t and expert output for product form), as featcal.statistics keeps a ViT block.
    inputs = [("q+k+v", xs, xe, None, None), ("out_proj", xs, xe, None, None), ("fc1", xs, xe, None, None),
              ("fc2", wide_s, None, w_fc2, y_fc2)]
    flops = sum(n * x.shape[1] * (x.shape[1] + 1) + (2 * n * x.shape[1] ** 2 if e is not None else 0)
                + (6 * n * wt.shape[0] * wt.shape[1] if wt is not None else 0) for _, x, e, wt, _ in inputs)

    def convert() -> list[tuple]:
        return [(x.float(), None if e is None else e.float(), None if y is None else y.float())
                for _, x, e, _, y in inputs]

    convert_s = cpu_seconds(convert)
    upcast = convert()
    def fp32_all() -> None:
        for (x32, e32, y32), (_, _, _, wt, _) in zip(upcast, inputs, strict=True):
            fp32_products(x32, e32, w, wt, y32)

    def bf16_all() -> None:
        for _, x, e, wt, y in inputs:
            bf16_path(x, e, w, wt, y)

    fp32_s = cpu_seconds(fp32_all)
    bf16_s = cpu_seconds(bf16_all)
    sums = [dual_gram(x32, e32, w) for x32, e32, _ in upcast]
    f64 = [(torch.zeros(s.c_ss.shape, dtype=torch.float64), torch.zeros(s.c_se.shape, dtype=torch.float64))
           for s in sums]

    def accumulate() -> None:
        for (ss, se), s in zip(f64, sums, strict=True):
            ss += s.c_ss
            se += s.c_se

    accumulate_s = cpu_seconds(accumulate)

    def fresh_gram() -> None:
        (ctx.run / ctx.run.stats(task, args.layer)).unlink(missing_ok=True)
        shutil.rmtree(ctx.run / ctx.run.acts(task, args.layer + 1, "expert"), ignore_errors=True)

    native = bf16_module.cpu_has_native_bf16
    stage = {}
    for label, units in (("fp32 products (bf16 units off)", lambda: False), ("bf16 units", native)):
        bf16_module.cpu_has_native_bf16 = units
        stage[label] = cpu_seconds(lambda: gram(ctx, task, args.layer), fresh_gram)
    bf16_module.cpu_has_native_bf16 = native
    rate = {p: matmul_rate(1, dt, "cpu", time.process_time) for p, dt in (("fp32", torch.float32),
                                                                           ("bf16", torch.bfloat16))}
    gf = flops / 1e9
    off, on = stage["fp32 products (bf16 units off)"], stage["bf16 units"]
    lines = [
        f"# The bf16 Gram stage, part by part — {args.run_dir.name}, block {args.layer}, {task}", "",
        f"Machine: {machine()}. CPU: {cpu_line()} (native bf16 here: {native()}). Date: "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}. One thread; CPU seconds, best of 5. Command: "
        f"`python -m benchmarks.gram_profile {' '.join(sys.argv[1:])}`", "",
        f"Rows: {n} ({hidden} wide; fc2's input {4 * hidden}). Gram FLOPs of one task and block, as the records "
        f"count them: {gf:.2f} GFLOP. Matmul rate measured in this invocation (`pipeline_cost.matmul_rate`, a "
        f"Gram-shaped 800-row product, by CPU time): fp32 {rate['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {rate['bf16'] / 1e9:.0f} GFLOP/s.",
        "",
        "| part | CPU s | note |", "|---|---:|---|",
        f"| Zarr read + decode (merged and expert rows) | {read_s:.3f} | |",
        f"| bf16 → fp32 conversion (fp32 path only) | {convert_s:.3f} | |",
        f"| products, fp32 path | {fp32_s:.3f} | {gf / fp32_s:.0f} GFLOP/s = {gf / fp32_s / (rate['fp32'] / 1e9):.0%} "
        f"of the fp32 rate |",
        f"| products, bf16 units | {bf16_s:.3f} | {gf / bf16_s:.0f} GFLOP/s = {gf / bf16_s / (rate['bf16'] / 1e9):.0%} "
        f"of the bf16 rate (two bf16 products each) |",
        f"| float64 accumulation of the chunk sums | {accumulate_s:.3f} | |",
        "", "| whole Gram stage (`tasks.gram.gram`) | CPU s |", "|---|---:|",
        *(f"| {label} | {s:.3f} |" for label, s in stage.items()),
        "",
        f"Products + conversion: fp32 path {fp32_s + convert_s:.3f} s, bf16 units {bf16_s:.3f} s "
        f"({(fp32_s + convert_s) / bf16_s:.2f}×). Whole stage: "
        f"{stage['fp32 products (bf16 units off)'] / stage['bf16 units']:.2f}×. Shares of the stage with the fp32 "
        f"path: read + decode {read_s / off:.0%}, conversion {convert_s / off:.0%}, products {fp32_s / off:.0%}, "
        f"float64 accumulation {accumulate_s / off:.0%}, the rest (block forwards, statistics file, bookkeeping) "
        f"{1 - (read_s + convert_s + fp32_s + accumulate_s) / off:.0%}; with the bf16 units: read + decode "
        f"{read_s / on:.0%}, products {bf16_s / on:.0%}, float64 accumulation {accumulate_s / on:.0%}, the rest "
        f"{1 - (read_s + bf16_s + accumulate_s) / on:.0%}. Two bf16 products stand for each useful one, so the "
        f"bf16 path's ceiling is half the bf16 rate.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
