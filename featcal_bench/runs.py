"""What a method run is: a merge, optionally a calibration method and its settings, and which models to evaluate;
where its run directory is, in which order runs that need each other run, and the pipeline config sections every
recipe's runs share. The recipes import this; the process that runs one is featcal_bench/method.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal_bench.layout import BASE, expert_dir
from tasks.assemble import CALIBRATED

SAMPLE_SIZES = (8, 16, 32, 64, 128, 256)
FULL = 256
SURGERY_METHODS = ("surgery", "probsurgery")  # adapters trained outside the pipeline (featcal_bench.surgery_run)


@dataclass(frozen=True)
class MethodRun:
    """One process: a merge, optionally a calibration method, and which of its models to evaluate."""

    merge: str  # task_arithmetic | ties | average | dare_linear | dare_ties | given (the checkpoint of run `start`)
    method: str | None  # featcal | regmean | regmean_plus_plus | surgery | probsurgery | None (merge only)
    examples: int = FULL
    models: tuple[str, ...] = ("calibrated",)
    featcal: dict[str, Any] = field(default_factory=dict)
    scaling: float = 0.3  # task arithmetic's (and TIES') scale s; 0.3 is the published default
    density: float | None = None  # DARE's keep probability (merge.density); None for the other merges
    # Another run of the same recipe whose calibrated checkpoint is this run's merge (merge given): FeatCal from the
    # best merge (RegMean + FeatCal). `bench run` runs it first and keys this run on its result.
    start: str | None = None
    # Another run whose head check raises this run's task weights where that run left a task agreeing with its expert
    # less often than the merge (featcal_bench/protect.py); it runs first and this run is keyed on its result.
    protect: str | None = None

    def __post_init__(self) -> None:
        if (self.merge == "given") != (self.start is not None):
            raise ValueError(f"MethodRun: merge given reads run `start`'s calibrated checkpoint, and only it does "
                             f"(merge {self.merge}, start {self.start!r})")
        if self.protect is not None and self.method != "featcal":
            raise ValueError(f"MethodRun: protect raises featcal.task_weights, which only FeatCal reads (method "
                             f"{self.method})")

    @property
    def needs(self) -> tuple[str, ...]:
        """The runs whose results this run reads: its start and the run it protects against."""
        return tuple(r for r in (self.start, self.protect) if r is not None)


# The paper's setting for its CLIP ViT-B/32 and FLAN-T5 benchmarks (the pipeline's defaults, docs/design.md §2.8).
PAPER_FEATCAL = {"lambda": 0.05, "rho": 2.2, "alpha": 0.25}
# What a user without labelled validation data runs: λ chosen per module on held-out calibration rows
# (featcal.lambda: auto) at the published ρ; it beat λ and ρ both auto on the validation split
# (benchmarks/results/minilm8_quality.md).
AUTO = {"lambda": "auto", "rho": 2.2, "alpha": 0.25}
# Few examples (issue 33 §2): λ auto on a grid that reaches below 0.01 (λ auto chose its floor, 0.01, in every block
# at 256 examples on MiniLM-8), and each task's Grams shrunk towards a scaled identity by a γ chosen on the held-out
# rows with λ.
FEW = {**AUTO, "shrinkage": "auto",
       "lambda_grid": [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]}


def paper_method_runs() -> dict[str, MethodRun]:
    """The rows the paper reports on its hub benchmarks, as FusionBench runs them: TA and TIES at 0.3 (TIES keeps the
    top 20 % of each task vector and sums the agreeing entries: the pipeline's defaults), each with FeatCal at 256
    examples per task; RegMean and RegMean++ from the average (non-linear parameters averaged), the Grams'
    off-diagonal scaled by 0.95; TA + FeatCal at 8–128 examples per task."""
    runs = {
        # One run yields experts, base, TA and TA + FeatCal, and the per-block drift plot.
        "ta_featcal": MethodRun("task_arithmetic", "featcal", models=("base", "merged", "calibrated", "expert"),
                                featcal=PAPER_FEATCAL),
        "ties_featcal": MethodRun("ties", "featcal", models=("merged", "calibrated"), featcal=PAPER_FEATCAL),
        "regmean": MethodRun("average", "regmean"),
        "regmean_pp": MethodRun("average", "regmean_plus_plus"),
    }
    for n in SAMPLE_SIZES[:-1]:
        runs[f"ta_featcal_n{n:03d}"] = MethodRun("task_arithmetic", "featcal", examples=n, featcal=PAPER_FEATCAL)
    return runs


def run_dir(bench: Path, name: str) -> Path:
    """Where method run `name` of the benchmark built in `bench` keeps its pipeline run."""
    return bench / "runs" / name


def start_checkpoint(bench: Path, start: str) -> Path:
    """The calibrated checkpoint of run `start`: a full checkpoint of the base's architecture (the merged body with
    its blocks calibrated, the experts' heads under heads/), which a run starting from it reads as a given merge."""
    return run_dir(bench, start) / CALIBRATED


def ordered_runs(names: list[str], known: dict[str, MethodRun]) -> list[str]:
    """`names` with every run one of them starts from placed before it, added where it was not asked for."""
    ordered: list[str] = []

    def add(name: str, after: tuple[str, ...]) -> None:  # `after`: the runs that need `name`, then name
        for need in known[name].needs:
            if need in ordered:
                continue
            if need not in known:
                raise ValueError(f"run {name}: {need!r} is no run of this recipe; known: {sorted(known)}")
            if need in after:
                chain = " → ".join((*after, need))
                raise ValueError(f"run {name}: {need!r} needs it in turn ({chain})")
            if known[need].method in SURGERY_METHODS:
                raise ValueError(f"run {name}: {need!r} is a {known[need].method} run, which writes no "
                                 "calibrated checkpoint; expected a pipeline run")
            add(need, (*after, need))
        if name not in ordered:
            ordered.append(name)

    for name in names:
        add(name, (name,))
    return ordered


def model_sections(bench: Path, tasks: list[str], run: MethodRun) -> dict[str, Any]:
    """The pipeline config's base, experts, merge and calibration method of a run on a built benchmark; a run with a
    `start` calibrates that run's calibrated checkpoint (merge given)."""
    merge = ({"method": "given", "path": str(start_checkpoint(bench, run.start))} if run.start is not None else
             {"method": run.merge, "scaling": run.scaling, **({"density": run.density} if run.density else {})})
    return {
        "base": str(bench / BASE),
        "experts": {t: str(bench / expert_dir(t)) for t in tasks},
        "merge": merge,
        "featcal": {"method": run.method if run.method in ("regmean", "regmean_plus_plus") else "featcal", **run.featcal},
    }
