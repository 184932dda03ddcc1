"""Accuracy and feature-drift bookkeeping, and the report files a user reads after a run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featcal.config import EVALUATED_MODELS as MODELS

METHOD_NAMES = {"featcal": "FeatCal", "regmean": "RegMean", "regmean_plus_plus": "RegMean++"}


@dataclass
class TaskScores:
    """Running sums for one task: correct predictions per model, squared drift per boundary."""

    correct: dict[str, int] = field(default_factory=dict)
    seen: int = 0
    drift_diff: dict[str, list[float]] = field(default_factory=dict)
    drift_ref: list[float] = field(default_factory=list)

    def add_predictions(self, model: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.correct[model] = self.correct.get(model, 0) + int((logits.argmax(-1) == labels).sum())

    def add_drift(self, model: str, hidden: tuple[torch.Tensor, ...], expert: tuple[torch.Tensor, ...],
                  mask: torch.Tensor) -> None:
        """Σ‖h_model − h_expert‖² and Σ‖h_expert‖² over real tokens, per block boundary."""
        m = mask.float()[..., None]
        diffs = [float((((h - e) * m) ** 2).sum()) for h, e in zip(hidden, expert, strict=True)]
        acc = self.drift_diff.setdefault(model, [0.0] * len(diffs))
        self.drift_diff[model] = [a + d for a, d in zip(acc, diffs)]

    def add_reference(self, expert: tuple[torch.Tensor, ...], mask: torch.Tensor) -> None:
        m = mask.float()[..., None]
        refs = [float(((e * m) ** 2).sum()) for e in expert]
        self.drift_ref = [a + r for a, r in zip(self.drift_ref or [0.0] * len(refs), refs)]

    def summary(self) -> dict[str, Any]:
        acc = {k: v / self.seen for k, v in self.correct.items()} if self.seen else {}
        drift = {
            k: [math.sqrt(d / r) if r > 0 else 0.0 for d, r in zip(v, self.drift_ref)]
            for k, v in self.drift_diff.items()
        }
        return {"examples": self.seen, "accuracy": acc, "drift": drift}


def summarize(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Averages over tasks, normalised accuracy (model / expert) and gap closed ((cal − merged)/(expert − merged))."""
    scored = {t: s["accuracy"] for t, s in tasks.items() if s["accuracy"]}
    avg = {m: sum(a[m] for a in scored.values()) / len(scored) for m in MODELS if scored and all(m in a for a in scored.values())}
    out: dict[str, Any] = {"average_accuracy": avg}
    if "expert" in avg and avg["expert"] > 0:
        out["normalized_accuracy"] = {m: v / avg["expert"] for m, v in avg.items()}
    if {"merged", "calibrated", "expert"} <= avg.keys() and avg["expert"] != avg["merged"]:
        out["gap_closed"] = (avg["calibrated"] - avg["merged"]) / (avg["expert"] - avg["merged"])
    drifts = [s["drift"] for s in tasks.values() if s["drift"]]
    if drifts:
        out["average_drift"] = {
            m: [sum(d[m][i] for d in drifts) / len(drifts) for i in range(len(drifts[0][m]))] for m in drifts[0]
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: one accuracy column per evaluated model (report["models"]), then drift."""
    method = METHOD_NAMES[report["method"]]
    lines = [f"# {method} report", ""]
    if report["method"] != "featcal":
        lines += [f"`calibrated` is the {method} solution; `merged` is the merge it started from.", ""]
    tasks, models = report["tasks"], report["models"]
    if any(s["accuracy"] for s in tasks.values()):
        lines += ["| task | " + " | ".join(models) + " | examples |", "|---" * (len(models) + 2) + "|"]
        for task, s in tasks.items():
            cells = [f"{100 * s['accuracy'][m]:.1f}" if m in s["accuracy"] else "–" for m in models]
            lines.append(f"| {task} | " + " | ".join(cells) + f" | {s['examples']} |")
        avg = report["summary"]["average_accuracy"]
        lines.append("| **average** | " + " | ".join(f"{100 * avg[m]:.1f}" if m in avg else "–" for m in models) + " | |")
        lines.append("")
        if "gap_closed" in report["summary"]:
            lines.append(f"Gap closed (calibrated − merged) / (expert − merged): **{100 * report['summary']['gap_closed']:.1f} %**")
            lines.append("")
    else:
        lines += ["No task has labelled evaluation data and a head: accuracy not measured.", ""]
    drift = report["summary"].get("average_drift")
    if drift:
        lines += ["## Feature drift ‖S(l) − E(l)‖ / ‖E(l)‖ (average over tasks; boundary 0 = embeddings)", ""]
        lines += ["| boundary | " + " | ".join(drift) + " |", "|---" * (len(drift) + 1) + "|"]
        for i in range(len(next(iter(drift.values())))):
            lines.append(f"| {i} | " + " | ".join(f"{drift[m][i]:.4f}" for m in drift) + " |")
    return "\n".join(lines) + "\n"


def drift_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (task, s) in enumerate(report["tasks"].items()):
        for model, style in (("merged", "--"), ("calibrated", "-")):
            if model in s["drift"]:  # one colour per task: dashed before, solid after
                ax.plot(s["drift"][model], style, marker="o", color=f"C{i}", label=f"{task} · {model}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("block boundary (0 = embeddings)")
    ax.set_ylabel("relative drift vs expert")
    ax.set_title(f"Feature drift before and after {METHOD_NAMES[report['method']]}")
    if ax.lines:  # no drift when neither merged nor calibrated was evaluated
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
