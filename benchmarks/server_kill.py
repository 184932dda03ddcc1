"""A run whose Prefect server is killed (mid-run, or as the flow run begins) against an undisturbed run, measured side
by side in one invocation.

    python -m benchmarks.server_kill --out benchmarks/results/server_kill.md [--example DIR] [--repeats 2]

Each repeat runs the tiny example without evaluation (built into a temporary directory unless --example names
one) three times, as a user would with `featcal server start` and `featcal run`: undisturbed; with the server
killed (SIGKILL to its process group) as soon as the second stage has finished; and with it killed as the flow run
begins, before any stage and before Prefect's log worker has sent a batch (its client does not retry a refused
connection until it has connected once). Each run gets a fresh server and run directory. Reported per case: the
process's wall time, the stages' span (first stage start to last stage end, from the run's events), the longest
wait between one stage's end and the next one's start, the slowest stage's ratio to the same stage in the
undisturbed run of the same repeat, the lines the run printed about the fault (or its last line, for a run that
failed before its first stage), Prefect's lines on the console, and whether the weights are the undisturbed run's
bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks.common import ROOT
from featcal_bench.example import build_tiny_example
from flows import server
from flows.pipeline import machine
from storage.atomic import digest
from storage.rundir import RunDir

CASES = {"undisturbed": None, "server killed": "[  2/", "server killed at the start": "Beginning flow run"}  # the
# line after which the server is killed: the second stage's progress line, Prefect's first line of the flow run
NOISE = ("Unable to connect", "EventsWorker", "Error logging to API", "Traceback", "Encountered retryable")


def run_once(config: Path, run_dir: Path, home: Path, kill_after: str | None) -> dict:
    info, _ = server.start(home, port=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update({"FEATCAL_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir)],
                            cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines, killed_at = [], None
    for line in proc.stdout:
        lines.append(line)
        if kill_after is not None and killed_at is None and kill_after in line:
            os.killpg(info.pid, signal.SIGKILL)
            killed_at = time.monotonic() - started
    code = proc.wait()
    wall = time.monotonic() - started
    if server.running(home) is not None:
        server.stop(home)
    events = RunDir(run_dir).events()
    if not events:  # the run failed before its first stage
        return {"code": code, "wall": wall, "killed_at": killed_at, "failed": lines[-1].strip() if lines else "",
                "noise": sum(any(n in line for n in NOISE) for line in lines), "fault_lines": []}
    starts = {e["stage"]: e["t"] for e in events if e["event"] == "start"}
    records = {str(p.relative_to(run_dir)): json.loads(p.read_text()) for p in (run_dir / "records").rglob("*.json")}
    seconds = {name: rec["seconds"] for name, rec in records.items() if isinstance(rec, dict) and "seconds" in rec}
    ends = [e["t"] for e in events if e["event"] == "done"] or [max(starts.values())]
    ordered = sorted((e["t"], e["event"]) for e in events if e["event"] in ("start", "done"))
    gaps = [b[0] - a[0] for a, b in zip(ordered, ordered[1:]) if a[1] == "done" and b[1] == "start"]
    return {"code": code, "wall": wall, "span": max(ends) - min(starts.values()), "killed_at": killed_at,
            "gap": max(gaps),
            "seconds": seconds, "weights": digest(run_dir / "calibrated" / "model.safetensors"),
            "fault_lines": [line.strip() for line in lines if "stopped answering" in line or "did not answer" in line],
            "noise": sum(any(n in line for n in NOISE) for line in lines)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--example", type=Path, help="an existing `featcal example build` directory")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.example or build_tiny_example(Path(tmp) / "example")
        raw = yaml.safe_load((root / "bert" / "example.yaml").read_text())
        raw["evaluation"] = {"enabled": False}
        config = root / "bert" / "no-eval.yaml"  # beside example.yaml: its paths are relative to it
        config.write_text(yaml.safe_dump(raw))
        results: dict[str, list[dict]] = {case: [] for case in CASES}
        for r in range(args.repeats):
            for c, (case, kill_after) in enumerate(CASES.items()):
                out = run_once(config, Path(tmp) / f"run-{r}-{c}", Path(tmp) / f"home-{r}-{c}", kill_after)
                results[case].append(out)
                print(f"repeat {r}: {case}: exit {out['code']}, {out['wall']:.1f} s", flush=True)
    write(args.out, results, args.repeats)


def write(out: Path, results: dict[str, list[dict]], repeats: int) -> None:
    base = results["undisturbed"]
    rows = []
    for case, runs in results.items():
        done = [(run, ref) for run, ref in zip(runs, base) if "failed" not in run]
        ratios = [max(run["seconds"][s] / max(ref["seconds"][s], 0.05) for s in ref["seconds"]) for run, ref in done]
        spans, gaps = [run["span"] for run, _ in done], [run["gap"] for run, _ in done]
        rows.append(f"| {case} | {statistics.median(r['wall'] for r in runs):.1f} | "
                    f"{_figure(spans, statistics.median, 1)} | {_figure(gaps, max, 2)} | {_figure(ratios, max, 2)} | "
                    f"{', '.join(str(r['code']) for r in runs)} | "
                    f"{len(done) == len(runs) and all(run['weights'] == ref['weights'] for run, ref in done)} | "
                    f"{sum(r['noise'] for r in runs)} |")
    lines = [
        "# A run whose Prefect server is killed, against an undisturbed run",
        "",
        f"`python -m benchmarks.server_kill` on {machine()}; the machine was shared with other jobs while it ran, so "
        "stage times vary by a few seconds from run to run. The tiny example without evaluation (23 stages), "
        f"{repeats} repeat(s), the three cases in turn, each with a fresh `featcal server` and run directory; the "
        "server is killed with SIGKILL to its process group once the second stage has finished, or as the flow run "
        "begins (Prefect's `Beginning flow run` line).",
        "",
        "| case | wall s (median) | stages' span s (median) | longest wait between two stages s (worst) | "
        "slowest stage ÷ same stage undisturbed (worst) | exit codes | weights = undisturbed | "
        "Prefect noise lines on the console |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The wait between two stages is where a dead server used to cost a minute per stage (the progress artifact's "
        "retries, in the flow's thread). The slowest-stage ratio compares each stage's own seconds (its record) and "
        "divides by at least 0.05 s: the tiny example's stages take 0.05 to 5 s here, so that ratio says more about "
        "the shared machine than about the server. What the killed runs printed about it:",
        "",
        *[f"- {case}, repeat {i}: killed at {r['killed_at']:.1f} s; "
          + (f"failed: `{r['failed']}`" if "failed" in r else " / ".join(f"`{line}`" for line in r["fault_lines"]))
          for case in CASES if CASES[case] is not None for i, r in enumerate(results[case])],
        "",
    ]
    out.write_text("\n".join(lines))
    print(out.read_text())


def _figure(values: list[float], summary: Callable[[list[float]], float], digits: int) -> str:
    """The summary of the runs that got to their stages, or a dash where none did."""
    return f"{summary(values):.{digits}f}" if values else "—"


if __name__ == "__main__":
    main()
