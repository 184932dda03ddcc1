"""Studies as data (featcal_bench/study.py): every recipe's runs, report rows and curves come from a YAML file;
includes, named settings and the one-line errors for a bad file."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from featcal_bench.builtin import recipes
from featcal_bench.llm import spec as llm_spec
from featcal_bench.runs import MethodRun
from featcal_bench.study import SHARED, load_study

ROOT = Path(__file__).resolve().parent.parent


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_every_recipes_study_loads_and_ships_as_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["featcal_bench"]
    files = sorted((ROOT / "featcal_bench").rglob("*.yaml"))
    assert [f for f in files if not any(fnmatch(str(f.relative_to(ROOT / "featcal_bench")), p) for p in data)] == []
    for recipe in recipes().values():
        study = load_study(recipe.study)
        assert study.reference == "ta_featcal" and study.paired_reference == "TA + FeatCal"
        assert recipe.study in files and (study.runs or recipe.name == "user")


def test_includes_settings_and_overrides_resolve(tmp_path):
    """An included file's settings, runs, rows and curves come first; `use` extends a setting (through a chain), a
    run's `featcal` is a setting's name or a section that extends one; a run the including file repeats is its own."""
    _write(
        tmp_path,
        {
            "shared/base.yaml": "reference: r\npaired_reference: R\nsettings:\n  paper: {lambda: 0.05, rho: 2.2}\n"
            "  auto: {use: paper, lambda: auto}\n"
            "runs:\n  r: {merge: task_arithmetic, method: featcal, featcal: paper}\n"
            "  g: {merge: ties, method: featcal}\n"
            "rows:\n  - [R, r, calibrated, total]\n",
            "study.yaml": "include: [shared/base.yaml]\nsettings:\n  few: {use: auto, shrinkage: auto}\n"
            "runs:\n  g: {merge: given, method: featcal, start: r, featcal: few, models: [merged, calibrated]}\n"
            "  h: {merge: task_arithmetic, method: featcal, examples: 8, featcal: {use: few, rho: 3.0}}\n"
            "rows:\n  - {label: G, run: g, model: merged, cost: merge}\n"
            "curves:\n  c: {run: r, label: C, gain: 'keeps {percent:.1f} %'}\ngains: [c]\n",
        },
    )
    study = load_study(tmp_path / "study.yaml")
    assert study.settings["few"] == {"lambda": "auto", "rho": 2.2, "shrinkage": "auto"}
    assert study.runs == {
        "r": MethodRun("task_arithmetic", "featcal", featcal={"lambda": 0.05, "rho": 2.2}),
        "g": MethodRun("given", "featcal", models=("merged", "calibrated"), start="r",
                       featcal={"lambda": "auto", "rho": 2.2, "shrinkage": "auto"}),
        "h": MethodRun("task_arithmetic", "featcal", examples=8, featcal={"lambda": "auto", "rho": 3.0,
                                                                         "shrinkage": "auto"}),
    }
    assert [(r.label, r.run, r.model, r.cost) for r in study.rows] == [("R", "r", "calibrated", "total"),
                                                                       ("G", "g", "merged", "merge")]
    assert study.curves["c"].run == "r" and study.gains == ("c",) and study.reference == "r"


@pytest.mark.parametrize(
    "files, message",
    [
        (
            {
                "s.yaml": "reference: r\npaired_reference: R\nruns:\n  r: {merge: task_arithmetic, method: featcal, "
                "featcal: tuned}\n"
            },
            "runs.r.featcal: unknown setting 'tuned'; known: []",
        ),
        (
            {
                "s.yaml": "reference: r\npaired_reference: R\nruns:\n  r: {merge: task_arithmetic, method: featcal, "
                "exmples: 8}\n"
            },
            "runs.r.exmples: Extra inputs are not permitted",
        ),
        (
            {"s.yaml": "reference: r\npaired_reference: R\nruns:\n  r: {merge: given, method: featcal}\n"},
            "runs.r: MethodRun: merge given reads run `start`'s calibrated checkpoint",
        ),
        ({"s.yaml": "include: [t.yaml]\n", "t.yaml": "include: [s.yaml]\n"}, "includes itself in turn"),
        ({"s.yaml": "include: [nope.yaml]\n"}, "nope.yaml: no such file"),
        ({"s.yaml": "runs: {}\n"}, "reference, paired_reference: required"),
        (
            {
                "s.yaml": "reference: r\npaired_reference: R\nsettings:\n  a: {use: b}\n  b: {use: a}\n"
                "runs:\n  r: {merge: task_arithmetic, method: featcal, featcal: a}\n"
            },
            "uses itself in turn (a → b → a)",
        ),
        (
            {
                "s.yaml": "reference: r\npaired_reference: R\nruns:\n  r: {merge: task_arithmetic, method: featcal}\n"
                "rows:\n  - [R, x, calibrated]\n"
            },
            "rows: runs ['x'] are not among the study's runs",
        ),
        (
            {"s.yaml": "reference: r\npaired_reference: R\ncurves:\n  c: {run: r, label: C}\ngains: [c]\n"},
            "gains: each must name a curve with a `gain` sentence",
        ),
    ],
)
def test_a_bad_study_is_named_in_one_line(tmp_path, files, message):
    _write(tmp_path, files)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_study(tmp_path / "s.yaml")
    assert message in str(err.value) and str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_mergebenchs_study_runs_at_the_settings_its_report_states():
    """The report's text states MergeBench's settings from llm/spec.py; the study's runs must use the same."""
    runs = load_study(SHARED.parent / "llm" / "study.yaml").runs
    assert runs["ta_featcal"].scaling == runs["ties_featcal"].scaling == llm_spec.TA_SCALING
    assert runs["regmean"].featcal == {"regmean_off_diagonal": llm_spec.REGMEAN_OFF_DIAGONAL}
    assert runs["regmean_pp"].featcal == {"regmean_off_diagonal": llm_spec.REGMEAN_PP_OFF_DIAGONAL}


def test_a_report_whose_runs_no_row_reads_is_refused_naming_them(tmp_path):
    """`bench run --runs` of runs the study gives no row (a rule's candidate, a draw) ran them, but a report of no row
    has nothing to show: one line says which runs and where their rows go, before any file is written."""
    from featcal_bench.report import save_report

    study = load_study(SHARED.parent / "minilm" / "study.yaml")
    with pytest.raises(ValueError, match=r"no row of the study reads the runs that ran \(a_run, b_run\); give them "
                                         r"rows in the study's `rows:`"):
        save_report(tmp_path, "demo", {"methods": []}, {"b_run": {}, "a_run": {}}, None, study)
    assert not (tmp_path / "report").exists()
