"""Encoder–decoder (T5) inputs and scores: the decoder's target sequences for calibration, from a data column or the
expert's own greedy output; decoder inputs built from them by teacher forcing; and text-to-text scoring of greedy
generations (exact match of label words, or Spearman of a parsed number). docs/design.md §3.7."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import datasets
import torch
from torch import nn
from transformers import AutoTokenizer, GenerationMixin, PreTrainedModel

from featcal.data import DataError
from featcal.modeling import task_model


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """`ids` up to and including its first EOS (all of it when generation stopped at the length limit)."""
    end = next((i for i, t in enumerate(ids) if t in eos), len(ids) - 1)
    return ids[: end + 1]


def generated(model: nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int) -> torch.Tensor:
    """Greedy output sequences [B, 1 + ≤max_new_tokens], the start token first."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate: expected a model with a generation head")
    with torch.inference_mode():
        return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)


def targets_of(model: nn.Module, sequences: torch.Tensor) -> list[list[int]]:
    """Each generated sequence without the start token, up to its first EOS: the target it teacher-forces."""
    if not isinstance(model, PreTrainedModel) or model.generation_config is None:
        raise TypeError(f"{type(model).__name__} has no generation config: expected a model with a generation head")
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    return [_until_eos(row, eos) for row in sequences[:, 1:].tolist()]


def greedy_targets(expert_dir: str | Path, batches: Sequence[dict[str, torch.Tensor]],
                   max_new_tokens: int, base_dir: str | Path | None = None) -> list[list[int]]:
    """Each example's target: the expert's greedy output, without the start token, up to its first EOS (`base_dir`:
    the base a LoRA adapter expert adapts)."""
    model = task_model(expert_dir, base_dir=base_dir)
    return [t for batch in batches for t in targets_of(model, generated(model, batch, max_new_tokens))]


def column_targets(values: list, tokenizer_dir: str | Path, max_length: int, where: str) -> list[list[int]]:
    """Targets from a data column: token id lists as they are (they should end in EOS), text through the base's
    tokenizer (which appends EOS); both truncated to `max_length` tokens."""
    if all(isinstance(v, list | tuple) for v in values):
        targets = [[int(t) for t in v][:max_length] for v in values]
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        except Exception as exc:
            raise DataError(f"{where}.target_column: a text target needs the base's tokenizer: {exc}") from exc
        targets = tokenizer(text_target=[str(v) for v in values], truncation=True, max_length=max_length)["input_ids"]
    empty = next((i for i, t in enumerate(targets) if not t), None)
    if empty is not None:
        raise DataError(f"{where}.target_column: row {empty} has an empty target; expected at least one token")
    return targets


def decoder_batches(targets: list[list[int]], batch_size: int, start_id: int,
                    pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Teacher forcing on each target: decoder_input_ids is the target shifted right (the start token first) and
    decoder_attention_mask covers the target's length; every batch is padded to the task's longest target."""
    width = max(len(t) for t in targets)
    ids = torch.tensor([[start_id, *t[:-1]] + [pad_id] * (width - len(t)) for t in targets], dtype=torch.long)
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in targets], dtype=torch.long)
    return [{"decoder_input_ids": ids[i:i + batch_size], "decoder_attention_mask": mask[i:i + batch_size]}
            for i in range(0, len(targets), batch_size)]


def normalised(text: str) -> str:
    """How a generated answer and a label word are compared: lower case, single spaces, no trailing full stop."""
    return " ".join(text.lower().split()).rstrip(".").rstrip()


def first_number(text: str) -> float:
    """The first number in `text` (a regression answer such as "3.8"), NaN when there is none."""
    found = re.search(r"[-+]?\d*\.?\d+", text)
    return float(found.group()) if found else math.nan


def answer_kind(features: datasets.Features, label_column: str, words: list[str] | None,
                where: str) -> list[str] | None:
    """The label words of a classification task in label-id order (`words` from the config, else the label column's
    ClassLabel names), or None for a regression task (a float label column, scored by Spearman)."""
    feature = features[label_column]
    if words:
        return words
    if isinstance(feature, datasets.ClassLabel):
        return feature.names
    if isinstance(feature, datasets.Value) and feature.dtype.startswith("float"):
        return None
    raise DataError(f"{where}.label_column: {label_column!r} is a {feature}; a text-to-text task needs a ClassLabel "
                    f"column, a float column (regression), or its label words in evaluation.label_words")


def predicted_ids(texts: list[str], words: list[str]) -> torch.Tensor:
    """The label id whose word each generated text is (exact match after `normalised`), −1 for none."""
    index = {normalised(w): i for i, w in enumerate(words)}
    return torch.tensor([index.get(normalised(t), -1) for t in texts], dtype=torch.long)

