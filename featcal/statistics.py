"""Running statistics of calibrated modules' inputs: float64 sums fed chunk by chunk by the Gram kernel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

import featcal_kernels
from featcal.closed_form import LinearMoments, NormMoments
from featcal.modeling import is_norm, linear_dims, normalized


class LinearStats:
    def __init__(self, dim: int):
        self.ss = torch.zeros(dim, dim, dtype=torch.float64)
        self.se = torch.zeros(dim, dim, dtype=torch.float64)
        self.sum_s = torch.zeros(dim, dtype=torch.float64)
        self.sum_e = torch.zeros(dim, dtype=torch.float64)
        self.sum_w = torch.zeros((), dtype=torch.float64)

    def add(self, xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor) -> None:
        g = featcal_kernels.dual_gram(xs, xe, w)
        self.ss += g.c_ss.double()
        self.se += g.c_se.double()
        self.sum_s += g.sum_s.double()
        self.sum_e += g.sum_e.double()
        self.sum_w += g.sum_w.double()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"ss": self.ss, "se": self.se, "sum_s": self.sum_s, "sum_e": self.sum_e, "sum_w": self.sum_w}


class NormStats:
    def __init__(self, dim: int):
        self.sum_z = torch.zeros(dim, dtype=torch.float64)
        self.sum_z2 = torch.zeros(dim, dtype=torch.float64)
        self.sum_w = torch.zeros((), dtype=torch.float64)

    def add(self, z: torch.Tensor, w: torch.Tensor) -> None:
        wz = w[:, None] * z
        self.sum_z += wz.sum(0).double()
        self.sum_z2 += (wz * z).sum(0).double()
        self.sum_w += w.double().sum()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"sum_z": self.sum_z, "sum_z2": self.sum_z2, "sum_w": self.sum_w}


def _positive(sum_w: torch.Tensor, module: str) -> float:
    total = float(sum_w)
    if total <= 0:
        raise ValueError(f"module {module}: no token carries weight (Σw = {total}); is every token padding?")
    return total


def linear_moments(t: dict[str, torch.Tensor], module: str) -> LinearMoments:
    sw = _positive(t["sum_w"], module)
    return LinearMoments(c_ss=t["ss"] / sw, c_se=t["se"] / sw, mu_s=t["sum_s"] / sw, mu_e=t["sum_e"] / sw)


def norm_moments(t: dict[str, torch.Tensor], module: str) -> NormMoments:
    sw = _positive(t["sum_w"], module)
    return NormMoments(m=t["sum_z"] / sw, e=t["sum_z2"] / sw)


# Prefix of the held-out rows' sums in a statistics file (kept besides the all-row sums when λ or ρ is auto).
HELD = "held_"


def flatten_stats(stats: dict[str, LinearStats | NormStats], prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{module}:{prefix}{k}": v.contiguous() for module, s in stats.items() for k, v in s.tensors().items()}


def held_out_sums(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One module's sums over its held-out rows."""
    return {k[len(HELD):]: v for k, v in t.items() if k.startswith(HELD)}


def fit_sums(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One module's sums over the rows that are not held out: all rows minus the held-out ones."""
    return {k: v - t[HELD + k] for k, v in t.items() if not k.startswith(HELD)}


def example_rows(
    weights: dict[str, torch.Tensor], examples: torch.Tensor, *sides: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], ...]:
    """The token weights, then each side's module inputs, of the chunk's `examples` (a bool per example).

    A module's rows are its examples' tokens in example order (B·T, or B·T_encoder for cross-attention keys
    and values, or B when it reads one token per example), so row r belongs to example r // (rows / B)."""
    chosen: list[dict[str, torch.Tensor]] = [{} for _ in range(1 + len(sides))]
    for name, w in weights.items():
        rows = examples.repeat_interleave(w.shape[0] // examples.shape[0])
        for out, source in zip(chosen, (weights, *sides), strict=True):
            out[name] = source[name][rows]
    return tuple(chosen)


def unflatten_stats(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in flat.items():
        module, key = name.rsplit(":", 1)
        out.setdefault(module, {})[key] = tensor
    return out


def new_stats(modules: dict[str, nn.Module]) -> dict[str, LinearStats | NormStats]:
    return {
        name: NormStats(m.weight.shape[0]) if is_norm(m) else LinearStats(linear_dims(m)[0])
        for name, m in modules.items()
    }


@contextmanager
def captured_inputs(modules: dict[str, nn.Module], sink: dict[str, torch.Tensor]) -> Iterator[None]:
    """Record each module's first positional input, flattened to [tokens, features], while the block runs."""

    def hook(name: str):
        def pre_hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            sink[name] = x.reshape(-1, x.shape[-1])

        return pre_hook

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def accumulate(
    stats: dict[str, LinearStats | NormStats], modules: dict[str, nn.Module],
    merged_inputs: dict[str, torch.Tensor], expert_inputs: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
) -> None:
    """Add one chunk's module inputs (both sides) into the running sums; weights are per token."""
    for name, s in stats.items():
        xs, w = merged_inputs[name], weights[name]
        if xs.shape[0] != w.shape[0]:
            raise ValueError(f"module {name}: input has {xs.shape[0]} token rows, token weights have {w.shape[0]}")
        if isinstance(s, NormStats):
            s.add(normalized(modules[name], xs), w)
        else:
            s.add(xs, expert_inputs[name], w)
