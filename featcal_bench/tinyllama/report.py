"""The tinyllama-domains report: per method, the next-token loss on each domain's held-out rows (lower is better), its
average and the loss gap closed, beside what the build made (split sizes, pretraining, each expert's gain on its own
domain) and what it all cost on this machine.

Rows, costs and next-token accuracies come from the benchmark report (featcal_bench.report), whose "accuracy" is here
each run's next-token accuracy; the losses are added to its rows."""

from __future__ import annotations

import math
from typing import Any

from featcal_bench.report import language_model_report
from featcal_bench.study import Study
from featcal_bench.tinyllama.build import DOMAINS, SPLITS, TinyLlamaSpec


def about(spec: TinyLlamaSpec) -> str:
    s, pre, ft = spec.shape, spec.pretrain, spec.finetune
    lines = [f"- `{d}`: {DOMAINS[d][2]}" for d in spec.tasks]
    return (
        f"A Llama made here ({s.num_hidden_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads, "
        f"{s.num_key_value_heads} key/value heads, MLP {s.intermediate_size}, tied embeddings; byte-level BPE of "
        f"{spec.vocab_size} tokens trained on the pretraining mix; rows of {spec.seq_len} tokens), pretrained from "
        f"scratch for {pre.steps} steps of {pre.batch_size} rows (lr {pre.lr:g}) on a mix of the four domains, then "
        f"one expert per domain: a full fine-tune from the base on that domain's own rows, ≤ {ft.steps} steps and "
        f"≤ {ft.max_epochs:g} epochs of {ft.batch_size} rows (lr {ft.lr:g}). Each domain's text is split by whole "
        f"groups (seed {spec.seed}): held-out test (≤ {spec.test_rows} rows), calibration pool (≤ "
        f"{spec.calibration_rows} rows), then the rest halved between the expert's fine-tuning and the base's "
        "pretraining; no group is in two splits. Every model is scored by its mean next-token loss in nats over "
        "every token of the held-out rows. Merges at scale 0.3 (TIES: top 20 % of each task vector); FeatCal λ "
        "0.05, ρ 2.2, α 0.25 (the paper's) and λ auto; RegMean and RegMean++ from the average, off-diagonal "
        "0.95. One CPU thread everywhere.\n\n" + "\n".join(lines)
    )


def tinyllama_report(results: dict[str, dict[str, Any]], spec: TinyLlamaSpec, meta: dict[str, Any],
                     study: Study) -> dict[str, Any]:
    """`language_model_report` of the runs, with `run_gap_closed`: for each run that scored its merge (or whose
    `start` run scored the calibrated model it calibrates) and its calibrated model, (start − calibrated) / (start −
    experts), what calibration added to the model it started from."""
    report = language_model_report(results, spec.tasks, meta, study)
    by_run = {(r["run"], r["model"]): r["average_loss"] for r in report["methods"]}
    experts = by_run.get((study.reference, "expert"))
    starts = {run: (res["start"], "calibrated") if res.get("start") else (run, "merged")
              for run, res in results.items()}
    report["run_gap_closed"] = {
        run: (by_run[start] - by_run[run, "calibrated"]) / (by_run[start] - experts)
        for run, start in starts.items()
        if experts is not None and {start, (run, "calibrated")} <= by_run.keys() and by_run[start] != experts}
    return report


def _build_lines(build: dict[str, Any], spec: TinyLlamaSpec) -> list[str]:
    head = [*SPLITS, "chars/token", "base loss", "expert loss"]
    lines = [f"## What the build made (rows of {spec.seq_len} tokens per split)", "",
             "| domain | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for d in spec.tasks:
        data, loss = build[f"data/{d}"]["info"], build[f"expert/{d}"]["info"]["test_loss"]
        lines.append(f"| {d} | " + " | ".join(str(data[s]) for s in SPLITS)
                     + f" | {data['characters_per_token']:.2f} | {loss['base']:.4f} | {loss['expert']:.4f} |")
    base = build["base"]["info"]
    lines += [
        "",
        f"Pretraining: {base['parameters']:,} parameters, {base['steps']} steps, {base['tokens']:,} tokens "
        f"({base['epochs']} epochs of the mix's {base['rows']} rows), {base['seconds']:.0f} s at "
        f"{base['tokens_per_second']} tokens/s, final training loss {base['final_loss']:.3f}. Experts: "
        + "; ".join(
            f"{d} {build[f'expert/{d}']['info']['steps']} steps ({build[f'expert/{d}']['info']['epochs']} "
            f"epochs, {build[f'expert/{d}']['info']['seconds']:.0f} s)"
            for d in spec.tasks
        )
        + ". *base loss* / *expert loss*: each domain's held-out loss before and after its fine-tune.",
    ]
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in build["seconds_by_kind"].items())
    lines += ["", f"Build wall time (sum of its stages): {build['seconds']:.0f} s ({stages})."]
    return lines


def markdown(report: dict[str, Any], spec: TinyLlamaSpec) -> str:
    """The build, the loss table (lower is better) with next-token accuracy and costs, each run's own gap closed."""
    tasks, rows = report["tasks"], report["methods"]
    head = [*tasks, "average loss (perplexity)", "gap closed (loss)", "next-token accuracy (%)", "time (s)"]
    lines = [f"# {report['title']}", "", report["about"], "", f"Machine: {report['machine']}.", "",
             *_build_lines(report["build"], spec), "",
             "## Next-token loss on each domain's held-out rows (nats, lower is better)", "",
             "| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['loss'][t]:.4f}" for t in tasks]
        cells += [f"{r['average_loss']:.4f} ({math.exp(r['average_loss']):.2f})",
                  f"{100 * r['gap_closed_loss']:.1f} %" if "gap_closed_loss" in r else "",
                  f"{100 * r['average']:.2f}", f"{r['seconds']:.1f}" if "seconds" in r else ""]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "*gap closed (loss)*: (TA − row) / (TA − experts) on the average loss: 0 at task arithmetic, 100 % at "
        "the experts (each on its own domain). *time*: the merge, plus calibration where there is one.",
        "",
    ]
    if report.get("run_gap_closed"):
        lines.append("Each calibrated run against its own merge (or, for RegMean + FeatCal and RegMean++ + FeatCal, "
                     "the RegMean model it calibrated), (start − calibrated) / (start − experts) on the average loss: "
                     + ", ".join(f"`{r}` {100 * g:.1f} %" for r, g in report["run_gap_closed"].items()) + ".")
    lines += ["", f"Run time (every method run's pipeline stages, as recorded when they ran, sum): "
                  f"{report['run_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"
