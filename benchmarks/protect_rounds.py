"""No task left behind on a built MiniLM benchmark (issue 33 §1): the protecting rounds, their checks, their test rows.

    featcal bench run BENCH --runs ta_featcal ta_featcal_auto_protect4     # λ auto and rounds 1–4 (and TA)
    python benchmarks/protect_rounds.py BENCH --out benchmarks/results/protect_rounds_minilm8.md

For λ auto (round 0) and each protecting round: its task weights; each task's agreement with its expert on the
validation rows (merge → calibrated; flagged where it fell; labels unread); each task's test accuracy against the
merge's; which round the rule keeps (featcal_bench/protect.py `settled`: the first whose own check flags no task,
else the last); and every round paired with λ auto on the same test rows. The last round's check is made here
(no later round made it).
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

ROUNDS = ["ta_featcal_auto", *(f"ta_featcal_auto_protect{k}" for k in range(1, 5))]


def markdown(bench: Path) -> str:
    rounds = [r for r in ROUNDS if (bench / "results" / f"{r}.json").is_file()]
    results = {r: read_json(bench / "results" / f"{r}.json") for r in rounds}
    merge = read_json(bench / "results" / "ta_featcal.json")
    tasks = sorted(merge["accuracy"])
    checks = [head_check(bench, r) for r in rounds]
    keep = settled(checks)
    ta = {t: 100 * merge["accuracy"][t]["merged"] for t in tasks}
    lines = [f"# Protecting rounds on `{bench.name}` (issue 33 §1)", "",
             f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; written by `benchmarks/protect_rounds.py`.", "",
             "Round 0 is TA + FeatCal with λ auto (ρ 2.2). Each later round reruns it with `featcal.task_weights` raised "
             "×4 for every task the round before left agreeing with its expert's top class on fewer validation rows "
             "(200 per task, labels unread) than task arithmetic does. Kept: the first round whose own check flags no "
             "task, else the last (fixed before any round's test figures beyond round 1 were read).", "",
             "## Validation check: agreement with the expert, merge → calibrated (%)", "",
             "| round | weights | " + " | ".join(tasks) + " | flagged |", "|---|---|" + "---:|" * len(tasks) + "---|"]
    for k, (r, check) in enumerate(zip(rounds, checks, strict=True)):
        weights = ", ".join(f"{t} {w:g}" for t, w in sorted(check["task_weights"].items())) or "all 1"
        lines.append(f"| {k} | {weights} | " + " | ".join(check_cells(check, tasks))
                     + f" | {', '.join(flagged(check)) or '—'} |")
    lines += ["", "## Test accuracy (%), change against task arithmetic, and against round 0", "",
              "| round | " + " | ".join(tasks) + " | average | tasks > 1 point below TA | Δ vs round 0 [95 % CI], p |",
              "|---|" + "---:|" * (len(tasks) + 3)]
    lines.append("| task arithmetic | " + " | ".join(f"{ta[t]:.1f}" for t in tasks)
                 + f" | {sum(ta.values()) / len(tasks):.2f} | | |")
    for k, r in enumerate(rounds):
        name = f"**{k} (kept)**" if k == keep else str(k)
        cells = accuracy_cells(results[r], ta, tasks, results[rounds[0]] if k else None)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Kept by the rule: round {keep}. Goal (issue 33 §1): no task more than 1 point below task arithmetic, "
              "and the average not below round 0's (paired interval)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    summarise(__doc__.splitlines()[0], markdown)


if __name__ == "__main__":
    main()
