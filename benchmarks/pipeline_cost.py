"""Cost of a FeatCal run: wall time split by stage, peak RSS as the number of experts grows, and the
floor of forward passes any calibration must make — all measured side by side in one invocation.

    python benchmarks/pipeline_cost.py --shape vit-b32 --experts 2 4 8 --examples 32 --threads 1 \
        --out benchmarks/results/pipeline_cost.md

The ViT-B/32 shape is the one docs/design.md §5 quotes for the official implementation on these CPUs
(8 experts, 32 examples/task, 1 thread: 291 s, 7.0 GiB peak RSS). Weights here are synthetic
(random base, experts = base + seeded perturbations): cost does not depend on what the weights learned.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import yaml

from flows.pipeline import machine

ROOT = Path(__file__).resolve().parent.parent
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


def config_file(work: Path, n_experts: int, examples: int) -> Path:
    tasks = [f"task{t}" for t in range(n_experts)]
    raw = {
        "base": str(work / "base"),
        "experts": {t: str(work / "experts" / t) for t in tasks},
        "calibration": {"data": {t: {"path": str(work / "data" / t)} for t in tasks},
                        "examples_per_task": examples, "batch_size": 16},
        "evaluation": {"enabled": False},
    }
    path = work / f"config-{n_experts}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_once(config: Path, run_dir: Path, threads: int, prefect: bool) -> dict:
    """One `featcal run` in a child process: wall time and that child's own peak RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir)]
    if not prefect:
        cmd.append("--no-prefect")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"featcal run failed:\n{proc.stderr.read()}")
    by_kind: dict[str, float] = defaultdict(float)
    for path in (run_dir / "records").glob("*.json"):
        rec = json.loads(path.read_text())
        if "stage" in rec:
            by_kind[rec["stage"].split("/")[0]] += rec["seconds"]
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 1024**2, "stages_s": dict(by_kind)}


def forward_floor(work: Path, n_experts: int, examples: int, threads: int) -> float:
    """Seconds for the forward passes any calibration needs: expert and merged model over every task's inputs."""
    from datasets import load_from_disk
    from transformers import CLIPVisionModel

    torch.set_num_threads(threads)
    model = CLIPVisionModel.from_pretrained(work / "base").eval()
    pixels = torch.tensor(np.asarray(load_from_disk(str(work / "data" / "task0"))["pixel_values"][:examples]))
    with torch.inference_mode():
        model(pixel_values=pixels[:2])  # warm-up
        start = time.perf_counter()
        for i in range(0, examples, 16):
            model(pixel_values=pixels[i:i + 16])
        one = time.perf_counter() - start
    return one * 2 * n_experts  # two models per task


def model_gib(work: Path) -> float:
    return (work / "base" / "model.safetensors").stat().st_size / 1024**3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit-b32")
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefect", action="store_true", help="run through the Prefect flow (ephemeral server)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-bench"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work / args.shape
    build_inputs(work, args.shape, max(args.experts), args.examples)
    rows = []
    for n in args.experts:
        run_dir = args.work / f"run-{args.shape}-{n}-{time.time_ns()}"
        result = run_once(config_file(work, n, args.examples), run_dir, args.threads, args.prefect)
        result["floor_s"] = forward_floor(work, n, args.examples, args.threads)
        rows.append((n, result))
        print(n, json.dumps(result), flush=True)
    kinds = ["merge", "prepare", "gram", "solve", "propagate", "assemble"]
    lines = [
        f"# FeatCal run cost — {args.shape} shape, {args.examples} examples/task, {args.threads} thread(s)",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Runner: {'Prefect flow' if args.prefect else 'direct (no Prefect)'}.",
        f"One model: {model_gib(work):.3f} GiB of float32 weights. Command: `python benchmarks/pipeline_cost.py "
        f"--shape {args.shape} --experts {' '.join(map(str, args.experts))} --examples {args.examples} --threads {args.threads}"
        f"{' --prefect' if args.prefect else ''}`",
        "",
        "| experts | wall (s) | " + " | ".join(f"{k} (s)" for k in kinds)
        + " | stages total (s) | forward floor (s) | stages / floor | peak RSS (GiB) | RSS / model |",
        "|---:" * (len(kinds) + 7) + "|",
    ]
    for n, r in rows:
        cells = [f"{r['stages_s'].get(k, 0.0):.1f}" for k in kinds]
        total = sum(r["stages_s"].get(k, 0.0) for k in kinds)
        lines.append(f"| {n} | {r['wall_s']:.1f} | " + " | ".join(cells) + f" | {total:.1f} | {r['floor_s']:.1f} | "
                     f"{total / r['floor_s']:.1f} | {r['peak_rss_gib']:.2f} | {r['peak_rss_gib'] / model_gib(work):.1f} |")
    lines += ["", "Stage seconds are summed over that stage's runs (from the run's records); wall includes process start,",
              "imports and preflight. The forward floor is the expert and merged full forward passes over every task's",
              "calibration inputs, measured in the same invocation."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
