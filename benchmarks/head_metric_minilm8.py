"""The head metric on a built MiniLM benchmark (issue 33 §1): each task's error in the last block's output.dense
measured through its own head (featcal.head_metric η), next to λ auto and the protecting rounds' kept round, and
with protecting rounds of its own where they ran.

    featcal bench run BENCH --runs ta_featcal ta_featcal_auto_protect4 ta_featcal_auto_head05 ta_featcal_auto_head1
    python benchmarks/head_metric_minilm8.py BENCH --out benchmarks/results/head_metric_minilm8_8tasks.md

For each row: each task's agreement with its expert's top class and KL to its expert's distribution on the validation
rows (merge → calibrated; labels unread), then each task's test accuracy against the merge's, and the row paired with
λ auto on the same test rows. η is kept by a validation-only rule (`kept`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_summary import summarise  # noqa: E402
from featcal_bench.left_behind import accuracy_cells, check_cells  # noqa: E402
from featcal_bench.protect import flagged, head_check, settled  # noqa: E402
from flows.pipeline import machine  # noqa: E402
from storage.atomic import read_json  # noqa: E402

REFERENCE = "ta_featcal_auto"
ROWS = {REFERENCE: "λ auto", "ta_featcal_auto_protect4": "protecting rounds, round 4 (kept)",
        "ta_featcal_auto_head05": "λ auto + head metric η 0.5", "ta_featcal_auto_head1": "λ auto + head metric η 1"}
CANDIDATES = ("ta_featcal_auto_head05", "ta_featcal_auto_head1")
# η 1 and the protecting rounds on top of it (featcal_bench/protect.py), round 0 being η 1 itself
HEAD_ROUNDS = ["ta_featcal_auto_head1", *(f"ta_featcal_auto_head1_protect{k}" for k in range(1, 5))]
ROWS.update({r: f"λ auto + head metric η 1 + protect, round {k}" for k, r in enumerate(HEAD_ROUNDS) if k})


def kept(checks: dict[str, dict]) -> str:
    """The η the rule keeps: of CANDIDATES, the one whose validation check flags the fewest tasks (calibrated
    agreement below the merge's); a tie goes to the higher mean validation agreement. Labels unread."""
    def key(run: str) -> tuple[int, float]:
        tasks = checks[run]["tasks"]
        mean = sum(e["calibrated"]["agreement"] for e in tasks.values()) / len(tasks)
        return len(flagged(checks[run])), -mean
    return min(CANDIDATES, key=key)


def markdown(bench: Path) -> str:
    runs = [r for r in ROWS if (bench / "results" / f"{r}.json").is_file()]
    results = {r: read_json(bench / "results" / f"{r}.json") for r in runs}
    merge = read_json(bench / "results" / "ta_featcal.json")
    tasks = sorted(merge["accuracy"])
    checks = {r: head_check(bench, r) for r in runs}
    rule = kept(checks) if set(CANDIDATES) <= set(runs) else None
    ta = {t: 100 * merge["accuracy"][t]["merged"] for t in tasks}

    def name(run: str) -> str:
        return f"**{ROWS[run]} (kept)**" if run == rule else ROWS[run]

    lines = [f"# The head metric on `{bench.name}` (issue 33 §1)", "",
             f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; written by `benchmarks/head_metric_minilm8.py`.", "",
             "Every row is TA + FeatCal with λ chosen per module on held-out calibration rows (ρ 2.2). The head metric "
             "(`featcal.head_metric`) measures, in the last block's output.dense only, each task's output error "
             "through its own head: (1−η)·I + η·H_tᵀH_t. " + (
                 "The η kept: of 0.5 and 1, the one whose validation check flags the fewest tasks, a tie to the higher "
                 "mean agreement (validation rows only, labels unread; written after η 1's test figures had been read, "
                 "before η 0.5's)." if rule else
                 "Only η 1 ran here: the η the 8-task build kept, run as a confirmation of the issue's goal, chosen "
                 "before this build's run."), "",
             "## Validation check: agreement with the expert's top class, merge → calibrated (%)", "",
             "| row | " + " | ".join(tasks) + " | flagged |", "|---|" + "---:|" * len(tasks) + "---|"]
    for r in runs:
        lines.append(f"| {name(r)} | " + " | ".join(check_cells(checks[r], tasks))
                     + f" | {', '.join(flagged(checks[r])) or '—'} |")
    lines += ["", "## Validation check: KL from the expert's predicted distribution, merge → calibrated (nats)", "",
              "| row | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for r in runs:
        e = checks[r]["tasks"]
        lines.append(f"| {name(r)} | " + " | ".join(
            f"{e[t]['merged']['kl']:.3f} → {e[t]['calibrated']['kl']:.3f}" for t in tasks) + " |")
    lines += ["", "## Test accuracy (%), change against task arithmetic, and against λ auto", "",
              "| row | " + " | ".join(tasks) + " | average | tasks > 1 point below TA | Δ vs λ auto [95 % CI], p |",
              "|---|" + "---:|" * (len(tasks) + 3),
              "| task arithmetic | " + " | ".join(f"{ta[t]:.1f}" for t in tasks)
              + f" | {sum(ta.values()) / len(tasks):.2f} | | |"]
    for r in runs:
        cells = accuracy_cells(results[r], ta, tasks, results[REFERENCE] if r != REFERENCE else None)
        lines.append(f"| {name(r)} | " + " | ".join(cells) + " |")
    rounds = [r for r in HEAD_ROUNDS if r in runs]
    if len(rounds) > 1:
        lines += ["", f"With the protecting rounds on η 1, the rule (the first round whose own check flags no task, "
                      f"else the last) keeps round {settled([checks[r] for r in rounds])} of {len(rounds) - 1}."]
    lines += ["", (f"Kept by the rule: {ROWS[rule]}. " if rule else "") + "Goal (issue 33 §1): no "
              "task more than 1 point below task arithmetic, and the average not below λ auto's (paired interval)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    summarise(__doc__.splitlines()[0], markdown)


if __name__ == "__main__":
    main()
