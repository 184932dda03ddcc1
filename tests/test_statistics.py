"""Module-input statistics gathered through hooks equal the moments computed by hand."""

import torch
from torch import nn

from featcal.modeling import calibrated_modules, normalized
from featcal.statistics import (
    accumulate,
    captured_inputs,
    flatten_stats,
    linear_moments,
    module_keys,
    new_stats,
    norm_moments,
)


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


@torch.no_grad()
def test_hooked_statistics_match_direct_moments():
    torch.manual_seed(0)
    merged, expert = TinyBlock(), TinyBlock()
    mods_m, mods_e = calibrated_modules(merged), calibrated_modules(expert)
    assert list(mods_m) == ["norm", "fc1", "fc2"]
    stats = new_stats(mods_m)
    chunks = [(torch.randn(2, 5, 4), torch.randn(2, 5, 4), (torch.rand(2, 5) > 0.3).float()) for _ in range(3)]
    for s, e, mask in chunks:
        sink_m, sink_e = {}, {}
        with captured_inputs(mods_m, sink_m):
            merged(s)
        with captured_inputs(mods_e, sink_e):
            expert(e)
        w = mask.reshape(-1)
        accumulate(stats, mods_m, sink_m, sink_e, dict.fromkeys(mods_m, w))
    flat = flatten_stats(stats)  # through the on-disk naming, read back as the solve reads it
    stats = {m: {part: flat[key] for key, part in module_keys(list(flat), m).items()} for m in mods_m}

    xs = torch.cat([s.reshape(-1, 4) for s, _, _ in chunks]).double()
    xe = torch.cat([e.reshape(-1, 4) for _, e, _ in chunks]).double()
    w = torch.cat([m.reshape(-1) for _, _, m in chunks]).double()
    # fc1 reads the normed input on each side
    hs = merged.norm(xs.float()).double()
    he = expert.norm(xe.float()).double()
    mom = linear_moments(stats["fc1"], "fc1")
    torch.testing.assert_close(mom.c_ss, (hs * w[:, None]).T @ hs / w.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mom.c_se, (hs * w[:, None]).T @ he / w.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mom.mu_e, (he * w[:, None]).sum(0) / w.sum(), rtol=1e-5, atol=1e-6)
    # the norm's statistics are of the merged side's normalised input, no affine
    z = normalized(merged.norm, xs.float()).double()
    nm = norm_moments(stats["norm"], "norm")
    torch.testing.assert_close(nm.m, (z * w[:, None]).sum(0) / w.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(nm.e, (z * z * w[:, None]).sum(0) / w.sum(), rtol=1e-5, atol=1e-6)


def test_token_weights_padding_and_pooled_emphasis():
    from tasks.gram import token_weights

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    plain = token_weights(mask, ["q", "k"], None, 0)
    assert torch.equal(plain["q"], torch.tensor([1, 1, 1, 0, 1, 1, 0, 0.0]))
    last = token_weights(mask, ["q", "k"], {"q": 0.01, "k": 1.0}, 0)
    assert torch.allclose(last["q"], torch.tensor([1, 0.01, 0.01, 0, 1, 0.01, 0, 0]))
    assert torch.equal(last["k"], plain["k"])  # key/value projections keep full weights
    assert torch.equal(token_weights(mask, ["q"], {"q": 0.01}, None)["q"], plain["q"])  # mean-pooled heads


def test_add_widened_is_the_whole_matrix_mixed_dtype_add_bit_for_bit():
    """Band by band (bands of 2 MiB of float64, so four at d = 1000; a vector in one add): the very sums
    `total += part` gives, for a float64 total and an fp32 part, matrices and vectors alike."""
    from featcal.statistics import WIDEN_BYTES, add_widened

    g = torch.Generator().manual_seed(3)
    for shape in ((1000, 1000), (1000, 90), (90,), ()):
        total = torch.randn(shape, generator=g, dtype=torch.float64) * 1e3
        part = torch.randn(shape, generator=g) * 1e-3
        want = total.clone()
        want += part
        add_widened(total, part)
        assert torch.equal(total, want), shape
    assert 1000 * 1000 * 8 > 3 * WIDEN_BYTES  # the matrix case did take several bands
