"""Architecture adapters: everything the pipeline must know about a model family, in one small class each.

Adding an architecture means subclassing `Adapter`, filling in the names, and registering it with
`@register`; `ViTAdapter` below is the shape of a typical one (about fifteen lines).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from storage.checkpoint import CanonicalCheckpoint
from storage.lora import LoraCheckpoint


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class BlockInput:
    """What one block needs besides the hidden states (e.g. the attention mask)."""

    attention_mask: torch.Tensor | None  # [B, T], 1 = real token, or None when every token is real
    # Encoder–decoder models only: the stream's encoder output and its mask, read by a decoder block's
    # cross-attention, and the relative position bias the block's stack computes in its first block.
    encoder_hidden: torch.Tensor | None = None  # [B, S, H]
    encoder_mask: torch.Tensor | None = None  # [B, S]
    position_bias: torch.Tensor | None = None  # [1, heads, T, T]
    # Decoder-only models with rotary positions: the (cos, sin) the model's rotary module makes for the batch.
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def given_mask(self) -> torch.Tensor:
        """The attention mask, for architectures whose `block_input` always sets it."""
        if self.attention_mask is None:
            raise ValueError("this architecture's blocks need BlockInput.attention_mask")
        return self.attention_mask


# Reads one tensor of a checkpoint by canonical name (CanonicalCheckpoint.get).
TensorGetter = Callable[[str], torch.Tensor]


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `keep` is true, the dtype's most negative value elsewhere: added to attention scores."""
    return (~keep).to(dtype) * torch.finfo(dtype).min


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
    # Modules inside a block whose input is the encoder output (cross-attention keys/values), so their
    # token weights follow the encoder's mask, not the block's own.
    memory_modules: ClassVar[tuple[str, ...]] = ()
    # Head tensors stay per task and are never merged.
    head_prefixes: ClassVar[tuple[str, ...]] = ("classifier.",)
    # A causal LM, scored by its next-token loss rather than by labels.
    language_model: ClassVar[bool] = False
    # Index of the token the head reads, or None when the head pools all tokens.
    pooled_token: ClassVar[dict[str, int | None]]
    probe_key: ClassVar[str]  # a canonical tensor name every checkpoint of the family has
    # (pattern, replacement) regexes from names as saved on disk to the module tree's names, applied in
    # order: transformers 5 renamed some modules but still saves (and loads) the legacy names.
    file_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The body submodule between the last block and the head that the head reads through (a pooler, a final
    # norm), per architecture; absent: none. With featcal.calibrate_head_side it is calibrated as block L.
    head_side: ClassVar[dict[str, str]] = {}
    # The module of the last block whose output reaches the head through linear maps and norms only, per architecture
    # (its name inside the block); absent: featcal.head_metric is refused. `head_map` gives that path's matrix.
    head_input: ClassVar[dict[str, str]] = {}
    # Whether every task's logits come through the merged model's head (a causal LM's LM head is merged with the
    # body), so featcal.head_metric reads the merged checkpoint's head; else each task's expert's own head.
    head_is_merged: ClassVar[bool] = False

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
        return cast(nn.ModuleList, body.get_submodule(self.blocks_path))  # typed Module; a ModuleList at that path

    def num_blocks(self) -> int:
        return self.text_or_vision_config().num_hidden_layers

    def text_or_vision_config(self) -> PretrainedConfig:
        return self.config

    def block_prefix(self, layer: int) -> str:
        """Block `layer`'s name prefix; block L (= num_blocks()) is the head side, so that every stage that reads a
        block by its prefix (gram, solve, assemble) serves it too."""
        if layer == self.num_blocks():
            return f"{self.head_side_path()}."
        return f"{self.blocks_path}.{layer}."

    def head_side_path(self) -> str:
        if self.architecture not in self.head_side:
            raise UnsupportedModelError(f"featcal.calibrate_head_side: not supported for {self.architecture}")
        return self.head_side[self.architecture]

    def head_side_tokens(self) -> slice:
        """The tokens of the last block's output that count in the head side's statistics: the pooled token alone
        where the head reads one (BERT's pooler and CLIP's post_layernorm read nothing else, and a ViT's final
        norm reaches the head only there), else every token."""
        pooled = self.pooled_index()
        return slice(None) if pooled is None else slice(pooled, pooled + 1)

    def run_head_side(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads: the head-side module on `hidden` [B, T, H] (its `head_side_tokens()`), as [B, T, H]."""
        out = module(hidden)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])  # BERT's pooler drops the token axis (T = 1 here)

    def head_input_module(self) -> str:
        if self.architecture not in self.head_input:
            raise UnsupportedModelError(f"featcal.head_metric: not supported for {self.architecture} (supported: "
                                        f"{', '.join(supported_head_inputs())})")
        return self.head_input[self.architecture]

    def head_map(self, expert: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """H [classes, hidden]: the linear part of the path from `head_input_module()`'s output to a task's logits,
        read from the task's expert checkpoint."""
        raise UnsupportedModelError(f"featcal.head_metric: not supported for {self.architecture}")

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

    @property
    def has_decoder(self) -> bool:
        """Whether the model decodes a target sequence (calibration then needs decoder inputs: featcal/t5.py)."""
        return False

    def stack_starts(self) -> tuple[int, ...]:
        """The first block of each stack (an encoder–decoder has two); each one's input comes from the embeddings."""
        return (0,)

    def embed_at(self, start: int, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states entering block `start`, one of `stack_starts()`."""
        return self.embed(modules, inputs)

    def mask_name(self, layer: int) -> str:
        """The model input holding block `layer`'s token mask."""
        return "attention_mask"

    def ends_stack(self, layer: int) -> str | None:
        """The body module (a final norm) that turns block `layer`'s output into the encoder output later blocks
        read, when block `layer` ends such a stack; None otherwise."""
        return None

    def reads_encoder(self, layer: int) -> bool:
        """Whether block `layer` reads the encoder output (cross-attention)."""
        return False

    def block_input(self, inputs: dict[str, torch.Tensor], layer: int = 0,
                    weights: TensorGetter | None = None) -> BlockInput:
        """What block `layer` needs besides its hidden states; `weights` reads the running model's tensors (for
        what a block takes from another block of its stack)."""
        return BlockInput(attention_mask=inputs.get("attention_mask"))

    def run_block(self, block: nn.Module, hidden: torch.Tensor, extra: BlockInput) -> torch.Tensor:
        mask = None
        if extra.attention_mask is not None:
            # Broadcast over heads and query positions: 0 keeps a key, -inf-ish drops it.
            mask = additive_mask(extra.attention_mask[:, None, None, :].bool(), hidden.dtype)
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


def supported_head_inputs() -> list[str]:
    """The architectures featcal.head_metric serves."""
    return sorted(a for cls in _REGISTRY for a in cls.head_input)


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
    head_side = {"BertForSequenceClassification": "pooler", "BertModel": "pooler"}
    head_input = {"BertForSequenceClassification": "output.dense"}
    probe_key = "embeddings.word_embeddings.weight"

    def head_map(self, expert: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's output.dense) → LayerNorm(x + y) → tanh(P·h + p) at the [CLS] token → C·z: the norm's
        γ and centring, then P and C. The norm's 1/σ and tanh′ vary per row and are left out (a scale per row, and
        a per-dimension one near 1 where tanh is not saturated)."""
        self.head_input_module()
        norm = norm_path(expert.get(f"{self.blocks_path}.{self.num_blocks() - 1}.output.LayerNorm.weight"))
        return expert.get("classifier.weight").double() @ expert.get("pooler.dense.weight").double() @ norm

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["embeddings"](input_ids=inputs["input_ids"], token_type_ids=inputs.get("token_type_ids"))

    def model_input_names(self) -> tuple[str, ...]:
        return ("input_ids", "attention_mask", "token_type_ids")


def norm_path(gamma: torch.Tensor) -> torch.Tensor:
    """The linear part of a LayerNorm's Jacobian, diag(γ)·(I − 11ᵀ/d), leaving out its per-row 1/σ and −n nᵀ/d."""
    d = gamma.numel()
    return gamma.double()[:, None] * (torch.eye(d, dtype=torch.float64) - 1.0 / d)


class _ImageAdapter(Adapter):
    def block_input(self, inputs: dict[str, torch.Tensor], layer: int = 0,
                    weights: TensorGetter | None = None) -> BlockInput:
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
    # post_layernorm makes the pooled output; CLIPForImageClassification's head reads the last block's output.
    head_side = {"CLIPVisionModel": "post_layernorm", "CLIPModel": "post_layernorm"}
    # With zero_shot only: a CLIPVisionModel has no head of its own, its tasks' heads come from their class names.
    head_input = {"CLIPVisionModel": "mlp.fc2"}
    probe_key = "embeddings.patch_embedding.weight"

    def head_map(self, expert: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        raise UnsupportedModelError("featcal.head_metric: a CLIPVisionModel has no head of its own; its tasks' heads "
                                    "come from zero_shot (class names through the CLIPModel's text tower)")

    def zero_shot_head_map(self, head: Mapping[str, torch.Tensor],
                           merged: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's mlp.fc2) → x + y → post_layernorm at the class token → the visual projection P → unit
        length → the class embeddings C (`featcal.zeroshot`): C·P·diag(γ)·(I − 11ᵀ/d), the norm's 1/σ and the unit
        length's per-row terms left out. γ is the merged checkpoint's: post_layernorm is outside the blocks."""
        self.head_input_module()
        return (head["class_embeddings"].double() @ head["visual_projection.weight"].double()
                @ norm_path(merged.get("post_layernorm.weight")))

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
    head_side = {"ViTForImageClassification": "layernorm", "ViTModel": "layernorm"}
    head_input = {"ViTForImageClassification": "mlp.fc2"}
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

    def head_map(self, expert: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's mlp.fc2) → x + y → the final LayerNorm → C at the class token: C·diag(γ)·(I − 11ᵀ/d)."""
        self.head_input_module()
        return expert.get("classifier.weight").double() @ norm_path(expert.get("layernorm.weight"))


@register
class T5Adapter(Adapter):
    """T5 and FLAN-T5: the encoder's blocks, then the decoder's, as one sequence of calibrated blocks.

    A decoder block's cross-attention reads its own stream's encoder output (after the encoder's final norm),
    and every block but a stack's first takes the relative position bias from that stack's first block, in
    the running model's weights: both travel in `BlockInput`. The shared embedding, the final norms and the
    LM head are merged and never calibrated; nothing is per task (`head_prefixes` is empty)."""

    model_types = ("t5",)
    body_attr = {"T5ForConditionalGeneration": "", "T5EncoderModel": ""}
    file_prefixes = ("",)
    blocks_path = "encoder.block"  # then decoder.block: `block_prefix` numbers both stacks as one sequence
    kv_modules = ("layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                  "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")
    memory_modules = ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")
    head_prefixes = ()
    pooled_token = {"T5ForConditionalGeneration": None, "T5EncoderModel": None}
    probe_key = "shared.weight"
    BIAS = "layer.0.SelfAttention.relative_attention_bias.weight"

    @property
    def encoder_blocks(self) -> int:
        return self.config.num_layers

    @property
    def has_decoder(self) -> bool:
        return self.architecture == "T5ForConditionalGeneration"

    def num_blocks(self) -> int:
        return self.encoder_blocks + (self.config.num_decoder_layers if self.has_decoder else 0)

    def is_decoder(self, layer: int) -> bool:
        return layer >= self.encoder_blocks

    def blocks(self, body: nn.Module) -> nn.ModuleList:
        stacks = ("encoder.block", "decoder.block") if self.has_decoder else ("encoder.block",)
        return nn.ModuleList([b for path in stacks for b in cast(nn.ModuleList, body.get_submodule(path))])

    def block_prefix(self, layer: int) -> str:
        if self.is_decoder(layer):
            return f"decoder.block.{layer - self.encoder_blocks}."
        return f"encoder.block.{layer}."

    def embedding_modules(self) -> tuple[str, ...]:
        return ("shared",)

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["shared"](inputs["input_ids"])

    def stack_starts(self) -> tuple[int, ...]:
        return (0, self.encoder_blocks) if self.has_decoder else (0,)

    def embed_at(self, start: int, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["shared"](inputs["decoder_input_ids"]) if self.is_decoder(start) else self.embed(modules, inputs)

    def mask_name(self, layer: int) -> str:
        return "decoder_attention_mask" if self.is_decoder(layer) else "attention_mask"

    def ends_stack(self, layer: int) -> str | None:
        return "encoder.final_layer_norm" if self.has_decoder and layer == self.encoder_blocks - 1 else None

    def reads_encoder(self, layer: int) -> bool:
        return self.is_decoder(layer)

    def model_input_names(self) -> tuple[str, ...]:
        return ("input_ids", "attention_mask")

    def evaluate_forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
        # The tokenizer path adds token_type_ids, which T5 does not take.
        return super().evaluate_forward(model, {k: v for k, v in inputs.items() if k in self.model_input_names()})

    def position_bias(self, table: torch.Tensor, length: int, decoder: bool) -> torch.Tensor:
        """[1, heads, length, length]: T5Attention.compute_bias with the stack's first block's bucket table."""
        from transformers.models.t5.modeling_t5 import T5Attention  # here: importing T5 costs every command a second

        position = torch.arange(length)
        buckets = T5Attention._relative_position_bucket(
            position[None, :] - position[:, None], bidirectional=not decoder,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance)
        return nn.functional.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)

    def block_input(self, inputs: dict[str, torch.Tensor], layer: int = 0,
                    weights: TensorGetter | None = None) -> BlockInput:
        mask = inputs["attention_mask"]
        start = self.encoder_blocks if self.is_decoder(layer) else 0
        bias = None  # a stack's first block computes its own
        if layer != start:
            if weights is None:
                raise ValueError(f"block {layer} needs the weights of block {start} for T5's relative position bias")
            bias = self.position_bias(weights(self.block_prefix(start) + self.BIAS).float(), mask.shape[1],
                                      self.is_decoder(layer))
        if not self.reads_encoder(layer):
            return BlockInput(attention_mask=mask, position_bias=bias)
        return BlockInput(attention_mask=mask, encoder_hidden=inputs["encoder_hidden_states"],
                          encoder_mask=inputs["encoder_attention_mask"], position_bias=bias)

    def run_block(self, block: nn.Module, hidden: torch.Tensor, extra: BlockInput) -> torch.Tensor:
        keep = extra.given_mask()[:, None, None, :].bool()
        cross = None
        if block.is_decoder:
            if extra.encoder_hidden is None or extra.encoder_mask is None:
                raise ValueError("a T5 decoder block needs its stream's encoder output and its mask "
                                 "(BlockInput.encoder_hidden, encoder_mask)")
            length = hidden.shape[1]
            keep = keep & torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
            cross = additive_mask(extra.encoder_mask[:, None, None, :].bool(), hidden.dtype)
        bias = None if extra.position_bias is None else extra.position_bias.to(hidden.device, hidden.dtype)
        out = block(hidden, attention_mask=additive_mask(keep, hidden.dtype), position_bias=bias,
                    encoder_hidden_states=extra.encoder_hidden, encoder_attention_mask=cross)
        return out[0]


def lm_head_root(checkpoint: CanonicalCheckpoint | LoraCheckpoint, embedding: str, rows: int) -> torch.Tensor:
    """(EᵀE)^½ [hidden, hidden] of a causal LM's head E [vocab, hidden]: it has E's Gram, which is all a head metric
    reads, and a vocabulary-wide H would not fit beside a large model. E is `lm_head.weight`, or `embedding` when the
    two are tied; EᵀE is summed `rows` rows at a time in float64."""
    name = "lm_head.weight" if "lm_head.weight" in checkpoint else embedding
    vocab, hidden = checkpoint.shape(name)
    gram = torch.zeros(hidden, hidden, dtype=torch.float64)
    for start in range(0, vocab, rows):
        band = checkpoint.get(name, (start, min(start + rows, vocab))).double()
        gram.addmm_(band.T, band)
    evals, vecs = torch.linalg.eigh(gram)
    return (vecs * evals.clamp_min(0).sqrt()) @ vecs.T


class _CausalLMAdapter(Adapter):
    """What every decoder-only causal LM shares: token ids and a padding mask in, positions counted over real tokens,
    and no per-task head (the LM head is merged with the body)."""

    file_prefixes = ("",)
    head_prefixes = ()
    language_model = True
    head_is_merged = True
    # Rows of the LM head read at a time to form EᵀE (`lm_head_root`): 16 MiB of float64 at a hidden size of 4096.
    HEAD_ROWS = 512

    @staticmethod
    def positions(mask: torch.Tensor) -> torch.Tensor:
        """[B, T] positions counted over real tokens, as `generate` makes them: 0..T-1 for a right-padded row (the
        model's own default), shifted past the padding for a left-padded one."""
        return (mask.long().cumsum(-1) - 1).clamp(min=0)

    def model_input_names(self) -> tuple[str, ...]:
        return ("input_ids", "attention_mask")

    def evaluate_forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
        return super().evaluate_forward(model, {k: v for k, v in inputs.items() if k in self.model_input_names()})


@register
class LlamaAdapter(_CausalLMAdapter):
    """Decoder-only causal LMs of the Llama layout (Llama, Qwen2, Mistral): pre-norm blocks with RMS norms, rotary
    positions, grouped-query attention and a SwiGLU MLP.

    The body is the whole model: the embedding, the final norm and the LM head (tied or not) are merged and never
    calibrated, and nothing is per task. Every real token weighs 1 (no pooled token). Positions count real tokens
    (`positions`: 0..T-1 on a right-padded row, as `pad_to` pads them), the model's rotary module turns them into
    (cos, sin) once per batch for every block, and each block gets a causal mask with padded keys dropped (and the
    sliding window, where the model has one)."""

    model_types: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "mistral")
    body_attr = {"LlamaForCausalLM": "", "Qwen2ForCausalLM": "", "MistralForCausalLM": ""}
    blocks_path = "model.layers"
    kv_modules = ("self_attn.k_proj", "self_attn.v_proj")
    pooled_token = {"LlamaForCausalLM": None, "Qwen2ForCausalLM": None, "MistralForCausalLM": None}
    head_side = {"LlamaForCausalLM": "model.norm", "Qwen2ForCausalLM": "model.norm", "MistralForCausalLM": "model.norm"}
    head_input = {"LlamaForCausalLM": "mlp.down_proj", "Qwen2ForCausalLM": "mlp.down_proj",
                  "MistralForCausalLM": "mlp.down_proj"}
    probe_key = "model.embed_tokens.weight"

    @classmethod
    def default_architecture(cls, config: PretrainedConfig) -> str:
        return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[
            config.model_type]

    def embedding_modules(self) -> tuple[str, ...]:
        return ("model.embed_tokens",)

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return modules["model.embed_tokens"](inputs["input_ids"])

    def head_map(self, checkpoint: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's mlp.down_proj) → x + y → RMSNorm → the LM head E [vocab, hidden]: E·diag(γ), the norm's
        1/rms left out (a scale per row), as the square (EᵀE)^½·diag(γ) (`lm_head_root`)."""
        self.head_input_module()
        return lm_head_root(checkpoint, "model.embed_tokens.weight", self.HEAD_ROWS) * \
            checkpoint.get("model.norm.weight").double()[None, :]


    def rotary_module(self) -> nn.Module:
        """The model's own rotary module (`model.model.rotary_emb`'s class, built from the config: it has no
        weights, only `inv_freq` derived from the config)."""
        if getattr(self, "_rotary", None) is None:
            import importlib  # here: importing a model family costs every command a second

            mt = self.config.model_type
            family = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
            cls = next(getattr(family, n) for n in dir(family) if n.endswith("RotaryEmbedding"))
            self._rotary = cls(config=self.config).eval()
        return self._rotary

    def block_input(self, inputs: dict[str, torch.Tensor], layer: int = 0,
                    weights: TensorGetter | None = None) -> BlockInput:
        mask = inputs["attention_mask"]
        cached = getattr(self, "_rotary_batch", None)  # every block of a batch gets the same: computed once
        if cached is None or cached[0].shape != mask.shape or not torch.equal(cached[0], mask):
            with torch.no_grad():  # (cos, sin) [B, T, head_dim] from the model's own rotary module
                rotary = self.rotary_module()(torch.zeros(1, dtype=torch.float32), position_ids=self.positions(mask))
            cached = self._rotary_batch = (mask.clone(), rotary)
        return BlockInput(attention_mask=mask, rotary=cached[1])

    def run_block(self, block: nn.Module, hidden: torch.Tensor, extra: BlockInput) -> torch.Tensor:
        length = hidden.shape[1]
        steps = torch.arange(length, device=hidden.device)
        query, key = steps[:, None], steps[None, :]
        keep = key <= query
        window = getattr(block.self_attn, "sliding_window", getattr(self.config, "sliding_window", None))
        if window is not None:
            keep = keep & (key > query - window)
        keep = keep[None, None] & extra.given_mask()[:, None, None, :].bool()
        if extra.rotary is None:
            raise ValueError("a rotary-position block needs the batch's (cos, sin) (BlockInput.rotary)")
        cos, sin = extra.rotary
        out = block(hidden, attention_mask=additive_mask(keep, hidden.dtype),
                    position_embeddings=(cos.to(hidden.device, hidden.dtype), sin.to(hidden.device, hidden.dtype)))
        return out[0] if isinstance(out, tuple) else out


@register
class GPT2Adapter(_CausalLMAdapter):
    """GPT-2 causal LMs: pre-norm blocks with LayerNorms (with biases), learned absolute positions (`wpe`), and
    transformers' `Conv1D` linears, whose weights are stored [in, out] (`featcal.modeling.as_out_in` turns them to
    the solves' [out, in] and back); the fused q/k/v projection `attn.c_attn` is one linear map in → 3·hidden.

    As for `LlamaAdapter`, the body is the whole model: embeddings, final `ln_f` and the LM head (tied to `wte`) are
    merged and never per task, and every real token weighs 1. Positions count real tokens (0..T-1 on a right-padded
    row, the model's own default) and each block gets a causal mask with padded keys dropped.

    Only GPT2LMHeadModel: GPT2ForSequenceClassification's head reads each row's last real token, whose index varies
    from row to row with right padding, and the pipeline knows one fixed pooled index per architecture
    (`pooled_index()`: token weights, the head side's tokens, the head-token drift)."""

    model_types = ("gpt2",)
    body_attr = {"GPT2LMHeadModel": ""}
    blocks_path = "transformer.h"
    kv_modules = ("attn.c_attn",)  # q, k and v in one map
    pooled_token = {"GPT2LMHeadModel": None}
    head_side = {"GPT2LMHeadModel": "transformer.ln_f"}
    head_input = {"GPT2LMHeadModel": "mlp.c_proj"}
    probe_key = "transformer.wte.weight"

    def __init__(self, config: PretrainedConfig):
        if config.architectures and config.architectures[0] == "GPT2ForSequenceClassification":
            raise UnsupportedModelError(
                "GPT2ForSequenceClassification is not supported: its head reads each row's last real token, an index "
                "that varies from row to row, and the calibration weighs one fixed pooled token per architecture; "
                "GPT2LMHeadModel is supported")
        super().__init__(config)

    def embedding_modules(self) -> tuple[str, ...]:
        return ("transformer.wte", "transformer.wpe")

    def head_map(self, checkpoint: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's mlp.c_proj) → x + y → ln_f → the LM head E (tied to wte): E·diag(γ)·(I − 11ᵀ/d), the
        norm's per-row 1/σ left out, as (EᵀE)^½·diag(γ)·(I − 11ᵀ/d) (`lm_head_root`)."""
        self.head_input_module()
        return lm_head_root(checkpoint, "transformer.wte.weight", self.HEAD_ROWS) @ norm_path(
            checkpoint.get("transformer.ln_f.weight"))

    def embed(self, modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        positions = torch.arange(ids.shape[1]).expand_as(ids) if mask is None else self.positions(mask)
        return modules["transformer.wte"](ids) + modules["transformer.wpe"](positions)


    def run_block(self, block: nn.Module, hidden: torch.Tensor, extra: BlockInput) -> torch.Tensor:
        length = hidden.shape[1]
        keep = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()[None, None]
        if extra.attention_mask is not None:
            keep = keep & extra.attention_mask[:, None, None, :].bool()
        out = block(hidden, attention_mask=additive_mask(keep, hidden.dtype))
        return out[0] if isinstance(out, tuple) else out


@register
class Gemma2Adapter(LlamaAdapter):
    """Gemma2 causal LMs: the Llama layout (rotary positions, grouped-query attention, causal and padding mask, the
    sliding window on the layers whose attention has one) with a GeGLU MLP, norms before and after both the attention
    and the MLP, and attention logit soft-capping, which the block's own forward applies. Its RMS norms scale by
    (1 + weight): `featcal.modeling.norm_scale_offset` makes the norm solve read γ = 1 + weight and write back
    weight = γ − 1. The embedding module scales by sqrt(hidden) itself; embedding, final norm and the LM head are
    merged, never per task."""

    model_types = ("gemma2",)
    body_attr = {"Gemma2ForCausalLM": ""}
    pooled_token = {"Gemma2ForCausalLM": None}
    head_side = {"Gemma2ForCausalLM": "model.norm"}
    head_input = {"Gemma2ForCausalLM": "mlp.down_proj"}

    def head_map(self, checkpoint: CanonicalCheckpoint | LoraCheckpoint) -> torch.Tensor:
        """y (the last block's mlp.down_proj) → the block's post-MLP RMSNorm → x + · → the final RMSNorm → the LM head
        E (tied) → the logit soft cap: E·diag(1 + w_final)·diag(1 + w_post), each norm's 1/rms and the cap's tanh′
        left out (per row), as (EᵀE)^½·diag(1 + w_final)·diag(1 + w_post). The post-MLP norm is the merged
        checkpoint's: the block's solve calibrates it beside down_proj."""
        self.head_input_module()
        post = f"{self.block_prefix(self.num_blocks() - 1)}post_feedforward_layernorm.weight"
        scale = (1 + checkpoint.get("model.norm.weight").double()) * (1 + checkpoint.get(post).double())
        return lm_head_root(checkpoint, "model.embed_tokens.weight", self.HEAD_ROWS) * scale[None, :]

    @classmethod
    def default_architecture(cls, config: PretrainedConfig) -> str:
        return "Gemma2ForCausalLM"


@register
class Qwen3Adapter(LlamaAdapter):
    """Qwen3 causal LMs: the Llama layout (the block's own forward does the rest) without q/k/v biases, with
    `head_dim` set by the config, and RMS norms on each head's query and key (`self_attn.q_norm`, `self_attn.k_norm`)
    before the rotary positions. Those two are calibrated like every other norm, each head's row of a token taking
    the token's weight (`statistics.per_row_weights`)."""

    model_types = ("qwen3",)
    body_attr = {"Qwen3ForCausalLM": ""}
    pooled_token = {"Qwen3ForCausalLM": None}
    head_side = {"Qwen3ForCausalLM": "model.norm"}
    head_input = {"Qwen3ForCausalLM": "mlp.down_proj"}

    @classmethod
    def default_architecture(cls, config: PretrainedConfig) -> str:
        return "Qwen3ForCausalLM"
