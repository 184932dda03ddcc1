"""The model card (README.md) written into a run's `calibrated/` and `merged/` checkpoints.

A pure function of what the run already recorded: its config as `run.yaml` holds it (credentials are
placeholders there, featcal/secrets.py; the card shows no credential-bearing section at all), the architecture
from the checkpoint's config.json, the calibration examples each prepare stage counted, and report.json when
evaluation ran. Hugging Face reads the YAML block at the top (`base_model`, `tags`, `library_name`,
`pipeline_tag`). `base_model` is only ever a hub id: a local path there would publish a directory of this machine
and link to nothing on the hub, so a base given as a path gets one only when the path is a snapshot in the hub cache.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

import yaml

from featcal.hub import hub_ref

MERGE_TAGS = {"task_arithmetic": "task_arithmetic", "ties": "ties", "average": "linear", "dare_linear": "dare_linear",
              "dare_ties": "dare_ties", "tsv_m": "tsv_m", "iso_c": "iso_c", "iso_cts": "iso_cts", "wudi": "wudi",
              "given": "given"}
# What the hub's widgets call the task of a checkpoint, by the end of its architecture's class name.
PIPELINE_TAGS = (
    ("ForSequenceClassification", "text-classification"),
    ("ForCausalLM", "text-generation"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("ForImageClassification", "image-classification"),
)
# Data-source fields the card shows: where the data came from, never how to log in to it.
SOURCE_FIELDS = ("path", "config", "split", "column", "text_pair_column", "label_column", "target_column")
# A snapshot in the hub cache: .../models--ORG--NAME/snapshots/COMMIT[/...].
_CACHED_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}(?:/|$)")


def hub_model_id(base: str) -> str | None:
    """The hub id `base` names (org/name, a pin dropped), from the id itself or from its hub-cache snapshot path;
    None for any other local path."""
    ref = hub_ref(base)
    if ref is not None:
        return ref[0]
    snapshot = _CACHED_SNAPSHOT.search(PurePath(base).as_posix())
    return f"{snapshot['org']}/{snapshot['name']}" if snapshot else None


def pipeline_tag(architecture: str | None) -> str | None:
    return next((tag for suffix, tag in PIPELINE_TAGS if architecture and architecture.endswith(suffix)), None)


def card_metadata(config: dict[str, Any], architecture: str | None) -> dict[str, Any]:
    tags = ["merge", "featcal", MERGE_TAGS[config["merge"]["method"]], config["featcal"]["method"]]
    meta: dict[str, Any] = {}
    base_id = hub_model_id(config["base"])
    if base_id is not None:
        meta["base_model"] = base_id
    meta.update(library_name="transformers", tags=list(dict.fromkeys(tags)))  # calibration method featcal: once
    tag = pipeline_tag(architecture)
    if tag is not None:
        meta["pipeline_tag"] = tag
    return meta


def merged_how(config: dict[str, Any]) -> str:
    if config["merge"]["method"] == "given":
        return (f"the merge of {len(config['experts'])} experts of `{config['base']}` read from "
                f"`{config['merge']['path']}` (made elsewhere)")
    return f"{len(config['experts'])} experts merged into `{config['base']}` with {config['merge']['method']}"


def _settings(section: dict[str, Any]) -> list[str]:
    return [f"| `{k}` | `{v}` |" for k, v in section.items() if k != "data"]


def evaluation_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, float], float | None]]:
    """Per task: its accuracy per evaluated model and the gap closed, (calibrated − merged) / (expert − merged)."""
    rows = []
    for task, scores in report["tasks"].items():
        acc = scores["accuracy"]
        gap = ((acc["calibrated"] - acc["merged"]) / (acc["expert"] - acc["merged"])
               if {"expert", "merged", "calibrated"} <= acc.keys() and acc["expert"] != acc["merged"] else None)
        rows.append((task, acc, gap))
    return rows


def model_card(config: dict[str, Any], checkpoint: str, architecture: str | None, examples: dict[str, int],
               report: dict[str, Any] | None) -> str:
    """The README.md of `checkpoint` ("calibrated" or "merged") of a run with the (redacted) `config`."""
    meta = yaml.safe_dump(card_metadata(config, architecture), sort_keys=False)
    what = ("the merged model after FeatCal feature calibration" if checkpoint == "calibrated"
            else "the merged model, before calibration")
    lines = [f"---\n{meta}---", "", f"# {checkpoint}", "",
             f"This checkpoint is {what}: {merged_how(config)}, then each block's weights solved so its features "
             "match the experts' on calibration data. Written by FeatCal.", "",
             *([] if hub_model_id(config["base"]) else
               ["The base is a local checkpoint, not a hub repository, so this card names no `base_model`.", ""]),
             "## Experts", "", "| task | expert |", "|---|---|"]
    lines += [f"| {t} | `{path}` |" for t, path in config["experts"].items()]
    lines += ["", "## Merge", "", "| setting | value |", "|---|---|", *_settings(config["merge"]),
              "", "## Calibration", "", "| setting | value |", "|---|---|", *_settings(config["calibration"]),
              *_settings(config["featcal"]), "", "### Calibration data", "",
              "| task | source | split | examples |", "|---|---|---|---|"]
    for t, source in config["calibration"]["data"].items():
        lines.append(f"| {t} | `{source['path']}` | {source['split']} | {examples.get(t, '')} |")
    if report is not None:
        models = report["models"]
        lines += ["", "## Evaluation", "", "| task | " + " | ".join(models) + " | gap closed |",
                  "|---|" + "---|" * (len(models) + 1)]
        for task, acc, gap in evaluation_rows(report):
            cells = [f"{acc[m]:.4f}" if m in acc else "" for m in models]
            lines.append(f"| {task} | " + " | ".join(cells) + f" | {'' if gap is None else f'{gap:.4f}'} |")
    return "\n".join(lines) + "\n"
