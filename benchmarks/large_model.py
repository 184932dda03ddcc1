"""A Llama-3.2-3B-shaped base and N experts (random bf16 weights, sharded on disk; together larger than this machine's
RAM), calibrated end to end on the CPU with a small calibration set: peak RSS, disk over time, time per block by stage
against the forward floor measured in the same invocation, `featcal plan`'s estimates, and a `kill -9` + resume.

    python -m benchmarks.large_model --work /work/bench_large --experts 2 5 --blocks 2 --examples 8 \
        --kill-run 2 --reference-blocks 2 --out benchmarks/results/large_model.md

State is kept in WORK/results.json, so the same figures can come from several shorter invocations (a run directory
kept with --keep-runs is resumed by the next one; benchmarks/results/large_model.md lists the ones that made it).

What it does, in order:

1. Builds (once, skipped when present) the base and max(--experts) experts under WORK/models, tensor by tensor
   straight into ~5 GB safetensors shards with a model.safetensors.index.json (bf16), never holding a model in RAM.
   Weights: N(0, 0.02) matrices, norms 1; expert t = base + 0.002·N(0, 1) (generator seeded from t and the tensor
   name). The embedding (tied with the LM head) is identical in every expert and sits alone in shard 1, which the
   experts hard-link from the base's (saves 0.73 GiB of disk per expert; every reader still reads it in full).
   Calibration data per task: --examples rows of 128 ready token ids (BOS first), saved with `save_to_disk`.
2. For each N in --experts: `featcal run --no-prefect` on tasks task0..task{N-1} (runtime.threads 1) in a child
   process; the run is stopped with SIGKILL once --blocks blocks are solved (all 28 only if --blocks 28). RSS of the
   child (and its children) and the run directory's disk use are sampled every second.
   With --kill-run N, that run is first killed with SIGKILL at a random moment (seeded) inside the blocks, then rerun
   to the same --blocks; the script checks from the stage events that no finished stage ran again, and compares the
   solved blocks with those of an uninterrupted run of the same config: --reference-blocks of them (a second, short
   uninterrupted run; 0 skips it).
3. The forward floor, in the same invocation after the runs: one block (real shape, the run's precision, weights of
   the base's block 0) run forward over one task's calibration tokens, timed; the method needs, per task and block,
   three such forwards (expert and merged in the Gram stage, calibrated in propagate), as benchmarks/pipeline_cost.py
   counts them, plus the Gram FLOPs the records count, at the matmul rate measured here (pipeline_cost's functions).
4. Writes the markdown (--out) with the machine, the command, every figure, and a per-block extrapolation to 28 blocks
   that says it is one.

Everything large goes under --work; delete it when done (`--clean` removes the models and runs at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from benchmarks.common import ROOT, matmul_rate, runtime_field
from flows.pipeline import machine

GIB = 1024**3
SHAPE = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
             num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
             max_position_embeddings=2048, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TOKENS = 128
SHARD_BYTES = 5 * 10**9
KINDS = ["merge", "prepare", "gram", "solve", "propagate", "assemble"]


# ---- inputs ---------------------------------------------------------------------------------------
def llama_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPE)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": SHAPE["rope_theta"]}
    cfg.dtype = torch.bfloat16
    return cfg


def tensor_specs(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor LlamaForCausalLM saves (tied LM head: not saved), in save order, from the model on `meta`."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.state_dict().items() if n != "lm_head.weight"]


def shard_plan(specs: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The embedding alone in shard 1 (so experts can hard-link it), then ~5 GB shards in order."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[s for s in specs if s[0] == "model.embed_tokens.weight"], []]
    size = 0
    for name, shape in specs:
        if name == "model.embed_tokens.weight":
            continue
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...]]], make) -> None:
    """One safetensors file written tensor by tensor: the header from the shapes, then each tensor's bf16 bytes as
    `make(name, shape)` returns them (one tensor in memory at a time)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape in entries:
            t = make(name, shape)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape, name
            fh.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    tmp.rename(path)


def _seed(name: str, owner: int) -> int:
    return (owner * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))) % 2**62


def base_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(_seed(name, 0))
    return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)


def write_model(out: Path, cfg, expert: int | None, base_dir: Path) -> None:
    """The base (expert None) or expert `expert` (base + seeded noise, the embedding hard-linked from the base)."""
    from storage.checkpoint import read_header, read_tensor

    if (out / "model.safetensors.index.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(tensor_specs(cfg))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    headers = {}

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if expert is None:
            return base_tensor(name, shape)
        path, (header, start) = headers[name]
        base = read_tensor(path, header[name], start)
        g = torch.Generator().manual_seed(_seed(name, 100 + expert))
        noise = torch.randn(shape, generator=g).mul_(0.002 if not name.endswith("norm.weight") else 0.02)
        return (base.float() + noise).to(torch.bfloat16)

    for file, entries in zip(names, shards, strict=True):
        if (out / file).is_file():
            continue
        if expert is not None:
            headers.update({n: (base_dir / file, read_header(base_dir / file)) for n, _ in entries})
            if entries[0][0] == "model.embed_tokens.weight":  # identical in every model: one inode on disk
                os.link(base_dir / file, out / file)
                continue
        write_safetensors(out / file, entries, make)
    cfg.save_pretrained(out)
    weight_map = {n: file for file, entries in zip(names, shards, strict=True) for n, _ in entries}
    total = sum(math.prod(s) * 2 for entries in shards for _, s in entries)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def write_data(out: Path, task: int, examples: int) -> None:
    from datasets import Dataset

    if out.is_dir():
        return
    rng = np.random.default_rng(1000 + task)
    ids = [[1] + rng.integers(3, SHAPE["vocab_size"], TOKENS - 1).tolist() for _ in range(examples)]
    Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * TOKENS for _ in ids]}).save_to_disk(str(out))


def build_inputs(work: Path, experts: int, examples: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = llama_config()
    seconds = {}
    start = time.perf_counter()
    write_model(work / "models" / "base", cfg, None, work / "models" / "base")
    seconds["base"] = time.perf_counter() - start
    for t in range(experts):
        start = time.perf_counter()
        write_model(work / "models" / f"expert{t}", cfg, t, work / "models" / "base")
        write_data(work / "data" / f"task{t}-{examples}", t, examples)
        seconds[f"expert{t}"] = time.perf_counter() - start
        free = shutil.disk_usage(work).free / GIB
        print(f"built expert{t} in {seconds[f'expert{t}']:.0f}s; {free:.1f} GiB free", flush=True)
    return seconds


# ---- runs -----------------------------------------------------------------------------------------
def config_file(work: Path, n: int, examples: int, precision: str, experts: str = "expert",
                runtime: dict[str, Any] | None = None) -> Path:
    """The run's config over `n` experts read from models/{experts}0, models/{experts}1, ..., with more `runtime`
    fields (--runtime, --keep-freed-memory)."""
    tasks = [f"task{t}" for t in range(n)]
    raw = {
        "base": str(work / "models" / "base"),
        "experts": {t: str(work / "models" / f"{experts}{i}") for i, t in enumerate(tasks)},
        "calibration": {"data": {t: {"path": str(work / "data" / f"task{i}-{examples}")} for i, t in enumerate(tasks)},
                        "examples_per_task": examples, "batch_size": examples, "max_length": TOKENS},
        "evaluation": {"enabled": False},
        "runtime": {"threads": 1, "precision": precision, **(runtime or {})},
    }
    path = work / f"config-{experts}-{n}-{examples}-{precision}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def plan_of(config: Path) -> dict:
    from featcal.config import load_config
    from flows.plan import plan

    return plan(load_config(str(config)))


def du(path: Path) -> int:
    """Bytes allocated on disk under `path` (hard links counted once)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def records(run_dir: Path) -> dict[str, dict]:
    out = {}
    for path in (run_dir / "records").glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if "stage" in rec:
            out[rec["stage"]] = rec
    return out


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "records" / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def blocks_done(run_dir: Path, n: int) -> int:
    """Blocks whose Gram, solve and propagations (none after the last block) all have records."""
    recs = records(run_dir)
    last = SHAPE["num_hidden_layers"] - 1
    k = 0
    while k <= last and f"solve/l{k:02d}" in recs and (
            k == last or all(f"propagate/l{k:02d}/task{t}" in recs for t in range(n))):
        k += 1
    return k


def segment(config: Path, run_dir: Path, n: int, blocks: int, min_free_gib: float,
            kill_after_start: tuple[str, float] | None = None) -> dict:
    """One `featcal run` process, SIGKILLed once `blocks` blocks are done (or, with `kill_after_start` (stage,
    seconds), that many seconds after that stage started, or when free disk falls under `min_free_gib`); RSS of its
    process tree and the run directory's disk use sampled every second."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir), "--no-prefect",
           "--skip-disk-check"]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    # (s, RSS GiB of the tree, run dir GiB, free GiB, 1-min load average, CPU seconds of the tree)
    samples: list[tuple[float, ...]] = []
    why = {"stopped": "finished"}
    done = threading.Event()

    def sample() -> None:
        ps = psutil.Process(proc.pid)
        killed_at = None
        while not done.is_set():
            try:
                tree = [ps, *ps.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree)
                cpu = sum(sum(p.cpu_times()[:2]) for p in tree)
            except psutil.Error:
                rss, cpu = 0, samples[-1][5] if samples else 0.0
            free = shutil.disk_usage(run_dir.parent).free / GIB
            samples.append((time.time() - start, rss / GIB, du(run_dir) / GIB, free, os.getloadavg()[0], cpu))
            for f in (run_dir / "stats").glob("*/*.safetensors"):
                try:
                    why["stats_file_bytes"] = max(why.get("stats_file_bytes", 0), f.stat().st_size)
                except FileNotFoundError:
                    pass
            reason = None
            if blocks_done(run_dir, n) >= blocks:
                reason = f"{blocks} block(s) done"
            elif free < min_free_gib:
                reason = f"free disk under {min_free_gib} GiB"
            elif kill_after_start is not None:
                stage, delay = kill_after_start
                t0 = next((e["t"] for e in events(run_dir) if e["stage"] == stage and e["event"] == "start"
                           and e["pid"] == proc.pid), None)
                if t0 is not None and time.time() >= t0 + delay:
                    reason = f"kill -9 {delay:.1f} s after stage {stage} started"
            if reason and killed_at is None:
                why["stopped"] = reason
                killed_at = time.time()
                os.kill(proc.pid, signal.SIGKILL)
            done.wait(1.0)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    watcher.join()
    log.close()
    return {"pid": proc.pid, "started_at": start, "wall_s": time.time() - start, "exit": status,
            "stopped": why["stopped"],
            "maxrss_gib": usage.ru_maxrss / 1024**2, "cpu_s": usage.ru_utime + usage.ru_stime, "samples": samples,
            "blocks_after": blocks_done(run_dir, n), "stats_file_bytes": why.get("stats_file_bytes", 0)}


def redone(run_dir: Path, first_pid: int, later_pid: int) -> list[str]:
    """Stages that finished in process `first_pid` and started again in `later_pid`."""
    ev = events(run_dir)
    finished = {e["stage"] for e in ev if e["pid"] == first_pid and e["event"] == "done"}
    return sorted({e["stage"] for e in ev if e["pid"] == later_pid and e["event"] == "start"} & finished)


def compare_blocks(a: Path, b: Path, blocks: int) -> dict:
    from safetensors.torch import load_file

    out = {"blocks": blocks, "tensors": 0, "equal": True, "differing": []}
    for k in range(blocks):
        wa, wb = load_file(a / f"l{k:02d}.safetensors"), load_file(b / f"l{k:02d}.safetensors")
        if wa.keys() != wb.keys():
            out["equal"] = False
            out["differing"].append(f"l{k:02d}: different tensor names")
            continue
        for name in wa:
            out["tensors"] += 1
            if not torch.equal(wa[name], wb[name]):
                out["equal"] = False
                out["differing"].append(f"l{k:02d}.{name}")
    return out


# ---- the floor ------------------------------------------------------------------------------------
def block_forward_seconds(work: Path, examples: int, precision: str, repeats: int = 3) -> dict[str, float]:
    """Wall and CPU seconds (each the best of `repeats`, after a warm-up) for one real-shape block forward over one
    task's calibration tokens (`examples` × 128, one batch, as the runs batch them), one thread, at the run's
    precision."""
    from datasets import load_from_disk

    from featcal.modeling import Skeleton
    from storage.checkpoint import CanonicalCheckpoint

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    skeleton = Skeleton.from_checkpoint(work / "models" / "base")
    adapter = skeleton.adapter
    block = skeleton.block(0, CanonicalCheckpoint(work / "models" / "base", adapter)).to(dtype)
    rows = load_from_disk(str(work / "data" / f"task0-{examples}"))
    batch = {k: torch.tensor(rows[k]) for k in ("input_ids", "attention_mask")}
    hidden = (0.02 * torch.randn(examples, TOKENS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0)))
    hidden = hidden.to(dtype)
    wall, cpu = float("inf"), float("inf")
    with torch.inference_mode():
        extra = adapter.block_input(batch, 0)
        for i in range(repeats + 1):
            started, cpu_started = time.perf_counter(), time.process_time()
            adapter.run_block(block, hidden, extra)
            if i:
                wall, cpu = min(wall, time.perf_counter() - started), min(cpu, time.process_time() - cpu_started)
    return {"wall": wall, "cpu": cpu}


# ---- the report -----------------------------------------------------------------------------------
def per_block(recs: dict[str, dict], k: int) -> dict[str, float]:
    pick = lambda prefix: [r for s, r in recs.items() if s.startswith(prefix)]  # noqa: E731
    return {"gram": sum(r["seconds"] for r in pick(f"gram/l{k:02d}/")),
            "solve": sum(r["seconds"] for r in pick(f"solve/l{k:02d}")),
            "propagate": sum(r["seconds"] for r in pick(f"propagate/l{k:02d}/")),
            "gram_flops": sum(r.get("info", {}).get("gram_flops", 0) for r in pick(f"gram/l{k:02d}/"))}


def stage_cpu(seg: list[dict], evs: list[dict]) -> dict[str, float]:
    """CPU seconds of each finished stage, from the processes' CPU time sampled every second (interpolated at the
    stage's start and done events); empty for processes sampled without CPU time."""
    out = {}
    for sg in seg:
        if "started_at" not in sg:
            continue
        pts = [(sg["started_at"] + x[0], x[5]) for x in sg["samples"] if len(x) > 5]
        if len(pts) < 2:
            continue
        ts, cs = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        mine = [e for e in evs if e["pid"] == sg["pid"]]
        starts = {e["stage"]: e["t"] for e in mine if e["event"] == "start"}
        for e in mine:
            if e["event"] == "done" and e["stage"] in starts:
                out[e["stage"]] = float(np.interp(e["t"], ts, cs) - np.interp(starts[e["stage"]], ts, cs))
    return out


def stats_size(state: dict) -> float:
    """GiB of the largest statistics file (one task, one block) any sampled process saw, or NaN."""
    seen = [sg.get("stats_file_bytes", 0) for e in state["runs"].values()
            for sg in [*e["segments"], *([e["reference"]] if "reference" in e else [])]]
    return max(seen, default=0) / GIB or float("nan")


def rss_by_stage(seg: list[dict], evs: list[dict]) -> dict[str, float]:
    """The largest RSS sampled (every second) while a stage of each kind ran, GiB."""
    out: dict[str, float] = {}
    for sg in seg:
        if "started_at" not in sg:
            continue
        mine = [e for e in evs if e["pid"] == sg["pid"]]
        starts = {e["stage"]: e["t"] for e in mine if e["event"] == "start"}
        for e in mine:
            if e["event"] == "done" and e["stage"] in starts:
                kind = e["stage"].split("/")[0]
                during = [x[1] for x in sg["samples"] if starts[e["stage"]] <= sg["started_at"] + x[0] <= e["t"]]
                if during:
                    out[kind] = max(out.get(kind, 0.0), max(during))
    return out


def rss_jumps(recs: dict[str, dict]) -> list[tuple[str, float]]:
    """(stage, peak RSS so far) at each stage that raised its process's peak, in the order they finished."""
    out, peak = [], 0.0
    for r in sorted(recs.values(), key=lambda r: r["finished_at"]):
        if r["peak_rss_mib"] > peak:
            peak = r["peak_rss_mib"]
            out.append((r["stage"], peak / 1024))
    return out


def fmt_samples(samples: list, every: float) -> list[list[float]]:
    out, nxt = [], 0.0
    for s in samples:
        if s[0] >= nxt:
            out.append(s)
            nxt = s[0] + every
    if samples and out[-1] is not samples[-1]:
        out.append(samples[-1])
    return out


def mean_load(seg: list[dict]) -> float:
    loads = [x[4] for sg in seg for x in sg["samples"] if len(x) > 4]
    return sum(loads) / len(loads) if loads else float("nan")


def quieter(ref: dict, seg: list[dict]) -> bool:
    return mean_load([ref]) < mean_load(seg)


def block_table(n: int, recs: dict, seg: list[dict], evs: list[dict], K: int, fwd: float, fwd_cpu: float,
                rate: float) -> list[str]:
    """Per-block stage seconds (from the records), CPU seconds (sampled), the floor and the ratios, then merge, prepare
    and the extrapolation to every block."""
    L = SHAPE["num_hidden_layers"]
    cpu = stage_cpu(seg, evs)
    lines = ["", "| block | Gram (s) | solve (s) | propagate (s) | block wall (s) | block CPU (s) | floor (s) "
             "| wall / floor | CPU / floor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    totals, cpu_blocks = [], []
    for k in range(K):
        r = per_block(recs, k)
        total = r["gram"] + r["solve"] + r["propagate"]
        passes = 2 if k == L - 1 else 3  # the last block's output is not propagated
        floor = passes * n * fwd + r["gram_flops"] / rate
        floor_cpu = passes * n * fwd_cpu + r["gram_flops"] / rate
        mine = block_stages(n, k, k)[:-n] if k == L - 1 else block_stages(n, k, k)
        used = sum(cpu[st] for st in mine) if all(st in cpu for st in mine) else None
        totals.append((total, floor))
        if used is not None:
            cpu_blocks.append((used, floor_cpu))
        lines.append(f"| {k} | {r['gram']:.1f} | {r['solve']:.1f} | {r['propagate']:.1f} | {total:.1f} | "
                     + (f"{used:.1f}" if used is not None else "–") + f" | {floor:.1f} | {total / floor:.2f} | "
                     + (f"{used / floor_cpu:.2f}" if used is not None else "–") + " |")
    merge = recs.get("merge", {}).get("seconds", float("nan"))
    prepare = sum(r["seconds"] for s, r in recs.items() if s.startswith("prepare/"))
    mean = sum(t for t, _ in totals) / max(1, len(totals))
    mean_floor = sum(f for _, f in totals) / max(1, len(totals))
    assemble = recs.get("assemble", {}).get("seconds")
    lines += ["", f"Merge {merge:.1f} s, prepare {prepare:.1f} s (all tasks), assemble "
              + (f"{assemble:.1f} s" if assemble is not None else "not run") + ". "]
    if K == L:  # the whole model: measured, stage records summed
        stages = merge + prepare + sum(t for t, _ in totals) + (assemble or 0.0)
        lines[-1] += (f"**Measured**, all {L} blocks: the stages sum to {stages / 60:.0f} min (merge, prepare, blocks, "
                      f"assemble), against a floor of {sum(f for _, f in totals) / 60:.0f} min for the blocks"
                      + (f"; in CPU seconds {sum(c for c, _ in cpu_blocks) / 60:.0f} min for the {len(cpu_blocks)} "
                         f"blocks sampled, against {sum(f for _, f in cpu_blocks) / 60:.0f} min."
                         if cpu_blocks else "."))
    else:
        lines[-1] += (
            f"**Extrapolated** (not measured) to all {L} blocks: merge + prepare + {L} × {mean:.1f} s "
            f"(mean measured block) = {(merge + prepare + L * mean) / 60:.0f} min without assemble; the floor for "
            f"{L} blocks ≈ {L * mean_floor / 60:.0f} min."
            + (f" In CPU seconds (less dependent on the other jobs): {L} × "
               f"{sum(c for c, _ in cpu_blocks) / len(cpu_blocks):.0f} s = "
               f"{L * sum(c for c, _ in cpu_blocks) / len(cpu_blocks) / 60:.0f} min for the blocks, against a "
               f"CPU floor of {L * sum(f for _, f in cpu_blocks) / len(cpu_blocks) / 60:.0f} min."
               if cpu_blocks else ""))
    lines.append("")
    return lines


def report(state: dict, args: argparse.Namespace) -> str:
    fwd, fwd_cpu = state["floor"]["block_forward_s"]["wall"], state["floor"]["block_forward_s"]["cpu"]
    rate = state["floor"]["matmul_flops"]
    L = SHAPE["num_hidden_layers"]
    specs = tensor_specs(llama_config())
    shards = shard_plan(specs)
    params = sum(math.prod(shape) for _, shape in specs)
    shard_gb = [sum(math.prod(shape) * 2 for _, shape in sh) for sh in shards]
    lines = [
        f"# FeatCal on a Llama-3.2-3B-shaped model: {', '.join(state['runs'])} experts, CPU, one thread",
        "",
        f"Machine: {state['machine']}; {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB RAM, "
        f"no swap. Date: {time.strftime('%Y-%m-%d')}. Invocations that produced these figures (each resumes from "
        "the state the previous ones left in WORK/results.json): " + "; ".join(f"`{c}`" for c in state["commands"])
        + ". Runs: `featcal run --no-prefect --skip-disk-check` in a child process, runtime.threads 1"
        + "".join(f", runtime.{k} {v}" for k, v in state.get("runtime", {}).items()) + ".",
        "",
        f"Shape: LlamaForCausalLM, hidden 3072, intermediate 8192, 28 blocks, 24 heads / 8 key-value heads (head dim "
        f"128), vocabulary 128256, tied embeddings, rope θ 500000 (default rope, no llama3 scaling); "
        f"{params / 1e9:.2f} B parameters, bf16, {state['model_gib']:.2f} GiB per model in {len(shards)} safetensors "
        f"shards of {', '.join(f'{b / 1e9:.2f}' for b in shard_gb)} GB (the first holds the embedding alone). "
        f"Random weights (N(0, 0.02), norms 1; expert = base + 0.002·N(0, 1)). The embedding shard is one "
        f"file hard-linked into every expert: {state['models_on_disk_gib']:.1f} GiB on disk for the base and the "
        f"experts, {state['models_read_gib']:.1f} GiB as the readers see them (this "
        f"machine has {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB of RAM). Calibration: "
        f"{args.examples} examples × {TOKENS} tokens per task (random token ids, BOS first, no padding), one batch; "
        f"precision {args.precision}.",
        "",
        f"Floor, measured in the same invocation: one block forward over one task's {args.examples} × {TOKENS} "
        f"tokens takes {fwd:.2f} s wall, {fwd_cpu:.2f} s CPU ({args.precision}, best of 3); the method needs three per "
        f"task and block (expert and merged in the Gram stage, calibrated in propagate), plus the Gram FLOPs the "
        f"records count at {rate / 1e9:.0f} GFLOP/s (matmul rate measured here, best of 5): "
        "benchmarks/pipeline_cost.py's definition. The 2 cores were shared with other people's jobs (load average "
        "in the tables below): wall times are inflated by that, so each block also gets its CPU seconds (the run "
        "process's CPU time, sampled every second, between each stage's start and done events), compared with the "
        "floor in CPU seconds (the Gram part stays wall-based).",
        "",
    ]
    for n_str, e in state["runs"].items():
        n, recs = int(n_str), e["records"]
        K = e["complete_to"]
        lines += [f"## {n} experts", ""]
        seg = e["segments"]
        lines.append("Processes: " + "; ".join(
            f"{s['role']} — {s['wall_s']:.0f} s wall"
            + (f" ({s['cpu_s']:.0f} s CPU)" if "cpu_s" in s else "")
            + f", stopped: {s['stopped']}, peak RSS {s['maxrss_gib']:.2f} GiB, "
            f"blocks done after it {s['blocks_after']}" for s in seg) + ".")
        lines += block_table(n, recs, seg, e.get("events", []), K, fwd, fwd_cpu, rate)
        peak = max(s["maxrss_gib"] for s in seg)
        sampled = max((x[1] for s in seg for x in s["samples"]), default=0.0)
        plan, now = e["plan"], e.get("plan_now", e["plan"])
        plans = (f"{now['estimated_peak_ram_gib']} GiB (this checkout's flows/plan.py; the run itself started under "
                 f"a plan that said {plan['estimated_peak_ram_gib']} GiB)"
                 if now["estimated_peak_ram_gib"] != plan["estimated_peak_ram_gib"] else
                 f"{plan['estimated_peak_ram_gib']} GiB")
        lines.append(f"Peak RSS: {peak:.2f} GiB (ru_maxrss of the run process; sampled every second over its "
                     f"process tree: {sampled:.2f} GiB). `featcal plan` estimates {plans}. "
                     "Stages that raised the peak, in order: " + ", ".join(
                         f"{st} {g:.2f}" for st, g in rss_jumps(recs)) + " (GiB). Largest RSS sampled while each "
                     "kind of stage ran: " + ", ".join(f"{k} {v:.2f}" for k, v in rss_by_stage(
                         seg, e.get("events", [])).items()) + " GiB.")
        disk_peak = max((x[2] for s in seg for x in s["samples"]), default=0.0)
        blocks_b = [v for kk, v in e["left_on_disk"].items() if kk.startswith("blocks/")]
        left = e["left_on_disk"]
        merged_gib = sum(v for kk, v in left.items() if kk.startswith("merged/")) / GIB
        lines += ["", f"Disk: the run directory peaked at {disk_peak:.2f} GiB over these {K} block(s). Left in it "
                  "when stopped: " + ", ".join([f"merged/ {merged_gib:.2f} GiB"] + [
                      f"{kk} {v / GIB:.3f} GiB" for kk, v in left.items()
                      if not kk.startswith("merged/") and v > 2**20])
                  + f". Released while running ({len(e['released'])} markers in records/released): "
                  + ", ".join(e["released"]) + "."]
        if blocks_b:
            per = sum(blocks_b) / len(blocks_b) / GIB
            stats_gib = stats_size(state)
            full = 2 * merged_gib + L * per + n * stats_gib
            lines.append(
                f"One solved block file: {per:.3f} GiB (kept until assemble, by design); one task's statistics for "
                f"one block: {stats_gib:.2f} GiB (all {n} tasks' live at once, from the first Gram of a block to its "
                f"solve). **Extrapolated** peak of a whole run (merged + calibrated checkpoints, all {L} solved "
                f"blocks, one block's statistics): {full:.1f} GiB. `featcal plan` estimates "
                f"{now['estimated_disk_gib']} GiB" + (f" (before this checkout's fix: {plan['estimated_disk_gib']} GiB)"
                                                     if now["estimated_disk_gib"] != plan["estimated_disk_gib"] else "")
                + ".")
        lines += ["", "Disk and memory over time (seconds since the process started):", "",
                  "| process | t (s) | RSS (GiB) | run dir (GiB) | free disk (GiB) | load average (1 min) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for s in seg:
            for x in fmt_samples(s["samples"], 60.0):
                load = f"{x[4]:.1f}" if len(x) > 4 else "–"
                lines.append(f"| {s['role']} | {x[0]:.0f} | {x[1]:.2f} | {x[2]:.2f} | {x[3]:.1f} | {load} |")
        if "kill" in e:
            kd = e["kill"]
            lines += ["", f"kill -9: the run was sent SIGKILL {kd['delay_s']:.1f} s after stage `{kd['stage']}` "
                      f"started (seeded random choice; stopped: {kd['stopped']}); in progress then: "
                      f"{', '.join(kd['in_progress']) or 'none'}; blocks done before: {kd['blocks_before']}, after the "
                      f"rerun: {kd['blocks_after']}. Stages finished before the kill and run again by the rerun: "
                      f"{', '.join(kd['redone']) or 'none'}."]
        if "reference" in e:
            ref = e["reference"]
            c = ref["compare"]
            lines += ["", f"Bit-identity: an uninterrupted run of the same config to {c['blocks']} block(s) "
                      f"({ref['wall_s']:.0f} s wall, {ref.get('cpu_s', float('nan')):.0f} s CPU, peak RSS "
                      f"{ref['maxrss_gib']:.2f} GiB) against the killed-and-resumed run: {c['tensors']} solved "
                      "tensors compared with torch.equal, "
                      + ("all equal." if c["equal"] else f"differing: {', '.join(c['differing'])}.")
                      + " That uninterrupted run, stage by stage (it ran while the machine was "
                      f"{'quieter' if quieter(ref, seg) else 'as busy'}: load average "
                      f"{mean_load([ref]):.1f} against {mean_load(seg):.1f} for the runs above):"]
            lines += block_table(n, ref["records"], [ref], ref.get("events", []), c["blocks"], fwd, fwd_cpu, rate)
            lines += ["Largest RSS sampled while each kind of stage ran: " + ", ".join(
                f"{k} {v:.2f}" for k, v in rss_by_stage([ref], ref.get("events", [])).items()) + " GiB.", ""]
        lines.append("")
    return "\n".join(lines) + "\n"


# ---- the whole benchmark --------------------------------------------------------------------------
def block_stages(n: int, first: int, last: int) -> list[str]:
    out = []
    for k in range(first, last + 1):
        out += [f"gram/l{k:02d}/task{t}" for t in range(n)] + [f"solve/l{k:02d}"]
        out += [f"propagate/l{k:02d}/task{t}" for t in range(n)]
    return out


def runtime_of(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime fields the runs set beyond threads and precision."""
    return {**({"keep_freed_memory": True} if args.keep_freed_memory else {}), **dict(args.runtime)}


def run_experts(args: argparse.Namespace, state: dict, n: int) -> None:
    """Run (or resume) the N-expert run to --blocks blocks; with --kill-run N, kill it once at a random moment and
    resume it, keep its solved blocks, and (now or in a later invocation) compare them with an uninterrupted run."""
    work = args.work
    config = config_file(work, n, args.examples, args.precision, runtime=runtime_of(args))
    entry = state["runs"].setdefault(str(n), {"segments": [], "config": str(config)})
    run_dir = work / "runs" / f"experts{n}"
    saved = work / "saved" / f"experts{n}"
    min_free = args.min_free_gb * 1e9 / GIB
    if entry.get("complete_to", 0) < args.blocks:
        entry["plan"] = plan_of(config)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        if n == args.kill_run and "kill" not in entry:
            rng = random.Random(args.kill_seed)
            first = blocks_done(run_dir, n) if run_dir.is_dir() else 0
            # A Gram or solve stage (each takes a minute or more here), and a moment within its first 30 s.
            stage = rng.choice([st for st in block_stages(n, first, args.blocks - 1) if not st.startswith("prop")])
            delay = rng.uniform(0.0, 30.0)
            killed = segment(config, run_dir, n, args.blocks, min_free, (stage, delay))
            entry["segments"].append({**killed, "role": "killed"})
            save(args, state)
            resumed = segment(config, run_dir, n, args.blocks, min_free)
            entry["segments"].append({**resumed, "role": "resumed"})
            entry["kill"] = {"stage": stage, "delay_s": delay, "stopped": killed["stopped"],
                             "blocks_before": killed["blocks_after"], "blocks_after": resumed["blocks_after"],
                             "redone": redone(run_dir, killed["pid"], resumed["pid"]),
                             "in_progress": in_progress(run_dir, killed["pid"])}
        else:
            entry["segments"].append({**segment(config, run_dir, n, args.blocks, min_free), "role": "run"})
        entry["records"] = records(run_dir)
        entry["events"] = events(run_dir)
        entry["released"] = sorted(p.stem for p in (run_dir / "records" / "released").glob("*.json"))
        entry["left_on_disk"] = {str(p.relative_to(run_dir)): du(p) for p in sorted(run_dir.glob("*/*"))}
        entry["complete_to"] = blocks_done(run_dir, n)
        if n == args.kill_run:
            saved.mkdir(parents=True, exist_ok=True)
            for f in (run_dir / "blocks").glob("l*.safetensors"):
                shutil.copy2(f, saved / f.name)
        save(args, state)
        if not args.keep_runs:
            shutil.rmtree(run_dir)
    if n == args.kill_run and args.reference_blocks and "reference" not in entry:
        shutil.rmtree(run_dir, ignore_errors=True)  # room for the reference run
        ref_dir = work / "runs" / f"experts{n}-reference"
        ref = segment(config, ref_dir, n, args.reference_blocks, min_free)
        entry["reference"] = {**ref, "records": records(ref_dir), "events": events(ref_dir),
                              "compare": compare_blocks(saved, ref_dir / "blocks", args.reference_blocks)}
        save(args, state)
        shutil.rmtree(ref_dir)


def in_progress(run_dir: Path, pid: int) -> list[str]:
    """Stages process `pid` started and did not finish (what the kill interrupted)."""
    ev = [e for e in events(run_dir) if e["pid"] == pid]
    started = {e["stage"] for e in ev if e["event"] == "start"}
    return sorted(started - {e["stage"] for e in ev if e["event"] == "done"})


def save(args: argparse.Namespace, state: dict) -> None:
    (args.work / "results.json").write_text(json.dumps(state, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/work/bench_large"))
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 5])
    parser.add_argument("--blocks", type=int, default=2, help="blocks to calibrate per run (28: the whole model)")
    parser.add_argument("--examples", type=int, default=8, help="calibration examples per task (× 128 tokens)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--keep-freed-memory", action="store_true", help="runtime.keep_freed_memory: true in the runs")
    parser.add_argument("--runtime", nargs="+", default=[], type=runtime_field, metavar="KEY=VALUE",
                        help="more runtime fields for the runs (row_statistics=off, ...)")
    parser.add_argument("--kill-run", type=int, help="the expert count whose run is killed (-9) once and resumed")
    parser.add_argument("--kill-seed", type=int, default=0)
    parser.add_argument("--reference-blocks", type=int, default=1,
                        help="blocks of an uninterrupted run to compare the resumed run's weights with (0: none)")
    parser.add_argument("--min-free-gb", type=float, default=5.0, help="stop a run when free disk falls under this")
    parser.add_argument("--keep-runs", action="store_true", help="keep the run directories (default: deleted)")
    parser.add_argument("--clean", action="store_true", help="delete the models, data and runs at the end")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write --out again from WORK/results.json (figures of earlier invocations)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / "results.json"
    state = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    if args.report_only:
        args.out.write_text(report(state, args))
        print(args.out.read_text())
        return
    state["command"] = "python -m benchmarks.large_model " + " ".join(sys.argv[1:])
    state["runtime"] = runtime_of(args)
    state.setdefault("commands", []).append(f"{time.strftime('%H:%M UTC', time.gmtime())} {state['command']}")
    state.setdefault("build_s", {}).update(build_inputs(args.work, max(args.experts), args.examples))
    state["models_on_disk_gib"] = du(args.work / "models") / GIB
    state["model_gib"] = sum(f.stat().st_size for f in (args.work / "models" / "base").glob("*.safetensors")) / GIB
    state["models_read_gib"] = state["model_gib"] * len(list((args.work / "models").iterdir()))
    save(args, state)
    for n in args.experts:
        run_experts(args, state, n)
    # The floor after the runs, in this process (the runs are children: their RSS does not include this one's).
    state["floor"] = {"block_forward_s": block_forward_seconds(args.work, args.examples, args.precision),
                      "matmul_flops": matmul_rate(1, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision],
                                                  "cpu")}
    state["machine"] = machine()
    for n in state["runs"]:  # this checkout's estimates (a run's own entry keeps the plan it started under)
        state["runs"][n]["plan_now"] = plan_of(config_file(args.work, int(n), args.examples, args.precision,
                                                           runtime=runtime_of(args)))
    save(args, state)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(state, args))
    print(args.out.read_text())
    if args.clean:
        for sub in ("models", "data", "runs", "saved"):
            shutil.rmtree(args.work / sub, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:  # inputs only: build WORK EXPERTS EXAMPLES
        build_inputs(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
