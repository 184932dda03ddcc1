"""A tiny CLIP built from configs, offline: its tokenizer, image processor, CLIPModel, and images of solid colours.

CLIP's own vocabulary cannot be downloaded here, so the tokenizer is byte-level: every character is a token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image as PILImage
from tokenizers import pre_tokenizers
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer, CLIPVisionModel

from tests.test_architectures import VISION

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
PROJECTION = 16


def clip_tokenizer() -> CLIPTokenizer:
    """CLIP's tokenizer with a byte-level vocabulary and no merges."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[])


def clip_processor() -> CLIPImageProcessorPil:
    size = VISION["image_size"]
    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def save_tiny_clip(out: Path, vision_dir: Path | None = None) -> Path:
    """A tiny CLIPModel with its tokenizer and image processor saved in `out`; its vision tower is the
    CLIPVisionModel in `vision_dir` when given, random (seeded) otherwise."""
    tokenizer = clip_tokenizer()
    text = dict(TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    clip = CLIPModel(CLIPConfig(vision_config=VISION, text_config=text, projection_dim=PROJECTION))
    if vision_dir is not None:
        clip.vision_model.load_state_dict(CLIPVisionModel.from_pretrained(vision_dir).state_dict())
    for part in (clip, tokenizer, clip_processor()):
        part.save_pretrained(out)
    return out


def perturbed_tower(clip_dir: Path, seed: int) -> CLIPVisionModel:
    """The CLIPModel's vision tower with seeded noise of 0.1 × each tensor's spread: an 'expert' fine-tuned from it."""
    tower = CLIPVisionModel.from_pretrained(clip_dir)
    g = torch.Generator().manual_seed(seed)
    tower.load_state_dict({k: v + 0.1 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)
                           if v.is_floating_point() and v.numel() > 1 else v for k, v in tower.state_dict().items()})
    return tower


def solid_images(rng: np.random.Generator, rows: int) -> list[PILImage.Image]:
    """`rows` images of one random colour each, at the tiny vision tower's size."""
    size = VISION["image_size"]
    return [PILImage.fromarray(np.full((size, size, 3), rng.integers(0, 256, 3), dtype=np.uint8)) for _ in range(rows)]
