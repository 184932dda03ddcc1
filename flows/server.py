"""`featcal server`: a local Prefect server with its UI, kept running in the background.

Everything it keeps lives under one home, `$FEATCAL_HOME` (default `~/.featcal`):

    prefect/       the server's PREFECT_HOME: its SQLite database
    server.json    pid, host, port, address of the server we started and whether it requires authentication
    server.log     its output
    server-auth    the basic-authentication secret (mode 0600), when the server requires one

The server listens on 127.0.0.1 unless told otherwise, with Prefect's telemetry off. On any other address
it requires Prefect's basic authentication (the server's `server.api.auth_string` setting) unless started
with `insecure=True`; `auth=True` requires it on loopback too. The secret is generated once and kept in
`server-auth`; clients send it as Prefect's `api.auth_string` setting (PREFECT_API_AUTH_STRING).

`featcal run` reports to `PREFECT_API_URL` when that is set, else to the server recorded here when it answers,
else to Prefect's ephemeral mode (`api_url_for_runs`); `using_api` adds the recorded server's secret when the
URL is that server's and no PREFECT_API_AUTH_STRING is set.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
STATE_FILE = "server.json"
LOG_FILE = "server.log"
AUTH_FILE = "server-auth"
AUTH_USER = "featcal"
WILDCARDS = ("0.0.0.0", "::", "")


class ServerError(RuntimeError):
    """A server could not be started, stopped or reached; the message says why and what to do."""


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    host: str
    port: int
    home: str
    auth: bool = False

    @property
    def url(self) -> str:
        """The UI's address (the API is under /api): on a wildcard address, this machine's name when it resolves."""
        host = _own_name() if self.host in WILDCARDS else self.host
        return f"http://{host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def local_url(self) -> str:
        """Where this machine reaches it (health checks): loopback for a wildcard address."""
        if self.host in WILDCARDS:
            return f"http://{'[::1]' if self.host == '::' else '127.0.0.1'}:{self.port}"
        return self.url


def _own_name() -> str:
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return "127.0.0.1"
    return name


def is_loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
        return ServerInfo(pid=int(raw["pid"]), host=raw["host"], port=int(raw["port"]), home=raw["home"],
                          auth=bool(raw.get("auth", False)))
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
    return info if healthy(info.local_url) else None


def _port_free(host: str, port: int) -> bool:
    """Whether nothing listens there. As the server will (uvicorn sets SO_REUSEADDR), ignore the closed connections
    a server killed a moment ago leaves in TIME_WAIT: a server restarted on its port finds it free."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def auth_file(where: Path) -> Path:
    return Path(where) / AUTH_FILE


def auth_secret(where: Path, create: bool = False) -> str | None:
    """The basic-authentication secret kept under `where` (`featcal:RANDOM`, mode 0600), made if asked and absent.

    A secret file that others may read is refused: the secret may be known, so it must be replaced."""
    path = auth_file(where)
    if create and not path.exists():
        value = f"{AUTH_USER}:{secrets.token_urlsafe(32)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another start made it a moment ago: use theirs
        else:
            with os.fdopen(fd, "w") as out:
                out.write(value + "\n")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if mode & 0o077:
        raise ServerError(f"{path} (the server's secret) can be read by other users (mode {mode & 0o777:o}): "
                          f"delete it and start the server again (a new secret is made), or `chmod 600 {path}`")
    value = path.read_text().strip()
    if not value:
        raise ServerError(f"{path} (the server's secret) is empty: delete it and start the server again")
    return value


def server_env(info: ServerInfo, auth_string: str | None = None) -> dict[str, str]:
    """The environment of the server process: its own PREFECT_HOME (SQLite inside), no telemetry, the UI
    told where its API is (it would otherwise point the browser at the default port), and basic
    authentication when `auth_string` is given (never inherited from ours: we decide whether it is on)."""
    drop = ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING",
            "PREFECT_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if auth_string is not None:
        # The server checks the first; its own in-process clients send the second.
        env.update({"PREFECT_SERVER_API_AUTH_STRING": auth_string, "PREFECT_API_AUTH_STRING": auth_string})
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


def start(where: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout: float = 90.0,
          auth: bool | None = None, insecure: bool = False) -> tuple[ServerInfo, bool]:
    """Start a server in the background (its own session, so it outlives this process) and wait until it answers.

    `auth`: require basic authentication; by default only off loopback. Off loopback a server without it is
    refused unless `insecure`. Returns the server and whether this call started it (False: one was already
    running here)."""
    if auth is None:
        auth = not is_loopback(host) and not insecure
    if auth and insecure:
        raise ServerError("--auth and --insecure exclude each other")
    if not auth and not is_loopback(host) and not insecure:
        raise ServerError(f"refusing to listen on {host} without authentication: anyone who reaches the port could "
                          "read every run and run code through deployments; use --auth (the default off loopback), "
                          "or --insecure if a firewall or private network already keeps others out")
    if (info := running(where)) is not None:
        return info, False
    if port == 0:
        port = free_port(host)
    if not _port_free(host, port):
        raise ServerError(f"port {port} on {host} is already in use; choose another with --port")
    if not where.exists():
        where.mkdir(parents=True, mode=0o700)  # the database holds every run's parameters and logs
    (where / "prefect").mkdir(parents=True, exist_ok=True, mode=0o700)
    auth_string = auth_secret(where, create=True) if auth else None
    planned = ServerInfo(pid=0, host=host, port=port, home=str(where), auth=auth)
    with open(where / LOG_FILE, "ab") as log:
        log.write(f"\n---- featcal server start {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
             "--analytics-off"],
            cwd=where, env=server_env(planned, auth_string), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    info = ServerInfo(pid=proc.pid, host=host, port=port, home=str(where), auth=auth)
    (where / STATE_FILE).write_text(json.dumps(asdict(info)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            (where / STATE_FILE).unlink(missing_ok=True)
            raise ServerError(f"the Prefect server exited with code {proc.returncode} before it answered; "
                              f"the end of {where / LOG_FILE}:\n{_log_tail(where)}")
        if healthy(info.local_url, timeout=1.0):
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


def _is_recorded_server(url: str, info: ServerInfo) -> bool:
    parts = urlsplit(url)
    if parts.port != info.port:
        return False
    names = {info.host, socket.gethostname(), socket.getfqdn(), "localhost", urlsplit(info.url).hostname}
    return parts.hostname in names or is_loopback(parts.hostname)


def auth_string_for(url: str | None, where: Path | None = None) -> str | None:
    """The secret of the featcal server recorded under `where` ($FEATCAL_HOME) when `url` is its API and it
    requires authentication; None otherwise."""
    if url is None:
        return None
    info = recorded(home(where))
    if info is None or not info.auth or not _is_recorded_server(url, info):
        return None
    return auth_secret(Path(info.home))


@contextmanager
def using_api(url: str | None) -> Iterator[None]:
    """Point Prefect at `url` for the duration: in this process's settings and in the environment that child
    processes (a served flow's runs, Dask workers) inherit, with the recorded featcal server's secret when `url`
    is that server and PREFECT_API_AUTH_STRING is not set already. Nothing changes for None (ephemeral mode)."""
    if url is None:
        yield
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    env = {"PREFECT_API_URL": url}
    updates = {PREFECT_API_URL: url}
    if not PREFECT_API_AUTH_STRING.value() and (secret := auth_string_for(url)) is not None:
        env["PREFECT_API_AUTH_STRING"] = secret
        updates[PREFECT_API_AUTH_STRING] = secret
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with temporary_settings(updates=updates):
            yield
    finally:
        restore_environ(before)


def restore_environ(before: dict[str, str | None]) -> None:
    """Put environment variables back as they were ({name: value, or None for unset})."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def ui_url(api_url: str) -> str:
    return api_url.rstrip("/").removesuffix("/api")
