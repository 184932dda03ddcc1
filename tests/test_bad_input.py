"""Bad input of every kind preflight covers: each ends in exit 2, one line naming the culprit, and no run directory
(or, for what can be fixed safely, a notice and a run that goes on). Table-driven over the tiny BERT example."""

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import datasets
import pytest
import torch
from safetensors.torch import load_file

import featcal.devices
from flows.cli import main
from tests.conftest import one_error_line, plan_or_run_args
from tests.llm_fixture import tiny_llama_run
from tests.tiny_example_inputs import (
    copied_bert_example,
    edit_example_yaml,
    edit_split,
    key_setting,
    own_checkpoint_copy,
    rewrite_tensors,
)

datasets.disable_progress_bars()
pytestmark = pytest.mark.usefixtures("fresh_console")


def _labels(value):
    def change(ds: datasets.Dataset) -> datasets.Dataset:
        labels = list(ds["label"])
        labels[3] = value
        return ds.remove_columns("label").add_column("label", labels)
    return change


def _truncate_header(root: Path, field: str) -> None:
    path = own_checkpoint_copy(root, field) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _garbage_header(root: Path, field: str) -> None:
    path = own_checkpoint_copy(root, field) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json at!"
    path.write_bytes(bytes(data))


def _empty_evaluation_file(root: Path) -> None:
    (root / "empty.csv").write_text("text,label\n")
    edit_example_yaml(root, lambda raw: raw["evaluation"]["data"]["topic"].update(path="empty.csv", split="train"))


def _empty_calibration_jsonl(root: Path) -> None:
    (root / "empty.jsonl").write_text("\n")
    edit_example_yaml(root, lambda raw: raw["calibration"]["data"]["negation"].update(path="empty.jsonl",
                                                                                       split="train"))


def _checkpoint_is_file(root: Path) -> None:
    (root / "a_file").write_text("x")
    edit_example_yaml(root, lambda raw: raw["experts"].__setitem__("count", "a_file"))


def _set(dotted: str, value) -> Callable[[Path], None]:
    """Set one key of the copied example.yaml (a dotted path)."""
    return lambda root: edit_example_yaml(root, key_setting(dotted, value))


def _split(task: str, split: str, change: Callable[[datasets.Dataset], datasets.Dataset]) -> Callable[[Path], None]:
    return lambda root: edit_split(root, task, split, change)


def _data_file(name: str, text: str, section: str = "calibration", task: str = "topic") -> Callable[[Path], None]:
    """Write a data file next to the config and point one task's data at it."""
    def breaks(root: Path) -> None:
        (root / name).write_text(text)
        edit_example_yaml(root, lambda raw: raw[section]["data"][task].update(path=name, split="train"))
    return breaks


def _tensors(field: str, change: Callable[[dict, dict], dict]) -> Callable[[Path], None]:
    """Rewrite the tensors of a copied checkpoint."""
    return lambda root: rewrite_tensors(root, field, change)


def _drop_query_bias(tensors: dict, _base: dict) -> dict:
    del tensors[next(n for n in tensors if n.endswith("layer.1.attention.self.query.bias"))]
    return tensors


def _widen_query_bias(tensors: dict, _base: dict) -> dict:
    name = next(n for n in tensors if n.endswith("layer.1.attention.self.query.bias"))
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1)
    return tensors


def _remove(field: str, *names: str) -> Callable[[Path], None]:
    def breaks(root: Path) -> None:
        directory = own_checkpoint_copy(root, field)
        for name in names:
            (directory / name).unlink()
    return breaks


def _write_in(field: str, name: str, text: str) -> Callable[[Path], None]:
    return lambda root: (own_checkpoint_copy(root, field) / name).write_text(text)


def _nested_head(tensors: dict, _base: dict) -> dict:
    """The linear head moved one module down (classifier.out_proj, as RoBERTa's classification head keeps it)."""
    return {n.replace("classifier.", "classifier.out_proj.", 1) if n.startswith("classifier.") else n: t
            for n, t in tensors.items()}


def _other_architecture(task: str) -> Callable[[Path], None]:
    """experts.TASK pointed at the example's CLIP expert (a vision model) while the base is BERT."""
    def breaks(root: Path) -> None:
        clip = (root / "base").resolve().parent.parent / "clip" / "experts"
        edit_example_yaml(root, lambda raw: raw["experts"].__setitem__(task, str(sorted(clip.iterdir())[0])))
    return breaks


def _no_experts(raw: dict) -> None:
    raw["experts"], raw["calibration"]["data"], raw["evaluation"]["data"] = {}, {}, {}


def _slash_task(raw: dict) -> None:
    for section in (raw["experts"], raw["calibration"]["data"], raw["evaluation"]["data"]):
        section["a/b"] = section.pop("count")


def _class_names(names: list[str]) -> Callable[[datasets.Dataset], datasets.Dataset]:
    return lambda ds: ds.cast_column("label", datasets.ClassLabel(names=names))


def _column(name: str, values: Callable[[datasets.Dataset], list], feature=None):
    return lambda ds: ds.remove_columns(name).add_column(name, values(ds), feature=feature)


def _given_merge(change: Callable[[dict], None] | None) -> Callable[[Path], None]:
    """merge.method given, its checkpoint a copy of the base with its tensors edited by `change` (None: no such
    directory)."""
    def breaks(root: Path) -> None:
        from safetensors.torch import save_file

        edit_example_yaml(root, lambda raw: raw.__setitem__("merge", {"method": "given", "path": "elsewhere"}))
        if change is None:
            return
        shutil.copytree((root / "base").resolve(), root / "elsewhere")
        tensors = load_file(root / "elsewhere" / "model.safetensors")
        change(tensors)
        save_file(tensors, str(root / "elsewhere" / "model.safetensors"), metadata={"format": "pt"})
    return breaks


def _reshaped(tensors: dict) -> None:
    name = "encoder.layer.0.attention.output.dense.weight"
    tensors[name] = tensors[name][:, :32].contiguous()


class Case(NamedTuple):
    """One kind of bad input: how it breaks the copied example, what --set adds, the words its one line holds."""

    kind: str
    area: str  # config, checkpoint or data
    breaks: Callable[[Path], None]
    words: list[str]
    sets: tuple[str, ...] = ()


def _unchanged(root: Path) -> None:
    """The input is broken by --set alone."""


CASES = [
    # ---- config: the file, --set, and the values pydantic validates ----
    Case("config-missing", "config", lambda r: (r / "example.yaml").unlink(),
         ["config file", "example.yaml does not exist"]),
    Case("config-not-yaml", "config", lambda r: (r / "example.yaml").write_text("base: [unclosed\n"),
         ["example.yaml is not valid YAML at line 2"]),
    Case("config-not-a-mapping", "config", lambda r: (r / "example.yaml").write_text("- base\n"),
         ["example.yaml: expected a mapping at the top level, got list"]),
    Case("config-unknown-section", "config", lambda r: edit_example_yaml(r, lambda raw: raw.__setitem__("mergee", {})),
         ["mergee: Extra inputs are not permitted", "from /", "example.yaml"]),
    Case("set-unknown-section", "config", _unchanged, ["nope: Extra inputs are not permitted", "from --set nope.x=1)"],
         ("nope.x=1",)),
    Case("set-without-equals", "config", _unchanged, ["--set 'merge.scaling'", "expected KEY.PATH=VALUE"],
         ("merge.scaling",)),
    Case("set-value-not-yaml", "config", _unchanged, ["--set 'merge.scaling=[1'", "not valid YAML"],
         ("merge.scaling=[1",)),
    Case("set-below-a-value", "config", _unchanged, ["merge.scaling is not a section", "0.3"], ("merge.scaling.x=1",)),
    Case("set-wrong-type", "config", _unchanged, ["calibration.batch_size", "got 'many'", "from --set"],
         ("calibration.batch_size=many",)),
    Case("merge-method-unknown", "config", _set("merge.method", "magic"),
         ["merge.method", "'magic'", "task_arithmetic"]),
    Case("merge-scaling-negative", "config", _set("merge.scaling", -0.5), ["merge.scaling", "greater than 0", "-0.5"]),
    Case("lambda-negative", "config", _set("featcal.lambda", -1), ["featcal.lambda", "must be >= 0", "-1"]),
    Case("examples-per-task-zero", "config", _set("calibration.examples_per_task", 0),
         ["calibration.examples_per_task", "greater than or equal to 1", "got 0"]),
    Case("views-token-drop-one", "config", _set("calibration.views", {"count": 2, "drop": 1}),
         ["calibration.views.drop", "less than 1"]),
    Case("experts-empty", "config", lambda r: edit_example_yaml(r, _no_experts),
         ["experts:", "needs at least one task"]),
    Case("task-name-with-slash", "config", lambda r: edit_example_yaml(r, _slash_task),
         ["experts", "'a/b'", "without '/'"]),
    Case("calibration-data-missing-task", "config",
         lambda r: edit_example_yaml(r, lambda raw: raw["calibration"]["data"].pop("count")),
         ["calibration.data has no entry for task(s) ['count']"]),
    Case("evaluation-data-unknown-task", "config",
         lambda r: edit_example_yaml(
             r, lambda raw: raw["evaluation"]["data"].__setitem__("extra", {"path": "data/topic"})),
         ["evaluation.data names task(s) ['extra']", "not in experts"]),
    Case("device-unknown", "config", _set("runtime", {"device": "tpu"}), ["runtime.device", "'tpu' is not a device"]),
    Case("activation-store-relative", "config", _set("runtime", {"activation_store": "acts"}),
         ["runtime.activation_store", "'acts' must be a URL"]),
    Case("evaluation-models-repeated", "config", _set("evaluation.models", ["merged", "merged"]),
         ["evaluation.models", "lists ['merged'] more than once"]),
    Case("label-words-unknown-task", "config", _set("evaluation.label_words", {"extra": ["no", "yes"]}),
         ["evaluation.label_words names task(s) ['extra']"]),
    Case("zero-shot-template-without-slot", "config",
         _set("zero_shot", {"clip_model": "base", "templates": ["a photo"]}),
         ["zero_shot.templates", "'a photo' must hold exactly one {}"]),
    Case("zero-shot-class-names-repeated", "config",
         _set("zero_shot", {"clip_model": "base", "class_names": {"topic": ["cat", "cat", "car"]}}),
         ["zero_shot.class_names", "task 'topic'", "distinct class names", "['cat', 'cat', 'car']"]),
    Case("head-side-with-regmean", "config", _set("featcal", {"method": "regmean", "calibrate_head_side": True}),
         ["featcal.calibrate_head_side: only with featcal.method featcal, not regmean"]),
    Case("task-weights-with-regmean", "config",
         _set("featcal", {"method": "regmean_plus_plus", "task_weights": {"topic": 2.0}}),
         ["featcal.task_weights: only with featcal.method featcal, not regmean_plus_plus"]),
    # ---- checkpoints: what the directories hold ----
    Case("base-missing", "checkpoint", _set("base", "./nowhere"),
         ["base: checkpoint directory", "nowhere does not exist"]),
    Case("expert-path-is-a-file", "checkpoint", _checkpoint_is_file, ["experts.count", "a_file", "is a file"]),
    Case("expert-header-truncated", "checkpoint", lambda r: _truncate_header(r, "experts/topic"),
         ["experts.topic", "model.safetensors", "unreadable safetensors header"]),
    Case("base-header-garbage", "checkpoint", lambda r: _garbage_header(r, "base"),
         ["base:", "model.safetensors", "unreadable safetensors header"]),
    Case("expert-config-missing", "checkpoint", _remove("experts/topic", "config.json"),
         ["experts.topic: checkpoint directory", "has no config.json"]),
    Case("expert-config-not-json", "checkpoint", _write_in("experts/negation", "config.json", "{not json"),
         ["experts.negation: cannot read the config of", "not a valid JSON file"]),
    Case("expert-other-architecture", "checkpoint", _other_architecture("count"),
         ["base is a bert model but experts.count is a clip model"]),
    # not the first task in order, whose config chooses the tensor layout: told by its config, before its tensors
    Case("later-expert-other-architecture", "checkpoint", _other_architecture("topic"),
         ["experts.topic: a clip model, but base is a bert model"]),
    Case("expert-tensor-missing", "checkpoint", _tensors("experts/negation", _drop_query_bias),
         ["experts.negation: tensor names differ from the base", "missing [", "layer.1.attention.self.query.bias"]),
    Case("expert-tensor-shape", "checkpoint", _tensors("experts/topic", _widen_query_bias),
         ["experts.topic: tensor", "layer.1.attention.self.query.bias has shape (65,), the base has (64,)"]),
    # refused before the body's calibration, not when the assemble stage reaches the head
    Case("head-refit-without-linear-head", "checkpoint", _tensors("experts/negation", _nested_head),
         ["featcal.head_refit: experts.negation has no linear head to refit", "expected tensor classifier.weight",
          "classifier.out_proj.bias"], sets=("featcal.head_refit=true",)),
    Case("base-without-tokenizer", "checkpoint",
         _remove("base", "vocab.txt", "tokenizer.json", "tokenizer_config.json"),
         ["calibration.data.topic: raw text column 'text' needs the base's tokenizer", "holds none of"]),
    Case("given-merge-missing", "checkpoint", _given_merge(None), ["merge.path", "elsewhere does not exist"]),
    Case("given-merge-other-shape", "checkpoint", _given_merge(_reshaped),
         ["merge.path", "tensor encoder.layer.0.attention.output.dense.weight has shape (64, 32)",
          "the base has (64, 64)"]),
    Case("given-merge-missing-tensor", "checkpoint", _given_merge(lambda t: t.pop("encoder.layer.1.output.dense.bias")),
         ["merge.path", "missing ['encoder.layer.1.output.dense.bias']", "not in base []"]),
    Case("given-merge-extra-tensor", "checkpoint",
         _given_merge(lambda t: t.update(extra=t["embeddings.LayerNorm.bias"].clone())),
         ["merge.path", "missing []", "not in base ['extra']"]),
    # ---- data: files, splits, columns and the values they hold ----
    Case("data-path-missing", "data", _set("calibration.data.topic.path", "./nowhere"),
         ["calibration.data.topic.path:", "nowhere does not exist", "a saved dataset directory"]),
    Case("split-unknown", "data", _set("calibration.data.negation.split", "dev"),
         ["calibration.data.negation.split: 'dev' is not a split of", "['calibration', 'test', 'train']"]),
    Case("file-suffix-unknown", "data", _data_file("rows.xlsx", "x"),
         ["calibration.data.topic.path", "suffix '.xlsx'"]),
    Case("column-unknown", "data", _set("calibration.data.topic.column", "body"),
         ["calibration.data.topic.column: 'body' is not a column", "['text', 'label']"]),
    Case("pair-column-unknown", "data", _set("evaluation.data.count.text_pair_column", "second"),
         ["evaluation.data.count.text_pair_column: 'second' is not a column"]),
    Case("no-input-column", "data", _split("negation", "calibration", lambda ds: ds.rename_column("text", "body")),
         ["calibration.data.negation.column: not set", "['body', 'label']"]),
    Case("label-column-unknown", "data", _set("evaluation.data.topic.label_column", "gold"),
         ["evaluation.data.topic.label_column: 'gold' is not a column"]),
    Case("csv-ragged-row", "data", _data_file("rows.csv", "text,label\na b,0\nc d,1,2\n"),
         ["calibration.data.topic.path", "rows.csv cannot be read as csv: the row on line 3 has 3 fields; expected 2"]),
    Case("csv-open-quote", "data", _data_file("rows.csv", 'text,label\n"a b,0\nc d,1\n'),
         ["calibration.data.topic.path", "rows.csv cannot be read as csv: the row on lines 2-3 (a quote left open?) "
          "has 1 fields"]),
    Case("jsonl-broken-line", "data", _data_file("rows.jsonl", '{"text": "a b", "label": 0}\n{"text": "c d", label}\n'),
         ["calibration.data.topic.path", "rows.jsonl cannot be read as json: line 2 is not JSON"]),
    Case("jsonl-not-an-object", "data", _data_file("rows.jsonl", '{"text": "a b", "label": 0}\n[1, 2]\n', task="count"),
         ["calibration.data.count.path", "line 2 is list; expected a JSON object"]),
    Case("parquet-corrupt", "data", _data_file("rows.parquet", "not parquet at all", "evaluation", "negation"),
         ["evaluation.data.negation.path: cannot load", "rows.parquet", "Parquet magic bytes not found"]),
    Case("calibration-empty", "data", _split("topic", "calibration", lambda ds: ds.select([])),
         ["calibration.data.topic.path", "split 'calibration' has no rows"]),
    Case("evaluation-empty", "data", _split("negation", "test", lambda ds: ds.select([])),
         ["calibration.data.negation.path", "split 'test' has no rows"]),  # the directory holds both splits
    Case("evaluation-empty-file", "data", _empty_evaluation_file,
         ["evaluation.data.topic.path", "empty.csv has no rows"]),
    Case("calibration-empty-jsonl", "data", _empty_calibration_jsonl,
         ["calibration.data.negation.path", "empty.jsonl has no rows"]),
    Case("text-not-string", "data", _split("negation", "calibration", _column("text", lambda ds: list(range(len(ds))))),
         ["calibration.data.negation.column", "'text' row 0", "(int)", "expected text"]),
    Case("text-none", "data", _split("topic", "test", _column(
        "text", lambda ds: [None, *list(ds["text"])[1:]], datasets.Value("string"))),
         ["evaluation.data.topic.column", "'text' row 0", "None"]),
    Case("text-a-list", "data", _split("topic", "test", _column("text", lambda ds: [t.split() for t in ds["text"]])),
         ["evaluation.data.topic.column", "'text' row 0", "(list)", "expected text"]),
    Case("label-above-range", "data", _split("topic", "test", _labels(7)),
         ["evaluation.data.topic.label_column", "'label' row 3", "label 7", "[0, 2]"]),
    Case("label-negative", "data", _split("negation", "test", _labels(-1)),
         ["evaluation.data.negation.label_column", "label -1", "[0, 1]"]),
    Case("label-equal-num-labels", "data", _split("count", "test", _labels(2)),
         ["evaluation.data.count.label_column", "label 2", "2 labels"]),
    Case("label-not-integer", "data", _split("topic", "test", _column("label", lambda ds: ["a"] * len(ds))),
         ["evaluation.data.topic.label_column", "'a' (str)", "integer class id"]),
    Case("label-float", "data", _split("negation", "test", _column("label", lambda ds: [0.5] * len(ds))),
         ["evaluation.data.negation.label_column", "row 0 is 0.5 (float)", "integer class id"]),
    Case("label-none", "data", _split("count", "test", _labels(None)),
         ["evaluation.data.count.label_column", "row 3 is None", "integer class id"]),
    Case("label-names-reordered", "data", _split("topic", "test", _class_names(["food", "animals", "vehicles"])),
         ["evaluation.data.topic.label_column", "['food', 'animals', 'vehicles']", "experts.topic",
          "['animals', 'food', 'vehicles']", "expected the same order"]),
]


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(tiny_example, tmp_path, capsys, command, case):
    root = copied_bert_example(tiny_example, tmp_path)
    case.breaks(root)
    capsys.readouterr()
    run_dir = tmp_path / "run"
    sets = [arg for value in case.sets for arg in ("--set", value)]
    assert main([*plan_or_run_args(command, root / "example.yaml", run_dir), *sets]) == 2
    line = one_error_line(capsys.readouterr().err)
    for word in case.words:
        assert word in line, (word, line)
    assert not run_dir.exists()


def test_keep_freed_memory_without_glibc_is_refused_before_work(tiny_example, tmp_path, capsys, monkeypatch):
    """A C library without mallopt (macOS, musl) cannot keep freed memory: refused by preflight, in one line naming
    the field, with no run directory made."""
    monkeypatch.setattr(featcal.devices, "_MALLOPT", None)
    root = copied_bert_example(tiny_example, tmp_path)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    args = [*plan_or_run_args("run", root / "example.yaml", run_dir), "--set", "runtime.keep_freed_memory=true"]
    assert main(args) == 2
    assert "runtime.keep_freed_memory: true needs glibc's mallopt" in one_error_line(capsys.readouterr().err)
    assert not run_dir.exists()


def test_the_table_holds_every_kind_once():
    """The count the issue asks for (40 across config, checkpoint, data, run directory and degenerate set-ups: the
    last two are in tests/test_run_dir_config.py and tests/test_setup_checks.py)."""
    kinds = [c.kind for c in CASES]
    assert len(set(kinds)) == len(kinds) == 68
    assert {c.area for c in CASES} == {"config", "checkpoint", "data"}


def test_class_names_other_than_the_heads_are_said_and_scored_by_position(tiny_example, tmp_path, capsys):
    """Names that differ in more than order may be wording only ('neg' for 'negative'): one notice, not a refusal."""
    root = copied_bert_example(tiny_example, tmp_path)
    edit_split(root, "negation", "test", _class_names(["no", "yes"]))
    assert main(["plan", str(root / "example.yaml")]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "names its classes" in line]
    assert said == [f"notice            evaluation.data.negation.label_column: 'label' names its classes ['no', 'yes'] "
                    f"but experts.negation's head (config.id2label) has {_head_names(root, 'negation')}; scored by "
                    "position (label id i is the head's output i)"]


def _head_names(root: Path, task: str) -> list[str]:
    id2label = json.loads((root / "experts" / task / "config.json").read_text())["id2label"]
    return [id2label[str(i)] for i in range(len(id2label))]


def test_max_length_beyond_positions_is_clamped_with_one_notice(tiny_example, tmp_path, caplog):
    """The example's BERT has 32 positions; texts of 12 sentences with max_length 128 crashed its embeddings
    ('The size of tensor a (128) must match the size of tensor b (32)') after merged/ was written."""
    from featcal.config import load_config
    from featcal.data import InputBuilder
    from flows.plan import plan, render
    from tasks.preflight import preflight

    root = copied_bert_example(tiny_example, tmp_path)
    edit_split(root, "topic", "calibration", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
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
    builder = InputBuilder(cfg.base, ("input_ids", "attention_mask", "token_type_ids"), source, 128, ds.column_names,
                           "w")
    assert builder(ds[:4])["input_ids"].shape == (4, 32)
    assert json.loads((Path(cfg.base) / "config.json").read_text())["max_position_embeddings"] == 32


def test_a_run_on_texts_longer_than_the_model_takes_completes(tiny_example, tmp_path):
    """End to end, the crash the clamp replaces: the whole run on those texts, evaluation included."""
    root = copied_bert_example(tiny_example, tmp_path)
    edit_split(root, "negation", "calibration", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
    edit_split(root, "negation", "test", lambda ds: ds.map(lambda r: {"text": " ".join([r["text"]] * 12)}))
    run_dir = tmp_path / "run"
    assert main(["run", "--no-prefect", str(root / "example.yaml"), "--run-dir", str(run_dir),
                 "--set", "calibration.max_length=128"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["tasks"]) == {"topic", "negation", "count"}
    assert all(t.isfinite().all() for t in load_file(run_dir / "calibrated" / "model.safetensors").values())


def test_a_tokenizer_without_padding_pads_with_eos_after_one_notice(tmp_path, capsys):
    """Llama's tokenizer has no padding token: `Asking to pad but the tokenizer does not have a padding token` came
    after merged/ was written. Preflight now says, once, that EOS pads (lm-evaluation-harness's choice); the plan
    shows it, every builder pads with it (masked out), and the run completes."""
    from featcal.config import load_config
    from featcal.data import InputBuilder

    config = tiny_llama_run(tmp_path)
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
    config = tiny_llama_run(tmp_path, eos=False)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert main(plan_or_run_args(command, config, run_dir)) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"featcal: error: base: the tokenizer of {tmp_path / 'base'} has no padding token "
                                "and no "
                                "EOS token to pad with; expected one (set tokenizer.pad_token and save the tokenizer "
                                "with the base)"]
    assert not run_dir.exists()


def test_class_names_are_compared_only_where_both_sides_have_real_names():
    """transformers' placeholders (LABEL_0, ...) and a plain integer column say nothing to compare; case and
    surrounding spaces are not a difference; a permutation is an error, other names a notice."""
    from featcal.input_checks import label_names_check

    named = datasets.Dataset.from_dict({"label": [0, 1, 2]}).cast_column(
        "label", datasets.ClassLabel(names=["cat", "dog", "Bird"]))
    plain = datasets.Dataset.from_dict({"label": [0, 1, 2]})
    check = lambda ds, id2label: label_names_check(ds, "label", id2label, 3, "evaluation.data.t", "experts.t")  # noqa: E731
    assert check(named, {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}) == (None, None)
    assert check(named, None) == (None, None)
    assert check(plain, {0: "cat", 1: "dog", 2: "bird"}) == (None, None)
    assert check(named, {0: "Cat ", 1: "DOG", 2: "bird"}) == (None, None)
    error, notice = check(named, {0: "dog", 1: "cat", 2: "bird"})
    assert notice is None and error == (
        "evaluation.data.t.label_column: 'label' names its classes ['cat', 'dog', 'Bird'] but experts.t's head "
        "(config.id2label) orders them ['dog', 'cat', 'bird']; expected the same order (remap the data with "
        "Dataset.align_labels_with_mapping(label2id, 'label'))")
    error, notice = check(named, {0: "cat", 1: "dog", 2: "fish"})
    assert error is None and notice.endswith("has ['cat', 'dog', 'fish']; scored by position (label id i is the head's "
                                             "output i)")
