"""Checks of what the data and checkpoints hold (not what the config says), each failure one line naming the
culprit: labels a head cannot score, text a tokenizer cannot read, headers that do not parse."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import datasets

from storage.checkpoint import CheckpointError

# Position embeddings of these families start after the padding index, so two of their positions are never usable.
_OFFSET_POSITIONS = {"roberta": 2, "xlm-roberta": 2, "camembert": 2, "longformer": 2}


def usable_positions(config) -> int | None:
    """How many token positions a text model accepts; None where positions are relative (no fixed limit)."""
    text = getattr(config, "text_config", None) or config
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if limit is None or getattr(text, "model_type", "") in ("t5", "mt5", "umt5"):
        return None
    return int(limit) - _OFFSET_POSITIONS.get(getattr(text, "model_type", ""), 0)


def text_length_limit(config, max_length: int) -> int:
    """`max_length`, or the positions the model accepts where it has fewer: longer inputs would crash its
    embeddings, so inputs are cut to this (featcal/data.py), plans size by it and preflight says so."""
    positions = usable_positions(config)
    return max_length if positions is None else min(max_length, positions)


def label_range_error(ds: datasets.Dataset, column: str, num_labels: int, where: str) -> str | None:
    """A label outside [0, num_labels) would be scored as a wrong answer without a word; name the first one seen."""
    labels = ds[column]
    for row, value in enumerate(labels):
        if isinstance(value, bool) or not isinstance(value, int):
            return (f"{where}.label_column: {column!r} row {row} is {value!r} ({type(value).__name__}); expected an "
                    f"integer class id in [0, {num_labels - 1}] for the head's {num_labels} labels")
        if not 0 <= value < num_labels:
            return (f"{where}.label_column: {column!r} row {row} holds label {value}; the expert's head has "
                    f"{num_labels} labels, so expected a value in [0, {num_labels - 1}]")
    return None


def text_type_error(ds: datasets.Dataset, column: str, where: str) -> str | None:
    """A raw text column must hold strings; the tokenizer's own message names none of ours."""
    feature = ds.features.get(column)
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        values = ds[column]
        row = next((i for i, v in enumerate(values) if v is None), None)
        return None if row is None else f"{where}.column: {column!r} row {row} is empty (None); expected text"
    if isinstance(feature, datasets.Value) or isinstance(feature, datasets.Sequence):
        value = ds[0][column]
        return (f"{where}.column: {column!r} row 0 is {value!r} ({type(value).__name__}); expected text (str) "
                "for the tokenizer")
    return None


def safetensors_header_error(directory: str | Path) -> str | None:
    """Every .safetensors file under a checkpoint directory must start with a readable JSON header."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                size_bytes = f.read(8)
                (size,) = struct.unpack("<Q", size_bytes)
                if size > path.stat().st_size - 8:
                    raise ValueError(f"header length {size} exceeds the file's {path.stat().st_size} bytes")
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            return f"{path}: unreadable safetensors header ({exc}); the file is corrupt or truncated"
    return None


def pad_with_eos(tokenizer, directory: str, field: str = "base") -> str | None:
    """A tokenizer without a padding token (Llama's, GPT-2's) pads with its EOS token, as lm-evaluation-harness
    does: padded positions are masked out, so their id never reaches a statistic or a score. Sets it on
    `tokenizer` (every builder of model inputs does, so calibration and evaluation pad alike) and returns the
    notice preflight logs; one with neither token is refused. `field` names the config field of `directory`."""
    if getattr(tokenizer, "pad_token", None) is not None:
        return None
    if tokenizer.eos_token is None:
        raise CheckpointError(f"{field}: the tokenizer of {directory} has no padding token and no EOS token to pad "
                              "with; expected one (set tokenizer.pad_token and save the tokenizer with the base)")
    tokenizer.pad_token = tokenizer.eos_token
    return (f"{field}: the tokenizer of {directory} has no padding token; padding with its EOS token "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), as lm-evaluation-harness does "
            "(padding is masked out)")


def _real_names(id2label: dict | None, num_labels: int) -> list[str] | None:
    """A head's class names in id order, or None where they are transformers' placeholders (LABEL_0, ...)."""
    names = [str((id2label or {}).get(i, f"LABEL_{i}")) for i in range(num_labels)]
    return None if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names


def label_names_check(ds: datasets.Dataset, column: str, id2label: dict | None, num_labels: int, where: str,
                      expert_field: str) -> tuple[str | None, str | None]:
    """(error, warning) from comparing the data's class names (a ClassLabel's) with the head's (config.id2label),
    where both are real names: the same names in another order would score every example against the wrong
    class (refused); other names may be wording only (said, scored by position)."""
    feature = ds.features.get(column)
    head = _real_names(id2label, num_labels)
    if not isinstance(feature, datasets.ClassLabel) or head is None:
        return None, None
    data = list(feature.names)
    ours, theirs = [n.strip().lower() for n in data], [n.strip().lower() for n in head]
    if ours == theirs:
        return None, None
    if sorted(ours) == sorted(theirs):
        return (f"{where}.label_column: {column!r} names its classes {data} but {expert_field}'s head "
                f"(config.id2label) orders them {head}; expected the same order (remap the data with "
                f"Dataset.align_labels_with_mapping(label2id, {column!r}))"), None
    return None, (f"{where}.label_column: {column!r} names its classes {data} but {expert_field}'s head "
                  f"(config.id2label) has {head}; scored by position (label id i is the head's output i)")


def malformed_file_error(path: Path) -> str | None:
    """The first row of a CSV or JSON Lines file that its reader cannot take, named by line (the library's own
    message names a line of its chunk, or none); None where no such row is found."""
    if path.suffix == ".csv":
        with path.open(newline="", errors="replace") as f:
            reader = csv.reader(f)
            try:
                header = next(reader, [])
                start = reader.line_num + 1
                for fields in reader:
                    if fields and len(fields) != len(header):
                        lines = (f"line {start}" if start == reader.line_num else
                                 f"lines {start}-{reader.line_num} (a quote left open?)")
                        return (f"the row on {lines} has {len(fields)} fields; expected {len(header)} as in the "
                                f"header {header}")
                    start = reader.line_num + 1
            except csv.Error as exc:
                return f"line {reader.line_num}: {exc}"
    if path.suffix == ".jsonl":
        with path.open(errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError as exc:
                        return f"line {number} is not JSON ({exc})"
                    if not isinstance(row, dict):
                        return f"line {number} is {type(row).__name__}; expected a JSON object (one row)"
    return None
