"""The pipeline as one Prefect flow: every stage a task with an explicit, verified cache key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from featcal.config import load_config
from flows.pipeline import STAGES, StageCall, run_pipeline
from storage.rundir import Record
from tasks.record import execute

RESULTS_DIR = ".prefect-results"


def _cache_key(_context: Any, parameters: dict[str, Any]) -> str:
    return parameters["key"]


@task(persist_result=True, cache_key_fn=_cache_key)
def stage_task(run_dir: str, kind: str, stage: str, key: str, needs: dict[str, str], params: dict[str, Any]) -> Record:
    """Returns the stage's record (paths and digests), never tensors."""
    return execute(run_dir, stage, key, STAGES[kind], needs, params)


def prefect_runner(run_dir: str, call: StageCall, done: Record | None) -> Record:
    # Prefect's cache is trusted only when our record verified the outputs on disk; otherwise refresh it.
    configured = stage_task.with_options(
        name=f"featcal-{call.kind}",
        task_run_name=call.label,
        refresh_cache=done is None,
        result_storage=Path(run_dir) / RESULTS_DIR,
    )
    return configured(run_dir, call.kind, call.stage, call.key, call.needs, call.params)


def _report_artifacts(run_dir: Path) -> None:
    report_md = run_dir / "report.md"
    if report_md.is_file():
        create_markdown_artifact(report_md.read_text(), key="featcal-report", description=str(run_dir))
    report_json = run_dir / "report.json"
    if report_json.is_file():
        report = json.loads(report_json.read_text())
        rows = [{"task": t, **{m: round(100 * a, 2) for m, a in s["accuracy"].items()}} for t, s in report["tasks"].items()]
        if any(len(r) > 1 for r in rows):
            create_table_artifact(rows, key="featcal-accuracy", description="accuracy (%) per task and model")


@flow(name="featcal", flow_run_name="featcal · {run_dir}")
def featcal_flow(config_path: str, run_dir: str, overrides: list[str] | None = None) -> dict[str, str]:
    cfg = load_config(config_path, overrides or [])
    records = run_pipeline(cfg, run_dir, prefect_runner)
    _report_artifacts(Path(run_dir).resolve())
    return {name: str(Path(run_dir).resolve() / next(iter(rec["outputs"]))) for name, rec in records.items()}
