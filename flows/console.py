"""Where our log lines go: a leaf module, so the CLI, the pool's worker processes and benchmark drivers can all set
up the same console without importing one another."""

from __future__ import annotations

import logging
from pathlib import Path


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


NOISY = ("prefect.events", "prefect._internal", "prefect.client")  # connection warnings, retries, worker failures


class _ToFile(logging.Filter):
    """Keeps Prefect's connection noise off a console handler, sending it to a log file instead."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.file = logging.FileHandler(path, delay=True)  # the file appears with the first message it gets
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name.startswith(NOISY) or _api_failure(record)):
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file.handle(record)
        return False


def _api_failure(record: logging.LogRecord) -> bool:
    import httpx

    return record.exc_info is not None and isinstance(record.exc_info[1], httpx.HTTPError)


def divert_prefect_noise(path: Path) -> None:
    """Prefect's own connection warnings, retries and failed requests (with their tracebacks) go to `path`, not to
    the terminal: when its server stops answering they would otherwise come by the dozen, while the run itself says
    so in one line (flows/api_watch.py). Call after Prefect is imported (its import sets up its handlers)."""
    to_file = _ToFile(path)
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger) and lg.name.startswith("prefect"))]
    for logger in loggers:
        for handler in logger.handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if console and handler.get_name() != "featcal-console" and not any(
                    isinstance(f, _ToFile) for f in handler.filters):
                handler.addFilter(to_file)
