"""Streaming merges against whole-stack reference implementations."""

import pytest
import torch

from featcal.config import MergeConfig
from featcal.merging import merged_tensor, trimmed

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
