"""Decoder-only causal LMs of the Llama layout (Llama, Qwen2, Mistral, Qwen3) on tiny models built from a config:
grouped-query attention (2 key/value heads for 4 query heads), SwiGLU MLP, RMS norms, rotary positions. The adapter's
block-by-block forward on a right-padded batch, single-expert exactness at every block boundary, and drift falling with
two experts."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from featcal.adapters import adapter_for
from featcal.config import config_from_dict
from featcal.modeling import Skeleton, calibrated_modules, is_norm, task_model
from featcal.statistics import accumulate, captured_inputs, new_stats
from flows.pipeline import run_pipeline
from storage.checkpoint import INDEX_NAME, CanonicalCheckpoint
from storage.rundir import RunDir
from tasks.gram import token_weights
from tests.perturbed_experts import perturbed

EXAMPLES = 16
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama": ("LlamaForCausalLM", lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", lambda: Qwen2Config(**SHAPE, tie_word_embeddings=False)),  # q/k/v biases
    # A window shorter than the rows, so the sliding-window mask is exercised.
    "mistral": ("MistralForCausalLM", lambda: MistralConfig(**SHAPE, sliding_window=5, tie_word_embeddings=False)),
    # Per-head q/k RMS norms; head_dim 16 is not hidden / heads (8), so the config's own head_dim is exercised.
    "qwen3": ("Qwen3ForCausalLM", lambda: Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)),
}


def _model(arch: str) -> torch.nn.Module:
    cls_name, make_config = CASES[arch]
    config = make_config()
    config._attn_implementation = "eager"  # the HF reference; the adapter's float mask suits sdpa as well
    return getattr(transformers, cls_name)(config).eval()


def _rows(seed: int) -> Dataset:
    """Ready token ids (BOS first) of varying lengths."""
    rng = np.random.default_rng(seed)
    ids = [[1] + rng.integers(3, 64, int(n)).tolist() for n in rng.integers(4, 12, EXAMPLES)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})


def _batch(rows: Dataset, left: bool = False) -> dict[str, torch.Tensor]:
    """The rows padded into one batch: on the right, as the prepare stage pads them, or on the left."""
    lengths = torch.tensor([len(r) for r in rows["input_ids"]])
    width = int(lengths.max())
    pad = [[0] * (width - len(r)) for r in rows["input_ids"]]
    ids = torch.tensor([p + r if left else r + p for r, p in zip(rows["input_ids"], pad, strict=True)])
    real = torch.arange(width) < lengths[:, None]
    return {"input_ids": ids, "attention_mask": (real.flip(-1) if left else real).long()}


def _boundaries(model, batch) -> list[torch.Tensor]:
    """Hidden states at every block boundary (the embeddings, then each block's output; the last after the final
    norm, which is what the LM head reads)."""
    with torch.inference_mode():
        return list(model(**batch, output_hidden_states=True).hidden_states)


def _deviations(model, expert, batch) -> list[float]:
    """Relative distance to the expert over real tokens, per boundary."""
    real = batch["attention_mask"].bool()
    return [float((a - b)[real].norm() / b[real].norm())
            for a, b in zip(_boundaries(model, batch), _boundaries(expert, batch), strict=True)]


def _build(root, arch: str, experts: int, norm_noise: float = 0.0, **sections):
    torch.manual_seed(0)
    base = _model(arch)
    base.save_pretrained(root / "base")
    for t in range(experts):
        expert = _model(arch)
        state = perturbed(base, seed=10 + t)
        if norm_noise:  # `perturbed` scales its noise by a tensor's spread, and norm weights start all equal
            g = torch.Generator().manual_seed(20 + t)
            state = {k: v + norm_noise * torch.randn(v.shape, generator=g) if k.endswith("norm.weight") else v
                     for k, v in state.items()}
        expert.load_state_dict(state)
        expert.save_pretrained(root / f"e{t}")
        _rows(t).save_to_disk(str(root / f"d{t}"))
    raw = {
        "base": str(root / "base"),
        "experts": {f"task{t}": str(root / f"e{t}") for t in range(experts)},
        "calibration": {"data": {f"task{t}": {"path": str(root / f"d{t}")} for t in range(experts)},
                        "examples_per_task": EXAMPLES, "batch_size": 4},
        "featcal": {"lambda": 0.01, "rho": 1.0, "alpha": 1.0},
        "evaluation": {"enabled": False},
        **sections,
    }
    return config_from_dict(raw, root)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_adapter_blocks_reproduce_the_model(arch, left):
    """Embeddings, then every block through `block_input`/`run_block` with the model's own modules, give the model's
    hidden states on a padded batch: rotary positions from the model's rotary module, causal and padding mask (and
    the sliding window), grouped-query attention. The last boundary goes through the final norm. Right-padded rows
    are compared with the model's plain forward (positions 0..T-1); left-padded ones with the forward given the
    positions `generate` computes from the mask, which is what the adapter uses (rotary attention is relative, so
    a row's shift does not change it). Only left padding puts padded keys before real queries, so only it checks the
    padding mask; Mistral's window (5) is shorter than the rows, so it checks the sliding window."""
    torch.manual_seed(0)
    model = _model(arch)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    layer0 = model.model.layers[0].self_attn
    assert layer0.k_proj.out_features < layer0.q_proj.out_features  # GQA: narrower k/v
    adapter = adapter_for(model.config)
    assert adapter.pooled_index() is None and adapter.head_prefixes == ()
    batch = _batch(_rows(0), left=left)
    assert not batch["attention_mask"].all()  # some rows are padded
    positions = batch["attention_mask"].cumsum(-1) - 1
    expected = _boundaries(model, {**batch, "position_ids": positions.clamp(min=0)} if left else batch)
    with torch.inference_mode():
        hidden = adapter.embed({"model.embed_tokens": model.model.embed_tokens}, batch)
        got = [hidden]
        for layer in range(adapter.num_blocks()):
            hidden = adapter.run_block(adapter.blocks(model)[layer], hidden, adapter.block_input(batch, layer))
            got.append(model.model.norm(hidden) if layer == adapter.num_blocks() - 1 else hidden)
    real = batch["attention_mask"].bool()
    assert len(got) == len(expected) == 3
    for want, have in zip(expected, got, strict=True):
        assert torch.allclose(have[real], want[real], atol=1e-5), float((have[real] - want[real]).abs().max())


@pytest.mark.parametrize("lam, exact", [(1e-9, True), (0.5, False)])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_single_expert_exactness(tmp_path, arch, lam, exact):
    """One expert, average merge (the statistics are the expert's own), α=1, λ→0 with the anchor pointing elsewhere
    (ρ=2.2 against the base): every block boundary of the calibrated model equals the expert's on the calibration
    rows (here within about 2e-5); with λ=0.5 the anchor pulls it away (so the check can fail)."""
    cfg = _build(tmp_path, arch, experts=1, merge={"method": "average"},
                 featcal={"lambda": lam, "rho": 2.2, "alpha": 1.0})
    run_pipeline(cfg, tmp_path / "run")
    adapter = adapter_for(_model(arch).config)
    expert = task_model(cfg.experts["task0"])
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(tmp_path / "run" / "calibrated", adapter))
    deviation = _deviations(calibrated, expert, _batch(_rows(0)))
    if exact:
        assert max(deviation) < 1e-4, deviation
    else:
        assert max(deviation) > 1e-3, deviation
    # Every module's inputs resolve all their directions above the Grams' rounding (the o_proj's nearest, 1.5e-7 of
    # its norm on Llama): no solve reports directions left to rounding, even at λ → 0.
    run = RunDir(tmp_path / "run")
    assert all("unresolved" not in run.record(f"solve/l{layer:02d}")["info"] for layer in (0, 1))


@pytest.mark.parametrize("arch", sorted(CASES))
def test_two_experts_drift_falls(tmp_path, arch):
    """Task arithmetic of two perturbed experts, then FeatCal: the drift to each expert, averaged over the tasks, is
    unchanged at the embeddings (merged, not calibrated) and falls at the last boundary (what the LM head reads); the
    LM head and final norm stay merged, and tied embeddings stay tied. The experts' norms differ (`norm_noise`): every
    norm of the blocks is calibrated, Qwen3's per-head q/k norms too."""
    cfg = _build(tmp_path, arch, experts=2, norm_noise=0.1)
    run_pipeline(cfg, tmp_path / "run")
    adapter = adapter_for(_model(arch).config)
    merged_ckpt = CanonicalCheckpoint(tmp_path / "run" / "merged", adapter)
    calibrated_ckpt = CanonicalCheckpoint(tmp_path / "run" / "calibrated", adapter)
    before, after = [], []
    for t, task in enumerate(cfg.tasks):
        batch = _batch(_rows(t))
        expert = task_model(cfg.experts[task])
        before.append(_deviations(task_model(cfg.experts[task], merged_ckpt), expert, batch))
        after.append(_deviations(task_model(cfg.experts[task], calibrated_ckpt), expert, batch))
    before, after = np.mean(before, axis=0), np.mean(after, axis=0)
    assert np.allclose(after[0], before[0])
    assert after[-1] < before[-1], (before, after)
    merged = task_model(cfg.experts["task0"], merged_ckpt)
    calibrated = task_model(cfg.experts["task0"], calibrated_ckpt)
    for name in ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(calibrated.get_parameter(name), merged.get_parameter(name)), name
    assert not torch.equal(calibrated.model.layers[1].mlp.down_proj.weight, merged.model.layers[1].mlp.down_proj.weight)
    loaded = type(calibrated).from_pretrained(tmp_path / "run" / "calibrated")
    tied = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert tied == loaded.config.tie_word_embeddings == (arch in ("llama", "qwen3"))
    norms = [n for n, m in calibrated.model.layers[0].named_modules() if is_norm(m)]
    assert ("self_attn.q_norm" in norms) == (arch == "qwen3")
    for layer in range(adapter.num_blocks()):
        for name in norms:
            key = f"model.layers.{layer}.{name}.weight"
            assert not torch.equal(calibrated.get_parameter(key), merged.get_parameter(key)), key


def test_qwen3_per_head_norms_give_each_head_its_tokens_weight(tmp_path):
    """Qwen3's `self_attn.q_norm`/`k_norm` read q or k as [B, T, heads, head_dim]: a block pass gives them `heads`
    rows per token, token-major, and each row takes its token's weight (padding 0). Their sums equal a brute force
    over those rows; every norm and linear map of the block is calibrated, in the skeleton's block template and in
    each block it materialises from a checkpoint alike."""
    torch.manual_seed(0)
    model = _model("qwen3")
    model.save_pretrained(tmp_path / "m")
    skeleton = Skeleton.from_checkpoint(tmp_path / "m")
    block = skeleton.block(1, CanonicalCheckpoint(tmp_path / "m", skeleton.adapter))
    every = {n: m for n, m in model.model.layers[0].named_modules() if is_norm(m) or isinstance(m, torch.nn.Linear)}
    assert {"self_attn.q_norm", "self_attn.k_norm"} < set(every)
    assert set(calibrated_modules(skeleton.block_template(1))) == set(calibrated_modules(block)) == set(every)
    batch = _batch(_rows(0))
    sink: dict[str, torch.Tensor] = {}
    with torch.inference_mode(), captured_inputs(every, sink):
        skeleton.adapter.run_block(model.model.layers[0], model.model.embed_tokens(batch["input_ids"]),
                                   skeleton.adapter.block_input(batch))
    weights = token_weights(batch["attention_mask"], list(every), None, None)
    tokens, config = batch["attention_mask"].numel(), model.config
    stats = new_stats(every)
    accumulate(stats, every, sink, sink, weights)
    heads_of = {"self_attn.q_norm": config.num_attention_heads, "self_attn.k_norm": config.num_key_value_heads}
    for name, heads in heads_of.items():
        x = sink[name].double()
        assert x.shape == (tokens * heads, config.head_dim)
        w = batch["attention_mask"].reshape(-1).double()
        rows = torch.stack([w[i // heads] for i in range(tokens * heads)])  # row i is token i // heads, head i % heads
        z = x / (x.pow(2).mean(-1, keepdim=True) + every[name].variance_epsilon).sqrt()
        got = stats[name].tensors()
        torch.testing.assert_close(got["sum_w"], rows.sum())
        torch.testing.assert_close(got["sum_z2"], (rows[:, None] * z * z).sum(0), rtol=1e-5, atol=1e-6)
        assert float(got["sum_w"]) == heads * float(w.sum())
    with pytest.raises(ValueError, match="self_attn.q_norm: input has .* rows, not a whole number per token weight"):
        accumulate(new_stats(every), every, {**sink, "self_attn.q_norm": sink["self_attn.q_norm"][:-1]}, sink, weights)


def test_qwen3_given_merge_with_other_qk_norms_gets_the_experts_back(tmp_path):
    """A merge equal to the expert except its per-head q/k norms (the expert's, ×1.5). One task and λ → 0: a norm's
    solve, γ = Σ_t e_t·γ_t / Σ_t e_t (design §2.7), must give the expert's q/k norms back whatever the merged side's
    inputs. (The block's other modules are solved on the merged block's inputs, which those norms changed, so the
    boundaries are not the expert's: that is the method, not this check.)"""
    cfg = _build(tmp_path, "qwen3", experts=1, norm_noise=0.1)
    expert = task_model(cfg.experts["task0"])
    given = _model("qwen3")
    state = {k: v * 1.5 if k.endswith(("q_norm.weight", "k_norm.weight")) else v
             for k, v in expert.state_dict().items()}
    given.load_state_dict(state)
    given.save_pretrained(tmp_path / "given")
    raw = cfg.model_dump(by_alias=True, mode="json")
    raw["merge"] = {"method": "given", "path": str(tmp_path / "given")}
    raw["featcal"].update({"lambda": 1e-9, "rho": 1.0, "alpha": 1.0})
    cfg = config_from_dict(raw, tmp_path)
    run_pipeline(cfg, tmp_path / "run")
    adapter = adapter_for(given.config)
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(tmp_path / "run" / "calibrated", adapter))
    for layer in range(adapter.num_blocks()):
        for name in ("q_norm", "k_norm"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            torch.testing.assert_close(calibrated.get_parameter(key), expert.get_parameter(key), rtol=1e-6, atol=1e-7)
            assert not torch.allclose(given.get_parameter(key), expert.get_parameter(key), rtol=0.1), key


def _brute_force_next_tokens(model, rows: Dataset) -> tuple[float, float]:
    """Mean token loss and next-token accuracy, one unpadded row at a time through the model's own loss."""
    nll, right, tokens = 0.0, 0, 0
    with torch.inference_mode():
        for ids in rows["input_ids"]:
            x = torch.tensor([ids])
            out = model(input_ids=x, labels=x)
            nll += float(out.loss) * (len(ids) - 1)
            right += int((out.logits[0, :-1].argmax(-1) == x[0, 1:]).sum())
            tokens += len(ids) - 1
    return nll / tokens, right / tokens


def test_language_model_evaluation(tmp_path):
    """The evaluate stage scores a causal LM on held-out text: per model the mean next-token loss, its perplexity and
    next-token accuracy, equal to the model's own loss on each unpadded row (the stage pads rows into batches of 3);
    the loss gap closed follows from the per-task losses, and the report shows them."""
    held_out = {t: _rows(100 + t) for t in range(2)}
    for t, rows in held_out.items():
        rows.save_to_disk(str(tmp_path / f"held{t}"))
    cfg = _build(tmp_path, "llama", experts=2, evaluation={
        "batch_size": 3, "models": ["merged", "calibrated", "expert"],
        "data": {f"task{t}": {"path": str(tmp_path / f"held{t}")} for t in range(2)}})
    run_pipeline(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    adapter = adapter_for(_model("llama").config)
    for t, task in enumerate(cfg.tasks):
        scores = report["tasks"][task]
        assert scores["metric"] == "next_token_accuracy"
        for name, ckpt in (("expert", None), ("calibrated", tmp_path / "run" / "calibrated")):
            model = task_model(cfg.experts[task], ckpt and CanonicalCheckpoint(ckpt, adapter))
            loss, accuracy = _brute_force_next_tokens(model, held_out[t])
            lm = scores["language_model"][name]
            assert lm["loss"] == pytest.approx(loss, rel=1e-5)
            assert lm["perplexity"] == pytest.approx(np.exp(loss), rel=1e-5)
            assert lm["next_token_accuracy"] == pytest.approx(accuracy) == scores["accuracy"][name]
            assert lm["tokens"] == sum(len(r) - 1 for r in held_out[t]["input_ids"])
    summary = report["summary"]
    loss = {m: np.mean([report["tasks"][t]["language_model"][m]["loss"] for t in cfg.tasks]) for m in report["models"]}
    assert summary["average_loss"] == pytest.approx(loss)
    assert summary["gap_closed_loss"] == pytest.approx(
        (loss["merged"] - loss["calibrated"]) / (loss["merged"] - loss["expert"]))
    text = (tmp_path / "run" / "report.md").read_text()
    assert "## Token loss in nats (perplexity)" in text and "Gap closed in loss" in text


def test_bf16_sharded_checkpoints(tmp_path):
    """LLMs ship as bf16 safetensors shards with an index: they are read as such, and the merged and calibrated
    checkpoints come out in bf16. Single-expert exactness then holds to bf16's rounding: the solve is float64, but
    each solved weight is stored with 8 significant bits (relative rounding ≤ 2⁻⁹ per weight), so the bound is
    bf16's unit 2⁻⁸ ≈ 3.9e-3 rather than the 1e-4 of fp32 checkpoints (measured here: about 7e-4)."""
    torch.manual_seed(0)
    base = _model("llama")
    base.to(torch.bfloat16).save_pretrained(tmp_path / "base", max_shard_size="20KB")
    expert = _model("llama")
    expert.load_state_dict(perturbed(base, seed=10))
    expert.to(torch.bfloat16).save_pretrained(tmp_path / "e0", max_shard_size="20KB")
    assert len(list((tmp_path / "e0").glob("*.safetensors"))) > 1 and (tmp_path / "e0" / INDEX_NAME).is_file()
    _rows(0).save_to_disk(str(tmp_path / "d0"))
    cfg = config_from_dict({
        "base": str(tmp_path / "base"), "experts": {"task0": str(tmp_path / "e0")}, "merge": {"method": "average"},
        "calibration": {"data": {"task0": {"path": str(tmp_path / "d0")}}, "examples_per_task": EXAMPLES,
                        "batch_size": 4},
        "featcal": {"lambda": 1e-9, "rho": 2.2, "alpha": 1.0}, "evaluation": {"enabled": False}}, tmp_path)
    run_pipeline(cfg, tmp_path / "run")
    adapter = adapter_for(_model("llama").config)
    for name in ("merged", "calibrated"):
        ckpt = CanonicalCheckpoint(tmp_path / "run" / name, adapter)
        assert {ckpt.get(n).dtype for n in ckpt.names()} == {torch.bfloat16}, name
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(tmp_path / "run" / "calibrated", adapter))
    deviation = _deviations(calibrated.float(), task_model(cfg.experts["task0"]).float(), _batch(_rows(0)))
    assert 0 < max(deviation) < 2**-8, deviation


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_lm_head_map_has_the_jacobians_gram_off_the_row_direction(tmp_path, arch):
    """featcal.head_metric on a causal LM: the logits' Jacobian with respect to the last down_proj's output at one row
    is E·diag(γ)/rms on every direction orthogonal to the row's normalised vector (RMSNorm's per-row terms are what
    head_map leaves out). head_map returns the square (EᵀE)^½·diag(γ), so its Gram is compared: HᵀH = JᵀJ·rms² there
    (tied embeddings for llama and qwen3, a separate lm_head for qwen2)."""
    torch.manual_seed(0)
    model = _model(arch)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    adapter = adapter_for(model.config)
    adapter.HEAD_ROWS = 10  # several row chunks of the 64-token vocabulary, the last one short
    head = adapter.head_map(CanonicalCheckpoint(tmp_path, adapter))
    assert head.shape == (SHAPE["hidden_size"],) * 2
    model.double()
    norm = model.model.norm
    x, y = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda out: model.lm_head(norm(x + out)), y)
    rms = float(torch.sqrt((x + y).pow(2).mean() + norm.variance_epsilon))
    n = (x + y) / rms
    v = torch.randn(32, 6, dtype=torch.float64)
    v -= n[:, None] * (n @ v)[None] / (n @ n)
    # HF's RMSNorm computes in float32 whatever the input: agreement to its precision
    torch.testing.assert_close((jac @ v).T @ (jac @ v), (head @ v).T @ (head @ v) / rms**2, rtol=1e-5, atol=1e-7)
    off = (jac @ n).norm() ** 2 - (head @ n).norm() ** 2 / rms**2
    assert abs(float(off)) > 1e-3  # along n the per-row term shows: a real check


def test_head_metric_run_takes_the_lm_heads_metric_in_the_last_down_proj(tmp_path, monkeypatch):
    """Every task reads the merged LM head, so the metric is the merged checkpoint's (and the preflight reads the
    base's head, whose tensors the merge uses, never an expert's); only the last block's down_proj changes against the
    plain run, and it records its conjugate-gradient steps."""
    from safetensors.torch import load_file

    from featcal.adapters import LlamaAdapter

    cfg = _build(tmp_path / "plain", "llama", experts=2)
    run_pipeline(cfg, tmp_path / "plain" / "run")
    head = _build(tmp_path / "head", "llama", experts=2, featcal={"lambda": 0.01, "rho": 1.0, "alpha": 1.0,
                                                                    "head_metric": 1.0})
    read, head_map = [], LlamaAdapter.head_map
    monkeypatch.setattr(LlamaAdapter, "head_map",
                        lambda self, ckpt: read.append(ckpt.directory) or head_map(self, ckpt))
    run_pipeline(head, tmp_path / "head" / "run")
    assert [Path(d).name for d in read] == ["base", "merged"]
    plain, metric = (load_file(tmp_path / r / "run" / "calibrated" / "model.safetensors") for r in ("plain", "head"))
    last = SHAPE["num_hidden_layers"] - 1
    assert {n for n in plain if not torch.equal(plain[n], metric[n])} == {f"model.layers.{last}.mlp.down_proj.weight"}
    path = RunDir(tmp_path / "head" / "run").record(f"solve/l{last:02d}")["info"]["solve_path"]
    assert list(path) == ["mlp.down_proj"] and path["mlp.down_proj"].startswith("head metric, ")
