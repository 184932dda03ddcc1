"""Stages in a local process pool (`--runner pool`): two workers reproduce a one-process run bit for bit; a killed
worker ends the run in one line and the rerun resumes; a stop signal leaves no worker behind. Real processes."""

import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from flows.cli import main
from storage.atomic import digest
from storage.rundir import RunDir
from tests.conftest import featcal_process
from tests.test_resume import _started, stopped

POOL = ("--no-prefect", "--runner", "pool", "--workers", "2", "--worker-threads", "1")
WEIGHTS = (
    "calibrated/model.safetensors",
    "merged/model.safetensors",
    *(f"blocks/l{b:02d}.safetensors" for b in range(3)),
)


def _pool_pids(run_dir: Path, main_pid: int) -> set[int]:
    return {e["pid"] for e in RunDir(run_dir).events() if e["event"] == "start"} - {main_pid}


def test_two_pool_workers_are_bit_identical_to_one_process(tiny_example, one_thread_run, tmp_path):
    run_dir = tmp_path / "pool"
    assert main(["run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(run_dir), *POOL,
                 "--set", "evaluation.enabled=false"]) == 0
    for rel in WEIGHTS:
        ours, reference = load_file(run_dir / rel), load_file(one_thread_run / rel)
        assert ours.keys() == reference.keys(), rel
        assert all(torch.equal(ours[k], reference[k]) for k in ours), rel
    # Every stage ran in a worker. (On this tiny model the worker that starts first may run them all.)
    started = {e["pid"] for e in RunDir(run_dir).events() if e["event"] == "start"}
    assert 1 <= len(started) <= 2 and os.getpid() not in started


def test_bad_worker_counts_are_usage_errors(tiny_example, tmp_path, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    for flags, message in ((["--runner", "pool", "--workers", "0"], "--workers must be at least 1, got 0"),
                           (["--workers", "2"], "--workers and --worker-threads need --runner pool"),
                           (["--runner", "pool", "--address", "tcp://h:1"], "--address needs --runner dask")):
        with pytest.raises(SystemExit) as exc:
            main(["run", config, "--run-dir", str(tmp_path / "r"), "--no-prefect", *flags])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_killed_worker_is_one_line_and_the_rerun_resumes(resume_config, one_thread_run, tmp_path):
    run_dir = tmp_path / "crashed"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), *POOL)
    _started(proc, run_dir, "gram/l01/count")
    victim = next(e["pid"] for e in RunDir(run_dir).events() if e["stage"] == "gram/l01/count")
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    # One line. (CPython's resource tracker may add a warning about the dead pool's semaphores after it.)
    errors = [line for line in out.splitlines() if line.startswith("featcal: error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"featcal: error: pool worker pid {victim} killed by SIGKILL \(out of memory\?\), so stage '.+' did not "
        r"finish; rerun the same command to resume: finished stages are kept", errors[0]), out
    assert "Traceback" not in out
    before = RunDir(run_dir).events()
    finished = {e["stage"] for e in before if e["event"] == "done"}
    assert "solve/l00" in finished
    assert main(["run", str(resume_config), "--run-dir", str(run_dir), *POOL]) == 0  # in this process: no start-up
    assert digest(run_dir / "calibrated" / "model.safetensors") == digest(
        one_thread_run / "calibrated" / "model.safetensors"
    )
    again = {e["stage"] for e in RunDir(run_dir).events()[len(before):] if e["event"] == "start"}
    assert "assemble" in again and not again & finished, f"recomputed after resume: {again & finished}"


@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c to the group", "sigterm to the main process"])
def test_stop_signal_leaves_no_worker_behind(signum, to_group, resume_config, tmp_path):
    run_dir = tmp_path / "stopped"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), *POOL)
    _started(proc, run_dir, "gram/l01/count")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert _pool_pids(run_dir, proc.pid) <= {c.pid for c in children}
    out = stopped(proc, signum, to_group)
    assert f"featcal: stopped by {signal.Signals(signum).name}" in out and "Traceback" not in out, out
    _, alive = psutil.wait_procs(children, timeout=2)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], f"left behind: {alive}"
