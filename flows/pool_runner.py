"""Running a block's independent stages at once in a pool of worker processes on this machine, without Dask.

`featcal run --runner pool --workers N`: every stage runs in one of N processes started with "spawn" (a fresh
interpreter: no copy of this process's threads, locks or Prefect client), each calling `direct_runner`: stages
rebuild what they need from the run directory (tasks/context.py). The pipeline submits only independent stages
together (the prepares, a block's Grams, its propagations) and collects their records in call order, so every
reduction keeps its fixed order: the weights are bit-identical to a one-process run with the same number of
torch threads per stage.

Each worker uses `threads` torch threads, by default the cores divided among the workers, so the pool does not
oversubscribe them; `runtime.threads`, when the config sets it, wins, as every stage applies it.

Stopping: workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; this process decides), and
leaving the pool on an error or a stop kills them at once; a killed stage leaves nothing half-written (atomic
writes) and a rerun does it again. A worker that dies (killed, out of memory) ends the run with `WorkerDied`:
one line naming the worker, how it ended and the stage that did not finish.
"""

from __future__ import annotations

import copyreg
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

from flows.pipeline import StageCall, direct_runner
from storage.rundir import MissingOutput, Record


class WorkerDied(RuntimeError):
    """A pool worker ended while stages were running; the message names it, how it ended, and what to do."""


def _rebuild_missing(exc: MissingOutput) -> tuple[type[MissingOutput], tuple[list[str], list[str]]]:
    return MissingOutput, (exc.producers, exc.paths)


# A stage's MissingOutput must reach the pipeline, which rewinds to the producers it names. Its arguments are not
# its message, so default pickling cannot rebuild it: the pool would report itself broken instead.
copyreg.pickle(MissingOutput, _rebuild_missing)


def _start_worker(threads: int, known_secrets: dict[str, Any]) -> None:
    """In each worker, once: Ctrl-C is for the parent, torch gets its share of the cores, the run's secrets are
    known (in memory, as the parent knows them), and stage logs reach the terminal as they would in one process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from featcal import secrets
    from flows.console import setup_logging

    torch.set_num_threads(threads)
    secrets.remember(known_secrets)
    setup_logging()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"killed by {name}" + (" (out of memory?)" if exitcode == -signal.SIGKILL else "")
    return f"exited with code {exitcode}"


class _Pending:
    """A submitted stage: `.result()` is its record, or a one-line `WorkerDied` if its worker went away."""

    def __init__(self, pool: StagePool, call: StageCall, future: Future):
        self.pool, self.call, self.future = pool, call, future

    def result(self) -> Record:
        try:
            return self.future.result()
        except BrokenProcessPool:
            raise self.pool.died(self.call) from None


class StagePool:
    """A Runner (call it) and a Submitter (`submit`) over a process pool, for `run_pipeline`."""

    def __init__(self, executor: ProcessPoolExecutor, workers: int, threads: int):
        self.executor, self.workers, self.threads = executor, workers, threads
        # The executor's own {pid: process}, filled as workers start: Python 3.11 has no public way to stop them.
        self._processes: Mapping[int, BaseProcess] = executor._processes

    def submit(self, run_dir: str, call: StageCall, done: Record | None) -> _Pending:
        if done is not None:  # verified already: nothing to send to a worker
            future: Future = Future()
            future.set_result(done)
        else:
            try:
                future = self.executor.submit(direct_runner, run_dir, call, None)
            except BrokenProcessPool:  # a worker died while the pool was idle
                raise self.died(call) from None
        return _Pending(self, call, future)

    def __call__(self, run_dir: str, call: StageCall, done: Record | None) -> Record:
        return self.submit(run_dir, call, done).result()

    def died(self, call: StageCall) -> WorkerDied:
        """Which worker ended, how, and the stage it cost. Once one dies the executor SIGTERMs the others: the odd
        one out is the first to go."""
        processes = list(self._processes.values())
        # A broken pool ends every worker; wait (briefly) for every exit code, so the one that died first is known, not
        # guessed from whichever the executor's SIGTERM reached. The executor's own thread reaps them too, and a join
        # that loses that race reads no exit code yet (waitpid: ECHILD): ask again until each has one.
        deadline = time.monotonic() + 3.0
        while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
            for p in processes:
                p.join(0.05)
        ended = {p.pid: p.exitcode for p in processes if p.exitcode}
        pid = next((pid for pid, code in ended.items() if code != -signal.SIGTERM), next(iter(ended), None))
        who = "a pool worker process died" if pid is None else f"pool worker pid {pid} {_how(ended[pid])}"
        return WorkerDied(f"{who}, so stage '{call.label}' did not finish; rerun the same command to resume: "
                          "finished stages are kept")

    def kill(self) -> None:
        for process in list(self._processes.values()):
            process.kill()


@contextmanager
def _sigint_ignored_by_new_processes() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction: an ignored signal stays ignored across
    exec, and Python then installs no KeyboardInterrupt handler. The workers' initializer ignores it too, but only
    after their imports: a Ctrl-C to the group during those printed a worker's traceback (seen in CI). Here, in
    the main thread only (signal handlers can be set nowhere else), this process ignores it for those few ms."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def stage_pool(workers: int | None = None, threads: int | None = None,
               known_secrets: dict[str, Any] | None = None) -> Iterator[StagePool]:
    """A pool of `workers` processes (default: one per core) with `threads` torch threads each (default: the
    cores divided among them); `known_secrets` ({placeholder: value}) are given to every worker. Leaving it on an
    error or a stop kills the workers; leaving it normally waits for them to exit."""
    cores = os.cpu_count() or 1
    workers = cores if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"--worker-threads must be at least 1, got {threads}")
    threads = threads or max(1, cores // workers)
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(threads, dict(known_secrets or {})))
    # The executor starts a worker per submit that finds none idle: `workers` empty calls now start them all at
    # once, importing torch while the merge runs, instead of the second only when a block's stages arrive.
    with _sigint_ignored_by_new_processes():
        for _ in range(workers):
            executor.submit(os.getpid)
    pool = StagePool(executor, workers, threads)
    try:
        yield pool
    except BaseException:
        pool.kill()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
