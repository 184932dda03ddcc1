"""Why the tests run torch on one thread (tests/conftest.py): the T5 hub fixture's expert training
(tests/t5_fixture.fine_tuned_t5, 40 full-batch Adam steps of a tiny T5) in two child processes at once, as two xdist
workers run on CI's 2 cores, at 1 and at 2 torch threads each; runs alternate between the thread counts so the
machine's load falls on both alike.

    python -m benchmarks.suite_threads --repeat 2 --out benchmarks/results/suite_threads.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, START_ENV, command_line, commit_of, cpu_line

PAIR = 2  # xdist workers on a 2-core machine (`-n logical`)


def train_once() -> None:
    """One expert of tests/test_bench_t5.py's mirror, trained as its fixture trains it (cola, seed 0)."""
    import numpy as np
    import torch
    from transformers import T5ForConditionalGeneration

    from tests.t5_fixture import fine_tuned_t5, glue_words, t5_config, t5_tokenizer
    from tests.test_bench_t5 import SENTENCE_WORDS, TASKS, _rows

    words = glue_words(TASKS, SENTENCE_WORDS)
    tokenizer = t5_tokenizer(words, split_punctuation=True)
    torch.manual_seed(0)
    base = T5ForConditionalGeneration(t5_config(vocab_size=3 + len(words))).eval()
    start = time.perf_counter()
    fine_tuned_t5(base, tokenizer, _rows("cola", np.random.default_rng(0), 24), "cola", seed=0)
    print(f"{time.perf_counter() - start:.3f}")


def pair_run(threads: int) -> tuple[list[float], float]:
    """Training wall seconds of each of `PAIR` children started together with `threads` torch threads each, and the
    CPU seconds (user + system) the children used in all."""
    env = {**START_ENV, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = [subprocess.Popen([sys.executable, "-m", "benchmarks.suite_threads", "--child"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, text=True) for _ in range(PAIR)]
    walls = []
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"a training child at {threads} thread(s) failed ({child.returncode})")
        walls.append(float(out.strip().splitlines()[-1]))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return walls, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train_once()
        return
    load_before = os.getloadavg()[0]
    runs: dict[int, list[tuple[list[float], float]]] = {1: [], 2: []}
    for _ in range(args.repeat):
        for threads in runs:
            runs[threads].append(pair_run(threads))
    load_after = os.getloadavg()[0]
    lines = [
        "# Torch threads in the tests: a tiny T5's training in two processes at once", "",
        f"Machine: {cpu_line()}, {os.cpu_count()} logical CPUs, shared with other jobs (load average "
        f"{load_before:.1f} before, {load_after:.1f} after); commit {commit_of(ROOT)}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. Command: `{command_line()}`.", "",
        f"Each run starts {PAIR} children together, each training one expert as tests/test_bench_t5.py's fixture does "
        "(40 Adam steps, a 2-layer T5 of width 32, 24 rows); wall is the training loop's own, per child.", "",
        "| torch threads per child | runs: training wall per child (s) | median wall (s) | CPU, both processes (s) |",
        "|---:|---|---:|---:|",
    ]
    for threads, results in runs.items():
        walls = [w for pair, _ in results for w in pair]
        shown = "; ".join(", ".join(f"{w:.1f}" for w in pair) for pair, _ in results)
        cpu = ", ".join(f"{c:.1f}" for _, c in results)
        lines.append(f"| {threads} | {shown} | {statistics.median(walls):.1f} | {cpu} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
