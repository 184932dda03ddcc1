"""Chunked Zarr arrays for block-boundary hidden states and model inputs.

One writer per array, preallocated, filled chunk by chunk into a temporary directory that is renamed
into place when complete (DESIGN.md §3: no appends or shared shards across processes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import zarr

from storage.atomic import atomic_path


class ActivationError(ValueError):
    pass


def write_array(path: Path, shape: tuple[int, ...], chunk_rows: int, dtype: str,
                row_blocks: Iterable[torch.Tensor | np.ndarray]) -> None:
    """Write consecutive row blocks into a new array at `path`; fails if the rows do not add up to `shape`."""
    with atomic_path(Path(path)) as tmp:
        array = zarr.create_array(
            store=str(tmp), shape=shape, chunks=(chunk_rows, *shape[1:]), dtype=dtype,
            compressors=None, fill_value=0,
        )
        start = 0
        for block in row_blocks:
            values = block.detach().cpu().numpy() if isinstance(block, torch.Tensor) else np.asarray(block)
            stop = start + values.shape[0]
            if stop > shape[0] or tuple(values.shape[1:]) != tuple(shape[1:]):
                raise ActivationError(f"{path}: block of shape {values.shape} does not fit array {shape} at row {start}")
            array[start:stop] = values.astype(dtype, copy=False)
            start = stop
        if start != shape[0]:
            raise ActivationError(f"{path}: wrote {start} rows, expected {shape[0]}")


def open_array(path: Path) -> zarr.Array:
    if not (Path(path) / "zarr.json").is_file():
        raise ActivationError(f"activation array {path} is missing")
    return zarr.open_array(str(path), mode="r")


def iter_row_blocks(path: Path, rows: int) -> Iterator[torch.Tensor]:
    """Stream an array in blocks of `rows` rows, so RAM never holds more than one block."""
    array = open_array(path)
    for start in range(0, array.shape[0], rows):
        yield torch.from_numpy(np.ascontiguousarray(array[start:start + rows]))
