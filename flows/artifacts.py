"""What a run shows in the Prefect UI while it runs: a progress bar, a small table per block, and at the end the
report, the accuracy table and links to the run directory. Fed by the pipeline's `on_stage` hook, in the flow's
process, and published from a thread of its own, so that no stage waits on the server: while it does not answer
(`reachable`, flows/api_watch.py) nothing is sent, and what piled up goes with the next stage after it is back. A
failure to publish is logged once, never fatal to the run."""

from __future__ import annotations

import contextvars
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from featcal.calibration_methods import calibration_method
from featcal.config import FeatCalConfig
from featcal.secrets import scrub
from flows.pipeline import StageCall, solve_stage, stage_count
from storage.rundir import Record
from tasks.context import context

log = logging.getLogger("featcal")

PROGRESS_KEY = "featcal-progress"
REPORT_KEY = "featcal-report"
ACCURACY_KEY = "featcal-accuracy"
RUN_DIR_KEY = "featcal-run-dir"


def block_key(layer: int) -> str:
    return f"featcal-block-{layer:02d}"


def accuracy_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"task": t, **{m: round(100 * a, 2) for m, a in s["accuracy"].items()}} for t, s in report["tasks"].items()]


class LiveArtifacts:
    def __init__(self, run_dir: str | Path, reachable: Callable[[], bool] = lambda: True):
        self.run_dir = Path(run_dir).resolve()
        self.reachable = reachable
        self.started = time.time()
        self.records: dict[str, Record] = {}
        self.fresh: set[str] = set()
        self.published: set[int] = set()
        self.progress_id: Any = None
        self._shape: tuple[list[str], int, int] | None = None
        self._warned = False
        self._last: StageCall | None = None
        self._sending = threading.Lock()  # the publisher and `finish`, one at a time (the stages never take it)
        self._wake = threading.Event()
        self._closing = False
        # The artifact functions find the flow run in the context: the publisher runs in a copy of this one.
        self._context = contextvars.copy_context()
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True, name="featcal-artifacts")

    # ---- the pipeline's hook --------------------------------------------------------------------
    def on_stage(self, call: StageCall, record: Record) -> None:
        self.records[call.stage] = record
        if record.get("finished_at", 0) >= self.started:
            self.fresh.add(call.stage)
        self._last = call
        if not self._publisher.is_alive():
            self._publisher.start()
        self._wake.set()

    def finish(self) -> None:
        """After the pipeline returned: what is still pending, the last block's table, the report, the accuracy
        table, links. Waits for the publisher only while the server answers."""
        self._closing = True
        self._wake.set()
        while self._publisher.is_alive() and self.reachable():
            self._publisher.join(timeout=0.5)
        if not self.reachable():
            return  # the watch has said so; rerunning the command reports the run
        with self._sending:
            _, layers, _ = self.shape
            for layer in range(layers):
                self._safely(self._block, layer)
            self._safely(self._final)

    def _publish_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            if self.reachable():
                self._context.run(self._publish)

    def _publish(self) -> None:
        """The progress bar, and the table of every block whose numbers are all in."""
        with self._sending:
            if (last := self._last) is None:
                return
            self._safely(self._progress, last)
            _, layers, _ = self.shape
            for layer in range(layers - 1):
                self._safely(self._block, layer)

    # ---- pieces ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[list[str], int, int]:
        """(tasks, blocks, stages) of this run; run.yaml exists once the pipeline has called its first stage."""
        if self._shape is None:
            ctx = context(self.run_dir)
            tasks, layers = list(ctx.tasks), ctx.calibrated_blocks  # with the head side, block L
            self._shape = (tasks, layers, stage_count(len(tasks), ctx.num_blocks, ctx.cfg.runtime.solve_groups,
                                                      ctx.cfg.evaluation.enabled, ctx.cfg.featcal.calibrate_head_side))
        return self._shape

    def _safely(self, fn, *args: Any) -> None:  # noqa: ANN001
        try:
            fn(*args)
        except Exception as exc:  # the UI is a view: a hiccup there must not fail a calibration run
            if not self._warned and self.reachable():  # an unreachable server is said once by the watch
                log.warning("could not publish a Prefect artifact (%s: %s); the run goes on", type(exc).__name__, exc)
                self._warned = True

    def _progress(self, call: StageCall) -> None:
        _, _, total = self.shape
        done = len(self.records)
        pct = round(min(100.0, 100.0 * done / total), 1)
        cached = done - len(self.fresh)
        description = f"{done}/{total} stages ({cached} from cache); last: {call.label}"
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(pct, key=PROGRESS_KEY, description=description)
        else:
            update_progress_artifact(self.progress_id, pct, description=description)

    def _block(self, layer: int) -> None:
        tasks, layers, _ = self.shape
        if layer in self.published:
            return
        grams = self._all([f"gram/l{layer:02d}/{t}" for t in tasks])
        groups = context(self.run_dir).solve_group_count(layer)
        solve_stages = [solve_stage(layer, g, groups) for g in range(groups)]
        solves = self._all(solve_stages)
        last = layer == layers - 1
        after_grams = self._all([f"gram/l{layer + 1:02d}/{t}" for t in tasks]) if not last else []
        if solves is None or grams is None or after_grams is None:
            return
        props = [self.records.get(f"propagate/l{layer:02d}/{t}") for t in tasks] if not last else [None] * len(tasks)
        report = self._report() if last else None
        eps = context(self.run_dir).cfg.featcal.eps
        grown = {m: d for rec in solves for m, d in rec["info"].get("damping_grown", {}).items()}
        damping = f"{eps:g}" if not grown else f"up to {max(grown.values()):g} ({len(grown)} grown from {eps:g})"
        rows = []
        for i, t in enumerate(tasks):
            if not last:
                after = _fmt(after_grams[i]["info"].get("drift_in"))
            elif report is not None and len(report["tasks"][t].get("drift", {}).get("calibrated") or ()) > layer + 1:
                after = _fmt(report["tasks"][t]["drift"]["calibrated"][layer + 1]) + " (eval, all tokens)"
                head = report["tasks"][t].get("last_boundary_drift", {}).get("calibrated", {}).get("head_token")
                if head is not None and (report.get("drift_definition") or {}).get("head_token_index") is not None:
                    after += f"; {_fmt(head)} (eval, head token)"
            else:
                after = "n/a"
            prop = props[i]
            seconds = grams[i]["seconds"] + (prop["seconds"] if prop is not None else 0.0)
            rows.append({"task": t, "modules solved": "", "damping used": "", "λ, ρ": "",
                         "drift before": _fmt(grams[i]["info"].get("drift_out_uncalibrated")), "drift after": after,
                         "seconds": round(seconds, 2)})
        rows.append({"task": "(solve, all tasks)",
                     "modules solved": sum(rec["info"].get("modules", 0) for rec in solves),
                     "damping used": damping, "λ, ρ": _hyper(solves, context(self.run_dir).cfg.featcal),
                     "drift before": "", "drift after": "",
                     "seconds": round(sum(rec["seconds"] for rec in solves), 2)})
        stages = [f"gram/l{layer:02d}/{t}" for t in tasks] + solve_stages
        stages += [f"propagate/l{layer:02d}/{t}" for t in tasks] if not last else []
        cached = sum(s not in self.fresh for s in stages)
        create_table_artifact(
            rows, key=block_key(layer),
            description=(f"block {layer:02d}: output drift ‖S−E‖/‖E‖ over all real tokens (lower is better) per task "
                         f"with the merged block (before) and the calibrated block (after), on the calibration data"
                         + (" (last block: after = evaluation data, all tokens and, where the head reads one token, "
                            "that head token; the head-token figure is the one the head sees)" if last else "")
                         + f"; seconds = gram + propagate per task, solve (summed over its {groups} group(s)); "
                           f"{cached} of {len(stages)} stages cached"))
        self.published.add(layer)

    def _all(self, stages: list[str]) -> list[Record] | None:
        """The records of `stages`, or None while any is missing."""
        found = [self.records.get(stage) for stage in stages]
        return [rec for rec in found if rec is not None] if None not in found else None

    def _report(self) -> dict[str, Any] | None:
        path = self.run_dir / "report.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _final(self) -> None:
        if self.progress_id is not None:
            _, _, total = self.shape
            update_progress_artifact(self.progress_id, 100.0,
                                     description=f"{total}/{total} stages ({total - len(self.fresh)} from cache); done")
        report_md = self.run_dir / "report.md"
        if report_md.is_file():
            # Whatever a report quotes, a credential this process knows is shown as its placeholder.
            create_markdown_artifact(scrub(report_md.read_text()), key=REPORT_KEY, description=str(self.run_dir))
        report = self._report()
        if report is not None:
            rows = accuracy_rows(report)
            if any(len(r) > 1 for r in rows):
                create_table_artifact(rows, key=ACCURACY_KEY, description="accuracy (%) per task and model")
        links = [("run directory", self.run_dir), ("calibrated checkpoint", self.run_dir / "calibrated"),
                 ("report", report_md), ("manifest", self.run_dir / "manifest.json")]
        md = "\n".join(f"- {name}: [`{path}`]({path.as_uri()})" for name, path in links if path.exists())
        create_markdown_artifact(scrub(md), key=RUN_DIR_KEY, description=f"where this run's files are ({self.run_dir})")


def _hyper(solves: list[Record], fc: FeatCalConfig) -> str:
    """The λ and ρ a block's solves used: the fixed values, or the range and median of the per-module choices."""
    def spread(key: str, fixed: Any) -> str:
        chosen = [v for rec in solves for v in rec["info"].get(key, {}).values()]
        if not chosen:
            return str(fixed)
        return f"{statistics.median(chosen):g} (auto, {min(chosen):g}–{max(chosen):g})"

    reads = calibration_method(fc).keys
    return f"{spread('lambda', fc.lam)}, {spread('rho', fc.rho)}" if {"lambda", "rho"} <= set(reads) else ""


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
