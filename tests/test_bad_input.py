"""Bad input of every kind preflight covers: each ends in exit 2, one line naming the culprit, and no run directory
(or, for what can be fixed safely, a notice and a run that goes on). Table-driven over the tiny BERT example."""

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
import yaml
import torch
from safetensors.torch import load_file

from flows.cli import main

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def _fresh_console():
    """main() adds a console handler on the stderr of its first call; each test's captured stderr needs its own."""
    yield
    ours = logging.getLogger("featcal")
    for handler in [h for h in ours.handlers if h.get_name() == "featcal-console"]:
        ours.removeHandler(handler)
    ours.propagate = True


def _copy(tiny_example: Path, tmp_path: Path) -> Path:
    """The BERT example's config and data copied (checkpoints linked: cases that break one copy it first)."""
    root = tmp_path / "ex"
    src = tiny_example / "bert"
    root.mkdir()
    shutil.copy(src / "example.yaml", root / "example.yaml")
    shutil.copytree(src / "data", root / "data")
    for name in ("base", "experts"):
        (root / name).symlink_to(src / name)
    return root


def _edit_yaml(root: Path, change: Callable[[dict], None]) -> None:
    raw = yaml.safe_load((root / "example.yaml").read_text())
    change(raw)
    (root / "example.yaml").write_text(yaml.safe_dump(raw))


def _edit_split(root: Path, task: str, split: str, change: Callable[[datasets.Dataset], datasets.Dataset]) -> None:
    path = root / "data" / task
    dd = datasets.load_from_disk(str(path))
    fresh = path.with_name(f"{task}.new")
    datasets.DatasetDict({**dd, split: change(dd[split])}).save_to_disk(str(fresh))
    shutil.rmtree(path)
    fresh.rename(path)


def _own_checkpoint(root: Path, field: str) -> Path:
    """Replace the linked checkpoint `field` (base or experts/TASK) with a copy of its own, to break."""
    link = root / field
    if field.startswith("experts/"):
        target = (root / "experts").resolve()
        (root / "experts").unlink()
        shutil.copytree(target, root / "experts", symlinks=False)
        return root / field
    target = link.resolve()
    link.unlink()
    shutil.copytree(target, link)
    return link


def _labels(value):
    def change(ds: datasets.Dataset) -> datasets.Dataset:
        labels = list(ds["label"])
        labels[3] = value
        return ds.remove_columns("label").add_column("label", labels)
    return change


def _truncate_header(root: Path, field: str) -> None:
    path = _own_checkpoint(root, field) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _garbage_header(root: Path, field: str) -> None:
    path = _own_checkpoint(root, field) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json at!"
    path.write_bytes(bytes(data))


def _empty_evaluation_file(root: Path) -> None:
    (root / "empty.csv").write_text("text,label\n")
    _edit_yaml(root, lambda raw: raw["evaluation"]["data"]["topic"].update(path="empty.csv", split="train"))


def _empty_calibration_jsonl(root: Path) -> None:
    (root / "empty.jsonl").write_text("\n")
    _edit_yaml(root, lambda raw: raw["calibration"]["data"]["negation"].update(path="empty.jsonl", split="train"))


def _checkpoint_is_file(root: Path) -> None:
    (root / "a_file").write_text("x")
    _edit_yaml(root, lambda raw: raw["experts"].__setitem__("count", "a_file"))


# (id, how the input is broken, the words the one line must hold)
CASES = [
    ("label-above-range", lambda r: _edit_split(r, "topic", "test", _labels(7)),
     ["evaluation.data.topic.label_column", "'label' row 3", "label 7", "[0, 2]"]),
    ("label-negative", lambda r: _edit_split(r, "negation", "test", _labels(-1)),
     ["evaluation.data.negation.label_column", "label -1", "[0, 1]"]),
    ("label-equal-num-labels", lambda r: _edit_split(r, "count", "test", _labels(2)),
     ["evaluation.data.count.label_column", "label 2", "2 labels"]),
    ("label-not-integer", lambda r: _edit_split(
        r, "topic", "test", lambda ds: ds.remove_columns("label").add_column("label", ["a"] * len(ds))),
     ["evaluation.data.topic.label_column", "'a' (str)", "integer class id"]),
    ("text-not-string", lambda r: _edit_split(
        r, "negation", "calibration", lambda ds: ds.remove_columns("text").add_column("text", list(range(len(ds))))),
     ["calibration.data.negation.column", "'text' row 0", "(int)", "expected text"]),
    ("text-none", lambda r: _edit_split(
        r, "topic", "test", lambda ds: ds.remove_columns("text").add_column(
            "text", [None, *list(ds["text"])[1:]], feature=datasets.Value("string"))),
     ["evaluation.data.topic.column", "'text' row 0", "None"]),
    ("calibration-empty", lambda r: _edit_split(r, "topic", "calibration", lambda ds: ds.select([])),
     ["calibration.data.topic.path", "split 'calibration' has no rows"]),
    ("evaluation-empty", lambda r: _edit_split(r, "negation", "test", lambda ds: ds.select([])),
     ["calibration.data.negation.path", "split 'test' has no rows"]),  # the directory holds both splits
    ("evaluation-empty-file", _empty_evaluation_file, ["evaluation.data.topic.path", "empty.csv has no rows"]),
    ("calibration-empty-jsonl", _empty_calibration_jsonl, ["calibration.data.negation.path", "empty.jsonl has no rows"]),
    ("expert-header-truncated", lambda r: _truncate_header(r, "experts/topic"),
     ["experts.topic", "model.safetensors", "unreadable safetensors header"]),
    ("base-header-garbage", lambda r: _garbage_header(r, "base"),
     ["base:", "model.safetensors", "unreadable safetensors header"]),
    ("expert-path-is-a-file", _checkpoint_is_file, ["experts.count", "a_file", "is a file"]),
]


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case,breaks,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(tiny_example, tmp_path, capsys, command, case, breaks, words):
    root = _copy(tiny_example, tmp_path)
    breaks(root)
    capsys.readouterr()
    run_dir = tmp_path / "run"
    args = ["plan", str(root / "example.yaml")] if command == "plan" else \
        ["run", "--no-prefect", str(root / "example.yaml"), "--run-dir", str(run_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("featcal: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not run_dir.exists()


def test_max_length_beyond_positions_is_clamped_with_one_notice(tiny_example, tmp_path, caplog):
    """The example's BERT has 32 positions; texts of 12 sentences with max_length 128 crashed its embeddings
    ('The size of tensor a (128) must match the size of tensor b (32)') after merged/ was written."""
    from featcal.config import load_config
    from featcal.data import InputBuilder
    from flows.plan import plan, render
    from tasks.preflight import preflight

    root = _copy(tiny_example, tmp_path)
    _edit_split(root, "topic", "calibration", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
    cfg = load_config(root / "example.yaml", ["calibration.max_length=128"])
    notice = ("calibration.max_length 128 exceeds the 32 positions the base accepts; texts are truncated to 32 "
              "tokens (calibration and evaluation)")
    with caplog.at_level(logging.WARNING, logger="featcal"):
        p = plan(cfg)  # quiet: the notice is a line of the plan
        assert caplog.records == []
        preflight(cfg)  # `featcal run`'s pipeline, after its quiet plan: said once in the log
    assert [r.getMessage() for r in caplog.records] == [notice]
    assert p["tokens_per_example_max"] == 32 and f"notice            {notice}" in render(p)
    source = cfg.calibration.data["topic"]
    ds = datasets.load_from_disk(str(root / "data/topic"))["calibration"]
    builder = InputBuilder(cfg.base, ("input_ids", "attention_mask", "token_type_ids"), source, 128, ds.column_names, "w")
    assert builder(ds[:4])["input_ids"].shape == (4, 32)
    assert json.loads((Path(cfg.base) / "config.json").read_text())["max_position_embeddings"] == 32


def test_a_run_on_texts_longer_than_the_model_takes_completes(tiny_example, tmp_path):
    """End to end, the crash the clamp replaces: the whole run on those texts, evaluation included."""
    root = _copy(tiny_example, tmp_path)
    _edit_split(root, "negation", "calibration", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
    _edit_split(root, "negation", "test", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
    run_dir = tmp_path / "run"
    assert main(["run", "--no-prefect", str(root / "example.yaml"), "--run-dir", str(run_dir),
                 "--set", "calibration.max_length=128"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["tasks"]) == {"topic", "negation", "count"}
    assert all(t.isfinite().all() for t in load_file(run_dir / "calibrated" / "model.safetensors").values())


def _tiny_llama(root: Path, eos: bool = True) -> Path:
    """A tiny Llama whose tokenizer, like Llama's and GPT-2's, has no padding token (tests/llm_fixture.py), two
    perturbed copies as experts and raw text to calibrate and evaluate on; `eos=False` drops its EOS token too."""
    from transformers import LlamaForCausalLM

    from tests.llm_fixture import WORDS, llm_config, llm_tokenizer
    from tests.test_architectures import perturbed

    texts = [" ".join(words) for words in WORDS.values()]
    tokenizer = llm_tokenizer(texts)
    if not eos:
        tokenizer.eos_token = None
    torch.manual_seed(0)
    base = LlamaForCausalLM(llm_config(len(tokenizer))).eval()
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    raw = {"base": "base", "experts": {}, "calibration": {"data": {}, "examples_per_task": 8, "batch_size": 4},
           "evaluation": {"data": {}}, "featcal": {"lambda": 0.05, "rho": 1.0}}
    for t, words in enumerate(list(WORDS.values())[:2]):
        base.load_state_dict(perturbed(base, seed=10 + t))
        base.save_pretrained(root / f"e{t}")
        rows = [" ".join(words[(i + k) % len(words)] for k in range(2 + i % 5)) for i in range(8)]  # ragged lengths
        datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(root / f"d{t}"))
        raw["experts"][f"task{t}"] = f"e{t}"
        raw["calibration"]["data"][f"task{t}"] = {"path": f"d{t}"}
        raw["evaluation"]["data"][f"task{t}"] = {"path": f"d{t}"}
    (root / "llama.yaml").write_text(yaml.safe_dump(raw))
    return root / "llama.yaml"


def test_a_tokenizer_without_padding_pads_with_eos_after_one_notice(tmp_path, capsys):
    """Llama's tokenizer has no padding token: `Asking to pad but the tokenizer does not have a padding token` came
    after merged/ was written. Preflight now says, once, that EOS pads (lm-evaluation-harness's choice); the plan
    shows it, every builder pads with it (masked out), and the run completes."""
    from featcal.config import load_config
    from featcal.data import InputBuilder

    config = _tiny_llama(tmp_path)
    notice = (f"base: the tokenizer of {tmp_path / 'base'} has no padding token; padding with its EOS token '</s>' "
              "(id 2), as lm-evaluation-harness does (padding is masked out)")
    assert main(["plan", str(config)]) == 0
    assert f"notice            {notice}" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    assert main(["run", "--no-prefect", str(config), "--run-dir", str(run_dir)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "padding token" in line]
    assert len(said) == 1 and said[0].endswith(f" WARNING {notice}"), said
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["tasks"]) == {"task0", "task1"}
    assert all(t.isfinite().all() for t in load_file(run_dir / "calibrated" / "model.safetensors").values())
    cfg = load_config(config)
    rows = datasets.load_from_disk(str(tmp_path / "d0"))[:4]
    builder = InputBuilder(cfg.base, ("input_ids", "attention_mask"), cfg.calibration.data["task0"], 32,
                           list(rows), "w")
    batch = builder(rows)
    lengths = [len(builder.processor(text)["input_ids"]) for text in rows["text"]]
    assert lengths == [3, 4, 5, 6]  # BOS and 2..5 words: rows 0..2 are padded
    assert builder.pad_id == 2 and batch["input_ids"].shape == (4, 6)
    for row, n in enumerate(lengths):
        assert batch["input_ids"][row, n:].tolist() == [2] * (6 - n)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (6 - n)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_tokenizer_without_padding_or_eos_is_refused(tmp_path, capsys, command):
    config = _tiny_llama(tmp_path, eos=False)
    run_dir = tmp_path / "run"
    args = ["plan", str(config)] if command == "plan" else ["run", "--no-prefect", str(config), "--run-dir", str(run_dir)]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"featcal: error: base: the tokenizer of {tmp_path / 'base'} has no padding token and no "
                                "EOS token to pad with; expected one (set tokenizer.pad_token and save the tokenizer "
                                "with the base)"]
    assert not run_dir.exists()
