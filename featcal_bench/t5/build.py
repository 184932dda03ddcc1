"""The FLAN-T5 GLUE benchmark builder's stages: the base with its tokenizer, one dataset and one expert per task, each
read from the hub or a local mirror (featcal_bench/t5/spec.py) and written under the benchmark directory.

Each GLUE row is rendered into the experts' text-to-text form (featcal_bench/t5/prompts.py): `text`, the prompt the
encoder reads; `target`, the answer it was trained to give (calibration teacher-forces it); `label`, GLUE's own label
(the score's reference). Each stage returns (outputs relative to the benchmark directory, info) so
`tasks.record.recorded` can cache it, and writes through `atomic_path`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import datasets
from datasets import ClassLabel, Value
from transformers import AutoTokenizer, T5ForConditionalGeneration

from featcal.data import pick_examples
from featcal_bench.layout import BASE, data_dir
from featcal_bench.mirror import dataset_split, expert_stage, pretrained, write_pretrained
from featcal_bench.recipe import Stage
from featcal_bench.t5.prompts import LABEL_WORDS, SCORE_FORMAT, TEMPLATES
from featcal_bench.t5.spec import BASE_MODEL, GLUE_TASKS, T5BenchSpec
from storage.atomic import atomic_path

log = logging.getLogger("featcal")

TEXT, TARGET, LABEL = "text", "target", "label"


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """FLAN-T5-base with its tokenizer (the pipeline tokenizes every prompt with the base's), re-saved here."""
    return write_pretrained(bench, BASE, T5BenchSpec.load(bench), BASE_MODEL, T5ForConditionalGeneration, AutoTokenizer)


def _split(spec: T5BenchSpec, task: str, split: str) -> datasets.Dataset:
    splits = ("train", GLUE_TASKS[task].validation)
    config = None if spec.data_from else task  # a mirror's directory is the task's configuration already
    return dataset_split(spec.data_source(task), config, split, bool(spec.data_from), splits)


def _checked(ds: datasets.Dataset, task: str, split: str, source: str) -> datasets.Dataset:
    """The columns the task's prompt reads, and its label: a ClassLabel with one class per label word, or (stsb) a
    float score."""
    columns, label = GLUE_TASKS[task].columns, ds.features.get(LABEL)
    if task in LABEL_WORDS:
        classes = len(LABEL_WORDS[task])
        fits, wanted = (
            isinstance(label, ClassLabel) and label.num_classes == classes,
            f"a ClassLabel of {classes} classes",
        )
    else:
        fits, wanted = isinstance(label, Value) and label.dtype.startswith("float"), "a float score"
    if not fits or any(c not in ds.features for c in columns):
        raise ValueError(f"{source} ({split}): expected string columns {list(columns)} and `label` {wanted} (the "
                         f"{task} prompt's); it has {dict(ds.features)}")
    return ds.select_columns([*columns, LABEL])


def rendered(ds: datasets.Dataset, task: str) -> datasets.Dataset:
    """Each row as the expert saw it: the prompt (`text`) and the answer (`target`), beside GLUE's `label`."""

    def render(row: dict[str, Any]) -> dict[str, str]:
        label = row[LABEL]
        target = LABEL_WORDS[task][label] if task in LABEL_WORDS else SCORE_FORMAT.format(label)
        return {TEXT: TEMPLATES[task].format(**{c: row[c] for c in GLUE_TASKS[task].columns}), TARGET: target}

    # In memory: a cache file beside the source's would write into the mirror, and change its fingerprint.
    return ds.map(render, remove_columns=list(GLUE_TASKS[task].columns), keep_in_memory=True
                  ).select_columns([TEXT, TARGET, LABEL])


def write_data(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    """A seeded calibration pool from the train split and the validation split (all of it, or a seeded subset),
    both rendered into prompts and answers."""
    spec = T5BenchSpec.load(bench)
    validation, where = GLUE_TASKS[task].validation, spec.data_name(task)
    train, test = (_checked(_split(spec, task, s), task, s, where) for s in ("train", validation))
    out = datasets.DatasetDict({
        "calibration": rendered(pick_examples(train, spec.calibration, spec.seed, f"{where} train"), task),
        "test": rendered(test if spec.test_rows is None else
                         pick_examples(test, spec.test_rows, spec.seed, f"{where} {validation}"), task),
    })
    with atomic_path(bench / data_dir(task)) as tmp:
        out.save_to_disk(str(tmp))
    log.info("data %s: %s", task, {k: len(v) for k, v in out.items()})
    return [data_dir(task)], {"source": where, "test_split": validation, **{s: len(rows) for s, rows in out.items()}}


T5_BUILD_STAGES: dict[str, Stage] = {"t5-base": write_base, "t5-data": write_data, "t5-expert": expert_stage(
    T5BenchSpec, lambda spec, hub_id: pretrained(T5ForConditionalGeneration, spec, hub_id))}
