"""Tasks left worse than their merge, found and given more weight with no labels (issue 33 §1).

A run's head check compares, for each task, its merged and its calibrated model with the task's expert on the task's
validation rows, read through the task's own head (tasks/evaluate.py `head_errors`: KL to the expert's predicted
distribution, and agreement with its top class); labels are not read. Calibration can bring a task's features closer
to its expert's overall and still move them off the directions its head reads: the feature error does not see that,
the head error does. A run with `protect` set to another run raises, in that run's task weights
(`featcal.task_weights`), the weight of every task whose calibrated model agrees with its expert less often than the
merge does, by `RAISE`; the rounds chain by naming the previous round."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from featcal_bench.runs import run_dir
from storage.atomic import read_json, write_json
from tasks.context import context
from tasks.evaluate import head_errors

log = logging.getLogger("featcal")

RAISE = 4.0  # a flagged task's weight is multiplied by this each round
CHECK_SPLIT = "validation"  # rows held out of the experts' training and of calibration


def check_path(bench: Path, name: str, split: str = CHECK_SPLIT, rows: int | None = None) -> Path:
    other = "" if (split, rows) == (CHECK_SPLIT, None) else f".{split}" + (f"{rows}" if rows is not None else "")
    return bench / "results" / f"{name}.check{other}.json"


def head_check(bench: Path, name: str, split: str = CHECK_SPLIT, rows: int | None = None) -> dict[str, Any]:
    """Run `name`'s merged and calibrated models against each expert on the tasks' `split` rows, or a seeded subset
    of `rows` of them (validation: held out of training and calibration; cached next to its results, and a rerun of
    `name` writes newer results and so a newer check)."""
    path, results = check_path(bench, name, split, rows), bench / "results" / f"{name}.json"
    if path.is_file() and path.stat().st_mtime >= results.stat().st_mtime:
        return read_json(path)
    ctx = context(run_dir(bench, name))
    tasks = {}
    for task in ctx.tasks:
        source = ctx.cfg.calibration.data[task].model_copy(update={"split": split})
        tasks[task] = head_errors(ctx, task, source, f"calibration.data.{task} (split {split})", subset=rows)
        log.info("head check · %s · %s: %s", name, task, tasks[task])
    check = {"run": name, "split": split, "rows": rows, "task_weights": dict(ctx.cfg.featcal.task_weights),
             "tasks": tasks}
    write_json(path, check)
    return check


def raised_weights(check: dict[str, Any]) -> dict[str, float]:
    """The checked run's task weights with every task whose calibrated model agrees with its expert's top class on
    fewer rows than the merge does raised by RAISE; the others keep theirs.

    Agreement, not KL: on the 7-task MiniLM-8's validation rows (2026-12-04), λ auto left word_polarity agreeing
    on 87.0 % against the merge's 91.5 % while its KL fell (0.247 → 0.225 nats); accuracy reads the top class."""
    weights = dict(check["task_weights"])
    for task in flagged(check):
        weights[task] = weights.get(task, 1.0) * RAISE
    return weights


def flagged(check: dict[str, Any]) -> list[str]:
    """The tasks a check flags: calibrated agreement with the expert below the merge's."""
    return sorted(t for t, e in check["tasks"].items() if e["calibrated"]["agreement"] < e["merged"]["agreement"])


def settled(checks: list[dict[str, Any]]) -> int:
    """The round the rule keeps, of rounds 0 (unprotected), 1, …: the first whose own check flags no task, else the
    last. Validation rows only, labels unread."""
    return next((k for k, check in enumerate(checks) if not flagged(check)), len(checks) - 1)
