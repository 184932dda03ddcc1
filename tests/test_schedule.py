"""`featcal serve` on a cron schedule against a real Prefect server: the schedule's runs complete, pick up a
changed expert, and a scheduled run killed with -9 resumes by hand from its cache, bit-identical."""

import os
import shutil
import signal
from datetime import UTC, datetime

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.states import Scheduled
from safetensors.torch import load_file, save_file

from flows.cli import main
from flows.pipeline import run_pipeline
from storage.atomic import digest
from storage.rundir import RunDir
from tests.conftest import example_config
from tests.prefect_helpers import cli_env, featcal, wait_for

pytest_plugins = ("tests.prefect_server",)

CRON = "0 2 * * *"
NO_EVAL = ("--set", "evaluation.enabled=false")


def _weights(run_dir) -> str:
    return digest(run_dir / "calibrated" / "model.safetensors")


def _started_since(run_dir, n: int) -> dict[str, int]:
    return {e["stage"]: e["pid"] for e in RunDir(run_dir).events()[n:] if e["event"] == "start"}


def _next_scheduled(client, deployment_id):
    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
        sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)
    return runs[0] if runs else None


def _deployment(client, name):
    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:  # not registered yet
        return None


def _run_scheduled_now(client, deployment_id):
    """Take the schedule's next run (02:00 UTC) and start it now rather than waiting for the night."""
    scheduled = wait_for("the schedule's next run", lambda: _next_scheduled(client, deployment_id), timeout=60)
    assert (scheduled.expected_start_time.hour, scheduled.expected_start_time.minute) == (2, 0)
    client.set_flow_run_state(scheduled.id, Scheduled(scheduled_time=datetime.now(UTC)), force=True)
    return scheduled.id


def _final(client, flow_run_id, timeout: float):
    return wait_for("the flow run to end", lambda: (r := client.read_flow_run(flow_run_id)).state.is_final() and r,
                    timeout=timeout)


def test_scheduled_runs_pick_up_changed_experts_and_resume_by_hand(prefect_server, tiny_example, tmp_path, capsys):
    shutil.copytree(tiny_example / "bert", tmp_path / "bert")  # its experts change below
    config, run_dir = tmp_path / "bert" / "example.yaml", tmp_path / "nightly"
    env = cli_env(prefect_server, PREFECT_RUNNER_POLL_FREQUENCY="1")
    serve = featcal("serve", str(config), "--run-dir", str(run_dir), "--cron", CRON, "--name", "nightly", *NO_EVAL,
                    env=env)
    try:
        with get_client(sync_client=True) as client:
            deployment = wait_for(
                "the deployment", lambda: serve.poll() is None and _deployment(client, "featcal/nightly"), timeout=90
            )
            assert [s.schedule.cron for s in deployment.schedules] == [CRON] and not deployment.paused
            assert deployment.parameters["run_dir"] == str(run_dir)
            assert main(["deployments"]) == 0
            listed = capsys.readouterr().out
            assert f"featcal/nightly  active  cron '{CRON}' (UTC)" in listed and str(run_dir) in listed

            # Night 1: the schedule's run computes everything.
            first = _final(client, _run_scheduled_now(client, deployment.id), timeout=180)
            assert first.state.is_completed(), first.state
            assert first.deployment_id == deployment.id and f"run-dir:{run_dir}" in first.tags
            before = _weights(run_dir)

            # Day 2: a new version of one expert lands (new checksum, so a new fingerprint).
            expert = tmp_path / "bert" / "experts" / "topic" / "model.safetensors"
            tensors = load_file(expert)
            name = next(k for k in sorted(tensors) if k.endswith("layer.0.attention.self.query.weight"))
            tensors[name] = tensors[name] + 1e-2
            save_file(tensors, str(expert), metadata={"format": "pt"})
            run_pipeline(example_config(tmp_path, "bert", evaluation={"enabled": False}), tmp_path / "reference")

            # Night 2: the schedule's run picks it up and recomputes what depends on it; killed (-9) in block 01.
            n = len(RunDir(run_dir).events())
            second = _run_scheduled_now(client, deployment.id)
            victim = wait_for(
                "block 01 to start", lambda: _started_since(run_dir, n).get("gram/l01/count"), timeout=120
            )
            os.kill(victim, signal.SIGKILL)
            assert _final(client, second, timeout=60).state.type in (StateType.CRASHED, StateType.FAILED)
            assert {"merge", "prepare/topic", "gram/l00/count", "solve/l00"} <= set(_started_since(run_dir, n))
            finished = {e["stage"] for e in RunDir(run_dir).events()[n:] if e["pid"] == victim and e["event"] == "done"}
            assert "solve/l00" in finished

        # Rerun by hand: it resumes from the scheduled run's cache, bit-identical to an uninterrupted run.
        n = len(RunDir(run_dir).events())
        assert main(["run", str(config), "--run-dir", str(run_dir), *NO_EVAL]) == 0
        again = set(_started_since(run_dir, n))
        assert "assemble" in again and not (finished & again), finished & again
        assert _weights(run_dir) == _weights(tmp_path / "reference") != before
    finally:
        os.killpg(serve.pid, signal.SIGTERM)  # the serve process we started, and a flow run it may still hold
        serve.communicate(timeout=60)
