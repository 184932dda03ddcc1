"""Drift bookkeeping (all tokens and the head token), the drift section of the report, and the per-batch
progress lines of the evaluate stage; functions called directly, on small random tensors."""

import logging
import math
import re

import pytest
import torch

from featcal.evaluation import EvalProgress, TaskScores, drift_definition, drift_plot, markdown, summarize

BOUNDARIES, B, T, D = 3, 4, 6, 5


def _batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    expert = tuple(torch.randn(B, T, D, generator=g) for _ in range(BOUNDARIES))
    models = {m: tuple(e + scale * torch.randn(B, T, D, generator=g) for e in expert)
              for m, scale in (("merged", 0.8), ("calibrated", 0.3))}
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    # Padding positions get large garbage values: any leak into the sums would show.
    for h in (*expert, *(x for hs in models.values() for x in hs)):
        h.masked_fill_(~mask.bool()[..., None], 1e3)
    return expert, models, mask


BATCHES = [_batch(0, [6, 3, 1, 4]), _batch(1, [2, 6, 5, 1])]


def _scores(head_index):
    scores = TaskScores(head_index=head_index)
    for expert, models, mask in BATCHES:
        scores.add_reference(expert, mask)
        for name, hidden in models.items():
            scores.add_drift(name, hidden, expert, mask)
        scores.seen += B
    return scores.summary()


def _brute(model: str, token: int | None) -> list[float]:
    """sqrt(Σ‖h − e‖² / Σ‖e‖²) over every row (and token, or just `token`) that is not padding, by loops."""
    out = []
    for k in range(BOUNDARIES):
        diff = ref = 0.0
        for expert, models, mask in BATCHES:
            for i in range(B):
                for t in range(T) if token is None else [token]:
                    if mask[i, t]:
                        diff += sum(
                            (models[model][k][i, t, d].item() - expert[k][i, t, d].item()) ** 2 for d in range(D)
                        )
                        ref += sum(expert[k][i, t, d].item() ** 2 for d in range(D))
        out.append(math.sqrt(diff / ref))
    return out


@pytest.mark.parametrize("head_index", [0, 2])
def test_head_token_drift_matches_brute_force(head_index):
    # Token 2 is padding in three of the eight rows: those rows must not count for the head token.
    s = _scores(head_index)
    for model in ("merged", "calibrated"):
        assert s["drift"][model] == pytest.approx(_brute(model, None), rel=1e-5)
        assert s["drift_head_token"][model] == pytest.approx(_brute(model, head_index), rel=1e-5)
        assert s["last_boundary_drift"][model] == pytest.approx(
            {"all_tokens": _brute(model, None)[-1], "head_token": _brute(model, head_index)[-1]}, rel=1e-5)
    # The two measures really differ here (one token vs all), and calibrated is the closer one on both.
    assert s["drift_head_token"]["merged"] != pytest.approx(s["drift"]["merged"], rel=1e-3)
    assert all(c < m for c, m in zip(s["drift_head_token"]["calibrated"], s["drift_head_token"]["merged"]))


def test_no_pooled_token_means_head_reads_all_tokens():
    s = _scores(None)
    assert s["drift"]["merged"] == pytest.approx(_brute("merged", None), rel=1e-5)
    assert s["drift_head_token"] == s["drift"]
    assert s["last_boundary_drift"]["calibrated"]["head_token"] == s["drift"]["calibrated"][-1]
    assert drift_definition(None)["head_token_index"] is None
    assert "equals the all-token drift" in drift_definition(None)["drift_head_token"]


def _report(head_index):
    a, b = _scores(head_index), _scores(head_index)
    # A second task with other numbers, so that per-task rows and the average differ.
    b["drift"] = {m: [2 * x for x in v] for m, v in b["drift"].items()}
    b["drift_head_token"] = {m: [3 * x for x in v] for m, v in b["drift_head_token"].items()}
    b["last_boundary_drift"] = {m: {"all_tokens": b["drift"][m][-1], "head_token": b["drift_head_token"][m][-1]}
                                for m in b["drift"]}
    for s in (a, b):
        s["accuracy"] = {"merged": 0.5, "calibrated": 0.75, "expert": 1.0}
    tasks = {"alpha": a, "beta": b}
    return {"method": "featcal", "models": ["merged", "calibrated", "expert"], "tasks": tasks,
            "summary": summarize(tasks), "drift_definition": drift_definition(head_index)}


def test_summary_keeps_average_drift_and_adds_head_token_keys():
    report = _report(0)
    a, b = report["tasks"]["alpha"], report["tasks"]["beta"]
    summary = report["summary"]
    # The old key keeps its meaning: all-token drift averaged over tasks, per boundary.
    assert summary["average_drift"]["merged"] == pytest.approx([1.5 * x for x in a["drift"]["merged"]])
    assert summary["average_drift_head_token"]["calibrated"] == pytest.approx(
        [2 * x for x in a["drift_head_token"]["calibrated"]])
    assert summary["average_last_boundary_drift"]["merged"] == pytest.approx(
        {"all_tokens": 1.5 * a["drift"]["merged"][-1], "head_token": 2 * a["drift_head_token"]["merged"][-1]})
    assert b["last_boundary_drift"]["merged"]["head_token"] == pytest.approx(3 * a["drift_head_token"]["merged"][-1])


def test_markdown_labels_both_figures_per_task():
    report = _report(0)
    md = markdown(report)
    assert md.count("lower is better") >= 3
    assert "token 0 (CLS)" in md
    header = "| task | merged · all tokens | merged · head token | calibrated · all tokens | calibrated · head token |"
    assert header in md
    for task, s in report["tasks"].items():
        lb = s["last_boundary_drift"]
        row = (f"| {task} | {lb['merged']['all_tokens']:.4f} | {lb['merged']['head_token']:.4f} | "
               f"{lb['calibrated']['all_tokens']:.4f} | {lb['calibrated']['head_token']:.4f} |")
        assert row in md
    avg = report["summary"]["average_last_boundary_drift"]
    assert f"| **average** | {avg['merged']['all_tokens']:.4f} | {avg['merged']['head_token']:.4f} |" in md
    every = report["summary"]
    assert ("| boundary | merged · all tokens | calibrated · all tokens | merged · head token | "
            "calibrated · head token |") in md
    last = BOUNDARIES - 1
    assert (
        f"| {last} | {every['average_drift']['merged'][last]:.4f} | {every['average_drift']['calibrated'][last]:.4f} | "
        f"{every['average_drift_head_token']['merged'][last]:.4f} | "
        f"{every['average_drift_head_token']['calibrated'][last]:.4f} |"
    ) in md


def test_markdown_without_pooled_token_says_the_head_reads_all_tokens():
    md = markdown(_report(None))
    assert "lower is better" in md
    assert "reads every token" in md and "all-token figure is also the head figure" in md
    assert "| task | merged · all tokens = head | calibrated · all tokens = head |" in md
    assert "head token |" not in md


def test_markdown_of_an_older_report_still_shows_the_average_table():
    report = _report(0)
    del report["drift_definition"]
    for key in ("average_drift_head_token", "average_last_boundary_drift"):
        del report["summary"][key]
    md = markdown(report)
    assert "| boundary | merged | calibrated |" in md and "lower is better" in md


@pytest.mark.parametrize("head_index", [0, None])
def test_drift_plot_writes_a_png(tmp_path, head_index):
    path = tmp_path / "drift.png"
    drift_plot(_report(head_index), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_lines_with_eta(caplog):
    clock = _Clock()
    progress = EvalProgress({"a": 10, "b": 6}, batch_size=4, min_interval=2.0, clock=clock)
    assert (progress.batches("a"), progress.batches("b")) == (3, 2)
    caplog.set_level(logging.INFO, logger="featcal")
    for task, sizes in (("a", [4, 4, 2]), ("b", [4, 2])):
        done = 0
        for i, n in enumerate(sizes, start=1):
            clock.now += 1.0  # one second per batch
            done += n
            progress.step(task, i, done, n)
    lines = [r.getMessage() for r in caplog.records if r.name == "featcal"]
    # a: batch 2 comes 1 s after batch 1 and is skipped; batch 3 is the task's last; b: both are edges.
    assert lines == [
        "evaluate · a: batch 1/3, 4/10 examples (4/16 all tasks), elapsed 00:00:01, ETA 00:00:03",
        "evaluate · a: batch 3/3, 10/10 examples (10/16 all tasks), elapsed 00:00:03, ETA 00:00:01",
        "evaluate · b: batch 1/2, 4/6 examples (14/16 all tasks), elapsed 00:00:04, ETA 00:00:00",
        "evaluate · b: batch 2/2, 6/6 examples (16/16 all tasks), elapsed 00:00:05, ETA 00:00:00",
    ]


def test_progress_logs_every_batch_when_batches_are_slow(caplog):
    clock = _Clock()
    progress = EvalProgress({"only": 40}, batch_size=10, min_interval=2.0, clock=clock)
    caplog.set_level(logging.INFO, logger="featcal")
    for i in range(1, 5):
        clock.now += 30.0
        progress.step("only", i, 10 * i, 10)
    etas = [re.search(r"ETA (\S+)$", r.getMessage()).group(1) for r in caplog.records]
    assert etas == ["00:01:30", "00:01:00", "00:00:30", "00:00:00"]
