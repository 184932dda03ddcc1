"""Requests a run makes to an object-store activation store (`runtime.activation_store: s3://…`), by kind, side by
side in one invocation: on a real bucket each request costs a round trip (tens of ms), so their number, not the
bytes, sets a small model's stage times there.

    python -m benchmarks.store_requests --compare-with /tmp/featcal-before --out benchmarks/results/store_requests.md

The tiny offline BERT example (evaluation off) runs with `--no-prefect` in a child process against a moto S3 server
on loopback in this process, which counts every request it answers. Rows: another checkout (`--compare-with`),
this checkout, and this checkout with `max_concurrency: 1` in `runtime.storage_options`, which stops s3fs from
asking each object's size (one HEAD) before reading it whole. Moto answers in a few ms, so its wall times say
little about a real bucket; the counts carry over.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import re
import sys
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT
from benchmarks.pipeline_cost import run_once
from featcal_bench.example import build_tiny_example
from flows.pipeline import machine

KINDS = ("HEAD", "GET", "LIST", "PUT", "DELETE")
REQUEST = re.compile(r'"(?P<verb>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


class RequestCounter(logging.Handler):
    """Counts the requests moto's server logs, by kind: a GET of the bucket itself is a listing, a POST a batch
    delete, a PUT an upload or a server-side copy."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.missing = 0

    def emit(self, record: logging.LogRecord) -> None:
        found = REQUEST.search(re.sub(r"\x1b\[[\d;]*m", "", record.getMessage()))
        if found is None:
            return
        verb, path = found["verb"], found["path"].split("?")[0].strip("/")
        kind = {"POST": "DELETE"}.get(verb, "LIST" if verb == "GET" and "/" not in path else verb)
        self.kinds[kind] += 1
        self.missing += found["status"] == "404"

    def take(self) -> tuple[dict[str, int], int]:
        kinds, missing = dict(self.kinds), self.missing
        self.kinds.clear()
        self.missing = 0
        return kinds, missing


def store_config(example: Path, bucket: str, options: dict) -> Path:
    raw = yaml.safe_load((example / "example.yaml").read_text())
    raw["evaluation"] = {"enabled": False}
    raw["runtime"] = {"activation_store": f"s3://{bucket}/run", "storage_options": options}
    path = example / f"{bucket}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare-with", type=Path, metavar="CHECKOUT", help="another checkout of this project")
    parser.add_argument("--work", type=Path, default=Path("/tmp/featcal-store-requests"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import fsspec
    from moto.server import ThreadedMotoServer

    example = build_tiny_example(args.work / "example", archs=("bert",)) / "bert"
    counter = RequestCounter()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counter)
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    runs = [("this checkout", ROOT, {}), ("this checkout, `max_concurrency: 1`", ROOT, {"max_concurrency": 1})]
    if args.compare_with is not None:
        runs.insert(0, (f"`{args.compare_with.name}`", args.compare_with.resolve(), {}))
    rows = []
    try:
        for i, (label, code, extra) in enumerate(runs):
            bucket = f"featcal-requests-{i}"
            fsspec.filesystem("s3", **endpoint).mkdir(bucket)
            config = store_config(example, bucket, {**endpoint, **extra})
            counter.take()
            result = run_once(config, args.work / f"run-{i}-{time.time_ns()}", threads=1, prefect=False, code=code)
            kinds, missing = counter.take()
            rows.append({"code": label, "kinds": kinds, "missing": missing, **result})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    lines = [
        "# Requests to an S3 activation store — tiny BERT example, 3 tasks × 3 blocks",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. moto S3 server on loopback, `featcal run "
        f"--no-prefect`, 1 thread. Command: `python -m benchmarks.store_requests {' '.join(sys.argv[1:])}`",
        "",
        "| code | " + " | ".join(KINDS) + " | all requests | of them 404 | stages (s) | wall (s) |",
        "|---|" + "---:|" * (len(KINDS) + 4),
    ]
    for r in rows:
        lines.append(f"| {r['code']} | " + " | ".join(str(r["kinds"].get(k, 0)) for k in KINDS)
                     + f" | {sum(r['kinds'].values())} | {r['missing']} | {sum(r['stages_s'].values()):.1f} | "
                     f"{r['wall_s']:.1f} |")
    lines += ["", "LIST is a listing (GET of the bucket), DELETE a batch delete (POST), PUT an upload or a server-side "
              "copy (publishing a finished array copies it from its temporary name). Stages: the seconds the run's "
              "records sum; wall includes process start and imports."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
