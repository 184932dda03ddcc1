"""The figures an issue's goals name, from the results a benchmark directory already holds (no run made here): the
best of one set of rows against the best of another, any row against another, each on the same test rows (and
calibration draws) with its paired-bootstrap interval, the worst task against a row's own starting merge, and the
share of a 256-example gain that 8 examples keep, averaged over draws.

    python -m benchmarks.goal_figures --bench M8/bench --title "..." --out benchmarks/results/NAME.md \\
        --best "label-free merge + FeatCal" tsv_m_featcal_auto=tsv_m_featcal:merged ... \\
        --best "no calibration" regmean tsv_m_featcal:merged ... \\
        --pair ta_featcal_paper_refit ta_featcal_auto --few ta_featcal_auto_n008=ta_featcal_auto

A row is RUN[:MODEL] (model: calibrated unless named); in `--best`, RUN=START[:MODEL] also names the row it started
from, whose per-task accuracy the worst task is read against. Task averages are over the benchmark's tasks; a run
with draws (`{run}_draw{k}`) counts by all of them."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.common import results_header
from featcal_bench.paired import compared
from featcal_bench.report import correct_rows, draws_of
from storage.atomic import read_json

REFERENCE = "ta_featcal:merged"  # the MiniLM study's task arithmetic at 0.3: what `--few` measures gains from


class Rows:
    """The benchmark's results, read once, and each row's per-task accuracy and correctness over its draws."""

    def __init__(self, bench: Path) -> None:
        self.results = {p.stem: read_json(p) for p in sorted((bench / "results").glob("*.json"))
                        if ".check" not in p.stem}
        self.tasks: list[str] = list(next(iter(self.results.values()))["accuracy"])

    def _split(self, row: str) -> tuple[str, str]:
        run, _, model = row.partition(":")
        if run not in self.results:
            raise SystemExit(f"{row}: no result of run {run} in the benchmark directory")
        return run, model or "calibrated"

    def _runs(self, row: str) -> tuple[list[str], str]:
        """The result names a row reads (a calibrated model: every draw; a merge or the experts: no draw changes
        them) and its model."""
        run, model = self._split(row)
        return (draws_of(self.results, run) if model == "calibrated" else [run]), model

    def draws(self, row: str) -> list[dict[str, float]]:
        names, model = self._runs(row)
        return [{t: 100 * self.results[n]["accuracy"][t][model] for t in self.tasks} for n in names]

    def average(self, row: str) -> float:
        return statistics.fmean(statistics.fmean(d.values()) for d in self.draws(row))

    def per_task(self, row: str) -> dict[str, float]:
        draws = self.draws(row)
        return {t: statistics.fmean(d[t] for d in draws) for t in self.tasks}

    def correct(self, row: str) -> list[dict[str, list[bool]]]:
        names, model = self._runs(row)
        found = [correct_rows(self.results[n], model, self.tasks) for n in names]
        if any(c is None for c in found):
            raise SystemExit(f"{row}: its results keep no per-example predictions")
        return [c for c in found if c is not None]

    def paired(self, a: str, b: str) -> str:
        c = compared(self.correct(a), self.correct(b), self.tasks)
        low, high = (100 * x for x in c["ci"])
        return f"{100 * c['difference']:+.2f} [{low:+.2f}, {high:+.2f}] (over {c['covers']})"


def _best(rows: Rows, label: str, specs: list[str]) -> tuple[list[str], str]:
    """The table lines of one `--best` set, and its best row."""
    starts: dict[str, str | None] = {}
    for spec in specs:
        row, _, named = spec.partition("=")
        starts[row] = named or None
    averages = {r: rows.average(r) for r in starts}
    best = max(averages, key=averages.__getitem__)
    lines = [f"### {label}", "", "| row | average | draws | worst task against its start |", "|---|---:|---:|---|"]
    for r, avg in sorted(averages.items(), key=lambda kv: -kv[1]):
        worst, start_row = "", starts[r]
        if start_row is not None:
            own, start = rows.per_task(r), rows.per_task(start_row)
            t = min(rows.tasks, key=lambda k: own[k] - start[k])
            worst = f"{t} {own[t] - start[t]:+.1f} (from `{start_row}`)"
        lines.append(f"| `{r}`{' **best**' if r == best else ''} | {avg:.2f} | {len(rows.draws(r))} | {worst} |")
    return lines + [""], best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, type=Path)
    parser.add_argument("--best", nargs="+", action="append", default=[], metavar=("LABEL", "ROW"),
                        help="a set of rows, the first word its label; the best two sets are compared, first minus "
                             "second")
    parser.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"), help="A minus B")
    parser.add_argument("--few", action="append", default=[], metavar="RUN8=RUN256",
                        help="the share of RUN256's gain over task arithmetic that RUN8 keeps (mean over draws)")
    parser.add_argument("--reference", default=REFERENCE, help=f"the row `--few` measures gains from ({REFERENCE})")
    parser.add_argument("--title", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    rows = Rows(args.bench.resolve())
    lines = [*results_header(args.title), f"Benchmark directory `{args.bench}`; results read as they were. Accuracy "
             "in points, task mean over the test rows; a row with draws is their mean. Intervals: 95 % paired "
             "bootstrap (featcal_bench/paired.py).", ""]
    bests = []
    for label, *specs in args.best:
        table, best = _best(rows, label, specs)
        lines += table
        bests.append((label, best))
    if len(bests) >= 2:
        (la, a), (lb, b) = bests[:2]
        lines += [f"**Best {la} (`{a}`) minus best {lb} (`{b}`): {rows.paired(a, b)}.**", ""]
    for a, b in args.pair:
        lines.append(f"- `{a}` minus `{b}`: {rows.paired(a, b)}")
    ta = rows.average(args.reference)
    for spec in args.few:
        few, full = spec.split("=", 1)
        gain_full = [statistics.fmean(d.values()) - ta for d in rows.draws(full)]
        shares = [100 * (statistics.fmean(d.values()) - ta) / gain_full[k % len(gain_full)]
                  for k, d in enumerate(rows.draws(few))]
        lines.append(f"- `{few}` keeps {statistics.fmean(shares):.0f} % of `{full}`'s gain over task arithmetic "
                     f"({rows.average(few):.2f} against {rows.average(full):.2f}, TA {ta:.2f}; per draw "
                     + ", ".join(f"{s:.0f} %" for s in shares) + ")")
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
