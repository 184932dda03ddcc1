"""storage/behind.py: the writer thread takes every item in order, and an error on either side ends the call with it
(a failed producer makes the writer abandon its write)."""

import threading

import pytest

from storage.behind import ProducerFailed, written_behind


def test_items_arrive_in_order_on_another_thread():
    seen: list[int] = []
    threads: set[int] = set()

    def write(items):
        for item in items:
            threads.add(threading.get_ident())
            seen.append(item)
        return len(seen)

    assert written_behind(write, iter(range(100)), depth=3) == 100
    assert seen == list(range(100))
    assert threads and threading.get_ident() not in threads


def test_producer_error_is_raised_and_the_write_abandoned():
    outcome: list[str] = []

    def write(items):
        try:
            for _ in items:
                pass
        except ProducerFailed:
            outcome.append("abandoned")
            raise
        outcome.append("completed")

    def produce():
        yield 1
        raise ValueError("chunk 2 failed")

    with pytest.raises(ValueError, match="chunk 2 failed"):
        written_behind(write, produce())
    assert outcome == ["abandoned"]


def test_writer_error_is_raised_and_production_stops():
    produced: list[int] = []

    def write(items):
        for item in items:
            if item == 3:
                raise OSError("disk full")

    def produce():
        for i in range(1000):
            produced.append(i)
            yield i

    with pytest.raises(OSError, match="disk full"):
        written_behind(write, produce(), depth=2)
    assert len(produced) < 1000


def test_a_writer_that_stops_early_is_an_error():
    def write(items):
        return next(iter(items))

    with pytest.raises(RuntimeError, match="before it took every item"):
        written_behind(write, iter(range(50)), depth=1)
