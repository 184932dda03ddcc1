"""Running one stage: skip it when its verified record exists, otherwise run it and record what it wrote."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

from featcal.devices import keep_freed_memory, peak_device_mib, reset_device_peak
from storage.rundir import Record, RunDir
from tasks.context import RunContext, context

StageFn = Callable[..., tuple[list[str], dict[str, Any]]]


def execute(run_dir: str, stage: str, key: str, fn: StageFn, needs: dict[str, str], params: dict[str, Any]) -> Record:
    """A pipeline stage: `fn(ctx, **params)` with the run's context."""
    ctx: RunContext = context(run_dir)
    if ctx.cfg.runtime.keep_freed_memory:
        keep_freed_memory()
    reset_device_peak(ctx.device)

    def work() -> tuple[list[str], dict[str, Any]]:
        outputs, info = fn(ctx, **params)
        info["device"] = str(ctx.device)  # a worker pinned to one GPU, or runtime.device
        if ctx.device.type != "cpu":  # on the CPU, peak RSS says it
            info["peak_device_mib"] = round(peak_device_mib(ctx.device), 1)
        return outputs, info

    return recorded(ctx.run, stage, key, work, needs)


def recorded(run: RunDir, stage: str, key: str, work: Callable[[], tuple[list[str], dict[str, Any]]],
             needs: dict[str, str] | None = None) -> Record:
    """Any directory-backed stage (the pipeline's, the benchmark's): `work()` returns (outputs, info)."""
    done = run.verified(stage, key)
    if done is not None:
        return done
    run.require(needs or {})
    run.event(stage, "start")
    started = time.perf_counter()
    outputs, info = work()
    seconds = time.perf_counter() - started
    record = {
        "stage": stage,
        "key": key,
        "outputs": {rel: run.digest(rel) for rel in outputs},
        "info": info,
        "seconds": round(seconds, 4),
        # The process's peak so far: where it jumps between consecutive records is the stage that set it.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "finished_at": time.time(),
    }
    run.save_record(record)
    run.event(stage, "done", seconds=round(seconds, 4))
    return record
