"""Linear maps that read one input (q/k/v, gate/up) solved as one map with their outputs stacked: one system matrix,
one Cholesky factor (tasks/solve.py, _solve_units). Each output row's solve is on its own, so the weights must
be those of solving the maps one by one."""

import pytest
import torch
from safetensors.torch import load_file

from featcal.calibration_methods import CalibrationMethod, FeatCal, calibration_method
from featcal.modeling import calibrated_modules
from tasks import solve
from tasks.context import context
from tasks.merge import MERGED
from tests.test_row_statistics import _llama_run

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj")


def _units(ctx, layer: int) -> list[tuple[str, ...]]:
    modules = calibrated_modules(ctx.skeleton.block_template(layer))
    _, inputs = solve._block_layout(ctx, layer, modules)
    merged = ctx.checkpoint(MERGED).with_prefix(ctx.adapter.block_prefix(layer))
    return solve._solve_units(ctx, layer, list(modules), merged, inputs,
                              calibration_method(ctx.cfg.featcal))


@pytest.mark.parametrize("row_statistics, hidden", [("off", 32), ("auto", 256)])
def test_readers_of_one_input_solved_together_give_the_weights_of_one_by_one(tmp_path, monkeypatch, row_statistics,
                                                                             hidden):
    """Sums (Gram form) and rows (row form, every input at hidden 256): bit for bit, for one factor instead of three
    and two."""
    run = _llama_run(tmp_path, row_statistics, hidden=hidden)
    ctx = context(run.root)
    assert [u for u in _units(ctx, 1) if len(u) > 1] == [ATTENTION, MLP]
    together = load_file(run.root / run.block(1))
    monkeypatch.setattr(FeatCal, "joins_readers", property(lambda self: False))
    assert all(len(u) == 1 for u in _units(ctx, 1))
    solve.solve(ctx, 1)
    alone = load_file(run.root / run.block(1))
    assert together.keys() == alone.keys() and len(together) == 9
    assert all(torch.equal(together[k], alone[k]) for k in alone)


def test_regmean_solves_readers_of_one_input_together_as_one_by_one(tmp_path, monkeypatch):
    """RegMean's W = (Σ_t G_t)⁻¹ Σ_t G_t W_tᵀ is one system per input as well (here on FeatCal's sums)."""
    run = _llama_run(tmp_path, "off")
    ctx = context(run.root)
    ctx.cfg.featcal.method = "regmean"
    assert [u for u in _units(ctx, 0) if len(u) > 1] == [ATTENTION, MLP]
    solve.solve(ctx, 0)
    together = load_file(run.root / run.block(0))
    monkeypatch.setattr(CalibrationMethod, "joins_readers", property(lambda self: False))
    solve.solve(ctx, 0)
    alone = load_file(run.root / run.block(0))
    assert all(torch.equal(together[k], alone[k]) for k in alone)
    assert not torch.equal(together["self_attn.q_proj.weight"], load_file(run.root / "merged" / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.weight"])


def test_maps_are_solved_alone_where_a_choice_is_made_per_module(tmp_path):
    """λ chosen per module on held-out rows: stacked maps would share one choice, so each is solved alone."""
    run = _llama_run(tmp_path, "off")
    ctx = context(run.root)
    ctx.cfg.featcal.lam = "auto"
    assert all(len(u) == 1 for u in _units(ctx, 0))
