"""A run directory belongs to one config (issue 29 §3): a rerun with another config is refused in one line naming
what changed, leaving the directory as it was; runtime-only changes go through; `--reuse` recomputes what changed
and drops what no longer belongs; a run that fails after it started says so in its manifest."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from featcal.config import load_config
from featcal.config_diff import config_changes
from flows import pipeline, signals
from flows.cli import main
from storage.rundir import RunDir
from tests.conftest import one_error_line, torch_threads_restored
from tests.tiny_example_inputs import key_setting

pytestmark = pytest.mark.usefixtures("fresh_console")  # each test's stderr gets its own console

TASKS = ["count", "negation", "topic"]  # the tiny BERT example's


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` with its bytes and mtime: what a refusal must leave as it was."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _config(resume_config: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], name: str = "edited") -> Path:
    """`resume_config` (paths made absolute) changed by `edit`, written under tmp_path."""
    raw = load_config(resume_config).model_dump(mode="json", by_alias=True)
    edit(raw)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _finished(reference_run: Path, tmp_path: Path) -> Path:
    """A copy of the uninterrupted reference run (its mtimes kept), to rerun into."""
    return Path(shutil.copytree(reference_run, tmp_path / "run"))


def _drop(task: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        for section in (raw["experts"], raw["calibration"]["data"], raw["evaluation"]["data"]):
            section.pop(task, None)
    return edit


def _all(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        for e in edits:
            e(raw)
    return edit


# (id, the change, what the one line says changed, run options)
NO_PREFECT = ["--no-prefect"]
REFUSED = [
    ("merge-scaling", key_setting("merge.scaling", 0.5), "(merge.scaling 0.3 → 0.5)", NO_PREFECT),
    ("merge-scaling-prefect", key_setting("merge.scaling", 0.5), "(merge.scaling 0.3 → 0.5)",
     []),  # refused before Prefect starts
    ("dropped-task", _drop("count"), "(tasks: dropped count)", NO_PREFECT),
    ("precision", key_setting("runtime.precision", "bf16"), "(runtime.precision fp32 → bf16)", NO_PREFECT),
    ("featcal-lambda", key_setting("featcal.lambda", 0.2), "(featcal.lambda 0.05 → 0.2)", NO_PREFECT),
    ("evaluation-on", key_setting("evaluation.enabled", True), "(evaluation.enabled false → true)", NO_PREFECT),
    ("five-changes", _all(_drop("count"), key_setting("merge.scaling", 0.5), key_setting("featcal.alpha", 0.5),
                          key_setting("featcal.rho", 2.0), key_setting("calibration.seed", 7)),
     "(tasks: dropped count, merge.scaling 0.3 → 0.5, calibration.seed 42 → 7 and 2 more)", NO_PREFECT),
]


@pytest.mark.parametrize("case,edit,changed,options", REFUSED, ids=[c[0] for c in REFUSED])
def test_another_config_is_refused_with_what_changed_and_the_directory_untouched(
        resume_config, reference_run, tmp_path, capsys, case, edit, changed, options):
    """Compared before the lock is taken: not even the lock file's holder line is written."""
    run_dir = _finished(reference_run, tmp_path)
    before = _snapshot(run_dir)
    config = _config(resume_config, tmp_path, edit)
    assert main(["run", str(config), "--run-dir", str(run_dir), *options]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"featcal: error: run directory {run_dir} holds a run of another config {changed}; use a new --run-dir, or "
        "--reuse to recompute what changed and drop what no longer belongs")
    assert _snapshot(run_dir) == before


# (id, --set, stages that must run again; None: none at all)
RUNTIME_ONLY = [
    ("threads", "runtime.threads=1", None),
    ("device", "runtime.device=cpu", None),
    ("keep-activations", "runtime.keep_activations=true", None),
    # Stages of other names, whose inputs (Gram statistics) were released: rebuilt as far back as needed.
    ("solve-groups", "runtime.solve_groups=2", {f"solve/l{layer:02d}/g{g}" for layer in range(3) for g in range(2)}),
]


@pytest.mark.parametrize("case,override,again", RUNTIME_ONLY, ids=[c[0] for c in RUNTIME_ONLY])
def test_runtime_changes_are_allowed(resume_config, reference_run, tmp_path, case, override, again):
    run_dir = _finished(reference_run, tmp_path)
    events = len(RunDir(run_dir).events())
    with torch_threads_restored():
        assert main(["run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect", "--set", override]) == 0
    ran = {e["stage"] for e in RunDir(run_dir).events()[events:] if e["event"] == "start"}
    assert ran == set() if again is None else again <= ran, ran
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    whole = [f"solve/l{layer:02d}" for layer in range(3)]
    if case == "solve-groups":  # one solve per block became two: the whole-block solves are gone, records and files
        assert set(manifest["stages"]) >= again and not set(manifest["stages"]) & set(whole)
        assert not list((run_dir / "blocks").glob("l0?.safetensors"))
        assert not RunDir(run_dir).stage_records().keys() & set(whole)
    else:
        assert set(manifest["stages"]) >= set(whole)
    assert (run_dir / "calibrated" / "model.safetensors").read_bytes() == \
        (reference_run / "calibrated" / "model.safetensors").read_bytes()


def test_reuse_drops_a_task_and_matches_a_fresh_run(resume_config, reference_run, tmp_path, capsys):
    run_dir = _finished(reference_run, tmp_path)
    config = _config(resume_config, tmp_path, _all(_drop("count"), key_setting("merge.scaling", 0.5)))
    assert main(["run", str(config), "--run-dir", str(run_dir), "--no-prefect"]) == 2
    assert "(tasks: dropped count, merge.scaling 0.3 → 0.5)" in one_error_line(capsys.readouterr().err)
    assert main(["run", str(config), "--run-dir", str(run_dir), "--no-prefect", "--reuse"]) == 0
    assert main(["run", str(config), "--run-dir", str(tmp_path / "fresh"), "--no-prefect"]) == 0

    reused, fresh = (json.loads((d / "manifest.json").read_text()) for d in (run_dir, tmp_path / "fresh"))
    assert reused["status"] == "complete" and reused["config_fingerprint"] == fresh["config_fingerprint"]
    assert set(reused["stages"]) == set(fresh["stages"]) and not [s for s in reused["stages"] if "count" in s]
    assert {s: r["key"] for s, r in reused["stages"].items()} == {s: r["key"] for s, r in fresh["stages"].items()}
    kept = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "count" in p.name)
    assert kept == [], kept  # records, released markers, activations and statistics of the dropped task
    a, b = (load_file(d / "calibrated" / "model.safetensors") for d in (run_dir, tmp_path / "fresh"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], load_file(reference_run / "calibrated" / "model.safetensors")[k]) for k in a)


def _raising(kind: str, exc: BaseException) -> Callable[..., Any]:
    def stage(ctx, **params):
        raise exc
    stage.__name__ = kind
    return stage


# (id, stage kind that fails, what it raises, exit code, manifest status, its reason)
FAILURES = [
    ("merge-value-error", "merge", ValueError("experts.topic: injected fault"), 2, "failed",
     "ValueError: experts.topic: injected fault"),
    ("solve-os-error", "solve", OSError(28, "No space left on device"), 2, "failed",
     "OSError: [Errno 28] No space left on device"),
]


@pytest.mark.parametrize("case,kind,exc,code,status,reason", FAILURES, ids=[c[0] for c in FAILURES])
def test_a_failed_run_says_so_in_its_manifest_and_resumes(resume_config, reference_run, tmp_path, monkeypatch, capsys,
                                                          case, kind, exc, code, status, reason):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setitem(pipeline.STAGES, kind, _raising(kind, exc))
        assert main(["run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect"]) == code
    one_error_line(capsys.readouterr().err)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == (status, reason)
    assert "stages" not in manifest and manifest["finished_at"] >= manifest["started_at"]
    assert main(["run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect"]) == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and "reason" not in manifest
    assert (run_dir / "calibrated" / "model.safetensors").read_bytes() == \
        (reference_run / "calibrated" / "model.safetensors").read_bytes()


def test_a_stopped_run_says_so_in_its_manifest(resume_config, tmp_path, monkeypatch):
    monkeypatch.setitem(pipeline.STAGES, "prepare", _raising("prepare", signals.Stopped(signal.SIGTERM)))
    cfg = load_config(resume_config)
    with pytest.raises(signals.Stopped):
        pipeline.run_pipeline(cfg, tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("stopped", "stopped by SIGTERM")


def test_config_changes_name_fields_and_leave_dropped_tasks_to_one_line():
    old = {"base": "/m/base", "experts": {"a": "/m/a", "b": "/m/b"}, "merge": {"scaling": 0.3},
           "calibration": {"data": {"a": {"path": "/d/a"}, "b": {"path": "/d/b"}}, "seed": 42},
           "evaluation": {"data": {"b": {"path": "/d/b"}}, "models": ["merged", "calibrated"]},
           "zero_shot": None, "runtime": {"threads": 2, "device": "auto", "precision": "fp32"}}
    new = {"base": "/models/a-much-longer-directory-name/of/the/base-checkpoint",
           "experts": {"a": "/m/a", "c": "/m/c"}, "merge": {"scaling": 0.5},
           "calibration": {"data": {"a": {"path": "/d/a", "split": "cal"}, "c": {"path": "/d/c"}}, "seed": 42},
           "evaluation": {"data": {}, "models": ["calibrated"]}, "zero_shot": None,
           "runtime": {"threads": 8, "device": "cuda", "precision": "fp32", "activation_store": "s3://x"}}
    assert config_changes(old, new) == [
        "tasks: dropped b", "tasks: added c",
        "base /m/base → …er-directory-name/of/the/base-checkpoint",  # a long value: its last 40 characters
        "merge.scaling 0.3 → 0.5",
        "calibration.data.a.split unset → cal",
        'evaluation.models ["merged", "calibrated"] → ["calibrated"]',
    ]
    assert config_changes(old, {**old, "runtime": {"threads": 1, "solve_groups": 4, "keep_activations": True,
                                                   "keep_freed_memory": True}}) == ["runtime.precision fp32 → unset"]
    assert config_changes(old, json.loads(json.dumps(old))) == []
    # A hub id as run.yaml records it (pinned to the commit resolved) is the config's unpinned id: a resume; another
    # commit asked for, or another repository, is a change.
    pinned = {**old, "base": "org/base@" + "a" * 40}
    assert config_changes(pinned, {**old, "base": "org/base"}) == []
    assert config_changes(pinned, {**old, "base": "org/base@" + "b" * 40}) == [f"base …{'a' * 40} → …{'b' * 40}"]
    assert config_changes(pinned, {**old, "base": "org/other"}) == [f"base …{'a' * 40} → org/other"]

