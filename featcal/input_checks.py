"""Checks of what the data and checkpoints hold (not what the config says), each failure one line naming the
culprit: labels a head cannot score, text a tokenizer cannot read, headers that do not parse."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import datasets

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
