"""The Prefect flow against the session's real Prefect server: cache hits across flow runs, artifacts."""

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)

from flows.prefect_flow import featcal_flow

pytest_plugins = ("tests.prefect_server",)


def _task_runs(client, flow_run_id, expected: int):
    """The server records task runs from events, asynchronously: wait (bounded) until all have landed."""
    deadline = time.time() + 60
    while True:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])), limit=200
        )
        final = [r for r in runs if r.state is not None and r.state.is_final()]
        if len(final) >= expected or time.time() > deadline:
            return final
        time.sleep(0.5)


def test_flow_caches_across_runs_and_publishes_report(prefect_server, tiny_example, tmp_path):
    config = str(tiny_example / "bert" / "example.yaml")
    first = featcal_flow(config, str(tmp_path / "run"), [], return_state=True)
    second = featcal_flow(config, str(tmp_path / "run"), [], tag_task_runs=True, return_state=True)
    assert first.is_completed() and second.is_completed()
    with get_client(sync_client=True) as client:
        runs = {fr.id: fr for fr in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.state_details.flow_run_id,
                                                                    second.state_details.flow_run_id])))}
        assert len(runs) == 2
        stages = 1 + 3 + 3 * (3 + 1) + 2 * 3 + 1 + 1  # merge, prepare, gram+solve, propagate, assemble, evaluate
        first_tasks = _task_runs(client, first.state_details.flow_run_id, stages)
        second_tasks = _task_runs(client, second.state_details.flow_run_id, stages)
        names = {t.name for t in first_tasks}
        assert {"merge", "block 00 · gram · topic", "block 02 · solve", "evaluate"} <= names
        assert all(t.state.is_completed() for t in first_tasks)
        assert not any(t.state.name == "Cached" for t in first_tasks)
        assert len(first_tasks) == len(second_tasks) == stages
        assert all(t.state.name == "Cached" for t in second_tasks), {t.name: t.state.name for t in second_tasks}
        assert all(t.tags == [] for t in first_tasks)
        assert all(
            {"featcal", "merge:task_arithmetic", f"run-dir:{tmp_path / 'run'}"} <= set(t.tags) for t in second_tasks
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first.state_details.flow_run_id])))
        by_key = {a.key: a for a in artifacts}
        assert {"featcal-report", "featcal-accuracy", "featcal-progress", "featcal-block-02"} <= set(by_key)
        table = by_key["featcal-accuracy"].data
        assert "topic" in str(table) and "calibrated" in str(table)
        again = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[second.state_details.flow_run_id])))
        progress = {a.key: a for a in again}["featcal-progress"]
        assert progress.data == 100 and f"{stages}/{stages} stages ({stages} from cache)" in progress.description
