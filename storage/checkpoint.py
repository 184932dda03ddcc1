"""Reading and writing HF safetensors checkpoints tensor by tensor, in canonical (body-relative) names.

Checkpoints of one family disagree on prefixes: a `BertModel` saves `encoder.layer.0...`, a
`BertForSequenceClassification` saves `bert.encoder.layer.0...`; transformers 5 saves `CLIPVisionModel`
without the `vision_model.` prefix that hub checkpoints carry. We detect the prefix from a probe tensor and
map every name to the body-relative one, and fail loudly when a checkpoint does not fit.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from storage.atomic import atomic_path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# A checkpoint's model card (featcal/model_card.py): documentation of the weights, written after the run and
# rewritten when its evaluation changes, so no output digest covers it (storage/rundir.py).
MODEL_CARD = "README.md"
# Files copied next to written weights so the result loads with from_pretrained like its base.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
    "special_tokens_map.json", "preprocessor_config.json", "merges.txt", "vocab.json", "added_tokens.json",
    "processor_config.json", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model",
)


class CheckpointError(ValueError):
    pass


DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TensorSpec(NamedTuple):
    """A tensor as a checkpoint's header records it, known before the tensor is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _raw_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(size)), 8 + size


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header (name → dtype, shape, offsets) and where the data starts."""
    header, data_start = _raw_header(path)
    header.pop("__metadata__", None)
    return header, data_start


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's free-form string metadata (a zero-shot head records its prompts there)."""
    return _raw_header(path)[0].get("__metadata__", {})


def read_tensor(path: Path, entry: dict, data_start: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One tensor by plain reads: safetensors' mmap would leave every page it touched in our RSS. With `rows`
    (start, stop): only those rows along the first dimension (a contiguous byte range of the file)."""
    start, end = entry["data_offsets"]
    shape = list(entry["shape"])
    if rows is not None:  # 0 <= rows[0] <= rows[1] <= shape[0]
        row_bytes = (end - start) // shape[0]
        start, end, shape[0] = start + rows[0] * row_bytes, start + rows[1] * row_bytes, rows[1] - rows[0]
    # Into an uninitialised tensor: a bytearray is zero-filled first, which took 4× as long as reading a float64
    # Gram from the page cache.
    raw = torch.empty(end - start, dtype=torch.uint8)
    with open(path, "rb") as fh:
        fh.seek(data_start + start)
        got = fh.readinto(raw.numpy().data)  # ndarray.data: a memoryview of the tensor's bytes
    if got != raw.numel():
        raise CheckpointError(f"{path}: tensor data ends after {got} of {raw.numel()} bytes: the file is cut short")
    return raw.view(DTYPES[entry["dtype"]]).reshape(shape)


class TensorFiles:
    """Name → file index over one checkpoint directory (single file or sharded), reading lazily."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        single = self.directory / WEIGHTS_NAME
        if index.is_file():
            files = sorted({self.directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif single.is_file():
            files = [single]
        else:
            raise CheckpointError(
                f"{self.directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; "
                "FeatCal reads safetensors checkpoints written by save_pretrained"
            )
        self._entries: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, data_start = read_header(path)
            self._entries.update({name: (path, entry, data_start) for name, entry in header.items()})

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_tensor(*self._entries[name], rows=rows)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entries[name][1]["dtype"]]


class TensorNaming(Protocol):
    """What a checkpoint reader needs of an architecture adapter (featcal.adapters.Adapter has it): stated here so
    that storage, below featcal, does not import the adapters."""

    @property
    def file_prefixes(self) -> tuple[str, ...]:
        """Prefixes a file may put before body tensor names, in the order to try them."""

    @property
    def probe_key(self) -> str:
        """A canonical tensor name every checkpoint of the family has."""

    @property
    def file_renames(self) -> tuple[tuple[str, str], ...]:
        """(pattern, replacement) regexes from names on disk to canonical names, applied in order."""


class CanonicalCheckpoint:
    """One checkpoint seen through an adapter: tensors by canonical name."""

    def __init__(self, directory: str | Path, adapter: TensorNaming):
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

    def get(self, canonical: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or with `rows` (start, stop) only those rows along its first dimension."""
        try:
            return self.files.get(self._file_name[canonical], rows)
        except KeyError:
            raise CheckpointError(f"{self.directory} has no tensor {canonical!r}") from None

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self.files.shape(self._file_name[canonical])

    def dtype(self, canonical: str) -> torch.dtype:
        return self.files.dtype(self._file_name[canonical])

    def spec(self, canonical: str) -> TensorSpec:
        """The tensor as a checkpoint written in this one's file names records it."""
        return TensorSpec(self.file_name(canonical), self.dtype(canonical), tuple(self.shape(canonical)))

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors whose canonical name starts with `prefix`, keyed relative to it."""
        return {n[len(prefix):]: self.get(n) for n in self.names() if n.startswith(prefix)}


def finite(tensor: torch.Tensor, name: str, owner: str, directory: Path) -> torch.Tensor:
    """`tensor` itself, or a CheckpointError naming `owner` (a config field), the tensor and its directory when it
    holds NaN or inf: a merge must not spread one expert's corruption into every weight it writes.

    Its sum first: one NaN or inf makes the sum NaN or inf, and a sum reads a tensor 22× faster than
    isfinite().all() (fp32, one thread, benchmarks/results/finite_check.md). Only a sum that is not finite, from a bad
    value or from finite values that overflow, sends the tensor to the element-by-element count."""
    if not tensor.is_floating_point() or math.isfinite(float(tensor.sum())):
        return tensor
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise CheckpointError(f"{owner}: tensor {name} holds {bad} NaN/inf value(s) of {tensor.numel()} "
                              f"(checkpoint {directory}); nothing was merged")
    return tensor


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `tensors`, each written from its own memory (`write_streamed`): safetensors' save_file
    first copies them all into one buffer, 2.2 GiB more for a Llama-3.2-3B block's statistics."""
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    write_streamed(path, specs, iter(tensors.values()), metadata)


def copy_side_files(source: Path, target: Path) -> None:
    for name in SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(target) / name)


def write_streamed(path: Path, specs: list[TensorSpec], tensors: Iterator[torch.Tensor],
                   metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, the header first (from `specs`), then each tensor's bytes as `tensors` yields it: one
    tensor in memory at a time, where safetensors' save_file needs them all at once (a whole shard, 0.33 GiB of a
    ViT-B/32 checkpoint). A yielded tensor must match its spec; a failed write is an OSError naming the file. A file
    already at `path` (a spare: RunDir.claim_spare) is written over in place and cut to the new length."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data 8-byte aligned, as safetensors writes it
    with open(path, "r+b" if Path(path).is_file() else "wb") as fh:
        _naming(path, fh.write, struct.pack("<Q", len(raw)) + raw)
        for spec in specs:
            tensor = next(tensors, None)  # the producer's own errors pass as they are
            if tensor is None:
                raise ValueError(f"{path}: no tensor came for {spec.name}: fewer tensors than specs")
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{path}: tensor {spec.name}: expected {spec.dtype} {list(spec.shape)}, got "
                                 f"{tensor.dtype} {list(tensor.shape)}")
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            _naming(path, fh.write, data.numpy().data)
            del tensor, data  # before the next is computed
        _naming(path, fh.truncate)
        _naming(path, fh.flush)


def _naming(path: Path, call: Callable[..., object], *args: object) -> None:
    """`call(*args)` on an open file, an OSError re-raised naming it: a failed write says only 'No space left on
    device'."""
    try:
        call(*args)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def write_checkpoint(
    target: Path,
    specs: list[TensorSpec],
    tensors: Iterable[torch.Tensor],
    side_files_from: Path | None = None,
    extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
    max_shard_bytes: int = 512 * 1024**2,
    extra_metadata: dict[str, dict[str, str]] | None = None,
) -> None:
    """Stream `tensors`, one per spec and in their order, into safetensors shards of at most `max_shard_bytes` (a
    tensor larger than that gets a shard of its own); the directory appears only when complete.

    `extra_files` are small side tensors files (per-task heads) written inside the same directory, with the
    safetensors metadata `extra_metadata` gives for the same relative path, if any."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    names = [WEIGHTS_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}.safetensors" for i in range(len(shards))]
    stream = iter(tensors)
    with atomic_path(Path(target)) as tmp:
        tmp.mkdir()
        for name, shard in zip(names, shards, strict=True):
            write_streamed(tmp / name, shard, stream)
        if next(stream, None) is not None:
            raise ValueError(f"{target}: more tensors than the {len(specs)} its specs name")
        if len(shards) > 1:
            weight_map = {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard}
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        for rel, extra in (extra_files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_tensors(extra, tmp / rel, (extra_metadata or {}).get(rel))
