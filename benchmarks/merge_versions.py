"""The merge stage of two checkouts of this project on one config, alternating, each run stopped once its merge is
recorded: the merge record's seconds and the run process's CPU seconds up to then (preflight scan included).

    python benchmarks/large_model.py ...   # or any config; here the Llama-3.2-3B shape of large_model.py
    git worktree add /tmp/before HEAD~1
    python benchmarks/merge_versions.py --before /tmp/before --after . --config WORK/config-expert-2-8-bf16.yaml \
        --work /tmp/merge-runs --repeats 2 --out benchmarks/results/merge_versions_llama.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.code_versions import commit_of  # noqa: E402
from benchmarks.pipeline_cost import child_env  # noqa: E402
from benchmarks.solve_precision import cpu_line  # noqa: E402


def merge_run(code: Path, config: Path, run_dir: Path) -> dict[str, float]:
    """One `featcal run` of the checkout at `code`, killed once records/merge.json appears."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir), "--no-prefect"]
    proc = subprocess.Popen(cmd, cwd=code, env=child_env(1, code), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    record = run_dir / "records" / "merge.json"
    try:
        while not record.is_file():
            if proc.poll() is not None:
                raise SystemExit(f"{code}: the run ended (exit {proc.returncode}) before its merge was recorded")
            time.sleep(0.2)
        with open(f"/proc/{proc.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime of the run process
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = json.loads(record.read_text())["seconds"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"merge_s": seconds, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    rows, results = [], {"before": [], "after": []}
    for repeat in range(1, args.repeats + 1):
        for side in ("before", "after"):
            got = merge_run(getattr(args, side).resolve(), args.config.resolve(), args.work / side)
            results[side].append(got)
            rows.append(f"| {side} ({repeat}) | {got['merge_s']:.1f} | {got['cpu_s']:.1f} |")
            print(rows[-1], flush=True)
    best = {side: min(r["merge_s"] for r in rs) for side, rs in results.items()}
    lines = [f"# The merge stage of two checkouts — `{args.config.name}`", "",
             f"Machine: {cpu_line()}, Python {platform.python_version()}. Date: "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. One after another, alternating, one thread. "
             f"Before: {commit_of(args.before)}; after: {commit_of(args.after)}. Command: `python "
             f"benchmarks/merge_versions.py --before {args.before} --after {args.after} --config {args.config} "
             f"--work {args.work} --repeats {args.repeats} --out {args.out}`", "",
             "| run | merge stage (s) | run process CPU until then (s, with the preflight scan) |", "|---|---:|---:|",
             *rows, "", f"Best merge stage: before {best['before']:.1f} s, after {best['after']:.1f} s "
             f"({best['before'] / best['after']:.2f}× faster).", ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
