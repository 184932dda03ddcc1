"""Reading and writing HF safetensors checkpoints tensor by tensor, in canonical (body-relative) names.

Checkpoints of one family disagree on prefixes: a `BertModel` saves `encoder.layer.0...`, a
`BertForSequenceClassification` saves `bert.encoder.layer.0...`; transformers 5 saves `CLIPVisionModel`
without the `vision_model.` prefix that hub checkpoints carry. We detect the prefix from a probe tensor and
map every name to the body-relative one, and fail loudly when a checkpoint does not fit.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from featcal.adapters import Adapter
from storage.atomic import atomic_path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files copied next to written weights so the result loads with from_pretrained like its base.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
    "special_tokens_map.json", "preprocessor_config.json", "merges.txt", "vocab.json", "added_tokens.json",
    "processor_config.json", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model",
)


class CheckpointError(ValueError):
    pass


class TensorFiles:
    """Name → file index over one checkpoint directory (single file or sharded), reading lazily."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        single = self.directory / WEIGHTS_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.directory / fname for name, fname in weight_map.items()}
        elif single.is_file():
            with safe_open(single, "pt") as fh:
                self.file_of = {name: single for name in fh.keys()}
        else:
            raise CheckpointError(
                f"{self.directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; "
                "FeatCal reads safetensors checkpoints written by save_pretrained"
            )
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return tuple(self._handles[path].get_slice(name).get_shape())


class CanonicalCheckpoint:
    """One checkpoint seen through an adapter: tensors by canonical name."""

    def __init__(self, directory: str | Path, adapter: Adapter):
        self.files = TensorFiles(directory)
        self.directory = self.files.directory
        names = set(self.files.names())
        tried = [p + adapter.probe_key for p in adapter.file_prefixes]
        prefix = next((p for p, probe in zip(adapter.file_prefixes, tried) if probe in names), None)
        if prefix is None:
            raise CheckpointError(
                f"{self.directory} has no tensor named {' or '.join(tried)}: it is not a checkpoint of the "
                f"{type(adapter).__name__} family, or it uses a tensor layout this transformers version renamed "
                "(load it once with from_pretrained and save_pretrained it again)"
            )
        self.prefix = prefix
        self.renames = [(re.compile(pattern), target) for pattern, target in adapter.file_renames]
        self._file_name = {self.canonical(n): n for n in names}

    def canonical(self, file_name: str) -> str:
        name = file_name[len(self.prefix):] if self.prefix and file_name.startswith(self.prefix) else file_name
        for pattern, target in self.renames:
            name = pattern.sub(target, name)
        return name

    def file_name(self, canonical: str) -> str:
        return self._file_name[canonical]

    def names(self) -> list[str]:
        return sorted(self._file_name)

    def __contains__(self, canonical: str) -> bool:
        return canonical in self._file_name

    def get(self, canonical: str) -> torch.Tensor:
        try:
            return self.files.get(self._file_name[canonical])
        except KeyError:
            raise CheckpointError(f"{self.directory} has no tensor {canonical!r}") from None

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self.files.shape(self._file_name[canonical])

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors whose canonical name starts with `prefix`, keyed relative to it."""
        return {n[len(prefix):]: self.get(n) for n in self.names() if n.startswith(prefix)}


def copy_side_files(source: Path, target: Path) -> None:
    for name in SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(target) / name)


def write_checkpoint(
    target: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    side_files_from: Path | None = None,
    extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Stream (name, tensor) pairs into safetensors shards; the directory appears only when complete.

    `extra_files` are small side tensors files (per-task heads) written inside the same directory."""
    with atomic_path(Path(target)) as tmp:
        tmp.mkdir()
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        weight_map: dict[str, str] = {}
        written: list[str] = []

        def flush() -> None:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
            written.append(name)
            weight_map.update({k: name for k in shards[-1]})
            shards[-1], sizes[-1] = {}, 0

        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
                flush()
            shards[-1][name] = tensor.contiguous()
            sizes[-1] += nbytes
        if shards[-1] or not written:
            flush()
        if len(written) == 1:
            (tmp / written[0]).rename(tmp / WEIGHTS_NAME)
        else:
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        for rel, extra in (extra_files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / rel), metadata={"format": "pt"})
