"""A tiny offline stand-in for MergeBench on Llama-3.2-3B, laid out as the hub names it: a tiny Llama with a word-level
tokenizer trained on the fixture's own text (Llama's cannot be downloaded here; like Llama's, it adds BOS and has no
padding token), one expert per domain fine-tuned a few steps on that domain's text, and `MergeBench/{domain}_val`
sets with MergeBench's field names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from featcal_bench.llm.build import rendered
from featcal_bench.llm.spec import BASE_MODEL, DOMAINS, HEADER
from tests.perturbed_experts import perturbed, trained_copy

SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
# Each domain's words; its text walks them in order (from a random start), which its expert learns.
WORDS = {d: tuple(f"{d[:4]}{i}" for i in range(8)) for d in DOMAINS}


def _walk(rng: np.random.Generator, words: tuple[str, ...], n: int) -> str:
    start = int(rng.integers(len(words)))
    return " ".join(words[(start + i) % len(words)] for i in range(n))


def domain_rows(domain: str, rows: int, seed: int) -> Dataset:
    """`rows` rows with the domain's MergeBench fields: prompt and response walks through its words (instruction:
    every other row with an `input`, the others with an empty one)."""
    d, rng = DOMAINS[domain], np.random.default_rng(seed)
    words = WORDS[domain]
    columns = {d.prompt: [_walk(rng, words, int(n)) for n in rng.integers(3, 7, rows)],
               d.response: [_walk(rng, words, int(n)) for n in rng.integers(4, 9, rows)]}
    if d.input:
        columns[d.input] = [_walk(rng, words, 3) if i % 2 else "" for i in range(rows)]
    return Dataset.from_dict(columns)


def llm_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on `texts` (words and punctuation), adding BOS as Llama's does; no padding
    token, as Llama's has none."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIAL)))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llm_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                       eos_token_id=2, pad_token_id=None, tie_word_embeddings=True)


def _fine_tuned(base: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, texts: list[str],
                seed: int) -> LlamaForCausalLM:
    """The base trained a few full-batch steps on `texts`: an expert whose loss on its own domain is lower."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in ids)
    inputs = torch.tensor([r + [0] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    labels = inputs.masked_fill(mask == 0, -100)
    return trained_copy(base, 30, seed, input_ids=inputs, attention_mask=mask, labels=labels)


def llm_mirror(root: Path, domains: list[str], rows: int) -> tuple[Path, Path]:
    """Under `root`: models/ (the base with its tokenizer and one expert per domain in `domains`) and data/ (every
    domain's held-out set of `rows` rows), under their hub names."""
    models_dir, data_dir = root / "models", root / "data"
    held_out = {d: domain_rows(d, rows, seed=i) for i, d in enumerate(DOMAINS)}
    training = {d: domain_rows(d, 16, seed=100 + i) for i, d in enumerate(domains)}
    texts = [HEADER, "### Instruction: ### Input: ### Response:", *(" ".join(w) for w in WORDS.values())]
    tokenizer = llm_tokenizer(texts)
    torch.manual_seed(0)
    base = LlamaForCausalLM(llm_config(len(tokenizer))).eval()
    base.save_pretrained(models_dir / BASE_MODEL)
    tokenizer.save_pretrained(models_dir / BASE_MODEL)
    for i, d in enumerate(domains):
        expert = _fine_tuned(base, tokenizer, rendered(training[d], d)["text"], seed=i)
        expert.save_pretrained(models_dir / DOMAINS[d].expert(d))
    for d, ds in held_out.items():
        DatasetDict({"train": ds}).save_to_disk(str(data_dir / DOMAINS[d].dataset(d)))
    return models_dir, data_dir


def tiny_llama_run(root: Path, eos: bool = True, base: str = "base", experts: tuple[str, str] = ("e0", "e1"),
                   config: str = "llama.yaml") -> Path:
    """A run config over a tiny Llama whose tokenizer, like Llama's and GPT-2's, has no padding token, two perturbed
    copies as experts and raw text to calibrate and evaluate on, each at the path given (relative to `root`);
    `eos=False` drops its EOS token too."""
    texts = [" ".join(words) for words in WORDS.values()]
    tokenizer = llm_tokenizer(texts)
    if not eos:
        tokenizer.eos_token = None
    torch.manual_seed(0)
    model = LlamaForCausalLM(llm_config(len(tokenizer))).eval()
    model.save_pretrained(root / base)
    tokenizer.save_pretrained(root / base)
    raw: dict = {"base": base, "experts": {}, "calibration": {"data": {}, "examples_per_task": 8, "batch_size": 4},
                 "evaluation": {"data": {}}, "featcal": {"lambda": 0.05, "rho": 1.0}}
    for t, (words, expert) in enumerate(zip(list(WORDS.values())[:2], experts, strict=True)):
        model.load_state_dict(perturbed(model, seed=10 + t))
        model.save_pretrained(root / expert)
        rows = [" ".join(words[(i + k) % len(words)] for k in range(2 + i % 5)) for i in range(8)]  # ragged lengths
        Dataset.from_dict({"text": rows}).save_to_disk(str(root / f"d{t}"))
        raw["experts"][f"task{t}"] = expert
        raw["calibration"]["data"][f"task{t}"] = {"path": f"d{t}"}
        raw["evaluation"]["data"][f"task{t}"] = {"path": f"d{t}"}
    (root / config).write_text(yaml.safe_dump(raw))
    return root / config
