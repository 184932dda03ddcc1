"""What a method run is: a merge, optionally a calibration method and its settings, and which models to evaluate;
where its run directory is, in which order runs that need each other run, and the pipeline config sections every
recipe's runs share. Which runs a benchmark has is data (each recipe's study.yaml, featcal_bench/study.py); the
process that runs one is featcal_bench/method.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from featcal.calibration_methods import CONFIG_METHODS
from featcal_bench.layout import BASE, expert_dir
from tasks.assemble import CALIBRATED

SAMPLE_SIZES = (8, 16, 32, 64, 128, 256)
FULL = 256
SURGERY_METHODS = ("surgery", "probsurgery")  # adapters trained outside the pipeline (featcal_bench.surgery_run)


@dataclass(frozen=True)
class MethodRun:
    """One process: a merge, optionally a calibration method, and which of its models to evaluate."""

    merge: str  # a merge.method (featcal/merging.py), or given: the checkpoint of run `start`
    method: str | None  # a featcal.method (featcal, regmean, lot, …) | surgery | probsurgery | None (merge only)
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
    # calibration.shared_inputs for this run (each task's term also reads the other tasks' inputs through its own
    # expert, docs/design.md §2.12); empty: the recipe's (off)
    shared_inputs: dict[str, Any] = field(default_factory=dict)
    # Which draw of the calibration rows (`featcal bench run --draws N`): 0 is the run as the study defines it, draw k
    # draws its rows with calibration.seed + k (`drawn`).
    draw: int = 0

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


DRAW = "_draw"  # run `r`'s draw k is run `r_draw{k}`


def draw_name(name: str, draw: int) -> str:
    """Run `name`'s draw `draw` (0: the run itself)."""
    return name if draw == 0 else f"{name}{DRAW}{draw}"


def split_draw(name: str) -> tuple[str, int]:
    """(the run, its draw) of a run name `draw_name` made."""
    base, _, k = name.rpartition(DRAW)
    return (base, int(k)) if base and k.isdigit() and int(k) > 0 else (name, 0)


def is_drawn(run: MethodRun) -> bool:
    """Whether a run's result depends on the draw of calibration rows: every run with a calibration method."""
    return run.method is not None


def drawn(run: MethodRun, draw: int, known: dict[str, MethodRun]) -> MethodRun:
    """Draw `draw` of `run`: its calibration rows drawn with calibration.seed + draw, scoring its calibrated model only
    (the base, the merge and the experts do not depend on the draw), and starting from (or protected by) the same draw
    of the runs it needs where those are drawn too, so each draw is one pass of the study on one set of rows."""
    def need(name: str | None) -> str | None:
        return draw_name(name, draw) if name is not None and is_drawn(known[name]) else name

    return replace(run, draw=draw, models=("calibrated",), start=need(run.start), protect=need(run.protect))


def with_draws(names: list[str], known: dict[str, MethodRun], draws: int) -> tuple[list[str], dict[str, MethodRun]]:
    """`names` (in `ordered_runs` order) followed by draws 1 … `draws` − 1 of each of them that has a calibration
    method, draw by draw in the same order (so each comes after the draws it needs), and `known` with those draws."""
    if draws < 1:
        raise ValueError(f"--draws: must be >= 1, got {draws}")
    extra = {draw_name(r, k): drawn(known[r], k, known) for k in range(1, draws) for r in names if is_drawn(known[r])}
    return [*names, *extra], {**known, **extra}


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
        "featcal": {
            "method": run.method if run.method in CONFIG_METHODS else "featcal",
            # a study row refits heads only where it says so: its rows keep their meaning whatever the default
            "head_refit": False,
            **run.featcal,
        },
    }
