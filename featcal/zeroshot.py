"""Zero-shot heads: a CLIP vision tower's features classified by their similarity to class-name prompts.

The public CLIP merging benchmarks fine-tune only the vision tower: their experts are `CLIPVisionModel`s with no
head, and every model is scored with heads made from the pretrained `CLIPModel`'s text tower, as CLIP classifies
zero-shot. A task's head is made once, by the merge stage, and stored like any other head
(`heads/{task}.safetensors`), so base, merged, calibrated and expert are each their vision tower plus the same head:

    head[c] = normalize(mean over templates of normalize(text features of the template filled with class c))
    logits  = exp(logit_scale) · normalize(visual_projection(post_layernorm(class token))) · headᵀ

With one template this is `CLIPModel.forward`'s `logits_per_image`; with several, CLIP's prompt ensembling. A
`CLIPVisionModel` has no `visual_projection` and no `logit_scale`, so the head file carries the CLIPModel's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import ClassLabel
from torch import nn
from transformers import AutoTokenizer, CLIPModel, CLIPTextConfig, PreTrainedTokenizerBase
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.utils import logging as hf_logging

from featcal.config import RunConfig, ZeroShotConfig
from featcal.data import load_split
from featcal.hub import local_dir
from featcal.input_checks import pad_with_eos

HEAD_KIND = "zero_shot"  # the head file's `featcal_head` metadata
TEXT_BATCH = 256  # prompts through the text tower at once


class ZeroShotError(ValueError):
    """A zero-shot head that cannot be made, with the config fields that would fix it."""


def zero_shot_settings(cfg: RunConfig) -> ZeroShotConfig:
    """The run's `zero_shot` section, which only runs of head-less CLIPVisionModel experts set."""
    if cfg.zero_shot is None:
        raise ValueError("zero_shot is not set: zero-shot heads are for head-less CLIPVisionModel experts")
    return cfg.zero_shot


def class_names(cfg: RunConfig, task: str) -> list[str]:
    """The task's class names in label-id order: `zero_shot.class_names[task]`, else the names of the `ClassLabel`
    label column of the data the task is evaluated on (its `label_column`, or its only ClassLabel column)."""
    listed = zero_shot_settings(cfg).class_names.get(task)
    if listed:
        return listed
    source = cfg.evaluation.data.get(task) or cfg.calibration.data[task]
    where = f"evaluation.data.{task}" if task in cfg.evaluation.data else f"calibration.data.{task}"
    features = load_split(source, where).features
    labelled = sorted(c for c, f in features.items() if isinstance(f, ClassLabel))
    column = source.label_column or (labelled[0] if len(labelled) == 1 else None)
    if column not in labelled:
        raise ZeroShotError(
            f"zero_shot: no class names for task {task!r}: {where} has no ClassLabel label column (label_column "
            f"{source.label_column!r}, ClassLabel columns {labelled}); set zero_shot.class_names.{task} to its class "
            f"names in label-id order, or set {where}.label_column to a datasets ClassLabel column")
    return features[column].names


def text_features(clip: CLIPModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> torch.Tensor:
    """[prompts, projection_dim]: `CLIPModel.get_text_features` (the text tower's end-of-text token through
    `text_projection`), in float32, a batch of prompts at a time."""
    text_config = clip.config.text_config
    if not isinstance(text_config, CLIPTextConfig):
        raise TypeError(f"{type(clip).__name__}'s text_config is a {type(text_config).__name__}, not a CLIPTextConfig")
    width = text_config.max_position_embeddings
    out = []
    for start in range(0, len(prompts), TEXT_BATCH):
        enc = tokenizer(prompts[start:start + TEXT_BATCH], padding=True, truncation=True, max_length=width,
                        return_tensors="pt")
        with torch.inference_mode():
            features = clip.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        out.append(features.pooler_output.float())
    return torch.cat(out)


def class_embeddings(clip: CLIPModel, tokenizer: PreTrainedTokenizerBase, names: list[str],
                     templates: list[str]) -> torch.Tensor:
    """[classes, projection_dim], one unit row per class: the mean over `templates` of its prompts' unit text
    embeddings, normalised again. Averaging unit vectors keeps every template's vote equal whatever its norm."""
    prompts = [template.replace("{}", name) for name in names for template in templates]
    units = F.normalize(text_features(clip, tokenizer, prompts), dim=-1)
    return F.normalize(units.view(len(names), len(templates), -1).mean(1), dim=-1)


def zero_shot_head(clip: CLIPModel, tokenizer: PreTrainedTokenizerBase, names: list[str], templates: list[str],
                   clip_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One task's head file: its tensors (class embeddings, and the CLIPModel's visual projection and logit scale,
    which a CLIPVisionModel lacks) and metadata saying it is zero-shot, from which prompts, at which scale."""
    tensors = {
        "class_embeddings": class_embeddings(clip, tokenizer, names, templates),
        "visual_projection.weight": clip.visual_projection.weight.detach().float().clone(),
        "logit_scale": clip.logit_scale.detach().float().clone(),
    }
    metadata = {"featcal_head": HEAD_KIND, "clip_model": str(clip_dir), "templates": json.dumps(templates),
                "class_names": json.dumps(names), "logit_scale": repr(float(tensors["logit_scale"].exp()))}
    return tensors, metadata


def zero_shot_heads(cfg: RunConfig) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Every task's head (tensors, metadata), from one load of `zero_shot.clip_model`."""
    zs = zero_shot_settings(cfg)
    hf_logging.disable_progress_bar()
    clip_dir = local_dir(zs.clip_model)
    clip = CLIPModel.from_pretrained(clip_dir, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(clip_dir, local_files_only=True)
    pad_with_eos(tokenizer, zs.clip_model, "zero_shot.clip_model")  # as preflight said (prompts are padded)
    return {task: zero_shot_head(clip, tokenizer, class_names(cfg, task), zs.templates_for(task), zs.clip_model)
            for task in cfg.tasks}


def zero_shot_logits(pooled: torch.Tensor, head: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[batch, classes] from the vision tower's `pooler_output` (the class token after `post_layernorm`): what
    `CLIPModel.get_image_features` projects, compared by cosine with the class embeddings at CLIP's scale."""
    image = F.normalize(pooled.float() @ head["visual_projection.weight"].T, dim=-1)
    return head["logit_scale"].exp() * image @ head["class_embeddings"].T


class ZeroShotClassifier(nn.Module):
    """A CLIP vision tower with a task's zero-shot head, called like a transformers image classifier: it returns
    the tower's hidden states (for drift) and the head's logits (for accuracy)."""

    def __init__(self, vision: nn.Module, head: Mapping[str, torch.Tensor]):
        super().__init__()
        self.vision = vision
        self.head = dict(head)

    def forward(self, pixel_values: torch.Tensor, output_hidden_states: bool = False) -> ImageClassifierOutput:
        out = self.vision(pixel_values=pixel_values, output_hidden_states=output_hidden_states)
        return ImageClassifierOutput(logits=zero_shot_logits(out.pooler_output, self.head),
                                     hidden_states=out.hidden_states)
