"""Outside services failing mid-run: the Prefect server (a user's `featcal server`, and Prefect's temporary one),
the S3 activation store, a Dask worker. Each test asserts how the run ends (it goes on, or it stops in one line
with a run directory that resumes) and that the weights are bit-identical to an undisturbed run's. How long a run
with a dead server takes is measured, not asserted: benchmarks/server_kill.py.

The tests that kill a server start their own; the session's shared one stays up for the others."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from moto.server import ThreadedMotoServer

from flows import server
from flows.prefect_flow import featcal_flow
from storage.atomic import digest
from storage.rundir import RunDir
from tests.conftest import featcal_process
from tests.dask_processes import dask_processes, free_port
from tests.prefect_helpers import cli_env, featcal, wait_for

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


def test_featcal_server_killed_as_the_run_begins_goes_on_in_one_line_and_a_rerun_reports_it(resume_config,
                                                                                           reference_run, tmp_path):
    """A user's `featcal server` dies (kill -9) as the flow run begins, before any stage and before Prefect's log
    worker has sent a batch (its client then does not retry a refused connection, and Prefect writes the failure to
    stderr itself): one line, the run completes with the weights of an undisturbed run, nothing of Prefect's on the
    console; once the server is back, the same command reports the run to it from the cache. (Prefect's temporary
    server is killed two stages in, below.)"""
    home = tmp_path / "home"
    info, _ = server.start(home, port=0)
    run_dir = tmp_path / "run"
    command = ("run", str(resume_config), "--run-dir", str(run_dir))
    try:
        out = _run_and_act(featcal(*command, env=cli_env(info)), "Beginning flow run", lambda: _kill_group(info.pid))
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


def _moto(port: int) -> ThreadedMotoServer:
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    return moto


def test_a_server_gone_before_the_run_wrote_its_manifest_is_one_line(tmp_path):
    """The flow's last request failed and the run directory has no manifest: the server went before the run began."""
    from flows.cli import RunFailed, _outcome_without_server

    with pytest.raises(RunFailed) as failed:
        _outcome_without_server(tmp_path)
    assert str(failed.value) == (
        f"the Prefect server stopped answering before the run began ({tmp_path / 'manifest.json'} was not written); "
        "rerun the same command: with the featcal server gone it runs in ephemeral mode; with PREFECT_API_URL set, "
        "rerun once that server answers")


def test_s3_store_unreachable_mid_run_stops_in_one_line_and_resumes(resume_config, reference_run, tmp_path):
    """The activation store's endpoint stops answering mid-run: a stage cannot read or write its activations, so the
    run stops in one line naming the store, its manifest says why, and once the endpoint is back the same command
    finishes with the weights of an undisturbed run. (moto keeps its buckets in this process, so a server restarted
    on the same port serves the same objects, as a restarted MinIO would.)"""
    import fsspec

    port = free_port()
    moto = _moto(port)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    fsspec.filesystem("s3", **options).mkdir("featcal-faults")
    run_dir = tmp_path / "run"
    command = ("run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect",
               "--set", "runtime.activation_store=s3://featcal-faults/run",
               "--set", f"runtime.storage_options={json.dumps(options)}")
    try:
        out = _run_and_act(featcal_process(*command), "[  5/", moto.stop)
        errors = [line for line in out.splitlines() if line.startswith("featcal: error:")]
        assert errors == [line for line in out.splitlines() if "error" in line.lower()], out
        # the request that meets the stopped endpoint is a read of the run's objects or a listing of its prefix,
        # whichever the stage was making when it stopped: both name the bucket and the run's prefix
        assert len(errors) == 1 and re.match(
            f"featcal: error: the activation store does not answer: Could not connect to the endpoint URL: "
            f'"http://127\\.0\\.0\\.1:{port}/featcal-faults(/run/|\\?list-type=2&prefix=run%2F)', errors[0]), out
        assert errors[0].endswith("; fix the cause and rerun the same command: finished stages are kept")
        assert "Traceback" not in out
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["status"] == "failed" and "EndpointConnectionError" in manifest["reason"]

        moto = _moto(port)
        proc = featcal_process(*command)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        assert out.count("cached") >= 5, out  # the stages finished before the fault are kept
        assert _weights(run_dir) == _weights(reference_run)
    finally:
        moto.stop()


@pytest.fixture
def dask_cluster(tmp_path: Path) -> Iterator[str]:
    """`dask scheduler` and `dask worker --nworkers 2` processes, as a user starts them: the worker command is a
    nanny that starts a worker process again when one dies."""
    with dask_processes("tcp", {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "dask-logs") as address:
        yield address


def test_dask_worker_killed_mid_stage_the_run_goes_on(prefect_server, tiny_example, dask_cluster, one_thread_run,
                                                      tmp_path):
    """A worker process is killed (SIGKILL) while it runs block 01's first Gram: the scheduler gives the stage to a
    worker again, it runs from the start (its outputs are written atomically, so nothing half-written is read), and
    the run completes with the weights of a one-process run."""
    run_dir = tmp_path / "dask"
    victim: dict[str, Any] = {}

    def kill_the_worker_of_a_gram() -> None:
        def running() -> tuple[str, int] | None:  # a Gram of block 01 that started and has not finished
            events = RunDir(run_dir).events()
            done = {e["stage"] for e in events if e["event"] == "done"}
            return next(((e["stage"], int(e["pid"])) for e in events if e["event"] == "start"
                         and e["stage"].startswith("gram/l01/") and e["stage"] not in done), None)

        victim["stage"], victim["pid"] = wait_for("a Gram of block 01 in progress", running, timeout=300, every=0.02)
        os.kill(victim["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_worker_of_a_gram, daemon=True)
    killer.start()
    state = featcal_flow(str(tiny_example / "bert" / "example.yaml"), str(run_dir), ["evaluation.enabled=false"],
                         runner="dask", address=dask_cluster, return_state=True)
    killer.join(timeout=10)
    assert state.is_completed(), state
    assert victim["pid"] != os.getpid() and not psutil.pid_exists(victim["pid"])
    runs = [e["pid"] for e in RunDir(run_dir).events() if e["stage"] == victim["stage"] and e["event"] == "start"]
    assert len(runs) == 2 and runs[0] == victim["pid"] != runs[1], runs  # it ran again, in another worker process
    for rel in ("calibrated/model.safetensors", "merged/model.safetensors"):
        assert digest(run_dir / rel) == digest(one_thread_run / rel), rel
