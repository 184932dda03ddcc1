"""A user's own benchmark from a recipe YAML (featcal_bench/user.py) over the tiny example's BERT experts and its data
exported to CSV and JSON Lines files: `featcal bench build --recipe` builds it, `bench run` runs TA, TIES, RegMean++
and TA + FeatCal on it and writes the same report, paired comparisons and plots as the built-in benchmarks; a changed
data file rebuilds only its own task's data. Also `featcal bench list` and the registry's one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from featcal.devices import one_thread
from featcal_bench import stages
from featcal_bench.builtin import loaded, recipes, registry
from featcal_bench.catalog import CATALOG, entry
from featcal_bench.cli import main
from featcal_bench.method import run_method
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.study import SHARED
from featcal_bench.user import UserRecipe
from storage.rundir import CONFIG_NAME, Record, RunDir
from tasks.record import recorded

TASKS = ("count", "negation", "topic")
CALIBRATION, TEST_ROWS = 16, 40


def in_process(bench, kind: str, name: str, key: str, **params) -> Record:
    """A stage in this process, the method runs too (the hub benchmarks' tests cover the one-process-per-run path)."""
    if kind != "method":
        return direct_call(bench, kind, name, key, **params)
    run, study = params["run"], params.get("study")
    return recorded(RunDir(bench), name, key, lambda: ([f"results/{run}.json"], run_method(bench, run, study)["cost"]))


def user_files(example, root):
    """The example's calibration rows as CSV files (JSON Lines for `count`, whose rows are token ids) and its test rows
    as JSON Lines, and a recipe naming them with paths relative to the recipe's own directory."""
    (root / "data").mkdir(parents=True)
    tasks = {}
    for t in TASKS:
        ds = datasets.load_from_disk(str(example / "bert" / "data" / t))
        text = "text" in ds["calibration"].column_names
        pool = f"data/{t}_pool.csv" if text else f"data/{t}_pool.jsonl"
        if text:
            ds["calibration"].to_csv(str(root / pool), index=False)
        else:
            ds["calibration"].to_json(str(root / pool))
        ds["test"].to_json(str(root / "data" / f"{t}_test.jsonl"))
        tasks[t] = {
            "calibration": pool,
            "test": {"path": f"data/{t}_test.jsonl"},
            **({"column": "text"} if text else {}),
        }
    recipe = {"name": "my-bench", "base": str(example / "bert" / "base"),
              "experts": {t: str(example / "bert" / "experts" / t) for t in TASKS}, "tasks": tasks,
              "runs": ["ta_featcal", "ties_featcal", "regmean_pp"], "calibration": CALIBRATION,
              "test_rows": TEST_ROWS, "runtime": {"threads": 1}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, recipe


@pytest.fixture(scope="module")
def built(tiny_example, tmp_path_factory):
    """`featcal bench build --recipe` (its flow run in this process without Prefect: Prefect is not under test)."""
    path, raw = user_files(tiny_example, tmp_path_factory.mktemp("user"))
    bench = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setattr(stages, "build_flow", lambda bench_dir, spec: build_stages(Path(bench_dir), spec, direct_call))
        assert main(["bench", "build", "--recipe", str(path), "--out", str(bench)]) == 0
    return bench, path, raw


@pytest.fixture(scope="module")
def ran(built):
    bench, _, _ = built
    with one_thread():
        return run_stages(bench, None, None, in_process)


def test_recipe_builds_a_benchmark_of_its_files(built):
    bench, path, _ = built
    spec = UserRecipe.load(bench)
    assert list(spec.tasks) == list(TASKS) and spec.runs == ["ta_featcal", "ties_featcal", "regmean_pp"]
    assert spec.tasks["topic"].calibration.path == str(path.parent / "data" / "topic_pool.csv")  # resolved
    for t in TASKS:
        data = datasets.load_from_disk(str(bench / "data" / t))
        assert (len(data["calibration"]), len(data["test"])) == (CALIBRATION, TEST_ROWS)
        source = datasets.Dataset.from_json(str(path.parent / "data" / f"{t}_test.jsonl"))
        assert data["test"].column_names == source.column_names
        assert {json.dumps(r) for r in data["test"]} <= {json.dumps(r) for r in source}
        assert (bench / "experts" / t / "config.json").is_file() and (bench / "configs" / "ta_featcal.yaml").is_file()
    starts = len(RunDir(bench).events())  # a second build finds every stage cached
    build_stages(bench, spec, direct_call)
    assert len(RunDir(bench).events()) == starts


def test_run_writes_the_same_report_paired_comparisons_and_plots(built, ran):
    bench, _, _ = built
    report = json.loads((bench / "report" / "my-bench.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {"experts (individual)", "task arithmetic", "TIES", "RegMean++", "TA + FeatCal", "TIES + FeatCal"} <= set(
        rows
    )
    ours = {run: json.loads((bench / "runs" / run / "report.json").read_text()) for run in ("ta_featcal", "regmean_pp")}
    for method, run, model in (
        ("task arithmetic", "ta_featcal", "merged"),
        ("TA + FeatCal", "ta_featcal", "calibrated"),
        ("RegMean++", "regmean_pp", "calibrated"),
    ):
        accuracy = {t: ours[run]["tasks"][t]["accuracy"][model] for t in TASKS}
        assert rows[method]["accuracy"] == accuracy and rows[method]["average"] == pytest.approx(
            sum(accuracy.values()) / 3
        )
    paired = {c["method"] for c in report["paired"]["comparisons"]}
    assert {"task arithmetic", "TIES", "RegMean++"} <= paired
    md = (bench / "report" / "my-bench.md").read_text()
    assert "a user recipe, 3 tasks" in md and "TA + FeatCal" in md
    assert all((bench / p).is_file() for p in ran["report"]["outputs"])
    assert any(p.endswith(".png") for p in ran["report"]["outputs"])
    starts = len(RunDir(bench).events())  # a rerun finds every method run and the report cached
    assert run_stages(bench, None, None, in_process) == ran and len(RunDir(bench).events()) == starts


def test_bench_run_takes_a_study_file(built, ran, tmp_path):
    """`bench run --study FILE`: the study's runs instead of the recipe's, and its rows in the report; a rerun of the
    same study is cached."""
    bench, _, _ = built
    copy = tmp_path / "bench"
    shutil.copytree(bench, copy)
    study = tmp_path / "study.yaml"
    study.write_text(
        f"include: [{SHARED / 'settings.yaml'}]\nreference: mine\n"
        "runs:\n  mine: {merge: task_arithmetic, method: featcal, models: [merged, calibrated, expert], "
        "featcal: {use: paper, lambda: 0.1}}\n"
        "rows:\n  - [experts, mine, expert]\n  - [TA, mine, merged, merge]\n  - [mine, mine, calibrated, total]\n"
    )
    with one_thread():
        records = run_stages(copy, None, None, in_process, str(study))
    assert sorted(records) == ["mine", "report"]
    ours = json.loads((copy / "runs" / "mine" / "report.json").read_text())
    resolved = yaml.safe_load((copy / "runs" / "mine" / CONFIG_NAME).read_text())
    assert resolved["featcal"]["lambda"] == 0.1 and resolved["featcal"]["rho"] == 2.2
    report = json.loads((copy / "report" / "my-bench.json").read_text())
    assert [r["method"] for r in report["methods"]] == ["experts", "TA", "mine"]
    assert report["methods"][2]["accuracy"] == {t: ours["tasks"][t]["accuracy"]["calibrated"] for t in TASKS}
    assert "| mine |" in (copy / "report" / "my-bench.md").read_text()
    starts = len(RunDir(copy).events())
    assert run_stages(copy, None, None, in_process, str(study)) == records and len(RunDir(copy).events()) == starts


def test_a_changed_data_file_rebuilds_only_its_task(built, ran, tmp_path):
    bench, path, raw = built
    copy = tmp_path / "bench"
    shutil.copytree(bench, copy)
    pool = path.parent / "data" / "topic_pool.csv"
    moved = tmp_path / "topic_pool.csv"
    rows = pool.read_text().splitlines()
    moved.write_text("\n".join([rows[0], *rows[2:], rows[1]]) + "\n")  # the same rows, another order
    raw = {**raw, "tasks": {**raw["tasks"], "topic": {**raw["tasks"]["topic"], "calibration": str(moved)}}}
    raw["tasks"] = {t: {**v, **({} if t == "topic" else {"calibration": str(path.parent / v["calibration"])}),
                        "test": {"path": str(path.parent / v["test"]["path"])}} for t, v in raw["tasks"].items()}
    spec = UserRecipe.model_validate(raw)
    before = {
        n: RunDir(copy).record(n)["key"] for n in ("base", *(f"{k}/{t}" for t in TASKS for k in ("data", "expert")))
    }
    with one_thread():
        after = build_stages(copy, spec, direct_call)
    changed = sorted(n for n, key in before.items() if after[n]["key"] != key)
    assert changed == ["data/topic"]


def test_bad_recipes_are_named_in_one_line(built, tmp_path, capsys):
    _, path, raw = built
    out = str(tmp_path / "b")
    cases = [({**raw, "experts": {"count": raw["experts"]["count"]}}, "experts: one per task"),
             ({**raw, "runs": ["ta_featcal", "fisher"]}, "runs: Value error, unknown runs ['fisher']"),
             ({**raw, "tasks": {**raw["tasks"], "topic": {**raw["tasks"]["topic"], "label_colum": "y"}}},
              "tasks.topic.label_colum: Extra inputs are not permitted"),
             ({**raw, "base": "no/such/base"}, f"base: {path.parent / 'no/such/base'} does not exist")]
    for recipe, expected in cases:
        bad = path.parent / "bad.yaml"
        bad.write_text(yaml.safe_dump(recipe))
        assert main(["bench", "build", "--recipe", str(bad), "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{bad}: " in err and expected in err, err
    assert main(["bench", "build", "--recipe", str(path), "--out", out, "--tasks", "topic"]) == 2
    assert "--tasks: only for clip-vit-b32-ta8" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_bench_list_names_every_benchmark_once(capsys):
    assert main(["bench", "list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split()[0] for line in lines]
    assert names == ["minilm8", "demo", "tinyllama-domains", "clip-vit-b32-ta8", "flan-t5-base-glue8",
                     "mergebench-llama-3.2-3b", "--recipe"]
    assert all(("offline" in line) == (n in ("minilm8", "demo", "tinyllama-domains")) for n, line in zip(names, lines))
    assert all("cost: " in line for line in lines[:-1])


def test_bench_list_imports_no_recipe_and_no_torch():
    """A listing reads the catalog alone: a recipe module pulls in torch, transformers and the pipeline (seconds)."""
    code = ("import sys; from featcal_bench.cli import main; main(['bench', 'list']); "
            "heavy = ('torch', 'transformers', 'prefect', 'datasets'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy "
            "or m.endswith('.recipe') or m in ('featcal_bench.user', 'featcal_bench.builtin')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_registry_refuses_a_second_claim_on_a_name():
    clip = recipes()["clip"]
    with pytest.raises(ValueError, match="recipe copy: preset clip-vit-b32-ta8 is already clip's"):
        registry([clip, dataclasses.replace(clip, entry=dataclasses.replace(clip.entry, name="copy"))])


def test_a_catalog_entry_must_name_the_module_of_its_recipe():
    assert [r.entry for r in recipes().values()] == list(CATALOG)
    with pytest.raises(ValueError, match="featcal_bench.clip.recipe.RECIPE is recipe 'clip', not 't5'"):
        loaded(dataclasses.replace(entry("t5"), module="featcal_bench.clip.recipe"))


def test_the_docs_template_is_a_valid_recipe():
    """The template docs/adding-a-benchmark.md tells users to copy validates as it stands."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-benchmark.md").read_text()
    template = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    spec = UserRecipe.model_validate(template)
    assert list(spec.tasks) == ["sentiment", "topic", "spam"] and spec.tasks["topic"].test.split == "test"
    assert spec.runs == ["ta_featcal", "ties_featcal", "regmean_pp"] and spec.sample_sizes == [8, 32]
