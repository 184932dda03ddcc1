"""A run started on one device kind and finished on another, against a run that never left the second; and one
`--runner dask --gpus N` run. What the README claims about resuming across devices comes from this script's output.

    python -m benchmarks.cross_device --first cuda --then cpu --gpus 1 --out benchmarks/results/cross_device_gpu.md

On the tiny offline BERT example (`featcal example`, evaluation off), in child processes (`featcal run`):
1. reference: the whole run with runtime.device = --then;
2. uninterrupted: the whole run with runtime.device = --first (how far the device kind alone moves the weights);
3. resumed: a run with runtime.device = --first, killed with SIGKILL as soon as block --kill-after-block is solved,
   then rerun to the end with runtime.device = --then (nothing in a stage's cache key names the device);
4. with --gpus N (N ≥ 1, needs CUDA): the whole run with `--runner dask --gpus N`, against 2.

For each run: where its stages ran (from the records), and for every tensor of the calibrated checkpoint the
largest relative difference ‖a − b‖ / ‖b‖ to the reference, and whether all are bit-identical.
`--first cpu --then cpu` checks the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.common import ROOT
from benchmarks.large_model import records
from featcal_bench.example import build_tiny_example
from flows.pipeline import machine

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def featcal(run_dir: Path, config: Path, device: str, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "flows.cli", "run", str(config), "--run-dir", str(run_dir),
            "--set", f"runtime.device={device}", *extra]
    return subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finished(proc: subprocess.Popen, what: str) -> None:
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (rc={proc.returncode}):\n{out[-4000:]}")


def killed_after(run_dir: Path, config: Path, device: str, block: int, *extra: str) -> float:
    """Start a run on `device` and SIGKILL it once block `block` is solved; the seconds it ran."""
    started = time.monotonic()
    proc = featcal(run_dir, config, device, "--no-prefect", *extra)
    while proc.poll() is None and f"solve/l{block:02d}" not in records(run_dir):
        time.sleep(0.05)
    if proc.poll() is not None:
        raise SystemExit(f"the run on {device} ended (rc={proc.returncode}) before block {block} was solved")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return time.monotonic() - started


def devices_used(run_dir: Path) -> dict[str, int]:
    """How many stages ran on each device, from the records."""
    return dict(collections.Counter(r["info"].get("device", "?") for r in records(run_dir).values()))


def compared(run_dir: Path, reference: Path) -> tuple[float, bool, int]:
    """(largest relative difference over the calibrated tensors, all bit-identical?, tensor count)."""
    ours = load_file(run_dir / "calibrated" / "model.safetensors")
    ref = load_file(reference / "calibrated" / "model.safetensors")
    if ours.keys() != ref.keys():
        raise SystemExit(f"{run_dir}: the calibrated checkpoint's tensors differ from the reference's by name")
    worst, equal = 0.0, True
    for name, b in ref.items():
        a = ours[name]
        equal &= torch.equal(a, b)
        if a.is_floating_point():
            denom = float(b.double().norm()) or 1.0
            worst = max(worst, float((a.double() - b.double()).norm()) / denom)
    return worst, equal, len(ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", default="cuda", help="runtime.device of the runs that start (default cuda)")
    ap.add_argument("--then", default="cpu", help="runtime.device of the reference and of the resumed half")
    ap.add_argument("--kill-after-block", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=0, help="also run `--runner dask --gpus N` (0: skip)")
    ap.add_argument("--work", type=Path, default=None, help="where the example and runs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-cross-device-"))
    config = build_tiny_example(work / "example", archs=("bert",)) / "bert" / "example.yaml"
    config_args = ["--set", "evaluation.enabled=false"]

    runs: dict[str, Path] = {name: work / name for name in ("reference", "uninterrupted", "resumed", "gpus")}
    finished(featcal(runs["reference"], config, args.then, "--no-prefect", *config_args), "the reference run")
    finished(featcal(runs["uninterrupted"], config, args.first, "--no-prefect", *config_args), "the uninterrupted run")
    seconds = killed_after(runs["resumed"], config, args.first, args.kill_after_block, *config_args)
    first_half = devices_used(runs["resumed"])
    finished(featcal(runs["resumed"], config, args.then, "--no-prefect", *config_args), "the resumed run")
    rows = [("reference", f"`{args.then}`", devices_used(runs["reference"]), runs["reference"]),
            ("uninterrupted", f"`{args.first}`", devices_used(runs["uninterrupted"]), runs["uninterrupted"]),
            ("resumed", f"`{args.first}`, killed {seconds:.1f} s in (block {args.kill_after_block} solved; stages "
                        f"by then: {json.dumps(first_half)}), rerun on `{args.then}`", devices_used(runs["resumed"]),
             runs["resumed"])]
    if args.gpus:
        finished(featcal(runs["gpus"], config, "auto", "--runner", "dask", "--gpus", str(args.gpus), *config_args),
                 "the --gpus run")
        rows.append((f"--runner dask --gpus {args.gpus}", "`auto`, one worker per GPU",
                     devices_used(runs["gpus"]), runs["gpus"]))
    lines = [f"# A run resumed on another device kind — tiny BERT example, `{args.first}` then `{args.then}`", "",
             f"Machine: {machine()}"
             + (f", CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "")
             + f". Date: {time.strftime('%Y-%m-%d')}. Command: `python -m benchmarks.cross_device "
             + " ".join(sys.argv[1:]) + "`", "",
             "| run | runtime.device | stages per device (records) | tensors | max relative difference to the "
             "reference | bit-identical |", "|---|---|---|---:|---:|---|"]
    for name, device, used, run_dir in rows:
        worst, equal, count = compared(run_dir, runs["reference"])
        lines.append(f"| {name} | {device} | {json.dumps(used)} | {count} | {worst:.1e} | {'yes' if equal else 'no'} |")
        if name.startswith("--runner dask"):  # one GPU per worker against the whole run on one
            worst, equal, _ = compared(run_dir, runs["uninterrupted"])
            lines.append(f"| (same, against `uninterrupted`) | | | | {worst:.1e} | {'yes' if equal else 'no'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
