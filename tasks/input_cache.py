"""The calibration inputs cache (runtime.input_cache): a task's model inputs — tokenised text or preprocessed images,
with their token mask — kept once per data fingerprint and input settings, and copied into later runs that share them
(another λ, α, merge or precision) instead of being prepared again. What the prepare stage computes from the merged and
expert checkpoints (the embeddings) is never cached: it depends on more than the data."""

from __future__ import annotations

import json
from typing import Any

import torch

from storage.activations import BFLOAT16, ActivationStore


class InputCache:
    """One task's entry: the Zarr group of its model inputs at `DIR/KEY`, and what the prepare stage reported about
    them at `DIR/KEY.json`, written last (an entry without it is incomplete and is made again)."""

    def __init__(self, directory: str, key: str):
        self.store = ActivationStore(directory)
        self.group = f"{self.store.root}/{key}"
        self.info_path = f"{self.group}.json"

    def info(self) -> dict[str, Any] | None:
        """The entry's prepare info when the entry is complete, else None."""
        if not self.store.fs.exists(self.info_path):
            return None
        info: dict[str, Any] = json.loads(self.store.fs.cat_file(self.info_path))
        return info

    def restore(self, store: ActivationStore, location: str, rows: int) -> dict[str, Any]:
        """Copy the entry into `location` of a run's `store`; its prepare info."""
        info = self.info()
        if info is None:
            raise FileNotFoundError(f"input cache entry {self.group} is incomplete")
        copy_group(self.store, self.group, store, location, rows)
        return info

    def save(self, store: ActivationStore, location: str, rows: int, info: dict[str, Any]) -> None:
        """Keep the model inputs at `location` of a run's `store` (and their prepare info) as this entry."""
        self.store.fs.makedirs(self.store.root, exist_ok=True)
        copy_group(store, location, self.store, self.group, rows)
        self.store.fs.pipe_file(self.info_path, json.dumps(info, sort_keys=True).encode())


def copy_group(source: ActivationStore, location: str, target: ActivationStore, into: str, rows: int) -> None:
    """Every array of group `location` of `source` into a new group `into` of `target` (replaced whole), `rows` rows
    a chunk, with the same dtype (bf16 arrays stay bf16): the arrays read back the same, chunk for chunk."""
    with target.staged(into) as tmp:
        for name in source.array_names(location):
            path = f"{location}/{name}"
            array = source.open_array(path)
            dtype = BFLOAT16 if source.array_dtype(path) == torch.bfloat16 else str(array.dtype)
            target.write_array(f"{tmp}/{name}", tuple(array.shape), rows, dtype, source.iter_row_blocks(path, rows))
