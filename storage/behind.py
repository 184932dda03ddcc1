"""Writing behind the computation: a consumer (a store's array writer) runs on a thread of its own while the caller's
thread produces what it writes, so encoding and file or object-store writes overlap the next chunk's compute."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_END = object()  # every item was produced
_ABORT = object()  # the producer failed: the consumer must not finish its write


class ProducerFailed(RuntimeError):
    """Raised inside the consumer when the producer failed, so a staged write is discarded, not completed."""


def _items(q: queue.Queue[object]) -> Iterator[T]:
    while True:
        item = q.get()
        if item is _END:
            return
        if item is _ABORT:
            raise ProducerFailed("the rows being written could not all be computed")
        yield item  # type: ignore[misc]  # everything but the two markers is the producer's T


def _put(q: queue.Queue[object], item: object, writer: threading.Thread) -> None:
    """Put `item` when there is room, or drop it once the writer has stopped: a dead writer never blocks the caller."""
    while writer.is_alive():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def written_behind(write: Callable[[Iterable[T]], R], items: Iterable[T], depth: int = 2) -> R:
    """`write(items)`, with `write` consuming on a writer thread while this thread produces `items`; at most `depth`
    items wait between them (bounded memory). Returns when the write is complete; an error on either side is raised
    here, the producer's own, or else the writer's (a failed producer makes the writer abandon its write)."""
    q: queue.Queue[object] = queue.Queue(maxsize=depth)
    outcome: dict[str, object] = {}

    def consume() -> None:
        try:
            outcome["result"] = write(_items(q))
        except BaseException as exc:  # handed to the producer's thread, which raises it
            outcome["error"] = exc

    writer = threading.Thread(target=consume, name="featcal-writer", daemon=True)
    writer.start()
    end, left = _ABORT, False
    try:
        for item in items:
            if not writer.is_alive():  # the write failed (raised below) or took fewer items than there are
                left = True
                break
            _put(q, item, writer)
        end = _END
    finally:
        _put(q, end, writer)
        writer.join()
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error
    if left:
        raise RuntimeError("the writer returned before it took every item it was given")
    return outcome["result"]  # type: ignore[return-value]  # set by `write`, whose type is R
