"""Whether the Prefect server still answers, watched beside a run so that no stage ever waits on it.

A thread asks the API's health every `interval` seconds. After `misses` failed checks in a row the run says so in
one line (what happened, that it goes on, where its records are, how to report it later) and, until the server
answers again:

- log records stop going to Prefect's API handler (they stay on the console and in the run's records), and
  `logging.raiseExceptions` is off, so the batches already queued fail quietly instead of writing Prefect's
  `--- Error logging to API ---` to stderr;
- the client settings the flow runs under get `max_retries = 0`: Prefect reads them at each request, so the one
  request the flow still makes in this thread (its final state) fails at once instead of after a minute of
  exponential backoff. The CLI then reads the run's outcome from its manifest (flows/cli.py).

Prefect's log worker reports a batch it could not send by writing straight to stderr, outside logging. A batch can
fail before the watch's next check: a server killed in a run's first seconds, before the worker's client has
connected once (until then it does not retry a refused connection). So while the watch runs, `sys.stderr` is a gate
that sends those writes to the run's prefect.log and has the watch check the server at once: down, the run says so
in its one line; up (it refused the batch), one warning says the UI misses those lines. Every other write passes.

The stages never call the API themselves: task-run states are events sent by Prefect's background worker, and the
artifacts are published from a thread of their own (flows/artifacts.py). When the server answers again, one line
says so and everything is put back. A fault still present when the watch ends leaves the settings as they are: the
flow's final state request comes after it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from flows.server import healthy, ui_url

log = logging.getLogger("featcal")

unanswered = threading.Event()  # set while a watched server does not answer, and left set if the run ends so


class _WhileUp(logging.Filter):
    """Passes records only while the server answers: put on Prefect's API log handlers."""

    def __init__(self, watch: ApiWatch):
        super().__init__()
        self.watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        return self.watch.up


def _api_log_handlers() -> list[logging.Handler]:
    from prefect.logging.handlers import APILogHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, APILogHandler)]


class _PrefectErrorGate:
    """`sys.stderr` while a watch runs: Prefect's `--- Error logging to API ---` and the error after it (two writes
    from one thread) go to the watch; everything else to the stream it stands in for."""

    HEADER = "--- Error logging to API ---\n"

    def __init__(self, stream: TextIO, watch: ApiWatch):
        self.stream, self.watch = stream, watch
        self._after_header: set[int] = set()  # threads whose next write is the error that follows the header

    def write(self, text: str) -> int:
        me = threading.get_ident()
        if text == self.HEADER:
            self._after_header.add(me)
        elif me in self._after_header:
            self._after_header.discard(me)
            self.watch.log_batch_failed(text)
        else:
            return self.stream.write(text)
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class ApiWatch:
    """Watches the API at `api_url` for the run in `run_dir` while inside `with`; `up` says whether it answers."""

    def __init__(self, api_url: str, run_dir: str | Path, ephemeral: bool = False, interval: float = 1.0,
                 timeout: float = 2.0, misses: int = 2):
        from prefect.settings import get_current_settings

        self.api_url, self.run_dir, self.ephemeral = api_url, Path(run_dir), ephemeral
        self.interval, self.timeout, self.misses = interval, timeout, misses
        self.faults = 0
        self._up = threading.Event()
        self._up.set()
        self._stop = threading.Event()
        self._settings = get_current_settings()  # the object the flow's requests read their retries from
        self._retries = self._settings.client.max_retries
        self._raise = logging.raiseExceptions
        self._filter = _WhileUp(self)
        self._handlers: list[logging.Handler] = []
        self._lock = threading.Lock()  # the watch thread and the log worker's both may find the server gone
        self._refused = False  # said once that the server refused a batch of log lines
        self._gate: _PrefectErrorGate | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="featcal-api-watch")

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def __enter__(self) -> ApiWatch:
        self._handlers = _api_log_handlers()
        for handler in self._handlers:
            handler.addFilter(self._filter)
        if _prefect_internal_level() != "DEBUG":  # at DEBUG Prefect prints a traceback: the user asked to see it
            self._gate = _PrefectErrorGate(sys.stderr, self)
            sys.stderr = self._gate
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + self.interval)
        for handler in self._handlers:
            handler.removeFilter(self._filter)
        if self._gate is not None and sys.stderr is self._gate:
            sys.stderr = self._gate.stream

    def log_batch_failed(self, error: str) -> None:
        """Prefect's log worker could not send a batch of this run's log lines, with `error`: keep its message in
        the run's prefect.log, and ask the server now rather than at the next check."""
        message = error.strip() or "no message"
        path = self.run_dir / PREFECT_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR prefect's log worker: --- Error logging to API "
                      f"--- {message}\n")
        if self.up and self.answers(f"a batch of log lines failed ({message})") and not self._refused:
            self._refused = True
            log.warning("the Prefect server at %s did not take a batch of this run's log lines (%s): the UI misses "
                        "them; they are on this console, and Prefect's message is in %s", ui_url(self.api_url),
                        message, path)

    def answers(self, failed: str) -> bool:
        """Whether the server answers a health check now, asked after a request failed with `failed`: if not, the
        run says so in its one line, as after the watch's own checks."""
        if healthy(ui_url(self.api_url), timeout=self.timeout):
            return True
        self._fault(f"{failed} and a health check got no reply")
        return False

    def _loop(self) -> None:
        failed = 0
        while not self._stop.wait(self.interval):
            if healthy(ui_url(self.api_url), timeout=self.timeout):
                failed = 0
                if not self.up:
                    self._cleared()
            else:
                failed += 1
                if failed == self.misses:
                    self._fault(f"no reply for {self.interval * self.misses:.0f} s")

    def _fault(self, why: str) -> None:
        with self._lock:
            if not self.up:
                return
            self.faults += 1
            self._up.clear()
            unanswered.set()
            logging.raiseExceptions = False  # first: cutting the retries makes the requests in flight fail now
            self._settings.client.max_retries = 0
        log.warning(fault_line(self.api_url, self.run_dir, self.ephemeral, why))

    def _cleared(self) -> None:
        with self._lock:
            self._settings.client.max_retries = self._retries
            logging.raiseExceptions = self._raise
            self._up.set()
            unanswered.clear()
        log.warning("the Prefect server at %s answers again: the UI gets this run's progress from here on; what it "
                    "missed meanwhile reaches it when you rerun the same command after the run", ui_url(self.api_url))


def fault_line(api_url: str, run_dir: Path, ephemeral: bool, why: str) -> str:
    """The one line a run logs when its server stops answering (`why`: how the watch found out)."""
    what = "Prefect's temporary server" if ephemeral else "the Prefect server"
    later = ("" if ephemeral else "; once the server is back, rerun the same command to report the run to it "
             "(every finished stage comes from the cache)")
    return (f"{what} at {ui_url(api_url)} stopped answering ({why}); the run goes on without "
            f"it at full speed: its records are in {run_dir} (manifest.json, records/), Prefect's own messages "
            f"in {run_dir / PREFECT_LOG}{later}")


PREFECT_LOG = Path("logs") / "prefect.log"


def _prefect_internal_level() -> str:
    from prefect.settings import PREFECT_LOGGING_INTERNAL_LEVEL

    return str(PREFECT_LOGGING_INTERNAL_LEVEL.value()).upper()


def run_api_url() -> tuple[str, bool]:
    """(the API this process's flow runs report to, whether it is Prefect's ephemeral server). The ephemeral
    server is a singleton that the running flow has started already, so asking for it starts nothing."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    api: Any = PREFECT_API_URL.value()
    if api:
        return str(api), False
    server = SubprocessASGIServer()
    server.start()
    return server.api_url, True
