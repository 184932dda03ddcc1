"""Cost of a FeatCal run against its floor: wall time split by stage, peak RSS, and the floor, all measured side by
side in one invocation.

    python benchmarks/pipeline_cost.py --shape vit-b32 --experts 8 --examples 32 --threads 1 \
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
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

# Children run in the environment this script started with: this checkout's `featcal` picks its own allocator
# settings (flows/cli.py), and another checkout keeps what it did. The floor is measured here with the ones this
# checkout's runs use, so it is set before torch loads.
START_ENV = dict(os.environ)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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


def runtime_field(text: str) -> tuple[str, str]:
    """An argparse type: `KEY=VALUE`, a runtime field a benchmark's runs also set (`keep_freed_memory=true`)."""
    key, sep, value = text.partition("=")
    if not (sep and key and value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. keep_freed_memory=true")
    return key, value


def child_env(threads: int, code: Path | None) -> dict[str, str]:
    """This script's starting environment with `threads` threads, offline, and `code` (when given) first on the
    import path; with None, no PYTHONPATH at all."""
    env = {**START_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    return env


def child_cost(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, peak RSS GiB, CPU seconds: user + system) of one child process, its own only; raises with its
    stderr if it fails. On a shared machine the CPU seconds say what the work cost, the wall what it waited too."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.read()}")
    return wall, usage.ru_maxrss / 1024**2, usage.ru_utime + usage.ru_stime


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
            _sync(device)
            start = time.perf_counter()
            for i in range(0, examples, 16):
                model(pixel_values=pixels[i:i + 16])
            _sync(device)
            best = min(best, time.perf_counter() - start)
        return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_rate(threads: int, dtype: torch.dtype, device: str, clock=time.perf_counter) -> float:
    """FLOP/s of a Gram-shaped product (one chunk's 16 × 50 rows, in 3072, out 768) at `dtype`, best of 5; by wall
    time, or by `clock` (time.process_time: CPU time, for a one-thread rate on a shared machine)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, 3072, generator=g).to(device, dtype)
    y = torch.randn(800, 768, generator=g).to(device, dtype)
    best = float("inf")
    for _ in range(6):  # the first is a warm-up
        _sync(device)
        start = clock()
        for _ in range(5):
            x.T @ y
        _sync(device)
        best = min(best, (clock() - start) / 5)
    return 2 * 800 * 3072 * 768 / best


def weight_gap(a: Path, b: Path) -> float:
    """Largest relative Frobenius difference between the calibrated weight matrices of two runs (biases and norms
    of a random-init model are near zero, so their relative difference says little)."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "calibrated" / "model.safetensors"), load_file(b / "calibrated" / "model.safetensors")
    if wa.keys() != wb.keys():
        raise RuntimeError(f"{a} and {b} hold different tensors")
    return max(float((wa[k].double() - wb[k].double()).norm() / wb[k].double().norm().clamp_min(1e-30))
               for k in wa if wa[k].dim() == 2)


def same_weights(a: Path, b: Path) -> bool:
    """Whether two runs' calibrated checkpoints hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    x, y = load_file(a / "calibrated" / "model.safetensors"), load_file(b / "calibrated" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


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
        f"{'Prefect flow' if args.prefect else 'direct (no Prefect)'}. Device: {args.device}. One model: {model_gib(work):.3f} GiB of float32 "
        f"weights. Command: `python benchmarks/pipeline_cost.py {' '.join(sys.argv[1:])}`",
        "",
        "Matmul rate measured here: " + ", ".join(f"{p} {rate[p] / 1e9:.0f} GFLOP/s" for p in args.precision)
        + "; one full forward over one task's inputs: " + ", ".join(f"{p} {forward[p]:.2f} s" for p in args.precision)
        + ".",
        "",
        "| experts | code | precision | wall (s) | " + " | ".join(f"{k} (s)" for k in KINDS)
        + " | stages total (s) | floor (s) | stages / floor | peak RSS (GiB) | weight matrices vs this checkout's fp32 |",
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
    lines += ["", "Stage seconds are summed over that stage's runs (from the run's records); wall includes process start,",
              "imports and preflight. Floor = 3 full forwards per task (expert and merged in the Gram stage, calibrated",
              "in propagate) at the run's precision + the Gram FLOPs its records count at the matmul rate of that",
              "precision. A checkout whose records do not count Gram FLOPs gets the forward part only (≥ / ≤)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
