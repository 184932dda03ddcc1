"""Issue 33 §2 on the 3-task MiniLM demo (not MiniLM-8): FeatCal with few calibration examples per task, with the
Gram shrinkage (featcal.shrinkage) off and chosen on held-out rows, against the most the demo's pool holds.

    python benchmarks/few_examples.py DEMO_DIR [VARIANT ...]

DEMO_DIR is a `featcal demo --out DIR` directory (its bench/ is read; the runs go to DIR/few_examples/). The demo's
calibration pool has 64 examples per task, so "full" here is 64, not MiniLM-8's 256. Writes
benchmarks/results/few_examples_demo.md and DIR/few_examples/rows.jsonl (one line per finished variant, appended).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from variant_rows import appended, requested

from featcal.config import config_from_dict
from featcal_bench.minilm.recipe import AUTO, FEATCAL, located_spec, pipeline_config
from featcal_bench.runs import MethodRun
from flows.console import setup_logging
from flows.pipeline import machine, run_pipeline
from storage.atomic import read_json

OUT = Path(__file__).resolve().parent / "results" / "few_examples_demo.md"
FULL, FEW = 64, 8  # the demo's whole calibration pool, and the few
SETTINGS: dict[str, dict[str, Any]] = {
    "auto": AUTO,  # λ chosen on held-out rows, ρ 2.2: the label-free setting issue 33 measures from
    "auto+shrink": {**AUTO, "shrinkage": "auto"},  # γ chosen with λ (joint grid), target tr(C)/d·I
    "auto+shrink_diag": {**AUTO, "shrinkage": "auto", "shrinkage_target": "diagonal"},
    "tuned": FEATCAL,  # MiniLM-8's validation-tuned λ 0.5, ρ 3 (the demo's own setting)
    "tuned+shrink": {**FEATCAL, "shrinkage": "auto"},  # λ, ρ fixed; γ alone chosen on held-out rows
}
VARIANTS = {f"{name}_n{n:03d}": (name, n) for name in SETTINGS for n in (FEW, FULL)}


def run_variant(demo: Path, name: str, first: bool) -> dict[str, Any]:
    setting, n = VARIANTS[name]
    spec = located_spec("demo")
    models = ("merged", "calibrated", "expert") if first else ("calibrated",)
    run = MethodRun("task_arithmetic", "featcal", examples=n, models=models, featcal=SETTINGS[setting])
    raw = pipeline_config(demo / "bench", spec, run)
    run_dir = demo / "few_examples" / name
    start = time.perf_counter()
    run_pipeline(config_from_dict(raw, root=demo, source=f"few_examples {name}"), run_dir, reuse=True)
    report = json.loads((run_dir / "report.json").read_text())
    solves = [read_json(p)["info"] for p in sorted((run_dir / "records").glob("solve__*.json"))]
    gammas = [v for info in solves for v in info.get("shrinkage", {}).values()]
    lams = [v for info in solves for v in info.get("lambda", {}).values()]
    return {"name": name, "setting": setting, "examples": n, "seconds": round(time.perf_counter() - start, 1),
            "accuracy": {t: s["accuracy"] for t, s in report["tasks"].items()},
            "chosen_shrinkage": gammas, "chosen_lambda": lams}


def _average(row: dict[str, Any], model: str) -> float:
    return 100 * statistics.mean(acc[model] for acc in row["accuracy"].values())


def markdown(rows: list[dict[str, Any]]) -> str:
    ref = next(r for r in rows if "merged" in next(iter(r["accuracy"].values())))
    tasks = sorted(ref["accuracy"])
    ta, expert = _average(ref, "merged"), _average(ref, "expert")
    by = {(r["setting"], r["examples"]): r for r in rows}
    lines = [
        "# Few calibration examples on the 3-task MiniLM demo (issue 33 §2)", "",
        "**This is the demo (`featcal demo`: party, word_moral, word_topic), not MiniLM-8.** Its calibration pool holds",
        f"{FULL} examples per task, so the reference is {FULL} examples, not 256; test: each task's 500 rows.",
        f"Host: {machine()}, shared with other jobs (accuracies do not depend on load).", "",
        f"Experts {expert:.1f}, task arithmetic {ta:.1f} (average over tasks, %). `benchmarks/few_examples.py`.", "",
        "| setting | examples | " + " | ".join(tasks) + " | average | gain over TA | γ chosen (median, range) | λ chosen (median) |",
        "|---|---:|" + "---:|" * (len(tasks) + 4)]
    for (setting, n), r in sorted(by.items(), key=lambda kv: (list(SETTINGS).index(kv[0][0]), kv[0][1])):
        accs = " | ".join(f"{100 * r['accuracy'][t]['calibrated']:.1f}" for t in tasks)
        g = r["chosen_shrinkage"]
        gam = f"{statistics.median(g):g} ({min(g):g}–{max(g):g})" if g else "off"
        lam = f"{statistics.median(r['chosen_lambda']):g}" if r["chosen_lambda"] else "fixed"
        avg = _average(r, "calibrated")
        lines.append(f"| {setting} | {n} | {accs} | {avg:.1f} | {avg - ta:+.1f} | {gam} | {lam} |")
    lines += ["", f"Share of the {FULL}-example gain kept at {FEW} examples, (calibrated − TA) at {FEW} over the same at "
              f"{FULL}:", "", "| setting | share, same setting at both sizes | share of `auto`'s "
              f"{FULL}-example gain |", "|---|---:|---:|"]
    base_full = by.get(("auto", FULL))
    for setting in SETTINGS:
        few, full = by.get((setting, FEW)), by.get((setting, FULL))
        if few is None or full is None:
            continue
        gain_few, gain_full = _average(few, "calibrated") - ta, _average(full, "calibrated") - ta
        vs_auto = (f"{100 * gain_few / (_average(base_full, 'calibrated') - ta):.0f} %" if base_full else "n/a")
        lines.append(f"| {setting} | {100 * gain_few / gain_full:.0f} % | {vs_auto} |")
    return "\n".join(lines) + "\n"


def main(demo: Path, names: list[str]) -> None:
    setup_logging()
    out = demo / "few_examples"
    out.mkdir(parents=True, exist_ok=True)
    done = out / "rows.jsonl"
    for name in names:
        first = not done.exists() or not done.read_text().strip()
        OUT.write_text(markdown(appended(done, run_variant(demo, name, first))))
    print(OUT.read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), requested(sys.argv[2:], VARIANTS))
