"""Orchestration overhead: the same FeatCal run with the stage functions called directly in one process, and as
the Prefect flow in ephemeral mode, against a Prefect server, and on a local Dask cluster (2 workers).

    python -m benchmarks.orchestration --out benchmarks/results/orchestration.md

Two workloads: the tiny example (BERT 3 layers, hidden 64, 3 tasks) and a mid-sized one with the shape of
MiniLM-L6-H384 (6 layers, hidden 384, 12 heads, FFN 1536; 4 tasks). No MiniLM checkpoint can be downloaded
here, so the mid-sized models are built from a transformers config: a random base and experts = base + small
seeded perturbations, data = random token ids; timing does not depend on what the weights learned.

Each measurement runs in a fresh process into a fresh run directory (every stage computed) and times the call
alone (imports excluded). The Prefect server is started once beforehand, as a user's would be; the ephemeral
server and the Dask cluster are started inside the timed call, as they are on every run. The table splits the
Prefect modes' wall time into start-up (call → first stage starts), time inside the stages, artifact
publishing, and the rest (task-run bookkeeping per stage).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT

MODES = ("direct", "ephemeral", "server", "dask")
MODE_LABEL = {"direct": "stage functions, one process", "ephemeral": "Prefect, ephemeral mode",
              "server": "Prefect, `featcal server`", "dask": "Prefect + Dask LocalCluster (2 workers × 1 thread)"}
MID = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
           max_position_embeddings=128)
MID_TASKS, MID_EXAMPLES, MID_EVAL, MID_TOKENS, MID_VOCAB = 4, 32, 64, 64, 1000


# ---- inputs -------------------------------------------------------------------------------------------------------
def build_mid(work: Path) -> Path:
    """Base, 4 experts and per-task token data with MiniLM-L6-H384's shape; returns the config file."""
    import numpy as np
    import torch
    import yaml
    from datasets import Dataset, DatasetDict
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    config = work / "example.yaml"
    if config.is_file():
        return config
    work.mkdir(parents=True, exist_ok=True)
    vocab = work / "vocab.txt"
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join([*special, *(f"w{i}" for i in range(MID_VOCAB - 5))]))
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    cfg = BertConfig(vocab_size=MID_VOCAB, **MID)
    torch.manual_seed(0)
    base = BertModel(cfg)
    base.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    tasks = [f"task{t}" for t in range(MID_TASKS)]
    raw = {"base": "base", "experts": {}, "merge": {"method": "task_arithmetic", "scaling": 0.3},
           "calibration": {"data": {}, "examples_per_task": MID_EXAMPLES, "batch_size": 16, "seed": 42},
           "evaluation": {"batch_size": 32, "data": {}}}
    for i, t in enumerate(tasks):
        g = torch.Generator().manual_seed(100 + i)
        expert = BertForSequenceClassification(BertConfig(vocab_size=MID_VOCAB, num_labels=2, **MID))
        state = expert.state_dict()
        for k, v in base.state_dict().items():
            state[f"bert.{k}"] = v + 0.02 * v.abs().mean() * torch.randn(v.shape, generator=g)
        expert.load_state_dict(state)
        expert.save_pretrained(work / "experts" / t)
        tokenizer.save_pretrained(work / "experts" / t)

        def split(n: int, rng: np.random.Generator) -> Dataset:
            lengths = rng.integers(MID_TOKENS // 2, MID_TOKENS + 1, n)
            ids = [[2, *rng.integers(5, MID_VOCAB, n_tok - 2).tolist(), 3] + [0] * (MID_TOKENS - n_tok)
                   for n_tok in lengths]
            mask = [[1] * n_tok + [0] * (MID_TOKENS - n_tok) for n_tok in lengths]
            labels = rng.integers(0, 2, n).tolist()
            return Dataset.from_dict({"input_ids": ids, "attention_mask": mask, "label": labels})

        rng = np.random.default_rng(i)
        splits = {"calibration": split(MID_EXAMPLES, rng), "test": split(MID_EVAL, rng)}
        DatasetDict(splits).save_to_disk(work / "data" / t)
        raw["experts"][t] = f"experts/{t}"
        raw["calibration"]["data"][t] = {"path": f"data/{t}", "split": "calibration"}
        raw["evaluation"]["data"][t] = {"path": f"data/{t}", "split": "test", "label_column": "label"}
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config


def tiny_config(tiny: Path) -> Path:
    if not (tiny / "bert" / "example.yaml").is_file():
        from featcal_bench.example import build_tiny_example

        build_tiny_example(tiny)
    return tiny / "bert" / "example.yaml"


# ---- one measurement (a fresh process) ---------------------------------------------------------------------------
def measure(mode: str, config: str, run_dir: str) -> dict:
    from featcal.config import load_config
    from flows import artifacts
    from storage.rundir import RunDir

    published = [0.0]

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                published[0] += time.perf_counter() - t
        return wrapper

    artifacts.LiveArtifacts.on_stage = timed(artifacts.LiveArtifacts.on_stage)
    artifacts.LiveArtifacts.finish = timed(artifacts.LiveArtifacts.finish)
    started_at = time.time()
    t0 = time.perf_counter()
    if mode == "direct":
        from flows.pipeline import run_pipeline

        run_pipeline(load_config(config), run_dir)
    else:
        from flows.prefect_flow import featcal_flow

        kw = {"runner": "dask", "workers": 2} if mode == "dask" else {}
        state = featcal_flow(config, run_dir, [], return_state=True, **kw)
        assert state.is_completed(), state
    wall = time.perf_counter() - t0
    events = RunDir(run_dir).events()
    stage_seconds = sum(e.get("seconds", 0.0) for e in events if e["event"] == "done")
    first_start = min(e["t"] for e in events if e["event"] == "start")
    return {"mode": mode, "wall": wall, "stages": sum(e["event"] == "done" for e in events),
            "stage_seconds": stage_seconds, "startup": first_start - started_at, "artifacts": published[0],
            "workers": len({e["pid"] for e in events if e["event"] == "start"}), "load": os.getloadavg()[0]}


def run_measurement(mode: str, config: Path, run_dir: Path, api_url: str | None) -> dict:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    if mode in ("server", "dask"):
        env["PREFECT_API_URL"] = api_url
    cmd = [sys.executable, "-m", "benchmarks.orchestration", "--measure", mode, str(config), str(run_dir)]
    out = subprocess.run(cmd, cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} on {config} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- report --------------------------------------------------------------------------------------------------------
def machine_and_date() -> str:
    import prefect

    from flows.pipeline import machine

    return f"{machine()}, prefect {prefect.__version__}, date {time.strftime('%Y-%m-%d')}"


def render(results: dict[str, list[dict]], about: dict[str, str]) -> str:
    lines = ["# Orchestration overhead", "", f"Machine: {machine_and_date()}.", "",
             "Each row: one run of the whole pipeline into a fresh run directory (every stage computed), in a fresh",
             "process, timing the call only. *Wall overhead*: wall time over the direct run's. The machine is shared",
             "(*load*: the 1-minute load average when the run ended, on 2 cores), so stage times themselves vary from",
             "run to run; *orchestration* = wall − time inside the stage functions isolates what the orchestration",
             "adds, and *overhead, stage-time corrected* = (orchestration − the direct run's) / direct wall.",
             "*Start-up*: from the call to the first stage starting (flow run creation; the ephemeral server or the",
             "Dask cluster starts inside it). *Artifacts*: publishing progress, block tables and the report to the UI.",
             "*Per stage*: orchestration less start-up and artifacts, per stage (task-run creation, state changes,",
             "result persistence, cache checks). On Dask the stages run on two workers at once, so only wall time",
             "compares.", ""]
    for workload, rows in results.items():
        direct = next(r for r in rows if r["mode"] == "direct")
        base_orch = direct["wall"] - direct["stage_seconds"]
        lines += [f"## {workload}", "", about[workload], "",
                  "| mode | wall s | wall overhead | in stages s | orchestration s | overhead, stage-time corrected "
                  "| start-up s | artifacts s | per stage ms | load |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            wall_over = f"{100 * (r['wall'] / direct['wall'] - 1):+.0f} %"
            if r["mode"] == "dask":
                orch = corrected = per_stage = "–"
            else:
                o = r["wall"] - r["stage_seconds"]
                orch, corrected = f"{o:.1f}", f"{100 * (o - base_orch) / direct['wall']:+.1f} %"
                per_stage = f"{1000 * (o - r['startup'] - r['artifacts']) / r['stages']:.0f}"
            lines.append(f"| {MODE_LABEL[r['mode']]} | {r['wall']:.1f} | {wall_over} | {r['stage_seconds']:.1f} "
                         f"| {orch} "
                         f"| {corrected} | {r['startup']:.1f} | {r['artifacts']:.1f} | {per_stage} | {r['load']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "orchestration.md")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "featcal-orchestration",
                        help="inputs are built here once and reused")
    parser.add_argument("--tiny", type=Path, help="the tiny example (default WORK/tiny; built if missing)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--measure", nargs=3, metavar=("MODE", "CONFIG", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    from flows import server

    work = args.work.resolve()
    workloads = {
        "tiny example": tiny_config((args.tiny or work / "tiny").resolve()),
        "mid-sized (MiniLM-L6-H384 shape, 4 tasks)": build_mid(work / "mid"),
    }
    about = {
        "tiny example": "BERT, 3 layers, hidden 64, 3 tasks, 64 calibration examples per task, "
                        "evaluation on 200 per task.",
        "mid-sized (MiniLM-L6-H384 shape, 4 tasks)":
            f"BERT built from a transformers config with MiniLM-L6-H384's shape (6 layers, hidden 384, 12 heads, FFN "
            f"1536), random weights, experts = base + 2 % seeded noise; {MID_TASKS} tasks, {MID_EXAMPLES} calibration "
            f"examples of ≤ {MID_TOKENS} tokens per task, evaluation on {MID_EVAL} per task.",
    }
    home = work / "home"
    info, _ = server.start(home, port=0)
    results: dict[str, list[dict]] = {}
    try:
        for name, config in workloads.items():
            results[name] = []
            for mode in args.modes:
                run_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
                row = run_measurement(mode, config, run_dir, info.api_url)
                print(f"{name:45s} {mode:10s} {row['wall']:7.1f} s  (stages {row['stage_seconds']:.1f} s, "
                      f"start-up {row['startup']:.1f} s)", flush=True)
                results[name].append(row)
    finally:
        server.stop(home)
    (work / "orchestration.json").write_text(json.dumps(results, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, about) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
