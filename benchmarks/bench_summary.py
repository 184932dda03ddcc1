"""The command line of the scripts that summarise a built benchmark's runs into one markdown file
(protect_rounds.py, tinyllama_paired.py, ...): `SCRIPT BENCH --out FILE [--OPTION VALUE ...]`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def summarise(description: str, markdown: Callable[..., str], choices: dict[str, list[str]] | None = None) -> None:
    """Parse BENCH and --out, write `markdown(BENCH)` to --out and print it. Each of `choices` (option → its values)
    becomes `--option VALUE ...` (default: all) and reaches `markdown` as a keyword."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("bench", type=Path, help="a built benchmark whose runs have run")
    parser.add_argument("--out", type=Path, required=True)
    for option, values in (choices or {}).items():
        parser.add_argument(f"--{option}", nargs="+", choices=values, default=values)
    args = parser.parse_args()
    text = markdown(args.bench.resolve(), **{option: getattr(args, option) for option in choices or {}})
    args.out.write_text(text)
    print(text)
