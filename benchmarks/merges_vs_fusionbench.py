"""TSV-M, Iso-C, Iso-CTS and WUDI against FusionBench's own functions, on small random task vectors.

FusionBench is not a dependency: install it (and the modules its package imports) into a throwaway directory and
name it with --fusion-bench, e.g.

    pip install --no-deps --target /tmp/fb fusion-bench hydra-core omegaconf antlr4-python3-runtime==4.9.3 \\
        lightning lightning-utilities torchmetrics bidict matplotlib h5py tensorboard
    python -m benchmarks.merges_vs_fusionbench --fusion-bench /tmp/fb --out benchmarks/results/merges_vs_fusionbench.md

Their functions take the task vectors of every tensor and return the merged task vector before the scaling factor:
`compute_and_sum_svd_mem_reduction` (TSV-M), `iso_c`, `iso_cts` and `wudi_merging`. Ours are run through
`featcal.merging.merged_tensor` with θ0 = 0 (so θ_t is τ_t exactly) and α = 1; both get the same float64 task
vectors (FusionBench computes in the tensors' dtype), and a float32 copy shows what FusionBench's usual precision
changes. WUDI's learning rate is fixed at 1e-5 in FusionBench; both take 300 steps. The timing rows time our WUDI
and FusionBench's per Adam step on MiniLM-sized matrices (8 tasks), on this machine's CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, command_line, commit_of, cpu_line
from featcal.config import MergeConfig
from featcal.merging import merged_tensor
from featcal.subspace_merges import wudi_loss

SHAPES = [(48, 32), (32, 48), (40, 40), (32,)]
TASKS = (3, 4, 8)
WUDI_STEPS = 300


def task_vectors(shape: tuple[int, ...], tasks: int, seed: int) -> list[torch.Tensor]:
    """Low-rank-plus-noise task vectors, as fine-tuning updates tend to be: rank 4 at scale 1e-2, noise at 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(tasks):
        if len(shape) == 2:
            low = torch.randn(shape[0], 4, generator=gen, dtype=torch.float64) @ torch.randn(
                4, shape[1], generator=gen, dtype=torch.float64)
            out.append(1e-2 * low / 4 + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64))
        else:
            out.append(1e-2 * torch.randn(shape, generator=gen, dtype=torch.float64))
    return out


def ours(method: str, taus: list[torch.Tensor]) -> torch.Tensor:
    cfg = MergeConfig(method=method, svd_scaling=1.0, iso_common_fraction=0.8, wudi_steps=WUDI_STEPS, wudi_lr=1e-5)
    zero = torch.zeros_like(taus[0], dtype=torch.float64)
    return merged_tensor(zero, lambda: (t.double() for t in taus), cfg)


def theirs(fb: dict[str, Callable[..., Any]], method: str, taus: list[torch.Tensor]) -> torch.Tensor:
    """FusionBench's merged task vector of one tensor, its progress printing silenced."""
    state = [{"w": t.clone()} for t in taus]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if method == "tsv_m":
            out = fb["tsv_m"](state, exclude_keys=None, accelerator="cpu")
        elif method == "iso_c":
            out = fb["iso_c"](state, accelerator="cpu")
        elif method == "iso_cts":
            out = fb["iso_cts"](state, common_space_fraction=0.8, accelerator="cpu")
        else:
            out = fb["wudi"](state, accelerator="cpu", iter_num=WUDI_STEPS)
    return out["w"].detach().double()


def fusion_bench(path: Path) -> dict[str, Callable[..., Any]]:
    sys.path.insert(0, str(path))
    from fusion_bench.method.isotropic_merging.iso_utils import iso_c, iso_cts
    from fusion_bench.method.task_singular_vector.utils.TSVM_utils import compute_and_sum_svd_mem_reduction
    from fusion_bench.method.wudi.wudi import wudi_merging

    return {"tsv_m": compute_and_sum_svd_mem_reduction, "iso_c": iso_c, "iso_cts": iso_cts, "wudi": wudi_merging}


def seconds_per_step(run: Callable[[int], Any], steps: int) -> float:
    """Seconds per WUDI step: a run of `steps` steps less a run of none (the set-up), over `steps`."""
    start = time.perf_counter()
    run(0)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    run(steps)
    return (time.perf_counter() - start - setup) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fusion-bench", type=Path, required=True, help="the directory FusionBench is installed in")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fb = fusion_bench(args.fusion_bench)
    torch.set_num_threads(1)
    rows = []
    for seed, (shape, tasks) in enumerate((s, t) for s in SHAPES for t in TASKS):
        taus = task_vectors(shape, tasks, seed)
        for method in ("tsv_m", "iso_c", "iso_cts", "wudi"):
            mine = ours(method, taus)
            scale = mine.abs().max().item()
            diff64 = (mine - theirs(fb, method, taus)).abs().max().item() / scale
            diff32 = (mine - theirs(fb, method, [t.float() for t in taus])).abs().max().item() / scale
            note = ""
            if method == "wudi" and len(shape) == 2:
                start, end = (wudi_loss(d, lambda taus=taus: iter(taus)) for d in (sum(taus), mine))
                note = f"loss {start:.3e} → {end:.3e}"
            rows.append(f"| {'×'.join(map(str, shape))} | {tasks} | {method} | {diff64:.1e} | {diff32:.1e} | {note} |")
    timing = []
    for shape in ((384, 384), (1536, 384), (384, 1536)):
        taus = [t.double() for t in task_vectors(shape, 8, 99)]
        zero = torch.zeros(shape, dtype=torch.float64)
        mine = seconds_per_step(lambda steps, taus=taus, zero=zero: merged_tensor(
            zero, lambda: iter(taus), MergeConfig(method="wudi", wudi_steps=steps)), 10)
        their = seconds_per_step(lambda steps, taus=taus: _fb_wudi(fb, taus, steps), 3)
        timing.append(f"| {'×'.join(map(str, shape))} | 8 | {mine * 1e3:.1f} | {their * 1e3:.1f} | "
                      f"{mine * WUDI_STEPS:.1f} |")
    lines = [f"# TSV-M, Iso-C, Iso-CTS and WUDI against FusionBench {version('fusion-bench')} "
             "(`benchmarks/merges_vs_fusionbench.py`)", "",
             f"Machine: {cpu_line()}, 1 thread. Date: {datetime.date.today()}. Command: `{command_line()}`. "
             f"Code: {commit_of(ROOT)}. torch {torch.__version__}.", "",
             "Task vectors: rank 4 at scale 1e-2 plus noise at 1e-3 (2-D), N(0, 1e-4) (1-D); θ0 = 0, α = 1, "
             "Iso-CTS common fraction 0.8, WUDI 300 Adam steps at lr 1e-5. `float64`: the largest difference between "
             "our merged task vector and FusionBench's, both from the same float64 task vectors, over the largest "
             "entry of ours; `float32`: FusionBench given float32 copies (its usual precision).", "",
             "| tensor | T | method | float64 | float32 | |", "|---|---|---|---|---|---|", *rows, "",
             "## WUDI's cost per Adam step (float64, CPU, 1 thread)", "",
             "Ours takes the gradient 2(ΔA − B) from two sums gathered once (one m×n by n×n product a step); "
             "FusionBench's differentiates the loss over the stacked task vectors by autograd (2T products of "
             "m×n by n×m a step, forward and backward).", "",
             "| matrix (out × in) | T | ours, ms/step | FusionBench, ms/step | ours, s for 300 steps |",
             "|---|---|---|---|---|", *timing]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fb_wudi(fb: dict[str, Callable[..., Any]], taus: list[torch.Tensor], steps: int) -> torch.Tensor:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fb["wudi"]([{"w": t} for t in taus], accelerator="cpu", iter_num=steps)["w"]


if __name__ == "__main__":
    main()
