"""Helpers for tests that drive `featcal` subprocesses against the session's Prefect server
(tests/prefect_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flows import server

ROOT = Path(__file__).resolve().parent.parent


def cli_env(info: server.ServerInfo, **extra: str) -> dict[str, str]:
    """Environment of a `featcal` subprocess that should find the session's server the way a user's does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update({"FEATCAL_HOME": info.home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}, **extra)
    return env


def featcal(*args: str, env: dict[str, str], **kw: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.25) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
