"""`featcal eval-harness` on a finished tiny Llama run, offline: lm-evaluation-harness scores every model on a
multiple-choice task defined over a local JSONL file, the scores equal the models' own log-likelihoods, land in
the report, and a rerun reuses them unless the settings changed."""

import json
import logging
import math
import socket

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from flows.cli import main
from flows.pipeline import run_pipeline
from storage.rundir import RunDir
from tests.test_decoders import _build

# Six rows, each with its choices and the index of the right one: a word-level vocabulary of 24 tokens (the tiny
# models have 64), so every word is one token.
ROWS = [
    {"question": "the cat sat on the", "choices": ["mat", "sky", "fire"], "label": 0},
    {"question": "the sky is", "choices": ["blue", "wet", "cat"], "label": 0},
    {"question": "ice is", "choices": ["hot", "cold"], "label": 1},
    {"question": "fire is", "choices": ["hot", "cold", "wet"], "label": 0},
    {"question": "water is", "choices": ["dry", "wet"], "label": 1},
    {"question": "the sun is", "choices": ["cold", "hot", "green"], "label": 1},
]
TASK = "featcal_tiny_mc"


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the rows' words, its special tokens at the tiny models' ids (pad 0, bos 1, eos 2)."""
    words = sorted({w for r in ROWS for w in (*r["question"].split(), *r["choices"])})
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    assert len(vocab) <= 64
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _task_dir(root) -> str:
    """A harness task YAML over a local JSONL file (its datasets cache kept under `root` too)."""
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files: {{test: {root / "rows.jsonl"}}}
  cache_dir: {root / "hf-cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return str(root / "tasks")


def _brute_force(checkpoint) -> tuple[float, float]:
    """Accuracy and length-normalised accuracy from the model's own log-probabilities of each choice's tokens after
    the question, one unpadded row at a time."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    right = right_norm = 0
    for row in ROWS:
        context = tok(row["question"])["input_ids"]
        lls = []
        for choice in row["choices"]:
            ids = tok(f"{row['question']} {choice}")["input_ids"]
            with torch.inference_mode():
                logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            lls.append(sum(float(logp[i - 1, ids[i]]) for i in range(len(context), len(ids))))
        right += max(range(len(lls)), key=lls.__getitem__) == row["label"]
        norm = [ll / len(c) for ll, c in zip(lls, row["choices"], strict=True)]
        right_norm += max(range(len(norm)), key=norm.__getitem__) == row["label"]
    return right / len(ROWS), right_norm / len(ROWS)


@pytest.fixture
def connections(monkeypatch) -> list:
    """Every attempt to open an internet connection, refused and recorded (lm_eval swallows some errors)."""
    tried = []
    real = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            tried.append(address)
            raise OSError("no network in tests")
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return tried


def test_eval_harness(tmp_path, monkeypatch, capsys, caplog, connections):
    cfg = _build(tmp_path, "llama", experts=2, evaluation={"batch_size": 16, "models": ["calibrated"]})
    for model in ("base", "e0", "e1"):
        _tokenizer().save_pretrained(tmp_path / model)
    run_dir = tmp_path / "run"
    run_pipeline(cfg, run_dir)
    args = ["eval-harness", str(run_dir), "--tasks", TASK, "--include-path", _task_dir(tmp_path), "--batch-size", "4"]
    assert main(args) == 0
    assert connections == []
    summary = json.loads((run_dir / "harness.json").read_text())
    assert set(summary) == {"calibrated", "merged", "expert:task0", "expert:task1"}
    for name, scores in summary.items():
        metrics = scores[TASK]
        assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr"} <= set(metrics)
        assert all(math.isfinite(v) for v in metrics.values())
        assert 0 <= metrics["acc"] <= 1 and 0 <= metrics["acc_norm"] <= 1
        kept = json.loads((run_dir / "harness" / f"{name}.json").read_text())
        assert kept["scores"] == scores and kept["lm_eval"]["n-samples"][TASK]["effective"] == len(ROWS)
        assert list(kept["data"]) == [str(tmp_path / "rows.jsonl")]  # an edit to the rows scores it again
    for name, checkpoint in (("calibrated", run_dir / "calibrated"), ("expert:task0", tmp_path / "e0")):
        acc, acc_norm = _brute_force(checkpoint)
        assert summary[name][TASK]["acc"] == pytest.approx(acc)
        assert summary[name][TASK]["acc_norm"] == pytest.approx(acc_norm)

    # Folded into the report; the evaluate stage's record follows, so resuming the run redoes nothing.
    report = json.loads((run_dir / "report.json").read_text())
    assert report["harness"] == summary and "tasks" in report
    text = (run_dir / "report.md").read_text()
    assert text.count("## lm-evaluation-harness") == 1 and f"| {TASK} | acc_norm |" in text
    assert "| task | metric | calibrated | merged | expert:task0 | expert:task1 |" in capsys.readouterr().out
    started = [e for e in RunDir(run_dir).events() if e["event"] == "start"]
    run_pipeline(cfg, run_dir)
    assert [e for e in RunDir(run_dir).events() if e["event"] == "start"] == started
    assert json.loads((run_dir / "report.json").read_text())["harness"] == summary

    # The same command again: every result reused, none scored, the section written once.
    import lm_eval

    mtimes = {p.name: p.stat().st_mtime_ns for p in (run_dir / "harness").iterdir()}
    scored = []
    real = lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: scored.append(kw) or real(**kw))
    logging.getLogger("featcal").addHandler(caplog.handler)
    try:
        assert main(args) == 0
    finally:
        logging.getLogger("featcal").removeHandler(caplog.handler)
    assert scored == []
    assert sum("reused" in r.getMessage() for r in caplog.records) == 4
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "harness").iterdir()} == mtimes
    assert (run_dir / "report.md").read_text().count("## lm-evaluation-harness") == 1

    # Other settings (a limit) are not the same result: scored again.
    assert main([*args, "--models", "calibrated", "--limit", "3"]) == 0
    assert len(scored) == 1
    kept = json.loads((run_dir / "harness" / "calibrated.json").read_text())
    assert kept["settings"]["limit"] == 3 and kept["lm_eval"]["n-samples"][TASK]["effective"] == 3
    assert list(json.loads((run_dir / "harness.json").read_text())) == ["calibrated"]
    assert connections == []


def test_eval_harness_bad_input(tmp_path, capsys):
    """A missing run directory, an unfinished run and an unknown --models entry: one line each, nothing scored."""
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "run.yaml").write_text(json.dumps({
        "base": str(tmp_path / "base"), "experts": {"task0": str(tmp_path / "e0")},
        "calibration": {"data": {"task0": {"path": str(tmp_path / "d0")}}}}))
    cases = {
        (str(tmp_path / "nowhere"),): "nowhere: no such run directory",
        (str(tmp_path / "unfinished"),): "unfinished/calibrated is missing: the run has not finished",
        (str(tmp_path / "unfinished"), "--models", "expert:nope"): "--models: unknown entry 'expert:nope'",
    }
    for extra, message in cases.items():
        assert main(["eval-harness", *extra, "--tasks", TASK]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("featcal: error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "nowhere").exists()
