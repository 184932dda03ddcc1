"""Streaming merges against whole-stack reference implementations."""

import pytest
import torch

from featcal.config import MergeConfig
from featcal.merging import chunk_rows, merged_rows, merged_tensor, trimmed

g = torch.Generator().manual_seed(0)
BASE = torch.randn(7, 9, generator=g)
EXPERTS = [BASE + 0.1 * torch.randn(7, 9, generator=g) for _ in range(4)]


def stream():
    return iter(EXPERTS)


def test_task_arithmetic():
    got = merged_tensor(BASE, stream, MergeConfig(method="task_arithmetic", scaling=0.3))
    torch.testing.assert_close(got, BASE + 0.3 * sum(e - BASE for e in EXPERTS))


def test_average():
    got = merged_tensor(BASE, stream, MergeConfig(method="average"))
    torch.testing.assert_close(got, torch.stack(EXPERTS).mean(0))


def test_trim_keeps_top_fraction():
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 0.05, 2.0, -1.0, 0.3, 0.0, 4.0])
    torch.testing.assert_close(trimmed(x, 0.3), torch.tensor([0, -5.0, 3.0, 0, 0, 0, 0, 0, 0, 4.0]))


@pytest.mark.parametrize("how", ["sum", "mean"])
def test_ties_matches_reference(how):
    cfg = MergeConfig(method="ties", scaling=0.7, ties_top_k=0.2, ties_merge=how)
    taus = torch.stack([e - BASE for e in EXPERTS]).reshape(4, -1)
    k = round(0.2 * taus.shape[1])
    kept = torch.zeros_like(taus)
    for i, tau in enumerate(taus):  # reference: explicit top-k indices per task
        idx = tau.abs().topk(k).indices
        kept[i, idx] = tau[idx]
    sign = torch.sign(kept.sum(0))
    agree = (torch.sign(kept) == sign) & (kept != 0)
    total = (kept * agree).sum(0)
    if how == "mean":
        total = total / agree.sum(0).clamp_min(1)
    expected = BASE + 0.7 * total.reshape(BASE.shape)
    torch.testing.assert_close(merged_tensor(BASE, stream, cfg), expected)


def test_integer_tensors_are_kept_from_base():
    ids = torch.arange(5)
    assert torch.equal(merged_tensor(ids, lambda: iter([ids + 1]), MergeConfig()), ids)


@pytest.mark.parametrize("method", ["task_arithmetic", "average"])
def test_row_chunks_equal_the_whole_tensor(method):
    """Merging by blocks of rows (how a large embedding is merged) gives the whole-tensor merge bit for bit, for
    bf16 and float32 tensors, with a last chunk shorter than the others."""
    cfg = MergeConfig(method=method, scaling=0.3)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.randn(37, 11, generator=gen).to(dtype)
        experts = [(base.float() + 0.01 * torch.randn(37, 11, generator=gen)).to(dtype) for _ in range(3)]
        rows = chunk_rows(tuple(base.shape), cfg, max_elements=50)
        assert rows == 4 and 37 % rows
        got = merged_rows(tuple(base.shape), dtype, lambda a, b: base[a:b],
                          lambda a, b: (e[a:b] for e in experts), cfg, rows)
        assert torch.equal(got, merged_tensor(base, lambda: iter(experts), cfg))


def test_chunking_is_off_for_ties_and_small_tensors():
    assert chunk_rows((37, 11), MergeConfig(method="ties"), max_elements=50) is None
    assert chunk_rows((37, 11), MergeConfig(), max_elements=1000) is None
    assert chunk_rows((1000,), MergeConfig(), max_elements=50) is None


def test_checkpoint_reads_rows(tmp_path):
    """A row range read from a safetensors file equals the slice of the whole tensor."""
    from safetensors.torch import save_file

    from storage.checkpoint import TensorFiles

    t = torch.randn(9, 5, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    save_file({"a": torch.ones(2), "t": t}, str(tmp_path / "model.safetensors"))
    files = TensorFiles(tmp_path)
    assert files.dtype("t") == torch.bfloat16
    for a, b in ((0, 9), (2, 5), (8, 9), (4, 4)):
        assert torch.equal(files.get("t", (a, b)), t[a:b])


def test_merge_stage_by_row_chunks_writes_the_same_checkpoint(tmp_path, monkeypatch):
    """The merge stage reading experts a few rows at a time (forced here for every matrix of a tiny Llama, as it is
    for an LLM's embedding) writes the same merged weights as merging whole tensors."""
    from safetensors.torch import load_file

    import tasks.merge
    from flows.pipeline import run_pipeline
    from tests.test_decoders import _build

    cfg = _build(tmp_path, "llama", experts=2, featcal={"lambda": 0.01, "rho": 1.0, "alpha": 1.0})
    run_pipeline(cfg, tmp_path / "whole")
    chunked_shapes = []

    def three_rows(shape, cfg):
        if len(shape) != 2:
            return None
        chunked_shapes.append(shape)
        return 3

    monkeypatch.setattr(tasks.merge, "chunk_rows", three_rows)
    run_pipeline(cfg, tmp_path / "chunked")
    whole, chunked = (load_file(tmp_path / run / "merged" / "model.safetensors") for run in ("whole", "chunked"))
    assert whole.keys() == chunked.keys()
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)
    assert any(shape[0] > 3 for shape in chunked_shapes)  # the chunked path ran, with several chunks
