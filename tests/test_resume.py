"""Crash safety: kill -9 or a stop signal mid-flow and rerun, corrupted outputs, changed settings, a held run
directory."""

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from flows.cli import main
from flows.pipeline import run_pipeline
from storage.atomic import digest
from storage.rundir import RunDir, RunDirLocked
from tests.conftest import example_config, featcal_process


def _weights(run_dir: Path) -> str:
    return digest(run_dir / "calibrated" / "model.safetensors")


def _by_pid(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    out: dict[int, list[tuple[str, str]]] = {}
    for e in RunDir(run_dir).events():
        out.setdefault(e["pid"], []).append((e["stage"], e["event"]))
    return out


def _started(proc: subprocess.Popen, run_dir: Path, stage: str) -> None:
    """Wait until `stage` has started in the run of `proc`."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if any(e["stage"] == stage and e["event"] == "start" for e in RunDir(run_dir).events()):
            return
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be stopped:\n" + proc.stdout.read())
        time.sleep(0.01)
    pytest.fail(f"stage {stage} did not start within 300 s")


def _resumes_bit_identically(resume_config: Path, run_dir: Path, first_pid: int, reference_run: Path,
                             *options: str) -> None:
    """Rerun the same command: the weights equal an uninterrupted run's, and no finished stage runs again."""
    assert not (run_dir / "calibrated").exists()
    finished_before = {s for s, ev in _by_pid(run_dir).get(first_pid, []) if ev == "done"}
    assert "solve/l00" in finished_before
    assert main(["run", str(resume_config), "--run-dir", str(run_dir), *options]) == 0  # in this process: no start-up
    assert _weights(run_dir) == _weights(reference_run)
    started_again = {s for pid, evs in _by_pid(run_dir).items() if pid != first_pid for s, ev in evs if ev == "start"}
    assert not (finished_before & started_again), f"recomputed after resume: {finished_before & started_again}"
    assert "assemble" in started_again


def test_kill9_mid_flow_then_rerun_is_bit_identical(resume_config, reference_run, tmp_path):
    run_dir = tmp_path / "victim"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir))  # real Prefect flow, ephemeral server
    _started(proc, run_dir, "gram/l01/count")
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its ephemeral Prefect server, no clean-up
    proc.wait()
    # Resumed by calling the stages directly: the records and caches a flow left are the same either way.
    _resumes_bit_identically(resume_config, run_dir, proc.pid, reference_run, "--no-prefect")


def stopped(proc: subprocess.Popen, signum: int, to_group: bool) -> str:
    """Stop a run as a terminal (the whole group) or a supervisor (the main process alone) would: it must exit with
    128 + signum within 10 s. Returns what it printed."""
    sent = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, signum)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signum, out
    assert took < 10, f"took {took:.1f} s to stop"
    return out


STOPS = {
    # Ctrl-C in a terminal: SIGINT to the whole process group, Prefect's temporary server included.
    "ctrl-c, prefect": (signal.SIGINT, True, ()),
    # `kill PID` from a supervisor: SIGTERM to the main process alone.
    "sigterm, prefect": (signal.SIGTERM, False, ()),
    # SIGINT to the main process alone, stages called directly.
    "sigint, no prefect": (signal.SIGINT, False, ("--no-prefect",)),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_stop_signal_ends_the_run_within_10_s_and_it_resumes(stop, resume_config, reference_run, tmp_path):
    signum, to_group, options = STOPS[stop]
    run_dir = tmp_path / "stopped"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), *options)
    _started(proc, run_dir, "gram/l01/count")
    children = psutil.Process(proc.pid).children(recursive=True)
    if not options:  # Prefect's temporary server is a child: it must not outlive the run
        assert any("uvicorn" in " ".join(c.cmdline()) for c in children)
    out = stopped(proc, signum, to_group)
    name = signal.Signals(signum).name
    assert f"featcal: stopped by {name} during stage 'block 01 · gram · count'" in out, out
    assert "rerun the same command to resume" in out
    _, alive = psutil.wait_procs(children, timeout=2)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], f"left behind: {alive}"
    _resumes_bit_identically(resume_config, run_dir, proc.pid, reference_run, "--no-prefect")


def test_corrupted_cached_output_is_recomputed(resume_config, reference_run, tmp_path):
    run_dir = tmp_path / "corrupt"
    cfg = example_config(resume_config.parent.parent, "bert", evaluation={"enabled": False})
    run_pipeline(cfg, run_dir)
    assert _weights(run_dir) == _weights(reference_run)
    block = run_dir / "blocks" / "l01.safetensors"
    data = bytearray(block.read_bytes())
    data[-5] ^= 0xFF
    block.write_bytes(bytes(data))
    before = len(RunDir(run_dir).events())
    run_pipeline(cfg, run_dir)
    again = {e["stage"] for e in RunDir(run_dir).events()[before:] if e["event"] == "start"}
    assert "solve/l01" in again and "merge" not in again and "solve/l00" not in again
    assert _weights(run_dir) == _weights(reference_run)


def test_changed_lambda_reuses_what_it_can(resume_config, tmp_path):
    root = resume_config.parent.parent
    first = example_config(root, "bert", evaluation={"enabled": False})
    second = example_config(root, "bert", evaluation={"enabled": False}, featcal__lambda=0.2)
    run_pipeline(first, tmp_path / "shared")
    before = len(RunDir(tmp_path / "shared").events())
    run_pipeline(second, tmp_path / "shared", reuse=True)  # another config: refused without it
    again = [e["stage"] for e in RunDir(tmp_path / "shared").events()[before:] if e["event"] == "start"]
    assert "merge" not in again and "solve/l00" in again
    run_pipeline(second, tmp_path / "fresh")
    assert _weights(tmp_path / "shared") == _weights(tmp_path / "fresh")


def test_changed_alpha_reruns_the_grams(resume_config, tmp_path):
    """Product-form statistics hold α (P_t): a new α must not reuse them, where a new λ does (statistics kept, so the
    first block's Grams could be reused)."""
    root = resume_config.parent.parent
    kept = {"evaluation": {"enabled": False}, "runtime": {"keep_activations": True}}
    first = example_config(root, "bert", **kept)
    run_dir = tmp_path / "shared"
    run_pipeline(first, run_dir)

    def started(cfg) -> list[str]:
        before = len(RunDir(run_dir).events())
        run_pipeline(cfg, run_dir, reuse=True)
        return [e["stage"] for e in RunDir(run_dir).events()[before:] if e["event"] == "start"]

    gram = "gram/l00/" + first.tasks[0]
    assert gram not in started(example_config(root, "bert", **kept, featcal__lambda=0.2))
    second = example_config(root, "bert", **kept, featcal__lambda=0.2, featcal__alpha=0.5)
    assert gram in started(second)
    run_pipeline(second, tmp_path / "fresh")
    assert _weights(run_dir) == _weights(tmp_path / "fresh")


def test_second_run_on_a_held_directory_is_refused(resume_config, tmp_path):
    cfg = example_config(resume_config.parent.parent, "bert", evaluation={"enabled": False})
    with RunDir(tmp_path / "held").lock():
        with pytest.raises(RunDirLocked, match="is in use by pid"):
            run_pipeline(cfg, tmp_path / "held")


def test_failed_assemble_leaves_no_half_checkpoint(resume_config, tmp_path, monkeypatch):
    from tasks import assemble

    cfg = example_config(resume_config.parent.parent, "bert", evaluation={"enabled": False})
    real = assemble.write_checkpoint
    monkeypatch.setattr(assemble, "write_checkpoint",
                        lambda target, specs, tensors, **kw: real(target, specs, _exploding(tensors), **kw))
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


def test_stop_line_names_the_stage_with_counts_where_the_caller_gives_them(monkeypatch):
    from flows import signals

    monkeypatch.setattr(signals, "where", signals._Where())
    assert "stopped by SIGTERM before any stage started;" in signals.stopped_line(signal.SIGTERM)
    signals.at_stage("expert/spam")  # a benchmark flow's stage: no counts
    assert "stopped by SIGINT during stage 'expert/spam'; finished" in signals.stopped_line(signal.SIGINT)
    signals.at_stage(None)
    assert "stopped by SIGINT between stages; finished" in signals.stopped_line(signal.SIGINT)
    signals.at_stage("block 00 · solve", 3, 10)
    assert "during stage 'block 00 · solve' (3 of 10 done);" in signals.stopped_line(signal.SIGINT)
    signals.at_stage(None, 4, 10)
    assert "between stages, 4 of 10 done;" in signals.stopped_line(signal.SIGINT)


def test_keep_freed_memory_changes_no_weight(resume_config, reference_run, tmp_path):
    """runtime.keep_freed_memory changes where freed memory goes, not a number: the weights equal a default run's bit
    for bit. In a process of its own: the setting stays with the process that applies it."""
    run_dir = tmp_path / "kept-heap"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect",
                           "--set", "runtime.keep_freed_memory=true")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert _weights(run_dir) == _weights(reference_run)
