"""The Gram stage's two savings (featcal/statistics.py): one set of input sums per shared input, and the expert
side kept as products where that is cheaper. Both must give the solve what C_se gave it."""

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

import featcal.statistics as statistics
from featcal.modeling import calibrated_modules
from featcal.statistics import (
    accumulate,
    captured_inputs,
    expert_side_form,
    flatten_stats,
    linear_moments,
    module_keys,
    new_stats,
    stats_layout,
)
from flows.pipeline import run_pipeline
from tasks import solve
from tasks.context import context
from tests.conftest import example_config, torch_threads_restored


class SharedInputBlock(nn.Module):
    """q, k and v read one input; down narrows (out < in), as an MLP's second layer does."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6, bias=False)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 3)

    def forward(self, x):
        h = self.q(x) + self.k(x) * self.v(x)
        return self.down(torch.tanh(self.up(h)))


ALPHA = 0.25


def _chunks():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g),
             (torch.rand(2, 5, generator=g) > 0.3).float()) for _ in range(3)]


@torch.no_grad()
def _stats(forced: str | None, monkeypatch, rows_of_tasks: int = 0):
    torch.manual_seed(0)
    merged, expert = SharedInputBlock(), SharedInputBlock()
    mods_m, mods_e = calibrated_modules(merged), calibrated_modules(expert)
    if forced is not None:
        monkeypatch.setattr(statistics, "expert_side_form", lambda *a: forced)
    stats = None
    for s, e, mask in _chunks():
        sink_m, sink_e, outs_e = {}, {}, {}
        with captured_inputs(mods_m, sink_m):
            merged(s)
        with captured_inputs(mods_e, sink_e, outs_e):
            expert(e)
        weights = dict.fromkeys(mods_m, mask.reshape(-1))
        if stats is None:
            forms, owners = stats_layout(mods_m, weights, (sink_m, sink_e), 6, 2, keeps_expert=True,
                                         rows_of_tasks=rows_of_tasks)
            stats = new_stats(mods_m, forms, owners, alpha=ALPHA)
        accumulate(stats, mods_m, sink_m, sink_e, weights, outs_e, mods_e)
    return stats, merged, expert


@pytest.mark.parametrize("form", ["gram", "product"])
def test_moments_match_brute_force_in_either_form(form, monkeypatch):
    stats, merged, expert = _stats(form, monkeypatch)
    assert stats["k"].owner == stats["v"].owner == "q" and stats["up"].owner == "up"
    flat = flatten_stats(stats)
    assert "q+k+v:ss" in flat and not {"q:ss", "k:ss", "v:ss"} & set(flat) and "up:ss" in flat
    acts_m, acts_e = {}, {}
    xs_all, xe_all, w_all = [], [], []
    for s, e, mask in _chunks():  # brute force: every row in float64
        with torch.no_grad(), captured_inputs(calibrated_modules(merged), acts_m), \
                captured_inputs(calibrated_modules(expert), acts_e):
            merged(s)
            expert(e)
        xs_all.append({k: v.double() for k, v in acts_m.items()})
        xe_all.append({k: v.double() for k, v in acts_e.items()})
        w_all.append(mask.reshape(-1).double())
    w = torch.cat(w_all)
    for name in ("k", "down"):
        keys = module_keys(list(flat), name)
        mom = linear_moments({part: flat[key] for key, part in keys.items()}, name)
        xs = torch.cat([c[name] for c in xs_all])
        xe = torch.cat([c[name] for c in xe_all])
        w_t = getattr(expert, name).weight.double()
        x_t = ALPHA * xe + (1 - ALPHA) * xs
        want = (xs * w[:, None]).T @ (x_t @ w_t.T) / w.sum()
        torch.testing.assert_close(mom.add_target(torch.zeros_like(want), ALPHA, w_t), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mom.c_ss, (xs * w[:, None]).T @ xs / w.sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mom.mu_e, (xe * w[:, None]).sum(0) / w.sum(), rtol=1e-5, atol=1e-6)
        assert (mom.p_st is not None) == (form == "product") and (mom.c_se is not None) == (form == "gram")


def test_expert_side_form_is_the_cheaper_one():
    # ViT-B/32, 32 examples × 50 tokens: the MLP's narrowing layer keeps products, the others C_se
    rows = 32 * 50
    assert expert_side_form(rows, 3072, 768, 1) == "product"
    assert expert_side_form(rows, 768, 3072, 1) == "gram"
    assert expert_side_form(rows, 768, 768, 3) == "gram"
    # few rows: products are cheaper than C_se's product with W_tᵀ in the solve
    assert expert_side_form(16, 768, 768, 1) == "product"


@pytest.fixture(scope="module")
def product_run(tiny_example, tmp_path_factory):
    """The tiny BERT example with every linear module in product form (the cost model keeps C_se for most of them at
    this size), one torch thread like the shared reference run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(statistics, "expert_side_form", lambda *a: "product")
        run_dir = tmp_path_factory.mktemp("forms-product")
        cfg = example_config(tiny_example, "bert", runtime={"keep_activations": True, "threads": 1},
                             evaluation={"enabled": False})
        with torch_threads_restored():
            run_pipeline(cfg, run_dir)
    return run_dir


def test_product_form_gives_the_weights_of_the_gram_form(product_run, one_thread_run):
    reference = load_file(one_thread_run / "calibrated" / "model.safetensors")
    product = load_file(product_run / "calibrated" / "model.safetensors")
    assert reference.keys() == product.keys()
    worst = max(float((product[k].double() - reference[k].double()).norm() / reference[k].double().norm())
                for k in reference if reference[k].dim() == 2)
    assert 0 < worst < 1e-5, worst  # other rounding, same solve
    stats = sorted((product_run / "stats").rglob("*.safetensors"))
    assert stats, "keep_activations keeps the statistics files"
    names = {key.rsplit(":", 1)[0] for key in load_file(stats[0])}
    shared = [n for n in names if "+" in n]  # one set of sums for query, key and value
    assert [sorted(n.split("+")) for n in shared] == [
        ["attention.self.key", "attention.self.query", "attention.self.value"]]


def test_product_sums_for_another_alpha_are_refused(product_run, tmp_path):
    """P_t holds α: a statistics file summed for one α must not feed a solve that asks another."""
    run = tmp_path / "run"
    shutil.copytree(product_run, run)
    raw = yaml.safe_load((run / "run.yaml").read_text())
    raw["featcal"]["alpha"] = 0.5
    (run / "run.yaml").write_text(yaml.safe_dump(raw))
    ctx = context(run)
    with pytest.raises(ValueError, match=r"P_t was summed for featcal.alpha 0.25, the run asks 0.5; rerun its Gram"):
        next(solve._task_stats(ctx, 0, ("attention.self.query",)))
    raw["featcal"]["alpha"] = 0.25  # the α it was summed for: read as it is
    (run / "run.yaml").write_text(yaml.safe_dump(raw))
    sums = next(solve._task_stats(context(run), 0, ("attention.self.query",)))
    assert sums["pt"].shape == (64, 64) and "se" not in sums
