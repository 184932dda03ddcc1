"""Atomic writes and content digests: a crash never leaves a half-written file under its final name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Container, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling path (file or directory) that replaces `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)) / final.name
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as exc:
        if exc.errno is not None and exc.filename is None:  # a failed write() names no file: name the one it was for
            raise OSError(exc.errno, exc.strerror, str(final)) from exc
        raise
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def write_bytes(final: Path, data: bytes) -> None:
    with atomic_path(final) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())


def write_json(final: Path, obj: Any) -> None:
    write_bytes(final, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def content_hash(data: bytes = b"") -> xxhash.xxh3_128:
    """The hash of every content digest: integrity, not secrecy (a record's digest says its output is the one it
    wrote), so a fast non-cryptographic 128-bit hash: xxh3 reads ~20 GB/s where blake2b read ~0.8, and a run
    hashes every statistics file it writes."""
    return xxhash.xxh3_128(data)


def digest(path: Path, skip: Container[str] = ()) -> str:
    """Content digest of a file, or of a directory tree (relative names and bytes, in sorted order) without the
    top-level files named in `skip`."""
    path = Path(path)
    h = content_hash()
    if path.is_dir():
        for child in sorted(p for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in skip):
            h.update(str(child.relative_to(path)).encode() + b"\0")
            with open(child, "rb") as fh:
                h.update(hashlib.file_digest(fh, content_hash).digest())
    else:
        with open(path, "rb") as fh:
            h.update(hashlib.file_digest(fh, content_hash).digest())
    return h.hexdigest()


def remove(path: Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
