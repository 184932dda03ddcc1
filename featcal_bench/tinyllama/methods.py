"""The tinyllama-domains benchmark's method runs (the runs themselves: study.yaml beside this file) on the built
experts, each a pipeline run in its own process (single-threaded, on the CPU), every model scored by its next-token
loss on each domain's held-out rows; each writes `results/{run}.json` like the other benchmarks' runs, with the
per-domain losses beside the next-token accuracies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_bench.layout import data_dir
from featcal_bench.runs import MethodRun, model_sections
from featcal_bench.tinyllama.build import TinyLlamaSpec


def pipeline_config(bench: Path, spec: TinyLlamaSpec, run: MethodRun) -> dict[str, Any]:
    """Calibration on each domain's pool, evaluation on its held-out rows (ready token ids); one CPU thread, as the
    build; every path absolute so the run directory can live anywhere."""

    def source(domain: str, split: str) -> dict[str, Any]:
        return {"path": str(bench / data_dir(domain)), "split": split}

    return {
        **model_sections(bench, spec.tasks, run),
        "calibration": {"data": {d: source(d, "calibration") for d in spec.tasks}, "examples_per_task": run.examples,
                        "batch_size": 16, "max_length": spec.seq_len, "seed": 42},
        "evaluation": {"enabled": True, "batch_size": 32, "models": list(run.models),
                       "data": {d: source(d, "test") for d in spec.tasks}},
        "runtime": {"threads": 1, "device": "cpu"},
    }
