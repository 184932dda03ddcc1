"""TSV-M, Iso-C, Iso-CTS and WUDI against references written from their definitions (numpy's SVD and eigh, autograd
for WUDI's loss), and the merge stage running them before FeatCal on the tiny example."""

import numpy as np
import pytest
import torch

from featcal.config import MergeConfig
from featcal.merging import chunk_rows, merged_tensor
from featcal.subspace_merges import iso_cts_sizes, wudi_loss

g = torch.Generator().manual_seed(11)
BASE = torch.randn(9, 6, generator=g, dtype=torch.float64)
TAUS = [0.1 * torch.randn(9, 6, generator=g, dtype=torch.float64) for _ in range(3)]
BIAS = torch.randn(6, generator=g, dtype=torch.float64)
BIAS_TAUS = [0.1 * torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3)]


def merge(method: str, base=BASE, taus=TAUS, **keys) -> torch.Tensor:
    return merged_tensor(base, lambda: (base + t for t in taus), MergeConfig(method=method, **keys))


def inverse_sqrt(m: np.ndarray) -> np.ndarray:
    """M^(−1/2) of a symmetric positive definite M by its eigendecomposition."""
    w, q = np.linalg.eigh(m)
    return q @ np.diag(w ** -0.5) @ q.T


def orthonormalised(x: np.ndarray) -> np.ndarray:
    """The polar factor by its definition X(XᵀX)^(−1/2): columns orthonormal, nearest to X's."""
    return x @ inverse_sqrt(x.T @ x)


def top(tau: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    u, s, vt = np.linalg.svd(tau, full_matrices=False)
    return u[:, :r], s[:r], vt[:r].T


def test_tsv_m_is_the_whitened_sum_of_each_tasks_top_singular_vectors():
    """k = 6, T = 3: each task's top 2 triplets; U and V stacked, orthonormalised by (XᵀX)^(−1/2); Σ U⊥ diag(σ) V⊥ᵀ,
    times α."""
    parts = [top(t.numpy(), 2) for t in TAUS]
    u = orthonormalised(np.concatenate([p[0] for p in parts], 1))
    v = orthonormalised(np.concatenate([p[2] for p in parts], 1))
    delta = u @ np.diag(np.concatenate([p[1] for p in parts])) @ v.T
    np.testing.assert_allclose(merge("tsv_m", svd_scaling=0.7).numpy(), BASE.numpy() + 0.7 * delta, rtol=0,
                               atol=1e-12)


def test_tsv_m_of_task_vectors_in_orthogonal_subspaces_is_task_arithmetic():
    """Rank-2 task vectors on mutually orthogonal left and right subspaces do not interfere: each keeps its whole
    spectrum, nothing is whitened away, and TSV-M gives their sum exactly."""
    q_left = torch.linalg.qr(torch.randn(9, 6, generator=g, dtype=torch.float64)).Q
    q_right = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64)).Q
    taus = [q_left[:, 2 * t:2 * t + 2] @ torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64) * (t + 1))
            @ q_right[:, 2 * t:2 * t + 2].T for t in range(3)]
    torch.testing.assert_close(merge("tsv_m", taus=taus), BASE + sum(taus), rtol=0, atol=1e-12)


def test_tsv_m_with_more_tasks_than_singular_values_keeps_none():
    taus = [0.1 * torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(3)]  # int(2/3) = 0 per task
    base = torch.zeros(4, 2, dtype=torch.float64)
    assert torch.equal(merge("tsv_m", base=base, taus=taus), base)


def test_iso_c_is_the_summed_task_matrix_with_its_mean_singular_value():
    """σ̄ = ‖Σ_t τ_t‖_* / k on the summed matrix's own directions: σ̄·Δ(ΔᵀΔ)^(−1/2)."""
    total = sum(TAUS).numpy()
    mean_sigma = np.linalg.norm(total, "nuc") / 6
    np.testing.assert_allclose(merge("iso_c", svd_scaling=1.3).numpy(),
                               BASE.numpy() + 1.3 * mean_sigma * orthonormalised(total), rtol=0, atol=1e-12)
    s = np.linalg.svd(merge("iso_c").numpy() - BASE.numpy(), compute_uv=False)
    np.testing.assert_allclose(s, np.full(6, mean_sigma), rtol=1e-12)  # isotropic


@pytest.mark.parametrize("k,tasks,fraction,sizes", [(10, 3, 0.8, (7, 1)), (8, 4, 0.8, (8, 0)), (384, 8, 0.8, (304, 10)),
                                                    (768, 8, 0.8, (616, 19)), (6, 3, 0.5, (3, 1))])
def test_iso_cts_sizes_leave_a_multiple_of_the_task_count_to_the_tasks(k, tasks, fraction, sizes):
    """int(f·k) common, then the rest rounded (half to even) to a multiple of T: (8 − 6)/4 = 0.5 rounds to 0."""
    assert iso_cts_sizes(k, tasks, fraction) == sizes


def test_iso_cts_is_common_plus_task_specific_directions_orthonormalised_with_a_flat_spectrum():
    """k = 6, T = 3, f = 0.5: the summed matrix's top 3 directions, then each task's top direction once the common
    left subspace is projected out of it; both stacks orthonormalised; every singular value their mean."""
    total = sum(TAUS).numpy()
    u_c, s_c, v_c = top(total, 3)
    us, ss, vs = [u_c], [s_c], [v_c]
    for tau in TAUS:
        u, s, v = top(tau.numpy() - u_c @ u_c.T @ tau.numpy(), 1)
        us, ss, vs = us + [u], ss + [s], vs + [v]
    sigma = np.concatenate(ss).mean()
    delta = sigma * orthonormalised(np.concatenate(us, 1)) @ orthonormalised(np.concatenate(vs, 1)).T
    got = merge("iso_cts", iso_common_fraction=0.5, svd_scaling=0.9).numpy()
    np.testing.assert_allclose(got, BASE.numpy() + 0.9 * delta, rtol=0, atol=1e-12)


def test_iso_cts_with_every_direction_common_is_iso_c():
    torch.testing.assert_close(merge("iso_cts", iso_common_fraction=1.0), merge("iso_c"), rtol=0, atol=1e-12)


def wudi_by_autograd(taus: list[torch.Tensor], steps: int, lr: float) -> torch.Tensor:
    """WUDI as its loss reads, Σ_t ‖(Δ − τ_t)τ_tᵀ‖²/‖τ_t‖², differentiated by autograd, from Δ = Σ_t τ_t."""
    delta = torch.nn.Parameter(sum(taus).clone())
    optimiser = torch.optim.Adam([delta], lr=lr)
    for _ in range(steps):
        loss = sum(((delta - t) @ t.T).square().sum() / t.square().sum() for t in taus)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return delta.detach()


def test_wudi_equals_adam_on_its_loss_by_autograd_and_lowers_the_loss():
    got = merge("wudi", wudi_steps=200, wudi_lr=1e-3) - BASE
    torch.testing.assert_close(got, wudi_by_autograd(TAUS, 200, 1e-3), rtol=0, atol=1e-12)
    start = wudi_loss(sum(TAUS), lambda: iter(TAUS))
    assert wudi_loss(got, lambda: iter(TAUS)) < 0.5 * start
    torch.testing.assert_close(merge("wudi", wudi_steps=0), BASE + sum(TAUS), rtol=0, atol=1e-15)  # no step: Σ τ_t


def test_wudi_loss_is_its_definition():
    delta = torch.randn(9, 6, generator=g, dtype=torch.float64)
    expected = sum(float(np.linalg.norm((delta - t).numpy() @ t.numpy().T) ** 2 / np.linalg.norm(t.numpy()) ** 2)
                   for t in TAUS)
    assert wudi_loss(delta, lambda: iter(TAUS)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("method,alpha", [("tsv_m", 0.5), ("iso_c", 0.5), ("iso_cts", 0.5), ("wudi", 1.0)])
def test_other_tensors_take_the_mean_task_vector(method, alpha):
    """1-D parameters (biases, norms) as the papers and FusionBench treat them: θ0 + α·mean τ_t (WUDI: α = 1)."""
    got = merge(method, base=BIAS, taus=BIAS_TAUS, svd_scaling=0.5)
    torch.testing.assert_close(got, BIAS + alpha * sum(BIAS_TAUS) / 3, rtol=0, atol=1e-15)


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts", "wudi"])
def test_matrix_merges_take_whole_tensors_in_the_base_dtype(method):
    assert chunk_rows((4096, 4096), MergeConfig(method=method), max_elements=50) is None
    base = BASE.float()
    got = merged_tensor(base, lambda: (base + t.float() for t in TAUS), MergeConfig(method=method, wudi_steps=5))
    assert got.dtype == torch.float32 and got.shape == base.shape


def test_iso_cts_merge_then_featcal_in_one_run(tiny_example, tmp_path):
    """`merge: {method: iso_cts}` followed by FeatCal on the tiny BERT example: the merge stage writes the merge
    the function makes of the checkpoints' tensors, and the calibrated model differs from it."""
    import json

    from safetensors.torch import load_file

    from flows.pipeline import run_pipeline
    from tests.conftest import example_config

    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False}, merge={"method": "iso_cts"})
    run_pipeline(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "records" / "merge.json").read_text())["info"]["method"] == "iso_cts"
    merged = load_file(tmp_path / "run" / "merged" / "model.safetensors")
    calibrated = load_file(tmp_path / "run" / "calibrated" / "model.safetensors")
    base = load_file(tiny_example / "bert" / "base" / "model.safetensors")
    experts = [load_file(tiny_example / "bert" / "experts" / t / "model.safetensors") for t in cfg.tasks]
    name = next(n for n in merged if n.endswith("layer.0.attention.self.query.weight"))
    copies = [next(v for k, v in e.items() if k.endswith(name)) for e in experts]
    direct = merged_tensor(base[name], lambda: iter(copies), MergeConfig(method="iso_cts"))
    assert torch.equal(merged[name], direct)
    assert not torch.equal(calibrated[name], merged[name])
