"""featcal.calibrate_head_side: the modules between the last block and the head (BERT's pooler, CLIP's post_layernorm,
a ViT's final norm) calibrated as one more block, L, on tiny models built from configs.

The experts differ from the base only in the head side (and the task head), so a task-arithmetic merge leaves the
blocks equal to the expert's, and the merged head side differs from it: with one expert, α = 1 and λ → 0 (the anchor,
ρ = 2.2, pointing elsewhere), only a correct head-side solve lands on the expert's head-side output."""

import json

import numpy as np
import pytest
import torch
import transformers
from datasets import Array3D, Dataset, Features
from safetensors.torch import load_file
from transformers import BertConfig, CLIPVisionConfig, LlamaConfig, T5ForConditionalGeneration, ViTConfig

from featcal.adapters import UnsupportedModelError, adapter_for
from featcal.config import ConfigError, config_from_dict
from featcal.modeling import task_model
from flows.pipeline import direct_runner, run_pipeline, stage_count
from flows.plan import plan
from storage.checkpoint import CanonicalCheckpoint
from tests.t5_fixture import t5_config
from tests.test_architectures import VISION

EXAMPLES = 48  # more rows than the pooler's 32 inputs + bias: its C_ss is full rank
CASES = {
    "bert": ("BertForSequenceClassification", lambda: BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, num_labels=3, pad_token_id=0)),
    "clip": ("CLIPVisionModel", lambda: CLIPVisionConfig(**VISION)),
    "vit": ("ViTForImageClassification", lambda: ViTConfig(**VISION, num_labels=3)),
}


def _data(arch: str) -> Dataset:
    rng = np.random.default_rng(0)
    if arch == "bert":  # ready token ids of varying lengths (so some rows are padded); a random first token, so
        ids = [rng.integers(3, 64, int(n)).tolist() for n in rng.integers(4, 12, EXAMPLES)]  # its states span H
        return Dataset.from_dict({"input_ids": ids})
    pixels = rng.standard_normal((EXAMPLES, 3, 16, 16)).astype(np.float32)
    return Dataset.from_dict({"pixel_values": pixels}, features=Features(pixel_values=Array3D((3, 16, 16), "float32")))


def _build(root, arch: str, **featcal):
    """Base and one expert that differs from it in the head side and the task head only; the run's config."""
    cls_name, make_config = CASES[arch]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    base = cls(make_config())
    base.save_pretrained(root / "base")
    adapter = adapter_for(base.config)
    changed = (adapter.body_prefix + adapter.head_side_path() + ".", *adapter.head_prefixes)
    g = torch.Generator().manual_seed(10)  # absolute noise: a fresh norm's weight (ones) and biases (0) have no spread
    expert = cls(make_config())
    expert.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g) if k.startswith(changed) else v
                            for k, v in base.state_dict().items()})
    expert.save_pretrained(root / "expert")
    _data(arch).save_to_disk(str(root / "data"))
    raw = {
        "base": str(root / "base"),
        "experts": {"task": str(root / "expert")},
        "calibration": {
            "data": {"task": {"path": str(root / "data")}},
            "examples_per_task": EXAMPLES,
            "batch_size": 16,
        },
        "merge": {"method": "task_arithmetic", "scaling": 0.3},
        "featcal": {"lambda": 1e-8, "alpha": 1.0, "rho": 2.2, **featcal},
        "evaluation": {"enabled": False},
        "runtime": {"keep_activations": True},  # switching the head side on afterwards resumes from the boundaries
    }
    return config_from_dict(raw, root)


def _deviations(cfg, run_dir) -> tuple[float, float]:
    """Relative distance of the calibrated model to the expert on the calibration rows: the worst over the block
    boundaries (real tokens), and over what the head reads (BERT's and CLIP's pooled output, ViT's normed token 0)."""
    expert_dir = cfg.experts["task"]
    adapter = adapter_for(transformers.AutoConfig.from_pretrained(expert_dir))
    models = [adapter.body(m) for m in (task_model(expert_dir, CanonicalCheckpoint(run_dir / "calibrated", adapter)),
                                        task_model(expert_dir))]
    rows = _data(adapter.config.model_type)
    if "input_ids" in rows.column_names:
        width = max(map(len, rows["input_ids"]))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows["input_ids"]])
        inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    else:
        inputs = {"pixel_values": torch.tensor(np.asarray(rows["pixel_values"]))}
    with torch.inference_mode():
        ours, theirs = (m(**inputs, output_hidden_states=True) for m in models)
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else slice(None)
    blocks = max(float((a[real] - b[real]).norm() / b[real].norm())
                 for a, b in zip(ours.hidden_states, theirs.hidden_states, strict=True))
    read = (lambda out: out.last_hidden_state[:, 0]) if adapter.architecture.startswith("ViT") else (
        lambda out: out.pooler_output)
    return blocks, float((read(ours) - read(theirs)).norm() / read(theirs).norm())


def _head_side(run_dir, name: str, cfg) -> dict[str, torch.Tensor]:
    """The head-side tensors of checkpoint `name` (merged, calibrated, or the expert) by canonical name."""
    adapter = adapter_for(transformers.AutoConfig.from_pretrained(cfg.base))
    ckpt = CanonicalCheckpoint(run_dir / name if name in ("merged", "calibrated") else cfg.experts[name], adapter)
    return ckpt.with_prefix(adapter.head_side_path() + ".")


def test_bert_pooler_switched_on_after_a_run_without_it(tmp_path):
    """Off: the pooler stays merged and misses the expert's pooled output. Switched on in the same run directory:
    only the stages the head side adds or changes run (the last block's Gram, which now writes E_t(L), its
    propagation, the head side's Gram and solve, assemble), and the pooled output is the expert's."""
    off = _build(tmp_path, "bert")
    run_dir = tmp_path / "run"
    run_pipeline(off, run_dir)
    merged, expert = _head_side(run_dir, "merged", off), _head_side(run_dir, "task", off)
    calibrated = _head_side(run_dir, "calibrated", off)
    assert set(calibrated) == {"dense.weight", "dense.bias"}
    assert all(torch.equal(calibrated[k], merged[k]) and not torch.allclose(merged[k], expert[k]) for k in merged)
    blocks, head = _deviations(off, run_dir)
    assert blocks < 1e-4 and head > 1e-3, (blocks, head)

    on = off.model_copy(update={"featcal": off.featcal.model_copy(update={"calibrate_head_side": True})})
    fresh = []

    def runner(run_dir, call, done):
        if done is None:
            fresh.append(call.stage)
        return direct_runner(run_dir, call, done)

    run_pipeline(on, run_dir, runner=runner, reuse=True)  # another config: refused without it
    assert fresh == ["gram/l01/task", "propagate/l01/task", "gram/l02/task", "solve/l02", "assemble"]
    assert load_file(run_dir / "blocks" / "l02.safetensors").keys() == {"dense.weight", "dense.bias"}
    calibrated = _head_side(run_dir, "calibrated", on)
    assert not any(torch.allclose(calibrated[k], merged[k]) for k in merged)
    blocks, head = _deviations(on, run_dir)
    assert blocks < 1e-4 and head < 1e-4, (blocks, head)

    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert plan(on)["stages"] == len(stages) == plan(off)["stages"] + 3 == stage_count(1, 2, 1, False, True)
    assert plan(on)["head_side"] == "pooler" and plan(off)["head_side"] is None


@pytest.mark.parametrize("arch", ["clip", "vit"])
def test_norm_head_side_reproduces_the_expert(tmp_path, arch):
    """A bare LayerNorm as block L: CLIP's post_layernorm (on the class token only) and ViT's final norm (all tokens,
    the head reads token 0)."""
    cfg = _build(tmp_path, arch, calibrate_head_side=True)
    run_pipeline(cfg, tmp_path / "run")
    calibrated, merged = _head_side(tmp_path / "run", "calibrated", cfg), _head_side(tmp_path / "run", "merged", cfg)
    expert = _head_side(tmp_path / "run", "task", cfg)
    assert set(calibrated) == {"weight", "bias"} and not torch.allclose(calibrated["weight"], merged["weight"])
    assert all(torch.allclose(calibrated[k], expert[k], atol=1e-5) for k in expert)  # γ_t, β_t: §2.9
    blocks, head = _deviations(cfg, tmp_path / "run")
    assert blocks < 1e-4 and head < 1e-4, (blocks, head)


@pytest.mark.parametrize("arch", ["bert", "clip", "vit", "llama"])
def test_run_head_side_gives_what_the_head_reads(arch):
    """The head side run by the adapter on the last block's output (its counted tokens) gives what the model's head
    reads: BERT's and CLIP's pooled output, ViT's normed token 0, a decoder's normed tokens."""
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    else:
        cls_name, make_config = CASES[arch]
        model = getattr(transformers, cls_name)(make_config())
    model.eval()
    adapter = adapter_for(model.config)
    body = adapter.body(model)
    last = []
    adapter.blocks(body)[-1].register_forward_hook(lambda m, i, o: last.append(o[0] if isinstance(o, tuple) else o))
    inputs = ({"pixel_values": torch.randn(2, 3, 16, 16)} if arch in ("clip", "vit")
              else {"input_ids": torch.randint(3, 64, (2, 7))})
    with torch.inference_mode():
        out = model.base_model(**inputs)
        got = adapter.run_head_side(
            body.get_submodule(adapter.head_side_path()), last[0][:, adapter.head_side_tokens()]
        )
    reads = (
        out.pooler_output[:, None] if arch in ("bert", "clip") else out.last_hidden_state[:, adapter.head_side_tokens()]
    )
    torch.testing.assert_close(got, reads)


def test_refused_where_there_is_no_head_side_or_no_featcal_solve(tmp_path):
    T5ForConditionalGeneration(t5_config()).save_pretrained(tmp_path / "t5")
    raw = {"base": str(tmp_path / "t5"), "experts": {"a": str(tmp_path / "t5")},
           "calibration": {"data": {"a": {"path": str(tmp_path / "none")}}}, "featcal": {"calibrate_head_side": True}}
    with pytest.raises(UnsupportedModelError, match="^featcal.calibrate_head_side: not supported for "
                                                    "T5ForConditionalGeneration$"):
        run_pipeline(config_from_dict(raw, tmp_path), tmp_path / "run")
    regmean = _build(tmp_path, "clip", calibrate_head_side=True, method="regmean")
    with pytest.raises(
        ConfigError, match="^featcal.calibrate_head_side: only with featcal.method featcal, not regmean$"
    ):
        run_pipeline(regmean, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    clip_classifier = adapter_for(transformers.CLIPConfig(vision_config=VISION, architectures=[
        "CLIPForImageClassification"]))
    with pytest.raises(UnsupportedModelError, match="not supported for CLIPForImageClassification"):
        clip_classifier.head_side_path()
