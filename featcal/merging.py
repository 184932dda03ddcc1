"""Merging task experts one tensor at a time, so memory holds one tensor per pass, never all experts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch

from featcal.config import MergeConfig

ExpertTensors = Callable[[], Iterator[torch.Tensor]]  # yields expert t's copy of one tensor, t in task order
RowReader = Callable[[int, int], torch.Tensor]  # rows [start, stop) of one tensor (along its first dimension)
ExpertRows = Callable[[int, int], Iterator[torch.Tensor]]  # yields expert t's rows [start, stop), t in task order
CHUNK_ELEMENTS = 1 << 22  # entries per row chunk: 32 MiB per float64 copy


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


def chunk_rows(shape: tuple[int, ...], cfg: MergeConfig, max_elements: int = CHUNK_ELEMENTS) -> int | None:
    """Rows per chunk for merging a tensor of `shape` a block of rows at a time, or None to merge it whole: a small
    tensor, or TIES (its trim threshold is a quantile of the whole tensor). Task arithmetic and averaging are
    elementwise, so merging by rows gives the whole tensor's values bit for bit."""
    if cfg.method not in ("task_arithmetic", "average") or len(shape) < 2 or shape[0] < 2:
        return None
    numel = 1
    for d in shape:
        numel *= d
    if numel <= max_elements:
        return None
    return max(1, max_elements // (numel // shape[0]))


def merged_rows(shape: tuple[int, ...], dtype: torch.dtype, base: RowReader, experts: ExpertRows, cfg: MergeConfig,
                rows: int) -> torch.Tensor:
    """`merged_tensor` of a tensor `rows` rows at a time: memory holds the result, one chunk of the base and of one
    expert, and the chunk's float64 sums, instead of float64 copies of the whole tensor (the 128256 × 3072 embedding
    of a Llama-3.2-3B is 3 GiB in float64)."""
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        out[start:stop] = merged_tensor(base(start, stop), partial(experts, start, stop), cfg)
    return out
