"""The FLAN-T5-base GLUE benchmark end to end on a tiny local mirror laid out as the hub names it: bench build (from
the mirror: prompts rendered from GLUE-like rows) → bench run (a few method runs, each in its own process) → the
report with the paper's figures (no Prefect)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import T5ForConditionalGeneration

from featcal.config import load_config
from featcal_bench.cli import main
from featcal_bench.mirror import preset_spec
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.study import load_study
from featcal_bench.t5.prompts import LABEL_WORDS, TEMPLATES
from featcal_bench.t5.recipe import RECIPE, t5_estimate
from featcal_bench.t5.report import PAPER
from featcal_bench.t5.spec import BASE_MODEL, GLUE, GLUE_TASKS, T5_PRESETS, T5BenchSpec
from flows.pipeline import machine
from storage.rundir import RunDir
from tests.t5_fixture import fine_tuned_t5, glue_words, t5_config, t5_tokenizer

TASKS = ["cola", "stsb"]  # a ClassLabel task and the float-scored one
SPLITS = {"train": 24, "validation": 12}
SENTENCE_WORDS = ("the", "cat", "dog", "sat", "ran", "on", "a", "mat", "big", "small")
RUNS = ["ta_featcal", "regmean"]


def _rows(task: str, rng: np.random.Generator, n: int) -> Dataset:
    """GLUE-like rows: short sentences from a small vocabulary, cola's acceptability ClassLabel or stsb's score."""
    def sentences() -> list[str]:
        return [" ".join(rng.choice(SENTENCE_WORDS, int(k))) for k in rng.integers(3, 7, n)]

    if task == "cola":
        features = Features(sentence=Value("string"), label=ClassLabel(names=["unacceptable", "acceptable"]))
        return Dataset.from_dict({"sentence": sentences(), "label": rng.integers(0, 2, n).tolist()}, features=features)
    features = Features(sentence1=Value("string"), sentence2=Value("string"), label=Value("float32"))
    return Dataset.from_dict({"sentence1": sentences(), "sentence2": sentences(),
                              "label": np.round(rng.uniform(0, 5, n), 2).tolist()}, features=features)


def _mirror(root):
    """The tiny base with its tokenizer, one expert fine-tuned from it per task, and each task's GLUE-like data, under
    the hub names."""
    models, data = root / "models", root / "data"
    words = glue_words(TASKS, SENTENCE_WORDS)
    tokenizer = t5_tokenizer(words, split_punctuation=True)
    torch.manual_seed(0)
    base = T5ForConditionalGeneration(t5_config(vocab_size=3 + len(words))).eval()
    base.save_pretrained(models / BASE_MODEL)
    tokenizer.save_pretrained(models / BASE_MODEL)
    for i, task in enumerate(TASKS):
        rng = np.random.default_rng(i)
        ds = DatasetDict({split: _rows(task, rng, n) for split, n in SPLITS.items()})
        ds.save_to_disk(str(data / GLUE / task))
        fine_tuned_t5(base, tokenizer, ds["train"], task, seed=i).save_pretrained(
            models / GLUE_TASKS[task].expert(task)
        )
    return models, data


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models, data = _mirror(tmp_path_factory.mktemp("mirror"))
    spec = preset_spec(T5_PRESETS["flan-t5-base-glue8"], str(models), str(data), tasks=TASKS)
    bench = tmp_path_factory.mktemp("bench")
    records = build_stages(bench, spec, direct_call)
    t5_estimate(bench, spec)  # as `bench build` does after the flow
    return bench, spec, records


@pytest.fixture(scope="module")
def ran(built):
    bench, _, _ = built
    return run_stages(bench, RUNS, None, direct_call)


def test_build_renders_the_benchmarks_prompts_and_writes_every_run_config(built):
    bench, spec, records = built
    assert T5BenchSpec.is_built(bench) and T5BenchSpec.load(bench) == spec
    for task in TASKS:
        source = datasets.load_from_disk(f"{spec.data_from}/{GLUE}/{task}")["validation"]
        ds = datasets.load_from_disk(str(bench / "data" / task))
        assert {s: len(ds[s]) for s in ds} == {"calibration": SPLITS["train"], "test": SPLITS["validation"]}
        columns = GLUE_TASKS[task].columns
        assert ds["test"]["text"] == [TEMPLATES[task].format(**{c: r[c] for c in columns}) for r in source]
        assert ds["test"]["label"] == source["label"]
        assert records[f"expert/{task}"]["info"]["source"].endswith(GLUE_TASKS[task].expert(task))
    test = datasets.load_from_disk(str(bench / "data" / "cola"))["test"]
    assert test["target"] == [LABEL_WORDS["cola"][y] for y in test["label"]]
    assert test["text"][0].startswith("Indicate if the following sentence is grammatically correct or not: \"")
    stsb = datasets.load_from_disk(str(bench / "data" / "stsb"))["calibration"]
    assert stsb["target"] == [f"{y:.1f}" for y in stsb["label"]]
    cfg = load_config(bench / "configs" / "ta_featcal.yaml")
    assert cfg.evaluation.label_words == {"cola": LABEL_WORDS["cola"]}  # stsb: a float label, scored by Spearman
    assert {t: (s.column, s.target_column) for t, s in cfg.calibration.data.items()} == dict.fromkeys(
        TASKS, ("text", "target")
    )
    assert (cfg.featcal.lam, cfg.featcal.rho, cfg.featcal.alpha, cfg.merge.scaling) == (0.05, 2.2, 0.25, 0.3)
    assert cfg.calibration.examples_per_task == 256
    assert load_config(bench / "configs" / "ta_featcal_n008.yaml").calibration.examples_per_task == 8
    assert load_config(bench / "configs" / "regmean_pp.yaml").merge.method == "average"
    assert not (bench / "configs" / "ta_surgery.yaml").exists()
    starts = len(RunDir(bench).events())  # a second build finds every stage cached
    assert build_stages(bench, spec, direct_call) == records and len(RunDir(bench).events()) == starts


def test_build_estimates_every_runs_passes_and_says_where_it_timed_them(built):
    bench, _, _ = built
    estimate = (bench / "estimate.md").read_text()
    assert f"featcal plan {bench / 'configs' / 'ta_featcal.yaml'}" in estimate and "RAM (estimate)" in estimate
    rows = {
        line.split(" | ")[0].strip("| *"): line.split(" | ") for line in estimate.splitlines() if line.startswith("| ")
    }
    assert rows["method run"][1:3] == ["forward passes", "generate calls"]
    assert set(load_study(RECIPE.study).runs) <= rows.keys() and "| **all** (`featcal bench run`) |" in estimate
    sizes = {t: RunDir(bench).record(f"data/{t}")["info"] for t in TASKS}
    test = sum(s["test"] for s in sizes.values())
    # 10.8 teacher-forced forwards per calibration example; per test row a generate call of each scored model and of
    # the expert as drift reference, and teacher-forced forwards of the expert and each drifting model.
    drift = {"ta_featcal": 2, "regmean": 1}  # (merged, calibrated) and (calibrated)
    generates = {"ta_featcal": 4, "regmean": 2}  # base, merged, calibrated, expert; calibrated and the expert
    for run in RUNS:
        calibration = sum(min(load_study(RECIPE.study).runs[run].examples, s["calibration"]) for s in sizes.values())
        assert rows[run][1:3] == [
            f"{10.8 * calibration + (drift[run] + 1) * test:,.0f}",
            f"{generates[run] * test:,.0f}",
        ]
    assert f"Measured on {machine()}: CPU ({torch.get_num_threads()} torch threads)" in estimate
    assert ("time, GPU (" in estimate) == torch.cuda.is_available()
    assert ("run `featcal bench build` on a GPU machine for the GPU time" in estimate) != torch.cuda.is_available()


def test_run_reports_our_rows_beside_the_papers(built, ran):
    bench, _, _ = built
    report = json.loads((bench / "report" / "flan-t5-base-glue8.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == {"experts (individual)", "FLAN-T5-base", "task arithmetic", "RegMean", "TA + FeatCal"}
    ours = {run: json.loads((bench / "runs" / run / "report.json").read_text())["tasks"] for run in RUNS}
    for method, run, model in (
        ("experts (individual)", "ta_featcal", "expert"),
        ("FLAN-T5-base", "ta_featcal", "base"),
        ("task arithmetic", "ta_featcal", "merged"),
        ("TA + FeatCal", "ta_featcal", "calibrated"),
        ("RegMean", "regmean", "calibrated"),
    ):
        assert rows[method]["accuracy"] == {t: ours[run][t]["accuracy"][model] for t in TASKS}, method
        assert ("paper" in rows[method]) == (method in PAPER)
    assert rows["TA + FeatCal"]["paper"] == pytest.approx(0.852)
    assert ours["ta_featcal"]["stsb"]["metric"] == "spearman" and "metric" not in ours["ta_featcal"]["cola"]
    # The experts answer label words (the labels are random, so not always the right one); the base never does.
    assert rows["experts (individual)"]["accuracy"]["cola"] > 0 == rows["FLAN-T5-base"]["accuracy"]["cola"]
    md = (bench / "report" / "flan-t5-base-glue8.md").read_text()
    assert "| method | cola | stsb | average | paper | normalized |" in md
    featcal_line = next(line for line in md.splitlines() if line.startswith("| TA + FeatCal |"))
    assert f"| {100 * rows['TA + FeatCal']['average']:.1f} |" in featcal_line and "| 85.2 |" in featcal_line
    assert "leaves out mnli, mrpc, qnli, qqp, rte, sst2" in md and "TA + Surgery 83.7" in md
    assert ran["report"]["outputs"]
    manifest = json.loads((bench / "runs" / "ta_featcal" / "manifest.json").read_text())
    assert manifest["decoder_targets"] == dict.fromkeys(TASKS, "column target")


def test_bench_run_dispatches_on_the_spec_file(built, ran, monkeypatch, capsys):
    """`featcal bench run DIR` on a FLAN-T5 build runs the FLAN-T5 flow (here a stand-in: Prefect is not under test)
    and prints its report."""
    bench, _, _ = built
    calls = []
    monkeypatch.setattr("featcal_bench.stages.run_flow", lambda *args: calls.append(args) or ran)
    assert main(["bench", "run", str(bench), "--runs", *RUNS]) == 0
    assert calls == [(str(bench), RUNS, None, None, 1)]  # one draw of the calibration rows unless --draws
    assert capsys.readouterr().out.strip() == (bench / "report" / "flan-t5-base-glue8.md").read_text().strip()


def test_missing_mirror_path_is_named_with_its_flag(built, tmp_path, capsys):
    _, spec, _ = built
    models, data = spec.models_from, spec.data_from
    out = str(tmp_path / "b")
    assert (
        main(["bench", "build", "flan-t5-base-glue8", "--out", out, "--models-from", models, "--data-from", data]) == 2
    )
    err = capsys.readouterr().err.strip()
    expected = f"--models-from {models}: {models}/tanganke/flan-t5-base_glue-mnli does not exist"
    assert len(err.splitlines()) == 1 and expected in err and "(11 more path(s) missing)" in err, err
    assert main(["bench", "build", "flan-t5-base-glue8", "--out", out, "--models-from", models, "--data-from",
                 str(tmp_path), "--tasks", *TASKS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data-from {tmp_path}: {tmp_path}/nyu-mll/glue/cola does not exist" in err
    assert not (tmp_path / "b").exists()
