"""Where a built benchmark keeps things: the base at `base/`, each task's data at `data/{task}` and its expert at
`experts/{task}`; every recipe's build writes there and every method run reads from there."""

from __future__ import annotations

BASE = "base"
CONFIGS = "configs"  # one pipeline config per method run, `featcal plan` / `featcal run` ready


def data_dir(task: str) -> str:
    return f"data/{task}"


def expert_dir(task: str) -> str:
    return f"experts/{task}"
