"""Chunked Zarr arrays for block-boundary hidden states and model inputs, in a run's activation store.

The store is the run directory's `acts/` (plain files), or any fsspec URL (`runtime.activation_store`: a
shared file system, `s3://…`, `gs://…`), so Dask workers on other machines can reach the activations without
mounting the run directory's disk. One writer per array, preallocated, filled chunk by chunk under a temporary
name and published under its final name only when complete (docs/design.md §3: no appends or shared shards).
On a local file system publishing is a rename; on an object store it is a copy of the finished objects, so a
crash can leave a half-copied array: its digest then differs from the record's and the stage runs again.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.storage import FsspecStore

from storage.atomic import atomic_path, content_hash, digest, remove

ROOT = "acts"  # activation outputs are named `acts/...` relative to the run directory, wherever they live
# zarr 3.1 has no bfloat16: such arrays hold each value's 16-bit pattern as uint16, tagged by this attribute.
BFLOAT16 = "bfloat16"
LOGICAL_DTYPE_ATTR = "featcal_dtype"


class ActivationError(ValueError):
    pass


class ActivationStore:
    """Where a run's activations live. Locations are strings: a local path, or a path of the store's file system."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.options)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    @classmethod
    def of_run(cls, run_root: Path, url: str | None, storage_options: dict[str, Any] | None = None) -> ActivationStore:
        return cls(url if url is not None else str(Path(run_root) / ROOT), storage_options)

    def location(self, rel: str) -> str:
        """Where output `acts/…` (named relative to the run directory) lives in this store."""
        head, _, tail = rel.partition("/")
        if head != ROOT:
            raise ActivationError(f"{rel!r} is not an activation output (they are named {ROOT}/…)")
        return f"{self.root}/{tail}" if tail else self.root

    # ---- writing ----------------------------------------------------------------------------
    @contextmanager
    def staged(self, location: str) -> Iterator[str]:
        """A temporary location that replaces `location` (an array or a group of arrays) if the block succeeds."""
        if self.local:
            with atomic_path(Path(location)) as local_tmp:
                yield str(local_tmp)
            return
        self.fs.invalidate_cache()
        for stale in self.fs.glob(f"{location}.partial-*"):  # one writer per array: leftovers of a crashed one
            self.fs.rm(stale, recursive=True)
        tmp = f"{location}.partial-{secrets.token_hex(6)}"
        try:
            yield tmp
            self.remove(location)
            files = self.fs.find(tmp)
            # A list of files, not a recursive move: s3fs trips over the "directories" of a recursive listing.
            self.fs.copy(files, [location + f[len(tmp):] for f in files])
        finally:
            self.remove(tmp)

    def write_array(self, location: str, shape: tuple[int, ...], chunk_rows: int, dtype: str,
                    row_blocks: Iterable[torch.Tensor | np.ndarray]) -> None:
        """Write consecutive row blocks into a new array; fails if the rows do not add up to `shape`.

        dtype "bfloat16" rounds each block to bf16 (as torch's .to(torch.bfloat16)) and stores the bit patterns."""
        words = dtype == BFLOAT16
        tagged = {"dtype": "uint16", "attributes": {LOGICAL_DTYPE_ATTR: BFLOAT16}} if words else {"dtype": dtype}
        with self.staged(location) as tmp:
            array = zarr.create_array(store=self._zarr_store(tmp, read_only=False), shape=shape,
                                      chunks=(chunk_rows, *shape[1:]), compressors=None, fill_value=0, **tagged)
            start = 0
            for block in row_blocks:
                if words:
                    values = _bf16_words(block)
                else:
                    values = block.detach().cpu().numpy() if isinstance(block, torch.Tensor) else np.asarray(block)
                stop = start + values.shape[0]
                if stop > shape[0] or tuple(values.shape[1:]) != tuple(shape[1:]):
                    raise ActivationError(
                        f"{location}: block of shape {values.shape} does not fit array {shape} at row {start}")
                array[start:stop] = values if words else values.astype(dtype, copy=False)
                start = stop
            if start != shape[0]:
                raise ActivationError(f"{location}: wrote {start} rows, expected {shape[0]}")

    # ---- reading ----------------------------------------------------------------------------
    def open_array(self, location: str) -> zarr.Array:
        # Opened straight away rather than checked first: on an object store the check is one more round trip.
        try:
            return zarr.open_array(self._zarr_store(location, read_only=True), mode="r", zarr_format=3)
        except FileNotFoundError as exc:  # zarr's ArrayNotFoundError is one too
            raise ActivationError(f"activation array {self._name(location)} is missing") from exc

    def iter_row_blocks(self, location: str, rows: int) -> Iterator[torch.Tensor]:
        """Stream an array in blocks of `rows` rows, so RAM never holds more than one block."""
        array = self.open_array(location)
        words = _is_bf16(array)
        for start in range(0, array.shape[0], rows):
            values = np.ascontiguousarray(array[start:start + rows])
            yield torch.from_numpy(values.view(np.int16)).view(torch.bfloat16) if words else torch.from_numpy(values)

    def array_dtype(self, location: str) -> torch.dtype:
        """The dtype iter_row_blocks yields: torch.bfloat16 for the tagged uint16 arrays, else the stored one."""
        array = self.open_array(location)
        return torch.bfloat16 if _is_bf16(array) else torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype

    def array_names(self, location: str) -> list[str]:
        """The arrays directly inside a group location, sorted."""
        if self.local:
            return sorted(p.name for p in Path(location).iterdir() if (p / "zarr.json").is_file())
        self.fs.invalidate_cache(location)
        return sorted(Path(p).name for p in self.fs.ls(location, detail=False) if self._is_array(p))

    # ---- what the run directory's records need -----------------------------------------------
    def exists(self, location: str) -> bool:
        if self.local:
            return Path(location).exists()
        self.fs.invalidate_cache(location)
        return self.fs.exists(location)

    def digest(self, location: str) -> str:
        """Content digest of an array or group: relative names and bytes, in sorted order."""
        if self.local:
            return digest(Path(location))
        h = content_hash()
        self.fs.invalidate_cache(location)
        for path in sorted(self.fs.find(location)):
            h.update(path[len(location):].lstrip("/").encode() + b"\0")
            h.update(content_hash(self.fs.cat_file(path)).digest())
        return h.hexdigest()

    def remove(self, location: str) -> None:
        if self.local:
            remove(Path(location))
            return
        self.fs.invalidate_cache(location)
        if self.fs.exists(location):
            self.fs.rm(location, recursive=True)

    def check_writable(self) -> None:
        """Fail before any work when a remote store cannot be written (bucket, credentials, permissions)."""
        if self.local:
            return  # under the run directory, which the run has just locked
        probe = f"{self.root}/.featcal-probe-{secrets.token_hex(6)}"
        try:
            self.fs.pipe_file(probe, b"featcal")
            self.remove(probe)
        except Exception as exc:  # noqa: BLE001 - any backend's failure, named with the store's URL
            raise ActivationError(f"runtime.activation_store: cannot write to {self.url}: "
                                  f"{type(exc).__name__}: {exc}") from exc

    # ---- helpers ----------------------------------------------------------------------------
    def _is_array(self, location: str) -> bool:
        if self.local:
            return (Path(location) / "zarr.json").is_file()
        self.fs.invalidate_cache(location)
        return self.fs.exists(f"{location}/zarr.json")

    def _zarr_store(self, location: str, read_only: bool) -> Any:
        if self.local:
            return location
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return FsspecStore.from_url(f"{protocol}://{location}", storage_options=self.options, read_only=read_only)

    def _name(self, location: str) -> str:
        return location if self.local else f"{self.url}{location[len(self.root):]}"


def _is_bf16(array: zarr.Array) -> bool:
    return array.attrs.get(LOGICAL_DTYPE_ATTR) == BFLOAT16


def _bf16_words(block: torch.Tensor | np.ndarray) -> np.ndarray:
    """The bf16 bit patterns of a block as uint16 (rounded on the block's own device: half the bytes to copy)."""
    values = block.detach() if isinstance(block, torch.Tensor) else torch.from_numpy(np.asarray(block))
    return values.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
