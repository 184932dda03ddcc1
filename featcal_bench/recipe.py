"""What a benchmark recipe is, and the registry that names every recipe once.

A recipe says only what differs between benchmarks: where its base and experts come from and which stages build them
(its build graph), its tasks' data, each run's pipeline config, and its report; its method runs, the report's rows and
curves are data, its study file (featcal_bench/study.py). The
generic machinery (featcal_bench/stages.py) builds, runs, caches, resumes and reports every recipe the same way;
`featcal_bench.method` is the one process a method run runs in; the registry (featcal_bench/builtin.py) finds a recipe
by the name `bench build` is given, or by the spec file a built directory holds.

A frozen dataclass rather than a YAML file for the built-in recipes: their build graphs and data renderers are code
(fine-tunes, tokenizer training, prompt templates), and a dataclass of typed fields and functions is checked by the
type checker and found by `grep`. A user's recipe is data only (local checkpoints and files), so it is a YAML file
validated by pydantic (featcal_bench/user.py's UserRecipe), built and run by the `user` recipe like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from featcal_bench.catalog import Entry, Preset
from featcal_bench.runs import MethodRun
from featcal_bench.study import Study
from storage.atomic import read_json, write_json
from storage.rundir import Record

S = TypeVar("S", bound="SavedSpec")
# A stage runner: (benchmark dir, stage kind, stage name, cache key, **params) → the stage's record.
Call = Callable[..., Record]
# A stage: (benchmark dir, **params) → (outputs relative to the benchmark dir, info).
Stage = Callable[..., tuple[list[str], dict[str, Any]]]
BUILD_OPTIONS = ("models_from", "data_from", "tasks", "test_rows", "spam_assassin", "wordnet")


class SavedSpec(BaseModel):
    """A built benchmark's settings, saved in its directory as SPEC_FILE: the file also tells which recipe built it.
    Each spec also has `tasks`, which iterates over its task names."""

    SPEC_FILE: ClassVar[str]

    name: str

    def save(self, bench_dir: Path) -> None:
        write_json(Path(bench_dir) / self.SPEC_FILE, self.model_dump(mode="json"))

    @classmethod
    def load(cls: type[S], bench_dir: Path) -> S:
        path = Path(bench_dir) / cls.SPEC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: build the benchmark first (featcal bench build ... --out "
                                    f"{bench_dir})")
        return cls.model_validate(read_json(path))

    @classmethod
    def is_built(cls, bench_dir: str | Path) -> bool:
        return (Path(bench_dir) / cls.SPEC_FILE).is_file()


@dataclass(frozen=True)
class BuildOptions:
    """What `featcal bench build` was given besides the name and `--out` (None: not given)."""

    models_from: str | None = None
    data_from: str | None = None
    tasks: list[str] | None = None
    test_rows: int | None = None
    spam_assassin: str | None = None
    wordnet: str | None = None

    def given(self) -> list[str]:
        return [k for k in BUILD_OPTIONS if getattr(self, k) is not None]


NO_OPTIONS = BuildOptions()  # `bench build NAME --out DIR` and nothing else


@dataclass(frozen=True)
class Report:
    """A recipe's report: its title line, what was built (`about`), and the report stage that writes the files.

    `write(bench, spec, results, meta, out_dir, study)` returns the report stage's (files, info); `meta` holds the
    title, about, machine and spec, which every report carries; the study's rows and curves make its table."""

    title: Callable[[Any], str]
    about: Callable[[Path, Any], str]
    write: Callable[[Path, Any, dict[str, dict[str, Any]], dict[str, Any], str | None, Study],
                    tuple[list[str], dict[str, Any]]]
    modules: Sequence[ModuleType]  # the code its cache key covers


@dataclass(frozen=True)
class Recipe:
    """One benchmark family: its presets, how a preset becomes a spec, its build graph, its study (method runs, report
    rows and curves) and its report."""

    entry: Entry  # its name, presets (the names `bench build` takes) and access, from featcal_bench/catalog.py
    spec: type[SavedSpec]
    options: frozenset[str]  # the BuildOptions it reads; any other given is refused in one line
    located: Callable[[str, BuildOptions], Any]  # (preset name, options) → its spec, sources checked before any work
    build: Callable[[Path, Any, Call, str, Path], dict[str, Record]]  # (bench, spec, stage, code digest, memo)
    build_modules: Sequence[ModuleType]  # the code the build stages' keys cover
    stages: Mapping[str, Stage]  # the stage kinds its build runs
    study: Path  # its study file: the run matrix, the report's rows and curves (`bench run --study` takes another)
    run_config: Callable[[Path, Any, MethodRun], dict[str, Any]]  # a run's pipeline config on a built benchmark
    method_modules: Sequence[ModuleType]  # the code the method runs' keys cover (besides the pipeline's own)
    report: Report
    # (spec, study) → its method runs by name: the study's, unless the recipe derives them from its spec
    runs: Callable[[Any, Study], dict[str, MethodRun]] = field(default=lambda spec, study: study.runs)
    run_inputs: Callable[[Any], list[str]] = field(default=lambda spec: [
        "base", *(f"{k}/{t}" for t in spec.tasks for k in ("data", "expert"))])  # build stages the runs are keyed on
    estimate: Callable[[Path, Any], str] | None = None  # what `bench run` will cost here, said after the build
    # A Surgery or ProbSurgery row trains on merged features computed once per pool example (CLIP: the same training
    # without 16,000 ViT forwards per task; its time is then a lower bound of the original protocol's), or per step.
    cache_surgery_features: bool = False
    threads: int | None = None  # torch threads of a method run's process (None: the pipeline config decides)
    write_configs: bool = False  # write every run's pipeline config under configs/ at build time

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def presets(self) -> Mapping[str, Preset]:
        return self.entry.presets

    @property
    def access(self) -> str:
        return self.entry.access
