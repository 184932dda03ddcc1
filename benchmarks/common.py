"""What several benchmark tools share: the machine line of a results file, the commit a checkout is at, child
processes run the way `featcal run` runs and what they cost, a matmul rate, and comparisons of saved weights.

Imported as `benchmarks.common` by tools run as `python -m benchmarks.TOOL` from the repository root (benchmarks/ is
a package that is not installed: measurement code stays out of the wheel users get). torch is imported inside the
functions that need it: `START_ENV` must be the environment before anything, torch included, is set up, since
`pipeline_cost` sets allocator variables for this process that children of another checkout must not inherit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
# The environment this process started with, before any tool changed it (see the module docstring).
START_ENV = dict(os.environ)


def cpu_line() -> str:
    """The CPU model and which native bf16 instruction sets it has, for a results file's header."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("Flags")), "")
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return f"{model}; bf16 flags: {', '.join(bf16) if bf16 else 'none (no avx512_bf16, no amx_bf16)'}"


def commit_of(code: Path) -> str:
    """The short commit a checkout is at, and whether tracked files changed since: what a result was measured on."""
    out = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + (" + uncommitted changes" if dirty else "")


def command_line() -> str:
    """How this tool was started, as a results file records it: `python -m benchmarks.TOOL ARGS`."""
    module = Path(sys.argv[0]).stem
    return f"python -m benchmarks.{module} {' '.join(sys.argv[1:])}".rstrip()


def runtime_field(text: str) -> tuple[str, str]:
    """An argparse type: `KEY=VALUE`, a runtime field a benchmark's runs also set (`keep_freed_memory=true`)."""
    key, sep, value = text.partition("=")
    if not (sep and key and value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. keep_freed_memory=true")
    return key, value


def child_env(threads: int, code: Path | None) -> dict[str, str]:
    """The starting environment with `threads` threads, offline, and `code` (when given) first on the import path;
    with None, no PYTHONPATH at all."""
    env = {**START_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), START_ENV.get("PYTHONPATH")]))
    return env


def child_cost(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, peak RSS GiB, CPU seconds: user + system) of one child process, its own only; raises with its
    stderr if it fails. On a shared machine the CPU seconds say what the work cost, the wall what it waited too."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        stderr = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr}")
    return wall, usage.ru_maxrss / 1024**2, usage.ru_utime + usage.ru_stime


def sync(device: str) -> None:
    """Wait for a CUDA device's queued work, so that a timing covers it; nothing on the CPU."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_rate(threads: int, dtype: torch.dtype, device: str, clock: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s of a Gram-shaped product (one chunk's 16 × 50 rows, in 3072, out 768) at `dtype`, best of 5; by wall
    time, or by `clock` (time.process_time: CPU time, for a one-thread rate on a shared machine)."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, 3072, generator=g).to(device, dtype)
    y = torch.randn(800, 768, generator=g).to(device, dtype)
    best = float("inf")
    for _ in range(6):  # the first is a warm-up
        sync(device)
        start = clock()
        for _ in range(5):
            x.T @ y
        sync(device)
        best = min(best, (clock() - start) / 5)
    return 2 * 800 * 3072 * 768 / best


def file_gap(a: Path, b: Path, matrices_only: bool = False) -> float:
    """Largest relative Frobenius difference ‖a − b‖ / ‖b‖ between the tensors of two safetensors files; with
    `matrices_only`, over 2-D tensors only (a random-init model's biases and norms are near zero, so their relative
    difference says little)."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        raise RuntimeError(f"{a} and {b} hold different tensors")
    return max(float((x[k].double() - y[k].double()).norm() / y[k].double().norm().clamp_min(1e-300))
               for k in x if not matrices_only or x[k].dim() == 2)


def weight_gap(a: Path, b: Path) -> float:
    """Largest relative difference between the calibrated weight matrices of two run directories."""
    return file_gap(a / "calibrated" / "model.safetensors", b / "calibrated" / "model.safetensors", matrices_only=True)


def same_weights(a: Path, b: Path) -> bool:
    """Whether two run directories' calibrated checkpoints hold the same tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "calibrated" / "model.safetensors"), load_file(b / "calibrated" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def example_run(raw: dict[str, Any], root: Path, run_dir: Path) -> tuple[dict[str, dict[str, float]], float]:
    """A tiny-example config (`raw`, relative to `root`) run into `run_dir`: per task, each evaluated model's test
    accuracy; and the run's seconds."""
    from featcal.config import config_from_dict
    from flows.pipeline import run_pipeline

    start = time.perf_counter()
    run_pipeline(config_from_dict(raw, root), run_dir)
    seconds = time.perf_counter() - start
    report = json.loads((run_dir / "report.json").read_text())
    return {t: s["accuracy"] for t, s in report["tasks"].items()}, seconds


def model_means(accuracy: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each evaluated model's accuracy averaged over the tasks of `example_run`'s first result."""
    models = next(iter(accuracy.values()))
    return {m: sum(a[m] for a in accuracy.values()) / len(accuracy) for m in models}


def results_header(title: str) -> list[str]:
    """A results file's first lines: its title, then the machine, the date, the command and the code it ran on."""
    import datetime

    return [f"# {title}", "", f"Machine: {cpu_line()}. Date: {datetime.date.today()}. Command: `{command_line()}`. "
            f"Code: {commit_of(ROOT)}.", ""]


def bench_arguments(values: list[str]) -> dict[str, tuple[Path, str, int | None]]:
    """`NAME=DIR[:SPLIT[:ROWS]]` arguments of the rules' tools → name: (directory, the split its head checks read
    (default validation), how many of its rows a task, seeded (default all))."""
    parsed = {}
    for value in values:
        name, _, rest = value.partition("=")
        if not name or not rest:
            raise SystemExit(f"--bench {value!r}: expected NAME=DIR[:SPLIT[:ROWS]]")
        directory, split, rows = (rest.split(":") + ["", ""])[:3]
        parsed[name] = (Path(directory), split or "validation", int(rows) if rows else None)
    return parsed


def benches_line(benches: dict[str, tuple[Path, str, int | None]]) -> str:
    """The rules' reports: which benchmarks, and which rows their head checks read."""
    return "Benchmarks: " + ", ".join(f"{b} (`{d}`, head checks on {rows or 'all'} {split} rows a task)"
                                      for b, (d, split, rows) in benches.items()) + "."


def write_rule_report(out: Path, header: list[str], table: list[str], verdicts: list[str]) -> None:
    """A rule's report: its header, its figures' table, then its verdicts; printed as written."""
    out.write_text("\n".join(header + table + ["", "## Verdicts", ""] + verdicts) + "\n")
    print(out.read_text())
