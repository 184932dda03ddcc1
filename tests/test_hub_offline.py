"""The hub path, offline: a temporary HF_HOME cache holds tiny models and a few rows under the real repository ids,
file names, configurations, splits and columns (tests/hub_fixture.py; docs/hub-layouts.md), and `featcal run` with
hub-id inputs, `bench build` of the three hub recipes and `bench run` of MergeBench read them with HF_HUB_OFFLINE=1,
no --models-from / --data-from."""

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
from featcal_bench.clip.spec import BASE_MODEL as CLIP_BASE, CLIP_PRESETS, CLIP_TASKS
from featcal_bench.llm.spec import BASE_MODEL as LLM_BASE, DOMAINS, LLM_PRESETS
from featcal_bench.method import run_method
from featcal_bench.mirror import preset_spec
from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.t5.prompts import LABEL_WORDS
from flows.plan import plan, render
from featcal_bench.t5.spec import BASE_MODEL as T5_BASE, GLUE, GLUE_TASKS, T5_PRESETS
from storage.rundir import Record, RunDir
from tasks.preflight import preflight
from tasks.record import recorded
from tests.clip_fixture import perturbed_tower, save_tiny_clip, solid_images
from tests.conftest import ROOT
from tests.hub_fixture import add_dataset, add_model, commit_of
from tests.llm_fixture import llm_mirror
from tests.t5_fixture import t5_config, t5_tokenizer
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


def _clip(cache: Path, root: Path) -> None:
    clip_dir = save_tiny_clip(root / "clip")
    add_model(cache, CLIP_BASE, clip_dir, bin_only=True)  # openai/clip-vit-base-patch32: pytorch_model.bin only
    layouts = {"eurosat": ("default", lambda c, s: f"data/{s}-00000-of-00001.parquet"),
               "svhn": ("cropped_digits", lambda c, s: f"{c}/{s}-00000-of-00001.parquet")}
    for i, task in enumerate(CLIP_RUN):
        tower = root / "towers" / task
        perturbed_tower(clip_dir, seed=10 + i).save_pretrained(tower)
        add_model(cache, CLIP_TASKS[task].expert, tower)  # config.json and model.safetensors, no processor
        rng = np.random.default_rng(i)
        features = Features(image=Image(), label=ClassLabel(names=CLASS_NAMES[task]))
        splits = DatasetDict({s: Dataset.from_dict({"image": solid_images(rng, n), "label": rng.integers(0, 10, n).tolist()},
                                                   features=features) for s, n in (("train", 12), ("test", 8))})
        config, layout = layouts[task]
        add_dataset(cache, CLIP_TASKS[task].dataset, {config: splits}, layout)


def _glue_rows(task: str, rng: np.random.Generator, n: int) -> Dataset:
    words = ("w3", "w4", "w5", "w6", "w7")
    text = lambda: [" ".join(rng.choice(words, 4)) for _ in range(n)]  # noqa: E731
    names = {"cola": ["unacceptable", "acceptable"], "mnli": ["entailment", "neutral", "contradiction"]}[task]
    columns = {"cola": {"sentence": text()}, "mnli": {"premise": text(), "hypothesis": text()}}[task]
    features = Features({**{c: Value("string") for c in columns}, "label": ClassLabel(names=names), "idx": Value("int32")})
    return Dataset.from_dict({**columns, "label": rng.integers(0, len(names), n).tolist(), "idx": list(range(n))},
                             features=features)


def _t5(cache: Path, root: Path) -> None:
    torch.manual_seed(0)
    base = root / "t5"
    T5ForConditionalGeneration(t5_config()).save_pretrained(base)
    t5_tokenizer().save_pretrained(base)
    add_model(cache, T5_BASE, base)
    for task in GLUE_RUN:  # tanganke's experts: config.json, generation_config.json, model.safetensors
        expert = root / "t5-experts" / task
        T5ForConditionalGeneration.from_pretrained(base).save_pretrained(expert)
        add_model(cache, GLUE_TASKS[task].expert(task), expert)
    rng = np.random.default_rng(0)
    splits = {"cola": ("train", "validation", "test"),
              "mnli": ("train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched")}
    add_dataset(cache, GLUE, {t: DatasetDict({s: _glue_rows(t, rng, 10) for s in splits[t]}) for t in GLUE_RUN},
                lambda c, s: f"{c}/{s}-00000-of-00001.parquet")


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
                       "data": {d: {"path": DOMAINS[d].dataset(d), "column": DOMAINS[d].response} for d in LLM_DOMAINS}},
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
    assert ds.column_names == ["premise", "hypothesis", "label", "idx"] and len(ds) == 10
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
    assert recorded_cfg["calibration"]["data"]["math"]["path"] == f"MergeBench/math_val@{commit_of('MergeBench/math_val')}"
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
        assert (info["source_rows"], info["calibration"], info["test"]) == (LLM_ROWS, CALIBRATION, LLM_ROWS - CALIBRATION)
    assert records["base"]["info"]["source"].endswith(f"models--meta-llama--Llama-3.2-3B/snapshots/{commit_of(LLM_BASE)}")
    assert ran["report"]["outputs"] and (bench / "report" / "mergebench-llama-3.2-3b.md").is_file()


def test_clip_and_flan_t5_build_from_the_hub_cache(hub, tmp_path):
    clip = preset_spec(CLIP_PRESETS["clip-vit-b32-ta8"], tasks=CLIP_RUN)
    with one_thread():
        built = build_stages(tmp_path / "clip", clip, direct_call)
    svhn = datasets.load_from_disk(str(tmp_path / "clip" / "data" / "svhn"))
    assert {s: len(svhn[s]) for s in svhn} == {"calibration": 12, "test": 8}
    assert built["data/svhn"]["info"]["source"] == f"ufldl-stanford/svhn@{commit_of('ufldl-stanford/svhn')} (cropped_digits)"
    # openai/clip-vit-base-patch32 holds pytorch_model.bin only: the build converts it to safetensors.
    assert (tmp_path / "clip" / "clip" / "model.safetensors").is_file()
    t5 = preset_spec(T5_PRESETS["flan-t5-base-glue8"], tasks=GLUE_RUN)
    with one_thread():
        built = build_stages(tmp_path / "t5", t5, direct_call)
    mnli = datasets.load_from_disk(str(tmp_path / "t5" / "data" / "mnli"))
    assert len(mnli["test"]) == 10 and set(mnli["test"]["target"]) <= set(LABEL_WORDS["mnli"])
    assert built["data/mnli"]["info"]["test_split"] == "validation_matched"
