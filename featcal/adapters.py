"""Architecture adapters: everything the pipeline must know about a model family, in one small class each.

Adding an architecture means subclassing `Adapter`, filling in the names, and registering it with
`@register`; `ViTAdapter` below is the shape of a typical one (about fifteen lines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class BlockInput:
    """What one block needs besides the hidden states (e.g. the attention mask)."""

    attention_mask: torch.Tensor | None  # [B, T], 1 = real token, or None when every token is real


class Adapter:
    """Names and calls for one architecture family, in canonical (body-relative) parameter names."""

    model_types: ClassVar[tuple[str, ...]]
    # Where the transformer body lives inside each supported model class ("" = the model is the body).
    body_attr: ClassVar[dict[str, str]]
    # Prefixes a checkpoint file may put before body tensor names (first match wins).
    file_prefixes: ClassVar[tuple[str, ...]]
    blocks_path: ClassVar[str]
    # Names (inside a block) of the key/value projections, which keep full token weights in the last block.
    kv_modules: ClassVar[tuple[str, ...]]
    # Head tensors stay per task and are never merged.
    head_prefixes: ClassVar[tuple[str, ...]] = ("classifier.",)
    # Index of the token the head reads, or None when the head pools all tokens.
    pooled_token: ClassVar[dict[str, int | None]]
    probe_key: ClassVar[str]  # a canonical tensor name every checkpoint of the family has
    # (pattern, replacement) regexes from names as saved on disk to the module tree's names, applied in
    # order: transformers 5 renamed some modules but still saves (and loads) the legacy names.
    file_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.architecture = (config.architectures or [type(self).default_architecture(config)])[0]
        if self.architecture not in self.body_attr:
            raise UnsupportedModelError(
                f"architecture {self.architecture} is not supported by {type(self).__name__}; "
                f"supported: {sorted(self.body_attr)}"
            )

    @classmethod
    def default_architecture(cls, config: PretrainedConfig) -> str:
        return next(iter(cls.body_attr))

    def body(self, model: nn.Module) -> nn.Module:
        attr = self.body_attr[self.architecture]
        return getattr(model, attr) if attr else model

    @property
    def body_prefix(self) -> str:
        """The body's prefix in the model class's own state-dict names."""
        attr = self.body_attr[self.architecture]
        return f"{attr}." if attr else ""

    def blocks(self, body: nn.Module) -> nn.ModuleList:
        return body.get_submodule(self.blocks_path)

    def num_blocks(self) -> int:
        return self.text_or_vision_config().num_hidden_layers

    def text_or_vision_config(self) -> PretrainedConfig:
        return self.config

    def block_prefix(self, layer: int) -> str:
        return f"{self.blocks_path}.{layer}."

    def is_head(self, canonical_name: str) -> bool:
        return canonical_name.startswith(self.head_prefixes)

    def pooled_index(self) -> int | None:
        return self.pooled_token[self.architecture]

    def embedding_modules(self) -> tuple[str, ...]:
        """Body submodules that turn model inputs into block-0 hidden states."""
        return ("embeddings",)

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Block-0 hidden states from the materialised `embedding_modules()`."""
        raise NotImplementedError

    def block_input(self, inputs: dict[str, torch.Tensor]) -> BlockInput:
        return BlockInput(attention_mask=inputs.get("attention_mask"))

    def run_block(self, block: nn.Module, hidden: torch.Tensor, extra: BlockInput) -> torch.Tensor:
        mask = None
        if extra.attention_mask is not None:
            # Additive mask broadcast over heads and query positions: 0 keeps a key, -inf-ish drops it.
            keep = extra.attention_mask[:, None, None, :].to(hidden.dtype)
            mask = (1.0 - keep) * torch.finfo(hidden.dtype).min
        out = block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    def model_input_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def evaluate_forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
        """Full-model outputs with `hidden_states` (and `logits` where the model has a head)."""
        return model(**inputs, output_hidden_states=True)


_REGISTRY: list[type[Adapter]] = []


def register(cls: type[Adapter]) -> type[Adapter]:
    _REGISTRY.append(cls)
    return cls


def adapter_for(config: PretrainedConfig) -> Adapter:
    for cls in _REGISTRY:
        if config.model_type in cls.model_types:
            return cls(config)
    known = sorted(t for cls in _REGISTRY for t in cls.model_types)
    raise UnsupportedModelError(f"model_type {config.model_type!r} is not supported; supported model types: {known}")


@register
class BertAdapter(Adapter):
    model_types = ("bert",)
    body_attr = {"BertForSequenceClassification": "bert", "BertModel": ""}
    file_prefixes = ("bert.", "")
    blocks_path = "encoder.layer"
    kv_modules = ("attention.self.key", "attention.self.value")
    pooled_token = {"BertForSequenceClassification": 0, "BertModel": 0}
    probe_key = "embeddings.word_embeddings.weight"

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["embeddings"](input_ids=inputs["input_ids"], token_type_ids=inputs.get("token_type_ids"))

    def model_input_names(self) -> tuple[str, ...]:
        return ("input_ids", "attention_mask", "token_type_ids")


class _ImageAdapter(Adapter):
    def block_input(self, inputs: dict[str, torch.Tensor]) -> BlockInput:
        return BlockInput(attention_mask=None)

    def model_input_names(self) -> tuple[str, ...]:
        return ("pixel_values",)


@register
class CLIPVisionAdapter(_ImageAdapter):
    model_types = ("clip", "clip_vision_model")
    body_attr = {"CLIPVisionModel": "", "CLIPForImageClassification": "vision_model", "CLIPModel": "vision_model"}
    file_prefixes = ("vision_model.", "")
    blocks_path = "encoder.layers"
    kv_modules = ("self_attn.k_proj", "self_attn.v_proj")
    # CLIPForImageClassification averages the patch tokens; the others read the class token.
    pooled_token = {"CLIPVisionModel": 0, "CLIPForImageClassification": None, "CLIPModel": 0}
    probe_key = "embeddings.patch_embedding.weight"

    @classmethod
    def default_architecture(cls, config: PretrainedConfig) -> str:
        return "CLIPVisionModel" if config.model_type == "clip_vision_model" else "CLIPModel"

    def text_or_vision_config(self) -> PretrainedConfig:
        return getattr(self.config, "vision_config", self.config)

    def embedding_modules(self) -> tuple[str, ...]:
        return ("embeddings", "pre_layrnorm")

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["pre_layrnorm"](modules["embeddings"](inputs["pixel_values"]))

    def evaluate_forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
        # CLIPModel's own forward needs text too; only its vision tower is calibrated and compared.
        return super().evaluate_forward(self.body(model) if self.architecture == "CLIPModel" else model, inputs)


@register
class ViTAdapter(_ImageAdapter):
    model_types = ("vit",)
    body_attr = {"ViTForImageClassification": "vit", "ViTModel": ""}
    file_prefixes = ("vit.", "")
    blocks_path = "layers"
    kv_modules = ("attention.k_proj", "attention.v_proj")
    pooled_token = {"ViTForImageClassification": 0, "ViTModel": 0}
    probe_key = "embeddings.patch_embeddings.projection.weight"
    file_renames = (
        (r"^encoder\.layer\.", "layers."),
        (r"attention\.attention\.query", "attention.q_proj"),
        (r"attention\.attention\.key", "attention.k_proj"),
        (r"attention\.attention\.value", "attention.v_proj"),
        (r"attention\.output\.dense", "attention.o_proj"),
        (r"intermediate\.dense", "mlp.fc1"),
        (r"\.output\.dense", ".mlp.fc2"),
    )

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["embeddings"](inputs["pixel_values"])

