"""The CLIP benchmark's method runs: the paper's rows, each a pipeline run (or Surgery) in its own process, scored
with zero-shot heads made from the benchmark's prompts; each writes `results/{run}.json` like the MiniLM runs.

    python -m featcal.bench.clip_methods BENCH_DIR RUN
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal.bench.build import BASE, data_dir, expert_dir
from featcal.bench.clip_build import CLIP
from featcal.bench.clip_prompts import CLASS_NAMES, TEMPLATES
from featcal.bench.clip_spec import ClipBenchSpec
from featcal.bench.methods import SAMPLE_SIZES, MethodRun, main, pipeline_result, timed_result
from featcal.config import config_from_dict

# The paper's setting for CLIP ViT-B/32 (the pipeline's defaults, docs/design.md §2.8), 256 examples per task.
FEATCAL = {"lambda": 0.05, "rho": 2.2, "alpha": 0.25}


def clip_method_runs() -> dict[str, MethodRun]:
    """The paper's rows. TIES and RegMean as FusionBench runs them for these experts: TIES keeps the top 20 % of each
    task vector, sums the agreeing entries and scales by 0.3 (the pipeline's defaults); RegMean and RegMean++ start
    from the average (non-linear parameters averaged) and scale the Grams' off-diagonal by 0.95."""
    runs = {
        # One run yields experts, zero-shot base, TA and TA + FeatCal, and the per-block drift plot.
        "ta_featcal": MethodRun("task_arithmetic", "featcal", models=("base", "merged", "calibrated", "expert"),
                                featcal=FEATCAL),
        "ties_featcal": MethodRun("ties", "featcal", models=("merged", "calibrated"), featcal=FEATCAL),
        "regmean": MethodRun("average", "regmean"),
        "regmean_pp": MethodRun("average", "regmean_plus_plus"),
        "ta_surgery": MethodRun("task_arithmetic", "surgery"),
    }
    for n in SAMPLE_SIZES[:-1]:
        runs[f"ta_featcal_n{n:03d}"] = MethodRun("task_arithmetic", "featcal", examples=n, featcal=FEATCAL)
    return runs


def pipeline_config(bench: Path, spec: ClipBenchSpec, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run: the vision towers, the zero-shot section with each task's class names and
    templates, every path absolute so the run directory can live anywhere."""

    def source(task: str, split: str, **extra: Any) -> dict[str, Any]:
        return {"path": str(bench / data_dir(task)), "split": split, **extra}

    return {
        "base": str(bench / BASE),
        "experts": {t: str(bench / expert_dir(t)) for t in spec.tasks},
        "merge": {"method": run.merge, "scaling": run.scaling},
        "calibration": {"data": {t: source(t, "calibration") for t in spec.tasks}, "examples_per_task": run.examples,
                        "batch_size": 32, "seed": 42},
        "featcal": {"method": run.method if run.method in ("regmean", "regmean_plus_plus") else "featcal", **run.featcal},
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
