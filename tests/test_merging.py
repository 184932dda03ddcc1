"""Streaming merges against whole-stack reference implementations."""

import pytest
import torch

from featcal.config import MergeConfig
from featcal.merging import chunk_rows, dare_kept, drop_masks, merged_rows, merged_tensor, trimmed

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


def mergekit_magnitude(tau: torch.Tensor, density: float) -> torch.Tensor:
    """MergeKit's `sparsify.magnitude` rule, written literally: int(density·n) entries of largest |τ| by a sort, here
    a stable one (equal magnitudes: the lower flat index first), the tie-break our TIES states."""
    k = int(density * tau.numel())
    if density >= 1:
        return tau
    order = sorted(range(tau.numel()), key=lambda i: (-abs(float(tau.reshape(-1)[i])), i))
    mask = torch.zeros(tau.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return torch.where(mask.view_as(tau), tau, torch.zeros_like(tau))


def mergekit_ties(base: torch.Tensor, taus: list[torch.Tensor], density: float, normalize: bool, lam: float):
    """MergeKit's GTA task with `sum` consensus, every model at weight 1, written out entry by entry."""
    kept = torch.stack([mergekit_magnitude(t, density) for t in taus])
    sign_weight = kept.sum(0)
    majority = torch.where(sign_weight >= 0, 1.0, -1.0).to(kept.dtype)
    mask = kept.sign() == majority
    mixed = (kept * mask).sum(0)
    if normalize:
        divisor = mask.to(kept.dtype).sum(0)
        divisor[divisor == 0] = 1
        mixed = mixed / divisor
    return base + lam * mixed


def test_trim_keeps_top_fraction():
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 0.05, 2.0, -1.0, 0.3, 0.0, 4.0])
    torch.testing.assert_close(trimmed(x, 0.3), torch.tensor([0, -5.0, 3.0, 0, 0, 0, 0, 0, 0, 4.0]))


@pytest.mark.parametrize("top_k,kept", [(0.2, 2), (0.29, 2), (0.3, 3), (0.05, 0), (1.0, 10), (0.99, 9)])
def test_trim_keeps_exactly_int_top_k_n_entries(top_k, kept):
    """int(top_k·n), the float product truncated as MergeKit computes it (0.29·10 = 2.9 → 2), even when every
    magnitude ties: the lowest flat indices win."""
    for x in (torch.randn(10, generator=torch.Generator().manual_seed(3)), torch.full((10,), -0.5)):
        got = trimmed(x.double(), top_k)
        assert int((got != 0).sum()) == kept
        torch.testing.assert_close(got, mergekit_magnitude(x.double(), top_k), rtol=0, atol=0)
    assert torch.equal(trimmed(torch.full((10,), 2.0), 0.3) != 0, torch.arange(10) < 3)


def test_trim_breaks_ties_at_the_cut_by_index():
    """Magnitudes tied across the cut, with signs mixed: the entries above it, then the tied ones in index order."""
    x = torch.tensor([[1.0, -3.0, 2.0, -2.0], [2.0, 0.5, -2.0, 3.0]], dtype=torch.float64)
    got = trimmed(x, 0.5)  # 4 of 8: both 3s, then the first two of the four 2s (flat indices 2, 3)
    assert torch.equal(got, torch.tensor([[0, -3.0, 2.0, -2.0], [0, 0, 0, 3.0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_k", [0.1, 0.2, 0.37, 0.5])
def test_trim_equals_mergekit_rule_on_ties_heavy_tensors(seed, top_k):
    """Quantised task vectors (few distinct magnitudes, so many ties at the cut) against the literal rule."""
    gen = torch.Generator().manual_seed(seed)
    tau = (torch.randint(-3, 4, (6, 7), generator=gen) * 0.25).double()
    got = trimmed(tau, top_k)
    assert int((got != 0).sum()) <= int(top_k * tau.numel())  # zeros of τ kept count as kept, yet are 0
    assert torch.equal(got, mergekit_magnitude(tau, top_k))


@pytest.mark.parametrize("how", ["sum", "mean"])
def test_ties_matches_reference(how):
    cfg = MergeConfig(method="ties", scaling=0.7, ties_top_k=0.2, ties_merge=how)
    taus = torch.stack([e - BASE for e in EXPERTS]).reshape(4, -1)
    k = int(0.2 * taus.shape[1])
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


@pytest.mark.parametrize("normalize", [False, True])
def test_ties_equals_mergekit_with_ties_on_sums_of_zero(normalize):
    """Our TIES against MergeKit's ties (weight 1, lambda = scaling; normalize false is ties_merge sum, true is mean),
    on quantised task vectors where ties at the cut and elected sums of exactly 0 (MergeKit elects +) occur."""
    gen = torch.Generator().manual_seed(7)
    base = (torch.randint(-8, 9, (5, 8), generator=gen) * 0.125).double()  # base + τ − base is τ exactly
    taus = [(torch.randint(-2, 3, (5, 8), generator=gen) * 0.5).double() for _ in range(3)]
    cfg = MergeConfig(method="ties", scaling=0.4, ties_top_k=0.45, ties_merge="mean" if normalize else "sum")
    got = merged_tensor(base, lambda: (base + t for t in taus), cfg)
    kept = torch.stack([mergekit_magnitude(t, 0.45) for t in taus])
    assert bool(((kept.sum(0) == 0) & (kept > 0).any(0)).any())  # an entry where MergeKit's + election matters
    torch.testing.assert_close(got, mergekit_ties(base, taus, 0.45, normalize, 0.4), rtol=1e-12, atol=1e-12)


def test_dare_masks_depend_on_seed_task_and_name_only():
    """The same (seed, task, name) gives the same mask in any run and whatever the other tasks are; another seed, task
    or tensor name gives another one."""
    a = dare_kept(42, 0.5, "sst2", "layer.0.w", 0, 1000)
    assert torch.equal(a, dare_kept(42, 0.5, "sst2", "layer.0.w", 0, 1000))
    for other in ((43, "sst2", "layer.0.w"), (42, "mnli", "layer.0.w"), (42, "sst2", "layer.1.w")):
        assert not torch.equal(a, dare_kept(other[0], 0.5, *other[1:], 0, 1000))
    cfg = MergeConfig(method="dare_linear", density=0.5)
    first = drop_masks(cfg, ["mnli", "sst2"], "layer.0.w", (10, 100))(1, 0, 10)
    second = drop_masks(cfg, ["qqp", "sst2", "zz"], "layer.0.w", (10, 100))(1, 0, 10)
    assert torch.equal(first, a) and torch.equal(second, a)


def test_dare_masks_of_any_entry_range_are_the_whole_masks_slice():
    """Philox is counter-based: entries [first, first + count) drawn alone equal the same entries of the whole mask,
    for ranges starting and ending off the 4-draw blocks."""
    whole = dare_kept(7, 0.3, "t", "w", 0, 103)
    for first, count in ((0, 1), (1, 4), (3, 9), (5, 98), (100, 3), (4, 0)):
        assert torch.equal(dare_kept(7, 0.3, "t", "w", first, count), whole[first:first + count])


@pytest.mark.parametrize("density", [0.1, 0.5, 0.9])
def test_dare_keeps_a_binomial_count(density):
    """Each entry is a Bernoulli(density) draw (as MergeKit's and PEFT's DARE), so the count kept per tensor is
    Binomial(n, density): its expectation, not exact. Over 20 tensors of 20 000 entries every count lies within 5
    standard deviations of n·density, and their total within 5 of the total's."""
    n, counts = 20_000, []
    for name in range(20):
        counts.append(int(dare_kept(42, density, "t", f"w{name}", 0, n).sum()))
    sd = (n * density * (1 - density)) ** 0.5
    assert all(abs(c - n * density) <= 5 * sd for c in counts), counts
    assert abs(sum(counts) - 20 * n * density) <= 5 * sd * 20**0.5


def test_dare_rescaled_expectation_is_the_task_vector():
    """E[dropped τ] = τ: the mean over 4000 seeds of DARE-linear with one expert at scale 1 is θ0 + τ, each entry
    within 5 standard errors, σ = |τ|·√((1 − p)/(p·N))."""
    gen = torch.Generator().manual_seed(5)
    base, tau = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    p, seeds = 0.3, 4000
    total = torch.zeros_like(tau)
    for seed in range(seeds):
        cfg = MergeConfig(method="dare_linear", density=p, scaling=1.0, seed=seed)
        masks = drop_masks(cfg, ["t"], "w", (3, 4))
        total += merged_tensor(base, lambda: iter([base + tau]), cfg, lambda t, masks=masks: masks(t, 0, 3)) - base
    error = (total / seeds - tau).abs()
    bound = 5 * tau.abs() * ((1 - p) / (p * seeds)) ** 0.5
    assert bool((error <= bound).all()), (error / bound).max()


@pytest.mark.parametrize("how", ["sum", "mean"])
@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_matches_reference(method, how):
    """DARE against a whole-stack reference written out as MergeKit's GTA task does it (weight 1, lambda = scaling),
    with 1/density rescaling and the same masks."""
    cfg = MergeConfig(method=method, scaling=0.6, density=0.4, ties_merge=how)
    tasks = ["a", "b", "c", "d"]
    masks = drop_masks(cfg, tasks, "w", tuple(BASE.shape))
    got = merged_tensor(BASE, stream, cfg, lambda t: masks(t, 0, BASE.shape[0]))
    base = BASE.double()
    deltas = torch.stack([torch.where(dare_kept(cfg.seed, 0.4, task, "w", 0, BASE.numel()).view(BASE.shape),
                                      (e.double() - base) / 0.4, 0.0) for task, e in zip(tasks, EXPERTS)])
    if method == "dare_linear":
        expected = base + 0.6 * deltas.sum(0)
    else:
        mask = deltas.sign() == torch.where(deltas.sum(0) >= 0, 1.0, -1.0).double()
        mixed = (deltas * mask).sum(0)
        if how == "mean":
            mixed = mixed / mask.double().sum(0).clamp_min(1)
        expected = base + 0.6 * mixed
    torch.testing.assert_close(got, expected.float())
    kept = (deltas != 0).sum().item() / deltas.numel()
    assert 0.25 < kept < 0.55  # 252 Bernoulli(0.4) draws


def test_dare_density_one_is_task_arithmetic():
    masks = drop_masks(MergeConfig(method="dare_linear", density=1.0), ["a", "b", "c", "d"], "w", (7, 9))
    got = merged_tensor(BASE, stream, MergeConfig(method="dare_linear", density=1.0), lambda t: masks(t, 0, 7))
    assert torch.equal(got, merged_tensor(BASE, stream, MergeConfig()))


def test_dare_without_masks_is_refused():
    with pytest.raises(ValueError, match="merge.method dare_ties needs the drop masks"):
        merged_tensor(BASE, stream, MergeConfig(method="dare_ties"))


def test_dare_streams_one_expert_at_a_time():
    """The experts are read one at a time per pass, never all held: of 6 expert copies made on demand, at most 2 are
    alive at once (the one being added and the previous one until its name is rebound)."""
    import weakref

    alive, most = set(), 0

    def experts():
        nonlocal most
        for i, e in enumerate(EXPERTS * 2):
            copy = e.clone()
            alive.add(i)
            weakref.finalize(copy, alive.discard, i)
            most = max(most, len(alive))
            yield copy

    cfg = MergeConfig(method="dare_ties", density=0.5)
    masks = drop_masks(cfg, [str(i) for i in range(8)], "w", (7, 9))
    merged_tensor(BASE, experts, cfg, lambda t: masks(t, 0, 7))
    assert most <= 2


def test_integer_tensors_are_kept_from_base():
    ids = torch.arange(5)
    assert torch.equal(merged_tensor(ids, lambda: iter([ids + 1]), MergeConfig()), ids)


@pytest.mark.parametrize("method", ["task_arithmetic", "average", "dare_linear", "dare_ties"])
def test_row_chunks_equal_the_whole_tensor(method):
    """Merging by blocks of rows (how a large embedding is merged) gives the whole-tensor merge bit for bit, for
    bf16 and float32 tensors, with a last chunk shorter than the others; DARE's masks included."""
    cfg = MergeConfig(method=method, scaling=0.3)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.randn(37, 11, generator=gen).to(dtype)
        experts = [(base.float() + 0.01 * torch.randn(37, 11, generator=gen)).to(dtype) for _ in range(3)]
        rows = chunk_rows(tuple(base.shape), cfg, max_elements=50)
        assert rows == 4 and 37 % rows
        masks = drop_masks(cfg, ["x", "y", "z"], "emb", (37, 11)) if method.startswith("dare") else None
        got = merged_rows(tuple(base.shape), dtype, lambda a, b, base=base: base[a:b],
                          lambda a, b, experts=experts: (e[a:b] for e in experts), cfg, rows, masks)
        whole = merged_tensor(base, lambda experts=experts: iter(experts), cfg,
                              masks and (lambda t, masks=masks: masks(t, 0, 37)))
        assert torch.equal(got, whole)
        if masks is not None:  # the masks did drop entries
            assert not torch.equal(whole, merged_tensor(base, lambda experts=experts: iter(experts),
                                                        MergeConfig(scaling=0.3)))


def test_chunking_is_off_for_ties_and_small_tensors():
    assert chunk_rows((37, 11), MergeConfig(method="ties"), max_elements=50) is None
    assert chunk_rows((37, 11), MergeConfig(method="dare_ties"), max_elements=50) == 4
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


@pytest.mark.parametrize("merge", [{"method": "task_arithmetic"}, {"method": "dare_ties", "density": 0.3}],
                         ids=["task_arithmetic", "dare_ties"])
def test_merge_stage_by_row_chunks_writes_the_same_checkpoint(tmp_path, monkeypatch, merge):
    """The merge stage reading experts a few rows at a time (forced here for every matrix of a tiny Llama, as it is
    for an LLM's embedding) writes the same merged weights as merging whole tensors; with DARE, the same masks."""
    from safetensors.torch import load_file

    import tasks.merge
    from flows.pipeline import run_pipeline
    from tests.test_decoders import _build

    cfg = _build(tmp_path, "llama", experts=2, featcal={"lambda": 0.01, "rho": 1.0, "alpha": 1.0}, merge=merge)
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


def test_dare_ties_run_is_reproducible_and_a_new_seed_is_another_merge(tiny_example, tmp_path):
    """Two DARE-TIES runs of the tiny BERT example in two run directories write the same merged checkpoint byte for
    byte (the masks depend on seed, task and tensor only); another merge.seed changes it, and the merge record says
    the method."""
    import json

    from flows.pipeline import run_pipeline
    from tests.conftest import example_config

    def merged(run: str, seed: int) -> bytes:
        cfg = example_config(tiny_example, "bert", evaluation={"enabled": False},
                             merge={"method": "dare_ties", "density": 0.5, "seed": seed, "scaling": 0.3})
        run_pipeline(cfg, tmp_path / run)
        assert json.loads((tmp_path / run / "records" / "merge.json").read_text())["info"]["method"] == "dare_ties"
        return (tmp_path / run / "merged" / "model.safetensors").read_bytes()

    first = merged("a", 42)
    assert merged("b", 42) == first
    assert merged("c", 7) != first


def test_every_config_method_but_given_is_a_registered_merge():
    from featcal.merging import CONFIG_METHODS, MADE_ELSEWHERE, METHODS

    assert set(METHODS) == set(CONFIG_METHODS) - {MADE_ELSEWHERE}


def test_the_registry_refuses_unknown_names_and_keys_and_parts_that_read_undeclared_keys():
    from featcal.merging import MAGNITUDE, TaskArithmeticFamily, register, register_family

    with pytest.raises(ValueError, match="merge.method does not accept it"):
        register(type("Other", (TaskArithmeticFamily,), {"name": "other", "keys": ()}))
    with pytest.raises(ValueError, match=r"reads \['lambda'\], which are not merge.\* keys"):
        register(type("Ta", (TaskArithmeticFamily,), {"name": "task_arithmetic", "keys": ("scaling", "lambda")}))
    with pytest.raises(ValueError, match=r"declares \['scaling'\] but its parts read \['scaling', 'ties_top_k'\]"):
        register_family(type("Ta", (TaskArithmeticFamily,), {"name": "task_arithmetic", "keys": ("scaling",),
                                                             "sparsifier": MAGNITUDE}))


def test_a_method_is_handed_only_the_keys_it_declares():
    """A key a method does not read cannot change its merge: task arithmetic ignores ties_top_k and the seed."""
    from featcal.merging import merge_method

    assert dict(merge_method(MergeConfig(method="dare_ties")).settings) == {
        "scaling": 0.3, "density": 0.5, "seed": 42, "ties_merge": "sum"}
    a = merged_tensor(BASE, stream, MergeConfig(scaling=0.4, ties_top_k=0.1, seed=1, wudi_steps=3))
    assert torch.equal(a, merged_tensor(BASE, stream, MergeConfig(scaling=0.4)))


def test_every_merge_method_has_a_model_card_tag():
    from featcal.merging import CONFIG_METHODS
    from featcal.model_card import MERGE_TAGS

    assert set(MERGE_TAGS) == set(CONFIG_METHODS)
