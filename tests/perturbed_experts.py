"""Stand-ins for fine-tuned experts: a model's state with seeded noise, for tests that build their own tiny
checkpoints (architectures, decoders, T5, a tokenizer without padding)."""

import torch


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """`model`'s state with seeded noise of 10 % of each float tensor's spread: a stand-in for a fine-tuned expert."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)
            if v.is_floating_point() and v.numel() > 1 else v for k, v in model.state_dict().items()}
