"""The tiny, fully offline example: real HF checkpoints and `datasets` directories.

FeatCal merges task experts fine-tuned from one base, so the demo and the test suite need a
base, three experts and per-task data for each architecture, built without any network
access. Everything here is synthetic, seeded and small enough to build on two CPU cores in
well under a minute, yet the task-arithmetic merge of the experts still loses accuracy.

Layout under ``out`` (other code relies on it)::

    {arch}/base/            base model (BertModel / CLIPVisionModel) + tokenizer / processor
    {arch}/experts/{task}/  fine-tuned classifier (BertForSequenceClassification /
                            CLIPForImageClassification) + tokenizer / processor
    {arch}/data/{task}/     DatasetDict with splits train / calibration / test
    {arch}/example.yaml     pipeline config, paths relative to the YAML's directory
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
import transformers
import yaml
from datasets import Array3D, ClassLabel, Dataset, DatasetDict, Features, List, Value
from torch import nn
from transformers import (  # type: ignore[attr-defined]  # BertTokenizerFast: a lazy alias in transformers 5
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    CLIPConfig,
    CLIPForImageClassification,
    CLIPImageProcessorPil,
    CLIPTextConfig,
    CLIPVisionConfig,
    CLIPVisionModel,
    PreTrainedModel,
)

from featcal.devices import one_thread

log = logging.getLogger("featcal.example")

SPLIT_SIZES = {"train": 400, "calibration": 64, "test": 200}
MERGE_SCALING = 0.3
# The one BERT task stored as ready model inputs, so the pipeline must handle both forms.
PRETOKENISED_TASK = "count"

HIDDEN, LAYERS, HEADS, INTERMEDIATE = 64, 3, 4, 128
IMAGE_SIZE, PATCH_SIZE = 32, 8
MAX_WORDS = 16

BATCH_SIZE = 32
PRETRAIN_STEPS, PRETRAIN_LR = 300, 1e-3
EXPERT_STEPS, EXPERT_LR = 300, 1e-4  # fine-tuning lr 10x below pretraining, as in real fine-tunes

WORD_GROUPS: dict[str, tuple[str, ...]] = {
    "animals": ("cat", "dog", "horse", "cow", "sheep", "goat", "bird", "fish", "mouse", "rabbit"),
    "food": ("bread", "apple", "cheese", "rice", "soup", "cake", "pear", "milk", "egg", "bean"),
    "vehicles": ("car", "bus", "train", "boat", "truck", "bike", "plane", "tram", "ship", "van"),
    "colours": ("red", "blue", "green", "yellow", "black", "white", "pink", "brown"),
    "positive": ("good", "great", "nice", "happy"),
    "negative": ("bad", "awful", "sad", "ugly"),
    "negations": ("not", "never", "no"),
    "fillers": ("the", "a", "is", "was", "and", "with", "of", "on", "it", "very"),
}
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(w for group in WORD_GROUPS.values() for w in group)

TASK_LABELS: dict[str, dict[str, tuple[str, ...]]] = {
    "bert": {
        "topic": ("animals", "food", "vehicles"),
        "negation": ("negative", "positive"),
        "count": ("few_colours", "many_colours"),
    },
    "clip": {
        "quadrant": ("top_left", "top_right", "bottom_left", "bottom_right"),
        "colour": ("red", "green", "blue"),
        "stripes": ("horizontal", "vertical"),
    },
}


# --------------------------------------------------------------------------- synthetic text


def _words_from(rng: random.Random, groups: tuple[str, ...], n: int) -> list[str]:
    return [rng.choice(WORD_GROUPS[rng.choice(groups)]) for _ in range(n)]


def _padded_sentence(rng: random.Random, words: list[str], groups: tuple[str, ...]) -> list[str]:
    """Shuffle `words` among distractors from `groups`, 4..16 words so padding matters."""
    n = rng.randint(max(4, len(words)), MAX_WORDS)
    sentence = words + _words_from(rng, groups, n - len(words))
    rng.shuffle(sentence)
    return sentence


def _topic_sentence(rng: random.Random, label: int) -> list[str]:
    """The labelled topic group has strictly more words than either other topic group."""
    topics = TASK_LABELS["bert"]["topic"]
    others = [rng.randint(0, 2) for _ in range(len(topics) - 1)]
    counts = others[:label] + [max(others) + rng.randint(2, 3)] + others[label:]
    words = [rng.choice(WORD_GROUPS[t]) for t, c in zip(topics, counts) for _ in range(c)]
    return _padded_sentence(rng, words, ("colours", "positive", "negative", "fillers"))


def _negation_sentence(rng: random.Random, label: int) -> list[str]:
    """One sentiment word, maybe negated right before it; the label is the resulting polarity.

    The context is filler words only: with 400 training sentences a tiny model learns this
    XOR among fillers but only memorises it among content words.
    """
    negated = rng.random() < 0.5
    polarity = "positive" if bool(label) != negated else "negative"
    phrase = [rng.choice(WORD_GROUPS["negations"])] * negated + [rng.choice(WORD_GROUPS[polarity])]
    context = _words_from(rng, ("fillers",), rng.randint(4, 10) - len(phrase))
    at = rng.randint(0, len(context))
    return context[:at] + phrase + context[at:]


def _count_sentence(rng: random.Random, label: int) -> list[str]:
    """Label 1 when the sentence holds more than two colour words."""
    k = rng.randint(3, 6) if label else rng.randint(0, 2)
    words = [rng.choice(WORD_GROUPS["colours"]) for _ in range(k)]
    return _padded_sentence(rng, words, ("animals", "food", "vehicles", "positive", "negative", "fillers"))


TEXT_SAMPLERS: dict[str, Callable[[random.Random, int], list[str]]] = {
    "topic": _topic_sentence,
    "negation": _negation_sentence,
    "count": _count_sentence,
}


def _unique_texts(task: str, n: int, rng: random.Random) -> list[tuple[str, int]]:
    """Distinct labelled sentences, labels balanced, so splits can be disjoint."""
    n_labels = len(TASK_LABELS["bert"][task])
    seen: dict[str, int] = {}
    while len(seen) < n:
        label = len(seen) % n_labels
        text = " ".join(TEXT_SAMPLERS[task](rng, label))
        seen.setdefault(text, label)
    rows = list(seen.items())
    rng.shuffle(rows)
    return rows


def _split_slices() -> Iterator[tuple[str, slice]]:
    start = 0
    for split, size in SPLIT_SIZES.items():
        yield split, slice(start, start + size)
        start += size


def _text_data(task: str, seed: int, tokenizer: BertTokenizerFast) -> DatasetDict:
    rows = _unique_texts(task, sum(SPLIT_SIZES.values()), random.Random(seed))
    label = ClassLabel(names=list(TASK_LABELS["bert"][task]))
    splits = {}
    for split, part in _split_slices():
        texts, labels = [t for t, _ in rows[part]], [y for _, y in rows[part]]
        if task == PRETOKENISED_TASK:
            enc = tokenizer(texts)
            columns = {**{k: enc[k] for k in ("input_ids", "attention_mask")}, "label": labels}
            ids = List(Value("int64"))
            features = Features(input_ids=ids, attention_mask=ids, label=label)
        else:
            columns = {"text": texts, "label": labels}
            features = Features(text=Value("string"), label=label)
        splits[split] = Dataset.from_dict(columns, features=features)
    return DatasetDict(splits)


# --------------------------------------------------------------------------- synthetic images


def _uniform(g: torch.Generator, low: float, high: float, shape: tuple[int, ...] = ()) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=g)


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """An int in [low, high], inclusive like `random.randint`."""
    return int(torch.randint(low, high + 1, (), generator=g))


def _noise(g: torch.Generator, scale: float) -> torch.Tensor:
    return scale * torch.randn((3, IMAGE_SIZE, IMAGE_SIZE), generator=g)


def _quadrant_image(g: torch.Generator, label: int) -> torch.Tensor:
    """A bright square of random size and colour inside the labelled quadrant."""
    image, half = _noise(g, 0.3), IMAGE_SIZE // 2
    size = _randint(g, 8, 12)
    top = (label // 2) * half + _randint(g, 0, half - size)
    left = (label % 2) * half + _randint(g, 0, half - size)
    image[:, top : top + size, left : left + size] += _uniform(g, 1.0, 2.0, (3, 1, 1))
    return image


def _colour_image(g: torch.Generator, label: int) -> torch.Tensor:
    """A square whose labelled channel dominates, on a background with a random colour cast.

    Reading the colour of the square rather than of the whole image ties this task to the
    localisation features the quadrant task also shapes, so a merge interferes with it.
    """
    image = _noise(g, 0.3) + _uniform(g, -0.4, 0.4, (3, 1, 1))
    size = _randint(g, 8, 14)
    top, left = _randint(g, 0, IMAGE_SIZE - size), _randint(g, 0, IMAGE_SIZE - size)
    colour = _uniform(g, 0.3, 0.9, (3,))
    colour[label] = colour.max() + _uniform(g, 0.3, 0.6)
    image[:, top : top + size, left : left + size] += colour[:, None, None]
    return image


def _stripes_image(g: torch.Generator, label: int) -> torch.Tensor:
    """Sinusoidal stripes of random period and phase; label 0 varies down the rows."""
    period, phase = _uniform(g, 3.0, 10.0), _uniform(g, 0.0, 6.3)
    wave = torch.sin(2 * torch.pi * torch.arange(IMAGE_SIZE) / period + phase)
    pattern = wave[:, None].expand(IMAGE_SIZE, IMAGE_SIZE)
    pattern = pattern if label == 0 else pattern.T
    return _noise(g, 0.5) + _uniform(g, 0.3, 0.9, (3, 1, 1)) * pattern


IMAGE_SAMPLERS: dict[str, Callable[[torch.Generator, int], torch.Tensor]] = {
    "quadrant": _quadrant_image,
    "colour": _colour_image,
    "stripes": _stripes_image,
}


def _images(task: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Balanced labelled images in random order (continuous noise makes them distinct)."""
    n_labels = len(TASK_LABELS["clip"][task])
    labels = [int(y) for y in torch.randperm(n, generator=g) % n_labels]
    return torch.stack([IMAGE_SAMPLERS[task](g, y) for y in labels]), labels


def _image_data(task: str, seed: int, _processor: Any) -> DatasetDict:
    """Image splits; the processor is unused because images are stored as model inputs."""
    images, labels = _images(task, sum(SPLIT_SIZES.values()), torch.Generator().manual_seed(seed))
    features = Features(
        pixel_values=Array3D((3, IMAGE_SIZE, IMAGE_SIZE), "float32"),
        label=ClassLabel(names=list(TASK_LABELS["clip"][task])),
    )
    return DatasetDict(
        {
            split: Dataset.from_dict(
                {"pixel_values": images[part].numpy(), "label": labels[part]}, features=features
            )
            for split, part in _split_slices()
        }
    )


# --------------------------------------------------------------------------- model inputs


def encode_split(dataset: Dataset, tokenizer: BertTokenizerFast | None = None) -> dict[str, torch.Tensor]:
    """Padded model inputs for a whole split, whichever of the three column layouts it has.

    The tokenizer is needed for text and pre-tokenised splits only.
    """
    columns = dataset.column_names
    if "pixel_values" in columns:
        return {"pixel_values": dataset.with_format("torch")[:]["pixel_values"]}
    if tokenizer is None:
        raise ValueError(f"a tokenizer is needed to encode columns {columns}")
    rows = dataset[:]
    if "text" in columns:
        enc = tokenizer(rows["text"], padding=True, return_tensors="pt")
    else:
        unpadded = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"]}
        enc = tokenizer.pad(unpadded, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def accuracy(model: PreTrainedModel, dataset: Dataset, tokenizer: BertTokenizerFast | None = None) -> float:
    """Top-1 accuracy of a sequence/image classifier on a labelled split."""
    inputs, labels = encode_split(dataset, tokenizer), torch.tensor(dataset[:]["label"])
    model.eval()
    predictions = torch.cat(
        [
            model(**{k: v[i : i + 256] for k, v in inputs.items()}).logits.argmax(-1)
            for i in range(0, len(labels), 256)
        ]
    )
    return (predictions == labels).float().mean().item()


# --------------------------------------------------------------------------- training


def _optimise(
    params: list[nn.Parameter], batch_loss: Callable[[], torch.Tensor], steps: int, lr: float
) -> float:
    """Plain Adam loop; returns the last loss for the log.

    foreach: one kernel per step for all parameters instead of one per tensor; these models have
    hundreds of small tensors, so it builds the example about 1.5x faster, with the same bytes."""
    optimiser = torch.optim.Adam(params, lr=lr, foreach=True)
    for _ in range(steps):
        optimiser.zero_grad()
        loss = batch_loss()
        loss.backward()
        optimiser.step()
    return loss.item()


def _word_groups() -> torch.Tensor:
    """Vocabulary id -> index of its word group (-100 for special tokens)."""
    group_of = {w: i for i, group in enumerate(WORD_GROUPS.values()) for w in group}
    return torch.tensor([group_of.get(token, -100) for token in VOCAB])


def _pretrain_bert(model: BertModel, tokenizer: BertTokenizerFast, seed: int) -> float:
    """Masked-token prediction plus word-group tagging on sentences from all tasks.

    The tagging gives the base the shared semantic features a real pretrained model has, so
    fine-tuning moves it only a little and a merge of the experts is not hopeless.
    """
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    tasks = list(TEXT_SAMPLERS)
    texts = []
    for _ in range(2048):
        task = rng.choice(tasks)
        label = rng.randrange(len(TASK_LABELS["bert"][task]))
        texts.append(" ".join(TEXT_SAMPLERS[task](rng, label)))
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    groups = _word_groups()
    token_head, group_head = nn.Linear(HIDDEN, len(VOCAB)), nn.Linear(HIDDEN, len(WORD_GROUPS))

    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(texts), (BATCH_SIZE,), generator=g)
        ids, mask = enc["input_ids"][idx], enc["attention_mask"][idx]
        words = groups[ids] >= 0
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & words
        inputs = ids.masked_fill(chosen, tokenizer.mask_token_id)
        states = model(input_ids=inputs, attention_mask=mask).last_hidden_state
        masked_lm = F.cross_entropy(token_head(states[chosen]), ids[chosen])
        return masked_lm + F.cross_entropy(group_head(states[words]), groups[ids][words])

    model.train()
    heads = [*token_head.parameters(), *group_head.parameters()]
    return _optimise([*model.parameters(), *heads], batch_loss, PRETRAIN_STEPS, PRETRAIN_LR)


def _patches(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] -> [B, patches, 3·P·P] in the row-major order of CLIP's patch tokens."""
    b, p = images.shape[0], PATCH_SIZE
    return images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 3 * p * p)


def _pretrain_clip(model: CLIPVisionModel, seed: int) -> float:
    """Masked-patch reconstruction plus patch-position prediction on images from all tasks.

    Position prediction puts "where" into every patch token, the shared feature a real
    pretrained model would bring; without it the quadrant expert only memorises.
    """
    g = torch.Generator().manual_seed(seed)
    tasks = list(IMAGE_SAMPLERS)
    images = []
    for _ in range(1024):
        task = tasks[_randint(g, 0, len(tasks) - 1)]
        images.append(IMAGE_SAMPLERS[task](g, _randint(g, 0, len(TASK_LABELS["clip"][task]) - 1)))
    pool = torch.stack(images)
    grid = IMAGE_SIZE // PATCH_SIZE
    positions = torch.arange(grid * grid).expand(BATCH_SIZE, -1)
    patch_head, position_head = nn.Linear(HIDDEN, 3 * PATCH_SIZE * PATCH_SIZE), nn.Linear(HIDDEN, grid * grid)

    def batch_loss() -> torch.Tensor:
        x = pool[torch.randint(len(pool), (BATCH_SIZE,), generator=g)]
        chosen = torch.rand((BATCH_SIZE, grid * grid), generator=g) < 0.25
        pixel_mask = chosen.view(BATCH_SIZE, 1, grid, grid).repeat_interleave(PATCH_SIZE, 2)
        pixel_mask = pixel_mask.repeat_interleave(PATCH_SIZE, 3)
        states = model(pixel_values=x.masked_fill(pixel_mask, 0.0)).last_hidden_state[:, 1:]
        reconstruction = F.mse_loss(patch_head(states[chosen]), _patches(x)[chosen])
        return reconstruction + F.cross_entropy(position_head(states).flatten(0, 1), positions.flatten())

    model.train()
    heads = [*patch_head.parameters(), *position_head.parameters()]
    return _optimise([*model.parameters(), *heads], batch_loss, PRETRAIN_STEPS, PRETRAIN_LR)


def _fine_tune(
    model: PreTrainedModel, train: Dataset, tokenizer: BertTokenizerFast | None, seed: int
) -> float:
    """Full fine-tune of body and head; lr and steps high enough that experts drift apart."""
    g = torch.Generator().manual_seed(seed)
    inputs, labels = encode_split(train, tokenizer), torch.tensor(train[:]["label"])

    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(labels), (BATCH_SIZE,), generator=g)
        return model(**{k: v[idx] for k, v in inputs.items()}, labels=labels[idx]).loss

    model.train()
    return _optimise(list(model.parameters()), batch_loss, EXPERT_STEPS, EXPERT_LR)


# --------------------------------------------------------------------------- per-arch recipes


def _bert_config() -> BertConfig:
    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=2 * MAX_WORDS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )


def _bert_tokenizer(vocab_file: Path) -> BertTokenizerFast:
    """Write `vocab_file` and return the tokenizer over the same vocabulary.

    transformers 5 silently ignores `vocab_file=` (leaving a 5-token vocabulary), so the
    vocabulary is passed as a mapping and its size checked.
    """
    vocab_file.write_text("\n".join(VOCAB) + "\n")
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = BertTokenizerFast(vocab=vocab, model_max_length=2 * MAX_WORDS)
    if len(tokenizer) != len(VOCAB):
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {len(VOCAB)}")
    return tokenizer


def _write_bert_base(out: Path, seed: int) -> None:
    tokenizer = _bert_tokenizer(out / "vocab.txt")
    torch.manual_seed(seed)
    model = BertModel(_bert_config())
    log.info("bert base: pretrained, last loss %.3f", _pretrain_bert(model, tokenizer, seed))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _bert_expert(base_dir: Path, labels: tuple[str, ...]) -> BertForSequenceClassification:
    config = BertConfig.from_pretrained(
        base_dir, id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)}
    )
    model = BertForSequenceClassification(config)
    model.bert.load_state_dict(BertModel.from_pretrained(base_dir).state_dict())
    return model


def _clip_vision_config() -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=HIDDEN,
    )


def _clip_processor() -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def _write_clip_base(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = CLIPVisionModel(_clip_vision_config())
    log.info("clip base: pretrained, last loss %.3f", _pretrain_clip(model, seed))
    model.save_pretrained(out)
    _clip_processor().save_pretrained(out)


def _clip_expert(base_dir: Path, labels: tuple[str, ...]) -> CLIPForImageClassification:
    """CLIPConfig whose vision part is the base's; the text part is unused but kept tiny."""
    base = CLIPVisionModel.from_pretrained(base_dir)
    # from_pretrained records the base's absolute path; keep it out of the expert's config.
    vision = {k: v for k, v in base.config.to_dict().items() if k != "_name_or_path"}
    text = CLIPTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=HIDDEN,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = CLIPConfig(
        text_config=text.to_dict(),
        vision_config=vision,
        projection_dim=HIDDEN,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    model = CLIPForImageClassification(config)
    model.vision_model.load_state_dict(base.state_dict())
    return model


@dataclass(frozen=True)
class _Recipe:
    """How one architecture's base, data, experts and preprocessor are made."""

    write_base: Callable[[Path, int], None]
    data: Callable[[str, int, Any], DatasetDict]
    expert: Callable[[Path, tuple[str, ...]], PreTrainedModel]
    preprocessor: Callable[[Path], Any]
    uses_tokenizer: bool


RECIPES: dict[str, _Recipe] = {
    "bert": _Recipe(
        _write_bert_base, _text_data, _bert_expert, BertTokenizerFast.from_pretrained, uses_tokenizer=True
    ),
    "clip": _Recipe(
        _write_clip_base, _image_data, _clip_expert, CLIPImageProcessorPil.from_pretrained, uses_tokenizer=False
    ),
}


def _write_data(out: Path, arch: str, root: Path, task: str, seed: int) -> None:
    recipe = RECIPES[arch]
    data = recipe.data(task, _piece_seed(seed, f"{arch}/data/{task}"), recipe.preprocessor(root / "base"))
    data.save_to_disk(str(out))


def _write_expert(out: Path, arch: str, root: Path, task: str, seed: int) -> None:
    recipe = RECIPES[arch]
    preprocessor = recipe.preprocessor(root / "base")
    tokenizer = preprocessor if recipe.uses_tokenizer else None
    data = datasets.load_from_disk(str(root / "data" / task))
    torch.manual_seed(seed)
    model = recipe.expert(root / "base", TASK_LABELS[arch][task])
    loss = _fine_tune(model, data["train"], tokenizer, seed)
    test_accuracy = accuracy(model, data["test"], tokenizer)
    log.info("%s expert %s: last loss %.3f, test accuracy %.3f", arch, task, loss, test_accuracy)
    model.save_pretrained(out)
    preprocessor.save_pretrained(out)


def _example_config(tasks: tuple[str, ...], max_length: int | None) -> dict[str, Any]:
    """`max_length`: the text model's positions (the default 128 would be cut to them with a notice)."""
    return {
        "base": "base",
        "experts": {t: f"experts/{t}" for t in tasks},
        "merge": {"method": "task_arithmetic", "scaling": MERGE_SCALING},
        "calibration": {
            "data": {t: {"path": f"data/{t}", "split": "calibration"} for t in tasks},
            "examples_per_task": SPLIT_SIZES["calibration"],
            "batch_size": 16,
            "seed": 42,
            **({"max_length": max_length} if max_length else {}),
        },
        "featcal": {"lambda": 0.05, "rho": 2.2, "alpha": 0.25},
        "evaluation": {
            "data": {t: {"path": f"data/{t}", "split": "test", "label_column": "label"} for t in tasks},
        },
    }


# --------------------------------------------------------------------------- atomic pieces


def _piece_seed(seed: int, piece: str) -> int:
    """A stable per-piece seed (Python's `hash` is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(piece.encode())) % 2**31


def _ensure_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Build `target` in a sibling temporary directory and rename it into place when complete.

    A present `target` is complete by construction and is skipped; temporaries left by a
    killed build are removed first (one builder per example directory).
    """
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    log.info("building %s", target)
    started = time.perf_counter()
    try:
        write(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s in %.1f s", target, time.perf_counter() - started)


def _ensure_file(target: Path, text: str) -> None:
    if target.exists():
        return
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence per-save progress bars during the build, restoring the caller's setting."""
    datasets_on = datasets.is_progress_bar_enabled()
    transformers_on = transformers.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if datasets_on:
            datasets.enable_progress_bars()
        if transformers_on:
            transformers.utils.logging.enable_progress_bar()


def _build_arch(root: Path, arch: str, seed: int) -> None:
    recipe, tasks = RECIPES[arch], tuple(TASK_LABELS[arch])
    _ensure_dir(root / "base", lambda out: recipe.write_base(out, _piece_seed(seed, f"{arch}/base")))
    for task in tasks:
        _ensure_dir(root / "data" / task, functools.partial(_write_data, arch=arch, root=root, task=task, seed=seed))
    for task in tasks:
        expert_seed = _piece_seed(seed, f"{arch}/experts/{task}")
        _ensure_dir(root / "experts" / task,
                    functools.partial(_write_expert, arch=arch, root=root, task=task, seed=expert_seed))
    _ensure_file(
        root / "example.yaml",
        yaml.safe_dump(_example_config(tasks, 2 * MAX_WORDS if arch == "bert" else None), sort_keys=False),
    )


def build_tiny_example(out: Path, archs: tuple[str, ...] = ("bert", "clip"), seed: int = 0) -> Path:
    """Build (or complete) the tiny example under `out` and return `out`.

    Idempotent and crash-safe: finished pieces are kept, unfinished ones rebuilt.
    Deterministic: a given seed and software stack give the same bytes, in any directory.
    """
    unknown = set(archs) - set(RECIPES)
    if unknown:
        raise ValueError(f"unknown example architectures {sorted(unknown)}; known: {sorted(RECIPES)}")
    out = Path(out)
    with _quiet_progress_bars(), one_thread():
        for arch in archs:
            _build_arch(out / arch, arch, seed)
    return out


def example_for_tests(tmp_path_factory: Any) -> Path:
    """One build per pytest session, shared by every test module that calls this.

    Pass pytest's `tmp_path_factory` from a session-scoped fixture; later calls find the
    build complete and return at once.
    """
    return build_tiny_example(tmp_path_factory.getbasetemp() / "featcal-tiny-example")
