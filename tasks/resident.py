"""The resident path (docs/design.md, "The resident path"): the boundaries a block's stages write are also kept in
memory, exactly as the store holds them, and read from there by the block's other stages and the next block's, and
the blocks every task of a layer runs (the merged block in the Gram stages, the calibrated one in the propagations)
are built once per layer. The store stays the durable record: every boundary is still written, and a stage's record
still follows its outputs, so resume reads the store as on the streaming path. Chosen when the run's boundaries fit
in memory (runtime.resident)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from featcal.adapters import Adapter
from featcal.config import RunConfig
from featcal.devices import activation_dtype
from featcal.input_checks import text_length_limit

# The resident boundaries may take at most this share of the memory available when the run starts.
RESIDENT_SHARE = 0.5


class Resident:
    """What the resident path keeps between stages in one process."""

    def __init__(self) -> None:
        self.boundaries: dict[str, list[torch.Tensor]] = {}  # output name → its row blocks, as stored
        self.blocks: dict[tuple[Any, ...], torch.nn.Module] = {}  # (kind, layer, ...) → a built block

    def chunks(self, rel: str) -> list[torch.Tensor] | None:
        return self.boundaries.get(rel)

    def keep(self, rel: str, chunks: list[torch.Tensor]) -> None:
        self.boundaries[rel] = chunks

    def drop(self, rel: str) -> None:
        self.boundaries.pop(rel, None)

    def block(self, key: tuple[Any, ...], build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The block under `key` ((kind, layer, ...)), built on first use; another layer's blocks are let go."""
        if key not in self.blocks:
            self.blocks = {k: b for k, b in self.blocks.items() if k[1] == key[1]}
            self.blocks[key] = build()
        return self.blocks[key]


def tokens_per_example(cfg: RunConfig, adapter: Adapter) -> int:
    """The most tokens one example gives a block: the text length limit, or an image's patches and class token."""
    if "input_ids" in adapter.model_input_names():
        return text_length_limit(adapter.config, cfg.calibration.max_length)
    vision = adapter.text_or_vision_config()
    return int((vision.image_size // vision.patch_size) ** 2 + 1)


def boundary_bytes(cfg: RunConfig, adapter: Adapter) -> int:
    """One side of one task's boundary, as stored: examples (its own and any foreign ones, and their views) × tokens ×
    hidden × activation bytes."""
    examples = cfg.calibration.examples_per_task + cfg.foreign_examples
    rows = examples * (1 + cfg.calibration.views.count) * tokens_per_example(cfg, adapter)
    return rows * adapter.text_or_vision_config().hidden_size * activation_dtype(cfg.runtime.precision).itemsize


def resident_bytes(cfg: RunConfig, adapter: Adapter) -> int:
    """The most the resident path holds at once: per task, both sides of a block's boundary and the next block's
    (a block's Grams write E(l+1) while S(l) waits for the propagations)."""
    return 4 * len(cfg.tasks) * boundary_bytes(cfg, adapter)


def available_memory() -> int:
    """Bytes of memory available to this process now: Linux's MemAvailable, else the free physical pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resident_choice(cfg: RunConfig, adapter: Adapter) -> tuple[bool, str]:
    """Whether the run takes the resident path, and why (a line for `featcal plan`)."""
    need = resident_bytes(cfg, adapter)
    if isinstance(cfg.runtime.resident, bool):
        on = cfg.runtime.resident
        return on, f"{'on' if on else 'off'}: runtime.resident is {str(on).lower()} (the boundaries take {_gib(need)})"
    room = int(available_memory() * RESIDENT_SHARE)
    fits = need <= room
    return fits, (f"{'on' if fits else 'off'}: boundaries {_gib(need)} {'≤' if fits else '>'} {_gib(room)} "
                  f"({RESIDENT_SHARE:.0%} of the memory available now)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.3f} GiB"
