"""MergeBench on Llama-3.2-3B end to end on a tiny local mirror laid out as the hub names it (tests/llm_fixture.py):
bench build (Alpaca-style text from MergeBench-like rows, a calibration pool and disjoint held-out rows) → bench run
(TA, TIES, TA + FeatCal, RegMean, RegMean++: four method runs, here in this process) → the report of held-out token
losses with the paper's figures (no Prefect)."""

from __future__ import annotations

import json

import datasets
import pytest

from featcal.config import load_config
from featcal.devices import one_thread
from featcal_bench.cli import main
from featcal_bench.llm.build import held_out_splits, rendered
from featcal_bench.llm.recipe import RECIPE
from featcal_bench.llm.report import PAPER_COLUMN
from featcal_bench.llm.spec import BASE_MODEL, DOMAINS, HEADER, LLM_PRESETS, LlmBenchSpec
from featcal_bench.method import run_method
from featcal_bench.mirror import MirrorMissing, preset_spec
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.study import load_study
from storage.rundir import Record, RunDir
from tasks.record import recorded
from tests.llm_fixture import domain_rows, llm_mirror

DOMAINS_RUN = ["instruction", "math"]  # the one with an optional input field, and one without
ROWS, CALIBRATION = 10, 6
PRESET = "mergebench-llama-3.2-3b"


def in_process(bench, kind: str, name: str, key: str, **params) -> Record:
    """A stage in this process, the method runs too: `bench run` starts one process per method run (the CLIP and
    FLAN-T5 tests cover that path), and each would spend longer importing than running a tiny model."""
    if kind != "method":
        return direct_call(bench, kind, name, key, **params)
    run = params["run"]
    return recorded(RunDir(bench), name, key, lambda: ([f"results/{run}.json"], run_method(bench, run)["cost"]))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with one_thread():  # tiny models: a second thread only adds contention
        models, data = llm_mirror(tmp_path_factory.mktemp("mirror"), DOMAINS_RUN, ROWS)
    spec = preset_spec(LLM_PRESETS[PRESET], str(models), str(data), tasks=DOMAINS_RUN).model_copy(
        update={"calibration": CALIBRATION}
    )
    bench = tmp_path_factory.mktemp("bench")
    return bench, spec, build_stages(bench, spec, direct_call)


@pytest.fixture(scope="module")
def ran(built):
    bench, _, _ = built
    with one_thread():
        return run_stages(bench, None, None, in_process)


def test_every_domain_renders_its_mergebench_fields_as_alpaca_text():
    for domain, d in DOMAINS.items():
        source = domain_rows(domain, 4, seed=0)
        texts = rendered(source, domain)
        assert list(texts["row"]) == [0, 1, 2, 3]
        for row, text in zip(source, texts["text"], strict=True):
            has_input = bool(d.input and row[d.input])
            assert text.startswith(HEADER + "\n\n### Instruction:\n" + row[d.prompt] + "\n\n")
            assert text.endswith("### Response:\n" + row[d.response])
            assert ("### Input:\n" + row[d.input] + "\n\n" in text) if has_input else "### Input:" not in text
    assert DOMAINS["instruction"].harness_tasks == ("ifeval",) and DOMAINS["math"].harness_tasks == ("gsm8k_cot",)
    assert len(DOMAINS["multilingual"].harness_tasks) == 12 and "m_mmlu_fr" in DOMAINS["multilingual"].harness_tasks
    assert all(not DOMAINS[d].harness_tasks and DOMAINS[d].other_harness for d in ("coding", "safety"))


def test_held_out_rows_are_never_calibration_rows():
    rows = datasets.Dataset.from_dict({"row": list(range(20))})
    splits = held_out_splits(rows, 8, None, seed=3, source="s")
    assert len(splits["calibration"]) == 8 and len(splits["test"]) == 12
    assert sorted([*splits["calibration"]["row"], *splits["test"]["row"]]) == list(range(20))
    assert set(held_out_splits(rows, 8, 5, 3, "s")["test"]["row"]) < set(splits["test"]["row"])
    with pytest.raises(ValueError, match="s: 8 rows; the build keeps 8 for calibration"):
        held_out_splits(rows.select(range(8)), 8, None, 3, "s")


def test_build_writes_text_a_held_out_split_and_every_run_config(built):
    bench, spec, records = built
    assert LlmBenchSpec.is_built(bench) and LlmBenchSpec.load(bench) == spec
    for domain in DOMAINS_RUN:
        source = datasets.load_from_disk(f"{spec.data_from}/MergeBench/{domain}_val")["train"]
        ds = datasets.load_from_disk(str(bench / "data" / domain))
        assert {s: len(ds[s]) for s in ds} == {"calibration": CALIBRATION, "test": ROWS - CALIBRATION}
        assert set(ds["calibration"]["row"]).isdisjoint(ds["test"]["row"])
        assert list(ds["test"]["text"]) == [rendered(source, domain)["text"][i] for i in ds["test"]["row"]]
        assert records[f"expert/{domain}"]["info"]["source"].endswith(DOMAINS[domain].expert(domain))
    assert records["base"]["info"]["pad_token_set"] and records["base"]["info"]["pad_token"] == "</s>"
    configs = {name: load_config(bench / "configs" / f"{name}.yaml") for name in load_study(RECIPE.study).runs}
    ta, ties, regmean, regmean_pp = (configs[n] for n in ("ta_featcal", "ties_featcal", "regmean", "regmean_pp"))
    assert (ta.merge.method, ta.merge.scaling, ta.featcal.lam, ta.featcal.rho, ta.featcal.alpha) == (
        "task_arithmetic", 0.4, 0.05, 2.2, 0.25)
    assert (ties.merge.method, ties.merge.scaling, ties.merge.ties_top_k) == ("ties", 0.4, 0.3)
    assert (regmean.merge.method, regmean.featcal.method, regmean.featcal.regmean_off_diagonal) == (
        "average", "regmean", 0.5)
    assert (regmean_pp.featcal.method, regmean_pp.featcal.regmean_off_diagonal) == ("regmean_plus_plus", 0.1)
    evaluated = {d: (s.split, s.column) for d, s in ta.evaluation.data.items()}
    assert evaluated == dict.fromkeys(DOMAINS_RUN, ("test", "text"))
    assert (ta.calibration.max_length, ta.calibration.examples_per_task) == (512, CALIBRATION)
    starts = len(RunDir(bench).events())  # a second build finds every stage cached
    assert build_stages(bench, spec, direct_call) == records and len(RunDir(bench).events()) == starts


def test_run_reports_every_methods_losses_beside_the_papers_figures(built, ran):
    bench, _, _ = built
    report = json.loads((bench / "report" / f"{PRESET}.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == {"experts (individual)", "Llama-3.2-3B (base)", "task arithmetic", "TIES", "RegMean",
                         "RegMean++", "TA + FeatCal", "TIES + FeatCal"}
    ours = {
        run: json.loads((bench / "runs" / run / "report.json").read_text()) for run in load_study(RECIPE.study).runs
    }
    for row in rows.values():
        lm = {d: ours[row["run"]]["tasks"][d]["language_model"][row["model"]] for d in DOMAINS_RUN}
        assert row["loss"] == {d: lm[d]["loss"] for d in DOMAINS_RUN}, row["method"]
        assert row["average"] == pytest.approx(sum(lm[d]["next_token_accuracy"] for d in DOMAINS_RUN) / 2)
    for run, merged, calibrated in (("ta_featcal", "task arithmetic", "TA + FeatCal"),
                                    ("ties_featcal", "TIES", "TIES + FeatCal"), ("regmean", None, "RegMean")):
        average = ours[run]["summary"]["average_loss"]
        assert rows[calibrated]["average_loss"] == pytest.approx(average["calibrated"])
        if merged:
            assert rows[merged]["average_loss"] == pytest.approx(average["merged"])
    assert rows["TA + FeatCal"]["gap_closed_loss"] == pytest.approx(ours["ta_featcal"]["summary"]["gap_closed_loss"])
    # The experts were fine-tuned on their domain's text: each predicts it better than the base does.
    for d in DOMAINS_RUN:
        assert rows["experts (individual)"]["loss"][d] < rows["Llama-3.2-3B (base)"]["loss"][d]
    assert (rows["task arithmetic"]["paper"], rows["TA + FeatCal"]["paper"]) == pytest.approx((0.601, 0.621))
    assert not any("paper" in rows[m] for m in ("TIES", "RegMean", "RegMean++"))
    assert report["harness_tasks"] == {"instruction": {"lm_eval": ["ifeval"], "other": None},
                                       "math": {"lm_eval": ["gsm8k_cot"], "other": None}}
    md = (bench / "report" / f"{PRESET}.md").read_text()
    header = (
        "| method | instruction | math | average loss (perplexity) | gap closed (loss) | next-token accuracy (%) | "
        f"{PAPER_COLUMN} |"
    )
    assert header in md
    lines = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 60.1 |" in lines["task arithmetic"] and "| 62.1 |" in lines["TA + FeatCal"]
    assert f"{rows['TA + FeatCal']['average_loss']:.4f}" in lines["TA + FeatCal"]
    assert "theirs, and a different metric" in md and "leaves out coding, multilingual, safety" in md
    assert BASE_MODEL in md and "ifeval" in md and "bigcode" not in md
    starts = len(RunDir(bench).events())  # a rerun finds every method run and the report cached
    assert run_stages(bench, None, None, in_process) == ran and len(RunDir(bench).events()) == starts


def test_missing_mirror_path_is_named_with_its_flag(built, tmp_path, capsys):
    _, spec, _ = built
    out = str(tmp_path / "b")
    assert main(["bench", "build", PRESET, "--out", out, "--models-from", spec.models_from, "--data-from",
                 spec.data_from]) == 2
    err = capsys.readouterr().err.strip()
    expected = f"--models-from {spec.models_from}: {spec.models_from}/MergeBench/Llama-3.2-3B_coding does not exist"
    assert len(err.splitlines()) == 1 and expected in err, err
    assert main(["bench", "build", "tinyllama-domains", "--out", out, "--tasks", "math"]) == 2
    assert f"--tasks: only for clip-vit-b32-ta8, flan-t5-base-glue8, {PRESET}, not tinyllama-domains" in (
        capsys.readouterr().err)
    assert not (tmp_path / "b").exists()
    with pytest.raises(MirrorMissing, match=f"--data-from {tmp_path}: {tmp_path}/MergeBench/instruction_val does not"):
        preset_spec(LLM_PRESETS[PRESET], spec.models_from, str(tmp_path), tasks=DOMAINS_RUN)
    with pytest.raises(ValueError, match="--tasks: \\['vision'\\] are not tasks of mergebench-llama-3.2-3b"):
        preset_spec(LLM_PRESETS[PRESET], tasks=["vision"])
