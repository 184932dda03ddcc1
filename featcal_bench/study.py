"""A study as data: the method runs of a benchmark, the rows of the table its report writes and its sample curves,
read from a YAML file (each built-in recipe's `study.yaml`, or one given to `featcal bench run --study FILE`).

    include: [../studies/settings.yaml]   # files read first: their settings, runs, rows and curves come first
    settings:                             # named `featcal` sections; `use` extends another one
      tuned: {lambda: 0.5, rho: 3.0, alpha: 0.25}
    runs:                                 # name → a MethodRun's fields; `featcal` is a setting's name or a section
      ta_featcal: {merge: task_arithmetic, method: featcal, models: [base, merged, calibrated, expert], featcal: tuned}
      ta_featcal_head: {merge: task_arithmetic, method: featcal, featcal: {use: tuned, calibrate_head_side: true}}
      ta_featcal_auto_shared_n008:          # `shared_inputs`: the run's calibration.shared_inputs section
        {merge: task_arithmetic, method: featcal, examples: 8, featcal: auto, shared_inputs: {weight: auto}}
    rows:                                 # the report's table, in order: label, run, model, what its cost is
      - [task arithmetic, ta_featcal, merged, merge]
      - [TA + FeatCal, ta_featcal, calibrated, total]
      - {label: TA + FeatCal + head side, run: ta_featcal_head, model: calibrated, cost: total,
         against: TA + FeatCal}           # also paired with the row without the option
    curves:                               # sample curves: run `{run}_n{n:03d}` has n examples per task
      featcal: {run: ta_featcal, label: TA + FeatCal}

Experiments live in these files, not in featcal_bench's code; a bad field is named in one line with its file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from featcal_bench.runs import FULL, MethodRun

SHARED = Path(__file__).with_name("studies")  # the parts studies include, and the user recipe's report


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunEntry(_Strict):
    """A method run as the file writes it: MethodRun's fields, `featcal` by setting name or as a section."""

    merge: str
    method: str | None
    examples: int = Field(FULL, ge=1)
    models: list[str] = Field(default_factory=lambda: ["calibrated"])
    featcal: str | dict[str, Any] = Field(default_factory=dict)
    scaling: float = 0.3
    density: float | None = None
    start: str | None = None
    protect: str | None = None
    shared_inputs: dict[str, Any] = Field(default_factory=dict)


class Row(_Strict):
    """A row of the report's table: its label, the run and the model it reads, and what its cost is (merge: the
    merge's; total: from the experts to this model; none: no cost column); `against`: the label of another row (the
    same run without one option) it is paired with, so the option's own effect has an interval."""

    label: str
    run: str
    model: str
    cost: Literal["merge", "total"] | None = None
    against: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        """`[label, run, model]` or `[label, run, model, cost]`: a table's row on one line."""
        if isinstance(value, list) and len(value) in (3, 4):
            return dict(zip(("label", "run", "model", "cost"), value))
        return value


class Curve(_Strict):
    """A sample curve: its 256-example run and its label; `gain` (optional) is the sentence the report writes with
    the share of the 256-example gain over TA that 8 examples keep, `{percent}` in it."""

    run: str
    label: str
    gain: str | None = None


class Choices(_Strict):
    """The run whose λ (and ρ) chosen without labels the report lists, and the section's heading."""

    run: str
    heading: str


class StudyFile(_Strict):
    """One YAML file of a study, before its includes are merged."""

    include: list[str] = Field(default_factory=list)
    reference: str | None = None  # the run that scores the experts and TA, every row's yardstick
    paired_reference: str | None = None  # the row label every other row is compared with
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    runs: dict[str, RunEntry] = Field(default_factory=dict)
    rows: list[Row] = Field(default_factory=list)
    curves: dict[str, Curve] = Field(default_factory=dict)
    gains: list[str] = Field(default_factory=list, description="the curves whose gain sentence the report writes, "
                             "in the order it writes them")
    choices: Choices | None = None


@dataclass(frozen=True)
class Study:
    """A study with its includes merged and its runs resolved."""

    source: str  # the file it was read from, for messages and cache keys
    reference: str
    paired_reference: str
    settings: dict[str, dict[str, Any]]  # each named `featcal` section, resolved
    runs: dict[str, MethodRun]
    rows: tuple[Row, ...]
    curves: Mapping[str, Curve]
    gains: tuple[str, ...]
    choices: Choices | None

    def report_part(self) -> dict[str, Any]:
        """What the report reads from the study, as plain data: its stage's cache key holds it."""
        return {
            "reference": self.reference,
            "paired_reference": self.paired_reference,
            "rows": [r.model_dump() for r in self.rows],
            "curves": {k: c.model_dump() for k, c in self.curves.items()},
            "gains": list(self.gains),
            "choices": self.choices.model_dump() if self.choices else None,
        }


def _read(path: Path, seen: tuple[Path, ...]) -> StudyFile:
    """`path` with its includes merged into it: theirs first, its own entries after (a name it repeats is its own)."""
    if path in seen:
        raise ValueError(f"{seen[-1]}: include {path} includes itself in turn ({' → '.join(map(str, (*seen, path)))})")
    if not path.is_file():
        raise FileNotFoundError(f"{seen[-1] if seen else 'study'}: {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
        own = StudyFile.model_validate(raw if raw is not None else {})
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()]
        raise ValueError(f"{path}: " + "; ".join(problems)) from None
    merged = StudyFile()
    for name in own.include:
        part = _read((path.parent / name).resolve(), (*seen, path))
        merged = _merged(merged, part)
    return _merged(merged, own)


def _merged(first: StudyFile, then: StudyFile) -> StudyFile:
    return StudyFile(reference=then.reference or first.reference,
                     paired_reference=then.paired_reference or first.paired_reference,
                     settings={**first.settings, **then.settings}, runs={**first.runs, **then.runs},
                     rows=[*first.rows, *then.rows], curves={**first.curves, **then.curves},
                     gains=[*first.gains, *then.gains], choices=then.choices or first.choices)


def _setting(study: StudyFile, value: str | dict[str, Any], where: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """A `featcal` section: a setting's name, or a section whose `use` names the setting it extends."""
    if isinstance(value, str):
        if value not in study.settings:
            raise ValueError(f"{where}: unknown setting {value!r}; known: {sorted(study.settings)}")
        if value in chain:
            raise ValueError(f"{where}: setting {value!r} uses itself in turn ({' → '.join((*chain, value))})")
        return _setting(study, study.settings[value], where, (*chain, value))
    section = dict(value)
    base = section.pop("use", None)
    return {**(_setting(study, base, where, chain) if base is not None else {}), **section}


def load_study(path: str | Path) -> Study:
    """The study in YAML file `path`, its includes merged and each run checked; a bad one is named in one line."""
    path = Path(path).resolve()
    study = _read(path, ())
    reference, paired_reference = study.reference, study.paired_reference
    if reference is None or paired_reference is None:
        missing = [k for k, v in (("reference", reference), ("paired_reference", paired_reference)) if v is None]
        raise ValueError(f"{path}: {', '.join(missing)}: required (here or in a file it includes)")
    runs = {}
    for name, entry in study.runs.items():
        fields = entry.model_dump()
        fields.update(
            models=tuple(entry.models), featcal=_setting(study, entry.featcal, f"{path}: runs.{name}.featcal")
        )
        try:
            runs[name] = MethodRun(**fields)
        except ValueError as exc:
            raise ValueError(f"{path}: runs.{name}: {exc}") from None
    for key, what in (("rows", [r.run for r in study.rows]), ("curves", [c.run for c in study.curves.values()])):
        unknown = sorted(set(what) - set(runs))
        if unknown and runs:
            raise ValueError(f"{path}: {key}: runs {unknown} are not among the study's runs")
    labels = {r.label for r in study.rows}
    unpaired = sorted({r.against for r in study.rows if r.against is not None} - labels)
    if unpaired:
        raise ValueError(f"{path}: rows: against {unpaired}: no row has that label")
    unknown_gains = sorted(set(study.gains) - set(study.curves))
    if unknown_gains or any(study.curves[g].gain is None for g in study.gains):
        raise ValueError(f"{path}: gains: each must name a curve with a `gain` sentence; got {study.gains}")
    settings = {name: _setting(study, name, f"{path}: settings.{name}") for name in study.settings}
    return Study(str(path), reference, paired_reference, settings, runs, tuple(study.rows), study.curves,
                 tuple(study.gains), study.choices)
