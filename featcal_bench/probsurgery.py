"""ProbSurgery (Wei et al., ICML 2025, "Representation Surgery in Model Merging with Probabilistic Modeling").

Surgery (featcal_bench.surgery) predicts the representation bias z − z_t of the merged feature z as one vector per
input. ProbSurgery predicts a diagonal Gaussian over it instead and subtracts a sample while training:

    h = ReLU(W_down · z)                          W_down: rank × d
    μ = W_μ · h,   log σ² = W_σ · h               W_μ, W_σ: d × rank, no biases
    b = μ + ε ⊙ exp(½ · log σ²),   ε ~ N(0, I)    (reparameterised sample)
    ẑ = z − b
    loss = mean_{i,j} |ẑ_ij − z_t,ij|  +  β · KL,
    KL = (1/B) Σ_i −½ Σ_j (1 + log σ²_ij − μ_ij² − σ²_ij)      = mean over rows of KL(N(μ, σ²) ‖ N(0, I))

and at inference uses the mean only: ẑ = z − μ, read by the task's own head as in Surgery.

Where each fact comes from (the authors' code, github.com/1998v7/ProbSurgery, commit 0793276):
- the module: `code/src_ours/merging_model.py`, `AlphaWrapper` — `up_proj` (d → hidden, kaiming_uniform a = √5),
  `linear_mean` and `linear_var` (hidden → d, both initialised at zero, so a new module is the identity with σ = 1),
  no biases, ReLU between; `forward` samples with `reparameterize` (std = exp(½ log_var), ε from `randn_like`) and
  returns z − sample; `KL_reg` is the batch mean of −½ Σ (1 + log_var − μ² − exp(log_var)).
- the objective and optimiser: `code/run/run_ProbSurgery.py` — `loss_func(revised_feature, finetuned_features) +
  KL_weight · kl_loss` with L1 (`--loss_func L1_loss`, the default), `--KL_weight 1e-4`, `--hidden_layer 128`,
  Adam lr 1e-3, betas (0.9, 0.999), no weight decay, batches of 16 images per task, tasks taking turns.
- inference: `code/src_ours/modeling.py`, `ImageClassifierWithMapping.forward` — z − μ (the sampling lines are
  commented out there), the same in `AlphaWrapper.get_surgery_feature`.

Settings here: hidden width (`rank`) 128 and β = 1e-4, the method's own; lr, betas, batch 16, L1 and 1,000 steps per
task are our Surgery's (featcal_bench/surgery_run.py), so the two baselines get the same budget of steps and data.
The reference trains 100 steps per task per "iteration", 5 iterations by default (`--iter_number 5`) and 50 in its
launch script (`code/run.py`), and keeps the iteration with the best test accuracy; we train a fixed number of steps
and never look at test labels. ε is drawn from the task's own seeded generator (featcal_bench.surgery), so a run is
reproducible.
"""

from __future__ import annotations

import math

import torch
from torch import nn

RANK = 128  # the reference's --hidden_layer
KL_WEIGHT = 1e-4  # the reference's --KL_weight


def probsurgery_loss(z: torch.Tensor, target: torch.Tensor, mean: torch.Tensor, log_var: torch.Tensor,
                     noise: torch.Tensor, kl_weight: float = KL_WEIGHT) -> torch.Tensor:
    """L1(z − (μ + ε·σ), z_t) + β · the batch mean of KL(N(μ, σ²) ‖ N(0, I)); every tensor [B, d]."""
    sample = mean + noise * torch.exp(0.5 * log_var)
    kl = (-0.5 * (1 + log_var - mean.square() - log_var.exp()).sum(dim=1)).mean()
    return (z - sample - target).abs().mean() + kl_weight * kl


class ProbSurgeryAdapter(nn.Module):
    """A Gaussian over the representation bias: training subtracts a sample, `forward` (inference) the mean.

    A new adapter is the identity at inference (W_μ starts at zero) and has σ = 1 (W_σ starts at zero)."""

    RANK = RANK

    def __init__(self, dim: int, rank: int = RANK, generator: torch.Generator | None = None):
        super().__init__()
        self.down = nn.utils.skip_init(nn.Linear, dim, rank, bias=False)
        self.mean = nn.utils.skip_init(nn.Linear, rank, dim, bias=False)
        self.log_var = nn.utils.skip_init(nn.Linear, rank, dim, bias=False)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.mean.weight)
            nn.init.zeros_(self.log_var.weight)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The corrected feature at inference: z − μ(z)."""
        return z - self.mean(torch.relu(self.down(z)))

    def training_loss(self, z: torch.Tensor, target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The reference's objective on one batch, ε drawn from `generator`."""
        hidden = torch.relu(self.down(z))
        mean, log_var = self.mean(hidden), self.log_var(hidden)
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        return probsurgery_loss(z, target, mean, log_var, noise)
