"""One real Prefect server for the test session (a pytest plugin: `pytest_plugins = ("tests.prefect_server",)`).

It is started and stopped by `featcal server`'s own code (flows/server.py) on a free loopback port, with its
home (SQLite database, pid file, log) in a temporary directory and telemetry off. In this process Prefect
reports to it; subprocesses find it through FEATCAL_HOME (tests/prefect_helpers.py: `cli_env`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flows import server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[server.ServerInfo]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("featcal-home")
    info, started = server.start(home, port=0)
    assert started and server.healthy(info.url)
    try:
        with temporary_settings(updates={PREFECT_API_URL: info.api_url}):
            yield info
            _drain()
    finally:
        server.stop(home)


def _drain() -> None:
    """Send what this process still buffers (logs, events) before the server goes away."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=10)
        except Exception:  # noqa: BLE001 - nothing was started
            pass
