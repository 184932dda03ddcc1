"""How much of a run's stage time is host overhead: everything that is not a model forward or a Gram/solve product
(reads, writes, encode/decode, copies, Python between steps), measured by profiling, for one or more checkouts side
by side in one invocation.

    python -m benchmarks.host_overhead --compare-with /tmp/featcal-before --threads 1 \
        --out benchmarks/results/host_overhead.md

Two runs per checkout, each a fresh `run_pipeline` (no Prefect, evaluation off) in a child process whose import path
starts with that checkout: the ViT-B/32 shape (`pipeline_cost.py`'s synthetic CLIP vision model, 8 experts × 32
examples) and the tiny example's BERT (`featcal example`). Each child runs under cProfile. cProfile rather than the
torch profiler: the question is where the *Python* side's time goes between the products, which cProfile sees call by
call with the exact nesting (callers and cumulative times), while the torch profiler sees operators and would need
every read, write and copy named by hand. Its cost: every Python call is charged a little more, so the overhead share
it reports is an upper bound; the table also gives the same run's stage seconds without the profiler's hooks on the
products (its records) to show the distortion.

Compute is the cumulative time of: the block forwards (`run_block`, `run_head_side`), the embeddings (`embed_at`,
and `embed` where no `embed_at` called it), the Gram products (`accumulate`), and the solves (`solve_linear`,
`solve_norm`) less what they spend reading their inputs (`_task_stats`, the statistics files; `solve_layout`, the
checkpoints' tensors). Host overhead is the rest of the stages' time (`tasks.record.execute`, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.10  # issue 50 §5: host overhead at most 10 % of stage time
FORWARDS = ("run_block", "run_head_side", "embed_at")
SOLVES = ("solve_linear", "solve_norm")
SOLVE_READS = ("_task_stats", "solve_layout")

Func = tuple[str, int, str]


def _cumulative(stats: dict[Func, Any], names: tuple[str, ...], under: str | None = None) -> float:
    """Cumulative seconds of the functions called `names` in the project's code; with `under`, only their calls
    from a function called `under` (pstats keeps each caller's share)."""
    total = 0.0
    for (path, _, name), (_, _, _, cumulative, callers) in stats.items():
        if name not in names or "site-packages" in path:
            continue
        total += cumulative if under is None else sum(c[3] for f, c in callers.items() if f[2] == under)
    return total


def split(stats: dict[Func, Any]) -> dict[str, float]:
    """Stage seconds and their parts (forwards, Gram products, solve products) from a profile's raw table."""
    embed_alone = _cumulative(stats, ("embed",)) - _cumulative(stats, ("embed",), under="embed_at")
    forwards = _cumulative(stats, FORWARDS) + embed_alone
    gram = _cumulative(stats, ("accumulate",))
    solve = _cumulative(stats, SOLVES) - _cumulative(stats, SOLVE_READS)
    stages = _cumulative(stats, ("execute",))
    return {"stages_s": stages, "forwards_s": forwards, "gram_s": gram, "solve_s": solve,
            "overhead_s": stages - forwards - gram - solve}


def child(config: Path, run_dir: Path, out: Path) -> None:
    """One profiled run of the checkout first on this process's import path; its split and its records' seconds."""
    from featcal.config import load_config
    from flows.pipeline import run_pipeline

    cfg = load_config(str(config), [])
    profile = cProfile.Profile()
    profile.enable()
    run_pipeline(cfg, run_dir)
    profile.disable()
    raw = pstats.Stats(profile).stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    records = [json.loads(p.read_text()) for p in (run_dir / "records").glob("*.json")]
    recorded = sum(r["seconds"] for r in records if "stage" in r)
    out.write_text(json.dumps({**split(raw), "recorded_s": recorded, "code": os.environ.get("PYTHONPATH", "")}))


def profiled_run(code: Path, config: Path, run_dir: Path, threads: int) -> dict[str, float]:
    """`child` in a process of its own with `code` first on the import path and `threads` threads."""
    out = run_dir.with_suffix(".json")
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    subprocess.run([sys.executable, __file__, "--child", str(config), str(run_dir), str(out)], cwd=code, env=env,
                   check=True)
    return json.loads(out.read_text())


def inputs(work: Path, threads: int) -> dict[str, Path]:
    """The two runs' configs: ViT-B/32 8 × 32 and the tiny example's BERT, evaluation off, `threads` threads."""
    import yaml

    from benchmarks.pipeline_cost import build_inputs, config_file
    from featcal_bench.example import build_tiny_example

    vit = work / "vit-b32"
    build_inputs(vit, "vit-b32", 8, 32)
    tiny = build_tiny_example(work / "tiny", ("bert",))
    raw = yaml.safe_load((tiny / "bert" / "example.yaml").read_text())
    raw["evaluation"] = {"enabled": False}
    raw.setdefault("runtime", {})["threads"] = threads
    tiny_config = tiny / "bert" / "host_overhead.yaml"
    tiny_config.write_text(yaml.safe_dump(raw))
    return {"ViT-B/32 8 × 32": config_file(vit, 8, 32, {"threads": str(threads)}), "tiny example (BERT)": tiny_config}


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| run | code | stages, profiled (s) | forwards (s) | Gram products (s) | solve products (s) | "
             "host overhead (s) | host overhead share | stages, records (s) |", "|---|---|" + "---:|" * 7]
    for r in rows:
        lines.append(f"| {r['run']} | {r['label']} | {r['stages_s']:.1f} | {r['forwards_s']:.1f} | {r['gram_s']:.1f} "
                     f"| {r['solve_s']:.1f} | {r['overhead_s']:.1f} | {r['overhead_s'] / r['stages_s']:.1%} "
                     f"| {r['recorded_s']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=3, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compare-with", type=Path, action="append", default=[],
                        help="another checkout of this project to profile beside this one (before a change, say)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-host-overhead"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.out is None:
        parser.error("--out is required")
    from benchmarks.common import cpu_line
    from flows.pipeline import machine

    configs = inputs(args.work, args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    codes = [(f"`{c.name}`", c.resolve()) for c in args.compare_with] + [("this checkout", ROOT)]
    rows: list[dict[str, Any]] = []
    for run, config in configs.items():
        for i, (label, code) in enumerate(codes):
            run_dir = args.work / f"run-{stamp}-{run.split()[0].replace('/', '')}-{i}"
            print(f"{run}: {label} …", flush=True)
            rows.append({"run": run, "label": label, **profiled_run(code, config, run_dir, args.threads)})
    ours = [r for r in rows if r["label"] == "this checkout"]
    worst = max(r["overhead_s"] / r["stages_s"] for r in ours)
    lines = [
        "# Host overhead: the share of stage time that is not model forwards or Gram/solve products",
        "",
        f"Machine: {machine()}; {cpu_line()}. Shared with other jobs while this ran (2 cores, 4 other helpers): "
        "seconds are wall, the shares are what to read. Date: " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        + f". {args.threads} thread(s), runner: direct (no Prefect), evaluation off.",
        "",
        f"Command: `python -m benchmarks.host_overhead {' '.join(sys.argv[1:])}`",
        "",
        *table(rows),
        "",
        f"- Goal (issue 50 §5): host overhead ≤ {GOAL:.0%} of stage time: {worst:.1%} (this checkout, worse run) — "
        + ("met" if worst <= GOAL else "missed"),
        "",
        "How: each run is one `run_pipeline` under cProfile in a child process. Forwards = cumulative time of the "
        "block forwards and embeddings; Gram products = `featcal.statistics.accumulate`; solve products = the "
        "method's `solve_linear`/`solve_norm` less their reads (`_task_stats`, `solve_layout`); host overhead = "
        "the stages' cumulative time (`tasks.record.execute`) less those three. cProfile charges every Python "
        "call, so the profiled stage time is above the records' (last column, the same run's own timing) and the "
        "share is an upper bound.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
