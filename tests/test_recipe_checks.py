"""`featcal bench build --recipe` runs `featcal plan`'s checkpoint and data checks on the recipe's own files before
anything is built: a wrong column, string labels or a missing label column stop the build in one line naming the
recipe field (tasks.TASK.column, ...), with nothing written, instead of failing every method run of `bench run`.
A method run of `bench run` that fails anyway is reported by its one-line cause and its log's path."""

from __future__ import annotations

import json

import pytest
import yaml

from featcal_bench.cli import main
from featcal_bench.stages import MethodRunFailed, failure_cause, run_method_process
from featcal_bench.user import recipe_field
from tests.conftest import one_error_line
from tests.test_bench_recipe import user_files


@pytest.fixture(scope="module")
def recipe(tiny_example, tmp_path_factory):
    return user_files(tiny_example, tmp_path_factory.mktemp("checked"))


def string_labels(path, root):
    """The topic test rows with each label written as its class name ('0' → 'class_0')."""
    rows = [json.loads(line) for line in (root / path).read_text().splitlines()]
    out = root / "data" / "topic_test_strings.jsonl"
    out.write_text("".join(json.dumps({**r, "label": f"class_{r['label']}"}) + "\n" for r in rows))
    return "data/topic_test_strings.jsonl"


def test_bad_sources_are_refused_at_build_naming_the_recipe_field(recipe, tmp_path, capsys):
    path, raw = recipe
    topic = raw["tasks"]["topic"]
    cases = [
        ({**topic, "column": "txt"}, "tasks.topic.column: "),
        ({**topic, "label_column": "y"}, "tasks.topic.label_column: "),
        ({**topic, "test": {"path": string_labels(topic["test"]["path"], path.parent)}}, "tasks.topic.label_column: "),
    ]
    for task, field in cases:
        bad = path.parent / "bad.yaml"
        bad.write_text(yaml.safe_dump({**raw, "tasks": {**raw["tasks"], "topic": task}}))
        assert main(["bench", "build", "--recipe", str(bad), "--out", str(tmp_path / "b")]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"featcal: error: {bad}: {field}"), line
        assert "calibration.data" not in line and "evaluation.data" not in line
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("message, renamed", [
    ("calibration.data.topic.column: 'txt' is not a column", "tasks.topic.column: 'txt' is not a column"),
    ("evaluation.data.sst2.label_column: row 3 holds 'pos'", "tasks.sst2.label_column: row 3 holds 'pos'"),
    ("evaluation.data.sst2.text_pair_column: missing", "tasks.sst2.text_pair_column: missing"),
    ("calibration.data.topic: split 'train' is empty", "tasks.topic.calibration: split 'train' is empty"),
    ("evaluation.data.topic: no such file", "tasks.topic.test: no such file"),
    ("calibration.max_length: 1 is below 2", "max_length: 1 is below 2"),
    ("experts.topic: lacks the head", "experts.topic: lacks the head"),
])
def test_plan_fields_are_named_as_the_recipe_names_them(message, renamed):
    assert recipe_field(message) == renamed


def test_a_failed_method_run_is_reported_by_its_cause_with_its_log(tmp_path):
    """`bench run`'s method process writes to runs/RUN.log; when it fails, the error leads with the cause (the last
    error line of that log), then names the log, which stays on disk with the whole traceback."""
    with pytest.raises(MethodRunFailed) as failed:
        run_method_process(tmp_path, "ta_featcal")  # no benchmark was built here
    log = tmp_path / "runs" / "ta_featcal.log"
    message = str(failed.value)
    assert "\n" not in message and message.startswith("benchmark run 'ta_featcal' failed: FileNotFoundError: ")
    assert "no benchmark spec" in message and f"its log: {log};" in message
    assert "Traceback (most recent call last)" in log.read_text()


@pytest.mark.parametrize("output, cause", [
    ("step 1\nTraceback (most recent call last):\n  File x\nValueError: tasks.topic.column: no\n", "ValueError: "
     "tasks.topic.column: no"),
    ("progress\nfeatcal: error: evaluation.data.t.label_column: 'pos'\n", "featcal: error: evaluation.data.t."
     "label_column: 'pos'"),
    ("KeyError: 'a'\nduring handling\nRuntimeError: then this\n  \n", "RuntimeError: then this"),
    ("killed at step 3\n", "killed at step 3"),
    ("", "no output"),
])
def test_failure_cause_is_the_last_error_line(output, cause):
    assert failure_cause(output) == cause
