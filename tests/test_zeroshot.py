"""Zero-shot heads for head-less CLIPVisionModel experts, on a tiny CLIP built from configs: the head against
CLIPModel's own forward, the pipeline end to end with those heads (and single-expert exactness), and refusals."""

import json

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, Features, Image, load_from_disk
from safetensors.torch import load_file
from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel, CLIPVisionModel

from featcal.config import DEFAULT_TEMPLATES, ConfigError, config_from_dict
from featcal.zeroshot import ZeroShotClassifier, ZeroShotError, class_embeddings, zero_shot_head, zero_shot_heads
from flows.pipeline import run_pipeline
from storage.checkpoint import CheckpointError, read_metadata
from tests.clip_fixture import PROJECTION, clip_processor, save_tiny_clip, solid_images
from tests.test_architectures import VISION, _build

# Many classes, so that the random tiny model's predictions differ from image to image.
NAMES = "cat dog car bus red blue tree house bird fish ship plane truck horse frog deer apple pear lake road".split()
TEMPLATE = "a photo of a {}."


def _predictions(clip_dir, images: list, vision_dir=None) -> torch.Tensor:
    """Class ids by the CLIPModel's own forward (logits_per_image, one template), with the vision tower of
    `vision_dir` when given."""
    clip = CLIPModel.from_pretrained(clip_dir).eval()
    if vision_dir is not None:
        clip.vision_model.load_state_dict(CLIPVisionModel.from_pretrained(vision_dir).state_dict())
    text = AutoTokenizer.from_pretrained(clip_dir)([TEMPLATE.replace("{}", name) for name in NAMES], padding=True,
                                                   return_tensors="pt")
    pixels = CLIPImageProcessorPil.from_pretrained(clip_dir)(images, return_tensors="pt").pixel_values
    with torch.inference_mode():
        return clip(**text, pixel_values=pixels).logits_per_image.argmax(-1)


def _images(path, clip_dir, seed: int, rows: int = 24):
    """`rows` images of random solid colours saved with datasets, with a ClassLabel label of NAMES: what the
    CLIPModel in `clip_dir` predicts. So the base scores 1 by construction, and a pipeline score of 1 checks every
    row."""
    images = solid_images(np.random.default_rng(seed), rows)
    features = Features(image=Image(), label=ClassLabel(names=NAMES))
    labels = _predictions(clip_dir, images).tolist()
    Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(str(path))
    return path


def _head_less_config(root, experts: int, tower_of_base: bool = True) -> dict:
    """test_architectures' tiny CLIPVisionModel base and experts (perturbed copies of it, data labelled with plain
    integers) as a raw config, with zero_shot.clip_model a CLIPModel around that base (around another vision tower
    unless `tower_of_base`)."""
    _, cfg = _build(root, "clip-vision", experts)
    raw = cfg.model_dump(mode="json", by_alias=True)
    raw["zero_shot"] = {"clip_model": str(save_tiny_clip(root / "clip", root / "base" if tower_of_base else None))}
    return raw


@pytest.fixture
def tiny_clip(tmp_path):
    clip_dir = save_tiny_clip(tmp_path / "clip")
    return CLIPModel.from_pretrained(clip_dir).eval(), AutoTokenizer.from_pretrained(clip_dir), clip_dir


def test_one_template_head_gives_clip_logits_per_image(tiny_clip):
    clip, tokenizer, clip_dir = tiny_clip
    head, metadata = zero_shot_head(clip, tokenizer, NAMES, [TEMPLATE], clip_dir)
    pixels = torch.randn(5, 3, VISION["image_size"], VISION["image_size"], generator=torch.Generator().manual_seed(0))
    text = tokenizer([TEMPLATE.replace("{}", name) for name in NAMES], padding=True, return_tensors="pt")
    with torch.inference_mode():
        ours = ZeroShotClassifier(clip.vision_model, head)(pixel_values=pixels).logits
        reference = clip(input_ids=text["input_ids"], pixel_values=pixels,
                         attention_mask=text["attention_mask"]).logits_per_image
    assert ours.shape == reference.shape == (5, len(NAMES))
    assert float((ours - reference).abs().max()) < 1e-5
    assert float(reference.max() - reference.min()) > 0.1  # the logits tell classes apart: the match means something
    assert head["class_embeddings"].shape == (len(NAMES), PROJECTION)
    assert metadata["featcal_head"] == "zero_shot" and json.loads(metadata["class_names"]) == NAMES
    assert float(metadata["logit_scale"]) == pytest.approx(float(clip.logit_scale.detach().exp()))


def test_several_templates_average_unit_prompt_embeddings(tiny_clip):
    clip, tokenizer, _ = tiny_clip
    templates = [TEMPLATE, "a blurry photo of the {}.", "art of {}"]
    got = class_embeddings(clip, tokenizer, NAMES, templates)
    expected = []
    with torch.inference_mode():
        for name in NAMES:  # one prompt at a time, unpadded
            units = []
            for template in templates:
                enc = tokenizer([template.replace("{}", name)], return_tensors="pt")
                embedding = clip.get_text_features(**enc).pooler_output[0]
                units.append(embedding / embedding.norm())
            mean = torch.stack(units).mean(0)
            expected.append(mean / mean.norm())
    assert float((got - torch.stack(expected)).abs().max()) < 1e-5
    assert float((got - class_embeddings(clip, tokenizer, NAMES, [TEMPLATE])).abs().max()) > 1e-3


def test_each_task_gets_its_class_names_and_templates(tiny_clip, tmp_path):
    clip, tokenizer, clip_dir = tiny_clip
    own = ["art of {}", "a {} photo."]
    raw = {"base": "b", "experts": {"a": "e", "b": "e"},
           "calibration": {"data": {"a": {"path": "d"}, "b": {"path": "d"}}},
           "zero_shot": {"clip_model": str(clip_dir), "templates": [TEMPLATE], "task_templates": {"b": own},
                         "class_names": {"a": NAMES[:2], "b": NAMES[2:5]}}}
    heads = zero_shot_heads(config_from_dict(raw, tmp_path))
    for task, names, templates in (("a", NAMES[:2], [TEMPLATE]), ("b", NAMES[2:5], own)):
        tensors, metadata = heads[task]
        assert json.loads(metadata["templates"]) == templates and json.loads(metadata["class_names"]) == names
        assert torch.equal(tensors["class_embeddings"], class_embeddings(clip, tokenizer, names, templates))


def test_head_less_experts_scored_with_zero_shot_heads(tmp_path):
    """Scored on raw images whose ClassLabel gives the class names, with one template, against CLIPModel's forward."""
    raw = _head_less_config(tmp_path, experts=2)
    clip_processor().save_pretrained(
        tmp_path / "base"
    )  # the evaluation images are raw: the base's processor reads them
    clip_dir = raw["zero_shot"]["clip_model"]
    raw["zero_shot"]["templates"] = [TEMPLATE]
    raw["evaluation"]["data"] = {task: {"path": str(_images(tmp_path / f"images-{task}", clip_dir, seed=i)),
                                        "label_column": "label"} for i, task in enumerate(sorted(raw["experts"]))}
    cfg = config_from_dict(raw, tmp_path)
    run_pipeline(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    for i, task in enumerate(cfg.tasks):
        scores, rows = report["tasks"][task], load_from_disk(cfg.evaluation.data[task].path)[:]
        assert set(scores["accuracy"]) == {"base", "merged", "calibrated", "expert"}
        assert len(set(rows["label"])) > 1, rows["label"]  # predictions vary from row to row
        # Base and expert predict each row as CLIPModel's own forward does with their vision tower.
        assert scores["predictions"]["base"] == rows["label"] and scores["accuracy"]["base"] == 1.0
        direct = _predictions(clip_dir, rows["image"], tmp_path / f"e{i}").tolist()
        assert scores["predictions"]["expert"] == direct != rows["label"]
        assert scores["accuracy"]["expert"] == sum(p == y for p, y in zip(direct, rows["label"])) / len(direct)
        merged, calibrated = (tmp_path / "run" / side / "heads" / f"{task}.safetensors"
                              for side in ("merged", "calibrated"))
        metadata = read_metadata(calibrated)
        assert metadata == read_metadata(merged)
        assert metadata["featcal_head"] == "zero_shot"
        assert json.loads(metadata["templates"]) == [TEMPLATE] and json.loads(metadata["class_names"]) == NAMES
        head = load_file(calibrated)
        assert head["class_embeddings"].shape == (len(NAMES), PROJECTION)
        assert all(torch.equal(head[k], v) for k, v in load_file(merged).items())
    drift = report["summary"]["average_drift"]  # the vision tower's drift, measured as for any head
    assert len(drift["merged"]) == len(drift["calibrated"]) == VISION["num_hidden_layers"] + 1


def test_single_expert_exactness_with_zero_shot_heads(tmp_path):
    """One expert, average merge, α=1, λ→0 with the anchor elsewhere (ρ=2.2): the calibrated tower is the expert's
    on the span of its calibration rows, so it is scored on them (their integer labels named by
    zero_shot.class_names, the default templates): features equal at every block, accuracy equal to the expert's."""
    raw = _head_less_config(tmp_path, experts=1)
    raw["merge"]["method"] = "average"
    raw["featcal"].update({"lambda": 1e-9, "rho": 2.2, "alpha": 1.0})
    raw["zero_shot"]["class_names"] = {"task0": NAMES[:3]}
    run_pipeline(config_from_dict(raw, tmp_path), tmp_path / "run")
    scores = json.loads((tmp_path / "run" / "report.json").read_text())["tasks"]["task0"]
    assert max(scores["drift"]["calibrated"]) < 1e-4, scores["drift"]
    assert scores["accuracy"]["calibrated"] == scores["accuracy"]["expert"]
    metadata = read_metadata(tmp_path / "run" / "calibrated" / "heads" / "task0.safetensors")
    assert json.loads(metadata["class_names"]) == NAMES[:3]
    assert json.loads(metadata["templates"]) == list(DEFAULT_TEMPLATES)


@pytest.mark.parametrize("case", ["no class names", "base is the CLIPModel", "another vision tower"])
def test_refused_before_work_in_one_line(tmp_path, case):
    raw = _head_less_config(tmp_path, experts=1, tower_of_base=case != "another vision tower")
    error, expected = ZeroShotError, ("no class names for task 'task0'", "set zero_shot.class_names.task0",
                                      "or set evaluation.data.task0.label_column to a datasets ClassLabel column")
    if case == "base is the CLIPModel":
        raw["base"] = raw["zero_shot"]["clip_model"]
        error, expected = CheckpointError, ("base: a CLIPModel", "the CLIPModel itself goes in zero_shot.clip_model")
    elif case == "another vision tower":
        error, expected = CheckpointError, ("zero_shot.clip_model: its vision tower is not base",)
    with pytest.raises(error) as raised:
        run_pipeline(config_from_dict(raw, tmp_path), tmp_path / "run")
    message = str(raised.value)
    assert "\n" not in message and all(part in message for part in expected), message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("zero_shot, message", [
    ({"clip_model": "clip", "templates": ["a photo."]}, r"zero_shot\.templates: .*'a photo\.' must hold exactly one"),
    ({"clip_model": "clip", "class_names": {"b": ["x"]}}, r"zero_shot\.class_names names task\(s\) \['b'\] that"),
    ({"clip_model": "clip", "class_names": {"a": ["x", "x"]}}, r"zero_shot\.class_names: .*distinct class names"),
    ({"clip_model": "clip", "task_templates": {"a": ["art"]}}, r"zero_shot\.task_templates: .*'art' must hold"),
    ({"templates": [TEMPLATE]}, r"zero_shot\.clip_model: Field required"),
])
def test_bad_zero_shot_config_names_the_field(tmp_path, zero_shot, message):
    raw = {"base": "b", "experts": {"a": "e"}, "calibration": {"data": {"a": {"path": "d"}}}, "zero_shot": zero_shot}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw, tmp_path)


def test_zero_shot_head_map_has_the_jacobians_gram_off_the_per_row_directions(tmp_path, tiny_clip):
    """featcal.head_metric with zero-shot heads: the logits' Jacobian with respect to the last fc2's output y at the
    class token is C·P·diag(γ)·(I − 11ᵀ/d) over the row's scales (post_layernorm's σ, the projected feature's length,
    the logit scale), on directions where post_layernorm's and the unit length's per-row terms vanish."""
    from featcal.adapters import adapter_for
    from featcal.zeroshot import zero_shot_logits
    from storage.checkpoint import CanonicalCheckpoint

    clip, tokenizer, clip_dir = tiny_clip
    head, _ = zero_shot_head(clip, tokenizer, NAMES, [TEMPLATE], clip_dir)
    with torch.no_grad():
        clip.vision_model.post_layernorm.weight.uniform_(0.5, 1.5)
    tower = CLIPVisionModel(clip.config.vision_config)
    tower.load_state_dict(clip.vision_model.state_dict())
    tower.save_pretrained(tmp_path / "vision")
    adapter = adapter_for(tower.config)
    h = adapter.zero_shot_head_map(head, CanonicalCheckpoint(tmp_path / "vision", adapter))
    assert h.shape == (len(NAMES), VISION["hidden_size"])
    norm = clip.vision_model.post_layernorm.double()
    double = {k: v.double() for k, v in head.items()}
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(VISION["hidden_size"], generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        centred = (x + y) - (x + y).mean()
        sigma = float(torch.sqrt(centred.pow(2).mean() + norm.eps))
        feature = double["visual_projection.weight"] @ norm(x + y)
        lin = double["visual_projection.weight"] @ torch.diag(norm.weight) @ (torch.eye(len(x), dtype=torch.float64)
                                                                           - 1 / len(x))
        v = torch.randn(len(x), 5, generator=g, dtype=torch.float64)
        basis, _ = torch.linalg.qr(torch.stack([centred, lin.T @ feature], dim=1))
        v -= basis @ (basis.T @ v)
    jac = torch.autograd.functional.jacobian(
        lambda out: (double["logit_scale"].exp() * torch.nn.functional.normalize(
            double["visual_projection.weight"] @ norm(x + out), dim=0) @ double["class_embeddings"].T), y)
    # the double-precision path is zero_shot_logits' formula (which casts to float32)
    torch.testing.assert_close(zero_shot_logits(norm(x + y)[None].float(), head)[0].double(),
                               double["logit_scale"].exp() * torch.nn.functional.normalize(feature, dim=0)
                               @ double["class_embeddings"].T, rtol=1e-5, atol=1e-5)
    scale = float(double["logit_scale"].exp()) / (sigma * float(feature.norm()))
    want = (h @ v).T @ (h @ v) * scale**2
    torch.testing.assert_close((jac @ v).T @ (jac @ v), want, rtol=1e-6, atol=1e-8 * float(want.abs().max()))
    along = (jac @ centred).norm() ** 2 - (h @ centred).norm() ** 2 * scale**2
    assert abs(float(along)) > 1e-3 * float(want.abs().max())  # where the left-out terms act, they show


def test_zero_shot_head_metric_run_changes_only_the_last_fc2(tmp_path):
    """head_metric 1 against the plain solve, with zero-shot heads: only the last block's mlp.fc2 changes, through the
    head-metric solve; head-less experts without zero_shot are refused in one line."""
    from featcal.adapters import UnsupportedModelError
    from storage.rundir import RunDir

    raw = _head_less_config(tmp_path, experts=2)
    raw["zero_shot"]["class_names"] = {task: NAMES[:4] for task in raw["experts"]}
    raw["evaluation"]["enabled"] = False
    raw["featcal"].update({"lambda": 0.01, "rho": 1.0, "alpha": 1.0})
    weights = {}
    for name, eta in (("plain", 0.0), ("head", 1.0)):
        raw["featcal"]["head_metric"] = eta
        run_pipeline(config_from_dict(raw, tmp_path), tmp_path / name)
        weights[name] = load_file(tmp_path / name / "calibrated" / "model.safetensors")
    last = VISION["num_hidden_layers"] - 1
    changed = {n for n in weights["plain"] if not torch.equal(weights["plain"][n], weights["head"][n])}
    assert changed == {f"encoder.layers.{last}.mlp.fc2.{p}" for p in ("weight", "bias")}
    path = RunDir(tmp_path / "head").record(f"solve/l{last:02d}")["info"]["solve_path"]
    assert list(path) == ["mlp.fc2"] and path["mlp.fc2"].startswith("head metric, ")
    del raw["zero_shot"]
    with pytest.raises(UnsupportedModelError, match="^featcal.head_metric: a CLIPVisionModel has no head of its own"):
        run_pipeline(config_from_dict(raw, tmp_path), tmp_path / "no-zero-shot")
