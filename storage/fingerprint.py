"""Content fingerprints of a run's inputs (checkpoints, datasets), memoised by file size and mtime."""

from __future__ import annotations

from pathlib import Path

from storage.atomic import digest, read_json, write_json


def _signature(path: Path) -> list[tuple[str, int, int]]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(f.relative_to(path) if path.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns)
            for f in files]


def fingerprint(path: str | Path, memo_file: Path) -> str:
    """Digest of a file or directory's content; a name that is not on disk (a hub id) is its own fingerprint."""
    path = Path(path)
    if not path.exists():
        return f"name:{path}"
    memo = read_json(memo_file) if memo_file.is_file() else {}
    signature = _signature(path)
    key = str(path.resolve())
    entry = memo.get(key)
    if entry and entry["signature"] == [list(s) for s in signature]:
        return entry["digest"]
    memo[key] = {"signature": signature, "digest": digest(path)}
    write_json(memo_file, memo)
    return memo[key]["digest"]
