"""A PEFT LoRA adapter read as the expert it stands for: base weights θ0 plus ΔW = scale·B·A, one tensor at a time.

An expert given as a LoRA adapter directory (PEFT's `adapter_config.json` + `adapter_model.safetensors`) serves the
same interface as a full checkpoint (`CanonicalCheckpoint`), so the merge, the block forwards and the evaluation read
it unchanged; each adapted tensor is formed when asked for and never written out. The arithmetic is PEFT's
`merge_and_unload`: ΔW = (B @ A)·scale in float32, scale = lora_alpha/r (lora_alpha/√r with rslora), transposed for a
weight stored [in, out] (transformers' Conv1D) and for an embedding, cast to the adapter's dtype and added to the base
tensor, rounding once to its dtype. Tensors the adapter saves whole (`modules_to_save`, trained biases, the weight
of a targeted embedding) replace the base's; ΔW adds to such a weight as to the base's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from storage.checkpoint import DTYPES, CanonicalCheckpoint, CheckpointError, TensorNaming, read_header, read_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT saves every tensor under the wrapped model's name for the original model.
PEFT_PREFIX = "base_model.model."
# Suffixes of the low-rank factors PEFT saves (the adapter's own name, "default", removed): Linear/Conv1D, Embedding.
FACTORS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "bias",
           ".lora_embedding_A": "A", ".lora_embedding_B": "B"}
EMBEDDING_FACTOR = ".lora_embedding_A"
# adapter_config.json settings that change what the adapter computes beyond scale·B·A; refused when set.
UNSUPPORTED = ("use_dora", "layer_replication", "target_parameters", "trainable_token_indices",
               "alora_invocation_tokens", "use_bdlora", "use_qalora")


def is_lora_adapter(directory: str | Path) -> bool:
    """Whether `directory` holds a PEFT adapter rather than a full checkpoint."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def config_directory(expert: str | Path, base: str | Path) -> Path:
    """The directory whose config.json describes expert `expert`: its own, or for an adapter without one, the base's
    (an adapter that adds a classification head to a bare encoder keeps the fine-tuned model's config beside it)."""
    expert = Path(expert)
    return Path(base) if is_lora_adapter(expert) and not (expert / "config.json").is_file() else expert


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """A per-module setting of PEFT's `alpha_pattern`: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _same_base(recorded: str, base: Path) -> bool:
    """Whether the adapter's `base_model_name_or_path` names `base`: the same directory where it exists here, else a
    hub id or a path from another machine whose trailing components are the base directory's, or, for a base read
    from the hub cache (…/models--org--name/snapshots/<commit>), its hub id."""
    if Path(recorded).exists():
        return Path(recorded).resolve() == base.resolve()
    parts = Path(recorded).parts
    tail = parts[-1:] if Path(recorded).is_absolute() else parts
    cached = base.parts[-3:-1]
    hub_id = tuple(cached[0].split("--")[1:]) if len(cached) == 2 and cached[0].startswith("models--") and \
        cached[1] == "snapshots" else None
    return len(tail) > 0 and (base.resolve().parts[-len(tail):] == tail or hub_id == tail)


@dataclass(frozen=True)
class LowRank:
    """How one base weight's ΔW is formed: from the adapter file's tensors `a` (A, r × in) and `b` (B, out × r)."""

    a: str
    b: str
    scale: float
    transposed: bool  # ΔW is (B @ A)ᵀ: the base stores the weight [in, out], or it is an embedding table


class LoraCheckpoint:
    """Expert = base + LoRA adapter, tensors by canonical name, with `CanonicalCheckpoint`'s interface.

    `stored_in_out(canonical)` says whether the module owning a weight stores it [in, out] (transformers' Conv1D),
    as PEFT decides the transpose by the module's class."""

    def __init__(self, directory: str | Path, base: CanonicalCheckpoint, naming: TensorNaming,
                 stored_in_out: Callable[[str], bool]):
        self.directory = Path(directory)
        self.base = base
        where = f"LoRA adapter {self.directory}"
        try:
            config = json.loads((self.directory / ADAPTER_CONFIG).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: cannot read {ADAPTER_CONFIG}: {exc}") from None
        if config.get("peft_type") != "LORA":
            raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters are read")
        for key in UNSUPPORTED:
            if config.get(key):
                raise CheckpointError(f"{where}: {key} = {config[key]!r} is not supported (plain LoRA only)")
        recorded = config.get("base_model_name_or_path")
        if not recorded or not _same_base(recorded, base.directory):
            raise CheckpointError(f"{where}: base_model_name_or_path {recorded!r} is not the run's base "
                                  f"{base.directory}; the adapter must have been trained on that base")
        weights = self.directory / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise CheckpointError(f"{where}: no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read)")
        header, data_start = read_header(weights)
        self._entries = {name: (weights, entry, data_start) for name, entry in header.items()}
        factors: dict[str, dict[str, str]] = {}  # module (file name) → role → tensor name in the adapter file
        embeddings: set[str] = set()  # modules whose factors are an embedding's (lora_embedding_A/B)
        self._whole: dict[str, str] = {}  # canonical → tensor name in the adapter file
        self._file_name: dict[str, str] = {}
        for key in header:
            if not key.startswith(PEFT_PREFIX):
                raise CheckpointError(f"{where}: tensor {key} lacks PEFT's prefix {PEFT_PREFIX!r}")
            name = key[len(PEFT_PREFIX):]
            suffix = next((s for s in FACTORS if name.endswith(s)), None)
            if suffix is not None:
                factors.setdefault(name[:-len(suffix)], {})[FACTORS[suffix]] = key
                if suffix.startswith(".lora_embedding"):
                    embeddings.add(name[:-len(suffix)])
            elif ".lora_" in name:
                raise CheckpointError(f"{where}: tensor {key} is not a LoRA factor this reader knows (DoRA and other "
                                      "variants are not supported)")
            else:  # a wrapped module's own weight (PEFT saves a targeted embedding's) sits under `base_layer`
                name = name.replace(".base_layer.", ".")
                whole = self._canonical(naming, name, must_exist=False)
                if whole is None:
                    raise CheckpointError(f"{where}: tensor {key} starts with none of the model's prefixes "
                                          f"{list(naming.file_prefixes)}")
                self._whole[whole], self._file_name[whole] = key, name
        alpha = config.get("lora_alpha")
        if factors and alpha is None:
            raise CheckpointError(f"{where}: {ADAPTER_CONFIG} has no lora_alpha")
        self._low_rank: dict[str, LowRank] = {}
        self._bias: dict[str, tuple[str, float]] = {}
        for module, parts in sorted(factors.items()):
            if "A" not in parts or "B" not in parts:
                raise CheckpointError(f"{where}: module {module} has only {sorted(parts)} of "
                                      "lora_A and lora_B")
            canonical = self._canonical(naming, f"{module}.weight", must_exist=True)
            if canonical is None:
                raise CheckpointError(f"{where}: module {module} has no weight in the base {base.directory}")
            a_shape, b_shape = self._shape(parts["A"]), self._shape(parts["B"])
            rank = a_shape[0]
            if len(a_shape) != 2 or len(b_shape) != 2 or b_shape[1] != rank:
                raise CheckpointError(f"{where}: module {module}: lora_A {a_shape} and lora_B {b_shape} are not "
                                      "(r, in) and (out, r) matrices of one rank")
            # The rank is the factors' own (PEFT's r, or its rank_pattern for this module).
            module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
            scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
            transposed = module in embeddings or stored_in_out(canonical)
            delta_shape = (a_shape[1], b_shape[0]) if transposed else (b_shape[0], a_shape[1])
            if delta_shape != base.shape(canonical):
                raise CheckpointError(f"{where}: module {module}: ΔW has shape {delta_shape}, the base tensor "
                                      f"{canonical} has {base.shape(canonical)}")
            self._low_rank[canonical] = LowRank(parts["A"], parts["B"], scale, transposed)
            if "bias" in parts:
                bias = self._canonical(naming, f"{module}.bias", must_exist=True)
                if bias is None or base.shape(bias) != self._shape(parts["bias"]):
                    raise CheckpointError(f"{where}: module {module}: lora_B.bias {self._shape(parts['bias'])} has "
                                          "no base bias of that shape")
                self._bias[bias] = (parts["bias"], scale)
        for canonical, key in self._whole.items():
            if canonical in base and base.shape(canonical) != self._shape(key):
                raise CheckpointError(f"{where}: module tensor {key} has shape {self._shape(key)}, the base tensor "
                                      f"{canonical} has {base.shape(canonical)}")
        self._names = sorted(set(base.names()) | set(self._whole))

    def _canonical(self, naming: TensorNaming, name: str, must_exist: bool) -> str | None:
        """The canonical name of `name` (a tensor name in the fine-tuned model): the first of the family's file
        prefixes it starts with that gives a base tensor, or, for a tensor the base lacks (a new head), the first it
        starts with; None if `must_exist` and no base tensor fits."""
        fits = []
        for prefix in naming.file_prefixes:
            if name.startswith(prefix):
                candidate = name[len(prefix):]
                for pattern, target in self.base.renames:
                    candidate = pattern.sub(target, candidate)
                if candidate in self.base:
                    return candidate
                fits.append(candidate)
        return None if must_exist or not fits else fits[0]

    def _shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key][1]["shape"])

    def _read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_tensor(*self._entries[key], rows=rows)

    def names(self) -> list[str]:
        return self._names

    def __contains__(self, canonical: str) -> bool:
        return canonical in self._whole or canonical in self.base

    def adapted(self) -> list[str]:
        """The canonical names whose tensors differ from the base's: adapted weights and biases, whole tensors."""
        return sorted({*self._low_rank, *self._bias, *self._whole})

    def file_name(self, canonical: str) -> str:
        return self._file_name[canonical] if canonical in self._whole else self.base.file_name(canonical)

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self._shape(self._whole[canonical]) if canonical in self._whole else self.base.shape(canonical)

    def dtype(self, canonical: str) -> torch.dtype:
        if canonical in self._whole:
            return DTYPES[self._entries[self._whole[canonical]][1]["dtype"]]
        return self.base.dtype(canonical)

    def delta(self, canonical: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """ΔW of an adapted weight (rows `rows` of it), in the adapter's dtype, computed as PEFT's merge does."""
        low = self._low_rank[canonical]
        a, b = self._read(low.a), self._read(low.b)
        if rows is not None:  # rows of ΔW are rows of B, or of Aᵀ when ΔW is transposed
            a, b = (a[:, rows[0]:rows[1]], b) if low.transposed else (a, b[rows[0]:rows[1]])
        product = b.float() @ a.float()
        return ((product.T if low.transposed else product) * low.scale).to(b.dtype)

    def get(self, canonical: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The expert's tensor, or with `rows` (start, stop) only those rows along its first dimension."""
        if canonical in self._whole:
            tensor = self._read(self._whole[canonical], rows)
        else:
            tensor = self.base.get(canonical, rows)
        if canonical in self._low_rank:
            return torch.add(tensor, self.delta(canonical, rows)).to(tensor.dtype)
        if canonical in self._bias:
            key, scale = self._bias[canonical]
            return torch.add(tensor, self._read(key, rows) * scale).to(tensor.dtype)
        return tensor

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors whose canonical name starts with `prefix`, keyed relative to it."""
        return {n[len(prefix):]: self.get(n) for n in self.names() if n.startswith(prefix)}
