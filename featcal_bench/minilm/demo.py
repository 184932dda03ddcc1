"""`featcal demo`: the 3-task MiniLM demo benchmark built, then TA + FeatCal on it through the pipeline's own flow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from featcal_bench.minilm.recipe import FEATCAL, located_spec, pipeline_config
from featcal_bench.minilm.spec import BenchSpec
from featcal_bench.runs import MethodRun
from featcal_bench.stages import build_flow
from flows.prefect_flow import featcal_flow
from storage.atomic import write_bytes

DEMO_EXAMPLES = 64


@flow(name="featcal-demo", flow_run_name="demo · {out}")
def demo_flow(out: str, spec: BenchSpec) -> Path:
    """Build the 3-task demo benchmark, then TA + FeatCal on it through the pipeline's own flow."""
    root = Path(out).resolve()
    build_flow(str(root / "bench"), spec)
    run = MethodRun("task_arithmetic", "featcal", examples=DEMO_EXAMPLES, models=("merged", "calibrated", "expert"),
                    featcal=FEATCAL)
    config = root / "demo.yaml"
    text = yaml.safe_dump(pipeline_config(root / "bench", spec, run), sort_keys=False)
    if not config.is_file() or config.read_text() != text:
        write_bytes(config, text.encode())
    featcal_flow(str(config), str(root / "run"))
    return root / "run"


def run_demo(out: str | Path) -> Path:
    return demo_flow(str(Path(out).resolve()), located_spec("demo"))


def demo_table(report: dict[str, Any]) -> str:
    names = {"expert": "experts", "merged": "task arithmetic", "calibrated": "TA + FeatCal"}
    tasks = sorted(report["tasks"])
    lines = ["| model | " + " | ".join(tasks) + " | average |", "|---|" + "---:|" * (len(tasks) + 1)]
    for model, label in names.items():
        accs = [report["tasks"][t]["accuracy"][model] for t in tasks]
        lines.append(
            f"| {label} | " + " | ".join(f"{100 * a:.1f}" for a in accs) + f" | {100 * sum(accs) / len(accs):.1f} |"
        )
    gap = report["summary"].get("gap_closed")
    if gap is not None:
        lines.append(f"\nFeatCal closes {100 * gap:.1f} % of the gap between task arithmetic and the experts.")
    last = report["summary"].get("average_last_boundary_drift", {})
    if {"merged", "calibrated"} <= last.keys():
        head = (report.get("drift_definition") or {}).get("head_token_index") is not None
        kinds = [("all_tokens", "all tokens"), ("head_token", "token the head reads")]
        if not head:
            kinds = [("all_tokens", "all tokens, all read by the head")]
        figures = ", ".join(f"{label} {last['merged'][k]:.3f} → {last['calibrated'][k]:.3f}" for k, label in kinds)
        lines.append(f"\nDrift from the experts at the last block, task average (lower is better): {figures}.")
    return "\n".join(lines)
