"""The CLIP ViT-B/32 benchmark end to end on a tiny local mirror laid out as the hub names it: bench build (from the
mirror) → bench run (a few method runs, each in its own process) → the report with the paper's figures (no Prefect)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
from safetensors.torch import load_file
from transformers import AutoConfig

from featcal.config import load_config
from featcal.modeling import task_model
from featcal.zeroshot import ZeroShotClassifier
from featcal_bench.cli import main
from featcal_bench.clip.estimate import clip_cost_estimate
from featcal_bench.clip.prompts import CLASS_NAMES, TEMPLATES
from featcal_bench.clip.report import PAPER
from featcal_bench.clip.spec import BASE_MODEL, CLIP_PRESETS, CLIP_TASKS
from featcal_bench.estimate import split_sizes
from featcal_bench.mirror import preset_spec
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.surgery import SurgeryAdapter, SurgeryClassifier, features
from flows.plan import plan
from storage.checkpoint import read_metadata
from storage.rundir import RunDir
from tests.clip_fixture import PROJECTION, clip_processor, perturbed_tower, save_tiny_clip, solid_images

TASKS = ["eurosat", "mnist"]  # ten classes each, like the real ones
ROWS = {"train": 16, "test": 12}
RUNS = ["ta_featcal", "regmean", "ta_surgery", "ta_probsurgery"]


def _mirror(root):
    """The tiny CLIP, one perturbed copy of its vision tower per task and each task's images, under the hub names."""
    models, data = root / "models", root / "data"
    clip_dir = save_tiny_clip(models / BASE_MODEL)
    for i, task in enumerate(TASKS):
        perturbed_tower(clip_dir, seed=10 + i).save_pretrained(models / CLIP_TASKS[task].expert)
        rng = np.random.default_rng(i)
        features = Features(image=Image(), label=ClassLabel(names=CLASS_NAMES[task]))
        DatasetDict({split: Dataset.from_dict({"image": solid_images(rng, n), "label": rng.integers(0, 10, n).tolist()},
                                              features=features) for split, n in ROWS.items()}
                    ).save_to_disk(str(data / CLIP_TASKS[task].dataset))
    return models, data


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models, data = _mirror(tmp_path_factory.mktemp("mirror"))
    spec = preset_spec(CLIP_PRESETS["clip-vit-b32-ta8"], str(models), str(data), tasks=TASKS)
    bench = tmp_path_factory.mktemp("bench")
    return bench, spec, build_stages(bench, spec, direct_call)


@pytest.fixture(scope="module")
def ran(built):
    bench, spec, _ = built
    return run_stages(bench, RUNS, None, direct_call)


def test_build_reads_the_mirror_and_writes_every_run_config(built):
    bench, spec, records = built
    assert AutoConfig.from_pretrained(bench / "clip").architectures == ["CLIPModel"]
    assert AutoConfig.from_pretrained(bench / "base").architectures == ["CLIPVisionModel"]
    assert (bench / "base" / "preprocessor_config.json").is_file()  # the raw images are read with the base's processor
    for task in TASKS:
        ds = datasets.load_from_disk(str(bench / "data" / task))
        assert {s: len(ds[s]) for s in ds} == {"calibration": ROWS["train"], "test": ROWS["test"]}  # pool ≤ train
        assert ds["test"].features["label"].names == CLASS_NAMES[task]
        assert records[f"expert/{task}"]["info"]["source"].endswith(CLIP_TASKS[task].expert)
    assert split_sizes(bench, TASKS) == {t: {"calibration": ROWS["train"], "test": ROWS["test"]} for t in TASKS}
    cfg = load_config(bench / "configs" / "ta_featcal.yaml")
    assert cfg.zero_shot.task_templates == {t: TEMPLATES[t] for t in TASKS}
    assert (cfg.featcal.lam, cfg.featcal.rho, cfg.featcal.alpha, cfg.merge.scaling) == (0.05, 2.2, 0.25, 0.3)
    assert plan(cfg)["architecture"] == "CLIPVisionModel"
    assert load_config(bench / "configs" / "regmean_pp.yaml").merge.method == "average"
    # A second build finds every stage cached.
    starts = len(RunDir(bench).events())
    assert build_stages(bench, spec, direct_call) == records and len(RunDir(bench).events()) == starts


def test_cost_estimate_counts_every_run(built):
    bench, _, _ = built
    estimate = clip_cost_estimate(bench, split_sizes(bench, TASKS))
    assert f"featcal plan {bench / 'configs' / 'ta_featcal.yaml'}" in estimate and "RAM (estimate)" in estimate
    rows = {line.split(" | ")[0].strip("| *"): line for line in estimate.splitlines() if line.startswith("| ")}
    assert {"ta_featcal", "ta_featcal_n008", "regmean_pp", "ta_surgery", "ta_probsurgery"} <= rows.keys()
    assert rows["ta_probsurgery"].split(" | ")[1] == rows["ta_surgery"].split(" | ")[1]  # the same forward passes
    assert "| **all** (`featcal bench run`) |" in estimate
    # ta_featcal: 10.8 passes per calibration example, 4 scored models per test row, 30 + 10 prompts.
    assert rows["ta_featcal"].split(" | ")[1] == f"{10.8 * 32 + 4 * 24 + 40:,.0f}"


def test_run_reports_our_rows_beside_the_papers(built, ran):
    bench, spec, _ = built
    report = json.loads((bench / "report" / "clip-vit-b32-ta8.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == {"experts (individual)", "zero-shot", "task arithmetic", "RegMean", "TA + Surgery",
                         "TA + ProbSurgery", "TA + FeatCal"}
    ours = {
        run: json.loads((bench / "runs" / run / "report.json").read_text())["tasks"]
        for run in ("ta_featcal", "regmean")
    }
    for method, run, model in (
        ("experts (individual)", "ta_featcal", "expert"),
        ("zero-shot", "ta_featcal", "base"),
        ("task arithmetic", "ta_featcal", "merged"),
        ("TA + FeatCal", "ta_featcal", "calibrated"),
        ("RegMean", "regmean", "calibrated"),
    ):
        assert rows[method]["accuracy"] == {t: ours[run][t]["accuracy"][model] for t in TASKS}, method
        assert rows[method]["paper"] == pytest.approx(PAPER[method] / 100)
    for method, run, rank in (("TA + Surgery", "ta_surgery", 16), ("TA + ProbSurgery", "ta_probsurgery", 128)):
        surgery = json.loads((bench / "results" / f"{run}.json").read_text())
        assert rows[method]["accuracy"] == {t: surgery["accuracy"][t]["calibrated"] for t in TASKS}
        assert rows[method]["paper"] == pytest.approx(PAPER[method] / 100)
        assert surgery["cost"]["cached_merged_features"] and len(surgery["labels"]["mnist"]) == ROWS["test"]
        assert (surgery["method"], surgery["cost"]["rank"], surgery["cost"]["steps"]) == (run[3:], rank, 1000)
    assert surgery["cost"]["kl_weight"] == 1e-4 and PAPER["TA + ProbSurgery"] == 78.8
    for row in rows.values():  # each task's own test rows size the standard error
        expected = sum(a * (1 - a) / ROWS["test"] for a in row["accuracy"].values()) ** 0.5 / len(TASKS)
        assert row["standard_error"] == pytest.approx(expected, rel=1e-12)
    md = (bench / "report" / "clip-vit-b32-ta8.md").read_text()
    assert "| method | eurosat | mnist | average | paper | normalized |" in md
    featcal_line = next(line for line in md.splitlines() if line.startswith("| TA + FeatCal |"))
    assert f"| {100 * rows['TA + FeatCal']['average']:.1f} ± " in featcal_line and "| 85.5 |" in featcal_line
    assert "| paper (TA + FeatCal) | 82.9 |  |  |  |  | 85.5 |" in md
    assert "leaves out dtd, gtsrb, resisc45, stanford_cars, sun397, svhn" in md
    assert ran["report"]["outputs"] and (bench / "report" / "clip-vit-b32-ta8_accuracy.png").stat().st_size > 0
    # The heads come from the benchmark's prompts, and the run keeps its per-example predictions.
    metadata = read_metadata(bench / "runs" / "ta_featcal" / "merged" / "heads" / "eurosat.safetensors")
    assert json.loads(metadata["templates"]) == TEMPLATES["eurosat"]
    assert json.loads(metadata["class_names"]) == CLASS_NAMES["eurosat"]
    assert {c["method"] for c in report["paired"]["comparisons"]} == set(rows) - {"TA + FeatCal"}


def test_surgery_adapter_sits_on_the_image_feature_the_zero_shot_head_reads(built, ran):
    bench, _, _ = built
    head = load_file(bench / "runs" / "ta_featcal" / "merged" / "heads" / "mnist.safetensors")
    model = ZeroShotClassifier(task_model(bench / "experts" / "mnist"), head)
    pixels = clip_processor()(solid_images(np.random.default_rng(5), 6), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        start = SurgeryClassifier(model, SurgeryAdapter(PROJECTION, 16).eval())  # an identity adapter
        torch.testing.assert_close(start(pixel_values=pixels), model(pixel_values=pixels).logits)
        assert features(model, {"pixel_values": pixels}).shape == (6, PROJECTION)


def test_missing_mirror_path_is_named_with_its_flag(built, tmp_path, capsys):
    bench, spec, _ = built
    models, data = spec.models_from, spec.data_from
    out = str(tmp_path / "b")
    assert main(["bench", "build", "clip-vit-b32-ta8", "--out", out, "--models-from", models, "--data-from", data]) == 2
    err = capsys.readouterr().err.strip()
    expected = f"--models-from {models}: {models}/tanganke/clip-vit-base-patch32_dtd does not exist"
    assert len(err.splitlines()) == 1 and expected in err and "(11 more path(s) missing)" in err, err
    assert main(["bench", "build", "clip-vit-b32-ta8", "--out", out, "--models-from", models, "--data-from",
                 str(tmp_path), "--tasks", *TASKS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data-from {tmp_path}: {tmp_path}/tanganke/eurosat does not exist" in err
    assert main(["bench", "build", "minilm8", "--out", out, "--tasks", "eurosat"]) == 2
    assert ("--tasks: only for clip-vit-b32-ta8, flan-t5-base-glue8, mergebench-llama-3.2-3b, not minilm8"
            in capsys.readouterr().err)
    assert not (tmp_path / "b").exists()
