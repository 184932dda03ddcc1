"""The tinyllama-domains benchmark's method runs: TA, TIES, RegMean, RegMean++ and TA + FeatCal on the built experts,
each a pipeline run in its own process (single-threaded, on the CPU), every model scored by its next-token loss on
each domain's held-out rows; each writes `results/{run}.json` like the other benchmarks' runs, with the per-domain
losses beside the next-token accuracies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_bench.layout import data_dir
from featcal_bench.runs import AUTO, FEW, PAPER_FEATCAL, MethodRun, model_sections
from featcal_bench.tinyllama.build import TinyLlamaSpec

EXAMPLES = 128  # calibration rows per domain (of seq_len tokens each); a smaller pool gives all it has


def tinyllama_method_runs() -> dict[str, MethodRun]:
    """FeatCal at the paper's λ 0.05, ρ 2.2, α 0.25 on the TA and TIES merges (scale 0.3), and at λ auto (chosen per
    module on held-out calibration rows, no labels); RegMean and RegMean++ from the average; and FeatCal from the plain
    sum of the task vectors (TA at 1.0), a stronger merge than 0.3 where fine-tunes move the weights little; and FeatCal
    from each RegMean run's calibrated checkpoint (a given merge). A merge's
    own model is scored in the run that calibrates it (TA in `ta_featcal`, TIES in `ties_featcal`, the average in
    `regmean`)."""
    return {
        "ta_featcal": MethodRun("task_arithmetic", "featcal", EXAMPLES, ("base", "merged", "calibrated", "expert"),
                                PAPER_FEATCAL),
        "ties_featcal": MethodRun("ties", "featcal", EXAMPLES, ("merged", "calibrated"), PAPER_FEATCAL),
        "regmean": MethodRun("average", "regmean", EXAMPLES, ("merged", "calibrated")),
        "regmean_pp": MethodRun("average", "regmean_plus_plus", EXAMPLES),
        "regmean_featcal": MethodRun("given", "featcal", EXAMPLES, featcal=PAPER_FEATCAL, start="regmean"),
        "regmean_pp_featcal": MethodRun("given", "featcal", EXAMPLES, featcal=PAPER_FEATCAL, start="regmean_pp"),
        "ta_featcal_auto": MethodRun("task_arithmetic", "featcal", EXAMPLES, featcal=AUTO),
        "ta10_featcal": MethodRun("task_arithmetic", "featcal", EXAMPLES, ("merged", "calibrated"), PAPER_FEATCAL,
                                  scaling=1.0),
        # The label-free options of issue 33 on a decoder: ρ chosen with λ, the Grams shrunk (γ auto, λ from 0.001),
        # and FeatCal from RegMean's checkpoint with λ and ρ chosen (ρ's grid holds 1, RegMean itself as anchor).
        "ta_featcal_auto_rho": MethodRun("task_arithmetic", "featcal", EXAMPLES, featcal={**AUTO, "rho": "auto"}),
        "ta_featcal_auto_shrink": MethodRun("task_arithmetic", "featcal", EXAMPLES, featcal=FEW),
        "regmean_featcal_auto": MethodRun("given", "featcal", EXAMPLES, featcal={**AUTO, "rho": "auto"},
                                          start="regmean"),
        # The head metric (η 1, as MiniLM-8 kept it) on a decoder: the last down_proj's error measured through the
        # merged LM head and final norm, from TA and from RegMean's checkpoint.
        "ta_featcal_auto_head1": MethodRun("task_arithmetic", "featcal", EXAMPLES,
                                           featcal={**AUTO, "head_metric": 1.0}),
        "regmean_featcal_auto_head1": MethodRun("given", "featcal", EXAMPLES,
                                                featcal={**AUTO, "rho": "auto", "head_metric": 1.0}, start="regmean"),
    }


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
