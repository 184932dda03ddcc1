"""Cost of a FeatCal run against its floor: wall time split by stage, peak RSS, and the floor, all measured side by
side in one invocation.

    python -m benchmarks.pipeline_cost --shape vit-b32 --experts 8 --examples 32 --threads 1 \
        --precision fp32 bf16 --compare-with /tmp/featcal-before --out benchmarks/results/pipeline_cost_vitb32.md

The floor is what any implementation of the method must compute: per task and block, the expert and merged forwards
(Gram stage) and the calibrated forward (propagate stage), measured here as full-model forwards at the run's
precision, plus the Gram FLOPs the run's statistics took (its Gram records count them) at the matmul rate measured
here at the same precision. `--compare-with DIR` also runs another checkout of this project (say, the commit before a
change) on the same inputs in fp32, and reports its time and how far its weights are from this checkout's.

The ViT-B/32 shape is the one docs/design.md §5 quotes for the official implementation on these CPUs. Weights here are
synthetic (random base, experts = base + seeded perturbations): cost does not depend on what the weights learned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import ROOT, child_cost, child_env, command_line, matmul_rate, sync, weight_gap

# Children run in the environment this process started with (benchmarks.common.START_ENV): this checkout's `featcal`
# picks its own allocator settings (flows/cli.py), and another checkout keeps what it did. The floor is measured here
# with the ones this checkout's runs use, so it is set before torch loads.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from flows.pipeline import machine  # noqa: E402

SHAPES = {
    "vit-b32": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=224, patch_size=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 image_size=32, patch_size=8),
}


def build_inputs(work: Path, shape: str, n_experts: int, examples: int) -> None:
    """Base, experts and per-task pixel data on disk (skipped when already there)."""
    from datasets import Array3D, Dataset, Features
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(**SHAPES[shape])
    torch.manual_seed(0)
    if not (work / "base" / "model.safetensors").is_file():
        CLIPVisionModel(cfg).save_pretrained(work / "base")
    base = None
    for t in range(n_experts):
        out = work / "experts" / f"task{t}"
        if not (out / "model.safetensors").is_file():
            base = base or CLIPVisionModel.from_pretrained(work / "base")
            g = torch.Generator().manual_seed(100 + t)
            expert = CLIPVisionModel(cfg)
            expert.load_state_dict({k: v + 0.02 * v.abs().mean() * torch.randn(v.shape, generator=g)
                                    for k, v in base.state_dict().items()})
            expert.save_pretrained(out)
        data = work / "data" / f"task{t}"
        if not data.is_dir():
            rng = np.random.default_rng(t)
            size = cfg.image_size
            pixels = (rng.standard_normal((examples, 3, size, size)) + 0.3 * t).astype(np.float32)
            features = Features(pixel_values=Array3D((3, size, size), "float32"))
            Dataset.from_dict({"pixel_values": pixels}, features=features).save_to_disk(str(data))


def config_file(work: Path, n_experts: int, examples: int, runtime: dict[str, str] | None = None) -> Path:
    """The run's config; `runtime` only for this checkout (one from before runtime.precision refuses the keys)."""
    tasks = [f"task{t}" for t in range(n_experts)]
    raw = {
        "base": str(work / "base"),
        "experts": {t: str(work / "experts" / t) for t in tasks},
        "calibration": {"data": {t: {"path": str(work / "data" / t)} for t in tasks},
                        "examples_per_task": examples, "batch_size": 16},
        "evaluation": {"enabled": False},
    }
    if runtime:
        raw["runtime"] = runtime
    suffix = "-".join(v.replace(":", "") for v in (runtime or {}).values()) or "default"
    path = work / f"config-{n_experts}-{suffix}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_once(config: Path, run_dir: Path, threads: int, prefect: bool, code: Path = ROOT) -> dict:
    """One `featcal run` of the checkout at `code` in a child process: wall time and that child's own peak RSS."""
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir)]
    if not prefect:
        cmd.append("--no-prefect")
    wall, peak_rss_gib, cpu = child_cost(cmd, code, child_env(threads, code))
    by_kind: dict[str, float] = defaultdict(float)
    gram_flops = 0
    for path in (run_dir / "records").glob("*.json"):
        rec = json.loads(path.read_text())
        if "stage" in rec:
            by_kind[rec["stage"].split("/")[0]] += rec["seconds"]
            gram_flops += rec.get("info", {}).get("gram_flops", 0) if rec["stage"].startswith("gram/") else 0
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_gib": peak_rss_gib, "stages_s": dict(by_kind),
            "gram_flops": gram_flops}


def forward_seconds(work: Path, examples: int, threads: int, dtype: torch.dtype, device: str) -> float:
    """Seconds for one full-model forward over one task's calibration inputs, batch 16, at `dtype` on `device`, best
    of 3 (one timing once read 4.6 s where the run's own forwards took 3.8 s per task: the floor must not be the
    noisy part)."""
    from datasets import load_from_disk
    from transformers import CLIPVisionModel

    torch.set_num_threads(threads)
    model = CLIPVisionModel.from_pretrained(work / "base").eval().to(device, dtype)
    pixels = torch.tensor(np.asarray(load_from_disk(str(work / "data" / "task0"))["pixel_values"][:examples]))
    pixels = pixels.to(device, dtype)
    with torch.inference_mode():
        model(pixel_values=pixels[:2])  # warm-up
        best = float("inf")
        for _ in range(3):
            sync(device)
            start = time.perf_counter()
            for i in range(0, examples, 16):
                model(pixel_values=pixels[i:i + 16])
            sync(device)
            best = min(best, time.perf_counter() - start)
        return best


def model_gib(work: Path) -> float:
    return (work / "base" / "model.safetensors").stat().st_size / 1024**3


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ["merge", "prepare", "gram", "solve", "propagate", "assemble"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit-b32")
    parser.add_argument("--experts", type=int, nargs="+", default=[8])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=sorted(DTYPES), nargs="+", default=["fp32"])
    parser.add_argument("--device", default="cpu", help="runtime.device of this checkout's runs (cpu, cuda, cuda:N)")
    parser.add_argument("--compare-with", type=Path, metavar="CHECKOUT",
                        help="another checkout of this project, run in fp32 on the same inputs")
    parser.add_argument("--prefect", action="store_true", help="run through the Prefect flow (ephemeral server)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-bench"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work / args.shape
    build_inputs(work, args.shape, max(args.experts), args.examples)
    rows = []
    for n in args.experts:
        runs = [("this checkout", p, ROOT) for p in args.precision]
        if args.compare_with is not None:
            runs.insert(0, (f"`{args.compare_with.name}`", "fp32", args.compare_with.resolve()))
        dirs: dict[tuple[str, str], Path] = {}
        for label, precision, code in runs:
            run_dir = args.work / f"run-{args.shape}-{n}-{precision}-{time.time_ns()}"
            runtime = {"precision": precision, "device": args.device} if code == ROOT else None
            result = run_once(config_file(work, n, args.examples, runtime), run_dir, args.threads, args.prefect, code)
            dirs[label, precision] = run_dir
            rows.append({"experts": n, "code": label, "precision": precision, **result})
            print(json.dumps(rows[-1]), flush=True)
        reference = dirs.get(("this checkout", "fp32"))
        for row in rows[-len(runs):]:
            if reference is not None:
                row["weight_gap"] = weight_gap(dirs[row["code"], row["precision"]], reference)
    # After the runs: a child's peak RSS starts from this process's at fork, so this process stays small till then.
    forward = {p: forward_seconds(work, args.examples, args.threads, DTYPES[p], args.device) for p in args.precision}
    rate = {p: matmul_rate(args.threads, DTYPES[p], args.device) for p in args.precision}
    for row in rows:
        row["forward_floor_s"] = forward[row["precision"]] * 3 * row["experts"]
        row["floor_s"] = row["forward_floor_s"] + row["gram_flops"] / rate[row["precision"]]
    lines = [
        f"# FeatCal run cost against its floor — {args.shape} shape, {args.examples} examples/task, "
        f"{args.threads} thread(s)",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Runner: "
        f"{'Prefect flow' if args.prefect else 'direct (no Prefect)'}. Device: {args.device}. "
        f"One model: {model_gib(work):.3f} GiB of float32 "
        f"weights. Command: `{command_line()}`",
        "",
        "Matmul rate measured here: " + ", ".join(f"{p} {rate[p] / 1e9:.0f} GFLOP/s" for p in args.precision)
        + "; one full forward over one task's inputs: " + ", ".join(f"{p} {forward[p]:.2f} s" for p in args.precision)
        + ".",
        "",
        "| experts | code | precision | wall (s) | " + " | ".join(f"{k} (s)" for k in KINDS)
        + " | stages total (s) | floor (s) | stages / floor | peak RSS (GiB) "
        "| weight matrices vs this checkout's fp32 |",
        "|---:|---|---|" + "---:|" * (len(KINDS) + 6),
    ]
    for r in rows:
        total = sum(r["stages_s"].get(k, 0.0) for k in KINDS)
        floor = f"{r['floor_s']:.1f}" if r["gram_flops"] else f"≥ {r['forward_floor_s']:.1f}"
        ratio = f"{total / r['floor_s']:.2f}" if r["gram_flops"] else f"≤ {total / r['forward_floor_s']:.2f}"
        gap = f"{r['weight_gap']:.1e}" if "weight_gap" in r else "–"
        lines.append(f"| {r['experts']} | {r['code']} | {r['precision']} | {r['wall_s']:.1f} | "
                     + " | ".join(f"{r['stages_s'].get(k, 0.0):.1f}" for k in KINDS)
                     + f" | {total:.1f} | {floor} | {ratio} | {r['peak_rss_gib']:.2f} | {gap} |")
    lines += ["", "Stage seconds are summed over that stage's runs (from the run's records); wall includes "
              "process start,",
              "imports and preflight. Floor = 3 full forwards per task (expert and merged in the Gram stage, "
              "calibrated",
              "in propagate) at the run's precision + the Gram FLOPs its records count at the matmul rate of that",
              "precision. A checkout whose records do not count Gram FLOPs gets the forward part only (≥ / ≤)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
