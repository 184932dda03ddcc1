"""Your own benchmark without touching the package: a recipe YAML over local checkpoints and data files.

    featcal bench build --recipe my_recipe.yaml --out bench/mine
    featcal bench run bench/mine

The YAML is validated by `UserRecipe` (a bad or missing field is named in one line, with the file), its paths are
resolved against the YAML's directory, and the build copies the base and each expert into the benchmark directory and
cuts each task's calibration pool and test rows from its files; from there it is a benchmark like ours: the same
cached, resumable stages, method runs, report, paired comparisons and plots (docs/adding-a-benchmark.md).
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import datasets
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from featcal.config import DataSource, config_from_dict, digest_of
from featcal.data import load_split, pick_examples
from featcal_bench.catalog import entry
from featcal_bench.estimate import split_sizes
from featcal_bench.layout import BASE, data_dir, expert_dir
from featcal_bench.recipe import BuildOptions, Call, Recipe, Report, SavedSpec
from featcal_bench.report import build_report, save_report
from featcal_bench.runs import FULL, SAMPLE_SIZES, MethodRun, model_sections
from featcal_bench.study import SHARED, Study, load_study
from storage.atomic import atomic_path
from storage.fingerprint import fingerprint
from storage.rundir import Record

log = logging.getLogger("featcal")

# The runs a recipe may ask for, by the names the report's rows read (featcal_bench/studies/user.yaml).
RUN_NAMES = ("ta_featcal", "ties_featcal", "regmean", "regmean_pp", "ta_surgery", "ta_probsurgery", "ta_featcal_refit")
REFERENCE_RUN = "ta_featcal"  # always run: it scores the experts and task arithmetic every other row is read against


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Split(_Strict):
    """Rows of a task: a data file (.csv, .json, .jsonl, .parquet) or a `save_to_disk` directory, and its split."""

    path: str
    split: str = "train"


class UserTask(_Strict):
    """One task: where its calibration pool and its test rows come from, and which columns hold what."""

    calibration: Split = Field(description="rows the calibration pool is drawn from (their labels are not read)")
    test: Split = Field(description="rows every model is scored on")
    column: str | None = Field(None, description="the raw input column (text or image); default: detected")
    text_pair_column: str | None = None
    label_column: str = "label"

    @field_validator("calibration", "test", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


class UserRecipe(SavedSpec):
    """A benchmark over your own base, experts (one per task) and data files."""

    model_config = ConfigDict(extra="forbid")
    SPEC_FILE = "recipe_bench.json"

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="names the report's files")
    base: str = Field(description="the pretrained checkpoint every expert was fine-tuned from (a directory)")
    experts: dict[str, str] = Field(description="task → its fine-tuned checkpoint (a directory)")
    tasks: dict[str, UserTask]  # its keys are the task names
    runs: list[str] = Field(default_factory=lambda: ["ta_featcal", "ties_featcal", "regmean", "regmean_pp"],
                            description=f"method runs, of {list(RUN_NAMES)}; {REFERENCE_RUN} is always run")
    sample_sizes: list[int] = Field(default_factory=list, description="also TA + FeatCal at these examples per "
                                    f"task (of {list(SAMPLE_SIZES[:-1])}): the sample-efficiency curve")
    calibration: int = Field(FULL, ge=1, description="calibration pool per task: a seeded subset of its rows")
    test_rows: int | None = Field(None, ge=1, description="a seeded subset of each test split; None: all of it")
    featcal: dict[str, Any] = Field(default_factory=lambda: load_study(SHARED / "settings.yaml").settings["paper"],
                                    description="the FeatCal runs' `featcal` config section (λ, ρ, α, ...)")
    scaling: float = Field(0.3, gt=0, description="task arithmetic's and TIES' scale")
    max_length: int = Field(128, ge=2, description="text: tokens per row")
    batch_size: int = Field(16, ge=1)
    runtime: dict[str, Any] = Field(default_factory=dict, description="the runs' `runtime` config section")
    seed: int = 0

    @field_validator("runs")
    @classmethod
    def _known_runs(cls, runs: list[str]) -> list[str]:
        unknown = sorted(set(runs) - set(RUN_NAMES))
        if unknown:
            raise ValueError(f"unknown runs {unknown}; known: {list(RUN_NAMES)}")
        return [REFERENCE_RUN, *(r for r in RUN_NAMES if r in runs and r != REFERENCE_RUN)]

    @field_validator("sample_sizes")
    @classmethod
    def _known_sizes(cls, sizes: list[int]) -> list[int]:
        unknown = sorted(set(sizes) - set(SAMPLE_SIZES[:-1]))
        if unknown:
            raise ValueError(f"unknown sizes {unknown}; known: {list(SAMPLE_SIZES[:-1])} (256 is the runs' own)")
        return sorted(set(sizes))

    @model_validator(mode="after")
    def _one_expert_per_task(self) -> UserRecipe:
        if not self.tasks:
            raise ValueError("tasks: at least one task")
        if set(self.experts) != set(self.tasks):
            raise ValueError(f"experts: one per task; tasks {sorted(self.tasks)}, experts {sorted(self.experts)}")
        return self

    def resolved(self, root: Path) -> UserRecipe:
        """Every path made absolute against `root` (the YAML's directory), so the benchmark can run from anywhere."""

        def at(path: str) -> str:
            return str((root / Path(path).expanduser()).resolve())

        raw = self.model_dump(mode="json")
        raw["base"] = at(raw["base"])
        raw["experts"] = {t: at(p) for t, p in raw["experts"].items()}
        for task in raw["tasks"].values():
            for split in ("calibration", "test"):
                task[split]["path"] = at(task[split]["path"])
        return UserRecipe.model_validate(raw)

    def missing(self) -> list[str]:
        """`field: path` for every checkpoint or data path that is not on disk."""
        paths = {"base": self.base, **{f"experts.{t}": p for t, p in self.experts.items()},
                 **{f"tasks.{t}.{s}.path": getattr(task, s).path for t, task in self.tasks.items()
                    for s in ("calibration", "test")}}
        return [f"{field}: {path} does not exist" for field, path in paths.items() if not Path(path).exists()]


def recipe_spec(path: Path) -> UserRecipe:
    """The recipe in YAML file `path`, validated and its paths resolved; a bad one is named in one line."""
    if not path.is_file():
        raise FileNotFoundError(f"--recipe {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of recipe fields (name, base, experts, tasks, ...)")
    try:
        spec = UserRecipe.model_validate(raw).resolved(path.parent)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()]
        raise ValueError(f"{path}: " + "; ".join(problems)) from None
    missing = spec.missing()
    if missing:
        raise FileNotFoundError(f"{path}: " + "; ".join(missing))
    check_sources(spec, path)
    return spec


# A `featcal plan` field, as its check names it, and the recipe field it comes from (first match wins).
RECIPE_FIELDS = (
    (r"(?:calibration|evaluation)\.data\.([^.:\s]+)\.(column|text_pair_column|label_column)", r"tasks.\1.\2"),
    (r"calibration\.data\.([^.:\s]+)", r"tasks.\1.calibration"),
    (r"evaluation\.data\.([^.:\s]+)", r"tasks.\1.test"),
    (r"calibration\.(max_length|batch_size)", r"\1"),
)


def recipe_field(message: str) -> str:
    """A check's one-line message with its leading config field renamed to the recipe field it came from."""
    for pattern, field in RECIPE_FIELDS:
        renamed, n = re.subn(rf"^{pattern}\b", field, message, count=1)
        if n:
            return renamed
    return message


def check_sources(spec: UserRecipe, path: Path) -> None:
    """The checks `featcal plan` makes (checkpoints: one architecture, the base's tensors in every expert, heads;
    data: files, splits, columns, text, labels within each head's classes), on the recipe's own files before
    anything is copied, so a wrong column or string labels stop `bench build` in one line naming the recipe field
    instead of failing every method run of `bench run`."""
    from tasks.preflight import preflight

    def source(task: UserTask, split: Split, **extra: Any) -> dict[str, Any]:
        columns = {"column": task.column, "text_pair_column": task.text_pair_column, **extra}
        return {"path": split.path, "split": split.split, **{k: v for k, v in columns.items() if v is not None}}

    raw = {"base": spec.base, "experts": spec.experts, "merge": {"method": "task_arithmetic", "scaling": spec.scaling},
           "calibration": {"data": {t: source(task, task.calibration) for t, task in spec.tasks.items()},
                           "examples_per_task": spec.calibration, "batch_size": spec.batch_size,
                           "max_length": spec.max_length, "seed": spec.seed},
           "featcal": spec.featcal, "runtime": spec.runtime,
           "evaluation": {"enabled": True, "data": {t: source(task, task.test, label_column=task.label_column)
                                                    for t, task in spec.tasks.items()}}}
    try:
        preflight(config_from_dict(raw, path.parent), quiet=True)
    except ValueError as exc:
        raise ValueError(f"{path}: {recipe_field(str(exc))}") from None


# ---- build ---------------------------------------------------------------------------------------
def _copied(source: str, bench: Path, rel: str) -> tuple[list[str], dict[str, Any]]:
    """Checkpoint directory `source` copied to `bench/rel`: the benchmark owns what its runs are keyed on."""
    with atomic_path(bench / rel) as tmp:
        shutil.copytree(source, tmp)
    return [rel], {"source": source}


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    return _copied(UserRecipe.load(bench).base, bench, BASE)


def write_expert(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    return _copied(UserRecipe.load(bench).experts[task], bench, expert_dir(task))


def write_data(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    """A seeded calibration pool of `calibration` rows and the test rows (all, or a seeded `test_rows` subset)."""
    spec = UserRecipe.load(bench)
    t = spec.tasks[task]
    rows = {s: load_split(DataSource.model_validate({"path": getattr(t, s).path, "split": getattr(t, s).split}),
                          f"tasks.{task}.{s}")
            for s in ("calibration", "test")}
    if t.label_column not in rows["test"].column_names:
        raise ValueError(f"tasks.{task}.label_column: {t.label_column!r} is not a column of {t.test.path} "
                         f"(has {rows['test'].column_names})")
    out = datasets.DatasetDict({
        "calibration": pick_examples(rows["calibration"], spec.calibration, spec.seed, f"tasks.{task}.calibration"),
        "test": rows["test"] if spec.test_rows is None else pick_examples(rows["test"], spec.test_rows, spec.seed,
                                                                          f"tasks.{task}.test"),
    })
    with atomic_path(bench / data_dir(task)) as tmp:
        out.save_to_disk(str(tmp))
    log.info("data %s: %s", task, {k: len(v) for k, v in out.items()})
    return [data_dir(task)], {split: len(rows) for split, rows in out.items()}


def build_graph(bench: Path, spec: UserRecipe, stage: Call, code: str, memo: Path) -> dict[str, Record]:
    """The base, then one dataset and one expert per task, each cached on its sources' content fingerprints."""
    records = {"base": stage(bench, "local-base", "base", digest_of([code, "base", fingerprint(spec.base, memo)]))}
    for t, task in spec.tasks.items():
        sources = [fingerprint(task.calibration.path, memo), fingerprint(task.test.path, memo)]
        records[f"data/{t}"] = stage(bench, "local-data", f"data/{t}", digest_of(
            [code, "data", t, task.model_dump(), spec.calibration, spec.test_rows, spec.seed, sources]), task=t)
    for t in spec.tasks:
        records[f"expert/{t}"] = stage(bench, "local-expert", f"expert/{t}", digest_of(
            [code, "expert", t, fingerprint(spec.experts[t], memo)]), task=t)
    return records


# ---- runs and report -----------------------------------------------------------------------------
def method_runs(spec: UserRecipe) -> dict[str, MethodRun]:
    """The runs the recipe asks for, FeatCal with its `featcal` section, merges at its `scaling`."""
    catalogue = {
        "ta_featcal": MethodRun("task_arithmetic", "featcal", models=("base", "merged", "calibrated", "expert"),
                                featcal=spec.featcal, scaling=spec.scaling),
        "ties_featcal": MethodRun("ties", "featcal", models=("merged", "calibrated"), featcal=spec.featcal,
                                  scaling=spec.scaling),
        # RegMean keeps the average of the non-linear parameters: the merged checkpoint is the average.
        "regmean": MethodRun("average", "regmean", models=("merged", "calibrated")),
        "regmean_pp": MethodRun("average", "regmean_plus_plus"),
        "ta_surgery": MethodRun("task_arithmetic", "surgery", scaling=spec.scaling),
        "ta_probsurgery": MethodRun("task_arithmetic", "probsurgery", scaling=spec.scaling),
        # TA + FeatCal with each task's head refitted (featcal.head_refit), paired with ta_featcal in the report
        "ta_featcal_refit": MethodRun("task_arithmetic", "featcal", featcal={**spec.featcal, "head_refit": True},
                                      scaling=spec.scaling),
    }
    runs = {name: catalogue[name] for name in spec.runs}
    for n in spec.sample_sizes:
        runs[f"ta_featcal_n{n:03d}"] = MethodRun("task_arithmetic", "featcal", examples=n, featcal=spec.featcal,
                                                 scaling=spec.scaling)
    return runs


def pipeline_config(bench: Path, spec: UserRecipe, run: MethodRun) -> dict[str, Any]:
    """The pipeline config of a run; every path absolute, so the run directory can live anywhere."""

    def source(task: str, split: str, **extra: Any) -> dict[str, Any]:
        t = spec.tasks[task]
        columns = {"column": t.column, "text_pair_column": t.text_pair_column}
        return {"path": str(bench / data_dir(task)), "split": split,
                **{k: v for k, v in columns.items() if v is not None}, **extra}

    tasks = list(spec.tasks)
    return {
        **model_sections(bench, tasks, run),
        "calibration": {"data": {t: source(t, "calibration") for t in tasks}, "examples_per_task": run.examples,
                        "batch_size": spec.batch_size, "max_length": spec.max_length, "seed": 42},
        "evaluation": {"enabled": True, "batch_size": 64, "models": list(run.models),
                       "data": {t: source(t, "test", label_column=spec.tasks[t].label_column) for t in tasks}},
        "runtime": spec.runtime,
    }


def about(bench: Path, spec: UserRecipe) -> str:
    rows = split_sizes(bench, list(spec.tasks))
    lines = [f"- `{t}`: expert `{spec.experts[t]}`; calibration pool {rows[t]['calibration']} rows of "
             f"`{task.calibration.path}`, test {rows[t]['test']} rows of `{task.test.path}`"
             for t, task in spec.tasks.items()]
    return (f"A user recipe: base `{spec.base}`; merges at scale {spec.scaling:g}; FeatCal {spec.featcal}; seed "
            f"{spec.seed}.\n\n" + "\n".join(lines))


def write_report(bench: Path, spec: UserRecipe, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                 out_dir: str | None, study: Study) -> tuple[list[str], dict[str, Any]]:
    tasks = list(spec.tasks)
    test_rows = {t: r["test"] for t, r in split_sizes(bench, tasks).items()}
    return save_report(bench, spec.name, build_report(results, tasks, {**meta, "test_rows": test_rows}, study),
                       results, out_dir, study)


def _by_file(name: str, options: BuildOptions) -> UserRecipe:
    raise ValueError(f"{name}: a user recipe is built from its file: featcal bench build --recipe FILE.yaml")


RECIPE = Recipe(
    entry=entry("user"),
    spec=UserRecipe,
    options=frozenset(),
    located=_by_file,
    build=build_graph,
    build_modules=(sys.modules[__name__],),
    stages={"local-base": write_base, "local-data": write_data, "local-expert": write_expert},
    study=SHARED / "user.yaml",
    # The recipe file's runs; a study given to `bench run --study` with runs of its own replaces them.
    runs=lambda spec, study: study.runs or method_runs(spec),
    run_config=pipeline_config,
    method_modules=(sys.modules[__name__],),
    report=Report(title=lambda spec: f"FeatCal benchmark `{spec.name}`: a user recipe, {len(spec.tasks)} tasks",
                  about=about, write=write_report, modules=(sys.modules[__name__],)),
    write_configs=True,
)
