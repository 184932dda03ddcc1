"""`featcal serve` and `featcal deployments`: the flow as a Prefect deployment on a cron schedule.

`serve` registers a deployment of `featcal_flow` with fixed parameters (config, run directory, overrides,
runner) and a cron schedule, then runs Prefect's runner in this process: it picks up the scheduled runs
(and runs triggered by hand from the UI or `prefect deployment run`) and executes each in a subprocess.
Every run works in the same run directory, so a run resumes what the last one left: new or changed
experts (a new checksum, so a new fingerprint) recompute only the stages that depend on them.

The deployment's parameters live in the server's database and show in the UI, so credentials in `--set`
overrides are stored as placeholders (featcal/secrets.py). Their values stay in this process's memory and
reach the runs it starts (its subprocesses) through the environment variable FEATCAL_SECRETS; a run started
by anything else cannot restore them and says so. Credentials in the config file are read from the file
by each run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal import secrets
from featcal.config import load_config

FLOW_NAME = "featcal"


class ServeError(ValueError):
    pass


def require_api() -> str:
    """A deployment lives in a server's database: the ephemeral mode would forget it when this process exits."""
    from flows.server import api_url_for_runs

    api, _ = api_url_for_runs()
    if api is None:
        raise ServeError("no Prefect server: start one with `featcal server start` (or set PREFECT_API_URL); "
                         "deployments and schedules live in a server")
    return api


def check_cron(cron: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        CronSchedule(cron=cron)
    except ValidationError as exc:
        raise ServeError(f"--cron {cron!r} is not a valid cron expression ({exc.errors()[0]['msg']})") from None


def deployment_parameters(config: str, run_dir: str, overrides: list[str], runner: str, address: str | None,
                          workers: int | None, worker_threads: int | None, tag_task_runs: bool,
                          tls_ca_file: str | None = None, tls_cert: str | None = None,
                          tls_key: str | None = None, devices: list[str] | None = None) -> dict[str, Any]:
    """The deployment's parameters, as stored by the server: overrides with their credentials redacted."""
    params: dict[str, Any] = {"config_path": str(Path(config).resolve()), "run_dir": str(Path(run_dir).resolve()),
                              "overrides": secrets.redact_overrides(overrides), "runner": runner,
                              "tag_task_runs": tag_task_runs}
    if runner == "pool":
        params.update(workers=workers, worker_threads=worker_threads)
    if runner == "dask":
        params.update(address=address, workers=workers, worker_threads=worker_threads)
        if devices:
            params["devices"] = list(devices)
        tls = {"tls_ca_file": tls_ca_file, "tls_cert": tls_cert, "tls_key": tls_key}
        params.update({k: str(Path(v).resolve()) for k, v in tls.items() if v is not None})
    return params


def export_override_secrets(overrides: list[str]) -> None:
    """Let the runs this process starts restore the credentials of `overrides` (FEATCAL_SECRETS, memory only)."""
    values = secrets.known()
    wanted = {ph: values[ph] for o in secrets.redact_overrides(overrides) for ph in secrets.PLACEHOLDER.findall(o)
              if ph in values}
    if wanted:
        os.environ[secrets.ENV_VAR] = secrets.export_env(wanted)


def serve(config: str, run_dir: str, cron: str, name: str, overrides: list[str], runner: str = "local",
          address: str | None = None, workers: int | None = None, worker_threads: int | None = None,
          tag_task_runs: bool = False, tls_ca_file: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, devices: list[str] | None = None) -> None:
    """Register the deployment and serve it until interrupted (its schedule is paused on shutdown)."""
    from prefect.deployments.runner import EntrypointType

    from featcal.devices import check_worker_devices
    from flows.prefect_flow import featcal_flow, run_tags

    check_cron(cron)
    cfg = load_config(config, overrides)  # a bad config fails now, not at 2 a.m.
    if devices:
        check_worker_devices(devices, cfg.runtime.device)
    params = deployment_parameters(config, run_dir, overrides, runner, address, workers, worker_threads, tag_task_runs,
                                   tls_ca_file, tls_cert, tls_key, devices)
    export_override_secrets(overrides)
    featcal_flow.serve(
        name=name,
        cron=cron,
        parameters=params,
        tags=[*run_tags(cfg, params["run_dir"]), f"schedule:{cron}"],
        description=f"FeatCal calibration of {params['config_path']} into {params['run_dir']} on '{cron}'",
        # Runs import the flow by module path: it works from any directory where featcal is installed.
        entrypoint_type=EntrypointType.MODULE_PATH,
        pause_on_shutdown=True,
    )


@dataclass
class DeploymentRow:
    name: str
    schedules: list[str]
    active: bool
    next_run: str
    run_dir: str
    last_state: str


def deployments() -> list[DeploymentRow]:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.client.schemas.sorting import FlowRunSort

    rows = []
    with get_client(sync_client=True) as client:
        for d in client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))):
            by_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[d.id]))
            upcoming = client.read_flow_runs(
                deployment_filter=by_deployment, sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1,
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
            latest = client.read_flow_runs(
                deployment_filter=by_deployment, sort=FlowRunSort.START_TIME_DESC, limit=1,
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=[StateType.SCHEDULED]))))
            schedules = [f"cron '{s.schedule.cron}' ({s.schedule.timezone or 'UTC'})"
                         if isinstance(s.schedule, CronSchedule) else str(s.schedule) for s in d.schedules]
            active = not d.paused and any(s.active for s in d.schedules)
            rows.append(DeploymentRow(
                name=f"{FLOW_NAME}/{d.name}", schedules=schedules, active=active,
                next_run=(upcoming[0].expected_start_time.strftime("%Y-%m-%d %H:%M %Z")
                          if upcoming and active and upcoming[0].expected_start_time else "-"),
                run_dir=str((d.parameters or {}).get("run_dir", "?")),
                last_state=f"{latest[0].state.name} ({latest[0].name})" if latest and latest[0].state else "-"))
    return sorted(rows, key=lambda r: r.name)


def render(rows: list[DeploymentRow]) -> str:
    if not rows:
        return "no featcal deployments (serve one with `featcal serve CONFIG --run-dir DIR --cron '0 2 * * *'`)"
    lines = []
    for r in rows:
        lines.append(f"{r.name}  {'active' if r.active else 'paused'}  {'; '.join(r.schedules) or 'no schedule'}")
        lines.append(f"    next run {r.next_run}   last run {r.last_state}")
        lines.append(f"    run dir  {r.run_dir}")
    return "\n".join(lines)
