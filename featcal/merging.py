"""Merging task experts one tensor at a time, so memory holds one tensor per pass, never all experts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from featcal.config import MergeConfig

ExpertTensors = Callable[[], Iterator[torch.Tensor]]  # yields expert t's copy of one tensor, t in task order


def trimmed(task_vector: torch.Tensor, top_k: float) -> torch.Tensor:
    """TIES trim: keep the top-k fraction of entries by magnitude (within this tensor), zero the rest."""
    flat = task_vector.reshape(-1)
    keep = max(1, round(top_k * flat.numel()))
    if keep >= flat.numel():
        return task_vector
    threshold = flat.abs().kthvalue(flat.numel() - keep + 1).values
    return torch.where(task_vector.abs() >= threshold, task_vector, torch.zeros_like(task_vector))


def merged_tensor(base: torch.Tensor, experts: ExpertTensors, cfg: MergeConfig) -> torch.Tensor:
    if not base.is_floating_point():
        return base
    theta0 = base.double()
    if cfg.method in ("task_arithmetic", "average"):
        total, count = torch.zeros_like(theta0), 0
        for theta_t in experts():
            total += theta_t.double() - theta0
            count += 1
        scale = 1.0 / count if cfg.method == "average" else cfg.scaling
        return (theta0 + scale * total).to(base.dtype)
    # TIES: pass 1 elects a sign per entry from the trimmed task vectors' total mass.
    mass = torch.zeros_like(theta0)
    for theta_t in experts():
        mass += trimmed(theta_t.double() - theta0, cfg.ties_top_k)
    sign = torch.sign(mass)
    # Pass 2: disjoint merge of the entries that agree with the elected sign.
    agreed, count = torch.zeros_like(theta0), torch.zeros_like(theta0)
    for theta_t in experts():
        tau = trimmed(theta_t.double() - theta0, cfg.ties_top_k)
        agree = (torch.sign(tau) == sign) & (tau != 0)
        agreed += torch.where(agree, tau, 0.0)
        count += agree.double()
    if cfg.ties_merge == "mean":
        agreed = agreed / count.clamp_min(1.0)
    return (theta0 + cfg.scaling * agreed).to(base.dtype)
