"""Table rows for the "no task left behind" summaries (issue 33 §1): each task's validation head check next to its
test accuracy, against task arithmetic and paired with a reference run (benchmarks/protect_rounds.py,
benchmarks/head_metric_minilm8.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from featcal_bench.paired import compared, p_text
from featcal_bench.protect import flagged
from featcal_bench.report import correct_rows

BAR = 1.0  # points below task arithmetic that the goal allows a task


def check_cells(check: dict[str, Any], tasks: Sequence[str]) -> list[str]:
    """Per task, agreement with the expert on the validation rows, merge → calibrated (%), ⚑ where it fell."""
    cells = []
    for t in tasks:
        e = check["tasks"][t]
        mark = " ⚑" if t in flagged(check) else ""
        cells.append(f"{100 * e['merged']['agreement']:.1f} → {100 * e['calibrated']['agreement']:.1f}{mark}")
    return cells


def accuracy_cells(result: dict[str, Any], merge: Mapping[str, float], tasks: Sequence[str],
                   reference: dict[str, Any] | None) -> list[str]:
    """Per task, test accuracy (change against the merge's), then the average, the tasks more than BAR points below
    the merge, and the paired difference against `reference` (blank without one)."""
    acc = {t: 100 * result["accuracy"][t]["calibrated"] for t in tasks}
    below = [f"{t} {acc[t] - merge[t]:+.1f}" for t in tasks if acc[t] - merge[t] < -BAR]
    paired = ""
    if reference is not None:
        ours = correct_rows(result, "calibrated", list(tasks))
        theirs = correct_rows(reference, "calibrated", list(tasks))
        if ours is None or theirs is None:
            raise ValueError("left_behind: a run without per-example predictions cannot be paired; rerun it")
        c = compared(ours, theirs, tasks)
        lo, hi = c["ci"]
        paired = f"{100 * c['difference']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}], {p_text(c['p_value'])}"
    return [*(f"{acc[t]:.1f} ({acc[t] - merge[t]:+.1f})" for t in tasks), f"{sum(acc.values()) / len(tasks):.2f}",
            ", ".join(below) or "—", paired]
