"""A tiny T5 (FLAN-T5's shape: gated-GELU, RMS norms, relative position bias, no biases) and a word-level tokenizer
for it, built offline: T5's own SentencePiece vocabulary cannot be downloaded here."""

from __future__ import annotations

from collections.abc import Sequence

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

from featcal_bench.t5.prompts import LABEL_WORDS, SCORE_FORMAT, TEMPLATES
from featcal_bench.t5.spec import GLUE_TASKS
from tests.perturbed_experts import trained_copy

SPECIAL = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as T5's
WORDS = tuple(f"w{i}" for i in range(3, 64))  # the default vocabulary: "w3" … "w63"


def t5_config(vocab_size: int = 64) -> T5Config:
    return T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1)


def t5_tokenizer(words: Sequence[str] = WORDS, split_punctuation: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` (ids from 3), appending EOS as T5's does; it splits on white space, and
    with `split_punctuation` also before and after each run of punctuation (prompts quote their fields)."""
    vocab = {**{s: i for i, s in enumerate(SPECIAL)}, **{w: 3 + i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def glue_words(tasks: Sequence[str], sentence_words: Sequence[str]) -> list[str]:
    """Every piece a word-level tokenizer meets on GLUE prompts of `tasks` over `sentence_words`: the prompts' words
    and punctuation, the sentences', the answers' (label words, digits of a score)."""
    split = pre_tokenizers.Whitespace()
    texts = [TEMPLATES[t].format(**dict.fromkeys(GLUE_TASKS[t].columns, "")) for t in tasks]
    texts += [" ".join(sentence_words), "0123456789 . '. \"."]
    texts += [" ".join(LABEL_WORDS[t]) for t in tasks if t in LABEL_WORDS]
    pieces = {piece for text in texts for piece, _ in split.pre_tokenize_str(text)}
    return sorted(pieces | {str(d) for d in range(10)})


def fine_tuned_t5(base: T5ForConditionalGeneration, tokenizer: PreTrainedTokenizerFast, rows: Dataset, task: str,
                  seed: int) -> T5ForConditionalGeneration:
    """The base trained a few steps on the task's prompts and answers: an expert that answers label words."""
    columns = GLUE_TASKS[task].columns
    texts = [TEMPLATES[task].format(**{c: r[c] for c in columns}) for r in rows]
    targets = [LABEL_WORDS[task][r["label"]] if task in LABEL_WORDS else SCORE_FORMAT.format(r["label"]) for r in rows]
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    labels = tokenizer(text_target=targets, padding=True, return_tensors="pt")["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100
    return trained_copy(base, 40, seed, **inputs, labels=labels)
