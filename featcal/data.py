"""Task data: load a split, pick the calibration examples, and turn rows into model inputs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from featcal.config import DataSource
from featcal.hub import local_dir
from featcal.input_checks import malformed_file_error, pad_with_eos, text_length_limit
from featcal.pixels import DevicePixels, device_pixels

log = logging.getLogger("featcal")

# A batch of rows, column by column: lists, or one numpy array for a fixed-shape array column (`row_batches`).
Rows = dict[str, list[Any] | np.ndarray]
TEXT_COLUMNS = ("text", "sentence", "sentence1", "question", "premise")
IMAGE_COLUMNS = ("image", "img")
# What a saved tokenizer writes (one at least): its fast form, its settings, or a slow tokenizer's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")
FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(ValueError):
    pass


def load_split(source: DataSource, where: str) -> datasets.Dataset:
    """`where` names the config field (e.g. calibration.data.sentiment) for error messages. A hub dataset id is read
    from its snapshot in the local cache (featcal/hub.py; preflight fetched it)."""
    try:
        path = Path(local_dir(source.path, "dataset"))
        if path.is_dir() and not _saved_to_disk(path):  # a hub snapshot or a folder of data files
            return datasets.load_dataset(str(path), source.config, split=source.split)
        if path.is_dir():
            empty = _empty_saved_splits(path)
            if empty:
                raise DataError(f"{where}.path: {path} split {empty[0]!r} has no rows (saved without data files)")
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if source.split not in loaded:
                    raise DataError(f"{where}.split: {source.split!r} is not a split of {path} (has {sorted(loaded)})")
                return loaded[source.split]
            return loaded
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise DataError(f"{where}.path: {path} has suffix {path.suffix!r}; "
                                f"expected one of {sorted(FILE_BUILDERS)}")
            if _file_has_no_rows(path):
                raise DataError(f"{where}.path: {path} has no rows")
            try:
                with _quiet_datasets_errors():
                    return datasets.load_dataset(builder, data_files=str(path), split="train")
            except Exception as exc:
                broken = malformed_file_error(path)
                if broken is None:
                    raise
                raise DataError(f"{where}.path: {path} cannot be read as {builder}: {broken}") from exc
        raise DataError(f"{where}.path: {source.path} does not exist; expected a saved dataset directory, a data file "
                        f"({', '.join(sorted(FILE_BUILDERS))}) or a hub dataset id")
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; name the field and the path either way
        raise DataError(f"{where}.path: cannot load {source.path!r} split {source.split!r}: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    """The first line of a library's message, with its cause's where it wraps one ("An error occurred while
    generating the dataset" says nothing by itself)."""
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    cause = exc.__cause__
    return said if cause is None else f"{said} ({type(cause).__name__}: {_one_line(cause)})"


@contextmanager
def _quiet_datasets_errors() -> Iterator[None]:
    """`datasets` logs a reader's failure ("Failed to read file ...") before raising it; our one line says it."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _saved_to_disk(path: Path) -> bool:
    """A directory `save_to_disk` wrote (a DatasetDict's or a Dataset's)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _file_has_no_rows(path: Path) -> bool:
    """A text data file with nothing past a CSV header (datasets then fails with "Instruction "train" corresponds to
    no data!" or a bare StopIteration); parquet files are left to their own reader."""
    if path.suffix not in (".csv", ".json", ".jsonl"):
        return False
    with path.open(errors="replace") as f:
        lines = [line for _, line in zip(range(2), (line for line in f if line.strip()))]
    return len(lines) <= (1 if path.suffix == ".csv" else 0)


def _empty_saved_splits(path: Path) -> list[str]:
    """Splits saved with no rows: `datasets` writes them without data files, then fails to load the whole directory
    with an IndexError that names nothing."""
    import json

    states = [path / "state.json"] if (path / "state.json").is_file() else sorted(path.glob("*/state.json"))
    return [state.parent.name for state in states if not json.loads(state.read_text()).get("_data_files")]


def pick_examples(ds: datasets.Dataset, n: int, seed: int, where: str) -> datasets.Dataset:
    """A seeded random subset of n rows; fewer rows than asked is said loudly and recorded by the caller."""
    if len(ds) == 0:
        raise DataError(f"{where}: the split has no rows")
    if len(ds) < n:
        log.warning("%s: only %d rows available, %d asked for; using all of them", where, len(ds), n)
    return ds.select(picked_rows(len(ds), n, seed))


def picked_rows(size: int, n: int, seed: int) -> list[int]:
    """The row numbers `pick_examples` takes of `size` rows, without its notice (preflight compares them)."""
    return sorted(np.random.default_rng(seed).permutation(size)[:n].tolist())


class InputBuilder:
    """Turns dataset rows into padded model inputs with the base checkpoint's tokenizer or image processor; on an
    accelerator (`device` not the CPU) the image processor's resize, crop and normalisation run there as tensor ops
    (featcal/pixels.py), on the CPU Pillow does them, which is faster there."""

    def __init__(self, base_dir: str, input_names: tuple[str, ...], source: DataSource, max_length: int,
                 columns: list[str], where: str, device: torch.device | str = "cpu"):
        self.where = where
        self.is_text = "input_ids" in input_names
        self.max_length = text_length_limit(_base_config(base_dir), max_length) if self.is_text else max_length
        self.pair_column = source.text_pair_column
        if source.column is not None and source.column not in columns:
            raise DataError(f"{where}.column: {source.column!r} is not a column of the data (it has {columns})")
        if self.pair_column is not None and self.pair_column not in columns:
            raise DataError(f"{where}.text_pair_column: {self.pair_column!r} is not a column of the data "
                            f"(it has {columns})")
        self.ready: list[str] = [c for c in ("input_ids", "pixel_values") if c in columns and c in input_names]
        self.padding_notice: str | None = None  # set where a tokenizer without a padding token pads with EOS
        self.special_ids: frozenset[int] = frozenset()  # a tokenizer's, which token views never delete
        # The tokenizer or image processor (transformers' Auto classes type what they load as Any), None with ready
        # inputs; the raw column it reads likewise.
        self.processor: Any = None
        self.pixels: DevicePixels | None = None
        self.column: str | None = None
        if self.ready:
            self.pad_id = _pad_token_id(base_dir)
            return
        self.column = source.column or next((c for c in (*TEXT_COLUMNS, *IMAGE_COLUMNS) if c in columns), None)
        if self.column is None:
            raise DataError(
                f"{where}.column: not set, and the data has no model input column: it has columns {columns}, expected "
                f"ready inputs ({', '.join(input_names)}) or a raw column such as {TEXT_COLUMNS + IMAGE_COLUMNS}"
            )
        from transformers import AutoImageProcessor, AutoTokenizer

        local = local_dir(base_dir)
        if "pixel_values" not in input_names and Path(local).is_dir() and not any(
                (Path(local) / name).is_file() for name in TOKENIZER_FILES):
            # transformers then makes an empty tokenizer of the config's class: every word becomes [UNK], silently
            raise DataError(f"{where}: raw text column {self.column!r} needs the base's tokenizer, "
                            f"but {base_dir} holds "
                            f"none of {list(TOKENIZER_FILES)}; expected the tokenizer saved with the base "
                            "(tokenizer.save_pretrained(BASE_DIR))")
        try:
            if "pixel_values" in input_names:
                self.processor = AutoImageProcessor.from_pretrained(local, local_files_only=True)
            else:
                self.processor = AutoTokenizer.from_pretrained(local, local_files_only=True)
        except Exception as exc:
            raise DataError(f"{where}: raw column {self.column!r} needs the base's tokenizer/processor: {exc}") from exc
        if "pixel_values" in input_names and on_accelerator(device):
            self.pixels = device_pixels(self.processor, device)
        if "pixel_values" not in input_names:
            self.padding_notice = pad_with_eos(self.processor, base_dir)
            self.special_ids = frozenset(self.processor.all_special_ids)
        self.pad_id = getattr(self.processor, "pad_token_id", None) or 0

    def text_inputs(self, rows: Rows) -> dict[str, torch.Tensor]:
        """Unpadded token lists → tensors padded to the longest row of these rows."""
        if "input_ids" in self.ready:
            ids = [list(r)[: self.max_length] for r in rows["input_ids"]]
            masks = rows.get("attention_mask")
            masks = [list(m)[: self.max_length] for m in masks] if masks else [[1] * len(r) for r in ids]
            types = rows.get("token_type_ids")
            types = [list(t)[: self.max_length] for t in types] if types else [[0] * len(r) for r in ids]
            width = max(len(r) for r in ids)

            def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
                return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)

            return {"input_ids": pad(ids, self.pad_id), "attention_mask": pad(masks, 0),
                    "token_type_ids": pad(types, 0)}
        pair = rows[self.pair_column] if self.pair_column else None
        enc = self._processor()(rows[self._raw_column()], pair, padding=True, truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        enc.setdefault("token_type_ids", torch.zeros_like(enc["input_ids"]))
        return enc

    def image_inputs(self, rows: Rows) -> dict[str, torch.Tensor]:
        if "pixel_values" in self.ready:
            return {"pixel_values": torch.tensor(np.asarray(rows["pixel_values"], dtype=np.float32))}
        images = rows[self._raw_column()]
        pixels = self.pixels(images) if self.pixels is not None else None  # None: images it does not cover
        if pixels is None:
            pixels = self._processor()(images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels.float()}

    def _processor(self) -> Any:
        """The base's tokenizer or image processor, which only raw columns load."""
        if self.processor is None:
            raise DataError(f"{self.where}: ready model inputs need no tokenizer or image processor")
        return self.processor

    def _raw_column(self) -> str:
        if self.column is None:
            raise DataError(f"{self.where}: no raw text or image column to read")
        return self.column

    def __call__(self, rows: Rows) -> dict[str, torch.Tensor]:
        return self.text_inputs(rows) if self.is_text else self.image_inputs(rows)


def on_accelerator(device: torch.device | str) -> bool:
    """Whether image preprocessing runs as tensor ops on `device` rather than in Pillow: off the CPU only."""
    return torch.device(device).type != "cpu"


def _base_config(base_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(local_dir(base_dir), local_files_only=True)


def _pad_token_id(base_dir: str) -> int:
    import json

    config = json.loads((Path(local_dir(base_dir)) / "config.json").read_text())
    return int(config.get("pad_token_id") or 0)


def pad_to(inputs: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad token inputs to a fixed width so every chunk of a task has the same sequence length."""
    out = {}
    for name, value in inputs.items():
        if name == "pixel_values":
            out[name] = value
            continue
        fill = pad_id if name == "input_ids" else 0
        extra = width - value.shape[1]
        out[name] = torch.nn.functional.pad(value, (0, extra), value=fill) if extra > 0 else value
    return out


def token_views(inputs: dict[str, torch.Tensor], count: int, drop: float, keep_ids: frozenset[int], pad_id: int,
                seed: int, first: int) -> dict[str, torch.Tensor]:
    """Each row followed by `count` views of it with round(drop·m) of its m droppable tokens deleted (at least one),
    in the row's width. Row i is example `first + i`, and its views are seeded by (seed, first + i, view), so a view
    does not depend on the batch size. Kept always: the first and last real token, the last token of each segment
    (a pair's separator, even without a tokenizer) and `keep_ids`."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    segments = inputs.get("token_type_ids")
    special = torch.tensor(sorted(keep_ids), dtype=ids.dtype)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in inputs}
    for i in range(ids.shape[0]):
        real = mask[i].nonzero().flatten()
        keep = torch.isin(ids[i], special)
        keep[real[[0, -1]]] = True
        if segments is not None:
            keep[:-1] |= segments[i, :-1] != segments[i, 1:]
        droppable = real[~keep[real]]
        for name in inputs:
            rows[name].append(inputs[name][i])
        for view in range(1, count + 1):
            gone = _dropped(droppable, drop, np.random.default_rng([seed, first + i, view]))
            kept = real[~torch.isin(real, gone)]
            for name, value in inputs.items():
                row = torch.full_like(value[i], pad_id if name == "input_ids" else 0)
                row[int(real[0]):int(real[0]) + len(kept)] = value[i, kept]
                rows[name].append(row)
    return {name: torch.stack(values) for name, values in rows.items()}


def _dropped(droppable: torch.Tensor, drop: float, rng: np.random.Generator) -> torch.Tensor:
    if len(droppable) < 2:  # deleting the only free token would leave nothing to vary
        return droppable[:0]
    k = max(1, round(drop * len(droppable)))
    return droppable[torch.from_numpy(np.sort(rng.choice(len(droppable), k, replace=False)))]


# Fixed-shape array features: read as numpy, not as nested Python lists.
ARRAY_FEATURES = (datasets.Array2D, datasets.Array3D, datasets.Array4D, datasets.Array5D)


def row_batches(ds: datasets.Dataset, batch_size: int) -> Iterator[Rows]:
    """`ds` in batches of rows, column by column. Fixed-shape array columns (ready pixel values) come as one numpy
    array a batch: as Python lists, 32 ViT-B/32 images took 0.37 s to read (0.04 s as numpy), more than a block's
    forward over them."""
    arrays = [name for name, feature in ds.features.items() if isinstance(feature, ARRAY_FEATURES)]
    if arrays:
        ds = ds.with_format("numpy", columns=arrays, output_all_columns=True)
    for start in range(0, len(ds), batch_size):
        yield ds[start:start + batch_size]
