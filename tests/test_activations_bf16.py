"""bfloat16 activation arrays: stored as their 16-bit patterns (zarr has no bfloat16), read back bit-exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from storage.activations import ActivationError, ActivationStore


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN payloads and -0.0 count (torch.equal treats NaN as unequal, -0.0 as 0.0)."""
    return t.view(torch.int16)


def _chunk_bytes(array_dir: Path) -> int:
    return sum(p.stat().st_size for p in array_dir.rglob("*") if p.is_file() and p.name != "zarr.json")


def test_bf16_round_trip_is_bit_exact(tmp_path):
    store = ActivationStore(str(tmp_path))
    values = torch.randn(37, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    words = np.array([0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x807F, 0x0040, 0x7F7F], dtype=np.uint16)
    special = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)  # -0, ±inf, NaN payload, subnormals, max
    values[5] = special
    location = str(tmp_path / "h")
    store.write_array(location, (37, 8), 10, "bfloat16", [values[:10], values[10:30], values[30:]])
    blocks = list(store.iter_row_blocks(location, 16))
    assert [b.shape[0] for b in blocks] == [16, 16, 5] and all(b.dtype == torch.bfloat16 for b in blocks)
    got = torch.cat(blocks)
    assert torch.equal(_bits(got), _bits(values))
    assert torch.equal(_bits(got[5]), _bits(special))
    assert torch.isnan(got[5, 3]) and got[5, 0] == 0 and torch.signbit(got[5, 0]) and got[5, 2] == -torch.inf
    assert store.array_dtype(location) == torch.bfloat16
    assert store.open_array(location).shape == (37, 8)
    stored = zarr.open_array(location, mode="r")
    assert stored.dtype == np.uint16 and stored.attrs["featcal_dtype"] == "bfloat16"


def test_fp32_blocks_are_rounded_to_nearest_even(tmp_path):
    store = ActivationStore(str(tmp_path))
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    ties = torch.tensor([[1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2 ** -20, -(1 + ulp / 2), 1e-40]])
    rows = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    as_numpy = rows[3:].numpy()  # numpy fp32 blocks take the same rounding
    store.write_array(str(tmp_path / "r"), (7, 5), 4, "bfloat16", [ties, rows[:3], as_numpy])
    got = torch.cat(list(store.iter_row_blocks(str(tmp_path / "r"), 7)))
    assert got[0, :4].tolist() == [1.0, 1 + 2 * ulp, 1 + ulp, -1.0]  # ties to even; just above a tie: up
    assert got[0, 4].item() == 2.0 ** -133  # an fp32 subnormal becomes the nearest bf16 subnormal
    want = torch.cat([ties, rows]).to(torch.bfloat16)
    assert torch.equal(_bits(got), _bits(want))


def test_bf16_array_takes_half_the_bytes_and_fp32_is_unchanged(tmp_path):
    store = ActivationStore(str(tmp_path))
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    store.write_array(str(tmp_path / "f"), (64, 32), 16, "float32", [values])
    store.write_array(str(tmp_path / "b"), (64, 32), 16, "bfloat16", [values])
    assert _chunk_bytes(tmp_path / "f") == 64 * 32 * 4 and _chunk_bytes(tmp_path / "b") == 64 * 32 * 2
    fp32 = zarr.open_array(str(tmp_path / "f"), mode="r")
    assert fp32.dtype == np.float32 and dict(fp32.attrs) == {}
    assert store.array_dtype(str(tmp_path / "f")) == torch.float32
    assert torch.equal(torch.cat(list(store.iter_row_blocks(str(tmp_path / "f"), 10))), values)


def test_bf16_array_still_checks_rows(tmp_path):
    store = ActivationStore(str(tmp_path))
    with pytest.raises(ActivationError, match="wrote 3 rows, expected 5"):
        store.write_array(str(tmp_path / "b"), (5, 4), 3, "bfloat16", [torch.zeros(3, 4)])
    with pytest.raises(ActivationError, match=r"block of shape \(2, 3\) does not fit array \(5, 4\) at row 0"):
        store.write_array(str(tmp_path / "b"), (5, 4), 3, "bfloat16", [torch.zeros(2, 3)])
    assert not (tmp_path / "b").exists()
