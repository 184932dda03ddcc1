"""`featcal server` and `featcal run` against a real Prefect server: state, task runs per block, artifacts, UI."""

import json
import re
from collections import Counter
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)

from flows.cli import main
from tests.prefect_helpers import cli_env, featcal, wait_for

pytest_plugins = ("tests.prefect_server",)

TASKS = ("count", "negation", "topic")
BLOCKS = 3
STAGES = (
    1 + 3 + BLOCKS * (3 + 1) + (BLOCKS - 1) * 3 + 1 + 1
)  # merge, prepare, gram+solve, propagate, assemble, evaluate


def _table(artifact) -> list[dict]:
    assert artifact.type == "table"
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def test_run_reports_to_the_server_with_names_tags_and_artifacts(prefect_server, tiny_example, tmp_path):
    run_dir = tmp_path / "ex1"
    proc = featcal("run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(run_dir),
                   env=cli_env(prefect_server))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"reporting to the featcal server (home {prefect_server.home}) at {prefect_server.url}" in out
    flow_run_id = UUID(re.search(rf"flow run: {re.escape(prefect_server.url)}/runs/flow-run/([0-9a-f-]+)", out)[1])

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        assert flow_run.state.is_completed()
        assert flow_run.name == "featcal · ex1"
        assert {"featcal", "model:bert/base", "merge:task_arithmetic", f"run-dir:{run_dir}"} <= set(flow_run.tags)
        assert flow_run.parameters["run_dir"] == str(run_dir) and flow_run.parameters["runner"] == "local"

        def final_task_runs():
            runs = client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])), limit=200)
            final = [r for r in runs if r.state is not None and r.state.is_final()]
            return final if len(final) >= STAGES else None  # task runs land from events, asynchronously

        task_runs = wait_for("the task runs to land", final_task_runs, timeout=60)
        assert len(task_runs) == STAGES and all(t.state.is_completed() for t in task_runs)
        per_block = Counter(t.name[:len("block 00")] for t in task_runs if t.name.startswith("block "))
        assert per_block == {"block 00": 7, "block 01": 7, "block 02": 4}  # 3 grams + solve (+ 3 propagations)
        names = {t.name for t in task_runs}
        assert {f"block {b:02d} · gram · {t}" for b in range(BLOCKS) for t in TASKS} <= names
        assert {"merge", "block 02 · solve", "block 01 · propagate · topic", "evaluate"} <= names
        assert all(t.tags == [] for t in task_runs)  # tags on task runs only with --tag-task-runs

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    by_key = {a.key: a for a in artifacts}
    assert by_key["featcal-progress"].type == "progress" and by_key["featcal-progress"].data == 100
    assert f"{STAGES}/{STAGES} stages (0 from cache)" in by_key["featcal-progress"].description
    accuracy = _table(by_key["featcal-accuracy"])
    assert sorted(row["task"] for row in accuracy) == list(TASKS)
    assert all(0 <= row["calibrated"] <= 100 for row in accuracy)
    for b in range(BLOCKS):
        rows = _table(by_key[f"featcal-block-{b:02d}"])
        assert [r["task"] for r in rows] == [*TASKS, "(solve, all tasks)"]
        assert rows[-1]["modules solved"] > 0 and rows[-1]["seconds"] >= 0
        assert all(float(r["drift before"]) > 0 for r in rows[:-1])
    assert "# FeatCal report" in by_key["featcal-report"].data
    assert f"file://{run_dir}/calibrated" in by_key["featcal-run-dir"].data


def test_ui_and_api_answer(prefect_server):
    home = httpx.get(prefect_server.url + "/", timeout=10)
    assert home.status_code == 200 and "<html" in home.text.lower()
    health = httpx.get(prefect_server.url + "/api/health", timeout=10)
    assert health.status_code == 200 and health.json() is True
    ui_settings = httpx.get(prefect_server.url + "/ui-settings", timeout=10).json()
    assert ui_settings["api_url"] == prefect_server.api_url  # the browser is sent to this server, not port 4200


def test_server_commands_say_what_runs(prefect_server, tmp_path, capsys):
    assert main(["server", "status", "--home", prefect_server.home]) == 0
    assert f"running: Prefect server at {prefect_server.url} (pid {prefect_server.pid}" in capsys.readouterr().out
    assert main(["server", "start", "--home", prefect_server.home, "--port", "0"]) == 0  # does not start a second
    assert f"already running: Prefect server, pid {prefect_server.pid}" in capsys.readouterr().out
    empty = str(tmp_path / "nobody-home")
    assert main(["server", "status", "--home", empty]) == 1
    assert "no featcal Prefect server is running" in capsys.readouterr().out
    assert main(["server", "stop", "--home", empty]) == 2
    assert f"no featcal Prefect server is running (home {tmp_path / 'nobody-home'})" in capsys.readouterr().err
