"""LOT Merging against RegMean and RegMean++ on the tiny example (issue 52 item 3): one pipeline run per architecture
and method, each from the average merge (the non-linear parameters all three keep), scoring the average and the
method's model on every task's test split, with the directions LOT's pseudoinverse kept per module.

    python -m benchmarks.lot_example --example /tmp/example --work /tmp/lot-example \\
        --out benchmarks/results/lot_example.md

The tiny example's experts are a few minutes of training on toy tasks (featcal_bench/example.py): the table says how
the three closed forms behave on them, not how they rank on real benchmarks (the MiniLM-8 study has LOT's rows).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from benchmarks.common import example_run, model_means, results_header
from featcal.modeling import calibrated_modules, linear_dims
from featcal_bench.example import build_tiny_example
from storage.rundir import RunDir
from tasks.context import context

METHODS = ("regmean", "regmean_plus_plus", "lot")


def run(example: Path, work: Path, arch: str, method: str) -> tuple[dict[str, dict[str, float]], float, str]:
    """Per task, the accuracy of the average, the method's model and the expert; the run's seconds; and for LOT how
    many linear modules' pseudoinverses kept every input direction (and what the others kept, of their width)."""
    raw = yaml.safe_load((example / arch / "example.yaml").read_text())
    raw["merge"] = {"method": "average"}
    raw["featcal"] = {"method": method}
    raw["evaluation"]["models"] = ["merged", "calibrated", "expert"]
    run_dir = work / f"{arch}-{method}"
    accuracy, seconds = example_run(raw, example / arch, run_dir)
    kept = ""
    if method == "lot":
        ctx, record = context(run_dir), RunDir(run_dir).record
        short = [(rank, linear_dims(calibrated_modules(ctx.skeleton.block_template(layer))[name])[0])
                 for layer in range(ctx.num_blocks)
                 for name, rank in record(f"solve/l{layer:02d}")["info"]["pinv_rank"].items()]
        partial = [f"{rank}/{width}" for rank, width in short if rank < width]
        kept = f"{len(short) - len(partial)} of {len(short)}" + (f" (others: {', '.join(partial)})" if partial else "")
    return accuracy, seconds, kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the run directories go")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    example = build_tiny_example(args.example)
    rows = []
    for arch in ("bert", "clip"):
        for method in METHODS:
            acc, seconds, kept = run(example, args.work, arch, method)
            means = model_means(acc)
            merged, solved, expert = means["merged"], means["calibrated"], means["expert"]
            per_task = ", ".join(f"{t} {100 * a['calibrated']:.1f}" for t, a in acc.items())
            rows.append(f"| {arch} | {method} | {100 * expert:.1f} | {100 * merged:.1f} | {100 * solved:.1f} | "
                        f"{per_task} | {kept or '–'} | {seconds:.0f} |")
            print(rows[-1], flush=True)
    lines = [*results_header("LOT Merging, RegMean and RegMean++ on the tiny example (`benchmarks/lot_example.py`)"),
             "Mean test accuracy over the example's 3 tasks (BERT: topic, negation, count; CLIP: quadrant, colour, "
             "stripes), %, each method from the average merge (`merge.method: average`, whose biases, norms and "
             "outside-block parameters RegMean keeps and LOT keeps but for the norm scales). `full rank`: of LOT's "
             "linear modules (q, k, v count one each), how many kept every input direction in the pseudoinverse, "
             "and the kept/width of the others. `s`: the whole run "
             "(merge, statistics, solves, evaluation) on this shared 2-core machine.", "",
             "| model | method | experts | average | method's model | per task | full rank | s |",
             "|---|---|---:|---:|---:|---|---|---:|", *rows, ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
