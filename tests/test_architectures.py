"""Every registered adapter end to end on small random models saved from transformers configs."""

import json

import numpy as np
import pytest
import torch
import transformers
from datasets import Array3D, Dataset, Features, Value
from transformers import CLIPConfig, CLIPVisionConfig, OPTConfig, OPTModel, ViTConfig

from featcal.adapters import UnsupportedModelError
from featcal.config import config_from_dict
from flows.pipeline import run_pipeline
from tests.perturbed_experts import perturbed

VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
)
CASES = {
    "vit": ("ViTForImageClassification", lambda: ViTConfig(**VISION, num_labels=3)),
    "clip-vision": ("CLIPVisionModel", lambda: CLIPVisionConfig(**VISION)),
    "clip-model": ("CLIPModel", lambda: CLIPConfig(vision_config=VISION, text_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50))),
}


def _build(root, arch: str, experts: int):
    cls_name, make_config = CASES[arch]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    base = cls(make_config())
    base.save_pretrained(root / "base")
    paths = {}
    for t in range(experts):
        expert = cls(make_config())
        expert.load_state_dict(perturbed(base, seed=10 + t))
        expert.save_pretrained(root / f"e{t}")
        rng = np.random.default_rng(t)
        pixels = (rng.standard_normal((12, 3, 16, 16)) + 0.5 * t).astype(np.float32)
        features = Features(pixel_values=Array3D((3, 16, 16), "float32"), label=Value("int64"))
        data = {"pixel_values": pixels, "label": rng.integers(0, 3, 12).tolist()}
        Dataset.from_dict(data, features=features).save_to_disk(str(root / f"d{t}"))
        paths[f"task{t}"] = t
    raw = {
        "base": str(root / "base"),
        "experts": {name: str(root / f"e{t}") for name, t in paths.items()},
        "calibration": {
            "data": {name: {"path": str(root / f"d{t}")} for name, t in paths.items()},
            "examples_per_task": 12,
            "batch_size": 4,
        },
        "featcal": {"lambda": 0.01, "rho": 1.0, "alpha": 1.0},
        "evaluation": {
            "data": {name: {"path": str(root / f"d{t}"), "label_column": "label"} for name, t in paths.items()}
        },
    }
    return cls, config_from_dict(raw, root)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_adapter_end_to_end(tmp_path, arch):
    cls, cfg = _build(tmp_path, arch, experts=2)
    run_pipeline(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    drift = report["summary"]["average_drift"]
    assert len(drift["merged"]) == len(drift["calibrated"]) == VISION["num_hidden_layers"] + 1
    assert all(d > 0 for d in drift["merged"][1:])
    assert bool(report["tasks"]["task0"]["accuracy"]) == (arch == "vit")  # only ViT has a head here
    assert isinstance(cls.from_pretrained(tmp_path / "run" / "calibrated"), cls)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_adapter_single_expert_exactness(tmp_path, arch):
    """One expert, average merge (so the statistics are the expert's own), α=1, λ→0 with the anchor
    pointing elsewhere (ρ=2.2 against the base): calibrated features equal the expert's at every block."""
    _, cfg = _build(tmp_path, arch, experts=1)
    cfg = cfg.model_copy(update={
        "merge": cfg.merge.model_copy(update={"method": "average"}),
        "featcal": cfg.featcal.model_copy(update={"lam": 1e-9, "rho": 2.2, "alpha": 1.0}),
    })
    run_pipeline(cfg, tmp_path / "run")
    drift = json.loads((tmp_path / "run" / "report.json").read_text())["tasks"]["task0"]["drift"]["calibrated"]
    assert max(drift) < 1e-4, drift


def test_unsupported_architecture_is_refused_before_work(tmp_path):
    OPTModel(OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32, vocab_size=20,
                       word_embed_proj_dim=16)).save_pretrained(tmp_path / "opt")
    cfg = config_from_dict({"base": str(tmp_path / "opt"), "experts": {"a": str(tmp_path / "opt")},
                            "calibration": {"data": {"a": {"path": str(tmp_path / "none")}}}}, tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type 'opt' is not supported"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
