"""Paired comparisons of two methods scored on the same test rows of several tasks.

Two methods evaluated on the same rows make mostly the same mistakes, so whether one beats the other is a question
about the rows where they disagree, not about two accuracies each with its own error bar. The benchmark weights
every task equally (its score is the task-averaged accuracy), so the bootstrap resamples rows within each task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import binomtest

RESAMPLES = 10_000
SEED = 0


def mcnemar(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict[str, float | int]:
    """Exact McNemar test on per-example correctness (rows of all tasks pooled): only the discordant rows carry
    evidence, and under "equally good" each of them is a fair coin flip between the two methods.

    Returns `only_a_right` (a right, b wrong), `only_b_right` (a wrong, b right) and the two-sided `p_value`
    (1.0 when the two never disagree)."""
    a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct, dtype=bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"paired correctness must be two flat sequences of one length, got shapes {a.shape} and {b.shape}"
        )
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {"only_a_right": only_a, "only_b_right": only_b, "p_value": float(p)}


def paired_bootstrap(a_correct_by_task: Mapping[str, Sequence[bool]], b_correct_by_task: Mapping[str, Sequence[bool]],
                     resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, float | list[float]]:
    """Task-averaged accuracy of a minus that of b (`difference`), with its 95 % percentile interval (`ci`) from a
    paired bootstrap: each resample redraws every task's test rows with replacement, within that task (each task
    keeps its weight) and the same rows for both methods (the pairing is what narrows the interval).

    The draws are reproducible: `numpy.random.default_rng(seed)`, then for each task in `a_correct_by_task`'s order
    one `integers(0, rows, size=(resamples, rows))` matrix of row indices, resample by resample."""
    if a_correct_by_task.keys() != b_correct_by_task.keys() or not a_correct_by_task:
        raise ValueError(f"both methods need the same, non-empty set of tasks: {sorted(a_correct_by_task)} vs "
                         f"{sorted(b_correct_by_task)}")
    rng = np.random.default_rng(seed)
    difference, resampled = 0.0, np.zeros(resamples)
    for task, a_correct in a_correct_by_task.items():
        a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct_by_task[task], dtype=bool)
        if a.shape != b.shape or a.ndim != 1 or not len(a):
            raise ValueError(f"task {task!r}: paired correctness must be two flat, non-empty sequences of one "
                             f"length, got shapes {a.shape} and {b.shape}")
        per_row = a.astype(np.int8) - b.astype(np.int8)  # the mean of the row differences is the accuracy difference
        difference += per_row.mean()
        resampled += per_row[rng.integers(0, len(per_row), size=(resamples, len(per_row)))].mean(axis=1)
    tasks = len(a_correct_by_task)
    low, high = np.percentile(resampled / tasks, [2.5, 97.5])
    return {"difference": float(difference / tasks), "ci": [float(low), float(high)]}


def compared(a: Mapping[str, Sequence[bool]], b: Mapping[str, Sequence[bool]], tasks: Sequence[str]) -> dict[str, Any]:
    """a's task-averaged accuracy minus b's with its paired-bootstrap interval, and McNemar's test on the rows of
    all tasks pooled (`only_a_right`, `only_b_right`, `p_value`)."""
    test = mcnemar([c for t in tasks for c in a[t]], [c for t in tasks for c in b[t]])
    return {**paired_bootstrap(a, b, RESAMPLES, SEED), **test}


def p_text(p: float) -> str:
    """A p-value as the tables print it: three decimals, and `< 0.001` below that."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"
