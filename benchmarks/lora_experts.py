"""LoRA experts against the same experts merged by PEFT and saved in full, on the Llama-3.2-3B shape of
benchmarks/large_model.py: peak RSS, disk (inputs and the run directory) and wall time of `featcal run`, and whether
the two runs write the same merged and calibrated weights.

    python -m benchmarks.lora_experts --work /work/bench_lora --layers 2 --experts 2 --rank 16 \
        --out benchmarks/results/lora_experts.md

1. Builds (once) under WORK/models a base of the 3B shape (hidden 3072, intermediate 8192, vocabulary 128256, tied
   embeddings, bf16) with --layers of its 28 blocks (large_model.py's writer and weights), then per expert a PEFT LoRA
   adapter on every linear map of the blocks (q/k/v/o, gate/up/down; r = --rank, lora_alpha = 2r, seeded factors
   giving ΔW entries of std ≈ 0.002 like large_model's experts), saved with PEFT's save_pretrained, and the same expert
   from PEFT's merge_and_unload() saved with save_pretrained: the full checkpoint a user would otherwise write.
   Calibration data: large_model.py's (8 × 128 random token ids per task).
2. Runs `featcal run --no-prefect` to the end on the adapters, then on the full checkpoints (child processes, one
   thread, large_model.py's `segment`: RSS of the process tree and the run directory's disk sampled every second).
3. Compares every tensor of merged/ and calibrated/ between the two runs, and writes the markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from benchmarks.large_model import GIB, TOKENS, config_file, du, llama_config, segment, write_data, write_model
from flows.pipeline import machine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMBEDDING_GIB = 128256 * 3072 * 2 / GIB  # the bf16 embedding table (tied with the LM head)
DELTA_STD = 0.002  # std of ΔW entries, as large_model.py's experts differ from their base


def build(work: Path, layers: int, experts: int, rank: int, examples: int) -> dict[str, float]:
    """The base, and per expert its adapter (models/lora{t}) and PEFT's merge of it (models/full{t})."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    seconds = {}
    cfg = llama_config()
    cfg.num_hidden_layers = layers
    base_dir = work / "models" / "base"
    started = time.perf_counter()
    write_model(base_dir, cfg, None, base_dir)
    seconds["base"] = time.perf_counter() - started
    for t in range(experts):
        write_data(work / "data" / f"task{t}-{examples}", t, examples)
        lora_dir, full_dir = work / "models" / f"lora{t}", work / "models" / f"full{t}"
        if (full_dir / "config.json").is_file():
            continue
        started = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                      init_lora_weights=False))
        g = torch.Generator().manual_seed(100 + t)
        with torch.no_grad():  # A ~ N(0, 1/in), B ~ N(0, σ²) with scale²·r·σ²/in = DELTA_STD²
            for name, p in peft_model.named_parameters():
                if ".lora_A." in name:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                elif ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * DELTA_STD / (2 * rank**0.5))
        peft_model.save_pretrained(lora_dir)
        peft_model.merge_and_unload().save_pretrained(full_dir)
        del model, peft_model
        seconds[f"expert{t}"] = time.perf_counter() - started
        print(f"built expert {t} in {seconds[f'expert{t}']:.0f} s", flush=True)
    return seconds


def compare(a: Path, b: Path) -> dict:
    """Every tensor of checkpoint directories `a` and `b`: how many, how many bit-identical, the largest relative
    difference (Frobenius norm of the difference over the tensor's)."""
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys():
        return {"tensors": len(tb), "same_names": False}
    differing = [k for k in tb if not torch.equal(ta[k], tb[k])]  # float64 copies only of those (not the embedding)
    worst = max((float((ta[k].double() - tb[k].double()).norm() / tb[k].double().norm().clamp(min=1e-30))
                 for k in differing), default=0.0)
    return {"tensors": len(tb), "same_names": True, "identical": len(tb) - len(differing), "max_relative": worst}


def run(work: Path, kind: str, experts: int, examples: int) -> dict:
    run_dir = work / f"run-{kind}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    seg = segment(config_file(work, experts, examples, "fp32", kind), run_dir, experts, blocks=10**6, min_free_gib=3.0)
    seg["peak_run_dir_gib"] = max(s[2] for s in seg["samples"])
    seg["peak_sampled_rss_gib"] = max(s[1] for s in seg["samples"])
    seg["left_gib"] = du(run_dir) / GIB
    seg["biggest_files"] = sorted(((p.stat().st_size / GIB, str(p.relative_to(run_dir)))
                                   for p in run_dir.rglob("*") if p.is_file()), reverse=True)[:4]
    del seg["samples"]
    return seg


def read_seconds(work: Path, repeats: int = 3) -> dict[str, float]:
    """CPU seconds (best of `repeats`, the two readers alternating, after a warm-up pass that reads the files into
    the page cache, which other jobs may evict) to read every tensor of expert 0 once: as base + adapter, and from
    its full checkpoint. The only code path in which the two runs differ; the runs' own stage times are too noisy
    on this shared host to show it."""
    from featcal.modeling import Skeleton, expert_checkpoint
    from storage.checkpoint import CanonicalCheckpoint

    torch.set_num_threads(1)
    models = work / "models"
    skeleton = Skeleton.from_checkpoint(models / "base")
    readers = {"lora": expert_checkpoint(models / "lora0", models / "base", skeleton),
               "full": CanonicalCheckpoint(models / "full0", skeleton.adapter)}
    best = {kind: float("inf") for kind in readers}
    for i in range(repeats + 1):
        for kind, reader in readers.items():
            started = time.process_time()
            for name in reader.names():
                reader.get(name)
            if i:
                best[kind] = min(best[kind], time.process_time() - started)
    return best


def cpu_flags() -> str:
    """The bf16 instructions the CPU has (they decide how fast bf16 runs here)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return ", ".join(f"{flag}: {'yes' if f' {flag}' in text else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))


def report(args, built: dict, runs: dict, inputs: dict, same: dict, reads: dict) -> str:
    lora, full = runs["lora"], runs["full"]
    base = inputs["base"]
    full_blocks = (inputs["full"] / args.experts - EMBEDDING_GIB) / args.layers  # one expert's block, on disk
    extrapolated = {"lora": inputs["lora"] * 28 / args.layers,
                    "full": args.experts * (EMBEDDING_GIB + 28 * full_blocks)}
    peak_ratio = (base + inputs["lora"] + lora["peak_run_dir_gib"]) / (base + inputs["full"] + full["peak_run_dir_gib"])
    lines = [
        "# LoRA experts against full expert checkpoints, Llama-3.2-3B shape",
        "",
        f"Machine: {machine()} ({cpu_flags()}). Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: "
        f"`python -m benchmarks.lora_experts --work {args.work} --layers {args.layers} --experts {args.experts} "
        f"--rank {args.rank} --examples {args.examples} --out {args.out}`"
        + (" (the runs, from an invocation without --report-only, then this one with --report-only)"
           if args.report_only else "") +
        ". Runs: `featcal run --no-prefect --skip-disk-check` in a child process, runtime.threads 1, precision fp32, "
        "evaluation off.",
        "",
        f"Shape: LlamaForCausalLM of Llama-3.2-3B (hidden 3072, intermediate 8192, 24/8 heads, vocabulary 128256, "
        f"tied embeddings, bf16) with **{args.layers} of its 28 blocks**: this 2-core host is shared by several "
        "jobs (load average about 14 during these runs), and all 28 blocks would take hours per run "
        "(benchmarks/results/large_model.md). "
        f"{args.experts} experts, each a PEFT LoRA adapter on q/k/v/o/gate/up/down of every block, r = {args.rank}, "
        f"lora_alpha = {2 * args.rank}, fp32 factors (PEFT's default on a bf16 model); the full checkpoints are the "
        "same experts after PEFT's `merge_and_unload()`, saved with `save_pretrained`. Calibration: "
        f"{args.examples} × {TOKENS} random token ids per task.",
        "",
        "| | LoRA experts | full experts | LoRA / full |",
        "|---|---:|---:|---:|",
        f"| expert inputs on disk (GiB, all experts) | {inputs['lora']:.3f} | {inputs['full']:.3f} | "
        f"{inputs['lora'] / inputs['full']:.4f} |",
        f"| base on disk (GiB) | {base:.3f} | {base:.3f} | 1 |",
        f"| run directory, peak (GiB) | {lora['peak_run_dir_gib']:.3f} | {full['peak_run_dir_gib']:.3f} | "
        f"{lora['peak_run_dir_gib'] / full['peak_run_dir_gib']:.3f} |",
        f"| run directory, left at the end (GiB) | {lora['left_gib']:.3f} | {full['left_gib']:.3f} | "
        f"{lora['left_gib'] / full['left_gib']:.3f} |",
        f"| inputs + run directory peak (GiB) | {base + inputs['lora'] + lora['peak_run_dir_gib']:.3f} | "
        f"{base + inputs['full'] + full['peak_run_dir_gib']:.3f} | "
        f"{peak_ratio:.3f} |",
        f"| peak RSS, ru_maxrss (GiB) | {lora['maxrss_gib']:.2f} | {full['maxrss_gib']:.2f} | "
        f"{lora['maxrss_gib'] / full['maxrss_gib']:.3f} |",
        f"| peak RSS, process tree sampled every second (GiB) | {lora['peak_sampled_rss_gib']:.2f} | "
        f"{full['peak_sampled_rss_gib']:.2f} | {lora['peak_sampled_rss_gib'] / full['peak_sampled_rss_gib']:.3f} |",
        f"| wall (s) | {lora['wall_s']:.0f} | {full['wall_s']:.0f} | {lora['wall_s'] / full['wall_s']:.2f} |",
        f"| CPU (s) | {lora['cpu_s']:.0f} | {full['cpu_s']:.0f} | {lora['cpu_s'] / full['cpu_s']:.2f} |",
        f"| read every tensor of expert 0 once, CPU s (best of 3) | {reads['lora']:.2f} | "
        f"{reads['full']:.2f} | {reads['lora'] / reads['full']:.2f} |",
        "",
        f"Both runs: {lora['stopped']} / {full['stopped']} (exit status {lora['exit']} / {full['exit']}). "
        "Largest files "
        "left in the LoRA run's directory: " + ", ".join(f"{p} {s:.3f} GiB" for s, p in lora["biggest_files"]) +
        "; in the full run's: " + ", ".join(f"{p} {s:.3f} GiB" for s, p in full["biggest_files"]) + ".",
        "",
        "Same weights: " + "; ".join(
            f"{part}/ — {c['tensors']} tensors, "
            + (f"{c['identical']} bit-identical, largest relative difference {c['max_relative']:.2e}"
               if c["same_names"] else "different tensor names")
            for part, c in same.items()) + ".",
        "",
        "Build (not part of the runs): " + ", ".join(f"{k} {v:.0f} s" for k, v in built.items()) + ".",
        "",
        "What it shows. **Disk**: the LoRA run needs the base, the adapters and its run directory, which holds the "
        "same files as the full run's (no expert is written in full, at any time: the peak of the run directory is "
        "the same); the full-checkpoint route needs the merged experts written first (the 'expert inputs' row). "
        f"Extrapolated to all 28 blocks (not measured; expert files scale with the blocks, the embedding of "
        f"{EMBEDDING_GIB:.3f} GiB once per full expert): {extrapolated['lora']:.2f} GiB of adapters against "
        f"{extrapolated['full']:.2f} GiB of full experts for these {args.experts} experts. "
        "**Memory**: the peak RSS is "
        f"{lora['maxrss_gib'] - full['maxrss_gib']:+.2f} GiB against the full run: forming an adapted weight holds, "
        "for a moment, its ΔW and the sum in float32 besides the base tensor (about 0.2 GiB for an 8192 × 3072 MLP "
        "weight); the stages otherwise hold one block or one tensor per side, as with full experts. **Time**: "
        f"reading the whole {args.layers}-block expert once took {reads['lora']:.2f} s of CPU as base + adapter and "
        f"{reads['full']:.2f} s from its file (best of 3; on this loaded host the figures move between invocations, "
        "page cache included); forming ΔW is a rank-r product and an add per adapted weight, well under a second "
        "per block, against a block's "
"stages (minutes here); the runs' CPU seconds are within noise of each other. Their wall times are not "
        "comparable: the host's load average was about 14 on 2 cores through both runs, and the LoRA run, first, "
        "also started with a cold page cache.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clean", action="store_true", help="remove WORK at the end")
    parser.add_argument("--report-only", action="store_true",
                        help="reuse WORK/results.json and the run directories of an earlier invocation")
    args = parser.parse_args()
    results = args.work / "results.json"
    if args.report_only:
        kept = json.loads(results.read_text())
        built, inputs, runs = kept["built"], kept["inputs"], kept["runs"]
    else:
        built = build(args.work, args.layers, args.experts, args.rank, args.examples)
        models = args.work / "models"
        inputs = {"base": du(models / "base") / GIB,
                  "lora": sum(du(models / f"lora{t}") for t in range(args.experts)) / GIB,
                  "full": sum(du(models / f"full{t}") for t in range(args.experts)) / GIB}
        runs = {kind: run(args.work, kind, args.experts, args.examples) for kind in ("lora", "full")}
        results.write_text(json.dumps({"runs": runs, "inputs": inputs, "built": built}, indent=1))
    same = {part: compare(args.work / "run-lora" / part, args.work / "run-full" / part)
            for part in ("merged", "calibrated")}
    args.out.write_text(report(args, built, runs, inputs, same, read_seconds(args.work)))
    print(args.out.read_text())
    if args.clean:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
