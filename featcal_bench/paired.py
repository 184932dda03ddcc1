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
Correct = Mapping[str, Sequence[bool]]  # per task, whether each test row was right


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


def _check_pair(a_correct_by_task: Correct, b_correct_by_task: Correct) -> None:
    """Refuse two results that are not on the same tasks and test rows, in one line."""
    if a_correct_by_task.keys() != b_correct_by_task.keys() or not a_correct_by_task:
        raise ValueError(f"both methods need the same, non-empty set of tasks: {sorted(a_correct_by_task)} vs "
                         f"{sorted(b_correct_by_task)}")
    for task, a_correct in a_correct_by_task.items():
        a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct_by_task[task], dtype=bool)
        if a.shape != b.shape or a.ndim != 1 or not len(a):
            raise ValueError(f"task {task!r}: paired correctness must be two flat, non-empty sequences of one "
                             f"length, got shapes {a.shape} and {b.shape}")


def paired_bootstrap(a_correct_by_task: Mapping[str, Sequence[bool]], b_correct_by_task: Mapping[str, Sequence[bool]],
                     resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, float | list[float]]:
    """Task-averaged accuracy of a minus that of b (`difference`), with its 95 % percentile interval (`ci`) from a
    paired bootstrap: each resample redraws every task's test rows with replacement, within that task (each task
    keeps its weight) and the same rows for both methods (the pairing is what narrows the interval).

    The draws are reproducible: `numpy.random.default_rng(seed)`, then for each task in `a_correct_by_task`'s order
    one `integers(0, rows, size=(resamples, rows))` matrix of row indices, resample by resample."""
    _check_pair(a_correct_by_task, b_correct_by_task)
    rng = np.random.default_rng(seed)
    difference, resampled = 0.0, np.zeros(resamples)
    for task, a_correct in a_correct_by_task.items():
        a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct_by_task[task], dtype=bool)
        per_row = a.astype(np.int8) - b.astype(np.int8)  # the mean of the row differences is the accuracy difference
        difference += per_row.mean()
        resampled += per_row[rng.integers(0, len(per_row), size=(resamples, len(per_row)))].mean(axis=1)
    tasks = len(a_correct_by_task)
    low, high = np.percentile(resampled / tasks, [2.5, 97.5])
    return {"difference": float(difference / tasks), "ci": [float(low), float(high)]}


def paired_bootstrap_draws(a_draws: Sequence[Correct], b_draws: Sequence[Correct], resamples: int = RESAMPLES,
                           seed: int = SEED) -> dict[str, float | list[float]]:
    """`paired_bootstrap` over test rows and calibration draws, each method given as its K draws (draw k of both ran
    on the same calibration rows) or as one (a method no draw changes: a merge, the experts). `difference` is the mean
    over draws of the task-averaged accuracy difference; each resample first picks a draw k uniformly, the same k
    for both methods, then redraws every task's rows as `paired_bootstrap` does, so the interval also covers which
    calibration rows were drawn. One draw each: `paired_bootstrap` itself, to the bit.

    The draws: `numpy.random.default_rng(seed)`, then `integers(0, K, size=resamples)` for the draws, then for each
    task in a's order one `integers(0, rows, size=(resamples, rows))` matrix of row indices."""
    k = max(len(a_draws), len(b_draws))
    if k == 1:
        return paired_bootstrap(a_draws[0], b_draws[0], resamples, seed)
    if {len(a_draws), len(b_draws)} - {1, k}:
        raise ValueError(f"paired draws: {len(a_draws)} against {len(b_draws)}; expected as many, or one")
    for i in range(k):
        _check_pair(a_draws[i % len(a_draws)], b_draws[i % len(b_draws)])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, k, size=resamples)
    difference, resampled = 0.0, np.zeros(resamples)
    for task in a_draws[0]:
        per_row = np.stack([np.asarray(a_draws[i % len(a_draws)][task], dtype=np.int8)
                            - np.asarray(b_draws[i % len(b_draws)][task], dtype=np.int8) for i in range(k)])
        difference += per_row.mean()
        rows = per_row.shape[1]
        resampled += per_row[picks[:, None], rng.integers(0, rows, size=(resamples, rows))].mean(axis=1)
    tasks = len(a_draws[0])
    low, high = np.percentile(resampled / tasks, [2.5, 97.5])
    return {"difference": float(difference / tasks), "ci": [float(low), float(high)]}


def covered(a_draws: Sequence[Correct], b_draws: Sequence[Correct]) -> str:
    """What a paired interval covers: the test rows, or the test rows and the calibration draws."""
    k = max(len(a_draws), len(b_draws))
    return "test rows" if k == 1 else f"test rows and {k} calibration draws"


def compared(a: Correct | Sequence[Correct], b: Correct | Sequence[Correct], tasks: Sequence[str]) -> dict[str, Any]:
    """a's task-averaged accuracy minus b's with its paired-bootstrap interval (`covers` says over what), and
    McNemar's test on the rows of all tasks pooled (`only_a_right`, `only_b_right`, `p_value`). a and b are one
    result each, or a list of draws (`paired_bootstrap_draws`); McNemar's test then reads the first draw of each (its
    rows are independent only within one draw)."""
    a_draws = [a] if isinstance(a, Mapping) else list(a)
    b_draws = [b] if isinstance(b, Mapping) else list(b)
    test = mcnemar([c for t in tasks for c in a_draws[0][t]], [c for t in tasks for c in b_draws[0][t]])
    return {**paired_bootstrap_draws(a_draws, b_draws, RESAMPLES, SEED), **test, "covers": covered(a_draws, b_draws)}


def p_text(p: float) -> str:
    """A p-value as the tables print it: three decimals, and `< 0.001` below that."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"
