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


def _given_merge(root: Path, change: Callable[[dict], None] | None) -> None:
    """merge.method given, its checkpoint a copy of the base with its tensors edited by `change` (None: no such
    directory)."""
    from safetensors.torch import save_file

    _edit_yaml(root, lambda raw: raw.__setitem__("merge", {"method": "given", "path": "elsewhere"}))
    if change is None:
        return
    shutil.copytree((root / "base").resolve(), root / "elsewhere")
    tensors = load_file(root / "elsewhere" / "model.safetensors")
    change(tensors)
    save_file(tensors, str(root / "elsewhere" / "model.safetensors"), metadata={"format": "pt"})


def _reshaped(tensors: dict) -> None:
    name = "encoder.layer.0.attention.output.dense.weight"
    tensors[name] = tensors[name][:, :32].contiguous()


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
    ("given-merge-missing", lambda r: _given_merge(r, None), ["merge.path", "elsewhere does not exist"]),
    ("given-merge-other-shape", lambda r: _given_merge(r, _reshaped),
     ["merge.path", "tensor encoder.layer.0.attention.output.dense.weight has shape (64, 32)",
      "the base has (64, 64)"]),
    ("given-merge-missing-tensor", lambda r: _given_merge(r, lambda t: t.pop("encoder.layer.1.output.dense.bias")),
     ["merge.path", "missing ['encoder.layer.1.output.dense.bias']", "not in base []"]),
    ("given-merge-extra-tensor",
     lambda r: _given_merge(r, lambda t: t.update(extra=t["embeddings.LayerNorm.bias"].clone())),
     ["merge.path", "missing []", "not in base ['extra']"]),
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
