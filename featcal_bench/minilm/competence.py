"""Are a benchmark's experts competent? Each expert against its test split's majority class and against the
task-arithmetic merge of all the benchmark's experts (the expert's own head on the merged body).

The demo states its rule in its spec (`BenchSpec.competence`); `bench build` checks it after the experts
(featcal_bench/stages.py) and `benchmarks/demo_tasks.py` writes the figures of every candidate task.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, BertForSequenceClassification, BertModel
from transformers.utils import logging as hf_logging

from featcal_bench.layout import BASE, data_dir, expert_dir
from featcal_bench.finetune import accuracy
from featcal_bench.minilm.probe import probe_figures
from featcal_bench.minilm.spec import BenchSpec, Competence
from featcal.config import MergeConfig
from featcal.merging import merged_tensor

log = logging.getLogger("featcal")

class IncompetentExperts(ValueError):
    """An expert fails the benchmark's competence rule; the message gives every failing figure."""


def majority_rate(labels: list[int]) -> float:
    return Counter(labels).most_common(1)[0][1] / len(labels)


def _load(cls: type, path: Path) -> torch.nn.Module:
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, local_files_only=True).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def figures(bench: Path, tasks: list[str], max_length: int, scaling: float = 0.3, probe: bool = False) -> dict[str, dict[str, Any]]:
    """Per task, on its test split: majority-class rate, expert accuracy, task arithmetic's accuracy
    (θ0 + scaling·Σ task vectors over `tasks`, every body tensor; each task keeps its own head) and, with
    `probe`, a linear probe's on the frozen base (featcal_bench/minilm/probe.py)."""
    bench = Path(bench)
    hf_logging.disable_progress_bar()  # one bar per model load
    tokenizer = AutoTokenizer.from_pretrained(bench / BASE, local_files_only=True)
    base_model = _load(BertModel, bench / BASE)  # the probe's frozen features, and θ0 of the merge
    base = base_model.state_dict()
    experts = {t: _load(BertForSequenceClassification, bench / expert_dir(t)) for t in tasks}
    bodies = {t: m.bert.state_dict() for t, m in experts.items()}
    cfg = MergeConfig(method="task_arithmetic", scaling=scaling)
    merged = {name: merged_tensor(base[name], lambda name=name: (bodies[t][name] for t in tasks), cfg)
              for name in bodies[tasks[0]]}
    out = {}
    for t in tasks:
        splits = datasets.load_from_disk(str(bench / data_dir(t)))
        test = splits["test"]
        row = {"test_rows": len(test), "majority": majority_rate(test["label"]),
               "expert": accuracy(experts[t], tokenizer, test, max_length)}
        experts[t].bert.load_state_dict(merged, strict=True)  # the expert's head on the merged body
        row["merged"] = accuracy(experts[t], tokenizer, test, max_length)
        if probe:
            row.update(probe_figures(base_model, tokenizer, splits, str(bench / data_dir(t)), max_length))
        out[t] = row
        log.info("competence · %s: majority %.1f %%, expert %.1f %%, task arithmetic %.1f %%%s", t,
                 100 * row["majority"], 100 * row["expert"], 100 * row["merged"],
                 f", linear probe {100 * row['probe']:.1f} %" if probe else "")
    return out


def failures(row: dict[str, float], rule: Competence) -> list[str]:
    """What `row` misses of `rule`, in words; empty when it passes. Margins compare in points, rounded to 0.1."""
    margins = [("majority", "majority class", rule.over_majority), ("merged", "task arithmetic", rule.over_merge)]
    if rule.over_probe is not None:
        margins.insert(1, ("probe", "linear probe", rule.over_probe))
    expert = round(100 * row["expert"], 1)
    out = []
    for key, name, margin in margins:
        other = round(100 * row[key], 1)
        if expert < round(other + 100 * margin, 1):
            out.append(f"expert {expert:.1f} % < {name} {other:.1f} % + {100 * margin:g} points")
    return out


def mix_table(walked: list[tuple[str, ...]], mixes: dict[tuple[str, ...], dict[str, dict[str, Any]]],
              rule: Competence, stricter: Mapping[str, Competence] = MappingProxyType({})) -> list[str]:
    """Markdown rows of the task mixes a selection tried, in order: per task expert / TA (expert − TA), ✗ where it
    fails `rule` (or its own rule in `stricter`), and what failed."""
    lines = ["| mix | task: expert / TA (expert − TA) | verdict |", "|---|---|---|"]
    for combo in walked:
        rows = mixes[combo]
        missed = {t: failures(rows[t], stricter.get(t, rule)) for t in combo}
        bad = {t: f for t, f in missed.items() if f}
        cells = "; ".join(f"{t}: {100 * rows[t]['expert']:.1f} / {100 * rows[t]['merged']:.1f} "
                          f"({100 * (rows[t]['expert'] - rows[t]['merged']):+.1f}){' ✗' if t in bad else ''}" for t in combo)
        verdict = "pass" if not bad else "; ".join(f"{t}: {', '.join(f)}" for t, f in bad.items())
        lines.append(f"| {', '.join(combo)} | {cells} | {verdict} |")
    return lines


def check(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The build's check stage: the spec's rule on every task; raises IncompetentExperts when one fails."""
    from storage.atomic import write_json

    spec = BenchSpec.load(bench)
    rule = spec.competence
    if rule is None:
        raise ValueError(f"{bench}: benchmark {spec.name!r} states no competence rule")
    rows = figures(bench, spec.tasks, spec.finetune.max_length, rule.scaling, probe=rule.over_probe is not None)
    for t, row in rows.items():
        row["failures"] = failures(row, rule)
    result = {"rule": rule.model_dump(), "tasks": rows, "passed": not any(r["failures"] for r in rows.values())}
    if not result["passed"]:
        bad = "; ".join(f"{t}: {', '.join(r['failures'])}" for t, r in rows.items() if r["failures"])
        raise IncompetentExperts(f"benchmark {spec.name!r}: experts fail its competence rule on the test split: {bad}")
    write_json(bench / CHECK_FILE, result)
    shown = ("majority", "expert", "merged", "probe")
    return [CHECK_FILE], {t: {k: round(100 * r[k], 1) for k in shown if k in r} for t, r in rows.items()}


CHECK_FILE = "checks/competence.json"
