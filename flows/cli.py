"""The `featcal` command line.

Each subcommand is a `_add_*` function that declares its arguments and a handler in COMMANDS; adding one is
adding both. A package above flows adds its own subcommands as `Command`s passed to `main` (featcal_bench/cli.py:
`bench`, `demo` and `example`; the `featcal` script is that module's main).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from flows.console import divert_prefect_noise, setup_logging

if TYPE_CHECKING:  # the CLI loads the config module and Prefect only when a command needs them
    from prefect.states import State

    from featcal.config import RunConfig

# Before Prefect is imported: no telemetry (no network here), and our logger shown in the UI.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "featcal")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # --no-prefect logs outside any flow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Prefect waits 20 s for its ephemeral server; a busy 2-core machine can take longer (seen: a failed start).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Before torch is imported (it reads this once, when it loads): tensors of 2 MiB and more on transparent huge
# pages. The Gram and solve stages allocate float64 matrices of tens of MB per task and module; on 4 KiB pages
# each costs a page fault per page when first written (a 3072² one: 65 ms to allocate, 15 ms on huge pages). On
# the ViT-B/32 shape the stages took 1.03–1.13× less time (two invocations) with the same weights bit for bit and
# a lower peak RSS (benchmarks/results/pipeline_cost_vitb32_avx2.md). Without kernel support it changes nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")


def _add_flow_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the stages run")
    g.add_argument("--runner", choices=["local", "pool", "dask"], default="local",
                   help="local: in this process (default); pool: in --workers processes on this machine, a block's "
                        "independent stages at once; dask: on Dask workers, the same")
    g.add_argument("--address", metavar="tcp://HOST:PORT",
                   help="with --runner dask: the scheduler of an existing cluster (tls://HOST:PORT: over TLS)")
    g.add_argument("--workers", type=int, metavar="N",
                   help="with --runner pool: N worker processes (default: one per core); with --runner dask: start a "
                        "local cluster of N worker processes")
    g.add_argument("--gpus", type=int, metavar="N",
                   help="with --runner dask: start a local cluster of N workers, one per GPU (cuda:0 … cuda:N-1), "
                        "each running its stages on its own GPU; runtime.device must be auto or cuda")
    g.add_argument("--worker-threads", type=int, metavar="N",
                   help="torch threads per worker process (default: the cores divided among the pool's workers; 1 "
                        "per Dask worker); runtime.threads, when set, wins")
    g.add_argument("--tls-ca-file", metavar="PEM",
                   help="with --address tls://…: the CA that signed the cluster's certificates")
    g.add_argument("--tls-cert", metavar="PEM",
                   help="with --address tls://…: this client's certificate (signed by that CA)")
    g.add_argument("--tls-key", metavar="PEM", help="with --address tls://…: its private key (if not in --tls-cert)")
    p.add_argument("--tag-task-runs", action="store_true",
                   help="tag every task run, not only the flow run, with model, merge method and run directory "
                        "(Prefect then checks each stage against tag concurrency limits: one server round trip each)")


def _add_strict(p: argparse.ArgumentParser) -> None:
    """--strict is `--set runtime.strict=true`: the flow and its deployments read it from the overrides."""
    p.add_argument("--strict", dest="overrides", action="append_const", const="runtime.strict=true",
                   help="refuse degenerate set-ups (an expert equal to the base, two tasks on one checkpoint, "
                        "calibration rows among the evaluation rows, ...) instead of warning about them")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show what a run will do, with RAM/disk estimates; computes nothing")
    p.add_argument("config", help="the run's YAML config (see configs/example.yaml)")
    _add_overrides(p)
    _add_strict(p)


def _add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run or resume the pipeline into a run directory",
                       description="Run the pipeline, or resume it: rerun the same command after a crash, Ctrl-C "
                                   "or kill, and only the stages that had not finished run again.")
    r.add_argument("config", help="the run's YAML config (see configs/example.yaml)")
    r.add_argument("--run-dir", required=True, help="where every output and intermediate goes (one run at a time)")
    _add_overrides(r)
    _add_strict(r)
    r.add_argument("--no-prefect", action="store_true", help="call the stages directly, without a Prefect flow")
    r.add_argument("--reuse", action="store_true",
                   help="the run directory holds a run of another config: recompute what changed and drop the stages "
                        "that no longer belong (without it such a directory is refused, naming what changed)")
    r.add_argument("--skip-disk-check", action="store_true",
                   help="start even when the run directory has less free space than `featcal plan` estimates")
    _add_flow_options(r)


def _add_push(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="upload a finished run's calibrated checkpoint and its model card to the "
                                    "Hugging Face hub")
    p.add_argument("run_dir", help="the run directory of a finished `featcal run`")
    p.add_argument("repo_id", help="the hub repository to create or update, e.g. you/my-calibrated-model")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--merged", action="store_true", help="upload merged/ (before calibration) instead")


def _add_server(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("server", help="a local Prefect server and UI in the background (SQLite under $FEATCAL_HOME)",
                       description="Start, stop or check a local Prefect server with its UI. Its database, pid file "
                                   "and log live under --home ($FEATCAL_HOME, default ~/.featcal).")
    s.add_argument("action", choices=["start", "stop", "status"], help="start, stop, or say whether one runs")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=4200, help="port (default 4200; 0 picks a free one)")
    s.add_argument("--home", help="where the server keeps its state (default $FEATCAL_HOME or ~/.featcal)")
    auth = s.add_mutually_exclusive_group()
    auth.add_argument("--auth", action="store_true",
                      help="require Prefect's basic authentication (the default on any address but loopback); the "
                           "secret is made once and kept in HOME/server-auth (mode 0600)")
    auth.add_argument("--insecure", action="store_true",
                      help="on an address other than loopback, start WITHOUT authentication: anyone who reaches "
                           "the port can read every run and run code through deployments")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a deployment of the flow on a cron schedule (runs until stopped)")
    s.add_argument("config", help="the run's YAML config")
    s.add_argument("--run-dir", required=True, help="every scheduled run resumes into this directory")
    s.add_argument("--cron", required=True, help="when to run, e.g. '0 2 * * *' (02:00 UTC every day)")
    s.add_argument("--name", help="deployment name (default: featcal-CONFIGNAME)")
    _add_overrides(s)
    _add_flow_options(s)


def _add_deployments(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("deployments", help="list featcal deployments: schedule, next and last run, run directory")


def _add_eval_harness(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser("eval-harness", help="score a finished run's checkpoints with lm-evaluation-harness and add "
                                            "the scores to its report (pip install 'featcal[harness]')")
    h.add_argument("run_dir", help="the run directory of a finished `featcal run` (decoder-only LMs)")
    h.add_argument("--tasks", required=True, help="comma-separated harness task names (or task YAML files)")
    h.add_argument("--include-path", metavar="DIR", help="a directory of extra task YAMLs (e.g. over local JSONL)")
    h.add_argument("--models", default="calibrated,merged,experts",
                   help="comma-separated: calibrated, merged, base, experts, expert:TASK (default: %(default)s)")
    h.add_argument("--limit", type=float, metavar="N", help="score at most N rows per task (a fraction if below 1)")
    h.add_argument("--batch-size", type=int, default=1, metavar="N", help="rows per forward (default 1)")


@dataclass(frozen=True)
class Command:
    """A subcommand added from above flows: its name, what declares its arguments, and its handler."""

    name: str
    add: Callable[[argparse._SubParsersAction], None]
    run: Callable[[argparse.Namespace], int]


def _parser(extra: Sequence[Command] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="featcal", description="Post-merging feature calibration (FeatCal).")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_plan, _add_run, _add_push, _add_server, _add_serve, _add_deployments,
                *(command.add for command in extra), _add_eval_harness):
        add(sub)
    _add_debug(parser)
    return parser


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """`-v/--debug` on every command, after its name (`featcal run ... -v`)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        parser.add_argument("-v", "--debug", action="store_true",
                            help="on an error, also print the traceback (ours and Prefect's)")
    for action in subs:
        for child in action.choices.values():
            _add_debug(child)


def _check_runner(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not hasattr(args, "runner"):
        return
    if args.gpus is not None:
        if args.runner != "dask" or args.address is not None or args.workers is not None:
            parser.error("--gpus N starts a local Dask cluster of one worker per GPU: it needs --runner dask and "
                         "excludes --address and --workers")
        if args.gpus < 1:
            parser.error(f"--gpus must be at least 1, got {args.gpus}")
    if args.runner == "dask":
        if args.address is None and args.workers is None and args.gpus is None:
            parser.error("--runner dask needs --address tcp://HOST:PORT (an existing cluster), "
                         "--workers N (a local cluster) or --gpus N (a local cluster, one worker per GPU)")
        if args.address is not None and args.workers is not None:
            parser.error("--address and --workers exclude each other: --address joins a cluster, --workers starts one")
        if getattr(args, "no_prefect", False):
            parser.error("--runner dask runs stages as Prefect tasks: it cannot be combined with --no-prefect")
    elif args.address is not None:
        parser.error("--address needs --runner dask")
    elif args.runner == "local" and (args.workers is not None or args.worker_threads is not None):
        parser.error("--workers and --worker-threads need --runner pool (processes on this machine) or --runner dask")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.worker_threads is not None and args.worker_threads < 1:
        parser.error(f"--worker-threads must be at least 1, got {args.worker_threads}")


# ---- handlers: each returns the exit code; errors the user can fix are raised as UserError ---------------------
def _cmd_plan(args: argparse.Namespace) -> int:
    from featcal.config import load_config
    from flows.plan import plan, render

    print(render(plan(load_config(args.config, args.overrides))))
    return 0


def _check_cluster(args: argparse.Namespace) -> None:
    """TLS options only with a tls:// address, naming files that exist; a scheduler that answers at --address."""
    if not (args.address or args.tls_ca_file or args.tls_cert or args.tls_key):
        return  # no cluster to reach: Dask is not even imported
    from flows.dask_runner import check_scheduler, check_tls

    check_tls(args.address, args.tls_ca_file, args.tls_cert, args.tls_key)
    if args.address:
        check_scheduler(args.address)


def _gpu_devices(args: argparse.Namespace, cfg: RunConfig) -> list[str] | None:
    """The devices of --gpus N, checked against what torch sees and runtime.device before any worker starts."""
    if args.gpus is None:
        return None
    from featcal.devices import check_worker_devices, gpu_devices

    devices = gpu_devices(args.gpus)
    check_worker_devices(devices, cfg.runtime.device)
    return devices


def _cmd_run(args: argparse.Namespace) -> int:
    from featcal.config import load_config
    from storage.rundir import RunDir

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir).resolve()
    if not args.reuse:
        from featcal.config_diff import check_same_config

        check_same_config(cfg, run_dir)  # reads only: a refused directory is left as it was
    RunDir(run_dir).check_usable()  # a busy or read-only run directory is refused now, before torch or Prefect load
    devices = _gpu_devices(args, cfg)
    from flows.plan import check_free_space, plan

    estimate = plan(cfg)  # checks every input (checkpoints, data, store) and estimates the disk the run needs
    if not args.skip_disk_check:
        check_free_space(estimate, run_dir)
    _check_cluster(args)
    if args.no_prefect and args.runner == "pool":
        from featcal import secrets
        from flows.pipeline import run_pipeline
        from flows.pool_runner import stage_pool

        known = secrets.found(cfg.model_dump(mode="json", by_alias=True))
        with stage_pool(args.workers, args.worker_threads, known) as pool:
            run_pipeline(cfg, run_dir, pool, submit=pool.submit, reuse=args.reuse)
    elif args.no_prefect:
        from flows.pipeline import run_pipeline

        run_pipeline(cfg, run_dir, reuse=args.reuse)
    else:
        import httpx

        from flows import server
        from flows.api_watch import PREFECT_LOG, unanswered

        api, source = server.api_url_for_runs()
        with server.using_api(api):
            from flows.prefect_flow import featcal_flow

            if api is None:
                print("featcal: no Prefect server (start one with `featcal server start`); "
                      "using Prefect's ephemeral mode", file=sys.stderr)
            else:
                print(f"featcal: reporting to {source} at {server.ui_url(api)}", file=sys.stderr)
            _quiet_prefect_tracebacks(args.debug)
            divert_prefect_noise(run_dir / PREFECT_LOG)
            try:
                # A State: Prefect's overloads take `return_state` for one of the flow's own keyword arguments first.
                state = cast("State[dict[str, str]]", featcal_flow(
                    args.config, str(run_dir), args.overrides, runner=args.runner, address=args.address,
                    workers=args.workers, worker_threads=args.worker_threads, tag_task_runs=args.tag_task_runs,
                    tls_ca_file=args.tls_ca_file, tls_cert=args.tls_cert, tls_key=args.tls_key, devices=devices,
                    reuse=args.reuse, return_state=True))
            except httpx.HTTPError:
                unanswered.set()  # the server went away, maybe too late for the watch to see it: exit without retries
                _outcome_without_server(run_dir)  # the flow run's last state was not recorded
            else:
                if api is not None:
                    print(f"flow run: {server.ui_url(api)}/runs/flow-run/{state.state_details.flow_run_id}")
                state.result()  # raises the flow's error, if any
    print(f"calibrated checkpoint: {run_dir / 'calibrated'}")
    if (run_dir / "report.md").is_file():
        print(f"report: {run_dir / 'report.md'}\n")
        print((run_dir / "report.md").read_text())
    return 0


def _outcome_without_server(run_dir: Path) -> None:
    """After the flow's last request to a server that stopped answering failed: the run's outcome is in its manifest.
    A complete run is reported as usual; a failed one by its reason; anything else is a real error."""
    from storage.atomic import read_json

    try:
        manifest = read_json(run_dir / "manifest.json")
    except FileNotFoundError:
        raise RunFailed(f"the Prefect server stopped answering before the run began ({run_dir / 'manifest.json'} "
                        "was not written); rerun the same command: with the featcal server gone it runs in "
                        "ephemeral mode; with PREFECT_API_URL set, rerun once that server answers") from None
    if manifest.get("status") == "complete":
        print("featcal: the run is complete; the Prefect server did not answer to record its end (rerun the same "
              "command once it is back to report it: every stage comes from the cache)", file=sys.stderr)
        return
    if manifest.get("status") == "failed":
        raise RunFailed(manifest.get("reason") or "the run failed (see the log above)")
    raise RunFailed(f"the Prefect server stopped answering and the run did not finish (manifest: "
                    f"{manifest.get('status')}); rerun the same command to resume")


class RunFailed(RuntimeError):
    """A run that failed while its server was down: reported in one line from its manifest's reason."""


def _cmd_push(args: argparse.Namespace) -> int:
    from flows.push import push

    print(push(args.run_dir, args.repo_id, args.private, "merged" if args.merged else "calibrated"))
    return 0


def _cmd_server(args: argparse.Namespace) -> int:
    from flows import server

    where = server.home(args.home)
    if args.action == "start":
        info, started = server.start(where, args.host, args.port, auth=True if args.auth else None,
                                     insecure=args.insecure)
        print(("started" if started else "already running:") + f" Prefect server, pid {info.pid}, home {where}")
        print(f"UI:  {info.url}" + ("   (it asks for the secret: paste the whole line of the file below)"
                                    if info.auth else ""))
        print(f"API: {info.api_url}   (featcal run uses it while it runs; stop it with `featcal server stop`)")
        if info.auth:
            secret_file = server.auth_file(where)
            print(f"authentication: on (Prefect basic auth); the secret is in {secret_file} (mode 0600, kept across "
                  "restarts; delete it to make a new one)\n"
                  "  featcal run / serve / deployments with this FEATCAL_HOME send it by themselves; anywhere else:\n"
                  f"    export PREFECT_API_URL={info.api_url}\n"
                  f"    export PREFECT_API_AUTH_STRING=\"$(cat {secret_file})\"\n"
                  "  Dask workers need nothing: each stage carries the client's Prefect settings (use --address "
                  "tls://… so they travel encrypted)")
        elif not server.is_loopback(info.host):
            print(f"featcal: warning: no authentication: anyone who reaches port {info.port} can read every run and "
                  "run code through deployments (--insecure)", file=sys.stderr)
        elif args.auth and not started:
            print("featcal: note: the running server does not require authentication; stop it and start it again "
                  "with --auth", file=sys.stderr)
        return 0
    if args.action == "stop":
        info = server.stop(where)
        print(f"stopped the Prefect server at {info.url} (pid {info.pid})")
        return 0
    found = server.running(where)
    if found is None:
        print(f"no featcal Prefect server is running (home {where})")
        return 1
    print(f"running: Prefect server at {found.url} (pid {found.pid}, home {where})"
          + (f"; basic authentication, secret in {server.auth_file(where)}" if found.auth else
             ("; NO authentication" if not server.is_loopback(found.host) else "")))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from featcal.devices import gpu_devices
    from flows import deploy, server

    api = deploy.require_api()
    _check_cluster(args)
    name = args.name or f"featcal-{Path(args.config).stem}"
    with server.using_api(api):
        print(f"featcal: serving deployment featcal/{name} on '{args.cron}' (UTC) at {server.ui_url(api)}; "
              "Ctrl-C stops serving and pauses its schedule", file=sys.stderr)
        deploy.serve(args.config, args.run_dir, args.cron, name, args.overrides, args.runner, args.address,
                     args.workers, args.worker_threads, args.tag_task_runs, args.tls_ca_file, args.tls_cert,
                     args.tls_key, gpu_devices(args.gpus) if args.gpus is not None else None)
    return 0


def _cmd_deployments(args: argparse.Namespace) -> int:
    from flows import deploy, server

    with server.using_api(deploy.require_api()):
        print(deploy.render(deploy.deployments()))
    return 0


def _cmd_eval_harness(args: argparse.Namespace) -> int:
    from flows.harness import eval_harness

    print(eval_harness(args.run_dir, [t for t in args.tasks.split(",") if t], args.models.split(","),
                       args.include_path, args.limit, args.batch_size))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _cmd_plan,
    "run": _cmd_run,
    "push": _cmd_push,
    "server": _cmd_server,
    "serve": _cmd_serve,
    "deployments": _cmd_deployments,
    "eval-harness": _cmd_eval_harness,
}


def _quiet_prefect_tracebacks(debug: bool) -> None:
    """Prefect logs a failed task or flow run with its traceback; for an error we report in one line, the
    traceback is noise unless --debug asked for it."""
    if debug:
        return
    import logging

    def one_line(record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], _user_errors()):
            record.exc_info, record.exc_text = None, None
        return True

    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if one_line not in handler.filters:
                handler.addFilter(one_line)


_USER_ERRORS = {"flows.plan": "NotEnoughDisk", "flows.server": "ServerError", "storage.rundir": "RunDirError",
                "flows.pool_runner": "WorkerDied", "botocore.exceptions": "EndpointConnectionError"}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors the user can fix (bad config or input, a busy, read-only or full disk, a server or S3 store that does
    not answer, a pool worker killed or out of memory, a run that failed while its server was down): reported in one
    line, not as a traceback. Config, data and checkpoint errors are ValueErrors. The others are taken from their
    modules only when loaded: a module never imported raised nothing, and importing one here (flows.plan loads every
    model class) would cost seconds on the way to a one-line refusal."""
    loaded = [getattr(sys.modules[module], name) for module, name in _USER_ERRORS.items() if module in sys.modules]
    return (ValueError, OSError, RunFailed, *loaded)


def _error_line(exc: BaseException) -> str:
    """One line: what failed, on which path, and what to do."""
    again = "fix the cause and rerun the same command: finished stages are kept"
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, FileNotFoundError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}; {again}"
    if type(exc).__name__ == "EndpointConnectionError":  # botocore's: the S3 activation store stopped answering
        return f"the activation store does not answer: {exc}; {again}"
    return str(exc).strip() or type(exc).__name__


def main(argv: list[str] | None = None, extra: Sequence[Command] = ()) -> int:
    from flows import signals

    parser = _parser(extra)
    args = parser.parse_args(argv)
    _check_runner(parser, args)
    setup_logging()
    commands = {**COMMANDS, **{command.name: command.run for command in extra}}
    with signals.stop_on_signals():
        try:
            code = commands[args.command](args)
        except signals.Stopped as stop:
            signals.exit_stopped(stop.signum)
        except BaseException as exc:
            if "prefect" in sys.modules:  # a SIGTERM that Prefect's own handler turned into its TerminationSignal
                from prefect.exceptions import TerminationSignal

                if isinstance(exc, TerminationSignal):
                    signals.exit_stopped(exc.signal)
            if not isinstance(exc, _user_errors()):
                raise
            if args.debug:
                traceback.print_exc()
            print(f"featcal: error: {_error_line(exc)}", file=sys.stderr)
            code = 2
    if argv is None and "flows.api_watch" in sys.modules and sys.modules["flows.api_watch"].unanswered.is_set():
        # The run said so in one line; as a program, skip Prefect's exit hooks: they would retry the server for minutes.
        signals.exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
