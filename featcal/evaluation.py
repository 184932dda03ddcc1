"""Accuracy and feature-drift bookkeeping, and the report files a user reads after a run.

Drift is the relative distance ‖h_model − h_expert‖ / ‖h_expert‖ to the task's expert at each block boundary
(0 = embeddings), summed over the evaluation rows before the ratio is taken; lower is better. It is measured two
ways: over every real (non-padding) token ("all tokens", the `drift` keys), and over the one token the
classification head reads ("head token", the `drift_head_token` keys; the adapter's `pooled_index()`, 0 = CLS).
FeatCal's last-block solve down-weights every token but the head token, so at the last boundary the all-token
drift may rise while the head-token drift, the one the head sees, falls. When the head pools all tokens
(`pooled_index()` is None) the head reads all tokens and the head-token figures equal the all-token ones.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featcal.config import EVALUATED_MODELS as MODELS

METHOD_NAMES = {"featcal": "FeatCal", "regmean": "RegMean", "regmean_plus_plus": "RegMean++", "lot": "LOT Merging"}
DRIFT_MODELS = ("merged", "calibrated")

log = logging.getLogger("featcal")


def head_token_label(index: int | None) -> str:
    """How the report names the token the head reads."""
    if index is None:
        return "all tokens (the head pools every token, or, in a language model, predicts from each)"
    return "token 0 (CLS)" if index == 0 else f"token {index}"


def drift_definition(head_index: int | None) -> dict[str, Any]:
    """The report's `drift_definition`: what the `drift` and `drift_head_token` numbers measure."""
    head = (f"only {head_token_label(head_index)}, the token the classification head reads" if head_index is not None
            else "the head reads every token (it pools them, or a language model predicts from each), so the "
                 "head-token drift equals the all-token drift")
    return {"measure": "relative drift ‖h_model − h_expert‖ / ‖h_expert‖ per block boundary (0 = embeddings)",
            "lower_is_better": True, "drift": "all real (non-padding) tokens", "drift_head_token": head,
            "head_token_index": head_index}


def _sq(x: torch.Tensor) -> float:
    return float((x.double() ** 2).sum())


@dataclass
class TaskScores:
    """Running sums for one task: correct predictions per model, squared drift per boundary, over all real tokens
    and over the head token (`head_index`, None = the head pools all tokens: no separate sums are kept).

    It also keeps every predicted class id per model and the label ids, in row order, so that two models can be
    compared row by row (a paired test) rather than only by their accuracies."""

    correct: dict[str, int] = field(default_factory=dict)
    predictions: dict[str, list[int]] = field(default_factory=dict)
    labels: list[int] = field(default_factory=list)
    seen: int = 0
    drift_diff: dict[str, list[float]] = field(default_factory=dict)
    drift_ref: list[float] = field(default_factory=list)
    head_index: int | None = None
    head_diff: dict[str, list[float]] = field(default_factory=dict)
    head_ref: list[float] = field(default_factory=list)
    # "accuracy", or "spearman" for a regression task answered in text: then `predictions` holds each model's parsed
    # numbers, `labels` the targets, and the accuracy figure is Spearman's ρ.
    metric: str = "accuracy"
    values: dict[str, list[float]] = field(default_factory=dict)
    targets: list[float] = field(default_factory=list)
    # A causal LM: per model (Σ next-token NLL, tokens predicted, tokens predicted right) (`add_next_tokens`); its
    # accuracy figure is then the next-token accuracy.
    next_tokens: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    # Per model, [Σ KL(p_expert ‖ p_model), rows agreeing with the expert's top class, rows]: read through the task's
    # head with no labels (`add_head_errors`).
    head_errors: dict[str, list[float]] = field(default_factory=dict)

    def add_values(self, model: str, values: list[float], targets: list[float]) -> None:
        """One batch of a regression task: `model`'s parsed answers (NaN: none) and the targets (kept once)."""
        kept = self.values.setdefault(model, [])
        kept += values
        if len(kept) > len(self.targets):
            self.targets += targets

    def add_predictions(self, model: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch of `model`'s logits (the predicted class is their argmax)."""
        self.add_predicted(model, logits.argmax(-1), labels)

    def add_predicted(self, model: str, predicted: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch of `model`'s predicted class ids (−1: none; a text-to-text answer that is no label word).
        Every model is given the same rows with the same labels, so the labels are kept once, by the first
        model to reach these rows."""
        self.correct[model] = self.correct.get(model, 0) + int((predicted == labels).sum())
        kept = self.predictions.setdefault(model, [])
        kept += predicted.tolist()
        if len(kept) > len(self.labels):
            self.labels += labels.tolist()

    def add_next_tokens(self, model: str, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """One batch of a causal LM: every real token after a row's first is predicted from the ones before it."""
        self.metric = "next_token_accuracy"
        nll, tokens, right = next_token_sums(logits, input_ids, mask)
        total_nll, total_tokens, total_right = self.next_tokens.get(model, (0.0, 0, 0))
        self.next_tokens[model] = (total_nll + nll, total_tokens + tokens, total_right + right)

    def add_head_errors(self, model: str, expert_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """One batch of `model`'s logits against the expert's, on the same rows (`head_error_sums`)."""
        kl, agree = head_error_sums(expert_logits, logits)
        acc = self.head_errors.setdefault(model, [0.0, 0, 0])
        acc[0] += kl
        acc[1] += agree
        acc[2] += len(logits)

    def _head(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, D]: the head token of every row, zero where that token is padding."""
        return h[:, self.head_index] * mask[:, self.head_index].to(h.dtype)[:, None]

    def add_drift(self, model: str, hidden: tuple[torch.Tensor, ...], expert: tuple[torch.Tensor, ...],
                  mask: torch.Tensor | list[torch.Tensor]) -> None:
        """Σ‖h_model − h_expert‖² over real tokens, and over the head token, per block boundary. `mask` is one
        [B, T] mask, or one per boundary (an encoder–decoder's decoder boundaries have their own tokens)."""
        masks = _per_boundary(mask, len(expert))
        diffs = [float((((h - e) * m.float()[..., None]) ** 2).sum())
                 for h, e, m in zip(hidden, expert, masks, strict=True)]
        acc = self.drift_diff.setdefault(model, [0.0] * len(diffs))
        self.drift_diff[model] = [a + d for a, d in zip(acc, diffs)]
        if self.head_index is not None:
            heads = [_sq(self._head(h, m) - self._head(e, m)) for h, e, m in zip(hidden, expert, masks, strict=True)]
            acc = self.head_diff.setdefault(model, [0.0] * len(heads))
            self.head_diff[model] = [a + d for a, d in zip(acc, heads)]

    def add_reference(self, expert: tuple[torch.Tensor, ...], mask: torch.Tensor | list[torch.Tensor]) -> None:
        """Σ‖h_expert‖² over real tokens, and over the head token, per block boundary (`mask` as in `add_drift`)."""
        masks = _per_boundary(mask, len(expert))
        refs = [float(((e * m.float()[..., None]) ** 2).sum()) for e, m in zip(expert, masks, strict=True)]
        self.drift_ref = [a + r for a, r in zip(self.drift_ref or [0.0] * len(refs), refs)]
        if self.head_index is not None:
            heads = [_sq(self._head(e, m)) for e, m in zip(expert, masks, strict=True)]
            self.head_ref = [a + r for a, r in zip(self.head_ref or [0.0] * len(heads), heads)]

    def summary(self) -> dict[str, Any]:
        """accuracy, `drift` (all tokens), `drift_head_token` (per boundary) and `last_boundary_drift`
        ({model: {"all_tokens", "head_token"}}); drift keys are empty when no drift was measured. When predictions
        were added, also `predictions` ({model: class ids}) and `labels` (label ids), both in row order."""
        acc = {k: v / self.seen for k, v in self.correct.items()} if self.seen else {}
        if self.metric == "spearman":
            acc = {k: spearman(v, self.targets) for k, v in self.values.items()}
        lm = {k: language_model_scores(*v) for k, v in self.next_tokens.items()}
        if lm:
            acc = {k: v["next_token_accuracy"] for k, v in lm.items()}

        def ratios(diff: dict[str, list[float]], ref: list[float]) -> dict[str, list[float]]:
            return {k: [math.sqrt(d / r) if r > 0 else 0.0 for d, r in zip(v, ref)] for k, v in diff.items()}

        drift = ratios(self.drift_diff, self.drift_ref)
        if self.head_index is None:  # the head pools every token: its figure is the all-token one
            head = {k: list(v) for k, v in drift.items()}
        else:
            head = ratios(self.head_diff, self.head_ref)
        last = {k: {"all_tokens": drift[k][-1], "head_token": head[k][-1]} for k in drift if drift[k]}
        out: dict[str, Any] = {"examples": self.seen, "accuracy": acc, "drift": drift, "drift_head_token": head,
                               "last_boundary_drift": last}
        if self.predictions:
            out |= {"predictions": self.predictions, "labels": self.labels}
        if self.head_errors:
            out["expert_agreement"] = {k: agree / rows for k, (_, agree, rows) in self.head_errors.items()}
            out["expert_kl"] = {k: kl / rows for k, (kl, _, rows) in self.head_errors.items()}
        if lm:
            out["language_model"] = lm
        if self.metric != "accuracy":
            out["metric"] = self.metric
        return out


def next_token_sums(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int, int]:
    """(Σ NLL in nats, tokens, tokens whose argmax is right) over the positions whose token and the one before it are
    real: logits [B, T, V] at position t predict token t + 1. The log-softmax runs one row at a time (a real LLM's
    vocabulary makes [B, T, V] in float32 large)."""
    nll, tokens, right = 0.0, 0, 0
    for row_logits, ids, real in zip(logits, input_ids, mask.bool(), strict=True):
        scored = real[:-1] & real[1:]
        predicted, target = row_logits[:-1][scored].float(), ids[1:][scored]
        if target.numel():
            nll += float(torch.nn.functional.cross_entropy(predicted, target, reduction="sum").double())
            right += int((predicted.argmax(-1) == target).sum())
            tokens += int(target.numel())
    return nll, tokens, right


def head_error_sums(expert_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    """Σ over rows of KL(p_expert ‖ p_model) in nats, and the rows whose top class is the expert's: a task's error
    read through its own head with no labels, the expert's prediction being the target."""
    log_p = torch.log_softmax(expert_logits.double(), -1)
    log_q = torch.log_softmax(logits.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return float(kl.sum()), int((expert_logits.argmax(-1) == logits.argmax(-1)).sum())


def language_model_scores(nll: float, tokens: int, right: int) -> dict[str, float]:
    """Mean token loss (nats), its perplexity, and next-token accuracy, from `next_token_sums` totals."""
    loss = nll / tokens if tokens else math.nan
    return {"loss": loss, "perplexity": math.exp(loss) if tokens else math.nan,
            "next_token_accuracy": right / tokens if tokens else math.nan, "tokens": tokens}


def _per_boundary(mask: torch.Tensor | list[torch.Tensor], boundaries: int) -> list[torch.Tensor]:
    return list(mask) if isinstance(mask, list | tuple) else [mask] * boundaries


def spearman(predicted: list[float], targets: list[float]) -> float:
    """Spearman's ρ of parsed answers against the targets; an unparsable answer (NaN) ranks below every number."""
    floor = min([*targets, *(p for p in predicted if not math.isnan(p))], default=0.0) - 1.0
    from scipy.stats import spearmanr  # here: scipy.stats takes about a second to import, and few runs need it

    rho = spearmanr([floor if math.isnan(p) else p for p in predicted], targets).statistic
    return 0.0 if math.isnan(rho) else float(rho)


class EvalProgress:
    """One INFO line per evaluation batch on the `featcal` logger: task, batch i/n, examples done (task and
    stage), elapsed time and the ETA of the whole evaluate stage (every task), from the examples still to go at
    the stage's rate so far.

    Rate limited: a batch's line is skipped when the last line is under `min_interval` seconds old, except the
    first and the last batch of every task, which are always logged."""

    def __init__(self, rows: dict[str, int], batch_size: int, min_interval: float = 2.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.rows, self.batch_size, self.min_interval, self.clock = dict(rows), batch_size, min_interval, clock
        self.total = sum(self.rows.values())
        self.done = 0
        self.started = clock()
        self.last_logged: float | None = None

    def batches(self, task: str) -> int:
        return math.ceil(self.rows[task] / self.batch_size)

    def step(self, task: str, batch: int, task_done: int, n: int) -> None:
        """After batch `batch` (1-based) of `task`, which held `n` rows and brought the task to `task_done`."""
        self.done += n
        now = self.clock()
        total_batches = self.batches(task)
        edge = batch == 1 or batch == total_batches
        if not edge and self.last_logged is not None and now - self.last_logged < self.min_interval:
            return
        self.last_logged = now
        elapsed = now - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        log.info("evaluate · %s: batch %d/%d, %d/%d examples (%d/%d all tasks), elapsed %s, ETA %s",
                 task, batch, total_batches, task_done, self.rows[task], self.done, self.total,
                 hms(elapsed), hms(eta))


def hms(seconds: float) -> str:
    """A duration as HH:MM:SS, for progress lines."""
    return time.strftime("%H:%M:%S", time.gmtime(max(0.0, seconds)))


def summarize(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Averages over tasks, normalised accuracy (model / expert) and gap closed ((cal − merged)/(expert − merged))."""
    scored = {t: s["accuracy"] for t, s in tasks.items() if s["accuracy"]}
    avg = {m: sum(a[m] for a in scored.values()) / len(scored)
           for m in MODELS if scored and all(m in a for a in scored.values())}
    out: dict[str, Any] = {"average_accuracy": avg}
    if "expert" in avg and avg["expert"] > 0:
        out["normalized_accuracy"] = {m: v / avg["expert"] for m, v in avg.items()}
    if {"merged", "calibrated", "expert"} <= avg.keys() and avg["expert"] != avg["merged"]:
        out["gap_closed"] = (avg["calibrated"] - avg["merged"]) / (avg["expert"] - avg["merged"])
    out |= _language_model_summary(tasks)
    drifts = [s["drift"] for s in tasks.values() if s["drift"]]
    if drifts:
        out["average_drift"] = _average(drifts)  # all tokens; the key older readers know
        heads = [s.get("drift_head_token") or s["drift"] for s in tasks.values() if s["drift"]]
        out["average_drift_head_token"] = _average(heads)
        out["average_last_boundary_drift"] = {
            m: {"all_tokens": out["average_drift"][m][-1], "head_token": out["average_drift_head_token"][m][-1]}
            for m in out["average_drift"] if out["average_drift"][m]
        }
    return out


def _language_model_summary(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Causal LMs: the token loss averaged over tasks (and its perplexity), and the gap closed in loss terms,
    (merged − calibrated) / (merged − expert): like the accuracy gap, 1 when calibration reaches the experts."""
    scored = [s["language_model"] for s in tasks.values() if s.get("language_model")]
    if not scored:
        return {}
    loss = {m: sum(lm[m]["loss"] for lm in scored) / len(scored) for m in MODELS if all(m in lm for lm in scored)}
    out: dict[str, Any] = {"average_loss": loss, "average_loss_perplexity": {m: math.exp(v) for m, v in loss.items()}}
    if {"merged", "calibrated", "expert"} <= loss.keys() and loss["expert"] != loss["merged"]:
        out["gap_closed_loss"] = (loss["merged"] - loss["calibrated"]) / (loss["merged"] - loss["expert"])
    return out


def _average(per_task: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    return {m: [sum(d[m][i] for d in per_task) / len(per_task) for i in range(len(per_task[0][m]))]
            for m in per_task[0]}


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: one accuracy column per evaluated model (report["models"]), then drift."""
    method = METHOD_NAMES[report["method"]]
    lines = [f"# {method} report", ""]
    if report.get("warnings"):  # degenerate set-ups (featcal/setup_checks.py): read them before the figures
        lines += ["## Warnings", "", *(f"- {w}" for w in report["warnings"]), ""]
    if report["method"] != "featcal":
        lines += [f"`calibrated` is the {method} solution; `merged` is the merge it started from.", ""]
    tasks, models = report["tasks"], report["models"]
    if any(s.get("language_model") for s in tasks.values()):
        lines += language_model_markdown(report)
    if any(s["accuracy"] for s in tasks.values()):
        if any(s.get("metric") == "next_token_accuracy" for s in tasks.values()):
            lines += ["## Next-token accuracy (%)", ""]
        lines += ["| task | " + " | ".join(models) + " | examples |", "|---" * (len(models) + 2) + "|"]
        for task, s in tasks.items():
            cells = [f"{100 * s['accuracy'][m]:.1f}" if m in s["accuracy"] else "–" for m in models]
            lines.append(f"| {task} | " + " | ".join(cells) + f" | {s['examples']} |")
        avg = report["summary"]["average_accuracy"]
        lines.append("| **average** | " + " | ".join(f"{100 * avg[m]:.1f}" if m in avg else "–" for m in models)
                     + " | |")
        lines.append("")
        if "gap_closed" in report["summary"]:
            gap = 100 * report["summary"]["gap_closed"]
            lines.append(f"Gap closed (calibrated − merged) / (expert − merged): **{gap:.1f} %**")
            lines.append("")
    else:
        lines += ["No task has labelled evaluation data and a head: accuracy not measured.", ""]
    lines += agreement_markdown(report)
    lines += drift_markdown(report)
    return "\n".join(lines) + "\n"


def agreement_markdown(report: dict[str, Any]) -> list[str]:
    """Per task, how often each model's top class is the expert's, and its KL to the expert's prediction: read
    through the task's head, no labels needed. A task the calibration moved off what its head reads shows here as
    lower agreement than the merge's, even where its features drift less."""
    tasks = {t: s for t, s in report["tasks"].items() if s.get("expert_agreement")}
    if not tasks:
        return []
    models = [m for m in report["models"] if all(m in s["expert_agreement"] for s in tasks.values())]
    lines = ["## Agreement with each task's expert (no labels)", "",
             "Share of rows whose top class is the expert's (KL to the expert's prediction, nats).", "",
             "| task | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for task, s in tasks.items():
        cells = [f"{100 * s['expert_agreement'][m]:.1f} ({s['expert_kl'][m]:.3f})" for m in models]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines + [""]


def language_model_markdown(report: dict[str, Any]) -> list[str]:
    """Causal LMs: per task, each model's mean token loss on the task's evaluation text and its perplexity."""
    models, summary = report["models"], report["summary"]
    lines = ["## Token loss in nats (perplexity), lower is better", "",
             "| task | " + " | ".join(models) + " | tokens |", "|---" * (len(models) + 2) + "|"]
    for task, s in report["tasks"].items():
        lm = s.get("language_model") or {}
        cells = [f"{lm[m]['loss']:.4f} ({lm[m]['perplexity']:.2f})" if m in lm else "–" for m in models]
        tokens = next(iter(lm.values()))["tokens"] if lm else 0
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {tokens} |")
    avg = summary.get("average_loss", {})
    lines.append("| **average** | " + " | ".join(
        f"{avg[m]:.4f} ({summary['average_loss_perplexity'][m]:.2f})" if m in avg else "–" for m in models) + " | |")
    lines.append("")
    if "gap_closed_loss" in summary:
        lines += [f"Gap closed in loss (merged − calibrated) / (merged − expert): "
                  f"**{100 * summary['gap_closed_loss']:.1f} %**", ""]
    return lines


def _head_index(report: dict[str, Any]) -> int | None:
    return (report.get("drift_definition") or {}).get("head_token_index")


def drift_markdown(report: dict[str, Any]) -> list[str]:
    """The drift section: the last boundary per task (all tokens and head token side by side), then every
    boundary averaged over tasks. Reports written before the head-token figures show the all-token table only."""
    drift = report["summary"].get("average_drift")
    if not drift:
        return []
    has_head = "average_drift_head_token" in report["summary"]
    index = _head_index(report)
    separate = has_head and index is not None  # a head token distinct from "all tokens"
    models = [m for m in drift if drift[m]]
    last = len(drift[models[0]]) - 1
    lines = ["## Feature drift ‖S(l) − E(l)‖ / ‖E(l)‖ vs each task's expert (lower is better)", ""]
    if separate:
        lines += [f"*all tokens*: over every real (non-padding) token. *head token*: only {head_token_label(index)}, "
                  "the token the classification head reads, which is the drift that reaches the head. FeatCal's "
                  "last-block solve weights that token above the others, so at the last boundary the all-token "
                  "drift may rise while the head-token drift falls.", ""]
    elif has_head:
        lines += ["*all tokens*: over every real (non-padding) token. The head reads every token (it pools them, "
                  "or a language model predicts from each): the all-token figure is also the head figure.", ""]
    if has_head:
        kinds = [("all_tokens", "all tokens"), ("head_token", "head token")]
        if not separate:
            kinds = [("all_tokens", "all tokens = head")]
        cols = [(m, k, f"{m} · {label}") for m in models for k, label in kinds]
        lines += [f"### Last boundary ({last}, the last block's output; the head reads it), per task "
                  "(lower is better)", "",
                  "| task | " + " | ".join(c[2] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
        for task, s in report["tasks"].items():
            lb = s.get("last_boundary_drift") or {}
            lines.append(f"| {task} | " + " | ".join(f"{lb[m][k]:.4f}" if m in lb else "–" for m, k, _ in cols) + " |")
        avg = report["summary"]["average_last_boundary_drift"]
        lines.append("| **average** | " + " | ".join(f"{avg[m][k]:.4f}" if m in avg else "–" for m, k, _ in cols)
                     + " |")
        lines.append("")
    heads = report["summary"].get("average_drift_head_token") if separate else None
    cols = [(drift, m, f"{m} · all tokens" if has_head else m) for m in models]
    cols += [(heads, m, f"{m} · head token") for m in models] if heads else []
    lines += ["### Every boundary, average over tasks (0 = embeddings; lower is better)", "",
              "| boundary | " + " | ".join(c[2] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for i in range(last + 1):
        lines.append(f"| {i} | " + " | ".join(f"{src[m][i]:.4f}" for src, m, _ in cols) + " |")
    return lines


def drift_plot(report: dict[str, Any], path: Path) -> None:
    """One colour per task, dashed = merged, solid = calibrated. Left panel: all tokens; right panel (when the head
    reads one token): that token only. The last boundary is the one the head reads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = _head_index(report)
    separate = index is not None and any("drift_head_token" in s for s in report["tasks"].values())
    pooled = "drift_definition" in report and index is None
    panels = [("drift", "all real tokens (the head reads all of them)" if pooled else "all real tokens")]
    if separate:
        panels.append(("drift_head_token", f"head token only: {head_token_label(index)}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8), sharey=True, squeeze=False)
    drawn = False
    for ax, (key, title) in zip(axes[0], panels):
        for i, (task, s) in enumerate(report["tasks"].items()):
            for model, style in (("merged", "--"), ("calibrated", "-")):
                if model in s.get(key, {}):  # one colour per task: dashed before, solid after
                    ax.plot(s[key][model], style, marker="o", color=f"C{i}", label=f"{task} · {model}")
                    drawn = True
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("block boundary (0 = embeddings; last = what the head reads)")
        ax.set_title(title, fontsize=9)
    axes[0][0].set_ylabel("relative drift vs expert (lower is better)")
    fig.suptitle(f"Feature drift before and after {METHOD_NAMES[report['method']]} (lower is better)", fontsize=10)
    if drawn:  # no drift when neither merged nor calibrated was evaluated
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
