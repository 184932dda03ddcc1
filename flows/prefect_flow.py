"""The pipeline as one Prefect flow: every stage a task with an explicit, verified cache key.

Stages run in the flow's process (`runner="local"`), or on Dask workers (`runner="dask"`, through prefect-dask)
where the independent stages of a block run at the same time, or in a pool of worker processes on this machine
(`runner="pool"`, flows/pool_runner.py; its stages are not Prefect task runs: the flow run, its logs and its
artifacts are). Either way the flow run carries tags (model, merge method, run directory), its task runs carry
readable names (`block 03 · gram · sentiment`), and the UI shows live progress, a table per block and the final
report (flows/artifacts.py).

Credentials in `--set` overrides never reach the Prefect API: the flow run's `overrides` parameter is stored
with them replaced by placeholders (featcal/secrets.py); the flow itself is called with the real values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import httpx
from prefect import Flow, get_client, task
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as current_flow_run

from featcal import secrets
from featcal.config import RunConfig, load_config
from featcal.devices import check_worker_devices
from flows.api_watch import ApiWatch, run_api_url
from flows.artifacts import LiveArtifacts
from flows.pipeline import STAGES, StageCall, run_pipeline
from flows.server import is_loopback
from storage.rundir import Record
from tasks.record import execute

log = logging.getLogger("featcal")

RESULTS_DIR = ".prefect-results"
RUNNERS = ("local", "pool", "dask")


def key_parameter(_context: Any, parameters: dict[str, Any]) -> str:
    """Prefect cache key: the task's own `key` parameter, our digest of everything it depends on."""
    return parameters["key"]


@task(persist_result=True, cache_key_fn=key_parameter)
def stage_task(run_dir: str, kind: str, stage: str, key: str, needs: dict[str, str], params: dict[str, Any]) -> Record:
    """Returns the stage's record (paths and digests), never tensors."""
    return execute(run_dir, stage, key, STAGES[kind], needs, params)


class StageRunner:
    """Runs stage calls as Prefect tasks: in this process when called, or on a task runner's workers (Dask)
    through `submit`, whose `.result()` is the stage's record.

    Task runs are named after the stage (`block 03 · gram · topic`). They carry `task_tags` only when asked:
    Prefect checks a tagged task run against tag concurrency limits, one round trip to the server per stage
    (benchmarks/results/orchestration.md)."""

    def __init__(self, task_tags: list[str] | None = None, task_runner: Any = None):
        self.task_tags = list(task_tags or [])
        self.task_runner = task_runner

    def task(self, run_dir: str, call: StageCall, done: Record | None):  # noqa: ANN201 (a prefect Task)
        # Prefect's cache is trusted only when our record verified the outputs on disk; otherwise refresh it.
        return stage_task.with_options(
            name=f"featcal-{call.kind}",
            task_run_name=call.label,
            tags=self.task_tags,
            refresh_cache=done is None,
            result_storage=Path(run_dir) / RESULTS_DIR,
        )

    @staticmethod
    def arguments(run_dir: str, call: StageCall) -> dict[str, Any]:
        return {"run_dir": run_dir, "kind": call.kind, "stage": call.stage, "key": call.key, "needs": call.needs,
                "params": call.params}

    def __call__(self, run_dir: str, call: StageCall, done: Record | None) -> Record:
        if self.task_runner is not None:
            return self.submit(run_dir, call, done).result()
        return self.task(run_dir, call, done)(**self.arguments(run_dir, call))

    def submit(self, run_dir: str, call: StageCall, done: Record | None) -> Any:
        return self.task_runner.submit(self.task(run_dir, call, done), self.arguments(run_dir, call))


prefect_runner = StageRunner()


def run_tags(cfg: RunConfig, run_dir: str | Path) -> list[str]:
    """Tags of a flow run: what was calibrated, how it was merged, and where it lives."""
    base = Path(cfg.base)
    model = "/".join(base.parts[-2:]) if base.exists() else str(cfg.base)
    return ["featcal", f"model:{model}", f"merge:{cfg.merge.method}", f"run-dir:{Path(run_dir).resolve()}"]


def _tag_this_flow_run(labels: list[str], watch: ApiWatch) -> None:
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    missing = [t for t in labels if t not in ctx.flow_run.tags]
    if missing:
        tag_flow_run(ctx.flow_run.id, [*ctx.flow_run.tags, *missing], watch)


def tag_flow_run(flow_run_id: UUID, tags: list[str], watch: ApiWatch) -> None:
    """Tags are for finding the run in the UI: one request without retries, and a run that goes on untagged if it
    fails (the watch's one line if the server is gone, else a warning). Without retries because Prefect's client,
    its retries cut by the watch in the middle of their backoff, ends with an AssertionError, not the request's
    error."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id, tags=tags)
    except httpx.HTTPError as exc:
        if watch.answers(f"tagging the flow run failed ({exc})"):
            log.warning("could not tag this flow run (%s): the run goes on untagged", exc)


def _api_for_workers(address: str | None) -> str:
    """The API URL Dask workers report their task runs to. Ephemeral mode's server is this process's own
    loopback server: fine for a local cluster, unreachable from other machines."""
    api, _ = run_api_url()
    if address is not None and not is_loopback(urlsplit(address).hostname) and is_loopback(urlsplit(api).hostname):
        raise ValueError(f"the Dask workers at {address} cannot reach the Prefect API at {api}: start the server "
                         "on an address they reach (`featcal server start --host 0.0.0.0`) or set PREFECT_API_URL")
    return api


def _flow_run_name() -> str:
    params = current_flow_run.parameters
    runner = params.get("runner", "local")
    return f"featcal · {Path(params['run_dir']).name}" + (f" · {runner}" if runner != "local" else "")


class RedactingFlow(Flow):
    """A flow whose `overrides` parameter is recorded (in the API, so in the UI) with credentials redacted."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        serialized = super().serialize_parameters(parameters)
        if isinstance(serialized.get("overrides"), list):
            serialized["overrides"] = secrets.redact_overrides(serialized["overrides"])
        return serialized


def redacting_flow(**options: Any) -> Callable[[Callable[..., dict[str, str]]], Flow[..., dict[str, str]]]:
    """`@flow` for a RedactingFlow."""
    return lambda fn: RedactingFlow(fn, **options)


@redacting_flow(name="featcal", flow_run_name=_flow_run_name)
def featcal_flow(config_path: str, run_dir: str, overrides: list[str] | None = None, runner: str = "local",
                 address: str | None = None, workers: int | None = None, worker_threads: int | None = None,
                 tag_task_runs: bool = False, tls_ca_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, devices: list[str] | None = None, reuse: bool = False) -> dict[str, str]:
    """Calibrate the merged model of CONFIG into RUN_DIR, resuming whatever a previous run finished.

    runner: "local" (stages in this process), "pool" (in `workers` processes on this machine, default one per
    core, each using `worker_threads` torch threads, default the cores divided among them) or "dask" (on the Dask
    cluster at `address`, or on a local cluster of `workers` processes, each using `worker_threads` torch threads,
    default 1; `tls_*`: the CA, certificate and key for a tls:// address; `devices`: a local cluster of one worker
    per device, each pinned to its own, e.g. ["cuda:0", "cuda:1"] from `--gpus 2`). The flow run is tagged with the
    model, merge method and run directory; `tag_task_runs` puts those tags on every task run too. `reuse`: RUN_DIR
    may hold a run of another config (flows/pipeline.py run_pipeline)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    cfg = load_config(config_path, overrides or [])
    if devices:
        if runner != "dask":
            raise ValueError(f"devices {', '.join(devices)} (--gpus) need runner 'dask', not {runner!r}")
        check_worker_devices(devices, cfg.runtime.device)
    plain = cfg.model_dump(mode="json", by_alias=True)
    # A deployment's overrides are stored redacted: their values come from `featcal serve`'s memory, or not at all.
    secrets.require_known(plain, f"the config of this run ({config_path} with its overrides)")
    known_secrets = secrets.found(plain)
    run_dir = str(Path(run_dir).resolve())
    labels = run_tags(cfg, run_dir)
    task_tags = labels if tag_task_runs else []
    with ExitStack() as stack:
        api, ephemeral = run_api_url()
        watch = stack.enter_context(ApiWatch(api, run_dir, ephemeral=ephemeral))
        _tag_this_flow_run(labels, watch)  # the flow's first request of its own: under the watch
        live = LiveArtifacts(run_dir, reachable=lambda: watch.up)
        if runner == "dask":
            from flows.dask_runner import dask_task_runner

            stack.enter_context(temporary_settings(updates={PREFECT_API_URL: _api_for_workers(address)}))
            stages = StageRunner(task_tags, stack.enter_context(dask_task_runner(
                run_dir, address, workers, worker_threads or 1, known_secrets=known_secrets, tls_ca_file=tls_ca_file,
                tls_cert=tls_cert, tls_key=tls_key, devices=devices)))
            records = run_pipeline(cfg, run_dir, stages, on_stage=live.on_stage, submit=stages.submit, reuse=reuse)
        elif runner == "pool":
            from flows.pool_runner import stage_pool

            pool = stack.enter_context(stage_pool(workers, worker_threads, known_secrets))
            records = run_pipeline(cfg, run_dir, pool, on_stage=live.on_stage, submit=pool.submit, reuse=reuse)
        else:
            records = run_pipeline(cfg, run_dir, StageRunner(task_tags), on_stage=live.on_stage, reuse=reuse)
        live.finish()
    return {name: str(Path(run_dir) / next(iter(rec["outputs"]))) for name, rec in records.items()}

