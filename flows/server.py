"""`featcal server`: a local Prefect server with its UI, kept running in the background.

Everything it keeps lives under one home, `$FEATCAL_HOME` (default `~/.featcal`):

    prefect/       the server's PREFECT_HOME: its SQLite database
    server.json    pid, host, port and address of the server we started
    server.log     its output

The server listens on 127.0.0.1 unless told otherwise, with Prefect's telemetry off. `featcal run`
reports to `PREFECT_API_URL` when that is set, else to the server recorded here when it answers,
else to Prefect's ephemeral mode (`api_url_for_runs`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
STATE_FILE = "server.json"
LOG_FILE = "server.log"


class ServerError(RuntimeError):
    """A server could not be started, stopped or reached; the message says why and what to do."""


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    host: str
    port: int
    home: str

    @property
    def url(self) -> str:
        """The UI's address (the API is under /api)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"


def home(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("FEATCAL_HOME") or Path.home() / ".featcal").expanduser().resolve()


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether a Prefect server answers /api/health at `url` (its UI address)."""
    try:
        return httpx.get(f"{url.rstrip('/')}/api/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def recorded(where: Path) -> ServerInfo | None:
    try:
        raw = json.loads((where / STATE_FILE).read_text())
        return ServerInfo(pid=int(raw["pid"]), host=raw["host"], port=int(raw["port"]), home=raw["home"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reaps it if it is our own child and has exited
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


def _is_prefect_server(pid: int) -> bool:
    """Guard against a recycled pid: the process must be a `prefect server start`."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return _alive(pid)  # no /proc: trust the pid file
    return b"prefect" in b" ".join(cmdline) and b"server" in cmdline and b"start" in cmdline


def running(where: Path) -> ServerInfo | None:
    """The server recorded under `where`, if its process is alive and it answers."""
    info = recorded(where)
    if info is None or not _alive(info.pid) or not _is_prefect_server(info.pid):
        return None
    return info if healthy(info.url) else None


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_env(info: ServerInfo) -> dict[str, str]:
    """The environment of the server process: its own PREFECT_HOME (SQLite inside), no telemetry, and the UI
    told where its API is (it would otherwise point the browser at the default port)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH")}
    env.update({
        "PREFECT_HOME": str(Path(info.home) / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_SERVER_API_HOST": info.host,
        "PREFECT_SERVER_API_PORT": str(info.port),
        "PREFECT_UI_API_URL": info.api_url,
    })
    return env


def _log_tail(where: Path, lines: int = 20) -> str:
    try:
        return "\n".join((where / LOG_FILE).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(where: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout: float = 90.0) -> tuple[ServerInfo, bool]:
    """Start a server in the background (its own session, so it outlives this process) and wait until it answers.

    Returns the server and whether this call started it (False: one was already running here)."""
    if (info := running(where)) is not None:
        return info, False
    if port == 0:
        port = free_port(host)
    if not _port_free(host, port):
        raise ServerError(f"port {port} on {host} is already in use; choose another with --port")
    (where / "prefect").mkdir(parents=True, exist_ok=True)
    planned = ServerInfo(pid=0, host=host, port=port, home=str(where))
    with open(where / LOG_FILE, "ab") as log:
        log.write(f"\n---- featcal server start {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port), "--analytics-off"],
            cwd=where, env=server_env(planned), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    info = ServerInfo(pid=proc.pid, host=host, port=port, home=str(where))
    (where / STATE_FILE).write_text(json.dumps(asdict(info)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            (where / STATE_FILE).unlink(missing_ok=True)
            raise ServerError(f"the Prefect server exited with code {proc.returncode} before it answered; "
                              f"the end of {where / LOG_FILE}:\n{_log_tail(where)}")
        if healthy(info.url, timeout=1.0):
            return info, True
        time.sleep(0.2)
    _terminate(proc.pid)
    (where / STATE_FILE).unlink(missing_ok=True)
    raise ServerError(f"the Prefect server did not answer at {info.url} within {timeout:.0f} s; "
                      f"the end of {where / LOG_FILE}:\n{_log_tail(where)}")


def _terminate(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the server's process group (it runs in a session of its own), SIGKILL it if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)


def stop(where: Path) -> ServerInfo:
    info = recorded(where)
    if info is None or not _alive(info.pid) or not _is_prefect_server(info.pid):
        (where / STATE_FILE).unlink(missing_ok=True)
        raise ServerError(f"no featcal Prefect server is running (home {where})")
    _terminate(info.pid)
    (where / STATE_FILE).unlink(missing_ok=True)
    return info


def api_url_for_runs(where: Path | None = None) -> tuple[str | None, str]:
    """(API URL, where it came from) for a run: Prefect's PREFECT_API_URL setting (environment or profile), else
    our server if it answers, else None (ephemeral)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return PREFECT_API_URL.value(), "PREFECT_API_URL"
    info = running(home(where))
    if info is not None:
        return info.api_url, f"the featcal server (home {info.home})"
    return None, "ephemeral"


@contextmanager
def using_api(url: str | None) -> Iterator[None]:
    """Point Prefect at `url` for the duration: in this process's settings and in the environment that child
    processes (a served flow's runs, Dask workers) inherit. Nothing changes for None (ephemeral mode)."""
    if url is None:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


def ui_url(api_url: str) -> str:
    return api_url.rstrip("/").removesuffix("/api")
