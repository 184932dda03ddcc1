"""The CLIP benchmark's method runs: the paper's rows, each a pipeline run (or Surgery) in its own process, scored
with zero-shot heads made from the benchmark's prompts; each writes `results/{run}.json` like the MiniLM runs.

    python -m featcal.bench.clip_methods BENCH_DIR RUN
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal.bench.build import data_dir
from featcal.bench.clip_build import CLIP
from featcal.bench.clip_prompts import CLASS_NAMES, TEMPLATES
from featcal.bench.clip_spec import ClipBenchSpec
from featcal.bench.methods import MethodRun, main, model_sections, paper_method_runs, pipeline_result, timed_result
from featcal.config import config_from_dict


def clip_method_runs() -> dict[str, MethodRun]:
    """The paper's rows (featcal.bench.methods.paper_method_runs), and TA + Surgery."""
    return {**paper_method_runs(), "ta_surgery": MethodRun("task_arithmetic", "surgery")}


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


def run_clip_method(bench: Path, name: str) -> dict[str, Any]:
    runs = clip_method_runs()
    if name not in runs:
        raise ValueError(f"unknown CLIP benchmark run {name!r}; known: {sorted(runs)}")
    run = runs[name]
    raw = pipeline_config(bench, ClipBenchSpec.load(bench), run)
    if run.method == "surgery":
        from featcal.bench.surgery_run import surgery_result

        # The merged features are computed once per pool image: the same training, without 16,000 ViT forwards per
        # task (the surgery timing is then a lower bound of the original protocol's).
        cfg = config_from_dict(raw, root=bench, source=f"bench run {name}")
        return timed_result(bench, name, run, lambda: surgery_result(bench, cfg, cache_features=True))
    return timed_result(bench, name, run, lambda: pipeline_result(bench, name, raw))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run_clip_method))
