"""The CLIP benchmark builder's stages: the CLIPModel, its vision tower as the base, one dataset and one expert per
task, each read from the hub or a local mirror (featcal_bench/clip/spec.py) and written under the benchmark directory.

Each returns (outputs relative to the benchmark directory, info) so `tasks.record.recorded` can cache it; each
writes through `atomic_path`, so a killed build leaves nothing half-written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import datasets
from datasets import ClassLabel, Image
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel, CLIPVisionModel
from transformers.utils import logging as hf_logging

from featcal.data import pick_examples
from featcal_bench.clip.prompts import CLASS_NAMES
from featcal_bench.clip.spec import BASE_MODEL, CLIP_TASKS, ClipBenchSpec
from featcal_bench.layout import BASE, data_dir
from featcal_bench.mirror import dataset_split, expert_stage, pretrained, write_pretrained
from featcal_bench.recipe import Stage
from storage.atomic import atomic_path

log = logging.getLogger("featcal")

CLIP = "clip"  # the full CLIPModel: the zero-shot heads' text tower, projections and tokenizer
SPLITS = ("train", "test")


def write_clip(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The CLIPModel with its tokenizer and image processor, re-saved by this transformers."""
    return write_pretrained(bench, CLIP, ClipBenchSpec.load(bench), BASE_MODEL, CLIPModel, AutoTokenizer,
                            AutoImageProcessor)


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The CLIPModel's vision tower as a CLIPVisionModel, with the image processor that reads the raw images: the
    model every expert was fine-tuned from."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a table of every text-tower tensor it leaves out, each time
    try:
        tower = CLIPVisionModel.from_pretrained(bench / CLIP, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    with atomic_path(bench / BASE) as tmp:
        tower.save_pretrained(tmp)
        AutoImageProcessor.from_pretrained(bench / CLIP, local_files_only=True).save_pretrained(tmp)
    return [BASE], {"parameters": sum(p.numel() for p in tower.parameters())}


def _split(spec: ClipBenchSpec, task: str, split: str) -> datasets.Dataset:
    return dataset_split(spec.data_source(task), CLIP_TASKS[task].config, split, bool(spec.data_from), SPLITS)


def _checked(ds: datasets.Dataset, task: str, split: str, source: str) -> datasets.Dataset:
    """Its `image` and `label` columns, the label a ClassLabel with as many classes as the task's prompts name."""
    label, image = ds.features.get("label"), ds.features.get("image")
    classes = len(CLASS_NAMES[task])
    if not isinstance(image, Image) or not isinstance(label, ClassLabel) or label.num_classes != classes:
        raise ValueError(f"{source} ({split}): expected an `image` Image column and a `label` ClassLabel of {classes} "
                         f"classes (the {task} prompts' class names); it has {dict(ds.features)}")
    return ds.select_columns(["image", "label"])


def write_data(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    """A seeded calibration pool from the train split and the test split (all of it, or a seeded subset)."""
    spec = ClipBenchSpec.load(bench)
    source = spec.data_name(task)
    train, test = (_checked(_split(spec, task, s), task, s, source) for s in SPLITS)
    out = datasets.DatasetDict({
        "calibration": pick_examples(train, spec.calibration, spec.seed, f"{source} train"),
        "test": test if spec.test_rows is None else pick_examples(test, spec.test_rows, spec.seed, f"{source} test"),
    })
    with atomic_path(bench / data_dir(task)) as tmp:
        out.save_to_disk(str(tmp))
    log.info("data %s: %s", task, {k: len(v) for k, v in out.items()})
    return [data_dir(task)], {"source": source, **{split: len(rows) for split, rows in out.items()}}


CLIP_BUILD_STAGES: dict[str, Stage] = {"clip-clip": write_clip, "clip-base": write_base, "clip-data": write_data,
                     "clip-expert": expert_stage(ClipBenchSpec, lambda spec, hub_id: pretrained(CLIPVisionModel, spec,
                                                                                                 hub_id))}
