"""Merging task experts one tensor at a time, so memory holds one tensor per pass, never all experts."""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar, get_args

import numpy as np
import torch

from featcal.config import MergeConfig, check_registration
from featcal.subspace_merges import TaskVectors, iso_c, iso_cts, summed, tsv_m, wudi

ExpertTensors = Callable[[], Iterator[torch.Tensor]]  # yields expert t's copy of one tensor, t in task order
RowReader = Callable[[int, int], torch.Tensor]  # rows [start, stop) of one tensor (along its first dimension)
ExpertRows = Callable[[int, int], Iterator[torch.Tensor]]  # yields expert t's rows [start, stop), t in task order
CHUNK_ELEMENTS = 1 << 22  # entries per row chunk: 32 MiB per float64 copy


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




def drop_masks(cfg: MergeConfig, tasks: Sequence[str], name: str, shape: tuple[int, ...]) -> DropMasks:
    """DARE's keep masks of tensor `name` by rows, expert t being `tasks[t]` (a 0-d tensor is one row of one)."""
    row = math.prod(shape[1:])
    return lambda t, start, stop: dare_kept(cfg.seed, cfg.density, tasks[t], name, start * row, (stop - start) * row)


def whole_tensor_rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def chunk_rows(shape: tuple[int, ...], cfg: MergeConfig, max_elements: int = CHUNK_ELEMENTS) -> int | None:
    """Rows per chunk for merging a tensor of `shape` a block of rows at a time, or None to merge it whole: a small
    tensor, or a method that is not elementwise (TIES' trim threshold is a quantile of the whole tensor; the
    singular-vector merges and WUDI read whole matrices). For an elementwise method (DARE's masks are drawn per
    entry, `dare_kept`) merging by rows gives the whole tensor's values bit for bit."""
    if not method_class(cfg).elementwise or len(shape) < 2 or shape[0] < 2:
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


class MergeMethod(ABC):
    """One `merge.method`: `keys` are the `merge.*` keys it reads (it is handed those and no others, so a key it does
    not declare cannot change its merge). `elementwise`: an entry's merged value reads only that entry of each
    expert, so a large tensor may be merged by blocks of rows (`chunk_rows`) with the whole tensor's values;
    `draws_masks`: it takes DARE's keep masks (`kept`)."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]]
    elementwise: ClassVar[bool]
    draws_masks: ClassVar[bool] = False

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = settings

    @abstractmethod
    def merged(self, theta0: torch.Tensor, experts: ExpertTensors, kept: KeptEntries | None) -> torch.Tensor:
        """θ_m in float64 of one floating tensor (or block of its rows), θ0 its float64 base."""


METHODS: dict[str, type[MergeMethod]] = {}
CONFIG_METHODS: tuple[str, ...] = get_args(MergeConfig.model_fields["method"].annotation)
MADE_ELSEWHERE = "given"  # a merge.method that reads a checkpoint (tasks/merge.py) instead of merging here
CONFIG_KEYS = frozenset(MergeConfig.model_fields) - {"method", "path"}


def register(cls: type[MergeMethod]) -> type[MergeMethod]:
    """Make `cls` the method of `merge.method: cls.name`; the config must accept that name and every key."""
    check_registration("merge method", "merge", CONFIG_METHODS, CONFIG_KEYS, cls.name, cls.keys,
                       refused=(MADE_ELSEWHERE,))
    METHODS[cls.name] = cls
    return cls


def method_class(cfg: MergeConfig) -> type[MergeMethod]:
    cls = METHODS.get(cfg.method)
    if cls is None:
        raise ValueError(f"merge.method: {cfg.method!r} is not merged here; known: {', '.join(sorted(METHODS))}")
    return cls


def merge_method(cfg: MergeConfig) -> MergeMethod:
    """The method `cfg.method` names, handed the values of the keys it declares."""
    cls = method_class(cfg)
    values = cfg.model_dump()
    return cls(MappingProxyType({key: values[key] for key in cls.keys}))


def merged_tensor(base: torch.Tensor, experts: ExpertTensors, cfg: MergeConfig,
                  kept: KeptEntries | None = None) -> torch.Tensor:
    """θ_m of one tensor (or of a block of its rows) in the base's dtype; `kept` gives DARE's keep masks. Integer
    tensors (position ids) are the base's."""
    if not base.is_floating_point():
        return base
    method = merge_method(cfg)
    if method.draws_masks and kept is None:
        raise ValueError(f"merge.method {cfg.method} needs the drop masks of the tensor (kept)")
    return method.merged(base.double(), experts, kept).to(base.dtype)


# The task-arithmetic family, MergeKit's generalized task arithmetic: each task vector sparsified, the sparse task
# vectors combined by a consensus rule, and θ0 + a rescale of the result.

@dataclass(frozen=True)
class Sparsifier:
    """What is kept of τ_t: `keep(τ_t, settings, DARE mask or None)`; `elementwise` as MergeMethod's."""

    keys: tuple[str, ...]
    keep: Callable[[torch.Tensor, Mapping[str, Any], torch.Tensor | None], torch.Tensor]
    elementwise: bool = True
    draws_masks: bool = False


def _dropped_by_mask(tau: torch.Tensor, settings: Mapping[str, Any], mask: torch.Tensor | None) -> torch.Tensor:
    assert mask is not None  # merged_tensor refuses a DARE merge without masks
    return dropped(tau, mask, settings["density"])


NO_SPARSIFIER = Sparsifier((), lambda tau, settings, mask: tau)
MAGNITUDE = Sparsifier(("ties_top_k",), lambda tau, settings, mask: trimmed(tau, settings["ties_top_k"]),
                       elementwise=False)  # its threshold is a quantile of the whole tensor
DARE_DROP = Sparsifier(("density", "seed"), _dropped_by_mask, draws_masks=True)
SparseTaskVectors = Callable[[], Iterator[torch.Tensor]]


def summed_vectors(task_vectors: SparseTaskVectors, settings: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """No consensus: Σ_t τ_t, and T."""
    return summed(task_vectors)


def sign_elected(task_vectors: SparseTaskVectors, settings: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """TIES' consensus, and T. Pass 1 elects a sign per entry from the task vectors' total mass (as MergeKit's `sum`
    consensus, a total of exactly 0 elects +); pass 2 sums (`ties_merge: sum`) or averages over the tasks that agree
    (`mean`) the entries whose sign is the elected one (a zero entry has none)."""
    mass, _ = summed_vectors(task_vectors, settings)
    elected = torch.where(mass >= 0, 1.0, -1.0).to(mass.dtype)
    del mass
    agreed, agreeing, count = torch.zeros_like(elected), torch.zeros_like(elected), 0
    for tau in task_vectors():
        agree = torch.sign(tau) == elected
        agreed += torch.where(agree, tau, 0.0)
        agreeing += agree.double()
        count += 1
    if settings["ties_merge"] == "mean":
        agreed = agreed / agreeing.clamp_min(1.0)
    return agreed, count


@dataclass(frozen=True)
class Consensus:
    """How the sparse task vectors combine: `combine(stream, settings)` → (combined, T); may read the stream twice."""

    keys: tuple[str, ...]
    combine: Callable[[SparseTaskVectors, Mapping[str, Any]], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class Rescale:
    """The factor on the combined task vector: `factor(settings, T)`."""

    keys: tuple[str, ...]
    factor: Callable[[Mapping[str, Any], int], float]


NO_CONSENSUS = Consensus((), summed_vectors)
SIGN_ELECTION = Consensus(("ties_merge",), sign_elected)
SCALED = Rescale(("scaling",), lambda settings, count: settings["scaling"])
MEAN = Rescale((), lambda settings, count: 1.0 / count)


class TaskArithmeticFamily(MergeMethod):
    """θ0 + rescale·consensus(sparsify(τ_t) for each t), streamed one expert at a time per pass. A member names its
    three parts; `register_family` checks it declares exactly the keys they read."""

    sparsifier: ClassVar[Sparsifier] = NO_SPARSIFIER
    consensus: ClassVar[Consensus] = NO_CONSENSUS
    rescale: ClassVar[Rescale] = SCALED

    def merged(self, theta0: torch.Tensor, experts: ExpertTensors, kept: KeptEntries | None) -> torch.Tensor:
        masks: dict[int, torch.Tensor] = {}  # DARE-TIES reads each mask twice: drawn once, 1 byte per entry per expert

        def task_vectors() -> Iterator[torch.Tensor]:
            for t, theta_t in enumerate(experts()):
                if kept is not None and self.draws_masks and t not in masks:
                    masks[t] = kept(t)
                yield self.sparsifier.keep(theta_t.double() - theta0, self.settings, masks.get(t))

        combined, count = self.consensus.combine(task_vectors, self.settings)
        return theta0 + self.rescale.factor(self.settings, count) * combined


def register_family(cls: type[TaskArithmeticFamily]) -> type[TaskArithmeticFamily]:
    """`register`, after checking that the method's keys are exactly those its parts read."""
    parts = cls.sparsifier.keys + cls.consensus.keys + cls.rescale.keys
    if set(parts) != set(cls.keys):
        raise ValueError(f"merge method {cls.name!r} declares {sorted(cls.keys)} but its parts read {sorted(parts)}")
    cls.elementwise = cls.sparsifier.elementwise
    cls.draws_masks = cls.sparsifier.draws_masks
    register(cls)
    return cls


@register_family
class TaskArithmetic(TaskArithmeticFamily):
    name, keys = "task_arithmetic", ("scaling",)


@register_family
class Average(TaskArithmeticFamily):
    name, keys, rescale = "average", (), MEAN


@register_family
class Ties(TaskArithmeticFamily):
    name, keys = "ties", ("scaling", "ties_top_k", "ties_merge")
    sparsifier, consensus = MAGNITUDE, SIGN_ELECTION


@register_family
class DareLinear(TaskArithmeticFamily):
    name, keys, sparsifier = "dare_linear", ("scaling", "density", "seed"), DARE_DROP


@register_family
class DareTies(TaskArithmeticFamily):
    name, keys = "dare_ties", ("scaling", "density", "seed", "ties_merge")
    sparsifier, consensus = DARE_DROP, SIGN_ELECTION


# Merges by singular vectors, and WUDI (featcal/subspace_merges.py): a 2-D tensor is merged whole, from its task
# vectors streamed one at a time; any other floating tensor takes the mean task vector, as these methods' papers and
# FusionBench treat 1-D parameters. θ_m = θ0 + α·Δ.

class MatrixMerge(MergeMethod):
    elementwise = False

    def merged(self, theta0: torch.Tensor, experts: ExpertTensors, kept: KeptEntries | None) -> torch.Tensor:
        def task_vectors() -> Iterator[torch.Tensor]:
            for theta_t in experts():
                yield theta_t.double() - theta0

        if theta0.dim() == 2:
            delta = self.delta(task_vectors)
        else:
            total, count = summed_vectors(task_vectors, self.settings)
            delta = total / count
        alpha = self.settings["svd_scaling"] if "svd_scaling" in self.keys else 1.0  # WUDI's Δ is not rescaled
        return theta0 + alpha * delta

    @abstractmethod
    def delta(self, task_vectors: TaskVectors) -> torch.Tensor:
        """Δ of a 2-D tensor from its task vectors."""


@register
class TsvM(MatrixMerge):
    name, keys = "tsv_m", ("svd_scaling",)

    def delta(self, task_vectors: TaskVectors) -> torch.Tensor:
        tasks = sum(1 for _ in task_vectors())  # r = k/T is needed in the one pass: T from a pass of reads alone
        return tsv_m(task_vectors, tasks)


@register
class IsoC(MatrixMerge):
    name, keys = "iso_c", ("svd_scaling",)

    def delta(self, task_vectors: TaskVectors) -> torch.Tensor:
        return iso_c(task_vectors)


@register
class IsoCts(MatrixMerge):
    name, keys = "iso_cts", ("svd_scaling", "iso_common_fraction")

    def delta(self, task_vectors: TaskVectors) -> torch.Tensor:
        return iso_cts(task_vectors, self.settings["iso_common_fraction"])


@register
class Wudi(MatrixMerge):
    name, keys = "wudi", ("wudi_steps", "wudi_lr")

    def delta(self, task_vectors: TaskVectors) -> torch.Tensor:
        return wudi(task_vectors, self.settings["wudi_steps"], self.settings["wudi_lr"])
