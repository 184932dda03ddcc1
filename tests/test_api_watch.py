"""The watch asked at once, by a failed request, rather than at its next check: a batch of log lines Prefect fails to
send (kept in the run's prefect.log) and the flow's tagging request (tests/test_service_faults.py kills real servers;
these drive the watch directly, with a port nobody listens on and a stand-in server that answers its health)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from uuid import uuid4

import pytest

from flows.api_watch import PREFECT_LOG, ApiWatch, unanswered
from flows.prefect_flow import tag_flow_run
from tests.dask_processes import free_port

HEADER = "--- Error logging to API ---\n"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """What the watch logs on `featcal`, and Prefect's settings and logging's flag put back after a fault."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    retries, raise_exceptions = settings.client.max_retries, logging.raiseExceptions
    handler = _Lines()
    logging.getLogger("featcal").addHandler(handler)
    try:
        yield handler.lines
    finally:
        logging.getLogger("featcal").removeHandler(handler)
        settings.client.max_retries, logging.raiseExceptions = retries, raise_exceptions
        unanswered.clear()


@pytest.fixture
def answering_server() -> Iterator[str]:
    """An API address whose /api/health answers 200, as a Prefect server's does."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/api"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_failed_log_batch_with_the_server_gone_is_the_one_fault_line(tmp_path: Path, warnings_logged, capsys):
    api = f"http://127.0.0.1:{free_port()}/api"
    stream = sys.stderr
    with ApiWatch(api, tmp_path, interval=3600) as watch:  # the watch's own checks would come only in an hour
        assert watch.up
        sys.stderr.write(HEADER)
        sys.stderr.write("All connection attempts failed")
        sys.stderr.write("a line of the run's own\n")
        assert not watch.up and watch.faults == 1 and unanswered.is_set()
        sys.stderr.write(HEADER)  # the batches after it: kept in the file, no second line
        sys.stderr.write("All connection attempts failed")
        assert sys.stderr is not stream
    assert sys.stderr is stream  # the gate is gone with the watch
    assert capsys.readouterr().err == "a line of the run's own\n"
    kept = (tmp_path / PREFECT_LOG).read_text().splitlines()
    assert len(kept) == 2 and all(line.endswith("--- Error logging to API --- All connection attempts failed")
                                  for line in kept), kept
    assert len(warnings_logged) == 1, warnings_logged
    assert warnings_logged[0].startswith(
        f"the Prefect server at {api.removesuffix('/api')} stopped answering (a batch of log lines failed (All "
        "connection attempts failed) and a health check got no reply); the run goes on without it"), warnings_logged
    assert logging.raiseExceptions is False


def test_a_failed_log_batch_with_the_server_up_is_one_warning_and_the_run_stays_reported(
        tmp_path: Path, answering_server: str, warnings_logged, capsys):
    with ApiWatch(answering_server, tmp_path, interval=3600) as watch:
        for _ in range(2):
            sys.stderr.write(HEADER)
            sys.stderr.write("Client error '413 Payload Too Large'")
        assert watch.up and watch.faults == 0 and not unanswered.is_set()
    assert capsys.readouterr().err == ""
    assert len((tmp_path / PREFECT_LOG).read_text().splitlines()) == 2
    assert warnings_logged == [
        f"the Prefect server at {answering_server.removesuffix('/api')} did not take a batch of this run's log lines "
        f"(Client error '413 Payload Too Large'): the UI misses them; they are on this console, and Prefect's "
        f"message is in {tmp_path / PREFECT_LOG}"]


def test_a_flow_run_tagged_with_the_server_gone_is_the_one_fault_line(tmp_path: Path, warnings_logged):
    """The flow's first request of its own: no retries (cut mid-backoff, Prefect's client ends in an AssertionError),
    the watch's one line, and the run goes on untagged."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = f"http://127.0.0.1:{free_port()}/api"
    with ApiWatch(api, tmp_path, interval=3600) as watch, temporary_settings(updates={PREFECT_API_URL: api}):
        tag_flow_run(uuid4(), ["featcal"], watch)
        assert not watch.up and watch.faults == 1
    assert len(warnings_logged) == 1 and warnings_logged[0].startswith(
        f"the Prefect server at {api.removesuffix('/api')} stopped answering (tagging the flow run failed ("), \
        warnings_logged


def test_a_flow_run_its_server_will_not_tag_goes_on_untagged_with_a_warning(tmp_path: Path, answering_server: str,
                                                                             warnings_logged):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with ApiWatch(answering_server, tmp_path, interval=3600) as watch, \
            temporary_settings(updates={PREFECT_API_URL: answering_server}):
        tag_flow_run(uuid4(), ["featcal"], watch)  # the stand-in server answers a PATCH with 501
        assert watch.up and watch.faults == 0
    assert len(warnings_logged) == 1 and warnings_logged[0].startswith("could not tag this flow run (") \
        and "501" in warnings_logged[0] and warnings_logged[0].endswith("): the run goes on untagged"), warnings_logged
