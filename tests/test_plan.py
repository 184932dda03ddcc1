"""`featcal plan`'s estimates on a decoder-only LM: checkpoints on disk in their stored dtype (bf16 halves them), one
block's statistics per task as the Gram stage keeps them, and the prepare stage's embedding in the RAM estimate."""

import logging
import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flows.plan
import tasks.preflight
import tasks.resident
from featcal.config import config_from_dict
from featcal.statistics import expert_side_form
from flows.plan import GIB, plan, render
from tests.test_decoders import SHAPE, _rows


def _config(root, dtype: torch.dtype, vocab: int = 64, examples: int = 16, **shape):
    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPE, "vocab_size": vocab, **shape}, tie_word_embeddings=True)
    # transformers wraps PreTrainedModel.to in a decorator whose stub loses the signature
    model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(root / "base")
    with torch.no_grad():  # an expert equal to its base would be a degenerate set-up, warned about in every plan
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(root / "e0")
    _rows(0).save_to_disk(str(root / "d0"))
    return config_from_dict({
        "base": str(root / "base"), "experts": {"task0": str(root / "e0")},
        "calibration": {"data": {"task0": {"path": str(root / "d0")}}, "examples_per_task": examples, "batch_size": 4,
                        "max_length": SHAPE["max_position_embeddings"]},
        "evaluation": {"enabled": False},
    }, root)


def test_disk_estimate_counts_checkpoints_in_their_stored_dtype(tmp_path):
    fp32 = plan(_config(tmp_path / "fp32", torch.float32))
    bf16 = plan(_config(tmp_path / "bf16", torch.bfloat16))
    h, i, v, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], 64, SHAPE["num_hidden_layers"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    model = v * h + layers * block + h  # tied embedding, blocks, final norm
    # merged + calibrated checkpoints and every solved block: 4 bytes a value in fp32, 2 in bf16
    halved = (2 * model + layers * block) * 2
    assert math.isclose((fp32["estimated_disk_gib"] - bf16["estimated_disk_gib"]) * GIB, halved, abs_tol=0.002 * GIB)


def test_ram_estimate_covers_the_prepare_stages_embedding(tmp_path):
    """A large vocabulary: the prepare stage (one side's float32 embedding and, while it fills, its stored bf16
    tensors) outweighs three blocks and their Grams."""
    p = plan(_config(tmp_path, torch.bfloat16, vocab=200_000))
    embedding = 200_000 * SHAPE["hidden_size"]
    assert math.isclose(p["estimated_peak_ram_gib"], (4 * embedding + 2 * embedding) / GIB + 1.0, abs_tol=0.001)


def test_ram_estimate_adds_the_prepare_stage_under_keep_freed_memory(tmp_path):
    """The heap keeps what the prepare stage freed, so the blocks' memory comes on top of it."""
    cfg = _config(tmp_path, torch.bfloat16, vocab=200_000)
    default = plan(cfg)
    kept = plan(cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"keep_freed_memory": True})}))
    prepare = 6 * 200_000 * SHAPE["hidden_size"]  # as above: the larger part, which the default estimate takes
    blocks = plan(_config(tmp_path / "small", torch.bfloat16, vocab=64))["estimated_peak_ram_gib"] - 1.0
    assert math.isclose(default["estimated_peak_ram_gib"], prepare / GIB + 1.0, abs_tol=0.001)
    assert math.isclose(kept["estimated_peak_ram_gib"], prepare / GIB + blocks + 1.0, abs_tol=0.002)


def test_disk_estimate_counts_rows_where_the_gram_stage_keeps_them(tmp_path):
    """A wide MLP against 2 examples of at most 64 tokens: down_proj (the one module whose input width is its own)
    keeps its 128 rows (x_s, target, weight: float32) instead of C_ss and the expert side (float64)."""
    inter, h, rows = 1024, SHAPE["hidden_size"], 2 * SHAPE["max_position_embeddings"]
    cfg = _config(tmp_path, torch.float32, examples=2, intermediate_size=inter)
    auto = plan(cfg)
    off = plan(cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"row_statistics": "off"})}))
    expert = inter * h if expert_side_form(rows, inter, h, 1) == "product" else inter * inter
    saved = 8 * (inter * inter + expert) - 4 * rows * (inter + h + 1)
    assert math.isclose((off["estimated_disk_gib"] - auto["estimated_disk_gib"]) * GIB, saved, abs_tol=0.002 * GIB)


def test_plan_says_when_bf16_would_be_emulated(tmp_path, monkeypatch, caplog):
    """Once: in the plan's text (`featcal plan`), or logged by the run's preflight (`featcal run` plans quietly)."""
    cfg = _config(tmp_path, torch.float32)
    bf16 = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"precision": "bf16", "device": "cpu"})})
    monkeypatch.setattr(flows.plan, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(tasks.preflight, "cpu_has_native_bf16", lambda: False)
    caplog.set_level(logging.WARNING, logger="featcal")
    text = render(plan(bf16))
    assert "warning           runtime.precision: bf16 on a CPU without bf16 instructions" in text
    assert caplog.records == []
    tasks.preflight.preflight(bf16)
    messages = [r.getMessage()[:58] for r in caplog.records]
    assert messages == ["runtime.precision: bf16 on a CPU without bf16 instructions"]
    assert plan(cfg)["warning"] is None and "warning" not in render(plan(cfg))
    monkeypatch.setattr(flows.plan, "cpu_has_native_bf16", lambda: True)
    assert plan(bf16)["warning"] is None


def test_plan_says_whether_the_resident_path_runs_and_counts_it(tmp_path, monkeypatch):
    cfg = _config(tmp_path, torch.float32, examples=64)
    boundary = 64 * SHAPE["max_position_embeddings"] * SHAPE["hidden_size"] * 4  # one side, one task, as stored
    monkeypatch.setattr(tasks.resident, "available_memory", lambda: 8 * boundary)  # half of it: room for 4
    auto = plan(cfg)
    assert auto["resident"] and auto["resident_reason"].startswith("on: boundaries 0.")
    assert "resident path     on: boundaries" in render(auto)
    monkeypatch.setattr(tasks.resident, "available_memory", lambda: 8 * boundary - 2)  # just too little
    streaming = plan(cfg)
    assert not streaming["resident"] and " > " in streaming["resident_reason"]
    # On the resident path the estimate holds the 4 boundaries and 2 more blocks on top.
    extra = auto["estimated_peak_ram_gib"] - streaming["estimated_peak_ram_gib"]
    block = sum(p.numel() * 4 for p in LlamaForCausalLM(LlamaConfig(**SHAPE)).model.layers[0].parameters())
    assert math.isclose(extra, (4 * boundary + 2 * block) / GIB, abs_tol=0.001)
    cfg.runtime.resident = False
    forced = plan(cfg)
    assert not forced["resident"] and forced["resident_reason"].startswith("off: runtime.resident is false")
