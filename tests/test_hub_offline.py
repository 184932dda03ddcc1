"""The hub path, offline: a temporary HF_HOME cache holds tiny models and a few rows under the real repository ids,
file names, configurations, splits and columns (tests/hub_fixture.py; docs/hub-layouts.md), and `featcal run` with
hub-id inputs, `bench build` and `bench run` of the three hub recipes read them with HF_HUB_OFFLINE=1, no
--models-from / --data-from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

from featcal.config import DataSource, config_from_dict, load_config
from featcal.data import DataError, load_split
from featcal.devices import one_thread
from featcal.hub import HubError, resolve
from featcal_bench.clip.prompts import CLASS_NAMES
from featcal_bench.clip.spec import BASE_MODEL as CLIP_BASE
from featcal_bench.clip.spec import CLIP_PRESETS, CLIP_TASKS
from featcal_bench.llm.spec import BASE_MODEL as LLM_BASE
from featcal_bench.llm.spec import DOMAINS, LLM_PRESETS
from featcal_bench.method import run_method
from featcal_bench.mirror import preset_spec
from featcal_bench.stages import build_stages, direct_call, recipe_of_spec, run_stages
from featcal_bench.t5.prompts import LABEL_WORDS
from featcal_bench.t5.spec import BASE_MODEL as T5_BASE
from featcal_bench.t5.spec import GLUE, GLUE_TASKS, T5_PRESETS
from flows.plan import plan, render
from storage.rundir import Record, RunDir
from tasks.preflight import preflight
from tasks.record import recorded
from tests.clip_fixture import perturbed_tower, save_tiny_clip, solid_images
from tests.conftest import ROOT
from tests.hub_fixture import add_dataset, add_model, commit_of
from tests.llm_fixture import llm_mirror
from tests.t5_fixture import fine_tuned_t5, glue_words, t5_config, t5_tokenizer
from tests.test_architectures import VISION
from tests.tiny_example_inputs import set_key

LLM_DOMAINS = ["instruction", "math"]
CLIP_RUN = ["eurosat", "svhn"]  # a default configuration, and SVHN's cropped_digits
GLUE_RUN = ["cola", "mnli"]  # scored on validation, and on validation_matched
LLM_ROWS, CALIBRATION = 10, 6
FAKE_TOKEN = "hf_FakeTokenThatMustNeverBeWritten0123"


def _sharded(model_dir: Path, out: Path) -> Path:
    """The checkpoint re-saved in shards with an index, as the hub's Llama repositories hold theirs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.save_pretrained(out, max_shard_size="40KB")
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _llm(cache: Path, root: Path) -> None:
    models, data = llm_mirror(root, LLM_DOMAINS, LLM_ROWS)
    for repo in [LLM_BASE, *(DOMAINS[d].expert(d) for d in LLM_DOMAINS)]:
        add_model(cache, repo, _sharded(models / repo, root / "sharded" / repo))
    for d in DOMAINS:  # MergeBench/{domain}_val: one `train` split (its push_to_hub layout)
        rows = datasets.load_from_disk(str(data / DOMAINS[d].dataset(d)))
        add_dataset(cache, DOMAINS[d].dataset(d), {"default": rows}, lambda c, s: f"data/{s}-00000-of-00001.parquet")


CLIP_SPLITS = {"train": 12, "test": 8, "extra": 5}  # svhn's `extra` too; eurosat has train and test
# openai/clip-vit-base-patch32's preprocessor_config.json is the old feature-extractor form (sizes as ints), with CLIP's
# own constants; here at the tiny tower's size.
CLIP_PREPROCESSOR = {"crop_size": VISION["image_size"], "do_center_crop": True, "do_normalize": True,
                     "do_resize": True, "feature_extractor_type": "CLIPFeatureExtractor",
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": VISION["image_size"]}


def _clip(cache: Path, root: Path) -> None:
    clip_dir = save_tiny_clip(root / "clip")
    (clip_dir / "preprocessor_config.json").write_text(json.dumps(CLIP_PREPROCESSOR, indent=2))
    add_model(cache, CLIP_BASE, clip_dir, weights="bin")  # openai/clip-vit-base-patch32: pytorch_model.bin only
    layouts = {"eurosat": ("default", lambda c, s: f"data/{s}-00000-of-00001.parquet"),
               "svhn": ("cropped_digits", lambda c, s: f"{c}/{s}-00000-of-00001.parquet")}
    for i, task in enumerate(CLIP_RUN):
        tower = root / "towers" / task
        perturbed_tower(clip_dir, seed=10 + i).save_pretrained(tower)
        add_model(cache, CLIP_TASKS[task].expert, tower)  # config.json and model.safetensors, no processor
        rng = np.random.default_rng(i)
        features = Features(image=Image(), label=ClassLabel(names=CLASS_NAMES[task]))
        sizes = {s: n for s, n in CLIP_SPLITS.items() if task == "svhn" or s != "extra"}
        # Every class in turn, so that a model's most frequent answer scores on some rows.
        splits = DatasetDict({s: Dataset.from_dict({"image": solid_images(rng, n), "label": [k % 10 for k in range(n)]},
                                                   features=features) for s, n in sizes.items()})
        config, layout = layouts[task]
        add_dataset(cache, CLIP_TASKS[task].dataset, {config: splits}, layout)


GLUE_WORDS = ("w3", "w4", "w5", "w6", "w7")  # the sentences' words
# Each split its own size: the row count a task was scored on names the split it came from.
GLUE_SPLITS = {"cola": {"train": 12, "validation": 8, "test": 6},
               "mnli": {"train": 12, "validation_matched": 7, "validation_mismatched": 9, "test_matched": 5,
                        "test_mismatched": 4}}


def _glue_rows(task: str, rng: np.random.Generator, n: int) -> Dataset:
    text = lambda: [" ".join(rng.choice(GLUE_WORDS, 4)) for _ in range(n)]  # noqa: E731
    names = {"cola": ["unacceptable", "acceptable"], "mnli": ["entailment", "neutral", "contradiction"]}[task]
    columns = {"cola": {"sentence": text()}, "mnli": {"premise": text(), "hypothesis": text()}}[task]
    features = Features({**{c: Value("string") for c in columns}, "label": ClassLabel(names=names),
                         "idx": Value("int32")})
    return Dataset.from_dict({**columns, "label": rng.integers(0, len(names), n).tolist(), "idx": list(range(n))},
                             features=features)


def _t5(cache: Path, root: Path) -> None:
    """The base with a tokenizer that knows the prompts' words and answers, and experts trained a few steps to
    answer label words, so the scores come from real answers."""
    rng = np.random.default_rng(0)
    glue = {t: DatasetDict({s: _glue_rows(t, rng, n) for s, n in GLUE_SPLITS[t].items()}) for t in GLUE_RUN}
    words = glue_words(GLUE_RUN, GLUE_WORDS)
    tokenizer = t5_tokenizer(words, split_punctuation=True)
    torch.manual_seed(0)
    base = T5ForConditionalGeneration(t5_config(vocab_size=3 + len(words))).eval()
    base.save_pretrained(root / "t5")
    tokenizer.save_pretrained(root / "t5")
    add_model(cache, T5_BASE, root / "t5", weights="both")  # google/flan-t5-base: the .bin beside the safetensors
    for i, task in enumerate(GLUE_RUN):  # tanganke's experts: config.json, generation_config.json, model.safetensors
        expert = root / "t5-experts" / task
        fine_tuned_t5(base, tokenizer, glue[task]["train"], task, seed=i).save_pretrained(expert)
        add_model(cache, GLUE_TASKS[task].expert(task), expert)
    add_dataset(cache, GLUE, glue, lambda c, s: f"{c}/{s}-00000-of-00001.parquet")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME with the three recipes' repositories; huggingface_hub's cache path pointed at it for this module."""
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    root = tmp_path_factory.mktemp("sources")
    with one_thread():
        _llm(cache, root)
        _clip(cache, root)
        _t5(cache, root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
        mp.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        yield home


def _run_config(tmp: Path, **change) -> Path:
    raw = {
        "base": LLM_BASE,
        "experts": {d: DOMAINS[d].expert(d) for d in LLM_DOMAINS},
        "merge": {"method": "task_arithmetic", "scaling": 0.5},
        "calibration": {"data": {d: {"path": DOMAINS[d].dataset(d), "column": DOMAINS[d].prompt} for d in LLM_DOMAINS},
                        "examples_per_task": 4, "batch_size": 2, "max_length": 32},
        "evaluation": {"enabled": True, "batch_size": 4,
                       "data": {d: {"path": DOMAINS[d].dataset(d), "column": DOMAINS[d].response}
                                for d in LLM_DOMAINS}},
    }
    for dotted, value in change.items():
        set_key(raw, dotted, value, sep="__")
    path = tmp / "hub.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _featcal(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_TOKEN": FAKE_TOKEN, "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_hub_dataset_resolves_to_its_cached_configuration_pinned_to_its_commit(hub):
    got = resolve(GLUE, "evaluation.data.mnli.path", "dataset", "mnli")
    snapshot = hub / "hub" / "datasets--nyu-mll--glue" / "snapshots" / commit_of(GLUE)
    assert (got.path, got.revision, got.pinned, got.downloaded) == (str(snapshot), commit_of(GLUE),
                                                                    f"{GLUE}@{commit_of(GLUE)}", 0)
    mnli = [p for p in snapshot.rglob("*") if p.is_file() and p.relative_to(snapshot).parts[0] in ("mnli", "README.md")]
    assert got.size == sum(p.stat().st_size for p in mnli)  # the configuration asked for, not cola's files
    ds = load_split(DataSource(path=got.pinned, config="mnli", split="validation_matched"), "evaluation.data.mnli")
    assert ds.column_names == ["premise", "hypothesis", "label", "idx"] and len(ds) == 7
    assert ds.features["label"].names == ["entailment", "neutral", "contradiction"]
    with pytest.raises(DataError, match=r"Unknown split \"validation\""):  # MNLI has no plain `validation`
        load_split(DataSource(path=GLUE, config="mnli", split="validation"), "evaluation.data.mnli")
    with pytest.raises(HubError) as wrong:
        resolve(GLUE, "calibration.data.mnli.path", "dataset", "mnli_typo")
    assert str(wrong.value) == ("calibration.data.mnli.path: hub dataset nyu-mll/glue: config 'mnli_typo' is not a "
                                "configuration of the dataset (its card lists ['cola', 'mnli'])")


def test_featcal_plan_and_run_read_hub_ids_and_record_them_pinned_without_the_token(hub, tmp_path):
    config = _run_config(tmp_path)
    planned = plan(load_config(config))  # in this process: `featcal run` below plans in its own
    math_expert = DOMAINS["math"].expert("math")
    assert planned["hub_inputs"]["experts.math"] == f"{math_expert}@{commit_of(math_expert)}"
    assert len(planned["hub_inputs"]) == 7  # base, 2 experts, 2 calibration and 2 evaluation sources
    assert planned["hub_download_gib"] == 0 and "hub inputs        7: " in render(planned)
    run_dir = tmp_path / "run"
    ran = _featcal(hub, "run", str(config), "--run-dir", str(run_dir), "--no-prefect")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    recorded_cfg = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert recorded_cfg["base"] == f"{LLM_BASE}@{commit_of(LLM_BASE)}"
    math_val = "MergeBench/math_val"
    assert recorded_cfg["calibration"]["data"]["math"]["path"] == f"{math_val}@{commit_of(math_val)}"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["inputs"]["base"] == f"name:{LLM_BASE}@{commit_of(LLM_BASE)}"
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["tasks"]) == set(LLM_DOMAINS)
    assert (run_dir / "calibrated" / "model.safetensors.index.json").is_file() or \
        (run_dir / "calibrated" / "model.safetensors").is_file()
    card = (run_dir / "calibrated" / "README.md").read_text()
    assert f"base_model: {LLM_BASE}\n" in card
    written = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".md", ".log", ".txt")]
    assert written and not [p for p in written if FAKE_TOKEN in p.read_text(errors="replace")]
    # The same command again (a resume after a crash): the config's hub ids pin to the commits run.yaml holds, so
    # the run directory is its own and every stage is a cache hit.
    weights = sorted(p.read_bytes() for p in (run_dir / "calibrated").glob("*.safetensors"))
    again = _featcal(hub, "run", str(config), "--run-dir", str(run_dir), "--no-prefect")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sorted(p.read_bytes() for p in (run_dir / "calibrated").glob("*.safetensors")) == weights


def test_a_given_merge_on_the_hub_is_pinned_and_checked_like_the_base(hub, tmp_path):
    """merge.path as a hub id (a MergeKit merge pushed to the hub): preflight pins it to its commit and checks its
    tensors against the base's in the cached snapshot, as it does for the base."""
    from featcal.hub import local_dir

    add_model(hub / "hub", "someone/merged", Path(local_dir(LLM_BASE)))
    cfg = load_config(_run_config(tmp_path, merge={"method": "given", "path": "someone/merged"}))
    planned = plan(cfg)
    assert planned["hub_inputs"]["merge.path"] == f"someone/merged@{commit_of('someone/merged')}"
    assert cfg.merge.path == f"someone/merged@{commit_of('someone/merged')}"


def test_a_missing_repository_a_bin_only_model_and_a_wrong_column_each_fail_in_one_line(hub, tmp_path):
    missing = config_from_dict(yaml.safe_load(_run_config(
        tmp_path, experts__math="MergeBench/Llama-3.2-3B_nope").read_text()), tmp_path)
    with pytest.raises(HubError) as err:
        preflight(missing)
    assert str(err.value) == (
        f"experts.math: hub model MergeBench/Llama-3.2-3B_nope is not in the cache {hub / 'hub'} (expected "
        "models--MergeBench--Llama-3.2-3B_nope/ with refs/main and its snapshot) and HF_HUB_OFFLINE=1; download it "
        "with network, or give a local directory")
    with pytest.raises(HubError) as err:
        resolve(CLIP_BASE, "base")
    assert str(err.value) == (f"base: hub model {CLIP_BASE} holds its weights only as pytorch_model.bin; featcal reads "
                              "safetensors: convert it once (AutoModel.from_pretrained(ID).save_pretrained(DIR)) and "
                              "give DIR")
    wrong = config_from_dict(yaml.safe_load(_run_config(
        tmp_path, calibration__data__math__column="question").read_text()), tmp_path)
    with pytest.raises(DataError) as err:
        preflight(wrong)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("calibration.data.math.column: 'question' is not a column of the data (it has "
                                     "['query', 'response'])")
    assert str(err.value).endswith(f"(hub dataset MergeBench/math_val@{commit_of('MergeBench/math_val')})")


def _in_process(bench, kind: str, name: str, key: str, **params) -> Record:
    """Build stages and method runs in this process (a method run's own process would mostly import)."""
    if kind != "method":
        return direct_call(bench, kind, name, key, **params)
    run = params["run"]
    return recorded(RunDir(bench), name, key, lambda: ([f"results/{run}.json"], run_method(bench, run)["cost"]))


def test_mergebench_builds_and_runs_from_the_hub_cache(hub, tmp_path):
    spec = preset_spec(LLM_PRESETS["mergebench-llama-3.2-3b"], tasks=LLM_DOMAINS).model_copy(
        update={"calibration": CALIBRATION})
    bench = tmp_path / "bench"
    with one_thread():
        records = build_stages(bench, spec, direct_call)
        ran = run_stages(bench, ["ta_featcal"], None, _in_process)
    for d in LLM_DOMAINS:
        info = records[f"data/{d}"]["info"]
        assert info["source"] == f"{DOMAINS[d].dataset(d)}@{commit_of(DOMAINS[d].dataset(d))}"
        assert (info["source_rows"], info["calibration"], info["test"]) == (LLM_ROWS, CALIBRATION,
                                                                           LLM_ROWS - CALIBRATION)
    snapshot = f"models--meta-llama--Llama-3.2-3B/snapshots/{commit_of(LLM_BASE)}"
    assert records["base"]["info"]["source"].endswith(snapshot)
    assert ran["report"]["outputs"] and (bench / "report" / "mergebench-llama-3.2-3b.md").is_file()


def _built(hub, tmp_path_factory, preset, tasks: list[str]) -> tuple[Path, dict[str, Record]]:
    """A hub recipe built from the cache as `featcal bench build NAME` does (no --models-from / --data-from): the
    build graph, then its cost estimate."""
    spec = preset_spec(preset, tasks=tasks)
    bench = tmp_path_factory.mktemp(spec.name)
    with one_thread():
        records = build_stages(bench, spec, direct_call)
        recipe_of_spec(spec).estimate(bench, spec)
    return bench, records


@pytest.fixture(scope="module")
def clip_bench(hub, tmp_path_factory):
    return _built(hub, tmp_path_factory, CLIP_PRESETS["clip-vit-b32-ta8"], CLIP_RUN)


@pytest.fixture(scope="module")
def t5_bench(hub, tmp_path_factory):
    return _built(hub, tmp_path_factory, T5_PRESETS["flan-t5-base-glue8"], GLUE_RUN)


def test_clip_and_flan_t5_build_from_the_hub_cache(clip_bench, t5_bench):
    bench, built = clip_bench
    svhn = datasets.load_from_disk(str(bench / "data" / "svhn"))
    assert {s: len(svhn[s]) for s in svhn} == {"calibration": 12, "test": 8}  # test, not extra
    svhn_id = "ufldl-stanford/svhn"
    assert built["data/svhn"]["info"]["source"] == f"{svhn_id}@{commit_of(svhn_id)} (cropped_digits)"
    # openai/clip-vit-base-patch32 holds pytorch_model.bin only: the build converts it to safetensors.
    assert (bench / "clip" / "model.safetensors").is_file()
    processor = json.loads((bench / "base" / "preprocessor_config.json").read_text())
    side = VISION["image_size"]
    assert (processor["size"], processor["crop_size"]) == ({"shortest_edge": side}, {"height": side, "width": side})
    bench, built = t5_bench
    mnli = datasets.load_from_disk(str(bench / "data" / "mnli"))
    assert len(mnli["test"]) == GLUE_SPLITS["mnli"]["validation_matched"]
    assert set(mnli["test"]["target"]) <= set(LABEL_WORDS["mnli"])
    assert built["data/mnli"]["info"]["test_split"] == "validation_matched"


def _hub_split(repo: str, config: str | None, split: str) -> Dataset:
    return load_split(DataSource(path=repo, config=config, split=split), f"{repo} {split}")


def _ran(bench: Path, hub_test: dict[str, Dataset]) -> dict:
    """`featcal bench run BENCH --runs ta_featcal` (its method run in this process, no Prefect), checked against the
    hub rows each task was scored on: the labels are theirs in order, every accuracy is the share of answers that
    match them, and each report row holds those accuracies, in [0, 1] (percentages in [0, 100] in the Markdown)."""
    with one_thread():
        ran = run_stages(bench, ["ta_featcal"], None, _in_process)
    result = json.loads((bench / "results" / "ta_featcal.json").read_text())
    for task, rows in hub_test.items():
        labels = result["labels"][task]
        assert labels == list(rows["label"]), task
        for model, answers in result["predictions"][task].items():
            assert len(answers) == len(rows)
            hits = sum(a == y for a, y in zip(answers, labels))
            assert result["accuracy"][task][model] == pytest.approx(hits / len(rows)), (task, model)
    name = next(Path(o).stem for o in ran["report"]["outputs"] if o.endswith(".json"))
    report = json.loads((bench / "report" / f"{name}.json").read_text())
    for row in report["methods"]:
        assert row["accuracy"] == {t: result["accuracy"][t][row["model"]] for t in hub_test}, row["method"]
        assert all(0 <= a <= 1 for a in row["accuracy"].values())
    md = (bench / "report" / f"{name}.md").read_text()
    for row in report["methods"]:
        line = next(x for x in md.splitlines() if x.startswith(f"| {row['method']} |")).split(" | ")
        assert line[1:1 + len(hub_test)] == [f"{100 * row['accuracy'][t]:.1f}" for t in hub_test], row["method"]
    assert "models from the Hugging Face hub, data from the Hugging Face hub" in md
    return {"report": report, "result": result, "md": md}


def test_clip_runs_from_the_hub_cache_and_reports_its_rows(hub, clip_bench):
    bench, _ = clip_bench
    test = {"eurosat": _hub_split(CLIP_TASKS["eurosat"].dataset, None, "test"),
            "svhn": _hub_split("ufldl-stanford/svhn", "cropped_digits", "test")}
    got = _ran(bench, test)
    assert [r["method"] for r in got["report"]["methods"]] == ["experts (individual)", "zero-shot", "task arithmetic",
                                                               "TA + FeatCal"]
    assert all(set(p) <= set(range(10)) for t in CLIP_RUN for p in got["result"]["predictions"][t].values())
    # the expert's most frequent class is among the labels
    assert got["report"]["methods"][0]["accuracy"]["eurosat"] > 0
    assert "- `svhn`: SVHN house-number digits (10); data `ufldl-stanford/svhn`" in got["md"]
    assert "test 8 rows, calibration pool 12" in got["md"]


def test_flan_t5_runs_from_the_hub_cache_and_scores_mnli_on_validation_matched(hub, t5_bench):
    bench, built = t5_bench
    matched = _hub_split(GLUE, "mnli", "validation_matched")
    got = _ran(bench, {"cola": _hub_split(GLUE, "cola", "validation"), "mnli": matched})
    assert [r["method"] for r in got["report"]["methods"]] == ["experts (individual)", "FLAN-T5-base",
                                                               "task arithmetic", "TA + FeatCal"]
    run = json.loads((bench / "runs" / "ta_featcal" / "report.json").read_text())
    assert run["tasks"]["mnli"]["examples"] == len(matched) == 7  # validation_mismatched has 9, test_matched 5
    assert built["data/mnli"]["info"]["test_split"] == "validation_matched"
    assert "validation_matched 7 rows, calibration pool 12; answers entailment / neutral / contradiction" in got["md"]
    # The experts answer label words (the fixture's labels are random, so not always the right one); the untrained
    # base never does.
    answers, accuracy = got["result"]["predictions"], got["result"]["accuracy"]
    assert all(0 <= a < len(LABEL_WORDS[t]) for t in GLUE_RUN for a in answers[t]["expert"])
    assert all(accuracy[t]["expert"] > 0 == accuracy[t]["base"] for t in GLUE_RUN)
