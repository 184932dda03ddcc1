"""The model card in a run's calibrated/ and merged/, and `featcal push` up to the upload call."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from huggingface_hub import HfApi, ModelCard

from featcal.model_card import evaluation_rows, hub_model_id, model_card, pipeline_tag
from flows import cli
from flows.pipeline import run_pipeline
from flows.push import PushRefused, checkpoint_to_push
from storage.rundir import RunDir
from tests.conftest import example_config


@pytest.fixture(scope="module")
def evaluated_run(tiny_example, tmp_path_factory):
    """The tiny BERT example with its evaluation, and a credential in the activation store's options."""
    cfg = example_config(tiny_example, "bert", runtime={"storage_options": {"secret": "hunter2-do-not-publish"}})
    run_dir = tmp_path_factory.mktemp("carded")
    run_pipeline(cfg, run_dir)
    return cfg, run_dir


def table(card_text: str, heading: str) -> list[list[str]]:
    """The rows of the markdown table under `heading`, each a list of its cells."""
    section = card_text.split(f"## {heading}\n\n", 1)[1].split("\n\n", 1)[0]
    rows = section.splitlines()
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


@pytest.mark.parametrize("checkpoint", ["calibrated", "merged"])
def test_card_metadata_and_evaluation_match_the_run(evaluated_run, checkpoint):
    cfg, run_dir = evaluated_run
    card = ModelCard.load(run_dir / checkpoint / "README.md")
    # The example's base is a local directory: no base_model (a path would be published), and the card says why.
    assert (run_dir / cfg.base).is_dir() and card.data.base_model is None
    assert cfg.base not in card.content.split("---")[1]  # the YAML block the hub reads
    assert "The base is a local checkpoint, not a hub repository, so this card names no `base_model`." in card.text
    assert (cfg.merge.method, cfg.featcal.method) == ("task_arithmetic", "featcal")
    assert card.data.tags == ["merge", "featcal", "task_arithmetic"]
    assert card.data.library_name == "transformers"
    # The example's checkpoint is a BertModel body with one head file per task: no single task the hub could show.
    assert json.loads((run_dir / checkpoint / "config.json").read_text())["architectures"] == ["BertModel"]
    assert card.data.pipeline_tag is None
    report = json.loads((run_dir / "report.json").read_text())
    rows = table(card.text, "Evaluation")
    assert [r[0] for r in rows] == cfg.tasks
    models = report["models"]
    for row, (task, acc, gap) in zip(rows, evaluation_rows(report), strict=True):
        assert row[0] == task
        assert [float(c) for c in row[1:1 + len(models)]] == pytest.approx([acc[m] for m in models], abs=5e-5)
        expected_gap = (acc["calibrated"] - acc["merged"]) / (acc["expert"] - acc["merged"])
        assert gap == pytest.approx(expected_gap)
        assert float(row[-1]) == pytest.approx(expected_gap, abs=5e-5)
    experts = {r[0]: r[1].strip("`") for r in table(card.text, "Experts")}
    assert experts == cfg.experts
    examples = {r[0]: int(r[3]) for r in table(card.text, "Calibration data")}
    assert examples == {t: RunDir(run_dir).record(f"prepare/{t}")["info"]["examples"] for t in cfg.tasks}
    assert f"| `scaling` | `{cfg.merge.scaling}` |" in card.text


def test_card_holds_no_secret_and_no_runtime(evaluated_run):
    _, run_dir = evaluated_run
    for checkpoint in ("calibrated", "merged"):
        text = (run_dir / checkpoint / "README.md").read_text()
        assert "hunter2" not in text and "storage_options" not in text and "redacted" not in text


def test_card_is_outside_the_checkpoint_digest_so_a_rerun_is_a_cache_hit(evaluated_run):
    cfg, run_dir = evaluated_run
    run = RunDir(run_dir)
    before = {p.name: p.read_bytes() for p in (run_dir / "records").glob("*.json")}
    assert run.output_ok("calibrated", run.record("assemble")["outputs"]["calibrated"])
    run_pipeline(cfg, run_dir)
    after = {p.name: p.read_bytes() for p in (run_dir / "records").glob("*.json")}
    assert after == before  # no stage ran again: every record (key, digests, timings) is the one it was


def test_card_without_evaluation_has_no_table(reference_run):
    text = (reference_run / "calibrated" / "README.md").read_text()
    assert ModelCard.load(reference_run / "calibrated" / "README.md").data.library_name == "transformers"
    assert "## Evaluation" not in text and "## Calibration data" in text


@pytest.mark.parametrize("architecture, tag", [("LlamaForCausalLM", "text-generation"),
                                               ("T5ForConditionalGeneration", "text2text-generation"),
                                               ("ViTForImageClassification", "image-classification"),
                                               ("BertForSequenceClassification", "text-classification")])
def test_pipeline_tag_follows_the_architecture(architecture, tag):
    assert pipeline_tag(architecture) == tag


def test_pipeline_tag_is_left_out_when_unknown():
    config = {"base": "org/base", "experts": {"a": "org/a"}, "merge": {"method": "ties"},
              "calibration": {"data": {"a": {"path": "org/data", "split": "train"}}}, "featcal": {"method": "regmean"}}
    meta = yaml.safe_load(re.match(r"---\n(.*?)---", model_card(config, "merged", "CLIPVisionModel", {}, None),
                                   re.S).group(1))
    assert meta == {"base_model": "org/base", "library_name": "transformers", "tags": ["merge", "featcal", "ties",
                                                                                       "regmean"]}


def test_push_uploads_calibrated_with_its_card(evaluated_run, monkeypatch, capsys):
    _, run_dir = evaluated_run
    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))

    def upload_folder(self, folder_path, repo_id, **kw):
        from pathlib import Path

        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        calls.append(("upload", repo_id, folder_path, files, kw))
        return "https://huggingface.co/me/cal/commit/abc"

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert cli.main(["push", str(run_dir), "me/cal", "--private"]) == 0
    assert capsys.readouterr().out.strip() == "https://huggingface.co/me/cal/commit/abc"
    (_, repo, create_kw), (_, repo2, folder, files, _) = calls
    assert (repo, repo2, create_kw["private"], folder) == ("me/cal", "me/cal", True, str(run_dir / "calibrated"))
    assert "README.md" in files and "model.safetensors" in files and "config.json" in files
    assert not {"run.yaml", "manifest.json"} & set(files) and not any(f.startswith("records") for f in files)
    calls.clear()
    assert cli.main(["push", str(run_dir), "me/merged", "--merged"]) == 0
    assert calls[1][2] == str(run_dir / "merged")


def test_push_refuses_a_tampered_an_unfinished_or_an_empty_run(evaluated_run, tmp_path, monkeypatch, capsys):
    _, run_dir = evaluated_run
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("no upload may start"))
    stray = run_dir / "calibrated" / "token.txt"
    stray.write_text("hf_secret")
    try:
        with pytest.raises(PushRefused, match="does not match the checksum"):
            checkpoint_to_push(run_dir)
        assert cli.main(["push", str(run_dir), "me/cal"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "calibrated: does not match the checksum" in err
    finally:
        stray.unlink()
    with pytest.raises(PushRefused, match="not a finished run"):
        checkpoint_to_push(tmp_path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "status": "complete"}))
    with pytest.raises(PushRefused, match="calibrated: missing"):
        checkpoint_to_push(tmp_path)


def test_a_checkpoint_digest_skips_only_the_top_level_card(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "calibrated" / "sub").mkdir(parents=True)
    (tmp_path / "calibrated" / "model.safetensors").write_bytes(b"weights")
    bare = run.digest("calibrated")
    (tmp_path / "calibrated" / "README.md").write_text("a card")
    assert run.digest("calibrated") == bare
    (tmp_path / "calibrated" / "sub" / "README.md").write_text("not the card")
    assert run.digest("calibrated") != bare


@pytest.mark.parametrize("base, expected", [
    ("org/base", "org/base"),
    ("org/base@" + "a" * 40, "org/base"),
    ("/home/me/.cache/huggingface/hub/models--meta-llama--Llama-3.2-3B/snapshots/" + "0" * 40,
     "meta-llama/Llama-3.2-3B"),
    ("/cache/hub/models--org--name/snapshots/" + "1" * 40 + "/sub", "org/name"),
    ("/data/models/base", None),
    ("./base", None),
    ("/cache/hub/models--org--name/snapshots/not-a-commit", None),
])
def test_base_model_is_a_hub_id_or_absent(base, expected):
    assert hub_model_id(base) == expected
    config = {"base": base, "experts": {"a": "org/a"}, "merge": {"method": "ties"},
              "calibration": {"data": {"a": {"path": "org/data", "split": "train"}}}, "featcal": {"method": "featcal"}}
    meta = yaml.safe_load(re.match(r"---\n(.*?)---", model_card(config, "merged", None, {}, None), re.S).group(1))
    assert meta.get("base_model") == expected


def test_push_refuses_a_card_that_names_a_local_base(evaluated_run, monkeypatch, capsys):
    """A card from before base_model left local paths out, or edited since: refused before any upload."""
    _, run_dir = evaluated_run
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("no upload may start"))
    card = run_dir / "calibrated" / "README.md"
    original = card.read_text()
    try:
        for local in (str(run_dir / "base"), "../examples/tiny/bert/base"):
            card.write_text(original.replace("---\n", f"---\nbase_model: {local}\n", 1))
            assert cli.main(["push", str(run_dir), "me/cal"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"base_model {local!r} is not a hub id" in err
        card.write_text(original.replace("---\n", "---\nbase_model: org/base\n", 1))
        assert checkpoint_to_push(run_dir) == run_dir / "calibrated"
    finally:
        card.write_text(original)


def test_card_of_a_given_merge_names_where_it_came_from():
    config = {"base": "org/base", "experts": {"a": "org/a", "b": "org/b"},
              "merge": {"method": "given", "path": "/m/out"},
              "calibration": {"data": {"a": {"path": "org/data", "split": "train"}}}, "featcal": {"method": "featcal"}}
    card = model_card(config, "calibrated", "LlamaForCausalLM", {}, None)
    assert "the merge of 2 experts of `org/base` read from `/m/out` (made elsewhere)" in card
    assert yaml.safe_load(re.match(r"---\n(.*?)---", card, re.S).group(1))["tags"] == ["merge", "featcal", "given"]
    config["merge"] = {"method": "dare_ties", "density": 0.5}
    card = model_card(config, "merged", None, {}, None)
    assert "2 experts merged into `org/base` with dare_ties" in card and "| `density` | `0.5` |" in card
