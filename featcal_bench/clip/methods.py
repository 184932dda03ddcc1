"""The CLIP benchmark's method runs (the runs themselves: study.yaml beside this file), each a pipeline run (or
Surgery, ProbSurgery) in its own process, scored with zero-shot heads made from the benchmark's prompts; each writes
`results/{run}.json` like the MiniLM runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_bench.clip.build import CLIP
from featcal_bench.clip.prompts import CLASS_NAMES, TEMPLATES
from featcal_bench.clip.spec import ClipBenchSpec
from featcal_bench.layout import data_dir
from featcal_bench.runs import MethodRun, model_sections


def pipeline_config(bench: Path, spec: ClipBenchSpec, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run: the vision towers, the zero-shot section with each task's class names and
    templates, every path absolute so the run directory can live anywhere."""

    def source(task: str, split: str, **extra: Any) -> dict[str, Any]:
        return {"path": str(bench / data_dir(task)), "split": split, **extra}

    return {
        **model_sections(bench, spec.tasks, run),
        "calibration": {"data": {t: source(t, "calibration") for t in spec.tasks}, "examples_per_task": run.examples,
                        "batch_size": 32, "seed": 42},
        "evaluation": {"enabled": True, "batch_size": 64, "models": list(run.models),
                       "data": {t: source(t, "test", label_column="label") for t in spec.tasks}},
        "zero_shot": {"clip_model": str(bench / CLIP), "task_templates": {t: TEMPLATES[t] for t in spec.tasks},
                      "class_names": {t: CLASS_NAMES[t] for t in spec.tasks}},
    }
