"""A real S3 endpoint on loopback for the test session (a pytest plugin: `pytest_plugins = ("tests.s3_server",)`).

moto's server answers the S3 API in memory; other processes (Dask workers) reach it at the same address.
`s3_options` is what a run's `runtime.storage_options` needs to reach it; each test gets its own bucket.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}


@pytest.fixture
def s3_bucket(s3_options: dict[str, Any]) -> str:
    import fsspec

    name = f"featcal-{secrets.token_hex(4)}"
    fsspec.filesystem("s3", **s3_options).mkdir(name)
    return name
