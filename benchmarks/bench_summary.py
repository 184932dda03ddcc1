"""The command line of the scripts that summarise a built benchmark's runs into one markdown file
(protect_rounds.py, tinyllama_paired.py): `SCRIPT BENCH --out FILE`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def summarise(description: str, markdown: Callable[[Path], str]) -> None:
    """Parse BENCH and --out, write `markdown(BENCH)` to --out and print it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("bench", type=Path, help="a built benchmark whose runs have run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    text = markdown(args.bench.resolve())
    args.out.write_text(text)
    print(text)
