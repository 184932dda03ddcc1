"""What preflight reads of the data before any work: label ranges against the head, empty splits, and texts longer
than the model takes (cut, with a notice, instead of a crash after merged/ and acts/ were written)."""

from __future__ import annotations

import json
import logging

import datasets
import pytest
import yaml
from safetensors.torch import load_file

from featcal.data import label_range_error, token_limit
from flows.cli import main
from tests.conftest import example_config


def _with_test_labels(tiny_example, tmp_path, labels):
    """The example's topic task with its test split's labels replaced (the feature becomes a plain column)."""
    data = datasets.load_from_disk(str(tiny_example / "bert" / "data" / "topic"))
    test = data["test"].select(range(len(labels))).remove_columns("label").add_column("label", labels)
    path = tmp_path / "topic"
    datasets.DatasetDict({**data, "test": test}).save_to_disk(str(path))
    return path


def _config_file(tiny_example, tmp_path, **changes) -> str:
    raw = yaml.safe_load((tiny_example / "bert" / "example.yaml").read_text())
    root = tiny_example / "bert"
    raw["base"] = str(root / raw["base"])
    raw["experts"] = {t: str(root / p) for t, p in raw["experts"].items()}
    for section in ("calibration", "evaluation"):
        for source in raw[section]["data"].values():
            source["path"] = str(root / source["path"])
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize(("labels", "expected"), [
    ([0, 1, 7, 2, 7], "evaluation.data.topic.label_column 'label': 2 of 5 labels are outside the head's classes 0..2: [7]"),
    ([0, -1, 1, -1], "2 of 4 labels are outside the head's classes 0..2: [-1] (-1 usually marks an unlabelled row"),
    ([0.0, 1.5, 2.0], "labels must be integer class ids for a 3-class head; found values of type ['float']"),
    (["food", "animals"], "labels must be integer class ids for a 3-class head; found values of type ['str']"),
])
def test_labels_the_head_cannot_predict_are_refused_before_any_work(tiny_example, tmp_path, capsys, labels, expected):
    path = _with_test_labels(tiny_example, tmp_path, labels)
    config = _config_file(tiny_example, tmp_path, evaluation__data__topic__path=str(path))
    run_dir = tmp_path / "run"
    assert main(["plan", config]) == 2
    assert expected in capsys.readouterr().err
    assert main(["run", config, "--run-dir", str(run_dir), "--no-prefect"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]
    assert not run_dir.exists() or not any(run_dir.iterdir())


@pytest.mark.parametrize("kind", ["saved split", "csv header only", "empty jsonl"])
def test_an_empty_dataset_is_named(tiny_example, tmp_path, capsys, kind):
    data = datasets.load_from_disk(str(tiny_example / "bert" / "data" / "negation"))
    split = "calibration" if kind == "saved split" else "train"
    if kind == "saved split":
        path = tmp_path / "negation"
        datasets.DatasetDict({**data, "calibration": data["calibration"].select([])}).save_to_disk(str(path))
    else:
        path = tmp_path / ("negation.csv" if kind == "csv header only" else "negation.jsonl")
        path.write_text("text,label\n" if kind == "csv header only" else "")
    config = _config_file(tiny_example, tmp_path, calibration__data__negation={"path": str(path), "split": split})
    assert main(["plan", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"featcal: error: calibration.data.negation: {path} (split {split!r}) has no rows"


def test_texts_longer_than_the_model_takes_are_cut_with_a_notice(tiny_example, tmp_path, caplog, capsys):
    """The example's base has 32 positions; max_length is set back to its default 128 and the texts run to 96 words."""
    data = datasets.load_from_disk(str(tiny_example / "bert" / "data" / "negation"))
    long = [" ".join([text] * 12) for text in data["calibration"]["text"]]
    calibration = data["calibration"].remove_columns("text").add_column("text", long)
    path = tmp_path / "negation"
    datasets.DatasetDict({**data, "calibration": calibration}).save_to_disk(str(path))
    config = _config_file(tiny_example, tmp_path, calibration__data__negation__path=str(path),
                          calibration__max_length=128, evaluation={"enabled": False})
    run_dir = tmp_path / "run"
    assert main(["plan", config]) == 0
    assert "tokens/example    ≤ 32" in capsys.readouterr().out
    with caplog.at_level(logging.WARNING, logger="featcal"):
        assert main(["run", config, "--run-dir", str(run_dir), "--no-prefect"]) == 0
    notices = [r.getMessage() for r in caplog.records if "calibration.max_length" in r.getMessage()]
    assert len(notices) == 1 and "calibration.max_length 128: the base (" in notices[0]
    assert notices[0].endswith("takes at most 32 tokens, so texts are cut to 32")
    tensors = load_file(run_dir / "calibrated" / "model.safetensors")
    assert all(t.isfinite().all() for t in tensors.values())


def test_token_limit_reads_the_positions_a_model_takes(tmp_path):
    def limit(**config):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return token_limit(tmp_path)

    assert limit(model_type="bert", max_position_embeddings=512) == 512
    assert limit(model_type="roberta", max_position_embeddings=514, pad_token_id=1) == 512
    assert limit(model_type="gpt2", n_positions=1024) == 1024
    assert limit(model_type="t5", n_positions=512) is None  # relative positions: any length runs
    assert limit(model_type="clip", text_config={"model_type": "clip_text_model", "max_position_embeddings": 77}) == 77


def test_label_range_error_accepts_every_class_of_the_head():
    assert label_range_error([0, 1, 2, 2, 0], 3, "w") is None
    assert label_range_error([True, False], 2, "w") == \
        "w: labels must be integer class ids for a 2-class head; found values of type ['bool']"
