"""A Dask cluster started the way a user starts one: `dask scheduler` and `dask worker --nworkers 2` processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.dask_runner import DaskUnavailable, check_scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def dask_processes(protocol: str, env: dict[str, str], logs: Path, flags: list[str] = ()) -> Iterator[str]:
    """Scheduler and two one-thread workers on loopback (`flags`: e.g. TLS certificates); yields the address."""
    dask = str(Path(sys.executable).parent / "dask")
    port = free_port()
    address = f"{protocol}://127.0.0.1:{port}"
    logs.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([dask, "scheduler", "--protocol", protocol, "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard", *flags], env=env, stdout=subprocess.DEVNULL,
                              stderr=(logs / "scheduler.log").open("w"))]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                check_scheduler(address, timeout=1.0)
                break
            except DaskUnavailable:
                assert time.monotonic() < deadline, (logs / "scheduler.log").read_text()
                time.sleep(0.2)
        procs.append(
            subprocess.Popen(
                [dask, "worker", address, "--nworkers", "2", "--nthreads", "1", "--no-dashboard", *flags],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(logs / "workers.log").open("w"),
            )
        )
        yield address
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
