"""Running the pipeline's stages on Dask workers, through prefect-dask's `DaskTaskRunner`.

Every stage rebuilds what it needs from the run directory (tasks/context.py), so a worker needs only the
run directory's path — and to see the same files there: the run directory (and the config's base, expert
and data paths) must be on a file system every worker mounts at the same path. `dask_task_runner` checks
that at start with a token file, and gives each worker a fixed number of torch threads so workers do not
oversubscribe the cores. Results do not depend on which worker runs what: each stage is deterministic and
the solve sums the tasks' statistics in task order.

Several GPUs: a local cluster given `devices` (`featcal run --gpus N`: cuda:0 … cuda:N-1) has one worker per device,
each pinned to its own by the `PinnedDevices` plugin (one stage at a time per worker, so one per GPU). Workers of
an existing cluster use their own runtime.device: start one per GPU with its CUDA_VISIBLE_DEVICES.

Security: `--address tls://HOST:PORT` with a CA, a certificate and its key (`tls_security`; distributed's
mutual TLS: the scheduler and the workers only talk to peers whose certificate the CA signed) encrypts the
traffic and keeps clients without a certificate out. Secrets the run's config holds (featcal/secrets.py) are
given to every worker, in memory, by the `KnownSecrets` plugin, and taken back when the run ends; over a
`tcp://` address they, and the Prefect API secret each stage carries, cross the network in clear.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from distributed.diagnostics.plugin import WorkerPlugin

from flows.server import restore_environ

if TYPE_CHECKING:  # prefect_dask is imported when a Dask run starts
    from prefect_dask import DaskTaskRunner

PROBE_NAME = ".featcal-worker-probe"
SECRETS_PLUGIN = "featcal-secrets"


class DaskUnavailable(ValueError):
    """The Dask cluster cannot be reached or cannot see the run directory; the message says which and why."""


def check_tls(address: str | None, ca_file: str | None = None, cert: str | None = None,
              key: str | None = None) -> None:
    """TLS options go with a tls:// address, and name files that exist; a tls:// address without them needs
    Dask's own TLS configuration (distributed.comm.tls.*)."""
    given = {"--tls-ca-file": ca_file, "--tls-cert": cert, "--tls-key": key}
    scheme = urlsplit(address).scheme if address and "://" in address else "tcp"
    if any(given.values()) and (address is None or scheme != "tls"):
        raise DaskUnavailable("--tls-ca-file, --tls-cert and --tls-key are for an existing cluster reached with "
                              f"--address tls://HOST:PORT{'' if address is None else f', not {address}'}")
    for flag, path in given.items():
        if path is not None and not Path(path).is_file():
            raise DaskUnavailable(f"{flag} {path}: no such file")
    if scheme == "tls":
        security = tls_security(ca_file, cert, key)
        if not security.tls_ca_file or not security.tls_client_cert:
            raise DaskUnavailable(f"--address {address} needs --tls-ca-file and --tls-cert (and --tls-key unless the "
                                  "key is in the certificate file), or Dask's distributed.comm.tls settings")


def tls_security(ca_file: str | None = None, cert: str | None = None, key: str | None = None):  # noqa: ANN201
    """distributed's Security for a client: our files over Dask's configuration (distributed.comm.tls.*)."""
    from distributed.security import Security

    overrides = {k: v for k, v in (("tls_ca_file", ca_file), ("tls_client_cert", cert), ("tls_client_key", key))
                 if v is not None}
    return Security(require_encryption=True, **overrides)


def check_scheduler(address: str, timeout: float = 5.0) -> None:
    """Fail fast, naming the address, when no scheduler listens there (Dask itself would wait 30 s)."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or not parts.port:
        raise DaskUnavailable(f"--address {address!r} is not a Dask scheduler address; expected tcp://HOST:PORT "
                              "or tls://HOST:PORT")
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


class PinnedDevices(WorkerPlugin):
    """Pins each worker of a local cluster to its device: worker i to devices[i]."""

    def __init__(self, devices: list[str]):
        self.devices = list(devices)

    def setup(self, worker) -> None:  # noqa: ANN001 (distributed.Worker)
        from featcal.devices import device_for_worker, pin_worker_device

        pin_worker_device(device_for_worker(worker.name, self.devices))


class KnownSecrets(WorkerPlugin):
    """Gives every worker (also those that join later) the run's secrets, in memory, so a stage can restore the
    placeholders of run.yaml; forgets them when the plugin is removed at the end of the run."""

    def __init__(self, values: dict):
        self.values = dict(values)

    def __repr__(self) -> str:  # never the values, whoever logs the plugin
        return f"KnownSecrets({len(self.values)} values)"

    def setup(self, worker) -> None:  # noqa: ANN001 (distributed.Worker)
        from featcal import secrets as featcal_secrets

        featcal_secrets.remember(self.values)

    def teardown(self, worker) -> None:  # noqa: ANN001
        from featcal import secrets as featcal_secrets

        featcal_secrets.forget(self.values)


def _probe(path: str, token: str) -> tuple[str, int, bool]:
    """Runs on each worker: its host, torch threads and whether it reads our token in the run directory."""
    import torch

    try:
        seen = (Path(path) / PROBE_NAME).read_text() == token
    except OSError:
        seen = False
    return socket.gethostname(), torch.get_num_threads(), seen


def local_cluster_kwargs(workers: int, threads: int) -> dict:
    # One Dask thread per worker process (a stage at a time each); the dashboard on a free port, never a fixed one.
    # Everything on loopback: the scheduler and workers (LocalCluster's default) and the dashboard.
    return {"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": "127.0.0.1:0",
            "env": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}


@contextmanager
def dask_task_runner(run_dir: str, address: str | None = None, workers: int | None = None, threads: int = 1,
                     known_secrets: dict | None = None, tls_ca_file: str | None = None, tls_cert: str | None = None,
                     tls_key: str | None = None, devices: list[str] | None = None) -> Iterator[DaskTaskRunner]:
    """A started DaskTaskRunner on an existing cluster (`address`, over TLS for tls://) or a new LocalCluster of
    `workers` processes (with `devices`: one per device, each pinned to its own), checked to see `run_dir` from
    every worker; `known_secrets` ({placeholder: value}) are given to every worker while the runner is open."""
    from prefect_dask import DaskTaskRunner

    if devices and (address is not None or workers not in (None, len(devices))):
        raise DaskUnavailable(f"--gpus starts a local cluster of one worker per GPU ({len(devices)}): it excludes "
                              "--address and --workers")
    workers = len(devices) if devices else workers
    if (address is None) == (workers is None):
        raise DaskUnavailable("the Dask runner needs either --address tcp://HOST:PORT (an existing cluster) "
                              "or --workers N (a local cluster), not both")
    check_tls(address, tls_ca_file, tls_cert, tls_key)
    if address is not None:
        check_scheduler(address)
        client_kwargs = {"timeout": "15s"}
        if urlsplit(address).scheme == "tls":
            client_kwargs["security"] = tls_security(tls_ca_file, tls_cert, tls_key)
        runner = DaskTaskRunner(address=address, client_kwargs=client_kwargs)
    else:
        assert workers is not None  # the check above: no address, so a local cluster of `workers`
        if workers < 1:
            raise DaskUnavailable(f"--workers must be at least 1, got {workers}")
        runner = DaskTaskRunner(cluster_kwargs=local_cluster_kwargs(workers, threads))
    before = {k: os.environ.get(k) for k in SPAWN_ENVIRON}
    try:
        runner.__enter__()
    except (OSError, TimeoutError) as exc:
        if address is None:
            raise
        raise DaskUnavailable(f"could not connect to the Dask scheduler at {address}: {exc}"
                              + ("; check --tls-ca-file, --tls-cert and --tls-key (the CA must have signed the "
                                 "scheduler's certificate and ours)" if address.startswith("tls://") else "")) from None
    with ExitStack() as stack:
        stack.push(runner.__exit__)
        client = runner.client  # connected (or the local cluster started) now, so failures surface here
        client.register_plugin(TorchThreads(threads), name="featcal-torch-threads")
        if devices:
            client.register_plugin(PinnedDevices(devices), name="featcal-devices")
        if known_secrets:
            client.register_plugin(KnownSecrets(known_secrets), name=SECRETS_PLUGIN)
            stack.callback(_unregister, client, SECRETS_PLUGIN)
        if address is not None:
            client.wait_for_workers(1, timeout=60)
        _check_shared(client, run_dir)
        restore_environ(before)
        yield runner


# What a local cluster's nannies write into this process's environment for their workers (Dask's
# `pre-spawn-environ` and our thread settings): left there, every process started later — a bench method
# run, a reference run in the tests — would run torch on one thread.
SPAWN_ENVIRON = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")


def _unregister(client, name: str) -> None:  # noqa: ANN001 (distributed.Client)
    try:
        client.unregister_worker_plugin(name)
    except Exception:  # noqa: BLE001 - a cluster that went away has forgotten them anyway
        pass


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
