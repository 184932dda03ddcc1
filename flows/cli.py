"""The `featcal` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# Before Prefect is imported: no telemetry (no network here), and our logger shown in the UI.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "featcal")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # --no-prefect logs outside any flow
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="featcal", description="Post-merging feature calibration (FeatCal).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="show what a run will do, with RAM/disk estimates; computes nothing")
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    r = sub.add_parser("run", help="run or resume the pipeline into a run directory")
    r.add_argument("config")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--no-prefect", action="store_true", help="call the stages directly, without a Prefect flow")
    e = sub.add_parser("example", help="the tiny offline example (models + data) used by the demo and tests")
    e.add_argument("action", choices=["build"])
    e.add_argument("out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Our progress goes to the terminal through this handler, and to the Prefect UI through the API
    # handler Prefect adds to the loggers named in PREFECT_LOGGING_EXTRA_LOGGERS.
    ours = logging.getLogger("featcal")
    ours.setLevel(logging.INFO)
    ours.propagate = False
    if not any(h.get_name() == "featcal-console" for h in ours.handlers):
        console = logging.StreamHandler()
        console.set_name("featcal-console")
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
        ours.addHandler(console)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from featcal.config import ConfigError, load_config
    from storage.rundir import RunDirLocked

    try:
        if args.command == "example":
            from featcal.example import build_tiny_example

            print(build_tiny_example(Path(args.out)))
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "plan":
            from flows.plan import plan, render

            print(render(plan(cfg)))
            return 0
        if args.no_prefect:
            from flows.pipeline import run_pipeline

            run_pipeline(cfg, args.run_dir)
        else:
            from flows.prefect_flow import featcal_flow

            featcal_flow(args.config, str(Path(args.run_dir).resolve()), args.overrides)
    except (ConfigError, RunDirLocked, ValueError, FileNotFoundError) as exc:
        print(f"featcal: error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    print(f"calibrated checkpoint: {run_dir / 'calibrated'}")
    if (run_dir / "report.md").is_file():
        print(f"report: {run_dir / 'report.md'}\n")
        print((run_dir / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
