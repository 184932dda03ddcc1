"""Stand-ins for fine-tuned experts, for tests that build their own tiny checkpoints: a model's state with seeded
noise (architectures, decoders, T5, a tokenizer without padding), or a few full-batch training steps (experts that
must answer their task: the hub recipes' T5 and Llama fixtures)."""

import torch


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """`model`'s state with seeded noise of 10 % of each float tensor's spread: a stand-in for a fine-tuned expert."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)
            if v.is_floating_point() and v.numel() > 1 else v for k, v in model.state_dict().items()}


def trained_copy(base: torch.nn.Module, steps: int, seed: int, **batch: torch.Tensor) -> torch.nn.Module:
    """A copy of `base` trained `steps` full-batch Adam steps (lr 3e-3) on `batch` (the model's keyword inputs,
    labels included), in eval mode."""
    torch.manual_seed(seed)
    expert = type(base)(base.config)
    expert.load_state_dict(base.state_dict())
    optimizer = torch.optim.Adam(expert.parameters(), lr=3e-3)
    expert.train()
    for _ in range(steps):
        optimizer.zero_grad()
        expert(**batch).loss.backward()
        optimizer.step()
    return expert.eval()
