"""The FLAN-T5 GLUE benchmark's method runs: the paper's rows, each a pipeline run in its own process, scored text to
text (greedy answers against the label words; stsb by Spearman's ρ of the parsed score); each writes
`results/{run}.json` like the MiniLM and CLIP runs.

No Surgery row: it trains an adapter on the feature a task's head reads, and a text-to-text model has no such head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_bench.layout import data_dir
from featcal_bench.runs import MethodRun, model_sections
from featcal_bench.t5.build import LABEL, TARGET, TEXT
from featcal_bench.t5.prompts import LABEL_WORDS
from featcal_bench.t5.spec import T5BenchSpec

MAX_LENGTH = 512  # prompt tokens: the FLAN-T5 tokenizer's limit, which FusionBench truncates to
MAX_TARGET_LENGTH = 8  # answer tokens teacher-forced in calibration: every label word and score fits
MAX_NEW_TOKENS = 9  # FusionBench's generate(max_length=10), its start token included


def pipeline_config(bench: Path, spec: T5BenchSpec, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run: calibration teacher-forces each prompt's answer (`target`), evaluation scores
    greedy answers against the label words; every path absolute so the run directory can live anywhere."""

    def source(task: str, split: str, **extra: Any) -> dict[str, Any]:
        return {"path": str(bench / data_dir(task)), "split": split, "column": TEXT, **extra}

    return {
        **model_sections(bench, spec.tasks, run),
        "calibration": {"data": {t: source(t, "calibration", target_column=TARGET) for t in spec.tasks},
                        "examples_per_task": run.examples, "batch_size": 16, "max_length": MAX_LENGTH,
                        "max_target_length": MAX_TARGET_LENGTH, "seed": 42},
        "evaluation": {"enabled": True, "batch_size": 32, "models": list(run.models), "max_new_tokens": MAX_NEW_TOKENS,
                       "data": {t: source(t, "test", label_column=LABEL) for t in spec.tasks},
                       "label_words": {t: LABEL_WORDS[t] for t in spec.tasks if t in LABEL_WORDS}},
    }
