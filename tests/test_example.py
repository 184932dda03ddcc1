"""The tiny offline example: layout, loadability, data, expert quality, idempotence, determinism.

`tiny_example` is the one session build from tests/conftest.py."""

from __future__ import annotations

import time
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    CLIPConfig,
    CLIPForImageClassification,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    CLIPVisionModel,
)

from featcal_bench import example
from featcal_bench.example import SPLIT_SIZES, TASK_LABELS, accuracy, build_tiny_example

ARCHS = ("bert", "clip")
MODELS = {
    "bert": (BertModel, BertForSequenceClassification, "bert."),
    "clip": (CLIPVisionModel, CLIPForImageClassification, "vision_model."),
}
MIN_EXPERT_ACCURACY = 0.8


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _tokenizer(root: Path) -> BertTokenizerFast | None:
    return BertTokenizerFast.from_pretrained(root / "base") if root.name == "bert" else None


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_config(tiny_example: Path, arch: str) -> None:
    root, tasks = tiny_example / arch, tuple(TASK_LABELS[arch])
    config = yaml.safe_load((root / "example.yaml").read_text())
    assert config["base"] == "base"
    assert config["experts"] == {t: f"experts/{t}" for t in tasks}
    assert config["merge"] == {"method": "task_arithmetic", "scaling": 0.3}
    assert config["featcal"] == {"lambda": 0.05, "rho": 2.2, "alpha": 0.25}
    assert config["calibration"]["examples_per_task"] == SPLIT_SIZES["calibration"]
    for task in tasks:
        assert config["calibration"]["data"][task] == {"path": f"data/{task}", "split": "calibration"}
        assert config["evaluation"]["data"][task] == {"path": f"data/{task}", "split": "test", "label_column": "label"}
    paths = [config["base"], *config["experts"].values(), *(d["path"] for d in config["evaluation"]["data"].values())]
    for relative in paths:
        assert (root / relative).is_dir(), relative
    assert not [p for p in root.rglob(".*tmp-*")], "temporary build directories left behind"


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_load_with_matching_weights(tiny_example: Path, arch: str) -> None:
    root = tiny_example / arch
    base_cls, expert_cls, prefix = MODELS[arch]
    base = base_cls.from_pretrained(root / "base")
    assert type(base) is base_cls
    base_shapes = _tensor_shapes(root / "base")
    assert not any(name.startswith(prefix) for name in base_shapes), "base names must carry no prefix"
    for task, labels in TASK_LABELS[arch].items():
        expert = expert_cls.from_pretrained(root / "experts" / task)
        assert type(expert) is expert_cls
        assert expert.config.id2label == dict(enumerate(labels))
        shapes = _tensor_shapes(root / "experts" / task)
        body = {name.removeprefix(prefix): s for name, s in shapes.items() if name.startswith(prefix)}
        head = {name: s for name, s in shapes.items() if not name.startswith(prefix)}
        assert body == base_shapes
        assert head == {"classifier.weight": (len(labels), example.HIDDEN), "classifier.bias": (len(labels),)}


def test_clip_expert_vision_config_is_the_base_config(tiny_example: Path) -> None:
    root = tiny_example / "clip"
    def comparable(config: CLIPVisionConfig) -> dict:
        return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}

    base = comparable(CLIPVisionConfig.from_pretrained(root / "base"))
    for task in TASK_LABELS["clip"]:
        config = CLIPConfig.from_pretrained(root / "experts" / task)
        assert comparable(config.vision_config) == base
        assert config.text_config.hidden_size <= example.HIDDEN


def test_bert_expert_config_matches_base(tiny_example: Path) -> None:
    root = tiny_example / "bert"
    base = BertConfig.from_pretrained(root / "base").to_dict()
    for task in TASK_LABELS["bert"]:
        expert = BertConfig.from_pretrained(root / "experts" / task).to_dict()
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            assert expert[key] == base[key]


def test_tokenizers_and_processors_load(tiny_example: Path) -> None:
    bert = tiny_example / "bert"
    assert (bert / "base" / "vocab.txt").read_text().split() == list(example.VOCAB)
    sentence = " ".join(w for group in example.WORD_GROUPS.values() for w in group[:1])
    for path in [bert / "base", *(bert / "experts" / t for t in TASK_LABELS["bert"])]:
        tokenizer = BertTokenizerFast.from_pretrained(path)
        assert len(tokenizer) == len(example.VOCAB)
        ids = tokenizer(sentence)["input_ids"]
        assert tokenizer.unk_token_id not in ids and len(ids) == len(example.WORD_GROUPS) + 2
    clip = tiny_example / "clip"
    for path in [clip / "base", *(clip / "experts" / t for t in TASK_LABELS["clip"])]:
        processor = CLIPImageProcessorPil.from_pretrained(path)
        assert (processor.crop_size.height, processor.crop_size.width) == (example.IMAGE_SIZE, example.IMAGE_SIZE)


def _row_keys(split: datasets.Dataset) -> set:
    rows = split[:]
    if "text" in rows:
        return set(rows["text"])
    if "input_ids" in rows:
        return {tuple(ids) for ids in rows["input_ids"]}
    return {bytes(memoryview(torch.as_tensor(x).numpy())) for x in split.with_format("torch")[:]["pixel_values"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_datasets(tiny_example: Path, arch: str) -> None:
    for task, labels in TASK_LABELS[arch].items():
        data = datasets.load_from_disk(str(tiny_example / arch / "data" / task))
        assert {split: len(data[split]) for split in data} == SPLIT_SIZES
        if arch == "clip":
            expected = ["pixel_values", "label"]
        elif task == example.PRETOKENISED_TASK:
            expected = ["input_ids", "attention_mask", "label"]
        else:
            expected = ["text", "label"]
        keys = {}
        for split in SPLIT_SIZES:
            assert data[split].column_names == expected
            assert set(data[split][:]["label"]) == set(range(len(labels)))
            keys[split] = _row_keys(data[split])
            assert len(keys[split]) == SPLIT_SIZES[split], f"duplicate rows in {task}/{split}"
        assert not keys["train"] & keys["calibration"]
        assert not keys["train"] & keys["test"]
        assert not keys["calibration"] & keys["test"]


def test_pretokenised_task_is_unpadded_and_variable_length(tiny_example: Path) -> None:
    rows = datasets.load_from_disk(str(tiny_example / "bert" / "data" / example.PRETOKENISED_TASK))["train"][:]
    lengths = {len(ids) for ids in rows["input_ids"]}
    assert len(lengths) > 3
    assert all(set(mask) == {1} for mask in rows["attention_mask"])
    assert [len(m) for m in rows["attention_mask"]] == [len(ids) for ids in rows["input_ids"]]


def test_pixel_values_shape(tiny_example: Path) -> None:
    for task in TASK_LABELS["clip"]:
        test = datasets.load_from_disk(str(tiny_example / "clip" / "data" / task))["test"]
        pixels = test.with_format("torch")[:]["pixel_values"]
        assert pixels.shape == (SPLIT_SIZES["test"], 3, example.IMAGE_SIZE, example.IMAGE_SIZE)
        assert pixels.dtype == torch.float32


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_are_accurate_on_their_task(tiny_example: Path, arch: str) -> None:
    root = tiny_example / arch
    _, expert_cls, _ = MODELS[arch]
    accuracies = {}
    for task in TASK_LABELS[arch]:
        test = datasets.load_from_disk(str(root / "data" / task))["test"]
        accuracies[task] = accuracy(expert_cls.from_pretrained(root / "experts" / task), test, _tokenizer(root))
    print(f"{arch} expert test accuracies: {accuracies}")
    assert all(acc >= MIN_EXPERT_ACCURACY for acc in accuracies.values()), accuracies


def test_rebuild_is_a_fast_no_op(tiny_example: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in tiny_example.rglob("*")}
    started = time.perf_counter()
    build_tiny_example(tiny_example)
    assert time.perf_counter() - started < 1.0
    assert {p: p.stat().st_mtime_ns for p in tiny_example.rglob("*")} == before


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown example architectures"):
        build_tiny_example(tmp_path, ("gpt2",))


def test_crash_then_resume_gives_the_same_bytes_as_a_clean_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit-identical across directories and across a crash; few steps keep this fast."""
    monkeypatch.setattr(example, "PRETRAIN_STEPS", 5)
    monkeypatch.setattr(example, "EXPERT_STEPS", 5)
    clean = build_tiny_example(tmp_path / "clean", ("bert",))

    write_expert = example._write_expert

    def crash_on_count(out: Path, arch: str, root: Path, task: str, seed: int) -> None:
        if task == "count":
            (out / "partial").write_text("half-written")
            raise KeyboardInterrupt
        write_expert(out, arch, root, task, seed)

    monkeypatch.setattr(example, "_write_expert", crash_on_count)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_example(tmp_path / "resumed", ("bert",))
    experts = tmp_path / "resumed" / "bert" / "experts"
    assert sorted(p.name for p in experts.iterdir()) == ["negation", "topic"]
    assert not (tmp_path / "resumed" / "bert" / "example.yaml").exists()

    (experts / ".count.tmp-killed").mkdir()  # what a kill -9 would leave
    monkeypatch.setattr(example, "_write_expert", write_expert)
    resumed = build_tiny_example(tmp_path / "resumed", ("bert",))
    assert _files(resumed) == _files(clean)
