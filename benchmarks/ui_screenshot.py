"""A screenshot of a FeatCal flow run in the Prefect UI, with its artifacts tab open.

    python -m benchmarks.ui_screenshot --out benchmarks/results/ui_flow_run.png

What it does, the way a user would: starts `featcal server` in a temporary home on a free loopback port,
builds the tiny example if `--example` does not hold it yet, runs `featcal run` on it (which reports to that
server), opens the flow run's page in headless Chromium, clicks the "Artifacts" tab, waits until our
artifacts (progress, per-block tables, accuracy table, report) are on screen, saves a PNG, and stops the
server. `--url URL` skips all that and photographs an existing flow-run page instead.

Needs Chromium (Debian: `apt-get install chromium`; it runs headless here with --no-sandbox --disable-gpu)
and nothing from the network. Not part of the test suite: CI machines have no browser.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

from benchmarks.common import ROOT
from flows import server

SHOWN = ("featcal-progress", "featcal-accuracy", "featcal-block-00")  # on screen once the tab has rendered


class Browser:
    """Just enough of the Chrome DevTools protocol: navigate, evaluate JavaScript, take a screenshot."""

    def __init__(self, chromium: str, width: int, height: int):
        self.profile = tempfile.mkdtemp(prefix="featcal-chromium-")
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        for line in self.proc.stderr:
            if m := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                port = int(m[1])
                break
        if port is None:
            raise RuntimeError("chromium did not open its DevTools port")
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json", timeout=10).json() if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20)
        self.ids = itertools.count(1)
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def js(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_js(self, expression: str, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.js(expression):
                return value
            time.sleep(0.25)
        raise RuntimeError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=20)
        shutil.rmtree(self.profile, ignore_errors=True)


def screenshot(url: str, out: Path, chromium: str, width: int = 1600, height: int = 1500) -> None:
    browser = Browser(chromium, width, height)
    try:
        browser.send("Page.navigate", url=url)
        click = """(() => {
            const tab = [...document.querySelectorAll('button, [role=tab], a, li')]
                .find(e => e.textContent.trim() === 'Artifacts' && e.offsetParent !== null);
            if (tab) { tab.click(); return true; } return false; })()"""
        browser.wait_js(click, "the Artifacts tab")
        shown = " && ".join(f"document.body.innerText.includes('{key}')" for key in SHOWN)
        browser.wait_js(shown, f"the artifacts {', '.join(SHOWN)} to render")
        time.sleep(1.0)  # let the cards finish drawing
        png = browser.send("Page.captureScreenshot", format="png")["data"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(png))
    finally:
        browser.close()


def run_example(example: Path, work: Path, home: Path) -> str:
    """Builds the tiny example if needed, runs it against the server in `home`; returns the flow run's UI URL."""
    env = {**os.environ, "FEATCAL_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    featcal = [sys.executable, "-m", "flows.cli"]
    if not (example / "bert" / "example.yaml").is_file():
        subprocess.run([*featcal, "example", "build", str(example)], cwd=ROOT, env=env, check=True)
    done = subprocess.run([*featcal, "run", str(example / "bert" / "example.yaml"), "--run-dir", str(work / "run")],
                          cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return re.search(r"^flow run: (\S+)$", done.stdout, re.M)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ui_flow_run.png")
    parser.add_argument("--example", type=Path, default=ROOT / "examples" / "tiny",
                        help="the tiny example (built here if missing)")
    parser.add_argument("--url", help="photograph this flow-run page instead of making one")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    parser.add_argument("--chromium", default=chromium)
    args = parser.parse_args()
    if args.url:
        screenshot(args.url, args.out, args.chromium)
    else:
        with tempfile.TemporaryDirectory(prefix="featcal-ui-") as tmp:
            home = Path(tmp) / "home"
            info, _ = server.start(home, port=0)
            try:
                url = run_example(args.example.resolve(), Path(tmp), home)
                print(f"flow run: {url}")
                screenshot(url, args.out, args.chromium)
            finally:
                server.stop(home)
    print(f"screenshot: {args.out}")


if __name__ == "__main__":
    main()
