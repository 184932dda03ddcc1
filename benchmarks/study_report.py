"""A study's report from the results a benchmark directory already holds, without running anything: for runs made by
several `featcal bench run` invocations (64-example runs once, 8-example runs with `--draws`), or made by code that
has changed since (a `bench run` would run them again: its stage keys hold the code).

    python -m benchmarks.study_report --bench DEMO/bench --runs ta_featcal ta_featcal_paper ... \\
        --draws 4 --title "..." --out benchmarks/results/NAME.md

`--study` defaults to the benchmark's own recipe study; rows whose runs are not named (or have no results) are left
out; each named run counts with the draws found for it (`{run}_draw{k}`), at most `--draws`."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import results_header
from featcal_bench.builtin import recipe_of
from featcal_bench.report import build_report, draws_of, markdown
from featcal_bench.study import load_study
from storage.atomic import read_json, write_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, type=Path, help="a directory written by `featcal bench build`")
    parser.add_argument("--runs", nargs="+", required=True, help="the runs whose results the report reads")
    parser.add_argument("--study", type=Path, help="a study file (default: the benchmark recipe's own)")
    parser.add_argument("--draws", type=int, default=1, help="at most this many draws of each run (default 1)")
    parser.add_argument("--title", required=True)
    parser.add_argument("--note", default="", help="a paragraph under the header: what the runs were, and how")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    bench = args.bench.resolve()
    recipe = recipe_of(bench)
    study = load_study(args.study or recipe.study)
    found = {p.stem: None for p in (bench / "results").glob("*.json") if ".check" not in p.stem}
    missing = [r for r in args.runs if r not in found]
    if missing:
        raise SystemExit(f"--runs: {bench}/results holds no result of {', '.join(missing)}")
    names = [d for r in args.runs for d in draws_of(found, r)[:args.draws]]
    results = {r: read_json(bench / "results" / f"{r}.json") for r in names}
    report = build_report(results, recipe.spec.load(bench).tasks, {"title": args.title}, study)
    counted = {r: len(draws_of(found, r)[:args.draws]) for r in args.runs}
    header = [*results_header(args.title),
              f"Benchmark directory `{bench}`; results read as they were (no run made here). Draws counted: "
              + ", ".join(f"{r} {n}" for r, n in counted.items()) + ".", ""]
    if args.note:
        header += [args.note, ""]
    text = markdown(report, study)
    first = text.index("\n\n")  # after the markdown's own title line
    write_bytes(args.out, ("\n".join(header) + text[first + 2:]).encode())
    print(args.out.read_text())


if __name__ == "__main__":
    main()
