"""Experts given as PEFT LoRA adapters (storage/lora.py): every tensor equals PEFT's own merge (`merge_and_unload`),
a whole run with LoRA experts gives the same calibrated weights as a run with those merges saved as full
checkpoints, and an adapter for another base, or with a module of another shape, is refused in one line."""

import json
import shutil

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel

from featcal.config import config_from_dict
from featcal.modeling import Skeleton, expert_checkpoint, task_model
from featcal.setup_checks import SetupError
from flows.harness import HarnessError, checkpoints
from flows.pipeline import run_pipeline
from flows.plan import plan
from storage.checkpoint import CanonicalCheckpoint, CheckpointError
from storage.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from storage.rundir import RunDir
from tasks.preflight import check_checkpoints
from tests.test_decoders import _model as decoder

EXAMPLES = 12
BERT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base(root, model) -> None:
    model.save_pretrained(root / "base")


def _adapter(root, name: str, model, seed: int, **lora) -> torch.nn.Module:
    """`model` (loaded from root/base, so PEFT records that base) wrapped in a LoRA adapter whose B factors are
    random as well (a freshly made one has B = 0, which would make every check trivial), the adapter saved to
    root/`name`, and the same expert merged by PEFT saved in full to root/`name`-full."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # factors of a trained size: ΔW comparable to the base's own spread
        for key, p in peft_model.named_parameters():
            if "lora_" in key:
                p.mul_(0.3)
    peft_model.save_pretrained(root / name)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / f"{name}-full")
    return merged


def _llama(root, experts: int = 2, arch: str = "llama", **lora) -> None:
    """A tiny decoder of the Llama layout (tests/test_decoders.py's: Llama, Qwen2 with q/k/v biases, Mistral, Qwen3)
    and `experts` LoRA experts on every linear map of its blocks."""
    torch.manual_seed(0)
    model = decoder(arch)
    _base(root, model)
    for t in range(experts):
        _adapter(root, f"e{t}", type(model).from_pretrained(root / "base"), seed=10 + t,
                 **{"r": 4, "lora_alpha": 8, "target_modules": LLAMA_TARGETS, **lora})


def _rows(seed: int, labels: int | None = None) -> Dataset:
    rng = np.random.default_rng(seed)
    ids = [[1] + rng.integers(3, 64, int(n)).tolist() for n in rng.integers(4, 12, EXAMPLES)]
    columns = {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}
    if labels:
        columns["label"] = rng.integers(0, labels, EXAMPLES).tolist()
    return Dataset.from_dict(columns)


def _run_config(root, suffix: str, experts: int, evaluate: bool, **featcal):
    for t in range(experts):
        if not (root / f"d{t}").exists():
            _rows(t, labels=3 if evaluate else None).save_to_disk(str(root / f"d{t}"))
    data = {f"task{t}": {"path": str(root / f"d{t}")} for t in range(experts)}
    raw = {
        "base": str(root / "base"),
        "experts": {f"task{t}": str(root / f"e{t}{suffix}") for t in range(experts)},
        "merge": {"method": "task_arithmetic", "scaling": 0.5},
        "calibration": {"data": data, "examples_per_task": EXAMPLES, "batch_size": 4},
        "featcal": {"lambda": 0.05, "rho": 1.5, "alpha": 0.5, **featcal},
        "evaluation": ({"data": {t: {**d, "label_column": "label"} for t, d in data.items()}} if evaluate
                       else {"enabled": False}),
    }
    return config_from_dict(raw, root)


def _tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _expert(root, name: str):
    skeleton = Skeleton.from_checkpoint(root / f"{name}-full")
    return expert_checkpoint(root / name, root / "base", skeleton), CanonicalCheckpoint(root / f"{name}-full",
                                                                                       skeleton.adapter)


def _assert_same_tensors(lora, full) -> None:
    assert lora.names() == full.names()
    for name in full.names():
        assert lora.shape(name) == full.shape(name) and lora.dtype(name) == full.dtype(name), name
        assert torch.equal(lora.get(name), full.get(name)), (name, float((lora.get(name) - full.get(name)).abs().max()))


@pytest.mark.parametrize("arch, lora", [
    ("llama", {}),
    ("llama", {"use_rslora": True, "r": 8, "lora_alpha": 4}),
    # Per-module rank and alpha; the embedding adapted too (ΔW transposed; PEFT saves the embedding beside it).
    ("llama", {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"v_proj": 32},
               "target_modules": [*LLAMA_TARGETS, "embed_tokens"]}),
    # Qwen2's q/k/v have biases: lora_B.bias·scale is added to them.
    ("qwen2", {"lora_bias": True, "target_modules": ["q_proj", "k_proj", "v_proj"]}),
    ("mistral", {}),
    ("qwen3", {}),
], ids=["llama", "llama-rslora", "llama-patterns-embedding", "qwen2-lora-bias", "mistral", "qwen3"])
def test_decoder_adapter_equals_peft_merge(tmp_path, arch, lora):
    """Every tensor of a decoder expert read as base + adapter equals PEFT's merge_and_unload() bit for bit, also a
    block of rows (how the merge stage reads an LLM's largest tensors)."""
    _llama(tmp_path, experts=1, arch=arch, **lora)
    adapter, full = _expert(tmp_path, "e0")
    _assert_same_tensors(adapter, full)
    name = "model.layers.1.self_attn.v_proj.weight"
    assert name in adapter.adapted() and not torch.equal(adapter.get(name), adapter.base.get(name))
    if lora.get("lora_bias"):
        assert "model.layers.1.self_attn.v_proj.bias" in adapter.adapted()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(adapter.get(name, (3, 7)), full.get(name)[3:7])
    if "embed_tokens" in lora.get("target_modules", ()):
        # Rows of a transposed ΔW are columns of B·A: a narrower product, which BLAS may sum in another order.
        name = "model.embed_tokens.weight"
        assert _relative(adapter.get(name, (3, 7)), full.get(name)[3:7]) <= 1e-6


def test_gpt2_conv1d_fan_in_fan_out(tmp_path):
    """GPT-2's Conv1D stores weights [in, out]: PEFT forms ΔW transposed (fan_in_fan_out), including the square
    attention output projection, where the shapes alone could not tell; a LoRA bias is added to the base bias."""
    torch.manual_seed(0)
    _base(tmp_path, GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)))
    _adapter(tmp_path, "e0", GPT2LMHeadModel.from_pretrained(tmp_path / "base"), seed=3, r=4, lora_alpha=16,
             fan_in_fan_out=True, lora_bias=True, target_modules=["c_attn", "c_proj", "c_fc"])
    adapter, full = _expert(tmp_path, "e0")
    _assert_same_tensors(adapter, full)
    assert adapter.shape("transformer.h.0.attn.c_proj.weight") == (32, 32)
    assert "transformer.h.0.attn.c_proj.bias" in adapter.adapted()
    name = "transformer.h.0.mlp.c_fc.weight"  # [in 32, out 128]: rows are input features, columns of B·A
    assert _relative(adapter.get(name, (5, 9)), full.get(name)[5:9]) <= 1e-6


def _bert(root, experts: int) -> None:
    """A bare BertModel base (as the tiny example's) and sequence-classification LoRA experts whose new classifier
    PEFT saves whole (modules_to_save); each keeps its fine-tuned config (3 labels) beside the adapter."""
    torch.manual_seed(0)
    _base(root, BertModel(BertConfig(**BERT)))
    for t in range(experts):
        model = BertForSequenceClassification.from_pretrained(root / "base", num_labels=3)
        _adapter(root, f"e{t}", model, seed=20 + t, task_type="SEQ_CLS", r=4, lora_alpha=8,
                 target_modules=["query", "key", "value", "dense"])
        model.config.save_pretrained(root / f"e{t}")


def test_bert_classifier_modules_to_save(tmp_path):
    """A classification expert over a bare encoder: body tensors base + ΔW, the classifier the adapter's own; its
    whole model (how evaluation loads an expert) equals PEFT's merged one."""
    _bert(tmp_path, experts=1)
    adapter, full = _expert(tmp_path, "e0")
    _assert_same_tensors(adapter, full)
    assert "classifier.weight" in adapter.adapted() and "classifier.weight" not in adapter.base
    ours = task_model(tmp_path / "e0", base_dir=tmp_path / "base").state_dict()
    theirs = task_model(tmp_path / "e0-full").state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_run_with_lora_experts_equals_run_with_merged_experts(tmp_path, arch):
    """A whole run (merge, statistics from the experts' blocks, solves, evaluation for BERT) with LoRA experts gives
    calibrated weights, merged weights and heads bit-identical to a run with PEFT's merges saved in full; no full
    expert is written in the LoRA run's directory."""
    build, evaluate = (_llama, False) if arch == "llama" else (_bert, True)
    build(tmp_path, experts=2)
    runs = {}
    for suffix in ("", "-full"):
        run_pipeline(_run_config(tmp_path, suffix, 2, evaluate), tmp_path / f"run{suffix}")
        runs[suffix] = tmp_path / f"run{suffix}"
    for part in ("calibrated", "merged"):
        ours, theirs = _tensors(runs[""] / part), _tensors(runs["-full"] / part)
        assert ours.keys() == theirs.keys()
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), (part, name)
    merged, calibrated = _tensors(runs[""] / "merged"), _tensors(runs[""] / "calibrated")
    assert sum(not torch.equal(calibrated[n], merged[n]) for n in merged) >= 10  # the solves changed the blocks
    if evaluate:
        for t in ("task0", "task1"):
            ours, theirs = (load_file(runs[s] / "merged" / "heads" / f"{t}.safetensors") for s in ("", "-full"))
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        ours, theirs = (json.loads((runs[s] / "report.json").read_text()) for s in ("", "-full"))
        # Accuracy and drift of every model, the expert included (loaded whole from base + adapter).
        assert ours["tasks"] == theirs["tasks"] and ours["summary"] == theirs["summary"]
        assert ours["models"] == ["base", "merged", "calibrated", "expert"]
    # The LoRA run writes exactly the files the full run writes: no expert is written out in full.
    written = {s: sorted(p.relative_to(runs[s]) for p in runs[s].rglob("*.safetensors")) for s in runs}
    assert written[""] == written["-full"]


def test_mismatched_base_and_shapes_refused_in_one_line(tmp_path):
    """Preflight refuses, before any work, an adapter trained on another base and one whose module does not fit the
    base's tensor, in one line naming the expert, the adapter and the module."""
    _llama(tmp_path, experts=1)
    cfg = _run_config(tmp_path, "", 1, evaluate=False)
    assert check_checkpoints(cfg).architecture == "LlamaForCausalLM"
    assert plan(cfg)["tasks"]["task0"]["expert"] == str(tmp_path / "e0")  # `featcal plan` reads it as well

    other = tmp_path / "e0-other-base"
    shutil.copytree(tmp_path / "e0", other)
    config = json.loads((other / ADAPTER_CONFIG).read_text())
    (other / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    with pytest.raises(CheckpointError) as bad_base:
        check_checkpoints(_run_config(tmp_path, "-other-base", 1, evaluate=False).model_copy(
            update={"experts": {"task0": str(other)}}))
    message = str(bad_base.value)
    assert "\n" not in message and message.startswith("experts.task0: LoRA adapter") and str(other) in message
    assert "'meta-llama/Llama-3.2-1B'" in message and str(tmp_path / "base") in message

    wide = tmp_path / "e0-wide"
    shutil.copytree(tmp_path / "e0", wide)
    tensors = load_file(wide / ADAPTER_WEIGHTS)
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    tensors[key] = torch.zeros(48, tensors[key].shape[1])  # k_proj's out is 16 (2 key/value heads of 8)
    save_file(tensors, wide / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError) as bad_shape:
        check_checkpoints(cfg.model_copy(update={"experts": {"task0": str(wide)}}))
    message = str(bad_shape.value)
    assert "\n" not in message and str(wide) in message and "model.layers.1.self_attn.k_proj" in message
    assert "(48, 32)" in message and "(16, 32)" in message


def test_eval_harness_refuses_lora_experts(tmp_path):
    """`featcal eval-harness` loads models by path: an adapter expert is refused in one line, naming it."""
    _llama(tmp_path, experts=1)
    cfg = _run_config(tmp_path, "", 1, evaluate=False)
    (tmp_path / "run" / "merged").mkdir(parents=True)
    assert checkpoints(tmp_path / "run", cfg, ["merged", "base"]).keys() == {"merged", "base"}
    with pytest.raises(
        HarnessError, match=r"^--models: expert:task0 is a LoRA adapter, .* \(--models calibrated,merged\)$"
    ):
        checkpoints(tmp_path / "run", cfg, ["merged", "experts"])


def test_unsupported_adapters_refused_in_one_line(tmp_path):
    """DoRA (a magnitude vector besides B·A) and an adapter for a module the base lacks are refused, each in one line
    naming the adapter (and the module)."""
    _llama(tmp_path, experts=1, use_dora=True)
    skeleton = Skeleton.from_checkpoint(tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"^LoRA adapter .*e0: use_dora = True is not supported"):
        expert_checkpoint(tmp_path / "e0", tmp_path / "base", skeleton)
    config = json.loads((tmp_path / "e0" / ADAPTER_CONFIG).read_text())
    (tmp_path / "e0" / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(CheckpointError, match=r"lora_magnitude_vector is not a LoRA factor this reader knows"):
        expert_checkpoint(tmp_path / "e0", tmp_path / "base", skeleton)
    tensors = {k.replace("layers.1.mlp.up_proj", "layers.1.mlp.side_proj"): v
               for k, v in load_file(tmp_path / "e0" / ADAPTER_WEIGHTS).items() if "magnitude" not in k}
    save_file(tensors, tmp_path / "e0" / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError) as missing:
        expert_checkpoint(tmp_path / "e0", tmp_path / "base", skeleton)
    assert str(missing.value) == (f"LoRA adapter {tmp_path / 'e0'}: module model.layers.1.mlp.side_proj has no weight "
                                  f"in the base {tmp_path / 'base'}")


def test_an_adapter_names_its_base_by_path_tail_or_by_the_hub_id_of_a_cached_snapshot(tmp_path):
    """`base_model_name_or_path` as written on another machine: a path whose trailing parts are the base directory's,
    or the hub id of a base that preflight resolved to its snapshot in the hub cache."""
    from storage.lora import _same_base

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-3B" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    assert _same_base("meta-llama/Llama-3.2-3B", snapshot)
    assert not _same_base("meta-llama/Llama-3.2-1B", snapshot)
    local = tmp_path / "models" / "base"
    local.mkdir(parents=True)
    assert _same_base("/elsewhere/models/base", local) and _same_base("models/base", local)
    assert not _same_base("meta-llama/Llama-3.2-3B", local)
    assert _same_base(str(local), local) and not _same_base(str(snapshot), local)


def test_head_metric_reads_a_lora_experts_classifier(tmp_path):
    """featcal.head_metric reads each expert's classifier, which a LoRA adapter saves whole (modules_to_save): a run
    with LoRA experts gives the calibrated weights of a run with PEFT's merges saved in full, bit for bit, and the
    last block's output.dense took the head-metric solve."""
    _bert(tmp_path, experts=2)
    for suffix in ("", "-full"):
        run_pipeline(_run_config(tmp_path, suffix, 2, evaluate=False, head_metric=1.0), tmp_path / f"run{suffix}")
    ours, theirs = _tensors(tmp_path / "run" / "calibrated"), _tensors(tmp_path / "run-full" / "calibrated")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    last = BertConfig(**BERT).num_hidden_layers - 1
    path = RunDir(tmp_path / "run").record(f"solve/l{last:02d}")["info"]["solve_path"]
    assert path["output.dense"].startswith("head metric, ")


def test_an_adapter_whose_config_lacks_its_head_is_refused_before_any_stage(tmp_path):
    """An adapter saving a classifier (modules_to_save) whose config.json names the bare encoder (as
    `base.config.save_pretrained` gives), or that has no config.json (the base's is used): refused by the
    checkpoint checks, before the data is read, in one line naming the adapter and which config was used."""
    _bert(tmp_path, experts=1)
    cfg = _run_config(tmp_path, "", 1, evaluate=True)
    check_checkpoints(cfg)  # the adapter with its fine-tuned config passes
    bare, bare_cfg = tmp_path / "e0-bare", tmp_path / "base" / "config.json"
    shutil.copytree(tmp_path / "e0", bare)
    shutil.copy(bare_cfg, bare / "config.json")
    unconfigured = tmp_path / "e0-unconfigured"
    shutil.copytree(tmp_path / "e0", unconfigured)
    (unconfigured / "config.json").unlink()
    for expert, used in ((bare, "its config.json names BertModel"),
                         (unconfigured, "it has no config.json, so the base's (BertModel) is used")):
        with pytest.raises(SetupError) as refused:
            check_checkpoints(cfg.model_copy(update={"experts": {"task0": str(expert)}}))
        assert str(refused.value) == (
            f"experts.task0: LoRA adapter {expert} holds head tensors ['classifier.bias', 'classifier.weight'], but "
            f"{used}, a class without that head: save the fine-tuned model's config beside the adapter "
            "(model.config.save_pretrained of the model with the head)")


def test_loading_a_lora_expert_prints_no_load_report_and_checks_what_it_would_name(tmp_path, capfd):
    """The base lacks the classifier the adapter holds: transformers' LOAD REPORT (MISSING, newly initialized) is not
    printed for it; an adapter that does not hold it after all is refused instead of loading a random head."""
    _bert(tmp_path, experts=1)
    model = task_model(tmp_path / "e0", base_dir=tmp_path / "base")
    assert torch.equal(model.classifier.weight, task_model(tmp_path / "e0-full").classifier.weight)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "newly initialized" not in err
    headless = tmp_path / "e0-headless"
    shutil.copytree(tmp_path / "e0", headless)
    tensors = {k: v for k, v in load_file(headless / ADAPTER_WEIGHTS).items() if "classifier" not in k}
    save_file(tensors, headless / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match=r"\['classifier.bias', 'classifier.weight'\] of its "
                                              r"BertForSequenceClassification are neither in base .* nor in the "
                                              r"adapter \(they would be random\)"):
        task_model(headless, base_dir=tmp_path / "base")
