"""Where our log lines go: a leaf module, so the CLI, the pool's worker processes and benchmark drivers can all set
up the same console without importing one another."""

from __future__ import annotations

import logging


def setup_logging() -> None:
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
    logging.getLogger("distributed").setLevel(logging.WARNING)  # a local Dask cluster's start-up chatter
