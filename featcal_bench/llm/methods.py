"""The MergeBench benchmark's method runs: TA, TIES, TA + FeatCal, RegMean and RegMean++ at MergeBench's
hyper-parameters, each a pipeline run in its own process, every model scored by its next-token loss on each domain's
held-out text (the pipeline's evaluate stage scores causal LMs so); each writes `results/{run}.json` like the other
benchmarks' runs, with the per-domain losses beside the next-token accuracies.

Four processes give the five methods and more: a merge's own model is scored in the run that calibrates it (TA in
`ta_featcal`, TIES in `ties_featcal`, which adds TIES + FeatCal), since the pipeline always calibrates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_bench.layout import data_dir
from featcal_bench.llm.build import TEXT
from featcal_bench.llm.spec import (
    MAX_LENGTH,
    TIES_TOP_K,
    LlmBenchSpec,
)
from featcal_bench.runs import MethodRun, model_sections


def pipeline_config(bench: Path, spec: LlmBenchSpec, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run: calibration on each domain's pool, evaluation on its held-out rows, both the
    `text` column cut at MAX_LENGTH tokens; every path absolute so the run directory can live anywhere. bf16 activations
    and forwards: the experts' own dtype, and half the activation store of float32."""

    def source(domain: str, split: str) -> dict[str, Any]:
        return {"path": str(bench / data_dir(domain)), "split": split, "column": TEXT}

    sections = model_sections(bench, spec.tasks, run)
    if run.merge == "ties":
        sections["merge"]["ties_top_k"] = TIES_TOP_K
    return {
        **sections,
        "calibration": {"data": {d: source(d, "calibration") for d in spec.tasks},
                        "examples_per_task": min(run.examples, spec.calibration), "batch_size": 8,
                        "max_length": MAX_LENGTH, "seed": 42},
        # Batches of 8: the logits of 8 rows × 512 tokens × Llama-3's 128,256-token vocabulary are 1 GiB in bf16.
        "evaluation": {"enabled": True, "batch_size": 8, "models": list(run.models),
                       "data": {d: source(d, "test") for d in spec.tasks}},
        "runtime": {"precision": "bf16"},
    }
