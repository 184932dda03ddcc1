"""featcal.head_refit: each task's own linear head refitted, without labels, to the calibrated body's features.

The shared body must compromise between tasks, and a task's head still reads the compromised features as its expert's
head did. On the task's calibration rows, with X the features the head reads from the calibrated model and Z the
expert's logits on the same rows, the head (W, b) is refitted in closed form, in float64:

    (W, b) = argmin ‖X̃Θᵀ − Z‖²/(n·n_c) + λ‖W − W_e‖²,   Θ = [W, b], x̃ = [x, 1],

with n the rows, n_c = ‖X̃ᵀX̃/n‖_F (so λ is relative to the features' scale, as the body's λ is to ‖C_ss‖_F) and
(W_e, b_e) the expert's head; the bias is not pulled (a head without a bias, CLIP's zero-shot class embeddings,
drops the column of ones). λ is chosen from a grid on held-out examples, as the body's `auto` (docs/design.md §2.8).
Derivation and tests: docs/design.md §2.11, tests/test_head_refit.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadFit:
    """A refitted head: W [classes, features], b [classes] (None: the head has none), the λ used, and the held-out
    score of every grid λ (summed over the folds; empty when no choice was made)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lam: float
    scores: tuple[float, ...] = ()


def _augmented(x: torch.Tensor, bias: bool) -> torch.Tensor:
    x = x.double()
    return torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64, device=x.device)], 1) if bias else x


def solve_head(x: torch.Tensor, z: torch.Tensor, w_e: torch.Tensor, b_e: torch.Tensor | None,
               lam: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W, b) minimising the objective above on rows x [n, d] with targets z [n, c], for one λ > 0: the normal
    equations (X̃ᵀX̃/(n·n_c) + λP)Θᵀ = X̃ᵀZ/(n·n_c) + λPΘ_eᵀ, P = diag(1, …, 1, 0), by Cholesky. λP makes the
    system definite for every n ≥ 1: a direction with no weight part reads the ones column, seen by every row."""
    bias = b_e is not None
    xa, zd = _augmented(x, bias), z.double()
    n, d = xa.shape[0], w_e.shape[1]
    gram = xa.T @ xa / n
    scale = float(torch.linalg.matrix_norm(gram)) or 1.0
    lhs = gram / scale
    lhs.diagonal()[:d] += lam
    rhs = xa.T @ zd / (n * scale)
    rhs[:d] += lam * w_e.double().T
    theta = torch.cholesky_solve(rhs, torch.linalg.cholesky(lhs)).T
    return theta[:, :d].contiguous(), (theta[:, d].contiguous() if bias else None)


def held_out_folds(examples: Sequence[int], every: int, folds: int) -> list[torch.Tensor]:
    """Per fold k, a boolean mask over the rows: those of examples i with i mod `every` = every − 1 − k (the body's
    folds: tasks/gram.py). `examples` gives each row's example index (views share their example's)."""
    index = torch.as_tensor(list(examples))
    return [(index % every) == every - 1 - k for k in range(folds)]


def refit_head(x: torch.Tensor, z: torch.Tensor, w_e: torch.Tensor, b_e: torch.Tensor | None,
               lams: Sequence[float], held: Sequence[torch.Tensor]) -> HeadFit:
    """The head refitted on every row at the grid λ whose fit on the other rows predicts the held-out rows' expert
    logits best (squared error summed over the folds `held`; ties to the first λ). One λ, or a fold that leaves no
    row on either side, makes no choice: the first λ then, or the largest (the strongest pull towards the expert's
    head) when a fold is empty."""
    if len(lams) > 1 and held and all(0 < int(h.sum()) < len(h) for h in held):
        totals = [0.0] * len(lams)
        for h in held:
            fit_x, fit_z, held_x, held_z = x[~h], z[~h], _augmented(x[h], b_e is not None), z[h].double()
            for i, lam in enumerate(lams):
                w, b = solve_head(fit_x, fit_z, w_e, b_e, lam)
                theta = w if b is None else torch.cat([w, b[:, None]], 1)
                totals[i] += float(((held_x @ theta.T - held_z) ** 2).sum())
        lam = float(lams[min(range(len(lams)), key=totals.__getitem__)])
        scores = tuple(totals)
    else:
        lam, scores = float(lams[0] if len(lams) == 1 else max(lams)), ()
    w, b = solve_head(x, z, w_e, b_e, lam)
    return HeadFit(weight=w, bias=b, lam=lam, scores=scores)
