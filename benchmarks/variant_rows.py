"""The variant studies' shared plumbing (few_examples.py, minilm8_quality.py): which variants a command line asks
for, and a JSON-lines file with one row per finished variant, appended, so a study stopped halfway keeps what it
finished and a rerun of a variant adds its new row."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def requested(names: list[str], known: Iterable[str]) -> list[str]:
    """`names`, or every known variant when none is given; an unknown name stops the script with the known ones."""
    known = list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {known}")
    return names or known


def appended(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of `path` after appending `row` to it."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return [json.loads(line) for line in path.read_text().splitlines()]
