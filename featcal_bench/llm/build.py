"""The MergeBench benchmark builder's stages: the base with its tokenizer, one dataset and one expert per domain, each
read from the hub or a local mirror (featcal_bench/llm/spec.py) and written under the benchmark directory.

Each domain's dataset has two splits with a `text` column (the Alpaca-style prompt and response) and `row` (the
source row it came from): `calibration`, a seeded pool, and `test`, held-out rows none of which is in the pool. Each
stage returns (outputs relative to the benchmark directory, info) so `tasks.record.recorded` can cache it, and writes
through `atomic_path`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import AutoModelForCausalLM, AutoTokenizer

from featcal_bench.layout import BASE, data_dir
from featcal_bench.llm.spec import BASE_MODEL, DOMAINS, PROMPT, PROMPT_WITH_INPUT, SOURCE_SPLIT, LlmBenchSpec
from featcal_bench.mirror import MODELS_FLAG, dataset_split, expert_stage, from_source, pretrained
from featcal_bench.recipe import Stage
from storage.atomic import atomic_path

log = logging.getLogger("featcal")

TEXT, ROW = "text", "row"


def _causal_lm(spec: LlmBenchSpec, hub_id: str) -> Any:
    """The hub model in the dtype its files hold (bf16 for MergeBench's: half the disk of float32, which
    transformers 4 would load it in)."""
    source = spec.model_source(hub_id)
    return from_source(lambda: AutoModelForCausalLM.from_pretrained(source, dtype="auto", local_files_only=True),
                       source, bool(spec.models_from), MODELS_FLAG)


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """Llama-3.2-3B with its tokenizer, re-saved here. Llama's tokenizer has no padding token and the pipeline pads
    rows into batches, so it pads with EOS (padding is masked out: the value never reaches a score)."""
    spec = LlmBenchSpec.load(bench)
    model, tokenizer = _causal_lm(spec, BASE_MODEL), pretrained(AutoTokenizer, spec, BASE_MODEL)
    padding = tokenizer.pad_token is None
    if padding:
        tokenizer.pad_token = tokenizer.eos_token
    with atomic_path(bench / BASE) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return [BASE], {"source": spec.model_source(BASE_MODEL), "parameters": sum(p.numel() for p in model.parameters()),
                    "dtype": str(model.dtype), "pad_token": tokenizer.pad_token, "pad_token_set": padding}


def rendered(ds: datasets.Dataset, domain: str) -> datasets.Dataset:
    """Each row as MergeBench's data-using merges read it: the Alpaca-style prompt and the response, in `text`;
    `row` keeps the source row's index."""
    d = DOMAINS[domain]

    def render(row: dict[str, Any], index: int) -> dict[str, Any]:
        extra = (row.get(d.input) if d.input else None) or ""
        fields = {"instruction": row[d.prompt], "response": row[d.response]}
        text = PROMPT_WITH_INPUT.format(**fields, input=extra) if extra else PROMPT.format(**fields)
        return {TEXT: text, ROW: index}

    # In memory: a cache file beside the source's would write into the mirror, and change its fingerprint.
    return ds.map(render, with_indices=True, remove_columns=ds.column_names, keep_in_memory=True)


def _checked(ds: datasets.Dataset, domain: str, source: str) -> datasets.Dataset:
    """The fields the domain's text is made of: its prompt and response, and its optional input where present, each
    a string column."""
    d = DOMAINS[domain]

    def is_text(field: str) -> bool:
        return getattr(ds.features.get(field), "dtype", None) == "string"

    if not (is_text(d.prompt) and is_text(d.response)) or (d.input is not None and d.input in ds.features
                                                           and not is_text(d.input)):
        optional = f" (and optionally {d.input!r})" if d.input else ""
        raise ValueError(f"{source} ({SOURCE_SPLIT}): expected string columns {[d.prompt, d.response]}{optional}, "
                         f"MergeBench's {domain} fields; it has {dict(ds.features)}")
    return ds


def held_out_splits(ds: datasets.Dataset, calibration: int, test_rows: int | None, seed: int,
                    source: str) -> dict[str, datasets.Dataset]:
    """A seeded permutation of the rows: its first `calibration` rows are the calibration pool, and the test rows
    (all the others, or the next `test_rows` of them) are held out: disjoint by construction."""
    if len(ds) <= calibration:
        raise ValueError(f"{source}: {len(ds)} rows; the build keeps {calibration} for calibration and needs at least "
                         "one more to hold out for evaluation")
    order = np.random.default_rng(seed).permutation(len(ds))
    rest = order[calibration:] if test_rows is None else order[calibration:calibration + test_rows]
    return {"calibration": ds.select(sorted(order[:calibration].tolist())), "test": ds.select(sorted(rest.tolist()))}


def write_data(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    """The held-out set of domain `task` rendered into text, split into a calibration pool and disjoint held-out
    rows."""
    spec = LlmBenchSpec.load(bench)
    source = spec.data_name(task)
    rows = _checked(dataset_split(spec.data_source(task), None, SOURCE_SPLIT, bool(spec.data_from), (SOURCE_SPLIT,)),
                    task, source)
    splits = held_out_splits(rendered(rows, task), spec.calibration, spec.test_rows, spec.seed, source)
    out = datasets.DatasetDict(splits)
    with atomic_path(bench / data_dir(task)) as tmp:
        out.save_to_disk(str(tmp))
    log.info("data %s: %s", task, {k: len(v) for k, v in out.items()})
    return [data_dir(task)], {"source": source, "source_rows": len(rows), **{s: len(r) for s, r in out.items()}}


LLM_BUILD_STAGES: dict[str, Stage] = {
    "llm-base": write_base,
    "llm-data": write_data,
    "llm-expert": expert_stage(LlmBenchSpec, _causal_lm),
}
