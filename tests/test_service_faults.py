"""Outside services failing mid-run: the Prefect server (a user's `featcal server`, and Prefect's temporary one),
the S3 activation store, a Dask worker. Each test asserts how the run ends (it goes on, or it stops in one line
with a run directory that resumes) and that the weights are bit-identical to an undisturbed run's. How long a run
with a dead server takes is measured, not asserted: benchmarks/server_kill.py.

The tests that kill a server start their own; the session's shared one stays up for the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from flows import server
from storage.atomic import digest
from storage.rundir import RunDir
from tests.prefect_helpers import cli_env, featcal

pytest_plugins = ("tests.prefect_server", "tests.s3_server")

NOISE = ("Unable to connect", "EventsWorker", "--- Error logging to API ---", "Traceback", "Encountered retryable")


def _weights(run_dir: Path) -> str:
    return digest(run_dir / "calibrated" / "model.safetensors")


def _run_and_act(proc: subprocess.Popen, at: str, act: Callable[[], None]) -> str:
    """Read the run's output; call `act` once the line with `at` (a stage's progress line) has come."""
    lines, acted = [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not acted and at in line:
            act()
            acted = True
    proc.wait(timeout=600)
    assert acted, "".join(lines)
    return "".join(lines)


def _kill_group(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


def test_featcal_server_killed_mid_run_goes_on_in_one_line_and_a_rerun_reports_it(resume_config, reference_run,
                                                                                  tmp_path):
    """A user's `featcal server` dies (kill -9) two stages in: one line, the run completes with the weights of an
    undisturbed run, nothing of Prefect's retries on the console; once the server is back, the same command reports
    the run to it from the cache."""
    home = tmp_path / "home"
    info, _ = server.start(home, port=0)
    run_dir = tmp_path / "run"
    command = ("run", str(resume_config), "--run-dir", str(run_dir))
    try:
        out = _run_and_act(featcal(*command, env=cli_env(info)), "[  2/", lambda: _kill_group(info.pid))
        faults = [line for line in out.splitlines() if "stopped answering" in line]
        assert len(faults) == 1, out
        assert (f"the Prefect server at {info.url} stopped answering" in faults[0]
                and f"its records are in {run_dir} (manifest.json, records/)" in faults[0]
                and "rerun the same command to report the run to it" in faults[0]), faults[0]
        assert "featcal: the run is complete; the Prefect server did not answer to record its end" in out, out
        assert not [n for n in NOISE if n in out], out
        assert "answers again" not in out
        assert (run_dir / "logs" / "prefect.log").stat().st_size > 0  # where Prefect's own messages went
        assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"
        assert _weights(run_dir) == _weights(reference_run)

        info, started = server.start(home, port=info.port)  # back, on the same port: a rerun reports to it
        assert started
        proc = featcal(*command, env=cli_env(info))
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        assert "stopped answering" not in out and out.count("cached") == 23, out
        flow_run = out.split(f"flow run: {info.url}/runs/flow-run/")[1].split()[0]
        state = httpx.get(f"{info.api_url}/flow_runs/{flow_run}", timeout=10).json()["state"]["type"]
        assert state == "COMPLETED"
        assert _weights(run_dir) == _weights(reference_run)
    finally:
        if server.running(home) is not None:
            server.stop(home)


def test_temporary_server_killed_mid_run_goes_on_in_one_line(resume_config, reference_run, tmp_path):
    """Without a server, Prefect starts a temporary one as a child of the run; killed, the run goes on and says so
    once (there is nothing to report it to later: that server keeps nothing)."""
    env = cli_env(server.ServerInfo(pid=0, host="127.0.0.1", port=0, home=str(tmp_path / "nobody")))
    run_dir = tmp_path / "run"
    proc = featcal("run", str(resume_config), "--run-dir", str(run_dir), env=env)

    def kill_temporary_server() -> None:
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "server" in " ".join(c.cmdline()) or "uvicorn" in " ".join(c.cmdline())]
        assert servers
        for child in servers:
            child.kill()

    out = _run_and_act(proc, "[  2/", kill_temporary_server)
    assert proc.returncode == 0, out
    faults = [line for line in out.splitlines() if "stopped answering" in line]
    assert len(faults) == 1 and "Prefect's temporary server at http://127.0.0.1:" in faults[0], out
    assert not [n for n in NOISE if n in out], out
    assert _weights(run_dir) == _weights(reference_run)
