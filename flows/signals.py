"""Stopping a run on Ctrl-C or SIGTERM: within seconds, its finished stages kept, no process left behind.

A signal becomes `Stopped` in the main thread, which unwinds the stage in progress (its atomic writes leave
nothing half-written) and Prefect's flow and task runs (they end up Crashed). The clean way out can hang
— a Ctrl-C reaches the whole process group, so Prefect's temporary server may be gone while the client
retries it — so a watchdog ends every child process and exits hard once `GRACE_SECONDS` have passed:
as safe as `kill -9`, which resume is built for. A second signal takes that hard exit at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import psutil

GRACE_SECONDS = 6.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal. A BaseException, so that no `except Exception` in a stage or in Prefect swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _Where:
    """What the run is doing, for the line printed when it stops."""

    started: bool = False
    stage: str | None = None
    done: int = 0
    total: int | None = None  # None where the caller does not count its stages (the benchmark flows)
    stopping: int | None = None  # the signal being handled, once one arrived


where = _Where()


def at_stage(label: str | None, done: int = 0, total: int | None = None) -> None:
    """Called before each stage (label) and after it or the last one (None); the pipeline adds its counts."""
    where.started, where.stage, where.done, where.total = True, label, done, total


def stopped_line(signum: int) -> str:
    name = signal.Signals(signum).name
    counts = f"{where.done} of {where.total} done" if where.total is not None else ""
    if not where.started:
        place = "before any stage started"
    elif where.stage is None:
        place = "between stages" + (f", {counts}" if counts else "")
    else:
        place = f"during stage '{where.stage}'" + (f" ({counts})" if counts else "")
    return (f"featcal: stopped by {name} {place}; finished stages are kept: "
            "rerun the same command to resume")


def end_children(timeout: float = 2.0) -> None:
    """SIGTERM every descendant process (Prefect's temporary server, Dask workers, method runs), then SIGKILL
    those still there after `timeout` seconds."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


_exiting = threading.Lock()


def exit_stopped(signum: int, forced: bool = False) -> NoReturn:
    """Say where the run stopped, send what Prefect still buffers, end every child process, and exit now.

    Not through Python's own exit: Prefect's exit hooks retry a server that the same Ctrl-C may have stopped,
    for more than a minute. Called by the CLI once the stop has unwound, or by the watchdog (`forced`)."""
    if not _exiting.acquire(blocking=False):
        while True:  # the other path is exiting the process already
            time.sleep(1)
    print(stopped_line(signum) + (f" (forced after {GRACE_SECONDS:.0f} s)" if forced else ""),
          file=sys.stderr, flush=True)
    if not forced:
        drain_prefect()
    exit_now(128 + signum, timeout=1.0 if forced else 2.0)  # the shell's convention: 130 SIGINT, 143 SIGTERM


def exit_now(code: int, timeout: float = 2.0) -> NoReturn:
    """End every child process and exit with `code`, without Python's exit hooks: Prefect's send what it still
    buffers, and to a server that is gone that is one request of several seconds per event, for minutes."""
    end_children(timeout=timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watchdog(signum: int, grace: float) -> None:
    time.sleep(grace)
    exit_stopped(signum, forced=True)


def _handler(signum: int, _frame: object) -> None:
    if where.stopping is not None:
        exit_stopped(signum, forced=True)  # a second signal: no more waiting
    where.stopping = signum
    print(f"featcal: {signal.Signals(signum).name} received, stopping (a second one forces it) ...",
          file=sys.stderr, flush=True)
    threading.Thread(target=_watchdog, args=(signum, GRACE_SECONDS), daemon=True,
                     name="featcal-stop-watchdog").start()
    raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise `Stopped` (main thread only; elsewhere this does nothing).

    Nested uses are fine: Prefect installs its own SIGTERM handler while a flow runs, so the pipeline
    enters this again inside the flow to take SIGTERM back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def drain_prefect(timeout: float = 2.0) -> None:
    """Send the log lines and events Prefect still buffers (the flow's "Crashed" among them) while its server
    may still answer; give up after `timeout` seconds each."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout)
        except Exception:  # noqa: BLE001 - nothing started, or the server is gone: nothing more to send
            pass
