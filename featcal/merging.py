"""Merging task experts one tensor at a time, so memory holds one tensor per pass, never all experts."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import numpy as np
import torch

from featcal.config import MergeConfig

ExpertTensors = Callable[[], Iterator[torch.Tensor]]  # yields expert t's copy of one tensor, t in task order
RowReader = Callable[[int, int], torch.Tensor]  # rows [start, stop) of one tensor (along its first dimension)
ExpertRows = Callable[[int, int], Iterator[torch.Tensor]]  # yields expert t's rows [start, stop), t in task order
CHUNK_ELEMENTS = 1 << 22  # entries per row chunk: 32 MiB per float64 copy


SIGN_ELECTED = ("ties", "dare_ties")  # methods that keep, per entry, only the task vectors of the elected sign
DARE = ("dare_linear", "dare_ties")
KeptEntries = Callable[[int], torch.Tensor]  # expert t's DARE keep mask (bool, flat) of the entries being merged
DropMasks = Callable[[int, int, int], torch.Tensor]  # expert t's DARE keep mask of rows [start, stop) of one tensor


def trimmed(task_vector: torch.Tensor, top_k: float) -> torch.Tensor:
    """TIES trim as MergeKit's `sparsify.magnitude` does it: keep exactly int(top_k·n) entries of this tensor, those of
    largest magnitude, and zero the rest. Among entries of equal magnitude at the cut the one with the lower flat
    index is kept (what a stable sort on |τ| descending would keep), so the result never depends on the sort."""
    flat = task_vector.reshape(-1)
    n = flat.numel()
    keep = int(top_k * n)  # MergeKit's count, float product and truncation included
    if keep >= n:
        return task_vector
    magnitude = flat.abs()
    if keep == 0:
        return torch.zeros_like(task_vector)
    threshold = magnitude.kthvalue(n - keep + 1).values  # the keep-th largest magnitude
    above, at = magnitude > threshold, magnitude == threshold
    kept = above | (at & (torch.cumsum(at, 0) <= keep - int(above.sum())))
    return torch.where(kept.view_as(task_vector), task_vector, torch.zeros_like(task_vector))


def drop_key(seed: int, task: str, name: str) -> np.ndarray:
    """The 128-bit Philox key of one expert's copy of one tensor: its drop mask depends on nothing else."""
    digest = hashlib.sha256(json.dumps([seed, task, name]).encode()).digest()
    return np.frombuffer(digest[:16], dtype="<u8").copy()


def dare_kept(seed: int, density: float, task: str, name: str, first: int, count: int) -> torch.Tensor:
    """DARE's keep mask of flat entries [first, first + count) of tensor `name` of expert `task`: entry i is kept
    when the i-th uniform of a Philox stream keyed by (seed, task, name) is below `density` (a Bernoulli draw, as
    MergeKit's and PEFT's DARE). Philox is counter-based (4 draws per counter value), so any range of entries is
    drawn directly: a block of rows gets the same mask as the whole tensor, on any platform."""
    block = first // 4
    raw = np.random.Philox(key=drop_key(seed, task, name), counter=block).random_raw(first + count - 4 * block)
    top = np.right_shift(raw[first - 4 * block:], np.uint64(11))  # u = top·2⁻⁵³, 53 random bits in [0, 1)
    return torch.from_numpy(top < np.uint64(math.ceil(density * 2.0**53)))  # u < density, in exact integers


def dropped(task_vector: torch.Tensor, kept: torch.Tensor, density: float) -> torch.Tensor:
    """DARE's drop and rescale: the kept entries divided by the density, so its expectation is the task vector."""
    return torch.where(kept.view(task_vector.shape), task_vector / density, torch.zeros_like(task_vector))


def merged_tensor(base: torch.Tensor, experts: ExpertTensors, cfg: MergeConfig,
                  kept: KeptEntries | None = None) -> torch.Tensor:
    """θ0 + the merged task vector of one tensor (or of a block of its rows); `kept` gives DARE's keep masks."""
    if not base.is_floating_point():
        return base
    if cfg.method in DARE and kept is None:
        raise ValueError(f"merge.method {cfg.method} needs the drop masks of the tensor (kept)")
    theta0 = base.double()
    masks: dict[int, torch.Tensor] = {}  # DARE-TIES reads each mask twice: drawn once, 1 byte per entry per expert

    def task_vectors() -> Iterator[torch.Tensor]:
        for t, theta_t in enumerate(experts()):
            tau = theta_t.double() - theta0
            if cfg.method == "ties":
                yield trimmed(tau, cfg.ties_top_k)
            elif cfg.method in DARE:
                assert kept is not None  # refused above when missing
                if t not in masks:
                    masks[t] = kept(t)
                yield dropped(tau, masks[t], cfg.density)
            else:
                yield tau

    if cfg.method not in SIGN_ELECTED:
        total, count = torch.zeros_like(theta0), 0
        for tau in task_vectors():
            total += tau
            count += 1
        scale = 1.0 / count if cfg.method == "average" else cfg.scaling
        return (theta0 + scale * total).to(base.dtype)
    # Pass 1 elects a sign per entry from the (trimmed or dropped) task vectors' total mass; as MergeKit's `sum`
    # consensus, a total of exactly 0 elects +.
    mass = torch.zeros_like(theta0)
    for tau in task_vectors():
        mass += tau
    elected = torch.where(mass >= 0, 1.0, -1.0).to(theta0.dtype)
    del mass
    # Pass 2: disjoint merge of the entries whose sign is the elected one (a zero entry has none).
    agreed, agreeing = torch.zeros_like(theta0), torch.zeros_like(theta0)
    for tau in task_vectors():
        agree = torch.sign(tau) == elected
        agreed += torch.where(agree, tau, 0.0)
        agreeing += agree.double()
    if cfg.ties_merge == "mean":
        agreed = agreed / agreeing.clamp_min(1.0)
    return (theta0 + cfg.scaling * agreed).to(base.dtype)


def drop_masks(cfg: MergeConfig, tasks: Sequence[str], name: str, shape: tuple[int, ...]) -> DropMasks:
    """DARE's keep masks of tensor `name` by rows, expert t being `tasks[t]` (a 0-d tensor is one row of one)."""
    row = math.prod(shape[1:])
    return lambda t, start, stop: dare_kept(cfg.seed, cfg.density, tasks[t], name, start * row, (stop - start) * row)


def whole_tensor_rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def chunk_rows(shape: tuple[int, ...], cfg: MergeConfig, max_elements: int = CHUNK_ELEMENTS) -> int | None:
    """Rows per chunk for merging a tensor of `shape` a block of rows at a time, or None to merge it whole: a small
    tensor, or TIES (its trim threshold is a quantile of the whole tensor). Every other method is elementwise (DARE's
    masks are drawn per entry, `dare_kept`), so merging by rows gives the whole tensor's values bit for bit."""
    if cfg.method == "ties" or len(shape) < 2 or shape[0] < 2:
        return None
    numel = math.prod(shape)
    if numel <= max_elements:
        return None
    return max(1, max_elements // (numel // shape[0]))


def _chunk_masks(masks: DropMasks, start: int, stop: int) -> Callable[[int], torch.Tensor]:
    """Expert t's keep mask of rows [start, stop) alone: what `merged_tensor` asks of one chunk."""
    return lambda t: masks(t, start, stop)


def merged_rows(shape: tuple[int, ...], dtype: torch.dtype, base: RowReader, experts: ExpertRows, cfg: MergeConfig,
                rows: int, masks: DropMasks | None = None) -> torch.Tensor:
    """`merged_tensor` of a tensor `rows` rows at a time: memory holds the result, one chunk of the base and of one
    expert, and the chunk's float64 sums, instead of float64 copies of the whole tensor (the 128256 × 3072 embedding
    of a Llama-3.2-3B is 3 GiB in float64)."""
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        kept = None if masks is None else _chunk_masks(masks, start, stop)
        out[start:stop] = merged_tensor(base(start, stop), partial(experts, start, stop), cfg, kept)
    return out
