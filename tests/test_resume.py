"""Crash safety: kill -9 mid-flow and rerun, corrupted outputs, changed settings, a held run directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.pipeline import run_pipeline
from storage.atomic import digest
from storage.rundir import RunDir, RunDirLocked
from tests.conftest import example_config

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _weights(run_dir: Path) -> str:
    return digest(run_dir / "calibrated" / "model.safetensors")


def _by_pid(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    out: dict[int, list[tuple[str, str]]] = {}
    for e in RunDir(run_dir).events():
        out.setdefault(e["pid"], []).append((e["stage"], e["event"]))
    return out


@pytest.fixture(scope="module")
def config_file(tiny_example, tmp_path_factory):
    raw = yaml.safe_load((tiny_example / "bert" / "example.yaml").read_text())
    raw["evaluation"] = {"enabled": False}
    path = tiny_example / "bert" / "resume.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def reference(config_file, tmp_path_factory):
    """An uninterrupted run, for the bits every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc = _cli("run", str(config_file), "--run-dir", str(run_dir), "--no-prefect")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return run_dir


def test_kill9_mid_flow_then_rerun_is_bit_identical(config_file, reference, tmp_path):
    run_dir = tmp_path / "victim"
    proc = _cli("run", str(config_file), "--run-dir", str(run_dir))  # real Prefect flow, ephemeral server
    deadline = time.time() + 300
    while time.time() < deadline:
        if any(e["stage"] == "gram/l01/count" and e["event"] == "start" for e in RunDir(run_dir).events()):
            break
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed:\n" + proc.stdout.read())
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its ephemeral Prefect server, no clean-up
    proc.wait()
    assert not (run_dir / "calibrated").exists()
    first_pid = proc.pid
    finished_before = {s for s, ev in _by_pid(run_dir).get(first_pid, []) if ev == "done"}
    assert "solve/l00" in finished_before

    rerun = _cli("run", str(config_file), "--run-dir", str(run_dir))
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    assert _weights(run_dir) == _weights(reference)
    started_again = {s for pid, evs in _by_pid(run_dir).items() if pid != first_pid for s, ev in evs if ev == "start"}
    assert not (finished_before & started_again), f"recomputed after resume: {finished_before & started_again}"
    assert "assemble" in started_again


def test_corrupted_cached_output_is_recomputed(config_file, reference, tmp_path):
    run_dir = tmp_path / "corrupt"
    cfg = example_config(config_file.parent.parent, "bert", evaluation={"enabled": False})
    run_pipeline(cfg, run_dir)
    assert _weights(run_dir) == _weights(reference)
    block = run_dir / "blocks" / "l01.safetensors"
    data = bytearray(block.read_bytes())
    data[-5] ^= 0xFF
    block.write_bytes(bytes(data))
    before = len(RunDir(run_dir).events())
    run_pipeline(cfg, run_dir)
    again = {e["stage"] for e in RunDir(run_dir).events()[before:] if e["event"] == "start"}
    assert "solve/l01" in again and "merge" not in again and "solve/l00" not in again
    assert _weights(run_dir) == _weights(reference)


def test_changed_lambda_reuses_what_it_can(config_file, tmp_path):
    root = config_file.parent.parent
    first = example_config(root, "bert", evaluation={"enabled": False})
    second = example_config(root, "bert", evaluation={"enabled": False}, featcal__lambda=0.2)
    run_pipeline(first, tmp_path / "shared")
    before = len(RunDir(tmp_path / "shared").events())
    run_pipeline(second, tmp_path / "shared")
    again = [e["stage"] for e in RunDir(tmp_path / "shared").events()[before:] if e["event"] == "start"]
    assert "merge" not in again and "solve/l00" in again
    run_pipeline(second, tmp_path / "fresh")
    assert _weights(tmp_path / "shared") == _weights(tmp_path / "fresh")


def test_second_run_on_a_held_directory_is_refused(config_file, tmp_path):
    cfg = example_config(config_file.parent.parent, "bert", evaluation={"enabled": False})
    with RunDir(tmp_path / "held").lock():
        with pytest.raises(RunDirLocked, match="is in use by pid"):
            run_pipeline(cfg, tmp_path / "held")


def test_failed_assemble_leaves_no_half_checkpoint(config_file, tmp_path, monkeypatch):
    from tasks import assemble

    cfg = example_config(config_file.parent.parent, "bert", evaluation={"enabled": False})
    real = assemble.write_checkpoint
    monkeypatch.setattr(assemble, "write_checkpoint", lambda target, tensors, **kw: real(target, _exploding(tensors), **kw))
    with pytest.raises(OSError, match="disk full"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "calibrated").exists()
    assert not list((tmp_path / "run").glob(".calibrated*"))
    monkeypatch.undo()
    run_pipeline(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "calibrated" / "model.safetensors").is_file()


def _exploding(tensors):
    """The assembled tensors, failing after a few were written (a full disk, say)."""
    for i, item in enumerate(tensors):
        if i == 3:
            raise OSError("disk full")
        yield item
