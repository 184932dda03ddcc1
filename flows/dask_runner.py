"""Running the pipeline's stages on Dask workers, through prefect-dask's `DaskTaskRunner`.

Every stage rebuilds what it needs from the run directory (tasks/context.py), so a worker needs only the
run directory's path — and to see the same files there: the run directory (and the config's base, expert
and data paths) must be on a file system every worker mounts at the same path. `dask_task_runner` checks
that at start with a token file, and gives each worker a fixed number of torch threads so workers do not
oversubscribe the cores. Results do not depend on which worker runs what: each stage is deterministic and
the solve sums the tasks' statistics in task order.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from distributed.diagnostics.plugin import WorkerPlugin

PROBE_NAME = ".featcal-worker-probe"


class DaskUnavailable(ValueError):
    """The Dask cluster cannot be reached or cannot see the run directory; the message says which and why."""


def check_scheduler(address: str, timeout: float = 5.0) -> None:
    """Fail fast, naming the address, when no scheduler listens there (Dask itself would wait 30 s)."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or not parts.port:
        raise DaskUnavailable(f"--address {address!r} is not a Dask scheduler address; expected tcp://HOST:PORT")
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            pass
    except OSError as exc:
        raise DaskUnavailable(f"no Dask scheduler answers at {address} ({exc}); start one with "
                              f"`dask scheduler` and `dask worker {address}`, or check --address") from None


class TorchThreads(WorkerPlugin):
    """Fixes torch's thread count in every worker, including workers that join later."""

    def __init__(self, threads: int):
        self.threads = threads

    def setup(self, worker) -> None:  # noqa: ANN001 (distributed.Worker)
        import torch

        torch.set_num_threads(self.threads)


def _probe(path: str, token: str) -> tuple[str, int, bool]:
    """Runs on each worker: its host, pid and whether it reads our token in the run directory."""
    import torch

    try:
        seen = (Path(path) / PROBE_NAME).read_text() == token
    except OSError:
        seen = False
    return socket.gethostname(), torch.get_num_threads(), seen


def local_cluster_kwargs(workers: int, threads: int) -> dict:
    # One Dask thread per worker process (a stage at a time each); the dashboard on a free port, never a fixed one.
    return {"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": ":0",
            "env": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}


@contextmanager
def dask_task_runner(run_dir: str, address: str | None = None, workers: int | None = None,
                     threads: int = 1) -> Iterator["DaskTaskRunner"]:  # noqa: F821
    """A started DaskTaskRunner on an existing cluster (`address`) or a new LocalCluster of `workers` processes,
    checked to see `run_dir` from every worker."""
    from prefect_dask import DaskTaskRunner

    if (address is None) == (workers is None):
        raise DaskUnavailable("the Dask runner needs either --address tcp://HOST:PORT (an existing cluster) "
                              "or --workers N (a local cluster), not both")
    if address is not None:
        check_scheduler(address)
        runner = DaskTaskRunner(address=address, client_kwargs={"timeout": "15s"})
    else:
        if workers < 1:
            raise DaskUnavailable(f"--workers must be at least 1, got {workers}")
        runner = DaskTaskRunner(cluster_kwargs=local_cluster_kwargs(workers, threads))
    with runner:
        client = runner.client  # connects (or starts the local cluster) now, so failures surface here
        client.register_plugin(TorchThreads(threads), name="featcal-torch-threads")
        if address is not None:
            client.wait_for_workers(1, timeout=60)
        _check_shared(client, run_dir)
        yield runner


def _check_shared(client, run_dir: str) -> None:  # noqa: ANN001 (distributed.Client)
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    probe = root / PROBE_NAME
    probe.write_text(token)
    try:
        seen = client.run(_probe, str(root), token)
    finally:
        probe.unlink(missing_ok=True)
    if not seen:
        raise DaskUnavailable("the Dask cluster has no workers")
    blind = sorted(f"{w} on {host}" for w, (host, _threads, ok) in seen.items() if not ok)
    if blind:
        raise DaskUnavailable(
            f"Dask workers {', '.join(blind)} cannot see the run directory {root} (from {socket.gethostname()}, "
            f"pid {os.getpid()}): the run directory, and the config's model and data paths, must be on a file "
            "system that every worker mounts at the same path")
