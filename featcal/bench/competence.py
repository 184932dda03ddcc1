"""Are a benchmark's experts competent? Each expert against its test split's majority class and against the
task-arithmetic merge of all the benchmark's experts (the expert's own head on the merged body).

The demo states its rule in its spec (`BenchSpec.competence`); `bench build` checks it after the experts
(flows/bench.py) and `benchmarks/demo_tasks.py` writes the figures of every candidate task.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, BertForSequenceClassification, BertModel
from transformers.utils import logging as hf_logging

from featcal.bench.build import BASE, data_dir, expert_dir
from featcal.bench.finetune import encode
from featcal.bench.spec import BenchSpec, Competence
from featcal.config import MergeConfig
from featcal.merging import merged_tensor

log = logging.getLogger("featcal")

EVAL_BATCH = 64  # the pipeline's evaluation batch (featcal.bench.methods.pipeline_config)


class IncompetentExperts(ValueError):
    """An expert fails the benchmark's competence rule; the message gives every failing figure."""


def majority_rate(labels: list[int]) -> float:
    return Counter(labels).most_common(1)[0][1] / len(labels)


def accuracy(model: torch.nn.Module, tokenizer: Any, rows: datasets.Dataset, max_length: int) -> float:
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(rows), EVAL_BATCH):
            batch = rows[start: start + EVAL_BATCH]
            logits = model(**encode(tokenizer, batch, max_length)).logits
            correct += int((logits.argmax(-1) == torch.tensor(batch["label"])).sum())
    return correct / len(rows)


def _load(cls: type, path: Path) -> torch.nn.Module:
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, local_files_only=True).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def figures(bench: Path, tasks: list[str], max_length: int, scaling: float = 0.3) -> dict[str, dict[str, float]]:
    """Per task, on its test split: majority-class rate, expert accuracy, and task arithmetic's accuracy
    (θ0 + scaling·Σ task vectors over `tasks`, every body tensor; each task keeps its own head)."""
    bench = Path(bench)
    hf_logging.disable_progress_bar()  # one bar per model load
    tokenizer = AutoTokenizer.from_pretrained(bench / BASE, local_files_only=True)
    base = _load(BertModel, bench / BASE).state_dict()
    experts = {t: _load(BertForSequenceClassification, bench / expert_dir(t)) for t in tasks}
    bodies = {t: m.bert.state_dict() for t, m in experts.items()}
    cfg = MergeConfig(method="task_arithmetic", scaling=scaling)
    merged = {name: merged_tensor(base[name], lambda name=name: (bodies[t][name] for t in tasks), cfg)
              for name in bodies[tasks[0]]}
    out = {}
    for t in tasks:
        test = datasets.load_from_disk(str(bench / data_dir(t)))["test"]
        row = {"test_rows": len(test), "majority": majority_rate(test["label"]),
               "expert": accuracy(experts[t], tokenizer, test, max_length)}
        experts[t].bert.load_state_dict(merged, strict=True)  # the expert's head on the merged body
        row["merged"] = accuracy(experts[t], tokenizer, test, max_length)
        out[t] = row
        log.info("competence · %s: majority %.1f %%, expert %.1f %%, task arithmetic %.1f %%", t,
                 100 * row["majority"], 100 * row["expert"], 100 * row["merged"])
    return out


def failures(row: dict[str, float], rule: Competence) -> list[str]:
    """What `row` misses of `rule`, in words; empty when it passes. Margins compare in points, rounded to 0.1."""
    out = []
    pts = {k: round(100 * row[k], 1) for k in ("majority", "expert", "merged")}
    if pts["expert"] < pts["majority"] + 100 * rule.over_majority:
        out.append(f"expert {pts['expert']:.1f} % < majority class {pts['majority']:.1f} % + {100 * rule.over_majority:g} points")
    if pts["expert"] < pts["merged"] + 100 * rule.over_merge:
        out.append(f"expert {pts['expert']:.1f} % < task arithmetic {pts['merged']:.1f} % + {100 * rule.over_merge:g} points")
    return out


def check(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The build's check stage: the spec's rule on every task; raises IncompetentExperts when one fails."""
    from storage.atomic import write_json

    spec = BenchSpec.load(bench)
    rule = spec.competence
    if rule is None:
        raise ValueError(f"{bench}: benchmark {spec.name!r} states no competence rule")
    rows = figures(bench, spec.tasks, spec.finetune.max_length, rule.scaling)
    for t, row in rows.items():
        row["failures"] = failures(row, rule)
    result = {"rule": rule.model_dump(), "tasks": rows, "passed": not any(r["failures"] for r in rows.values())}
    if not result["passed"]:
        bad = "; ".join(f"{t}: {', '.join(r['failures'])}" for t, r in rows.items() if r["failures"])
        raise IncompetentExperts(f"benchmark {spec.name!r}: experts fail its competence rule on the test split: {bad}")
    write_json(bench / CHECK_FILE, result)
    return [CHECK_FILE], {t: {k: round(100 * r[k], 1) for k in ("majority", "expert", "merged")} for t, r in rows.items()}


CHECK_FILE = "checks/competence.json"
