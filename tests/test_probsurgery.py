"""ProbSurgery (featcal_bench.probsurgery): its objective against a loop-by-loop reference, its inference path, and its
training through the Surgery loop (featcal_bench.surgery.fit_adapters)."""

import math

import pytest
import torch
import torch.nn.functional as F

from featcal_bench.probsurgery import KL_WEIGHT, RANK, ProbSurgeryAdapter, probsurgery_loss
from featcal_bench.surgery import SurgeryAdapter, fit_adapters, train_surgery


def _tensors(seed: int, b: int = 3, d: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, generator=g, dtype=torch.float64) for _ in range(5)]


def _loss_by_loops(z, target, mean, log_var, noise, kl_weight) -> float:
    """L1 over every entry of z − (μ + ε·σ) − z_t, plus β · the rows' mean of −½ Σ_j (1 + log σ² − μ² − σ²)."""
    b, d = z.shape
    l1 = kl = 0.0
    for i in range(b):
        for j in range(d):
            m, lv = float(mean[i, j]), float(log_var[i, j])
            sample = m + float(noise[i, j]) * math.sqrt(math.exp(lv))
            l1 += abs(float(z[i, j]) - sample - float(target[i, j]))
            kl += -0.5 * (1 + lv - m * m - math.exp(lv))
    return l1 / (b * d) + kl_weight * kl / b


@pytest.mark.parametrize("kl_weight", [KL_WEIGHT, 0.3])
def test_loss_matches_a_loop_reference(kl_weight):
    z, target, mean, log_var, noise = _tensors(0)
    got = probsurgery_loss(z, target, mean, log_var, noise, kl_weight)
    assert float(got) == pytest.approx(_loss_by_loops(z, target, mean, log_var, noise, kl_weight), rel=1e-12)
    # The KL term is the closed form of KL(N(μ, σ²) ‖ N(0, 1)), summed over features and averaged over rows.
    p = torch.distributions.Normal(mean, (0.5 * log_var).exp())
    kl = torch.distributions.kl_divergence(p, torch.distributions.Normal(0.0, 1.0)).sum(1).mean()
    no_kl = probsurgery_loss(z, target, mean, log_var, noise, 0.0)
    assert float(got - no_kl) == pytest.approx(kl_weight * float(kl), rel=1e-10)


def test_new_adapter_is_the_identity_with_unit_variance():
    adapter = ProbSurgeryAdapter(32, generator=torch.Generator().manual_seed(0))
    z = torch.randn(8, 32)
    assert adapter.down.weight.shape == (RANK, 32) and RANK == 128
    assert torch.equal(adapter(z), z)
    assert torch.count_nonzero(adapter.mean.weight) == 0 and torch.count_nonzero(adapter.log_var.weight) == 0
    bound = 1 / 32**0.5  # kaiming_uniform(a=√5), as nn.Linear and the reference initialise W_down
    assert 0.8 * bound < float(adapter.down.weight.detach().abs().max()) <= bound


def test_inference_uses_the_mean_path_only():
    """forward = z − μ(z): a Surgery adapter with W_up = W_μ, whatever W_σ holds, and no noise drawn."""
    g = torch.Generator().manual_seed(1)
    prob = ProbSurgeryAdapter(16, 8, g)
    surgery = SurgeryAdapter(16, 8)
    with torch.no_grad():
        prob.mean.weight.copy_(torch.randn(16, 8, generator=g))
        prob.log_var.weight.copy_(3 * torch.randn(16, 8, generator=g))
        surgery.down.weight.copy_(prob.down.weight)
        surgery.up.weight.copy_(prob.mean.weight)
        z = torch.randn(5, 16, generator=g)
        state = torch.get_rng_state()
        out = prob(z)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(out, surgery(z)) and not torch.equal(out, z)
        prob.log_var.weight.mul_(-2)
        assert torch.equal(prob(z), out)
        # With no noise and no KL term the training objective is Surgery's L1 of the same adapter.
        target = torch.randn(5, 16, generator=g)
        hidden = torch.relu(prob.down(z))
        zero_variance = probsurgery_loss(z, target, prob.mean(hidden), prob.log_var(hidden), torch.zeros(5, 16), 0.0)
        assert float(zero_variance) == pytest.approx(float(surgery.training_loss(z, target, g)), rel=1e-6)


def test_training_noise_comes_from_the_generator():
    adapter = ProbSurgeryAdapter(16, 8, torch.Generator().manual_seed(0))
    z, target = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        first, again, other = (adapter.training_loss(z, target, torch.Generator().manual_seed(s)) for s in (5, 5, 6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    # σ = 1 at init: the loss is L1(z − ε, z_t) (μ = 0) and a zero KL term.
    noise = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    assert float(first) == pytest.approx(float(F.l1_loss(z - noise, target)), rel=1e-6)


def _distorted(seed: int = 0):
    """Targets that are a known rank-4 ReLU distortion of the input."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(256, 32, generator=g)
    up, down = torch.randn(32, 4, generator=g) * 0.5, torch.randn(4, 32, generator=g) / 32**0.5
    return z, z - torch.relu(z @ down.T) @ up.T


def test_training_lowers_the_feature_distance_and_is_seeded(torch_on_one_thread, caplog):
    z, target = _distorted()
    with caplog.at_level("INFO", logger="featcal"):
        fit = fit_adapters({"x": z.__getitem__}, {"x": target}, method="probsurgery", seed=0)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("probsurgery: step")]
    assert len(progress) == 19 and progress[0].startswith("probsurgery: step 50/1000, elapsed ")
    adapter = fit["x"]
    assert isinstance(adapter, ProbSurgeryAdapter) and adapter.down.weight.shape == (RANK, 32) and not adapter.training
    with torch.no_grad():
        before, after = float(F.l1_loss(z, target)), float(F.l1_loss(adapter(z), target))
        log_var = adapter.log_var(torch.relu(adapter.down(z)))
    assert before == pytest.approx(0.4725, abs=1e-4)
    assert after < before / 20, (before, after)  # 0.020 here; Surgery reaches 0.017 on the same data
    assert float(log_var.mean()) < -5  # the L1 term pulls σ down from its start at 1 (log σ² −8.9 here)
    again = fit_adapters({"x": z.__getitem__}, {"x": target}, method="probsurgery", seed=0)["x"]
    other = fit_adapters({"x": z.__getitem__}, {"x": target}, method="probsurgery", seed=1)["x"]
    assert all(torch.equal(p, q) for p, q in zip(adapter.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(adapter.mean.weight, other.mean.weight)


def test_an_unknown_method_is_refused_in_one_line(tmp_path):
    z, target = _distorted()
    with pytest.raises(ValueError, match=r"^surgery method 'prob' is not one of \['probsurgery', 'surgery'\]$"):
        fit_adapters({"x": z.__getitem__}, {"x": target}, method="prob")
    with pytest.raises(ValueError, match="surgery method 'prob'"):
        train_surgery(tmp_path / "merged", {"x": tmp_path / "expert"}, {"x": []}, method="prob")
