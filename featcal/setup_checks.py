"""Degenerate set-ups: inputs that load and run, but whose result says less than it seems to
(docs/resilience.md#degenerate-set-ups-and---strict). Each is a warning, or `runtime.strict` makes it a refusal.

Everything here is read before any stage. The experts are streamed once, a tensor (or a block of rows of a large
one) at a time, and that one pass also refuses NaN/inf values and tensor data cut short: such a checkpoint is named
before the run directory is touched."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

from featcal.adapters import Adapter
from featcal.config import ConfigError, DataSource, MergeConfig, RunConfig
from featcal.data import InputBuilder, load_split, picked_rows
from featcal.merging import chunk_rows
from featcal.modeling import Skeleton, expert_checkpoint
from storage.checkpoint import CanonicalCheckpoint, CheckpointError, finite
from storage.lora import LoraCheckpoint, config_directory, is_lora_adapter

# ‖θ_t − θ0‖ / ‖θ0‖ over the body below this is a near-zero task vector: far below the tiny example's experts (0.12
# to 0.17; published fine-tunes are not measured here), above the exact 0 of a float32 re-save of the base. A bf16
# re-save of a float32 base (about 2e-3 of rounding) is not caught.
NEAR_ZERO = 1e-5
# Row blocks of the size the merge reads a large tensor in (an LLM's embedding), so the scan holds no more.
_BY_ROWS = MergeConfig(method="average")
_PIECE = 1 << 18  # entries per piece of the sums (1 MiB of float32): temporaries that stay in cache
# What a task's expert is read as: a full checkpoint, or a LoRA adapter over the base (base + ΔW).
Checkpoint = CanonicalCheckpoint | LoraCheckpoint


class SetupError(ConfigError):
    """A degenerate set-up refused: by `runtime.strict`, or because its result would be meaningless."""


@dataclass(frozen=True)
class ExpertScan:
    relative_norm: float  # ‖θ_t − θ0‖ / ‖θ0‖ over the body tensors (the heads are per task, not merged)
    # Per tensor (block): Σ(θ_t − θ0)² over the body, Σθ² over the head. Identical content gives identical sums, so
    # only experts with equal signatures are compared byte for byte (`identical_pairs`): no hash of every byte.
    signature: tuple[tuple[str, float], ...]


def row_blocks(ckpt: Checkpoint, name: str) -> list[tuple[int, int] | None]:
    """The row ranges tensor `name` is read in: whole (None), or blocks of rows of the size the merge reads."""
    shape = ckpt.shape(name)
    rows = chunk_rows(shape, _BY_ROWS) if ckpt.dtype(name).is_floating_point else None
    return [None] if rows is None else [(a, min(a + rows, shape[0])) for a in range(0, shape[0], rows)]


def _read(owner: str, ckpt: Checkpoint, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
    """A tensor (block), or one line naming the config field, tensor and file where its data is cut short."""
    try:
        return ckpt.get(name, rows)
    except CheckpointError as exc:
        raise CheckpointError(f"{owner}: tensor {name}: {exc}") from None


def squared_distance(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """Σ(x − y)² (Σx² without `y`), summed in float64, by pieces of _PIECE entries: whole-tensor temporaries ran 5 to
    8 times slower here, and float64 copies twice as slow as a float64 norm of the float32 difference. Two distinct
    floats never differ by 0, so a zero is exact. NaN/inf in x or y gives NaN/inf: the finiteness check is free."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = 0.0
    ys = y.reshape(-1).split(_PIECE) if y is not None else None
    for i, piece in enumerate(x.reshape(-1).split(_PIECE)):
        d = piece.to(wide) if ys is None else piece.to(wide) - ys[i].to(wide)
        total += float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2
    return total


def _finite_sum(total: float, owner: str, ckpt: Checkpoint, name: str, tensor: torch.Tensor) -> float:
    if not math.isfinite(total):
        finite(tensor, name, owner, ckpt.directory)  # raises, naming the owner, tensor, count and directory
    return total


def scan_checkpoints(base: CanonicalCheckpoint, experts: dict[str, Checkpoint],
                     is_head: Callable[[str], bool]) -> dict[str, ExpertScan]:
    """Per owner (`experts.TASK`): its task vector's relative norm and signature; every tensor of base and experts
    refused if it holds NaN/inf or its data is cut short. Memory: one block of the base and of one expert."""
    signatures: dict[str, list[tuple[str, float]]] = {owner: [] for owner in experts}
    sq_base = 0.0
    for name in base.names():
        for rows in row_blocks(base, name):
            theta0 = _read("base", base, name, rows)
            own = _finite_sum(squared_distance(theta0), "base", base, name, theta0)
            if is_head(name):
                continue
            sq_base += own
            for owner, ckpt in experts.items():
                theta = _read(owner, ckpt, name, rows)
                signatures[owner].append((name, _finite_sum(squared_distance(theta, theta0), owner, ckpt, name, theta)))
    body = {owner: sum(v for _, v in sig) for owner, sig in signatures.items()}
    for owner, ckpt in experts.items():
        for name in (n for n in ckpt.names() if is_head(n)):
            for rows in row_blocks(ckpt, name):
                head = _read(owner, ckpt, name, rows)
                signatures[owner].append((name, _finite_sum(squared_distance(head), owner, ckpt, name, head)))
    return {owner: ExpertScan(math.sqrt(body[owner] / sq_base) if sq_base else math.inf, tuple(signatures[owner]))
            for owner in experts}


def same_content(a: Checkpoint, b: Checkpoint) -> bool:
    """Every tensor of `a` and `b` equal in name, dtype, shape and value, read a block at a time."""
    if a.names() != b.names():
        return False
    for name in a.names():
        if a.dtype(name) != b.dtype(name) or a.shape(name) != b.shape(name):
            return False
        if not all(torch.equal(a.get(name, rows), b.get(name, rows)) for rows in row_blocks(a, name)):
            return False
    return True


def identical_pairs(experts: dict[str, Checkpoint],
                    scans: dict[str, ExpertScan]) -> list[tuple[str, str]]:
    """Pairs of tasks (in order) whose checkpoints hold the same content: those with equal signatures, confirmed."""
    tasks = list(experts)
    return [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]
            if scans[a].signature == scans[b].signature and same_content(experts[a], experts[b])]


def task_vector_warnings(base: str, experts: dict[str, str], norms: dict[str, float],
                         identical: list[tuple[str, str]]) -> list[str]:
    """An expert that is the base (its path, or a task vector of exactly zero), a near-zero task vector, and two
    tasks on one checkpoint (one path, or the same content): the merge then has less in it than the config says."""
    out = []
    for task, path in experts.items():
        norm = norms[task]
        if Path(path).resolve() == Path(base).resolve():
            out.append(f"experts.{task}: {path} is the base checkpoint itself: its task vector is zero, so the task "
                       "adds nothing to the merge and calibration aims at the base's own features")
        elif norm == 0:
            out.append(f"experts.{task}: its body equals the base's ({path}): its task vector is zero, so the task "
                       "adds nothing to the merge and calibration aims at the base's own features")
        elif norm < NEAR_ZERO:
            out.append(f"experts.{task}: near-zero task vector, ‖θ_t − θ0‖/‖θ0‖ = {norm:.2g} over the body "
                       f"(below {NEAR_ZERO:g}): {path} is barely fine-tuned")
    tasks = list(experts)
    for i, first in enumerate(tasks):
        for second in tasks[i + 1:]:
            if Path(experts[first]).resolve() == Path(experts[second]).resolve():
                why = f"the same checkpoint {experts[first]}"
            elif (first, second) in identical:
                why = f"checkpoints of identical content ({experts[first]}, {experts[second]})"
            else:
                continue
            out.append(f"experts.{first} and experts.{second} are {why}: its task vector counts twice in the merge")
    return out


def expected_head(skeleton: Skeleton) -> list[str]:
    """The head tensors of the expert's class (its config's `architectures`), from its skeleton on the meta device:
    those from_pretrained would initialise at random where the checkpoint lacks them."""
    return sorted(n for n in skeleton.model.state_dict() if skeleton.adapter.is_head(n))


def lora_config_used(path: str, skeleton: Skeleton) -> str:
    """For a LoRA adapter expert, which config gives its class: its own config.json or, without one, the base's."""
    if (Path(path) / "config.json").is_file():
        return f"its config.json names {skeleton.adapter.architecture}"
    return f"it has no config.json, so the base's ({skeleton.adapter.architecture}) is used"


def check_lora_head(task: str, path: str, skeleton: Skeleton, ckpt: Checkpoint) -> None:
    """A LoRA adapter that saves a head (PEFT's modules_to_save) whose class, from the config beside it, has none:
    the expert would be loaded without its head, so it is refused before any stage, naming the adapter."""
    if not is_lora_adapter(path) or not isinstance(ckpt, LoraCheckpoint):
        return
    held = sorted(n for n in ckpt.adapted() if skeleton.adapter.is_head(n))
    if not held or set(held) <= set(expected_head(skeleton)):
        return
    raise SetupError(f"experts.{task}: LoRA adapter {path} holds head tensors {held[:4]}, but "
                     f"{lora_config_used(path, skeleton)}, a class without that head: save the fine-tuned model's "
                     f"config beside the adapter (model.config.save_pretrained of the model with the head)")


def head_warning(task: str, path: str, expected: list[str], ckpt: Checkpoint, adapter: Adapter,
                 skeleton: Skeleton | None = None) -> str | None:
    """None when the expert holds the head its class has; a warning when its class has none (the task is calibrated,
    not scored); a refusal when the class has a head the file lacks (every score of the task would be chance)."""
    held = [n for n in ckpt.names() if adapter.is_head(n)]
    missing = sorted(set(expected) - set(held))
    if missing:
        raise SetupError(f"experts.{task}: {path} lacks the head tensors {missing} its class has; from_pretrained "
                         "would initialise them at random, so every score of the task would be chance (give the "
                         "fine-tuned checkpoint with its head)")
    if not expected and not held:
        used = f" (a LoRA adapter: {lora_config_used(path, skeleton)})" if skeleton and is_lora_adapter(path) else ""
        return (f"experts.{task}: {path} has no task head{used}: the task is calibrated but its accuracy is not "
                "measured")
    return None


def row_digests(ds: datasets.Dataset, columns: list[str]) -> list[str]:
    """One digest per row of the raw input values in `columns` (text, image bytes, token ids), as stored."""
    table = ds.select_columns(columns).with_format("arrow")
    out = []
    for start in range(0, len(ds), 1024):
        for row in table[start:start + 1024].to_pylist():
            raw = json.dumps([_stored(row[c]) for c in columns], sort_keys=True, default=bytes.hex)
            out.append(hashlib.blake2b(raw.encode(), digest_size=16).hexdigest())
    return out


def _stored(value: Any) -> Any:
    """An image as its encoded bytes where it has them (its path would tell two copies of one image apart)."""
    if isinstance(value, dict) and value.get("bytes") is not None:
        return value["bytes"]
    return value


def overlap_count(calibration: list[str], evaluation: list[str]) -> int:
    """How many evaluation rows are among the calibration rows."""
    seen = set(calibration)
    return sum(d in seen for d in evaluation)


def _used_rows(cfg: RunConfig, adapter: Adapter, source: DataSource, where: str, n: int | None) -> list[str]:
    """Digests of the rows a stage reads: the same seeded pick of `n` rows (all with None) as the stage makes."""
    ds = load_split(source, where)
    if n is not None:
        ds = ds.select(picked_rows(len(ds), n, cfg.calibration.seed))
    builder = InputBuilder(cfg.base, adapter.model_input_names(), source, cfg.calibration.max_length,
                           ds.column_names, where)
    columns = builder.ready or [c for c in (builder.column, builder.pair_column) if c]
    return row_digests(ds, columns)


def overlap_warnings(cfg: RunConfig, adapter: Adapter) -> list[str]:
    """Evaluation rows that are also calibration rows (with shared inputs: any task's, or the pool's): calibration has
    seen them, so the report overstates what it wins back on unseen data."""
    if not cfg.evaluation.enabled:
        return []

    def calibration_rows(task: str) -> list[str]:
        return _used_rows(cfg, adapter, cfg.calibration.data[task], f"calibration.data.{task}",
                          cfg.calibration.examples_per_task)

    # With calibration.shared_inputs every task's rows, and the pool's, are calibration rows of every task
    foreign: list[str] = []
    sharing = cfg.calibration.shared_inputs
    if sharing.weights:
        foreign = [row for t in cfg.tasks for row in calibration_rows(t)]
        if sharing.pool is not None:
            foreign += _used_rows(cfg, adapter, sharing.pool, "calibration.shared_inputs.pool", sharing.pool_examples)
    out = []
    for task, source in sorted(cfg.evaluation.data.items()):
        where = f"evaluation.data.{task}"
        cal = foreign or calibration_rows(task)
        ev = _used_rows(cfg, adapter, source, where, cfg.evaluation.max_examples)
        shared = overlap_count(cal, ev)
        if shared:
            out.append(f"{where}: {shared} of its {len(ev)} rows are also calibration rows (same raw input values): "
                       "the report overstates what calibration wins back on unseen data")
    return out


def setup_warnings(cfg: RunConfig, adapter: Adapter) -> list[str]:
    """Every degenerate set-up of the run, in one pass over the checkpoints; refuses (SetupError, CheckpointError)
    what would make the result meaningless, and NaN/inf or truncated tensors."""
    base = CanonicalCheckpoint(cfg.base, adapter)
    skeletons = {t: Skeleton.from_checkpoint(config_directory(cfg.experts[t], cfg.base)) for t in cfg.tasks}
    # A LoRA expert is read as base + ΔW (storage/lora.py), tensor by tensor like a full one.
    experts = {t: expert_checkpoint(cfg.experts[t], cfg.base, skeletons[t]) for t in cfg.tasks}
    by_owner = scan_checkpoints(base, {f"experts.{t}": c for t, c in experts.items()}, adapter.is_head)
    scans = {t: by_owner[f"experts.{t}"] for t in cfg.tasks}
    out = task_vector_warnings(cfg.base, {t: cfg.experts[t] for t in cfg.tasks},
                               {t: scan.relative_norm for t, scan in scans.items()}, identical_pairs(experts, scans))
    # Zero-shot experts are head-less by design (the heads come from the CLIPModel); LMs have no per-task head.
    if cfg.zero_shot is None and adapter.head_prefixes:
        for task in cfg.tasks:
            warning = head_warning(task, cfg.experts[task], expected_head(skeletons[task]), experts[task], adapter,
                                   skeletons[task])
            out += [warning] if warning else []
    return out + overlap_warnings(cfg, adapter)


def strict_refusal(warnings: list[str]) -> SetupError:
    """`runtime.strict` (`--strict`): every warning, in one line."""
    return SetupError(f"runtime.strict (--strict) refuses degenerate set-ups: {'; '.join(warnings)}")
