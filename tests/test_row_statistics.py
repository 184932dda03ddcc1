"""Statistics kept as rows (featcal/statistics.py, row form) and the weight solve in row form
(featcal.closed_form.solve_linear_weight_rows): where all tasks' rows together are few against a module's input
width, the rows replace its in × in Gram and the solve works on the n × n system of the rows. Both must give the
weights of the normal equations."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import featcal.statistics as statistics
from featcal.calibration_methods import ModuleData, calibration_method
from featcal.closed_form import PANEL, Hyper, LinearRows, panel_product, solve_linear_weight_rows
from featcal.config import FeatCalConfig, config_from_dict
from featcal.modeling import calibrated_modules
from featcal.statistics import captured_inputs, flatten_stats, linear_moments, module_keys, row_form_pays
from flows.pipeline import run_pipeline
from storage.rundir import RunDir
from tests.perturbed_experts import perturbed
from tests.test_gram_forms import ALPHA, _chunks, _stats


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_row_form_pays_where_rows_are_few():
    # Llama-3.2-3B shape, 2 tasks × 8 examples × 128 tokens: down_proj (8192 → 3072) keeps rows; o_proj (3072 →
    # 3072) and q/k/v (3072 → 3072, 1024, 1024) do not: 2048 rows are not few against 3072 inputs
    assert row_form_pays(1024, 2, 8192, [3072])
    assert not row_form_pays(1024, 2, 3072, [3072]) and not row_form_pays(1024, 2, 3072, [3072, 1024, 1024])
    # with 4 examples a task (1024 rows) they are, readers of one input together as alone
    assert row_form_pays(512, 2, 3072, [3072]) and row_form_pays(512, 2, 3072, [3072, 1024, 1024])
    # ViT-B/32, 8 tasks × 32 examples × 50 tokens: far more rows than inputs everywhere
    assert not row_form_pays(1600, 8, 3072, [768]) and not row_form_pays(1600, 8, 768, [3072, 768, 768])


def _task_rows(seed: int, d_in: int = 40, d_out: int = 7) -> list[LinearRows]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, n in enumerate((6, 9)):
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
        out.append(LinearRows(x=torch.randn(n, d_in, generator=g, dtype=torch.float64) + 0.2,
                              y=torch.randn(n, d_out, generator=g, dtype=torch.float64), w=w,
                              sum_w=float(w.sum()) * 1.25, weight=0.5 + t))
    return out


@pytest.mark.parametrize("lam", [0.05, 1.0])
def test_row_form_solve_is_the_normal_equations_solution(lam):
    """Wᵀ = (Σ_t C_ss/n_t + (λ+ε)I)⁻¹(Σ_t P_t/n_t + λA(W)ᵀ), n_t = ‖C_ss‖_F/c_t, built from the rows by brute force;
    Σw counts rows the row form left out (zero weight), so it is larger than the kept rows' weights."""
    tasks = _task_rows(0)
    g = torch.Generator().manual_seed(1)
    merged, base = (torch.randn(7, 40, generator=g, dtype=torch.float64) for _ in range(2))
    hp = Hyper(lam=lam, rho=2.2, alpha=ALPHA, eps=1e-8)
    sol, normalisers = solve_linear_weight_rows(tasks, merged, base, hp)
    a = (hp.lam + hp.eps) * torch.eye(40, dtype=torch.float64)
    b = lam * (2.2 * merged - 1.2 * base).T
    for t in tasks:
        c_ss = (t.x * t.w[:, None]).T @ t.x / t.sum_w
        n_t = float(torch.linalg.matrix_norm(c_ss)) / t.weight
        assert normalisers.pop(0) == pytest.approx(n_t, rel=1e-12)
        a += c_ss / n_t
        b += (t.x * t.w[:, None]).T @ t.y / t.sum_w / n_t
    want = torch.linalg.solve(a, b).T
    assert _relative(sol.weight, want) < 1e-10
    assert sol.path == "rows: 15 rows for 40 inputs" and sol.damping == hp.eps
    # fp32 rows, as the Gram stage stores them: fp32 products, float64 solve
    rounded = [replace(t, x=t.x.float(), y=t.y.float()) for t in tasks]
    assert 0 < _relative(solve_linear_weight_rows(rounded, merged, base, hp)[0].weight, want) < 1e-6


def test_panel_product_sums_fp32_panels_in_float64():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 2 * PANEL + 37, generator=g), torch.randn(3, 2 * PANEL + 37, generator=g)
    exact = a.double() @ b.double().T
    assert _relative(panel_product(a.double(), b.double()), exact) < 1e-14
    fp32 = panel_product(a, b)
    assert fp32.dtype == torch.float64 and 0 < _relative(fp32, exact) < 1e-6


def test_row_form_solve_refuses_the_objectives_it_does_not_solve():
    tasks = _task_rows(0)
    w = torch.zeros(7, 40, dtype=torch.float64)
    for hp in (Hyper(lam=0.1, rho=1.0, alpha=1.0, eps=1e-8, trust=0.1),
               Hyper(lam=0.1, rho=1.0, alpha=1.0, eps=1e-8, shrink=0.1)):
        with pytest.raises(ValueError, match="^the row-form solve takes neither featcal.trust nor featcal.shrinkage"):
            solve_linear_weight_rows(tasks, w, w, hp)


@torch.no_grad()
def test_row_statistics_keep_the_rows_of_weight_and_match_brute_force(monkeypatch):
    """An input's rows of non-zero weight are kept once for all the modules that read it (q, k and v share theirs),
    each module keeps its targets W_t x_t, and as moments they are the Gram form's."""
    monkeypatch.setattr(statistics, "row_form_pays", lambda *a: True)
    stats, merged, expert = _stats(None, monkeypatch, rows_of_tasks=2)
    assert all(stats[m].form == "rows" for m in ("q", "k", "v", "up", "down"))
    xs_all, xe_all, w_all = [], [], []
    for s, e, mask in _chunks():  # brute force: the rows again, in float64
        sink_m, sink_e = {}, {}
        with captured_inputs(calibrated_modules(merged), sink_m), captured_inputs(calibrated_modules(expert), sink_e):
            merged(s)
            expert(e)
        xs_all.append({k: v.double() for k, v in sink_m.items()})
        xe_all.append({k: v.double() for k, v in sink_e.items()})
        w_all.append(mask.reshape(-1).double())
    flat = flatten_stats(stats)
    assert {"down:xs", "down:yt", "down:w", "up:xs", "q+k+v:xs", "q+k+v:w", "q:yt", "k:yt"} <= set(flat)
    assert not [key for key in flat if key.endswith((":ss", ":se", ":pt"))] and "q:xs" not in flat
    w = torch.cat(w_all)
    kept = w > 0
    assert 0 < int(kept.sum()) < w.numel()
    for name, rows_key in (("k", "q+k+v:xs"), ("down", "down:xs")):
        xs, xe = torch.cat([c[name] for c in xs_all]), torch.cat([c[name] for c in xe_all])
        torch.testing.assert_close(flat[rows_key].double(), xs[kept])
        w_t = getattr(expert, name).weight.double()
        x_t = ALPHA * xe + (1 - ALPHA) * xs
        torch.testing.assert_close(flat[f"{name}:yt"].double(), (x_t @ w_t.T)[kept], rtol=1e-5, atol=1e-6)
        mom = linear_moments({part: flat[key] for key, part in module_keys(list(flat), name).items()}, name)
        torch.testing.assert_close(mom.c_ss, (xs * w[:, None]).T @ xs / w.sum(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mom.p_st, (xs * w[:, None]).T @ (x_t @ w_t.T) / w.sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mom.mu_e, (xe * w[:, None]).sum(0) / w.sum(), rtol=1e-6, atol=1e-7)


def test_featcal_row_form_solve_gives_the_moment_solve_weights_and_bias():
    """The same rows, solved in row form (ModuleData.rows) and as moments (the path trust, shrinkage and the head
    metric take): the same weight and bias, with task weights c_t."""
    g = torch.Generator().manual_seed(3)
    d_in, d_out, alpha = 30, 5, 0.25
    tensors = {f"{who}.{part}": torch.randn(d_out, d_in, generator=g, dtype=torch.float64) if part == "weight"
               else torch.randn(d_out, generator=g, dtype=torch.float64)
               for who in ("merged", "base", "e0", "e1") for part in ("weight", "bias")}
    sums = []
    for t, n in enumerate((8, 11)):
        xs = torch.randn(n, d_in, generator=g, dtype=torch.float64) + 0.2
        xe = xs + 0.3 * torch.randn(n, d_in, generator=g, dtype=torch.float64)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
        y = (alpha * xe + (1 - alpha) * xs) @ tensors[f"e{t}.weight"].T
        sums.append({"xs": xs, "yt": y, "w": w, "sum_s": (w[:, None] * xs).sum(0), "sum_e": (w[:, None] * xe).sum(0),
                     "sum_w": w.sum()})
    data = ModuleData(where="layer.0.down", tasks=("t0", "t1"), task_weights=(1.0, 0.4), has_bias=True,
                      stats=lambda: iter([{k: v.clone() for k, v in s.items()} for s in sums]),
                      merged=lambda part: tensors[f"merged.{part}"], base=lambda part: tensors[f"base.{part}"],
                      expert=lambda t, part: tensors[f"e{t}.{part}"])
    method = calibration_method(FeatCalConfig.model_validate({"lambda": 0.05, "rho": 2.2, "alpha": alpha}))
    rows, moments = method.solve_linear(replace(data, rows=True)), method.solve_linear(data)
    assert rows.report["solve_path"] == "rows: 19 rows for 30 inputs" and "solve_path" not in moments.report
    for part in ("weight", "bias"):
        assert _relative(rows.tensors[part], moments.tensors[part]) < 1e-10, part


def _llama_run(root, row_statistics: str, name: str = "", hidden: int = 32):
    """Two experts of a tiny Llama whose MLP is wide (256) against its 2 × 4 calibration examples of ≤ 12 tokens (and,
    with `hidden` 256, its attention too)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    if not (root / "base").exists():
        torch.manual_seed(0)
        base = LlamaForCausalLM(cfg).eval()
        base.save_pretrained(root / "base")
        for t in range(2):
            expert = LlamaForCausalLM(cfg).eval()
            expert.load_state_dict(perturbed(base, seed=10 + t))
            expert.save_pretrained(root / f"e{t}")
            rng = np.random.default_rng(t)
            ids = [[1] + rng.integers(3, 64, int(n)).tolist() for n in rng.integers(4, 12, 4)]
            Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}).save_to_disk(
                str(root / f"d{t}"))
    raw = {"base": str(root / "base"), "experts": {f"task{t}": str(root / f"e{t}") for t in range(2)},
           "calibration": {"data": {f"task{t}": {"path": str(root / f"d{t}")} for t in range(2)},
                           "examples_per_task": 4, "batch_size": 2},
           "featcal": {"lambda": 0.05, "rho": 2.2, "alpha": 0.3}, "evaluation": {"enabled": False},
           "runtime": {"row_statistics": row_statistics, "keep_activations": True}}
    run_dir = root / f"run-{row_statistics}{name}"
    run_pipeline(config_from_dict(raw, root), run_dir)
    return RunDir(run_dir)


def test_a_run_with_row_statistics_gives_the_weights_of_grams(tmp_path):
    """End to end: down_proj keeps rows (its 256 inputs against ≤ 2 × 48 rows) and is solved in row form, the other
    modules keep sums; the weights are those of a run with `runtime.row_statistics: off` up to fp32 rounding."""
    rows, grams = _llama_run(tmp_path, "auto"), _llama_run(tmp_path, "off")
    for layer in range(2):
        assert rows.record(f"gram/l{layer:02d}/task0")["info"]["row_form"] == ["mlp.down_proj"]
        assert grams.record(f"gram/l{layer:02d}/task0")["info"]["row_form"] == []
        path = rows.record(f"solve/l{layer:02d}")["info"]["solve_path"]
        assert list(path) == ["mlp.down_proj"] and path["mlp.down_proj"].startswith("rows: ")
        assert "solve_path" not in grams.record(f"solve/l{layer:02d}")["info"]
    kept = load_file(next((rows.root / "stats").rglob("*.safetensors")))
    assert "mlp.down_proj:xs" in kept and not any(k.startswith("mlp.down_proj:ss") for k in kept)
    a, b = (load_file(r.root / "calibrated" / "model.safetensors") for r in (rows, grams))
    worst = max(_relative(a[k], b[k]) for k in b if "down_proj" in k)
    assert 0 < worst < 1e-5, worst
    assert all(torch.equal(a[k], b[k]) for k in b if "layers.0" in k and "down_proj" not in k)


def test_a_run_with_row_statistics_is_deterministic(tmp_path):
    """The rows are kept and solved in a fixed order: a second run gives the same weights bit for bit."""
    first, second = _llama_run(tmp_path, "auto"), _llama_run(tmp_path, "auto", "-again")
    a, b = (load_file(r.root / "calibrated" / "model.safetensors") for r in (first, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_modules_that_share_an_input_share_its_rows_in_a_run(tmp_path):
    """At hidden 256 every input's rows are few: q/k/v and gate/up keep one set of rows each, every linear module is
    solved in row form, and the weights are those of Grams up to fp32 rounding."""
    rows, grams = _llama_run(tmp_path, "auto", hidden=256), _llama_run(tmp_path, "off", hidden=256)
    linear = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"]
    assert sorted(rows.record("gram/l01/task1")["info"]["row_form"]) == sorted(linear)
    assert sorted(rows.record("solve/l01")["info"]["solve_path"]) == sorted(linear)
    kept = load_file(rows.root / "stats" / "l01" / "task1.safetensors")
    assert "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj:xs" in kept and "self_attn.k_proj:yt" in kept
    assert not [key for key in kept if key.endswith((":ss", ":se", ":pt"))]
    a, b = (load_file(r.root / "calibrated" / "model.safetensors") for r in (rows, grams))
    worst = max(_relative(a[k], b[k]) for k in b if b[k].dim() == 2 and "layers" in k)
    assert 0 < worst < 1e-5, worst
