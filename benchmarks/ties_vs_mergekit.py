"""Our TIES and DARE-TIES against MergeKit's own functions, on random task vectors: how many entries differ.

    pip install --target /tmp/mk --no-deps mergekit
    PYTHONPATH=/tmp/mk:. python -m benchmarks.ties_vs_mergekit --out benchmarks/results/ties_vs_mergekit.md

MergeKit's `ties` and `dare_ties` are its GTA task (mergekit/merge_methods/generalized_task_arithmetic.py): sparsify
each task vector, weight it, elect signs with `get_mask(..., "sum")`, sum the agreeing entries, divide by the
agreeing weights when `normalize`, multiply by `lambda`. Here those steps call MergeKit's `sparsify.magnitude` and
`get_mask` on float32 checkpoints (every model at weight 1, lambda = our scaling) and are set against
`featcal.merging.merged_tensor`, which computes in float64. For DARE-TIES MergeKit's random drop is replaced by
our masks with its rescaling off (its L1 rescale is not DARE's 1/density), so the comparison is of the rest of
the method: the division by density, the election and the merge.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from mergekit.merge_methods.generalized_task_arithmetic import get_mask
from mergekit.sparsify import magnitude

from featcal.config import MergeConfig
from featcal.merging import drop_masks, merged_tensor, trimmed
from flows.pipeline import machine

SHAPES = [(384, 384), (1536, 384), (384,), (30522, 64)]
TASKS = 7


def mergekit_merge(base: torch.Tensor, experts: list[torch.Tensor], sparsify, normalize: bool, lam: float):
    deltas = torch.stack([sparsify(e - base) for e in experts])  # weight 1: weighted deltas are the deltas
    mask = get_mask(deltas, method="sum", mask_dtype=base.dtype)
    mixed = (deltas * mask).sum(dim=0)
    divisor = mask.to(base.dtype).sum(dim=0)
    divisor[divisor == 0] = 1
    if normalize:
        mixed /= divisor
    return (base + lam * mixed).to(base.dtype)


def compare(shape: tuple[int, ...], method: str, density: float, how: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    experts = [base + 0.01 * torch.randn(shape, generator=gen) for _ in range(TASKS)]
    tasks = [f"task{t}" for t in range(TASKS)]
    if method == "ties":
        cfg = MergeConfig(method="ties", ties_top_k=density, ties_merge=how, scaling=0.3)
        ours = merged_tensor(base, lambda: iter(experts), cfg)
        theirs = mergekit_merge(base, experts, lambda d: magnitude(d, density), how == "mean", 0.3)
    else:
        cfg = MergeConfig(method="dare_ties", density=density, ties_merge=how, scaling=0.3)
        masks = drop_masks(cfg, tasks, "w", shape)
        rows = shape[0]
        ours = merged_tensor(base, lambda: iter(experts), cfg, lambda t: masks(t, 0, rows))
        kept = iter([masks(t, 0, rows).view(shape) for t in range(TASKS)])
        theirs = mergekit_merge(base, experts, lambda d: torch.where(next(kept), d / density, 0.0), how == "mean", 0.3)
    # Our trim on MergeKit's own float32 task vectors: where the kept sets differ only because MergeKit rounds
    # θ_t − θ0 to float32 (we keep it exact in float64), this is 0.
    same_input = off_ties = 0
    for e in experts if method == "ties" else []:
        tau = e - base
        differs = (trimmed(tau.double(), density) != 0) != (magnitude(tau, density) != 0)
        cut = tau.abs().reshape(-1).kthvalue(tau.numel() - int(density * tau.numel()) + 1).values
        same_input += int(differs.sum())
        off_ties += int((differs & (tau.abs() != cut)).sum())
    scale = (ours - base).abs().max().item()
    diff = (ours - theirs).abs()
    return {"shape": "×".join(map(str, shape)), "method": method, "density": density, "how": how,
            "entries": ours.numel(), "differ": int((diff > 1e-3 * scale).sum()), "max_rel": diff.max().item() / scale,
            "trim_same_input": same_input, "off_ties": off_ties}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [compare(shape, method, density, how, seed)
            for seed, shape in enumerate(SHAPES) for method in ("ties", "dare_ties") for density in (0.2, 0.5)
            for how in ("sum", "mean")]
    from importlib.metadata import version

    lines = [f"# TIES and DARE-TIES against MergeKit {version('mergekit')} (`benchmarks/ties_vs_mergekit.py`)", "",
             f"Machine: {machine()}. {TASKS} experts per tensor, θ_t = θ0 + 0.01·N(0, 1), float32 checkpoints,",
             "scale 0.3.",
             "`differ`: entries whose merged value differs by more than 1e-3 of the largest merged update (a kept or",
             "elected entry that is not the same); `max rel`: the largest difference over that update (float rounding",
             "when nothing differs); `trim on their τ`: entries kept by one trim and not the other when ours is given",
             "MergeKit's float32 task vectors (TIES only), summed over the experts; `of them off the cut`: those whose",
             "|τ| is not the magnitude at the cut. θ_t − θ0 rounded to float32 is a multiple of θ0's ulp, so "
             "magnitudes",
             "tied at the cut are common, and MergeKit's argsort orders them in no stated way (we keep the lower "
             "index).",
             "",
             "| tensor | method | density | merge | entries | differ | max rel | trim on their τ "
             "| of them off the cut |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['method']} | {r['density']} | {r['how']} | {r['entries']:,} | {r['differ']} | "
              f"{r['max_rel']:.1e} | {r['trim_same_input'] if r['method'] == 'ties' else ''} | "
              f"{r['off_ties'] if r['method'] == 'ties' else ''} |" for r in rows]
    ties_off_cut = sum(r["off_ties"] for r in rows)
    dare_worst = max(r["max_rel"] for r in rows if r["method"] == "dare_ties")
    lines += ["", f"TIES differences off the cut, over all rows: {ties_off_cut}; DARE-TIES, given the same masks: "
              f"{sum(r['differ'] for r in rows if r['method'] == 'dare_ties')} entries differ, the largest difference "
              f"{dare_worst:.1e} of the update (float rounding)."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
