"""Model skeletons on the meta device, and real copies of single submodules loaded from a checkpoint.

Only the submodule being worked on (one block, or the embeddings) ever holds real memory, so the
resident size is one block per model side, never a whole model per expert.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

from featcal.adapters import Adapter, adapter_for
from storage.checkpoint import CanonicalCheckpoint, CheckpointError
from storage.lora import LoraCheckpoint, config_directory, is_lora_adapter


class Skeleton:
    """A full model built on the meta device: its module tree, with no memory behind the parameters."""

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.adapter: Adapter = adapter_for(config)
        cls = getattr(transformers, self.adapter.architecture)
        with torch.device("meta"):
            self.model = cls(config)
        self.model.eval()
        self.body = self.adapter.body(self.model)

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> Skeleton:
        return cls(AutoConfig.from_pretrained(directory))

    def stored_in_out(self, canonical: str) -> bool:
        """Whether the module owning weight `canonical` (a body or head tensor) stores it [in, out] (Conv1D)."""
        path = canonical.rsplit(".", 1)[0]
        for root in (self.body, self.model):
            try:
                return isinstance(root.get_submodule(path), Conv1D)
            except AttributeError:
                continue
        raise CheckpointError(f"{self.adapter.architecture} has no module {path} (owner of tensor {canonical})")

    def block_template(self, layer: int) -> nn.Module:
        return self.body.get_submodule(self.adapter.block_prefix(layer).rstrip("."))

    def materialize(self, path: str, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A real, standalone copy of body submodule `path`, with `state` (names relative to it) loaded strictly."""
        module = copy.deepcopy(self.body.get_submodule(path)).to_empty(device="cpu")
        # Non-persistent buffers (position ids, ...) are not in checkpoints: let the model's own init rebuild them.
        for sub in module.modules():
            if any(True for _ in sub.named_buffers(recurse=False)):
                self.model._init_weights(sub)
        persistent = module.state_dict()
        missing = sorted(set(persistent) - set(state))
        unexpected = sorted(set(state) - set(persistent))
        if missing or unexpected:
            raise CheckpointError(
                f"cannot load submodule {path!r}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected tensors {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(persistent[name].shape):
                raise CheckpointError(
                    f"tensor {path}.{name}: shape {tuple(tensor.shape)} does not fit the model's "
                    f"{tuple(persistent[name].shape)}"
                )
        # Straight into the allocated parameters (state_dict's tensors share their storage; copy_ casts): a converted
        # copy of every tensor first would double the peak of an LLM's embedding.
        with torch.no_grad():
            for name, tensor in state.items():
                persistent[name].copy_(tensor)
        return module.eval()

    def block(self, layer: int, checkpoint: CanonicalCheckpoint | LoraCheckpoint) -> nn.Module:
        prefix = self.adapter.block_prefix(layer)
        return self.materialize(prefix.rstrip("."), checkpoint.with_prefix(prefix))

    def embedding(self, checkpoint: CanonicalCheckpoint | LoraCheckpoint) -> dict[str, nn.Module]:
        return {
            name: self.materialize(name, checkpoint.with_prefix(f"{name}."))
            for name in self.adapter.embedding_modules()
        }


def calibrated_modules(block: nn.Module) -> dict[str, nn.Module]:
    """The modules FeatCal solves for inside a block: every linear map (nn.Linear, and transformers' Conv1D, GPT-2's
    linear with its weight stored [in, out]) and every norm with an affine."""
    found = {}
    for name, module in block.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) or is_norm(module):
            found[name] = module
    return found


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a calibrated linear map."""
    if isinstance(module, Conv1D):
        return int(module.nx), int(module.nf)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    raise TypeError(f"{type(module).__name__} is not a linear map (nn.Linear or Conv1D)")


def as_out_in(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A linear map's weight as its module stores it, in the solves' [out, in] layout, or a solved [out, in] weight
    back in the module's layout: Conv1D stores [in, out], and a transpose is its own inverse; nn.Linear is as is."""
    return weight.T if isinstance(module, Conv1D) else weight


# RMS norms (scale only) whose class name does not say so.
RMS_NORMS = ("T5LayerNorm",)
# Norms whose forward scales by (offset + weight), not by weight: the norm solve's γ is offset + weight.
NORM_SCALE_OFFSETS = {"GemmaRMSNorm": 1.0, "Gemma2RMSNorm": 1.0}


def norm_scale_offset(module: nn.Module) -> float:
    """What the norm solve adds to a stored norm weight to get its scale γ (and subtracts from a solved γ)."""
    return NORM_SCALE_OFFSETS.get(type(module).__name__, 0.0)


def is_norm(module: nn.Module) -> bool:
    if isinstance(module, nn.LayerNorm):
        return module.elementwise_affine
    name = type(module).__name__
    return (name.endswith("RMSNorm") or name in RMS_NORMS) and isinstance(getattr(module, "weight", None), nn.Parameter)


def norm_eps(module: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    raise ValueError(f"norm module {type(module).__name__} exposes no eps/variance_epsilon")


def normalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's input with the normalisation applied and the affine left out (z in docs/design.md §2)."""
    x = x.float()
    eps = norm_eps(module)
    if isinstance(module, nn.LayerNorm):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) * torch.rsqrt(var + eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def expert_checkpoint(directory: str | Path, base_dir: str | Path,
                      skeleton: Skeleton) -> CanonicalCheckpoint | LoraCheckpoint:
    """An expert's tensors by canonical name: a full checkpoint, or a LoRA adapter read over the base."""
    if is_lora_adapter(directory):
        base = CanonicalCheckpoint(base_dir, skeleton.adapter)
        return LoraCheckpoint(directory, base, skeleton.adapter, skeleton.stored_in_out)
    return CanonicalCheckpoint(directory, skeleton.adapter)


def _lora_expert_model(expert_dir: str | Path, base_dir: str | Path | None) -> PreTrainedModel:
    """A LoRA expert as a whole model: the base's weights loaded into the expert's class, then every tensor the
    adapter changes (`LoraCheckpoint.adapted`) set to base + ΔW or to the adapter's own."""
    if base_dir is None:
        raise CheckpointError(f"LoRA adapter {expert_dir}: loading it as a model needs the run's base directory")
    config = AutoConfig.from_pretrained(config_directory(expert_dir, base_dir), local_files_only=True)
    skeleton = Skeleton(config)
    expert = expert_checkpoint(expert_dir, base_dir, skeleton)
    if not isinstance(expert, LoraCheckpoint):
        raise CheckpointError(f"{expert_dir}: expected a LoRA adapter, found a full checkpoint")
    # The base lacks the expert's head, which the adapter holds: transformers' load report would call it newly
    # initialised. It is silenced for this load, and every tensor it would name is checked to be set below.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = getattr(transformers, skeleton.adapter.architecture).from_pretrained(
            base_dir, config=config, local_files_only=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    body_state, model_state = skeleton.adapter.body(model).state_dict(), model.state_dict()
    set_here = set()
    with torch.no_grad():
        for name in expert.adapted():
            target = body_state.get(name, model_state.get(name))
            if target is None:
                raise CheckpointError(f"LoRA adapter {expert_dir}: tensor {name} is not in a "
                                      f"{skeleton.adapter.architecture}")
            target.copy_(expert.get(name))
            set_here.add(target.data_ptr())
    unset = sorted(k for k in info["missing_keys"] if model_state[k].data_ptr() not in set_here)
    if unset:
        raise CheckpointError(f"LoRA adapter {expert_dir}: {unset[:5]} of its {skeleton.adapter.architecture} are "
                              f"neither in base {base_dir} nor in the adapter (they would be random)")
    return model


def task_model(expert_dir: str | Path, body_from: CanonicalCheckpoint | None = None,
               base_dir: str | Path | None = None) -> nn.Module:
    """Expert `expert_dir` (its class, config and head), with its body replaced by `body_from` if given. A LoRA
    adapter expert needs `base_dir`, the base it adapts.

    This is how a merged or calibrated checkpoint is used for one task: shared body, the task's own head."""
    hf_logging.disable_progress_bar()  # one bar per model load drowns the pipeline's own progress
    if is_lora_adapter(expert_dir):
        model = _lora_expert_model(expert_dir, base_dir)
        adapter = adapter_for(model.config)
    else:
        config = AutoConfig.from_pretrained(expert_dir, local_files_only=True)
        adapter = adapter_for(config)
        model = getattr(transformers, adapter.architecture).from_pretrained(expert_dir, local_files_only=True)
    if body_from is not None:
        body = adapter.body(model)
        wanted = body.state_dict()
        # Tied parameters (T5's shared embedding) appear under several names, but a checkpoint stores one.
        def storage(name: str) -> tuple[int, tuple[int, ...]] | str:
            t = wanted[name]
            return (t.data_ptr(), tuple(t.shape)) if t.numel() else name

        stored: dict[tuple[int, tuple[int, ...]] | str, str] = {}
        for n in wanted:
            if n in body_from:
                stored.setdefault(storage(n), n)
        missing = [n for n in wanted if storage(n) not in stored]
        if missing:
            raise CheckpointError(f"{body_from.directory} lacks body tensors {missing[:5]} of {expert_dir}")
        body.load_state_dict({n: body_from.get(stored[storage(n)]).to(t.dtype) for n, t in wanted.items()},
                             strict=True)
    return model.eval()
